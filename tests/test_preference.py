"""`lmloss.preference` without TRL: the spec's checks and agreement vector, LD-DPO's weights against the
rule written out here, packed layouts against padded ones, a precomputed reference, the stated differences
from TRL, and the errors. (Parity with TRL's own code: tests/test_preference_trl.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmloss.preference import (
    PreferenceSpec,
    per_token_weights,
    preference_loss,
    preference_loss_from_logprobs,
    sequence_stats,
)
from lmloss.preference.spec import AGREEMENT_FIELDS, LOSS_TYPES


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(family="simpo"), "family"),
        (dict(loss_type="kto"), "loss_type"),
        (dict(loss_type=("sigmoid", "sigmoid")), "loss_type"),
        (dict(family="cpo", loss_type=("sigmoid", "hinge")), "loss_type"),
        (dict(loss_type=("sigmoid", "ipo"), loss_weights=(1.0,)), "loss_weights"),
        (dict(beta=0.0), "beta"),
        (dict(beta=float("nan")), "beta"),
        (dict(loss_type="exo_pair"), "label_smoothing"),
        (dict(loss_type="robust", label_smoothing=0.5), "label_smoothing"),
        (dict(loss_type="bco_pair", f_divergence="forward_kl"), "f_divergence"),
        (dict(f_divergence="kl"), "f_divergence"),
        (dict(ld_alpha=1.5), "ld_alpha"),
        (dict(family="kto", ld_alpha=0.5), "ld_alpha"),
        (dict(loss_type="aot", use_weighting=True), "use_weighting"),
        (dict(discopop_tau=0.0), "discopop_tau"),
        (dict(family="kto", desirable_weight=-1.0), "desirable_weight"),
    ],
)  # fmt: skip
def test_spec_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"PreferenceSpec.{field}"):
        PreferenceSpec(**kwargs)


def test_spec_defaults_sugar_and_agreement_vector():
    assert PreferenceSpec().loss_type == ("sigmoid",)
    assert PreferenceSpec(family="kto").loss_type == ("kto",)
    alphapo = PreferenceSpec(family="cpo", loss_type="alphapo", alpha=0.3)  # TRL's CPOConfig sugar
    assert alphapo.loss_type == ("simpo",) and alphapo.cpo_alpha == 0.0
    every = PreferenceSpec(loss_type=LOSS_TYPES["dpo"], label_smoothing=0.1)
    specs = [PreferenceSpec(), every, alphapo, PreferenceSpec(beta=0.1 + 1e-12), PreferenceSpec(ld_alpha=0.0),
             PreferenceSpec(loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.5))]  # fmt: skip
    vectors = [s.agreement_vector() for s in specs]
    assert all(v.dtype == torch.int64 and v.shape == (len(AGREEMENT_FIELDS),) for v in vectors)
    for i in range(len(vectors)):  # equal vectors <=> equal specs
        for j in range(len(vectors)):
            assert torch.equal(vectors[i], vectors[j]) == (i == j) == (specs[i] == specs[j])
    assert torch.equal(PreferenceSpec(loss_type="ipo").agreement_vector(), PreferenceSpec(loss_type=["ipo"]).agreement_vector())


def ld_reference(mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """LD-DPO's weights as its paper states them: a completion's tokens up to its pair's shorter length weigh
    1, the rest alpha (mask [2B, T], chosen rows first)."""
    rows = mask.tolist()
    w = [[0.0] * len(r) for r in rows]
    b = len(rows) // 2
    for i in range(b):
        shared = min(sum(rows[i]), sum(rows[b + i]))
        for row in (i, b + i):
            k = 0
            for t, counted in enumerate(rows[row]):
                if counted:
                    k += 1
                    w[row][t] = 1.0 if k <= shared else alpha
    return torch.tensor(w, dtype=torch.float64)


def batch(b=3, t=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(1, 4, (2 * b,), generator=g)
    length = torch.randint(0, t - 3, (2 * b,), generator=g)
    pos = torch.arange(t)
    mask = (pos >= start[:, None]) & (pos < (start + length)[:, None])
    logps = -torch.rand(2 * b, t, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(2 * b, t, generator=g, dtype=torch.float64) * 3
    return logps, ref, mask


def test_ld_weights_match_the_rule_padded_and_packed():
    logps, ref, mask = batch(b=4, t=11)
    spec = PreferenceSpec(ld_alpha=0.25)
    want = ld_reference(mask, 0.25)
    assert want[mask].lt(1).any() and want[mask].eq(1).any()  # both kinds of tokens are present
    torch.testing.assert_close(per_token_weights(mask, spec, dtype=torch.float64), want, rtol=0, atol=0)
    cu = torch.arange(0, mask.numel() + 1, mask.shape[1])
    packed = per_token_weights(mask.reshape(-1), spec, cu_seqlens=cu, dtype=torch.float64)
    torch.testing.assert_close(packed, want.reshape(-1), rtol=0, atol=0)
    assert torch.equal(per_token_weights(mask, PreferenceSpec()), mask.float())


def pack(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's tokens from its first to its last counted position (padding dropped), concatenated."""
    return torch.cat([row[: int(m.nonzero().max()) + 1] if m.any() else row[:0] for row, m in zip(t, mask)])


