"""MemoryProfiler on 2 gloo ranks (CPU): one report per rank, named by its global rank and coordinates.

One run hosts both checks: every rank profiles step 1 of steps 0..2 into ``all/`` with its data
parallel coordinate from a dict, and step 1 into ``only1/`` under ``ranks=(1,)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from dist_utils import run_ranks

from lmloss.profiling import MemoryProfiler, MemoryProfilerConfig


def _profile_on_rank(rank: int, world_size: int, out: str) -> list:
    every = MemoryProfiler(
        MemoryProfilerConfig(profile_steps=(1,)),
        Path(out) / "all",
        coords={"dp": rank, "tp": 0},
        device="cpu",
    )
    only1 = MemoryProfiler(
        MemoryProfilerConfig(profile_steps=(1,), ranks=(1,)), Path(out) / "only1", device="cpu"
    )
    written = []
    for step in range(3):
        with every.step(step) as a, only1.step(step) as b:
            w = torch.randn(128, 128, requires_grad=True)
            (w @ w).sum().backward()
            torch.distributed.all_reduce(w.grad)
        written.append((step, None if a is None else a.name, None if b is None else b.name))
    return written


def test_each_rank_writes_its_own_report_only_for_profiled_steps_and_ranks(tmp_path):
    results = run_ranks(_profile_on_rank, 2, str(tmp_path))
    assert results[0] == [(0, None, None), (1, "rank0_pp0_dp0_cp0_tp0.json", None), (2, None, None)]
    assert results[1] == [
        (0, None, None),
        (1, "rank1_pp0_dp1_cp0_tp0.json", "rank1_pp0_dp0_cp0_tp0.json"),
        (2, None, None),
    ]
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json"))
    assert files == [
        "all/step_1/rank0_pp0_dp0_cp0_tp0.json",
        "all/step_1/rank1_pp0_dp1_cp0_tp0.json",
        "only1/step_1/rank1_pp0_dp0_cp0_tp0.json",
    ]
    for f in files:
        report = json.loads((tmp_path / f).read_text())
        assert report["rank"] == int(f.split("/rank")[1][0])
        assert report["peak_bytes"] >= 128 * 128 * 4
