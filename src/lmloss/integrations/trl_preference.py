"""TRL's preference trainers through lmloss: ``DPOTrainer``, ``KTOTrainer`` and ``trl.experimental``'s
``ORPOTrainer`` / ``CPOTrainer``.

`lmloss.integrations.trl.patch(trainer)` hands these trainers to `patch` here. It replaces, on the trainer
instance, the one method that computes the loss and its logged metrics (``_compute_loss`` for DPO / KTO,
``get_batch_loss_metrics`` for ORPO / CPO). The replacement:

* scores the policy's per-token log-probs with lmloss's fused head (`lmloss.integrations.hf.token_logprobs`
  -> `lmloss.linear_token_logprobs` on the model's last hidden states and head weight: no ``[2B, T, V]``
  logits), with the by-products TRL logs or weights with from the same pass: the entropy, the mean logit
  (``logits/chosen`` / ``logits/rejected``), the argmax (DPO's ``mean_token_accuracy``) and WPO's
  ``log Σ p²`` (``use_weighting=True``); DPO / KTO at the completion tokens only, ORPO / CPO at every position
  (their ``logits/*`` are TRL's mean over every position of the padded batch, CPO's last one included: it is
  scored through one appended padding token); the reference model's log-probs alike, without gradient (or
  TRL's precomputed ``ref_*_logps`` columns);
* runs that head as the model's forward where a ``DistributedDataParallel`` wraps the model
  (`lmloss.integrations.hf.run_as_forward`): DDP's forward arms the backward's gradient all-reduce, which a
  head calling the inner model directly skips (Liger's fused DPO / KTO path, TRL #7245);
* translates the trainer's options into a `lmloss.preference.PreferenceSpec` (`preference_spec`), forms the
  per-sequence sums (`lmloss.preference.sequence_stats`) and computes the loss and the metrics with
  `lmloss.preference.preference_loss` (metrics summed over every process, as TRL's ``gather_for_metrics``);
* logs under TRL's names, in TRL's places (``self._metrics`` for DPO / KTO, the returned dict for ORPO /
  CPO), plus TRL's ``num_tokens`` bookkeeping: the same names TRL logs.

Refused at `patch` time with a ValueError: PEFT models without a reference model (TRL disables the adapter for
the reference), MoE auxiliary losses, encoder-decoder models (ORPO / CPO), ``cast_lm_head_to_fp32``.

``trl`` is not imported; the trainer is recognised by its class names (tested with ``trl==1.16.0``).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

from lmloss.chunks import check_memory_budget
from lmloss.integrations import hf
from lmloss.preference import PreferenceSpec, preference_loss, sequence_stats

__all__ = ["is_patched", "is_preference_trainer", "patch", "preference_spec", "trainer_family", "unpatch"]

_STATE_ATTR = "_lmloss_trl_preference_patch"
#: family -> the trainer method the patch replaces
_METHODS = {"dpo": "_compute_loss", "kto": "_compute_loss", "orpo": "get_batch_loss_metrics", "cpo": "get_batch_loss_metrics"}
_CLASSES = {"DPOTrainer": "dpo", "KTOTrainer": "kto", "ORPOTrainer": "orpo", "CPOTrainer": "cpo"}


def trainer_family(trainer: Any) -> str | None:
    """``"dpo"`` / ``"kto"`` / ``"orpo"`` / ``"cpo"`` for TRL's trainers of those names (or subclasses), else None."""
    for cls in type(trainer).__mro__:
        if cls.__name__ in _CLASSES:
            return _CLASSES[cls.__name__]
    return None


def is_preference_trainer(trainer: Any) -> bool:
    return trainer_family(trainer) is not None


def preference_spec(trainer: Any) -> PreferenceSpec:
    """The `PreferenceSpec` of a TRL preference trainer's options (read from the trainer's attributes, as its
    own loss code reads them)."""
    family = trainer_family(trainer)
    if family == "dpo":
        return PreferenceSpec(
            family="dpo", loss_type=tuple(trainer.loss_types), loss_weights=tuple(trainer.loss_weights),
            beta=trainer.beta, label_smoothing=trainer.label_smoothing, f_divergence=trainer.f_divergence_type,
            f_alpha=trainer.f_alpha_divergence_coef, ld_alpha=trainer.ld_alpha, use_weighting=trainer.use_weighting,
            discopop_tau=trainer.args.discopop_tau,
        )  # fmt: skip
    if family == "kto":
        return PreferenceSpec(
            family="kto", loss_type=trainer.loss_type, beta=trainer.beta,
            desirable_weight=trainer.desirable_weight, undesirable_weight=trainer.undesirable_weight,
        )  # fmt: skip
    if family == "orpo":
        return PreferenceSpec(family="orpo", beta=trainer.beta)
    if family == "cpo":
        return PreferenceSpec(
            family="cpo", loss_type=trainer.loss_type, beta=trainer.beta, label_smoothing=trainer.label_smoothing,
            cpo_alpha=trainer.cpo_alpha, simpo_gamma=getattr(trainer, "simpo_gamma", 0.5), alpha=trainer.alpha,
        )  # fmt: skip
    raise TypeError(f"trainer: {type(trainer).__name__} is not a TRL DPO / KTO / ORPO / CPO trainer")


