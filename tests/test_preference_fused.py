"""lmloss.preference.linear_preference_loss on one process: the sequence objective of the one chunk loop.

The reference is plain PyTorch in float64 on the materialized logits, written here: ``logits = h @ W.T (+ b)``
(softcapped, over temperature), ``log_softmax``, the labels' log-probs gathered, summed per sequence over the
completion tokens (``labels != -100``, with the mask and the per-token weights), and DPO's sigmoid loss
``-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` averaged over pairs (a stand-in for the preference
module's losses: the op takes any loss of the per-sequence sums). Tensor, sequence and context parallelism are
in tests/distributed/test_preference_fused_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from impl_params import IMPLS
from lmloss.preference import linear_preference_loss
from tracking_support import LargestAllocation

pytestmark = pytest.mark.usefixtures("one_thread")
F64_TOL = dict(rtol=1e-10, atol=1e-12)
BETA = 0.1
MiB = 1024**2


def dpo_sigmoid(stats):
    """DPO's sigmoid loss of `lmloss.preference.SequenceStats` (chosen half, then rejected half)."""
    b = stats.logps.shape[0] // 2
    ref = stats.ref_logps if stats.ref_logps is not None else torch.zeros_like(stats.logps)
    margin = (stats.logps[:b] - ref[:b]) - (stats.logps[b:] - ref[b:])
    return -F.logsigmoid(BETA * margin).mean()


def simpo_like(stats):
    """A reference-free loss of the mean log-probs (SimPO's shape), returning ``(loss, metrics)``."""
    b = stats.logps.shape[0] // 2
    mean = stats.logps / stats.n_tokens.clamp(min=1)
    loss = -F.logsigmoid(2.0 * (mean[:b] - mean[b:]) - 0.5).mean()
    return loss, {"chosen": mean[:b].detach().mean()}


def _problem(s=4, t=9, h=8, v=40, *, dtype=torch.float64, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    p = dict(
        hidden=torch.randn(s, t, h, generator=g, dtype=torch.float64),
        weight=torch.randn(v, h, generator=g, dtype=torch.float64) * (2.0 / h**0.5),
        bias=torch.randn(v, generator=g, dtype=torch.float64) if bias else None,
        ref_hidden=torch.randn(s, t, 6, generator=g, dtype=torch.float64),
        ref_weight=torch.randn(v, 6, generator=g, dtype=torch.float64) * 0.8,
        labels=torch.randint(0, v, (s, t), generator=g),
        token_weights=torch.rand(s, t, generator=g, dtype=torch.float64) + 0.5,
        mask=torch.rand(s, t, generator=g) > 0.2,
    )
    p["labels"][:, :3] = -100  # the prompts
    p["labels"][1, 6:] = -100  # padding
    for k in ("hidden", "weight", "bias"):
        if p[k] is not None:
            p[k] = p[k].to(dtype).requires_grad_(True)
    return p


def _logprobs(h, w, b, labels, *, temperature=1.0, softcap=None):
    z = h @ w.T + (0 if b is None else b)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / temperature, -1)
    return logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]


def _reference(p, loss, *, head=True, mask=False, weights=False, temperature=1.0, softcap=None):
    """float64 loss and gradients of hidden / weight / bias from the materialized logits."""
    leaves = [p[k].detach().double().requires_grad_(True) for k in ("hidden", "weight", "bias") if p[k] is not None]
    h, w, b = leaves[0], leaves[1], (leaves[2] if len(leaves) > 2 else None)
    counts = p["labels"] != -100
    if mask:
        counts = counts & p["mask"]
    tw = p["token_weights"] if weights else torch.ones_like(p["token_weights"])
    lp = _logprobs(h, w, b, p["labels"], temperature=temperature, softcap=softcap)
    logps = torch.where(counts, tw * lp, 0.0).sum(-1)
    ref = None
    if head:
        rlp = _logprobs(p["ref_hidden"], p["ref_weight"], None, p["labels"], temperature=temperature, softcap=softcap)
        ref = torch.where(counts, tw * rlp, 0.0).sum(-1)
    from lmloss.preference import SequenceStats

    out = loss(SequenceStats(logps=logps, ref_logps=ref, n_tokens=counts.sum(-1).double()))
    value = out[0] if isinstance(out, tuple) else out
    return value.detach(), torch.autograd.grad(value, leaves), (logps.detach(), ref)


