"""Triton implementation of the per-chunk softmax math (CUDA; tested on the CPU under ``TRITON_INTERPRET=1``).

Same contract as ``lmloss.kernels.torch_ref``; see ``lmloss.kernels`` for ``ChunkMath``. For a chunk of logits
``x [c, V_local]`` (fp32 / bf16 / fp16, ``x.stride(1) == 1``, any row stride) and a valid column ``j < valid``,
``y_j = scale * (softcap * tanh(x_j / softcap) if softcap else x_j)`` in fp32; padded columns take no part.

- ``softmax_partials``: one program per row walks the valid columns in ``BLOCK_V`` blocks with an online max,
  so a row is read once whatever V is; returns the fp32 ``[c, 5]`` partials (max, sum exp, entropy numerator,
  target logit, sum of logits) that the caller combines across vocabulary shards.
- ``softmax_grad_``: a 2-D grid (row, vocabulary block), each program reading its block once and writing its
  gradient once, which is what makes ``out is x`` (the in-place mode) safe.
- ``cross_entropy_loss_and_grad_``: the single-process scalar-loss path in one kernel. One program per row reads
  the row for its log-sum-exp and loss, then walks it again (from its last block, the likeliest still in L2)
  writing ``d loss / d x``: one read from memory and one write where the two-kernel path reads twice.

This module is the only one in lmloss that imports ``triton``; import it only when the Triton implementation
is selected.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from lmloss.kernels import ChunkMath

__all__ = [
    "softmax_partials",
    "softmax_grad_",
    "cross_entropy_loss_and_grad_",
    "block_config",
    "FORWARD_BLOCKS",
    "BACKWARD_BLOCKS",
    "TritonKernels",
]

# (largest V, BLOCK_V, num_warps), first row whose V fits wins; BLOCK_V is also capped at next_pow2(V).
# Forward: one program walks a whole row, so large blocks amortise the two block reductions per step
# (8192 bf16 = 16 KiB in flight per program, 16 elements per thread at 16 warps).
# Backward: no loop and no reduction, a block per program; 4096 keeps rows x blocks programs many enough
# to fill the GPU for chunks of a few hundred rows.
FORWARD_BLOCKS: tuple[tuple[float, int, int], ...] = (
    (1024, 1024, 4),
    (8192, 4096, 8),
    (float("inf"), 8192, 16),
)
BACKWARD_BLOCKS: tuple[tuple[float, int, int], ...] = ((1024, 1024, 4), (float("inf"), 4096, 8))
_MIN_BLOCK = 16


def block_config(n_cols: int, table: tuple[tuple[float, int, int], ...]) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for a row of ``n_cols`` columns from ``FORWARD_BLOCKS`` or ``BACKWARD_BLOCKS``."""
    for limit, block, warps in table:
        if n_cols <= limit:
            return min(block, max(_MIN_BLOCK, triton.next_power_of_2(max(n_cols, 1)))), warps
    raise AssertionError("the last row of a block table must have limit inf")


@triton.jit
def _softcap_tanh(x, softcap):
    # tanh(x / softcap) from exp, written out because the CPU interpreter that tests these kernels does not
    # emulate libdevice. (1 - e) / (1 + e) with e = exp(-2|z|) loses relative accuracy as z -> 0, so small |z|
    # take the odd Taylor series, whose first omitted term is < 2e-9 relative at |z| = 1/8.
    z = x / softcap
    az = tl.abs(z)
    e = tl.exp(-2.0 * az)
    z2 = z * z
    series = az * (1.0 + z2 * (-0.333333333333 + z2 * (0.133333333333 + z2 * -0.053968253968)))
    th = tl.where(az < 0.125, series, (1.0 - e) / (1.0 + e))
    return tl.where(z < 0.0, -th, th)


