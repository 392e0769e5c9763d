"""Hugging Face ``transformers``: compute a causal LM's loss with lmloss's fused head, inside its own forward.

``patch(model)`` replaces the forward of one ``*ForCausalLM`` instance (a decoder body plus an ``lm_head``:
Llama, Qwen2, Qwen3, Gemma2, Mistral, ...). With ``labels`` the patched forward runs the body, then
`lmloss.linear_cross_entropy` on the last hidden states and the head's weight: the loss and every gradient
are those of unpatched transformers, and no ``[tokens, vocab]`` logits tensor is made (``logits`` is None in
the output). Without labels the original forward runs and returns logits as before (``generate`` works).

Two things make it work under FSDP2 (``fully_shard``) unchanged:

* the loss runs inside the model's own ``forward``, so the root module's hooks have gathered its
  parameters (the README's "call the body, then pass ``lm_head.weight``" recipe fails there with "mixed
  torch.Tensor and DTensor");
* the fused op is called *through* the ``lm_head`` module (its forward is redirected for that one call), so
  when ``lm_head`` is sharded as its own FSDP unit its unshard / reshard / gradient hooks fire as usual.

`token_logprobs(model, ...)` does the same for RL scoring: per-token log-probs (and entropy) with a
temperature, from `lmloss.linear_token_logprobs`, run inside the root forward.

``transformers`` is imported only inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import lmloss

__all__ = ["is_patched", "patch", "token_logprobs", "unpatch"]

_STATE_ATTR = "_lmloss_hf_patch"
# Keyword arguments that belong to the loss (transformers' ForCausalLMLoss), not to the decoder body.
_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
# Config fields of causal LMs that change the logits in ways this patch does not reproduce.
_UNSUPPORTED_CONFIG = {
    "logit_scale": "Cohere-style logit scaling",
    "logits_scaling": "Granite-style logit scaling",
}


@dataclasses.dataclass(frozen=True)
class _PatchState:
    """Kept on the patched model: how to undo the patch and the options the loss runs with."""

    instance_forward: Callable | None  # a forward set on the instance before patching (None: the class's)
    options: dict[str, Any]  # keyword arguments for lmloss.linear_cross_entropy


def _softcap(model: torch.nn.Module) -> float | None:
    cap = getattr(model.config, "final_logit_softcapping", None)
    return None if cap is None else float(cap)


def _check_supported(model: torch.nn.Module) -> None:
    """Raise if `model` is not a decoder body plus a linear head whose logits this patch reproduces."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model") or model.base_model is model:
        raise TypeError(
            f"model must be a transformers *ForCausalLM with a decoder body and an lm_head, got "
            f"{type(model).__name__}"
        )
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(
            f"{type(model).__name__} has no linear output head (get_output_embeddings() gave "
            f"{type(head).__name__}); lmloss's fused head needs a [vocab, hidden] weight"
        )
    for name, what in _UNSUPPORTED_CONFIG.items():
        value = getattr(config, name, None)
        if value is not None and float(value) != 1.0:
            raise NotImplementedError(f"{type(model).__name__} uses {what} (config.{name}={value})")
    if getattr(config, "output_router_logits", False):
        raise NotImplementedError(
            f"{type(model).__name__} adds a router auxiliary loss (config.output_router_logits=True), "
            "which this patch does not compute"
        )


def call_through(module: torch.nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with ``fn(module, *args, **kwargs)`` standing in for its forward.

    The module's forward pre- and post-hooks fire around `fn` (FSDP2 gathers the parameters before and
    frees them after, and registers its backward hooks on the output), which calling `fn` directly would
    skip. The module's own forward is restored afterwards, also when `fn` raises.
    """
    had_instance_forward = "forward" in module.__dict__
    saved = module.__dict__.get("forward")
    module.forward = lambda *a, **k: fn(module, *a, **k)
    try:
        return module(*args, **kwargs)
    finally:
        if had_instance_forward:
            module.forward = saved
        else:
            del module.forward


def _shift(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """transformers' causal shift: position ``i`` predicts ``labels[..., i + 1]``; the last predicts nothing."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _keep(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    try:  # recent transformers (5.x): the exact slicing its models use (ints, index and mask tensors)
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # older releases slice inline, with an int or a 1-D index tensor
        index = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden[:, index, :]
    return slice_logits_to_keep(hidden, logits_to_keep)


