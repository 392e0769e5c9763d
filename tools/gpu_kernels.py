"""Issue #33's kernels against their targets on one GPU, in one run (`tools/gpu_check.sh` calls it).

    python tools/gpu_kernels.py --device cuda --out OUT                     # on a lent GPU: the issue's shapes
    TRITON_INTERPRET=1 python tools/gpu_kernels.py --device cpu --tiny      # a dry run of the script here

Each row is a forward + backward (or one kernel launch) timed against its baseline in the same interleaved
rounds (median over rounds, CUDA events), with the issue's target for the ratio:

* ``token_logprobs`` from ``[32768, 128256]`` bf16 logits (``impl="triton"``): ``top_p=0.9`` (the Triton threshold
  search) <= 2x and ``top_k=50`` <= 1.5x the plain op; ``invariant=True`` <= 1.10x;
* the fused head 8192 x 4096 x 128256 bf16: ``linear_token_logprobs(invariant=True)`` <= 1.10x the default;
  ``rl.linear_policy_loss`` (PPO, entropy, temperature) ``invariant=True`` <= 1.10x and ``kl_loss_type="full"``
  (the KL folded in the Triton softmax gradient) <= 1.35x the policy loss without it;
* the kernels alone on one ``[1024, 128256]`` chunk against the softmax statistics kernel (one read of the
  chunk, the memory floor): the search's histograms (by key, by mass) and candidates, the invariant block
  sums, each <= 1.10x; the softmax gradient with the folded KL term against the plain gradient: <= 1.5x (it moves
  6 bytes per element instead of 4).

Writes ``OUT/kernels33.json`` (every sample) and prints a table. The static figures these should meet are in
docs/kernels.md (`python -m lmloss.kernels.report`); none of them was timed before this run.
"""

from __future__ import annotations

import torch
from gpu_rounds import parser, report, run_rounds

import lmloss
from lmloss import sampling

#: One ``[32768, 128256]`` input shared by the logits rows (8.4 GB in bf16, its gradient as much again), freed
#: after their group.
_SHARED: dict[str, torch.Tensor] = {}


