"""lmloss: per-token log-probs, entropy and cross-entropy for huge vocabularies, at the lowest peak memory."""

from lmloss.logits import cross_entropy, token_entropy, token_logprobs

__all__ = ["cross_entropy", "token_entropy", "token_logprobs"]
__version__ = "0.1.0"
