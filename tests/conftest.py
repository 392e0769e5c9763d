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


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory):
    """`lmloss sft` command-line tests (tests/sft_support.py): every run of the module on 300 records of the
    embedded task set (tokenizing all 3,000 costs each run half a second), without drawing loss.png
    (matplotlib: most of a short run's time)."""
    from lmloss.sft import report, tasks
    from sft_support import SMALL_DATA

    path = tmp_path_factory.mktemp("data") / "tasks.jsonl"
    tasks.write_jsonl(tasks.generate(300), path)
    patch = pytest.MonkeyPatch()
    patch.setattr(report, "plot_loss", lambda *args: None)
    SMALL_DATA[:] = ["--data", str(path)]
    yield
    SMALL_DATA.clear()
    patch.undo()
