"""lmloss.rl against verl 0.9.1's own code, float64, relative 1e-7 (values and d/dlogprobs).

verl is imported by tests/verl_support.py (installed without its dependencies; the module is skipped where
verl is not installed). The references are verl's functions called on the same tensors: every loss of
``POLICY_LOSS_REGISTRY`` under every ``loss_agg_mode``, ``agg_loss`` (= `token_weights`), ``kl_penalty``
(every KL name), the rollout-correction weights (batch-normalized too) and rejection masks of
``rollout_corr_helper``, and ``bypass_mode``.
"""

from __future__ import annotations

import math
import random
import unittest.mock

import pytest
import torch

import lmloss
import verl_support
from lmloss.rl import policy_loss, token_weights

verl = verl_support.load()
CA = verl.core_algos
REL = dict(rtol=1e-7, atol=1e-12)
B, T = 4, 7
VERL_AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]

#: lmloss's options of each registered loss: clips asymmetric (a swapped pair changes every loss below),
#: each option away from its default where the math reads it. The same values go into verl's config.
LOSSES = {
    "vanilla": dict(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=3.0),
    "dppo_tv": dict(clip_ratio_low=0.08, clip_ratio_high=0.15, clip_ratio_c=2.5),
    "dppo_kl": dict(clip_ratio_low=0.02, clip_ratio_high=0.06, clip_ratio_c=2.5),
    "gspo": dict(clip_ratio_low=0.05, clip_ratio_high=0.3),
    "sapo": dict(tau_pos=0.9, tau_neg=1.3),
    "gpg": {},
    "clip_cov": dict(
        clip_ratio_low=0.1, clip_ratio_high=0.28, clip_cov_ratio=0.15, clip_cov_lb=0.2, clip_cov_ub=4.0
    ),
    "kl_cov": dict(kl_cov_ratio=0.2, ppo_kl_coef=0.3),
    "geo_mean": dict(clip_ratio_low=0.1, clip_ratio_high=0.28),
    "dro": dict(dro_beta=0.3),
    "cispo": dict(clip_ratio_low=0.2, clip_ratio_high=0.3),
}
ACTOR_FIELDS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg")
#: verl aggregates these policy terms its own way whatever ``loss_agg_mode`` (sapo: seq-mean-token-mean;
#: geo_mean: the mean over rows of sequence losses); lmloss applies the given weights: the mode below is
#: the one that equals verl's (geo_mean: when every row has a valid token).
VERL_FIXED_AGG = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}


def verl_config(loss: str, **over):
    kw = {**LOSSES[loss], **over}
    actor = {k: v for k, v in kw.items() if k in ACTOR_FIELDS}
    if loss == "geo_mean":
        actor.pop("clip_ratio_c", None)
    return verl_support.actor_config(
        verl, loss_mode=loss, policy_loss={k: v for k, v in kw.items() if k not in ACTOR_FIELDS}, **actor
    )


