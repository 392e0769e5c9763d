"""What a GPU must confirm of ``invariant=True`` (docs/invariant.md), in one run: bits and cost.

    python tools/gpu_invariant.py --device cuda --out OUT          # on a lent GPU (the issue's shapes)
    python tools/gpu_invariant.py --device cpu --tokens 512 --vocab 8192 --hidden 64   # a dry run here

Bits: each case's per-token outputs with ``invariant=True`` are compared with ``torch.equal`` against the same
op on the same rows computed another way: other chunk sizes, the first rows alone, a shuffled batch, a
sub-batch as its own call. The default mode is run through the same comparisons for contrast (it is not
expected to hold them all). Cases: `token_logprobs` from bf16 and fp32 logits (the Triton kernels where
available, `impl="auto"`), with entropy, with ``top_p=0.9``; `linear_token_logprobs` (the fixed-shape GEMM
tiles, cuBLAS on a GPU). Cost: forward + backward of the default and the invariant op, interleaved rounds,
median. Writes ``OUT/invariant.json`` and prints a table. Tensor parallelism needs several devices: not here
(tests/distributed/ checks TP 1 / 2 / 4 / 8 over gloo on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import lmloss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _splits(n: int, g: torch.Generator) -> dict[str, object]:
    """Ways to compute the same rows: name -> chunk size, or ("rows", index) for a call on those rows only."""
    perm = torch.randperm(n, generator=g)
    return {
        "chunk 3": 3, "chunk 64": 64, "chunk 1000": 1000, "chunk None": None, "chunk auto": "auto",
        "first 8 rows alone": ("rows", torch.arange(8)), "shuffled": ("rows", perm),
        "second half alone": ("rows", torch.arange(n // 2, n)),
    }  # fmt: skip


def _compare(run, n: int, g: torch.Generator, reference_chunk) -> dict[str, object]:
    """`run(rows_index_or_None, chunk)` -> tuple of per-token outputs; each split against the reference."""
    want = run(None, reference_chunk)
    out = {}
    for name, how in _splits(n, g).items():
        if isinstance(how, tuple):
            idx = how[1]
            got, ref = run(idx, reference_chunk), tuple(w[idx.to(w.device)] for w in want)
        else:
            got, ref = run(None, how), want
        same = all(torch.equal(a, b) for a, b in zip(got, ref))
        diff = max(float((a.double() - b.double()).abs().max()) if a.numel() else 0.0 for a, b in zip(got, ref))
        out[name] = {"equal": same, "max_abs_diff": diff}
    return out


def _time(step, device: torch.device, rounds: int) -> float:
    step()
    _sync(device)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    n, v, h = args.tokens, args.vocab, args.hidden
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    logits32 = (torch.randn(n, v, generator=g) * 2).to(device)
    hidden = torch.randn(n, h, generator=g).to(device, torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(device, torch.bfloat16)
    top_labels = logits32.argmax(-1)
    results: dict[str, dict] = {"device": str(device), "shape": [n, v, h], "bits": {}, "ms": {}}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    results["versions"] = {"torch": torch.__version__, "lmloss": lmloss.__version__}

    def logits_case(x, lbl, **kw):
        def run(idx, chunk, invariant):
            xs, ls = (x, lbl) if idx is None else (x[idx.to(x.device)], lbl[idx.to(lbl.device)])
            out = lmloss.token_logprobs(xs, ls, chunk_size=chunk, invariant=invariant, **kw)
            return out if isinstance(out, tuple) else (out,)

        return run

    def fused_case(idx, chunk, invariant):
        hs, ls = (hidden, labels) if idx is None else (hidden[idx.to(device)], labels[idx.to(device)])
        return (lmloss.linear_token_logprobs(hs, weight, ls, chunk_size=chunk, invariant=invariant),)

    cases = {
        "token_logprobs bf16": logits_case(logits32.bfloat16(), labels),
        "token_logprobs fp32": logits_case(logits32, labels),
        "token_logprobs + entropy bf16": logits_case(logits32.bfloat16(), labels, return_entropy=True),
        "top_p 0.9 fp32": logits_case(logits32, top_labels, top_p=0.9),
        "linear_token_logprobs bf16": fused_case,
    }
    with torch.no_grad():
        for name, run in cases.items():
            for invariant in (True, False):
                key = f"{name}{' invariant' if invariant else ' default'}"
                results["bits"][key] = _compare(
                    lambda idx, chunk, run=run, invariant=invariant: run(idx, chunk, invariant),
                    n, torch.Generator().manual_seed(1), 256,
                )  # fmt: skip
                held = sum(r["equal"] for r in results["bits"][key].values())
                print(f"{key:<45} {held}/{len(results['bits'][key])} splits give the same bits", flush=True)

    x16 = logits32.bfloat16().requires_grad_()
    hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def logits_step(invariant):
        x16.grad = None
        lmloss.token_logprobs(x16, labels, invariant=invariant).sum().backward()

    def fused_step(invariant):
        hg.grad = wg.grad = None
        lmloss.linear_token_logprobs(hg, wg, labels, invariant=invariant).sum().backward()

    for name, step in (("token_logprobs bf16", logits_step), ("linear_token_logprobs bf16", fused_step)):
        samples = {False: [], True: []}
        for r in range(3):  # interleaved rounds, alternating which goes first
            for invariant in ((False, True) if r % 2 == 0 else (True, False)):
                samples[invariant].append(_time(lambda s=step, i=invariant: s(i), device, args.rounds))
        default, inv = statistics.median(samples[False]), statistics.median(samples[True])
        results["ms"][name] = {"default": default, "invariant": inv, "ratio": inv / default}
        print(f"{name:<45} default {default:8.2f} ms, invariant {inv:8.2f} ms: {inv / default:.3f}x", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "invariant.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
