"""Preference optimization losses (DPO and its family, KTO, ORPO, CPO) as functions of per-sequence sums.

`PreferenceSpec` (`lmloss.preference.spec`) holds a loss's options, validated once; `lmloss.preference.losses`
turns per-token log-probs into per-sequence sums (`sequence_stats`) and those into the loss and TRL's
metrics (`preference_loss`); `lmloss.preference.fused.linear_preference_loss` makes the sums from the fused LM
head (policy and reference heads in one token-chunked pass) and differentiates the loss back to every token.
docs/preference.md has the formulas and examples.
"""

from lmloss.preference.fused import PAIR_LAYOUTS, linear_preference_loss
from lmloss.preference.losses import (
    PreferenceOutput,
    SequenceStats,
    kto_kl,
    per_token_weights,
    preference_loss,
    preference_loss_from_logprobs,
    sequence_stats,
)
from lmloss.preference.spec import PreferenceSpec

__all__ = [
    "PAIR_LAYOUTS",
    "PreferenceOutput",
    "PreferenceSpec",
    "SequenceStats",
    "kto_kl",
    "linear_preference_loss",
    "per_token_weights",
    "preference_loss",
    "preference_loss_from_logprobs",
    "sequence_stats",
]
