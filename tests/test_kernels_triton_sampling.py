"""The Triton threshold search (`lmloss.kernels.triton_sampling`, `lmloss.sampling.keep_thresholds_by_kernels`).

Its kernels against bins and sums written out here in PyTorch (order-preserving keys exactly; the bins of
``exp(y - M)`` up to the columns whose float64 value lies within a relative 1e-6 of a bin edge, where the
kernels' exp may land on either side), then the kept set it finds against vLLM's sampler written out in float64
(`sampling_support.vllm_kept`) on the rows of tests/test_sampling.py. Under Triton's interpreter here: small
shapes, and small ``block_v`` so that rows take the unmasked main loop, the edge block and unaligned heads.
"""

from __future__ import annotations

import math

import pytest
import torch

from sampling_support import per_row, vllm_kept
from triton_support import kernel_test_device

triton = pytest.importorskip("triton", reason="the Triton kernels need triton installed")

from lmloss import sampling  # noqa: E402
from lmloss.kernels import ChunkMath  # noqa: E402
from lmloss.kernels import triton_sampling as ts  # noqa: E402

DEVICE = kernel_test_device()
INF = math.inf


def logits(rows, cols, seed, dtype=torch.float32, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g, dtype=torch.float64) * spread).to(dtype).to(DEVICE)


def key_bins(y: torch.Tensor) -> torch.Tensor:
    """The top 11 bits of each fp32 value's order-preserving key, as [0, 2048)."""
    bits = y.float().contiguous().view(torch.int32).long()
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (key >> 21) + 1024


