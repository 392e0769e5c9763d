"""Property tests: random shapes, chunk sizes, temperatures, ignore masks and vocab padding.

Each example is checked against an fp64 reference written out in plain PyTorch (log_softmax, gather,
F.cross_entropy, logsumexp) over the first `vocab_size` columns, with autograd for the gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import lmloss

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
TOL = dict(atol=1e-5, rtol=1e-5)


@st.composite
def cases(draw):
    """A random batch: leading shape, vocab (with optional padding), labels with ignored positions, options."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    n = 1
    for d in shape:
        n *= d
    columns = draw(st.integers(1, 48))
    vocab_size = draw(st.one_of(st.none(), st.integers(1, columns)))
    real = columns if vocab_size is None else vocab_size
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([0.1, 1.0, 4.0, 10.0]))
    logits = torch.randn(*shape, columns, generator=g, dtype=torch.float64) * scale
    if vocab_size is not None:
        logits[..., vocab_size:] = draw(st.sampled_from([-30.0, 0.0, 50.0]))  # padding must not matter
    labels = torch.randint(0, real, shape, generator=g)
    ignore = torch.rand(shape, generator=g) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    labels[ignore] = -100
    chunk_size = draw(st.one_of(st.none(), st.integers(1, n + 2)))
    temperature = draw(st.floats(0.25, 4.0))
    weights = torch.randn(shape, generator=g, dtype=torch.float64)
    return dict(
        logits=logits.float(),
        labels=labels,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        temperature=temperature,
        weights=weights,
    )


def _ref_tempered_log_softmax(x64, vocab_size, temperature):
    return torch.log_softmax(x64[..., :vocab_size] / temperature, dim=-1)


@SETTINGS
@given(case=cases())
def test_logprobs_and_entropy_match_reference_for_random_inputs(case):
    logits, labels, w = case["logits"], case["labels"], case["weights"]
    kw = dict(chunk_size=case["chunk_size"], temperature=case["temperature"], vocab_size=case["vocab_size"])

    x = logits.clone().requires_grad_()
    logp, ent = lmloss.token_logprobs(x, labels, return_entropy=True, **kw)
    ((logp * w.float()).sum() + (ent * w.flip(-1).float()).sum()).backward()

    x64 = logits.double().requires_grad_()
    logp_all = _ref_tempered_log_softmax(x64, case["vocab_size"], case["temperature"])
    valid = labels != -100
    r_logp = torch.where(
        valid, logp_all.gather(-1, torch.where(valid, labels, 0)[..., None]).squeeze(-1), 0.0
    )
    r_ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)  # an ignored token: 0, no gradient
    ((r_logp * w).sum() + (r_ent * w.flip(-1)).sum()).backward()

    assert torch.equal(logp[~valid], torch.zeros(int((~valid).sum())))
    assert torch.equal(ent[~valid], torch.zeros(int((~valid).sum())))
    torch.testing.assert_close(logp.double(), r_logp.detach(), **TOL)
    torch.testing.assert_close(ent.double(), r_ent.detach(), **TOL)
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL)


@SETTINGS
@given(
    case=cases(),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    label_smoothing=st.sampled_from([0.0, 0.1, 0.7]),
    z_loss=st.sampled_from([0.0, 1e-4, 1e-2]),
)
def test_cross_entropy_matches_reference_for_random_inputs(case, reduction, label_smoothing, z_loss):
    logits, labels, w = case["logits"], case["labels"], case["weights"]
    T, vocab_size = case["temperature"], case["vocab_size"]

    x = logits.clone().requires_grad_()
    out = lmloss.cross_entropy(
        x, labels, chunk_size=case["chunk_size"], temperature=T, vocab_size=vocab_size,
        reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
    )  # fmt: skip
    upstream = w.float() if reduction == "none" else torch.tensor(1.0)
    (out * upstream).sum().backward()

    x64 = logits.double().requires_grad_()
    real = x64[..., :vocab_size] / T
    flat = real.reshape(-1, real.shape[-1])
    flat_labels = labels.reshape(-1)
    valid = flat_labels != -100
    per_tok = F.cross_entropy(flat, flat_labels, label_smoothing=label_smoothing, reduction="none")
    per_tok = torch.where(valid, per_tok + z_loss * torch.logsumexp(flat, -1) ** 2, 0.0).view(labels.shape)
    if reduction == "none":
        ref = per_tok
    elif reduction == "sum":
        ref = per_tok.sum()
    else:
        ref = per_tok.sum() / valid.sum().clamp(min=1)
    (ref * (w if reduction == "none" else 1.0)).sum().backward()

    assert out.shape == ref.shape
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref.detach(), **TOL)
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL)


@SETTINGS
@given(case=cases(), other_chunk=st.one_of(st.none(), st.integers(1, 64)))
def test_fp32_results_do_not_depend_on_chunk_size(case, other_chunk):
    def run(chunk_size):
        x = case["logits"].clone().requires_grad_()
        kw = dict(chunk_size=chunk_size, temperature=case["temperature"], vocab_size=case["vocab_size"])
        logp, ent = lmloss.token_logprobs(x, case["labels"], return_entropy=True, **kw)
        ce = lmloss.cross_entropy(x, case["labels"], label_smoothing=0.1, z_loss=1e-3, reduction="none", **kw)
        w = case["weights"].float()
        ((logp * w).sum() + (ent * w).sum() + ce.sum()).backward()
        return [logp.detach(), ent.detach(), ce.detach(), x.grad]

    for a, b in zip(run(case["chunk_size"]), run(other_chunk)):
        assert torch.equal(a, b)


@SETTINGS
@given(case=cases(), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_low_precision_values_match_fp64_reference_of_the_same_values(case, dtype):
    logits = case["logits"].clamp(-60, 60).to(dtype)  # keep fp16 finite
    labels, T, vocab_size = case["labels"], case["temperature"], case["vocab_size"]
    kw = dict(chunk_size=case["chunk_size"], temperature=T, vocab_size=vocab_size)
    logp, ent = lmloss.token_logprobs(logits, labels, return_entropy=True, **kw)
    tent = lmloss.token_entropy(logits, **kw)

    logp_all = _ref_tempered_log_softmax(logits.double(), vocab_size, T)
    valid = labels != -100
    r_logp = torch.where(
        valid, logp_all.gather(-1, torch.where(valid, labels, 0)[..., None]).squeeze(-1), 0.0
    )
    r_ent = -(logp_all.exp() * logp_all).sum(-1)
    # the math is fp32 on the exactly upcast inputs: fp32 rounding only
    torch.testing.assert_close(logp.double(), r_logp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), torch.where(valid, r_ent, 0.0), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(tent.double(), r_ent, atol=2e-5, rtol=1e-5)