def _cases(device, tiny: bool):
    """name -> (make() -> step, baseline name or None, target ratio or None)."""
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    n, v = (32768, 128256) if not tiny else (64, 1000)
    nf, hf = (8192, 4096) if not tiny else (64, 32)
    chunk_rows, chunk_v = (1024, 128256) if not tiny else (16, 1000)
    g = torch.Generator(device=device).manual_seed(
        0
    )  # made on the device: a CPU randn of 4G elements takes seconds

    def logits(op="token_logprobs", **kw):
        def make():
            if op == "cross_entropy inplace" or "x" not in _SHARED:  # the in-place backward writes its input
                x = (torch.randn(n, v, generator=g, device=device) * 2).to(dt).to(device).requires_grad_()
                if op != "cross_entropy inplace":
                    _SHARED["x"] = x
            else:
                x = _SHARED["x"]
            y = x.detach().float().argmax(-1)  # kept by every truncation
            produced: dict[str, torch.Tensor] = {}

            def step():
                x.grad = None
                if op == "cross_entropy inplace":
                    loss = lmloss.cross_entropy(produced.pop("logits"), y, impl="triton", inplace_backward=True,
                                                **kw)  # fmt: skip
                    loss.backward()
                    return
                out = lmloss.token_logprobs(x, y, impl="triton", **kw)
                (out[0] + out[1] if isinstance(out, tuple) else out).sum().backward()

            if (
                op == "cross_entropy inplace"
            ):  # logits an op made (as an lm_head's are), copied before the timing
                from lmloss.bench.impls import _ModelOutput

                anchor = torch.zeros((), device=device, requires_grad=True)
                step.prepare = lambda: produced.update(logits=_ModelOutput.apply(x.detach(), anchor, {}))
            return step

        return make

    def fused(policy=False, **kw):
        def make():
            h = torch.randn(nf, hf, generator=g, device=device).to(dt).to(device).requires_grad_()
            w = (torch.randn(v, hf, generator=g, device=device) / hf**0.5).to(dt).to(device).requires_grad_()
            y = torch.randint(0, v, (nf,), generator=g, device=device)
            adv = torch.randn(nf, generator=g, device=device).to(device)
            old = (-10.0 + 0.3 * adv).to(device)
            extra = {}
            if kw.get("loss_mode") in ("gspo", "geo_mean"):  # sequence objectives: 16 sequences of 512 tokens
                extra = dict(cu_seqlens=torch.arange(0, nf + 1, max(nf // 16, 1), device=device),
                             loss_agg_mode="seq-mean-token-mean")  # fmt: skip
            if kw.pop("full_kl", False):
                extra = dict(kl_loss_type="full", kl_loss_coef=0.01, ref_hidden=(h.detach() + 0.01).contiguous(),
                             ref_weight=(w.detach() * 1.01).contiguous())  # fmt: skip

            def step():
                h.grad = w.grad = None
                if policy:
                    loss, _ = lmloss.rl.linear_policy_loss(h, w, y, old, adv, temperature=0.7, entropy_coeff=0.01,
                                                           impl="triton", **extra, **kw)  # fmt: skip
                else:
                    loss = lmloss.linear_token_logprobs(h, w, y, impl="triton", **kw).sum()
                loss.backward()

            return step

        return make

    def kernel(name):
        def make():
            from lmloss.kernels import ChunkMath
            from lmloss.kernels import triton_kernels as tk
            from lmloss.kernels import triton_sampling as ts

            x = (torch.randn(chunk_rows, chunk_v, generator=g, device=device) * 2).to(dt).to(device)
            z = (x.float() + 0.01).to(dt)
            math = ChunkMath(vocab_start=0, valid=chunk_v, scale=1 / 0.7)
            stats = tk.softmax_partials(x, None, math, entropy=False, target=False, sum_logits=False)
            m, lse = stats[:, 0].contiguous(), (stats[:, 0] + stats[:, 1].log()).contiguous()
            lo = torch.full((chunk_rows,), float("-inf"), device=device)
            coef = torch.tensor([[-1.0, 1.0, 0.0, 0.0]], device=device).expand(chunk_rows, 4).contiguous()
            labels = x.float().argmax(-1)
            counts, _ = ts.histogram(x, math, lo, m, ts.MODE_MASS)
            top = (counts > 0).int().cumsum(1).argmax(1).to(torch.int32)  # the highest occupied bin: a few columns
            out = torch.empty_like(x)
            steps = {
                "kernel softmax_partials": lambda: tk.softmax_partials(x, labels, math, entropy=False, target=True,
                                                                       sum_logits=False),  # fmt: skip
                "kernel top_k_histogram": lambda: ts.histogram(x, math, lo, None, ts.MODE_KEY),
                "kernel top_p_histogram": lambda: ts.histogram(x, math, lo, m, ts.MODE_MASS),
                "kernel top_p_candidates": lambda: ts.candidates(x, math, lo, m, top - 8, top, 4096, ts.MODE_MASS),
                "kernel invariant block_partials": lambda: tk.block_partials(x, labels, math, entropy=False,
                                                                             target=True, sum_logits=False),  # fmt: skip
                "kernel softmax_grad": lambda: tk.softmax_grad_(x, labels, lse, None, coef, math, out),
                "kernel softmax_grad full KL": lambda: tk.softmax_grad_(
                    x, labels, lse, None, coef, math, out, difference=(z, torch.full_like(lse, 0.1))),
            }  # fmt: skip
            return steps[name]

        return make

    read = "kernel softmax_partials"
    return {
        "token_logprobs": (logits(), None, None),
        "token_logprobs entropy": (logits(return_entropy=True), "token_logprobs", 1.3),
        "cross_entropy inplace": (logits("cross_entropy inplace"), "token_logprobs", None),
        "token_logprobs top_p=0.9": (logits(top_p=0.9), "token_logprobs", 2.0),
        "token_logprobs top_k=50": (logits(top_k=50), "token_logprobs", 1.5),
        "token_logprobs invariant": (logits(invariant=True), "token_logprobs", 1.10),
        "linear_token_logprobs": (fused(), None, None),
        "linear_token_logprobs invariant": (fused(invariant=True), "linear_token_logprobs", 1.10),
        "linear_policy_loss": (fused(policy=True), None, None),
        "linear_policy_loss invariant": (fused(policy=True, invariant=True), "linear_policy_loss", 1.10),
        "linear_policy_loss full KL": (fused(policy=True, full_kl=True), "linear_policy_loss", 1.35),
        "linear_policy_loss gspo": (fused(policy=True, loss_mode="gspo"), "linear_policy_loss", None),
        read: (kernel(read), None, None),
        "kernel top_k_histogram": (kernel("kernel top_k_histogram"), read, 1.10),
        "kernel top_p_histogram": (kernel("kernel top_p_histogram"), read, 1.10),
        "kernel top_p_candidates": (kernel("kernel top_p_candidates"), read, 1.10),
        "kernel invariant block_partials": (kernel("kernel invariant block_partials"), read, 1.10),
        "kernel softmax_grad": (kernel("kernel softmax_grad"), None, None),
        "kernel softmax_grad full KL": (kernel("kernel softmax_grad full KL"), "kernel softmax_grad", 1.5),
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--case", action="append", help="only these cases (and their baselines)")
    args = p.parse_args()
    device = torch.device(args.device)
    cases = _cases(device, args.tiny)
    names = list(cases) if not args.case else [c for c in cases if c in args.case or any(
        cases[k][1] == c for k in args.case if k in cases)]  # fmt: skip
    samples = run_rounds(cases, names, device, args.rounds, after_group=_SHARED.clear)
    # top-p's rows left to the sorted fallback (every row of every call before the window's two-sided bound)
    report(cases, samples, device, args, "kernels33.json", extra={"top_p_rows_sorted": sampling.FALLBACK_ROWS[0]})


if __name__ == "__main__":
    main()
