"""verl's own actor-loss code, for the parity tests: `load()` imports ``verl.trainer.ppo.core_algos``.

verl 0.9.1 is installed *without* its dependencies (``make venv``: its requirements pull ``ray[default]``,
a transformers older than this venv's, wandb, peft, hydra...), plus the few packages its loss modules
import (tensordict, omegaconf, codetiming; see the Makefile). The only module left out is ``ray``: verl's
worker classes import it at module level (``verl.workers.config`` -> ``verl.utils.profiler`` ->
``verl.single_controller``; ``verl.protocol``) and name ``ray.ObjectRef`` in annotations, but no loss
function calls it. Where ray is not installed, a stub stands in during the import: a module whose
attributes are a class that raises when instantiated. It is removed from ``sys.modules`` afterwards, so
other code (transformers' ``is_ray_available``...) still sees ray as absent. verl's ``import`` also calls
``logging.basicConfig``; the root logger's handlers and level are restored after it.

The functions compared are verl's: ``POLICY_LOSS_REGISTRY[...]``, ``agg_loss``, ``kl_penalty``,
``compute_policy_loss_bypass_mode``, ``rollout_corr_helper.compute_rollout_correction_weights``; for the model
patch (`load_model_patch`), ``apply_monkey_patch``, ``dense_common.forward_with_torch_backend`` and the
unfused path's ``logprobs_from_logits`` / ``entropy_from_logits``, with `lmloss.integrations.verl` imported
the same way (it imports verl).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import sys
import types
from types import SimpleNamespace

import pytest

VERL_VERSION = "0.9.1"


class _RayIsNotInstalled:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("ray is not installed: this is the import stub of tests/verl_support.py")


def _ray_stub() -> types.ModuleType:
    stub = types.ModuleType("ray")

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _RayIsNotInstalled

    stub.__getattr__ = __getattr__
    return stub


_LOADED: SimpleNamespace | None = None


@contextlib.contextmanager
def _ray_importable():
    """The ray stub in ``sys.modules`` where ray is not installed (removed afterwards), and the root logger's
    handlers and level restored after verl's ``logging.basicConfig``."""
    stubbed = False
    try:
        import ray  # noqa: F401
    except ImportError:
        sys.modules["ray"] = _ray_stub()
        stubbed = True
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        if stubbed:
            del sys.modules["ray"]


def load() -> SimpleNamespace:
    """verl's modules (``core_algos``, ``rollout_corr_helper``) and config classes; skips the calling test
    module when verl is not installed (``make venv`` installs it)."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    try:
        version = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"verl is not installed (make venv installs verl=={VERL_VERSION} without its dependencies)",
                    allow_module_level=True)  # fmt: skip
    with _ray_importable():
        from verl.trainer.config import RolloutCorrectionConfig
        from verl.trainer.ppo import core_algos, rollout_corr_helper
        from verl.workers.config import ActorConfig, PolicyLossConfig
    _LOADED = SimpleNamespace(
        version=version, core_algos=core_algos, rollout_corr_helper=rollout_corr_helper, ActorConfig=ActorConfig,
        PolicyLossConfig=PolicyLossConfig, RolloutCorrectionConfig=RolloutCorrectionConfig,
    )  # fmt: skip
    return _LOADED


def actor_config(
    verl: SimpleNamespace, *, loss_mode: str = "vanilla", policy_loss: dict | None = None, **actor
):
    """An ``ActorConfig`` (the fields verl's loss functions read), ``actor_rollout_ref.actor.*`` names."""
    return verl.ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        policy_loss=verl.PolicyLossConfig(loss_mode=loss_mode, **(policy_loss or {})), **actor,
    )  # fmt: skip


def load_model_patch() -> SimpleNamespace:
    """verl's model patch (``monkey_patch``, ``dense_common``, ``verl.utils.torch_functional``) and
    `lmloss.integrations.verl`, imported under the stub; skips like `load`."""
    load()
    with _ray_importable():
        from verl.models.transformers import dense_common, monkey_patch
        from verl.utils import torch_functional

        import lmloss.integrations.verl as integration
    return SimpleNamespace(
        monkey_patch=monkey_patch, dense_common=dense_common, torch_functional=torch_functional,
        integration=integration,
    )  # fmt: skip


class _PeftStub(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})  # a class verl's engine names in imports and annotations, never calls here


class _PeftStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "peft" or name.startswith("peft."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _PeftStub(spec.name)

    def exec_module(self, module):
        module.__path__ = []


@contextlib.contextmanager
def _peft_importable():
    """peft stubbed during the import where it is not installed (verl's FSDP engine imports it at module level
    for LoRA checkpoints; ``make venv`` does not install it); the stub modules are removed afterwards."""
    if importlib.util.find_spec("peft") is not None:
        yield
        return
    finder = _PeftStubFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "peft" or n.startswith("peft.")]:
            del sys.modules[name]


def load_engine() -> SimpleNamespace:
    """verl's FSDP LM engine module (``verl.workers.engine.fsdp.transformer_impl``), its micro-batch layout
    (``verl.workers.utils.padding``, ``tensordict_utils``), and `lmloss.integrations.verl` hooked into it;
    imported under the ray and peft stubs. Skips like `load`."""
    import warnings

    patching = load_model_patch()
    # verl's engine package imports every other engine it can (megatron-core's is seconds): not needed here
    others = [f"verl.workers.engine.{e}" for e in ("torchtitan", "veomni", "automodel", "mindspeed", "megatron")]
    absent = {name: sys.modules.get(name) for name in others}
    with _ray_importable(), _peft_importable(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sys.modules.update(dict.fromkeys(others))  # None: "import fails", which verl's package catches
        try:
            from verl.utils import tensordict_utils
            from verl.workers.engine.fsdp import transformer_impl
            from verl.workers.utils import padding
        finally:
            for name, module in absent.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
    patching.integration._hook_engine()  # what apply_monkey_patch does first in a worker
    return SimpleNamespace(transformer_impl=transformer_impl, padding=padding, tu=tensordict_utils)


def cpu_engine(engine_module, model, *, forward_only: bool):
    """A ``FSDPEngineWithLMHead`` holding `model` as verl's engine holds its FSDP module, without the FSDP
    set-up (one process, CPU): the attributes its ``forward_step`` reads. ``forward_only``: a reference's."""
    import torch

    engine = object.__new__(engine_module.FSDPEngineWithLMHead)
    engine.__dict__.update(
        module=model, engine_config=SimpleNamespace(forward_only=forward_only), use_ulysses_sp=False,
        pad_to_length=False, _autocast_dtype=torch.float32,
    )  # fmt: skip
    return engine