def _batch(seed=0, *, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1
    old = lp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    old[:, 1::3] = lp[:, 1::3] - 1.5  # ratio e^1.5 > 3: the dual clip / the ratio cap bite
    adv[:, 1] = -adv[:, 1].abs()
    old[2] = lp[2] - 0.25  # one sequence far off-policy as a whole (gspo / geo_mean clip it)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 1] = True
    if empty_row:
        mask[0, :] = False  # a sequence without a valid token (not counted by the seq-mean modes)
    mask[1, :2] = True
    return lp, old, adv, mask


def _grad(loss, x):
    return torch.autograd.grad(loss, x)[0]


def _verl_loss(loss, lp, old, adv, mask, agg, cfg, is_w=None):
    value, _ = CA.POLICY_LOSS_REGISTRY[loss](
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=agg, config=cfg,
        rollout_is_weights=is_w,
    )  # fmt: skip
    return value


def test_the_installed_verl_is_the_pinned_release_with_the_registry_covered_here():
    assert verl.version == verl_support.VERL_VERSION
    # bypass_mode is a composition (test_bypass_mode_is_a_composition); every other name is a loss_mode
    # (lmloss.integrations.verl, imported by another test module, adds lmloss_<mode> entries: not verl's)
    verls = {name for name, fn in CA.POLICY_LOSS_REGISTRY.items() if not fn.__module__.startswith("lmloss.")}
    assert verls == set(LOSSES) | {"bypass_mode"}
    assert set(LOSSES) <= set(lmloss.rl.LOSS_MODES)


@pytest.mark.parametrize("agg", VERL_AGG_MODES)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_every_registered_policy_loss_equals_verl_under_every_agg_mode(loss, agg):
    lp, old, adv, mask = _batch(empty_row=loss != "geo_mean")
    lp = lp.requires_grad_(True)
    torch.manual_seed(11)  # clip_cov draws its tokens from torch's global generator, in verl and lmloss alike
    want = _verl_loss(loss, lp, old, adv, mask, agg, verl_config(loss))
    torch.manual_seed(11)
    got, _ = policy_loss(
        lp, old, adv, mask, loss_mode=loss, loss_agg_mode=VERL_FIXED_AGG.get(loss, agg), **LOSSES[loss]
    )
    torch.testing.assert_close(got, want, **REL)
    torch.testing.assert_close(_grad(got, lp), _grad(want, lp), **REL)


@pytest.mark.parametrize("loss", list(LOSSES))
def test_rollout_is_weights_enter_every_loss_as_in_verl(loss):
    lp, old, adv, mask = _batch(1, empty_row=loss != "geo_mean")
    lp = lp.requires_grad_(True)
    is_w = torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 1.5 + 0.25
    agg = VERL_FIXED_AGG.get(loss, "seq-mean-token-sum")
    torch.manual_seed(3)
    want = _verl_loss(loss, lp, old, adv, mask, agg, verl_config(loss), is_w=is_w)
    torch.manual_seed(3)
    got, _ = policy_loss(
        lp, old, adv, mask, loss_mode=loss, loss_agg_mode=agg, rollout_is_weights=is_w, **LOSSES[loss]
    )
    torch.testing.assert_close(got, want, **REL)
    torch.testing.assert_close(_grad(got, lp), _grad(want, lp), **REL)


def test_the_batch_exercises_every_branch_and_a_swapped_clip_pair_changes_every_clipped_loss():
    lp, old, adv, mask = _batch()
    for loss in ("vanilla", "dppo_tv", "dppo_kl", "gspo", "clip_cov", "kl_cov", "cispo", "geo_mean"):
        kw = LOSSES[loss]
        torch.manual_seed(11)
        base, m = policy_loss(lp, old, adv, mask, loss_mode=loss, **kw)
        assert 0 < m["pg_clipfrac"] < 1, (loss, m["pg_clipfrac"])  # some tokens clipped / selected, not all
        if "clip_ratio_low" in kw:
            swapped = {**kw, "clip_ratio_low": kw["clip_ratio_high"], "clip_ratio_high": kw["clip_ratio_low"]}
            torch.manual_seed(11)
            other, _ = policy_loss(lp, old, adv, mask, loss_mode=loss, **swapped)
            assert not torch.isclose(base, other, rtol=1e-6), loss
    _, m = policy_loss(
        lp,
        old,
        adv,
        mask,
        clip_ratio_c=3.0,
        **{k: v for k, v in LOSSES["vanilla"].items() if k != "clip_ratio_c"},
    )
    assert m["pg_clipfrac_lower"] > 0  # the dual clip bites


@pytest.mark.parametrize("loss", ["dppo_tv", "dppo_kl"])
def test_dppo_clipfrac_lower_counts_the_valid_tokens_above_clip_ratio_c_as_verl(loss):
    lp, old, adv, mask = _batch(4)
    # a token whose probability moves 0.01 -> 0.05: ratio 5 above clip_ratio_c = 2.5, yet within the TV / KL
    # thresholds (a valid token: its policy term counts, capped at c)
    lp[1, 3], old[1, 3], adv[1, 3], mask[1, 3] = math.log(0.05), math.log(0.01), 1.0, True
    _, metrics = CA.POLICY_LOSS_REGISTRY[loss](
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode="token-mean",
        config=verl_config(loss), rollout_is_weights=None,
    )  # fmt: skip
    _, m = policy_loss(lp, old, adv, mask, loss_mode=loss, **LOSSES[loss])
    want = metrics["actor/pg_clipfrac_lower"]
    assert want > 0
    assert float(m["pg_clipfrac_lower"]) == pytest.approx(want, rel=1e-6)
    assert float(m["pg_clipfrac"]) == pytest.approx(metrics["actor/pg_clipfrac"], rel=1e-6)


@pytest.mark.parametrize("loss", sorted(VERL_FIXED_AGG))
def test_verl_ignores_loss_agg_mode_for_sapo_and_geo_mean(loss):
    # documented in docs/rl.md: lmloss applies the given weights; verl's value is the same for every mode
    lp, old, adv, mask = _batch(2, empty_row=False)
    values = [_verl_loss(loss, lp, old, adv, mask, agg, verl_config(loss)) for agg in VERL_AGG_MODES]
    assert all(torch.equal(v, values[0]) for v in values)


def test_geo_mean_divides_by_every_row_in_verl():
    # verl's geo_mean is torch.mean over the rows, a row without a valid token included: lmloss's
    # seq-mean-token-mean counts the S rows with one, so verl's value is S / B of it.
    lp, old, adv, mask = _batch(3)
    want = _verl_loss("geo_mean", lp, old, adv, mask, "token-mean", verl_config("geo_mean"))
    got, _ = policy_loss(lp, old, adv, mask, loss_mode="geo_mean", loss_agg_mode="seq-mean-token-mean",
                         **LOSSES["geo_mean"])  # fmt: skip
    torch.testing.assert_close(got * (B - 1) / B, want, **REL)


@pytest.mark.parametrize("agg", VERL_AGG_MODES)
def test_the_actor_total_with_kl_and_entropy_equals_verl(agg):
    # verl's actor (verl/workers/utils/losses.py ppo_loss): pg - entropy_coeff * agg_loss(entropy)
    # + kl_loss_coef * agg_loss(kl_penalty(log_prob, ref, kl_loss_type)), every term with loss_agg_mode
    lp, old, adv, mask = _batch(4)
    g = torch.Generator().manual_seed(8)
    ref = lp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = (torch.rand(B, T, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    lp = lp.requires_grad_(True)
    cfg = verl_config("vanilla")
    want = (
        _verl_loss("vanilla", lp, old, adv, mask, agg, cfg)
        - 0.01 * CA.agg_loss(loss_mat=ent, loss_mask=mask, loss_agg_mode=agg)
        + 0.05 * CA.agg_loss(loss_mat=CA.kl_penalty(lp, ref, "k3+"), loss_mask=mask, loss_agg_mode=agg)
    )
    got, _ = policy_loss(lp, old, adv, mask, loss_agg_mode=agg, ref_logprobs=ref, kl_loss_type="k3+",
                         kl_loss_coef=0.05, entropy=ent, entropy_coeff=0.01, **LOSSES["vanilla"])  # fmt: skip
    torch.testing.assert_close(got, want, **REL)
    for a, b in zip(torch.autograd.grad(got, [lp, ent]), torch.autograd.grad(want, [lp, ent])):
        torch.testing.assert_close(a, b, **REL)


@pytest.mark.parametrize("horizon", [None, 11])
@pytest.mark.parametrize("agg", VERL_AGG_MODES)
def test_token_weights_are_verl_agg_loss(agg, horizon):
    lp, _, _, mask = _batch(5)
    loss_mat = torch.randn(
        B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(6)
    ).requires_grad_(True)
    want = CA.agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=agg, loss_scale_factor=horizon)
    w = token_weights(mask, agg, horizon=horizon, dtype=torch.float64)
    got = (w * loss_mat).sum()
    torch.testing.assert_close(got, want, **REL)
    torch.testing.assert_close(_grad(got, loss_mat), _grad(want, loss_mat), **REL)
    # packed tokens with cu_seqlens: the same weights
    cu = torch.tensor([0, *torch.full((B,), T).cumsum(0).tolist()])
    packed = token_weights(mask.reshape(-1), agg, cu_seqlens=cu, horizon=horizon or T, dtype=torch.float64)
    torch.testing.assert_close(packed, w.reshape(-1), **REL)


@pytest.mark.parametrize("kl_type", lmloss.rl.KL_LOSS_TYPES)
def test_every_kl_name_equals_verl_kl_penalty(kl_type):
    lp, _, _, _ = _batch(6)
    ref = lp + 0.7 * torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref[0, 0], ref[0, 1] = lp[0, 0] + 30.0, lp[0, 1] - 30.0  # beyond k3's clamps, both sides
    lp = lp.requires_grad_(True)
    got, want = lmloss.rl.kl_estimate(lp, ref, kl_type), CA.kl_penalty(lp, ref, kl_type)
    torch.testing.assert_close(got, want, **REL)
    torch.testing.assert_close(_grad(got.sum(), lp), _grad(want.sum(), lp), **REL)


#: (level, threshold): TIS (a cap) and IcePop ("lower_upper": zero outside), each biting on the batches below
IS_CASES = [("token", 1.2), ("token", "0.8_1.2"), ("sequence", 1.2), ("sequence", "0.5_1.2")]
IS_IDS = ["token-tis", "token-icepop", "sequence-tis", "sequence-icepop"]


def _lmloss_is_weights(current, rollout, mask, level, threshold, **kw):
    if isinstance(threshold, str):
        lower, upper = (float(v) for v in threshold.split("_"))
        return lmloss.rl.masked_is_weights(current, rollout, mask, lower=lower, upper=upper, level=level, **kw)
    return lmloss.rl.truncated_is_weights(current, rollout, mask, cap=threshold, level=level, **kw)


def _near(x, seed):
    return x + 0.15 * torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("level,threshold", IS_CASES, ids=IS_IDS)
def test_rollout_correction_weights_equal_verl(level, threshold):
    _, old, _, mask = _batch(7)
    rollout = _near(old, 1)
    want, _ = verl.rollout_corr_helper.compute_rollout_correction_weights(
        log_ratio=old - rollout, response_mask=mask, rollout_is=level, rollout_is_threshold=threshold
    )
    got = _lmloss_is_weights(old, rollout, mask, level, threshold)
    torch.testing.assert_close(got, want, **REL)
    raw = torch.exp(
        torch.where(mask, old - rollout, 0.0).sum(-1, keepdim=True) if level == "sequence" else old - rollout
    )
    raw = raw.expand(B, T)[mask]
    assert (got[mask] != raw).any() and (got[mask] == raw).any()  # the threshold bites, not everywhere


@pytest.mark.parametrize("level,threshold", IS_CASES, ids=IS_IDS)
def test_batch_normalized_rollout_correction_weights_equal_verl(level, threshold):
    old, rollout, mask = _rollout_batch()
    want, metrics = verl.rollout_corr_helper.compute_rollout_correction_weights(
        log_ratio=old - rollout, response_mask=mask, rollout_is=level, rollout_is_threshold=threshold,
        rollout_is_batch_normalize=True,
    )  # fmt: skip
    got = _lmloss_is_weights(old, rollout, mask, level, threshold, batch_normalize=True)
    torch.testing.assert_close(got, want, **REL)
    assert abs(metrics["rollout_is_batch_norm_factor"] - 1) > 1e-3  # the normalization changes the weights
    packed = lmloss.rl.truncated_is_weights(
        old[mask], rollout[mask], mask[mask], cap=1.2, level=level, batch_normalize=True,
        cu_seqlens=torch.tensor([0, *mask.sum(-1).cumsum(0).tolist()]),
    )  # fmt: skip
    rows = lmloss.rl.truncated_is_weights(old, rollout, mask, cap=1.2, level=level, batch_normalize=True)
    torch.testing.assert_close(packed, rows[mask], **REL)


def _rollout_batch():
    """8 x 12 log-probs whose rollout drifts from near (row 1) to far (row 7) off-policy; row 0 has no valid token."""
    g = torch.Generator().manual_seed(11)
    old = -torch.rand(8, 12, generator=g, dtype=torch.float64) * 3
    drift = torch.linspace(0.02, 0.6, 8, dtype=torch.float64)[:, None]
    rollout = old + drift * torch.randn(8, 12, generator=g, dtype=torch.float64)
    mask = torch.rand(8, 12, generator=g) > 0.3
    mask[0] = False
    return old, rollout, mask


RS_CASES = [
    ("token_k1", "0.8_1.25"), ("token_k1", 1.25), ("token_k2", 0.02), ("token_k3", 0.02),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", 0.1), ("seq_sum_k3", 0.1),
    ("seq_mean_k1", 1.05), ("seq_mean_k2", 0.05), ("seq_mean_k3", 0.05), ("seq_max_k2", 0.05), ("seq_max_k3", 0.05),
    ("token_k1,seq_max_k3", "0.8_1.25,0.05"), ("token_k2, seq_mean_k3,token_k2", 0.02),
]  # fmt: skip


@pytest.mark.parametrize("rollout_rs,threshold", RS_CASES)
def test_rejection_mask_equals_verl(rollout_rs, threshold):
    old, rollout, mask = _rollout_batch()
    want, _ = verl.rollout_corr_helper.compute_rollout_rejection_mask(
        log_ratio=old - rollout, response_mask=mask, rollout_rs=rollout_rs, rollout_rs_threshold=threshold
    )
    got = lmloss.rl.rejection_mask(old, rollout, mask, rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    assert got.dtype == torch.bool and torch.equal(got, want.bool())
    assert got.any() and (got != mask).any()  # the criterion keeps some valid tokens and rejects others
    packed = lmloss.rl.rejection_mask(
        old[mask], rollout[mask], mask[mask], rollout_rs=rollout_rs, rollout_rs_threshold=threshold,
        cu_seqlens=torch.tensor([0, *mask.sum(-1).cumsum(0).tolist()]),
    )  # fmt: skip
    assert torch.equal(packed, got[mask])


@pytest.mark.parametrize(
    "rollout_rs,threshold,message",
    [("token_k4", 1.0, "unknown criterion 'token_k4'"), ("seq_max_k1", 1.0, "unknown criterion"),
     ("", 1.0, "non-empty"), ("token_k2", "0.5_2", "takes one upper bound"), ("token_k1", "2_0.5", "lower <= upper"),
     ("token_k2", -1.0, "must be finite and > 0"), ("token_k2,token_k3", "1,2,3", "3 entries for 2 criteria"),
     ("token_k2", None, "must be a number or a string")],
)  # fmt: skip
def test_rejection_mask_refuses_what_verl_refuses(rollout_rs, threshold, message):
    old, rollout, mask = _rollout_batch()
    with pytest.raises((ValueError, TypeError), match=message):
        lmloss.rl.rejection_mask(old, rollout, mask, rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    with pytest.raises((ValueError, TypeError)):
        verl.rollout_corr_helper.compute_rollout_rejection_mask(
            log_ratio=old - rollout, response_mask=mask, rollout_rs=rollout_rs or None, rollout_rs_threshold=threshold
        )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("level,threshold", IS_CASES, ids=IS_IDS)
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_mode_is_a_composition(loss_type, level, threshold, agg):
    # verl's bypass_mode: old_log_prob is the rollout's. "ppo_clip": vanilla PPO against the rollout (the
    # ratio is the IS correction); "reinforce": REINFORCE times IS weights of the *current* policy against
    # the rollout, computed without gradient. In lmloss: policy_loss, and rollout weights of logprobs.
    lp, _, adv, mask = _batch(8)
    rollout = _near(lp, 2)
    lp = lp.requires_grad_(True)
    rc = verl.RolloutCorrectionConfig(loss_type=loss_type, rollout_is=level, rollout_is_threshold=threshold,
                                      bypass_mode=True)  # fmt: skip
    cfg = verl_support.actor_config(verl, loss_mode="bypass_mode", policy_loss=dict(rollout_correction=rc),
                                    clip_ratio_low=0.1, clip_ratio_high=0.28)  # fmt: skip
    want, _ = CA.compute_policy_loss_bypass_mode(
        old_log_prob=rollout, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=agg, config=cfg
    )
    if loss_type == "ppo_clip":
        got, _ = policy_loss(lp, rollout, adv, mask, loss_agg_mode=agg, clip_ratio_low=0.1, clip_ratio_high=0.28,
                             clip_ratio_c=3.0)  # fmt: skip
    else:
        w = _lmloss_is_weights(lp, rollout, mask, level, threshold)  # detached, though lp requires grad
        got, _ = policy_loss(
            lp, rollout, adv, mask, loss_mode="reinforce", loss_agg_mode=agg, rollout_is_weights=w
        )
    torch.testing.assert_close(got, want, **REL)
    torch.testing.assert_close(_grad(got, lp), _grad(want, lp), **REL)


def _random_rollout_case(seed):
    """A random batch (shape, dtype, drift, mask with empty rows) for the rollout-correction fuzz tests."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    b, t = rnd.randint(1, 6), rnd.randint(1, 9)
    dtype = rnd.choice([torch.float64, torch.float32])
    old = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 4).to(dtype)
    drift = rnd.choice([0.01, 0.1, 0.5, 3.0])
    rollout = (old.double() + drift * torch.randn(b, t, generator=g, dtype=torch.float64)).to(dtype)
    mask = torch.rand(b, t, generator=g) > rnd.random()
    mask[0, 0] = True
    return rnd, old, rollout, mask


@pytest.mark.parametrize("seed", range(0, 400, 50))
def test_rejection_mask_equals_verl_on_random_batches_and_chains(seed):
    for case in range(seed, seed + 50):
        rnd, old, rollout, mask = _random_rollout_case(case)
        criteria = rnd.sample(lmloss.rl.REJECTION_CRITERIA, rnd.randint(1, 3))
        spec = ",".join(
            rnd.choice(["0.5_2", "0.9_1.1", str(rnd.uniform(1.01, 3))]) if c.endswith("k1")
            else str(round(rnd.uniform(0.001, 1.0), 4))
            for c in criteria
        )  # fmt: skip
        want, _ = verl.rollout_corr_helper.compute_rollout_rejection_mask(
            log_ratio=old - rollout, response_mask=mask, rollout_rs=",".join(criteria), rollout_rs_threshold=spec
        )
        got = lmloss.rl.rejection_mask(old, rollout, mask, rollout_rs=",".join(criteria), rollout_rs_threshold=spec)
        assert torch.equal(got, want.bool()), (case, criteria, spec)


def test_batch_normalized_is_weights_equal_verl_on_random_batches():
    compared = 0
    for case in range(300):
        rnd, old, rollout, mask = _random_rollout_case(case)
        level = rnd.choice(["token", "sequence"])
        threshold = rnd.choice([1.2, 2.0, "0.8_1.2", "0.5_2.0", 5.0])
        try:
            want, _ = verl.rollout_corr_helper.compute_rollout_correction_weights(
                log_ratio=old - rollout, response_mask=mask, rollout_is=level, rollout_is_threshold=threshold,
                rollout_is_batch_normalize=True,
            )  # fmt: skip
        except ZeroDivisionError:  # verl's metrics where every IcePop weight is 0; lmloss returns the zeros
            got = _lmloss_is_weights(old, rollout, mask, level, threshold, batch_normalize=True)
            assert isinstance(threshold, str) and not got.any()
            continue
        got = _lmloss_is_weights(old, rollout, mask, level, threshold, batch_normalize=True)
        tol = REL if old.dtype == torch.float64 else dict(rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(got, want.to(got.dtype), **tol)
        compared += 1
    assert compared > 250


# ----------------------------------------------------------- verl's 1e-8 in a token count, by the mask's dtype
#
# verl divides by ``mask.sum(...) + 1e-8`` (``masked_mean``, ``agg_loss``'s seq-mean-token-mean, GMPO's
# lengths). A float mask's count is in its dtype, and the 1e-8 stays in float64; a bool mask's count is an
# integer tensor, and the 1e-8 is added in torch's default float dtype, where it rounds away. Each site
# below is compared with verl's own function for a bool and a float64 mask at 1e-12, which the 1e-8 exceeds
# on these short rows (it moves a mean over n tokens by 1e-8 / n), and verl's two results differ.

MASK_DTYPES = [torch.bool, torch.float64]
TIGHT = dict(rtol=1e-12, atol=1e-15)


def _equal_for_both_masks(run):
    """`run(mask_dtype)` -> (lmloss's tensors, verl's tensors): equal at `TIGHT` for each mask dtype, and verl's
    results for the two dtypes differ beyond it (the case sees which dtype verl adds its 1e-8 in). verl's
    one-process path: with a process group alive in this process (the bench's Megatron row starts one and
    keeps it) verl's rollout helpers take their distributed means, as lmloss's do given `group=`."""
    verls = []
    for mask_dtype in MASK_DTYPES:
        with unittest.mock.patch.object(torch.distributed, "is_initialized", return_value=False):
            got, want = run(mask_dtype)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TIGHT, msg=lambda m, d=mask_dtype: f"{d}: {m}")
        verls.append(want)
    assert any(not torch.allclose(a, b, rtol=1e-11, atol=0) for a, b in zip(*verls))


def _seq_mean_token_mean_case(mask_dtype):
    lp, old, adv, mask = _batch(9)
    mask = mask.to(mask_dtype)
    loss_mat = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    return lp.requires_grad_(True), old, adv, mask, loss_mat


def test_seq_mean_token_mean_adds_verls_eps_in_the_masks_dtype():
    def run(mask_dtype):
        lp, old, adv, mask, loss_mat = _seq_mean_token_mean_case(mask_dtype)
        agg = "seq-mean-token-mean"
        want_agg = CA.agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=agg)
        got_agg = (token_weights(mask, agg, dtype=torch.float64) * loss_mat).sum()
        cu = torch.tensor([0, *torch.full((B,), T).cumsum(0).tolist()])  # packed rows: the same weights
        packed = token_weights(mask.reshape(-1), agg, cu_seqlens=cu, dtype=torch.float64).view(B, T)
        want = _verl_loss("vanilla", lp, old, adv, mask, agg, verl_config("vanilla"))
        got, _ = policy_loss(lp, old, adv, mask, loss_agg_mode=agg, **LOSSES["vanilla"])
        return (
            [got_agg, _grad(got_agg, loss_mat), (packed * loss_mat).sum(), got, _grad(got, lp)],
            [want_agg, _grad(want_agg, loss_mat), want_agg, want, _grad(want, lp)],
        )

    _equal_for_both_masks(run)


@pytest.mark.parametrize("with_is_weights", [False, True], ids=["plain", "is-weights"])
def test_geo_mean_adds_verls_eps_in_the_masks_dtype(with_is_weights):
    def run(mask_dtype):
        lp, old, adv, mask = _batch(10)
        lp, mask = lp.requires_grad_(True), mask.to(mask_dtype)
        is_w = None
        if with_is_weights:
            is_w = torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.5
        want = _verl_loss("geo_mean", lp, old, adv, mask, "token-mean", verl_config("geo_mean"), is_w=is_w)
        rows = mask.double()  # verl's aggregation: the mean of the rows' sequence losses, every row counted
        w = rows / (rows.sum(-1, keepdim=True).clamp(min=1) * B)
        got, _ = policy_loss(lp, old, adv, mask, loss_mode="geo_mean", token_weights=w, rollout_is_weights=is_w,
                             **LOSSES["geo_mean"])  # fmt: skip
        return [got, _grad(got, lp)], [want, _grad(want, lp)]

    _equal_for_both_masks(run)


def test_the_fused_loss_adds_verls_eps_in_the_masks_dtype():
    # linear_policy_loss carries its mask's dtype to the weights (vanilla: chunked) and to geo_mean (two passes)
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(B, T, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(24, 8, generator=g, dtype=torch.float64) * 0.7
    labels = torch.randint(0, 24, (B, T), generator=g)
    _, old, adv, mask = _batch(11)

    def lp():  # verl's input: the log-probs of the materialized logits
        return torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[..., None])[..., 0]

    def run(mask_dtype):
        m = mask.to(mask_dtype)
        want_ppo = _verl_loss("vanilla", lp(), old, adv, m, "seq-mean-token-mean", verl_config("vanilla"))
        fused = dict(mask=m, impl="torch", chunk_size=5)
        got_ppo, _ = lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, loss_agg_mode="seq-mean-token-mean",
                                                  **fused, **LOSSES["vanilla"])  # fmt: skip
        want_geo = _verl_loss("geo_mean", lp(), old, adv, m, "token-mean", verl_config("geo_mean"))
        rows = mask.double()
        w = rows / (rows.sum(-1, keepdim=True).clamp(min=1) * B)
        got_geo, _ = lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, loss_mode="geo_mean", token_weights=w,
                                                  **fused, **LOSSES["geo_mean"])  # fmt: skip
        return (
            [got_ppo, _grad(got_ppo, hidden), got_geo, _grad(got_geo, hidden)],
            [want_ppo, _grad(want_ppo, hidden), want_geo, _grad(want_geo, hidden)],
        )

    _equal_for_both_masks(run)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalized_is_weights_add_verls_eps_in_the_masks_dtype(level):
    # the sequences' weight means (both levels of verl's masked_mean), and on one process the token level's
    old, rollout, mask = _rollout_batch()

    def run(mask_dtype):
        m = mask.to(mask_dtype)
        want, _ = verl.rollout_corr_helper.compute_rollout_correction_weights(
            log_ratio=old - rollout, response_mask=m, rollout_is=level, rollout_is_threshold=1.2,
            rollout_is_batch_normalize=True,
        )  # fmt: skip
        return [_lmloss_is_weights(old, rollout, m, level, 1.2, batch_normalize=True)], [want]

    _equal_for_both_masks(run)


def test_seq_mean_rejection_adds_verls_eps_in_the_masks_dtype():
    # a sequence of two tokens whose mean k1 sits within verl's 1e-8 of the upper bound: a bool mask's count
    # (the 1e-8 rounded away) puts it above and rejects it, a float64 mask's (1e-8 kept) below
    old, rollout, mask = _rollout_batch()
    mask[3] = False
    mask[3, 4:6] = True
    rollout[3, 4:6] = old[3, 4:6] + 0.25
    k1_mean = float((rollout[3, 4:6] - old[3, 4:6]).sum()) / 2
    spec = f"0.01_{math.exp(k1_mean * (1 - 0.25e-8))!r}"
    kept = []
    for mask_dtype in MASK_DTYPES:
        m = mask.to(mask_dtype)
        want, _ = verl.rollout_corr_helper.compute_rollout_rejection_mask(
            log_ratio=old - rollout, response_mask=m, rollout_rs="seq_mean_k1", rollout_rs_threshold=spec
        )
        got = lmloss.rl.rejection_mask(old, rollout, m, rollout_rs="seq_mean_k1", rollout_rs_threshold=spec)
        assert torch.equal(got, want.bool()), mask_dtype
        kept.append(bool(want[3, 4]))
    assert kept == [False, True]


def test_clip_cov_means_add_verls_eps_in_the_masks_dtype():
    # clip_cov's means (verl's masked_mean) place a token's covariance; with clip_cov_lb between its two values
    # (the count with and without the 1e-8), the token is selected for one mask dtype only. Every candidate is
    # selected (clip_cov_ratio=1), so the selection does not depend on the random draw.
    lp, old, adv, mask = _batch(13)
    valid = mask.reshape(-1)
    a, x = torch.where(mask, adv, 0.0).reshape(-1), torch.where(mask, lp, 0.0).reshape(-1)
    n = float(valid.sum())
    ratio = (lp - old).exp().reshape(-1)
    unclipped = ~(-adv.reshape(-1) * ratio.clamp(0.9, 1.28) > -adv.reshape(-1) * ratio) & valid

    def cov(count):  # the setup only: where to put the bound (verl's own function is the reference below)
        return (a - a.sum() / count) * (x - x.sum() / count)

    plain, eps = cov(n), cov(n + 1e-8)
    t = int(torch.where(unclipped & (plain > 0.2) & (plain < 3.0), plain, 0.0).argmax())
    options = dict(LOSSES["clip_cov"], clip_cov_ratio=1.0, clip_cov_lb=float((plain[t] + eps[t]) / 2), clip_cov_ub=9.0)
    lp = lp.requires_grad_(True)
    selected = []

    def run(mask_dtype):
        m = mask.to(mask_dtype)
        torch.manual_seed(0)
        want = _verl_loss("clip_cov", lp, old, adv, m, "token-mean", verl_config("clip_cov", **options))
        got, _ = policy_loss(lp, old, adv, m, loss_mode="clip_cov", **options)
        selection = lmloss.rl.covariance_selection(
            lp, old, adv, m, loss_mode="clip_cov", **{k: v for k, v in options.items() if k != "clip_ratio_c"}
        )
        selected.append(bool(selection.reshape(-1)[t]))
        return [got, _grad(got, lp)], [want, _grad(want, lp)]

    _equal_for_both_masks(run)
    assert selected[0] != selected[1]  # the token the bound was put beside: selected for one mask dtype only
