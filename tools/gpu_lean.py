"""Issue #31 on one GPU (`tools/gpu_check.sh` calls it): tokens that do not count cost nothing.

    python tools/gpu_lean.py --device cuda --out OUT                       # on a lent GPU: the issue's shapes
    python tools/gpu_lean.py --device cpu --tiny                           # a dry run of the script here

Each op runs with none of its tokens ignored and with the first half of every 512-token sequence ignored (as
prompts are in SFT and RL), in the same interleaved rounds (median, CUDA events); the targets are the issue's:
the fused ops (`linear_cross_entropy`, `linear_token_logprobs` under a per-token upstream, 8192 x 4096 x 128256
bf16) <= 0.6x, `token_logprobs` from ``[32768, 128256]`` bf16 logits <= 0.85x. Writes ``OUT/lean31.json``.
The memory budget's rows (the fused head at the default budget and below its fp32 accumulator, beside Liger and
Cut Cross-Entropy) are `lmloss bench --budget`'s, which gpu_check.sh runs next to this.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import lmloss


def _timed(step, device) -> float:
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


def _labels(n: int, v: int, g: torch.Generator, half_ignored: bool) -> torch.Tensor:
    y = torch.randint(0, v, (n,), generator=g, device=g.device)
    if half_ignored:
        y.view(-1, 512)[:, :256] = -100
    return y


def _cases(device: torch.device, tiny: bool) -> dict:
    """name -> (make() -> step, the case with none ignored or None, target ratio or None)."""
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    n, h, v = (8192, 4096, 128256) if not tiny else (1024, 32, 1000)
    nl = 32768 if not tiny else 1024
    g = torch.Generator(device=device).manual_seed(
        0
    )  # made on the device: a CPU randn of 4G elements takes seconds

    def fused(op: str, half: bool):
        def make():
            x = torch.randn(n, h, generator=g, device=device).to(device, dt).requires_grad_()
            w = (torch.randn(v, h, generator=g, device=device) / h**0.5).to(device, dt).requires_grad_()
            y, u = _labels(n, v, g, half).to(device), torch.randn(n, generator=g, device=device).to(device)

            def step():
                x.grad = w.grad = None
                if op == "ce":
                    lmloss.linear_cross_entropy(x, w, y).backward()
                else:
                    (lmloss.linear_token_logprobs(x, w, y) * u).sum().backward()

            return step

        return make

    def logits(half: bool):
        def make():
            x = (torch.randn(nl, v, generator=g, device=device) * 2).to(device, dt).requires_grad_()
            y, u = _labels(nl, v, g, half).to(device), torch.randn(nl, generator=g, device=device).to(device)

            def step():
                x.grad = None
                (lmloss.token_logprobs(x, y) * u).sum().backward()

            return step

        return make

    return {
        "linear_cross_entropy": (fused("ce", False), None, None),
        "linear_cross_entropy half ignored": (fused("ce", True), "linear_cross_entropy", 0.6),
        "linear_token_logprobs": (fused("lp", False), None, None),
        "linear_token_logprobs half ignored": (fused("lp", True), "linear_token_logprobs", 0.6),
        "token_logprobs": (logits(False), None, None),
        "token_logprobs half ignored": (logits(True), "token_logprobs", 0.85),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="small shapes (a dry run of the script)")
    args = p.parse_args()
    device = torch.device(args.device)
    cases = _cases(device, args.tiny)
    samples: dict[str, list[float]] = {c: [] for c in cases}
    for base in [c for c in cases if cases[c][1] is None]:  # each pair's tensors live together, then go
        group = [base] + [c for c in cases if cases[c][1] == base]
        steps = {}
        for c in group:
            try:
                steps[c] = cases[c][0]()
                steps[c]()  # warm-up: compiles the kernels
            except Exception as exc:  # noqa: BLE001 - report it and go on with the other rows
                print(f"{c}: {type(exc).__name__}: {exc}", flush=True)
                steps.pop(c, None)
        for r in range(args.rounds):
            for c in steps if r % 2 == 0 else list(reversed(steps)):
                samples[c].append(_timed(steps[c], device))
        del steps
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows = []
    print(f"{'case':<36} {'ms':>9} {'ratio':>7} {'target':>7}  met")
    for c, (_, base, target) in cases.items():
        if not samples[c]:
            continue
        ms = statistics.median(samples[c])
        ratio = ms / statistics.median(samples[base]) if base and samples[base] else None
        met = None if ratio is None else ratio <= target
        rows.append(dict(case=c, ms=ms, samples=samples[c], baseline=base, ratio=ratio, target=target, met=met))
        print(f"{c:<36} {ms:>9.3f} {'' if ratio is None else f'{ratio:.2f}':>7} "
              f"{'' if target is None else f'{target:.2f}':>7}  {'' if met is None else ('yes' if met else 'NO')}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        info = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    torch=torch.__version__, rounds=args.rounds, tiny=args.tiny)  # fmt: skip
        with open(os.path.join(args.out, "lean31.json"), "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
