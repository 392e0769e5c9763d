"""The per-chunk softmax math, in two implementations with one contract.

Everything above this package (the plan, the chunk loop, the TP combine) is the same for both; only these
functions differ. ``impl="torch"`` is the PyTorch reference (any device; the ground truth in tests);
``impl="triton"`` runs Triton kernels (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

The contract, for one chunk ``x [c, V_local]`` (fp32 / bf16 / fp16; ``x.stride(1) == 1``) with global
labels ``[c]`` (int64, or None). For a valid column ``j < valid`` write
``y_j = scale * softcap(x_j)``, where ``softcap(x) = cap * tanh(x / cap)`` (the identity when cap is 0),
computed in fp32. Padded columns (``j >= valid``) take no part in anything and get a zero gradient.

``softmax_partials(x, labels, math, *, entropy, target, sum_logits, sum_sq=False, argmax=False) -> [c, 5]`` fp32, per row, relative
to this shard only (combined over the TP group afterwards by `lmloss.vocab_parallel.combine_partials`):

    0: m = max_j y_j            (-inf when the shard has no valid column)
    1: s = sum_j exp(y_j - m)
    2: t = sum_j exp(y_j - m) * (y_j - m)    if entropy, else 0 (a column with exp(...) == 0 adds 0)
    3: y_label (label owned by this shard)  if target, else 0 (also 0 when not owned or ignored)
    4: sum_j y_j                            if sum_logits, else 0

With ``sum_sq`` or ``argmax`` (the by-products of the per-token ops, issue #42) the partials are ``[c, 8]``:
the five columns above, then

    5: s2 = sum_j exp(2 (y_j - m))          if sum_sq, else 0 (the same shift m as s: log sum p^2 = log s2 - 2 log s)
    6: v = max_j y_j                        if argmax, else 0 (-inf when the shard has no kept valid column)
    7: the global id ``vocab_start + j`` of the lowest column with y_j == v, as a float (exact: the plan
       keeps the vocabulary below 2**24), -1 when v is -inf; if argmax, else 0

over the same columns as the others (the kept valid ones); ``v`` is column 0's ``m`` wherever the kernels shift
by the shard's own max (the PyTorch kernels' kept path shifts by the threshold search's global max instead).
`lmloss.vocab_parallel.combine_partials` combines them (``s2`` rescaled by ``exp(2 (m - M))``; ``v`` in the
same MAX as ``m``, the lowest id of the ranks whose ``v`` is the global one in the same SUM).

``softmax_grad_(x, labels, lse, entropy, coef, math, out) -> out`` writes ``d/dx`` of the chunk's outputs
into `out` (any float dtype; `out` may be `x` itself), from the per-row coefficients ``coef [c, 4]`` fp32
``(a, b, c, d)``, with ``logp_j = y_j - lse`` and ``p_j = exp(logp_j)``:

    g_j = a * p_j + d * p_j * (logp_j + H) + b * [j == label] + c,   then times dy/dx (scale, softcap)

where a term whose coefficient is 0 adds exactly 0 (the Triton kernels guarantee it for the ``p`` terms
through the row: in a row with ``a == d == 0`` its lse takes no part, nor H where ``d == 0``; the
logits themselves are then finite in every row the ops produce), ``p * (logp + H)`` is 0 where ``p == 0``,
and a row whose coefficients are all 0 gets exactly 0 whatever its logits (NaN, inf). `entropy` ``[c]`` (``H``) is
None when no row has ``d != 0``.

``partials_then_grad_(x, labels, math, flags, finish, out) -> (result, out)``: the two in one visit of the
chunk, with ``finish(partials) -> (result, coef, lse)`` or ``(result, coef, lse, entropy)`` in between (the
TP combine and the output math; the coefficients may depend on the chunk's own outputs, as an RL
objective's do). `finish` returns ``entropy`` when ``coef`` has a ``d`` term (then ``flags["entropy"]``
is set).

The scalar-loss paths (``reduction="sum" / "mean"`` with the gradient computed in the forward) fold the
reduction's factor into the gradient there: ``grad_scale`` (a 0-d device tensor, ``1 / count`` for a mean)
multiplies the per-token upstream, so the gradient comes out already scaled and no host sync is needed.
The backward then multiplies by the upstream scalar with `scale_`, which does nothing over the gradient
when that upstream is exactly 1.0 (the common ``loss.backward()``), and `scaled_cast` scales and casts in
one pass.

**Two distributions** (the student / teacher divergences of `lmloss.distill`). For a student chunk ``xs``
and a teacher chunk ``xt`` (the same ``[c, V_local]`` columns; the teacher may have another float dtype)
with their global log-sum-exps ``lse [c, 2]`` (student, teacher; from `softmax_partials` of each, combined),
write ``ls = scale * softcap(xs) - lse[:, 0]`` (the math's softcap is the student's) and
``lt = scale * xt - lse[:, 1]`` (a teacher's own softcap is applied by its chunk source) over the valid
columns and
``p_s = exp(ls)``, ``p_t = exp(lt)``; for ``0 < beta < 1``, ``log m = logaddexp(ls + log(1 - beta),
lt + log(beta))``. A column where a probability is 0 adds exactly 0 to the sums that weight by it.

``lse`` may be None, where ``normalises_rows`` is True, for one process whose columns are all valid:
the kernel then normalises each row itself (``ls = log_softmax(scale * xs)``), with no separate statistics pass.

``divergence_partials(xs, xt, lse, math, beta, *, overwrite) -> [c, 2]`` per-row sums over this shard:

    beta == 0:      0: sum p_t (lt - ls)                 1: 0
    beta == 1:      0: sum p_s (ls - lt)                 1: 0
    otherwise:      0: sum p_t (lt - log m)              1: sum p_s (ls - log m)

``divergence_grad_(xs, xt, lse, coef, math, beta, out, *, overwrite) -> out`` writes, from per-row
``coef [c, 2]`` = (weight ``w``, ``S``: from the global sums, `lmloss.distill.divergence_rows`),
``out = w * g * dy/dx`` with ``g = p_s - p_t`` (beta 0), ``p_s (ls - lt - S)`` (beta 1),
``p_s ((1 - beta)(ls - log m) - S)`` (otherwise) and ``dy/dx`` the student's (``scale``, times
``1 - tanh^2`` with softcap); padded columns and rows with ``w == 0`` get exactly 0.
``divergence_partials_then_grad_(xs, xt, lse, math, beta, finish, out, *, overwrite) -> result`` does both,
calling ``finish(partials) -> (result, coef)`` in between. ``overwrite=True``: both chunks are the caller's
scratch (and `out` may be `xs`); they may be overwritten. Implementations: `lmloss.kernels.torch_distill`
and `lmloss.kernels.triton_distill` (``normalises_rows``: whether ``lse=None`` is supported; PyTorch only).
A sparse teacher needs only the single-distribution contract above.

**The folded full KL** (both implementations since issue #33; the RL objective's ``kl_loss_type="full"``,
`lmloss.objectives.SoftmaxObjective`): ``softmax_grad_with_difference_(x, labels, z, lse, math, finish, out, *,
uniform_term) -> sums`` is `softmax_grad_` with one more term against a second chunk ``z`` of the same columns (the
reference policy's logits, its softcap applied; ``math`` without softcap): ``sums = sum_j p_j (x_j - z_j)`` over
the valid columns (this shard's, ``[c]``), then ``coef, z_coef, entropy = finish(sums)`` (the TP SUM and the
objective's upstream), then

    out = dy/dx * (a p + d p (log p + H) + z_coef p (x - z)) + b [j == label] + c

(a row whose coefficients and ``z_coef`` are all 0 gets exactly 0, whatever its x or z hold). Which chunks it takes:
``can_fold_difference(x, z, z_is_scratch) -> bool`` (the PyTorch kernels write ``x - z`` over ``z``: it must be
the caller's scratch in x's compute dtype; the Triton kernels read any float dtypes and write neither). The
PyTorch kernels reuse the exps the policy's `softmax_partials` of the same chunk left in their scratch when it is
the last call before (the objective makes the reference's partials first); the Triton kernels make the sums in one
kernel (`triton_kernels.difference_sums`) and the term in the gradient kernel (``DIFF``). The policy's
``softmax_partials(x, ..., overwrite=True, difference_into=z)`` says that this gradient of x and z follows: an
implementation may write ``x - z`` over z there and then work in x (the PyTorch kernels do, for an fp32 / fp64 x
they own: one chunk-sized buffer fewer, the same bits); the Triton kernels ignore it.

Kept set (sampling truncation, `lmloss.sampling`): ``softmax_partials``, ``softmax_grad_`` and
``partials_then_grad_`` take an optional ``keep_min [c]`` (y's dtype). A valid column with
``y_j < keep_min`` is outside the row's distribution, like padding: it adds nothing to the partials (its
target is -inf when it is the label), and its gradient is 0; ``p`` above is then the renormalised
probability over the kept columns (``lse`` is theirs). The comparison is on ``y`` rounded exactly as the
partials round it (`TorchKernels.scaled`), so forward and backward agree on the set. A row with no kept
column on this shard (TP) gives ``m = -inf``, ``s = t = 0``. ``softmax_partials`` also takes an optional
``kept_exps = (e [c, V_valid], shift [c], kept_mass [c] or None)`` with the keep_min: what the threshold
search (`lmloss.sampling.keep_thresholds`) already computed, ``e_j = exp(y_j - shift)`` (``shift`` the global
row max, so ``e`` may be overwritten) and, where it summed it, the kept set's mass ``sum e_j`` over this
rank's kept columns. An implementation may use them instead of recomputing (the PyTorch one does; its
``m`` is then ``shift``, which the TP combine accepts: the partials are the same relative to any shift
at or above the kept values) or ignore them (the Triton kernels do: their one pass makes its own exps;
they take ``keep_min`` behind a ``KEEP`` constexpr, so the plain kernels compile unchanged). The thresholds
are found by `lmloss.sampling.keep_thresholds` on PyTorch's rounding of ``y`` (any implementation with softcap,
whose Triton tanh rounds differently, or in invariant mode), or, with the Triton kernels otherwise, by
`lmloss.sampling.keep_thresholds_by_kernels` with the search's own Triton kernels (`lmloss.kernels.triton_sampling`:
a histogram of the row's columns over fixed bins and the candidates of a window of bins, each one read of the chunk;
their contract is in that module) on the same fp32 products ``x * scale``: the same kept set, without a
``[c, V]`` buffer.

**Invariant mode** (``invariant=True`` of the ops, docs/invariant.md): instead of `softmax_partials`, the
objectives ask for ``block_partials(x, labels, math, *, entropy, target, sum_logits, argmax=False, keep_min=None,
kept_exps=None, block=INVARIANT_BLOCK, global_max=None, overwrite=False) -> BlockPartials``: the same sums
taken over fixed blocks of `INVARIANT_BLOCK` columns (local columns ``[b B, (b + 1) B)``; the plan checks
that every shard starts at a multiple of B, so local block b is global block ``vocab_start / B + b``). Per
block, over its kept valid columns: ``s_b = sum exp(y - m_b)``, ``t_b = sum exp(y - m_b) (y - m_b)`` (if
entropy), ``sum y`` (if sum_logits), and per row the target as in `softmax_partials` (``[c]``) and, if
argmax, `BlockPartials.top` (the row's max and its lowest id: exact, no blocks; ``sum_sq`` has no block form,
the plan refuses it in this mode), where the
shift ``m_b`` is the block's own max of y (-inf when it has none), or, when the implementation calls
``global_max(values [c, k]) -> [c, k]`` (one MAX over the TP group; with sum_logits its last column is the
largest finite ``|sum y|`` block's magnitude), the row's global max for every block. A block's sums are
reduced in an order fixed by B alone: the same bits for that block whatever the chunk's rows, the shard
width or the block's position in the shard; the last block of the vocabulary may be partial (its missing
columns take no part, in the same fixed positions). `lmloss.vocab_parallel.combine_blocks` then combines
the blocks exactly (fixed point, integer sums: no order at all). Both implementations: the PyTorch one
shifts by the global max (and reuses `kept_exps`, which are shifted by it), the Triton one by each block's
max in its one pass, and sums each block exactly too (int32 sums of terms rounded to 2**-22 of the block's max:
no layout, alignment or code path of the compiled kernel changes a bit; a row with a NaN or +inf logit gets NaN
sums in its first block). `block` 1 (a replayed support's slots, which the ranks hold scattered) makes every
slot its own block. The gradient contract is unchanged: `softmax_grad_` is elementwise given the row's lse
and coefficients, so it needs no invariant variant (the PyTorch ``partials_then_grad_`` reuse of the
forward's exps is not used in this mode).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

IMPLS = ("auto", "torch", "triton")
#: Columns per block of the invariant mode's vocabulary sums (`BlockPartials`): Megatron pads the vocabulary
#: to a multiple of 128 x TP by default (``--make-vocab-size-divisible-by 128``), so its shards start on a block.
INVARIANT_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class BlockPartials:
    """A chunk's sums per block of columns (invariant mode, see the module docstring), each ``[c, n_blocks]``
    in the compute dtype: `m` the shift of each block's sums (``[c, 1]``: one for every block), `s` sum
    exp(y - m), `t` the entropy numerator (None unless asked), `sum_y` (None unless asked); `target` ``[c]``
    y at the label where this shard owns it, else 0. `m` is the block's max of y (-inf: no kept valid
    column), or with `global_max` the row's max over the whole vocabulary (every rank's), already agreed;
    then `y_scale` ``[c]`` (with `sum_y`) is the largest finite ``|sum_y|`` block's over every rank too.
    `top` ``[c, 2]`` (with ``argmax``, else None): per row the shard's largest y over its kept valid columns and
    the global id of its lowest column (-inf and -1 where it has none), as the partials' columns 6 and 7: a max
    and its position are exact, so they need no block form."""

    m: torch.Tensor
    s: torch.Tensor
    t: torch.Tensor | None
    sum_y: torch.Tensor | None
    target: torch.Tensor
    global_max: bool = False
    y_scale: torch.Tensor | None = None
    top: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.target.shape[0]

    def padded(self, n_blocks: int) -> BlockPartials:
        """These blocks followed by empty ones (max -inf, sums 0) up to `n_blocks`, so that two sets of rows
        can share one combine."""
        extra = n_blocks - self.s.shape[1]
        if extra <= 0:
            return self

        def pad(t, value):
            return None if t is None else torch.cat([t, t.new_full((t.shape[0], extra), value)], dim=1)

        m = self.m.expand(-1, self.s.shape[1])
        return BlockPartials(pad(m, float("-inf")), pad(self.s, 0.0), pad(self.t, 0.0), pad(self.sum_y, 0.0),
                             self.target, self.global_max, top=self.top)  # fmt: skip

    @staticmethod
    def cat(parts: list[BlockPartials]) -> BlockPartials:
        """The rows of `parts` one after another (blocks padded to the widest)."""
        width = max(p.s.shape[1] for p in parts)
        parts = [p.padded(width) for p in parts]

        def cat(name):
            values = [getattr(p, name) for p in parts]
            if all(v is None for v in values):
                return None
            return torch.cat([torch.zeros_like(p.s) if v is None else v for p, v in zip(parts, values)])

        m = torch.cat([p.m.expand(-1, width) for p in parts])
        if any(p.top is not None for p in parts):
            raise ValueError("BlockPartials.cat: the by-products' argmax rides with one set of rows only")
        return BlockPartials(m, cat("s"), cat("t"), cat("sum_y"), cat("target"), all(p.global_max for p in parts))

    def cast(self, dtype: torch.dtype) -> BlockPartials:
        def to(t):
            return None if t is None else t.to(dtype)

        return BlockPartials(to(self.m), to(self.s), to(self.t), to(self.sum_y), to(self.target), self.global_max,
                             top=to(self.top))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ChunkMath:
    """What the per-chunk kernels need to know of the plan.

    vocab_start: global vocabulary id of local column 0.
    valid: leading local columns that are real vocabulary (the rest are padding).
    scale: ``1 / temperature``.
    softcap: 0.0 for none; else each logit is first mapped to ``softcap * tanh(x / softcap)``.
    """

    vocab_start: int
    valid: int
    scale: float = 1.0
    softcap: float = 0.0


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the per-chunk math and the per-token outputs use: float64 for float64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(impl: str, device: torch.device, dtype: torch.dtype) -> str:
    """``"auto"`` -> ``"triton"`` for CUDA tensors when triton imports (and the dtype is not float64), else
    ``"torch"``. An explicit ``"triton"`` without triton, or with float64, raises naming `impl`."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        use_triton = device.type == "cuda" and dtype != torch.float64 and triton_available()
        return "triton" if use_triton else "torch"
    if impl == "triton":
        if not triton_available():
            raise ValueError('impl="triton" needs the triton package (pip install triton); use impl="torch"')
        if dtype == torch.float64:
            raise ValueError('impl="triton" computes in fp32; float64 inputs need impl="torch" (or "auto")')
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f'impl="triton" runs on CUDA tensors (got {device.type}), or on CPU ones under Triton\'s '
                'interpreter (TRITON_INTERPRET=1 before triton is imported); use impl="torch" or "auto"'
            )
    return impl