# Contract: x rows of x_row_stride elements, columns [0, valid) are vocabulary; labels [c] integer (global ids),
# read only when TARGET. Writes out[row, 0:5] (fp32, contiguous) = (m, s, t, target, sum_y):
#   m = max_j y_j (-inf if valid == 0), s = sum_j exp(y_j - m), t = sum_j exp(y_j - m) * (y_j - m) with
#   exp(..) == 0 terms exactly 0, target = y at label - vocab_start if owned else 0, sum_y = sum_j y_j.
# t is kept relative to the running max; when it moves m -> m', t <- exp(m - m') * (t + (m - m') * s).
@triton.jit
def _scaled_logits(ptrs, mask, scale, softcap, SOFTCAP: tl.constexpr):
    # y = scale * softcap(x) in fp32 where `mask`, -inf elsewhere (so max / exp ignore those columns)
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if SOFTCAP:
        y = softcap * _softcap_tanh(y, softcap)
    return tl.where(mask, y * scale, -float("inf"))


@triton.jit
def _online_step(m, y):
    # One block of the streaming softmax: the new running max, the reference the exps are taken from
    # (0 while everything seen is -inf: exp(-inf - 0) = 0 where exp(-inf - -inf) is NaN), the factor
    # that rescales the sums so far (0 on the first finite block, m = -inf) and the block's exps.
    m_new = tl.maximum(m, tl.max(y, 0))
    ref = tl.where(m_new == -float("inf"), 0.0, m_new)
    return m_new, ref, tl.exp(m - ref), tl.exp(y - ref)


