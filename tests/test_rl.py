"""lmloss.rl.policy_loss / token_weights / rollout weights on one process, against float64 references.

The references below are plain float64 PyTorch math of verl 0.9.1's actor loss (``compute_policy_loss_vanilla``
/ ``_gspo`` / ``_cispo`` / ``_reinforce``, ``agg_loss``, ``kl_penalty``; the actor's total ``pg - entropy_coeff
* agg(entropy) + kl_loss_coef * agg(kl)``), on ``[B, T]`` rows, with autograd for the reference gradients;
tests/test_rl_fused.py uses them too. verl's *own* functions are the reference in tests/test_rl_verl.py
(every registered loss, ``agg_loss``, ``kl_penalty``) and TRL's ``GRPOTrainer`` in tests/test_rl_trl.py; the
argument checks, refusals and the fused op's weights are here.
"""

from __future__ import annotations

import math

import pytest
import torch

import lmloss
from impl_params import IMPLS
from lmloss.rl import policy_loss, token_weights

REL = dict(rtol=1e-7, atol=1e-12)
B, T = 4, 7
VERL_AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


# ----------------------------------------------------------------------------------- verl, written out


def ref_agg(loss_mat, mask, mode):
    m = mask.double()
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum()
    if mode == "token-sum":
        return (loss_mat * m).sum()
    seq_len = m.sum(-1)
    n_seqs = (seq_len > 0).double().sum()
    if mode == "seq-mean-token-sum":
        return ((loss_mat * m).sum(-1) * (seq_len > 0)).sum() / n_seqs
    if mode == "seq-mean-token-mean":  # verl's 1e-8 on the mask's own count (bool: in float32, where it rounds away)
        return ((loss_mat * m).sum(-1) / (mask.sum(-1) + 1e-8) * (seq_len > 0)).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":  # verl 0.9.1: the seq-mean of token sums, over the horizon
        return ((loss_mat * m).sum(-1) * (seq_len > 0)).sum() / n_seqs / mask.shape[-1]
    raise AssertionError(mode)


def ref_pg(mode, lp, old, adv, mask, low=0.2, high=0.2, c=None):
    if mode == "reinforce":
        return -adv * lp
    if mode == "gspo":
        seq_len = mask.double().sum(-1).clamp(min=1)
        seq_kl = ((lp - old) * mask).sum(-1) / seq_len
        log_r = (lp - lp.detach() + seq_kl.detach()[:, None]).clamp(max=10.0)
        r = torch.exp(log_r)
        return torch.maximum(-adv * r, -adv * r.clamp(1 - low, 1 + high))
    r = torch.exp((lp - old).clamp(-20, 20))
    if mode == "cispo":
        return -r.clamp(1 - low, 1 + high).detach() * adv * lp
    l1, l2 = -adv * r, -adv * r.clamp(1 - low, 1 + high)
    clipped = torch.maximum(l1, l2)
    if c is None:
        return clipped
    return torch.where(adv < 0, torch.minimum(-adv * c, clipped), clipped)


def ref_kl(lp, ref, kind):
    base = kind.rstrip("+")
    if base in ("k1", "kl"):
        v = lp - ref
    elif base == "abs":
        v = (lp - ref).abs()
    elif base in ("k2", "mse"):
        v = 0.5 * (lp - ref) ** 2
    else:
        k = (ref - lp).clamp(-20, 20)
        v = (torch.exp(k) - k - 1).clamp(-10, 10)
    if kind.endswith("+") and base not in ("k2", "mse"):
        b = 0.5 * (lp - ref) ** 2
        v = b - b.detach() + v.detach()
    return v


def ref_actor_loss(mode, agg, lp, old, adv, mask, *, ref=None, kl_type="low_var_kl", kl_coef=0.0, ent=None,
                   ent_coef=0.0, is_w=None, **clip):  # fmt: skip
    pg = ref_pg(mode, lp, old, adv, mask, **clip)
    if is_w is not None:
        pg = pg * is_w
    loss = ref_agg(pg, mask, agg)
    if ent is not None:
        loss = loss - ent_coef * ref_agg(ent, mask, agg)
    if ref is not None:
        loss = loss + kl_coef * ref_agg(ref_kl(lp, ref, kl_type), mask, agg)
    return loss