def _head_inputs(hidden: torch.Tensor, head: torch.nn.Module):
    """(hidden, weight, bias) in one dtype: the head's, or the autocast dtype inside an autocast region
    (what ``nn.Linear`` would compute in). The casts are differentiable."""
    weight, bias = head.weight, getattr(head, "bias", None)
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = weight.dtype
    cast = [None if t is None else t.to(dtype) for t in (hidden, weight, bias)]
    return cast[0], cast[1], cast[2], device_type


def _fused_loss(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | None,
    ignore_index: int,
    softcap: float | None,
    options: dict[str, Any],
) -> torch.Tensor:
    """The head's forward while patched: transformers' ``ForCausalLMLoss`` of ``head(hidden)``, fused.

    `options`: `patch`'s keyword arguments for `lmloss.linear_cross_entropy` (chunk_size, impl, ...)."""
    hidden, weight, bias, device_type = _head_inputs(hidden, head)
    reduction = "mean" if num_items_in_batch is None else "sum"
    with torch.autocast(device_type, enabled=False):  # dtypes are settled; the op runs its own GEMMs
        loss = lmloss.linear_cross_entropy(
            hidden, weight, targets.to(hidden.device), bias=bias, ignore_index=ignore_index,
            reduction=reduction, softcap=softcap, **options,
        )  # fmt: skip
    if num_items_in_batch is not None:  # Trainer's gradient accumulation: sum over the global count
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _patched_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Any,
):
    """A ``*ForCausalLM`` forward: with ``labels`` (or ``shift_labels``) the loss comes from lmloss's fused
    head and ``logits`` is None; without them, the model's original forward runs."""
    state: _PatchState = getattr(self, _STATE_ATTR)
    if labels is None and kwargs.get("shift_labels") is None:
        original = state.instance_forward or type(self).forward.__get__(self, type(self))
        return original(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
            logits_to_keep=logits_to_keep, **kwargs,
        )  # fmt: skip
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if kwargs.get("output_router_logits"):
        raise NotImplementedError("output_router_logits=True: the router auxiliary loss is not computed here")
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    loss_kwargs = {k: kwargs.pop(k) for k in _LOSS_KWARGS if k in kwargs}
    ignore_index = loss_kwargs.get("ignore_index", -100)

    outputs = self.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
    )  # fmt: skip
    hidden = _keep(outputs.last_hidden_state, logits_to_keep)
    targets = loss_kwargs.get("shift_labels")
    if targets is None:
        targets = _shift(labels, ignore_index)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels give targets of shape {tuple(targets.shape)} but the model kept hidden states "
            f"{tuple(hidden.shape[:-1])} (logits_to_keep={logits_to_keep!r})"
        )
    loss = call_through(
        self.get_output_embeddings(), _fused_loss, hidden, targets,
        num_items_in_batch=loss_kwargs.get("num_items_in_batch"), ignore_index=ignore_index,
        softcap=_softcap(self), options=state.options,
    )  # fmt: skip
    out = CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )
    return out if return_dict else out.to_tuple()


