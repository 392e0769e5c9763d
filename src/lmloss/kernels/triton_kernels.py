"""Triton implementation of the per-chunk softmax math (CUDA; tested on the CPU under ``TRITON_INTERPRET=1``).

Same contract as ``lmloss.kernels.torch_ref``; see ``lmloss.kernels`` for ``ChunkMath``. For a chunk of logits
``x [c, V_local]`` (fp32 / bf16 / fp16, ``x.stride(1) == 1``, any row stride) and a valid column ``j < valid``,
``y_j = scale * (softcap * tanh(x_j / softcap) if softcap else x_j)`` in fp32; padded columns take no part.

- ``softmax_partials``: one program per row walks the valid columns in ``BLOCK_V`` blocks, each lane keeping
  its own running max and sum (one exp per element; the lanes are reduced once per row), so a row is read
  once whatever V is; returns the fp32 ``[c, 5]`` partials (max, sum exp, entropy numerator, target logit,
  sum of logits) that the caller combines across vocabulary shards.
- ``softmax_grad_``: program (row, split) walks every splits-th block of the row (splits > 1 only when the
  chunk has too few rows to fill the GPU), reading each block once and writing its gradient once, which is
  what makes ``out is x`` (the in-place mode) safe.
- ``cross_entropy_loss_and_grad_``: the single-process scalar-loss path in one kernel, on a persistent grid of
  a few programs per SM (`CROSS_ENTROPY_PROGRAMS_PER_SM`, measured). A program reads a row for its
  log-sum-exp and loss (asking L2 to keep it: evict_last),
  then walks it back from where it ended (evict_first) writing ``d loss / d x``: one read from memory and
  one write where the two-kernel path reads twice. The gradient comes out times ``grad_scale`` (a device
  scalar: the mean's ``1 / count``).

Every row walk has the same shape: an unmasked main loop from the row's first 16-byte aligned column in whole
blocks (16-byte loads and stores whatever the width and row stride), and one masked edge block for the
columns before and after it. The lanes' summation order follows that alignment, so a row at another
address may round differently in the last bit (a given layout is deterministic). ``python -m
lmloss.kernels.report`` compiles the kernels for sm_90 and reports registers, spills, load widths and SASS
instructions per element of these loops (docs/kernels.md).

This module is the only one in lmloss that imports ``triton``; import it only when the Triton implementation
is selected.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from lmloss.kernels import INVARIANT_BLOCK, BlockPartials, ChunkMath

__all__ = [
    "softmax_partials",
    "block_partials",
    "softmax_grad_",
    "difference_sums",
    "cross_entropy_loss_and_grad_",
    "block_config",
    "cross_entropy_config",
    "FORWARD_BLOCKS",
    "BACKWARD_BLOCKS",
    "TritonKernels",
    "scale_by_device_scalar_",
    "scaled_cast_by_device_scalar",
    "transform",
    "math_args",
    "alignment",
    # shared with the other Triton modules (triton_distill, triton_sampling)
    "fast_exp2",
    "row_split",
    "edge_cols",
    "block_for",
    "device_guard",
    "check_rows",
    "row_vector",
]

# (largest V, BLOCK_V, num_warps), first row whose V fits wins; BLOCK_V is also capped at next_pow2(V).
# Forward (and the one-kernel loss): one program walks a whole row, 16 elements per thread per step (8192 bf16
# = 16 KiB in flight per program at 16 warps); the per-lane max / sum cost registers, not reductions.
# Backward: no reduction; 4096 at 8 warps (16 elements per thread) keeps the loop short per program when a
# small chunk's rows are split across programs.
FORWARD_BLOCKS: tuple[tuple[float, int, int], ...] = (
    (1024, 1024, 4),
    (8192, 4096, 8),
    (float("inf"), 8192, 16),
)
BACKWARD_BLOCKS: tuple[tuple[float, int, int], ...] = ((1024, 1024, 4), (float("inf"), 4096, 8))
#: The one-kernel loss (`cross_entropy_loss_and_grad_`): its blocks, and how many programs of its persistent
#: grid share an SM (the rows in flight: that many per SM). Chosen on an H200 among 11 configurations timed
#: side by side (tools/gpu_tune.py, docs/gpu.md): in place over [32768, 128256] bf16 in chunks of 1024 rows,
#: 4096 columns at 8 warps with 3 rows per SM took 7.97 ms (3.16 TB/s counting two reads and a write), the
#: former 8192 at 16 warps with one row per SM 8.66 ms; one 8192-row chunk 1.87 ms against 2.16.
#: With softcap the kernel needs more registers (the accurate tanh): at 4096 / 8 warps it spilled (static
#: report, sm_90), so it keeps the forward's blocks and one row per SM.
CROSS_ENTROPY_BLOCKS: tuple[tuple[float, int, int], ...] = ((1024, 1024, 4), (8192, 4096, 8), (float("inf"), 4096, 8))
CROSS_ENTROPY_PROGRAMS_PER_SM = 3


def cross_entropy_config(n_cols: int, softcap: bool) -> tuple[int, int, int]:
    """``(BLOCK_V, num_warps, programs per SM)`` of the one-kernel loss for rows of `n_cols` columns."""
    if softcap:
        return (*block_config(n_cols, FORWARD_BLOCKS), 1)
    return (*block_config(n_cols, CROSS_ENTROPY_BLOCKS), CROSS_ENTROPY_PROGRAMS_PER_SM)
_MIN_BLOCK = 16
#: The forward's largest BLOCK_V with the by-products (`softmax_partials`' sum_sq / argmax): at FORWARD_BLOCKS'
#: 8192 x 16 warps, temperature + softcap + entropy + smoothing + both by-products took 128 registers and 41
#: spills (static sm_90 compile, 128256 bf16 columns); at 4096 x 16 warps 87 registers, no spill, 42.5 instructions
#: per element; the by-products alone at default options 64 registers, 17.0 per element (the plain kernel 10.5).
BYPRODUCT_BLOCK_V = 4096


def block_config(n_cols: int, table: tuple[tuple[float, int, int], ...]) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for a row of ``n_cols`` columns from ``FORWARD_BLOCKS`` or ``BACKWARD_BLOCKS``."""
    for limit, block, warps in table:
        if n_cols <= limit:
            return min(block, max(_MIN_BLOCK, triton.next_power_of_2(max(n_cols, 1)))), warps
    raise AssertionError("the last row of a block table must have limit inf")


_LOG2E = 1.4426950408889634
_FLT_MAX = 3.4028234663852886e38


