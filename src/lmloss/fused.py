"""Log-probs, entropy and cross-entropy straight from hidden states and the LM-head weight.

The same chunk loop as the logits ops (`lmloss.plan`), with another chunk source and gradient sink:

* source: each chunk's logits ``hidden[s:e] @ weight.T + bias`` are made by one matmul in the inputs'
  dtype into a reused chunk buffer (bf16 / fp16 GEMMs accumulate in fp32 and round their output once).
  No ``[tokens, V_local]`` tensor ever exists.
* sink: the kernel turns the chunk's logits into its d-logits in place, and the sink chains them
  through the matmul: ``d hidden[s:e] = dz @ W``, ``d W += dz.T @ hidden[s:e]``, ``d b += sum(dz)``.

Two ways through:

* per-token outputs (`linear_token_logprobs`, ``reduction="none"``): the backward recomputes each chunk's
  logits and turns arbitrary per-token upstream gradients (RL advantages) into gradients (4 matmuls).
* a summed loss (``reduction="sum"`` / ``"mean"``) with gradients: the upstream gradient is one scalar,
  so the forward computes the gradients while each chunk's logits are at hand and the backward only
  scales them (3 matmuls, the floor).

The weight (and bias) gradient accumulates over chunks in ``weight_grad_dtype`` (fp32 by default; on
CUDA with bf16 / fp16 inputs the d-logits stay in the input dtype and the GEMM accumulates into the fp32
buffer directly, ``addmm(out_dtype=float32)``, so the tensor cores do the work). The hidden gradient is
written once per row, in the hidden dtype (fp32 under TP, where ranks' partial gradients are summed:
all-reduced over ``tp_group``, or reduce-scattered with sequence parallelism).
"""

from __future__ import annotations

import functools
import math
import os

import torch

from lmloss import _validate
from lmloss._autograd import once_differentiable
from lmloss.kernels import compute_dtype, scaled_cast
from lmloss.kernels.torch_ref import ChunkScratch
from lmloss.logits import loss_denominator
from lmloss.plan import LossPlan, backward_pass, forward_pass, grad_coefficients, has_uniform_term, make_plan
from lmloss.sampling import make_sampling, report_dropped
from lmloss.vocab_parallel import (
    ProcessGroup,
    all_reduce_sum_,
    errors_raised_on_every_rank,
    gather_rows,
    reduce_scatter_rows,
    world_size,
)

#: Working-set budget for ``chunk_size="auto"`` (MiB); override with ``LMLOSS_CHUNK_BUDGET_MIB``. What
#: counts per chunk: the PyTorch implementation holds two fp32 ``[chunk, V_local]`` tensors at once (the
#: logits chunk, and ``p`` beside it for an entropy gradient); the Triton one only the chunk's logits
#: in the input dtype (its d-logits overwrite them).
DEFAULT_CHUNK_BUDGET_MIB = {"cpu": 64, "cuda": 2048}