def patch(
    model: torch.nn.Module,
    *,
    chunk_size: int | str | None = "auto",
    impl: str = "auto",
    weight_grad_dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """Make `model` (a ``transformers`` ``*ForCausalLM``) compute its loss with lmloss's fused head.

    After ``patch(model)``, ``model(input_ids, attention_mask=..., labels=...)`` returns the loss of
    transformers' ``ForCausalLMLoss`` (labels shifted inside, ``ignore_index`` from the keyword, default
    -100; ``shift_labels=`` taken as already shifted; ``num_items_in_batch`` divides the summed loss, as
    ``Trainer`` does under gradient accumulation; ``logits_to_keep`` slices the hidden states first) and
    the same gradients, with ``logits=None``: no ``[tokens, vocab]`` tensor is made. Tied embeddings,
    bf16 / fp16, autocast and ``final_logit_softcapping`` (Gemma 2) are handled. Without ``labels`` the
    model's original forward runs. ``transformers.Trainer`` needs no change (TRL's ``SFTTrainer`` computes
    metrics from ``outputs.logits``: see docs/use_in_your_stack.md).

    One difference: a batch whose every label is ignored gives loss 0.0 (transformers gives NaN).

    Only this instance is patched (its ``forward`` attribute), not the class. Patching twice is a no-op;
    `unpatch` restores the original forward.

    Args:
        model: a ``PreTrainedModel`` with a decoder body (``model.base_model``) and a linear
            ``lm_head`` (``model.get_output_embeddings()``), optionally already wrapped by FSDP2's
            ``fully_shard``.
        chunk_size, impl, weight_grad_dtype: `lmloss.linear_cross_entropy`'s arguments, used for every
            loss the patched model computes.

    Returns:
        `model` itself.

    Raises:
        TypeError: `model` has no decoder body or no linear head.
        NotImplementedError: the model changes its logits in a way not reproduced here (logit scaling,
            a router auxiliary loss).
    """
    if is_patched(model):
        return model
    _check_supported(model)
    options = dict(chunk_size=chunk_size, impl=impl, weight_grad_dtype=weight_grad_dtype)
    state = _PatchState(instance_forward=model.__dict__.get("forward"), options=options)
    setattr(model, _STATE_ATTR, state)
    model.forward = _patched_forward.__get__(model, type(model))
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: the model's forward is the one it had before (a no-op on an unpatched model)."""
    state: _PatchState | None = model.__dict__.get(_STATE_ATTR)
    if state is None:
        return model
    if state.instance_forward is None:
        del model.forward
    else:
        model.forward = state.instance_forward
    delattr(model, _STATE_ATTR)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """Whether `patch` has been applied to this model instance."""
    return _STATE_ATTR in model.__dict__


def _score(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    return_entropy: bool,
    ignore_index: int,
    chunk_size: int | str | None,
    model_kwargs: dict[str, Any],
):
    """The root module's forward during `token_logprobs`: body, then the fused head through ``lm_head``."""
    outputs = model.base_model(input_ids=input_ids, use_cache=False, **model_kwargs)
    hidden = outputs.last_hidden_state[:, :-1]
    return call_through(
        model.get_output_embeddings(), _fused_logprobs, hidden, targets[:, 1:], temperature=temperature,
        return_entropy=return_entropy, ignore_index=ignore_index, softcap=_softcap(model),
        chunk_size=chunk_size,
    )  # fmt: skip


def _fused_logprobs(head, hidden, targets, *, temperature, return_entropy, ignore_index, softcap, chunk_size):
    hidden, weight, bias, device_type = _head_inputs(hidden, head)
    with torch.autocast(device_type, enabled=False):
        return lmloss.linear_token_logprobs(
            hidden, weight, targets.to(hidden.device), bias=bias, temperature=temperature,
            ignore_index=ignore_index, return_entropy=return_entropy, chunk_size=chunk_size, softcap=softcap,
        )  # fmt: skip


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    chunk_size: int | str | None = "auto",
    **model_kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (and entropy) of a causal LM's own tokens, without logits: RL scoring.

    Runs the decoder body and `lmloss.linear_token_logprobs` inside ``model``'s forward call (so FSDP2
    gathers parameters as usual), patched or not. Differentiable: ``(-(logprobs * advantages)).sum()
    .backward()`` trains through it.

    Args:
        model: a ``transformers`` ``*ForCausalLM`` (see `patch` for what is supported).
        input_ids: int64 ``[B, S]``.
        labels: int64 ``[B, S]``, the token scored at each position (``ignore_index`` = not scored).
            Default: `input_ids`, with positions where ``attention_mask == 0`` ignored.
        attention_mask: ``[B, S]`` passed to the model (padding).
        temperature: the logits are divided by it (after the model's softcap, if any).
        return_entropy: also return the entropy of each position's next-token distribution.
        model_kwargs: more keyword arguments for the decoder body (e.g. ``position_ids``).

    Returns:
        fp32 ``[B, S]``, aligned with the tokens: ``logprobs[:, t] = log softmax(logits[:, t - 1] / T)
        [labels[:, t]]``, the log-prob of token ``t`` given the tokens before it; 0.0 at ``t = 0`` and
        where ``labels`` is ``ignore_index``. With ``return_entropy``, ``(logprobs, entropy)`` where
        ``entropy[:, t]`` is the entropy of that same distribution (0.0 at ``t = 0``; mask it with your
        response mask).
    """
    _check_supported(model)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    if labels is None:
        labels = (
            input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, ignore_index)
        )
    elif labels.shape != input_ids.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}"
        )
    if attention_mask is not None:
        model_kwargs["attention_mask"] = attention_mask
    out = call_through(
        model, _score, input_ids, labels, temperature=temperature, return_entropy=return_entropy,
        ignore_index=ignore_index, chunk_size=chunk_size, model_kwargs=model_kwargs,
    )  # fmt: skip
    # position 0 has no prediction: pad the [B, S - 1] outputs on the left
    outs = tuple(F.pad(o, (1, 0)) for o in (out if return_entropy else (out,)))
    return outs if return_entropy else outs[0]
