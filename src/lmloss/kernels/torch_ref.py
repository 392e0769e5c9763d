"""The PyTorch reference of the per-chunk softmax math (contract in `lmloss.kernels`).

Written as a few whole-chunk PyTorch ops over one reused scratch buffer per role: on CPU a fresh
``[chunk, V]`` tensor costs its page faults every time (about 80 ms per 125 MiB on 2 cores, more than
the math on it), so `ChunkScratch` allocates each buffer once per pass. float64 chunks are computed in
float64 (``gradcheck`` holds); every other dtype in fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import torch

from lmloss.kernels import INVARIANT_BLOCK, BlockPartials, ChunkMath, ChunkScratch, compute_dtype

_FP32_MIN = torch.finfo(torch.float32).min


@contextlib.contextmanager
def serial_row_reductions(rows: int, device: torch.device) -> Iterator[None]:
    """Reduce each row on one thread when a chunk has fewer rows than intra-op threads.

    Given enough rows, torch's CPU reductions hand whole rows to threads and sum each row in one fixed
    order; with fewer rows than threads they split a row across threads and round differently. Forcing
    the serial order keeps fp32 results bit-identical for every chunk size (a tail chunk of one row
    included).
    """
    if torch.compiler.is_compiling() or device.type != "cpu":
        yield  # a compiled graph has its own reduction order
        return
    threads = torch.get_num_threads()
    if rows >= threads or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Run a block of small ops (``[c]``, ``[c, blocks]``) on one CPU thread: on a busy machine each parallel
    op waits for its pool's threads to be scheduled, milliseconds per op, far more than their work."""
    if device.type != "cpu" or torch.compiler.is_compiling() or torch.get_num_threads() == 1:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def transform_into(
    out: torch.Tensor,
    x: torch.Tensor,
    math: ChunkMath,
    *,
    aliased: bool = False,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = scale * softcap(x) - shift[:, None]`` in out's dtype (fp32 / fp64), the same rounding in
    every pass. `aliased`: `out` is `x`'s memory.

    Each elementwise pass over a chunk costs about as much as its math on CPU, so the common cases take
    one pass (``torch.sub(x, shift, out=out)``) or two. Low-precision `x` is upcast first: scaling in
    bf16 / fp16 would round ``x * scale`` to that dtype, and mixed-dtype ops with ``out=fp32`` take a
    slow path on CPU.
    """
    same_dtype = x.dtype == out.dtype
    if not aliased and same_dtype and not math.softcap:
        if math.scale == 1.0:
            return out.copy_(x) if shift is None else torch.sub(x, shift[:, None], out=out)
        torch.mul(x, math.scale, out=out)
    else:
        if not aliased:
            out.copy_(x)
        if math.softcap:
            out.div_(math.softcap).tanh_().mul_(math.softcap * math.scale)
        elif math.scale != 1.0:
            out.mul_(math.scale)
    return out if shift is None else out.sub_(shift[:, None])


@dataclasses.dataclass(frozen=True)
class _Leftover:
    """What `TorchKernels._partials` left in the pass's scratch for chunk `x` (unmodified): per row the shift `m`
    (the local max of y), ``exps = exp(y - m)`` and, with the entropy, ``e_shifted = exps * (y - m)`` (0 where
    exps is 0); valid while the scratch has handed out no other view since (`ChunkScratch.handed_out`). With
    `difference` (`softmax_partials(..., difference_into=z)`), x was worked on in place: `e_shifted` (or, without
    the entropy, `exps`) is x's own memory, and z holds ``x - z`` of the raw x."""

    x: torch.Tensor
    m: torch.Tensor
    exps: torch.Tensor
    e_shifted: torch.Tensor | None
    handed_out: int
    difference: torch.Tensor | None = None  # the chunk ``x - z`` was written over before x was worked in place


def _lse_only(x, math: ChunkMath, acc, keep_exps: bool, entropy: bool, target: bool, sum_logits: bool,
              extras: bool = False) -> bool:
    """Whether `TorchKernels._partials` is asked for a read-only chunk's ``m`` and ``s`` alone (no softcap): then
    the scaled logits need not be written before they are shifted, and the exps go to the "exps" buffer (the
    folded full KL's reference: the policy's in-place partials that follow use no other). The outputs that other
    ops compare bit for bit (the target, the entropy, a chunk the caller owns) keep the two-rounding path."""
    return not (keep_exps or entropy or target or sum_logits or extras or math.softcap) and x.dtype == acc


class TorchKernels:
    """`softmax_partials` / `softmax_grad_` for one pass, with that pass's scratch buffers."""

    name = "torch"

    def __init__(self, max_rows: int, cols: int, device: torch.device) -> None:
        self.scratch = ChunkScratch(max_rows, cols, device)
        self._left: _Leftover | None = None

    def leftover_of(self, x: torch.Tensor) -> _Leftover | None:
        """What the last `softmax_partials` of chunk `x` left in the scratch, if it is still there."""
        left = self._left
        if left is None or left.x is not x or left.handed_out != self.scratch.handed_out:
            return None
        return left

    def softmax_partials(
        self, x, labels, math: ChunkMath, *, entropy: bool, target: bool, sum_logits: bool, sum_sq: bool = False,
        argmax: bool = False, overwrite=False, keep_min=None, kept_exps=None, live=None, difference_into=None,
    ) -> torch.Tensor:  # fmt: skip
        """`overwrite=True`: `x` is scratch of the caller's; an fp32 `x` is worked on in place. `live` (the
        rows that count) is not used: whole-chunk tensor ops compute every row (the caller masks the others).
        `keep_min` ``[c]``: the kept-set threshold of each row (see `lmloss.kernels`), or None;
        `kept_exps`: ``(exps, shift, kept_mass or None)`` the threshold search left (reused here, and
        overwritten). `difference_into` (the contract's hint of a folded full KL to follow): where x is worked
        on in place, ``x - z`` is written over this chunk first, for `softmax_grad_with_difference_`."""
        with serial_row_reductions(x.shape[0], x.device):
            if keep_min is not None:
                return self._partials_kept(x, labels, math, entropy, target, sum_logits, keep_min, kept_exps,
                                           sum_sq=sum_sq, argmax=argmax)  # fmt: skip
            acc = compute_dtype(x.dtype)
            in_place = overwrite and x.dtype == acc and not math.softcap
            take = difference_into if in_place and difference_into is not None and difference_into.dtype == acc else None
            # a difference asked for and not taken: x stays as it is, for the gradient to take it from
            keep_exps = overwrite and (difference_into is None or take is not None)
            return self._partials(x, labels, math, entropy, target, sum_logits, keep_exps=keep_exps, difference_into=take,
                                  sum_sq=sum_sq, argmax=argmax)  # fmt: skip

    def block_partials(
        self, x, labels, math: ChunkMath, *, entropy: bool, target: bool, sum_logits: bool, argmax: bool = False,
        keep_min=None, kept_exps=None, block: int = INVARIANT_BLOCK, global_max=None, overwrite: bool = False,
    ) -> BlockPartials:  # fmt: skip
        """The invariant mode's sums per block of `block` columns (`lmloss.kernels`), in `softmax_partials`'
        passes (transform, max, shift, exp, sums) with each sum taken per block (`block_sums`: an order fixed
        by the block's width). `global_max` (``local row max [c] -> the group's``, one MAX over the TP
        group): the exps are shifted by the row's global max, exact in any order, and the partials say so
        (`BlockPartials.global_max`); None: by each block's own max. With it, the threshold search's
        `kept_exps` (shifted by that same max) are reused; with `sum_logits` the same MAX carries the largest
        block sum's magnitude (`BlockPartials.y_scale`). `x` is modified only with `overwrite` (the caller's
        scratch: an fp32 chunk is then worked on in place)."""
        rows, n_valid = x.shape[0], math.valid
        acc = compute_dtype(x.dtype)
        target_out = torch.zeros(rows, dtype=acc, device=x.device)
        top = None
        if argmax:  # (-inf, -1): no kept valid column, until the chunk is read below
            top = torch.tensor([float("-inf"), -1.0], dtype=acc, device=x.device).repeat(rows, 1)
        if n_valid == 0:  # a shard of padding only (TP): no block, and the MAX the other ranks make
            empty = torch.zeros((rows, 0), dtype=acc, device=x.device)
            m = torch.full((rows, 1), float("-inf"), dtype=acc, device=x.device)
            y_scale = None
            if global_max is not None:
                if kept_exps is not None:
                    m = kept_exps[1][:, None]
                maxes = ([] if kept_exps is not None else [m[:, 0]]) + ([target_out] if sum_logits else [])
                if maxes:
                    agreed = global_max(torch.stack(maxes, dim=1))
                    m = m if kept_exps is not None else agreed[:, :1]
                    y_scale = agreed[:, -1] if sum_logits else None
            return BlockPartials(m, empty, empty if entropy else None, empty if sum_logits else None, target_out,
                                 global_max is not None, y_scale, top)  # fmt: skip
        xv = x[:, :n_valid]
        identity = x.dtype == acc and math.scale == 1.0 and not math.softcap
        if global_max is not None and kept_exps is not None and kept_exps[2] is not None and not (entropy or sum_logits or argmax):
            # the threshold search summed the kept set's mass exactly (this rank's share: all of it on the
            # group's first rank): one block of it, and no pass over the chunk
            _, big_m, kept_mass = kept_exps
            if target:
                idx, owned = local_targets(labels, math)
                x_label = xv.gather(1, idx[:, None]).squeeze(1)
                y_label = transform_into(torch.empty(rows, dtype=acc, device=x.device), x_label, math)
                target_out = torch.where(owned, torch.where(x_label.to(acc) >= keep_min, y_label, float("-inf")), 0.0)
            self._scaled_of = None
            return BlockPartials(big_m[:, None], kept_mass.to(acc)[:, None], None, None, target_out, True)
        kept = None if keep_min is None else xv >= keep_min[:, None]
        scratch_y = self.scratch.get("y", rows, n_valid, acc)
        if identity and kept is None:
            y = xv  # read-only: shifted into scratch below
        elif identity:
            y = scratch_y.copy_(xv)
        elif getattr(self, "_scaled_of", None) is x:
            y = scratch_y  # the threshold search's `scaled` left them there
        else:
            y = transform_into(scratch_y, xv, math)
        self._scaled_of = None
        if kept is not None:
            y.masked_fill_(~kept, float("-inf"))
        if target:
            idx, owned = local_targets(labels, math)
            target_out = torch.where(owned, y.gather(1, idx[:, None]).squeeze(1), 0.0)
        if argmax:  # over the kept valid columns (the others are -inf now)
            v, first = y.max(dim=-1)
            _put_argmax(top, v, first, math, columns=(0, 1))
        sum_y = y_scale = None
        if sum_logits:
            sum_y = block_sums(y if kept is None else torch.where(kept, y, 0.0), block)
        if global_max is None:
            m = _block_max(y, block)
            shift = m.clamp(min=_FP32_MIN)  # a block with no kept column (-inf): a finite stand-in, exps 0
        else:
            # the row max (and, for sum y, the largest block sum's magnitude) over the group, in one MAX
            maxes = [] if kept_exps is not None else [y.amax(-1)]
            if sum_y is not None:
                maxes.append(torch.where(torch.isfinite(sum_y), sum_y.abs(), 0.0).amax(-1))
            maxes = global_max(torch.stack(maxes, dim=1)) if maxes else None
            if sum_y is not None:
                y_scale = maxes[:, -1]
            exps = None
            if kept_exps is not None:  # exp(y - M) of every column (M: the group's row max): keep the kept ones
                exps, big_m, _ = kept_exps
                exps.masked_fill_(~kept, 0.0)
            else:
                big_m = maxes[:, 0]
            m = big_m[:, None]
            shift = m.clamp(min=_FP32_MIN)
            if exps is not None and not entropy:
                return BlockPartials(m, block_sums(exps, block), None, sum_y, target_out, True, y_scale, top)
        shifted = y if y is not xv or (overwrite and kept is None) else scratch_y
        if shift.shape[1] == 1:
            torch.sub(y, shift, out=shifted)
        else:
            _sub_per_block(y, shift, block, out=shifted)
        agreed = global_max is not None
        if not entropy:
            return BlockPartials(m, block_sums(shifted.exp_(), block), None, sum_y, target_out, agreed, y_scale, top)
        if global_max is None or kept_exps is None:
            exps = torch.exp(shifted, out=self.scratch.get("exps", rows, n_valid, acc))
        if global_max is not None and kept_exps is not None and kept_exps[2] is not None:
            # the threshold search's exact kept mass, as without the entropy: the row's lse (and log-prob) are
            # the same bits whichever outputs are asked
            s = kept_exps[2].to(acc)[:, None]
        else:
            s = block_sums(exps, block)
        shifted.clamp_(min=_FP32_MIN)  # -inf logits: 0 * -inf would be NaN; their term is 0
        t = block_sums(shifted.mul_(exps), block)
        return BlockPartials(m, s, t, sum_y, target_out, agreed, y_scale, top)

    def scaled(self, x, math: ChunkMath) -> torch.Tensor:
        """``scale * softcap(x)`` of the valid columns in a scratch buffer, rounded exactly as the partials
        and the gradient round it (the kept-set thresholds are found on these values). The next
        `softmax_partials` of the same `x` with `keep_min` reuses them instead of recomputing."""
        acc = compute_dtype(x.dtype)
        self._scaled_of = x
        if x.dtype == acc and math.scale == 1.0 and not math.softcap:
            return x[:, : math.valid]  # y is x itself (read-only): no copy
        return transform_into(self.scratch.get("y", x.shape[0], math.valid, acc), x[:, : math.valid], math)

    def _partials_kept(self, x, labels, math: ChunkMath, entropy, target, sum_logits, keep_min, kept_exps, *,
                       sum_sq=False, argmax=False):
        """The partials over the kept columns ``x >= keep_min`` (the threshold is on the logits themselves:
        the set is the search's, whatever the transform rounds). The exps are those of every column (an exp
        of -inf takes CPUs' slow path), multiplied by the kept mask, a 0 / 1 float tensor (a bool mask in
        a multiply, ``masked_fill`` or ``where`` costs several passes on CPU). With `kept_exps`
        (``exp(y - shift)``, ``shift`` the global row max) they are not recomputed, and ``m`` is ``shift``:
        the partials are the same relative to any shift at or above the kept values; with its kept mass
        (``sum exp(y - shift)`` over the kept set) too, ``s`` is that, and only the target is read."""
        rows, n_valid = x.shape[0], math.valid
        acc = compute_dtype(x.dtype)
        out = _new_partials(rows, acc, x.device, sum_sq, argmax)
        if n_valid == 0:
            return out
        identity = x.dtype == acc and math.scale == 1.0 and not math.softcap
        if identity:
            y = x[:, :n_valid]  # read-only: shifted into scratch below
        elif getattr(self, "_scaled_of", None) is x:
            y = self.scratch.get("y", rows, n_valid, acc)  # `scaled` left them there
        else:
            y = transform_into(self.scratch.get("y", rows, n_valid, acc), x[:, :n_valid], math)
        self._scaled_of = None
        if argmax:
            _kept_argmax(out, y, x[:, :n_valid], keep_min, math)
        kept_mass = None
        if kept_exps is not None:
            exps, shift, kept_mass = kept_exps
            out[:, 0] = shift
        else:
            exps, shift = None, y.amax(dim=-1)
            # the row's max is kept unless this shard keeps nothing (TP): then m = -inf and s = t = 0
            kept_any = x[:, :n_valid].amax(dim=-1).to(acc) >= keep_min
            out[:, 0] = torch.where(kept_any, shift, float("-inf"))
        if target:
            idx, owned = local_targets(labels, math)
            y_label = y.gather(1, idx[:, None]).squeeze(1)
            x_label = x.gather(1, idx[:, None]).squeeze(1).to(acc)
            out[:, 3] = torch.where(owned, torch.where(x_label >= keep_min, y_label, float("-inf")), 0.0)
        if kept_mass is not None and not entropy and not sum_logits and not sum_sq:
            out[:, 1] = kept_mass  # the threshold search summed it: no pass over the chunk
            return out
        kept = torch.ge(x[:, :n_valid], keep_min[:, None], out=self.scratch.get("kept", rows, n_valid, acc))
        if sum_logits:  # a row-wise dot product: no chunk-sized product (the kept mask is 0 / 1)
            out[:, 4] = torch.bmm(y[:, None, :], kept[:, :, None]).view(-1)
        if not entropy:  # exps in the "exps" buffer: the threshold search's, already paged in
            if exps is None:
                exps = torch.sub(y, shift[:, None], out=self.scratch.get("exps", rows, n_valid, acc)).exp_()
            out[:, 1] = exps.mul_(kept).sum(dim=-1)
            if sum_sq:
                out[:, 5] = _sum_of_squares(exps)
            return out
        if identity:
            shifted = torch.sub(y, shift[:, None], out=self.scratch.get("y", rows, n_valid, acc))
        else:
            shifted = y.sub_(shift[:, None])
        if exps is None:
            exps = torch.exp(shifted, out=self.scratch.get("exps", rows, n_valid, acc))
        exps.mul_(kept)
        out[:, 1] = exps.sum(dim=-1)
        if sum_sq:
            out[:, 5] = _sum_of_squares(exps)
        shifted.clamp_(min=_FP32_MIN)  # -inf logits: 0 * -inf would be NaN
        out[:, 2] = exps.mul_(shifted).sum(dim=-1)
        return out

    def _partials(self, x, labels, math: ChunkMath, entropy, target, sum_logits, keep_exps, difference_into=None, *,
                  sum_sq=False, argmax=False):  # fmt: skip
        rows, n_valid = x.shape[0], math.valid
        acc = compute_dtype(x.dtype)
        out = _new_partials(rows, acc, x.device, sum_sq, argmax)
        if n_valid == 0:
            return out
        xv = x[:, :n_valid]  # padded vocabulary columns are a suffix: a view drops them
        if _lse_only(x, math, acc, keep_exps, entropy, target, sum_logits, sum_sq or argmax):
            # only ``m`` and ``sum exp(scale x - m)`` (a reference head's, a full vocabulary's): ``m = scale * max x``
            # (rounding is monotonic: the max of the rounded products) and, under a temperature, the shift in one
            # fused pass ``scale * x - m`` (one rounding) instead of writing ``scale * x`` first: one pass fewer
            m = xv.amax(dim=-1)
            work = self.scratch.get("exps", rows, n_valid, acc)
            if math.scale == 1.0:
                torch.sub(xv, m[:, None], out=work)
            else:
                m.mul_(math.scale)
                torch.add(-m[:, None], xv, alpha=math.scale, out=work)
            out[:, 0] = m
            exps = work.exp_()
            out[:, 1] = exps.sum(dim=-1)
            self._left = _Leftover(x, m, exps, None, self.scratch.handed_out)
            return out
        if difference_into is not None:  # before x changes (`softmax_grad_with_difference_` reads it from there)
            torch.sub(xv, difference_into[:, :n_valid], out=difference_into[:, :n_valid])
        if keep_exps and x.dtype == acc:  # a chunk the caller owns: work in it (exps are left there)
            y = transform_into(xv, xv, math, aliased=True)
        elif x.dtype == acc and math.scale == 1.0 and not math.softcap:
            y = xv  # read-only: shifted into scratch below in one pass
        else:
            y = transform_into(self.scratch.get("y", rows, n_valid, acc), xv, math)
        if argmax:  # the max and its first column in the one pass the max takes anyway
            m, top = y.max(dim=-1)
            _put_argmax(out, m, top, math)
        else:
            m = y.amax(dim=-1)
        out[:, 0] = m
        if target:
            idx, owned = local_targets(labels, math)
            out[:, 3] = torch.where(owned, y.gather(1, idx[:, None]).squeeze(1), 0.0)
        if sum_logits:
            out[:, 4] = y.sum(dim=-1)
        if y is xv and not keep_exps:
            shifted = torch.sub(xv, m[:, None], out=self.scratch.get("y", rows, n_valid, acc))
        else:
            shifted = y.sub_(m[:, None])
        if entropy:
            exps = torch.exp(shifted, out=self.scratch.get("exps", rows, n_valid, acc))
            out[:, 1] = exps.sum(dim=-1)
            # the product goes into `shifted` (writable here: scratch, or the caller's chunk), leaving the
            # exps intact: `partials_then_grad_` builds the gradient from both without another exp
            e_shifted = shifted.mul_(exps)
            out[:, 2] = e_shifted.sum(dim=-1)
            # a logit of -inf (a sampler's mask) makes exp * shifted = 0 * -inf = NaN, where its term is 0:
            # only a chunk that has one pays the pass that zeroes them (a NaN logit stays NaN: exps is NaN)
            if torch.compiler.is_compiling() or bool(out[:, 2].isnan().any()):
                e_shifted.masked_fill_(exps == 0, 0.0)
                out[:, 2] = e_shifted.sum(dim=-1)
        else:
            exps, e_shifted = shifted.exp_(), None
            out[:, 1] = exps.sum(dim=-1)
        if sum_sq:
            out[:, 5] = _sum_of_squares(exps)
        # x itself is intact unless it was worked on in place: `softmax_grad_with_difference_` of the same chunk
        # reuses what is left in the scratch (``exp(y - m)``, and ``exp(y - m)(y - m)`` with the entropy)
        if difference_into is not None:
            self._left = _Leftover(x, m, exps, e_shifted, self.scratch.handed_out, difference_into)
        else:
            self._left = None if y is xv and keep_exps else _Leftover(x, m, exps, e_shifted, self.scratch.handed_out)
        return out

    def softmax_grad_(
        self, x, labels, lse, entropy, coef, math: ChunkMath, out, *, uniform_term: bool = True, keep_min=None
    ) -> torch.Tensor:
        """`uniform_term=False` promises ``coef[:, 2] == 0`` (no label smoothing), saving one pass.
        `keep_min` ``[c]``: the rows' kept-set thresholds (the same as the partials had), or None."""
        n_valid = math.valid
        acc = compute_dtype(x.dtype)
        rows = x.shape[0]
        in_out = out.dtype == acc
        # The partials' "y" buffer is free by now: the gradient's fp32 work (or, when the work is `out`
        # itself, the softcap slope) reuses it, so a pass holds one fp32 chunk, not two.
        slope = self._softcap_slope(x, math, "y" if in_out else "slope")  # before `out` (maybe `x`) changes
        work = out[:, :n_valid] if in_out else self.scratch.get("y", rows, n_valid, acc)
        if keep_min is None:
            transform_into(work, x[:, :n_valid], math, aliased=in_out and out is x, shift=lse)  # log p
        else:  # the kept mask from the logits (as in the partials), then y - lse: every column's is <= 0
            # (lse is over kept columns, all above the dropped ones)
            kept = self.scratch.get("kept", rows, n_valid, acc)
            torch.ge(x[:, :n_valid], keep_min[:, None], out=kept)  # on x, before `work` (maybe x) changes
            if x.dtype == acc and math.scale == 1.0 and not math.softcap and out is not x:
                torch.sub(x[:, :n_valid], lse[:, None], out=work)  # y is x itself: one pass fewer
            else:
                transform_into(work, x[:, :n_valid], math, aliased=in_out and out is x)
                work.sub_(lse[:, None])
        a, d = coef[:, 0:1], coef[:, 3:4]
        if entropy is not None:
            p = torch.exp(work, out=self.scratch.get("p", rows, n_valid, acc))
            if keep_min is not None:
                p.mul_(kept)
            work.clamp_(min=_FP32_MIN)  # -inf logits: p = 0, and 0 * (log p + H) must be 0
            work.add_(entropy[:, None]).mul_(p).mul_(d).addcmul_(p, a)
        elif keep_min is not None:
            work.exp_().mul_(kept).mul_(a)
        else:
            work.exp_().mul_(a)
        self._finish_grad_(work, slope, labels, coef, math, uniform_term)
        if not in_out:
            out[:, :n_valid].copy_(work)
        out[:, n_valid:].zero_()
        return out

    def partials_then_grad_(
        self, x, labels, math: ChunkMath, flags: dict, finish, out, *, uniform_term=True, keep_min=None, live=None
    ):
        """`softmax_partials`, then ``finish(partials) -> (result, coef, lse[, entropy])`` (the TP combine and
        the output math), then `softmax_grad_` into `out`; returns `result`.

        When `out` is an fp32 `x` with no softcap (the fused path's own chunk, or fp32 logits in the
        in-place mode), the exps of the forward are turned into the gradient without recomputing them:
        ``p = exps * exp(m - lse)``. With the entropy flag the partials leave ``e = exp(y - m)`` in their
        "exps" scratch and ``e * (y - m)`` (0 at -inf logits) in the chunk (no third chunk-sized buffer),
        and the gradient
        ``p (d (log p + H) + a)``, with ``log p = (y - m) - (lse - m)``, is two passes over them:
        ``r d * [e (y - m)] + r (d (H - (lse - m)) + a) * e`` with ``r = exp(m - lse)``; the temperature's
        ``1 / T`` is folded into those per-row factors instead of a pass of its own.
        """
        reuse = out is x and x.dtype == torch.float32 and not math.softcap
        with serial_row_reductions(x.shape[0], x.device):
            if keep_min is not None:
                reuse = False
                partials = self._partials_kept(x, labels, math, keep_min=keep_min, kept_exps=None, **flags)
            else:
                partials = self._partials(x, labels, math, keep_exps=reuse, **flags)
        result, coef, lse, *rest = finish(partials)
        entropy = rest[0] if rest else None
        if not reuse:
            return result, self.softmax_grad_(
                x, labels, lse, entropy, coef, math, out, uniform_term=uniform_term, keep_min=keep_min
            )
        work = x[:, : math.valid]
        r = torch.exp(partials[:, 0] - lse)  # p = exp(y - m) * r
        if not flags.get("entropy"):  # the partials left exp(y - m) in the chunk
            work.mul_((coef[:, 0] * r)[:, None])
        else:  # they left e * (y - m) in the chunk and e = exp(y - m) in "exps" (both 0 at -inf logits)
            exps = self.scratch.get("exps", *work.shape, work.dtype)
            a = coef[:, 0] * r * math.scale  # dy/dx = 1 / T, applied here rather than in _finish_grad_
            if entropy is None:
                torch.mul(exps, a[:, None], out=work)
            else:
                d = coef[:, 3] * r * math.scale
                work.mul_(d[:, None]).addcmul_(exps, (a + d * (entropy - (lse - partials[:, 0])))[:, None])
            coef, math = coef * math.scale, dataclasses.replace(math, scale=1.0)  # the other terms, scaled
        self._finish_grad_(work, None, labels, coef, math, uniform_term)
        out[:, math.valid :].zero_()
        return result, out

    def _softcap_slope(self, x, math: ChunkMath, buffer: str) -> torch.Tensor | None:
        """``d/dx cap * tanh(x / cap) = 1 - tanh(x / cap)**2`` for the valid columns, in the scratch buffer
        `buffer`; None without softcap."""
        if not math.softcap:
            return None
        rows, acc = x.shape[0], compute_dtype(x.dtype)
        t = self.scratch.get(buffer, rows, math.valid, acc).copy_(x[:, : math.valid])
        return t.div_(math.softcap).tanh_().square_().neg_().add_(1.0)

    def _finish_grad_(self, work, slope, labels, coef, math: ChunkMath, uniform_term: bool) -> None:
        """Add the terms without ``p`` (``c``, ``b * onehot``), apply ``dy/dx``, zero inactive rows."""
        if uniform_term:
            work.add_(coef[:, 2:3])
        if labels is not None and math.valid > 0:
            idx, owned = local_targets(labels, math)
            work.scatter_add_(1, idx[:, None], torch.where(owned, coef[:, 1], 0.0)[:, None].to(work.dtype))
        if slope is not None:
            work.mul_(slope)
        if math.scale != 1.0:
            work.mul_(math.scale)
        inactive = (coef == 0).all(dim=1)
        if torch.compiler.is_compiling():  # compiled: always, fused into the passes before
            work.masked_fill_(inactive[:, None], 0.0)
        elif bool(inactive.any()):  # eager: only those rows written (a broadcast row mask reads a flag per element:
            # 3-4x the time at [16384, 256] or [128, 32000] with half the rows inactive)
            work.index_fill_(0, inactive.nonzero()[:, 0], 0.0)


def _new_partials(rows: int, dtype: torch.dtype, device: torch.device, sum_sq: bool, argmax: bool) -> torch.Tensor:
    """Zeroed partials ``[rows, 5]``, or ``[rows, 8]`` with the by-products' columns (`lmloss.kernels`), whose
    max (column 0, and 6 with the argmax) is -inf and id (column 7) -1: a shard with no kept valid column."""
    out = torch.zeros((rows, 8 if sum_sq or argmax else 5), dtype=dtype, device=device)
    out[:, 0] = float("-inf")
    if argmax:
        out[:, 6], out[:, 7] = float("-inf"), -1.0
    return out


def _put_argmax(out: torch.Tensor, v: torch.Tensor, top: torch.Tensor, math: ChunkMath, columns=(6, 7)) -> None:
    """Columns 6 and 7 of the partials (`columns` of `out`) from each row's max `v` and its local column `top`:
    the global id, or -1 where the row's max is -inf (no kept valid column)."""
    out[:, columns[0]] = v
    out[:, columns[1]] = torch.where(v == float("-inf"), -1, top + math.vocab_start).to(out.dtype)


def _kept_argmax(out: torch.Tensor, y: torch.Tensor, xv: torch.Tensor, keep_min: torch.Tensor, math: ChunkMath):
    """`_put_argmax` over the kept columns ``x >= keep_min``: y is monotone in x, so the row's first largest y is
    a kept column unless the transform's rounding ties it with a dropped one (then, and where this shard keeps
    nothing, those rows are taken again over their kept columns alone: no chunk-sized buffer otherwise)."""
    if torch.compiler.is_compiling():  # no data-dependent branch in a graph: the masked max (fused there)
        v, top = torch.where(xv >= keep_min[:, None], y, float("-inf")).max(dim=-1)
        _put_argmax(out, v, top, math)
        return
    v, top = y.max(dim=-1)
    outside = xv.gather(1, top[:, None]).squeeze(1).to(keep_min.dtype) < keep_min
    if bool(outside.any()):
        rows = outside.nonzero()[:, 0]
        sub = y[rows].masked_fill_(xv[rows] < keep_min[rows, None], float("-inf"))
        v[rows], top[rows] = sub.max(dim=-1)
    _put_argmax(out, v, top, math)


def _sum_of_squares(exps: torch.Tensor) -> torch.Tensor:
    """``sum_j exps_j**2`` per row without a chunk-sized temporary (a norm's reduction, squared)."""
    return torch.linalg.vector_norm(exps, dim=-1).square_()


def _block_max(y: torch.Tensor, block: int) -> torch.Tensor:
    """Max of ``[c, n]`` over blocks of `block` columns -> ``[c, ceil(n / block)]`` (exact in any order)."""
    rows, n = y.shape
    n_full = n // block
    if n_full * block == n:
        return y.unflatten(1, (n_full, block)).amax(-1)
    m = torch.empty((rows, n_full + 1), dtype=y.dtype, device=y.device)
    torch.amax(y[:, : n_full * block].unflatten(1, (n_full, block)), -1, out=m[:, :n_full])
    torch.amax(y[:, n_full * block :], -1, out=m[:, n_full])
    return m


def _sub_per_block(y: torch.Tensor, shift: torch.Tensor, block: int, *, out: torch.Tensor) -> torch.Tensor:
    """``out = y - shift[block of the column]`` for ``[c, n]`` `y` and ``[c, ceil(n / block)]`` `shift`
    (`out` may be `y`)."""
    n = y.shape[1]
    n_full = n // block
    main = (slice(None), slice(0, n_full * block))
    torch.sub(y[main].unflatten(1, (n_full, block)), shift[:, :n_full, None],
              out=out[main].unflatten(1, (n_full, block)))  # fmt: skip
    if n_full * block < n:
        torch.sub(y[:, n_full * block :], shift[:, n_full:], out=out[:, n_full * block :])
    return out


def block_sums(t: torch.Tensor, block: int) -> torch.Tensor:
    """Sums of ``[c, n]`` over blocks of `block` columns -> ``[c, ceil(n / block)]``, each block reduced in the
    order its width alone fixes: the whole blocks as one ``[c, n // block, block]`` reduction of the last dim
    (PyTorch reduces each output from its contiguous inner run, on one thread, given enough outputs:
    `serial_row_reductions`), a partial last block as a whole block with zeros in its missing columns. The
    same block gives the same bits in any chunk, at any position, beside any other blocks."""
    rows, n = t.shape
    n_full = n // block
    if n_full * block == n:
        with serial_row_reductions(rows * n_full, t.device):
            return t.unflatten(1, (n_full, block)).sum(-1)
    out = torch.empty((rows, -(-n // block)), dtype=t.dtype, device=t.device)
    with serial_row_reductions(rows * n_full, t.device):
        torch.sum(t[:, : n_full * block].unflatten(1, (n_full, block)), -1, out=out[:, :n_full])
    if n_full < out.shape[1]:
        tail = t.new_zeros((rows, block))
        tail[:, : n - n_full * block] = t[:, n_full * block :]
        with serial_row_reductions(rows, t.device):
            out[:, n_full] = tail.sum(-1)
    return out


#: The elementwise functions invariant mode applies whose rounding is a property of PyTorch's kernels rather than
#: IEEE's (the softcap's tanh, the exps of every pass, the log of a row's mass, the gradient's ``w + p * a``, where
#: a compiler may fuse the multiply-add in one loop and not in another), with the range of arguments each sees.
INVARIANT_ELEMENTWISE = {
    "exp": (lambda x: torch.exp(x), (-104.0, 0.0)),  # (looked up at the call: a planted torch.exp is probed)
    "tanh": (lambda x: torch.tanh(x), (-20.0, 20.0)),
    "log": (lambda x: torch.log(x), (2.0**-20, 2.0**24)),
    "addcmul": (lambda x: torch.addcmul(x, x, x, value=0.37), (-2.0, 2.0)),
}


def probe_invariant_math(device: torch.device, dtype: torch.dtype) -> str | None:
    """Verify on this machine, under the current thread count, what invariant mode's PyTorch math relies on
    besides the GEMMs (`lmloss.chunks.probe_invariant_gemm`), in `dtype` (the kernels' fp32 or float64): None if
    it holds, else what does not.

    * each of `INVARIANT_ELEMENTWISE` gives a value the same bits wherever it sits: in a long contiguous tensor
      (vectorized, its threads' ranges split at odd places; and on one thread), in a strided view (element by
      element), and in short tensors at other offsets (the vector loop's tail), on random arguments of the range
      it sees;
    * `block_sums` gives a block the same bits in a chunk of 300 rows (also on one thread), for a row alone, in
      a sub-batch and in a shuffled chunk (each output reduced by one thread in an order its width fixes).

    Cached per (device, dtype, thread count) by `check_invariant_math`; costs a few milliseconds."""
    g = torch.Generator().manual_seed(0)
    n = 3 * 2**15 + 13  # odd: the thread ranges and the vector tails fall at other places
    for name, (f, (lo, hi)) in INVARIANT_ELEMENTWISE.items():
        x = (torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(device, dtype)
        whole = f(x)
        with one_thread(device):
            if not torch.equal(f(x), whole):
                return f"torch.{name} rounds differently on one thread than on {torch.get_num_threads()}"
        if not torch.equal(f(x[1::3]), whole[1::3]):
            return f"torch.{name} of a strided view rounds differently than of a contiguous tensor"
        for start in (0, 1, 5, 4099):
            for length in (1, 2, 3, 5, 7, 9, 15, 17, 31, 33, 65):
                if not torch.equal(f(x[start : start + length]), whole[start : start + length]):
                    return f"torch.{name} of {length} values rounds differently than of {n}"
    t = torch.rand(300, 1000, generator=g, dtype=torch.float64).to(device, dtype)
    full = block_sums(t, INVARIANT_BLOCK)
    with one_thread(device):
        if not torch.equal(block_sums(t, INVARIANT_BLOCK), full):
            return f"the sums of {INVARIANT_BLOCK}-column blocks round differently on one thread than on several"
    perm = torch.randperm(300, generator=g).to(device)
    for rows in (slice(0, 1), slice(137, 138), slice(299, 300), slice(41, 178)):
        if not torch.equal(block_sums(t[rows], INVARIANT_BLOCK), full[rows]):
            return f"the sums of {INVARIANT_BLOCK}-column blocks of {rows.stop - rows.start} rows round differently"
    if not torch.equal(block_sums(t[perm], INVARIANT_BLOCK), full[perm]):
        return f"the sums of {INVARIANT_BLOCK}-column blocks of shuffled rows round differently"
    return None


@functools.lru_cache(maxsize=32)
def _math_verdict(device: torch.device, dtype: torch.dtype, threads: int) -> str | None:
    return probe_invariant_math(device, dtype)


def check_invariant_math(device: torch.device, dtype: torch.dtype) -> None:
    """Raise RuntimeError if `probe_invariant_math` (at first use per device, dtype and thread count in the
    process) finds that invariant mode's elementwise math or block sums cannot hold their bits here. CPU only:
    on CUDA the PyTorch kernels' bits are what docs/invariant.md says a GPU must confirm."""
    if device.type != "cpu" or torch.compiler.is_compiling():
        return
    verdict = _math_verdict(device, dtype, torch.get_num_threads())
    if verdict is not None:
        raise RuntimeError(f"invariant=True cannot hold on this machine: {verdict}")


def local_targets(labels: torch.Tensor, math: ChunkMath) -> tuple[torch.Tensor, torch.Tensor]:
    """(column index clamped into this shard, whether this shard owns the label) for global labels."""
    local = labels - math.vocab_start
    owned = (local >= 0) & (local < math.valid)
    return local.clamp(0, max(math.valid - 1, 0)), owned