def _grads(loss, p):
    return torch.autograd.grad(loss, [p[k] for k in ("hidden", "weight", "bias") if p[k] is not None])


def _interleave(t):
    """Rows in the halves order (chosen 0..B-1, rejected 0..B-1) -> c0, r0, c1, r1, ..."""
    b = t.shape[0] // 2
    return torch.stack([t[:b], t[b:]], dim=1).reshape(t.shape)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("padded_reference_head", dict(head=True)),
        ("padded_head_mask_weights_bias_softcap_temperature", dict(head=True, mask=True, weights=True, bias=True,
                                                                    temperature=0.8, softcap=4.0)),  # fmt: skip
        ("reference_free_tuple_output", dict(head=False, loss=simpo_like)),
    ],
)
def test_loss_and_gradients_equal_the_float64_reference(name, kw):
    p = _problem(bias=kw.get("bias", False))
    loss_fn = kw.get("loss", dpo_sigmoid)
    opts = dict(temperature=kw.get("temperature", 1.0), softcap=kw.get("softcap"))
    got = linear_preference_loss(
        p["hidden"], p["weight"], p["labels"], loss=loss_fn, bias=p["bias"], chunk_size=5,
        ref_hidden=p["ref_hidden"] if kw.get("head") else None, ref_weight=p["ref_weight"] if kw.get("head") else None,
        mask=p["mask"] if kw.get("mask") else None, token_weights=p["token_weights"] if kw.get("weights") else None,
        **opts,
    )  # fmt: skip
    got_loss = got[0] if isinstance(got, tuple) else got
    want, want_grads, _ = _reference(p, loss_fn, head=kw.get("head"), mask=kw.get("mask", False),
                                     weights=kw.get("weights", False), **opts)  # fmt: skip
    torch.testing.assert_close(got_loss, want, **F64_TOL)
    for g, w in zip(_grads(got_loss, p), want_grads):
        torch.testing.assert_close(g, w, **F64_TOL)
    if isinstance(got, tuple):  # the loss's own metrics come back as it returned them
        assert set(got[1]) == {"chosen"}


def test_packed_pairs_and_precomputed_reference_sums_give_the_padded_batch_s_loss():
    """The same pairs packed (``cu_seqlens``, each sequence's tokens without its padding), interleaved pair by
    pair, with the reference given as its per-sequence sums (precomputed): the padded batch's loss and
    gradients (at the tokens that hold them)."""
    p = _problem()
    want, want_grads, (_, ref_sums) = _reference(p, dpo_sigmoid)
    lengths = [9, 6, 9, 9]  # sequence 1's padding dropped
    order = [0, 2, 1, 3]  # c0, r0, c1, r1
    hidden = torch.cat([p["hidden"].detach()[s, : lengths[s]] for s in order]).requires_grad_(True)
    labels = torch.cat([p["labels"][s, : lengths[s]] for s in order])
    cu = torch.tensor([0, *torch.tensor([lengths[s] for s in order]).cumsum(0).tolist()])
    weight = p["weight"].detach().clone().requires_grad_(True)
    loss = linear_preference_loss(hidden, weight, labels, loss=dpo_sigmoid, ref_logps=_interleave(ref_sums),
                                  cu_seqlens=cu, pairs="interleaved", chunk_size=7)  # fmt: skip
    torch.testing.assert_close(loss, want, **F64_TOL)
    g_hidden, g_weight = torch.autograd.grad(loss, [hidden, weight])
    torch.testing.assert_close(g_weight, want_grads[1], **F64_TOL)
    want_hidden = torch.cat([want_grads[0][s, : lengths[s]] for s in order])
    torch.testing.assert_close(g_hidden, want_hidden, **F64_TOL)


