"""The per-chunk softmax math, in two implementations with one contract.

Everything above this package (the plan, the chunk loop, the TP combine) is the same for both; only these
functions differ. ``impl="torch"`` is the PyTorch reference (any device; the ground truth in tests);
``impl="triton"`` runs Triton kernels (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

The contract, for one chunk ``x [c, V_local]`` (fp32 / bf16 / fp16; ``x.stride(1) == 1``) with global
labels ``[c]`` (int64, or None). For a valid column ``j < valid`` write
``y_j = scale * softcap(x_j)``, where ``softcap(x) = cap * tanh(x / cap)`` (the identity when cap is 0),
computed in fp32. Padded columns (``j >= valid``) take no part in anything and get a zero gradient.

``softmax_partials(x, labels, math, *, entropy, target, sum_logits) -> [c, 5]`` fp32, per row, relative
to this shard only (combined over the TP group afterwards by `lmloss.vocab_parallel.combine_partials`):

    0: m = max_j y_j            (-inf when the shard has no valid column)
    1: s = sum_j exp(y_j - m)
    2: t = sum_j exp(y_j - m) * (y_j - m)    if entropy, else 0 (a column with exp(...) == 0 adds 0)
    3: y_label (label owned by this shard)  if target, else 0 (also 0 when not owned or ignored)
    4: sum_j y_j                            if sum_logits, else 0

``softmax_grad_(x, labels, lse, entropy, coef, math, out) -> out`` writes ``d/dx`` of the chunk's outputs
into `out` (any float dtype; `out` may be `x` itself), from the per-row coefficients ``coef [c, 4]`` fp32
``(a, b, c, d)``, with ``logp_j = y_j - lse`` and ``p_j = exp(logp_j)``:

    g_j = a * p_j + d * p_j * (logp_j + H) + b * [j == label] + c,   then times dy/dx (scale, softcap)

where a term whose coefficient is 0 adds exactly 0, ``p * (logp + H)`` is 0 where ``p == 0``, and a row
whose coefficients are all 0 gets exactly 0 whatever its logits (NaN, inf). `entropy` ``[c]`` (``H``) is
None when no row has ``d != 0``.

``partials_then_grad_(x, labels, math, flags, finish, out) -> (result, out)``: the two in one visit of the
chunk, with ``finish(partials) -> (result, coef, lse)`` or ``(result, coef, lse, entropy)`` in between (the
TP combine and the output math; the coefficients may depend on the chunk's own outputs, as an RL
objective's do). `finish` returns ``entropy`` when ``coef`` has a ``d`` term (then ``flags["entropy"]``
is set).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

IMPLS = ("auto", "torch", "triton")


@dataclasses.dataclass(frozen=True)
class ChunkMath:
    """What the per-chunk kernels need to know of the plan.

    vocab_start: global vocabulary id of local column 0.
    valid: leading local columns that are real vocabulary (the rest are padding).
    scale: ``1 / temperature``.
    softcap: 0.0 for none; else each logit is first mapped to ``softcap * tanh(x / softcap)``.
    """

    vocab_start: int
    valid: int
    scale: float = 1.0
    softcap: float = 0.0


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the per-chunk math and the per-token outputs use: float64 for float64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(impl: str, device: torch.device, dtype: torch.dtype) -> str:
    """``"auto"`` -> ``"triton"`` for CUDA tensors when triton imports (and the dtype is not float64), else
    ``"torch"``. An explicit ``"triton"`` without triton, or with float64, raises naming `impl`."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        use_triton = device.type == "cuda" and dtype != torch.float64 and triton_available()
        return "triton" if use_triton else "torch"
    if impl == "triton":
        if not triton_available():
            raise ValueError('impl="triton" needs the triton package (pip install triton); use impl="torch"')
        if dtype == torch.float64:
            raise ValueError('impl="triton" computes in fp32; float64 inputs need impl="torch" (or "auto")')
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f'impl="triton" runs on CUDA tensors (got {device.type}), or on CPU ones under Triton\'s '
                'interpreter (TRITON_INTERPRET=1 before triton is imported); use impl="torch" or "auto"'
            )
    return impl


def make_kernels(impl: str, max_rows: int, cols: int, device: torch.device):
    """The kernels object for one pass over the chunks (it may hold chunk-sized scratch buffers)."""
    if impl == "triton":
        from lmloss.kernels.triton_kernels import TritonKernels

        return TritonKernels()
    from lmloss.kernels.torch_ref import TorchKernels

    return TorchKernels(max_rows, cols, device)
