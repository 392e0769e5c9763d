"""lmloss.rl.linear_policy_loss on one process, against float64 references on the materialized logits.

The reference: ``logits = softcap(hidden @ weight.T + bias) / T`` over the first ``vocab_size`` columns,
``log_softmax``, the label's log-prob and the entropy, then verl's actor loss written out in
tests/test_rl.py (`ref_actor_loss`), with autograd for the hidden / weight / bias gradients.
Tensor and sequence parallelism are in tests/distributed/test_rl_parallel.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lmloss
from impl_params import IMPLS
from lmloss.profiling import peak_memory
from test_rl import ref_actor_loss

pytestmark = pytest.mark.usefixtures("one_thread")
F64_TOL = dict(rtol=1e-10, atol=1e-12)
FP32_TOL = dict(rtol=1e-5, atol=1e-6)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    loss_mode: str = "vanilla"
    agg: str = "token-mean"
    options: dict = dataclasses.field(default_factory=dict)
    temperature: float = 1.0
    softcap: float | None = None
    bias: bool = False
    vocab_size: int | None = None
    is_weights: bool = False

    def __str__(self) -> str:
        return self.name


PPO = dict(clip_ratio_c=3.0, kl_loss_type="k3", kl_loss_coef=0.1, entropy_coeff=0.05)
CASES = [
    Case("ppo_dualclip_k3_entropy_temperature", options=PPO, temperature=0.7),
    Case("cispo_seqmean_bias_softcap", "cispo", "seq-mean-token-mean", dict(clip_ratio_high=0.3, entropy_coeff=0.02),
         softcap=3.0, bias=True),  # fmt: skip
    Case("reinforce_is_weights_k1plus_sumnorm", "reinforce", "seq-mean-token-sum-norm",
         dict(kl_loss_type="k1+", kl_loss_coef=0.2), is_weights=True),  # fmt: skip
    Case("ppo_abs_kl_padded_vocab_seqsum", agg="seq-mean-token-sum", options=dict(kl_loss_type="abs", kl_loss_coef=0.3),
         vocab_size=33),  # fmt: skip
    Case("gspo_two_pass_fallback", "gspo", "seq-mean-token-mean", dict(entropy_coeff=0.05, kl_loss_coef=0.1),
         temperature=1.3),  # fmt: skip
]
B, T, H, V = 3, 6, 8, 40


def _problem(case: Case, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (2.0 / H**0.5)
    bias = torch.randn(V, generator=g, dtype=torch.float64) if case.bias else None
    labels = torch.randint(0, case.vocab_size or V, (B, T), generator=g)
    labels[0, ::3] = -100
    labels[2, 4:] = -100
    lp_guess = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 2.5
    old = lp_guess
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = lp_guess + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    is_w = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5 if case.is_weights else None
    cast = (lambda t: None if t is None else t.to(dtype).requires_grad_(True))  # noqa: E731
    return dict(hidden=cast(hidden), weight=cast(weight), bias=cast(bias), labels=labels, old=old, adv=adv, ref=ref,
                is_w=is_w)  # fmt: skip


def _reference(case: Case, p):
    h, w = p["hidden"].detach().double().requires_grad_(True), p["weight"].detach().double().requires_grad_(True)
    b = None if p["bias"] is None else p["bias"].detach().double().requires_grad_(True)
    z = h @ w.T + (0 if b is None else b)
    if case.softcap:
        z = case.softcap * torch.tanh(z / case.softcap)
    logp = torch.log_softmax(z[..., : case.vocab_size or V] / case.temperature, -1)
    mask = p["labels"] != -100
    lp = logp.gather(-1, p["labels"].clamp(min=0)[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    o = case.options
    loss = ref_actor_loss(
        case.loss_mode, case.agg, lp, p["old"], p["adv"], mask, ref=p["ref"], kl_type=o.get("kl_loss_type", "low_var_kl"),
        kl_coef=o.get("kl_loss_coef", 0.0), ent=ent, ent_coef=o.get("entropy_coeff", 0.0), is_w=p["is_w"],
        low=0.2, high=o.get("clip_ratio_high", 0.2), c=o.get("clip_ratio_c"),
    )  # fmt: skip
    leaves = [t for t in (h, w, b) if t is not None]
    return loss.detach(), torch.autograd.grad(loss, leaves)


def _fused(case: Case, p, **kw):
    loss, metrics = lmloss.rl.linear_policy_loss(
        p["hidden"], p["weight"], p["labels"], p["old"], p["adv"], bias=p["bias"], loss_mode=case.loss_mode,
        loss_agg_mode=case.agg, ref_logprobs=p["ref"], rollout_is_weights=p["is_w"], temperature=case.temperature,
        softcap=case.softcap, vocab_size=case.vocab_size, **{"chunk_size": 4, **kw}, **case.options,
    )  # fmt: skip
    return loss, metrics


def _grads(loss, p):
    leaves = [p[k] for k in ("hidden", "weight", "bias") if p[k] is not None]
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_policy_loss_and_gradients_equal_the_float64_reference(case):
    p = _problem(case)
    loss, _ = _fused(case, p, impl="torch")
    want, want_grads = _reference(case, p)
    torch.testing.assert_close(loss, want, **F64_TOL)
    for got, exp in zip(_grads(loss, p), want_grads):
        torch.testing.assert_close(got, exp, **F64_TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_both_implementations_match_the_reference_in_fp32(impl):
    case = CASES[0]
    p = _problem(case, dtype=torch.float32)
    loss, _ = _fused(case, p, impl=impl)
    want, want_grads = _reference(case, p)
    torch.testing.assert_close(loss.double(), want, **FP32_TOL)
    for got, exp in zip(_grads(loss, p), want_grads):
        torch.testing.assert_close(got.double(), exp, **FP32_TOL)


def test_bf16_weight_gradient_accumulates_in_fp32_and_comes_back_in_bf16():
    case = CASES[0]
    p = _problem(case, dtype=torch.bfloat16)
    loss, _ = _fused(case, p, impl="torch")
    gh, gw = _grads(loss, p)
    assert gh.dtype == gw.dtype == torch.bfloat16
    # the reference from the bf16-rounded inputs (the logits rounded to bf16 as the bf16 matmul does)
    want, (want_h, want_w) = _reference(case, p)
    torch.testing.assert_close(loss.double(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw.double(), want_w, rtol=5e-2, atol=2e-2)
    torch.testing.assert_close(gh.double(), want_h, rtol=5e-2, atol=2e-2)


def test_metrics_of_the_fused_loss_equal_those_of_policy_loss_on_reference_logprobs():
    case = CASES[0]
    p = _problem(case)
    _, metrics = _fused(case, p)
    logp = torch.log_softmax((p["hidden"].detach() @ p["weight"].detach().T) / case.temperature, -1)
    lp = logp.gather(-1, p["labels"].clamp(min=0)[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    mask = p["labels"] != -100
    r = torch.exp(lp - p["old"])[mask]
    torch.testing.assert_close(metrics["ratio_mean"], r.mean(), **F64_TOL)
    torch.testing.assert_close(metrics["ratio_max"], r.max(), **F64_TOL)
    torch.testing.assert_close(metrics["entropy"], ent[mask].mean(), **F64_TOL)
    torch.testing.assert_close(metrics["ppo_kl"], (p["old"] - lp)[mask].mean(), **F64_TOL)


class _CountMatmuls(TorchDispatchMode):
    """Counts the [rows, H] x [H, V] class of GEMMs (forward and backward alike: the mode sees both)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode,per_chunk", [("vanilla", 3), ("cispo", 3), ("reinforce", 3), ("gspo", 4)])
