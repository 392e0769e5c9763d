"""StatsTracker on one process (group None); CP / DP reductions are checked in tests/distributed."""

from __future__ import annotations

import math

import pytest
import torch

from lmloss.metrics import StatsTracker


def test_stat_is_the_mean_over_the_denominator_mask_accumulated_over_calls():
    t = StatsTracker()
    t.denominator("n_valid_tokens", torch.tensor([True, False, True]))
    t.stat("loss", torch.tensor([1.0, float("nan"), 3.0]), denominator="n_valid_tokens")  # NaN is masked out
    t.denominator("n_valid_tokens", torch.tensor([False, True]))
    t.stat("loss", torch.tensor([100.0, 8.0]), denominator="n_valid_tokens")  # uses the latest mask
    out = t.export()
    assert out == {"loss": (1.0 + 3.0 + 8.0) / 3, "n_valid_tokens": 3.0}


def test_scalars_reduce_by_sum_mean_max_and_min():
    t = StatsTracker()
    for v in (2.0, torch.tensor(6.0), torch.tensor([4.0])):
        t.scalar("s", v, reduce="sum")
        t.scalar("m", v)
        t.scalar("hi", v, reduce="max")
        t.scalar("lo", v, reduce="min")
    assert t.export() == {"hi": 6.0, "lo": 2.0, "m": 4.0, "s": 12.0}


def test_perplexity_is_the_mean_over_sequences_of_exp_minus_mean_logprob():
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.1, -0.2], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False, False, True])
    seq = torch.tensor([0, 0, 1, 1, 2, 2])
    t = StatsTracker()
    # sequence 3 has no token
    t.perplexity("ppl", logprobs, mask=mask, sequence_ids=seq, num_sequences=4, count_key="n_seq")
    expected = (math.exp(1.5) + math.exp(0.5) + math.exp(0.2)) / 3
    out = t.export()
    assert out["ppl"] == pytest.approx(expected, rel=1e-12)
    assert out["n_seq"] == 3.0


def test_perplexity_over_micro_batches_adds_sequences():
    t = StatsTracker()
    t.perplexity(
        "ppl",
        torch.tensor([-1.0]),
        mask=torch.tensor([True]),
        sequence_ids=torch.tensor([0]),
        num_sequences=1,
    )
    t.perplexity(
        "ppl",
        torch.tensor([-3.0]),
        mask=torch.tensor([True]),
        sequence_ids=torch.tensor([0]),
        num_sequences=1,
    )
    assert t.export()["ppl"] == pytest.approx((math.e + math.exp(3.0)) / 2, rel=1e-12)


def test_empty_means_export_nan_and_counts_export_zero():
    t = StatsTracker()
    t.denominator("n", torch.zeros(3, dtype=torch.bool))
    t.stat("loss", torch.ones(3), denominator="n")
    t.perplexity(
        "ppl",
        torch.ones(3),
        mask=torch.zeros(3, dtype=torch.bool),
        sequence_ids=torch.zeros(3),
        num_sequences=1,
    )
    out = t.export()
    assert out["n"] == 0.0 and math.isnan(out["loss"]) and math.isnan(out["ppl"])


def test_export_resets_unless_asked_not_to():
    t = StatsTracker()
    t.scalar("x", 1.0, reduce="sum")
    assert t.export(reset=False) == {"x": 1.0}
    assert t.export() == {"x": 1.0}
    assert t.export() == {}


def test_misuse_raises():
    t = StatsTracker()
    t.denominator("n", torch.ones(2, dtype=torch.bool))
    with pytest.raises(KeyError, match="denominator 'm' is not registered"):
        t.stat("loss", torch.ones(2), denominator="m")
    with pytest.raises(ValueError, match="shape"):
        t.stat("loss", torch.ones(3), denominator="n")
    with pytest.raises(ValueError, match="already recorded as another kind"):
        t.scalar("n", 1.0)
    with pytest.raises(ValueError, match="reduce must be one of"):
        t.scalar("x", 1.0, reduce="median")
    t.scalar("y", 1.0, reduce="sum")
    with pytest.raises(ValueError, match="another reduce"):
        t.scalar("y", 1.0, reduce="max")
    with pytest.raises(ValueError, match="one element"):
        t.scalar("z", torch.ones(2))
    with pytest.raises(ValueError, match="same 1-D shape"):
        t.perplexity(
            "p",
            torch.ones(2),
            mask=torch.ones(3, dtype=torch.bool),
            sequence_ids=torch.zeros(2),
            num_sequences=1,
        )


def test_a_group_that_is_not_a_process_group_raises_a_type_error_naming_it():
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup"):
        StatsTracker(group="dp")
    t = StatsTracker()
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup"):
        t.denominator("n", torch.ones(2, dtype=torch.bool), group="dp")
    with pytest.raises(TypeError, match="cp_group must be a torch.distributed.ProcessGroup"):
        t.perplexity(
            "p", torch.ones(2), mask=torch.ones(2, dtype=torch.bool), sequence_ids=torch.zeros(2, dtype=torch.long),
            num_sequences=1, cp_group="cp",
        )  # fmt: skip