class ChunkScratch:
    """Chunk-sized buffers allocated once per pass and reused by every chunk."""

    def __init__(self, rows: int, cols: int, device: torch.device) -> None:
        self.rows, self.cols, self.device = rows, cols, device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        #: how many views were handed out: what one call left in the buffers is still there while it is unchanged
        self.handed_out = 0

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A ``[rows, cols]`` view of the buffer `name` (made on first use at the full chunk size)."""
        self.handed_out += 1
        buf = self._buffers.get((name, dtype))
        if buf is None:
            buf = torch.empty((self.rows, self.cols), dtype=dtype, device=self.device)
            self._buffers[(name, dtype)] = buf
        return buf[:rows, :cols]

    def contiguous(self, name: str, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A contiguous ``[rows, cols]`` tensor over the storage of the buffer `name` (``rows * cols`` at most
        the buffer's size), for outputs that must be contiguous (a matmul's ``out=``); its values are not
        those `get` shows at the same indices."""
        buf = self.get(name, self.rows, self.cols, dtype)
        return buf.view(-1)[: rows * cols].view(rows, cols)



def scale_(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``t *= factor`` in place for a 0-d `factor`, touching nothing of `t` when ``factor == 1.0`` exactly.

    No host sync on CUDA: a Triton kernel reads `factor` on the device and its programs load and store
    nothing when it is 1 (without triton, or for a non-contiguous `t`, a plain ``mul_``). Off CUDA the
    value is read on the host, which costs no sync there.
    """
    if t.device.type == "cuda" and factor.device.type == "cuda":
        if triton_available() and t.is_contiguous() and t.dtype in (torch.float32, torch.bfloat16, torch.float16):
            from lmloss.kernels.triton_kernels import scale_by_device_scalar_

            return scale_by_device_scalar_(t, factor)
        return t.mul_(factor)
    if torch.compiler.is_compiling() or factor.item() != 1.0:
        t.mul_(factor)
    return t


def scaled_cast(t: torch.Tensor, factor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``(t * factor).to(dtype)`` in one pass over `t` (`t` itself, scaled in place, when it has `dtype`);
    `factor` 0-d or None (no scaling)."""
    if factor is None:
        return t.to(dtype)
    if t.dtype == dtype:
        return scale_(t, factor)
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if (
        t.device.type == "cuda" and factor.device == t.device and triton_available() and t.is_contiguous()
        and t.dtype in floats and dtype in floats
    ):  # fmt: skip
        from lmloss.kernels.triton_kernels import scaled_cast_by_device_scalar

        return scaled_cast_by_device_scalar(t, factor, dtype)
    # mul with out= of a narrower float dtype computes in t's precision and rounds once on the store
    return torch.mul(t, factor, out=torch.empty(t.shape, dtype=dtype, device=t.device))


def make_kernels(impl: str, max_rows: int, cols: int, device: torch.device):
    """The kernels object for one pass over the chunks: the single-distribution contract and the
    two-distribution one (the PyTorch one holds chunk-sized scratch buffers shared by both)."""
    if impl == "triton":
        from lmloss.kernels.triton_distill import TritonDistillKernels

        return TritonDistillKernels()
    from lmloss.kernels.torch_distill import TorchDistillKernels

    return TorchDistillKernels(max_rows, cols, device)
