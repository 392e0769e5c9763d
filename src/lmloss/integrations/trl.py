"""TRL: ``trl.GRPOTrainer``'s per-token log-probs and entropies from lmloss's fused head; the preference
trainers (``DPOTrainer``, ``KTOTrainer``, ``trl.experimental``'s ``ORPOTrainer`` / ``CPOTrainer``): their loss
and metrics through `lmloss.preference` (`lmloss.integrations.trl_preference`, where `patch` hands them).

``lmloss.integrations.trl.patch(trainer)`` (one line, after building the trainer) replaces one method of
that trainer instance, ``_get_per_token_logps_and_entropies``: the one every log-prob of GRPO goes through
(the policy's in the loss step, the old policy's and the reference model's when scoring a generation
batch). The replacement runs the decoder body and `lmloss.linear_token_logprobs` on its last hidden states
and the head's weight, through `lmloss.integrations.hf.token_logprobs`: no ``[B, T, V]`` logits, the
vocabulary walked in chunks, the backward's logits-gradient fused in the same loop. The rest of the
trainer is untouched: every ``loss_type`` (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``cispo``, ...), its
clipping, KL, entropy bonus and its ``num_items_in_batch`` / gradient-accumulation normalisation run as
written in TRL, on the tensors this method returns (the same values as TRL's own, zero where a position is
not scored).

What the replacement does not cover, it hands to TRL's own method, unchanged: multimodal inputs (pixel
values, image grids, ...) and MoE models whose load-balancing loss is requested (``compute_aux_loss``).
Models whose head `lmloss.integrations.hf.head_transform` cannot reproduce raise its ``ValueError`` at
`patch` time.

**Under DDP** (``accelerate launch`` on several processes wraps the model in
``torch.nn.parallel.DistributedDataParallel``) the fused computation runs *as the wrapper's forward*
(`lmloss.integrations.hf.run_as_forward`): DDP's forward is what arms its gradient hooks for the backward (its reducer's
``prepare_for_backward``) and broadcasts its buffers; a computation that calls the inner model's modules
directly, as Liger's fused DPO / KTO path did (TRL #7245), gets no gradient all-reduce, and every rank's
parameters drift apart from the first step. FSDP2 does not wrap (it shards the modules in place): there the
model is called as it is. The preference trainers' patch runs its fused head the same way.

``patch(trainer, sampler_truncation=True)`` scores the policy's log-probs and entropies (the old policy's
too) under the distribution the generation sampled from, and the reference's on its full distribution (see
`patch`): the trainer's ``top_k`` / ``top_p`` / ``min_p`` (``args.generation_kwargs``
overriding them, as TRL does), after its temperature; what vLLM returns as ``processed_logprobs``, which
TRL's importance-sampling correction compares with. ``invariant=True`` uses lmloss's batch-invariant head
(docs/invariant.md: the head's bits, not the model body's).

``trl`` is not imported by this module; it works on the trainer instance it is given (tested with
``trl==1.16.0``, the version the ``lmloss[trl]`` extra pins).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from lmloss import _validate
from lmloss.chunks import check_memory_budget
from lmloss.integrations import hf, trl_preference

__all__ = ["generation_truncation", "is_patched", "patch", "unpatch"]

_METHOD = "_get_per_token_logps_and_entropies"
_STATE_ATTR = "_lmloss_trl_patch"


def _scorer(self, options: dict[str, Any], return_entropy: bool = False):
    """``score(body, ids, labels, mask)``: `lmloss.integrations.hf.token_logprobs` on `body` at the trainer's
    temperature and autocast, with `options` (the patch's, or the reference's untruncated ones); the
    `compute` that `hf.run_as_forward` runs as the model's forward."""

    def score(body: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor):
        with self.accelerator.autocast():
            return hf.token_logprobs(
                body, ids, labels, attention_mask=mask, temperature=self.temperature,
                return_entropy=return_entropy, **options,
            )  # fmt: skip

    return score


