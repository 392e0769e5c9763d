"""A compact check of `invariant=True` for one process: tests/test_invariant.py runs it in a fresh process per
CPU code path (`VARIANTS`: environment variables read when the libraries load, and the intra-op thread count), so
that a design leaning on one code path's rounding fails on a machine that has others.

``python tests/invariant_variants.py THREADS`` checks, with `torch.equal`, that per-token outputs do not depend on
the split (chunk sizes, a row alone, a shuffled batch): fused in fp32 (two hidden parts: H = 300), bf16 and float64,
from logits under softcap, temperature and top-p, the docs/invariant.md example's output, the first PPO ratio,
and the fused fp32 case again with `tiled_linear`'s probe forced to report that nothing but the R-row tile holds
(every GEMM a padded tile, on one thread, from copied weight tiles). Prints one line ``ok <what ran>`` or raises.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

import torch

import lmloss
from lmloss import chunks

ROOT = Path(__file__).resolve().parents[1]

#: name -> (environment, intra-op threads). What each changes with torch 2.13 (CPU wheel: MKL, oneDNN) on the
#: AVX2-only AMD EPYC this was written on, against the same process without it: ATEN_CPU_CAPABILITY=default swaps
#: ATen's vectorized kernels for its scalar ones and changes the bits of the GEMMs of every dtype and of exp /
#: tanh / log; MKL_CBWR=COMPATIBLE takes MKL's compatible code path and changes fp32 and float64 GEMMs (fp32's
#: small GEMMs then round like the tile only from 8 columns: the probe picks ('cols', 8) instead of ('rows', 4)).
#: Changing nothing here, run for the machines where they do: the AVX2 caps (this CPU is AVX2; on an AVX-512 one
#: they emulate it) and MKL_ENABLE_INSTRUCTIONS=SSE4_2 (MKL keeps its code path on this AMD CPU; on an Intel one
#: it takes MKL's SSE4.2 kernels); ONEDNN_MAX_CPU_ISA changed none of these ops' bits here (AVX2 or SSE41).
VARIANTS = {
    "avx2-caps-2-threads": (
        {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, 2),
    "aten-default-mkl-sse4_2-1-thread": ({"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, 1),
    "mkl-cbwr-compatible-2-threads": ({"MKL_CBWR": "COMPATIBLE"}, 2),
}  # fmt: skip


def _splits(op, rows: tuple[torch.Tensor, ...], chunks_: tuple, what: str) -> None:
    """``op(*rows, chunk_size)`` -> tuple of per-token outputs: the same bits for every chunk size, for rows alone
    and for the batch shuffled."""
    base = op(*rows, None)
    n = rows[0].shape[0]

    def same(got, idx, how):
        for g, b in zip(got, base):
            assert torch.equal(g, b[idx]), f"{what}: {how}"

    for c in chunks_:
        same(op(*rows, c), slice(None), f"chunk_size={c}")
    for i in (0, n // 2 + 7, n - 1):
        same(op(*(t[i : i + 1] for t in rows), "auto"), slice(i, i + 1), f"row {i} alone")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    same(op(*(t[perm] for t in rows), 64), perm, "shuffled")


def _head(dtype, n, h, v, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    bias = (torch.randn(v, generator=g) * 0.1).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::13] = -100
    return hidden, weight, bias, labels


def check_fused(dtype, h, what) -> None:
    """260 rows: two whole 128-row tiles and 4 after them (a small GEMM where the probe allows, else a tile)."""
    hidden, weight, bias, labels = _head(dtype, 260, h, 1500, seed=3)

    def op(hs, ls, chunk):
        return lmloss.linear_token_logprobs(hs, weight, ls, bias=bias, return_entropy=True, temperature=0.8,
                                            chunk_size=chunk, invariant=True)  # fmt: skip

    _splits(op, (hidden, labels), (1, 64, 130) if dtype == torch.float32 else (64,), what)


def check_logits() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(100, 1000, generator=g) * 3
    labels = x.argmax(-1)  # inside the kept set

    def op(xs, ls, chunk):
        lp, ent = lmloss.token_logprobs(xs, ls, return_entropy=True, softcap=8.0, temperature=0.7, chunk_size=chunk,
                                        invariant=True)  # fmt: skip
        kept = lmloss.token_logprobs(xs, ls, top_p=0.9, chunk_size=chunk, invariant=True)
        return lp, ent, kept

    _splits(op, (x, labels), (7,), "from logits")


def check_docs_example() -> None:
    text = (ROOT / "docs" / "invariant.md").read_text()
    code, shown = re.search(r"```python\n(.*?)```\n```\n(.*?)```", text, flags=re.S).groups()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/invariant.md", "exec"), {})
    assert out.getvalue() == shown, f"docs/invariant.md's example printed\n{out.getvalue()}"


def check_first_ratio() -> None:
    hidden, weight, _, labels = _head(torch.float32, 40, 64, 1500, seed=5)
    labels = labels.clamp(min=0)
    old = torch.cat([lmloss.linear_token_logprobs(hidden[i : i + 1], weight, labels[i : i + 1], invariant=True)
                     for i in range(40)])  # fmt: skip
    _, metrics = lmloss.rl.linear_policy_loss(hidden, weight, labels, old, torch.ones(40), chunk_size=32,
                                              invariant=True)  # fmt: skip
    assert metrics["ratio_max"].item() == 1.0 and metrics["ratio_min"].item() == 1.0, "the first PPO ratio"


def main(threads: int) -> str:
    torch.set_num_threads(threads)
    check_fused(torch.float32, 300, "fused fp32")
    check_fused(torch.bfloat16, 64, "fused bf16")
    check_fused(torch.float64, 64, "fused float64")
    check_logits()
    check_docs_example()
    check_first_ratio()
    cpu = torch.device("cpu")
    forms = {str(d).removeprefix("torch."): chunks.invariant_gemm_form(cpu, d, h, True, (128, 4096)).small
             for d, h in ((torch.float32, 300), (torch.bfloat16, 64), (torch.float64, 64))}  # fmt: skip
    # the probe reporting that no small form holds, that the tile's bits change with the thread count, the
    # weight's alignment and the output's layout: every GEMM then a zero-padded R-row tile made on one thread
    # from a copied weight tile into a fresh buffer
    probed = chunks._probed_gemm
    chunks._probed_gemm = lambda *key: chunks.InvariantGemm(one_thread=True, copy_weight=True, small=None,
                                                            direct_out=False)  # fmt: skip
    try:
        check_fused(torch.float32, 300, "fused fp32, the probe's fallback")
    finally:
        chunks._probed_gemm = probed
    return f"ok capability={torch.backends.cpu.get_cpu_capability()} threads={torch.get_num_threads()} small={forms}"


if __name__ == "__main__":
    print(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1))
