"""The distribution a rollout engine sampled from: min-p, top-k and top-p kept sets, recomputed or replayed.

vLLM's sampler (``vllm/v1/sample/sampler.py``, ``ops/topk_topp_sampler.py``) turns logits into the
distribution it samples from in this order: temperature, then min-p (keep ``p >= min_p * max p``), then
top-k (keep values ``>=`` the k-th largest: ties at the boundary are kept), then top-p over the
renormalised result (sorted ascending, drop the tokens whose cumulative probability is ``<= 1 - top_p``,
always keep the most likely one). Each step keeps a *top set* of the scaled logits ``y``, so the kept set
of a row is ``{j : y_j >= keep_min}`` for one per-row threshold ``keep_min``; the per-chunk kernels take
that threshold (`lmloss.kernels`) and give the log-probs, entropy and gradient of the renormalised
distribution over it.

This module finds the thresholds without sorting the vocabulary (`keep_thresholds`):

* min-p: ``keep_min = M + log(min_p)`` from the global row max ``M`` (rounded up to fp32, so the fp32
  comparison is the exact one);
* top-k: the k-th largest value of the row: ``topk`` of each shard's valid columns, gathered over the TP
  group, ``topk`` again;
* top-p: a token is kept iff the mass strictly above it is ``< top_p * Z`` (``Z``: mass of the set kept
  so far). Each token's bin is read off the bits of its fp32 ``exp(y - M)`` (exponent and
  `TOP_P_MANTISSA_BITS` mantissa bits: `TOP_P_BINS` fixed log-probability bins per row) and one
  ``scatter_add`` sums the kept mass per bin (all-reduced over the group: ``[c, TOP_P_BINS]``); summed in
  float64 the bins give ``Z``, the bin where the cumulative mass crosses ``top_p * Z`` and the mass above
  it. The tokens of that bin (a few dozen to a few hundred per row) are gathered over the group and the
  exact crossing is found among them in float64; with one process the kept set's mass comes out of the
  same sums, and the kernels need no pass of their own for it. A row whose crossing fell outside that
  bin (fp32 rounding of a bin's sum right at a bin edge) is solved by sorting that row alone (rare;
  counted in `FALLBACK_ROWS`).

The ``exp(y - M)`` of the search are left to the kernels (`ChunkThresholds.exps`), which reuse them.

Ties: top-k keeps ties at the k-th value, as vLLM does. At the top-p boundary vLLM's choice among equal
values depends on its sort's order; here all tokens equal to the smallest kept value are kept.

Replay (`support=`): the ids the engine kept per token, ``[N, K]`` padded with -1 (`support_from_offsets`
converts vLLM's flat ids + offsets), replace the recomputation: the op works on the ``[N, K]`` slots of
those ids (`support_slots`, `lmloss.replay`), fused ops matmul only the weight rows the chunk's ids name.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.distributed as dist

from lmloss._validate import INT64_MAX
from lmloss.kernels import INVARIANT_BLOCK
from lmloss.kernels.torch_ref import block_sums, one_thread
from lmloss.vocab_parallel import (
    INVARIANT_FRACTION_BITS,
    ProcessGroup,
    all_reduce_max_,
    all_reduce_sum_,
    fixed_point_sum,
    to_fixed_point,
    world_size,
)

#: Top-p bins a token by its fp32 ``exp(y - M)``: the exponent and this many leading mantissa bits, i.e.
#: ``2**5`` bins per halving of the probability (about 0.022 in y), fixed (no value range to find first)
#: and the same on every TP rank.
TOP_P_MANTISSA_BITS = 5
#: Halvings of the probability (below the row's top one) that get their own bins; the tokens below
#: ``2**-64`` times the top probability share bin 0.
TOP_P_OCTAVES = 64
_TOP_P_SHIFT = 23 - TOP_P_MANTISSA_BITS
#: The bin id of ``2**-TOP_P_OCTAVES``: the bits of an fp32 shifted right by `_TOP_P_SHIFT` (1.0 is
#: ``127 << 23`` before the shift).
_TOP_P_LOWEST = (127 - TOP_P_OCTAVES) << TOP_P_MANTISSA_BITS
#: Bins per row: ``2**-TOP_P_OCTAVES`` up to 1.0 (the row's top token) inclusive.
TOP_P_BINS = (TOP_P_OCTAVES << TOP_P_MANTISSA_BITS) + 1
#: Rows (since import) whose top-p crossing was solved by the dense fallback; for tests and curiosity.
FALLBACK_ROWS = [0]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The engine's truncation, per token (flat ``[N]`` tensors) or one number for all; None = off.

    top_k: int64 ``[N]`` (or int) >= 1; a value >= the vocabulary keeps everything.
    top_p: float64 ``[N]`` (or float) in (0, 1]; 1 keeps everything.
    min_p: float64 ``[N]`` (or float) in [0, 1]; 0 keeps everything.
    k_max: the largest top_k (0 without top_k), agreed across TP ranks.
    log_kept_mass: also return ``log`` of the kept set's probability under the full softmax.
    """

    top_k: torch.Tensor | int | None = None
    top_p: torch.Tensor | float | None = None
    min_p: torch.Tensor | float | None = None
    k_max: int = 0
    log_kept_mass: bool = False

    def rows(self, rows) -> dict[str, torch.Tensor | int | float | None]:
        """The parameters of a chunk's tokens (`lmloss.rows.Rows`)."""

        def part(v):
            return rows.take(v) if isinstance(v, torch.Tensor) else v

        return dict(top_k=part(self.top_k), top_p=part(self.top_p), min_p=part(self.min_p))

    def agree_fields(self) -> dict[str, int | float]:
        """What every TP rank must agree on (tensors: their presence, k_max)."""

        def code(v, off):
            if v is None:
                return off
            return -3.0 if isinstance(v, torch.Tensor) else float(v)

        return dict(
            top_k_max=self.k_max, top_p=code(self.top_p, 2.0), min_p=code(self.min_p, -1.0),
            log_kept_mass=int(self.log_kept_mass),
        )  # fmt: skip


def _check_param(name, value, n, device, *, integer, low, high, low_open=False):
    """A number or an ``[N]``-shaped tensor (any shape with N elements, flattened) in range."""
    if value is None:
        return None
    shown = "2**63 - 1" if high == INT64_MAX else high  # top_k's bound: an int64 in the agreement vector
    if isinstance(value, torch.Tensor):
        if integer and (value.is_floating_point() or value.dtype == torch.bool):
            raise TypeError(f"{name} must be an int or an integer tensor, got {value.dtype}")
        if not integer and not (value.is_floating_point() or value.dtype != torch.bool):
            raise TypeError(f"{name} must be a float or a float tensor, got {value.dtype}")
        if value.numel() != n:
            raise ValueError(
                f"{name} as a tensor must have one value per token ({n}), got shape {tuple(value.shape)}"
            )
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but the logits are on {device}")
        flat = value.reshape(-1).to(torch.int64 if integer else torch.float64)
        lo_bad = (flat <= low) if low_open else (flat < low)
        bad = lo_bad | (flat > high) | (flat != flat)
        if n and bool(bad.any()):
            raise ValueError(
                f"{name} values must be in {'(' if low_open else '['}{low}, {shown}], found {flat[bad][0].item()}"
            )
        return flat
    if integer and not _is_int(value):
        raise TypeError(f"{name} must be an int, an integer tensor or None, got {value!r}")
    if not integer and not _is_real(value):
        raise TypeError(f"{name} must be a float, a float tensor or None, got {value!r}")
    if (value <= low if low_open else value < low) or value > high or value != value:
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{low}, {shown}], got {value}")
    return value


