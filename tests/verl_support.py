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
import importlib.metadata
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