@triton.jit
def _softmax_partials_kernel(
    x_ptr, x_row_stride, labels_ptr, out_ptr, valid, vocab_start, scale, softcap,
    SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, TARGET: tl.constexpr, SUM_LOGITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    m = -float("inf")
    s = 0.0
    t = 0.0
    sum_y = 0.0
    for start in range(0, valid, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_vocab = cols < valid
        y = _scaled_logits(x_row + cols, in_vocab, scale, softcap, SOFTCAP)
        m_new, ref, alpha, e = _online_step(m, y)
        if ENTROPY:
            shift = tl.where(s > 0, m - ref, 0.0)  # s == 0 means m = -inf: -inf * 0 would be NaN
            t = alpha * (t + shift * s) + tl.sum(e * tl.where(e > 0, y - ref, 0.0), 0)
        s = alpha * s + tl.sum(e, 0)
        if SUM_LOGITS:
            sum_y += tl.sum(tl.where(in_vocab, y, 0.0), 0)
        m = m_new
    target = 0.0
    if TARGET:
        local = tl.load(labels_ptr + row) - vocab_start
        owned = (local >= 0) & (local < valid)
        target = tl.where(owned, _scaled_logits(x_row + local, owned, scale, softcap, SOFTCAP), 0.0)
    out_row = out_ptr + row * 5
    tl.store(out_row + 0, m)
    tl.store(out_row + 1, s)
    tl.store(out_row + 2, t)
    tl.store(out_row + 3, target)
    tl.store(out_row + 4, sum_y)


# Contract: program (row, block) reads x[row, block] once and writes out[row, block] once (so out may be x).
# coef[row] = (a, b, c, d); with logp = y - lse[row], P = exp(logp), H = entropy[row]:
#   g = a*P [a != 0] + d*P*(logp + H) [d != 0, P > 0] + b [j owns the label] + c, times dy/dx;
# rows whose coefficients are all 0 and padded columns (valid <= j < n_cols) get exactly 0 and read no x.
@triton.jit
def _softmax_grad_kernel(
    x_ptr, x_row_stride, out_ptr, out_row_stride, labels_ptr, lse_ptr, entropy_ptr, coef_ptr,
    n_cols, valid, vocab_start, scale, softcap,
    SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, LABELS: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    a = tl.load(coef_ptr + row * 4 + 0)
    b = tl.load(coef_ptr + row * 4 + 1)
    c = tl.load(coef_ptr + row * 4 + 2)
    d = tl.load(coef_ptr + row * 4 + 3)
    live = (a != 0.0) | (b != 0.0) | (c != 0.0) | (d != 0.0)
    in_vocab = cols < tl.where(live, valid, 0)  # a dead row reads nothing and writes zeros
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=in_vocab, other=0.0).to(tl.float32)
    if SOFTCAP:
        th = _softcap_tanh(x, softcap)
        y = softcap * th * scale
        dy_dx = scale * (1.0 - th * th)
    else:
        y = x * scale
        dy_dx = scale
    logp = y - tl.load(lse_ptr + row)
    p = tl.exp(logp)
    g = tl.where(a != 0.0, a * p, 0.0) + c  # where, not a * p: P may be NaN in a row that only uses b, c
    if ENTROPY:
        h = tl.load(entropy_ptr + row)
        entropy_term = d * p * (tl.where(p > 0.0, logp, 0.0) + h)  # no -inf * 0 even in the unused lanes
        g += tl.where(d != 0.0, tl.where(p > 0.0, entropy_term, 0.0), 0.0)
    if LABELS:
        g += tl.where(cols == tl.load(labels_ptr + row) - vocab_start, b, 0.0)
    g = tl.where(in_vocab, g * dy_dx, 0.0)
    tl.store(out_ptr + row * out_row_stride + cols, g.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


# Contract: one program per row of x [c, n_cols] (columns [0, valid) are the whole vocabulary, vocab_start 0).
# A row whose label is ignore_index reads nothing: res[row] = (0, 0) and out[row, :] = 0 exactly. Otherwise
#   pass 1 (reads x): m, s online as in _softmax_partials_kernel, y_t = y[label] (0 if label not in [0, valid)),
#     sum_y when SMOOTHING; lse = m + log s;
#     loss = (1-eps)(lse - y_t) + eps(lse - sum_y / vocab_size) + z lse^2, written as (m - y_t) + log s etc.
#   pass 2 (reads x, then writes out, block by block from the last):
#     g_j = ((1 + 2 z lse) p_j - (1-eps)[j == label] - eps / vocab_size) * dy/dx for j < valid, 0 beyond.
# Every read of pass 1 precedes every write, and pass 2 reads each block before writing it: out may be x.
@triton.jit
def _cross_entropy_loss_grad_kernel(
    x_ptr, x_row_stride, out_ptr, out_row_stride, labels_ptr, res_ptr,
    n_cols, n_blocks, valid, ignore_index, scale, softcap, eps, z_loss, inv_vocab,
    SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    label = tl.load(labels_ptr + row)
    live = label != ignore_index
    n_read = tl.where(live, valid, 0)  # an ignored row is neither read nor given a gradient

    m = -float("inf")
    s = 0.0
    sum_y = 0.0
    for start in range(0, n_read, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_vocab = cols < n_read
        y = _scaled_logits(x_row + cols, in_vocab, scale, softcap, SOFTCAP)
        m_new, _, alpha, e = _online_step(m, y)
        s = alpha * s + tl.sum(e, 0)
        if SMOOTHING:
            sum_y += tl.sum(tl.where(in_vocab, y, 0.0), 0)
        m = m_new
    owned = live & (label >= 0) & (label < valid)
    y_t = tl.where(owned, _scaled_logits(x_row + label, owned, scale, softcap, SOFTCAP), 0.0)
    # An ignored row read nothing (m = -inf, s = 0): give it lse 0 so that no inf reaches the arithmetic below.
    m = tl.where(live, m, 0.0)
    log_s = tl.log(tl.where(live, s, 1.0))
    lse = m + log_s
    loss = (m - y_t) + log_s  # -log p_label, with the large m cancelled first
    if SMOOTHING:
        loss = (1.0 - eps) * loss + eps * ((m - sum_y * inv_vocab) + log_s)
    if Z_LOSS:
        loss += z_loss * lse * lse
        p_coef = 1.0 + 2.0 * z_loss * lse
    else:
        p_coef = 1.0
    tl.store(res_ptr + row * 2 + 0, tl.where(live, lse, 0.0))
    tl.store(res_ptr + row * 2 + 1, tl.where(live, loss, 0.0))

    label_coef = 1.0 - eps if SMOOTHING else 1.0
    for i in range(0, n_blocks):
        cols = (n_blocks - 1 - i) * BLOCK_V + tl.arange(0, BLOCK_V)
        in_vocab = cols < n_read
        x = tl.load(x_row + cols, mask=in_vocab, other=0.0).to(tl.float32)
        if SOFTCAP:
            th = _softcap_tanh(x, softcap)
            y = softcap * th * scale
            dy_dx = scale * (1.0 - th * th)
        else:
            y = x * scale
            dy_dx = scale
        g = p_coef * tl.exp(y - lse) - tl.where(cols == label, label_coef, 0.0)
        if SMOOTHING:
            g -= eps * inv_vocab
        g = tl.where(in_vocab, g * dy_dx, 0.0)
        tl.store(out_row + cols, g.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


def _block(n_cols: int, table: tuple[tuple[float, int, int], ...], block_v: int | None) -> tuple[int, int]:
    block, warps = block_config(n_cols, table)
    if block_v is not None:
        if block_v < 1 or block_v & (block_v - 1):
            raise ValueError(f"block_v must be a power of 2, got {block_v}")
        block = block_v
    return block, warps


def _device_guard(t: torch.Tensor):
    # Triton launches on the current CUDA device; make it the tensors' one.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check_rows(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D with unit column stride, got shape {tuple(t.shape)}, "
                         f"strides {t.stride()}")  # fmt: skip
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {dtypes}, got {t.dtype}")


def _row_vector(name: str, t: torch.Tensor, rows: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if t.shape != (rows,) or t.dtype not in dtypes:
        raise ValueError(f"{name} must be [{rows}] of dtype in {dtypes}, got {tuple(t.shape)} {t.dtype}")
    t = t.contiguous()
    # A 64-bit vector that starts at an address not 16-byte aligned (a slice at an odd offset) has been
    # read wrongly by some Triton versions; a fresh copy of c elements is cheap insurance.
    return t.clone() if t.element_size() == 8 and t.data_ptr() % 16 else t


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int64, torch.int32)


def softmax_partials(
    x: torch.Tensor,
    labels: torch.Tensor | None,
    math: ChunkMath,
    *,
    entropy: bool,
    target: bool,
    sum_logits: bool,
    block_v: int | None = None,
) -> torch.Tensor:
    """Per-row softmax partials of a chunk over this shard's valid columns.

    Args:
        x: ``[c, V_local]`` fp32 / bf16 / fp16 logits, ``x.stride(1) == 1``.
        labels: ``[c]`` integer global vocabulary ids (ignore values such as -100 own no column); needed only
            when ``target``.
        math: vocabulary range of the shard, scale (1 / temperature) and softcap.
        entropy, target, sum_logits: compute columns 2, 3, 4 (else they are 0).
        block_v: vocabulary block override (a power of 2); default from ``FORWARD_BLOCKS``.

    Returns:
        fp32 ``[c, 5]``: (max y, sum exp(y - max), sum exp(y - max) * (y - max), y at the label if this shard
        owns it else 0, sum y), sums over the ``math.valid`` leading columns.
    """
    _check_rows("x", x, _FLOATS)
    rows, n_cols = x.shape
    if not 0 <= math.valid <= n_cols:
        raise ValueError(f"math.valid must be in [0, {n_cols}], got {math.valid}")
    if target:
        if labels is None:
            raise ValueError("labels is required when target=True")
        labels = _row_vector("labels", labels, rows, _INTS)
    out = torch.empty(rows, 5, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    block, warps = _block(math.valid, FORWARD_BLOCKS, block_v)
    with _device_guard(x):
        _softmax_partials_kernel[(rows,)](
            x, x.stride(0), labels if target else x, out, math.valid, math.vocab_start,
            float(math.scale), float(math.softcap or 1.0),
            SOFTCAP=bool(math.softcap), ENTROPY=entropy, TARGET=target, SUM_LOGITS=sum_logits,
            BLOCK_V=block, num_warps=warps,
        )  # fmt: skip
    return out


def softmax_grad_(
    x: torch.Tensor,
    labels: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    coef: torch.Tensor,
    math: ChunkMath,
    out: torch.Tensor,
    *,
    block_v: int | None = None,
) -> torch.Tensor:
    """Write ``d loss / d x`` of a chunk into ``out`` and return it.

    With ``logp = y - lse``, ``P = exp(logp)``, ``H = entropy`` and ``(a, b, c, d) = coef[row]``, a valid column
    gets ``(a*P + d*P*(logp + H) + b*[j is the label] + c) * dy/dx`` (terms with a zero coefficient are exactly
    0); padded columns and rows whose four coefficients are all 0 get exactly 0, whatever x holds.

    Args:
        x: ``[c, V_local]`` fp32 / bf16 / fp16 logits, ``x.stride(1) == 1``.
        labels: ``[c]`` integer global ids, or None when every b is 0.
        lse: ``[c]`` fp32 global log-sum-exp of y.
        entropy: ``[c]`` fp32 global entropy, or None when every d is 0 (the d term is then skipped).
        coef: ``[c, 4]`` fp32 coefficients (a, b, c, d).
        math: as in ``softmax_partials``.
        out: ``[c, V_local]`` float, ``out.stride(1) == 1``; may be ``x`` itself (each block is read, then
            overwritten, by one program).
        block_v: vocabulary block override (a power of 2); default from ``BACKWARD_BLOCKS``.
    """
    _check_rows("x", x, _FLOATS)
    _check_rows("out", out, _FLOATS)
    rows, n_cols = x.shape
    if out.shape != x.shape:
        raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if not 0 <= math.valid <= n_cols:
        raise ValueError(f"math.valid must be in [0, {n_cols}], got {math.valid}")
    if coef.shape != (rows, 4) or coef.dtype != torch.float32:
        raise ValueError(f"coef must be fp32 [{rows}, 4], got {tuple(coef.shape)} {coef.dtype}")
    coef = coef.contiguous()
    lse = _row_vector("lse", lse, rows, (torch.float32,))
    if entropy is not None:
        entropy = _row_vector("entropy", entropy, rows, (torch.float32,))
    if labels is not None:
        labels = _row_vector("labels", labels, rows, _INTS)
    block, warps = _block(n_cols, BACKWARD_BLOCKS, block_v)
    if rows == 0 or n_cols == 0:
        return out
    with _device_guard(x):
        _softmax_grad_kernel[(rows, triton.cdiv(n_cols, block))](
            x, x.stride(0), out, out.stride(0), x if labels is None else labels, lse,
            lse if entropy is None else entropy, coef, n_cols, math.valid, math.vocab_start,
            float(math.scale), float(math.softcap or 1.0),
            SOFTCAP=bool(math.softcap), ENTROPY=entropy is not None, LABELS=labels is not None,
            BLOCK_V=block, num_warps=warps,
        )  # fmt: skip
    return out


def cross_entropy_loss_and_grad_(
    x: torch.Tensor,
    labels: torch.Tensor,
    math: ChunkMath,
    *,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    vocab_size: int,
    out: torch.Tensor,
    block_v: int | None = None,
) -> torch.Tensor:
    """Per-row cross-entropy of a chunk and, in the same kernel, the gradient of their sum written into `out`.

    One process holds the whole vocabulary (``math.vocab_start == 0``, ``math.valid == vocab_size``); with
    ``y = scale * softcap(x)`` over the valid columns and ``lse = logsumexp(y)``, a row's loss is
    ``(1 - eps) * (lse - y[label]) + eps * (lse - mean(y)) + z_loss * lse**2`` (``F.cross_entropy`` with
    ``label_smoothing=eps``, plus the z-loss) and its gradient ``((1 + 2 z_loss lse) softmax(y) - (1 - eps)
    onehot(label) - eps / vocab_size) * dy/dx``. Rows whose label is `ignore_index` are not read: their loss and
    lse are 0 and their gradient is exactly 0, whatever x holds; padded columns get exactly 0.

    Args:
        x: ``[c, V_local]`` fp32 / bf16 / fp16 logits, ``x.stride(1) == 1``, ``V_local >= vocab_size``.
        labels: ``[c]`` integer class ids in ``[0, vocab_size)`` or `ignore_index` (not checked here).
        math: ``vocab_start`` 0, ``valid == vocab_size``, scale (1 / temperature) and softcap.
        ignore_index, label_smoothing, z_loss: as in ``lmloss.cross_entropy``.
        vocab_size: the number of classes (the smoothing's uniform target spreads over these).
        out: ``[c, V_local]`` float, ``out.stride(1) == 1``; may be ``x`` itself (the in-place mode: a row's
            program reads all of it before writing any, then reads each block before overwriting it).
        block_v: vocabulary block override (a power of 2); default from ``FORWARD_BLOCKS``.

    Returns:
        fp32 ``[c, 2]``: (lse, loss) per row, both 0 for ignored rows.
    """
    _check_rows("x", x, _FLOATS)
    _check_rows("out", out, _FLOATS)
    rows, n_cols = x.shape
    if out.shape != x.shape:
        raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if not 1 <= vocab_size <= n_cols:
        raise ValueError(f"vocab_size must be in [1, {n_cols}], got {vocab_size}")
    if math.vocab_start != 0 or math.valid != vocab_size:
        raise ValueError(
            "math must cover the whole vocabulary (vocab_start 0, valid == vocab_size) in the one-kernel loss, "
            f"got vocab_start {math.vocab_start}, valid {math.valid}, vocab_size {vocab_size}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not z_loss >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    labels = _row_vector("labels", labels, rows, _INTS)
    res = torch.empty(rows, 2, dtype=torch.float32, device=x.device)
    if rows == 0:
        return res
    block, warps = _block(n_cols, FORWARD_BLOCKS, block_v)
    with _device_guard(x):
        _cross_entropy_loss_grad_kernel[(rows,)](
            x, x.stride(0), out, out.stride(0), labels, res, n_cols, triton.cdiv(n_cols, block), vocab_size,
            int(ignore_index), float(math.scale), float(math.softcap or 1.0), float(label_smoothing),
            float(z_loss), 1.0 / vocab_size,
            SOFTCAP=bool(math.softcap), SMOOTHING=label_smoothing > 0, Z_LOSS=z_loss > 0,
            BLOCK_V=block, num_warps=warps,
        )  # fmt: skip
    return res


class TritonKernels:
    """The two kernels behind the interface the chunk loop calls (`lmloss.plan`); holds no scratch.

    `overwrite` and `uniform_term` are hints the PyTorch reference uses to save passes; the kernels
    need neither (they keep no chunk-sized temporaries and test each row's coefficients themselves).
    """

    name = "triton"

    def softmax_partials(self, x, labels, math, *, entropy, target, sum_logits, overwrite=False):
        return softmax_partials(x, labels, math, entropy=entropy, target=target, sum_logits=sum_logits)

    def softmax_grad_(self, x, labels, lse, entropy, coef, math, out, *, uniform_term=True):
        return softmax_grad_(x, labels, lse, entropy, coef, math, out)

    def partials_then_grad_(self, x, labels, math, flags, finish, out, *, uniform_term=True):
        """Partials, then ``finish(partials) -> (result, coef, lse[, entropy])`` (TP combine, output math),
        then the gradient into `out` (which may be `x`). Returns ``(result, out)``."""
        result, coef, lse, *rest = finish(softmax_partials(x, labels, math, **flags))
        return result, softmax_grad_(x, labels, lse, rest[0] if rest else None, coef, math, out)

    def loss_and_grad_(
        self, x, labels, math, *, ignore_index, label_smoothing, z_loss, vocab_size, out
    ) -> dict[str, torch.Tensor]:
        """The single-process scalar-loss chunk in one kernel (`cross_entropy_loss_and_grad_`): returns
        ``{"lse": [c], "loss": [c]}`` fp32 (0 for ignored rows) and writes d(sum of losses)/dx into `out`."""
        res = cross_entropy_loss_and_grad_(
            x, labels, math, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
            vocab_size=vocab_size, out=out,
        )  # fmt: skip
        return {"lse": res[:, 0], "loss": res[:, 1]}