def test_token_separable_objectives_run_three_matmuls_per_chunk_and_gspo_four(mode, per_chunk):
    case = Case(mode, mode, options=dict(entropy_coeff=0.1, kl_loss_coef=0.1))
    p = _problem(case)
    with _CountMatmuls() as counter:
        loss, _ = _fused(case, p, chunk_size=6)  # 18 tokens: 3 chunks
        _grads(loss, p)
    assert counter.count == per_chunk * 3


def test_peak_memory_is_that_of_linear_cross_entropy_plus_per_token_vectors():
    n, h, v = 512, 32, 2000
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    old, adv, ref = -torch.rand(n, generator=g) - 7, torch.randn(n, generator=g), -torch.rand(n, generator=g) - 7

    def peak(fn):
        hidden.grad = weight.grad = None
        with peak_memory() as mem:
            fn().backward()
        return mem.peak_bytes

    chunk = 64
    ce = peak(lambda: lmloss.linear_cross_entropy(hidden, weight, labels, chunk_size=chunk))
    no_entropy = {**PPO, "entropy_coeff": 0.0}
    rl = peak(lambda: lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, ref_logprobs=ref,
                                                   chunk_size=chunk, **no_entropy)[0])  # fmt: skip
    assert rl <= ce + 128 * n  # O(N) vectors: inputs masked, log-probs, weights, coefficients, metrics
    # an entropy bonus: the PyTorch kernels keep exp(y - m) beside the chunk for the entropy partial sum and
    # then p for its gradient, in one chunk-sized buffer (the Triton kernels hold no chunk-sized scratch);
    # no more than the two-pass path, which holds the same in its backward
    rl_h = peak(lambda: lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, ref_logprobs=ref,
                                                     chunk_size=chunk, **PPO)[0])  # fmt: skip

    def two_pass():
        lp, ent = lmloss.linear_token_logprobs(hidden, weight, labels, chunk_size=chunk, return_entropy=True)
        return lmloss.rl.policy_loss(lp, old, adv, labels != -100, ref_logprobs=ref, entropy=ent, **PPO)[0]

    assert rl_h <= ce + chunk * v * 4 + 128 * n
    assert rl_h <= peak(two_pass) + 32 * n


