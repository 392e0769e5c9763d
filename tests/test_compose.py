"""Options that compose through the one loop, each against float64 math written here (one process; TP=2 in
tests/distributed/test_compose_parallel.py):

* the fused policy loss (`lmloss.rl.linear_policy_loss`) under the sampler's kept set: top-k, top-p,
  min-p, and a replayed support: the objective of the renormalised log-probs, gradients on the kept set;
* distillation with a student softcap and a teacher softcap (logits and both heads fused; dense and
  sparse teacher);
* both implementations (Triton under its interpreter here).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import lmloss
from lmloss import sampling
from sampling_support import per_row, vllm_kept

pytestmark = pytest.mark.usefixtures("one_thread")

N, H, V, T = 12, 8, 48, 0.8
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not lmloss.kernels.triton_available(), reason="the Triton kernels need triton installed"))]  # fmt: skip


def _problem(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g) * 1.5
    weight = torch.randn(V, H, generator=g)
    adv = torch.randn(N, generator=g)
    old = torch.randn(N, generator=g) * 0.3 - 2.5
    ref = old + 0.1 * torch.randn(N, generator=g)
    return hidden.to(dtype), weight.to(dtype), adv.to(dtype), old.to(dtype), ref.to(dtype), g


POLICY = dict(clip_ratio=0.2, clip_ratio_c=3.0, kl_loss_type="k3", kl_loss_coef=0.05, entropy_coeff=0.01)
KEPT = {
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "all_three": dict(top_k=12, top_p=0.9, min_p=0.02),
    "support": None,  # replayed: the ids a set of the engine's kept
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("softcap", [None, 4.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("case", list(KEPT))
def test_fused_policy_loss_under_the_kept_set_matches_float64(case, softcap, impl):
    """`linear_policy_loss` with the sampler's truncation: loss, hidden and weight gradients equal
    `policy_loss` of float64 log-probs and entropies of the renormalised kept set (kept-set mask from vLLM's
    rule, or the support ids), labels drawn from the kept set; a label outside it is left out of the
    objective (its term is 0; the token-mean's denominator, from the caller's mask, still counts it)."""
    dtype = torch.float64 if impl == "torch" else torch.float32
    hidden, weight, adv, old, ref, g = _problem(3, dtype)
    z = hidden.double() @ weight.double().T
    y = (softcap * torch.tanh(z / softcap) if softcap else z) / T
    kw = KEPT[case]
    if kw is None:  # a support of 9 ids per token, the label among them (but token 4's)
        support = torch.stack([torch.randperm(V, generator=g)[:9] for _ in range(N)])
        kept = torch.zeros(N, V, dtype=torch.bool).scatter_(1, support, True)
        kw = {"support": support}
    else:
        kept = vllm_kept(y, **{k: per_row(v, N) for k, v in kw.items()})
    labels = torch.multinomial(kept.double(), 1, generator=g).squeeze(1)
    labels[4] = int((~kept[4]).nonzero()[0])  # outside the kept set: warned, left out of the objective
    labels[7] = -100
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with pytest.warns(sampling.KeptSetWarning, match="1 label"):
        loss, metrics = lmloss.rl.linear_policy_loss(
            h, w, labels, old, adv, ref_logprobs=ref, temperature=T, softcap=softcap, chunk_size=5, impl=impl,
            **POLICY, **kw,
        )  # fmt: skip
    loss.backward()

    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    zr = hr @ wr.T
    yr = ((softcap * torch.tanh(zr / softcap)) if softcap else zr) / T
    logp = yr.masked_fill(~kept, -math.inf).log_softmax(-1)
    p = logp.exp()
    ent = -(p * logp.masked_fill(~kept, 0.0)).sum(-1)
    valid = labels != -100
    mask = valid & kept.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    lp = torch.where(mask, logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
    # token-mean over the batch's response tokens (the mask the caller passed): the left-out token still
    # counts in the denominator, its term is 0
    weights = mask.double() / valid.sum()
    expected, expected_metrics = lmloss.rl.policy_loss(
        lp, old.double(), adv.double(), mask, ref_logprobs=ref.double(), entropy=ent, token_weights=weights, **POLICY
    )
    expected.backward()
    tol = dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(loss.double(), expected.detach(), **tol)
    torch.testing.assert_close(h.grad.double(), hr.grad, **tol)
    torch.testing.assert_close(w.grad.double(), wr.grad, **tol)
    # the metrics are those of the tokens in the objective: the loss shares (pg_loss, kl_loss, entropy_loss,
    # which add up to the loss) and the means over the tokens whose label is in the kept set
    assert set(metrics) == set(expected_metrics)
    for key, value in expected_metrics.items():
        torch.testing.assert_close(metrics[key].double(), value.double(), **tol, msg=key)


@pytest.mark.parametrize("loss_mode, agg", [("gspo", "seq-mean-token-mean"), ("kl_cov", "token-mean")])
def test_fused_policy_loss_of_a_whole_sequence_under_the_kept_set_keeps_the_callers_denominators(loss_mode, agg):
    """The objectives that need every token's log-prob first (sequence ratios, covariance selections) leave a
    token whose label is outside the kept set out of the objective like the token objectives do: its term is
    0, and the aggregation's denominators are those of the caller's mask, which still counts it."""
    b, t = 3, N // 3
    hidden, weight, adv, old, _, g = _problem(4)
    y = (hidden @ weight.T) / T
    kept = vllm_kept(y, top_k=per_row(7, N))
    labels = torch.multinomial(kept.double(), 1, generator=g).squeeze(1)
    labels[5] = int((~kept[5]).nonzero()[0])  # outside the kept set: left out of the objective
    labels[10] = -100
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    options = dict(loss_mode=loss_mode, kl_cov_ratio=0.2, entropy_coeff=0.01)
    with pytest.warns(sampling.KeptSetWarning, match="1 label"):
        loss, metrics = lmloss.rl.linear_policy_loss(
            h.view(b, t, H), w, labels.view(b, t), old.view(b, t), adv.view(b, t), loss_agg_mode=agg,
            temperature=T, chunk_size=5, top_k=7, **options,
        )  # fmt: skip
    loss.backward()

    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp = ((hr @ wr.T) / T).masked_fill(~kept, -math.inf).log_softmax(-1)
    ent = -(logp.exp() * logp.masked_fill(~kept, 0.0)).sum(-1)
    valid = labels != -100
    mask = valid & kept.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    lp = torch.where(mask, logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
    weights = lmloss.rl.token_weights(valid.view(b, t), agg, dtype=torch.float64)  # the caller's mask
    expected, expected_metrics = lmloss.rl.policy_loss(
        lp.view(b, t), old.view(b, t), adv.view(b, t), mask.view(b, t), token_weights=weights,
        entropy=ent.view(b, t), **options,
    )  # fmt: skip
    expected.backward()
    tol = dict(rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(loss, expected.detach(), **tol)
    torch.testing.assert_close(h.grad, hr.grad, **tol)
    torch.testing.assert_close(w.grad, wr.grad, **tol)
    for key, value in expected_metrics.items():
        torch.testing.assert_close(metrics[key], value, **tol, msg=key)


def _divergence(ls, lt, beta):
    ps, pt = ls.exp(), lt.exp()
    if beta == 0.0:
        return (pt * (lt - ls)).sum(-1)
    if beta == 1.0:
        return (ps * (ls - lt)).sum(-1)
    lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    return beta * (pt * (lt - lm)).sum(-1) + (1 - beta) * (ps * (ls - lm)).sum(-1)


def _capped(x, cap):
    return cap * torch.tanh(x / cap) if cap else x


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("path", ["logits", "fused"])
def test_distillation_with_student_and_teacher_softcaps_matches_float64(path, beta, impl):
    """``softcap=`` caps the student's logits (through the kernels' transform and its gradient),
    ``teacher_softcap=`` the teacher's, each before the temperature."""
    dtype = torch.float64 if impl == "torch" else torch.float32
    hidden, weight, *_, g = _problem(5, dtype)
    t_hidden = torch.randn(N, 6, generator=g).to(dtype)
    t_weight = torch.randn(V, 6, generator=g).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[2] = -100
    cap_s, cap_t = 3.0, 2.0
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    common = dict(beta=beta, temperature=T, softcap=cap_s, teacher_softcap=cap_t, chunk_size=5, impl=impl)
    if path == "logits":
        logits = (h @ w.T).detach().requires_grad_()
        loss = lmloss.distillation_loss(logits, t_hidden @ t_weight.T, labels, **common)
        loss.backward()
        got_grads = [logits.grad]
    else:
        loss = lmloss.linear_distillation_loss(h, w, t_hidden, t_weight, labels, **common)
        loss.backward()
        got_grads = [h.grad, w.grad]

    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    zr = (hr @ wr.T).detach().requires_grad_() if path == "logits" else hr @ wr.T
    ls = (_capped(zr, cap_s) / T).log_softmax(-1)
    lt = (_capped(t_hidden.double() @ t_weight.double().T, cap_t) / T).log_softmax(-1)
    valid = labels != -100
    expected = torch.where(valid, _divergence(ls, lt, beta), 0.0).sum() / valid.sum()
    expected.backward()
    ref_grads = [zr.grad] if path == "logits" else [hr.grad, wr.grad]
    tol = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-6)
    torch.testing.assert_close(loss.double(), expected.detach(), **tol)
    for got, ref in zip(got_grads, ref_grads):
        torch.testing.assert_close(got.double(), ref, **tol)


