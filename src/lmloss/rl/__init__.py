"""RL policy losses with verl's names and semantics, aggregation that no batch split can change, and the
objective fused into the LM head.

* `token_weights`: per-token weights of a global loss (verl's ``loss_agg_mode``), counted over the DP group;
* `policy_loss`: the actor's loss on per-token log-probs (every policy loss verl 0.9.1 registers: vanilla
  PPO / dual clip, dppo_tv, dppo_kl, gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, dro, cispo; reinforce; TRL's
  vespo; KL to a reference; entropy bonus; rollout IS weights; a policy-term mask) and its metrics;
* `covariance_selection`: clip_cov / kl_cov's token selection from the global batch's statistics;
  `high_entropy_mask` and `off_policy_sequence_mask`: TRL's ``top_entropy_quantile`` and
  ``off_policy_mask_threshold`` as a ``pg_mask``;
* `linear_policy_loss`: the same from hidden states and the LM-head weight, three matmuls for
  token-separable objectives;
* `truncated_is_weights` / `masked_is_weights`: rollout-correction weights (TIS, MIS / icepop), optionally
  normalized to mean 1 over the global batch; `rejection_mask`: verl's rejection sampling (``rollout_rs``);
* `full_kl`: the exact per-token KL(pi || pi_ref) over the vocabulary (``kl_loss_type="full"``).

See docs/rl.md for the objectives x frameworks table (verl, TRL, ...) and the normalisation convention.
"""

from lmloss.rl.aggregation import LOSS_AGG_MODES, token_weights
from lmloss.rl.fused import linear_policy_loss
from lmloss.rl.kl import full_kl
from lmloss.rl.objectives import (
    KL_LOSS_TYPES,
    LOSS_MODES,
    covariance_selection,
    high_entropy_mask,
    kl_estimate,
    off_policy_sequence_mask,
    policy_loss,
)
from lmloss.rl.rollout import REJECTION_CRITERIA, masked_is_weights, rejection_mask, truncated_is_weights

__all__ = [
    "KL_LOSS_TYPES",
    "LOSS_AGG_MODES",
    "LOSS_MODES",
    "REJECTION_CRITERIA",
    "covariance_selection",
    "full_kl",
    "high_entropy_mask",
    "kl_estimate",
    "linear_policy_loss",
    "masked_is_weights",
    "off_policy_sequence_mask",
    "policy_loss",
    "rejection_mask",
    "token_weights",
    "truncated_is_weights",
]
