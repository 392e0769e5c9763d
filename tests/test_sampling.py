"""Log-probs under the rollout engine's truncation (top-k / top-p / min-p), one process.

The reference is vLLM's sampler written out in float64 here: temperature, min-p on the probabilities,
then ``apply_top_k_top_p`` over an ascending sort (top-k keeps values >= the k-th largest, top-p drops
the prefix whose cumulative probability is <= 1 - p and always keeps the last). One documented
difference: all tokens equal to the smallest top-p-kept value are kept (vLLM's choice among such ties
follows its sort order); the reference applies the same rule.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import pytest
import torch

import lmloss
from lmloss import sampling
from sampling_support import per_row, vllm_kept

pytestmark = pytest.mark.usefixtures("one_thread")

INF = math.inf


def kept_set_of(logits, temperature, **kw) -> torch.Tensor:
    """The op's kept set, read off as the finite log-probs of every label of every row."""
    n, v = logits.shape
    rows = logits.repeat_interleave(v, dim=0)
    labels = torch.arange(v).repeat(n)
    expanded = {k: (t.repeat_interleave(v) if isinstance(t, torch.Tensor) else t) for k, t in kw.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sampling.KeptSetWarning)
        lp = lmloss.token_logprobs(rows, labels, temperature=temperature, chunk_size=1000, **expanded)
    return torch.isfinite(lp).view(n, v)


def make_logits(n, v, seed, dtype=torch.float32, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g) * spread).to(dtype)