@pytest.mark.parametrize("tail", [True, False])
def test_sparse_teacher_with_a_student_softcap_matches_float64(tail):
    """A top-k teacher against a softcapped student: the student's log-probs at the ids (and its tail) come
    from the capped logits, and so does the gradient's slope."""
    hidden, weight, *_, g = _problem(9)
    logits = (hidden @ weight.T).requires_grad_()
    k, cap = 5, 3.0
    teacher = torch.randn(N, V, generator=g, dtype=torch.float64).log_softmax(-1)
    top = teacher.topk(k, dim=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = lmloss.distillation_loss(
            logits, None, teacher_topk=(top.indices, top.values), tail=tail, softcap=cap, reduction="sum",
            chunk_size=5,
        )  # fmt: skip
    loss.backward()
    x = logits.detach().clone().requires_grad_()
    ls_all = _capped(x, cap).log_softmax(-1)
    ls = ls_all.gather(1, top.indices)
    lq = top.values
    if tail:
        q_tail = 1 - lq.exp().sum(-1)
        p_tail = 1 - ls.exp().sum(-1)
        expected = (lq.exp() * (lq - ls)).sum(-1) + q_tail * (q_tail.log() - p_tail.log())
    else:
        lq = lq.log_softmax(-1)
        ls = ls.log_softmax(-1)
        expected = (lq.exp() * (lq - ls)).sum(-1)
    expected.sum().backward()
    torch.testing.assert_close(loss, expected.sum().detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(logits.grad, x.grad, rtol=1e-9, atol=1e-12)


def test_teacher_softcap_with_a_sparse_teacher_is_refused():
    logits = torch.randn(3, 10)
    ids = torch.zeros(3, 2, dtype=torch.long)
    ids[:, 1] = 1
    with pytest.raises(ValueError, match="teacher_softcap"):
        lmloss.distillation_loss(logits, None, teacher_topk=(ids, torch.full((3, 2), -1.0)), teacher_softcap=2.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_token_entropy_over_a_replayed_support_matches_float64(impl):
    """`token_entropy(support=...)`: the entropy of the softmax renormalised over the replayed ids (-1 pads)."""
    dtype = torch.float64 if impl == "torch" else torch.float32
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(N, V, generator=g) * 2).to(dtype).requires_grad_()
    support = torch.stack([torch.randperm(V, generator=g)[:8] for _ in range(N)])
    support[0, 5:] = -1
    h = lmloss.token_entropy(x, support=support, temperature=T, softcap=5.0, impl=impl)
    h.sum().backward()
    xr = x.detach().double().requires_grad_()
    keep = torch.zeros(N, V, dtype=torch.bool).scatter_(1, support.clamp(min=0), True)
    keep[0] = False
    keep[0, support[0, :5]] = True
    logp = (_capped(xr, 5.0) / T).masked_fill(~keep, -math.inf).log_softmax(-1)
    ref = -(logp.exp() * logp.masked_fill(~keep, 0.0)).sum(-1)
    ref.sum().backward()
    tol = dict(rtol=1e-10, atol=1e-12) if impl == "torch" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.double(), ref.detach(), **tol)
    torch.testing.assert_close(x.grad.double(), xr.grad, **tol)


def _exact_kl(z, z_ref, cap, t):
    lp = (_capped(z, cap) / t).log_softmax(-1) if cap else (z / t).log_softmax(-1)
    lq = (_capped(z_ref, cap) / t).log_softmax(-1) if cap else (z_ref / t).log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
@pytest.mark.parametrize("softcap", [None, 4.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("entropy_coeff", [0.01, 0.0], ids=["entropy", "no-entropy"])
def test_full_kl_in_the_fused_policy_loss_matches_float64(entropy_coeff, softcap, loss_mode, impl):
    """``kl_loss_type="full"`` with the reference head: the KL term is the exact per-token KL(pi || pi_ref)
    over the vocabulary (float64 here), aggregated like the other terms; hidden and weight gradients
    equal autograd's through it (gspo: the two-pass path)."""
    dtype = torch.float64 if impl == "torch" else torch.float32
    hidden, weight, adv, old, _, g = _problem(13, dtype)
    r_hidden = torch.randn(N, 5, generator=g).to(dtype)
    r_weight = torch.randn(V, 5, generator=g).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[3] = -100
    cu = torch.tensor([0, 5, N])
    opts = dict(loss_mode=loss_mode, kl_loss_type="full", kl_loss_coef=0.3, entropy_coeff=entropy_coeff, temperature=T,
                softcap=softcap, cu_seqlens=cu if loss_mode == "gspo" else None)  # fmt: skip
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = lmloss.rl.linear_policy_loss(
        h, w, labels, old, adv, ref_hidden=r_hidden, ref_weight=r_weight, chunk_size=5, impl=impl, **opts
    )
    loss.backward()

    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = hr @ wr.T
    y = (_capped(z, softcap) if softcap else z) / T
    logp = y.log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1)
    mask = labels != -100
    lp = torch.where(mask, logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
    kl = _exact_kl(z, r_hidden.double() @ r_weight.double().T, softcap, T)
    opts.pop("temperature")
    opts.pop("softcap")
    expected, _ = lmloss.rl.policy_loss(lp, old.double(), adv.double(), mask, entropy=ent, kl=kl, **opts)
    expected.backward()
    tol = dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(loss.double(), expected.detach(), **tol)
    torch.testing.assert_close(h.grad.double(), hr.grad, **tol)
    torch.testing.assert_close(w.grad.double(), wr.grad, **tol)
    kl_ref = (torch.where(mask, kl, 0.0).sum() / mask.sum()).item()
    assert math.isclose(float(metrics["kl_loss"]), kl_ref, rel_tol=1e-4)


def test_full_kl_from_logits_is_the_exact_kl_and_feeds_policy_loss():
    """`lmloss.rl.full_kl`: per-token KL(pi || pi_ref) over the vocabulary (float64 reference), the
    reference detached; with `policy_loss(kl_loss_type="full", kl=...)` the gradient reaches the logits."""
    g = torch.Generator().manual_seed(17)
    x = torch.randn(N, V, generator=g, dtype=torch.float64, requires_grad=True)
    x_ref = torch.randn(N, V, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[0] = -100
    kl = lmloss.rl.full_kl(x, x_ref, labels, temperature=T, softcap=3.0, chunk_size=5)
    expected = torch.where(labels != -100, _exact_kl(x, x_ref.detach(), 3.0, T), 0.0)
    torch.testing.assert_close(kl, expected, rtol=1e-10, atol=1e-12)
    lp = lmloss.token_logprobs(x, labels, temperature=T, softcap=3.0)
    loss, _ = lmloss.rl.policy_loss(
        lp, lp.detach(), torch.ones(N, dtype=torch.float64), labels != -100, kl_loss_type="full", kl_loss_coef=0.5, kl=kl
    )
    loss.backward()
    assert x.grad is not None and x_ref.grad is None


def test_full_kl_arguments_are_checked_naming_them():
    hidden, weight, adv, old, ref, _ = _problem(1)
    labels = torch.zeros(N, dtype=torch.long)
    with pytest.raises(ValueError, match="ref_hidden and ref_weight"):
        lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, kl_loss_type="full", kl_loss_coef=0.1)
    with pytest.raises(ValueError, match="ref_logprobs is for the estimators"):
        lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, kl_loss_type="full", ref_logprobs=ref)
    with pytest.raises(ValueError, match="does not combine"):
        lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, kl_loss_type="full", kl_loss_coef=0.1,
                                     ref_hidden=hidden, ref_weight=weight, top_k=5)  # fmt: skip
    with pytest.raises(ValueError, match="kl_loss_type='full'"):
        lmloss.rl.policy_loss(old, old, adv, torch.ones(N, dtype=torch.bool), kl=old)


@pytest.mark.parametrize("impl", IMPLS)
def test_full_kl_with_a_non_finite_reference_at_an_ignored_token_leaves_the_gradients_untouched(impl):
    """An ignored token (label -100) whose reference row is NaN or inf adds nothing: the loss and every
    gradient equal those with a finite reference row there."""
    hidden, weight, adv, old, _, g = _problem(17, torch.float32)
    r_hidden, r_weight = torch.randn(N, 5, generator=g), torch.randn(V, 5, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[2] = -100
    outs = []
    for bad in (0.0, math.nan, math.inf):
        rh = r_hidden.clone()
        rh[2] = bad
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, _ = lmloss.rl.linear_policy_loss(h, w, labels, old, adv, ref_hidden=rh, ref_weight=r_weight,
                                               kl_loss_type="full", kl_loss_coef=0.3, temperature=T, impl=impl)  # fmt: skip
        loss.backward()
        outs.append((loss.detach(), h.grad, w.grad))
    for got in outs[1:]:
        for a, b in zip(got, outs[0]):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=0, atol=0)
