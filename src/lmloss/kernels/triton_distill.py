"""Triton implementation of the two-distribution (student / teacher) chunk math (contract in `lmloss.kernels`).

CUDA; tested on the CPU under ``TRITON_INTERPRET=1``. For chunks ``xs``, ``xt`` ``[c, V_local]`` (fp32 / bf16 /
fp16, ``stride(1) == 1``) and their global log-sum-exps ``lse [c, 2]`` fp32:

- ``divergence_partials``: one program per row walks the valid columns in ``BLOCK_V`` blocks, reading each
  row of both chunks once, and writes the row's two partial sums.
- ``divergence_grad_``: a 2-D grid (row, vocabulary block); each program reads its block of both chunks
  once and writes its block of the gradient once, so ``out`` may be ``xs`` (the fused path's chunk).

The statistics (``lse``) come from the single-distribution kernels (`lmloss.kernels.triton_kernels`), so
``lse=None`` (a row's own log-softmax) is not supported here: `normalises_rows` is False.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lmloss.kernels import ChunkMath
from lmloss.kernels.triton_kernels import TritonKernels, math_args, transform

#: (largest V, BLOCK_V, num_warps): the first row whose V fits wins; BLOCK_V is capped at next_pow2(V).
BLOCKS: tuple[tuple[float, int, int], ...] = ((1024, 1024, 4), (float("inf"), 4096, 8))
_MODES = {"forward": 0, "reverse": 1, "jsd": 2}


def _mode(beta: float) -> int:
    return _MODES["forward"] if beta == 0.0 else _MODES["reverse"] if beta == 1.0 else _MODES["jsd"]


@triton.jit
def _log_probs(xs_row, xt_row, cols, mask, scale, inv_cap, cap_scale, lse_s, lse_t, SCALE: tl.constexpr,
               SOFTCAP: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    # ls = scale * softcap(xs) - lse_s (the student's transform, `transform`), lt = scale * xt - lse_t (the
    # teacher comes capped by its source) over the columns in `mask`; -inf elsewhere (probability 0). th:
    # tanh(xs / cap) for the gradient's softcap slope.
    ys, th = transform(tl.load(xs_row + cols, mask=mask, other=0.0), scale, inv_cap, cap_scale, SCALE, SOFTCAP, FAST)
    yt = tl.load(xt_row + cols, mask=mask, other=0.0).to(tl.float32)
    ls = tl.where(mask, ys - lse_s, -float("inf"))
    lt = tl.where(mask, yt * scale - lse_t, -float("inf"))
    return ls, lt, th


@triton.jit
def _log_mixture(ls, lt, log1m_beta, log_beta):
    # log((1 - beta) p_s + beta p_t) as a logaddexp; -inf where both are -inf
    a = ls + log1m_beta
    b = lt + log_beta
    hi = tl.maximum(a, b)
    ref = tl.where(hi == -float("inf"), 0.0, hi)
    return ref + tl.log(tl.exp(a - ref) + tl.exp(b - ref))


# Contract: out[row, 0:2] (fp32) = the per-row sums of `lmloss.kernels` for MODE 0 (forward KL), 1 (reverse
# KL), 2 (generalized JSD); a term whose weighting probability is 0 adds exactly 0.
@triton.jit
def _divergence_partials_kernel(
    xs_ptr, xs_stride, xt_ptr, xt_stride, lse_ptr, out_ptr, valid, scale, inv_cap, cap_scale, log1m_beta, log_beta,
    MODE: tl.constexpr, BLOCK_V: tl.constexpr, SCALE: tl.constexpr, SOFTCAP: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    xs_row, xt_row = xs_ptr + row * xs_stride, xt_ptr + row * xt_stride
    lse_s = tl.load(lse_ptr + row * 2)
    lse_t = tl.load(lse_ptr + row * 2 + 1)
    acc0 = 0.0
    acc1 = 0.0
    for start in range(0, valid, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ls, lt, _ = _log_probs(xs_row, xt_row, cols, cols < valid, scale, inv_cap, cap_scale, lse_s, lse_t,
                               SCALE, SOFTCAP, FAST)  # fmt: skip
        ps = tl.exp(ls)
        pt = tl.exp(lt)
        if MODE == 0:
            acc0 += tl.sum(tl.where(pt > 0, pt * (lt - ls), 0.0), 0)
        elif MODE == 1:
            acc0 += tl.sum(tl.where(ps > 0, ps * (ls - lt), 0.0), 0)
        else:
            lm = _log_mixture(ls, lt, log1m_beta, log_beta)
            acc0 += tl.sum(tl.where(pt > 0, pt * (lt - lm), 0.0), 0)
            acc1 += tl.sum(tl.where(ps > 0, ps * (ls - lm), 0.0), 0)
    tl.store(out_ptr + row * 2, acc0)
    tl.store(out_ptr + row * 2 + 1, acc1)


# Contract: program (row, block) reads its block of xs and xt once and writes out[row, block] once (out may be
# xs). coef[row] = (w, S): out = w * scale * g with g = p_s - p_t (MODE 0), p_s (ls - lt - S) (MODE 1),
# p_s ((1 - beta)(ls - log m) - S) (MODE 2); rows with w == 0 and padded columns get exactly 0, reading no x.
@triton.jit
def _divergence_grad_kernel(
    xs_ptr, xs_stride, xt_ptr, xt_stride, lse_ptr, coef_ptr, out_ptr, out_stride, valid, n_cols, scale,
    inv_cap, cap_scale, one_minus_beta, log1m_beta, log_beta, MODE: tl.constexpr, BLOCK_V: tl.constexpr,
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    w = tl.load(coef_ptr + row * 2)
    subtract = tl.load(coef_ptr + row * 2 + 1)
    mask = cols < tl.where(w != 0, valid, 0)  # an inactive row reads nothing
    lse_s = tl.load(lse_ptr + row * 2)
    lse_t = tl.load(lse_ptr + row * 2 + 1)
    ls, lt, th = _log_probs(xs_ptr + row * xs_stride, xt_ptr + row * xt_stride, cols, mask, scale, inv_cap,
                            cap_scale, lse_s, lse_t, SCALE, SOFTCAP, FAST)  # fmt: skip
    ps = tl.exp(ls)
    if MODE == 0:
        g = ps - tl.exp(lt)
    elif MODE == 1:
        g = tl.where(ps > 0, ps * (ls - lt - subtract), 0.0)
    else:
        lm = _log_mixture(ls, lt, log1m_beta, log_beta)
        g = tl.where(ps > 0, ps * (one_minus_beta * (ls - lm) - subtract), 0.0)
    if SOFTCAP:
        g = g * (1.0 - th * th)
    g = tl.where(mask, g * (w * scale), 0.0)
    tl.store(out_ptr + row * out_stride + cols, g.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


def _block(n_cols: int, block_v: int | None) -> tuple[int, int]:
    if block_v is not None:
        return block_v, 4
    for limit, block, warps in BLOCKS:
        if n_cols <= limit:
            return min(block, max(16, triton.next_power_of_2(max(n_cols, 1)))), warps
    raise AssertionError("the last row of BLOCKS must have limit inf")


def _check(xs: torch.Tensor, xt: torch.Tensor, lse: torch.Tensor | None) -> None:
    if lse is None:
        raise ValueError("the Triton divergence kernels need lse (they do not normalise rows themselves)")
    for name, x in (("xs", xs), ("xt", xt)):
        if x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"{name} must be [c, V] with unit column stride, got stride {tuple(x.stride())}")


class TritonDistillKernels(TritonKernels):
    """The Triton kernels of one pass: the single-distribution contract (`TritonKernels`) and the
    two-distribution one. `block_v` overrides the two-distribution block table (tests use a small one so
    that rows span several blocks)."""

    normalises_rows = False

    def __init__(self, block_v: int | None = None) -> None:
        self.block_v = block_v

    def _params(self, beta: float):
        log1m = math.log1p(-beta) if beta < 1.0 else -math.inf
        log_b = math.log(beta) if beta > 0.0 else -math.inf
        return _mode(beta), log1m, log_b

    def divergence_partials(self, xs, xt, lse, math_: ChunkMath, beta: float, *, overwrite=False):
        _check(xs, xt, lse)
        rows = xs.shape[0]
        out = torch.zeros((rows, 2), dtype=torch.float32, device=xs.device)
        if rows == 0 or math_.valid == 0:
            return out
        mode, log1m, log_b = self._params(beta)
        block, warps = _block(math_.valid, self.block_v)
        lse = lse.to(torch.float32).contiguous()
        values, flags = math_args(math_, xs)
        _divergence_partials_kernel[(rows,)](
            xs, xs.stride(0), xt, xt.stride(0), lse, out, math_.valid, *values, log1m, log_b,
            MODE=mode, BLOCK_V=block, num_warps=warps, **flags,
        )  # fmt: skip
        return out

    def divergence_grad_(self, xs, xt, lse, coef, math_: ChunkMath, beta: float, out, *, overwrite=False):
        _check(xs, xt, lse)
        rows, n_cols = out.shape
        if rows == 0 or n_cols == 0:
            return out
        if out.stride(1) != 1:
            raise ValueError("out must have unit column stride")
        mode, log1m, log_b = self._params(beta)
        block, warps = _block(n_cols, self.block_v)
        lse = lse.to(torch.float32).contiguous()
        coef = coef.to(torch.float32).contiguous()
        values, flags = math_args(math_, xs)
        _divergence_grad_kernel[(rows, triton.cdiv(n_cols, block))](
            xs, xs.stride(0), xt, xt.stride(0), lse, coef, out, out.stride(0), math_.valid, n_cols, *values,
            1.0 - beta, log1m, log_b, MODE=mode, BLOCK_V=block, num_warps=warps, **flags,
        )  # fmt: skip
        return out

    def divergence_partials_then_grad_(self, xs, xt, lse, math_: ChunkMath, beta: float, finish, out, *,
                                       overwrite=False):  # fmt: skip
        result, coef = finish(self.divergence_partials(xs, xt, lse, math_, beta))
        self.divergence_grad_(xs, xt, lse, coef, math_, beta, out)
        return result
