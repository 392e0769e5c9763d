"""Triton per-chunk kernels against float64 references written out here.

Runs on the CPU under ``TRITON_INTERPRET=1`` (set in conftest.py before triton is imported); with
``TRITON_INTERPRET=0`` and a GPU the same tests run on CUDA. The interpreter costs about a millisecond per
program, so shapes stay tiny and tiny ``block_v`` overrides force several vocabulary blocks per row.
"""

from __future__ import annotations

import pytest
import torch

from triton_support import kernel_test_device

triton = pytest.importorskip("triton", reason="the Triton kernels need triton installed")

from lmloss.kernels import ChunkMath  # noqa: E402
from lmloss.kernels.triton_kernels import (  # noqa: E402
    BACKWARD_BLOCKS,
    FORWARD_BLOCKS,
    block_config,
    softmax_grad_,
    softmax_partials,
)

DEVICE = kernel_test_device()

NAN, INF = float("nan"), float("inf")
IGNORE = -100


def make_logits(c: int, v_local: int, valid: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random logits with NaN in the padded columns (they must never be read into a result)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, v_local, generator=g, dtype=torch.float64) * 3
    x[:, valid:] = NAN
    return x.to(dtype).to(DEVICE)


def ref_y(x: torch.Tensor, math: ChunkMath) -> torch.Tensor:
    """float64 transformed logits of the valid columns, [c, valid]."""
    y = x[:, : math.valid].double()
    if math.softcap:
        y = math.softcap * torch.tanh(y / math.softcap)
    return y * math.scale


def ref_partials(x: torch.Tensor, labels: torch.Tensor, math: ChunkMath) -> torch.Tensor:
    """float64 [c, 5]: max, sum exp, sum exp * (y - max) (0 where exp is 0), owned target logit, sum y."""
    y = ref_y(x, math)
    m = y.max(-1).values if math.valid else torch.full((x.shape[0],), -INF, dtype=torch.float64)
    shift = y - torch.where(m == -INF, 0.0, m)[:, None]
    e = shift.exp()
    t = torch.where(e > 0, e * shift, 0.0).sum(-1)
    local = labels.to(DEVICE) - math.vocab_start
    owned = (local >= 0) & (local < math.valid)
    y_label = y.gather(1, local.clamp(0, max(math.valid - 1, 0))[:, None])[:, 0] if math.valid else m
    target = torch.where(owned, y_label, 0.0)
    return torch.stack([m, e.sum(-1), t, target, y.sum(-1)], 1)


def ref_grad(x, labels, lse, entropy, coef, math) -> torch.Tensor:
    """float64 [c, V_local] gradient from the formula of the contract (checked against autograd below)."""
    y = ref_y(x, math)
    a, b, c, d = (coef.double()[:, k : k + 1] for k in range(4))
    logp = y - lse.double()[:, None]
    p = logp.exp()
    g = torch.where(a != 0, a * p, 0.0) + c
    if entropy is not None:
        g = g + torch.where((d != 0) & (p > 0), d * p * (logp + entropy.double()[:, None]), 0.0)
    if labels is not None:
        cols = torch.arange(math.valid, device=DEVICE)
        g = g + torch.where(cols == (labels.to(DEVICE) - math.vocab_start)[:, None], b, 0.0)
    if math.softcap:
        g = g * (1 - torch.tanh(x[:, : math.valid].double() / math.softcap) ** 2)
    g = torch.where((coef != 0).any(1, keepdim=True), g * math.scale, 0.0)
    return torch.nn.functional.pad(g, (0, x.shape[1] - math.valid))


