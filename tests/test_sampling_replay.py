"""Replay (``support=``): log-probs renormalised over the kept ids the engine returned; and the memory the
sampling paths hold (no ``[N, V]`` copy)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import lmloss
from lmloss import sampling
from lmloss.profiling import peak_memory

pytestmark = pytest.mark.usefixtures("one_thread")

INF = math.inf


def kept_top_k(y: torch.Tensor, k: int) -> torch.Tensor:
    """Plain top-k mask with ties kept, written out (values >= the k-th largest)."""
    return y >= y.topk(k, dim=1).values[:, -1:]


def support_of(kept: torch.Tensor, generator: torch.Generator, width: int | None = None) -> torch.Tensor:
    """``[N, K]`` ids of each row's kept set, shuffled, -1 padded (how an engine might return them)."""
    counts = kept.sum(1)
    out = torch.full((kept.shape[0], width or int(counts.max())), -1)
    for i in range(kept.shape[0]):
        ids = kept[i].nonzero().squeeze(1)
        out[i, : ids.numel()] = ids[torch.randperm(ids.numel(), generator=generator)]
    return out


def reference(x: torch.Tensor, labels: torch.Tensor, kept: torch.Tensor, temperature: float):
    """Log-probs and entropy of the renormalised kept set; both 0 where the label is ignored (a label outside
    the set still counts: -inf, and the set's entropy)."""
    logp = (x.double() / temperature).masked_fill(~kept, -INF).log_softmax(-1)
    valid = labels != -100
    lp = torch.where(valid, logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
    return lp, torch.where(valid, -(logp.exp() * logp.masked_fill(~kept, 0.0)).sum(-1), 0.0)


def test_replay_from_logits_matches_the_float64_reference_and_the_recomputed_set():
    g = torch.Generator().manual_seed(0)
    n, v, t = 10, 300, 0.5
    logits = torch.randn(n, v, generator=g) * 3
    kept = kept_top_k(logits.double() / t, 25)
    labels = torch.multinomial(kept.double(), 1, generator=g).squeeze(1)
    labels[3] = -100
    labels[6] = int((~kept[6]).nonzero()[0])  # the engine never returned it: -inf, no gradient
    u = torch.randn(n, generator=g)
    support = support_of(kept, g, width=40)

    x = logits.clone().requires_grad_()
    with pytest.warns(sampling.KeptSetWarning, match="1 label"):
        lp, ent = lmloss.token_logprobs(x, labels, temperature=t, support=support, return_entropy=True)
    (torch.where(torch.isinf(lp), 0.0, lp) * u + ent).sum().backward()
    xr = logits.double().requires_grad_()
    lp_ref, ent_ref = reference(xr, labels, kept, t)
    (torch.where(torch.isinf(lp_ref), 0.0, lp_ref) * u.double() + ent_ref).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp.double(), lp_ref, **tol)
    torch.testing.assert_close(ent.double(), ent_ref, **tol)
    torch.testing.assert_close(x.grad.double(), xr.grad, **tol)
    assert lp[6] == -INF and lp[3] == 0.0

    # the same set recomputed by top_k gives the same numbers
    x2 = logits.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sampling.KeptSetWarning)
        lp2, ent2 = lmloss.token_logprobs(x2, labels, temperature=t, top_k=25, return_entropy=True)
    (torch.where(torch.isinf(lp2), 0.0, lp2) * u + ent2).sum().backward()
    torch.testing.assert_close(lp, lp2)
    torch.testing.assert_close(x.grad, x2.grad)


def test_fused_replay_matches_the_reference_with_bias_and_softcap():
    g = torch.Generator().manual_seed(1)
    n, h, v, t, cap = 24, 16, 200, 0.7, 5.0
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.6
    bias = torch.randn(v, generator=g) * 0.1
    z64 = hidden.double() @ weight.double().T + bias.double()
    kept = kept_top_k(cap * torch.tanh(z64 / cap), 12)
    labels = torch.multinomial(kept.double(), 1, generator=g).squeeze(1)
    support = support_of(kept, g)

    hh, ww, bb = (a.clone().requires_grad_() for a in (hidden, weight, bias))
    lp = lmloss.linear_token_logprobs(
        hh, ww, labels, bias=bb, support=support, temperature=t, softcap=cap, chunk_size=5
    )
    lp.sum().backward()
    h64, w64, b64 = (a.double().requires_grad_() for a in (hidden, weight, bias))
    z = h64 @ w64.T + b64
    lp_ref, _ = reference(cap * torch.tanh(z / cap), labels, kept, t)
    lp_ref.sum().backward()
    torch.testing.assert_close(lp.double(), lp_ref, rtol=1e-5, atol=1e-5)
    for got, want in ((hh, h64), (ww, w64), (bb, b64)):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)
    outside = ~kept.any(0)  # weight rows no token kept get no gradient
    assert torch.all(ww.grad[outside] == 0)


