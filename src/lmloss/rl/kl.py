"""The exact KL to a reference policy over the whole vocabulary, per token, from logits.

``kl_loss_type="full"``: verl's ``kl_penalty(..., "full")`` raises ``NotImplementedError``; the estimators
k1 / k2 / k3 see only the sampled token. The exact ``KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log
pi_ref(v))`` needs both distributions at every token: a loss-end operation, which the two-distribution
objective of `lmloss.distill` computes chunk by chunk without a second ``[tokens, vocab]`` tensor (the
reference's chunks are read, its softmax statistics combined with the policy's in the same collectives).
`linear_policy_loss` computes it from both heads itself (``ref_hidden=``, ``ref_weight=``), its gradient
formed in the forward with the policy term.
"""

from __future__ import annotations

import torch

from lmloss.distill import distillation_loss
from lmloss.vocab_parallel import ProcessGroup


def full_kl(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_size: int | str | None = "auto",
    impl: str = "auto",
) -> torch.Tensor:
    """Per-token ``KL(pi || pi_ref)`` of ``pi = softmax(softcap(logits) / T)`` and ``pi_ref`` likewise of
    `ref_logits` (the reference model has the policy's head transform), over the valid global vocabulary.

    Args:
        logits: ``[..., V_local]`` the policy's (this rank's shard under TP); receives the gradient.
        ref_logits: the same shape, the reference's; detached.
        labels: ``[...]`` or None, compared with `ignore_index` only: those tokens give exactly 0.
        Others as in `lmloss.token_logprobs`.

    Returns:
        fp32 ``[...]`` (fp64 for fp64 logits), differentiable; feed it to
        ``policy_loss(..., kl_loss_type="full", kl=...)``. It is `lmloss.distillation_loss` with
        ``beta=1`` (the reverse KL from the student, here the policy) and ``reduction="none"``.
    """
    return distillation_loss(
        logits, ref_logits, labels, beta=1.0, temperature=temperature, reduction="none", ignore_index=ignore_index,
        tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size, chunk_size=chunk_size, impl=impl,
        softcap=softcap, teacher_softcap=softcap,
    )  # fmt: skip
