"""What `tools/gpu_kernels.py` and `tools/gpu_lean.py` share: rows timed against a baseline in interleaved rounds.

A case is ``name -> (make, baseline name or None, target ratio or None)``; ``make()`` builds the case's inputs
and returns its ``step()`` (forward + backward, or one kernel), which may carry a ``prepare()`` run untimed before
each timing (what the step consumes, e.g. the in-place row's logits).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def parser(doc: str) -> argparse.ArgumentParser:
    """The scripts' common arguments: --device, --out, --rounds, --tiny (small shapes: a dry run)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="small shapes (a dry run of the script)")
    return p


def timed(step, device: torch.device) -> float:
    """Milliseconds of one ``step()``: CUDA events on a GPU, the wall clock elsewhere."""
    getattr(step, "prepare", lambda: None)()
    if device.type != "cuda":
        start = time.perf_counter()
        step()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    step()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end)


def run_rounds(cases: dict, names: list[str], device: torch.device, rounds: int, after_group=None) -> dict:
    """Samples (ms) of each of `names`, by groups of a baseline and the rows against it (each group's tensors
    live together, then go; `after_group()` frees what the cases share): one warm-up each (it compiles the
    kernels), then `rounds` rounds alternating the order. A case that fails to build or warm up is reported and
    left out."""
    samples: dict[str, list[float]] = {c: [] for c in names}
    for base in [c for c in names if cases[c][1] is None]:
        group = [base] + [c for c in names if cases[c][1] == base]
        steps = {}
        for c in group:
            try:
                steps[c] = cases[c][0]()
                timed(steps[c], device)
            except Exception as exc:  # noqa: BLE001 - report it and go on with the other rows
                print(f"{c}: {type(exc).__name__}: {exc}", flush=True)
                steps.pop(c, None)
        for r in range(rounds):
            for c in list(steps) if r % 2 == 0 else list(reversed(steps)):
                samples[c].append(timed(steps[c], device))
        del steps
        if after_group is not None:
            after_group()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return samples


def report(cases: dict, samples: dict, device: torch.device, args, filename: str, extra: dict | None = None) -> list[dict]:
    """Print each row's median, its ratio to its baseline's and whether it meets its target; with ``args.out``
    write every sample to ``args.out/filename`` (JSON, with the device, torch, ``args.rounds``, ``args.tiny`` and
    what `extra` adds, printed too)."""
    rows = []
    print(f"{'case':<36} {'ms':>9} {'baseline':>26} {'ratio':>7} {'target':>7}  met")
    for c in samples:
        if not samples[c]:
            continue
        ms = statistics.median(samples[c])
        base, target = cases[c][1], cases[c][2]
        ratio = ms / statistics.median(samples[base]) if base and samples.get(base) else None
        met = None if ratio is None or target is None else ratio <= target
        rows.append(dict(case=c, ms=ms, samples=samples[c], baseline=base, ratio=ratio, target=target, met=met))
        print(f"{c:<36} {ms:>9.3f} {base or '':>26} {'' if ratio is None else f'{ratio:.2f}':>7} "
              f"{'' if target is None else f'{target:.2f}':>7}  {'' if met is None else ('yes' if met else 'NO')}")
    for key, value in (extra or {}).items():
        print(f"{key}: {value}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        info = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    torch=torch.__version__, rounds=args.rounds, tiny=args.tiny, **(extra or {}))  # fmt: skip
        with open(os.path.join(args.out, filename), "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    return rows
