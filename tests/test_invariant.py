"""``invariant=True`` (docs/invariant.md), one process: each token's outputs are the same bits (`torch.equal`)
whatever the chunk size, the other rows of the call (a row alone, a shuffled batch, a sub-batch as its own
micro-batch), for every input dtype, from logits and fused, under top-k / top-p / min-p and a replayed support;
and within float tolerance of float64 math written here. TP degrees 1, 2 and 4 (and sequence parallelism):
tests/distributed/test_invariant_parallel.py.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import lmloss
from impl_params import IMPLS

pytestmark = pytest.mark.usefixtures("one_thread")  # many small ops per chunk: faster on one thread

N, V, H = 300, 1000, 32  # V: 7 whole blocks of 128 and a partial one
CHUNKS = [1, 3, 64, 1000, None, "auto"]
#: Triton's interpreter runs one program at a time: its cases are smaller (rows, columns) and fewer chunkings.
TRITON_N, TRITON_V, TRITON_CHUNKS = 12, 300, [5, None]
ALONE = (0, 137, 299)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]  # fmt: skip
_TRITON = pytest.mark.skipif(not lmloss.kernels.triton_available(), reason="triton is not installed")
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _case(dtype, impl):
    return pytest.param(dtype, impl, id=f"{_NAMES[dtype]}-{impl}", marks=_TRITON if impl == "triton" else ())


#: Every dtype on the PyTorch kernels; on Triton (its interpreter runs one program at a time) fp32, and bf16
#: where the logits are loaded in it. The fused ops' own part (the GEMM tiles) is the same for both.
LOGITS_CASES = [*(_case(d, "torch") for d in _NAMES), _case(torch.float32, "triton"), _case(torch.bfloat16, "triton")]


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def assert_invariant(op, rows: tuple[torch.Tensor, ...], chunks=CHUNKS) -> tuple[torch.Tensor, ...]:
    """``op(*rows, chunk_size=c)`` -> per-token outputs: the same bits for every chunk size in `chunks`, for a
    row alone, for the batch shuffled and for a sub-batch of its own. Returns the outputs of one chunk."""
    base = _as_tuple(op(*rows, chunk_size=None))
    n = rows[0].shape[0]
    alone = ALONE if n == N else (0, n - 1)
    sub = slice(41, 178) if n == N else slice(3, n - 2)

    def same(got, rows_of_base, what):
        for g, b in zip(_as_tuple(got), base):
            assert torch.equal(g, b[rows_of_base]), what

    for c in chunks:
        same(op(*rows, chunk_size=c), slice(None), f"chunk_size={c}")
    for i in alone:
        same(op(*(t[i : i + 1] for t in rows), chunk_size="auto"), slice(i, i + 1), f"row {i} alone")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    shuffled = _as_tuple(op(*(t[perm] for t in rows), chunk_size=64))
    for g, b in zip(shuffled, base):
        assert torch.equal(g, b[perm]), "shuffled"
    same(op(*(t[sub] for t in rows), chunk_size=50), sub, "a sub-batch")
    return base


def _logits(dtype, seed=0, n=N, v=V):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g) * 3).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::17] = -100
    return x, labels


@pytest.mark.parametrize(("dtype", "impl"), LOGITS_CASES)
def test_logprobs_entropy_and_losses_from_logits_are_the_same_bits_for_every_split(dtype, impl):
    x, labels = _logits(dtype) if impl == "torch" else _logits(dtype, n=TRITON_N, v=TRITON_V)
    chunks = CHUNKS if impl == "torch" else TRITON_CHUNKS
    opts = dict(temperature=0.7, softcap=None if impl == "triton" else 8.0, impl=impl, invariant=True)

    def per_token(x, labels, chunk_size):
        lp, ent = lmloss.token_logprobs(x, labels, chunk_size=chunk_size, return_entropy=True, **opts)
        ce = lmloss.cross_entropy(x, labels, chunk_size=chunk_size, reduction="none", label_smoothing=0.1,
                                  z_loss=1e-3, **opts)  # fmt: skip
        return lp, ent, ce, lmloss.token_entropy(x, chunk_size=chunk_size, **opts)

    lp, ent, ce, ent_alone = assert_invariant(per_token, (x, labels), chunks)
    valid = labels != -100
    # token_logprobs' entropy is token_entropy's bits where the token counts, and 0 where it is ignored
    assert torch.equal(ent, torch.where(valid, ent_alone, 0.0))
    y = x.double() if opts["softcap"] is None else 8.0 * torch.tanh(x.double() / 8.0)
    y = y / 0.7
    lse = y.logsumexp(-1)
    logp = y - lse[:, None]
    ref_lp = torch.where(valid, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    ref_ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    ref_ce = torch.where(valid, 0.9 * -ref_lp + 0.1 * -logp.mean(-1) + 1e-3 * lse**2, 0.0)
    for got, ref in ((lp, ref_lp), (ent, ref_ent), (ce, ref_ce)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_logits_gradient_of_a_row_is_the_same_bits_for_every_split(dtype):
    """The backward is elementwise given the row's saved lse (invariant) and its upstream: each row's gradient
    is invariant too."""
    x, labels = _logits(dtype, seed=2)
    up = torch.randn(N, generator=torch.Generator().manual_seed(3))

    def grad_rows(x, labels, up, chunk_size):
        x = x.clone().requires_grad_()
        lp, ent = lmloss.token_logprobs(x, labels, chunk_size=chunk_size, return_entropy=True, invariant=True,
                                        temperature=0.9)  # fmt: skip
        ((lp * up).sum() + 0.1 * (ent * up).sum()).backward()
        return x.grad

    (g,) = assert_invariant(grad_rows, (x, labels, up))
    z = x.double().requires_grad_()
    logp = (z / 0.9).log_softmax(-1)
    lp = torch.where(labels != -100, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    ent = torch.where(labels != -100, -(logp.exp() * logp).sum(-1), 0.0)  # ignored tokens: 0, no gradient
    ((lp * up).sum() + 0.1 * (ent * up).sum()).backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(g.double(), z.grad, **tol)


KEPT = {
    "top_p": dict(top_p=0.8),
    "top_p_per_token": "per-token",
    "top_k+min_p": dict(top_k=40, min_p=0.02),
}


@pytest.mark.parametrize(("case", "impl"), [*((c, "torch") for c in KEPT),
                                             pytest.param("top_p_per_token", "triton", marks=_TRITON)])  # fmt: skip
def test_the_kept_set_and_its_log_probs_are_the_same_bits_for_every_split(case, impl):
    """top-k / top-p / min-p: the threshold search (top-p's masses summed exactly in fixed point), the
    renormalised log-probs and entropy, and the log of the kept mass."""
    x, _ = _logits(torch.float32, seed=4) if impl == "torch" else _logits(torch.float32, 4, TRITON_N, TRITON_V)
    labels = x.argmax(-1)
    chunks = CHUNKS if impl == "torch" else TRITON_CHUNKS
    top_p = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.5 + 0.45

    def per_token(x, labels, top_p, chunk_size):
        kw = {"top_p": top_p} if KEPT[case] == "per-token" else KEPT[case]
        return lmloss.token_logprobs(x, labels, chunk_size=chunk_size, return_entropy=True, invariant=True,
                                     return_log_kept_mass=True, impl=impl, **kw)  # fmt: skip

    lp, ent, log_mass = assert_invariant(per_token, (x, labels, top_p), chunks)
    y = x.double()
    kw = {"top_p": top_p} if KEPT[case] == "per-token" else KEPT[case]
    kept = _kept(y, **kw)
    logp = y.masked_fill(~kept, -math.inf).log_softmax(-1)
    torch.testing.assert_close(lp.double(), logp.gather(1, labels[:, None])[:, 0], rtol=1e-5, atol=2e-5)
    ref_ent = -(logp.exp() * logp.masked_fill(~kept, 0.0)).sum(-1)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=2e-5)
    full = y.log_softmax(-1)
    torch.testing.assert_close(log_mass.double(), full.masked_fill(~kept, -math.inf).logsumexp(-1), rtol=1e-5, atol=2e-5)


def _kept(y, top_k=None, top_p=None, min_p=None):
    """vLLM's kept set, written out: min-p, then top-k (ties kept), then top-p over the renormalised rest."""
    kept = torch.ones_like(y, dtype=torch.bool)
    if min_p is not None:
        kept &= y.softmax(-1) >= min_p * y.softmax(-1).amax(-1, keepdim=True)
    if top_k is not None:
        kept &= y >= y.topk(top_k, -1).values[:, -1:]
    if top_p is not None:
        p = y.masked_fill(~kept, -math.inf).softmax(-1)
        srt, idx = p.sort(-1)
        top_p = torch.as_tensor(top_p, dtype=torch.float64).expand(y.shape[0])[:, None]
        drop = srt.cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        kept &= torch.zeros_like(kept).scatter(1, idx, ~drop)
    return kept


@pytest.mark.parametrize("impl", IMPLS)
def test_a_replayed_support_gives_the_same_bits_for_every_split(impl):
    x, _ = _logits(torch.float32, seed=6) if impl == "torch" else _logits(torch.float32, 6, TRITON_N, TRITON_V)
    support = x.topk(24, -1).indices
    support[::5, -3:] = -1  # rows with fewer ids
    labels = support[:, 0].clone()
    chunks = CHUNKS if impl == "torch" else TRITON_CHUNKS

    def per_token(x, labels, support, chunk_size):
        return lmloss.token_logprobs(x, labels, support=support, chunk_size=chunk_size, return_entropy=True,
                                     return_log_kept_mass=True, invariant=True, impl=impl, temperature=1.3)  # fmt: skip

    lp, ent, log_mass = assert_invariant(per_token, (x, labels, support), chunks)
    y = x.double() / 1.3
    kept = torch.zeros_like(y, dtype=torch.bool).scatter_(1, support.clamp(min=0), True)
    kept[::5] = torch.zeros_like(kept[::5]).scatter_(1, support[::5, :-3], True)
    logp = y.masked_fill(~kept, -math.inf).log_softmax(-1)
    torch.testing.assert_close(lp.double(), logp.gather(1, labels[:, None])[:, 0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), -(logp.exp() * logp.masked_fill(~kept, 0.0)).sum(-1), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(log_mass.double(), y.log_softmax(-1).masked_fill(~kept, -math.inf).logsumexp(-1),
                               rtol=1e-5, atol=2e-5)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- fused

VF = 1500  # fewer columns than a CPU GEMM tile (zero-padded); a partial block of 128 at the end


def _head(dtype, seed=7, n=N, v=VF):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, H, generator=g)).to(dtype)
    weight = (torch.randn(v, H, generator=g) / 2).to(dtype)
    bias = (torch.randn(v, generator=g) * 0.1).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::13] = -100
    return hidden, weight, bias, labels


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_logprobs_entropy_and_losses_are_the_same_bits_for_every_split(dtype):
    """The head's matmul made of GEMMs of one fixed shape: a token's logits do not depend on the chunk's
    rows (the default path's GEMM of one row, or seven, takes another kernel on this CPU)."""
    hidden, weight, bias, labels = _head(dtype)

    def per_token(hidden, labels, chunk_size):
        opts = dict(bias=bias, chunk_size=chunk_size, temperature=0.8, invariant=True)
        lp, ent = lmloss.linear_token_logprobs(hidden, weight, labels, return_entropy=True, **opts)
        ce = lmloss.linear_cross_entropy(hidden, weight, labels, reduction="none", label_smoothing=0.05, **opts)
        return lp, ent, ce

    lp, ent, ce = assert_invariant(per_token, (hidden, labels))
    z = torch.addmm(bias.double(), hidden.double(), weight.double().T)
    if dtype != torch.float32:
        z = z.to(dtype).double()  # the GEMM rounds its output to the inputs' dtype once
    logp = (z / 0.8).log_softmax(-1)
    valid = labels != -100
    ref_lp = torch.where(valid, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    tol = dict(rtol=1e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=0, atol=0.05)
    torch.testing.assert_close(lp.double(), ref_lp, **tol)
    torch.testing.assert_close(ent.double(), torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0), **tol)
    torch.testing.assert_close(ce.double(), torch.where(valid, -0.95 * ref_lp - 0.05 * logp.mean(-1), 0.0), **tol)


