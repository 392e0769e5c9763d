"""Hugging Face ``transformers``: compute a causal LM's loss with lmloss's fused head, inside its own forward.

``patch(model)`` replaces the forward of one ``*ForCausalLM`` instance (a decoder body plus an ``lm_head``:
Llama, Qwen2, Qwen3, Gemma2, Mistral, ...). In training mode with ``labels`` the patched forward runs the
body, then `lmloss.linear_cross_entropy` on the last hidden states and the head's weight: the loss and
every gradient are those of unpatched transformers, and no ``[tokens, vocab]`` logits tensor is made
(``logits`` is None in the output). Without labels, and in eval mode (``Trainer.evaluate`` / ``predict``),
the original forward runs and returns logits as before (``generate`` and ``compute_metrics`` work).

The patch reproduces only heads it knows: ``lm_head(hidden)`` and the transforms `head_transform` reads
from the config (softcaps, logit multipliers), checked at patch time by one 8-token forward against the
unpatched model. The config is read again at every forward: after a change (``model.config.
final_logit_softcapping = 30``) the patch runs that check once more and follows the model, whether its
forward reads the field as it runs (Gemma) or kept the value it was built with (Cohere's ``logit_scale``). Anything else (seq2seq decoders, heads of several layers, unknown transforms) raises a
``ValueError`` naming the class and the reason; docs/use_in_your_stack.md lists the classes of the
transformers release tested.

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
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import lmloss
from lmloss.chunks import check_memory_budget

__all__ = ["HeadTransform", "head_transform", "is_patched", "patch", "run_as_forward", "token_logprobs", "unpatch"]

_STATE_ATTR = "_lmloss_hf_patch"
# Keyword arguments that belong to the loss (transformers' ForCausalLMLoss), not to the decoder body.
_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
# Config fields (on the model's config or its text config) that soft-cap the head's output,
# ``c * tanh(z / c)``: Gemma 2 / 3 / 4 and the VLMs built on them (PaliGemma...), RecurrentGemma, xLSTM.
_SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
# Config fields that multiply the logits by a constant: (field, where it applies, direction). "before the
# softcap" factors scale ``z`` inside the tanh; "after" ones scale the capped logits. The direction is
# how the model uses the value (checked against each model's forward in the class sweep of the tests).
_SCALE_FIELDS = (
    ("output_multiplier", "before", "multiply"),  # MuseGlimmer / MuseSpark: c * tanh(z * m / c)
    ("logits_mup_width_multiplier", "before", "divide"),  # Inkling: the hidden states / m, then the head
    ("logit_scale", "after", "multiply"),  # Cohere, Cohere2, CohereCompass
    ("logits_scaling", "after", "divide"),  # Granite family (HyperCLOVAX multiplies: below)
    ("lm_head_multiplier", "after", "multiply"),  # FalconH1
)
# model_type -> field whose value that model multiplies by although the field's usual direction divides.
_MULTIPLIES_INSTEAD = {"hyperclovax": "logits_scaling", "hyperclovax_vision_v2": "logits_scaling"}
# model_type -> field its config carries but its transformers forward does not apply (MPT's logit_scale).
_IGNORED_BY_MODEL = {"mpt": "logit_scale"}


@dataclasses.dataclass(frozen=True)
class HeadTransform:
    """What a model does to its head's output ``z = lm_head(hidden)`` to get its logits, in lmloss's terms:
    ``logits = scale * softcap(z)`` with ``softcap(z) = c * tanh(z / c)`` (none when `softcap` is None).
    The fused op runs it as ``softcap=softcap, temperature=1 / scale`` (one more division by the caller's
    temperature in `token_logprobs`)."""

    softcap: float | None = None
    scale: float = 1.0
    source: str = "lm_head(hidden)"  # the config fields it came from, for messages and the docs

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale


@dataclasses.dataclass
class _PatchState:
    """Kept on the patched model: how to undo the patch and the options the loss runs with."""

    instance_forward: Callable | None  # a forward set on the instance before patching (None: the class's)
    options: dict[str, Any]  # keyword arguments for lmloss.linear_cross_entropy
    logits_in_eval: bool
    verify: bool
    # The config can change after patch(). `config_read`: what `head_transform` read from it when
    # `transform` (what the fused loss runs, checked against the model's own forward) was settled.
    config_read: HeadTransform
    transform: HeadTransform


def _config_value(model: torch.nn.Module, field: str) -> Any:
    """`field` where the model's forward reads it: a number the model keeps as its own attribute (Cohere and
    the Granite MoE models copy ``config.logit_scale`` / ``logits_scaling`` into the module when it is built,
    and their forward reads that copy), else its config, else its text config (VLMs keep the LM's fields
    there)."""
    own = model.__dict__.get(field)  # a plain attribute (parameters, buffers and submodules live elsewhere)
    if isinstance(own, (int, float)) and not isinstance(own, bool):
        return own
    config = model.config
    value = getattr(config, field, None)
    if value is None and hasattr(config, "get_text_config"):
        try:
            value = getattr(config.get_text_config(decoder=True), field, None)
        except ValueError:  # several text configs: ambiguous, so none is read
            value = None
    return value


def _body(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder body: ``model.base_model``, or ``model.model`` where ``base_model_prefix`` names another
    attribute (Llama 4's text model); None when there is neither."""
    body = getattr(model, "base_model", None)
    if body is None or body is model:
        body = getattr(model, "model", None)
    return body if isinstance(body, torch.nn.Module) and body is not model else None