def test_replay_returns_the_log_kept_mass_of_the_replayed_set():
    g = torch.Generator().manual_seed(5)
    n, v, t, cap = 12, 300, 0.7, 8.0
    logits = (torch.randn(n, v, generator=g) * 3).requires_grad_()
    y = cap * torch.tanh(logits.detach().double() / cap) / t
    kept = kept_top_k(y, 30)
    support = support_of(kept, g, width=35)
    labels = support[:, 0].clone()
    labels[4] = -100  # an ignored token counts for nothing: its kept mass too is 0
    lp, mass = lmloss.token_logprobs(
        logits, labels, temperature=t, softcap=cap, support=support, return_log_kept_mass=True, chunk_size=5
    )
    expected = torch.logsumexp(y.masked_fill(~kept, -INF), -1) - torch.logsumexp(y, -1)
    expected[4] = 0.0
    torch.testing.assert_close(mass.double(), expected, rtol=0, atol=2e-6)
    assert lp.requires_grad and not mass.requires_grad  # the mass is not differentiable


def test_support_from_offsets_converts_vllms_flat_layout():
    ids = torch.tensor([4, 1, 7, 2, 9, 0])
    offsets = torch.tensor([0, 3, 3, 4, 6])  # token 1 has no kept id (e.g. a prompt position)
    expected = torch.tensor([[4, 1, 7], [-1, -1, -1], [2, -1, -1], [9, 0, -1]])
    assert torch.equal(sampling.support_from_offsets(ids, offsets), expected)
    with pytest.raises(ValueError, match="offsets"):
        sampling.support_from_offsets(ids, torch.tensor([0, 3, 2, 6]))


@pytest.mark.parametrize(
    "support, match",
    [
        (torch.tensor([[1, 1], [2, 3], [0, -1]]), "twice"),
        (torch.tensor([[1, 10], [2, 3], [0, -1]]), "support ids"),
        (torch.tensor([[1, -2], [2, 3], [0, -1]]), "support ids"),
        (torch.tensor([[1, 2], [2, 3]]), "support must be"),
        (torch.tensor([[1.0, 2.0], [2, 3], [0, 1]]), "integer"),
    ],
)
def test_bad_support_raises_naming_it(support, match):
    with pytest.raises((ValueError, TypeError), match=match):
        lmloss.token_logprobs(torch.randn(3, 10), torch.tensor([1, 2, 0]), support=support, vocab_size=10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_from_logits_writes_its_gradient_into_one_buffer(dtype):
    # torch.gather's own backward holds two [N, V] tensors (zeros, then an out-of-place scatter_add)
    g = torch.Generator().manual_seed(3)
    n, v, k = 256, 4096, 16
    logits = torch.randn(n, v, generator=g).to(dtype).requires_grad_()
    support = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    labels = support[:, 0].clone()
    grad_bytes = n * v * logits.element_size()
    with peak_memory() as pm:
        lmloss.token_logprobs(logits, labels, support=support, chunk_size=64).sum().backward()
    assert pm.peak_bytes - grad_bytes < grad_bytes / 4, f"{pm.peak_bytes / grad_bytes:.2f} x [N, V]"
    # the gradient itself: onehot - p over the support, 0 elsewhere (float64, written out)
    x = logits.detach().double()
    masked = torch.full_like(x, -INF).scatter(1, support, x.gather(1, support))
    want = torch.zeros_like(x).scatter(1, labels[:, None], 1.0) - masked.softmax(-1)
    tol = dict(rtol=2e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), want, **tol)


def test_fused_sampling_paths_hold_no_token_by_vocabulary_tensor():
    g = torch.Generator().manual_seed(2)
    n, h, v, chunk = 256, 32, 4096, 32
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.3).requires_grad_()
    support = torch.stack([torch.randperm(v, generator=g)[:16] for _ in range(n)])
    labels = support[:, 0].clone()
    full = n * v * 4
    chunk_bytes = chunk * v * 4
    grads = (n * h + v * h) * 4
    with peak_memory() as replay:
        lmloss.linear_token_logprobs(
            hidden, weight, labels, support=support, chunk_size=chunk
        ).sum().backward()
    assert replay.peak_bytes - grads < full / 4, f"{replay.peak_bytes / full:.2f} x [N, V]"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sampling.KeptSetWarning)
        with peak_memory() as recompute:
            lp = lmloss.linear_token_logprobs(hidden, weight, labels, top_k=50, top_p=0.9, chunk_size=chunk)
            torch.where(torch.isinf(lp), 0.0, lp).sum().backward()
    # the chunk loop's buffers plus the threshold search's (exps, positions, int32 bins, two masks)
    assert recompute.peak_bytes - grads < 8 * chunk_bytes, f"{recompute.peak_bytes / chunk_bytes:.2f} chunks"