@pytest.mark.parametrize(
    "spec",
    [PreferenceSpec(loss_type=("sigmoid", "ipo", "sft"), ld_alpha=0.5), PreferenceSpec(family="orpo", beta=0.3),
     PreferenceSpec(family="cpo", loss_type="simpo", alpha=0.2)],
    ids=["dpo-ld-mpo", "orpo", "cpo"],
)  # fmt: skip
def test_packed_layouts_equal_the_padded_one(spec):
    logps, ref, mask = batch()
    logps.requires_grad_(True)
    sft_mask = mask | (torch.arange(mask.shape[1]) < 1)  # a token more in the NLL term (ORPO's prompt)
    padded = preference_loss_from_logprobs(
        logps, mask, spec, ref_token_logps=ref if spec.needs_reference else None, sft_mask=sft_mask
    )
    (want,) = torch.autograd.grad(padded.loss, logps)
    lengths = torch.tensor([int(m.nonzero().max()) + 1 if m.any() else 0 for m in sft_mask])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    flat = pack(logps, sft_mask)
    args = dict(ref_token_logps=pack(ref, sft_mask) if spec.needs_reference else None, sft_mask=pack(sft_mask, sft_mask))
    by_cu = preference_loss_from_logprobs(flat, pack(mask, sft_mask), spec, cu_seqlens=cu, **args)
    ids = torch.arange(len(lengths)).repeat_interleave(lengths)
    by_ids = preference_loss_from_logprobs(flat, pack(mask, sft_mask), spec, sequence_ids=ids, **args)
    for out in (by_cu, by_ids):
        torch.testing.assert_close(out.loss, padded.loss, rtol=1e-14, atol=0)
        (got,) = torch.autograd.grad(out.loss, logps)
        torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
        assert out.metrics.keys() == padded.metrics.keys()


def test_precomputed_reference_sums_equal_per_token_reference():
    logps, ref, mask = batch()
    spec = PreferenceSpec(loss_type=("sigmoid", "apo_down"), ld_alpha=0.5)
    per_token = preference_loss_from_logprobs(logps, mask, spec, ref_token_logps=ref)
    sums = (per_token_weights(mask, spec, dtype=torch.float64) * ref).sum(1)
    precomputed = preference_loss_from_logprobs(logps, mask, spec, ref_logps=sums)
    torch.testing.assert_close(precomputed.loss, per_token.loss, rtol=1e-15, atol=0)


def test_dpo_sigmoid_and_sft_against_the_formula_and_sft_with_wpo():
    """The formulas written out: DPO's -log σ(β Δ), the chosen tokens' mean NLL, WPO's weight
    exp(mean(logp - log Σp²)); with WPO the sft term is mean(w_c w_r) · nll (TRL raises there: it scales an
    expanded tensor in place)."""
    logps, ref, mask = batch()
    lssp = -torch.rand(logps.shape, dtype=torch.float64)
    spec = PreferenceSpec(loss_type=("sigmoid", "sft"), loss_weights=(0.7, 0.3), beta=0.4, use_weighting=True)
    out = preference_loss_from_logprobs(logps, mask, spec, ref_token_logps=ref, log_sum_sq_probs=lssp)
    m = mask.double()
    s, r = (logps * m).sum(1), (ref * m).sum(1)
    b = logps.shape[0] // 2
    delta = (s[:b] - r[:b]) - (s[b:] - r[b:])
    w = torch.exp(((logps - lssp) * m).sum(1) / m.sum(1).clamp(min=1))
    pair_w = w[:b] * w[b:]
    nll = -(logps[:b] * m[:b]).sum() / m[:b].sum()
    want = 0.7 * (-F.logsigmoid(0.4 * delta) * pair_w).mean() + 0.3 * (pair_w * nll).mean()
    torch.testing.assert_close(out.loss, want, rtol=1e-14, atol=0)
    assert out.metrics["rewards/margins"].item() == pytest.approx((0.4 * delta).mean().item(), rel=1e-13)