def softmax_stats(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 lse and entropy -sum p log p of y [c, V] (terms with p == 0 count 0)."""
    logp = torch.log_softmax(y, -1)
    return torch.logsumexp(y, -1), -torch.where(logp > -INF, logp.exp() * logp, 0.0).sum(-1)


def autograd_grad(shards, labels, coef, maths) -> list[torch.Tensor]:
    """d/dx of sum_rows (a * lse + b * y_label + c * sum_j y_j - d * H) in float64 over the vocabulary made of
    the shards' valid columns: the loss whose gradient the contract's (a, b, c, d) describe."""
    xs = [x[:, : m.valid].double().requires_grad_() for x, m in zip(shards, maths)]
    y = torch.cat([ref_y(x, m) for x, m in zip(xs, maths)], 1)
    lse, entropy = softmax_stats(y)
    owned = (labels >= 0) & (labels < y.shape[1])
    y_label = torch.where(owned.to(DEVICE), y.gather(1, labels.clamp(0).to(DEVICE)[:, None])[:, 0], 0.0)
    a, b, c, d = coef.double().unbind(1)
    (a * lse + b * y_label + c * y.sum(-1) - d * entropy).sum().backward()
    return [torch.nn.functional.pad(x.grad, (0, s.shape[1] - m.valid)) for x, s, m in zip(xs, shards, maths)]


def assert_close(actual, expected, dtype=torch.float32):
    tol = {torch.float32: (1e-5, 2e-6), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (2e-3, 1e-6)}[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=tol[0], atol=tol[1])


# (c, V_local, valid, vocab_start, scale, softcap, block_v): ragged shapes no block divides, padded columns,
# several vocabulary blocks, one block, the default block, temperature and softcap.
CASES = {
    "ragged-3-blocks": (5, 37, 37, 0, 1.0, 0.0, 16),
    "padded-shard": (4, 40, 33, 100, 1 / 0.7, 0.0, 16),
    "softcap-temperature": (3, 37, 30, 0, 0.5, 5.0, 8),
    "default-block": (2, 37, 37, 0, 1.0, 0.0, None),
}


def case_labels(c, vocab_start):
    # owned column 5, a column past the shard, ignored, a column before the shard, and the last valid column
    return torch.tensor([vocab_start + 5, vocab_start + 1000, IGNORE, vocab_start - 1, vocab_start + 29][:c])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_partials_match_float64(case, dtype):
    c, v_local, valid, start, scale, softcap, block = CASES[case]
    math = ChunkMath(vocab_start=start, valid=valid, scale=scale, softcap=softcap)
    x = make_logits(c, v_local, valid, dtype)
    x[1, [0, 3, valid - 1]] = -INF  # a sampler's mask: exp == 0 terms give 0, not NaN
    labels = case_labels(c, start)
    out = softmax_partials(
        x, labels.to(DEVICE), math, entropy=True, target=True, sum_logits=True, block_v=block
    )
    assert out.dtype == torch.float32 and out.shape == (c, 5) and out.is_contiguous()
    expected = ref_partials(x, labels, math)
    assert torch.isfinite(out[:, :4]).all()
    assert out[0, 3] != 0 and (out[1:4, 3] == 0).all()  # owned / not owned / ignored / before the shard
    assert_close(out, expected)  # x's dtype is read exactly and the math is fp32 either way


def test_partials_flags_off_and_degenerate_rows():
    math = ChunkMath(vocab_start=0, valid=20, scale=1.0, softcap=0.0)
    x = make_logits(3, 24, 20, torch.float32)
    x[1, :20] = -INF  # a row entirely masked: m = -inf, s = 0, t = 0
    full = softmax_partials(x, torch.zeros(3, dtype=torch.long, device=DEVICE), math,
                            entropy=True, target=True, sum_logits=True, block_v=8)  # fmt: skip
    bare = softmax_partials(x, None, math, entropy=False, target=False, sum_logits=False, block_v=8)
    assert_close(full, ref_partials(x, torch.zeros(3, dtype=torch.long), math))
    assert full[1, 0] == -INF and full[1, 1] == 0 and full[1, 2] == 0 and not full[1, :3].isnan().any()
    torch.testing.assert_close(bare[:, :2], full[:, :2])
    assert (bare[:, 2:] == 0).all()
    empty = softmax_partials(x, None, ChunkMath(0, 0, 1.0, 0.0), entropy=True, target=False, sum_logits=True)
    assert (empty[:, 0] == -INF).all() and (empty[:, 1:] == 0).all()


@pytest.mark.parametrize("case", ["ragged-3-blocks", "padded-shard", "softcap-temperature"])
def test_partials_of_rows_that_do_not_count_read_nothing_and_give_lse_0(case):
    # a slice of logits joins short gaps of ignored rows (lmloss.rows): `live` False rows are not read (NaN
    # there reaches nothing) and give (m, s, t, target, sum_y) = (0, 1, 0, 0, 0); the live rows are unchanged
    c, v_local, valid, start, scale, softcap, block = CASES[case]
    math = ChunkMath(vocab_start=start, valid=valid, scale=scale, softcap=softcap)
    x = make_logits(c, v_local, valid, torch.float32, seed=5)
    live = torch.ones(c, dtype=torch.bool)
    live[1::2] = False
    x[~live] = NAN
    labels = case_labels(c, start).to(DEVICE)
    flags = dict(entropy=True, target=True, sum_logits=True, block_v=block)
    got = softmax_partials(x, labels, math, live=live.to(DEVICE), **flags)
    every = softmax_partials(x, labels, math, **flags)
    assert torch.equal(got[live], every[live])
    assert torch.equal(got[~live].cpu(), torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]]).expand(int((~live).sum()), 5))
    assert every[~live].isnan().any()  # without `live` those rows are read
    with pytest.raises(ValueError, match="live"):
        softmax_partials(x, labels, math, live=live[:-1].to(DEVICE), **flags)


def combine(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lse, entropy and target logit of the whole vocabulary from the shards' partials, in float64."""
    p = torch.stack(parts).double()  # [shards, c, 5]
    m = p[..., 0].max(0).values
    w = torch.exp(p[..., 0] - m)
    s = (w * p[..., 1]).sum(0)
    t = (w * (p[..., 2] + (p[..., 0] - m) * p[..., 1])).sum(0)
    return m + s.log(), s.log() - t / s, p[..., 3].sum(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_vocab_shards_match_the_whole_softmax(dtype):
    """Two shards of 19 valid columns (padded to 24) combine to the whole-vocabulary lse, entropy and target,
    and their gradients from the global lse and entropy are autograd's through softcap and temperature."""
    c, v_local, valid = 5, 24, 19
    maths = [ChunkMath(vocab_start=r * valid, valid=valid, scale=1 / 1.3, softcap=4.0) for r in range(2)]
    shards = [make_logits(c, v_local, valid, dtype, seed=r) for r in range(2)]
    shards[0][2, 4] = -INF
    labels = torch.tensor([3, 25, IGNORE, 18, 37])  # shard 0, shard 1, ignored, both shards' edges
    parts = [
        softmax_partials(x, labels.to(DEVICE), m, entropy=True, target=True, sum_logits=False, block_v=8)
        for x, m in zip(shards, maths)
    ]
    y = torch.cat([ref_y(x, m) for x, m in zip(shards, maths)], 1)
    lse_ref, entropy_ref = softmax_stats(y)
    owned = labels >= 0
    target_ref = torch.where(owned.to(DEVICE), y.gather(1, labels.clamp(0).to(DEVICE)[:, None])[:, 0], 0.0)
    lse, entropy, target = combine(parts)
    assert_close(lse, lse_ref)
    assert_close(entropy, entropy_ref)
    assert_close(target, target_ref)

    g = torch.Generator().manual_seed(1)
    coef = torch.randn(c, 4, generator=g)
    coef[0, 0] = 0.0  # a row without the lse term
    coef[3, 3] = 0.0  # a row without the entropy term
    coef = coef.to(DEVICE)
    expected = autograd_grad(shards, labels, coef, maths)
    for x, m, exp in zip(shards, maths, expected):
        out = torch.empty(c, v_local, dtype=torch.float32, device=DEVICE)
        softmax_grad_(x, labels.to(DEVICE), lse.float(), entropy.float(), coef, m, out, block_v=8)
        assert_close(out, exp)
        assert (out[:, valid:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_grad_matches_formula_and_dead_rows_are_zero(case, dtype):
    c, v_local, valid, start, scale, softcap, block = CASES[case]
    math = ChunkMath(vocab_start=start, valid=valid, scale=scale, softcap=softcap)
    x = make_logits(c, v_local, valid, dtype, seed=2)
    x[0, [1, valid - 2]] = -INF  # masked columns in a live row with an entropy term
    x[c - 1, :valid:3] = NAN  # the last row is ignored (all coefficients 0): NaN and -inf give exact 0
    x[c - 1, 1] = -INF
    labels = case_labels(c, start)
    y = ref_y(x, math)
    lse, entropy = softmax_stats(y)
    lse[c - 1] = NAN
    lse[1] = NAN  # row 1 uses b and c only: its unused lse must not reach the gradient (a * NaN)
    g = torch.Generator().manual_seed(3)
    coef = torch.randn(c, 4, generator=g)
    coef[c - 1] = 0.0
    coef[1, 0] = coef[1, 3] = 0.0
    coef = coef.to(DEVICE)
    out = torch.full((c, v_local), 7.0, dtype=torch.float32, device=DEVICE)
    returned = softmax_grad_(
        x, labels.to(DEVICE), lse.float(), entropy.float(), coef, math, out, block_v=block
    )
    assert returned is out
    assert_close(out, ref_grad(x, labels, lse, entropy, coef, math))
    assert torch.isfinite(out).all()
    assert (out[c - 1] == 0).all() and (out[:, valid:] == 0).all()


def test_grad_without_labels_or_entropy():
    """labels=None and entropy=None compile the b and d terms out: a, c only (d(lse) and d(sum y))."""
    math = ChunkMath(vocab_start=0, valid=30, scale=2.0, softcap=0.0)
    x = make_logits(4, 33, 30, torch.float32, seed=4)
    lse, _ = softmax_stats(ref_y(x, math))
    coef = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0.5, 0], [-2.0, 0, 1.0, 0], [0, 0, 0, 0]], device=DEVICE)
    out = softmax_grad_(x, None, lse.float(), None, coef, math, torch.empty_like(x), block_v=16)
    expected = autograd_grad([x], torch.full((4,), IGNORE), coef, [math])[0]
    assert_close(out, expected)
    assert_close(out, ref_grad(x, None, lse, None, coef, math))


@pytest.mark.parametrize(
    ("x_dtype", "out_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_strided_rows_and_in_place(x_dtype, out_dtype):
    """A column-sliced view and a row slice of a bigger tensor, written out of place and in place (out is x)."""
    c, valid = 4, 29
    math = ChunkMath(vocab_start=10, valid=valid, scale=1.0, softcap=0.0)
    big = make_logits(c + 3, 48, 48, x_dtype, seed=5)
    labels = torch.tensor([12, 10 + valid - 1, IGNORE, 3], device=DEVICE)
    coef = torch.tensor(
        [[-1.0, 1, 0, 0], [-0.5, 0.5, 0, -0.25], [0, 0, 0, 0], [0.3, 0, 0.1, 0.2]], device=DEVICE
    )
    for view in (big[1 : 1 + c, 5:40], big[2 : 2 + c, :35]):  # column slice (row stride 48), row slice
        assert view.stride(0) == 48 and view.shape == (c, 35)
        ref = ref_partials(view, labels, math)
        parts = softmax_partials(view, labels, math, entropy=True, target=True, sum_logits=True, block_v=8)
        assert_close(parts, ref)
        lse, entropy = softmax_stats(ref_y(view, math))
        expected = ref_grad(view, labels, lse, entropy, coef, math)
        out = softmax_grad_(view, labels, lse.float(), entropy.float(), coef, math,
                            torch.empty(c, 35, dtype=out_dtype, device=DEVICE), block_v=8)  # fmt: skip
        assert out.dtype == out_dtype
        assert_close(out, expected, out_dtype)
        if out_dtype == x_dtype:
            before = big.clone()
            row0, col0 = divmod(view.storage_offset(), 48)
            inside = torch.zeros_like(big, dtype=torch.bool)
            inside[row0 : row0 + c, col0 : col0 + 35] = True
            returned = softmax_grad_(view, labels, lse.float(), entropy.float(), coef, math, view, block_v=8)
            assert returned is view
            torch.testing.assert_close(view, out, rtol=0, atol=0)  # in place equals out of place, bit for bit
            assert torch.equal(big[~inside], before[~inside])  # nothing outside the view was written


def test_softcap_keeps_relative_accuracy_near_zero():
    """softcap * tanh(x / softcap) ~ x for tiny x: relative, not just absolute, fp32 accuracy."""
    math = ChunkMath(vocab_start=0, valid=16, scale=1.0, softcap=30.0)
    x = make_logits(4, 16, 16, torch.float32, seed=6) * 1e-4
    labels = torch.tensor([0, 5, 9, 15], device=DEVICE)
    out = softmax_partials(x, labels, math, entropy=False, target=True, sum_logits=False)
    torch.testing.assert_close(out[:, 3].double(), ref_partials(x, labels, math)[:, 3], rtol=1e-6, atol=0)


def test_block_table_and_argument_errors():
    for table in (FORWARD_BLOCKS, BACKWARD_BLOCKS):
        for n in (1, 37, 1000, 5000, 128256, 262144):
            block, warps = block_config(n, table)
            assert block & (block - 1) == 0 and warps in (1, 2, 4, 8, 16, 32)
            assert block >= min(n, 1024)  # one block covers a small row; big rows use big blocks
    math = ChunkMath(vocab_start=0, valid=8, scale=1.0, softcap=0.0)
    x = make_logits(2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="labels"):
        softmax_partials(x, None, math, entropy=False, target=True, sum_logits=False)
    with pytest.raises(ValueError, match="x must be 2-D"):
        softmax_partials(x.t(), None, math, entropy=False, target=False, sum_logits=False)
    with pytest.raises(ValueError, match="math.valid"):
        softmax_partials(x, None, ChunkMath(0, 9, 1.0, 0.0), entropy=False, target=False, sum_logits=False)
    with pytest.raises(ValueError, match="block_v"):
        softmax_partials(x, None, math, entropy=False, target=False, sum_logits=False, block_v=12)
    with pytest.raises(ValueError, match="coef"):
        softmax_grad_(x, None, torch.zeros(2), None, torch.zeros(2, 3), math, x)


def test_grad_split_across_programs_gives_the_same_bits():
    """A chunk of few rows splits its vocabulary blocks over programs: any split count writes the same
    gradient bit for bit (each block is computed by exactly one program), edges and padding included."""
    math = ChunkMath(vocab_start=3, valid=50, scale=1 / 0.9, softcap=0.0)
    x = make_logits(3, 57, 50, torch.bfloat16, seed=6)  # row stride 57: rows start at three alignments
    labels = torch.tensor([3 + 40, 3 + 2, 3 + 49], device=DEVICE)
    lse, entropy = softmax_stats(ref_y(x, math))
    coef = torch.tensor([[1.0, -1.0, 0.1, 0.5], [-0.5, 0.5, 0, -1.0], [2.0, -2.0, 0, 0]], device=DEVICE)
    outs = [
        softmax_grad_(x, labels, lse.float(), entropy.float(), coef, math, torch.full_like(x, 7.0),
                      block_v=8, splits=splits)  # fmt: skip
        for splits in (1, 3, 7)
    ]
    assert_close(outs[0], ref_grad(x, labels, lse, entropy, coef, math), torch.bfloat16)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def ref_blocks(x, labels, math, keep=None, block=128):
    """float64 per-block (max, sum exp(y - max), sum exp(y - max)(y - max), sum y) of the kept valid columns."""
    y = ref_y(x, math)
    if keep is not None:
        y = y.masked_fill(x[:, : math.valid].float() < keep[:, None], -INF)
    out = []
    for b in range(0, math.valid, block):
        yb = y[:, b : b + block]
        m = yb.amax(1)
        e = torch.exp(yb - torch.where(m == -INF, 0.0, m)[:, None])
        t = torch.where(e > 0, e * (yb - m[:, None]), 0.0).sum(1)
        out.append(torch.stack([m, e.sum(1), t, torch.where(yb > -INF, yb, 0.0).sum(1)], 1))
    return torch.stack(out, 1)


@pytest.mark.parametrize("softcap", [0.0, 6.0])
def test_block_partials_match_float64_and_a_block_is_the_same_bits_at_any_alignment(softcap):
    """The invariant mode's block sums (exact sums of fixed-point terms) against float64, over 3 rows of a
    ragged, padded shard with a kept-set threshold; then each row alone, and the rows copied to an address that
    is no 16-byte boundary (another alignment: on a GPU another compiled layout), give the same bits."""
    from lmloss.kernels.triton_kernels import block_partials

    math = ChunkMath(vocab_start=128, valid=1100, scale=1 / 0.7, softcap=softcap)
    x = make_logits(3, 1111, 1100, torch.bfloat16, seed=9)
    labels = torch.tensor([128 + 7, 128 + 1099, IGNORE], device=DEVICE)
    keep = torch.tensor([-INF, -1.0, 0.5], device=DEVICE)
    got = block_partials(x, labels, math, entropy=True, target=True, sum_logits=True, keep_min=keep)
    ref = ref_blocks(x, labels, math, keep)
    if softcap:
        torch.testing.assert_close(got.m.double().cpu(), ref[..., 0].cpu(), rtol=1e-6, atol=1e-6)
    else:  # a max is exact: fp32's x * scale (as the kernels round it), blocks of 128
        y32 = x[:, :1100].float() * torch.tensor(math.scale, dtype=torch.float32)
        y32 = y32.masked_fill(x[:, :1100].float() < keep[:, None], -INF)
        m32 = torch.nn.functional.pad(y32, (0, 1152 - 1100), value=-INF).view(3, 9, 128).amax(-1)
        assert torch.equal(got.m, m32)
    for k, name in ((1, "s"), (2, "t"), (3, "sum_y")):
        torch.testing.assert_close(getattr(got, name).double().cpu(), ref[..., k].cpu(), rtol=1e-5, atol=1e-5)
    y_label = ref_y(x, math)[torch.arange(3), labels.clamp(128, 1227) - 128]
    assert torch.isclose(got.target[0].double(), y_label[0], rtol=1e-6) and got.target[2] == 0.0

    shifted = torch.empty(3, 1112 * 3 + 1, dtype=x.dtype, device=DEVICE)[:, 1 : 1 + 1111]  # odd start, odd stride
    shifted.copy_(x)
    for rows in ([0], [1], [2], [0, 1, 2]):
        for xs in (x[rows], shifted[rows]):
            alone = block_partials(xs, labels[rows], math, entropy=True, target=True, sum_logits=True,
                                   keep_min=keep[rows])  # fmt: skip
            for name in ("m", "s", "t", "sum_y", "target"):
                assert torch.equal(getattr(alone, name), getattr(got, name)[rows]), (name, rows)


def test_block_partials_make_a_row_with_nan_or_inf_nan():
    from lmloss.kernels.triton_kernels import block_partials

    math = ChunkMath(vocab_start=0, valid=300)
    x = make_logits(3, 300, 300, torch.float32, seed=10)
    x[0, 250] = NAN
    x[1, 3] = INF
    got = block_partials(x, None, math, entropy=True, target=False, sum_logits=True)
    assert torch.isnan(got.s[:2, 0]).all() and torch.isnan(got.t[:2, 0]).all()
    assert torch.isnan(got.sum_y[0, 1]) and got.sum_y[1, 0] == INF
    assert torch.isfinite(got.s[2]).all() and torch.isfinite(got.sum_y[2]).all()


@pytest.mark.parametrize("z_dtype", [torch.float32, torch.bfloat16])
def test_folded_difference_sums_and_gradient_match_float64(z_dtype):
    """The folded full KL (`difference_sums`, `softmax_grad_(difference=...)`): sum_j p_j (x_j - z_j) and the
    gradient's extra ``z_coef * p * (x - z)`` term, over a padded shard with strided rows (no 16-byte alignment),
    blocks of 8 columns; a row whose only nonzero coefficient is z_coef is live, a row with all coefficients 0 gets
    exactly 0 although its z is NaN."""
    from lmloss.kernels.triton_kernels import difference_sums

    math = ChunkMath(vocab_start=7, valid=45, scale=1 / 0.7)
    x = make_logits(4, 53, 45, torch.bfloat16, seed=11)
    z = (x[:, :45].double() + 0.3 * torch.randn(4, 45, generator=torch.Generator().manual_seed(12)).to(DEVICE))
    z = torch.nn.functional.pad(z, (0, 8), value=NAN).to(z_dtype)
    z[3] = NAN
    y = ref_y(x, math)
    lse, entropy = softmax_stats(y)
    p = torch.exp(y - lse[:, None])
    diff = x[:, :45].double() - z[:, :45].double()
    sums = difference_sums(x, z, lse.float(), math, block_v=8)
    torch.testing.assert_close(sums[:3].double().cpu(), (p * diff).sum(1)[:3].cpu(), rtol=1e-5, atol=1e-6)

    labels = torch.tensor([7 + 3, 7 + 44, IGNORE, 7 + 1], device=DEVICE)
    coef = torch.tensor([[0.5, -1.0, 0.0, 0.2], [0.0, 0.0, 0.0, 0.0], [-0.3, 0.0, 0.0, 0.0], [0.0] * 4], device=DEVICE)
    z_coef = torch.tensor([0.7, -1.2, 0.0, 0.0], device=DEVICE)
    out = softmax_grad_(x, labels, lse.float(), entropy.float(), coef, math, torch.full_like(x, 9.0), block_v=8,
                        difference=(z, z_coef))  # fmt: skip
    expected = ref_grad(x, labels, lse, entropy, coef, math)
    extra = torch.where(z_coef[:, None] != 0, z_coef.double()[:, None] * p * torch.nan_to_num(diff), 0.0) * math.scale
    expected[:, :45] += extra
    assert_close(out, expected, torch.bfloat16)
    assert (out[1, :45] != 0).any() and torch.equal(out[3], torch.zeros_like(out[3]))
    assert torch.equal(out[:, 45:], torch.zeros_like(out[:, 45:]))