# Hardware form on the GPU (FAST, a constexpr the wrappers set for CUDA tensors): ex2 is one MUFU instruction,
# flushing denormal results to zero (the non-ftz ex2 costs four more instructions to rescale them); its
# relative error (about 2^-22) is far below fp32's rounding of the sums it feeds. The interpreter, which
# tests these kernels on the CPU, cannot run PTX: there it is tl.exp2.
@triton.jit
def fast_exp2(x, FAST: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.exp2(x)


@triton.jit
def _tanh(z, FAST: tl.constexpr):
    # Not the hardware tanh.approx: its relative error of about 2^-11 is 0.01 on a softcapped logit of 20
    # (cap 30), a log-prob error the sampler (exact tanh) does not make; on an H200 it put fp32 outputs up to
    # 1e-4 off float64 where the tests allow 1e-5 relative. (1 - e) / (1 + e) with e = exp(-2|z|) is a few
    # ulps from tanh, but 1 - e cancels as z -> 0 (it magnifies ex2's own error), so small |z| take the odd
    # Taylor series, whose first omitted term is < 2e-9 relative at |z| = 1/8. The softcap path costs
    # about 10 more instructions per element than tanh.approx did (the static report, --all-options).
    az = tl.abs(z)
    e = fast_exp2(az * -2.8853900817779268, FAST)  # exp(-2|z|) = 2^(-2 log2(e) |z|)
    z2 = z * z
    series = az * (1.0 + z2 * (-0.333333333333 + z2 * (0.133333333333 + z2 * -0.053968253968)))
    th = tl.where(az < 0.125, series, (1.0 - e) / (1.0 + e))
    return tl.where(z < 0.0, -th, th)


@triton.jit
def transform(x, scale, inv_cap, cap_scale, SCALE: tl.constexpr, SOFTCAP: tl.constexpr, FAST: tl.constexpr):
    # y = scale * cap * tanh(x / cap) in fp32 (cap_scale = cap * scale), and tanh for the backward's slope;
    # without softcap a multiply only when scale != 1 (SCALE)
    x = x.to(tl.float32)
    if SOFTCAP:
        th = _tanh(x * inv_cap, FAST)
        return th * cap_scale, th
    elif SCALE:
        return x * scale, x
    else:
        return x, x


@triton.jit
def _lane_step(m, s, t, s2, y, ENTROPY: tl.constexpr, SUM_SQ: tl.constexpr, FAST: tl.constexpr):
    # One element per lane of the streaming softmax, each lane keeping its own running max m, sum s,
    # entropy numerator t and (SUM_SQ) sum of squared exps s2 (relative to m); one exp per element:
    # exp(-|y - m|) is the element's own term when y <= m and the rescale of the lane's sums when y > m (the
    # element then adds exp(0) = 1). m starts at -FLT_MAX, not -inf, so that y = -inf gives d = -inf and
    # exp = 0, never inf - inf.
    d = y - m
    e = fast_exp2(tl.abs(d) * -1.4426950408889634, FAST)
    up = d > 0.0
    if ENTROPY:  # up: t <- e (t - d s) (the shift to the new max; the element adds 0); else t += e d
        t = tl.where(up, e * (t - d * s), t + e * tl.maximum(d, -3.4028234663852886e38))
    if SUM_SQ:  # the squares of the same exps: e**2 rescales them, or is the element's own
        s2 = tl.where(up, s2 * (e * e) + 1.0, s2 + e * e)
    s = tl.where(up, s * e + 1.0, s + e)
    m = tl.where(up, y, m)
    return m, s, t, s2


@triton.jit
def _lanes_reduce(m, s, t, s2, ENTROPY: tl.constexpr, SUM_SQ: tl.constexpr, FAST: tl.constexpr):
    # The row's (max, sum exp, entropy numerator, sum of squared exps) from the lanes' once per row; -inf max
    # when nothing is finite.
    big_m = tl.max(m, 0)
    w = fast_exp2((m - big_m) * 1.4426950408889634, FAST)
    s_row = tl.sum(s * w, 0)
    t_row = 0.0
    if ENTROPY:
        t_row = tl.sum(tl.where(s > 0.0, w * (t + (m - big_m) * s), 0.0), 0)
    s2_row = 0.0
    if SUM_SQ:
        s2_row = tl.sum(s2 * (w * w), 0)
    return tl.where(s_row > 0.0, big_m, -float("inf")), s_row, t_row, s2_row


@triton.jit
def _lane_argmax(best, m, y, col, TIES: tl.constexpr):
    # Each lane's lowest column holding its max (before the lane step updates m). The main loop visits a lane's
    # columns in increasing order, so a strictly larger y is enough there (the first of equal ones stays); the
    # edge (TIES) holds the row's head columns, visited after the main blocks: an equal y at a lower column wins.
    if TIES:
        return tl.where((y > m) | ((y == m) & (col < best)), col, best)
    else:
        return tl.where(y > m, col, best)


@triton.jit
def row_split(row_start, valid, ALIGN: tl.constexpr, BLOCK_V: tl.constexpr):
    # A row's columns as: `head` leading columns before the first 16-byte aligned address, `n_main` columns
    # from there in whole blocks (the unmasked, vectorised main loop), and the edge: the head plus whatever
    # follows the main blocks (masked). Edge lane j is column j if j < head, else n_main + j.
    head = ((ALIGN - row_start % ALIGN) % ALIGN).to(tl.int32)
    n_main = (tl.maximum(valid - head, 0) // BLOCK_V) * BLOCK_V
    return head, n_main


@triton.jit
def edge_cols(j, head, n_main):
    return tl.where(j < head, j, n_main + j)


# Contract: x rows of x_row_stride elements, columns [0, valid) are vocabulary; labels [c] integer (global ids),
# read only when TARGET. Writes out[row, 0:5] (fp32, contiguous) = (m, s, t, target, sum_y):
#   m = max_j y_j (-inf if nothing is finite), s = sum_j exp(y_j - m), t = sum_j exp(y_j - m) * (y_j - m) with
#   exp(..) == 0 terms exactly 0, target = y at label - vocab_start if owned else 0, sum_y = sum_j y_j;
# with WIDTH 8 also out[row, 5:8] = (s2, v, id): s2 = sum_j exp(2 (y_j - m)) (SUM_SQ), v = m and id = vocab_start +
#   the lowest column with y_j == v, -1 when v is -inf (ARGMAX); 0 where not asked.
# ALIGN: elements per 16 bytes when x's base is 16-byte aligned (else 1): the main loop starts at each row's
# first aligned column, so its loads are 16 bytes wide whatever the width and row stride.
@triton.jit
def _softmax_partials_kernel(
    x_ptr, x_row_stride, labels_ptr, out_ptr, valid, vocab_start, scale, inv_cap, cap_scale, keep_ptr, live_ptr,
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, TARGET: tl.constexpr,
    SUM_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr, ALIGN: tl.constexpr, FAST: tl.constexpr,
    KEEP: tl.constexpr, LIVE: tl.constexpr, SUM_SQ: tl.constexpr = False, ARGMAX: tl.constexpr = False,
    WIDTH: tl.constexpr = 5,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_start = row * x_row_stride
    x_row = x_ptr + row_start
    if LIVE:  # a row that does not count reads nothing: (m, s, t, target, sum_y) = (0, 1, 0, 0, 0), lse 0
        valid = tl.where(tl.load(live_ptr + row) != 0, valid, 0)
    keep = -float("inf")
    if KEEP:  # the row's kept set is x >= keep (lmloss.sampling: on the logits themselves, so that the set
        keep = tl.load(keep_ptr + row)  # is the search's whatever the transform rounds); the rest is padding
    target = 0.0
    if TARGET:
        local = tl.load(labels_ptr + row) - vocab_start
        owned = (local >= 0) & (local < valid)
        x_t = tl.load(x_row + local, mask=owned, other=0.0)
        y_t, th_t = transform(x_t, scale, inv_cap, cap_scale, SCALE, SOFTCAP, FAST)
        if KEEP:
            y_t = tl.where(x_t.to(tl.float32) >= keep, y_t, -float("inf"))
        target = tl.where(owned, y_t, 0.0)
    head, n_main = row_split(row_start, valid, ALIGN, BLOCK_V)
    x_main = x_ptr + tl.multiple_of(row_start + head, ALIGN)
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], -3.4028234663852886e38, tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    t = tl.zeros([BLOCK_V], tl.float32)
    s2 = tl.zeros([BLOCK_V], tl.float32)
    sum_y = tl.zeros([BLOCK_V], tl.float32)
    best = tl.full([BLOCK_V], 2147483647, tl.int32)
    for k in range(0, n_main, BLOCK_V):
        x = tl.load(x_main + k + offs)
        y, _ = transform(x, scale, inv_cap, cap_scale, SCALE, SOFTCAP, FAST)
        if KEEP:
            kept = x.to(tl.float32) >= keep
            if SUM_LOGITS:
                sum_y += tl.where(kept, y, 0.0)
            y = tl.where(kept, y, -float("inf"))
        elif SUM_LOGITS:
            sum_y += y
        if ARGMAX:
            best = _lane_argmax(best, m, y, head + k + offs, False)
        m, s, t, s2 = _lane_step(m, s, t, s2, y, ENTROPY, SUM_SQ, FAST)
    n_edge = valid - n_main
    for e0 in range(0, n_edge, BLOCK_V):
        j = e0 + offs
        mask = j < n_edge
        cols = edge_cols(j, head, n_main)
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        y, _ = transform(x, scale, inv_cap, cap_scale, SCALE, SOFTCAP, FAST)
        if KEEP:
            mask = mask & (x.to(tl.float32) >= keep)
        y = tl.where(mask, y, -float("inf"))
        if ARGMAX:
            best = _lane_argmax(best, m, y, cols, True)
        m, s, t, s2 = _lane_step(m, s, t, s2, y, ENTROPY, SUM_SQ, FAST)
        if SUM_LOGITS:
            sum_y += tl.where(mask, y, 0.0)
    m_row, s_row, t_row, s2_row = _lanes_reduce(m, s, t, s2, ENTROPY, SUM_SQ, FAST)
    top = 0
    if ARGMAX:  # the lowest column among the lanes that hold the row's max
        first = tl.min(tl.where(m == tl.max(m, 0), best, 2147483647), 0)
        top = tl.where((m_row == -float("inf")) | (first == 2147483647), -1, first + vocab_start)
    v_row = m_row
    if LIVE:
        m_row = tl.where(valid > 0, m_row, 0.0)
        s_row = tl.where(valid > 0, s_row, 1.0)
    out_row = out_ptr + row * WIDTH
    tl.store(out_row + 0, m_row)
    tl.store(out_row + 1, s_row)
    tl.store(out_row + 2, t_row)
    tl.store(out_row + 3, target)
    tl.store(out_row + 4, tl.sum(sum_y, 0))
    if WIDTH == 8:
        tl.store(out_row + 5, s2_row)
        if ARGMAX:
            tl.store(out_row + 6, v_row)
            tl.store(out_row + 7, top.to(tl.float32))
        else:
            tl.store(out_row + 6, 0.0)
            tl.store(out_row + 7, 0.0)


@triton.jit
def _fixed(v):
    # round(v) as int32 for |v| < 2**22, in two full-rate instructions: adding 1.5 * 2**23 rounds v to an
    # integer (ties to even), whose bits then sit at the bottom of the sum's mantissa
    return (v + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def _block_sums(x, mask, keep, b0, row, out_ptr, n_blocks, scale, inv_cap, cap_scale, SCALE: tl.constexpr,
                SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, SUM_LOGITS: tl.constexpr, KEEP: tl.constexpr,
                FAST: tl.constexpr, GROUP: tl.constexpr, MASKED: tl.constexpr, ARGMAX: tl.constexpr = False,
                BLOCK: tl.constexpr = 128):  # fmt: skip
    # One [GROUP, BLOCK] tile of a row: block b0 + i is its row i. Every sum is an int32 sum of rounded fixed-point
    # terms (exact: no order, so no layout, alignment or code path changes a bit), stored as fp32. Returns the tile's
    # exps summed per lane (NaN where a NaN or +inf y made one NaN), for the row's check.
    if SOFTCAP:
        y, _ = transform(x, scale, inv_cap, cap_scale, SCALE, SOFTCAP, FAST)
        k2 = 1.4426950408889634
    else:  # y = x * scale is monotone: the block's max of y is its max of x times scale, and the exp's FFMA
        y = x.to(tl.float32)  # takes the scale (no multiply per element)
        k2 = 1.4426950408889634 * (scale if SCALE else 1.0)
    if KEEP:
        mask = mask & (x.to(tl.float32) >= keep)
    if MASKED or KEEP:
        y = tl.where(mask, y, -float("inf"))
    m = tl.max(y, 1)
    shift2 = tl.where(m == -float("inf"), 0.0, m * k2)  # an empty block: every exp is 0
    e = fast_exp2(y * k2 - shift2[:, None], FAST)  # exp(y - m) in [0, 1], 1 at the block's max
    s = tl.sum(_fixed(e * 4194304.0), 1).to(tl.float32) * 2.384185791015625e-07  # 2**22 fraction bits
    if not SOFTCAP and SCALE:
        m = m * scale
    blk = b0 + tl.arange(0, GROUP)
    out = out_ptr + (row * n_blocks + blk) * (5 if ARGMAX else 4)
    in_row = blk < n_blocks
    tl.store(out + 0, m, mask=in_row)
    tl.store(out + 1, s, mask=in_row)
    if ARGMAX:  # the block's lowest column holding its largest y (y as stored: times the scale)
        ys = y
        if not SOFTCAP and SCALE:
            ys = y * scale
        first = tl.min(tl.where(ys == tl.max(ys, 1)[:, None], tl.arange(0, BLOCK)[None, :], BLOCK), 1)
        tl.store(out + 4, first.to(tl.float32), mask=in_row)
    if ENTROPY:  # e (y - m) in [-1/e, 0]; 0 where e is 0 (no 0 * -inf)
        d = tl.maximum(y * k2 - shift2[:, None], -3.4028234663852886e38) * 0.6931471805599453  # y - m
        t = tl.sum(_fixed(e * d * 4194304.0), 1).to(tl.float32)
        tl.store(out + 2, t * 2.384185791015625e-07, mask=in_row)
    if SUM_LOGITS:  # in fixed point below the block's largest |y|'s binary exponent (22 bits under it)
        if not SOFTCAP and SCALE:
            y = y * scale
        yk = tl.where(mask, y, 0.0)
        big = tl.max(tl.abs(yk), 1)
        expo = (big.to(tl.int32, bitcast=True) >> 23) & 0xFF
        k = tl.minimum(148 - expo, 127)  # |y| * 2**k < 2**22 (a zero or subnormal block: 2**127)
        up = ((k + 127) << 23).to(tl.float32, bitcast=True)
        down = ((127 - k) << 23).to(tl.float32, bitcast=True)
        total = tl.sum(_fixed(yk * up[:, None]), 1).to(tl.float32) * down
        # a NaN or infinite y: the float sum of the infinities alone (inf, -inf or NaN in any order) or NaN
        odd = tl.sum(tl.where((tl.abs(yk) == float("inf")) | (yk != yk), yk, 0.0), 1)
        total = tl.where(odd == 0.0, total, odd)
        tl.store(out + 3, total, mask=in_row)
    return e


# Contract (invariant mode, `lmloss.kernels`): one program per row walks its blocks of BLOCK columns (local columns
# [b * BLOCK, (b + 1) * BLOCK); those >= valid or, with KEEP, x < keep take no part) GROUP at a time, in an unmasked
# main loop over whole groups and one masked group after it, and writes out[row, b, 0:4] (fp32) = (m_b, s_b, t_b,
# sum_y_b): the block's max of y (-inf: none), sum exp(y - m_b), sum exp(y - m_b) (y - m_b) (0-terms exactly 0),
# sum y. The sums are of fixed-point terms (2**-22 units of exp(y - m_b); sum y in 2**-22 units of the block's
# largest |y|'s binary octave) in int32, exact: a block's sums depend on its own columns alone, whatever the row,
# (and, with ARGMAX, out[row, b, 4] = the block's lowest column, within it, holding its max: out is then
# [c, n_blocks, 5], else [c, n_blocks, 4])
# the chunk, the shard, the alignment or the compiled layout. A row with a NaN y, or a +inf y, gets NaN s_b and t_b
# in its first block (the combine makes the row NaN); sum_y_b is NaN / +-inf as a float sum of its non-finite y
# would be. Also target[row] = y at the label if owned (-inf if KEEP drops it), else 0.
# ALIGN: elements per 16 bytes when every row starts 16-byte aligned (base and row stride), else 1.
@triton.jit
def _block_partials_kernel(
    x_ptr, x_row_stride, labels_ptr, out_ptr, target_ptr, valid, n_blocks, vocab_start, scale, inv_cap,
    cap_scale, keep_ptr,
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, TARGET: tl.constexpr,
    SUM_LOGITS: tl.constexpr, KEEP: tl.constexpr, FAST: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
    ALIGN: tl.constexpr, ARGMAX: tl.constexpr = False,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + tl.multiple_of(row * x_row_stride, ALIGN)
    keep = -float("inf")
    if KEEP:
        keep = tl.load(keep_ptr + row)
    if TARGET:
        local = tl.load(labels_ptr + row) - vocab_start
        owned = (local >= 0) & (local < valid)
        x_t = tl.load(x_row + local, mask=owned, other=0.0)
        y_t, _ = transform(x_t, scale, inv_cap, cap_scale, SCALE, SOFTCAP, FAST)
        if KEEP:
            y_t = tl.where(x_t.to(tl.float32) >= keep, y_t, -float("inf"))
        tl.store(target_ptr + row, tl.where(owned, y_t, 0.0))
    cols = tl.arange(0, GROUP)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    n_main = valid // (GROUP * BLOCK) * GROUP  # blocks in whole groups of whole blocks
    check = tl.zeros([GROUP, BLOCK], tl.float32)  # the exps, per lane: NaN if any is NaN
    for b0 in range(0, n_main, GROUP):
        x = tl.load(x_row + b0 * BLOCK + cols)
        check += _block_sums(x, cols >= 0, keep, b0, row, out_ptr, n_blocks, scale, inv_cap, cap_scale, SCALE,
                             SOFTCAP, ENTROPY, SUM_LOGITS, KEEP, FAST, GROUP, False, ARGMAX, BLOCK)  # fmt: skip
    for b0 in range(n_main, n_blocks, GROUP):
        mask = b0 * BLOCK + cols < valid
        x = tl.load(x_row + b0 * BLOCK + cols, mask=mask, other=0.0)
        check += _block_sums(x, mask, keep, b0, row, out_ptr, n_blocks, scale, inv_cap, cap_scale, SCALE, SOFTCAP,
                             ENTROPY, SUM_LOGITS, KEEP, FAST, GROUP, True, ARGMAX, BLOCK)  # fmt: skip
    if n_blocks > 0:  # a NaN or +inf y anywhere (an exp of NaN): the row's first block's sums are NaN
        nan = tl.sum(tl.sum(check, 1), 0)
        tl.store(out_ptr + row * n_blocks * (5 if ARGMAX else 4) + 1, float("nan"), mask=nan != nan)
        if ENTROPY:
            tl.store(out_ptr + row * n_blocks * (5 if ARGMAX else 4) + 2, float("nan"), mask=nan != nan)


@triton.jit
def _grad_block(x, j_label, th, lse2, pa, pb, pc, d_coef, h, dz, pz, SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr,
                FAST: tl.constexpr, DIFF: tl.constexpr):  # fmt: skip
    # One block of the gradient from y (x after transform, in fp32) with the row's coefficients already
    # times dy/dx's constant part: g = pa p + pb [j == label] + pc (+ d p (log p + H)) (+ pz p dz, the folded
    # difference term: dz = x - z), times (1 - th^2). j_label: whether each lane holds the label's column.
    # lse2 = lse * log2(e). The difference term is 0 where p is (a column without the policy's mass: its
    # dz = -inf would give NaN), +inf where p > 0 and the reference has none, as plain PyTorch.
    if ENTROPY:
        logp2 = x * 1.4426950408889634 - lse2
        p = fast_exp2(logp2, FAST)
        logp = tl.where(p > 0.0, logp2 * 0.6931471805599453, 0.0)  # no -inf * 0 where p == 0
        g = (pa + d_coef * (logp + h)) * p + tl.where(j_label, pb + pc, pc)
    else:
        p = fast_exp2(x * 1.4426950408889634 - lse2, FAST)
        g = pa * p + tl.where(j_label, pb + pc, pc)
    if DIFF:
        g = g + pz * tl.where(p > 0.0, p * dz, 0.0)
    if SOFTCAP:
        g = g * (1.0 - th * th)
    return g


# Contract: program (row, split) walks the row's main blocks split, split + splits, ... (reading each once and
# writing it once, so out may be x); split 0 also does the row's edge (head, tail, and padded columns
# valid <= j < n_cols, which get exactly 0). coef[row] = (a, b, c, d); with logp = y - lse[row], P = exp(logp),
# H = entropy[row]: g = a*P + d*P*(logp + H) [P > 0] + b [j owns the label] + c, times dy/dx; a row whose four
# coefficients are all 0 gets exactly 0 (a select after the math: the x loads never wait on the coefficients).
# DIFF (the folded full KL, `lmloss.kernels`; no softcap): g also has zc[row] * P * (x - z) for a second chunk z of
# the same columns, and a row is live where zc is nonzero too.
# ALIGN as in _softmax_partials_kernel, for x, out (and z) together (the wrapper checks they share their alignment).
@triton.jit
def _softmax_grad_kernel(
    x_ptr, x_row_stride, out_ptr, out_row_stride, labels_ptr, lse_ptr, entropy_ptr, coef_ptr,
    n_cols, valid, vocab_start, scale, inv_cap, cap_scale, keep_ptr, z_ptr, z_row_stride, zc_ptr,
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, LABELS: tl.constexpr, BLOCK_V: tl.constexpr,
    ALIGN: tl.constexpr, FAST: tl.constexpr, KEEP: tl.constexpr, DIFF: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    x_start = row * x_row_stride
    o_start = row * out_row_stride
    z_start = row * z_row_stride
    head, n_main = row_split(x_start, valid, ALIGN, BLOCK_V)
    x_main = x_ptr + tl.multiple_of(x_start + head, ALIGN)
    o_main = out_ptr + tl.multiple_of(o_start + head, ALIGN)
    z_main = z_ptr + tl.multiple_of(z_start + head, ALIGN)
    a = tl.load(coef_ptr + row * 4 + 0)
    b = tl.load(coef_ptr + row * 4 + 1)
    c = tl.load(coef_ptr + row * 4 + 2)
    d = tl.load(coef_ptr + row * 4 + 3)
    zc = 0.0
    if DIFF:
        zc = tl.load(zc_ptr + row)
    live = (a != 0.0) | (b != 0.0) | (c != 0.0) | (d != 0.0) | (zc != 0.0)
    # A row without p terms (a = d = zc = 0) takes lse = inf, so p = 0 and its lse (maybe NaN) reaches nothing;
    # likewise H only where d != 0: zero coefficients add exactly 0 without a select per element.
    no_p = (a == 0.0) & (d == 0.0) & (zc == 0.0)
    lse2 = tl.where(no_p, float("inf"), tl.load(lse_ptr + row) * 1.4426950408889634)
    h = 0.0
    if ENTROPY:
        h = tl.where(d != 0.0, tl.load(entropy_ptr + row), 0.0)
    # dy/dx's constant factor (scale) goes into the coefficients; softcap's (1 - th^2) stays per element
    k = scale if SCALE or SOFTCAP else 1.0
    pa = a * k
    pb = b * k
    pc = c * k
    pd = d * k
    pz = zc * k
    label = -1
    if LABELS:  # compared in 32 bits; a label outside [0, valid) matches no column
        local = tl.load(labels_ptr + row) - vocab_start
        label = tl.where((local >= 0) & (local < valid), local, -1).to(tl.int32)
    keep = -float("inf")
    if KEEP:  # columns with x < keep are outside the row's kept set: gradient exactly 0
        keep = tl.load(keep_ptr + row)
    offs = tl.arange(0, BLOCK_V)
    if live:
        for kb in range(split * BLOCK_V, n_main, splits * BLOCK_V):
            x = tl.load(x_main + kb + offs)
            y, th = transform(x, scale, inv_cap, cap_scale, SCALE, SOFTCAP, FAST)
            dz = 0.0
            if DIFF:  # no softcap: th is x in fp32
                dz = th - tl.load(z_main + kb + offs).to(tl.float32)
            g = _grad_block(y, offs == label - head - kb, th, lse2, pa, pb, pc, pd, h, dz, pz, SOFTCAP, ENTROPY,
                            FAST, DIFF)  # fmt: skip
            if KEEP:
                g = tl.where(x.to(tl.float32) >= keep, g, 0.0)
            tl.store(o_main + kb + offs, g.to(out_ptr.dtype.element_ty))
    else:  # a row without coefficients (a token that does not count): zeros, x not read (a write, not 3 passes)
        zeros = tl.zeros([BLOCK_V], dtype=tl.float32).to(out_ptr.dtype.element_ty)
        for kb in range(split * BLOCK_V, n_main, splits * BLOCK_V):
            tl.store(o_main + kb + offs, zeros)
    if split == 0:
        n_edge = n_cols - n_main
        for e0 in range(0, n_edge, BLOCK_V):
            j = e0 + offs
            cols = edge_cols(j, head, n_main)
            in_vocab = (j < n_edge) & (cols < valid)
            x = tl.load(x_ptr + x_start + cols, mask=in_vocab, other=0.0)
            y, th = transform(x, scale, inv_cap, cap_scale, SCALE, SOFTCAP, FAST)
            dz = 0.0
            if DIFF:
                dz = th - tl.load(z_ptr + z_start + cols, mask=in_vocab, other=0.0).to(tl.float32)
            g = _grad_block(y, cols == label, th, lse2, pa, pb, pc, pd, h, dz, pz, SOFTCAP, ENTROPY, FAST, DIFF)
            if KEEP:
                in_vocab = in_vocab & (x.to(tl.float32) >= keep)
            g = tl.where(in_vocab, tl.where(live, g, 0.0), 0.0)
            tl.store(out_ptr + o_start + cols, g.to(out_ptr.dtype.element_ty), mask=j < n_edge)


# Contract (the folded full KL's sums, `lmloss.kernels`): one program per row writes out[row] (fp32) = sum over the
# valid columns of P_j (x_j - z_j), P = exp(y - lse[row]), y = scale * x (no softcap); x and z of any float dtype.
# The row is walked like _softmax_partials_kernel's (unmasked aligned main loop for x and z together, one masked
# edge), each lane keeping its own sum, reduced once.
@triton.jit
def _difference_sums_kernel(
    x_ptr, x_row_stride, z_ptr, z_row_stride, lse_ptr, out_ptr, valid, scale,
    SCALE: tl.constexpr, BLOCK_V: tl.constexpr, ALIGN: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_start = row * x_row_stride
    z_start = row * z_row_stride
    lse2 = tl.load(lse_ptr + row) * 1.4426950408889634
    k2 = 1.4426950408889634 * (scale if SCALE else 1.0)
    head, n_main = row_split(x_start, valid, ALIGN, BLOCK_V)
    x_main = x_ptr + tl.multiple_of(x_start + head, ALIGN)
    z_main = z_ptr + tl.multiple_of(z_start + head, ALIGN)
    offs = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for kb in range(0, n_main, BLOCK_V):
        x = tl.load(x_main + kb + offs).to(tl.float32)
        z = tl.load(z_main + kb + offs).to(tl.float32)
        p = fast_exp2(x * k2 - lse2, FAST)
        acc += tl.where(p > 0.0, p * (x - z), 0.0)  # a column without the policy's mass adds 0, not NaN
    n_edge = valid - n_main
    for e0 in range(0, n_edge, BLOCK_V):
        j = e0 + offs
        mask = j < n_edge
        cols = edge_cols(j, head, n_main)
        x = tl.load(x_ptr + x_start + cols, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + z_start + cols, mask=mask, other=0.0).to(tl.float32)
        p = fast_exp2(x * k2 - lse2, FAST)
        acc += tl.where(mask & (p > 0.0), p * (x - z), 0.0)
    tl.store(out_ptr + row, tl.sum(acc, 0))


# Contract: a persistent grid; program p takes rows p, p + programs, ... of x [c, n_cols] (columns [0, valid) are
# the whole vocabulary, vocab_start 0). A row whose label is ignore_index reads nothing: res[row] = (0, 0) and
# out[row, :] = 0 exactly. Otherwise
#   pass 1 (reads x: edge, then main blocks forward, kept in L2 with evict_last): y_t = y[label] read first
#     (before any write of the row), per-lane m, s as in _softmax_partials_kernel, sum_y when SMOOTHING;
#     lse = m + log s; loss = (1-eps)(lse - y_t) + eps(lse - sum_y / vocab_size) + z lse^2;
#   pass 2 (main blocks backward from where pass 1 ended, then the edge; evict_first):
#     g_j = k ((1 + 2 z lse) p_j - (1-eps)[j == label] - eps / vocab_size) * dy/dx for j < valid, 0 beyond,
#     with k = *grad_scale_ptr (the upstream of each row's loss, 1 / count for a mean).
# Every read of pass 1 precedes every write, and pass 2 reads each block before writing it: out may be x.
@triton.jit
def _cross_entropy_loss_grad_kernel(
    x_ptr, x_row_stride, out_ptr, out_row_stride, labels_ptr, res_ptr, grad_scale_ptr,
    n_rows, n_cols, valid, ignore_index, scale, inv_cap, cap_scale, eps, z_loss, inv_vocab,
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr,
    BLOCK_V: tl.constexpr, ALIGN: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    grad_scale = tl.load(grad_scale_ptr)
    offs = tl.arange(0, BLOCK_V)
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        x_start = row * x_row_stride
        o_start = row * out_row_stride
        label = tl.load(labels_ptr + row)
        live = label != ignore_index
        n_read = tl.where(live, valid, 0)  # an ignored row is neither read nor given a gradient
        owned = live & (label >= 0) & (label < valid)
        y_t, th_t = transform(tl.load(x_ptr + x_start + label, mask=owned, other=0.0), scale, inv_cap, cap_scale,
                            SCALE, SOFTCAP, FAST)  # fmt: skip
        y_t = tl.where(owned, y_t, 0.0)
        head, n_main = row_split(x_start, n_read, ALIGN, BLOCK_V)
        x_main = x_ptr + tl.multiple_of(x_start + head, ALIGN)
        o_main = out_ptr + tl.multiple_of(o_start + head, ALIGN)

        m = tl.full([BLOCK_V], -3.4028234663852886e38, tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
        sum_y = tl.zeros([BLOCK_V], tl.float32)
        n_edge = n_read - n_main
        for e0 in range(0, n_edge, BLOCK_V):
            j = e0 + offs
            mask = j < n_edge
            x = tl.load(x_ptr + x_start + edge_cols(j, head, n_main), mask=mask, other=0.0,
                        eviction_policy="evict_last")  # fmt: skip
            y, _ = transform(x, scale, inv_cap, cap_scale, SCALE, SOFTCAP, FAST)
            y = tl.where(mask, y, -float("inf"))
            m, s, _, _ = _lane_step(m, s, s, s, y, False, False, FAST)
            if SMOOTHING:
                sum_y += tl.where(mask, y, 0.0)
        for kb in range(0, n_main, BLOCK_V):
            x = tl.load(x_main + kb + offs, eviction_policy="evict_last")
            y, _ = transform(x, scale, inv_cap, cap_scale, SCALE, SOFTCAP, FAST)
            m, s, _, _ = _lane_step(m, s, s, s, y, False, False, FAST)
            if SMOOTHING:
                sum_y += y
        m_row, s_row, t_row, _ = _lanes_reduce(m, s, s, s, False, False, FAST)
        # An ignored row read nothing (m = -inf, s = 0): give it lse 0 so that no inf reaches the arithmetic below.
        m_row = tl.where(live, m_row, 0.0)
        log_s = tl.log(tl.where(live, s_row, 1.0))
        lse = m_row + log_s
        loss = (m_row - y_t) + log_s  # -log p_label, with the large m cancelled first
        if SMOOTHING:
            loss = (1.0 - eps) * loss + eps * ((m_row - tl.sum(sum_y, 0) * inv_vocab) + log_s)
        p_coef = 1.0
        if Z_LOSS:
            loss += z_loss * lse * lse
            p_coef = 1.0 + 2.0 * z_loss * lse
        tl.store(res_ptr + row * 2 + 0, tl.where(live, lse, 0.0))
        tl.store(res_ptr + row * 2 + 1, tl.where(live, loss, 0.0))

        # the row's constants, dy/dx's constant part (scale) and the upstream folded in
        k = grad_scale * (scale if SCALE or SOFTCAP else 1.0)
        pa = p_coef * k
        pc = -eps * inv_vocab * k if SMOOTHING else 0.0
        pb = -(1.0 - eps) * k if SMOOTHING else -k
        lse2 = lse * 1.4426950408889634
        label32 = tl.where(owned, label, -1).to(tl.int32)
        for i in range(0, n_main, BLOCK_V):
            kb = n_main - BLOCK_V - i
            x = tl.load(x_main + kb + offs, eviction_policy="evict_first")
            y, th = transform(x, scale, inv_cap, cap_scale, SCALE, SOFTCAP, FAST)
            g = _grad_block(y, offs == label32 - head - kb, th, lse2, pa, pb, pc, 0.0, 0.0, 0.0, 0.0, SOFTCAP, False, FAST,
                            False)  # fmt: skip
            tl.store(o_main + kb + offs, g.to(out_ptr.dtype.element_ty), eviction_policy="evict_first")
        n_edge = n_cols - n_main  # the head, the tail and the padded columns (zeros); all of an ignored row
        for e0 in range(0, n_edge, BLOCK_V):
            j = e0 + offs
            cols = edge_cols(j, head, n_main)
            in_vocab = (j < n_edge) & (cols < n_read)
            x = tl.load(x_ptr + x_start + cols, mask=in_vocab, other=0.0, eviction_policy="evict_first")
            y, th = transform(x, scale, inv_cap, cap_scale, SCALE, SOFTCAP, FAST)
            g = _grad_block(y, cols == label32, th, lse2, pa, pb, pc, 0.0, 0.0, 0.0, 0.0, SOFTCAP, False, FAST, False)
            g = tl.where(in_vocab, g, 0.0)
            tl.store(out_ptr + o_start + cols, g.to(out_ptr.dtype.element_ty), mask=j < n_edge,
                     eviction_policy="evict_first")  # fmt: skip


def block_for(n_cols: int, table: tuple[tuple[float, int, int], ...], block_v: int | None) -> tuple[int, int]:
    """`block_config`'s ``(BLOCK_V, num_warps)``, BLOCK_V replaced by `block_v` (a power of 2) when given."""
    block, warps = block_config(n_cols, table)
    if block_v is not None:
        if block_v < 1 or block_v & (block_v - 1):
            raise ValueError(f"block_v must be a power of 2, got {block_v}")
        block = block_v
    return block, warps


def device_guard(t: torch.Tensor):
    """The context in which a launch for tensor `t` runs on its device."""
    # Triton launches on the current CUDA device; make it the tensors' one.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def check_rows(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise unless `t` is 2-D with unit column stride and a dtype in `dtypes`."""
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D with unit column stride, got shape {tuple(t.shape)}, "
                         f"strides {t.stride()}")  # fmt: skip
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {dtypes}, got {t.dtype}")


def row_vector(name: str, t: torch.Tensor, rows: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """`t` checked as ``[rows]`` of a dtype in `dtypes`, contiguous (and 16-byte aligned if 64-bit)."""
    if t.shape != (rows,) or t.dtype not in dtypes:
        raise ValueError(f"{name} must be [{rows}] of dtype in {dtypes}, got {tuple(t.shape)} {t.dtype}")
    t = t.contiguous()
    # A 64-bit vector that starts at an address not 16-byte aligned (a slice at an odd offset) has been
    # read wrongly by some Triton versions; a fresh copy of c elements is cheap insurance.
    return t.clone() if t.element_size() == 8 and t.data_ptr() % 16 else t


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int64, torch.int32)


def alignment(*rows: torch.Tensor) -> int:
    """The kernels' ``ALIGN``: elements per 16 bytes of the narrowest dtype among `rows` (2-D tensors walked
    together, column by column), when each base address is aligned to that many of its own elements and the
    row strides agree modulo it, so that one column offset puts every row of every tensor on a 16-byte
    boundary; else 1 (no alignment assumed: correct, with narrower loads)."""
    align = 16 // min(t.element_size() for t in rows)
    aligned = all(t.data_ptr() % (align * t.element_size()) == 0 for t in rows)
    return align if aligned and len({t.stride(0) % align for t in rows}) == 1 else 1


def math_args(math: ChunkMath, x: torch.Tensor) -> tuple[tuple[float, float, float], dict]:
    """``(scale, 1 / cap, cap * scale)`` and the constexprs SCALE, SOFTCAP, FAST shared by the kernels."""
    cap = float(math.softcap or 0.0)
    scale = float(math.scale)
    args = (scale, 1.0 / cap if cap else 1.0, cap * scale if cap else scale)
    return args, dict(SCALE=scale != 1.0, SOFTCAP=bool(cap), FAST=x.is_cuda)


def _programs(device: torch.device) -> int:
    """How many programs keep the GPU busy: 4 per SM on CUDA (a few under the CPU interpreter, enough to
    exercise the splitting and persistent loops)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _check_partials_args(x, labels, math: ChunkMath, target: bool, keep_min):
    """The checks of `softmax_partials` / `block_partials`: ``(rows, labels, keep_min)``, the vectors checked
    (labels only when `target`)."""
    check_rows("x", x, _FLOATS)
    rows, n_cols = x.shape
    if not 0 <= math.valid <= n_cols:
        raise ValueError(f"math.valid must be in [0, {n_cols}], got {math.valid}")
    if target:
        if labels is None:
            raise ValueError("labels is required when target=True")
        labels = row_vector("labels", labels, rows, _INTS)
    if keep_min is not None:
        keep_min = row_vector("keep_min", keep_min, rows, (torch.float32,))
    return rows, labels, keep_min


def softmax_partials(
    x: torch.Tensor,
    labels: torch.Tensor | None,
    math: ChunkMath,
    *,
    entropy: bool,
    target: bool,
    sum_logits: bool,
    block_v: int | None = None,
    keep_min: torch.Tensor | None = None,
    live: torch.Tensor | None = None,
    sum_sq: bool = False,
    argmax: bool = False,
) -> torch.Tensor:
    """Per-row softmax partials of a chunk over this shard's valid columns.

    Args:
        x: ``[c, V_local]`` fp32 / bf16 / fp16 logits, ``x.stride(1) == 1``.
        labels: ``[c]`` integer global vocabulary ids (ignore values such as -100 own no column); needed only
            when ``target``.
        math: vocabulary range of the shard, scale (1 / temperature) and softcap.
        entropy, target, sum_logits: compute columns 2, 3, 4 (else they are 0).
        block_v: vocabulary block override (a power of 2); default from ``FORWARD_BLOCKS``.
        keep_min: ``[c]`` fp32 per-row threshold of the kept set on the logits (`lmloss.kernels`): columns
            with ``x < keep_min`` count as padding (a dropped label's target is -inf); None for all columns.
        live: ``[c]`` bool, the rows that count (`lmloss.rows`: a slice's computed-and-masked rows do not):
            a row with False reads nothing and gets ``(0, 1, 0, 0, 0)`` (lse 0); None for every row.
        sum_sq, argmax: the by-products' columns (`lmloss.kernels`): the partials are then ``[c, 8]``.

    Returns:
        fp32 ``[c, 5]``: (max y, sum exp(y - max), sum exp(y - max) * (y - max), y at the label if this shard
        owns it else 0, sum y), sums over the ``math.valid`` leading columns; ``[c, 8]`` with (sum exp(2 (y -
        max)), max y, global id of its lowest column or -1) after them with `sum_sq` or `argmax`.
    """
    rows, labels, keep_min = _check_partials_args(x, labels, math, target, keep_min)
    if live is not None:
        live = row_vector("live", live, rows, (torch.bool,))
    width = 8 if sum_sq or argmax else 5
    out = torch.empty(rows, width, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    block, warps = block_for(math.valid, FORWARD_BLOCKS, block_v)
    if width == 8 and block_v is None:  # two more per-lane arrays (s2, the argmax's column): at 8192 x 16 warps
        # every option with them spilled (static sm_90 compile); 4096 keeps them in registers
        block = min(block, BYPRODUCT_BLOCK_V)
    values, flags = math_args(math, x)
    with device_guard(x):
        _softmax_partials_kernel[(rows,)](
            x, x.stride(0), labels if target else x, out, math.valid, math.vocab_start, *values,
            out if keep_min is None else keep_min, out if live is None else live, ENTROPY=entropy, TARGET=target,
            SUM_LOGITS=sum_logits, BLOCK_V=block, ALIGN=alignment(x), KEEP=keep_min is not None,
            LIVE=live is not None, SUM_SQ=sum_sq, ARGMAX=argmax, WIDTH=width, num_warps=warps, **flags,
        )  # fmt: skip
    return out


#: The invariant kernel's tile: BLOCK_GROUP blocks of INVARIANT_BLOCK columns per step of a row's walk, at
#: BLOCK_WARPS warps (8 bf16 columns, 16 bytes, per thread). Tuning only: the blocks' sums are exact integer sums.
BLOCK_GROUP, BLOCK_WARPS = 8, 4


def block_partials(
    x: torch.Tensor,
    labels: torch.Tensor | None,
    math: ChunkMath,
    *,
    entropy: bool,
    target: bool,
    sum_logits: bool,
    keep_min: torch.Tensor | None = None,
    argmax: bool = False,
) -> BlockPartials:
    """The invariant mode's per-block sums of a chunk (`lmloss.kernels.BlockPartials`): blocks of
    `INVARIANT_BLOCK` columns over this shard's valid ones, one program per row walking them, each block's sums
    exact sums of fixed-point terms (`_block_partials_kernel`): the same bits for a block whatever the chunk, the
    shard, the rows' alignment or the compiled layout. Arguments as in `softmax_partials`."""
    rows, labels, keep_min = _check_partials_args(x, labels, math, target, keep_min)
    n_blocks = triton.cdiv(math.valid, INVARIANT_BLOCK)
    out = torch.zeros((rows, n_blocks, 5 if argmax else 4), dtype=torch.float32, device=x.device)
    tgt = torch.zeros(rows, dtype=torch.float32, device=x.device)
    if rows and n_blocks:
        values, flags = math_args(math, x)
        with device_guard(x):
            align = alignment(x) if x.stride(0) % (16 // x.element_size()) == 0 else 1  # every row, not only the first
            _block_partials_kernel[(rows,)](
                x, x.stride(0), labels if target else x, out, tgt, math.valid, n_blocks, math.vocab_start, *values,
                tgt if keep_min is None else keep_min, ENTROPY=entropy, TARGET=target, SUM_LOGITS=sum_logits,
                KEEP=keep_min is not None, BLOCK=INVARIANT_BLOCK, GROUP=BLOCK_GROUP, ALIGN=align, ARGMAX=argmax,
                num_warps=BLOCK_WARPS, **flags,
            )  # fmt: skip
    top = None
    if argmax:  # the row's max over its blocks' (exact), and the lowest column of the first block holding it
        top = torch.tensor([float("-inf"), -1.0], device=x.device).repeat(rows, 1)
        if n_blocks:
            v, b = out[:, :, 0].max(dim=1)
            col = b * INVARIANT_BLOCK + out[:, :, 4].gather(1, b[:, None]).squeeze(1).to(torch.int64)
            top[:, 0] = v
            top[:, 1] = torch.where(v == float("-inf"), -1, col + math.vocab_start).to(torch.float32)
    return BlockPartials(
        out[:, :, 0], out[:, :, 1], out[:, :, 2] if entropy else None, out[:, :, 3] if sum_logits else None, tgt,
        top=top,
    )


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
    splits: int | None = None,
    keep_min: torch.Tensor | None = None,
    difference: tuple[torch.Tensor, torch.Tensor] | None = None,
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
        splits: programs per row (each walks every splits-th block); default: 1, or more when the chunk has
            too few rows to fill the GPU.
        keep_min: ``[c]`` fp32 kept-set thresholds (as in ``softmax_partials``): columns with
            ``x < keep_min`` get exactly 0; None for all columns.
        difference: ``(z, z_coef)``, the folded full KL (`lmloss.kernels`): a second chunk ``z`` of x's shape (any
            float dtype, ``z.stride(1) == 1``) and ``z_coef [c]`` fp32; each valid column also gets
            ``z_coef * P * (x - z)`` (before dy/dx). No softcap.
    """
    check_rows("x", x, _FLOATS)
    check_rows("out", out, _FLOATS)
    z = zc = None
    if difference is not None:
        z, zc = difference
        check_rows("z", z, _FLOATS)
        if z.shape != x.shape:
            raise ValueError(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
        if math.softcap:
            raise ValueError("the folded difference term takes no softcap (dy/dx would not be the scale)")
        zc = row_vector("z_coef", zc, x.shape[0], (torch.float32,))
    rows, n_cols = x.shape
    if out.shape != x.shape:
        raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if not 0 <= math.valid <= n_cols:
        raise ValueError(f"math.valid must be in [0, {n_cols}], got {math.valid}")
    if coef.shape != (rows, 4) or coef.dtype != torch.float32:
        raise ValueError(f"coef must be fp32 [{rows}, 4], got {tuple(coef.shape)} {coef.dtype}")
    coef = coef.contiguous()
    lse = row_vector("lse", lse, rows, (torch.float32,))
    if entropy is not None:
        entropy = row_vector("entropy", entropy, rows, (torch.float32,))
    if labels is not None:
        labels = row_vector("labels", labels, rows, _INTS)
    if keep_min is not None:
        keep_min = row_vector("keep_min", keep_min, rows, (torch.float32,))
    block, warps = block_for(n_cols, BACKWARD_BLOCKS, block_v)
    if rows == 0 or n_cols == 0:
        return out
    if splits is None:  # split the vocabulary only when the rows alone leave programs idle
        splits = min(triton.cdiv(n_cols, block), triton.cdiv(_programs(x.device), rows))
    values, flags = math_args(math, x)
    with device_guard(x):
        _softmax_grad_kernel[(rows, max(1, splits))](
            x, x.stride(0), out, out.stride(0), x if labels is None else labels, lse,
            lse if entropy is None else entropy, coef, n_cols, math.valid, math.vocab_start, *values,
            lse if keep_min is None else keep_min, x if z is None else z, 0 if z is None else z.stride(0),
            lse if zc is None else zc, ENTROPY=entropy is not None, LABELS=labels is not None, BLOCK_V=block,
            ALIGN=alignment(x, out) if z is None else alignment(x, out, z), KEEP=keep_min is not None,
            DIFF=z is not None, num_warps=warps, **flags,
        )  # fmt: skip
    return out


def difference_sums(
    x: torch.Tensor, z: torch.Tensor, lse: torch.Tensor, math: ChunkMath, *, block_v: int | None = None
) -> torch.Tensor:
    """Per-row ``sum_j P_j (x_j - z_j)`` over the valid columns, ``P = exp(scale * x - lse)`` (the folded full
    KL's sums, `lmloss.kernels`): fp32 ``[c]``. `x`, `z`: ``[c, V_local]`` of any float dtypes, unit column
    stride; `lse` ``[c]`` fp32; no softcap."""
    check_rows("x", x, _FLOATS)
    check_rows("z", z, _FLOATS)
    if z.shape != x.shape:
        raise ValueError(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if math.softcap:
        raise ValueError("difference_sums takes no softcap")
    rows = x.shape[0]
    lse = row_vector("lse", lse, rows, (torch.float32,))
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    block, warps = block_for(math.valid, FORWARD_BLOCKS, block_v)
    values, flags = math_args(math, x)
    with device_guard(x):
        _difference_sums_kernel[(rows,)](
            x, x.stride(0), z, z.stride(0), lse, out, math.valid, values[0], SCALE=flags["SCALE"], BLOCK_V=block,
            ALIGN=alignment(x, z), FAST=flags["FAST"], num_warps=warps,
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
    grad_scale: torch.Tensor | None = None,
    block_v: int | None = None,
    programs: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Per-row cross-entropy of a chunk and, in the same kernel, the gradient of their sum (times
    `grad_scale`) written into `out`.

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
        grad_scale: one-element fp32 tensor on x's device multiplying the gradient (``1 / count`` for a mean,
            read by the kernel: no host sync); None for 1.
        block_v, num_warps: overrides of `cross_entropy_config`'s (block_v a power of 2).
        programs: size of the persistent grid (each program walks rows p, p + programs, ...); default
            `cross_entropy_config`'s programs per SM on CUDA.

    Returns:
        fp32 ``[c, 2]``: (lse, loss) per row, both 0 for ignored rows.
    """
    check_rows("x", x, _FLOATS)
    check_rows("out", out, _FLOATS)
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
    labels = row_vector("labels", labels, rows, _INTS)
    if grad_scale is None:
        grad_scale = torch.ones((), dtype=torch.float32, device=x.device)
    elif grad_scale.numel() != 1 or grad_scale.device != x.device:
        raise ValueError(f"grad_scale must be one element on {x.device}, got {tuple(grad_scale.shape)}")
    grad_scale = grad_scale.reshape(()).to(torch.float32)
    res = torch.empty(rows, 2, dtype=torch.float32, device=x.device)
    if rows == 0:
        return res
    block, warps, per_sm = cross_entropy_config(n_cols, bool(math.softcap))
    if block_v is not None:
        block = block_for(n_cols, CROSS_ENTROPY_BLOCKS, block_v)[0]
    warps = num_warps or warps
    if programs is None:
        programs = _programs(x.device) // 4 * per_sm
    values, flags = math_args(math, x)
    with device_guard(x):
        _cross_entropy_loss_grad_kernel[(max(1, min(rows, programs)),)](
            x, x.stride(0), out, out.stride(0), labels, res, grad_scale, rows, n_cols, vocab_size,
            int(ignore_index), *values, float(label_smoothing), float(z_loss), 1.0 / vocab_size,
            SMOOTHING=label_smoothing > 0, Z_LOSS=z_loss > 0, BLOCK_V=block, ALIGN=alignment(x, out),
            num_warps=warps, **flags,
        )  # fmt: skip
    return res


# Contract: t[i] *= factor for i < n, where factor is read on the device; a grid of a few programs per SM walks
# the blocks. When factor is exactly 1.0 the walk is empty: each program reads the factor and exits, nothing
# of t is loaded or stored (the backward of loss.backward() moves no bytes).
@triton.jit
def _scale_kernel(t_ptr, n, factor_ptr, BLOCK: tl.constexpr):
    f = tl.load(factor_ptr).to(tl.float32)
    n_scaled = tl.where(f != 1.0, n, 0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n_scaled, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_scaled
        t = tl.load(t_ptr + offs, mask=mask)
        tl.store(t_ptr + offs, (t.to(tl.float32) * f).to(t_ptr.dtype.element_ty), mask=mask)


def scale_by_device_scalar_(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``t *= factor`` for a contiguous float `t` and a 0-d `factor` on its device, with no host sync; nothing
    of `t` is read or written when ``factor == 1.0``. Returns `t`."""
    if not t.is_contiguous() or t.dtype not in _FLOATS:
        raise ValueError(f"t must be contiguous with dtype in {_FLOATS}, got {t.dtype}")
    if factor.numel() != 1 or factor.device != t.device:
        raise ValueError(f"factor must be one element on {t.device}, got {tuple(factor.shape)} on {factor.device}")
    n = t.numel()
    if n:
        block = 4096
        with device_guard(t):
            grid = min(triton.cdiv(n, block), _programs(t.device))
            _scale_kernel[(grid,)](t, n, factor.reshape(()), BLOCK=block, num_warps=4)
    return t


# Contract: dst[i] = src[i] * factor for i < n, computed in fp32 and rounded once to dst's dtype; factor read on
# the device. One read of src, one write of dst: the fp32 weight-gradient accumulator becomes the weight's
# bf16 gradient in one pass (PyTorch's mixed-dtype mul with out= takes a non-vectorized path, ~3x slower
# on an H200 for [128256, 4096]).
@triton.jit
def _scaled_cast_kernel(src_ptr, dst_ptr, n, factor_ptr, BLOCK: tl.constexpr):
    f = tl.load(factor_ptr).to(tl.float32)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        t = tl.load(src_ptr + offs, mask=mask, eviction_policy="evict_first")
        tl.store(dst_ptr + offs, (t.to(tl.float32) * f).to(dst_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def scaled_cast_by_device_scalar(src: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(src * factor).to(dtype)`` for a contiguous float `src` and a 0-d `factor` on its device, in one
    pass and with no host sync (the product in fp32, rounded once). Returns a new contiguous tensor."""
    if not src.is_contiguous() or src.dtype not in _FLOATS or dtype not in _FLOATS:
        raise ValueError(f"src must be contiguous, src and dtype in {_FLOATS}; got {src.dtype} -> {dtype}")
    if factor.numel() != 1 or factor.device != src.device:
        raise ValueError(f"factor must be one element on {src.device}, got {tuple(factor.shape)} on {factor.device}")
    dst = torch.empty(src.shape, dtype=dtype, device=src.device)
    n = src.numel()
    if n:
        block = 4096
        with device_guard(src):
            grid = min(triton.cdiv(n, block), _programs(src.device))
            _scaled_cast_kernel[(grid,)](src, dst, n, factor.reshape(()), BLOCK=block, num_warps=8)
    return dst


class TritonKernels:
    """The two kernels behind the interface the chunk loop calls (`lmloss.plan`); holds no scratch.

    `overwrite` and `uniform_term` are hints the PyTorch reference uses to save passes; the kernels
    need neither (they keep no chunk-sized temporaries and test each row's coefficients themselves).
    """

    name = "triton"

    def softmax_partials(
        self, x, labels, math, *, entropy, target, sum_logits, sum_sq=False, argmax=False, overwrite=False,
        keep_min=None, kept_exps=None, live=None, difference_into=None,
    ):  # fmt: skip
        """`kept_exps` (the threshold search's exps) is not used: the kernel's one pass makes its own. `live`:
        the rows that count; the others are not read (`softmax_partials`). `difference_into` is not used: the
        folded gradient kernel reads both chunks as they are."""
        return softmax_partials(
            x, labels, math, entropy=entropy, target=target, sum_logits=sum_logits, keep_min=keep_min, live=live,
            sum_sq=sum_sq, argmax=argmax,
        )  # fmt: skip

    def block_partials(
        self, x, labels, math, *, entropy, target, sum_logits, argmax=False, keep_min=None, kept_exps=None,
        block=INVARIANT_BLOCK, global_max=None, overwrite=False,
    ):  # fmt: skip
        """The invariant mode's block sums (`block_partials`): each block shifted by its own max, in the one
        pass over the chunk (`global_max` and `kept_exps` are not used). `block` 1 (a replayed support's
        slots, already transformed: one value per block, nothing to reduce) runs the PyTorch reference's."""
        if block != INVARIANT_BLOCK:
            from lmloss.kernels.torch_ref import TorchKernels

            return TorchKernels(x.shape[0], x.shape[1], x.device).block_partials(
                x, labels, math, entropy=entropy, target=target, sum_logits=sum_logits, keep_min=keep_min, block=block,
                global_max=global_max, argmax=argmax,
            )  # fmt: skip
        return block_partials(x, labels, math, entropy=entropy, target=target, sum_logits=sum_logits, keep_min=keep_min,
                              argmax=argmax)  # fmt: skip

    def softmax_grad_(self, x, labels, lse, entropy, coef, math, out, *, uniform_term=True, keep_min=None):
        return softmax_grad_(x, labels, lse, entropy, coef, math, out, keep_min=keep_min)

    def can_fold_difference(self, x, z, z_is_scratch: bool) -> bool:
        """The folded gradient reads both chunks as they are (any float dtypes) and writes neither."""
        return True

    def softmax_grad_with_difference_(self, x, labels, z, lse, math, finish, out, *, uniform_term=True):
        """The contract's folded gradient (`lmloss.kernels`): the sums ``sum P (x - z)`` (one kernel reading x
        and z), ``coef, z_coef, entropy = finish(sums)``, then `softmax_grad_` with the difference term (the
        gradient kernel reads z beside x). Returns the sums; `z` is not written."""
        sums = difference_sums(x, z, lse.to(torch.float32), math)
        coef, z_coef, entropy = finish(sums)
        softmax_grad_(x, labels, lse.to(torch.float32), None if entropy is None else entropy.to(torch.float32),
                      coef.to(torch.float32), math, out, difference=(z, z_coef.to(torch.float32)))  # fmt: skip
        return sums

    def partials_then_grad_(
        self, x, labels, math, flags, finish, out, *, uniform_term=True, keep_min=None, live=None
    ):  # fmt: skip
        """Partials, then ``finish(partials) -> (result, coef, lse[, entropy])`` (TP combine, output math),
        then the gradient into `out` (which may be `x`). Returns ``(result, out)``. A row that does not count
        (`live` False; its coefficients are 0) is read by neither kernel."""
        result, coef, lse, *rest = finish(softmax_partials(x, labels, math, **flags, keep_min=keep_min, live=live))
        entropy = rest[0] if rest else None
        return result, softmax_grad_(x, labels, lse, entropy, coef, math, out, keep_min=keep_min)

    def loss_and_grad_(
        self, x, labels, math, *, ignore_index, label_smoothing, z_loss, vocab_size, out, grad_scale=None
    ) -> dict[str, torch.Tensor]:
        """The single-process scalar-loss chunk in one kernel (`cross_entropy_loss_and_grad_`): returns
        ``{"lse": [c], "loss": [c]}`` fp32 (0 for ignored rows) and writes ``grad_scale`` d(sum of losses)/dx
        into `out`."""
        res = cross_entropy_loss_and_grad_(
            x, labels, math, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
            vocab_size=vocab_size, out=out, grad_scale=grad_scale,
        )  # fmt: skip
        return {"lse": res[:, 0], "loss": res[:, 1]}
