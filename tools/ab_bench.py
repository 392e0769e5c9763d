"""Interleaved A/B timing of two lmloss source trees on this machine (a change against the commit before it).

    git archive <commit> src | tar -x -C /tmp/base     # the previous commit's source
    python tools/ab_bench.py --a /tmp/base/src --b src --rounds 7 [--case NAME ...] [--json out.json]
    python tools/ab_bench.py --a src --b src --b-invariant --case logits_fp32_auto --case fused_logprobs_fp32

With ``--b-invariant`` side B runs the cases' lmloss op with ``invariant=True`` (docs/invariant.md): the cost of
the invariant mode against the default, in one tree (only the cases whose op takes it, `INVARIANT_CASES`); with
``--a-invariant`` as well, two trees' invariant modes.

Each round runs every case once in tree A and once in tree B, alternating which goes first, each in a fresh
process (so each side imports its own lmloss) that builds the case's inputs (seeded), runs one untimed warm-up
step, then `--steps` timed forward + backward steps, and reports their median and its exact peak memory above
the inputs (lmloss.profiling's live-tensor tracker, one extra step). The summary: per case, the median over
rounds of each side's step time, B / A, and each side's spread (half the min-max range over the median):
differences smaller than the spreads are not measured. Threads: torch's default (2 here) unless --threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap


def _logits_ignored(n: int, v: int, *, half: bool) -> str:
    """A `token_logprobs` case under a per-token upstream over ``[n, v]`` fp32 logits; `half`: the first 256 of
    every 512 tokens ignored (as prompts are in SFT and RL)."""
    ignore = "; y.view(-1, 512)[:, :256] = -100" if half else ""
    return f"""
        x = (torch.randn({n}, {v}) * 2).requires_grad_(); y = torch.randint(0, {v}, ({n},)){ignore}; u = torch.randn({n})
        def step():
            x.grad = None; (lmloss.token_logprobs(x, y) * u).sum().backward()
    """


#: name -> (setup code defining `step()`, what it is). Shapes of the README's and docs' CPU cost rows.
CASES = {
    "logits_fp32_chunk1024": ("""
        x = (torch.randn(4096, 32000) * 2).requires_grad_(); y = torch.randint(0, 32000, (4096,))
        def step():
            x.grad = None; lmloss.token_logprobs(x, y, chunk_size=1024).sum().backward()
    """, "token_logprobs [4096, 32000] fp32, chunk 1024"),
    "logits_fp32_auto": ("""
        x = (torch.randn(4096, 32000) * 2).requires_grad_(); y = torch.randint(0, 32000, (4096,))
        def step():
            x.grad = None; lmloss.token_logprobs(x, y, **INV).sum().backward()
    """, "token_logprobs [4096, 32000] fp32, chunk 'auto'"),
    "logits_entropy_fp32_auto": ("""
        x = (torch.randn(4096, 32000) * 2).requires_grad_(); y = torch.randint(0, 32000, (4096,))
        def step():
            x.grad = None; lp, ent = lmloss.token_logprobs(x, y, return_entropy=True, **INV)
            (lp.sum() + 0.01 * ent.sum()).backward()
    """, "token_logprobs + entropy [4096, 32000] fp32, chunk 'auto'"),
    "fused_logprobs_fp32": ("""
        h = torch.randn(4096, 256).requires_grad_(); w = (torch.randn(32000, 256) / 16).requires_grad_()
        y = torch.randint(0, 32000, (4096,))
        def step():
            h.grad = w.grad = None; lmloss.linear_token_logprobs(h, w, y, **INV).sum().backward()
    """, "linear_token_logprobs 4096 x 256 x 32000 fp32, chunk 'auto'"),
    "logits_bf16_chunk1024": ("""
        x = (torch.randn(4096, 32000) * 2).bfloat16().requires_grad_(); y = torch.randint(0, 32000, (4096,))
        def step():
            x.grad = None; lmloss.token_logprobs(x, y, chunk_size=1024).sum().backward()
    """, "token_logprobs [4096, 32000] bf16, chunk 1024"),
    "inplace_fp32_chunk1024": ("""
        base = torch.randn(4096, 32000) * 2; y = torch.randint(0, 32000, (4096,)); a = torch.ones((), requires_grad=True)
        def step():
            lmloss.cross_entropy(base * a, y, chunk_size=1024, reduction="sum", inplace_backward=True).backward()
    """, "cross_entropy(inplace_backward=True) [4096, 32000] fp32, chunk 1024 (the step includes making the logits)"),
    "fused_fp32": ("""
        h = torch.randn(4096, 256).requires_grad_(); w = (torch.randn(32000, 256) / 16).requires_grad_()
        y = torch.randint(0, 32000, (4096,))
        def step():
            h.grad = w.grad = None; lmloss.linear_cross_entropy(h, w, y).backward()
    """, "linear_cross_entropy 4096 x 256 x 32000 fp32, chunk 'auto'"),
    "fused_rl_fp32": ("""
        h = torch.randn(4096, 256).requires_grad_(); w = (torch.randn(32000, 256) / 16).requires_grad_()
        y = torch.randint(0, 32000, (4096,)); u = torch.randn(4096)
        def step():
            h.grad = w.grad = None
            lp, ent = lmloss.linear_token_logprobs(h, w, y, temperature=0.7, return_entropy=True, **INV)
            ((lp * u).sum() + 0.01 * ent.sum()).backward()
    """, "linear_token_logprobs + entropy under a per-token upstream, 4096 x 256 x 32000 fp32"),
    "policy_fp32": ("""
        h = torch.randn(4096, 256).requires_grad_(); w = (torch.randn(32000, 256) / 16).requires_grad_()
        y = torch.randint(0, 32000, (4096,)); adv = torch.randn(4096); old = -10.9 + 0.3 * adv; ref = old - 0.1
        def step():
            h.grad = w.grad = None
            loss, _ = lmloss.rl.linear_policy_loss(h, w, y, old, adv, ref_logprobs=ref, temperature=0.7,
                clip_ratio_c=3.0, kl_loss_type="k3", kl_loss_coef=0.01, entropy_coeff=0.01)
            loss.backward()
    """, "rl.linear_policy_loss (PPO, dual clip, k3 KL, entropy) 4096 x 256 x 32000 fp32"),
    "policy_fullkl_fp32": ("""
        h = torch.randn(4096, 256).requires_grad_(); w = (torch.randn(32000, 256) / 16).requires_grad_()
        rh = h.detach() + 0.1 * torch.randn(4096, 256); rw = w.detach() + 0.01 * torch.randn(32000, 256)
        y = torch.randint(0, 32000, (4096,)); adv = torch.randn(4096); old = -10.9 + 0.3 * adv
        def step():
            h.grad = w.grad = None
            loss, _ = lmloss.rl.linear_policy_loss(h, w, y, old, adv, temperature=0.7, clip_ratio_c=3.0,
                kl_loss_type="full", kl_loss_coef=0.01, ref_hidden=rh, ref_weight=rw, entropy_coeff=0.01)
            loss.backward()
    """, "rl.linear_policy_loss as policy_fp32 with the full KL to a reference head (4 matmuls; a tree without "
         "kl_loss_type='full' cannot run it)"),
    "topp_fp32": ("""
        x = (torch.randn(2048, 32000) * 2).requires_grad_(); y = x.detach().argmax(-1)
        def step():
            x.grad = None; lmloss.token_logprobs(x, y, top_p=0.9, chunk_size=1024, **INV).sum().backward()
    """, "token_logprobs(top_p=0.9) [2048, 32000] fp32"),
    "topk_fp32": ("""
        x = (torch.randn(2048, 32000) * 2).requires_grad_(); y = x.detach().argmax(-1)
        def step():
            x.grad = None; lmloss.token_logprobs(x, y, top_k=50, chunk_size=1024).sum().backward()
    """, "token_logprobs(top_k=50) [2048, 32000] fp32"),
    "replay_fp32": ("""
        x = (torch.randn(2048, 32000) * 2).requires_grad_(); top = x.detach().topk(512, dim=-1).indices
        y = top[:, 0].contiguous()
        def step():
            x.grad = None; lmloss.token_logprobs(x, y, support=top, chunk_size=1024).sum().backward()
    """, "token_logprobs(support=[2048, 512]) [2048, 32000] fp32"),
    "distill_fused_fp32": ("""
        h = torch.randn(4096, 256).requires_grad_(); w = (torch.randn(32000, 256) / 16).requires_grad_()
        th = torch.randn(4096, 256); tw = torch.randn(32000, 256) / 16
        def step():
            h.grad = w.grad = None; lmloss.linear_distillation_loss(h, w, th, tw).backward()
    """, "linear_distillation_loss (forward KL) 4096 x 256 x 32000 fp32"),
    "distill_floor_fp32": ("""
        h = torch.randn(4096, 256); w = torch.randn(32000, 256) / 16
        th = torch.randn(4096, 256); tw = torch.randn(32000, 256) / 16
        def step():
            z = h @ w.T; zt = th @ tw.T; gh = z @ w; gw = z.T @ h
    """, "the four matmuls distillation needs (student and teacher logits, dh, dW), 4096 x 256 x 32000 fp32"),
    "distill_logits_fp32": ("""
        x = (torch.randn(4096, 32000) * 2).requires_grad_(); t = torch.randn(4096, 32000) * 2
        def step():
            x.grad = None; lmloss.distillation_loss(x, t, beta=0.5).backward()
    """, "distillation_loss (JSD beta 0.5) [4096, 32000] fp32"),
    # issue #31: tokens that do not count cost nothing (the first half of every 512-token sequence ignored,
    # as prompts are in SFT and RL); a tree that computes them shows the cost they had
    "fused_ce_half_ignored": ("""
        h = torch.randn(8192, 256).requires_grad_(); w = (torch.randn(32000, 256) / 16).requires_grad_()
        y = torch.randint(0, 32000, (8192,)); y.view(-1, 512)[:, :256] = -100
        def step():
            h.grad = w.grad = None; lmloss.linear_cross_entropy(h, w, y).backward()
    """, "linear_cross_entropy 8192 x 256 x 32000 fp32, the first half of every 512 tokens ignored"),
    "fused_ce_none_ignored": ("""
        h = torch.randn(8192, 256).requires_grad_(); w = (torch.randn(32000, 256) / 16).requires_grad_()
        y = torch.randint(0, 32000, (8192,))
        def step():
            h.grad = w.grad = None; lmloss.linear_cross_entropy(h, w, y).backward()
    """, "linear_cross_entropy 8192 x 256 x 32000 fp32, no token ignored"),
    "fused_logprobs_half_ignored": ("""
        h = torch.randn(8192, 256).requires_grad_(); w = (torch.randn(32000, 256) / 16).requires_grad_()
        y = torch.randint(0, 32000, (8192,)); y.view(-1, 512)[:, :256] = -100; u = torch.randn(8192)
        def step():
            h.grad = w.grad = None; (lmloss.linear_token_logprobs(h, w, y) * u).sum().backward()
    """, "linear_token_logprobs under a per-token upstream, 8192 x 256 x 32000 fp32, half ignored"),
    "fused_logprobs_none_ignored": ("""
        h = torch.randn(8192, 256).requires_grad_(); w = (torch.randn(32000, 256) / 16).requires_grad_()
        y = torch.randint(0, 32000, (8192,)); u = torch.randn(8192)
        def step():
            h.grad = w.grad = None; (lmloss.linear_token_logprobs(h, w, y) * u).sum().backward()
    """, "linear_token_logprobs under a per-token upstream, 8192 x 256 x 32000 fp32, none ignored"),
    "logits_half_ignored": (_logits_ignored(8192, 32000, half=True),
                            "token_logprobs under a per-token upstream [8192, 32000] fp32, chunk 'auto', half ignored"),
    "logits_none_ignored": (_logits_ignored(8192, 32000, half=False),
                            "token_logprobs under a per-token upstream [8192, 32000] fp32, chunk 'auto', none ignored"),
    # a narrow vocabulary, where a skipped gap costs more than its rows (lmloss.rows.GAP_LOGITS)
    "narrow_half_ignored": (_logits_ignored(16384, 256, half=True),
                            "token_logprobs over a narrow vocabulary [16384, 256] fp32, chunk 'auto', half ignored"),
    "narrow_none_ignored": (_logits_ignored(16384, 256, half=False),
                            "token_logprobs over a narrow vocabulary [16384, 256] fp32, chunk 'auto', none ignored"),
    # an engine scoring one token at a time (docs/invariant.md, "Small batches"): 200 single-row calls per step
    "single_row_logits": ("""
        x = torch.randn(200, 1, 32000) * 2; y = torch.randint(0, 32000, (200, 1))
        def step():
            with torch.no_grad():
                for i in range(200): lmloss.token_logprobs(x[i], y[i], **INV)
    """, "200 single-row token_logprobs [1, 32000] fp32, no grad"),
    "single_row_fused": ("""
        h = torch.randn(200, 1, 256); w = torch.randn(32000, 256) / 16; y = torch.randint(0, 32000, (200, 1))
        def step():
            with torch.no_grad():
                for i in range(200): lmloss.linear_token_logprobs(h[i], w, y[i], **INV)
    """, "200 single-row linear_token_logprobs [1, 256] x [32000, 256] fp32, no grad"),
    # the same where no small GEMM form is verified (lmloss.chunks.probe_invariant_gemm): each row a padded tile
    "single_row_fused_tiles": ("""
        lmloss.chunks.SMALL_GEMM_FORMS = ()
        h = torch.randn(200, 1, 256); w = torch.randn(32000, 256) / 16; y = torch.randint(0, 32000, (200, 1))
        def step():
            with torch.no_grad():
                for i in range(200): lmloss.linear_token_logprobs(h[i], w, y[i], **INV)
    """, "single_row_fused with no small GEMM form allowed (every row in a zero-padded 128-row tile)"),
}

#: The cases whose op takes ``invariant=`` (their code passes ``**INV``).
INVARIANT_CASES = tuple(c for c, (code, _) in CASES.items() if "**INV" in code)

RUNNER = """
import json, statistics, sys, time, warnings
import torch
warnings.simplefilter("ignore")
import lmloss
from lmloss.profiling import peak_memory
torch.manual_seed(0)
{threads}
INV = {inv}
{setup}
step()
times = []
for _ in range({steps}):
    start = time.perf_counter(); step(); times.append(time.perf_counter() - start)