def _batch(seed=0, b=B, t=T):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 0.1
    old = lp + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = lp + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ent = torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    old[:, 1::3] = lp[:, 1::3] - 1.5  # ratio e^1.5 > 3: the dual clip bites where the advantage is < 0
    adv[:, 1] = -adv[:, 1].abs()
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 1] = True
    mask[0, :] = False  # a fully masked sequence (excluded from the sequence count)
    mask[1, :2] = True
    return lp, old, adv, ref, ent, mask


def _grads(loss, *xs):
    return torch.autograd.grad(loss, xs, allow_unused=True)


# ----------------------------------------------------------------------------------- parity with verl

PG_CASES = [
    ("vanilla", dict(clip_ratio=0.2)),
    ("vanilla", dict(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=3.0)),
    ("cispo", dict(clip_ratio_low=0.2, clip_ratio_high=0.3)),
    ("reinforce", {}),
]


def _clip_kw(kw):
    low = kw.get("clip_ratio_low", kw.get("clip_ratio", 0.2))
    return dict(low=low, high=kw.get("clip_ratio_high", kw.get("clip_ratio", 0.2)), c=kw.get("clip_ratio_c"))


@pytest.mark.parametrize("agg", VERL_AGG_MODES)
@pytest.mark.parametrize("mode,kw", PG_CASES, ids=["ppo", "ppo_asym_dualclip", "cispo", "reinforce"])
def test_policy_loss_matches_verl_actor_loss_value_and_gradient(agg, mode, kw):
    lp, old, adv, ref, ent, mask = _batch()
    lp, ent = lp.requires_grad_(True), ent.requires_grad_(True)
    opts = dict(
        ref_logprobs=ref, kl_loss_type="low_var_kl", kl_loss_coef=0.05, entropy=ent, entropy_coeff=0.01
    )
    loss, _ = policy_loss(lp, old, adv, mask, loss_mode=mode, loss_agg_mode=agg, **kw, **opts)
    expected = ref_actor_loss(mode, agg, lp, old, adv, mask, ref=ref, kl_type="low_var_kl", kl_coef=0.05, ent=ent,
                              ent_coef=0.01, **_clip_kw(kw))  # fmt: skip
    torch.testing.assert_close(loss, expected, **REL)
    for got, want in zip(_grads(loss, lp, ent), _grads(expected, lp, ent)):
        torch.testing.assert_close(got, want, **REL)


@pytest.mark.parametrize("agg", VERL_AGG_MODES)
def test_gspo_matches_the_sequence_ratio_under_every_agg_mode(agg):
    # verl 0.9.1's gspo aggregates its pg term with the actor's loss_agg_mode (earlier verl forced
    # seq-mean-token-mean); asymmetric clips so that swapping them changes the loss.
    lp, old, adv, ref, ent, mask = _batch(1)
    lp, ent = lp.requires_grad_(True), ent.requires_grad_(True)
    # sequence ratios e^0.3, e^-0.25, e^0.2 (row 0 is masked): clipped by the asymmetric bounds on one side
    old = lp.detach() - torch.tensor([0.0, 0.3, -0.25, 0.2], dtype=torch.float64)[:, None]
    loss, _ = policy_loss(lp, old, adv, mask, loss_mode="gspo", loss_agg_mode=agg, clip_ratio_low=0.05,
                          clip_ratio_high=0.3, ref_logprobs=ref, kl_loss_coef=0.1, kl_loss_type="k1", entropy=ent,
                          entropy_coeff=0.02)  # fmt: skip
    expected = ref_actor_loss("gspo", agg, lp, old, adv, mask, ref=ref, kl_type="k1", kl_coef=0.1, ent=ent,
                              ent_coef=0.02, low=0.05, high=0.3)  # fmt: skip
    torch.testing.assert_close(loss, expected, **REL)
    for got, want in zip(_grads(loss, lp, ent), _grads(expected, lp, ent)):
        torch.testing.assert_close(got, want, **REL)