def make_sampling(
    top_k, top_p, min_p, *, n_tokens: int, device: torch.device, log_kept_mass: bool = False
) -> Sampling | None:
    """Check the truncation arguments (errors name the argument); None when nothing truncates."""
    # an int top_k travels in the agreement vector as int64 (a value >= the vocabulary keeps everything)
    top_k = _check_param("top_k", top_k, n_tokens, device, integer=True, low=1, high=INT64_MAX)
    top_p = _check_param("top_p", top_p, n_tokens, device, integer=False, low=0.0, high=1.0, low_open=True)
    min_p = _check_param("min_p", min_p, n_tokens, device, integer=False, low=0.0, high=1.0)
    if not isinstance(log_kept_mass, bool):
        raise TypeError(f"return_log_kept_mass must be a bool, got {log_kept_mass!r}")
    if top_k is None and top_p is None and min_p is None:
        if log_kept_mass:
            raise ValueError("return_log_kept_mass=True needs top_k, top_p or min_p")
        return None
    if isinstance(top_k, torch.Tensor):
        k_max = int(top_k.max()) if top_k.numel() else 1
    else:
        k_max = 0 if top_k is None else top_k
    return Sampling(top_k=top_k, top_p=top_p, min_p=min_p, k_max=k_max, log_kept_mass=log_kept_mass)


class KeptSetWarning(UserWarning):
    """Labels outside the sampling kept set: the engine and the trainer disagree on the distribution."""


def report_dropped(
    logprobs: torch.Tensor,
    labels: torch.Tensor | None,
    ignore_index: int,
    *,
    counting: torch.Tensor | None = None,
    counted_by: str | None = None,
) -> int:
    """Count the tokens that count whose log-prob is -inf (outside the kept set) and warn if any.

    A token counts where ``labels != ignore_index`` and, when given, where `counting` (bool, `logprobs`'
    shape: the caller's mask, e.g. verl's ``response_mask``) is True; `labels` None: `counting` alone.
    The warning says how many of how many counted tokens, and what counted them (`counted_by`, else the
    labels / the mask). One host sync; skipped (returns 0) inside a compiled region.
    """
    if torch.compiler.is_compiling():
        return 0
    counted = torch.ones_like(logprobs, dtype=torch.bool) if labels is None else labels != ignore_index
    if counting is not None:
        counted = counted & counting.reshape(logprobs.shape).bool()
    if counted_by is None:
        counted_by = "labels != ignore_index" + (" and the caller's mask" if counting is not None else "")
    n, total = (int(v) for v in torch.stack([(torch.isneginf(logprobs) & counted).sum(), counted.sum()]).tolist())
    if n:
        warnings.warn(
            f"{n} label(s) of the {total} counted ({counted_by}) lie outside the sampling kept set (top_k / "
            "top_p / min_p / support): their log-prob is -inf with zero gradient. The rollout engine sampled "
            "them, so the trainer's truncation differs from the engine's (parameters, temperature, or "
            "logits), or the policy has moved since it sampled them (several optimizer steps per batch)",
            KeptSetWarning,
            stacklevel=3,
        )
    return n


# ----------------------------------------------------------------------------------------------------------
# what the search holds


