"""`lmloss.preference` over 2 gloo ranks, in one run: data-parallel metrics and KTO's KL against one process
holding the whole batch, a context-parallel split of every sequence against the unsplit loss and gradient,
and the rank agreement (a spec or a field that differs, a check failed on one rank: every rank raises)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from lmloss.agreement import RankAgreementError
from lmloss.preference import (
    PreferenceSpec,
    per_token_weights,
    preference_loss,
    preference_loss_from_logprobs,
    sequence_stats,
)

WORLD = 2


def _batch(seed=0, b=4, t=8):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(2 * b, t, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(2 * b, t, generator=g, dtype=torch.float64) * 3
    entropy = torch.rand(2 * b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(2 * b, t, generator=g) < 0.7
    mask[:, 0] = False
    return logps, ref, entropy, mask


def _rows_of(rank: int, n: int) -> torch.Tensor:
    """This DP rank's pairs: rank r holds pairs r*n/2 .. of each half (chosen and rejected rows alike)."""
    half = n // 2
    pairs = torch.arange(rank * half // WORLD, (rank + 1) * half // WORLD)
    return torch.cat([pairs, pairs + half])


def _outcome(fn):
    try:
        fn()
        return "ok"
    except RankAgreementError as e:
        return f"RankAgreementError: {e}"


def worker(rank, world):
    group = dist.group.WORLD
    out = {}
    logps, ref, entropy, mask = _batch()
    spec = PreferenceSpec(loss_type=("sigmoid", "sft"), beta=0.3)
    rows = _rows_of(rank, logps.shape[0])
    # DP: each rank its pairs; the metrics over every rank's sequences
    dp = preference_loss_from_logprobs(logps[rows], mask[rows], spec, ref_token_logps=ref[rows], entropy=entropy[rows],
                                       group=group)  # fmt: skip
    out["dp_metrics"] = {k: v.item() for k, v in dp.metrics.items()}
    out["dp_loss"] = dp.loss.item()
    # KTO: the KL is the mean of the ranks' means
    kto = PreferenceSpec(family="kto", beta=0.5)
    desirable = torch.tensor([True, False, True, True, False, True, True, False])
    kl_stats = sequence_stats(logps[rows].flip(0), mask[rows], kto, ref_token_logps=logps[rows].flip(0) - rank - 0.5)
    k = preference_loss_from_logprobs(logps[rows], mask[rows], kto, ref_token_logps=ref[rows] - 1,
                                      desirable=desirable[rows], kl_stats=kl_stats, group=group)  # fmt: skip
    out["kto_kl"] = k.metrics["kl"].item()
    out["kto_local_kl"] = (kl_stats.logps - kl_stats.ref_logps).mean().item()
    # CP: every sequence's positions split between the ranks (rank 0 the first half of the columns)
    cols = slice(0, 4) if rank == 0 else slice(4, None)
    local = logps[:, cols].clone().requires_grad_(True)
    ld = PreferenceSpec(loss_type=("ipo", "sft"), ld_alpha=0.5)
    w = per_token_weights(mask, ld, dtype=torch.float64)[:, cols]  # on whole sequences, before the split
    stats = sequence_stats(local, mask[:, cols], ld, ref_token_logps=ref[:, cols], token_weights=w, cp_group=group)
    cp = preference_loss(stats, ld)
    cp.loss.backward()
    out["cp_loss"], out["cp_grad"], out["cp_cols"] = cp.loss.item(), local.grad, cols
    try:
        sequence_stats(local, mask[:, cols], ld, ref_token_logps=ref[:, cols], cp_group=group)
        out["cp_ld_without_weights"] = "ok"
    except ValueError as e:
        out["cp_ld_without_weights"] = str(e)
    # the agreement: every rank raises alike
    stats = sequence_stats(logps[rows], mask[rows], spec, ref_token_logps=ref[rows])
    scenarios = {
        "beta": lambda: preference_loss(stats, PreferenceSpec(beta=[0.1, 0.2][rank]), group=group),
        "missing_ref_on_one_rank": lambda: preference_loss(
            sequence_stats(logps[rows], mask[rows], spec, ref_token_logps=[ref[rows], None][rank]), spec, group=group
        ),
        "entropy_on_one_rank": lambda: preference_loss(
            sequence_stats(logps[rows], mask[rows], spec, ref_token_logps=ref[rows], entropy=[entropy[rows], None][rank]),
            spec, group=group,
        ),
        "cp_sequences": lambda: sequence_stats(local.detach()[: [8, 6][rank]], mask[: [8, 6][rank], cols], spec,
                                               ref_token_logps=ref[: [8, 6][rank], cols], cp_group=group),
        "cp_bad_mask_on_one_rank": lambda: sequence_stats(local.detach(), [mask[:, cols], mask][rank], spec,
                                                          ref_token_logps=ref[:, cols], cp_group=group),
        "spec_type_on_one_rank": lambda: preference_loss(stats, [spec, {"family": "dpo"}][rank], group=group),
        "after_the_errors": lambda: preference_loss(stats, spec, group=group),
    }  # fmt: skip
    out["agreement"] = {name: _outcome(fn) for name, fn in scenarios.items()}
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(worker, WORLD)


def test_dp_metrics_are_the_whole_batch_ones_and_the_loss_each_ranks_own(results):
    logps, ref, entropy, mask = _batch()
    spec = PreferenceSpec(loss_type=("sigmoid", "sft"), beta=0.3)
    whole = preference_loss_from_logprobs(logps, mask, spec, ref_token_logps=ref, entropy=entropy)
    for rank, r in enumerate(results):
        assert r["dp_metrics"].keys() == whole.metrics.keys()
        for name, value in whole.metrics.items():
            assert r["dp_metrics"][name] == pytest.approx(value.item(), rel=1e-12), name
        rows = _rows_of(rank, logps.shape[0])
        own = preference_loss_from_logprobs(logps[rows], mask[rows], spec, ref_token_logps=ref[rows])
        assert r["dp_loss"] == pytest.approx(own.loss.item(), rel=1e-14)
    mean_of_means = sum(r["kto_local_kl"] for r in results) / WORLD
    assert mean_of_means > 0
    assert all(r["kto_kl"] == pytest.approx(mean_of_means, rel=1e-14) for r in results)


def test_cp_split_sequences_sum_to_the_unsplit_loss_and_gradient(results):
    logps, ref, _, mask = _batch()
    ld = PreferenceSpec(loss_type=("ipo", "sft"), ld_alpha=0.5)
    whole = logps.clone().requires_grad_(True)
    loss = preference_loss(sequence_stats(whole, mask, ld, ref_token_logps=ref), ld).loss
    loss.backward()
    assert sum(r["cp_loss"] for r in results) == pytest.approx(loss.item(), rel=1e-14)
    for r in results:
        torch.testing.assert_close(r["cp_grad"], whole.grad[:, r["cp_cols"]], rtol=1e-14, atol=1e-16)
        assert "per_token_weights" in r["cp_ld_without_weights"]


def test_ranks_agree_or_raise_alike(results):
    a, b = (r["agreement"] for r in results)
    assert a == b  # every rank raised the same error, or none did
    assert a["after_the_errors"] == "ok"
    assert "beta" in a["beta"] and "rank 0" in a["beta"]
    assert "ref_logps" in a["missing_ref_on_one_rank"]
    assert a["entropy_on_one_rank"].startswith("RankAgreementError") and "fields" in a["entropy_on_one_rank"]
    assert "n_seq" in a["cp_sequences"]
    assert "PreferenceSpec" in a["spec_type_on_one_rank"]
    assert "rank 1" in a["cp_bad_mask_on_one_rank"] and "mask must have the shape" in a["cp_bad_mask_on_one_rank"]
