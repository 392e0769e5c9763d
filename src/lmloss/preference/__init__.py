"""Preference optimization (DPO and its family) from the fused LM head: `linear_preference_loss`, a sequence
objective (`lmloss.sequences`) of the per-sequence sums of the policy's and a reference's log-probs."""

from lmloss.preference.fused import PAIR_LAYOUTS, SequenceStats, linear_preference_loss

__all__ = ["PAIR_LAYOUTS", "SequenceStats", "linear_preference_loss"]