def auto_chunk_size(
    n_tokens: int,
    local_vocab: int,
    device: torch.device | str = "cpu",
    bytes_per_logit: int = 8,
    *,
    budget_mib: float | None = None,
) -> int:
    """Tokens per chunk so that the chunk's working set (``bytes_per_logit`` per logit) fits the budget.

    Budget: ``LMLOSS_CHUNK_BUDGET_MIB`` if set, else `DEFAULT_CHUNK_BUDGET_MIB` for the device type
    (64 MiB on CPU, 2 GiB on CUDA). Rounded down to a multiple of 64 (matmul-friendly) when >= 64.
    """
    budget_mib = chunk_budget_mib(device) if budget_mib is None else budget_mib
    rows = int(budget_mib * 2**20 // (bytes_per_logit * max(local_vocab, 1)))
    if rows >= 64:
        rows -= rows % 64
    return max(1, min(rows, max(n_tokens, 1)))


def chunk_budget_mib(device: torch.device | str = "cpu") -> float:
    """``LMLOSS_CHUNK_BUDGET_MIB`` if set (a positive number), else `DEFAULT_CHUNK_BUDGET_MIB` for the device
    type. Read before the TP ranks' agreement gather, which carries it: ranks with different budgets would
    cut different chunks and issue different collectives."""
    text = os.environ.get("LMLOSS_CHUNK_BUDGET_MIB")
    if text is None:
        return float(DEFAULT_CHUNK_BUDGET_MIB.get(torch.device(device).type, 96))
    try:
        budget = float(text)
    except ValueError:
        budget = math.nan
    if not 0 < budget < math.inf:
        raise ValueError(f"LMLOSS_CHUNK_BUDGET_MIB must be a positive number of MiB, got {text!r}")
    return budget


@functools.lru_cache(maxsize=8)
def gemm_accumulates_into_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(fp32, lowp, lowp, out_dtype=float32)`` runs here (CUDA, PyTorch >= 2.11)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        a = torch.ones((2, 2), dtype=dtype, device=device)
        acc = torch.ones((2, 2), dtype=torch.float32, device=device)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return bool((acc == 3.0).all())  # accumulated into the buffer it read (1 + 1*1 + 1*1)


class _HiddenRows:
    """Chunk source: ``hidden[s:e] @ weight.T (+ bias)`` into one reused ``[chunk, V_local]`` buffer.

    The chunk is made in the weight's dtype and, when `chunk_dtype` is fp32 (low-precision inputs whose
    d-logits must be fp32, see `_Accumulators`), upcast into an fp32 buffer. The chunk is scratch the
    kernels may overwrite (`owns_chunks`).
    """

    owns_chunks = True

    def __init__(self, hidden, weight, bias, scratch: ChunkScratch, chunk_dtype: torch.dtype) -> None:
        self.hidden, self.weight, self.bias, self.scratch = hidden, weight, bias, scratch
        self.chunk_dtype = chunk_dtype

    def __call__(self, s: int, e: int) -> torch.Tensor:
        v_local = self.weight.shape[0]
        z = self.scratch.get("logits_lowp", e - s, v_local, self.weight.dtype)
        if self.bias is None:
            torch.mm(self.hidden[s:e], self.weight.t(), out=z)
        else:
            torch.addmm(self.bias, self.hidden[s:e], self.weight.t(), out=z)
        if self.chunk_dtype == z.dtype:
            return z
        return self.scratch.get("logits", e - s, v_local, self.chunk_dtype).copy_(z)


def chunk_dtype_for(weight: torch.Tensor, weight_grad_dtype: torch.dtype) -> torch.dtype:
    """The dtype each chunk's logits (then d-logits, in place) live in.

    The input dtype when the weight-gradient GEMM can take low-precision d-logits as they are: fp32
    inputs, a low-precision accumulator by request, or a GEMM that accumulates into the fp32 buffer
    itself (CUDA). Otherwise (bf16 / fp16 on CPU) fp32, so that the fp32 accumulator gets unrounded
    d-logits.
    """
    if weight.dtype in (torch.float32, torch.float64) or weight_grad_dtype == weight.dtype:
        return weight.dtype
    return weight.dtype if gemm_accumulates_into_fp32(weight.device, weight.dtype) else torch.float32


class _Accumulators:
    """Gradient sink of the fused ops: chains each chunk's d-logits into hidden / weight / bias gradients.

    hidden: ``[N, H]``, each row written once (hidden dtype; fp32 when TP ranks' partials are summed).
    weight, bias: accumulated over chunks in `weight_grad_dtype`.
    None where that input needs no gradient.
    """

    def __init__(
        self, hidden, weight, bias, needs, *, weight_grad_dtype, tp_summed, sequence_parallel, scratch, **_
    ):
        self.hidden_in, self.weight_in, self.scratch = hidden, weight, scratch
        self.sequence_parallel = sequence_parallel
        h_dtype = torch.promote_types(hidden.dtype, torch.float32) if tp_summed else hidden.dtype
        self.hidden = torch.empty(hidden.shape, dtype=h_dtype, device=hidden.device) if needs[0] else None
        # not zero-filled: the first chunk's GEMM writes it with beta=0 (one plain GEMM for a single chunk)
        self.weight = (
            torch.empty(weight.shape, dtype=weight_grad_dtype, device=weight.device) if needs[1] else None
        )
        self.weight_written = False
        self.bias = None
        if bias is not None and needs[2]:
            bias_dtype = torch.promote_types(bias.dtype, torch.float32)
            self.bias = torch.zeros(bias.shape, dtype=bias_dtype, device=bias.device)

    def buffer(self, s, e, x):
        return x  # the chunk is scratch in `chunk_dtype_for`: its d-logits overwrite it

    def consume(self, s, e, dz):
        rows, w = self.hidden_in[s:e], self.weight_in
        if self.hidden is not None:
            # the source's low-precision chunk buffer is free again once the chunk was upcast
            dz_w = (
                dz if dz.dtype == w.dtype else self.scratch.get("logits_lowp", *dz.shape, w.dtype).copy_(dz)
            )
            if self.hidden.dtype == w.dtype:
                torch.mm(dz_w, w, out=self.hidden[s:e])
            else:  # the GEMM accumulates in fp32 internally; each hidden row comes from one GEMM
                self.hidden[s:e] = torch.mm(dz_w, w)
        if self.weight is not None:
            beta = 1.0 if self.weight_written else 0.0  # beta=0: the buffer's unset contents are not read
            if dz.dtype == self.weight.dtype:
                self.weight.addmm_(dz.t(), rows if rows.dtype == dz.dtype else rows.to(dz.dtype), beta=beta)
            else:  # low-precision d-logits into the fp32 accumulator, on the tensor cores
                torch.addmm(self.weight, dz.t(), rows, out_dtype=torch.float32, beta=beta, out=self.weight)
            self.weight_written = True
        if self.bias is not None:
            self.bias.add_(dz.sum(dim=0, dtype=self.bias.dtype))

    def finish(self, hidden, weight, bias, tp_group, scale=None):
        """The gradients in their inputs' dtypes; scaled by the upstream scalar `scale` if given, in the same
        pass as the cast (`scaled_cast`: no pass at all over a same-dtype buffer when `scale` is 1.0)."""
        gh = gw = gb = None
        if self.hidden is not None:
            if not self.sequence_parallel:  # with it, the sum is `_GatherRows`' backward (a reduce-scatter)
                all_reduce_sum_(self.hidden, tp_group)
            gh = scaled_cast(self.hidden, scale, hidden.dtype)
        if self.weight is not None:
            if not self.weight_written:  # no chunk (no tokens): a zero gradient
                self.weight.zero_()
            gw = scaled_cast(self.weight, scale, weight.dtype)
        if self.bias is not None:
            gb = scaled_cast(self.bias, scale, bias.dtype)
        return gh, gw, gb


def _pass_scratch(plan: LossPlan, hidden: torch.Tensor) -> ChunkScratch:
    n = hidden.shape[0]
    return ChunkScratch(max(1, min(n, plan.chunk_size or n)), plan.shard.size, hidden.device)


class _LinearSoftmaxPerToken(torch.autograd.Function):
    """hidden ``[N, H]`` (all tokens), weight ``[V_local, H]`` -> per-token outputs; recompute in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, plan: LossPlan, opts: dict):
        source = _HiddenRows(hidden, weight, bias, _pass_scratch(plan, hidden), opts["chunk_dtype"])
        results = forward_pass(
            plan, hidden.shape[0], source, labels, device=hidden.device, dtype=hidden.dtype
        )
        ctx.plan, ctx.opts = plan, opts
        ctx.save_for_backward(
            hidden, weight, bias, labels, results["lse"], results.get("entropy"), results.get("keep_min"),
            results.get("dropped"),
        )  # fmt: skip
        ctx.set_materialize_grads(False)
        if "log_kept_mass" in results:
            ctx.mark_non_differentiable(results["log_kept_mass"])
        return tuple(results[k] for k in plan.returned)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads_out):
        plan: LossPlan = ctx.plan
        hidden, weight, bias, labels, lse, entropy, keep_min, dropped = ctx.saved_tensors
        upstream = dict(zip(plan.outputs, grads_out))
        coef = grad_coefficients(plan, labels, lse, upstream, dropped)
        if coef is None:
            return None, None, None, None, None, None
        scratch = _pass_scratch(plan, hidden)
        acc = _Accumulators(hidden, weight, bias, ctx.needs_input_grad[:3], scratch=scratch, **ctx.opts)
        backward_pass(
            plan, hidden.shape[0], _HiddenRows(hidden, weight, bias, scratch, ctx.opts["chunk_dtype"]), labels, lse,
            entropy if upstream.get("entropy") is not None else None, coef, acc, device=hidden.device,
            uniform_term=has_uniform_term(plan, upstream), keep_min=keep_min,
        )  # fmt: skip
        grads = acc.finish(hidden, weight, bias, plan.tp_group)
        return (*grads, None, None, None)


class _LinearCrossEntropySum(torch.autograd.Function):
    """Scalar ``sum`` of per-token losses; gradients computed in the forward pass, scaled in backward.

    The backward scales the saved gradients in place (no second weight-sized buffer). A second backward
    through the same graph (``retain_graph=True``, ``gradcheck``) finds them spent and recomputes them
    with the forward's loop (the same collectives on every TP rank).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, plan: LossPlan, opts: dict, grad_enabled: bool, denominator):
        # grad mode is always off inside forward(): the caller says whether gradients will be wanted;
        # `denominator` (0-d, or None for "sum"): the mean's count, folded into the gradients here
        needs = tuple(n and grad_enabled for n in ctx.needs_input_grad[:3])
        grad_scale = None if denominator is None else denominator.reciprocal()
        results, acc = _summed_pass(hidden, weight, bias, labels, plan, opts, needs, grad_scale)
        ctx.plan, ctx.opts, ctx.acc, ctx.grad_scale = plan, opts, acc, grad_scale
        ctx.save_for_backward(hidden, weight, bias, labels)
        total = results["loss"].sum()
        return total if denominator is None else total / denominator

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        hidden, weight, bias, labels = ctx.saved_tensors
        acc, ctx.acc = ctx.acc, "used"
        if acc == "used":
            _, acc = _summed_pass(
                hidden, weight, bias, labels, ctx.plan, ctx.opts, ctx.needs_input_grad[:3], ctx.grad_scale
            )
        if acc is None:
            return None, None, None, None, None, None, None, None
        grads = acc.finish(hidden, weight, bias, ctx.plan.tp_group, grad_total)
        return (*grads, None, None, None, None, None)


def _summed_pass(hidden, weight, bias, labels, plan: LossPlan, opts: dict, needs, grad_scale):
    """The per-token losses and, for the inputs that `needs` a gradient, the `_Accumulators` holding the
    gradient of their sum times `grad_scale` (a 0-d device tensor, or None for 1) (None if none does)."""
    scratch = _pass_scratch(plan, hidden)
    acc = _Accumulators(hidden, weight, bias, needs, scratch=scratch, **opts) if any(needs) else None
    results = forward_pass(
        plan, hidden.shape[0], _HiddenRows(hidden, weight, bias, scratch, opts["chunk_dtype"]), labels,
        device=hidden.device, dtype=hidden.dtype, grad_sink=acc, grad_scale=grad_scale,
    )  # fmt: skip
    return results, acc


class _GatherRows(torch.autograd.Function):
    """Sequence parallelism: gather token rows over TP in rank order; the backward sums each rank's
    partial gradient (it covers one vocabulary shard) and hands every rank its own rows."""

    @staticmethod
    def forward(ctx, rows, group):
        ctx.group = group
        return gather_rows(rows, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_rows(grad.contiguous(), ctx.group), None


def _check_tensors(
    hidden, weight, labels, bias, sequence_parallel, weight_grad_dtype, tp_group, reduction, mean_group
):
    """The fused ops' local checks; returns the int64 labels (or None) and the leading shape the labels
    must have."""
    if reduction is not None:
        _validate.check_reduction(reduction)
    _validate.check_group("mean_group", mean_group)
    _validate.check_floating("hidden", hidden)
    _validate.check_floating("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V_local, H], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden width {hidden.shape[-1] if hidden.dim() else None} does not match weight [V_local, H] "
            f"with H={weight.shape[1]}"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    if bias is not None:
        _validate.check_floating("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [V_local] = [{weight.shape[0]}], got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias ({bias.dtype}) and weight ({weight.dtype}) must have the same dtype")
    if weight_grad_dtype not in (torch.float32, weight.dtype):
        raise ValueError(
            f"weight_grad_dtype must be torch.float32 or the weight's dtype ({weight.dtype}), got {weight_grad_dtype}"
        )
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    if sequence_parallel and tp_group is None:
        raise ValueError("sequence_parallel=True needs the tp_group that the tokens are sharded over")
    expected = hidden.shape[:-1]
    if sequence_parallel:
        expected = torch.Size((world_size(tp_group) * hidden.shape[0], *hidden.shape[1:-1]))
    if labels is not None:
        against = "hidden (gathered over tp_group)" if sequence_parallel else "hidden"
        labels = _validate.check_labels(labels, expected, hidden.device, against=against)
    return labels, expected


def _prepare(
    hidden, weight, labels, bias, *, chunk_size, sequence_parallel, weight_grad_dtype, tp_group,
    reduction=None, mean_group=None, agree=None, bytes_per_logit=None, **options,
):  # fmt: skip
    """Check the tensors, resolve the plan, gather sequence-parallel hidden states.

    `agree`: more values every TP rank must share (fields of `lmloss.vocab_parallel.HOST_FIELDS`);
    `bytes_per_logit`: the PyTorch implementation's per-logit working set for ``chunk_size="auto"``
    (default 8), for ops holding more.
    """
    _validate.check_group("tp_group", tp_group)
    with errors_raised_on_every_rank(tp_group, options["vocab_start"], hidden):
        labels, expected = _check_tensors(
            hidden, weight, labels, bias, sequence_parallel, weight_grad_dtype, tp_group, reduction, mean_group
        )  # fmt: skip
        budget = chunk_budget_mib(weight.device) if chunk_size == "auto" else -1.0
    h_width, dtype_bytes = weight.shape[1], weight.element_size()

    def auto_chunk(n_tokens, local_vocab, impl):
        per_logit = dtype_bytes if impl == "triton" else (bytes_per_logit or 8)
        return auto_chunk_size(n_tokens, local_vocab, weight.device, per_logit, budget_mib=budget)

    grad = torch.is_grad_enabled() and sum(
        1 << i for i, t in enumerate((hidden, weight, bias)) if t is not None and t.requires_grad
    )
    agree = {
        "op": 1, **(agree or {}), "hidden_width": h_width, "sequence_parallel": int(sequence_parallel),
        "grad": int(grad), "reduction": -1 if reduction is None else _validate.REDUCTIONS.index(reduction),
        "mean_group": -1 if mean_group is None else world_size(mean_group), "chunk_budget": budget,
    }  # fmt: skip
    plan = make_plan(
        n_tokens=math.prod(expected), local_vocab=weight.shape[0], device=weight.device, dtype=weight.dtype,
        labels=None if labels is None else labels.reshape(-1), chunk_size=chunk_size, auto_chunk=auto_chunk,
        tp_group=tp_group, agree=agree, **options,
    )  # fmt: skip
    flat = hidden.reshape(-1, hidden.shape[-1])
    if sequence_parallel:
        flat = _GatherRows.apply(flat, tp_group)
    opts = dict(
        # float64 weights accumulate in float64 (the fp32 default is "at least fp32")
        weight_grad_dtype=torch.float64 if weight.dtype == torch.float64 else weight_grad_dtype,
        tp_summed=world_size(tp_group) > 1,
        sequence_parallel=sequence_parallel,
        chunk_dtype=chunk_dtype_for(weight, weight_grad_dtype),
    )
    return flat, None if labels is None else labels.reshape(-1), plan, opts, expected


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | str | None = "auto",
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    sequence_parallel: bool = False,
    return_entropy: bool = False,
    weight_grad_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    support: torch.Tensor | None = None,
    return_log_kept_mass: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`lmloss.token_logprobs` of ``hidden @ weight.T + bias``, without materializing the logits.

    Args:
        hidden: ``[..., H]`` fp32 / bf16 / fp16. With ``sequence_parallel=True``, this rank's block of
            tokens along dim 0; the op gathers the blocks over `tp_group` in rank order.
        weight: ``[V_local, H]``, same dtype: the LM head, a tied embedding, or this rank's vocab shard.
        labels: ``[...]`` global vocabulary ids, the (gathered) leading shape of `hidden`.
        bias: optional ``[V_local]``.
        chunk_size: tokens per chunk; ``"auto"`` sizes it from a memory budget (`auto_chunk_size`),
            agreed across `tp_group`; None for one chunk.
        sequence_parallel: `hidden` is sharded along tokens over `tp_group`; its gradient is
            reduce-scattered back. Without it every TP rank holds the same `hidden` and receives the
            full (all-reduced) gradient.
        weight_grad_dtype: dtype of the weight-gradient accumulator, ``torch.float32`` (default) or the
            weight's own dtype (saves ``4 - 2`` bytes per weight element for bf16, at the precision cost
            stated in the README).
        top_k, top_p, min_p, return_log_kept_mass: the rollout engine's truncation, recomputed per chunk
            (as in `lmloss.token_logprobs`).
        support: the engine's kept ids ``[..., K]`` (-1 padded): each chunk multiplies its hidden rows by
            only the weight rows its ids name (`lmloss.replay`). With ``sequence_parallel``, `labels` and
            `support` cover every rank's tokens (as `labels` always does).
        Other arguments as in `lmloss.token_logprobs` (`temperature`, `softcap`, `impl`, ...).

    Returns:
        fp32 ``[...]`` log-probs (0.0 where ignored), then entropy and log kept mass if asked (a tuple);
        the same on every TP rank. Gradients flow to `hidden`, `weight` and `bias` for any per-token
        upstream gradients.
    """
    if support is not None:
        from lmloss.replay import replay_over_hidden

        return replay_over_hidden(
            hidden, weight, labels, support, bias=bias, top=(top_k, top_p, min_p, return_log_kept_mass),
            chunk_size=chunk_size, temperature=temperature, softcap=softcap, ignore_index=ignore_index,
            vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start, sequence_parallel=sequence_parallel,
            return_entropy=return_entropy, impl=impl,
        )  # fmt: skip
    n_tokens = math.prod(hidden.shape[:-1]) * (world_size(tp_group) if sequence_parallel else 1)
    with errors_raised_on_every_rank(tp_group, vocab_start, hidden):
        sampling = make_sampling(
            top_k, top_p, min_p, n_tokens=n_tokens, device=hidden.device, log_kept_mass=return_log_kept_mass
        )
    flat, flat_labels, plan, opts, shape = _prepare(
        hidden, weight, labels, bias, chunk_size=chunk_size, temperature=temperature, softcap=softcap,
        ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
        sequence_parallel=sequence_parallel, weight_grad_dtype=weight_grad_dtype, impl=impl,
        outputs=("logprobs", "entropy") if return_entropy else ("logprobs",), sampling=sampling,
    )  # fmt: skip
    outs = _LinearSoftmaxPerToken.apply(flat, weight, bias, flat_labels, plan, opts)
    outs = tuple(o.view(shape) for o in outs)
    if sampling is not None:
        report_dropped(outs[0], flat_labels.view(shape), ignore_index)
    return outs if len(outs) > 1 else outs[0]


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | str | None = "auto",
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    temperature: float = 1.0,
    softcap: float | None = None,
    vocab_size: int | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    sequence_parallel: bool = False,
    mean_group: ProcessGroup | None = None,
    weight_grad_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
) -> torch.Tensor:
    """`lmloss.cross_entropy` of ``hidden @ weight.T + bias``, without materializing the logits.

    Arguments as in `linear_token_logprobs` and `lmloss.cross_entropy` (``reduction``, ``label_smoothing``,
    ``z_loss``, ``mean_group``). With ``"sum"`` / ``"mean"`` and gradients enabled, the gradients are
    computed during the forward (3 matmuls in all instead of 4) and only scaled by the backward.
    """
    flat, flat_labels, plan, opts, shape = _prepare(
        hidden, weight, labels, bias, chunk_size=chunk_size, temperature=temperature, softcap=softcap,
        ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
        sequence_parallel=sequence_parallel, weight_grad_dtype=weight_grad_dtype, impl=impl,
        outputs=("loss",), label_smoothing=label_smoothing, z_loss=z_loss, reduction=reduction,
        mean_group=mean_group,
    )  # fmt: skip
    if reduction == "none":
        (per_token,) = _LinearSoftmaxPerToken.apply(flat, weight, bias, flat_labels, plan, opts)
        return per_token.view(shape)
    denominator = loss_denominator(
        flat_labels, ignore_index=ignore_index, reduction=reduction, mean_group=mean_group,
        dtype=compute_dtype(hidden.dtype),
    )  # fmt: skip
    return _LinearCrossEntropySum.apply(
        flat, weight, bias, flat_labels, plan, opts, torch.is_grad_enabled(), denominator
    )
