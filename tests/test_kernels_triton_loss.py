"""The one-kernel cross-entropy loss + in-place gradient (`cross_entropy_loss_and_grad_`) against float64
references written out here: ``F.cross_entropy(..., label_smoothing=eps) + z * logsumexp**2`` and its autograd
gradient.

Runs on the CPU under ``TRITON_INTERPRET=1`` (set in conftest.py before triton is imported); with
``TRITON_INTERPRET=0`` and a GPU the same tests run on CUDA. Shapes stay tiny; ``block_v`` overrides force
several vocabulary blocks per row.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_support import kernel_test_device

triton = pytest.importorskip("triton", reason="the Triton kernels need triton installed")

from lmloss.kernels import ChunkMath  # noqa: E402
from lmloss.kernels.triton_kernels import (  # noqa: E402
    TritonKernels,
    cross_entropy_loss_and_grad_,
    scale_by_device_scalar_,
    scaled_cast_by_device_scalar,
)

DEVICE = kernel_test_device()

NAN, INF = float("nan"), float("inf")
IGNORE = -100

# (c, V_local, valid, scale, softcap, label_smoothing, z_loss, block_v): ragged widths no block divides,
# padded columns, several blocks per row, the default block, temperature and softcap.
CASES = {
    "plain-3-blocks": (5, 37, 37, 1.0, 0.0, 0.0, 0.0, 16),
    "smoothing-zloss-padded": (6, 70, 61, 1.0, 0.0, 0.1, 0.01, 16),
    "temperature-softcap-all": (5, 45, 40, 1 / 0.7, 5.0, 0.2, 0.05, 8),
    "default-block-padded": (4, 37, 33, 1.0, 0.0, 0.0, 0.02, None),
}


def make_inputs(c: int, v_local: int, valid: int, dtype: torch.dtype, seed: int = 0):
    """Logits whose padded columns hold NaN and huge values, the labels (first column, last valid column,
    middle ones), and the last two rows ignored, one all NaN, one -inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, v_local, generator=g, dtype=torch.float64) * 3
    x[:, valid::2] = NAN
    x[:, valid + 1 :: 2] = 1e30
    labels = torch.randint(0, valid, (c,), generator=g)
    labels[0], labels[1] = 0, valid - 1
    labels[-2:] = IGNORE
    x[-1] = NAN
    x[-2, ::2] = -INF
    x[-2, 1::2] = NAN
    return x.to(dtype).to(DEVICE), labels.to(DEVICE)


def reference(x, labels, valid, scale, softcap, eps, z):
    """float64 (lse, loss, d sum(loss) / dx) with the loss ``F.cross_entropy(y, label_smoothing=eps) + z lse^2``
    of the valid rows (0 for ignored ones) over the valid columns; lse of ignored rows is 0."""
    live = labels != IGNORE
    xv = torch.where(live[:, None], x[:, :valid].double(), 0.0).requires_grad_()  # ignored rows take no part
    y = (softcap * torch.tanh(xv / softcap) if softcap else xv) * scale
    lse = torch.logsumexp(y, -1)
    ce = F.cross_entropy(y, labels, ignore_index=IGNORE, label_smoothing=eps, reduction="none")
    loss = ce + torch.where(live, z * lse.square(), 0.0)
    loss.sum().backward()
    grad = F.pad(xv.grad, (0, x.shape[1] - valid))
    return torch.where(live, lse, 0.0).detach(), loss.detach(), grad


