"""``lmloss bench``: time and peak memory of forward+backward, lmloss against naive PyTorch and peers.

Flags left unset take each workload's default for the device, which together make the default sweep.
On CPU (about two minutes on two idle cores): the logits workload at 2048 and 4096 tokens x 32000 vocab in fp32
and bf16 (naive, chunk 1024, chunk none, Megatron), and one fused shape, 2048 x 256 hidden x 32000 vocab
fp32 (naive, lmloss fused at ``auto``, torch's fused op, Cut Cross-Entropy, Liger, the matmul floor).
On CUDA: logits [32768, 128256] bf16 and the fused head at 8192 and 16384 tokens x 4096 hidden x 128256
vocab bf16, every impl, lmloss's Triton and PyTorch kernels side by side.

Each configuration: one tracked run (peak memory, check against naive); then, for all rows of a shape
together, --warmup untimed rounds and --repeats timed rounds, each running every row once (interleaved,
so that a cold start or a slow spell of the machine does not fall on one row). The time is the median; a
row whose spread (half the min-max range over the median) passes ±10% is marked noisy in its note.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from lmloss.bench.impls import DEFAULT_IMPLS, DTYPES, IMPLS_BY_WORKLOAD, KERNELS, WORKLOADS, parse_chunk
from lmloss.cli import extra_install_hint

#: Per-device, per-workload defaults for flags the user leaves unset.
DEFAULTS: dict[str, dict[str, dict[str, list]]] = {
    "cpu": {
        "logits": {"tokens": [2048, 4096], "dtype": ["float32", "bfloat16"], "chunk": [1024, None]},
        "fused": {"tokens": [2048], "dtype": ["float32"], "chunk": ["auto"]},
    },
    "cuda": {  # the shapes of the GPU issues' tables: Llama-3's vocabulary, bf16
        "logits": {"tokens": [32768], "dtype": ["bfloat16"], "chunk": [1024]},
        "fused": {"tokens": [8192, 16384], "dtype": ["bfloat16"], "chunk": ["auto"]},
    },
}
DEFAULT_VOCAB = {"cpu": [32000], "cuda": [128256]}
DEFAULT_HIDDEN = {"cpu": [256], "cuda": [4096]}
DEFAULT_KERNELS = {"cpu": ["torch"], "cuda": ["triton", "torch"]}
#: Timed rounds and untimed warm-up rounds before them. A CPU run lasts 0.1-5 s: 5 give a median that one
#: slow run cannot move; GPU runs are milliseconds, so more cost little.
DEFAULT_REPEATS = {"cpu": 5, "cuda": 10}
DEFAULT_WARMUP = {"cpu": 1, "cuda": 2}


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _choice_list(choices: tuple[str, ...] | list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{', '.join(bad) or text!r}: choose from {', '.join(choices)}")
        return values

    return parse


def _chunk_list(text: str) -> list[int | str | None]:
    try:
        return [parse_chunk(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--chunk takes integers, 'none' or 'auto': {err}") from err


def _budget_list(text: str) -> list[float | None]:
    values: list[float | None] = []
    for v in (v.strip() for v in text.split(",") if v.strip()):
        try:
            values.append(None if v == "default" else float(v))
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"--budget takes MiB or 'default', got {v!r}") from err
        if values[-1] is not None and not 0 < values[-1] < float("inf"):
            raise argparse.ArgumentTypeError(f"--budget takes positive MiB, got {v!r}")
    if not values:
        raise argparse.ArgumentTypeError("--budget takes MiB or 'default'")
    return values


ALL_IMPLS = sorted({name for names in IMPLS_BY_WORKLOAD.values() for name in names})


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time and peak memory of lmloss vs naive PyTorch and peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload",
        type=_choice_list(WORKLOADS),
        default=list(WORKLOADS),
        help="logits ([T, V] -> loss) and/or fused ([T, H] x [V, H] -> loss) (default: both)",
    )
    p.add_argument(
        "--tokens",
        type=_int_list,
        help="T, comma-separated (default: CPU 2048,4096 logits, 2048 fused; CUDA 32768 logits, 8192,16384 fused)",
    )
    p.add_argument("--vocab", type=_int_list, help="V, comma-separated (default: CPU 32000; CUDA 128256)")
    p.add_argument("--hidden", type=_int_list, help="H for the fused workload (default: CPU 256; CUDA 4096)")
    p.add_argument(
        "--dtype",
        type=_choice_list(tuple(DTYPES)),
        help="float32,bfloat16,float16 (default: CPU float32,bfloat16 logits, float32 fused; CUDA bfloat16)",
    )
    p.add_argument(
        "--chunk",
        type=_chunk_list,
        help="lmloss chunk sizes: integers, 'none', 'auto' (the ops' own choice) "
        "(default: CPU 1024,none logits; CUDA 1024 logits; auto fused)",
    )
    cpu_impls = "; ".join(f"{w} {','.join(names)}" for w, names in DEFAULT_IMPLS["cpu"].items())
    p.add_argument(
        "--impl",
        type=_choice_list(ALL_IMPLS),
        help=f"which impls to run, of {', '.join(ALL_IMPLS)} (default: CPU {cpu_impls}; CUDA all)",
    )
    p.add_argument(
        "--kernel",
        type=_choice_list(KERNELS),
        help="lmloss's implementations to run its rows with (its impl=): torch,triton "
        "(default: CPU torch; CUDA triton,torch)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed rounds: runs of each configuration, interleaved with the other rows of its shape "
        f"(default: CPU {DEFAULT_REPEATS['cpu']}; CUDA {DEFAULT_REPEATS['cuda']})",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed rounds before them, after the tracked memory run "
        f"(default: CPU {DEFAULT_WARMUP['cpu']}; CUDA {DEFAULT_WARMUP['cuda']})",
    )
    p.add_argument(
        "--max-memory-mib",
        type=float,
        default=None,
        help="treat a configuration whose peak (inputs included) passes this as out of memory; "
        "on CPU the run stops at the allocation that passes it",
    )
    p.add_argument(
        "--budget",
        type=_budget_list,
        default=[None],
        help="memory budgets (MiB) for lmloss's rows, comma-separated, 'default' for the op's own "
        "(LMLOSS_CHUNK_BUDGET_MIB or the device's); each budget is a row of its own (named ...@<MiB>MiB) whose "
        "note gives what it held beyond its inputs and their gradients, against the budget (default: default)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    p.add_argument(
        "--invariant",
        action="store_true",
        help="beside each row of an op that takes invariant= (docs/invariant.md), the same row with "
        "invariant=True, named <impl>+inv; its note gives its time over the default row's",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write results.json, results.csv and PNG plots here (replacing those of an earlier run)",
    )
    p.add_argument("--no-plots", action="store_true", help="with --out, skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=main)


def config_from_args(args: argparse.Namespace):
    """Resolve per-workload defaults into a `SweepConfig`."""
    from lmloss.bench.runner import SweepConfig

    kind = "cuda" if args.device.startswith("cuda") else "cpu"

    def per_workload(flag: str, value) -> dict[str, list]:
        return {w: list(value) if value is not None else list(DEFAULTS[kind][w][flag]) for w in WORKLOADS}

    if args.impl is None:
        impls = {w: list(DEFAULT_IMPLS[kind][w]) for w in WORKLOADS}
    else:
        impls = {w: [n for n in args.impl if n in IMPLS_BY_WORKLOAD[w]] for w in WORKLOADS}
    return SweepConfig(
        workloads=[w for w in WORKLOADS if w in args.workload and impls[w]],
        tokens=per_workload("tokens", args.tokens),
        vocab=list(args.vocab or DEFAULT_VOCAB[kind]),
        hidden=list(args.hidden or DEFAULT_HIDDEN[kind]),
        dtypes=per_workload("dtype", args.dtype),
        chunks=per_workload("chunk", args.chunk),
        impls=impls,
        device=args.device,
        kernels=list(args.kernel or DEFAULT_KERNELS[kind]),
        repeats=DEFAULT_REPEATS[kind] if args.repeats is None else args.repeats,
        warmup=DEFAULT_WARMUP[kind] if args.warmup is None else args.warmup,
        max_memory_mib=args.max_memory_mib,
        seed=args.seed,
        invariant=args.invariant,
        budgets=list(args.budget),
    )


def main(args: argparse.Namespace) -> int:
    import torch

    from lmloss.bench.report import format_table, write_csv, write_json
    from lmloss.bench.runner import environment, run_sweep

    if (args.repeats is not None and args.repeats < 1) or (args.warmup is not None and args.warmup < 0):
        print("lmloss bench: --repeats must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("lmloss bench: --device cuda given but CUDA is not available", file=sys.stderr)
        return 2
    config = config_from_args(args)
    if not config.workloads:
        print("lmloss bench: no selected impl belongs to the selected workloads", file=sys.stderr)
        return 2
    rows = run_sweep(config, show_progress=not args.no_progress)
    print(format_table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        replaced = clear_earlier_run(args.out)
        meta = {
            "environment": environment(config.device),
            "argv": sys.argv[1:],
            "config": _config_dict(config),
        }
        write_json(args.out / "results.json", rows, meta)
        write_csv(args.out / "results.csv", rows)
        written = ["results.json", "results.csv"]
        no_plots = None
        if not args.no_plots:
            from lmloss.bench.plots import plot_results

            try:
                written += [p.name for p in plot_results(rows, args.out)]
            except ImportError as err:  # matplotlib (or a part of it) is not installed
                hint = extra_install_hint("bench")
                no_plots = f"no plots: {err.name or 'matplotlib'} is not installed ({hint} gives them)"
        print(f"\nwrote {', '.join(written)} to {args.out}")
        stale = sorted(set(replaced) - set(written))
        if stale:
            print(f"removed an earlier run's {', '.join(stale)} from {args.out}")
        if no_plots:
            print(no_plots)
    return 0


def clear_earlier_run(out: Path) -> list[str]:
    """Delete what an earlier ``lmloss bench --out`` wrote into `out` (results.json, results.csv and PNGs
    named as `lmloss.bench.plots.plot_name` names them), so that no old plot sits beside new results.
    Other files are left alone. Returns the names deleted."""
    from lmloss.bench.plots import PLOT_NAME_PATTERN

    removed = []
    for path in sorted(out.iterdir()):
        if path.is_file() and (path.name in RESULT_FILES or PLOT_NAME_PATTERN.fullmatch(path.name)):
            path.unlink()
            removed.append(path.name)
    return removed


RESULT_FILES = ("results.json", "results.csv")


def _config_dict(config) -> dict:
    import dataclasses

    return dataclasses.asdict(config)