def test_fused_tiles_that_overlap_at_the_ends_give_the_same_bits_for_every_split(monkeypatch):
    """GEMM tiles narrower than the vocabulary (the last one overlapping the one before), as the production
    tile meets a real vocabulary: `tiled_linear` with a tile of 128 x 512 over 1500 columns."""
    monkeypatch.setitem(lmloss.chunks.INVARIANT_GEMM_TILE, "cpu", (128, 512))
    hidden, weight, bias, labels = _head(torch.float32, seed=14)

    def per_token(hidden, labels, chunk_size):
        return lmloss.linear_token_logprobs(hidden, weight, labels, bias=bias, chunk_size=chunk_size, invariant=True)

    (lp,) = assert_invariant(per_token, (hidden, labels), [1, 200, None])
    logp = torch.addmm(bias.double(), hidden.double(), weight.double().T).log_softmax(-1)
    ref = torch.where(labels != -100, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=2e-5)


def _at_odd_offset(t):
    """`t` copied one element into a fresh buffer (rows of it at odd offsets: another alignment)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    return buf[1:].view(t.shape).copy_(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
def test_tiled_linear_gives_a_row_alone_or_in_a_few_the_bits_of_a_whole_tile(dtype):
    """`tiled_linear`'s rows after the whole R-row tiles (a small GEMM where the probe verified it, else a padded
    tile; fp32's hidden dimension in `_CPU_GEMM_K` parts) get the bits the same rows get inside an R-row tile,
    over a weight of several overlapping tiles, with a bias, and with the hidden rows at odd offsets (MKL's
    float64 GEMM rounds a row 8 bytes off its 16-byte alignment differently)."""
    from lmloss.chunks import tiled_linear

    g = torch.Generator().manual_seed(21)
    rows = 16
    hidden = _at_odd_offset(torch.randn(rows, 600, generator=g).to(dtype))  # fp32: three hidden parts (256, 256, 88)
    n = 4200
    weight = (torch.randn(n, 600, generator=g) / 8).to(dtype)
    bias = (torch.randn(n, generator=g) * 0.1).to(dtype)
    for cols in (384, 4096):  # weight tiles overlapping at the end (4200 = 10 x 384 + 360 = 4096 + 104)
        tile = tiled_linear(hidden.clone(), weight, bias, hidden.new_empty((rows, n)), (rows, cols))
        assert torch.equal(tiled_linear(hidden, weight, bias, hidden.new_empty((rows, n)), (rows, cols)), tile)
        for idx in ([3], [0, 7], list(range(5, 16)), list(range(16)) + [2, 9]):  # alone, a few, a tile and 2 after
            got = tiled_linear(hidden[idx], weight, bias, hidden.new_empty((len(idx), n)), (rows, cols))
            assert torch.equal(got, tile[idx]), (cols, idx)
        for i in (3, 8):  # a view of one row at an odd offset, and of 8 rows
            got = tiled_linear(hidden[i : i + 1], weight, bias, hidden.new_empty((1, n)), (rows, cols))
            assert torch.equal(got, tile[i : i + 1]), (cols, i)
            got = tiled_linear(hidden[i : i + 8], weight, bias, hidden.new_empty((8, n)), (rows, cols))
            assert torch.equal(got, tile[i : i + 8]), (cols, i)
    ref = torch.addmm(bias.double(), hidden.double(), weight.double().T)
    tol = dict(rtol=0.02, atol=0.05) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tile.double(), ref, **tol)


@contextlib.contextmanager
def _planted_library(differs):
    """`torch.mm` / `torch.addmm` as a matrix library whose kernels round one ulp differently where
    ``differs(a, b, out)`` says (True: the whole output, or the rows it returns), and `tiled_linear`'s cached
    verdicts forgotten before and after."""
    mm, addmm = torch.mm, torch.addmm

    def nudge(a, b, r):
        where = differs(a, b, r)
        if where is True:
            where = slice(None)
        if where is not None and where is not False:
            r[where] = torch.nextafter(r[where], torch.full_like(r[where], math.inf))
        return r

    patch = pytest.MonkeyPatch()
    patch.setattr(torch, "mm", lambda a, b, *, out=None: nudge(a, b, mm(a, b, out=out)))
    patch.setattr(torch, "addmm", lambda c, a, b, *, out=None: nudge(a, b, addmm(c, a, b, out=out)))
    lmloss.chunks._probed_gemm.cache_clear()
    try:
        yield
    finally:
        patch.undo()
        lmloss.chunks._probed_gemm.cache_clear()


def _tiled_rows_alone_hold(dtype=torch.float32, weight_offset=False):
    """`tiled_linear` of rows alone and of 3 rows give the bits of the whole 16-row tile (a 384-row weight tile,
    the weight at an odd offset if asked)."""
    from lmloss.chunks import tiled_linear

    g = torch.Generator().manual_seed(22)
    hidden = torch.randn(16, 40, generator=g).to(dtype)
    weight = (torch.randn(500, 40, generator=g) / 8).to(dtype)
    tile = tiled_linear(hidden, weight, None, hidden.new_empty((16, 500)), (16, 384))
    weight = _at_odd_offset(weight) if weight_offset else weight
    for idx in ([5], [15], [0, 9, 4]):
        got = tiled_linear(hidden[idx], weight, None, hidden.new_empty((len(idx), 500)), (16, 384))
        assert torch.equal(got, tile[idx]), idx


def test_the_gemm_probe_keeps_the_bits_where_a_matrix_library_rounds_small_gemms_differently():
    """Force the probe to find that no small form holds (a planted library rounding every GEMM of fewer than 16
    rows or columns differently): rows alone then take zero-padded tiles and keep the tile's bits."""
    from lmloss.chunks import probe_invariant_gemm

    cpu = torch.device("cpu")
    assert probe_invariant_gemm(cpu, torch.float32, 40, False, (16, 384)).small is not None  # (this machine's)
    with _planted_library(lambda a, b, r: min(r.shape) < 16):
        verdict = probe_invariant_gemm(cpu, torch.float32, 40, False, (16, 384))
        assert verdict.small is None and not verdict.one_thread and not verdict.copy_weight
        _tiled_rows_alone_hold()


