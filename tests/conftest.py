"""Fixtures shared across test modules."""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET when it is first imported: set it before any test module can import triton, so
# the Triton kernels run on the CPU interpreter here (export TRITON_INTERPRET=0 to run them on a GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Chunked ops are many small kernels: on a shared 2-core machine one intra-op thread is several times
    faster than two (no OpenMP barrier spinning). Use with ``pytestmark = pytest.mark.usefixtures(...)``;
    restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