def test_fp32_loss_and_gradients_are_close_to_float64():
    p = _problem(dtype=torch.float32)
    loss = linear_preference_loss(p["hidden"], p["weight"], p["labels"], loss=dpo_sigmoid, ref_hidden=p["ref_hidden"].float(),
                                  ref_weight=p["ref_weight"].float(), chunk_size=8)  # fmt: skip
    want, want_grads, _ = _reference(p, dpo_sigmoid)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    for g, w in zip(_grads(loss, p), want_grads):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_both_kernel_implementations_and_the_weight_pass_give_the_reference_gradients(impl):
    """fp32 on either kernel implementation, with the default budget (the fp32 weight-gradient accumulator)
    and with a budget below that accumulator (the weight gradient from the weight pass over column blocks)."""
    p = _problem(h=64, v=300, dtype=torch.float32)
    want, want_grads, _ = _reference(p, dpo_sigmoid)
    accumulator_mib = 300 * 64 * 4 / MiB
    for budget in (None, accumulator_mib / 2):
        loss = linear_preference_loss(
            p["hidden"], p["weight"], p["labels"], loss=dpo_sigmoid, ref_hidden=p["ref_hidden"].float(),
            ref_weight=p["ref_weight"].float(), chunk_size=8, impl=impl, memory_budget_mib=budget,
        )  # fmt: skip
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
        for g, w in zip(_grads(loss, p), want_grads):
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-6)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_four_policy_matmuls_and_one_reference_matmul_per_chunk():
    """The policy's logits, then in the backward its logits again, d hidden and d weight; the reference's
    logits once, in the forward's pass (not a second loop over the tokens)."""
    p = _problem(s=2, t=12)
    p["labels"][:] = 1  # every token counts: 24 tokens, 3 chunks of 8
    with _CountMatmuls() as counter:
        loss = linear_preference_loss(p["hidden"], p["weight"], p["labels"], loss=dpo_sigmoid, chunk_size=8,
                                      ref_hidden=p["ref_hidden"][:2], ref_weight=p["ref_weight"])  # fmt: skip
        _grads(loss, p)
    assert counter.count == (4 + 1) * 3


@pytest.mark.parametrize("t", [512, 4096])
def test_peak_memory_above_inputs_and_gradients_is_within_the_budget_whatever_the_length(t):
    """One pair of T-token sequences (64 prompt tokens each), H = 16, V = 2000, a 2 MiB budget: everything the op
    holds beyond its inputs and their gradients (live-tensor tracking) is the budget's chunks (both heads' in the
    forward) and O(tokens) vectors, at T = 512 as at 4096, while one [tokens, V] fp32 tensor is 7.8 / 62.5 MiB."""
    h, v, budget = 16, 2000, 2.0
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, t, h, generator=g).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * h**-0.5).requires_grad_(True)
    ref_hidden, ref_weight = torch.randn(2, t, h, generator=g), torch.randn(v, h, generator=g) * h**-0.5
    labels = torch.randint(0, v, (2, t), generator=g)
    labels[:, :64] = -100
    with LargestAllocation() as mem:
        linear_preference_loss(hidden, weight, labels, loss=dpo_sigmoid, ref_hidden=ref_hidden, ref_weight=ref_weight,
                               memory_budget_mib=budget).backward()  # fmt: skip
    grads = (hidden.numel() + weight.numel()) * 4
    per_token = 64  # log-probs, the saved log-sum-exps, the counts, the sums' columns and their gradients
    above = mem.peak - grads
    assert above <= budget * MiB + per_token * 2 * t, f"{above / MiB:.2f} MiB above inputs and gradients"
    tokens_by_vocab = 2 * t * v * 4
    assert tokens_by_vocab > 3 * budget * MiB  # the bound has teeth: one [tokens, V] tensor is far above it
    assert mem.largest <= max(grads, budget * MiB) < tokens_by_vocab