def _refuse(model: torch.nn.Module, reason: str) -> ValueError:
    return ValueError(f"lmloss.integrations.hf cannot reproduce {type(model).__name__}'s loss: {reason}")


def head_transform(model: torch.nn.Module, *, for_loss: bool = True) -> HeadTransform:
    """The transform between `model`'s ``lm_head`` output and its logits, read from its config.

    `for_loss`: the head computes the model's training loss (`patch`), so a config that adds a router
    auxiliary loss to it is refused; False for scoring alone (log-probs and entropy, no loss to add it to).

    Raises:
        ValueError: naming the model class and the reason, when the model is not a decoder body plus a
            linear head (an encoder-decoder model, a head that is not one ``[vocab, hidden]`` matrix) or its
            config asks for something lmloss does not compute (a router auxiliary loss, a negative scale).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    config = getattr(model, "config", None)
    if config is None or _body(model) is None:
        raise _refuse(model, "it is not a *ForCausalLM with a decoder body (model.base_model) and an lm_head")
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(
            model, "it is an encoder-decoder (seq2seq) model; only decoder-only causal LMs are patched"
        )
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise _refuse(
            model,
            f"it has no linear output head (get_output_embeddings() gave {type(head).__name__}); the fused "
            "head needs one [vocab, hidden] weight",
        )
    if for_loss and getattr(config, "output_router_logits", False):
        raise _refuse(model, "it adds a router auxiliary loss (config.output_router_logits=True)")
    fields, softcap, before, after = [], None, 1.0, 1.0
    for field in _SOFTCAP_FIELDS:
        value = _config_value(model, field)
        if value:  # None or 0: no cap
            softcap = float(value)
            fields.append(f"{field}={value}")
            break
    model_type = getattr(config, "model_type", None)
    for field, where, direction in _SCALE_FIELDS:
        value = _config_value(model, field)
        if value is None or isinstance(value, bool) or _IGNORED_BY_MODEL.get(model_type) == field:
            continue
        value = float(value)
        if not (value > 0 and math.isfinite(value)):
            raise _refuse(model, f"config.{field}={value} is not a positive finite scale")
        if field == "logits_mup_width_multiplier" and getattr(head, "bias", None) is not None:
            raise _refuse(model, f"config.{field} scales the hidden states before a head with a bias")
        multiply = direction == "multiply" or _MULTIPLIES_INSTEAD.get(model_type) == field
        factor = value if multiply else 1.0 / value
        if where == "before":
            before *= factor
        else:
            after *= factor
        fields.append(f"{field}={value}")
    if softcap is not None:  # c * tanh(b * z / c) == b * (c / b) * tanh(z / (c / b))
        softcap /= before
    return HeadTransform(softcap=softcap, scale=before * after, source=", ".join(fields) or "lm_head(hidden)")


def _settled_transform(model: torch.nn.Module, state: _PatchState) -> HeadTransform:
    """The transform the fused loss runs, for the config as it is now (called inside the root forward).

    Models read these fields at different times: Gemma's forward reads ``config.final_logit_softcapping``
    at every call, Cohere copies ``config.logit_scale`` into the module when it is built and reads that copy
    (`_config_value` reads it there too). So when the fields announce another transform than at the last
    check, the check `patch` runs
    (one 8-token forward in eval mode, no gradient) runs again, once per change, and the patch takes the
    transform the model's own forward now applies: the new one, else the one it had. Raises ValueError
    (naming the class, the change and the reason) when it is neither, when the new value is one lmloss
    cannot reproduce, or under ``patch(verify=False)``, where nothing can be checked.
    """
    now = head_transform(model)
    if now == state.config_read:
        return state.transform
    change = f"{state.config_read.source} -> {now.source}"
    if not state.verify:
        raise _refuse(model, f"its config changed after patch(verify=False) ({change}), and without the check "
                      "the patch cannot tell whether its forward follows the change; unpatch(model) and patch "
                      "it again")  # fmt: skip
    try:
        _verify(model, state, now, nested=True)
        settled = now
    except ValueError as err:
        try:
            _verify(model, state, state.transform, nested=True)
        except ValueError:
            why = str(err).split("'s loss: ", 1)[-1]
            raise _refuse(model, f"its config changed after patch() ({change}) and its forward applies neither "
                          f"transform: {why}") from None  # fmt: skip
        settled = state.transform  # the model kept the value it was built with
    state.config_read, state.transform = now, settled
    return settled


def call_through(
    module: torch.nn.Module, fn: Callable[..., Any], *args: Any, caller: torch.nn.Module | None = None, **kwargs: Any
) -> Any:
    """``module(*args, **kwargs)`` with ``fn(module, *args, **kwargs)`` standing in for its forward.

    The module's forward pre- and post-hooks fire around `fn` (FSDP2 gathers the parameters before and
    frees them after, and registers its backward hooks on the output), which calling `fn` directly would
    skip. The module's own forward is restored afterwards, also when `fn` raises. `caller`: a wrapper whose
    forward calls `module` (DDP): ``caller(*args, **kwargs)`` is called instead, so that its forward runs
    around `fn` too (`run_as_forward`).
    """
    had_instance_forward = "forward" in module.__dict__
    saved = module.__dict__.get("forward")
    module.forward = lambda *a, **k: fn(module, *a, **k)
    try:
        return (module if caller is None else caller)(*args, **kwargs)
    finally:
        if had_instance_forward:
            module.forward = saved
        else:
            del module.forward


def run_as_forward(model: torch.nn.Module, inner: torch.nn.Module, compute, *args: Any, **kwargs: Any) -> Any:
    """``compute(inner, *args, **kwargs)``, run as `model`'s forward when `model` wraps `inner`.

    `model`: what the trainer holds (a ``DistributedDataParallel`` under multi-process DDP, or `inner` itself);
    `inner`: the unwrapped model (``accelerator.unwrap_model(model)``). Where they differ, `inner`'s forward is
    replaced by `compute` for one call of ``model(*args, **kwargs)``, so that the wrapper's own forward runs
    around it: DDP's arms the gradient all-reduce of the backward that follows (a computation that bypassed
    it would leave every rank with its own gradients, TRL #7245) and syncs the buffers. `inner`'s own forward
    (a class method, or an instance attribute such as accelerate's autocast wrapper) is restored after the
    call, whatever it raised (`call_through`). Where `model` is `inner` (one process,
    FSDP2), `compute` is called directly.
    The tensors `compute` returns are what the call returns (DDP passes a tuple of tensors through as it
    is). For the trainers' patched methods (`lmloss.integrations.trl`'s and `trl_preference`'s, and any
    other that runs a fused head on a trainer's model)."""
    if model is inner:
        return compute(inner, *args, **kwargs)
    return call_through(inner, compute, *args, caller=model, **kwargs)


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
    transform: HeadTransform,
    options: dict[str, Any],
) -> torch.Tensor:
    """The head's forward while patched: transformers' ``ForCausalLMLoss`` of the model's logits
    (``transform`` of ``head(hidden)``), fused.

    `options`: `patch`'s keyword arguments for `lmloss.linear_cross_entropy` (chunk_size, impl, ...)."""
    hidden, weight, bias, device_type = _head_inputs(hidden, head)
    reduction = "mean" if num_items_in_batch is None else "sum"
    with torch.autocast(device_type, enabled=False):  # dtypes are settled; the op runs its own GEMMs
        loss = lmloss.linear_cross_entropy(
            hidden, weight, targets.to(hidden.device), bias=bias, ignore_index=ignore_index,
            reduction=reduction, softcap=transform.softcap, temperature=transform.temperature, **options,
        )  # fmt: skip
    if num_items_in_batch is not None:  # Trainer's gradient accumulation: sum over the global count
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _original_forward(model: torch.nn.Module, state: _PatchState) -> Callable[..., Any]:
    return state.instance_forward or type(model).forward.__get__(model, type(model))