def search_bytes(
    sampling: Sampling | None, *, dtype: torch.dtype, vocab: int, invariant: bool = False, world: int = 1
) -> tuple[int, int]:
    """What the PyTorch search of a chunk's kept set (`keep_thresholds`) holds beside the kernels' own two
    chunk-sized buffers, as ``(bytes per logit, bytes per row)`` for the plan's chunking (`lmloss.plan`):
    the kept mask (every truncation); top-p's int64 bin of every logit and its candidate mask, and per row
    its histogram (`TOP_P_BINS` bins and the lumped ones below them, then their float64 sums; in the
    invariant mode all of them 64-bit); top-k's candidates (``k_max`` values and their int64 indices, every
    rank's under TP; `vocab`: the global vocabulary, which caps k). `dtype`: the logits' (the search works in
    `compute_dtype`); `world`: the TP group's size. Not counted: the top-p
    crossing bin's candidates (typically tens to hundreds per row). (0, 0) without a truncation."""
    if sampling is None:
        return 0, 0
    item = max(torch.finfo(dtype).bits // 8, 4)  # y's dtype: fp32 for bf16 / fp16 / fp32 logits
    per_logit, per_row = 4, 2 * world * min(sampling.k_max, vocab) * (item + 8)
    if sampling.top_p is not None:
        # the bins (int64), the candidates' mask, y's own buffer beside the kernels' (an entropy's p), fixed point
        per_logit += 8 + 1 + 4 + (8 if invariant and item == 8 else 0)
        if invariant:  # the 64-bit scatter's bins and the histogram, then the histogram, its sums and two temporaries
            per_row += max((_TOP_P_LOWEST + 2 * TOP_P_BINS) * 8, 4 * TOP_P_BINS * 8)
        else:  # the scatter's bins and the histogram, then the histogram and its float64 suffix sums
            per_row += max((_TOP_P_LOWEST + 2 * TOP_P_BINS) * item, TOP_P_BINS * (item + 8 + 8))
    return per_logit, per_row


# ----------------------------------------------------------------------------------------------------------
# thresholds of one chunk


def _per_row(v, rows: int, device, dtype) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.to(dtype)
    return torch.full((rows,), v, dtype=dtype, device=device)


def _round_up_to(t64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest `dtype` value >= each float64 value (so ``y >= result`` iff ``y >= t64`` for `dtype` y)."""
    t = t64.to(dtype)
    return torch.where(t.double() < t64, torch.nextafter(t, torch.full_like(t, math.inf)), t)


@dataclasses.dataclass(frozen=True)
class ChunkThresholds:
    """What `keep_thresholds` finds for one chunk.

    keep_min: ``[c]`` (y's dtype) the kept set's threshold per row on the logits x (``x >= keep_min``),
        -inf where nothing is cut.
    row_max: ``[c]`` the global row max ``M`` of y (over the TP group); None where the kernels' search did
        not need it (top-k alone).
    exps: ``[c, V_valid]`` ``exp(y - row_max)`` of every column, already 0 in some dropped ones (a scratch
        buffer the kernels may reuse: `lmloss.kernels`, ``kept_exps``); None from the kernels' search.
    full_lse: ``[c]`` the global ``logsumexp(y)`` over the whole vocabulary, or None (not asked).
    kept_mass: ``[c]`` ``sum exp(y - row_max)`` over the kept set, where the search found it on the way
        (top-p, one process: from its histogram and candidates); else None.
    """

    keep_min: torch.Tensor
    row_max: torch.Tensor | None
    exps: torch.Tensor | None
    full_lse: torch.Tensor | None
    kept_mass: torch.Tensor | None = None


def keep_thresholds(
    y: torch.Tensor, x: torch.Tensor, params: dict, k_max: int, *, group: ProcessGroup | None, scratch,
    want_full_lse: bool, invariant: bool = False, scale: float | None = None,
) -> ChunkThresholds:  # fmt: skip
    """The kept set of each row of the chunk's scaled logits (see `ChunkThresholds`).

    y: ``[c, V_valid]`` this rank's valid columns of ``scale * softcap(x)`` (fp32 / fp64), as the PyTorch
        kernels compute them; not modified. x: the same columns of the logits themselves. The set is found
        on `y` and handed to the kernels as a threshold on `x` (``keep_min``): y is monotone in x, so
        ``{y >= t} = {x >= min of the kept x}``, and every implementation keeps exactly this set however
        its transform rounds (a Triton tanh and torch.tanh differ in the last bits).
    params: `Sampling.rows` of the chunk. group: the TP group (thresholds are global).
    scratch: a `ChunkScratch` with chunk-sized buffers (the exps are left in its ``"exps"`` buffer).
    want_full_lse: also the global ``logsumexp(y)`` (for the kept mass).
    invariant: the invariant mode (docs/invariant.md): every mass is summed in fixed point
        (`lmloss.vocab_parallel.to_fixed_point`), so that the kept set and the full mass are the same bits
        however the rows are chunked and the vocabulary sharded; the kept set's mass is then left to the
        kernels (`ChunkThresholds.kept_mass` None).
    scale: when y is ``x * scale`` (no softcap), that scale: the threshold on x then needs no pass over the
        chunk (`_on_logits`).
    """
    rows, dt, dev = y.shape[0], y.dtype, y.device
    neg_inf = torch.full((rows,), -math.inf, dtype=dt, device=dev)
    big_m = all_reduce_max_(y.amax(dim=1) if y.shape[1] else neg_inf.clone(), group)
    keep = neg_inf.clone()
    if params["min_p"] is not None:
        min_p = _per_row(params["min_p"], rows, dev, torch.float64)
        t = big_m.double() + torch.log(min_p)  # log(0) = -inf: nothing cut
        keep = torch.maximum(keep, _round_up_to(t, dt))
    if params["top_k"] is not None:
        keep = torch.maximum(
            keep, _kth_largest(y, _per_row(params["top_k"], rows, dev, torch.int64), k_max, group)
        )
    # exp(y - M) once: the full mass, top-p's histogram and the kernels' partials all use them
    exps = torch.sub(y, big_m[:, None], out=scratch.get("exps", rows, y.shape[1], dt)).exp_()
    full_lse = None
    if want_full_lse:
        if invariant:
            full = fixed_point_sum(block_sums(exps, INVARIANT_BLOCK), group)
        else:
            full = all_reduce_sum_(_sum64(exps), group)
        full_lse = (big_m.double() + full.log()).to(dt)
    kept_mass = None
    if params["top_p"] is not None:
        top_p = _per_row(params["top_p"], rows, dev, torch.float64)
        if bool((top_p < 1.0).any()):
            if invariant:
                t, mass = _top_p_threshold_exact(y, exps, big_m, keep, top_p, group=group, scratch=scratch)
            else:
                t, mass = _top_p_threshold(y, exps, big_m, keep, top_p, group=group, scratch=scratch)
            keep = torch.maximum(keep, t)
            if invariant and bool(torch.isfinite(big_m).all()):
                # the group's kept mass, found exactly: the first rank's share is all of it (the kernels' exact
                # SUM adds the others' zeros)
                first = world_size(group) == 1 or dist.get_rank(group) == 0
                kept_mass = mass.to(dt) if first else torch.zeros_like(big_m)
            # under TP the default's mass is the group's, not this shard's: the kernels sum their own
            elif world_size(group) == 1 and bool(torch.isfinite(big_m).all()):
                kept_mass = mass.to(dt)
    return ChunkThresholds(
        keep_min=_on_logits(x, y, keep, group, scratch, scale), row_max=big_m, exps=exps, full_lse=full_lse,
        kept_mass=kept_mass,
    )  # fmt: skip


def _on_logits(x: torch.Tensor, y, keep: torch.Tensor, group, scratch, scale: float | None) -> torch.Tensor:
    """The threshold on y, moved onto the logits: per row an x threshold that keeps exactly the x whose y is
    kept, -inf where nothing is cut. In y's dtype, which holds every x value exactly.

    `scale`: y is ``x * scale`` rounded to y's dtype (no softcap): the threshold follows from `keep` alone
    (`_smallest_kept`, a few per-row steps, no pass over the chunk, the same on every TP rank). Otherwise
    (softcap, whose tanh is not checked here to round alike in every evaluation) it is the smallest kept x
    of the chunk (over the TP group: one MIN). `y`: the chunk's y, or a function making it (only that scan
    reads it); `scratch` None: its buffer is a fresh one."""
    rows, dt = keep.shape[0], keep.dtype
    cut = torch.isfinite(keep)
    if rows == 0 or not bool(cut.any()):
        return keep
    if scale is not None:
        low = _smallest_kept(keep, cut, float(scale))
        if low is not None:
            return torch.where(cut, low, -math.inf)
    y = y() if callable(y) else y
    cols = y.shape[1]
    kept_x = torch.empty_like(y) if scratch is None else scratch.get("kept", rows, cols, dt)
    kept_x.copy_(x).masked_fill_(y < keep[:, None], math.inf)
    low = kept_x.amin(dim=1) if cols else torch.full((rows,), math.inf, dtype=dt, device=y.device)
    low = all_reduce_max_(low.neg_(), group).neg_()
    return torch.where(cut, low, -math.inf)


#: The most candidates per row the kernels' search (`keep_thresholds_by_kernels`) gathers from one crossing's
#: bins; a row with more is solved by sorting it (as the rare rows whose crossing misses its bins are).
KERNEL_CANDIDATES_MAX = 4096


def keep_thresholds_by_kernels(
    x: torch.Tensor, math_, params: dict, k_max: int, *, group: ProcessGroup | None, want_full_lse: bool
) -> ChunkThresholds:
    """`keep_thresholds` with the passes over the chunk made by Triton kernels (`lmloss.kernels.triton_sampling`;
    CUDA, or CPU tensors under Triton's interpreter), for the default mode without softcap: the same kept set
    (vLLM's, ties as documented), found on ``y = x * scale`` in fp32 without a ``[c, V]`` buffer. Per chunk,
    each step one pass and at most one collective over `group`:

    * min-p, top-p or the full mass: the row max (the softmax statistics kernel; one MAX);
    * top-k: a count histogram of the kept-so-far columns (one SUM), then the crossing bin's columns (one
      all-gather), sorted: the k-th largest. Alone it bins y's own bits (no max needed); before top-p it bins
      ``exp(y - M)``, and its second pass also sums the mass above that bin, so that top-p needs no histogram;
    * top-p: the histogram of ``exp(y - M)`` and the kept mass Z (one SUM, unless top-k made them), bounds of
      each bin's mass give the bins where the mass from the top can cross ``top_p * Z``; their columns and the
      mass above them (one all-gather) give the exact crossing in float64 (`_crossing_among`).

    Rows whose crossing bins hold more than `KERNEL_CANDIDATES_MAX` columns, or whose crossing is not among the
    candidates, are sorted (`_kth_largest`, `_dense_top_p`; counted in `FALLBACK_ROWS` for top-p). `exps` and
    `kept_mass` of the result are None (the Triton kernels make their own)."""
    from lmloss.kernels import triton_sampling as ts
    from lmloss.kernels.triton_kernels import softmax_partials

    rows, dev, f32 = x.shape[0], x.device, torch.float32
    top_k, top_p, min_p = params["top_k"], params["top_p"], params["min_p"]
    p_rows = None if top_p is None else _per_row(top_p, rows, dev, torch.float64)
    p_active = p_rows is not None and bool((p_rows < 1.0).any())
    cap = KERNEL_CANDIDATES_MAX
    y_made = []

    def y_of():  # the chunk's y in fp32, made only for the rows the kernels' search leaves to a sort
        if not y_made:
            y_made.append(torch.mul(x[:, : math_.valid].to(f32), math_.scale))
        return y_made[0]

    keep = torch.full((rows,), -math.inf, dtype=f32, device=dev)

    def on_x(keep):  # the kept-so-far set as the kernels read it: a threshold on the logits
        return _on_logits(x[:, : math_.valid], y_of, keep, group, None, math_.scale)

    big_m = full = None
    pending = []  # this rank's share of sums the next SUM carries (the full mass)
    if min_p is not None or p_active or want_full_lse:
        part = softmax_partials(x, None, math_, entropy=False, target=False, sum_logits=False)
        big_m = all_reduce_max_(part[:, 0].clone(), group)
        if want_full_lse:
            pending.append(torch.where(part[:, 1] > 0, part[:, 1] * torch.exp(part[:, 0] - big_m), 0.0))
    finite = torch.ones(rows, dtype=torch.bool, device=dev) if big_m is None else torch.isfinite(big_m)
    if min_p is not None:
        t = big_m.double() + torch.log(_per_row(min_p, rows, dev, torch.float64))  # log(0) = -inf: nothing cut
        keep = torch.where(finite, torch.maximum(keep, _round_up_to(t, f32)), keep)

    def summed(*parts):  # one SUM over the group of the parts (fp32 columns) and what is pending
        cols = [q.to(f32).reshape(rows, -1) for q in (*parts, *pending)]
        out = all_reduce_sum_(torch.cat(cols, dim=1), group)
        if pending:
            pending.clear()
            return out[:, :-1], out[:, -1]
        return out, None

    def gathered(values, above):  # one all-gather of every rank's candidates and mass above them
        packed = torch.cat([above[:, None], values], dim=1)
        if world_size(group) > 1:
            parts = [torch.empty_like(packed) for _ in range(world_size(group))]
            dist.all_gather(parts, packed, group=group)
            packed = torch.stack(parts)
        else:
            packed = packed[None]
        above = packed[:, :, 0].double().sum(0)
        cand = packed[:, :, 1:].permute(1, 0, 2).reshape(rows, -1).sort(dim=1, descending=True).values
        return cand, above

    sorted_rows = torch.zeros(rows, dtype=torch.bool, device=dev)  # top-k rows sorted: top-p sorts them too
    counts = z_mass = None
    if top_k is not None:
        k = _per_row(top_k, rows, dev, torch.int64)
        mode = ts.MODE_MASS if p_active else ts.MODE_KEY
        lo = on_x(keep)
        hist, mass = ts.histogram(x, math_, lo, big_m, mode)
        total, full_sum = summed(hist, mass)
        full = full_sum if full_sum is not None else full
        hist = total[:, : ts.NBINS].round().to(torch.int64)
        at_or_above = _suffix_sums(hist)
        cut = finite & (k <= at_or_above[:, 0])
        b_k = ((at_or_above >= k[:, None]).sum(1) - 1).clamp(min=0)
        above_count = torch.cat([at_or_above, at_or_above.new_zeros(rows, 1)], 1).gather(1, (b_k + 1)[:, None])[:, 0]
        in_bin = hist.gather(1, b_k[:, None])[:, 0]
        dense = cut & (in_bin > cap)
        picked = cut & ~dense
        width = int(torch.where(picked, in_bin, 0).max()) if rows else 0
        # rows not cut: an empty window (their mass above it is all their kept mass, which top-p needs)
        b_lo = torch.where(picked, b_k, ts.NBINS).to(torch.int32)
        b_hi = torch.where(picked, b_k, -1).to(torch.int32)
        values, _, above = ts.candidates(x, math_, lo, big_m, b_lo, b_hi, width, mode)
        cand, above = gathered(values, above)
        kth = cand.gather(1, (k - above_count - 1).clamp(0, cand.shape[1] - 1)[:, None])[:, 0]
        keep = torch.where(picked, torch.maximum(keep, kth), keep)
        if bool(dense.any()):
            idx = dense.nonzero(as_tuple=True)[0]
            kth_dense = _kth_largest(y_of()[idx], k[idx], k_max, group)
            keep[idx] = torch.maximum(keep[idx], kth_dense)
            sorted_rows = dense
        if p_active:  # the kept-so-far set's histogram and mass, from this pass: no pass of its own for top-p
            kept_cand = (cand >= keep[:, None]) & torch.isfinite(cand)
            counts = torch.where(torch.arange(ts.NBINS, device=dev)[None, :] > b_k[:, None], hist, 0)
            counts = torch.where(picked[:, None], counts, hist)
            counts.scatter_add_(1, b_k[:, None], torch.where(picked, kept_cand.sum(1), 0)[:, None])
            cand_mass = torch.where(kept_cand, torch.exp(cand.double() - big_m.double()[:, None]), 0.0)
            z_mass = above + cand_mass.sum(1)
    if p_active:
        lo = on_x(keep)
        if counts is None:
            hist, mass = ts.histogram(x, math_, lo, big_m, ts.MODE_MASS)
            total, full_sum = summed(hist, mass)
            full = full_sum if full_sum is not None else full
            counts, z_mass = total[:, : ts.NBINS].round().to(torch.int64), total[:, ts.NBINS].double()
        target = p_rows * z_mass
        b_lo, b_hi, in_window = crossing_bins(counts, z_mass, target, *ts.mass_bin_bounds(dev))
        active = (p_rows < 1.0) & finite
        dense = active & ((in_window > cap) | sorted_rows)
        picked = active & ~dense
        width = int(torch.where(picked, in_window, 0).max()) if rows else 0
        values, _, above = ts.candidates(
            x, math_, lo, big_m, torch.where(picked, b_lo, ts.NBINS).to(torch.int32),
            torch.where(picked, b_hi, -1).to(torch.int32), width, ts.MODE_MASS,
        )  # fmt: skip
        cand, above = gathered(values, above)
        with one_thread(dev):
            t, _, missed = _crossing_among(cand, above, target, keep, big_m)
            miss = dense | (picked & missed)
            if bool(miss.any()):
                t_dense, _ = _dense_top_p(y_of(), keep, big_m, p_rows, miss, group)
                t = torch.where(miss, t_dense, t)
        keep = torch.maximum(keep, torch.where(active, t, -math.inf).to(f32))
    full_lse = None
    if want_full_lse:
        if full is None:
            full = all_reduce_sum_(pending.pop(), group)
        full_lse = (big_m.double() + full.double().log()).to(f32)
    return ChunkThresholds(keep_min=on_x(keep), row_max=big_m, exps=None, full_lse=full_lse)


#: The relative error `crossing_bins` allows the kept mass ``Z`` it is given: the histogram kernel's fp32 sum of a
#: row (each of its 8192 lanes adds V_local / 8192 terms in order, then a tree over the lanes; then a TP SUM of
#: the ranks' sums) is at worst about ``(V_local / 8192 + 16) * 2**-24`` off the sum of its terms, ~2**-17 at
#: V_local = 2**20 a rank; the margin is 32 times that.
CROSSING_MASS_MARGIN = 2.0**-12


def crossing_bins(
    counts: torch.Tensor, z_mass: torch.Tensor, target: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bins where top-p's crossing can lie, from a count histogram alone: int64 ``counts [c, B]`` of the kept
    columns per mass bin (bin b holds ``low[b] <= e < high[b]``, float64 ``[B]``, ascending), their total mass
    ``z_mass`` and the crossing's `target` (float64 ``[c]``, ``top_p * Z``). The crossing bin ``b*`` is the last
    whose mass at or above it reaches the target. Returns int64 ``(b_lo, b_hi, in_window)`` ``[c]``: ``b_lo <=
    b* <= b_hi`` and the count of columns in those bins.

    The mass at or above a bin is bounded two ways, and the tighter bound of each side is taken: from the top
    (the counts above times their bins' bounds: ~2% wide per bin, and these errors add up over the ~90% of the
    mass above the crossing) and from the bottom (``Z`` less the mass below, whose error adds up over the ~10%
    below it only). On flat rows (``2 * randn`` logits over 128256 columns, top_p = 0.9) the window holds
    600-1400 columns where the bound from the top alone held ~5000, more than the kernels' candidates take
    (`KERNEL_CANDIDATES_MAX`), so every such row was sorted. The bounds carry margins (the bins' edges
    ``2**-16``: a column's float64 mass may lie a few fp32 ulps outside the bin its fp32 exp was counted in,
    ``Z`` `CROSSING_MASS_MARGIN`); a crossing outside the window anyway is caught and sorted (`_crossing_among`).

    A ``Z`` that the counts contradict beyond the margins (the two bounds cross: the lower one above the upper
    one) is not used for the row: its window is the one of the counts' bounds alone (wider, and never inverted
    or empty)."""
    c = counts.double()
    lo_mass, hi_mass = c * (low * (1 - 2.0**-16)), c * (high * (1 + 2.0**-16))
    below_max = lo_mass.new_zeros(c.shape)  # the mass strictly below each bin, at most and at least
    below_min = lo_mass.new_zeros(c.shape)
    below_max[:, 1:], below_min[:, 1:] = hi_mass.cumsum(1)[:, :-1], lo_mass.cumsum(1)[:, :-1]
    z = z_mass.double()[:, None]
    from_top_min, from_top_max = _suffix_sums(lo_mass), _suffix_sums(hi_mass)
    at_or_above_min = torch.maximum(from_top_min, z * (1 - CROSSING_MASS_MARGIN) - below_max)
    at_or_above_max = torch.minimum(from_top_max, z * (1 + CROSSING_MASS_MARGIN) - below_min)

    def last_reaching(bound):  # every bound falls with the bin (differences of monotone sums): a prefix
        return ((bound >= target[:, None]).sum(1) - 1).clamp(min=0)

    b_lo, b_hi = last_reaching(at_or_above_min), last_reaching(at_or_above_max)
    crossed = b_lo > b_hi  # Z contradicts the counts: bound by the counts alone (b_lo <= b* <= b_hi again)
    b_lo = torch.where(crossed, last_reaching(from_top_min), b_lo)
    b_hi = torch.where(crossed, last_reaching(from_top_max), b_hi)
    count_from = torch.cat([_suffix_sums(counts), counts.new_zeros(counts.shape[0], 1)], 1)
    in_window = count_from.gather(1, b_lo[:, None])[:, 0] - count_from.gather(1, (b_hi + 1)[:, None])[:, 0]
    return b_lo, b_hi, in_window


def _suffix_sums(t: torch.Tensor) -> torch.Tensor:
    """Per bin of ``[c, bins]``, the sum over that bin and every bin above it, summed from the top (exact for
    integer counts; `_at_or_above` is the float64 mass form the PyTorch search uses)."""
    return t.flip(1).cumsum(1).flip(1)


def _smallest_kept(keep: torch.Tensor, cut: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Per row the smallest float x of keep's dtype with ``x * scale >= keep`` (the product rounded as the
    kernels' `transform_into` rounds it: the same op, ``torch.mul`` by the same scalar), or None when a row's
    boundary is not pinned down within a few ulps (then the caller scans the chunk).

    Rounding is monotone, so ``{x : x * scale >= keep}`` is ``{x >= that x}``: a threshold on the logits that
    keeps exactly the set the search found on y. Starting from ``keep / scale`` it steps up while the product
    is below `keep` and down while the one below still reaches it; checked at the end."""
    if not scale > 0 or not math.isfinite(scale):
        return None
    t = torch.where(cut, keep, 0.0)
    up, down = torch.full_like(t, math.inf), torch.full_like(t, -math.inf)
    x = (t.double() / scale).to(t.dtype)
    for _ in range(3):
        x = torch.where(torch.mul(x, scale) < t, torch.nextafter(x, up), x)
    for _ in range(3):
        below = torch.nextafter(x, down)
        x = torch.where(torch.mul(below, scale) >= t, below, x)
    pinned = (torch.mul(x, scale) >= t) & (torch.mul(torch.nextafter(x, down), scale) < t)
    return x if bool((pinned | ~cut).all()) else None


def _kth_largest(y: torch.Tensor, k: torch.Tensor, k_max: int, group) -> torch.Tensor:
    """The k-th largest value of each row over the global vocabulary (-inf where k >= its size)."""
    rows, cols = y.shape
    local_k = min(k_max, cols)
    vals = torch.topk(y, local_k, dim=1).values if local_k > 0 else y.new_empty((rows, 0))
    if world_size(group) > 1:  # every rank's candidates, padded to k_max (a shard may be smaller)
        vals = torch.cat([vals, vals.new_full((rows, k_max - local_k), -math.inf)], dim=1)
        parts = [torch.empty_like(vals) for _ in range(world_size(group))]
        dist.all_gather(parts, vals.contiguous(), group=group)
        vals = torch.topk(torch.cat(parts, dim=1), k_max, dim=1).values
    k_total = vals.shape[1]
    kth = (
        vals.gather(1, (k.clamp(max=max(k_total, 1)) - 1).clamp(min=0)[:, None]).squeeze(1)
        if k_total
        else None
    )
    # k beyond the candidates (or an -inf padding value, a vocabulary smaller than k): nothing cut
    cut = (k <= k_total) if kth is not None else torch.zeros_like(k, dtype=torch.bool)
    if kth is None:
        return torch.full((rows,), -math.inf, dtype=y.dtype, device=y.device)
    return torch.where(cut, kth, -math.inf)


def _sum64(t: torch.Tensor) -> torch.Tensor:
    """Row sums of ``[c, V]`` as float64: fp32 sums of 256-column blocks, then float64 across blocks (as
    accurate as a float64 sum here, at the cost of an fp32 one)."""
    rows, cols = t.shape
    main = cols - cols % 256
    total = (
        t[:, :main].unflatten(1, (-1, 256)).sum(-1).double().sum(1) if main else t.new_zeros(rows).double()
    )
    return total + t[:, main:].double().sum(1) if main < cols else total


def _at_or_above(hist: torch.Tensor) -> torch.Tensor:
    """Float64 mass at or above each bin (summed from the top bin down), ``[c, bins]``: one float64 buffer kept
    (``hist``'s values convert to float64 exactly, so adding the fp32 ones adds the same numbers)."""
    below = hist.double().cumsum(1)  # mass at or below each bin; at or above = total - below + own (in place)
    total = below[:, -1:].clone()
    return torch.sub(total, below, out=below).add_(hist)


def _mass_above(at_or_above: torch.Tensor, crossing: torch.Tensor) -> torch.Tensor:
    """The mass strictly above each row's `crossing` bin: the next bin's mass at or above it (0 above the top
    bin), read without a padded copy of ``[c, bins]``."""
    nxt = (crossing + 1)[:, None]
    above = at_or_above.gather(1, nxt.clamp(max=at_or_above.shape[1] - 1)).squeeze(1)
    return torch.where(nxt.squeeze(1) < at_or_above.shape[1], above, 0)


def _crossing(at_or_above: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The largest bin whose mass at or above it reaches `target` (0 if none)."""
    return ((at_or_above >= target[:, None]).sum(1) - 1).clamp(min=0)


def _mass_kept_so_far(y, exps, keep, big_m, scratch) -> tuple[bool, torch.Tensor]:
    """Zero the exps (in place) outside the set top-k / min-p kept so far and in rows of NaN / inf logits
    (their exps are NaN: no mass). Returns whether any row was cut and which rows are finite."""
    rows, cols = y.shape
    keep_cut = bool(torch.isfinite(keep).any())
    if keep_cut:  # a multiply by a 0 / 1 float mask: a bool operand, masked_fill or where cost several passes on CPU
        exps.mul_(torch.ge(y, keep[:, None], out=scratch.get("kept", rows, cols, y.dtype)))
    finite = torch.isfinite(big_m)
    if not bool(finite.all()):
        exps.masked_fill_(~finite[:, None], 0.0)
    return keep_cut, finite


def _top_p_threshold(y, exps, big_m, keep, top_p, *, group, scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest kept value of top-p over ``{y >= keep}`` (-inf where top_p == 1), and the mass
    ``sum exp(y - M)`` of the kept set (float64 ``[c]``; over the whole group's vocabulary).

    `exps` ``[c, V]``: ``exp(y - M)`` (zeroed here below `keep`). A histogram of the kept mass per row over
    `TOP_P_BINS` fixed log-probability bins (summed over the group) gives the kept mass ``Z``, the bin
    where the mass from the top crosses ``top_p * Z``, and the mass above that bin; the tokens of the
    crossing bin are the candidates, and the exact crossing is found among them in float64. Each bin
    sums fp32 exps and the bins are summed in float64, so the masses are good to ~1e-7 relative.
    """
    rows, cols = y.shape
    dt, dev = y.dtype, y.device
    nb = TOP_P_BINS
    keep_cut, finite = _mass_kept_so_far(y, exps, keep, big_m, scratch)
    # each token's bin: the leading bits of its fp32 exp (exponent and TOP_P_MANTISSA_BITS mantissa bits),
    # monotone in y, below _TOP_P_LOWEST + nb for every value in [0, 1]. The histogram and the candidates'
    # mask both read these same integers, so they agree on every token's bin. (int32 work in the free
    # "kept" buffer; scatter_add wants int64 indices, and parallelises over rows where index_add does not.)
    bins = scratch.get("kept", rows, cols, torch.float32).view(torch.int32)
    bits = exps if dt == torch.float32 else bins.view(torch.float32).copy_(exps)  # fp64: rounded, monotone
    torch.bitwise_right_shift(bits.view(torch.int32), _TOP_P_SHIFT, out=bins)
    index = scratch.get("samp_index", rows, cols, torch.int64).copy_(bins)
    full = torch.zeros((rows, _TOP_P_LOWEST + nb), dtype=dt, device=dev).scatter_add_(1, index, exps)
    # the bins below 2**-TOP_P_OCTAVES are lumped into the lowest one kept (nb per row are summed over the
    # group and searched); a crossing down there (top_p within ~1e-15 of 1) misses the candidates, which
    # are the crossing bin's own tokens, and goes to the dense fallback
    with one_thread(dev):  # [c, bins] work
        hist = full[:, _TOP_P_LOWEST:].contiguous()
        hist[:, 0] += full[:, :_TOP_P_LOWEST].sum(1)
        del full  # [c, ~4k bins]: let it go before the float64 sums (the budget counts per-row bytes)
        at_or_above = _at_or_above(all_reduce_sum_(hist, group))
        del hist
        target = top_p * at_or_above[:, 0]  # the kept mass Z is everything at or above bin 0
        crossing = _crossing(at_or_above, target)
        above = _mass_above(at_or_above, crossing)  # the mass strictly above the bin
        z_mass = at_or_above[:, 0].clone()
        del at_or_above
        cross_id = (crossing + _TOP_P_LOWEST).to(torch.int32)[:, None]
    in_bin = torch.eq(bins, cross_id, out=scratch.get("samp_mask", rows, cols, torch.bool))
    r, col = in_bin.nonzero(as_tuple=True)
    vals = y[r, col]
    with one_thread(dev):
        cand = _candidates(vals, r, rows, group)  # [c, C] descending, -inf padded
        t, kept_mass, missed = _crossing_among(cand, above, target, keep if keep_cut else None, big_m)
        active = (top_p < 1.0) & finite
        miss = active & missed
        if bool(miss.any()):
            t_dense, mass_dense = _dense_top_p(y, keep, big_m, top_p, miss, group)
            t = torch.where(miss, t_dense, t)
            kept_mass = torch.where(miss, mass_dense, kept_mass)
        kept_mass = torch.where(active, kept_mass, z_mass)
        return torch.where(active, t, -math.inf), kept_mass


def _crossing_among(cand, above, target, keep, big_m) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-p's crossing among the candidates ``cand [c, C]`` (descending, -inf padded): the tokens of the bins
    where the mass from the top crosses `target` (float64 ``[c]``), `above` (float64 ``[c]``) the mass of every
    token above them, masses ``exp(y - big_m)`` in float64, those below `keep` (None: none) left out. Returns the
    threshold (the last kept value), the kept set's mass and the rows whose crossing is not among the candidates
    (nothing kept, or all kept with mass still short of the target: the caller sorts those rows)."""
    cand_mass = torch.exp(cand.double() - big_m.double()[:, None])  # the padding's is 0
    if keep is not None:
        cand_mass = torch.where(cand >= keep[:, None], cand_mass, 0.0)
    # a candidate is kept iff the mass strictly above it is < target: a prefix of the descending list.
    # Per position, not per run of equal values: the threshold is the last kept value, and y >= t keeps
    # all of its equals, which is what the rule on runs keeps
    cum = cand_mass.cumsum(1)
    kept = (cum - cand_mass < (target - above)[:, None]) & (cand_mass > 0)
    n_kept = kept.sum(1)
    t = cand.gather(1, (n_kept - 1).clamp(min=0)[:, None]).squeeze(1)
    kept_mass = above + torch.where(cand >= t[:, None], cand_mass, 0.0).sum(1)
    # the crossing must lie among the candidates: something kept, and not all while mass remains below
    # (fp32 rounding of a bin's sum right at a bin edge can put it one bin off: that row is sorted)
    all_kept_short = (n_kept == (cand_mass > 0).sum(1)) & (above + cum[:, -1] < target)
    return t, kept_mass, (n_kept == 0) | all_kept_short


#: Rows per `scatter_add` of the invariant top-p's float64 histogram (a ``[rows, V]`` float64 copy of the exps).
_EXACT_SLICE_ROWS = 64


def _top_p_threshold_exact(y, exps, big_m, keep, top_p, *, group, scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """`_top_p_threshold` in the invariant mode: the same bins, crossing and candidates, with every mass
    summed exactly, so that they are the same whatever the chunk and the shards.

    fp32 exps: a bin's tokens share one binary exponent (the bin is read off the exponent and leading
    mantissa bits), so their float64 sum is exact in any order, and so is the SUM of the ranks' bins; the
    tokens below ``2**-64`` times the top one (their own exponents: the default lumps them into bin 0) are
    left out. The candidates are the crossing bin's tokens, their masses the same float64 values, summed
    exactly too. float64 exps: each token's mass as a fixed-point integer (`to_fixed_point`), summed as
    int64. The float sums above the bins (the mass at or above each) run in the bins' fixed order. Returns the
    threshold (-inf where top_p == 1) and the kept set's mass (float64, the group's; the bins' total where
    top_p == 1), both functions of the group's bins and candidates alone."""
    rows, cols = y.shape
    dt, dev = y.dtype, y.device
    nb = TOP_P_BINS
    keep_cut, finite = _mass_kept_so_far(y, exps, keep, big_m, scratch)
    bins = scratch.get("kept", rows, cols, torch.float32).view(torch.int32)
    bits = exps if dt == torch.float32 else bins.view(torch.float32).copy_(exps)
    torch.bitwise_right_shift(bits.view(torch.int32), _TOP_P_SHIFT, out=bins)
    index = scratch.get("samp_index", rows, cols, torch.int64).copy_(bins)
    if dt == torch.float32:
        full = torch.zeros((rows, _TOP_P_LOWEST + nb), dtype=torch.float64, device=dev)
        for r in range(0, rows, _EXACT_SLICE_ROWS):
            part = slice(r, r + _EXACT_SLICE_ROWS)
            full[part].scatter_add_(1, index[part], exps[part].double())

        def mass_of(values):  # the histogram's own values of the candidates
            return torch.exp(values - big_m[:, None]).double()

    else:
        mass = to_fixed_point(exps, out=scratch.get("samp_mass", rows, cols, torch.int64))
        full = torch.zeros((rows, _TOP_P_LOWEST + nb), dtype=torch.int64, device=dev).scatter_add_(1, index, mass)

        def mass_of(values):
            return to_fixed_point(torch.exp(values - big_m[:, None]))

    with one_thread(dev):
        hist = full[:, _TOP_P_LOWEST:].contiguous()
        if dt != torch.float32:  # integers: the lumped bin's sum is exact too
            hist[:, 0] += full[:, :_TOP_P_LOWEST].sum(1)
        del full  # [c, ~4k bins]: let it go before the sums (the budget counts per-row bytes)
        all_reduce_sum_(hist, group)
        below = hist.cumsum(1)
        at_or_above = below[:, -1:] - below + hist
        target = top_p * at_or_above[:, 0].double()
        crossing = ((at_or_above.double() >= target[:, None]).sum(1) - 1).clamp(min=0)
        above = _mass_above(at_or_above, crossing)
        cross_id = (crossing + _TOP_P_LOWEST).to(torch.int32)[:, None]
    in_bin = torch.eq(bins, cross_id, out=scratch.get("samp_mask", rows, cols, torch.bool))
    r, col = in_bin.nonzero(as_tuple=True)
    vals = y[r, col]
    with one_thread(dev):
        cand = _candidates(vals, r, rows, group)
        cand_mass = mass_of(cand)  # the padding's is 0
        if keep_cut:
            cand_mass = torch.where(cand >= keep[:, None], cand_mass, 0)
        cum = cand_mass.cumsum(1)
        kept = ((above[:, None] + (cum - cand_mass)).double() < target[:, None]) & (cand_mass > 0)
        n_kept = kept.sum(1)
        t = cand.gather(1, (n_kept - 1).clamp(min=0)[:, None]).squeeze(1)
        # the kept candidates are a prefix of the descending list (every value >= t): their running mass there
        n_at_or_above = (cand >= t[:, None]).sum(1)
        kept_mass = above + cum.gather(1, (n_at_or_above - 1).clamp(min=0)[:, None]).squeeze(1)
        kept_mass = torch.where(active := (top_p < 1.0) & finite, kept_mass, at_or_above[:, 0])
        if kept_mass.dtype == torch.int64:  # fixed point
            kept_mass = kept_mass.double() * 2.0**-INVARIANT_FRACTION_BITS
        all_kept_short = (n_kept == (cand_mass > 0).sum(1)) & ((above + cum[:, -1]).double() < target)
        miss = active & ((n_kept == 0) | all_kept_short)
        if bool(miss.any()):
            t_dense, mass_dense = _dense_top_p(y, keep, big_m, top_p, miss, group, exact=True)
            t, kept_mass = torch.where(miss, t_dense, t), torch.where(miss, mass_dense, kept_mass)
        return torch.where(active, t, -math.inf), kept_mass


def _candidates(vals: torch.Tensor, r: torch.Tensor, rows: int, group) -> torch.Tensor:
    """Flat values `vals` of rows `r` (non-decreasing, as ``nonzero`` gives them), gathered over `group`:
    ``[rows, C]`` descending per row, -inf padded."""
    counts = torch.bincount(r, minlength=rows)
    width = int(counts.max()) if r.numel() else 0
    if world_size(group) > 1:
        width_t = torch.tensor([width], device=vals.device)
        width = int(all_reduce_max_(width_t, group))
    starts = counts.cumsum(0) - counts
    within = torch.arange(r.numel(), device=vals.device) - starts[r]
    dense = vals.new_full((rows, max(width, 1)), -math.inf)
    dense[r, within] = vals
    if world_size(group) > 1:
        parts = [torch.empty_like(dense) for _ in range(world_size(group))]
        dist.all_gather(parts, dense, group=group)
        dense = torch.cat(parts, dim=1)
    return dense.sort(dim=1, descending=True).values


def _dense_top_p(y, keep, big_m, top_p, rows_mask, group, *, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-p threshold and kept mass (as `_top_p_threshold`) of the rows in `rows_mask` by sorting
    them whole (the rare fallback). `exact`: the masses in fixed point (`_top_p_threshold_exact`), exact sums
    whatever the rows' widths."""
    idx = rows_mask.nonzero(as_tuple=True)[0]
    FALLBACK_ROWS[0] += int(idx.numel())
    sub = y[idx]
    if world_size(group) > 1:
        width = torch.tensor([sub.shape[1]], device=y.device)
        width = int(all_reduce_max_(width, group))
        sub = torch.cat([sub, sub.new_full((sub.shape[0], width - sub.shape[1]), -math.inf)], dim=1)
        parts = [torch.empty_like(sub) for _ in range(world_size(group))]
        dist.all_gather(parts, sub.contiguous(), group=group)
        sub = torch.cat(parts, dim=1)
    vals = sub.sort(dim=1, descending=True).values
    if exact:  # as the histogram's: exp in y's dtype, then fixed point
        mass = to_fixed_point(torch.exp(vals - big_m[idx][:, None]))
        mass = torch.where(vals >= keep[idx][:, None], mass, 0)
    else:
        mass = torch.exp(vals.double() - big_m[idx].double()[:, None])
        mass = torch.where(vals >= keep[idx][:, None], mass, 0.0)
    z = mass.sum(1)
    excl = mass.cumsum(1) - mass
    n = vals.shape[1]
    pos = torch.arange(n, device=y.device).expand_as(vals)
    new_run = torch.ones_like(vals, dtype=torch.bool)
    if n > 1:
        new_run[:, 1:] = vals[:, 1:] != vals[:, :-1]
    excl = excl.gather(1, torch.where(new_run, pos, 0).cummax(1).values)
    kept = (excl.double() < (top_p[idx] * z.double())[:, None]) & (mass > 0)
    t_rows = vals.gather(1, (kept.sum(1) - 1).clamp(min=0)[:, None]).squeeze(1)
    out = torch.full_like(big_m, -math.inf)
    out[idx] = t_rows
    kept_mass = torch.zeros(big_m.shape, dtype=torch.float64, device=y.device)
    rows_mass = torch.where(kept, mass, 0).sum(1)
    kept_mass[idx] = rows_mass.double() * 2.0**-INVARIANT_FRACTION_BITS if exact else rows_mass
    return out, kept_mass


# ----------------------------------------------------------------------------------------------------------
# replay: the kept set the engine returned


def support_from_offsets(ids: torch.Tensor, offsets: torch.Tensor, *, pad: int = -1) -> torch.Tensor:
    """vLLM-style flat kept ids + offsets -> ``[N, K]`` int64 padded with `pad` (-1).

    ids: ``[T]`` integer, the kept ids of every token one after another. offsets: ``[N + 1]`` integer,
    non-decreasing, token i's ids are ``ids[offsets[i]:offsets[i + 1]]`` (``offsets[0] == 0``,
    ``offsets[-1] == T``). K is the largest count.
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point():
        raise TypeError("ids must be a 1-D integer tensor")
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.is_floating_point():
        raise TypeError("offsets must be a 1-D integer tensor")
    offsets = offsets.long()
    counts = offsets[1:] - offsets[:-1]
    if (
        offsets.numel() == 0
        or int(offsets[0]) != 0
        or int(offsets[-1]) != ids.numel()
        or bool((counts < 0).any())
    ):
        raise ValueError(
            f"offsets must be non-decreasing from 0 to len(ids)={ids.numel()}, got {offsets.tolist()[:8]}..."
        )
    n = counts.numel()
    width = int(counts.max()) if n else 0
    out = torch.full((n, max(width, 1)), pad, dtype=torch.int64, device=ids.device)
    row = torch.repeat_interleave(torch.arange(n, device=ids.device), counts)
    within = torch.arange(ids.numel(), device=ids.device) - offsets[:-1][row]
    out[row, within] = ids.long()
    return out


def check_support(
    support: object, n_tokens: int, device: torch.device, vocab_size: int | None
) -> torch.Tensor:
    """``[..., K]`` integer ids (-1 padding) with ``N`` leading elements -> flat ``[N, K]`` int64."""
    if not isinstance(support, torch.Tensor) or support.is_floating_point() or support.dtype == torch.bool:
        raise TypeError(
            f"support must be an integer tensor of kept ids [N, K] (-1 padded), got {support!r:.60}"
        )
    if (
        support.dim() < 1
        or support.numel() // max(support.shape[-1], 1) != n_tokens
        or support.shape[-1] == 0
    ):
        raise ValueError(
            f"support must be [N, K] with N = {n_tokens} tokens and K >= 1, got {tuple(support.shape)}"
        )
    if support.device != device:
        raise ValueError(f"support is on {support.device} but the inputs are on {device}")
    flat = support.reshape(n_tokens, support.shape[-1]).long()
    high = math.inf if vocab_size is None else vocab_size
    bad = (flat < -1) | (flat >= high)
    if bool(bad.any()):
        raise ValueError(f"support ids must be in [0, vocab) or -1 (padding), found {int(flat[bad][0])}")
    srt = flat.sort(dim=1).values
    if bool(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()):
        raise ValueError("support has an id twice in one row; each row must list distinct ids")
    return flat


@dataclasses.dataclass(frozen=True)
class SupportSlots:
    """Where this rank's columns sit in the ``[N, K]`` support slots.

    local: ``[N, K]`` int64 local column of each slot's id (clamped; meaningless where not owned).
    owned: ``[N, K]`` bool, the slot's id is a valid column of this rank's shard.
    labels: ``[N]`` int64 labels for the op over the slots (global slot ``rank * K + q``), ignore_index
        where the label was ignored or is outside the support (`dropped`).
    dropped: ``[N]`` bool, a non-ignored label that is not in the support.
    """

    local: torch.Tensor
    owned: torch.Tensor
    labels: torch.Tensor | None
    dropped: torch.Tensor | None


def support_slots(
    support: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    start: int,
    valid: int,
    local_vocab: int,
    rank: int,
    group: ProcessGroup | None,
    ignore_index: int,
) -> SupportSlots:
    """Map global support ids and labels onto this rank's slots (see `SupportSlots`)."""
    k = support.shape[1]
    local = support - start
    owned = (support >= 0) & (local >= 0) & (local < valid)
    local = local.clamp(0, max(local_vocab - 1, 0))
    if labels is None:
        return SupportSlots(local, owned, None, None)
    hit = support == labels[:, None]
    in_support = hit.any(1)
    valid_label = labels != ignore_index
    pos = hit.to(torch.int8).argmax(1)
    mine = (labels >= start) & (labels < start + valid)
    # the label's slot is global (owner rank * K + position) and the same on every rank: the rank that
    # owns it is found with one all-reduce of [N] (exactly one rank's shard holds a supported label)
    owner = torch.where(mine & in_support, rank, 0)
    all_reduce_sum_(owner, group)
    dropped = valid_label & ~in_support
    slot_labels = torch.where(valid_label & in_support, owner * k + pos, ignore_index)
    return SupportSlots(local, owned, slot_labels, dropped)
