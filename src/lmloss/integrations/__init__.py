"""Adapters from lmloss's public ops to the stacks people train with.

* `lmloss.integrations.hf`: `patch(model)` makes a Hugging Face ``*ForCausalLM`` compute its loss with the
  fused LM head (no logits), and `token_logprobs(model, ...)` scores tokens for RL without logits.
* `lmloss.integrations.megatron`: a drop-in for Megatron-core's ``vocab_parallel_cross_entropy``, a fused
  loss for the last pipeline stage, and ``PackedSeqParams`` from an `lmloss.packing.PackedBatch`.
* `lmloss.integrations.trl`: `patch(trainer)` makes a ``trl.GRPOTrainer`` compute its per-token log-probs
  and entropies with the fused head (through `hf.token_logprobs`).
* `lmloss.integrations.verl` (imported on its own, not by this package: importing it imports verl and is
  what adopts lmloss in verl's workers, through ``external_lib``): lmloss as the ``fused_kernels_backend``
  of verl's ``apply_monkey_patch``, and verl's policy losses with verl's signature.

None of `transformers`, `trl` or `megatron-core` is imported until a function that needs it is called, so
``import lmloss.integrations.hf`` works without them. Only the public ops are used here.
"""

from lmloss.integrations import hf, megatron, trl

__all__ = ["hf", "megatron", "trl"]