def _cache_name(fields: Any) -> str:
    """The name transformers gives the KV cache among `fields` (argument or output field names): ``cache`` in
    transformers 5.x, ``past_key_values`` before. Naming the other one makes 5.x warn that it is deprecated."""
    return "cache" if "cache" in fields else "past_key_values"


def _patched_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Any,
):
    """A ``*ForCausalLM`` forward: in training mode with ``labels`` (or ``shift_labels``) the loss comes from
    lmloss's fused head and ``logits`` is None; without labels, or in eval mode (``Trainer.evaluate`` /
    ``predict``, unless ``patch(..., logits_in_eval=False)``), the model's original forward runs.

    `cache` is the fourth positional argument of transformers' forwards (``cache`` in 5.x,
    ``past_key_values`` before): passed on under the model's own name, and only when given, so the patched
    model warns about it exactly when the unpatched one does (a ``past_key_values=`` keyword goes through
    `kwargs` unchanged)."""
    state: _PatchState = getattr(self, _STATE_ATTR)
    if cache is not None:
        kwargs[_cache_name(inspect.signature(_original_forward(self, state)).parameters)] = cache
    call = dict(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds,
        labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs,
    )  # fmt: skip
    no_labels = labels is None and kwargs.get("shift_labels") is None
    if no_labels or (not self.training and state.logits_in_eval):
        return _original_forward(self, state)(**call)
    return _fused_forward(self, state, **call)


