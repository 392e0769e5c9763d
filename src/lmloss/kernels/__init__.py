"""Per-chunk softmax math, implemented twice with one contract: ``torch_ref`` (PyTorch, any device;
the ground truth) and ``triton_kernels`` (CUDA; imported only when the Triton implementation is selected).

Placeholder on the ``triton`` branch: the lead owns this module and replaces it on merge.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ChunkMath:
    vocab_start: int  # global vocabulary id of local column 0
    valid: int  # leading local columns that are real vocabulary (0 <= valid <= V_local); the rest are padding
    scale: float  # 1 / temperature
    softcap: float  # 0.0 = none; else the logit is first mapped x -> softcap * tanh(x / softcap)