def _metrics_group() -> Any:
    """Where the metrics (and KTO's KL) are averaged: every process, as TRL's ``gather_for_metrics``."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


#: the per-token by-products `_score` can return, in `hf.token_logprobs`' order (its ``return_*`` flags)
_BY_PRODUCTS = {"entropy": "return_entropy", "mean_logits": "return_logit_sum", "is_top1": "return_argmax",
                "log_sum_sq_probs": "return_log_sum_sq_probs"}  # fmt: skip


def _score(self, model, input_ids, labels, attention_mask, *, outputs=(), **model_kwargs):
    """``([B, T - 1] fp32 log-probs of labels[:, 1:], {name: [B, T - 1]})`` from lmloss's fused head, in TRL's
    shifted layout (0 where the label is -100); the by-products named in `outputs` (`_BY_PRODUCTS`), as TRL's
    fused head returns them: ``entropy``, ``mean_logits`` (the logits' sum over the head's vocabulary divided by
    its size, ``weight.shape[0]`` as TRL's kernel divides), ``is_top1`` (bool: the label is the argmax, the
    first maximum as ``torch.argmax``), ``log_sum_sq_probs`` (WPO's ``log Σ p²``).

    Runs as `model`'s forward where `model` wraps (DDP: `lmloss.integrations.hf.run_as_forward`), so that the
    backward's gradient all-reduce is armed; `model` itself otherwise."""

    inner = self.accelerator.unwrap_model(model)
    options = getattr(self, _STATE_ATTR)["options"]
    flags = {flag: name in outputs for name, flag in _BY_PRODUCTS.items()}

    def compute(body, ids, scored, mask, **kwargs):
        with self.accelerator.autocast():
            return hf.token_logprobs(body, ids, scored, attention_mask=mask, **flags, **options, **kwargs)

    out = hf.run_as_forward(model, inner, compute, input_ids, labels, attention_mask, **model_kwargs)
    out = out if isinstance(out, tuple) else (out,)
    rest = iter(o[:, 1:] for o in out[1:])
    extra = {name: next(rest) for name in _BY_PRODUCTS if name in outputs}
    if "mean_logits" in extra:
        extra["mean_logits"] = extra["mean_logits"] / inner.get_output_embeddings().weight.shape[0]
    if "is_top1" in extra:
        extra["is_top1"] = extra["is_top1"] == labels[:, 1:]
    return out[0][:, 1:], extra


def _reference(self, input_ids, labels, attention_mask, **model_kwargs) -> torch.Tensor:
    with torch.no_grad():
        return _score(self, self.ref_model, input_ids, labels, attention_mask, **model_kwargs)[0]


def _log(self, mode: str, metrics: dict[str, torch.Tensor], names) -> None:
    for name in names:
        if name in metrics:
            self._metrics[mode][name].append(metrics[name].item())


def _with_outputs(model, model_kwargs: dict, loss: torch.Tensor, return_outputs: bool):
    """TRL's ``return_outputs=True`` (deprecated there): the model's outputs, logits included, from one more
    forward without gradient, as TRL's own method makes them."""
    if not return_outputs:
        return loss
    with torch.no_grad():
        return loss, model(**model_kwargs, use_cache=False)


def _count_tokens(self, mode: str, attention_mask: torch.Tensor) -> None:
    """TRL's ``num_tokens`` bookkeeping (the attended tokens seen in training, over every process)."""
    if mode == "train":
        n = self.accelerator.gather_for_metrics(attention_mask.sum()).sum().item()
        self._total_train_tokens += n // self._tp_size
    self._metrics[mode]["num_tokens"] = [self._total_train_tokens]


_DPO_KEYS = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}
_DPO_LOGGED = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy", "rewards/chosen",
               "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")  # fmt: skip


