"""lmloss: per-token log-probs, entropy and cross-entropy for huge vocabularies, at the lowest peak memory."""

from lmloss import cp, distributed, metrics, packing, rl
from lmloss.distributed import broadcast_batch, pipeline_stage_keys
from lmloss.fused import linear_cross_entropy, linear_token_logprobs
from lmloss.logits import cross_entropy, token_entropy, token_logprobs
from lmloss.metrics import StatsTracker
from lmloss.packing import PackedBatch, pack, shift_labels

__all__ = [
    "PackedBatch",
    "StatsTracker",
    "broadcast_batch",
    "cp",
    "cross_entropy",
    "distributed",
    "linear_cross_entropy",
    "linear_token_logprobs",
    "metrics",
    "pack",
    "packing",
    "pipeline_stage_keys",
    "rl",
    "shift_labels",
    "token_entropy",
    "token_logprobs",
]
__version__ = "0.1.0"
