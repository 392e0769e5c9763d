"""The multi-process harness itself (`dist_utils.run_ranks`): a run whose ranks wait for each other fails in
bounded time, naming what happened, instead of blocking the suite (gloo's default timeout is 30 minutes)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks


def _sum_of_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def _rank_0_waits_alone(rank: int, world: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: the collective times out
    else:
        time.sleep(1.5)  # alive (a rank that exited would close the connection instead)


def _rank_1_sleeps(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(60)


def _rank_1_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("an error of rank 1's own")


def test_every_rank_returns_its_result():
    assert run_ranks(_sum_of_ranks, 3) == [6.0, 6.0, 6.0]


def test_a_collective_one_rank_skipped_times_out_and_the_run_names_that_rank():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)rank 0 raised:.*RuntimeError.*imed out"):
        run_ranks(_rank_0_waits_alone, 2, timeout_s=0.5)
    assert time.monotonic() - start < 30


def test_a_run_past_its_deadline_is_killed_and_names_the_ranks_still_running():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[1\] of 2 still running after 0.5 s"):
        run_ranks(_rank_1_sleeps, 2, deadline_s=0.5)
    assert time.monotonic() - start < 30


def test_a_rank_that_raises_is_reported_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 raised:.*ValueError: an error of rank 1's own"):
        run_ranks(_rank_1_raises, 2)