with peak_memory() as mem:
    step()
print(json.dumps({{"ms": statistics.median(times) * 1e3, "peak_mib": mem.peak_mib}}))
"""


def run_one(src: str, case: str, steps: int, threads: int | None, invariant: bool = False) -> dict:
    code = RUNNER.format(
        setup=textwrap.dedent(CASES[case][0]), steps=steps,
        threads="" if threads is None else f"torch.set_num_threads({threads})",
        inv="dict(invariant=True)" if invariant else "{}",
    )  # fmt: skip
    env = dict(os.environ, PYTHONPATH=src, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{case} in {src}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="tree A's src directory (the baseline)")
    p.add_argument("--b", required=True, help="tree B's src directory (the change)")
    p.add_argument("--case", action="append", choices=sorted(CASES), help="cases to run (default: all)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per process (their median is the sample)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write every sample here")
    p.add_argument("--b-invariant", action="store_true", help="side B passes invariant=True to the case's op")
    p.add_argument("--a-invariant", action="store_true", help="side A too (two trees' invariant modes)")
    args = p.parse_args()
    invariant = {"a": args.a_invariant, "b": args.b_invariant}
    cases = args.case or list(INVARIANT_CASES if any(invariant.values()) else CASES)
    if any(invariant.values()) and set(cases) - set(INVARIANT_CASES):
        p.error(f"--a-invariant / --b-invariant take the cases {', '.join(INVARIANT_CASES)}")
    samples = {c: {"a": [], "b": [], "peak_a": None, "peak_b": None} for c in cases}
    for r in range(args.rounds):
        for c in cases:
            order = ("a", "b") if r % 2 == 0 else ("b", "a")
            for side in order:
                got = run_one(getattr(args, side), c, args.steps, args.threads, invariant[side])
                samples[c][side].append(got["ms"])
                samples[c]["peak_" + side] = got["peak_mib"]
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"{'case':<24} {'A ms (spread)':>18} {'B ms (spread)':>18} {'B/A':>6} {'peak A':>9} {'peak B':>9}")
    for c in cases:
        s = samples[c]
        med = {k: statistics.median(s[k]) for k in ("a", "b")}
        spread = {k: (max(s[k]) - min(s[k])) / 2 / med[k] for k in ("a", "b")}
        print(f"{c:<24} {med['a']:>10.1f} (±{100 * spread['a']:>3.0f}%) {med['b']:>10.1f} (±{100 * spread['b']:>3.0f}%)"
              f" {med['b'] / med['a']:>6.2f} {s['peak_a']:>8.0f}M {s['peak_b']:>8.0f}M")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": {c: CASES[c][1] for c in cases}, "samples": samples, "argv": sys.argv[1:]}, f, indent=1)


if __name__ == "__main__":
    main()
