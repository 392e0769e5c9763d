"""Preference optimization losses (DPO and its family, KTO, ORPO, CPO) as functions of per-sequence sums.

`PreferenceSpec` (`lmloss.preference.spec`) holds a loss's options, validated once; `lmloss.preference.losses`
turns per-token log-probs into per-sequence sums (`sequence_stats`) and those into the loss and TRL's
metrics (`preference_loss`). docs/preference.md has the formulas and examples.
"""

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
    "PreferenceOutput",
    "PreferenceSpec",
    "SequenceStats",
    "kto_kl",
    "per_token_weights",
    "preference_loss",
    "preference_loss_from_logprobs",
    "sequence_stats",
]