def test_the_gemm_probe_keeps_the_bits_where_the_tile_rounds_with_the_thread_count_or_the_alignment():
    """A planted library whose tile rounds differently on two threads: the GEMMs run on one thread; one whose
    tile rounds differently with the weight off 64-byte alignment: the weight tiles are copied; or written into
    a strided output: each tile is made in a fresh buffer; one that rounds a row by its place in the tile:
    invariant mode refuses to run, naming why."""
    from lmloss.chunks import probe_invariant_gemm

    cpu = torch.device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with _planted_library(lambda a, b, r: torch.get_num_threads() > 1):
            assert probe_invariant_gemm(cpu, torch.float32, 40, False, (16, 384)).one_thread
            _tiled_rows_alone_hold()
    finally:
        torch.set_num_threads(threads)
    with _planted_library(lambda a, b, r: any(t.data_ptr() % 64 for t in (a, b) if 384 in t.shape)):
        assert probe_invariant_gemm(cpu, torch.float32, 40, False, (16, 384)).copy_weight
        _tiled_rows_alone_hold(weight_offset=True)
    with _planted_library(lambda a, b, r: not r.is_contiguous()):  # a strided output (the chunk's logits)
        assert not probe_invariant_gemm(cpu, torch.float32, 40, False, (16, 384)).direct_out
        _tiled_rows_alone_hold()
    planted = _planted_library(lambda a, b, r: slice(0, 1) if r.shape == (16, 384) else None)  # a row's place
    with planted, pytest.raises(RuntimeError, match="cannot hold on this machine"):
        probe_invariant_gemm(cpu, torch.float32, 40, False, (16, 384))