def _dpo_compute_loss(self, model, inputs, return_outputs=False):
    mode = "train" if self.model.training else "eval"
    spec = preference_spec(self)
    extra = {k: v for k, v in inputs.items() if k not in _DPO_KEYS | {"input_ids", "attention_mask"}}
    ids, attn, completion = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
    labels = ids.masked_fill(completion == 0, -100)
    mask = completion[:, 1:].bool()
    wanted = ("entropy", "mean_logits", "is_top1") + (("log_sum_sq_probs",) if spec.use_weighting else ())
    logps, by_products = _score(self, model, ids, labels, attn, outputs=wanted, **extra)
    if self.precompute_ref_logps:
        ref = dict(ref_logps=torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]).to(logps.dtype))
    else:
        ref = dict(ref_token_logps=_reference(self, ids, labels, attn, **extra))
    stats = sequence_stats(logps, mask, spec, **by_products, **ref)
    out = preference_loss(stats, spec, group=_metrics_group())
    _log(self, mode, out.metrics, ("entropy",))
    _count_tokens(self, mode, attn)
    _log(self, mode, out.metrics, _DPO_LOGGED[1:])
    return _with_outputs(model, {k: v for k, v in inputs.items() if k not in _DPO_KEYS}, out.loss, return_outputs)


_KTO_KEYS = {"completion_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask", "KL_token_type_ids",
             "KL_mm_token_type_ids", "label", "ref_logps", "ref_KL_logps"}  # fmt: skip


def _kto_compute_loss(self, model, inputs, return_outputs=False):
    mode = "train" if self.model.training else "eval"
    spec = preference_spec(self)
    batch = {k: (v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    extra = {k: v for k, v in batch.items() if k not in _KTO_KEYS | {"input_ids", "attention_mask"}}
    ids, attn, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    labels = ids.masked_fill(completion == 0, -100)
    desirable = torch.as_tensor(batch["label"], dtype=torch.bool, device=ids.device)
    logps, by_products = _score(self, model, ids, labels, attn, outputs=("entropy", "mean_logits"), **extra)
    if self.precompute_ref_logps:
        ref = dict(ref_logps=batch["ref_logps"].to(logps.dtype))
    else:
        ref = dict(ref_token_logps=_reference(self, ids, labels, attn, **extra))
    stats = sequence_stats(logps, completion[:, 1:].bool(), spec, desirable=desirable, **by_products, **ref)
    if self.calculate_KL:  # the mismatched pairs' sums, without gradient (TRL's KL estimate)
        kl_ids, kl_attn, kl_completion = batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"]
        kl_labels = kl_ids.masked_fill(kl_completion == 0, -100)
        with torch.no_grad():
            kl_logps = _score(self, model, kl_ids, kl_labels, kl_attn)[0]
        kl_ref = (
            dict(ref_logps=batch["ref_KL_logps"].to(logps.dtype)) if self.precompute_ref_logps
            else dict(ref_token_logps=_reference(self, kl_ids, kl_labels, kl_attn))
        )  # fmt: skip
        kl = sequence_stats(kl_logps, kl_completion[:, 1:].bool(), spec, **kl_ref)
        stats.kl_logps, stats.ref_kl_logps = kl.logps, kl.ref_logps
    out = preference_loss(stats, spec, group=_metrics_group())
    self._metrics[mode]["kl"].append(out.metrics["kl"].item() if "kl" in out.metrics else 0.0)
    _log(self, mode, out.metrics, ("entropy",))
    _count_tokens(self, mode, attn)
    _log(self, mode, out.metrics, ("logits/chosen", "logits/rejected", "rewards/chosen", "logps/chosen",
                                   "rewards/rejected", "logps/rejected", "rewards/margins"))  # fmt: skip
    return _with_outputs(model, {k: v for k, v in batch.items() if k not in _KTO_KEYS}, out.loss, return_outputs)


_PAIRED_LOGGED = {
    "orpo": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/rejected",
             "logps/chosen", "nll_loss", "log_odds_ratio", "log_odds_chosen"),
    "cpo": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/rejected",
            "logps/chosen", "nll_loss"),
}  # fmt: skip


