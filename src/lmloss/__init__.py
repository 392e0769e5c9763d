"""lmloss: per-token log-probs, entropy and cross-entropy for huge vocabularies, at the lowest peak memory."""

import warnings as _warnings

with _warnings.catch_warnings():
    # Without numpy (the core install has none), torch warns "Failed to initialize NumPy" when imported. lmloss
    # never uses numpy, so where lmloss is what imports torch first (the `lmloss` command) that one warning is
    # dropped; nothing changes for a program that imported torch itself. See lmloss.cli.NUMPY_WARNING.
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch as _torch  # noqa: F401

from lmloss import cp, distributed, metrics, packing, preference, rl
from lmloss.agreement import RankAgreementError
from lmloss.distill import distillation_loss, linear_distillation_loss
from lmloss.distributed import broadcast_batch, pipeline_stage_keys
from lmloss.fused import linear_cross_entropy, linear_token_logprobs
from lmloss.logits import cross_entropy, token_entropy, token_logprobs
from lmloss.metrics import StatsTracker
from lmloss.modules import CrossEntropyLoss, LinearCrossEntropyLoss
from lmloss.packing import PackedBatch, pack, shift_labels

__all__ = [
    "CrossEntropyLoss",
    "LinearCrossEntropyLoss",
    "PackedBatch",
    "RankAgreementError",
    "StatsTracker",
    "broadcast_batch",
    "cp",
    "cross_entropy",
    "distillation_loss",
    "distributed",
    "linear_cross_entropy",
    "linear_distillation_loss",
    "linear_token_logprobs",
    "metrics",
    "pack",
    "packing",
    "pipeline_stage_keys",
    "preference",
    "rl",
    "shift_labels",
    "token_entropy",
    "token_logprobs",
]
__version__ = "0.1.0"