@pytest.mark.parametrize("kl_type", lmloss.rl.KL_LOSS_TYPES)
def test_kl_loss_types_match_verl_kl_penalty_value_and_gradient(kl_type):
    lp, old, adv, ref, _, mask = _batch(2)
    ref = ref.clone()
    ref[2, 3] = lp[2, 3] + 30.0  # beyond k3's clamps
    lp = lp.requires_grad_(True)
    loss, metrics = policy_loss(lp, old, adv, mask, ref_logprobs=ref, kl_loss_type=kl_type, kl_loss_coef=0.3)
    expected = ref_actor_loss(
        "vanilla", "token-mean", lp, old, adv, mask, ref=ref, kl_type=kl_type, kl_coef=0.3
    )
    torch.testing.assert_close(loss, expected, **REL)
    torch.testing.assert_close(_grads(loss, lp)[0], _grads(expected, lp)[0], **REL)
    torch.testing.assert_close(
        metrics["kl_loss"], ref_agg(ref_kl(lp, ref, kl_type), mask, "token-mean").detach(), **REL
    )


def test_rollout_is_weights_multiply_the_policy_gradient_term_only():
    lp, old, adv, ref, _, mask = _batch(3)
    lp = lp.requires_grad_(True)
    is_w = torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) * 2
    loss, _ = policy_loss(lp, old, adv, mask, rollout_is_weights=is_w, ref_logprobs=ref, kl_loss_coef=0.2)
    expected = ref_actor_loss("vanilla", "token-mean", lp, old, adv, mask, ref=ref, kl_coef=0.2, is_w=is_w)
    torch.testing.assert_close(loss, expected, **REL)
    torch.testing.assert_close(_grads(loss, lp)[0], _grads(expected, lp)[0], **REL)


# ----------------------------------------------------------------------------------- packed tokens


@pytest.mark.parametrize("agg", [*VERL_AGG_MODES, "token-sum"])
@pytest.mark.parametrize("mode", ["vanilla", "gspo"])
def test_packed_tokens_with_cu_seqlens_equal_the_padded_rows(agg, mode):
    lp, old, adv, ref, ent, mask = _batch(4)
    lengths = [5, 3, 7, 2]
    rows = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    mask = mask & rows
    lp = lp.requires_grad_(True)
    kw = dict(
        loss_mode=mode, loss_agg_mode=agg, ref_logprobs=ref, kl_loss_coef=0.1, entropy=ent, entropy_coeff=0.1
    )
    want, _ = policy_loss(lp, old, adv, mask, **kw)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def pack(t):
        return t[rows]

    kw_p = {**kw, "ref_logprobs": pack(ref), "entropy": pack(ent)}
    got, _ = policy_loss(pack(lp), pack(old), pack(adv), pack(mask), cu_seqlens=cu, horizon=T, **kw_p)
    torch.testing.assert_close(got, want, **REL)
    torch.testing.assert_close(_grads(got, lp)[0], _grads(want, lp)[0], **REL)


# ----------------------------------------------------------------------------------- token_weights


def test_token_weights_are_the_global_denominators_of_each_mode():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    w = {m: token_weights(mask, m, dtype=torch.float64) for m in lmloss.rl.LOSS_AGG_MODES[:5]}
    m = mask.double()
    torch.testing.assert_close(w["token-mean"], m / 6)
    torch.testing.assert_close(w["token-sum"], m)
    torch.testing.assert_close(w["seq-mean-token-sum"], m / 2)  # two sequences have a valid token
    lens = torch.tensor([2.0, 0.0, 4.0], dtype=torch.float64)[:, None]
    torch.testing.assert_close(w["seq-mean-token-mean"], m / ((lens + 1e-8) * 2))
    torch.testing.assert_close(w["seq-mean-token-sum-norm"], m / (2 * 4))  # / (S * horizon), verl's


def test_prompt_mean_weights_give_each_prompt_group_equal_total_weight():
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    cu = torch.tensor([0, 3, 5, 9])  # sequences of 3, 2, 4 tokens
    prompt = torch.tensor([0, 0, 1])  # sequences 0 and 1 answer prompt 0, sequence 2 prompt 1
    w = token_weights(mask, "prompt-mean-token-mean", cu_seqlens=cu, prompt_ids=prompt, dtype=torch.float64)
    expected = (
        torch.tensor([1 / 4, 1 / 4, 1 / 4, 0, 1 / 4, 1 / 4, 1 / 4, 1 / 4, 1 / 4], dtype=torch.float64) / 2
    )
    torch.testing.assert_close(w, expected)