def test_nan_at_ignored_positions_gives_finite_gradients_and_zero_hidden_rows():
    case = CASES[0]
    p = _problem(case)
    ignored = p["labels"] == -100
    clean, _ = _fused(case, p)
    clean_grads = _grads(clean, p)
    for k in ("old", "adv", "ref"):
        p[k] = p[k].clone()
        p[k][ignored] = float("nan")
    loss, _ = _fused(case, p)
    grads = _grads(loss, p)
    torch.testing.assert_close(loss, clean, **F64_TOL)
    for got, exp in zip(grads, clean_grads):
        torch.testing.assert_close(got, exp, **F64_TOL)
    assert torch.equal(grads[0][ignored], torch.zeros_like(grads[0][ignored]))


def test_without_grad_the_loss_is_the_same_and_a_second_backward_recomputes_the_gradients():
    """The one rule of the summed ops (`lmloss.functions.SummedLoss`): the gradients made in the forward are
    handed out once, and a second backward through the graph recomputes them (the same values)."""
    case = CASES[0]
    p = _problem(case)
    with torch.no_grad():
        plain, _ = _fused(case, p)
    loss, _ = _fused(case, p)
    torch.testing.assert_close(plain, loss.detach(), **F64_TOL)
    leaves = [p["hidden"], p["weight"]]
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    for a, b in zip(first, second):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fused_bad_arguments_name_them():
    case = CASES[0]
    p = _problem(case)
    with pytest.raises(ValueError, match="advantages"):
        lmloss.rl.linear_policy_loss(p["hidden"], p["weight"], p["labels"], p["old"], p["adv"][:, :2])
    with pytest.raises(ValueError, match="loss_mode"):
        lmloss.rl.linear_policy_loss(p["hidden"], p["weight"], p["labels"], p["old"], p["adv"], loss_mode="grpo")
    with pytest.raises(ValueError, match="ref_logprobs"):
        lmloss.rl.linear_policy_loss(p["hidden"], p["weight"], p["labels"], p["old"], p["adv"], kl_loss_coef=0.1)


def test_full_kl_to_a_reference_head_holds_chunk_buffers_not_a_tokens_by_vocab_tensor():
    """``kl_loss_type="full"`` with ``ref_hidden``/``ref_weight``: the reference head is read chunk by chunk
    in the same loop, so the peak above linear_cross_entropy's is a fixed number of fp32 chunks (PyTorch
    kernels, the KL in the policy's gradient pass, the policy's chunk worked in place: the reference's chunk,
    which takes ``x - x_ref``, and the exps: 2 chunks above cross-entropy's one, with the entropy bonus too),
    never a ``[N, V]`` tensor."""
    n, h, v, chunk = 1024, 32, 2000, 64
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_()
    ref_hidden, ref_weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / h**0.5
    labels = torch.randint(0, v, (n,), generator=g)
    old, adv = -torch.rand(n, generator=g) - 7, torch.randn(n, generator=g)

    def peak(fn):
        hidden.grad = weight.grad = None
        with peak_memory(record=True, min_bytes=64 * 1024) as mem:
            fn().backward()
        return mem

    ce = peak(lambda: lmloss.linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)).peak_bytes
    chunk_bytes = chunk * v * 4
    for entropy_coeff, buffers in ((0.0, 2), (0.05, 2)):
        mem = peak(lambda coeff=entropy_coeff: lmloss.rl.linear_policy_loss(
            hidden, weight, labels, old, adv, kl_loss_type="full", kl_loss_coef=0.1, entropy_coeff=coeff,
            ref_hidden=ref_hidden, ref_weight=ref_weight, chunk_size=chunk)[0])  # fmt: skip
        bound = ce + buffers * chunk_bytes + 128 * n
        assert mem.peak_bytes <= bound, f"{(mem.peak_bytes - ce) / chunk_bytes:.2f} chunks above cross-entropy"
        assert bound < ce + n * v * 4  # the bound has teeth: one [N, V] fp32 tensor would not fit in it
        assert all(a.shape != (n, v) for a in mem.allocations)


