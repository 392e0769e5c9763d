"""Triton kernels of the kept set's threshold search (`lmloss.sampling.keep_thresholds_by_kernels`).

CUDA; tested on the CPU under ``TRITON_INTERPRET=1``. For a chunk of logits ``x [c, V_local]`` (fp32 / bf16 /
fp16, ``x.stride(1) == 1``) and no softcap, ``y = scale * x`` in fp32 (the product the PyTorch kernels and the
PyTorch search round alike; ``scale > 0``, so y's order is x's). Each kernel walks a row as the softmax kernels do
(one program per row: an unmasked main loop of 16-byte loads from the row's first aligned column, one masked edge
block) and reads it once; the search's small per-row work (crossing bins, sorting a few candidates, float64 sums)
stays in PyTorch. The kept-so-far set comes as a threshold on the logits (``x >= lo``, as the softmax kernels
take it) and the kernels never form y but for the candidates they return.

Bins (`bins_of`), ``NBINS`` per row, both monotone in x (a larger x never gets a smaller bin):

- ``MODE_KEY``: the top 11 bits of x's order-preserving integer key (sign, exponent, two mantissa bits: a
  quarter of a binary octave of |x|); needs nothing but x (top-k alone: no row max first).
- ``MODE_MASS``: the exponent and 5 leading mantissa bits of ``e = exp(y - shift)``, made as ``exp2(x * scale
  * log2(e) - shift * log2(e))`` (``shift``: the row's global max of y, so ``e <= 1``): 32 bins per halving of the
  probability, the 64 octaves below 1 (bin 0 lumps everything below ``2**-63``, the top bin takes ``e = 1``).

``histogram(x, math, lo, shift, mode) -> (counts [c, NBINS] int32, mass [c] fp32)``: per row, the count of the
columns with ``x >= lo[row]`` in each bin and (``MODE_MASS``) their mass ``sum e``.

``candidates(x, math, lo, shift, bin_lo, bin_hi, width, mode) -> (values [c, width] fp32, count [c] int32,
above [c] fp32)``: per row the y of the columns with ``x >= lo`` whose bin is in ``[bin_lo, bin_hi]``, in no
particular order, -inf padded (at most `width` kept; `count` counts them all), how many there were, and
(``MODE_MASS``) the mass ``sum e`` of those with ``x >= lo`` in the bins above ``bin_hi``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmloss.kernels import ChunkMath
from lmloss.kernels.triton_kernels import (
    FORWARD_BLOCKS,
    alignment,
    block_for,
    check_rows,
    device_guard,
    edge_cols,
    fast_exp2,
    math_args,
    row_split,
    row_vector,
)

NBINS = 2048
MODE_KEY, MODE_MASS = 0, 1
#: ``MODE_MASS``: mantissa bits of e per bin and the bin id of e's bits shifted right by `MASS_SHIFT`
#: (``2**-64`` is ``(127 - 64) << 23`` before the shift): bin = (bits >> MASS_SHIFT) - MASS_LOWEST, clamped.
MASS_MANTISSA_BITS = 5
MASS_SHIFT = 23 - MASS_MANTISSA_BITS
MASS_LOWEST = (127 - 64) << MASS_MANTISSA_BITS
#: ``MODE_KEY``: the key's bits below the 11 that make the bin.
KEY_SHIFT = 21
#: `_histogram_kernel` counts with ``tl.histogram`` where Triton lowers it to shared-memory atomics (3.9 does:
#: a few instructions per element whatever the bins); before that (3.6) it lowers to warp ballots whose cost
#: grows with the bins (~240 SASS instructions per element at 2048 bins, ~45x one read on an H200), and the
#: kernel adds one relaxed global atomic per column instead (~9x / ~19x the read on an H200 by key / mass).
HISTOGRAM_IN_SHARED = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 9)


@triton.jit
def bins_of(x, k2, shift2, MODE: tl.constexpr, FAST: tl.constexpr):
    """Each element's bin (int32 in [0, NBINS)) and, in MODE_MASS, e = exp(y - shift) = exp2(x k2 - shift2) with
    k2 = scale * log2(e), shift2 = shift * log2(e) (one FFMA, one ex2)."""
    if MODE == 0:
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # order-preserving: signed compares of keys = of floats
        return (key >> 21) + 1024, x
    else:
        e = fast_exp2(x * k2 - shift2, FAST)
        b = (e.to(tl.int32, bitcast=True) >> 18) - 2016
        return tl.minimum(tl.maximum(b, 0), 2047), e


@triton.jit
def _count_block(x, inside, counts, counts_row, mass, k2, shift2, MODE: tl.constexpr, NB: tl.constexpr,
                 FAST: tl.constexpr, SHARED: tl.constexpr):  # fmt: skip
    """A block of a row into its histogram (`_histogram_kernel`): the bins of the columns `inside` counted,
    by tl.histogram into `counts` (SHARED) or by relaxed atomics into the row's bins at `counts_row`, and in
    MODE_MASS their e summed into `mass`. Returns (counts, mass)."""
    b, e = bins_of(x, k2, shift2, MODE, FAST)
    if SHARED:
        counts += tl.histogram(b, NB, mask=inside)
    else:
        tl.atomic_add(counts_row + b, 1, mask=inside, sem="relaxed")
    if MODE == 1:
        mass += tl.where(inside, e, 0.0)
    return counts, mass


# Contract: see the module docstring (`histogram`). One program per row; columns [0, valid) of x are vocabulary.
@triton.jit
def _histogram_kernel(
    x_ptr, x_row_stride, lo_ptr, shift_ptr, counts_ptr, mass_ptr, valid, scale,
    SCALE: tl.constexpr, MODE: tl.constexpr, NB: tl.constexpr, BLOCK_V: tl.constexpr, ALIGN: tl.constexpr,
    FAST: tl.constexpr, SHARED: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_start = row * x_row_stride
    lo = tl.load(lo_ptr + row)
    k2 = 1.4426950408889634 * (scale if SCALE else 1.0)
    shift2 = 0.0
    if MODE == 1:
        shift2 = tl.load(shift_ptr + row) * 1.4426950408889634
    head, n_main = row_split(row_start, valid, ALIGN, BLOCK_V)
    x_main = x_ptr + tl.multiple_of(row_start + head, ALIGN)
    offs = tl.arange(0, BLOCK_V)
    # SHARED: tl.histogram (`HISTOGRAM_IN_SHARED`); else the row's bins in global memory (zeroed by the wrapper),
    # one relaxed atomic per kept column, a cost that does not grow with NB. Integer sums either way: the
    # counts are exact and the same in any order.
    counts_row = counts_ptr + row * NB
    counts = tl.zeros([NB], tl.int32)
    mass = tl.zeros([BLOCK_V], tl.float32)
    for k in range(0, n_main, BLOCK_V):
        x = tl.load(x_main + k + offs).to(tl.float32)
        counts, mass = _count_block(x, x >= lo, counts, counts_row, mass, k2, shift2, MODE, NB, FAST, SHARED)
    n_edge = valid - n_main
    for e0 in range(0, n_edge, BLOCK_V):
        j = e0 + offs
        x = tl.load(x_ptr + row_start + edge_cols(j, head, n_main), mask=j < n_edge, other=0.0).to(tl.float32)
        inside = (j < n_edge) & (x >= lo)
        counts, mass = _count_block(x, inside, counts, counts_row, mass, k2, shift2, MODE, NB, FAST, SHARED)
    if SHARED:
        tl.store(counts_row + tl.arange(0, NB), counts)
    tl.store(mass_ptr + row, tl.sum(mass, 0))


@triton.jit
def _order_bits(x, k2, shift2, MODE: tl.constexpr, FAST: tl.constexpr):
    """Int32 bits that order the elements as their bins do (`bins_of`: a bin is a range of them), and e."""
    if MODE == 0:
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), x
    else:
        e = fast_exp2(x * k2 - shift2, FAST)
        return e.to(tl.int32, bitcast=True), e


# Contract: see the module docstring (`candidates`). One program per row; a column is picked when its `_order_bits`
# lie in [bits_lo, bits_hi] (the window's bins, made per row by the wrapper). Picked columns take the row's next
# free slots by atomics (rare: the blocks that hold the window), at most `width` kept; the common path is compares
# and one block reduction per step.
@triton.jit
def _candidates_kernel(
    x_ptr, x_row_stride, lo_ptr, shift_ptr, bits_ptr, values_ptr, count_ptr, above_ptr, valid, width, scale,
    SCALE: tl.constexpr, MODE: tl.constexpr, BLOCK_V: tl.constexpr, ALIGN: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_start = row * x_row_stride
    lo = tl.load(lo_ptr + row)
    bits_lo = tl.load(bits_ptr + row * 2)
    bits_hi = tl.load(bits_ptr + row * 2 + 1)
    k2 = 1.4426950408889634 * (scale if SCALE else 1.0)
    shift2 = 0.0
    if MODE == 1:
        shift2 = tl.load(shift_ptr + row) * 1.4426950408889634
    head, n_main = row_split(row_start, valid, ALIGN, BLOCK_V)
    x_main = x_ptr + tl.multiple_of(row_start + head, ALIGN)
    out_row = values_ptr + row * width
    counter = count_ptr + row + tl.zeros([BLOCK_V], tl.int32)
    offs = tl.arange(0, BLOCK_V)
    above = tl.zeros([BLOCK_V], tl.float32)
    for k in range(0, n_main, BLOCK_V):
        x = tl.load(x_main + k + offs).to(tl.float32)
        inside = x >= lo
        q, e = _order_bits(x, k2, shift2, MODE, FAST)
        if MODE == 1:
            above += tl.where(inside & (q > bits_hi), e, 0.0)
        pick = inside & (q >= bits_lo) & (q <= bits_hi)
        if tl.max(pick.to(tl.int32), 0) > 0:  # rare: a few steps of a row hold the window's columns
            slot = tl.atomic_add(counter, 1, mask=pick)
            tl.store(out_row + slot, x * scale if SCALE else x, mask=pick & (slot < width))
    n_edge = valid - n_main
    for e0 in range(0, n_edge, BLOCK_V):
        j = e0 + offs
        x = tl.load(x_ptr + row_start + edge_cols(j, head, n_main), mask=j < n_edge, other=0.0).to(tl.float32)
        inside = (j < n_edge) & (x >= lo)
        q, e = _order_bits(x, k2, shift2, MODE, FAST)
        if MODE == 1:
            above += tl.where(inside & (q > bits_hi), e, 0.0)
        pick = inside & (q >= bits_lo) & (q <= bits_hi)
        slot = tl.atomic_add(counter, 1, mask=pick)
        tl.store(out_row + slot, x * scale if SCALE else x, mask=pick & (slot < width))
    tl.store(above_ptr + row, tl.sum(above, 0))


def _check(x: torch.Tensor, math: ChunkMath, lo: torch.Tensor, shift: torch.Tensor | None, mode: int):
    check_rows("x", x, (torch.float32, torch.bfloat16, torch.float16))
    if math.softcap:
        raise ValueError("the Triton threshold search takes no softcap (the PyTorch search handles it)")
    if mode not in (MODE_KEY, MODE_MASS):
        raise ValueError(f"mode must be MODE_KEY or MODE_MASS, got {mode}")
    rows = x.shape[0]
    lo = row_vector("lo", lo, rows, (torch.float32,))
    if mode == MODE_MASS:
        if shift is None:
            raise ValueError("MODE_MASS needs the rows' shift (their global max)")
        shift = row_vector("shift", shift, rows, (torch.float32,))
    return rows, lo, lo if shift is None else shift


def histogram(
    x: torch.Tensor, math: ChunkMath, lo: torch.Tensor, shift: torch.Tensor | None, mode: int, *,
    block_v: int | None = None, shared: bool = HISTOGRAM_IN_SHARED,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per row, the count of the valid columns with ``x >= lo`` in each of the `NBINS` bins of `mode`, and in
    ``MODE_MASS`` their mass ``sum exp(y - shift)`` (module docstring): ``(int32 [c, NBINS], fp32 [c])``.
    `block_v`: the vocabulary block (a power of 2; default from ``FORWARD_BLOCKS``); `shared`: count with
    ``tl.histogram`` rather than global atomics (`HISTOGRAM_IN_SHARED`; the counts are the same)."""
    rows, lo, shift = _check(x, math, lo, shift, mode)
    counts = torch.zeros((rows, NBINS), dtype=torch.int32, device=x.device)
    mass = torch.zeros(rows, dtype=torch.float32, device=x.device)
    if rows == 0 or math.valid == 0:
        return counts, mass
    block, warps = block_for(math.valid, FORWARD_BLOCKS, block_v)
    values, flags = math_args(math, x)
    with device_guard(x):
        _histogram_kernel[(rows,)](
            x, x.stride(0), lo, shift, counts, mass, math.valid, values[0], SCALE=flags["SCALE"], MODE=mode,
            NB=NBINS, BLOCK_V=block, ALIGN=alignment(x), FAST=flags["FAST"], SHARED=shared, num_warps=warps,
        )  # fmt: skip
    return counts, mass


