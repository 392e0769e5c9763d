"""The `lmloss` command. Each subcommand lives with the module it drives; this file only wires them.

A subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func=<callable(args) -> int>`` as the parser default.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, what it is) — imported lazily so `lmloss --help` stays fast and optional extras stay optional.
SUBCOMMAND_MODULES = (
    "lmloss.bench.cli",
    "lmloss.profiling.report",
    "lmloss.sft.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmloss",
        description="Chunked, vocab-parallel log-probs, entropy and cross-entropy for LLM training.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is not None and (err.name == name or name.startswith(err.name + ".")):
                continue  # that subcommand is not part of this build
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