def test_prompt_mean_counts_only_the_prompt_groups_that_have_a_valid_token():
    """G is the number of prompt groups with a valid token: a group whose sequences are all masked out, and
    a prompt id no sequence uses, take no share of the weight."""
    mask = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    cu = torch.tensor([0, 2, 5, 9])  # sequences of 2, 3 (all masked), 4 tokens
    prompt = torch.tensor([0, 1, 3])  # prompt 1 has no valid token, prompt 2 no sequence
    w = token_weights(mask, "prompt-mean-token-mean", cu_seqlens=cu, prompt_ids=prompt, dtype=torch.float64)
    expected = torch.tensor([1 / 2, 1 / 2, 0, 0, 0, 1 / 4, 1 / 4, 1 / 4, 1 / 4], dtype=torch.float64) / 2
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(w.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_token_weights_of_an_empty_batch_are_zero():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert torch.equal(token_weights(mask, mode), torch.zeros(2, 3))


# ----------------------------------------------------------------------------------- metrics


def test_metrics_are_masked_statistics_and_the_tracker_exports_the_same():
    lp, old, adv, ref, ent, mask = _batch(5)
    old[~mask] = float("nan")  # must not reach any statistic
    tracker = lmloss.StatsTracker()
    _, m = policy_loss(lp, old, adv, mask, clip_ratio_c=3.0, entropy=ent, entropy_coeff=0.1, tracker=tracker)
    r = torch.exp(lp - old)[mask]
    a = adv[mask]
    l1, l2 = -a * r, -a * r.clamp(0.8, 1.2)
    clipped = torch.maximum(l1, l2)
    expected = {
        "pg_clipfrac": (l2 > l1).double().mean(),
        "pg_clipfrac_lower": ((clipped > -a * 3.0) & (a < 0)).double().mean(),
        "ppo_kl": (old - lp)[mask].mean(),
        "ratio_mean": r.mean(),
        "ratio_max": r.max(),
        "ratio_min": r.min(),
        "entropy": ent[mask].mean(),
    }
    exported = tracker.export()
    for k, v in expected.items():
        torch.testing.assert_close(m[k], v, **REL)
        assert math.isclose(exported[k], v.item(), rel_tol=1e-9), k
    assert exported["policy_tokens"] == mask.sum().item()


# ----------------------------------------------------------------------------------- rollout correction


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_and_masked_is_weights(level):
    lp, old, _, _, _, mask = _batch(6)
    rollout = old + 0.5 * torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    log_r = torch.where(mask, old - rollout, 0.0)
    if level == "sequence":
        log_r = log_r.sum(-1, keepdim=True).expand(B, T)
    ratio = torch.exp(log_r.clamp(-20, 20))
    tis = lmloss.rl.truncated_is_weights(old, rollout, mask, cap=1.5, level=level)
    torch.testing.assert_close(tis, torch.where(mask, ratio.clamp(max=1.5), 0.0), **REL)
    mis = lmloss.rl.masked_is_weights(old, rollout, mask, lower=0.7, upper=1.4, level=level)
    torch.testing.assert_close(mis, torch.where(mask & (ratio >= 0.7) & (ratio <= 1.4), ratio, 0.0), **REL)
    packed = lmloss.rl.truncated_is_weights(old[mask], rollout[mask], mask[mask], cap=1.5, level=level,
                                            cu_seqlens=torch.tensor([0, *mask.sum(-1).cumsum(0).tolist()]))  # fmt: skip
    torch.testing.assert_close(packed, tis[mask], **REL)


# ----------------------------------------------------------------------------------- bad input


def test_nan_and_inf_at_masked_positions_give_exactly_zero_gradient():
    lp, old, adv, ref, ent, mask = _batch(7)
    for t, v in (
        (lp, float("nan")),
        (old, float("inf")),
        (adv, float("-inf")),
        (ref, float("nan")),
        (ent, float("inf")),
    ):
        t[~mask] = v
    lp, ent = lp.requires_grad_(True), ent.requires_grad_(True)
    is_w = torch.where(mask, 0.9, float("nan")).double()
    for mode in lmloss.rl.LOSS_MODES:
        loss, metrics = policy_loss(lp, old, adv, mask, loss_mode=mode, clip_ratio_c=3.0 if mode == "vanilla" else None,
                                    loss_agg_mode="seq-mean-token-mean", ref_logprobs=ref, kl_loss_type="k3+",
                                    kl_loss_coef=0.1, entropy=ent, entropy_coeff=0.1, rollout_is_weights=is_w,
                                    dro_beta=0.2, clip_cov_ratio=0.2, kl_cov_ratio=0.2)  # fmt: skip
        assert torch.isfinite(loss)
        g_lp, g_ent = _grads(loss, lp, ent)
        assert torch.equal(g_lp[~mask], torch.zeros_like(g_lp[~mask])), mode
        assert torch.equal(g_ent[~mask], torch.zeros_like(g_ent[~mask])), mode
        assert torch.isfinite(g_lp).all() and all(torch.isfinite(v) for v in metrics.values() if v.dim() == 0)


def _bad(**over):
    lp, old, adv, ref, ent, mask = _batch(8)
    kw = dict(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask)
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over,name",
    [
        (dict(loss_mode="ppo2"), "loss_mode"),
        (dict(loss_agg_mode="mean"), "loss_agg_mode"),
        (dict(kl_loss_type="k4", ref_logprobs=torch.zeros(B, T)), "kl_loss_type"),
        (dict(advantages=torch.zeros(B, T + 1)), "advantages"),
        (dict(old_logprobs=torch.zeros(B)), "old_logprobs"),
        (dict(mask=torch.ones(B, T - 1, dtype=torch.bool)), "mask"),
        (dict(token_weights=torch.ones(T)), "token_weights"),
        (dict(kl_loss_coef=0.1), "ref_logprobs"),
        (dict(entropy_coeff=0.1), "entropy"),
        (dict(clip_ratio_c=0.5), "clip_ratio_c"),
        (dict(clip_ratio_c=3.0, loss_mode="cispo"), "clip_ratio_c"),
        (dict(clip_ratio_low=-0.1), "clip_ratio_low"),
        (dict(loss_mode="dro"), "dro_beta"),
        (dict(loss_mode="dro", dro_beta=0.0), "dro_beta"),
        (dict(loss_mode="sapo", clip_ratio_c=3.0), "clip_ratio_c"),
        (dict(loss_mode="sapo", tau_neg=0.0), "tau_neg"),
        (dict(loss_mode="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0), "clip_cov_lb"),
        (dict(loss_mode="kl_cov", kl_cov_ratio=0.0), "kl_cov_ratio"),
        (dict(loss_mode="vespo", vespo_k_pos=float("nan")), "vespo_k_pos"),
        (dict(cov_selection=torch.zeros(B, T, dtype=torch.bool)), "cov_selection"),
        (dict(pg_mask=torch.full((B, T), 0.5)), "pg_mask"),
        (dict(mask=torch.full((B, T), 0.5)), "mask"),
        (dict(mask=torch.full((B, T), 2)), "mask"),
        (dict(horizon=float("inf"), loss_agg_mode="seq-mean-token-sum-norm"), "horizon"),
        (dict(horizon=float("nan"), loss_agg_mode="seq-mean-token-sum-norm"), "horizon"),
        (dict(horizon=0, loss_agg_mode="seq-mean-token-sum-norm"), "horizon"),
        (dict(token_weights=torch.ones(B, T), loss_agg_mode="seq-mean-token-mean"), "token_weights"),
        # an option that does not apply is refused, not ignored: the importance weight of a KL estimate
        (dict(kl_importance_weighted=True, kl_loss_type="full"), "kl_importance_weighted"),
        (dict(kl_importance_weighted=True, loss_mode="gspo", cu_seqlens=None), "kl_importance_weighted"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(over, name):
    with pytest.raises((ValueError, TypeError), match=name):
        policy_loss(**_bad(**over))


def test_packed_input_errors_name_cu_seqlens_and_horizon():
    lp, old, adv, _, _, mask = (t.reshape(-1) for t in _batch(9))
    with pytest.raises(ValueError, match="cu_seqlens"):  # a seq-mean mode on 1-D tokens needs boundaries
        policy_loss(lp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    with pytest.raises(ValueError, match="cu_seqlens"):  # gspo too
        policy_loss(lp, old, adv, mask, loss_mode="gspo")
    with pytest.raises(ValueError, match="cu_seqlens covers 20 tokens but there are 28"):
        policy_loss(
            lp, old, adv, mask, loss_agg_mode="seq-mean-token-sum", cu_seqlens=torch.tensor([0, 10, 20])
        )
    with pytest.raises(ValueError, match="cu_seqlens covers 20 tokens"):  # checked in every mode
        policy_loss(lp, old, adv, mask, cu_seqlens=torch.tensor([0, 10, 20]))
    with pytest.raises(ValueError, match="horizon"):
        policy_loss(lp, old, adv, mask, loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="prompt_ids"):
        token_weights(mask, "prompt-mean-token-mean", cu_seqlens=torch.tensor([0, 28]))


@pytest.mark.parametrize(
    "name", ["old_logprobs", "advantages", "ref_logprobs", "rollout_is_weights", "token_weights"]
)
def test_a_differentiable_constant_is_refused_naming_it(name):
    lp, old, adv, ref, _, mask = _batch(10)
    lp = lp.requires_grad_(True)
    kw = dict(old_logprobs=old, advantages=adv, ref_logprobs=ref, rollout_is_weights=torch.ones(B, T).double(),
              token_weights=token_weights(mask, dtype=torch.float64))  # fmt: skip
    kw[name] = kw[name].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=f"{name} requires grad"):
        policy_loss(lp, mask=mask, kl_loss_coef=0.1, **kw)
    with pytest.raises(ValueError, match="old_logprobs requires grad"):  # the silent zero-gradient case
        policy_loss(lp, lp, adv, mask)
    with torch.no_grad():  # no graph, nothing to get wrong: accepted
        policy_loss(lp, mask=mask, kl_loss_coef=0.1, **kw)
    labels = torch.where(mask, 3, -100)
    hidden, weight = (
        torch.randn(B, T, 4, dtype=torch.float64),
        torch.randn(9, 4, dtype=torch.float64, requires_grad=True),
    )
    kw.pop("token_weights") if name != "token_weights" else None
    with pytest.raises(ValueError, match=f"{name} requires grad"):  # the fused op shares the check
        lmloss.rl.linear_policy_loss(hidden, weight, labels, kl_loss_coef=0.1, **kw)


def test_a_0_1_mask_of_any_dtype_equals_the_bool_mask():
    lp, old, adv, _, _, mask = _batch(11)
    want, _ = policy_loss(lp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    for m in (mask.float(), mask.int(), mask.to(torch.uint8)):
        got, _ = policy_loss(lp, old, adv, m, loss_agg_mode="seq-mean-token-mean")
        assert torch.equal(got, want)
    # verl's 1e-8 in each sequence's count stays in a float64 mask's (it rounds away in float32, where verl adds
    # it to the integer count of a bool mask): tests/test_rl_verl.py checks both against verl
    got, _ = policy_loss(lp, old, adv, mask.double(), loss_agg_mode="seq-mean-token-mean")
    assert not torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=0)
    with pytest.raises(ValueError, match="mask must be bool or hold only 0 and 1; it holds 0.5"):
        token_weights(torch.tensor([1.0, 0.5, 0.0]))


def test_token_weights_checks_ids_horizon_and_cu_seqlens_in_every_mode():
    mask = torch.ones(6, dtype=torch.bool)
    cu = torch.tensor([0, 2, 6])
    with pytest.raises(
        TypeError, match="prompt_ids must be an integer tensor"
    ):  # 0.9 would be truncated to 0
        token_weights(mask, "prompt-mean-token-mean", cu_seqlens=cu, prompt_ids=torch.tensor([0.9, 1.0]))
    with pytest.raises(TypeError, match="sequence_ids must be an integer tensor"):
        policy_loss(torch.zeros(6).double(), torch.zeros(6).double(), torch.ones(6).double(), mask, loss_mode="gspo",
                    sequence_ids=torch.tensor([0.0, 0.9, 1.0, 1.0, 1.0, 1.0]), cu_seqlens=cu)  # fmt: skip
    with pytest.raises(TypeError, match="sequence_ids"):
        lmloss.rl.truncated_is_weights(torch.zeros(6).double(), torch.zeros(6).double(), mask, level="sequence",
                                       sequence_ids=torch.zeros(6))  # fmt: skip
    for bad in (float("inf"), float("nan"), -1.0, 0, True):
        with pytest.raises(ValueError, match="horizon must be a finite number > 0"):
            token_weights(mask.view(2, 3), "seq-mean-token-sum-norm", horizon=bad)
    for mode in ("token-mean", "token-sum", "seq-mean-token-mean"):  # an unused cu_seqlens is checked too
        with pytest.raises(ValueError, match="cu_seqlens covers 5 tokens but there are 6"):
            token_weights(mask, mode, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="prompt_ids is for"):
        token_weights(mask, "token-mean", prompt_ids=torch.tensor([0]))


def test_rollout_weights_of_a_differentiable_policy_are_detached():
    # bypass mode weighs REINFORCE by the *current* policy's ratio to the rollout's: the weights must not
    # carry its gradient (verl computes them under no_grad)
    lp, old, adv, _, _, mask = _batch(12)
    lp = lp.requires_grad_(True)
    for level in ("token", "sequence"):
        for w in (lmloss.rl.truncated_is_weights(lp, old, mask, cap=1.5, level=level),
                  lmloss.rl.masked_is_weights(lp, old, mask, lower=0.5, upper=1.5, level=level)):  # fmt: skip
            assert not w.requires_grad
            loss, _ = policy_loss(lp, old, adv, mask, loss_mode="reinforce", rollout_is_weights=w)
            want = -(adv * lp * w * mask).sum() / mask.sum()
            torch.testing.assert_close(_grads(loss, lp)[0], _grads(want, lp)[0], **REL)


def test_linear_policy_loss_uses_the_given_token_weights():
    # the fused op against policy_loss on the materialized log-probs, with weights no mode produces
    g = torch.Generator().manual_seed(13)
    n, h, v = 10, 4, 7
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[2, 7]] = -100
    mask = labels != -100
    old = -torch.rand(n, generator=g, dtype=torch.float64) - 1.5
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    w = torch.rand(n, generator=g, dtype=torch.float64) * mask
    for mode in ("vanilla", "sapo", "gspo"):
        cu = torch.tensor([0, 4, 10])
        got, _ = lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, loss_mode=mode, token_weights=w,
                                              cu_seqlens=cu, chunk_size=3)  # fmt: skip
        lp = torch.log_softmax(hidden @ weight.T, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
        want, _ = policy_loss(lp, old, adv, mask, loss_mode=mode, token_weights=w, cu_seqlens=cu)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(_grads(got, weight)[0], _grads(want, weight)[0], rtol=1e-10, atol=1e-12)
        default, _ = lmloss.rl.linear_policy_loss(
            hidden, weight, labels, old, adv, loss_mode=mode, cu_seqlens=cu
        )
        assert not torch.isclose(default, got, rtol=1e-3)  # the weights matter in this case
    with pytest.raises(ValueError, match="token_weights and loss_agg_mode='token-sum'"):
        lmloss.rl.linear_policy_loss(
            hidden, weight, labels, old, adv, token_weights=w, loss_agg_mode="token-sum"
        )


def test_pg_mask_drops_the_policy_term_but_keeps_the_denominators():
    lp, old, adv, ref, _, mask = _batch(14)
    keep = torch.rand(B, T, generator=torch.Generator().manual_seed(3)) > 0.5
    got, _ = policy_loss(
        lp, old, adv, mask, pg_mask=keep, ref_logprobs=ref, kl_loss_coef=0.1, kl_loss_type="k1"
    )
    pg = ref_pg("vanilla", lp, old, adv, mask) * keep
    want = ref_agg(pg + 0.1 * (lp - ref), mask, "token-mean")
    torch.testing.assert_close(got, want, **REL)


def test_linear_policy_loss_runs_every_loss_mode_like_policy_loss():
    # the fused op at each objective's default options (it has no dro_beta: "dro" is refused), chunked
    g = torch.Generator().manual_seed(15)
    n, h, v = 12, 4, 7
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[1, 8]] = -100
    mask, cu = labels != -100, torch.tensor([0, 5, 12])
    lp0 = torch.log_softmax(hidden @ weight.detach().T, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    old = lp0 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    for mode in lmloss.rl.LOSS_MODES:
        kw = dict(loss_mode=mode, loss_agg_mode="seq-mean-token-mean", cu_seqlens=cu)
        if mode == "dro":
            with pytest.raises(ValueError, match="dro_beta"):
                lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, **kw)
            continue
        torch.manual_seed(0)
        got, _ = lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, chunk_size=5, **kw)
        lp = torch.log_softmax(hidden @ weight.T, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
        torch.manual_seed(0)
        want, _ = policy_loss(lp, old, adv, mask, **kw)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=mode)
        torch.testing.assert_close(
            _grads(got, weight)[0], _grads(want, weight)[0], rtol=1e-10, atol=1e-12, msg=mode
        )


def _fused_full_kl_case(seed=21):
    g = torch.Generator().manual_seed(seed)
    n, h, v = 6, 4, 7
    d = dict(
        hidden=torch.randn(n, h, generator=g, dtype=torch.float64), weight=torch.randn(v, h, generator=g, dtype=torch.float64),
        labels=torch.randint(0, v, (n,), generator=g), old=-torch.rand(n, generator=g, dtype=torch.float64) - 1.0,
        adv=torch.randn(n, generator=g, dtype=torch.float64), ref_hidden=torch.randn(n, 3, generator=g, dtype=torch.float64),
        ref_weight=torch.randn(v, 3, generator=g, dtype=torch.float64),
    )  # fmt: skip
    return d


def test_kl_importance_weighted_is_refused_with_the_full_kl_in_both_ops():
    d = _fused_full_kl_case()
    with pytest.raises(ValueError, match="kl_importance_weighted"):
        lmloss.rl.linear_policy_loss(d["hidden"], d["weight"], d["labels"], d["old"], d["adv"], kl_loss_type="full",
                                     kl_loss_coef=0.1, ref_hidden=d["ref_hidden"], ref_weight=d["ref_weight"],
                                     kl_importance_weighted=True)  # fmt: skip
    lp, old, adv, _, _, mask = _batch(8)
    with pytest.raises(ValueError, match="kl_importance_weighted"):
        policy_loss(lp, old, adv, mask, kl_loss_type="full", kl_loss_coef=0.1, kl=torch.zeros(B, T),
                    kl_importance_weighted=True)  # fmt: skip
    # accepted with an estimator (it weights that estimate)
    policy_loss(lp, old, adv, mask, kl_loss_type="k3", kl_loss_coef=0.1, ref_logprobs=old, kl_importance_weighted=True)


def test_the_reference_heads_row_count_is_checked_against_the_policys_vocabulary_shard():
    d = _fused_full_kl_case()
    short = d["ref_weight"][:-1]
    with pytest.raises(ValueError, match=r"ref_weight must be \[V_local, H_ref\] with the policy's V_local=7, got \(6, 3\)"):
        lmloss.rl.linear_policy_loss(d["hidden"], d["weight"], d["labels"], d["old"], d["adv"], kl_loss_type="full",
                                     kl_loss_coef=0.1, ref_hidden=d["ref_hidden"], ref_weight=short)  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
def test_the_fused_full_kl_where_the_policy_has_no_mass_on_a_column_is_the_finite_kl(impl):
    """A vocabulary column the policy gives no mass (a -inf bias: a banned token) adds 0 to KL(pi || pi_ref), as
    in plain PyTorch's sum over pi > 0; it came out NaN from the PyTorch kernels (0 * (-inf - z))."""
    g = torch.Generator().manual_seed(50)
    n, h, v = 5, 4, 9
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g).requires_grad_()
    ref_hidden, ref_weight = torch.randn(n, 3, generator=g), torch.randn(v, 3, generator=g)
    bias = torch.zeros(v)
    bias[2] = -math.inf
    labels, old, adv = torch.tensor([0, 1, 3, 4, 5]), -torch.rand(n, generator=g) - 1, torch.randn(n, generator=g)
    loss, metrics = lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, bias=bias, kl_loss_type="full",
                                                 kl_loss_coef=0.1, ref_hidden=ref_hidden, ref_weight=ref_weight,
                                                 impl=impl)  # fmt: skip
    loss.backward()
    log_p = torch.log_softmax(hidden.double() @ weight.detach().double().T + bias.double(), -1)
    log_r = torch.log_softmax(ref_hidden.double() @ ref_weight.double().T, -1)
    p = log_p.exp()
    kl = torch.where(p > 0, p * (log_p - log_r), 0.0).sum(-1)
    torch.testing.assert_close(metrics["kl_loss"].double(), kl.mean(), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(loss) and torch.isfinite(weight.grad).all()