CASES = {
    "top_k": dict(top_k=20),
    "top_p": dict(top_p=0.9),
    "min_p": dict(min_p=0.05),
    "all_three": dict(top_k=60, top_p=0.8, min_p=0.01),
    "per_token": dict(
        top_k=torch.tensor([1, 5, 600, 40] * 2),
        top_p=torch.tensor([0.5, 1.0, 0.95, 0.3] * 2),
        min_p=torch.tensor([0.0, 0.1, 0.0, 0.02] * 2),
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_set_equals_vllm_float64_reference(case, dtype):
    kw = CASES[case]
    logits = make_logits(8, 400, seed=1, dtype=dtype)
    ref = vllm_kept(logits.double() / 0.5, **{k: per_row(v, 8) for k, v in kw.items()})
    assert torch.equal(kept_set_of(logits, 0.5, **kw), ref)


def test_top_p_kept_set_over_a_wide_vocabulary_matches_the_reference():
    # thousands of columns per row: many tokens per histogram bin around the crossing
    logits = make_logits(16, 5000, seed=2, spread=1.0)
    top_p = torch.linspace(0.05, 0.99, 16)
    y = logits.double() * 2.0  # temperature 0.5: exact in fp32
    ref = vllm_kept(y, top_p=top_p)
    # the most likely token as each label (always kept): an ignored label would give the row 0 everywhere
    lp = lmloss.token_logprobs(
        logits, logits.argmax(-1), temperature=0.5, top_p=top_p, return_log_kept_mass=True
    )
    # the kept mass pins the kept set down: log of the reference set's probability
    expected = torch.logsumexp(y.masked_fill(~ref, -INF), -1) - torch.logsumexp(y, -1)
    torch.testing.assert_close(lp[1].double(), expected, rtol=0, atol=1e-5)


def reference_outputs(logits, labels, temperature, kept, ignore_index=-100):
    """float64 log-probs and entropy of the renormalised kept set (both 0 at an ignored label), and the
    logits' gradient of ``sum(u * logprob) + sum(w * entropy)`` (dropped labels: no gradient)."""
    x = logits.detach().double().requires_grad_()
    logp = (x / temperature).masked_fill(~kept, -INF).log_softmax(-1)
    valid = labels != ignore_index
    lp = logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    lp = torch.where(valid, lp, 0.0)
    p = logp.exp()
    ent = torch.where(valid, -(p * logp.masked_fill(~kept, 0.0)).sum(-1), 0.0)
    return x, lp, ent


VALUE_CASES = [
    *[(case, dtype, "torch") for dtype in (torch.float32, torch.bfloat16)
      for case in ("top_k", "top_p", "all_three", "per_token")],
    # the Triton kernels take the kept-set threshold too (under the interpreter here)
    ("all_three", torch.float32, "triton"),
    ("per_token", torch.bfloat16, "triton"),
]  # fmt: skip


@pytest.mark.parametrize("case, dtype, impl", VALUE_CASES)
def test_values_and_gradients_match_float64_masked_log_softmax(case, dtype, impl):
    if impl == "triton":
        pytest.importorskip("triton", reason="the Triton kernels need triton installed")
    kw = CASES[case]
    n, v, temperature = 8, 400, 0.5
    logits = make_logits(n, v, seed=3, dtype=dtype)
    kept = vllm_kept(logits.double() / temperature, **{k: per_row(t, n) for k, t in kw.items()})
    # labels sampled from the kept set (what an engine returns), one ignored, one outside the set
    g = torch.Generator().manual_seed(4)
    labels = torch.multinomial(kept.double(), 1, generator=g).squeeze(1)
    labels[2] = -100
    labels[5] = int((~kept[5]).nonzero()[0])
    u = torch.randn(n, generator=g)
    w = torch.randn(n, generator=g)

    x = logits.clone().requires_grad_()
    with pytest.warns(sampling.KeptSetWarning, match="1 label"):
        lp, ent = lmloss.token_logprobs(
            x, labels, temperature=temperature, return_entropy=True, chunk_size=5, impl=impl, **kw
        )
    (torch.where(torch.isinf(lp), 0.0, lp) * u + ent * w).sum().backward()

    xr, lp_ref, ent_ref = reference_outputs(logits, labels, temperature, kept)
    (torch.where(torch.isinf(lp_ref), 0.0, lp_ref) * u.double() + ent_ref * w.double()).sum().backward()
    assert lp[5] == -INF and lp_ref[5] == -INF
    assert lp[2] == 0.0
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp.double(), lp_ref, **tol)
    torch.testing.assert_close(ent.double(), ent_ref, **tol)
    grad_tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else tol
    torch.testing.assert_close(x.grad.double(), xr.grad.to(dtype).double(), **grad_tol)
    assert torch.all(x.grad[~kept] == 0)


def test_token_entropy_is_the_entropy_of_the_truncated_distribution():
    logits = make_logits(10, 300, seed=5)
    kept = vllm_kept(logits.double(), top_k=per_row(30, 10), top_p=per_row(0.7, 10))
    logp = logits.double().masked_fill(~kept, -INF).log_softmax(-1)
    expected = -(logp.exp() * logp.masked_fill(~kept, 0.0)).sum(-1)
    torch.testing.assert_close(lmloss.token_entropy(logits, top_k=30, top_p=0.7).double(), expected)


@pytest.mark.parametrize("kw", [dict(top_k=600), dict(top_k=10**9), dict(top_p=1.0), dict(min_p=0.0)])
def test_parameters_that_cut_nothing_give_the_full_softmax(kw):
    logits = make_logits(8, 600, seed=6)
    labels = torch.randint(0, 600, (8,), generator=torch.Generator().manual_seed(0))
    x = logits.clone().requires_grad_()
    lp, mass = lmloss.token_logprobs(x, labels, temperature=2.0, return_log_kept_mass=True, **kw)
    lp.sum().backward()
    xr = logits.double().requires_grad_()
    ref = (xr / 2.0).log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
    ref.sum().backward()
    torch.testing.assert_close(lp.double(), ref)
    torch.testing.assert_close(x.grad.double(), xr.grad)
    assert torch.all(mass.abs() < 1e-6)


def test_ties_at_the_top_k_boundary_are_all_kept():
    # values 5, 4, 3, 3, 3, 2, ...: top_k=3 keeps the three tied 3s too (vLLM keeps values >= the k-th)
    logits = torch.tensor([[5.0, 3.0, 4.0, 3.0, 2.0, 3.0, 1.0, 0.0]])
    labels = torch.arange(8)[None].T
    with pytest.warns(sampling.KeptSetWarning, match="3 label"):
        lp = lmloss.token_logprobs(logits.expand(8, 8), labels.squeeze(1), top_k=3)
    kept = torch.tensor([True, True, True, True, False, True, False, False])
    assert torch.equal(torch.isfinite(lp), kept)
    ref = logits[0].masked_fill(~kept, -INF).log_softmax(-1)
    torch.testing.assert_close(lp[kept], ref[kept])


def test_min_p_keeps_the_fp32_logit_just_above_its_float64_threshold_and_drops_the_one_just_below():
    """``p >= min_p * max p`` is ``y >= M + log(min_p)``: a float64 threshold that lies between two fp32 values
    here (M = 0, min_p = 0.1). vLLM's rule on the exact probabilities drops the fp32 logit just below it (which
    the threshold rounded to the nearest fp32 would equal) and keeps the one just above."""
    threshold = math.log(0.1)
    below = torch.tensor(threshold, dtype=torch.float32)  # the nearest fp32 is below it
    above = torch.nextafter(below, torch.tensor(0.0))
    assert below.double() < threshold < above.double()
    logits = torch.tensor([[0.0, float(below), float(above), -5.0]])
    kept = kept_set_of(logits, 1.0, min_p=0.1)
    assert kept.tolist() == [[True, False, True, False]]
    assert torch.equal(kept, vllm_kept(logits.double(), min_p=per_row(0.1, 1)))


@pytest.mark.parametrize("kept_by", ["top_k", "support"])
def test_a_label_outside_the_kept_set_passes_no_gradient_whatever_its_upstream(kept_by):
    """Its log-prob is the constant -inf: an upstream gradient that reaches it (a loss that did not mask it
    out) adds nothing, and the logits' gradient is that of the other tokens' log-probs alone."""
    n, v = 6, 50
    logits = make_logits(n, v, seed=8, dtype=torch.float64)
    kept = vllm_kept(logits, top_k=per_row(5, n))
    g = torch.Generator().manual_seed(8)
    labels = torch.multinomial(kept.double(), 1, generator=g).squeeze(1)
    labels[1] = int((~kept[1]).nonzero()[0])
    labels[3] = -100
    u = torch.randn(n, generator=g, dtype=torch.float64)
    kw = dict(top_k=5) if kept_by == "top_k" else dict(support=logits.topk(5, dim=-1).indices)
    x = logits.clone().requires_grad_()
    with pytest.warns(sampling.KeptSetWarning, match="1 label"):
        lp = lmloss.token_logprobs(x, labels, chunk_size=4, **kw)
    (grad,) = torch.autograd.grad(lp, x, u)
    xr = logits.clone().requires_grad_()
    lp_ref = xr.masked_fill(~kept, -INF).log_softmax(-1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    counted = (labels != -100) & (torch.arange(n) != 1)
    (grad_ref,) = torch.autograd.grad((lp_ref * u)[counted].sum(), xr)
    assert lp[1] == -INF
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)


def test_all_ignored_rows_give_zero_values_and_zero_gradient():
    logits = make_logits(6, 200, seed=7).requires_grad_()
    labels = torch.full((6,), -100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to report: ignored labels are not "outside the set"
        lp = lmloss.token_logprobs(logits, labels, top_k=5, top_p=0.5)
    lp.sum().backward()
    assert torch.equal(lp, torch.zeros(6))
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_fused_path_matches_the_float64_reference():
    n, h, v = 20, 16, 300
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.7
    logits64 = hidden.double() @ weight.double().T
    kept = vllm_kept(logits64 * 2.0, top_k=per_row(50, n), top_p=per_row(0.9, n), min_p=per_row(0.01, n))
    labels = torch.multinomial(kept.double(), 1, generator=g).squeeze(1)
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = lmloss.linear_token_logprobs(
        hh, ww, labels, temperature=0.5, top_k=50, top_p=0.9, min_p=0.01, return_entropy=True, chunk_size=7
    )
    (lp + 0.1 * ent).sum().backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp = ((h64 @ w64.T) * 2.0).masked_fill(~kept, -INF).log_softmax(-1)
    ent_ref = -(logp.exp() * logp.masked_fill(~kept, 0.0)).sum(-1)
    lp_ref = logp.gather(1, labels[:, None]).squeeze(1)
    (lp_ref + 0.1 * ent_ref).sum().backward()
    torch.testing.assert_close(lp.double(), lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hh.grad.double(), h64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ww.grad.double(), w64.grad, rtol=1e-4, atol=1e-4)


def exact_top_p_kept(masses: list[int], top_p: float) -> list[bool]:
    """vLLM's top-p rule in exact rational arithmetic over integer masses (probabilities ``m / sum``):
    sort ascending, drop the tokens whose cumulative probability is ``<= 1 - top_p``, keep the last; then
    every token equal to the smallest kept one (the documented tie rule)."""
    total, bound = sum(masses), 1 - Fraction(top_p)
    kept, cum = [False] * len(masses), Fraction(0)
    order = sorted(range(len(masses)), key=lambda j: masses[j])
    for j in order[:-1]:
        cum += Fraction(masses[j], total)
        kept[j] = cum > bound
    kept[order[-1]] = True
    smallest = min(m for m, k in zip(masses, kept) if k)
    return [m >= smallest for m in masses]


# Masses n / 512 of the row's top token (float64 logits log(n / 512), all within 0.2 of the top, so that
# exp gives n / 512 back exactly), summing to 4092 / 512 = 4 * (512 + 511) / 512: at top_p = 0.25 the mass
# above the third token is exactly top_p times the total. WITHIN_BIN: that token (505) shares its histogram
# bin with 511 (bins are 1/64 wide there), so the exact crossing is decided among the bin's candidates;
# AT_BIN_EDGE: it (480) has a bin of its own, so the crossing falls on a bin edge.
WITHIN_BIN = [512, 511, 505, 428, 428, 428, 428, 428, 424]
AT_BIN_EDGE = [512, 511, 480, 432, 432, 432, 432, 432, 429]


@pytest.mark.parametrize("path", ["histogram", "dense_fallback"])
def test_top_p_drops_a_token_whose_mass_above_is_exactly_top_p_and_keeps_it_one_ulp_higher(monkeypatch, path):
    if path == "dense_fallback":  # every row solved by sorting, as a misplaced crossing would be
        monkeypatch.setattr(sampling, "_crossing", lambda hist, target: torch.zeros_like(target, dtype=torch.long))  # fmt: skip
    rows, top_p, expected = [], [], []
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(0))  # the boundary token not in place
    for masses in (WITHIN_BIN, AT_BIN_EDGE):
        assert sum(masses) == 4 * (512 + 511)
        for p in (0.25, math.nextafter(0.25, 1.0)):
            kept = exact_top_p_kept(masses, p)
            assert sum(kept) == (2 if p == 0.25 else 3)  # the third token is the one on the boundary
            rows.append([math.log(masses[j] / 512) for j in perm])
            top_p.append(p)
            expected.append([kept[j] for j in perm])
    y = torch.tensor(rows, dtype=torch.float64)
    exps = (y - y.amax(1, keepdim=True)).exp() * 512  # the premise: the masses are exact
    assert torch.equal(exps, exps.round())
    before = sampling.FALLBACK_ROWS[0]
    got = kept_set_of(y, 1.0, top_p=torch.tensor(top_p, dtype=torch.float64))
    assert got.tolist() == expected
    assert sampling.FALLBACK_ROWS[0] - before == (0 if path == "histogram" else 4 * 9)  # every label's row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab", [(32, 64), (16, 1000), (8, 20000)])
def test_top_p_finds_the_crossing_in_the_histogram_without_the_dense_fallback(rows, vocab, dtype):
    # The dense fallback would repair any row whose crossing bin is off by one, so a misplaced crossing
    # shows only here: on ordinary inputs it is never used (and the kept set is vLLM's).
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab, generator=g) * torch.linspace(0.3, 4.0, rows)[:, None]).to(dtype)
    top_p = torch.rand(rows, generator=g) * 0.98 + 0.01
    top_k = torch.where(torch.arange(rows) % 3 == 0, vocab // 2, vocab)  # some rows cut before top-p
    y = logits.double() / 0.7
    before = sampling.FALLBACK_ROWS[0]
    labels = logits.argmax(-1)  # always kept (an ignored label would make the row's every output 0)
    _, log_mass = lmloss.token_logprobs(
        logits, labels, temperature=0.7, top_p=top_p, top_k=top_k, return_log_kept_mass=True
    )
    assert sampling.FALLBACK_ROWS[0] == before
    ref = vllm_kept(y, top_p=top_p, top_k=top_k)
    expected = torch.logsumexp(y.masked_fill(~ref, -INF), -1) - torch.logsumexp(y, -1)
    torch.testing.assert_close(log_mass.double(), expected, rtol=0, atol=1e-5)


def test_the_dense_fallback_solves_rows_whose_histogram_crossing_was_misplaced(monkeypatch):
    # a misplaced crossing (fp32 histogram rounding at a bin edge) is simulated by pointing at bin 0
    monkeypatch.setattr(
        sampling, "_crossing", lambda hist, target: torch.zeros(hist.shape[0], dtype=torch.long)
    )
    before = sampling.FALLBACK_ROWS[0]
    logits = make_logits(6, 400, seed=9)
    assert torch.equal(kept_set_of(logits, 1.0, top_p=0.8), vllm_kept(logits.double(), top_p=per_row(0.8, 6)))
    assert sampling.FALLBACK_ROWS[0] > before


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(top_k=0), "top_k"),
        (dict(top_k=-3), "top_k"),
        (dict(top_k=torch.tensor([5, 0, 5, 5])), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=torch.tensor([0.5, 0.5, -0.1, 0.5])), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.01), "min_p"),
        (dict(min_p=torch.tensor([0.1, 0.2])), "min_p"),
        (dict(return_log_kept_mass=True), "return_log_kept_mass"),
        (dict(top_k=5, support=torch.zeros(4, 2, dtype=torch.long)), "support"),
    ],
)
def test_bad_values_raise_naming_the_argument(kw, match):
    logits = torch.randn(4, 10)
    with pytest.raises((ValueError, TypeError), match=match):
        lmloss.token_logprobs(logits, torch.zeros(4, dtype=torch.long), **kw)


