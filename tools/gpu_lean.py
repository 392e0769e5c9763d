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

import torch
from gpu_rounds import parser, report, run_rounds

import lmloss


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
    p = parser(__doc__)
    args = p.parse_args()
    device = torch.device(args.device)
    cases = _cases(device, args.tiny)
    samples = run_rounds(cases, list(cases), device, args.rounds)
    report(cases, samples, device, args, "lean31.json")


if __name__ == "__main__":
    main()