def test_the_math_probe_refuses_where_short_and_long_exps_round_differently(monkeypatch):
    from lmloss.kernels.torch_ref import probe_invariant_math

    cpu = torch.device("cpu")
    assert probe_invariant_math(cpu, torch.float32) is None and probe_invariant_math(cpu, torch.float64) is None
    exp = torch.exp
    monkeypatch.setattr(torch, "exp", lambda x: exp(x) if x.numel() > 64 else torch.nextafter(exp(x), x.new_tensor(2.0)))
    assert probe_invariant_math(cpu, torch.float32) == "torch.exp of 1 values rounds differently than of 98317"
    lmloss.kernels.torch_ref._math_verdict.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="invariant=True cannot hold on this machine: torch.exp of 1 values"):
            lmloss.token_logprobs(torch.randn(3, 200), torch.zeros(3, dtype=torch.long), invariant=True)
    finally:
        lmloss.kernels.torch_ref._math_verdict.cache_clear()


def test_invariant_holds_under_every_cpu_code_path_this_machine_can_emulate():
    """tests/invariant_variants.py in a fresh process per `VARIANTS` entry (environment variables the libraries
    read when they load, 1 or 2 threads), two at a time: each checks fused fp32 / bf16 / float64 and from-logits
    outputs across splits, the docs example, the first PPO ratio and the probe's fallback, and says which
    ATen code path ran (ATEN_CPU_CAPABILITY=default must give the scalar one)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import invariant_variants

    here = Path(__file__).resolve().parent
    src = str(here.parent / "src")
    script = str(here / "invariant_variants.py")
    names = list(invariant_variants.VARIANTS)
    pending, running, results = list(names), {}, {}
    while pending or running:
        while pending and len(running) < 2:  # two at a time (2 cores)
            name = pending.pop(0)
            env_vars, threads = invariant_variants.VARIANTS[name]
            env = {**os.environ, **env_vars, "PYTHONPATH": src, "OMP_NUM_THREADS": str(threads),
                   "OMP_WAIT_POLICY": "PASSIVE"}  # (two processes of 2 threads on 2 cores: no spinning)
            running[name] = subprocess.Popen([sys.executable, "-W", "ignore", script, str(threads)], env=env,
                                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        name = next(iter(running))
        results[name] = running.pop(name).communicate(timeout=600)
    for name in names:
        out, err = results[name]
        assert out.startswith("ok "), f"{name}: {err[-3000:]}"
    assert "capability=DEFAULT threads=1" in results["aten-default-mkl-sse4_2-1-thread"][0]
    assert "threads=2" in results["mkl-cbwr-compatible-2-threads"][0]


def test_fused_under_top_p_and_a_replayed_support_gives_the_same_bits_for_every_split():
    hidden, weight, _, _ = _head(torch.float32, seed=8)
    z = hidden.double() @ weight.double().T
    labels = z.argmax(-1)
    support = z.topk(16, -1).indices

    def per_token(hidden, labels, support, chunk_size):
        kw = dict(chunk_size=chunk_size, invariant=True, return_entropy=True)
        a = lmloss.linear_token_logprobs(hidden, weight, labels, top_p=0.7, **kw)
        b = lmloss.linear_token_logprobs(hidden, weight, labels, support=support, **kw)
        return (*a, *b)

    lp_p, _, lp_s, _ = assert_invariant(per_token, (hidden, labels, support), [1, 64, None, "auto"])
    kept = _kept(z, top_p=0.7)
    ref = z.masked_fill(~kept, -math.inf).log_softmax(-1).gather(1, labels[:, None])[:, 0]
    torch.testing.assert_close(lp_p.double(), ref, rtol=1e-5, atol=2e-5)
    in_support = torch.zeros_like(kept).scatter_(1, support, True)
    ref = z.masked_fill(~in_support, -math.inf).log_softmax(-1).gather(1, labels[:, None])[:, 0]
    torch.testing.assert_close(lp_s.double(), ref, rtol=1e-5, atol=2e-5)


def test_fused_gradients_are_deterministic_for_a_fixed_split():
    """What is invariant ends at the per-token outputs (docs/invariant.md): the weight gradient sums over the
    batch's tokens, the hidden gradient is a GEMM over the chunk; for a fixed split both are the same bits
    run after run."""
    hidden, weight, bias, labels = _head(torch.float32, seed=9)
    up = torch.randn(N, generator=torch.Generator().manual_seed(10))

    def grads():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp = lmloss.linear_token_logprobs(h, w, labels, bias=bias, chunk_size=64, invariant=True)
        (lp * up).sum().backward()
        return h.grad, w.grad

    (gh1, gw1), (gh2, gw2) = grads(), grads()
    assert torch.equal(gh1, gh2) and torch.equal(gw1, gw2)
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp = torch.addmm(bias.double(), h, w.T).log_softmax(-1)
    valid = labels != -100
    (torch.where(valid, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0) * up).sum().backward()
    torch.testing.assert_close(gh1.double(), h.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw1.double(), w.grad, rtol=1e-5, atol=1e-5)


def test_summed_losses_take_their_gradient_in_the_forward_from_the_invariant_statistics():
    """The summed paths (the gradient made while each chunk is at hand): in place over the logits, and the
    fused head's accumulators; loss and gradients against float64."""
    x, labels = _logits(torch.float32, seed=15, n=64)
    base = x.clone().requires_grad_()
    logits = base * 1.0  # a non-leaf, as an lm_head's output
    loss = lmloss.cross_entropy(logits, labels, chunk_size=7, label_smoothing=0.1, inplace_backward=True,
                                invariant=True)  # fmt: skip
    loss.backward()
    z = x.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(z, labels, label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(base.grad.double(), z.grad, rtol=1e-5, atol=1e-7)

    hidden, weight, bias, hl = _head(torch.float32, seed=16, n=64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = lmloss.linear_cross_entropy(h, w, hl, bias=bias, chunk_size=7, z_loss=1e-3, invariant=True)
    loss.backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = torch.addmm(bias.double(), h64, w64.T)
    valid = hl != -100
    ref = (torch.nn.functional.cross_entropy(z, hl, reduction="none") + 1e-3 * z.logsumexp(-1) ** 2)[valid].mean()
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)


def test_the_first_ppo_ratio_is_exactly_one_whatever_the_split():
    """The RL motivation: old log-probs from the invariant op on a row-by-row split; the fused policy loss on
    the whole batch in other chunks sees every ratio exactly 1 (and, without invariant=True, the same
    computation on this CPU does not: the default GEMM of one row rounds differently)."""
    hidden, weight, _, labels = _head(torch.float32, seed=11)
    labels = labels.clamp(min=0)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(12))
    old = torch.cat([lmloss.linear_token_logprobs(hidden[i : i + 1], weight, labels[i : i + 1], invariant=True)
                     for i in range(N)])  # fmt: skip
    _, metrics = lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, chunk_size=96, invariant=True)
    assert metrics["ratio_max"].item() == 1.0 and metrics["ratio_min"].item() == 1.0
    assert metrics["pg_clipfrac"].item() == 0.0 and metrics["ppo_kl"].item() == 0.0