def _fused_per_token_logps_and_entropies(
    self,
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
    compute_entropy: bool = False,
    compute_aux_loss: bool = False,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """TRL's method's contract, fused: ``(logps, entropies or None, None)``, each fp32 ``[B, logits_to_keep]``:
    the log-prob of each of the last `logits_to_keep` tokens (the completion) under the model's
    next-token distribution at ``self.temperature`` (within the generation's kept set with
    ``patch(..., sampler_truncation=True)``), and that distribution's entropy; 0.0 where ``attention_mask``
    is 0. `batch_size` rows are scored per forward (TRL's memory knob)."""
    state = getattr(self, _STATE_ATTR)
    if compute_aux_loss or any(v is not None for v in extra.values()):
        # multimodal inputs or a MoE aux loss: TRL's own method, as if unpatched
        return state["original"](
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
            compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra,
        )  # fmt: skip
    inner = self.accelerator.unwrap_model(model)
    options = state["options"]
    reference = getattr(self, "ref_model", None)
    if reference is not None and inner is self.accelerator.unwrap_model(reference):
        options = {**options, "top_k": None, "top_p": None, "min_p": None}  # the reference: its full distribution
    truncated = any(options.get(k) is not None for k in ("top_k", "top_p", "min_p"))

    score = _scorer(self, options, return_entropy=compute_entropy)
    batch_size = batch_size or input_ids.size(0)
    all_logps, all_entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids = input_ids[start : start + batch_size]
        mask = attention_mask[start : start + batch_size]
        # score only the completion's tokens that are not padding, as TRL does
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        out = hf.run_as_forward(model, inner, score, ids, labels, mask)  # through DDP's forward where it wraps
        logps, entropy = out if compute_entropy else (out, None)
        if truncated:
            logps = _full_where_dropped(self, model, inner, ids, mask, labels, logps, options)
        all_logps.append(logps[:, -logits_to_keep:])
        if compute_entropy:
            # TRL's entropy is 0.0 where the label is not scored, as token_logprobs' (which does not compute
            # it there); the prompt positions before the completion are cut here
            scored = labels[:, -logits_to_keep:] != -100
            all_entropies.append(entropy[:, -logits_to_keep:].masked_fill(~scored, 0.0))
    entropies = torch.cat(all_entropies) if compute_entropy else None
    return torch.cat(all_logps), entropies, None


def _full_where_dropped(self, model, inner, ids, mask, labels, logps, options) -> torch.Tensor:
    """`logps` with each scored token outside the policy's kept set (-inf) scored on the full distribution.

    Such a token was sampled by the generation, so the policy scoring it has moved since (a later iteration
    on the batch) or its truncation differs from the engine's (warned by the op). TRL's loss cannot take its
    -inf: its KL estimator gives inf - inf = NaN there, and CISPO 0 * -inf. The rows holding one are scored
    again (rare: the body runs once more for them alone), without truncation, at those tokens only."""
    dropped = torch.isneginf(logps) & (labels != -100)
    rows = dropped.any(-1).nonzero()[:, 0]
    group = getattr(model, "process_group", None) if model is not inner else None
    if group is not None:
        # under DDP every rank must run the same forwards (each broadcasts buffers and arms the reducer):
        # where any rank has such a token, every rank scores its whole chunk again (its other labels -100)
        anywhere = torch.tensor([rows.numel()], dtype=torch.int64, device=logps.device)
        torch.distributed.all_reduce(anywhere, op=torch.distributed.ReduceOp.MAX, group=group)
        if anywhere.item() > 0:
            rows = torch.arange(logps.size(0), device=logps.device)
    if rows.numel() == 0:
        return logps
    again = labels[rows].masked_fill(~dropped[rows], -100)
    score = _scorer(self, {**options, "top_k": None, "top_p": None, "min_p": None})
    full = hf.run_as_forward(model, inner, score, ids[rows], again, mask[rows])  # with gradients: through DDP too
    return logps.index_put((rows,), torch.where(dropped[rows], full, logps[rows]))


def generation_truncation(trainer: Any) -> dict[str, float | int | None]:
    """The ``top_k`` / ``top_p`` / ``min_p`` `trainer` generates with, in lmloss's terms (None: off).

    TRL's ``GRPOConfig`` values (``top_k=0`` / None and ``top_p=1.0`` keep every token, ``min_p`` None or
    0 none), overridden by ``args.generation_kwargs`` entries of the same names, as TRL passes them to
    ``generate`` and to vLLM."""
    values = {name: getattr(trainer, name, None) for name in ("top_k", "top_p", "min_p")}
    overrides = getattr(getattr(trainer, "args", None), "generation_kwargs", None) or {}
    values.update({k: v for k, v in overrides.items() if k in values})
    top_k, top_p, min_p = values["top_k"], values["top_p"], values["min_p"]
    return dict(
        top_k=None if top_k is None or top_k <= 0 else int(top_k),
        top_p=None if top_p is None or top_p >= 1.0 else float(top_p),
        min_p=None if not min_p else float(min_p),
    )


def patch(
    trainer: Any,
    *,
    chunk_size: int | str | None = "auto",
    sampler_truncation: bool = False,
    invariant: bool = False,
    memory_budget_mib: float | None = None,
) -> Any:
    """Make `trainer` (a ``trl.GRPOTrainer``) compute its per-token log-probs and entropies with lmloss's fused
    head; a preference trainer its loss and metrics (`lmloss.integrations.trl_preference.patch`). Returns the
    trainer.

    Args:
        trainer: a built ``trl.GRPOTrainer``, ``DPOTrainer``, ``KTOTrainer`` or ``trl.experimental`` ``ORPOTrainer`` /
            ``CPOTrainer`` (or a subclass) whose model is a ``transformers`` ``*ForCausalLM``.
        chunk_size: tokens per chunk of the fused op (`lmloss.linear_token_logprobs`'s argument).
        sampler_truncation: score the policy under the generation's ``top_k`` / ``top_p`` / ``min_p``
            (`generation_truncation`), the distribution the completions were sampled from; False (TRL's
            own choice): the full softmax at the temperature. The reference model (``beta != 0``) is always
            scored on its full distribution: the KL compares the policy under the sampler with the
            reference model itself (a truncated reference scores a token it would not keep -inf: an
            infinite KL, NaN parameters). A completion token outside the policy's kept set (the policy has
            moved since it sampled it, or its truncation differs from the engine's: warned) is scored on
            the policy's full distribution instead of -inf, which TRL's KL and CISPO terms turn into NaN.
        invariant: lmloss's batch-invariant head (docs/invariant.md).
        memory_budget_mib: what the fused head may hold beyond its inputs and their gradients (MiB; None:
            ``LMLOSS_CHUNK_BUDGET_MIB`` or the device's default).

    Raises:
        TypeError: `trainer` has no ``_get_per_token_logps_and_entropies`` (not a GRPO trainer) and is not a
            preference trainer (those: `lmloss.integrations.trl_preference.patch`); `invariant` or
            `sampler_truncation` is not a bool, `chunk_size` not an int, "auto" or None.
        ValueError: the trainer is already patched; ``sampler_truncation`` with a KL (``beta != 0``) but no
            separate ``ref_model`` (a PEFT policy); its model's head cannot be reproduced (see
            `lmloss.integrations.hf.head_transform`); ``args.cast_lm_head_to_fp32`` is set (the fused op
            computes in the head weight's dtype, so it would not be honoured).
    """
    # checked here, not at the first training step; a bool is asked for, not a truthy value ("false" is one)
    _validate.check_chunk_size(chunk_size)
    _validate.check_invariant(invariant)
    if not isinstance(sampler_truncation, bool):
        raise TypeError(f"sampler_truncation must be a bool, got {sampler_truncation!r}")
    if trl_preference.is_preference_trainer(trainer):  # DPO / KTO / ORPO / CPO: their own module
        if sampler_truncation:
            raise ValueError("sampler_truncation is for GRPO's generations; preference trainers score without it")
        return trl_preference.patch(trainer, chunk_size=chunk_size, invariant=invariant, memory_budget_mib=memory_budget_mib)
    original = getattr(trainer, _METHOD, None)
    if original is None:
        raise TypeError(f"trainer: {type(trainer).__name__} has no {_METHOD} (expected a trl.GRPOTrainer)")
    if is_patched(trainer):
        raise ValueError("trainer: already patched by lmloss.integrations.trl")
    if getattr(getattr(trainer, "args", None), "cast_lm_head_to_fp32", False):
        raise ValueError("trainer: args.cast_lm_head_to_fp32=True is not supported by the fused head")
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            hf.head_transform(trainer.accelerator.unwrap_model(model))
    check_memory_budget(memory_budget_mib)
    if (
        sampler_truncation
        and getattr(trainer, "beta", 0.0) != 0.0
        and getattr(trainer, "ref_model", None) is None
        and any(v is not None for v in generation_truncation(trainer).values())
    ):
        raise ValueError(
            "trainer: sampler_truncation=True with beta != 0 needs a separate ref_model: here the reference is the "
            "policy with its PEFT adapter disabled, whose calls cannot be told from the policy's, and the "
            "reference must be scored on its full distribution (a truncated reference gives -inf: a NaN KL)"
        )
    options: dict[str, Any] = dict(chunk_size=chunk_size, invariant=invariant, memory_budget_mib=memory_budget_mib)
    if sampler_truncation:
        options.update(generation_truncation(trainer))
    setattr(trainer, _STATE_ATTR, {"original": original, "options": options})
    setattr(trainer, _METHOD, types.MethodType(_fused_per_token_logps_and_entropies, trainer))
    return trainer


def unpatch(trainer: Any) -> Any:
    """Undo `patch`: the trainer's own method again. Returns the trainer."""
    if trl_preference.is_patched(trainer):
        return trl_preference.unpatch(trainer)
    if not is_patched(trainer):
        raise ValueError("trainer: not patched by lmloss.integrations.trl")
    delattr(trainer, _METHOD)  # the instance attribute; the class's method shows through again
    delattr(trainer, _STATE_ATTR)
    return trainer


def is_patched(trainer: Any) -> bool:
    """Whether `patch` has been applied to this trainer instance."""
    return _STATE_ATTR in getattr(trainer, "__dict__", {}) or trl_preference.is_patched(trainer)