def _paired_batch_loss_metrics(self, model, batch, train_eval="train"):
    """ORPO's / CPO's ``get_batch_loss_metrics``: ``(loss, {name: float})``."""
    spec = preference_spec(self)
    padding = self.padding_value if spec.family == "orpo" else self.pad_token_id
    cat = self.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=padding, device=self.accelerator.device)
    ids, attn, labels = cat["concatenated_input_ids"], cat["concatenated_attention_mask"], cat["concatenated_labels"]
    completion = labels[:, 1:] != -100
    # ORPO's NLL reads the whole attended chosen sequence, prompt included
    sft_mask = attn[:, 1:].bool() if spec.family == "orpo" else None
    # TRL's logits/chosen, logits/rejected here: the mean logit over every position of the padded batch, prompt
    # and padding included (ORPO's every position but the last, CPO's every one). So every position is scored
    # (the loss reads only its tokens: the others get no gradient), CPO's last through one appended padding
    # token, which the causal body does not let change the positions before it.
    n = ids.size(1)
    if spec.family == "cpo":
        ids, attn = torch.nn.functional.pad(ids, (0, 1), value=padding), torch.nn.functional.pad(attn, (0, 1))
    logps, by_products = _score(self, model, ids, ids, attn, outputs=("mean_logits",))
    logps, mean_logits, b = logps[:, : n - 1], by_products["mean_logits"], batch["chosen_labels"].size(0)
    out = preference_loss(sequence_stats(logps, completion, spec, sft_mask=sft_mask), spec, group=_metrics_group())
    prefix = "eval_" if train_eval == "eval" else ""
    metrics = {f"{prefix}{k}": out.metrics[k].item() for k in _PAIRED_LOGGED[spec.family] if k in out.metrics}
    for name, rows in (("logits/chosen", mean_logits[:b]), ("logits/rejected", mean_logits[b:])):
        # TRL's: each process's mean, averaged over the processes
        metrics[f"{prefix}{name}"] = self.accelerator.gather_for_metrics(rows.mean()).mean().item()
    return out.loss, metrics


_REPLACEMENTS = {"dpo": _dpo_compute_loss, "kto": _kto_compute_loss, "orpo": _paired_batch_loss_metrics,
                 "cpo": _paired_batch_loss_metrics}  # fmt: skip


def _refuse(trainer: Any, family: str) -> None:
    args = getattr(trainer, "args", None)
    if getattr(args, "cast_lm_head_to_fp32", False):
        raise ValueError("trainer: args.cast_lm_head_to_fp32=True is not supported by the fused head")
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError("trainer: MoE auxiliary losses (router_aux_loss_coef) are not supported by the lmloss patch")
    if family in ("dpo", "kto") and trainer.ref_model is None and not trainer.precompute_ref_logps:
        raise ValueError(
            "trainer: no ref_model (a PEFT adapter disabled for the reference) is not supported by the lmloss "
            "patch; pass a ref_model or precompute_ref_log_probs=True"
        )
    if family in ("orpo", "cpo") and getattr(trainer, "is_encoder_decoder", False):
        raise ValueError("trainer: encoder-decoder models are not supported by the lmloss patch")


def patch(
    trainer: Any,
    *,
    chunk_size: int | str | None = "auto",
    invariant: bool = False,
    memory_budget_mib: float | None = None,
) -> Any:
    """Make a TRL ``DPOTrainer`` / ``KTOTrainer`` / ``ORPOTrainer`` / ``CPOTrainer`` compute its loss and
    logged metrics with lmloss (see the module docstring). Returns the trainer. Called by
    `lmloss.integrations.trl.patch`; the options are `lmloss.linear_token_logprobs`'."""
    family = trainer_family(trainer)
    if family is None:
        raise TypeError(f"trainer: {type(trainer).__name__} is not a TRL DPO / KTO / ORPO / CPO trainer")
    if is_patched(trainer):
        raise ValueError("trainer: already patched by lmloss.integrations.trl")
    _refuse(trainer, family)
    preference_spec(trainer)  # the trainer's options, checked now
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            hf.head_transform(trainer.accelerator.unwrap_model(model))
    check_memory_budget(memory_budget_mib)
    options = dict(chunk_size=chunk_size, invariant=bool(invariant), memory_budget_mib=memory_budget_mib)
    method = _METHODS[family]
    setattr(trainer, _STATE_ATTR, {"method": method, "options": options})
    setattr(trainer, method, types.MethodType(_REPLACEMENTS[family], trainer))
    return trainer


def unpatch(trainer: Any) -> Any:
    """Undo `patch`: the trainer's own method again. Returns the trainer."""
    if not is_patched(trainer):
        raise ValueError("trainer: not patched by lmloss.integrations.trl")
    delattr(trainer, getattr(trainer, _STATE_ATTR)["method"])  # the class's method shows through again
    delattr(trainer, _STATE_ATTR)
    return trainer


def is_patched(trainer: Any) -> bool:
    """Whether `patch` has been applied to this trainer instance."""
    return _STATE_ATTR in getattr(trainer, "__dict__", {})