def test_stated_differences_from_trl_empty_completions_and_alphapo():
    logps, ref, mask = batch()
    mask[0] = False  # an empty chosen completion: TRL's ORPO / CPO averages are 0 / 0 = nan there
    for spec in (PreferenceSpec(family="orpo"), PreferenceSpec(family="cpo", loss_type="ipo")):
        assert torch.isfinite(preference_loss_from_logprobs(logps, mask, spec).loss)
    # AlphaPO's reward (1 - p^-α) / α where p = exp(logp) underflows: TRL's p.pow(-α) is inf, lmloss's finite
    stats = sequence_stats(torch.full((2, 1), -800.0, dtype=torch.float64), torch.ones(2, 1, dtype=torch.bool),
                           PreferenceSpec(family="cpo", cpo_alpha=0.0))  # fmt: skip
    assert math.isinf(torch.exp(torch.tensor(-800.0, dtype=torch.float64)).pow(-0.1).item())
    out = preference_loss(stats, PreferenceSpec(family="cpo", alpha=0.1, cpo_alpha=0.0))
    assert torch.isfinite(out.loss) and torch.isfinite(out.metrics["rewards/chosen"])


def test_kto_kl_is_clamped_constant_and_needed():
    g = torch.Generator().manual_seed(3)
    logps = -torch.rand(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(6, 5, dtype=torch.bool)
    desirable = torch.tensor([True, False, True, True, False, True])
    spec = PreferenceSpec(family="kto", beta=0.5)
    kl_stats = sequence_stats(-torch.rand(6, 5, generator=g, dtype=torch.float64), mask, spec,
                              ref_token_logps=-torch.rand(6, 5, generator=g, dtype=torch.float64) - 1)  # fmt: skip
    out = preference_loss_from_logprobs(logps, mask, spec, ref_token_logps=logps.detach() * 0.9,
                                        desirable=desirable, kl_stats=kl_stats)  # fmt: skip
    kl = (kl_stats.logps - kl_stats.ref_logps).mean().clamp(min=0)
    assert kl > 0 and out.metrics["kl"].item() == pytest.approx(kl.item(), rel=1e-15)
    lr = (logps * 0.1).sum(1)
    want = torch.cat([1 - torch.sigmoid(0.5 * (lr[desirable] - kl)), 1 - torch.sigmoid(0.5 * (kl - lr[~desirable]))]).mean()
    torch.testing.assert_close(out.loss, want, rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="kl_logps"):
        preference_loss_from_logprobs(logps, mask, spec, ref_token_logps=logps.detach(), desirable=desirable)


def test_errors_name_what_is_missing():
    logps, ref, mask = batch()
    with pytest.raises(ValueError, match="ref_logps"):
        preference_loss_from_logprobs(logps, mask, PreferenceSpec())
    with pytest.raises(ValueError, match="2B sequences"):
        preference_loss_from_logprobs(logps[:5], mask[:5], PreferenceSpec(family="orpo"))
    with pytest.raises(ValueError, match="desirable"):
        preference_loss_from_logprobs(logps, mask, PreferenceSpec(family="kto", loss_type="apo_zero_unpaired"), ref_token_logps=ref)
    with pytest.raises(ValueError, match="log_sum_sq_probs"):
        preference_loss_from_logprobs(logps, mask, PreferenceSpec(use_weighting=True), ref_token_logps=ref)
    with pytest.raises(ValueError, match="labels != ignore_index"):
        per_token_weights(torch.tensor([[-100, 5, 7], [-100, 2, -100]]), PreferenceSpec())
    with pytest.raises(ValueError, match="mask must have the shape"):
        sequence_stats(logps, mask[:, :-1], PreferenceSpec())
    with pytest.raises(TypeError, match="spec"):
        preference_loss(sequence_stats(logps, mask, PreferenceSpec(family="orpo")), {"family": "orpo"})


def test_low_precision_log_probs_are_summed_in_float32():
    logps, ref, mask = batch()
    spec = PreferenceSpec()
    half = logps.to(torch.bfloat16).requires_grad_(True)
    stats = sequence_stats(half, mask, spec, ref_token_logps=ref.to(torch.bfloat16))
    assert stats.logps.dtype == torch.float32
    want = (half.detach().float() * mask).sum(1)
    torch.testing.assert_close(stats.logps, want, rtol=1e-6, atol=1e-6)
    preference_loss(stats, spec).loss.backward()
    assert half.grad.dtype == torch.bfloat16 and half.grad[mask].ne(0).all()