def test_bad_arguments_name_them():
    p = _problem()
    h, w, labels = p["hidden"], p["weight"], p["labels"]
    with pytest.raises(ValueError, match="even number of sequences"):
        linear_preference_loss(h[:3], w, labels[:3], loss=dpo_sigmoid)
    with pytest.raises(ValueError, match="ref_hidden and ref_weight"):
        linear_preference_loss(h, w, labels, loss=dpo_sigmoid, ref_hidden=p["ref_hidden"])
    with pytest.raises(ValueError, match="ref_logps must be"):
        linear_preference_loss(h, w, labels, loss=dpo_sigmoid, ref_logps=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="pairs"):
        linear_preference_loss(h, w, labels, loss=dpo_sigmoid, pairs="zipped")
    with pytest.raises(ValueError, match="cu_seqlens"):
        linear_preference_loss(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1), loss=dpo_sigmoid)
    with pytest.raises(TypeError, match="loss must be a callable"):
        linear_preference_loss(h, w, labels, loss="sigmoid")
    with pytest.raises(ValueError, match="0-d tensor"):
        linear_preference_loss(h, w, labels, loss=lambda s: s.logps)


def test_without_grad_the_loss_is_the_same_and_a_second_backward_gives_the_same_gradients():
    p = _problem()
    kw = dict(loss=dpo_sigmoid, ref_hidden=p["ref_hidden"], ref_weight=p["ref_weight"], chunk_size=5)
    with torch.no_grad():
        plain = linear_preference_loss(p["hidden"], p["weight"], p["labels"], **kw)
    loss = linear_preference_loss(p["hidden"], p["weight"], p["labels"], **kw)
    torch.testing.assert_close(plain, loss.detach(), rtol=0, atol=0)
    leaves = [p["hidden"], p["weight"]]
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    for a, b in zip(first, second):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("loss_type", [("sigmoid",), ("ipo",), ("hinge", "exo_pair"), ("robust",)])
def test_a_spec_gives_the_per_token_front_doors_loss_and_gradients(loss_type):
    """`loss=PreferenceSpec(...)` runs `lmloss.preference.preference_loss` on the fused sums: equal (float64)
    to `preference_loss_from_logprobs` over log-probs of the materialized logits, with LD-DPO's weights."""
    from lmloss.preference import PreferenceSpec, per_token_weights, preference_loss_from_logprobs

    weights = (1.0,) * len(loss_type) if len(loss_type) > 1 else None
    spec = PreferenceSpec(loss_type=loss_type, loss_weights=weights, beta=0.2, label_smoothing=0.1 * (loss_type[-1] in ("robust", "exo_pair")), ld_alpha=0.5)
    p = _problem()
    counts = p["labels"] != -100
    tw = per_token_weights(counts, spec, dtype=torch.float64)
    got = linear_preference_loss(
        p["hidden"], p["weight"], p["labels"], loss=spec, ref_hidden=p["ref_hidden"], ref_weight=p["ref_weight"],
        token_weights=tw,
    )  # fmt: skip
    h, w = (p[k].detach().clone().requires_grad_(True) for k in ("hidden", "weight"))
    lp = _logprobs(h, w, None, p["labels"])
    rlp = _logprobs(p["ref_hidden"], p["ref_weight"], None, p["labels"])
    want = preference_loss_from_logprobs(
        torch.where(counts, lp, 0.0), counts, spec, ref_token_logps=torch.where(counts, rlp, 0.0), token_weights=tw
    )
    torch.testing.assert_close(got.loss, want.loss, **F64_TOL)
    for g, r in zip(_grads(got.loss, p), torch.autograd.grad(want.loss, [h, w])):
        torch.testing.assert_close(g, r, **F64_TOL)
