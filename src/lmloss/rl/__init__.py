"""RL policy losses with verl's names and semantics, aggregation that no batch split can change, and the
objective fused into the LM head.

* `token_weights`: per-token weights of a global loss (verl's ``loss_agg_mode``), counted over the DP group;
* `policy_loss`: the actor's loss on per-token log-probs (vanilla PPO / dual clip, gspo, cispo,
  reinforce; KL to a reference; entropy bonus; rollout IS weights) and its metrics;
* `linear_policy_loss`: the same from hidden states and the LM-head weight, three matmuls for
  token-separable objectives;
* `truncated_is_weights` / `masked_is_weights`: rollout-correction weights (TIS, MIS / icepop).

See docs/rl.md for the name map to verl / TRL / SkyRL and the normalisation convention.
"""

from lmloss.rl.aggregation import LOSS_AGG_MODES, token_weights
from lmloss.rl.fused import linear_policy_loss
from lmloss.rl.objectives import KL_LOSS_TYPES, LOSS_MODES, kl_estimate, policy_loss
from lmloss.rl.rollout import masked_is_weights, truncated_is_weights

__all__ = [
    "KL_LOSS_TYPES",
    "LOSS_AGG_MODES",
    "LOSS_MODES",
    "kl_estimate",
    "linear_policy_loss",
    "masked_is_weights",
    "policy_loss",
    "token_weights",
    "truncated_is_weights",
]