def assert_close(actual, expected, dtype=torch.float32):
    rtol, atol = {torch.float32: (1e-5, 2e-6), torch.bfloat16: (1.6e-2, 1e-5)}[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_loss_and_grad_match_float64(case, dtype):
    c, v_local, valid, scale, softcap, eps, z, block = CASES[case]
    math = ChunkMath(vocab_start=0, valid=valid, scale=scale, softcap=softcap)
    x, labels = make_inputs(c, v_local, valid, dtype)
    if eps == 0:
        x[2, [3, valid - 2]] = -INF  # a sampler's mask in a live row: p = 0, no NaN
    before = x.clone()
    out = torch.full((c, v_local), 7.0, dtype=torch.float32, device=DEVICE)
    res = cross_entropy_loss_and_grad_(
        x,
        labels,
        math,
        ignore_index=IGNORE,
        label_smoothing=eps,
        z_loss=z,
        vocab_size=valid,
        out=out,
        block_v=block,
    )
    assert res.dtype == torch.float32 and res.shape == (c, 2)
    lse, loss, grad = reference(x, labels, valid, scale, softcap, eps, z)
    assert_close(res[:, 0], lse)  # x's dtype is read exactly and the math is fp32 either way
    assert_close(res[:, 1], loss)
    assert_close(out, grad)
    assert torch.isfinite(out).all() and torch.isfinite(res).all()
    assert (out[-2:] == 0).all() and (res[-2:] == 0).all()  # ignored rows of NaN / -inf: exact zeros
    assert (out[:, valid:] == 0).all()  # padded columns of NaN / 1e30: exact zeros
    assert (out[:-2, :valid] != 0).any(1).all()  # not vacuous: every live row has a gradient
    torch.testing.assert_close(x, before, rtol=0, atol=0, equal_nan=True)  # out of place: x untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_equals_out_of_place_bit_for_bit(dtype):
    """``out is x`` on a row slice of a bigger tensor (row stride 80, rows at every 16-byte alignment): the same
    bits as a separate `out` of x's dtype laid out alike (the lanes' summation order follows each row's
    alignment), and nothing outside the view is written."""
    c, valid, v_local = 5, 61, 67
    math = ChunkMath(vocab_start=0, valid=valid, scale=1 / 1.3, softcap=8.0)
    x_dense, labels = make_inputs(c, v_local, valid, dtype, seed=1)
    big = torch.full((c + 2, 80), 5.0, dtype=dtype, device=DEVICE)
    view = big[1 : 1 + c, 3 : 3 + v_local]
    view.copy_(x_dense)
    x = big.clone()[1 : 1 + c, 3 : 3 + v_local]
    kwargs = dict(ignore_index=IGNORE, label_smoothing=0.1, z_loss=0.01, vocab_size=valid, block_v=16)
    separate = torch.empty_like(big)[1 : 1 + c, 3 : 3 + v_local]
    res_out = cross_entropy_loss_and_grad_(x, labels, math, out=separate, **kwargs)
    before = big.clone()
    res_in = cross_entropy_loss_and_grad_(view, labels, math, out=view, **kwargs)
    torch.testing.assert_close(view, separate, rtol=0, atol=0)
    torch.testing.assert_close(res_in, res_out, rtol=0, atol=0)
    inside = torch.zeros_like(big, dtype=torch.bool)
    inside[1 : 1 + c, 3 : 3 + v_local] = True
    assert torch.equal(big[~inside], before[~inside])
    _, loss, grad = reference(x, labels, valid, math.scale, math.softcap, 0.1, 0.01)
    assert_close(view, grad, dtype)  # the gradient itself, rounded once to x's dtype
    assert_close(res_in[:, 1], loss)


def test_triton_kernels_method_and_bf16_x_with_fp32_out():
    c, v_local, valid = 4, 40, 40
    math = ChunkMath(vocab_start=0, valid=valid, scale=1.0, softcap=0.0)
    x, labels = make_inputs(c, v_local, valid, torch.bfloat16, seed=2)
    labels = labels.to(torch.int32)  # int32 labels are read as well
    out = torch.empty(c, v_local, dtype=torch.float32, device=DEVICE)
    got = TritonKernels().loss_and_grad_(
        x, labels, math, ignore_index=IGNORE, label_smoothing=0.05, z_loss=0.0, vocab_size=valid, out=out
    )
    assert set(got) == {"lse", "loss"} and all(
        v.shape == (c,) and v.dtype == torch.float32 for v in got.values()
    )
    lse, loss, grad = reference(x, labels.long(), valid, 1.0, 0.0, 0.05, 0.0)
    assert_close(got["lse"], lse)
    assert_close(got["loss"], loss)
    assert_close(out, grad)


def test_all_rows_ignored_and_argument_errors():
    math = ChunkMath(vocab_start=0, valid=8, scale=1.0, softcap=0.0)
    x = torch.full((3, 10), NAN, device=DEVICE)
    labels = torch.full((3,), IGNORE, device=DEVICE)
    kwargs = dict(ignore_index=IGNORE, label_smoothing=0.0, z_loss=0.0, vocab_size=8)
    res = cross_entropy_loss_and_grad_(x, labels, math, out=x, **kwargs)
    assert (res == 0).all() and (x == 0).all()
    empty = torch.empty(0, 10, device=DEVICE)
    assert cross_entropy_loss_and_grad_(empty, labels[:0], math, out=empty, **kwargs).shape == (0, 2)
    y = torch.zeros(3, 10, device=DEVICE)
    with pytest.raises(ValueError, match="whole vocabulary"):
        cross_entropy_loss_and_grad_(y, labels, ChunkMath(2, 8, 1.0, 0.0), out=y, **kwargs)
    with pytest.raises(ValueError, match="whole vocabulary"):
        cross_entropy_loss_and_grad_(y, labels, ChunkMath(0, 7, 1.0, 0.0), out=y, **kwargs)
    with pytest.raises(ValueError, match="vocab_size"):
        cross_entropy_loss_and_grad_(y, labels, math, out=y, **dict(kwargs, vocab_size=11))
    with pytest.raises(ValueError, match="out must have"):
        cross_entropy_loss_and_grad_(y, labels, math, out=y[:2], **kwargs)
    with pytest.raises(ValueError, match="labels"):
        cross_entropy_loss_and_grad_(y, labels.float(), math, out=y, **kwargs)
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy_loss_and_grad_(y, labels, math, out=y, **dict(kwargs, label_smoothing=1.5))
    with pytest.raises(ValueError, match="block_v"):
        cross_entropy_loss_and_grad_(y, labels, math, out=y, block_v=12, **kwargs)
    with pytest.raises(TypeError, match="out must have dtype"):
        cross_entropy_loss_and_grad_(y, labels, math, out=y.long(), **kwargs)


def test_persistent_grid_of_any_size_and_grad_scale():
    """Programs walking rows p, p + programs, ...: 1, 2 or 7 programs for 5 rows give the same bits; a
    grad_scale (the mean's 1 / count, read on the device) multiplies the gradient and not the loss."""
    c, valid = 5, 45
    math = ChunkMath(vocab_start=0, valid=valid, scale=1.0, softcap=0.0)
    x, labels = make_inputs(c, valid, valid, torch.float32, seed=2)
    kwargs = dict(ignore_index=IGNORE, label_smoothing=0.1, z_loss=0.0, vocab_size=valid, block_v=16)
    runs = []
    for programs in (1, 2, 7):
        out = torch.empty_like(x)
        runs.append((cross_entropy_loss_and_grad_(x, labels, math, out=out, programs=programs, **kwargs), out))
    for res, out in runs[1:]:
        assert torch.equal(res, runs[0][0]) and torch.equal(out, runs[0][1])
    _, loss, grad = reference(x, labels, valid, 1.0, 0.0, 0.1, 0.0)
    quarter = torch.tensor(0.25, device=DEVICE)
    out = torch.empty_like(x)
    res = cross_entropy_loss_and_grad_(x, labels, math, out=out, grad_scale=quarter, **kwargs)
    assert_close(res[:, 1], loss)
    assert_close(out, 0.25 * grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_by_device_scalar(dtype):
    """``t *= factor`` with the factor read on the device: 0.5 scales every element exactly; 1.0 leaves the
    bits as they were (NaN and inf included)."""
    t = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)).to(dtype).to(DEVICE)
    t[0, 0], t[1, 1] = NAN, INF
    expected, kept = t * 0.5, t.clone()
    assert scale_by_device_scalar_(t, torch.tensor(0.5, device=DEVICE)) is t
    torch.testing.assert_close(t, expected, rtol=0, atol=0, equal_nan=True)
    unit = kept.clone()
    scale_by_device_scalar_(unit, torch.tensor(1.0, device=DEVICE))
    torch.testing.assert_close(unit, kept, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="contiguous"):
        scale_by_device_scalar_(t.t(), torch.tensor(0.5, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_cast_rounds_the_fp32_product_once(dtype):
    """``(src * factor).to(dtype)`` with the factor read on the device: on a GPU every element is the fp32
    product rounded once to nearest-even, bit for bit PyTorch's fp32 multiply then cast; NaN and inf carried;
    a length no block divides. Triton's interpreter truncates fp32 -> bf16 / fp16 casts whatever the rounding
    mode asked for, so there the elements are within one ulp of the dtype."""
    src = torch.randn(3, 1001, generator=torch.Generator().manual_seed(1)) * 100
    src[0, 0], src[1, 1], src[2, 2] = NAN, INF, -INF
    factor = torch.tensor(0.3)
    out = scaled_cast_by_device_scalar(src.to(DEVICE), factor.to(DEVICE), dtype)
    assert out.dtype == dtype and out.shape == src.shape
    ulp = 0.0 if DEVICE == "cuda" else torch.finfo(dtype).eps
    torch.testing.assert_close(out.cpu(), (src * factor).to(dtype), rtol=ulp, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="contiguous"):
        scaled_cast_by_device_scalar(src.t().to(DEVICE), factor.to(DEVICE), dtype)