@pytest.mark.parametrize("path", ["logits", "fused"])
def test_top_p_log_probs_are_the_same_bits_whichever_outputs_are_asked(path):
    """The kept set's log-probs do not depend on whether the entropy (or the kept mass) is asked: the kept
    mass the threshold search summed exactly is the row's mass in every case."""
    if path == "logits":
        x, _ = _logits(torch.float32, seed=31)

        def op(**kw):
            return lmloss.token_logprobs(x, x.argmax(-1), top_p=0.85, invariant=True, chunk_size=64, **kw)
    else:
        hidden, weight, _, _ = _head(torch.float32, seed=31)
        top = (hidden @ weight.T).argmax(-1)

        def op(**kw):
            return lmloss.linear_token_logprobs(hidden, weight, top, top_p=0.85, invariant=True, chunk_size=64, **kw)

    alone = op()
    with_entropy, _ = op(return_entropy=True)
    with_mass, _ = op(return_log_kept_mass=True)
    assert torch.isfinite(alone).all()
    assert torch.equal(with_entropy, alone) and torch.equal(with_mass, alone)


def test_the_first_ratio_of_a_top_p_policy_with_an_entropy_bonus_is_exactly_one():
    """`linear_policy_loss(top_p=..., invariant=True, entropy_coeff != 0)` (which asks for the entropy) on old
    log-probs of `linear_token_logprobs(top_p=..., invariant=True)` (which does not)."""
    hidden, weight, _, _ = _head(torch.float32, seed=32)
    labels = (hidden @ weight.T).argmax(-1)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(33))
    old = lmloss.linear_token_logprobs(hidden, weight, labels, top_p=0.9, invariant=True)
    _, metrics = lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, top_p=0.9, invariant=True,
                                              entropy_coeff=0.01, chunk_size=96)  # fmt: skip
    assert metrics["ratio_max"].item() == 1.0 and metrics["ratio_min"].item() == 1.0