def mass_bins(e64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bins of float64 masses in [0, 1] (exponent and 5 mantissa bits of their fp32 value, the 64 octaves
    below 1, clamped) and whether each value lies within a relative 1e-6 of a bin edge (the kernels make e as
    exp2(x * scale * log2 e - ...): either bin is right)."""
    def bin_of(v):
        bits = v.float().contiguous().view(torch.int32).long()
        return ((bits >> 18) - ((127 - 64) << 5)).clamp(0, 2047)

    b = bin_of(e64)
    near = (bin_of(e64 * (1 + 1e-6)) != b) | (bin_of(e64 * (1 - 1e-6)) != b)
    return b, near


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_histogram_and_candidates_by_key_over_strided_padded_rows(dtype):
    # rows of 203 columns inside a wider, offset tensor (unaligned heads, a row stride of 211), 190 of them
    # vocabulary; the rest NaN (never read); blocks of 32 columns: main loop and edge block both taken
    base = logits(6, 211, seed=1, dtype=dtype)
    base[:, 3 + 190 :] = float("nan")
    x = base[:, 3:206]
    math_ = ChunkMath(vocab_start=0, valid=190, scale=1 / 0.7)
    xv = x[:, :190].float()
    y = xv * math_.scale
    lo = torch.tensor([-INF, 0.0, -1.5, 2.0, -INF, 100.0], device=DEVICE)  # thresholds on x
    counts, _ = ts.histogram(x, math_, lo, None, ts.MODE_KEY, block_v=32)
    inside = xv >= lo[:, None]
    ref = torch.stack([torch.bincount(key_bins(xv[r])[inside[r]], minlength=ts.NBINS) for r in range(6)])
    assert torch.equal(counts.long(), ref)
    assert counts[5].sum() == 0  # nothing at or above 100

    # the candidates of each row's most populated bin, and of a two-bin window; a width too small keeps some
    b = ref.argmax(1).to(torch.int32)
    for hi, width in ((b, 64), (b + 1, 64), (b, 2)):
        values, count, _ = ts.candidates(x, math_, lo, None, b, hi.to(torch.int32), width, ts.MODE_KEY, block_v=32)
        bins = key_bins(xv)
        for r in range(6):
            want = y[r][inside[r] & (bins[r] >= b[r]) & (bins[r] <= hi[r])].sort(descending=True).values
            assert count[r] == want.numel()
            got = values[r].sort(descending=True).values
            kept = min(width, want.numel())
            assert torch.isinf(got[kept:]).all() and (got[kept:] < 0).all()
            if kept == want.numel():
                assert torch.equal(got[:kept], want)
            else:  # some of them, each one of the row's
                assert torch.isin(got[:kept], want).all()


def test_histogram_and_candidates_by_mass_with_the_mass_above():
    x = logits(5, 300, seed=2)
    math_ = ChunkMath(vocab_start=0, valid=300, scale=1 / 0.7)
    y = (x * math_.scale).double()  # as fp32 rounds it
    shift = y.amax(1).float()
    lo = torch.tensor([-INF, -INF, 0.0, 2.5, -INF], device=DEVICE)  # thresholds on x
    counts, mass = ts.histogram(x, math_, lo, shift, ts.MODE_MASS, block_v=64)
    e = torch.exp(y - shift.double()[:, None])
    inside = x.double() >= lo.double()[:, None]
    bins, near = mass_bins(e)
    for r in range(5):
        ref = torch.bincount(bins[r][inside[r]], minlength=ts.NBINS)
        assert (counts[r].long() - ref).abs().sum() <= 2 * int((near[r] & inside[r]).sum())
    torch.testing.assert_close(mass.double(), torch.where(inside, e, 0.0).sum(1), rtol=1e-5, atol=0)
    assert counts[:, ts.NBINS - 1].min() >= 1  # the row max: e = 1, the top bin

    b_lo = (bins.amax(1) - 40).to(torch.int32)
    b_hi = (bins.amax(1) - 10).to(torch.int32)
    values, count, above = ts.candidates(x, math_, lo, shift, b_lo, b_hi, 300, ts.MODE_MASS, block_v=64)
    for r in range(5):
        if bool(near[r].any()):
            continue  # a column on a bin edge may be a candidate or not
        pick = inside[r] & (bins[r] >= b_lo[r]) & (bins[r] <= b_hi[r])
        assert torch.equal(values[r][: count[r]].sort().values, y[r][pick].float().sort().values)
        torch.testing.assert_close(above[r].double(), e[r][inside[r] & (bins[r] > b_hi[r])].sum(), rtol=1e-5, atol=1e-12)


CASES = {
    "top_k": dict(top_k=20),
    "top_p": dict(top_p=0.9),
    "min_p": dict(min_p=0.05),
    "top_k_min_p": dict(top_k=7, min_p=0.1),
    "all_three": dict(top_k=60, top_p=0.8, min_p=0.01),
    "per_token": dict(
        top_k=torch.tensor([1, 5, 600, 40] * 2),
        top_p=torch.tensor([0.5, 1.0, 0.95, 0.3] * 2, dtype=torch.float64),
        min_p=torch.tensor([0.0, 0.1, 0.0, 0.02] * 2, dtype=torch.float64),
    ),  # fmt: skip
}


def search(x, scale, kw, full_lse=False, valid=None):
    params = dict(top_k=None, top_p=None, min_p=None)
    params.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    k = params["top_k"]
    k_max = 0 if k is None else int(k.max()) if isinstance(k, torch.Tensor) else k
    valid = x.shape[1] if valid is None else valid
    math_ = ChunkMath(vocab_start=0, valid=valid, scale=scale)
    return sampling.keep_thresholds_by_kernels(x, math_, params, min(k_max, valid), group=None, want_full_lse=full_lse)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_set_equals_vllm_float64_reference(case, dtype):
    """The rows of tests/test_sampling.py's kept-set test (8 x 400, temperature 0.5), with the full mass."""
    kw = CASES[case]
    x = (torch.randn(8, 400, generator=torch.Generator().manual_seed(1)) * 3).to(dtype).to(DEVICE)
    found = search(x, 2.0, kw, full_lse=True)
    y = x.double().cpu() * 2.0
    ref = vllm_kept(y, **{k: per_row(v, 8) for k, v in kw.items()})
    assert torch.equal((x.float() >= found.keep_min[:, None]).cpu(), ref)
    torch.testing.assert_close(found.full_lse.double().cpu(), torch.logsumexp(y, -1), rtol=0, atol=2e-6)


def test_top_p_over_thousands_of_columns_with_a_wide_window_and_the_sorted_fallback(monkeypatch):
    """Flat rows (many columns per bin around the crossing) over several blocks, every top_p from 0.05 to 0.99;
    then the same rows with at most one candidate per row: every row sorted (`_dense_top_p`), the same set."""
    x = logits(6, 3000, seed=3, spread=0.5)
    top_p = torch.linspace(0.05, 0.99, 6, dtype=torch.float64)
    ref = vllm_kept(x.double().cpu() * 2.0, top_p=top_p, top_k=per_row(2500, 6))
    before = sampling.FALLBACK_ROWS[0]
    found = search(x, 2.0, dict(top_p=top_p, top_k=2500))
    assert torch.equal((x >= found.keep_min[:, None]).cpu(), ref)
    assert sampling.FALLBACK_ROWS[0] == before  # found among the candidates
    monkeypatch.setattr(sampling, "KERNEL_CANDIDATES_MAX", 1)
    found = search(x, 2.0, dict(top_p=top_p, top_k=2500))
    assert torch.equal((x >= found.keep_min[:, None]).cpu(), ref)
    assert sampling.FALLBACK_ROWS[0] - before == 6


@pytest.mark.parametrize("top_k", [None, 90000])
def test_top_p_over_a_flat_row_of_a_large_vocabulary_is_found_among_the_candidates(top_k):
    """2 * randn logits over 128256 columns (the GPU benchmark's rows), top_p 0.9: ~30000 columns kept, ~450 per
    mass bin at the crossing. Bounding the mass above a bin from the top alone left ~5000 columns in the window,
    more than the candidates take (`KERNEL_CANDIDATES_MAX`): every row was sorted. Alone and after a top-k that
    binned the masses for it, the set is vLLM's, found without sorting a row."""
    x = logits(2, 128256, seed=3, spread=2.0)
    kw = dict(top_p=0.9) if top_k is None else dict(top_p=0.9, top_k=top_k)
    before = sampling.FALLBACK_ROWS[0]
    found = search(x, 1.0, kw)
    assert sampling.FALLBACK_ROWS[0] == before
    ref = vllm_kept(x.double().cpu(), **{k: per_row(v, 2) for k, v in kw.items()})
    assert torch.equal((x >= found.keep_min[:, None]).cpu(), ref)


def test_crossing_bins_hold_the_crossing_and_few_columns_on_random_rows():
    """`sampling.crossing_bins` from counts and the total mass, against the crossing bin of float64 per-bin masses
    of the same values: over flat, peaked and tied rows, top_p from 0.01 to 0.999, and a kept mass off by up to
    half the margin either way, the crossing is inside the window, and the window's count is its columns'."""
    g = torch.Generator().manual_seed(9)
    low, high = ts.mass_bin_bounds(torch.device("cpu"))
    for trial in range(60):
        cols = int(torch.randint(2, 150000, (1,), generator=g))
        spread = float(torch.empty(1).uniform_(0.05, 8.0, generator=g))
        y = torch.randn(4, cols, generator=g, dtype=torch.float64) * spread
        if trial % 5 == 0:
            y = y.round()  # ties: many columns share a bin
        e = torch.exp(y - y.amax(1, keepdim=True)).float()  # as the kernels' bins see them
        b, _ = mass_bins(e.double())
        counts = torch.zeros(4, ts.NBINS, dtype=torch.int64).scatter_add_(1, b, torch.ones_like(b))
        mass = torch.zeros(4, ts.NBINS, dtype=torch.float64).scatter_add_(1, b, e.double())
        top_p = torch.empty(4, dtype=torch.float64).uniform_(0.01, 0.999, generator=g)
        for off in (-0.5, 0.0, 0.5):
            z_given = mass.sum(1) * (1 + off * sampling.CROSSING_MASS_MARGIN)
            _assert_window_holds_the_crossing(counts, mass, z_given, top_p * z_given, b)


@pytest.mark.parametrize("top_p", [0.9, 0.05])
def test_crossing_bins_of_flat_rows_hold_a_few_bins_worth_of_columns(top_p):
    """On the benchmark's flat rows (2 * randn over 128256 columns; at top_p 0.9 ~450 columns a bin at the
    crossing) the window spans a few bins: at most four times the crossing bin's columns, and half what the
    candidates take. The bound from the top alone left 11-13 bins (~5000 columns) at 0.9; the one from the
    bottom alone is as wide at 0.05."""
    g = torch.Generator().manual_seed(12)
    y = (torch.randn(16, 128256, generator=g) * 2).double()
    e = torch.exp(y - y.amax(1, keepdim=True)).float()
    b, _ = mass_bins(e.double())
    counts = torch.zeros(16, ts.NBINS, dtype=torch.int64).scatter_add_(1, b, torch.ones_like(b))
    mass = torch.zeros(16, ts.NBINS, dtype=torch.float64).scatter_add_(1, b, e.double())
    z = mass.sum(1)
    b_lo, b_hi, in_window = sampling.crossing_bins(counts, z, top_p * z, *ts.mass_bin_bounds(torch.device("cpu")))
    crossing = (mass.flip(1).cumsum(1).flip(1) >= top_p * z[:, None]).sum(1) - 1
    assert ((b_lo <= crossing) & (crossing <= b_hi)).all()
    assert (in_window <= 4 * counts.gather(1, crossing[:, None])[:, 0]).all()
    assert (in_window <= sampling.KERNEL_CANDIDATES_MAX // 2).all()


@pytest.mark.parametrize("edge", ["low", "high"])
def test_crossing_bins_hold_a_crossing_at_a_bins_edge_with_the_kept_mass_off_by_half_the_margin(edge):
    """Masses at their bins' lowest (or just below their highest) values, where the bounds from the bottom are
    tightest, and targets right at the mass at or above a bin (or just above the next one's): the margin on the
    kept mass keeps the crossing inside the window."""
    g = torch.Generator().manual_seed(10)
    low, high = ts.mass_bin_bounds(torch.device("cpu"))
    bins = torch.randint(1700, ts.NBINS - 1, (4, 300), generator=g)
    values = low.float()[bins] if edge == "low" else torch.nextafter(high.float()[bins], torch.tensor(0.0))
    counts = torch.zeros(4, ts.NBINS, dtype=torch.int64).scatter_add_(1, bins, torch.ones_like(bins))
    mass = torch.zeros(4, ts.NBINS, dtype=torch.float64).scatter_add_(1, bins, values.double())
    at_or_above = mass.flip(1).cumsum(1).flip(1)
    for b in range(1700, ts.NBINS - 1, 7):
        for target in (at_or_above[:, b], torch.minimum(at_or_above[:, b + 1] * (1 + 2.0**-40), at_or_above[:, 0])):
            for off in (-0.5, 0.5):
                z_given = mass.sum(1) * (1 + off * sampling.CROSSING_MASS_MARGIN)
                _assert_window_holds_the_crossing(counts, mass, z_given, target, bins)


def _assert_window_holds_the_crossing(counts, mass, z_given, target, bins):
    low, high = ts.mass_bin_bounds(torch.device("cpu"))
    crossing = (mass.flip(1).cumsum(1).flip(1) >= target[:, None]).sum(1) - 1
    b_lo, b_hi, in_window = sampling.crossing_bins(counts, z_given, target, low, high)
    assert ((b_lo <= crossing) & (crossing <= b_hi)).all()
    assert torch.equal(in_window, ((bins >= b_lo[:, None]) & (bins <= b_hi[:, None])).sum(1))


def test_ties_at_the_top_k_boundary_and_padding_columns():
    # 5, 4, 3, 3, 3, 2, ...: top_k=3 keeps the three tied 3s; the last two columns are padding (never kept)
    x = torch.tensor([[5.0, 3.0, 4.0, 3.0, 2.0, 3.0, 1.0, 0.0, 9.0, 9.0]], device=DEVICE)
    found = search(x, 1.0, dict(top_k=3), valid=8)
    assert (x[0, :8] >= found.keep_min[0]).tolist() == [True, True, True, True, False, True, False, False]


@pytest.mark.parametrize("mode", [ts.MODE_KEY, ts.MODE_MASS])
def test_histogram_by_global_atomics_equals_tl_histogram(mode):
    # the two ways `_histogram_kernel` counts (HISTOGRAM_IN_SHARED picks one by Triton's version) agree exactly
    torch.manual_seed(3)
    x = (torch.randn(4, 300) * 3).to(torch.bfloat16).to(DEVICE)
    math_ = ChunkMath(vocab_start=0, valid=290)
    lo = torch.tensor([-math.inf, 0.0, -1.0, 2.0], device=DEVICE)
    shift = x[:, :290].float().amax(1)
    a = ts.histogram(x, math_, lo, shift, mode, block_v=64, shared=True)
    b = ts.histogram(x, math_, lo, shift, mode, block_v=64, shared=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