def _fused_forward(
    model: torch.nn.Module,
    state: _PatchState,
    *,
    labels: torch.Tensor | None,
    logits_to_keep: int | torch.Tensor,
    **kwargs: Any,
):
    """The body, then the fused loss through ``lm_head``: a ``CausalLMOutputWithPast`` with ``logits=None``,
    or with ``return_dict=False`` the tuple transformers returns with ``None`` in the logits slot."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if kwargs.get("output_router_logits"):
        raise _refuse(model, "output_router_logits=True asks for a router auxiliary loss")
    transform = _settled_transform(model, state)  # the config as it is now (changed after patch() too)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    loss_kwargs = {k: kwargs.pop(k) for k in _LOSS_KWARGS if k in kwargs}
    ignore_index = loss_kwargs.get("ignore_index", -100)
    # Only the arguments given: bodies without attention masks or caches (Mamba, RWKV) take what they know.
    outputs = _body(model)(**{k: v for k, v in kwargs.items() if v is not None})
    hidden = _keep(outputs[0], logits_to_keep)
    targets = loss_kwargs.get("shift_labels")
    if targets is None:
        targets = lmloss.packing.shift_labels(labels, ignore_index=ignore_index)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels give targets of shape {tuple(targets.shape)} but the model kept hidden states "
            f"{tuple(hidden.shape[:-1])} (logits_to_keep={logits_to_keep!r})"
        )
    loss = call_through(
        model.get_output_embeddings(), _fused_loss, hidden, targets,
        num_items_in_batch=loss_kwargs.get("num_items_in_batch"), ignore_index=ignore_index,
        transform=transform, options=state.options,
    )  # fmt: skip
    cache = _cache_name({f.name for f in dataclasses.fields(CausalLMOutputWithPast)})
    out = CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        **{cache: getattr(outputs, cache, None)},
    )
    if return_dict:
        return out
    # ModelOutput.to_tuple() drops None fields: without the logits everything after the loss would move one
    # place up. Keep transformers' layout, (loss, logits, cache, ...), with None for the logits.
    return (loss, None, *out.to_tuple()[1:])


def _verify(
    model: torch.nn.Module, state: _PatchState, transform: HeadTransform, *, nested: bool = False
) -> None:
    """One tiny forward (8 tokens, eval mode, no gradient, no autocast) of the unpatched model against the
    patch.

    Checks that the model's logits are `transform` of its head applied to its body's last hidden
    state, and that the fused loss equals the model's own loss (the label shift, the body call). Raises
    `ValueError` naming the class and what differs. `nested`: called inside the root module's forward
    (its hooks have run: FSDP2's parameters are gathered), so the model's forward is called directly."""
    head = model.get_output_embeddings()
    device = head.weight.device
    if device.type == "meta":
        raise _refuse(model, "its weights are on the meta device, so the patch cannot be verified; load "
                      "them first or pass verify=False")  # fmt: skip
    embeddings = model.get_input_embeddings()
    vocab = min(head.weight.shape[0], getattr(embeddings, "num_embeddings", head.weight.shape[0]))
    ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            try:
                # through the module's call, so that its hooks (FSDP2's) fire around the original forward
                # (inside the root forward they have fired already)
                want = (
                    _original_forward(model, state)(input_ids=ids, labels=ids, use_cache=False)
                    if nested
                    else call_through(
                        model,
                        lambda m, **kw: _original_forward(m, state)(**kw),
                        input_ids=ids,
                        labels=ids,
                        use_cache=False,
                    )  # fmt: skip
                )
            except Exception as err:  # noqa: BLE001 - any failure of the model's own forward
                raise _refuse(model, f"its forward failed on a check input ({type(err).__name__}: {err}); "
                              "pass verify=False to patch without the check") from err  # fmt: skip
            if getattr(want, "logits", None) is None or getattr(want, "loss", None) is None:
                raise _refuse(model, "its forward gave no logits or no loss to check against")
            # as the root module's forward: FSDP2 gathers the parameters, whichever unit holds the head
            z, got = (
                _check_outputs(model, ids, state, transform)
                if nested
                else call_through(model, _check_outputs, ids, state, transform)
            )
            t = transform
            expected = (z if t.softcap is None else t.softcap * torch.tanh(z / t.softcap)) * t.scale
            logits = want.logits.float()
            # a 16-bit head rounds its logits (and the model's transform of them) to 8 or 11 bits
            tol = 1e-4 if head.weight.dtype in (torch.float32, torch.float64) else 3e-2
            if logits.shape != expected.shape or not torch.allclose(logits, expected, rtol=tol, atol=tol):
                diff = (logits - expected).abs().max().item() if logits.shape == expected.shape else "shape"
                raise _refuse(
                    model,
                    f"its logits are not {_describe(t)} of its output embedding applied to its body's last "
                    f"hidden state (max difference {diff}): its head has more layers than one linear map, or "
                    "its forward transforms the logits in a way lmloss does not know",
                )
            if not torch.allclose(got.float(), want.loss.float(), rtol=tol, atol=tol):
                raise _refuse(
                    model,
                    f"its own loss is {want.loss.item():.6f} and the fused one {got.item():.6f} on a check "
                    "input: its loss is not the mean next-token cross-entropy of its logits",
                )
    finally:
        for module, training in modes.items():
            module.training = training


def _check_outputs(model: torch.nn.Module, ids: torch.Tensor, state: _PatchState, transform: HeadTransform):
    """`_verify`'s side, run as the root module's forward: the head's raw output ``z`` (fp32) on the body's
    last hidden state, and the fused loss of the shifted `ids`."""
    head = model.get_output_embeddings()
    hidden = _body(model)(input_ids=ids, use_cache=False)[0]
    if not isinstance(hidden, torch.Tensor) or hidden.shape[-1] != head.weight.shape[-1]:
        raise _refuse(model, f"its body's output does not fit its output embedding "
                      f"{tuple(head.weight.shape)}: the head has more than one layer")  # fmt: skip
    z = call_through(head, lambda m, h: type(m).forward(m, h), hidden).float()
    loss = call_through(
        head, _fused_loss, hidden, lmloss.packing.shift_labels(ids), num_items_in_batch=None,
        ignore_index=-100, transform=transform, options=state.options,
    )  # fmt: skip
    return z, loss


def _describe(t: HeadTransform) -> str:
    if t.source == "lm_head(hidden)":
        return "the identity"
    return f"scale * softcap (softcap={t.softcap}, scale={t.scale:g}, from config {t.source})"


def patch(
    model: torch.nn.Module,
    *,
    chunk_size: int | str | None = "auto",
    impl: str = "auto",
    weight_grad_dtype: torch.dtype = torch.float32,
    memory_budget_mib: float | None = None,
    logits_in_eval: bool = True,
    verify: bool = True,
) -> torch.nn.Module:
    """Make `model` (a ``transformers`` ``*ForCausalLM``) compute its training loss with lmloss's fused head.

    After ``patch(model)``, in training mode ``model(input_ids, attention_mask=..., labels=...)`` returns the
    loss of transformers' ``ForCausalLMLoss`` (labels shifted inside, ``ignore_index`` from the keyword,
    default -100; ``shift_labels=`` taken as already shifted; ``num_items_in_batch`` divides the summed
    loss, as ``Trainer`` does under gradient accumulation; ``logits_to_keep`` slices the hidden states
    first) and the same gradients, with ``logits=None``: no ``[tokens, vocab]`` tensor is made.
    ``return_dict=False`` gives transformers' tuple with ``None`` in the logits slot. Tied embeddings,
    bf16 / fp16, autocast, a final-logit softcap and logit multipliers (`head_transform`) are handled. They
    are read from ``model.config`` at every forward: after a change the check below runs again (once) and
    the fused loss follows the model's own, whether its forward reads the field as it runs or kept the
    value it was built with; a value lmloss cannot reproduce (a negative scale) raises ValueError there,
    and so does any change under ``verify=False``.

    Logits where a caller needs them: without ``labels``, and in eval mode (``model.eval()``, which
    ``Trainer.evaluate`` / ``predict`` set), the model's original forward runs and returns its logits (and
    its own loss), so ``generate``, ``compute_metrics`` and ``predict`` work unchanged.
    ``logits_in_eval=False`` keeps the fused loss (no logits) in eval mode too.

    One difference: a batch whose every label is ignored gives loss 0.0 (transformers gives NaN).

    Only this instance is patched (its ``forward`` attribute), not the class. Patching twice is a no-op;
    `unpatch` restores the original forward.

    Args:
        model: a ``PreTrainedModel`` with a decoder body (``model.base_model`` or ``model.model``) and a linear
            ``lm_head`` (``model.get_output_embeddings()``), optionally already wrapped by FSDP2's
            ``fully_shard`` (then every rank must call `patch`: the check below runs a forward).
        chunk_size, impl, weight_grad_dtype, memory_budget_mib: `lmloss.linear_cross_entropy`'s arguments,
            used for every loss the patched model computes (``memory_budget_mib`` caps what the loss allocates
            beyond its inputs and their gradients, the ``[V, H]`` fp32 weight-gradient accumulator included;
            None: ``LMLOSS_CHUNK_BUDGET_MIB`` or the device's default).
        logits_in_eval: in eval mode, run the original forward (logits and transformers' loss).
        verify: run one forward of 8 tokens of the unpatched model in eval mode at patch time, and refuse
            the patch unless the model's logits are the transform lmloss applies and its loss equals the
            fused one. ``False`` skips it (weights not loaded yet); the config checks still run.

    Returns:
        `model` itself.

    Raises:
        ValueError: naming the model class and the reason, when the patch would not reproduce the model's
            loss: an encoder-decoder model, no linear head, a router auxiliary loss, or (with `verify`)
            logits or a loss that differ from the fused ones.
        TypeError: `model` is not a module.
    """
    if is_patched(model):
        return model
    transform = head_transform(model)
    check_memory_budget(memory_budget_mib)
    options = dict(chunk_size=chunk_size, impl=impl, weight_grad_dtype=weight_grad_dtype,
                   memory_budget_mib=memory_budget_mib)  # fmt: skip
    state = _PatchState(
        instance_forward=model.__dict__.get("forward"), options=options, logits_in_eval=bool(logits_in_eval),
        verify=bool(verify), config_read=transform, transform=transform,
    )  # fmt: skip
    if verify:
        _verify(model, state, transform)
    setattr(model, _STATE_ATTR, state)
    model.forward = _patched_forward.__get__(model, type(model))
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: the model's forward is the one it had before (a no-op on an unpatched model)."""
    restore_forward(model, _STATE_ATTR)
    return model


def restore_forward(model: torch.nn.Module, state_attr: str) -> Any:
    """Undo an instance patch whose state ``model.<state_attr>`` keeps the ``instance_forward`` it replaced
    (None: the class's): the forward the instance had before, the state removed. Returns the state, or None
    (nothing done) where the instance holds none. `unpatch` here and in `lmloss.integrations.verl`."""
    state = model.__dict__.get(state_attr)
    if state is None:
        return None
    if state.instance_forward is None:
        del model.forward
    else:
        model.forward = state.instance_forward
    delattr(model, state_attr)
    return state


def is_patched(model: torch.nn.Module) -> bool:
    """Whether `patch` has been applied to this model instance."""
    return _STATE_ATTR in getattr(model, "__dict__", {})


def _score(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    return_entropy: bool,
    ignore_index: int,
    op_options: dict[str, Any],
    model_kwargs: dict[str, Any],
):
    """The root module's forward during `token_logprobs`: body, then the fused head through ``lm_head``."""
    outputs = _body(model)(input_ids=input_ids, use_cache=False, **model_kwargs)
    hidden = outputs[0][:, :-1]
    state = model.__dict__.get(_STATE_ATTR)
    transform = _settled_transform(model, state) if state is not None else head_transform(model)
    return call_through(
        model.get_output_embeddings(), _fused_logprobs, hidden, targets[:, 1:],
        temperature=temperature * transform.temperature, return_entropy=return_entropy,
        ignore_index=ignore_index, softcap=transform.softcap, op_options=op_options,
    )  # fmt: skip


def _fused_logprobs(head, hidden, targets, *, temperature, return_entropy, ignore_index, softcap, op_options):
    hidden, weight, bias, device_type = _head_inputs(hidden, head)
    with torch.autocast(device_type, enabled=False):
        return lmloss.linear_token_logprobs(
            hidden, weight, targets.to(hidden.device), bias=bias, temperature=temperature,
            ignore_index=ignore_index, return_entropy=return_entropy, softcap=softcap, **op_options,
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
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    invariant: bool = False,
    memory_budget_mib: float | None = None,
    return_logit_sum: bool = False,
    return_argmax: bool = False,
    return_log_sum_sq_probs: bool = False,
    **model_kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Per-token log-probs (and entropy) of a causal LM's own tokens, without logits: RL scoring.

    Runs the decoder body and `lmloss.linear_token_logprobs` inside ``model``'s forward call (so FSDP2
    gathers parameters as usual), patched or not. Differentiable: ``(-(logprobs * advantages)).sum()
    .backward()`` trains through it.

    With the rollout's `top_k` / `top_p` / `min_p` the log-probs and entropy are those of the distribution
    the engine sampled from (vLLM's order, docs/sampling.md); pass `labels` with the prompt at `ignore_index`
    then: a prompt token outside the kept set would get -inf (and a `lmloss.sampling.KeptSetWarning`).
    `invariant=True`: lmloss's batch-invariant head (docs/invariant.md; it covers the head, not the model
    body that makes the hidden states).

    Args:
        model: a ``transformers`` ``*ForCausalLM`` (see `patch` for what is supported).
        input_ids: int64 ``[B, S]``.
        labels: int64 ``[B, S]``, the token scored at each position (``ignore_index`` = not scored).
            Default: `input_ids`, with positions where ``attention_mask == 0`` ignored.
        attention_mask: ``[B, S]`` passed to the model (padding).
        temperature: the model's logits (after its softcap and multipliers, if any) are divided by it.
        return_entropy: also return the entropy of each position's next-token distribution.
        chunk_size, top_k, top_p, min_p, invariant, memory_budget_mib: `lmloss.linear_token_logprobs`'
            arguments (the sampling parameters: one value for the call).
        return_logit_sum, return_argmax, return_log_sum_sq_probs: the by-products of the same pass
            (`lmloss.token_logprobs`): the sum of the scaled logits over the vocabulary (TRL's mean logit times
            the vocabulary), the argmax (int64: token accuracy is ``argmax == labels``), ``log sum p**2`` (WPO).
        model_kwargs: more keyword arguments for the decoder body (e.g. ``position_ids``).

    Returns:
        fp32 ``[B, S]``, aligned with the tokens: ``logprobs[:, t] = log softmax(logits[:, t - 1] / T)
        [labels[:, t]]``, the log-prob of token ``t`` given the tokens before it; 0.0 at ``t = 0`` and
        where ``labels`` is ``ignore_index``. With ``return_entropy``, ``(logprobs, entropy)`` where
        ``entropy[:, t]`` is the entropy of that same distribution (0.0 at ``t = 0`` and where ``labels``
        is ``ignore_index``: those positions are not computed at all); then the by-products asked, aligned
        alike (0.0, the argmax -1, at ``t = 0`` and where ignored), in that order.
    """
    head_transform(model)  # refuses what the fused head cannot reproduce, before any forward
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
    check_memory_budget(memory_budget_mib)
    op_options = dict(chunk_size=chunk_size, top_k=top_k, top_p=top_p, min_p=min_p, invariant=invariant,
                      memory_budget_mib=memory_budget_mib, return_logit_sum=return_logit_sum,
                      return_argmax=return_argmax, return_log_sum_sq_probs=return_log_sum_sq_probs)  # fmt: skip
    out = call_through(
        model, _score, input_ids, labels, temperature=temperature, return_entropy=return_entropy,
        ignore_index=ignore_index, op_options=op_options, model_kwargs=model_kwargs,
    )  # fmt: skip
    # position 0 has no prediction: pad the [B, S - 1] outputs on the left (the argmax with -1, "none")
    outs = tuple(F.pad(o, (1, 0), value=-1 if o.dtype == torch.int64 else 0.0) for o in
                 (out if isinstance(out, tuple) else (out,)))  # fmt: skip
    return outs if len(outs) > 1 else outs[0]