def test_invariant_is_checked_and_refused_where_it_cannot_hold():
    x, labels = _logits(torch.float32, n=4)
    with pytest.raises(TypeError, match="invariant must be a bool"):
        lmloss.token_logprobs(x, labels, invariant="yes")
    hidden, weight, _, hl = _head(torch.float32, n=4)
    with pytest.raises(ValueError, match="invariant=True does not take kl_loss_type='full'"):
        lmloss.rl.linear_policy_loss(hidden, weight, hl.clamp(min=0), torch.zeros(4), torch.ones(4), invariant=True,
                                     kl_loss_type="full", kl_loss_coef=0.1, ref_hidden=hidden, ref_weight=weight)  # fmt: skip
    wide = torch.zeros(1, 2**24 + 1)
    with pytest.raises(ValueError, match="up to 16777216 columns"):
        lmloss.token_logprobs(wide, torch.zeros(1, dtype=torch.long), invariant=True)


def test_the_fixed_point_combine_is_exact_in_any_order():
    """`combine_blocks` of blocks split into parts (as over ranks) and summed in any order: the same bits."""
    from lmloss.kernels import BlockPartials
    from lmloss.vocab_parallel import combine_blocks

    g = torch.Generator().manual_seed(13)
    m = torch.randn(5, 40, generator=g) * 4
    m[0, 3] = -math.inf
    s = torch.rand(5, 40, generator=g) * 127 + 1
    s[0, 3] = 0.0
    t = -torch.rand(5, 40, generator=g) * 40
    y = torch.randn(5, 40, generator=g) * 100
    whole = combine_blocks(BlockPartials(m, s, t, y, torch.zeros(5)), None)
    for order in (torch.randperm(40, generator=g), torch.arange(39, -1, -1)):
        got = combine_blocks(BlockPartials(m[:, order], s[:, order], t[:, order], y[:, order], torch.zeros(5)), None)
        assert torch.equal(got, whole)
    big_m = m.double().amax(1, keepdim=True)
    r = torch.where(s > 0, torch.exp(m.double() - big_m), 0.0)
    torch.testing.assert_close(whole[:, 1].double(), (s * r).sum(1), rtol=1e-6, atol=0)
    torch.testing.assert_close(whole[:, 4].double(), y.double().sum(1), rtol=1e-6, atol=1e-6)


def test_the_docs_example_prints_what_the_page_shows():
    import contextlib
    import io
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "invariant.md").read_text()
    code, shown = re.search(r"```python\n(.*?)```\n```\n(.*?)```", text, flags=re.S).groups()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/invariant.md", "exec"), {})
    assert out.getvalue() == shown
