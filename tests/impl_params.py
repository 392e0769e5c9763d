"""Parameters shared by the tests that run both implementations (imported by test modules)."""

from __future__ import annotations

import pytest
import torch

from lmloss.kernels import triton_available

IMPLS = [
    "torch",
    pytest.param(
        "triton", marks=pytest.mark.skipif(not triton_available(), reason="triton is not installed")
    ),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
