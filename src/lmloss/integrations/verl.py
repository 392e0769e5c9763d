"""verl 0.9.1: lmloss as a fused-kernel backend of verl's own model patch, and verl's policy losses.

**The fused head, by configuration.** verl's FSDP engine builds the actor (and the reference) model, then
calls ``verl.models.transformers.monkey_patch.apply_monkey_patch(model, use_fused_kernels=...,
fused_kernels_backend=...)``; with fused kernels on, the model's forward returns verl's PPO output
(``log_probs``, ``entropy``: per token, of the next token under ``softmax(logits / temperature)``) computed
from the hidden states by a backend (torch, triton, liger), without logits. Every worker imports the modules
named by ``external_lib`` first. So these three lines make lmloss that backend::

    actor_rollout_ref.model.external_lib=lmloss.integrations.verl
    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.fused_kernel_options.impl_backend=lmloss

The backend string may carry the head's options after a colon, ``lmloss:top_p=0.95,invariant=true`` (in a
YAML config the rollout's own values can be interpolated: ``"lmloss:top_k=${actor_rollout_ref.rollout.top_k},
top_p=${actor_rollout_ref.rollout.top_p}"``): see `HeadOptions`. The old and the new log-probs of the actor
(and the reference's) then come from the distribution the rollout sampled from, and with ``invariant=true``
from lmloss's batch-invariant head (docs/invariant.md: the head's bits, not the model body's).

**What importing this module changes in verl** (process-wide, idempotent; nothing else):

* ``verl.models.transformers.monkey_patch.patch_forward_with_backends`` (which ``apply_monkey_patch`` calls
  last) is wrapped: the backend ``lmloss`` goes to `patch`; every other value goes to verl's function
  unchanged.
* ``verl.utils.experimental.torch_functional.FusedLinearForPPO``, the head verl's forwards build per call,
  becomes `FusedLinearForPPO`, a subclass that also accepts ``impl_backend="lmloss"`` and is verl's class
  for every other backend.
* ``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY`` gains ``lmloss_<mode>`` for each of verl's modes
  (`register_policy_losses`); verl's own entries are not touched.
* ``verl.models.transformers.monkey_patch.is_trl_available`` (read by ``apply_monkey_patch`` alone) also asks
  whether TRL has the value-head class verl patches: TRL 1.16 removed it, and verl's ``apply_monkey_patch``
  then failed whenever TRL was installed; now it skips that class's patch (`_is_trl_available`). TRL itself
  is not changed.
* Once verl's FSDP engine module is loaded (its ``apply_monkey_patch`` call is what patches a model),
  ``FSDPEngineWithLMHead.forward_step`` and ``prepare_model_outputs`` are wrapped (`_hook_engine`): a
  forward-only engine (the reference model's) scores its model on the full distribution whatever the
  backend's truncation, and the `lmloss.sampling.KeptSetWarning` of a step counts its response tokens alone.
  Both call verl's methods unchanged.

No model class is changed: `patch` sets the forward of the one model instance (verl's own torch / triton /
liger backends set the forward of the model's *class*). The forward it sets is verl's own
``forward_with_torch_backend`` for the model's family (dense decoders, Qwen2/2.5-VL, Qwen3-VL, GLM-4V,
Qwen3.5: the body, ``shift_labels`` (Ulysses SP) or the rolled labels, the packed or padded layout, exactly
verl's), with `lmloss.linear_token_logprobs` as the head: no ``[tokens, vocab]`` tensor, the vocabulary
walked in chunks, the model's own logit transform (Gemma's softcap, Cohere's / Granite's scales, read by
`lmloss.integrations.hf.head_transform`) applied where verl's torch backend leaves it out.

**Policy losses with verl's signature.** `policy_loss_fn(loss_mode)` returns a function with the signature
and the return of verl's ``PolicyLossFn`` (``old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights -> (loss, metrics)``) computed by `lmloss.rl.policy_loss`, equal to
verl's own function of that name: its config fields, its ``global_batch_info`` (DP size and global counts),
its dual clip, its fixed aggregation of ``sapo`` and ``geo_mean`` (where `lmloss.rl.policy_loss` itself
differs from verl on purpose, docs/rl.md, this adapter reproduces verl). In verl, set
``actor_rollout_ref.actor.policy_loss.loss_mode=lmloss_<mode>`` with this module as ``external_lib``.

Tested against verl 0.9.1 (the ``lmloss[verl]`` extra pins it): the forward against verl's ``torch``
backend and its unfused path on tiny models, the losses against ``core_algos``
(tests/test_integrations_verl.py).
This module imports verl; `lmloss.integrations` does not import this module.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
import math
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

import lmloss
from lmloss import _validate
from lmloss.chunks import check_memory_budget
from lmloss.integrations import hf
from lmloss.sampling import KeptSetWarning, report_dropped

try:
    from verl.models.transformers import monkey_patch as _verl_monkey_patch
    from verl.trainer.ppo import core_algos as _verl_core_algos
    from verl.utils.experimental import torch_functional as _verl_torch_functional
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError(
        "lmloss.integrations.verl needs verl (tested with verl==0.9.1: pip install 'lmloss[verl]'), and verl's "
        f"own dependencies (ray, transformers...): {err}"
    ) from err

__all__ = [
    "BACKEND",
    "POLICY_LOSS_PREFIX",
    "VERL_LOSS_MODES",
    "FusedLinearForPPO",
    "HeadOptions",
    "backend_options",
    "is_patched",
    "patch",
    "policy_loss_fn",
    "register_policy_losses",
    "unpatch",
]

#: The ``fused_kernel_options.impl_backend`` value (optionally followed by ``:options``, `backend_options`).
BACKEND = "lmloss"
#: `register_policy_losses` registers ``lmloss_<mode>`` for each of `VERL_LOSS_MODES`.
POLICY_LOSS_PREFIX = "lmloss_"
#: verl 0.9.1's ``POLICY_LOSS_REGISTRY`` names, each reproduced by `policy_loss_fn`.
VERL_LOSS_MODES = (
    "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo",
    "bypass_mode",
)  # fmt: skip

_STATE_ATTR = "_lmloss_verl_patch"
# model_type -> the verl module whose ``forward_with_torch_backend`` verl 0.9.1's
# ``patch_forward_with_backends`` picks for it (every other model type: ``dense_common``); the tests check
# the choice against verl's own function.
_FAMILY_MODULES = {
    "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
    "glm4v": "glm4v", "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5",
}  # fmt: skip
_IMPLS = ("auto", "torch", "triton")


@dataclasses.dataclass(frozen=True)
class HeadOptions:
    """The fused head's options in verl (`lmloss.linear_token_logprobs`' arguments of the same names).

    verl's "off" values are accepted and mean off: ``top_k <= 0`` (verl's rollout default -1, TRL's 0),
    ``top_p == 1``, ``min_p == 0``; so ``top_k=${actor_rollout_ref.rollout.top_k}`` can be passed as is.

    Attributes:
        top_k, top_p, min_p: score the actor under the rollout engine's truncated distribution (vLLM's
            order: min-p, top-k, top-p, after the temperature; docs/sampling.md). A model verl builds in a
            forward-only engine (the reference) is scored on its full distribution whatever these say (see
            `_EngineStep`). A sampled token outside the kept set the trainer recomputes gets log-prob -inf
            (and lmloss warns, in verl's engine step counting response tokens alone); positions that score
            no sampled token (the prompt, each sequence's last position) may too, and verl drops them from
            the loss.
        invariant: the head's outputs are the same bits whatever the batch, the packing and the chunking
            (docs/invariant.md; the model body's hidden states are not covered).
        chunk_size: tokens per chunk, ``"auto"`` (a memory budget) or None (one chunk).
        impl: ``"auto"`` (Triton on CUDA when it imports), ``"torch"`` or ``"triton"``.
        memory_budget_mib: what the head may allocate beyond its inputs and their gradients, in MiB (the
            ``[V, H]`` fp32 weight-gradient accumulator included: below it, the weight pass); None: the
            default (``LMLOSS_CHUNK_BUDGET_MIB`` or the device's).
    """

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    invariant: bool = False
    chunk_size: int | str | None = "auto"
    impl: str = "auto"
    memory_budget_mib: float | None = None

    def __post_init__(self) -> None:
        def set_(name, value):
            object.__setattr__(self, name, value)

        if self.top_k is not None:
            if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
                raise TypeError(f"top_k must be an int or None, got {self.top_k!r}")
            if self.top_k <= 0:
                set_("top_k", None)
            else:  # past int64 the op would refuse it mid-step: refuse it when the options are read
                _validate.check_int64("top_k", self.top_k)
        for name in ("top_p", "min_p"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite float or None, got {value!r}")
            value = float(value)
            if name == "top_p" and not 0.0 < value <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {value}")
            if name == "min_p" and not 0.0 <= value <= 1.0:
                raise ValueError(f"min_p must be in [0, 1], got {value}")
            off = value == 1.0 if name == "top_p" else value == 0.0  # keeps every token: skip the search
            set_(name, None if off else value)
        if not isinstance(self.invariant, bool):
            raise TypeError(f"invariant must be a bool, got {self.invariant!r}")
        chunk = self.chunk_size
        if not (
            chunk is None
            or chunk == "auto"
            or (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1)
        ):
            raise ValueError(f"chunk_size must be an int >= 1, 'auto' or None, got {chunk!r}")
        _validate.check_chunk_size(chunk)
        if self.impl not in _IMPLS:
            raise ValueError(f"impl must be one of {_IMPLS}, got {self.impl!r}")
        check_memory_budget(self.memory_budget_mib)

    def op_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for `lmloss.linear_token_logprobs`."""
        return dataclasses.asdict(self)


# the spellings of a boolean option (YAML's and the command line's; compared lower-cased)
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def backend_options(spec: str) -> HeadOptions:
    """The options of a backend string: ``"lmloss"`` (the defaults) or ``"lmloss:key=value,key=value"``.

    Keys are `HeadOptions`' fields: ``top_k`` (int; ``0`` or negative: off), ``top_p`` / ``min_p`` (float),
    ``invariant`` (``true`` / ``1`` / ``yes`` / ``on`` or ``false`` / ``0`` / ``no`` / ``off``, any case),
    ``chunk_size`` (int, ``auto`` or ``none``), ``impl``, ``memory_budget_mib`` (MiB, or ``none``). Spaces
    are ignored.

    Raises:
        ValueError: naming the backend string and the key or value it cannot read.
    """
    if not isinstance(spec, str):
        raise TypeError(f"fused_kernels_backend must be a string, got {type(spec).__name__}")
    name, _, rest = spec.strip().partition(":")
    if name.strip() != BACKEND:
        raise ValueError(
            f"fused_kernels_backend {spec!r} is not lmloss's ({BACKEND!r} or '{BACKEND}:options')"
        )
    fields = {f.name for f in dataclasses.fields(HeadOptions)}
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, raw = (s.strip() for s in item.partition("="))
        if not sep or key not in fields:
            raise ValueError(
                f"fused_kernels_backend {spec!r}: {item!r} is not key=value with a key in {sorted(fields)}"
            )
        if key in options:
            raise ValueError(f"fused_kernels_backend {spec!r}: {key} is given twice")
        low = raw.lower()
        try:
            if key == "top_k":
                value: Any = int(raw)
            elif key in ("top_p", "min_p"):
                value = float(raw)
            elif key == "invariant":
                if low not in _TRUE + _FALSE:
                    raise ValueError(raw)
                value = low in _TRUE
            elif key == "chunk_size":
                value = None if low in ("none", "null") else "auto" if low == "auto" else int(raw)
            elif key == "memory_budget_mib":
                value = None if low in ("none", "null") else float(raw)
            else:
                value = raw
        except ValueError:
            raise ValueError(f"fused_kernels_backend {spec!r}: cannot read {key}={raw!r}") from None
        options[key] = value
    try:
        return HeadOptions(**options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"fused_kernels_backend {spec!r}: {err}") from None


@dataclasses.dataclass
class _PatchState:
    """Kept on the patched model instance."""

    options: HeadOptions
    transform: hf.HeadTransform
    verl_forward: Callable[..., Any]  # verl's forward_with_torch_backend of the model's family
    instance_forward: Callable[..., Any] | None  # a forward set on the instance before (None: the class's)


# The model whose forward is running, and its state: the head (`FusedLinearForPPO`) reads its options here.
_RUNNING: contextvars.ContextVar[tuple[torch.nn.Module, _PatchState] | None] = contextvars.ContextVar(
    "lmloss_verl_running", default=None
)


def _verl_torch_forward(model: torch.nn.Module) -> Callable[..., Any]:
    family = _FAMILY_MODULES.get(getattr(model.config, "model_type", None), "dense_common")
    return importlib.import_module(f"verl.models.transformers.{family}").forward_with_torch_backend


def _ppo_forward(self, *args: Any, **kwargs: Any) -> Any:
    """The patched instance's forward: verl's torch-backend forward of its family, whose head
    (`FusedLinearForPPO` with ``impl_backend="lmloss"``) reads this model's options."""
    state: _PatchState = self.__dict__[_STATE_ATTR]
    token = _RUNNING.set((self, state))
    try:
        return state.verl_forward(self, *args, **kwargs)
    finally:
        _RUNNING.reset(token)


def patch(model: torch.nn.Module, options: HeadOptions | None = None, **kwargs: Any) -> torch.nn.Module:
    """Make `model`'s forward verl's fused PPO forward with lmloss's head (what ``apply_monkey_patch(...,
    use_fused_kernels=True, fused_kernels_backend="lmloss")`` does). Returns `model`.

    Afterwards ``model(input_ids=..., attention_mask=..., position_ids=..., temperature=T, return_dict=True,
    shift_labels=...)`` returns verl's output dataclass for the model's family with ``log_probs`` and
    ``entropy``, each fp32 ``[B, S]`` (``[1, total_nnz]`` packed): at position ``t`` the log-prob of
    ``shift_labels[:, t]`` (else the labels or input ids rolled by one, as verl) under ``softmax(logits[:, t]
    / T)`` (within the kept set, with `HeadOptions`' truncation), and that distribution's entropy. Both are
    differentiable; verl's torch backend returns the entropy in the model's dtype, lmloss in fp32.

    Only this instance is patched (its ``forward`` attribute); patching again replaces the options;
    `unpatch` restores the forward it had.

    Args:
        model: a ``transformers`` model verl builds for the actor or reference (``*ForCausalLM``, or a VLM's
            ``*ForConditionalGeneration``) with a linear ``lm_head`` without bias.
        options: the head's `HeadOptions`, or the same as keyword arguments (``top_p=0.95, ...``).

    Raises:
        ValueError: the model's head is not one linear map lmloss reproduces (`hf.head_transform`'s
            reasons), or it has a bias (verl's fused forwards pass the weight alone).
    """
    if options is None:
        options = HeadOptions(**kwargs)
    elif kwargs:
        raise TypeError("pass either options= or keyword options, not both")
    elif not isinstance(options, HeadOptions):
        raise TypeError(f"options must be a HeadOptions, got {type(options).__name__}")
    transform = hf.head_transform(model, for_loss=False)
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise ValueError(
            f"lmloss.integrations.verl cannot patch {type(model).__name__}: its lm_head has a bias, and verl's "
            "fused forward passes the head's weight alone"
        )
    previous: _PatchState | None = model.__dict__.get(_STATE_ATTR)
    instance_forward = previous.instance_forward if previous else model.__dict__.get("forward")
    setattr(model, _STATE_ATTR, _PatchState(options, transform, _verl_torch_forward(model), instance_forward))
    model._verl_fused_kernels_backend = BACKEND  # the attribute verl's forwards read to pick the head
    model.forward = types.MethodType(_ppo_forward, model)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: the forward the instance had before (a no-op on a model `patch` did not touch)."""
    if hf.restore_forward(model, _STATE_ATTR) is None:
        return model
    if model.__dict__.get("_verl_fused_kernels_backend") == BACKEND:
        del model._verl_fused_kernels_backend
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """Whether `patch` has been applied to this model instance."""
    return _STATE_ATTR in getattr(model, "__dict__", {})


def _ppo_head(
    hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's head contract (hidden ``[..., H]``, the head's weight ``[V, H]``, the targets ``[...]``, the
    temperature) -> fp32 ``(log_probs, entropy)`` of shape ``[...]``, by `lmloss.linear_token_logprobs`."""
    running = _RUNNING.get()
    options, transform = (running[1].options, running[1].transform) if running else (HeadOptions(), None)
    kwargs = options.op_kwargs()
    step = _STEP.get()
    if step is not None and step.reference:  # the reference model: its own full distribution (see _EngineStep)
        kwargs.update(top_k=None, top_p=None, min_p=None)
    truncated = any(kwargs[k] is not None for k in ("top_k", "top_p", "min_p"))
    if isinstance(temperature, torch.Tensor):
        temperature = float(temperature)
    if transform is not None:
        temperature, softcap = temperature * transform.temperature, transform.softcap
    else:
        softcap = None
    if hidden_states.dtype != vocab_weights.dtype:
        hidden_states = hidden_states.to(vocab_weights.dtype)
    with torch.autocast(vocab_weights.device.type, enabled=False), warnings.catch_warnings():
        if step is not None and truncated:
            # in verl's engine step the -inf are counted on the response tokens alone, after the step's outputs
            # are laid out (_report_response_tokens): every prompt position and each sequence's last would count here
            step.truncated = True
            warnings.simplefilter("ignore", KeptSetWarning)
        return lmloss.linear_token_logprobs(
            hidden_states, vocab_weights, input_ids.long(), temperature=temperature, softcap=softcap,
            return_entropy=True, **kwargs,
        )  # fmt: skip


# verl's own class (also when this module is reloaded and the name already holds the subclass below)
_VERL_FUSED_LINEAR_FOR_PPO = getattr(
    _verl_torch_functional.FusedLinearForPPO, "verl_class", _verl_torch_functional.FusedLinearForPPO
)


class FusedLinearForPPO(_VERL_FUSED_LINEAR_FOR_PPO):
    """verl's ``FusedLinearForPPO`` (the fused head its model forwards build), with one more backend:
    ``impl_backend="lmloss"`` computes ``(log_probs, entropy)`` with `lmloss.linear_token_logprobs` and
    the options of the patched model whose forward is running. Every other backend is verl's class."""

    verl_class = _VERL_FUSED_LINEAR_FOR_PPO

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        if impl_backend == BACKEND:
            torch.nn.Module.__init__(self)
            self.chunk_size, self.impl_backend = chunk_size, impl_backend
        else:
            super().__init__(chunk_size=chunk_size, impl_backend=impl_backend)

    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        if self.impl_backend != BACKEND:
            return super().forward(hidden_states, vocab_weights, input_ids, temperature)
        return _ppo_head(hidden_states, vocab_weights, input_ids, temperature)


def _patch_forward_with_backends(
    model: torch.nn.Module, use_fused_kernels: bool = False, fused_kernels_backend: str | None = None
) -> None:
    """verl's ``patch_forward_with_backends``, with ``lmloss`` (and ``lmloss:options``) among the backends."""
    if (
        use_fused_kernels
        and isinstance(fused_kernels_backend, str)
        and fused_kernels_backend.split(":")[0].strip() == BACKEND
    ):
        _hook_engine()  # the engine that builds this model (reference or actor) is loaded by now
        patch(model, backend_options(fused_kernels_backend))
        print(f"Using lmloss backend for fused kernels in {type(model).__name__} (this instance's forward)")
        return None
    return _VERL_PATCH_FORWARD_WITH_BACKENDS(
        model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend
    )


# ------------------------------------------------------------------------------------- verl's engine step


@dataclasses.dataclass
class _EngineStep:
    """The verl engine step whose forward is running (`_hook_engine`), as the head needs it.

    reference: the engine is forward-only (``engine_config.forward_only``: verl builds its reference model in
        such an engine; the actor's is not, its old log-probs included). The reference is scored on its own
        full distribution, whatever the backend's truncation: the KL terms compare the policy under the
        sampler with the reference model itself, and a token the sampler kept but the reference's truncation
        would not stays finite (a truncated reference gave it -inf: an infinite or clamped KL).
    truncated: the head ran under a kept set during this step (its -inf are counted after the step's
        outputs are laid out, on the response tokens alone).
    """

    reference: bool
    truncated: bool = False


_STEP: contextvars.ContextVar[_EngineStep | None] = contextvars.ContextVar("lmloss_verl_engine_step", default=None)
#: verl 0.9.1's FSDP engine, whose ``_build_module`` calls ``apply_monkey_patch`` (and so `patch`).
ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"


def _report_response_tokens(log_probs: torch.Tensor | None, micro_batch: Any) -> None:
    """Warn (`lmloss.sampling.KeptSetWarning`) of the response tokens whose log-prob is -inf in a step's output:
    the positions verl's losses read (``no_padding_2_padding``'s response slice, within ``response_mask``).
    A micro-batch without ``responses`` (not an RL batch) counts every position."""
    if log_probs is None:
        return
    log_probs = log_probs.detach()
    if {"prompts", "responses", "response_mask"} <= set(micro_batch.keys()):
        from verl.workers.utils.padding import no_padding_2_padding

        try:  # the slice verl's ppo_loss reads; a layout it refuses costs the warning's precision, not the step
            response = no_padding_2_padding(log_probs, micro_batch)
        except (AssertionError, KeyError, RuntimeError, ValueError):
            response = None
        if response is not None:
            mask = micro_batch["response_mask"]
            mask = (mask.to_padded_tensor(0) if mask.is_nested else mask).bool()
            counted = torch.zeros_like(response, dtype=torch.bool)
            width = min(counted.shape[-1], mask.shape[-1])
            counted[:, :width] = mask[:, :width]
            report_dropped(response, None, 0, counting=counted, counted_by="verl's response_mask")
            return
    values = log_probs.values() if log_probs.is_nested else log_probs
    report_dropped(values, None, 0, counted_by="every position: no response slice in the micro-batch")


def _hook_engine() -> None:
    """Wrap ``forward_step`` and ``prepare_model_outputs`` of verl's ``FSDPEngineWithLMHead`` once, if its
    module is loaded (it is whenever its ``apply_monkey_patch`` runs; not imported here: it needs peft, ray...).

    ``forward_step``: the step's `_EngineStep` for the head (a forward-only engine: the reference).
    ``prepare_model_outputs``: after verl lays out the step's log-probs, the -inf among its response tokens are
    counted (`_report_response_tokens`). Both call verl's method unchanged."""
    cls = getattr(sys.modules.get(ENGINE_MODULE), "FSDPEngineWithLMHead", None)
    if cls is None or getattr(cls.forward_step, "__lmloss_verl__", False):
        return
    verl_step, verl_outputs = cls.forward_step, cls.prepare_model_outputs

    def forward_step(self, micro_batch, loss_function, forward_only):
        config = getattr(self, "engine_config", None)
        token = _STEP.set(_EngineStep(reference=bool(getattr(config, "forward_only", False))))
        try:
            return verl_step(self, micro_batch, loss_function, forward_only)
        finally:
            _STEP.reset(token)

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        model_output = verl_outputs(self, output, output_args, micro_batch, logits_processor_func)
        step = _STEP.get()
        if step is not None and step.truncated:
            step.truncated = False
            _report_response_tokens(model_output.get("log_probs"), micro_batch)
        return model_output

    for name, wrapper, verl_fn in (("forward_step", forward_step, verl_step),
                                   ("prepare_model_outputs", prepare_model_outputs, verl_outputs)):  # fmt: skip
        wrapper.__wrapped__, wrapper.__lmloss_verl__ = verl_fn, True  # type: ignore[attr-defined]
        wrapper.__name__ = wrapper.__qualname__ = name
        setattr(cls, name, wrapper)


# ------------------------------------------------------------------------------------------ policy losses


def _option(config: Any, name: str, default: Any) -> Any:
    """``config.name``, or `default` where it is absent or None (verl's ``x if x is not None else d``)."""
    value = getattr(config, name, None) if config is not None else None
    return default if value is None else value


def _verl_token_weights(
    response_mask: torch.Tensor, loss_agg_mode: str, batch_info: Mapping[str, Any], dtype: torch.dtype
) -> torch.Tensor:
    """Per-token weights ``w`` with ``sum(w * loss_mat)`` = verl's ``agg_loss(loss_mat, response_mask,
    loss_agg_mode, **global_batch_info)``, for verl's padded ``[batch, length]`` rows.

    Without the global counts the denominators are the call's (valid tokens; rows with a valid token). With
    them (verl's actor sets ``dp_size``, ``batch_num_tokens`` and ``global_batch_size`` per step) they are the
    global batch's, and each rank's loss is multiplied by ``dp_size`` (the DP wrapper averages gradients)."""
    modes = lmloss.rl.LOSS_AGG_MODES[:5]  # verl's names
    if loss_agg_mode not in modes:
        raise ValueError(f"loss_agg_mode must be one of verl's {modes}, got {loss_agg_mode!r}")
    mask = response_mask.to(dtype)
    dp_size = batch_info.get("dp_size") or 1

    def count(name: str, local: torch.Tensor) -> torch.Tensor | float:
        value = batch_info.get(name)
        if value is None:
            if dp_size > 1:
                raise ValueError(
                    f"config.global_batch_info: {name} is required when dp_size > 1 (verl's agg_loss)"
                )
            return local
        return value

    if loss_agg_mode == "token-sum":
        return mask * dp_size
    if loss_agg_mode == "token-mean":
        return mask * (dp_size / count("batch_num_tokens", mask.sum()))
    n_seqs = count("global_batch_size", (mask.sum(-1) > 0).sum(dtype=dtype))
    if loss_agg_mode == "seq-mean-token-mean":  # verl's 1e-8 in each row's count, as verl adds it for this mask
        mask = mask / lmloss.rl.aggregation.count_with_eps(mask.sum(-1), response_mask.dtype)[:, None]
    weights = mask * (dp_size / n_seqs)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        horizon = batch_info.get("loss_scale_factor")
        weights = weights / (response_mask.shape[-1] if horizon is None else horizon)
    return weights


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return (torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)).item()


#: The modes whose verl function clamps the log-ratio to [-20, 20] before its ``actor/ppo_kl`` metric (verl's
#: ``negative_approx_kl``; ``bypass_mode``'s PPO-clip is ``vanilla``). The others report the unclamped mean.
_PPO_KL_CLAMPED = ("vanilla", "dppo_tv", "dppo_kl", "sapo", "cispo")
_VERL_LOG_RATIO_CLAMP = 20.0


def _verl_metrics(loss_mode: str, metrics: dict[str, torch.Tensor], lp, old, mask) -> dict[str, float]:
    """The metrics verl's function of `loss_mode` returns, under its keys, as Python floats.

    Means over `mask` read nothing at a masked token (a NaN or -inf there does not reach them, where verl's
    ``masked_mean``, a product with the mask, gives NaN: docs/use_in_your_stack.md)."""
    if loss_mode == "gpg":
        return {}
    if loss_mode == "kl_cov":  # verl reports the mean |log ratio| for kl_cov
        return {"actor/ppo_kl": _masked_mean((lp - old).detach().abs(), mask)}
    if loss_mode in ("dro", "reinforce"):
        return {"actor/ppo_kl": metrics["ppo_kl"].item()}
    ppo_kl = metrics["ppo_kl"].item()
    if loss_mode in _PPO_KL_CLAMPED:  # verl clamps the log-ratio first: a ratio of e^30 reads as e^20 here
        clamped = (lp - old).detach().clamp(-_VERL_LOG_RATIO_CLAMP, _VERL_LOG_RATIO_CLAMP)
        ppo_kl = _masked_mean(-clamped, mask)
    out = {"actor/pg_clipfrac": metrics["pg_clipfrac"].item(), "actor/ppo_kl": ppo_kl}
    if loss_mode != "clip_cov":
        out["actor/pg_clipfrac_lower"] = metrics["pg_clipfrac_lower"].item()
    return out


def _objective_options(loss_mode: str, config: Any) -> dict[str, Any]:
    """`lmloss.rl.policy_loss`'s options of verl's function `loss_mode`, read from verl's actor config."""
    clip = _option(config, "clip_ratio", 0.2)
    options: dict[str, Any] = dict(
        clip_ratio=clip, clip_ratio_low=_option(config, "clip_ratio_low", clip),
        clip_ratio_high=_option(config, "clip_ratio_high", clip),
    )  # fmt: skip
    if loss_mode == "vanilla":  # verl's dual clip is always on
        options["clip_ratio_c"] = _option(config, "clip_ratio_c", 3.0)
    elif loss_mode in ("dppo_tv", "dppo_kl"):  # the same field caps DPPO's ratio
        options["clip_ratio_c"] = _option(config, "clip_ratio_c", 20.0)
    elif loss_mode == "sapo":
        options.update(tau_pos=_option(config, "tau_pos", 1.0), tau_neg=_option(config, "tau_neg", 1.05))
    policy = getattr(config, "policy_loss", None)
    if loss_mode == "clip_cov":
        options.update(
            clip_cov_ratio=_option(policy, "clip_cov_ratio", 0.0002),
            clip_cov_lb=_option(policy, "clip_cov_lb", 1.0),
            clip_cov_ub=_option(policy, "clip_cov_ub", 5.0),
        )
    elif loss_mode == "kl_cov":
        options.update(
            kl_cov_ratio=_option(policy, "kl_cov_ratio", 0.0002),
            ppo_kl_coef=_option(policy, "ppo_kl_coef", 1.0),
        )
    elif loss_mode == "dro":
        beta = getattr(policy, "dro_beta", None)
        if beta is None or beta <= 0:
            raise ValueError(f"config.policy_loss.dro_beta must be > 0 for loss_mode 'dro', got {beta!r}")
        options["dro_beta"] = beta
    return options


def _policy_loss(
    loss_mode: str,
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode,
    config,
    rollout_is_weights,
) -> tuple[torch.Tensor, dict[str, float]]:
    mask = lmloss.rl.aggregation.check_mask(response_mask, log_prob.shape, name="response_mask")
    if log_prob.dim() != 2:
        raise ValueError(
            f"log_prob must be verl's padded [batch, response_length], got shape {tuple(log_prob.shape)}"
        )
    batch_info = dict(getattr(config, "global_batch_info", None) or {})
    if loss_mode == "geo_mean":
        # verl: the mean over the batch's rows of each row's loss (rows without a valid token count, as 0),
        # whatever loss_agg_mode and without the global counts
        rows = mask.to(log_prob.dtype)
        weights = rows / (rows.sum(-1, keepdim=True).clamp(min=1.0) * mask.shape[0])
    else:
        mode = "seq-mean-token-mean" if loss_mode == "sapo" else loss_agg_mode  # verl fixes sapo's
        weights = _verl_token_weights(response_mask, mode, batch_info, log_prob.dtype)
    options = {} if loss_mode == "reinforce" else _objective_options(loss_mode, config)
    loss, metrics = lmloss.rl.policy_loss(  # verl's mask as given: its dtype decides how verl adds its 1e-8
        log_prob, old_log_prob, advantages, response_mask, loss_mode=loss_mode, token_weights=weights,
        rollout_is_weights=rollout_is_weights, **options,
    )  # fmt: skip
    if not bool(torch.isfinite(weights).all()):
        # a denominator of 0 (a call without a valid token and no global counts): verl's agg_loss gives
        # 0 / 0 = NaN, with a gradient of 0; lmloss.rl would give 0
        loss = loss + float("nan")
    return loss, _verl_metrics(loss_mode, metrics, log_prob, old_log_prob, mask)


def _bypass_mode(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``bypass_mode``: ``old_log_prob`` is the rollout's; the rollout-correction weights of the current
    policy against it (computed without gradient) and the rejection mask, then PPO clip against the rollout
    (``loss_type="ppo_clip"``, the weights unused) or REINFORCE times the weights (``"reinforce"``)."""
    correction = getattr(getattr(config, "policy_loss", None), "rollout_correction", None)
    if correction is None:
        raise ValueError("config.policy_loss.rollout_correction is required for loss_mode 'bypass_mode'")
    loss_type = _option(correction, "loss_type", "ppo_clip")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(
            "config.policy_loss.rollout_correction.loss_type must be 'ppo_clip' or 'reinforce', "
            f"got {loss_type!r}"
        )
    lmloss.rl.aggregation.check_mask(response_mask, log_prob.shape, name="response_mask")
    # the mask as verl has it, in response_mask's dtype throughout (verl's 1e-8 in a count follows it)
    mask = response_mask
    level, threshold = (
        getattr(correction, "rollout_is", None),
        _option(correction, "rollout_is_threshold", 2.0),
    )
    weights = None
    # verl normalizes the weights over every process (its distributed_masked_mean on the default group)
    world = (
        torch.distributed.group.WORLD
        if torch.distributed.is_available() and torch.distributed.is_initialized()
        else None
    )
    with torch.no_grad():
        current = log_prob.detach()
        if level is not None and threshold is not None:
            normalize = bool(_option(correction, "rollout_is_batch_normalize", False))
            spec = str(threshold).strip()
            common = dict(level=level, batch_normalize=normalize, group=world)
            if "_" in spec:  # "lower_upper": IcePop, zero outside the bounds
                lower, upper = (float(v) for v in spec.split("_", 1))
                weights = lmloss.rl.masked_is_weights(
                    current, old_log_prob, mask, lower=lower, upper=upper, **common
                )
            else:  # one bound: TIS, capped
                weights = lmloss.rl.truncated_is_weights(current, old_log_prob, mask, cap=float(spec), **common)
        rollout_rs = getattr(correction, "rollout_rs", None)
        if rollout_rs is not None:
            rs_threshold = getattr(correction, "rollout_rs_threshold", None)
            if rs_threshold is None:
                raise ValueError(
                    "config.policy_loss.rollout_correction.rollout_rs_threshold is required with rollout_rs"
                )
            mask = lmloss.rl.rejection_mask(current, old_log_prob, mask, rollout_rs=rollout_rs,
                                            rollout_rs_threshold=rs_threshold).to(response_mask.dtype)  # fmt: skip
    if loss_type == "reinforce":
        return _policy_loss(
            "reinforce", old_log_prob, log_prob, advantages, mask, loss_agg_mode, config, weights
        )
    return _policy_loss("vanilla", old_log_prob, log_prob, advantages, mask, loss_agg_mode, config, None)


#: verl's default ``loss_agg_mode`` of each function (the keyword's default in its signature).
_DEFAULT_AGG = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean"}


def policy_loss_fn(loss_mode: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """verl's policy loss `loss_mode`, computed by `lmloss.rl.policy_loss`: a function with verl's
    ``PolicyLossFn`` signature and return.

    The returned ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=..., config=None,
    rollout_is_weights=None) -> (loss, metrics)`` takes verl's padded ``[batch, response_length]`` tensors
    and its ``ActorConfig`` (``actor_rollout_ref.actor``: the clip ratios, ``clip_ratio_c``, ``tau_pos`` /
    ``tau_neg``, ``policy_loss.*``, and ``global_batch_info`` with ``dp_size``, ``batch_num_tokens``,
    ``global_batch_size``, ``loss_scale_factor``, which verl's actor fills per step). It returns the 0-d
    loss (differentiable with respect to `log_prob`) and verl's metrics of that mode (``actor/pg_clipfrac``,
    ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` as Python floats, the keys verl's function returns). Equal
    to verl 0.9.1's own function, value and gradient, including what `lmloss.rl.policy_loss` does
    differently on purpose (docs/rl.md): the dual clip always on for ``vanilla``, ``sapo``'s policy term by
    ``seq-mean-token-mean`` and ``geo_mean``'s as the mean over every row whatever `loss_agg_mode`, the
    clip_cov / kl_cov selection from the call's tokens, sequences counted as verl counts them.
    ``bypass_mode`` returns the policy term's metrics, not verl's ``rollout_corr/`` diagnostics.

    Raises:
        ValueError: `loss_mode` is not one of `VERL_LOSS_MODES` (or, when called, a missing config or field).
    """
    if loss_mode not in VERL_LOSS_MODES:
        raise ValueError(f"loss_mode must be one of verl's {VERL_LOSS_MODES}, got {loss_mode!r}")
    default_agg = _DEFAULT_AGG.get(loss_mode, "token-mean")

    def fn(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = default_agg,
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if config is None:
            raise ValueError(
                f"config is required: verl's ActorConfig (actor_rollout_ref.actor) for {loss_mode!r}"
            )
        if loss_mode == "bypass_mode":
            return _bypass_mode(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)
        return _policy_loss(
            loss_mode,
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            loss_agg_mode,
            config,
            rollout_is_weights,
        )

    fn.__name__ = fn.__qualname__ = f"{POLICY_LOSS_PREFIX}{loss_mode}"
    fn.__doc__ = f"verl's policy loss {loss_mode!r} by lmloss.rl.policy_loss (see policy_loss_fn)."
    return fn


def register_policy_losses(prefix: str = POLICY_LOSS_PREFIX) -> list[str]:
    """Register `policy_loss_fn` of each of `VERL_LOSS_MODES` in verl's ``POLICY_LOSS_REGISTRY`` as
    ``prefix + mode``; returns the names. Importing this module does it with the default prefix, so
    ``actor_rollout_ref.actor.policy_loss.loss_mode=lmloss_gspo`` selects lmloss's GSPO in verl.

    Raises:
        ValueError: `prefix` is empty or a name is taken by a function that is not lmloss's (verl's own
            entries are never replaced).
    """
    if not prefix:
        raise ValueError("prefix must be non-empty: verl's own policy losses are not replaced")
    registry = _verl_core_algos.POLICY_LOSS_REGISTRY
    names = [prefix + mode for mode in VERL_LOSS_MODES]
    for name in names:
        taken = registry.get(name)
        if taken is not None and getattr(taken, "__module__", None) != __name__:
            raise ValueError(
                f"verl's POLICY_LOSS_REGISTRY already has {name!r} ({taken!r}); choose another prefix"
            )
    for name, mode in zip(names, VERL_LOSS_MODES):
        registry[name] = policy_loss_fn(mode)
    return names


# ----------------------------------------------------------------------------------------- installation

#: Where verl 0.9.1's ``apply_monkey_patch`` looks for TRL's value-head model class (whose ``state_dict`` it
#: patches whenever TRL is installed): TRL 1.16 has it in neither place.
_TRL_VALUE_HEAD = (("trl", "AutoModelForCausalLMWithValueHead"), ("trl.experimental.ppo", "AutoModelForCausalLMWithValueHead"))


def _trl_has_value_head() -> bool:
    for module, name in _TRL_VALUE_HEAD:
        try:
            with warnings.catch_warnings():  # TRL warns on any import from trl.experimental
                warnings.simplefilter("ignore")
                if hasattr(importlib.import_module(module), name):
                    return True
        except ImportError:
            continue
    return False


def _is_trl_available() -> bool:
    """verl's ``is_trl_available`` as its ``apply_monkey_patch`` asks it (its only use in that module): TRL is
    installed *and* has the value-head class verl then patches. With TRL 1.16 (which removed the class: no model
    of it can exist, so there is nothing to patch) verl skips that step instead of failing with ``ImportError:
    cannot import name 'AutoModelForCausalLMWithValueHead' from 'trl'``; so the ``verl`` and ``trl`` extras share
    one environment. With a TRL that has the class, verl's patch runs as written."""
    return _VERL_IS_TRL_AVAILABLE() and _trl_has_value_head()


_VERL_IS_TRL_AVAILABLE = getattr(
    _verl_monkey_patch.is_trl_available, "__wrapped_verl__", _verl_monkey_patch.is_trl_available
)
_is_trl_available.__wrapped_verl__ = _VERL_IS_TRL_AVAILABLE  # type: ignore[attr-defined]
_verl_monkey_patch.is_trl_available = _is_trl_available

_VERL_PATCH_FORWARD_WITH_BACKENDS = getattr(
    _verl_monkey_patch.patch_forward_with_backends,
    "__wrapped_verl__",
    _verl_monkey_patch.patch_forward_with_backends,
)
_patch_forward_with_backends.__wrapped_verl__ = _VERL_PATCH_FORWARD_WITH_BACKENDS  # type: ignore[attr-defined]
_verl_monkey_patch.patch_forward_with_backends = _patch_forward_with_backends
_verl_torch_functional.FusedLinearForPPO = FusedLinearForPPO
register_policy_losses()
_hook_engine()
