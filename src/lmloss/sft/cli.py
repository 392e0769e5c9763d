"""``lmloss sft``: packed SFT of a Hugging Face causal LM with the fused, vocab-parallel loss head.

Every `SFTConfig` field is a flag (``tokens_per_batch`` -> ``--tokens-per-batch``); ``--config file.yaml``
loads a YAML of the same keys first, and flags given on the command line override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

from lmloss.sft.config import LOSS_IMPLS, SFTConfig
from lmloss.sft.parallel import INTERRUPTED

SFT_EXTRA_MODULES = ("transformers", "tokenizers", "yaml", "tqdm", "matplotlib")
HELP = {
    "data": "JSONL dataset: {prompt, response} or {text} per line (default: the embedded task set)",
    "model_config": "model config JSON/YAML (with model_type), or a local from_pretrained directory",
    "tokenizer": "tokenizer.json or a directory holding one (default: train a byte-level BPE on the data)",
    "tokenizer_vocab": "size of the BPE trained on the data",
    "vocab_size": "pad the embedding and LM head to this many rows, e.g. 151936 (masked in the loss)",
    "truncate": "cut examples longer than --tokens-per-batch (default: stop with an error naming them)",
    "tokens_per_batch": "real tokens per packed micro-batch (an example must fit in one)",
    "micro_batches": "micro-batches per optimizer step over all DP ranks (default: dp)",
    "dp": "data-parallel size",
    "cp": "context-parallel size (zigzag split of every packed sequence)",
    "tp": "tensor-parallel size of the LM head (vocab-sharded); the body is replicated",
    "nproc": "spawn this many local processes (default dp*cp*tp; not with torchrun)",
    "loss_impl": "fused: lmloss.linear_cross_entropy; naive: materialized logits + cross_entropy",
    "chunk_size": "fused-head tokens per chunk: an int or 'auto'",
    "out": "output directory (metrics.jsonl, loss.png, summary.json, checkpoints/, tokenizer.json)",
    "save_every": "save a checkpoint every N steps (and at the end); 0: never",
    "resume": "checkpoint directory to resume from, or 'latest' (the newest intact one under --out)",
    "head_memory": "measure the loss head's peak memory, fused vs naive, before training",
    "head_memory_vocab": "vocabulary of that measurement, e.g. 151936 (default: the model's padded vocab)",
    "track_memory": "measure every step's peak memory (exact live-tensor tracking on CPU, ~2x slower steps)",
    "steps": "optimizer steps (default: 100; on --resume, the resumed run's)",
    "schedule_steps": "length of the warmup + cosine learning-rate schedule (default: --steps; on --resume, "
    "the resumed run's, so a larger --steps trains on at its final learning rate)",
    "overwrite": "delete the earlier run in a non-empty --out and start afresh (without it, such an --out is "
    "refused)",
    "override": "on --resume, accept a changed run setting (seed, lr, data, tokenizer, ...); repeat or "
    "comma-separate",
    "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "cosine decay ends at lr * this",
    "warmup_steps": "linear warmup steps",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "clip the global gradient norm to this; 0: off",
    "seed": "seed of the model initialisation and the data order",
    "shuffle": "shuffle the examples every epoch",
    "device": "auto, cpu or cuda (cuda: one GPU per local process, NCCL; auto: cuda when every local "
    "process gets its own GPU, else cpu with gloo)",
    "dtype": "float32 or bfloat16 parameters",
    "log_every": "print a metrics line every N steps",
    "progress": "show a progress bar",
    "memory_profile": "JSON: MemoryProfiler settings, e.g. '{\"profile_steps\": [0, 1]}'",
}


def _flag_type(field: dataclasses.Field):
    name, kind = field.name, str(field.type)
    if name == "memory_profile":
        return json.loads
    if name == "chunk_size":
        return lambda v: v if v == "auto" else (None if v == "none" else int(v))
    if kind.startswith("int"):
        return int
    if kind.startswith("float"):
        return float
    return str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of SFTConfig keys; flags override it")
    for field in dataclasses.fields(SFTConfig):
        flag = "--" + field.name.replace("_", "-")
        shown = field.default not in (None, False, ()) and field.name != "memory_profile"
        default = f" (default: {field.default})" if shown else ""
        common = {
            "dest": field.name,
            "default": argparse.SUPPRESS,
            "help": HELP.get(field.name, "") + default,
        }
        if str(field.type) == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        elif field.name == "override":
            parser.add_argument(flag, action="append", metavar="NAME", **common)
        elif field.name == "loss_impl":
            parser.add_argument(flag, choices=LOSS_IMPLS, **common)
        else:
            parser.add_argument(flag, type=_flag_type(field), **common)


def config_from_args(args: argparse.Namespace) -> SFTConfig:
    overrides = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(SFTConfig) if hasattr(args, f.name)
    }
    if getattr(args, "config", None):
        return SFTConfig.from_yaml(args.config, overrides)
    return SFTConfig.from_dict(overrides)


def main(args: argparse.Namespace) -> int:
    cfg = None
    try:
        cfg = config_from_args(args)
        from lmloss.sft.launch import run

        run(cfg)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in SFT_EXTRA_MODULES:
            from lmloss.cli import extra_install_hint

            print(f"lmloss sft: error: {err.name} is missing; install the sft extra: {extra_install_hint('sft')}",
                  file=sys.stderr)  # fmt: skip
            return 2
        raise
    except (ValueError, FileNotFoundError) as err:  # DataError, ConfigError, CheckpointError, RankError too
        print(f"lmloss sft: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        previous = signal.signal(
            signal.SIGINT, signal.SIG_IGN
        )  # a second Ctrl-C must not cut this line short
        try:
            if os.environ.get("RANK", "0") == "0":  # under torchrun: once
                print(interrupted_message(cfg), file=sys.stderr, flush=True)
        finally:
            signal.signal(signal.SIGINT, previous)
        return INTERRUPTED
    return 0


def interrupted_message(cfg: SFTConfig | None) -> str:
    """One line after Ctrl-C: the last step logged and how to go on from the newest saved checkpoint."""
    if cfg is None:
        return "lmloss sft: interrupted before the run started"
    from lmloss.sft.checkpoint import MANIFEST, step_dirs

    out = Path(cfg.out)
    last = None
    try:
        for line in (out / "metrics.jsonl").read_text().splitlines():
            last = json.loads(line)["step"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no log yet, or its last line torn by the interrupt
    saved = [p for p in step_dirs(out / "checkpoints") if (p / MANIFEST).is_file()]
    where = f" after step {last}" if last is not None else ""
    if saved:
        if cfg.resume == "latest":
            how = "rerun the same command"
        else:
            how = "rerun the same command with --resume latest" + (
                " in place of --overwrite" if cfg.overwrite else " in place of --resume" if cfg.resume else ""
            )
        hint = f"{saved[0]} is the newest checkpoint: to continue, {how}"
    else:
        hint = "no checkpoint was saved (--save-every N saves them); rerun with --overwrite to start over"
    return f"lmloss sft: interrupted{where}; {hint}"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "sft",
        help="packed SFT of a transformers model with DP x CP x TP and the fused loss head",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=main)


def standalone(argv: list[str] | None = None) -> int:
    """``python -m lmloss.sft``: the same command without the ``lmloss`` front door."""
    parser = argparse.ArgumentParser(prog="python -m lmloss.sft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(parser)
    return main(parser.parse_args(argv))
