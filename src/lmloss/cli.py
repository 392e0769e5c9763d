"""The `lmloss` command. Each subcommand lives with the module it drives; this file only wires them.

A subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func=<callable(args) -> int>`` as the parser default.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from pathlib import Path

# (module, what it is) — imported lazily so `lmloss --help` stays fast and optional extras stay optional.
SUBCOMMAND_MODULES = (
    "lmloss.bench.cli",
    "lmloss.profiling.report",
    "lmloss.sft.cli",
)

#: torch's warning at import when numpy is not installed (the core install has none; lmloss never uses it).
#: ``lmloss/__init__.py`` drops it for this process; `main` passes the same filter on to the processes the
#: command starts (``lmloss sft --nproc``), which import torch before lmloss.
NUMPY_WARNING = "Failed to initialize NumPy"
NUMPY_WARNING_FILTER = f"ignore:{NUMPY_WARNING}:UserWarning"


def extra_install_hint(extra: str) -> str:
    """The pip command that adds `extra` to this lmloss (it is not on PyPI, so never ``pip install
    lmloss[...]``, which would look for another project of that name there): from the checkout this lmloss
    is installed from when it is an editable install of one, else a placeholder for the user's checkout."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "src" / "lmloss").is_dir():
        return f'pip install -e "{root}[{extra}]"'
    return f'pip install "/path/to/lmloss[{extra}]" (your lmloss checkout; lmloss is not on PyPI)'


def version_text() -> str:
    """``lmloss <version> (torch <version>, triton <version or 'not installed'>)``."""
    import torch

    import lmloss

    try:
        triton = importlib.metadata.version("triton")  # read from the metadata: importing triton is slow
    except importlib.metadata.PackageNotFoundError:
        triton = "not installed"
    return f"lmloss {lmloss.__version__} (torch {torch.__version__}, triton {triton})"


class _VersionAction(argparse.Action):
    """``--version``: like argparse's own, but the text is built only when asked for (it imports torch)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())  # on stdout, as argparse's own version action prints
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmloss",
        description="Chunked, vocab-parallel log-probs, entropy and cross-entropy for LLM training.",
    )
    parser.add_argument(
        "--version", action=_VersionAction, help="print lmloss's version (and torch's and triton's) and exit"
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


def _child_warning_filters(environ: dict[str, str]) -> str:
    """``PYTHONWARNINGS`` for processes the command starts: the user's filters plus `NUMPY_WARNING_FILTER`."""
    current = environ.get("PYTHONWARNINGS", "")
    if NUMPY_WARNING_FILTER in current.split(","):
        return current
    return f"{current},{NUMPY_WARNING_FILTER}" if current else NUMPY_WARNING_FILTER


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    before = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = _child_warning_filters(os.environ)
    try:
        return int(args.func(args) or 0)
    finally:  # main() may be called in-process (tests, notebooks): leave the environment as it was
        if before is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = before


if __name__ == "__main__":
    sys.exit(main())