def candidates(
    x: torch.Tensor, math: ChunkMath, lo: torch.Tensor, shift: torch.Tensor | None, bin_lo: torch.Tensor,
    bin_hi: torch.Tensor, width: int, mode: int, *, block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per row the y of the valid columns with ``x >= lo`` whose bin lies in ``[bin_lo, bin_hi]`` (fp32 ``[c,
    width]``, unordered, -inf padded), their count (int32 ``[c]``; more than `width` are counted, not kept) and
    in ``MODE_MASS`` the mass of the columns with ``x >= lo`` in the bins above ``bin_hi`` (fp32 ``[c]``)."""
    rows, lo, shift = _check(x, math, lo, shift, mode)
    bin_lo = row_vector("bin_lo", bin_lo, rows, (torch.int32,))
    bin_hi = row_vector("bin_hi", bin_hi, rows, (torch.int32,))
    width = max(int(width), 1)
    values = torch.full((rows, width), float("-inf"), dtype=torch.float32, device=x.device)
    count = torch.zeros(rows, dtype=torch.int32, device=x.device)
    above = torch.zeros(rows, dtype=torch.float32, device=x.device)
    if rows == 0 or math.valid == 0:
        return values, count, above
    block, warps = block_for(math.valid, FORWARD_BLOCKS, block_v)
    scale, flags = math_args(math, x)
    with device_guard(x):
        _candidates_kernel[(rows,)](
            x, x.stride(0), lo, shift, window_bits(bin_lo, bin_hi, mode), values, count, above, math.valid, width,
            scale[0], SCALE=flags["SCALE"], MODE=mode, BLOCK_V=block, ALIGN=alignment(x), FAST=flags["FAST"],
            num_warps=warps,
        )  # fmt: skip
    return values, count, above


def window_bits(bin_lo: torch.Tensor, bin_hi: torch.Tensor, mode: int) -> torch.Tensor:
    """int32 ``[c, 2]``: the inclusive range of the kernels' ordering bits (`_order_bits`: x's order-preserving key,
    or e's bits) whose bin lies in ``[bin_lo, bin_hi]`` (empty where ``bin_lo > bin_hi``); the end bins extend to
    every value they take (bin 0 and the top bin clamp in MODE_MASS)."""
    lo, hi = bin_lo.long(), bin_hi.long()
    if mode == MODE_KEY:
        first, last = (lo - 1024) << KEY_SHIFT, ((hi - 1023) << KEY_SHIFT) - 1
    else:
        first = torch.where(lo <= 0, -(2**31), (lo + MASS_LOWEST) << MASS_SHIFT)
        last = torch.where(hi >= NBINS - 1, 2**31 - 1, ((hi + 1 + MASS_LOWEST) << MASS_SHIFT) - 1)
    empty = lo > hi
    first = torch.where(empty, 2**31 - 1, first).clamp(-(2**31), 2**31 - 1)
    last = torch.where(empty, -(2**31), last).clamp(-(2**31), 2**31 - 1)
    return torch.stack([first, last], dim=1).to(torch.int32).contiguous()


def mass_bin_bounds(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[NBINS]`` (low, high) of the ``MODE_MASS`` bins: ``low <= e < high`` (the top bin: ``e <= 1``;
    bin 0 from 0)."""
    ids = torch.arange(NBINS + 1, dtype=torch.int64, device=device) + MASS_LOWEST
    edges = (ids << MASS_SHIFT).to(torch.int32).view(torch.float32).double()
    low, high = edges[:-1].clone(), edges[1:].clone()
    low[0] = 0.0
    high[-1] = 1.0
    return low, high