def test_cross_entropy_style_summed_loss_does_not_take_sampling_arguments():
    with pytest.raises(TypeError):
        lmloss.cross_entropy(torch.randn(3, 5), torch.zeros(3, dtype=torch.long), top_k=2)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_softcap_and_temperature_come_before_the_truncation(impl):
    """Both implementations (Triton under its interpreter here): the kept set is found on the PyTorch values
    of ``softcap(x) / T`` and handed to the kernels as a threshold on the logits, so it is the same set
    however each implementation's tanh rounds."""
    if impl == "triton":
        pytest.importorskip("triton", reason="the Triton kernels need triton installed")
    n, v, cap, t = 8, 300, 4.0, 0.5
    logits = make_logits(n, v, seed=10)
    y = cap * torch.tanh(logits.double() / cap) / t
    kept = vllm_kept(y, top_p=per_row(0.8, n), min_p=per_row(0.02, n))
    labels = torch.multinomial(kept.double(), 1, generator=torch.Generator().manual_seed(1)).squeeze(1)
    x = logits.clone().requires_grad_()
    lp = lmloss.token_logprobs(x, labels, softcap=cap, temperature=t, top_p=0.8, min_p=0.02, impl=impl)
    lp.sum().backward()
    xr = logits.double().requires_grad_()
    ref = (cap * torch.tanh(xr / cap) / t).masked_fill(~kept, -INF).log_softmax(-1)
    ref.gather(1, labels[:, None]).sum().backward()
    torch.testing.assert_close(
        lp.double(), ref.gather(1, labels[:, None]).squeeze(1).detach(), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_the_top_k_boundary_token_stays_kept_under_softcap(impl):
    """The k-th largest token is exactly at the top-k threshold: with softcap it must stay in its own kept
    set on either implementation (a threshold compared with each kernel's own tanh could drop it)."""
    if impl == "triton":
        pytest.importorskip("triton", reason="the Triton kernels need triton installed")
    n, v, k, cap = 16, 257, 7, 3.0
    logits = make_logits(n, v, seed=12) * 1.5  # within tanh's range: no ties in fp32 among the top k
    labels = logits.topk(k, dim=1).indices[:, -1]  # each row's k-th largest: the boundary
    lp = lmloss.token_logprobs(logits, labels, softcap=cap, temperature=0.7, top_k=k, impl=impl)
    y = (cap * torch.tanh(logits.double() / cap) / 0.7)
    kept = y >= y.topk(k, dim=1).values[:, -1:]
    ref = y.masked_fill(~kept, -INF).log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
    assert torch.isfinite(lp).all()
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1 / 0.7, 1 / 0.6, 0.37])
def test_the_threshold_moved_onto_the_logits_keeps_exactly_the_set_found_on_the_scaled_logits(dtype, scale):
    # y = x * scale (temperature, no softcap): the x threshold is computed per row from y's threshold alone.
    # Rows hold a run of consecutive floats around the boundary, so any threshold one ulp off shows.
    g = torch.Generator().manual_seed(5)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    x = (torch.randn(6, 300, generator=g, dtype=torch.float64) * 3).to(dtype)
    centre = x[:, 7].to(compute)
    run = [centre]
    for _ in range(40):
        run.append(torch.nextafter(run[-1], torch.full_like(centre, math.inf)))
        run.insert(0, torch.nextafter(run[0], torch.full_like(centre, -math.inf)))
    x = torch.cat([x, torch.stack(run, 1).to(dtype)], 1)  # bf16: the run collapses onto bf16 values
    y = torch.mul(x.to(compute), scale)
    keep = y[:, 300 + 40].clone()  # the value at the run's centre: ties and neighbours on both sides
    scratch = lmloss.kernels.ChunkScratch(x.shape[0], x.shape[1], x.device)
    found = sampling._on_logits(x.to(compute), y, keep, None, scratch, scale)
    scanned = sampling._on_logits(x.to(compute), y, keep, None, scratch, None)  # the chunk scan
    assert torch.equal(x.to(compute) >= found[:, None], y >= keep[:, None])
    assert torch.equal(x.to(compute) >= scanned[:, None], y >= keep[:, None])
    assert not torch.equal(y >= keep[:, None], torch.ones_like(y, dtype=torch.bool))  # something is cut