@pytest.mark.parametrize("kl_type", ["k1", "abs", "k2", "low_var_kl"])
def test_under_the_samplers_top_p_the_kl_is_to_the_reference_on_its_full_distribution(kl_type):
    # the policy scored under the sampler's top-p, the reference model on its full distribution: finite, and
    # the plain math's loss and gradient; a reference scored under the top-p too (-inf on a sampled token its
    # own kept set leaves out) is refused, naming ref_logprobs
    from sampling_support import vllm_kept

    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (3.0 / H**0.5)
    ref_weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (3.0 / H**0.5)  # the policy moved far
    top_p = torch.full((B * T,), 0.7, dtype=torch.float64)
    kept = vllm_kept((hidden @ weight.T).view(-1, V), top_p=top_p).view(B, T, V)
    labels = torch.multinomial(kept.view(-1, V).double(), 1, generator=g).view(B, T)  # the sampler's tokens
    ref_logits = hidden @ ref_weight.T
    ref_full = ref_logits.log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    ref_kept = vllm_kept(ref_logits.view(-1, V), top_p=top_p).view(B, T, V)
    ref_truncated = ref_logits.masked_fill(~ref_kept, -torch.inf).log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    assert torch.isneginf(ref_truncated).any()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp = (h @ w.T).masked_fill(~kept, -torch.inf).log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    old = lp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    want = ref_actor_loss("vanilla", "token-mean", lp, old, adv, torch.ones(B, T, dtype=torch.bool), ref=ref_full,
                          kl_type=kl_type, kl_coef=0.3)  # fmt: skip
    want_grads = torch.autograd.grad(want, (h, w))
    common = dict(top_p=0.7, kl_loss_type=kl_type, kl_loss_coef=0.3, chunk_size=7)
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, metrics = lmloss.rl.linear_policy_loss(h2, w2, labels, old, adv, ref_logprobs=ref_full, **common)
    torch.testing.assert_close(loss, want, **F64_TOL)
    for got, expected in zip(torch.autograd.grad(loss, (h2, w2)), want_grads):
        torch.testing.assert_close(got, expected, **F64_TOL)
    assert all(torch.isfinite(v).all() for v in metrics.values())
    with pytest.raises(ValueError, match=r"ref_logprobs is -inf at \d+ counted token"):
        lmloss.rl.linear_policy_loss(h2, w2, labels, old, adv, ref_logprobs=ref_truncated, **common)


def test_the_kept_set_warning_counts_the_tokens_of_the_callers_mask():
    # a label outside the policy's kept set at a token the mask leaves out: not counted, no warning; the same
    # token in the mask: counted once, the message says of how many and by what
    import warnings

    from sampling_support import vllm_kept

    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (3.0 / H**0.5)
    kept = vllm_kept((hidden @ weight.T).view(-1, V), top_p=torch.full((B * T,), 0.5, dtype=torch.float64))
    labels = (hidden @ weight.T).argmax(-1)  # inside any kept set
    labels[1, 2] = (~kept.view(B, T, V)[1, 2]).nonzero()[0, 0]  # outside
    old, adv = torch.full((B, T), -1.0, dtype=torch.float64), torch.ones(B, T, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 2] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", lmloss.sampling.KeptSetWarning)
        lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, mask=mask, top_p=0.5)
    mask[1, 2], mask[0, 0] = True, False
    with pytest.warns(lmloss.sampling.KeptSetWarning, match=rf"1 label\(s\) of the {B * T - 1} counted \(labels != ignore_index and mask\)"):
        lmloss.rl.linear_policy_loss(hidden, weight, labels, old, adv, mask=mask, top_p=0.5)