# ----------------------------------------------------------------------------------------------------------
# the top-p crossing's window (`sampling.crossing_bins`) where the columns' masses sit at their bins' edges


def _crossing_and_window(bins, masses, z_given, target):
    """The crossing bin of the float64 masses (the last bin whose mass at or above it reaches `target`) and
    crossing_bins' window from the counts of `bins` and the kept mass `z_given`."""
    ts = pytest.importorskip("lmloss.kernels.triton_sampling")
    low, high = ts.mass_bin_bounds(torch.device("cpu"))
    counts = torch.zeros(bins.shape[0], ts.NBINS, dtype=torch.int64).scatter_add_(1, bins, torch.ones_like(bins))
    mass = torch.zeros(bins.shape[0], ts.NBINS, dtype=torch.float64).scatter_add_(1, bins, masses)
    crossing = (mass.flip(1).cumsum(1).flip(1) >= target[:, None]).sum(1) - 1
    b_lo, b_hi, in_window = sampling.crossing_bins(counts, z_given, target, low, high)
    assert torch.equal(in_window, ((bins >= b_lo[:, None]) & (bins <= b_hi[:, None])).sum(1))
    return crossing, b_lo, b_hi, mass


@pytest.mark.parametrize("edge", ["high", "low"])
def test_the_window_holds_a_crossing_whose_masses_lie_a_few_ulps_outside_the_bins_they_were_counted_in(edge):
    """The kernels count a column in the bin of its fp32 exp; the crossing is found on float64 masses, a few
    fp32 ulps away: a mass just above its bin's upper edge (or below its lower one) must still leave the
    crossing inside the window (crossing_bins' 2**-16 margins on the edges)."""
    ts = pytest.importorskip("lmloss.kernels.triton_sampling")
    low, high = ts.mass_bin_bounds(torch.device("cpu"))
    g = torch.Generator().manual_seed(21)
    bins = torch.randint(1800, ts.NBINS - 1, (4, 400), generator=g)
    ulps = 2.0**-23 * 4
    masses = high[bins] * (1 + ulps) if edge == "high" else low[bins] * (1 - ulps)
    total = torch.zeros(4, dtype=torch.float64).index_add_(0, torch.arange(4).repeat_interleave(400), masses.reshape(-1))
    for b in range(1800, ts.NBINS - 1, 5):
        # targets right at the mass at or above bin b, and just past the one above it (the crossing is b)
        for target in (torch.where(bins >= b, masses, 0.0).sum(1), torch.where(bins > b, masses, 0.0).sum(1) * (1 + 2.0**-40)):
            crossing, b_lo, b_hi, _ = _crossing_and_window(bins, masses, total, torch.minimum(target, total))
            assert ((b_lo <= crossing) & (crossing <= b_hi)).all(), (b, crossing, b_lo, b_hi)


@pytest.mark.parametrize("factor", [0.25, 0.9, 1.1, 4.0])
def test_a_kept_mass_the_counts_contradict_gives_the_counts_window_never_an_inverted_one(factor):
    """A kept mass Z off by far more than its margin (the bounds from Z cross: the lowest bin above the
    highest): the window is the one the counts alone bound, which holds the crossing of the target asked;
    never inverted, never empty. Off by less, Z narrows the window as usual."""
    ts = pytest.importorskip("lmloss.kernels.triton_sampling")
    low, high = ts.mass_bin_bounds(torch.device("cpu"))
    g = torch.Generator().manual_seed(22)
    bins = torch.randint(1700, ts.NBINS - 1, (6, 500), generator=g)
    masses = low[bins] + (high[bins] - low[bins]) * torch.rand(6, 500, generator=g, dtype=torch.float64)
    total = masses.sum(1)
    for share in (0.05, 0.3, 0.7, 0.95):  # a target within the columns' mass (a crossing exists)
        crossing, b_lo, b_hi, _ = _crossing_and_window(bins, masses, total * factor, share * total)
        assert (b_lo <= b_hi).all()
        assert ((b_lo <= crossing) & (crossing <= b_hi)).all(), (share, crossing, b_lo, b_hi)
