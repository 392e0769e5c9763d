"""token_logprobs / token_entropy / cross_entropy on one process, against plain-PyTorch fp64 references.

Every reference below is written out in plain PyTorch (log_softmax, gather, F.cross_entropy) in float64,
with autograd supplying the reference gradients; nothing here calls lmloss to compute an expected value.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lmloss

# lmloss computes in fp32 internally: against an fp64 reference of the same inputs we allow fp32 rounding.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(shape, *, seed=0, scale=3.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(shape, generator=_gen(seed), dtype=torch.float64) * scale).to(dtype)


def _labels(shape, vocab, *, seed=1, ignore_every=0, ignore_index=-100) -> torch.Tensor:
    labels = torch.randint(0, vocab, shape, generator=_gen(seed))
    if ignore_every:
        flat = labels.view(-1)
        flat[::ignore_every] = ignore_index
    return labels


def _ref_logprobs(
    x64: torch.Tensor, labels: torch.Tensor, *, temperature=1.0, ignore_index=-100, vocab_size=None
):
    """log_softmax(x / T)[label] in fp64 over the first `vocab_size` columns; 0 where ignored."""
    logp = torch.log_softmax(x64[..., :vocab_size] / temperature, dim=-1)
    valid = labels != ignore_index
    picked = logp.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked))


def _ref_entropy(x64: torch.Tensor, *, temperature=1.0, vocab_size=None, labels=None, ignore_index=-100):
    """The entropy of softmax(x / T) in fp64; with `labels` (token_logprobs' entropy), 0 where they are
    ignored: an ignored token counts for nothing, its entropy included."""
    logp = torch.log_softmax(x64[..., :vocab_size] / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return entropy if labels is None else torch.where(labels != ignore_index, entropy, 0.0)


def _leaf64(logits: torch.Tensor) -> torch.Tensor:
    return logits.detach().double().requires_grad_()


def _leaf(logits: torch.Tensor) -> torch.Tensor:
    return logits.detach().clone().requires_grad_()


# ----------------------------------------------------------------------------------------------------------
# token_logprobs


@pytest.mark.parametrize("shape", [(3, 5), (17,), (2, 3, 4)], ids=["B_S", "packed_T", "three_leading_dims"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
def test_token_logprobs_matches_log_softmax_gather_for_any_leading_shape(shape, temperature):
    vocab = 29
    logits = _leaf(_logits((*shape, vocab)))
    labels = _labels(shape, vocab)
    weights = torch.randn(shape, generator=_gen(2))

    out = lmloss.token_logprobs(logits, labels, chunk_size=4, temperature=temperature)
    (out * weights).sum().backward()

    x64 = _leaf64(logits)
    ref = _ref_logprobs(x64, labels, temperature=temperature)
    (ref * weights.double()).sum().backward()

    assert out.dtype == torch.float32 and out.shape == labels.shape
    torch.testing.assert_close(out.double(), ref.detach(), **FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)


def test_token_logprobs_on_a_single_position_with_scalar_label():
    logits = _leaf(_logits((13,)))
    label = torch.tensor(4)
    out = lmloss.token_logprobs(logits, label)
    out.backward()
    x64 = _leaf64(logits)
    ref = torch.log_softmax(x64, dim=-1)[4]
    ref.backward()
    assert out.shape == ()
    torch.testing.assert_close(out.double(), ref.detach(), **FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)


def test_empty_token_batch_gives_empty_outputs_and_gradient():
    logits = torch.zeros(0, 7, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long)
    out = lmloss.token_logprobs(logits, labels)
    out.sum().backward()
    assert out.shape == (0,)
    assert logits.grad.shape == (0, 7)


def test_ignored_positions_give_exactly_zero_and_no_gradient():
    logits = _leaf(_logits((4, 6, 19)))
    labels = _labels((4, 6), 19, ignore_every=3)
    ignored = labels == -100
    out = lmloss.token_logprobs(logits, labels, chunk_size=5)
    # large arbitrary upstream weights: ignored rows must still get exactly zero gradient
    (out * torch.randn(4, 6, generator=_gen(3)) * 100).sum().backward()
    assert ignored.sum() == 8
    assert torch.equal(out[ignored], torch.zeros(8))
    assert torch.equal(logits.grad[ignored], torch.zeros(8, 19))
    assert (logits.grad[~ignored].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("op", ["token_logprobs", "cross_entropy"])
def test_ignored_positions_get_no_gradient_even_from_non_finite_upstream(op):
    logits = _leaf(_logits((4, 6)))
    labels = torch.tensor([1, -100, 2, -100])
    upstream = torch.tensor([1.0, float("nan"), 2.0, float("inf")])  # e.g. advantages undefined at padding
    kwargs = dict(reduction="none") if op == "cross_entropy" else {}
    (getattr(lmloss, op)(logits, labels, **kwargs) * upstream).sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[1::2], torch.zeros(2, 6))


def test_custom_ignore_index_inside_the_vocabulary_is_ignored():
    logits = _leaf(_logits((10, 8)))
    labels = _labels((10,), 8)
    labels[[1, 4]] = 5
    out = lmloss.token_logprobs(logits, labels, ignore_index=5)
    out.sum().backward()
    x64 = _leaf64(logits)
    _ref_logprobs(x64, labels, ignore_index=5).sum().backward()
    assert (out[labels == 5] == 0).all()
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)


@pytest.mark.parametrize("ignore_index", [0, 5])
def test_mean_cross_entropy_with_an_ignore_index_inside_the_vocabulary_divides_by_the_other_tokens(
    ignore_index,
):
    """``reduction="mean"`` counts the tokens whose label is not `ignore_index`, also when it is a real id."""
    logits = _leaf(_logits((10, 8)))
    labels = _labels((10,), 8)
    labels[[1, 4, 7]] = ignore_index
    loss = lmloss.cross_entropy(logits, labels, ignore_index=ignore_index, chunk_size=3)
    loss.backward()
    x64 = _leaf64(logits)
    kept = labels != ignore_index
    picked = torch.log_softmax(x64, dim=-1)[kept].gather(1, labels[kept][:, None])
    ref = -picked.sum() / kept.sum()
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, **FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)


def test_return_entropy_gives_differentiable_logprobs_and_entropy_that_is_zero_at_ignored_tokens():
    logits = _leaf(_logits((5, 7, 23)))
    labels = _labels((5, 7), 23, ignore_every=4)
    adv = torch.randn(5, 7, generator=_gen(4))  # per-token RL advantages
    ent_w = torch.randn(5, 7, generator=_gen(5))  # arbitrary entropy-bonus weights
    T = 0.8

    logp, ent = lmloss.token_logprobs(logits, labels, chunk_size=6, temperature=T, return_entropy=True)
    ((logp * adv).sum() + (ent * ent_w).sum()).backward()

    x64 = _leaf64(logits)
    ref_lp = _ref_logprobs(x64, labels, temperature=T)
    ref_ent = _ref_entropy(x64, temperature=T, labels=labels)  # 0 where ignored, with no gradient
    ((ref_lp * adv.double()).sum() + (ref_ent * ent_w.double()).sum()).backward()

    assert ent.dtype == torch.float32 and ent.shape == labels.shape
    ignored = labels == -100
    assert ignored.any() and torch.equal(ent[ignored], torch.zeros_like(ent[ignored]))
    assert torch.equal(logits.grad[ignored], torch.zeros_like(logits.grad[ignored]))
    torch.testing.assert_close(logp.double(), ref_lp.detach(), **FP32_TOL)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), **FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)


@pytest.mark.parametrize("used", ["logprobs_only", "entropy_only"])
def test_return_entropy_with_only_one_output_used_gives_that_outputs_gradient(used):
    logits = _leaf(_logits((9, 17)))
    labels = _labels((9,), 17, ignore_every=4)
    logp, ent = lmloss.token_logprobs(logits, labels, chunk_size=4, return_entropy=True)
    (logp if used == "logprobs_only" else ent).sum().backward()
    x64 = _leaf64(logits)
    (_ref_logprobs(x64, labels) if used == "logprobs_only" else _ref_entropy(x64, labels=labels)).sum().backward()
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)


# ----------------------------------------------------------------------------------------------------------
# token_entropy


@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_token_entropy_is_shannon_entropy_of_tempered_softmax_with_gradient(temperature):
    logits = _leaf(_logits((3, 11, 31)))
    w = torch.randn(3, 11, generator=_gen(6))
    ent = lmloss.token_entropy(logits, chunk_size=8, temperature=temperature)
    (ent * w).sum().backward()
    x64 = _leaf64(logits)
    ref = _ref_entropy(x64, temperature=temperature)
    (ref * w.double()).sum().backward()
    assert ent.shape == (3, 11) and ent.dtype == torch.float32
    torch.testing.assert_close(ent.double(), ref.detach(), **FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)


def test_token_entropy_of_uniform_logits_is_log_vocab():
    ent = lmloss.token_entropy(torch.full((4, 50), 2.0))
    torch.testing.assert_close(ent, torch.full((4,), torch.log(torch.tensor(50.0)).item()))


def test_logprobs_and_entropy_of_the_same_logits_backpropagate_together():
    """SkyRL #1648: two ops reading the same logits, one backward; gradients must add up correctly."""
    hidden = torch.randn(12, 8, generator=_gen(7), requires_grad=True)
    weight = torch.randn(8, 27, generator=_gen(8), requires_grad=True)
    labels = _labels((12,), 27, ignore_every=5)
    adv = torch.randn(12, generator=_gen(9))

    logits = hidden @ weight  # non-leaf, shared by both ops
    logp = lmloss.token_logprobs(logits, labels, chunk_size=5)
    ent = lmloss.token_entropy(logits, chunk_size=3)
    (-(logp * adv).sum() - 0.01 * ent.sum()).backward()

    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    x64 = h64 @ w64
    (-(_ref_logprobs(x64, labels) * adv.double()).sum() - 0.01 * _ref_entropy(x64).sum()).backward()

    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# backward: saved tensors, dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backward_never_modifies_saved_logits_and_can_run_twice(dtype):
    logits = _leaf(_logits((13, 21), dtype=dtype))
    before = logits.detach().clone()
    version = logits._version
    labels = _labels((13,), 21, ignore_every=4)
    logp, ent = lmloss.token_logprobs(logits, labels, chunk_size=4, return_entropy=True)
    loss = logp.sum() + ent.sum() + lmloss.cross_entropy(logits, labels, chunk_size=5, label_smoothing=0.1)
    loss.backward(retain_graph=True)
    first = logits.grad.clone()
    logits.grad = None
    loss.backward()  # a second backward would see any in-place change of a saved tensor
    assert logits._version == version
    assert torch.equal(logits.detach(), before)
    assert torch.equal(logits.grad, first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["token_logprobs", "token_entropy", "cross_entropy"])
def test_gradient_dtype_is_the_logits_dtype(dtype, op):
    logits = _leaf(_logits((6, 10), dtype=dtype))
    labels = _labels((6,), 10)
    if op == "token_entropy":
        out = lmloss.token_entropy(logits, chunk_size=4)
    else:
        out = getattr(lmloss, op)(logits, labels, chunk_size=4)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert logits.grad.dtype == dtype
    assert logits.grad.shape == logits.shape


# ----------------------------------------------------------------------------------------------------------
# cross_entropy


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_reductions_match_f_cross_entropy(reduction):
    logits = _leaf(_logits((4, 9, 33)))
    labels = _labels((4, 9), 33, ignore_every=5)
    out = lmloss.cross_entropy(logits, labels, chunk_size=7, reduction=reduction)
    upstream = torch.randn(4, 9, generator=_gen(10)) if reduction == "none" else torch.tensor(1.0)
    (out * upstream).sum().backward()

    x64 = _leaf64(logits)
    ref = F.cross_entropy(x64.reshape(-1, 33), labels.reshape(-1), reduction=reduction)
    if reduction == "none":
        ref = ref.view(4, 9)
    (ref * upstream.double()).sum().backward()

    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref.detach(), **FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)


def test_cross_entropy_with_temperature_is_cross_entropy_of_scaled_logits():
    logits = _leaf(_logits((15, 12)))
    labels = _labels((15,), 12, ignore_every=6)
    out = lmloss.cross_entropy(logits, labels, temperature=1.7, chunk_size=4)
    out.backward()
    x64 = _leaf64(logits)
    F.cross_entropy(x64 / 1.7, labels).backward()
    torch.testing.assert_close(out.double(), F.cross_entropy(x64.detach() / 1.7, labels), **FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_with_every_token_ignored_is_zero_with_zero_gradient(reduction):
    logits = _leaf(_logits((3, 4, 10)))
    labels = torch.full((3, 4), -100)
    out = lmloss.cross_entropy(logits, labels, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    out.backward()
    assert out.item() == 0.0
    assert not torch.isnan(out)
    assert torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("label_smoothing", [0.1, 0.5, 1.0])
def test_label_smoothing_matches_f_cross_entropy(label_smoothing):
    logits = _leaf(_logits((21, 17)))
    labels = _labels((21,), 17, ignore_every=4)
    out = lmloss.cross_entropy(logits, labels, label_smoothing=label_smoothing, temperature=0.9, chunk_size=5)
    out.backward()
    x64 = _leaf64(logits)
    ref = F.cross_entropy(x64 / 0.9, labels, label_smoothing=label_smoothing)
    ref.backward()
    torch.testing.assert_close(out.double(), ref.detach(), **FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)


def test_z_loss_adds_squared_logsumexp_per_non_ignored_token():
    logits = _leaf(_logits((2, 8, 14), scale=4.0))
    labels = _labels((2, 8), 14, ignore_every=3)
    z, T = 1e-2, 1.3
    w = torch.randn(2, 8, generator=_gen(11))
    out = lmloss.cross_entropy(logits, labels, z_loss=z, temperature=T, reduction="none", chunk_size=3)
    (out * w).sum().backward()

    x64 = _leaf64(logits)
    nll = F.cross_entropy((x64 / T).reshape(-1, 14), labels.reshape(-1), reduction="none").view(2, 8)
    lse = torch.logsumexp(x64 / T, dim=-1)
    ref = torch.where(labels != -100, nll + z * lse**2, torch.zeros_like(nll))
    (ref * w.double()).sum().backward()

    assert (out[labels == -100] == 0).all()
    torch.testing.assert_close(out.double(), ref.detach(), **FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)


def test_z_loss_and_label_smoothing_combine_in_mean_reduction():
    logits = _leaf(_logits((19, 11)))
    labels = _labels((19,), 11, ignore_every=5)
    out = lmloss.cross_entropy(logits, labels, z_loss=1e-3, label_smoothing=0.2, chunk_size=6)
    out.backward()
    x64 = _leaf64(logits)
    valid = labels != -100
    smoothed = F.cross_entropy(x64, labels, label_smoothing=0.2, reduction="none")
    zl = 1e-3 * torch.logsumexp(x64, -1) ** 2
    ref = torch.where(valid, smoothed + zl, torch.zeros_like(zl)).sum() / valid.sum()
    ref.backward()
    torch.testing.assert_close(out.double(), ref.detach(), **FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)


# ----------------------------------------------------------------------------------------------------------
# chunk_size: bit-identical in fp32


def _all_outputs(logits, labels, chunk_size):
    """Values and gradients of every op (with options that exercise every backward term)."""
    x = _leaf(logits)
    w = torch.randn(labels.shape, generator=_gen(12))
    logp, ent = lmloss.token_logprobs(x, labels, chunk_size=chunk_size, temperature=0.7, return_entropy=True)
    ent2 = lmloss.token_entropy(x, chunk_size=chunk_size, temperature=1.3)
    ce = lmloss.cross_entropy(
        x, labels, chunk_size=chunk_size, label_smoothing=0.1, z_loss=1e-3, reduction="none"
    )
    ((logp * w).sum() + (ent * w.flip(0)).sum() + ent2.sum() + (ce * w.abs()).sum()).backward()
    return [logp.detach(), ent.detach(), ent2.detach(), ce.detach(), x.grad]


def test_fp32_values_and_gradients_are_bit_identical_for_every_chunk_size():
    logits = _logits((37, 301))
    labels = _labels((37,), 301, ignore_every=5)
    expected = _all_outputs(logits, labels, None)
    for chunk_size in (1, 7, 64, 36, 37, 1000):
        got = _all_outputs(logits, labels, chunk_size)
        for name, a, b in zip(
            ("logprobs", "entropy", "token_entropy", "cross_entropy", "grad"), got, expected
        ):
            assert torch.equal(a, b), f"{name} differs at chunk_size={chunk_size}"


def test_fp32_chunk_results_are_bit_identical_with_a_vocabulary_above_torch_grain_size():
    logits = _logits((3, 40000), seed=0)
    labels = _labels((3,), 40000)

    def run(chunk_size):
        x = _leaf(logits)
        logp, ent = lmloss.token_logprobs(x, labels, chunk_size=chunk_size, return_entropy=True)
        (logp.sum() + ent.sum()).backward()
        return [logp.detach(), ent.detach(), x.grad]

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected, got = run(None), run(1)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


# ----------------------------------------------------------------------------------------------------------
# vocab_size: embedding padding


def test_padding_columns_are_excluded_from_every_output_and_get_zero_gradient():
    vocab, padded = 21, 32
    logits = _logits((6, 5, padded))
    logits[..., vocab:] = 40.0  # padding with huge logits would dominate the softmax if it were counted
    logits = _leaf(logits)
    labels = _labels((6, 5), vocab, ignore_every=4)
    w = torch.randn(6, 5, generator=_gen(13))

    logp, ent = lmloss.token_logprobs(logits, labels, vocab_size=vocab, chunk_size=7, return_entropy=True)
    ent2 = lmloss.token_entropy(logits, vocab_size=vocab, chunk_size=4, temperature=0.6)
    ce = lmloss.cross_entropy(logits, labels, vocab_size=vocab, label_smoothing=0.3, z_loss=1e-3)
    ((logp * w).sum() + (ent * w).sum() + ent2.sum() + ce).backward()

    x64 = _leaf64(logits)
    r_lp = _ref_logprobs(x64, labels, vocab_size=vocab)
    r_ent = _ref_entropy(x64, vocab_size=vocab, labels=labels)
    r_ent2 = _ref_entropy(x64, vocab_size=vocab, temperature=0.6)
    real = x64[..., :vocab].reshape(-1, vocab)
    flat_labels = labels.reshape(-1)
    valid = flat_labels != -100
    per_tok = F.cross_entropy(real, flat_labels, label_smoothing=0.3, reduction="none")
    per_tok = per_tok + 1e-3 * torch.logsumexp(real, -1) ** 2
    r_ce = torch.where(valid, per_tok, torch.zeros_like(per_tok)).sum() / valid.sum()
    ((r_lp * w.double()).sum() + (r_ent * w.double()).sum() + r_ent2.sum() + r_ce).backward()

    torch.testing.assert_close(logp.double(), r_lp.detach(), **FP32_TOL)
    torch.testing.assert_close(ent.double(), r_ent.detach(), **FP32_TOL)
    torch.testing.assert_close(ent2.double(), r_ent2.detach(), **FP32_TOL)
    torch.testing.assert_close(ce.double(), r_ce.detach(), **FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x64.grad, **FP32_TOL)
    assert torch.equal(logits.grad[..., vocab:], torch.zeros(6, 5, padded - vocab))


# ----------------------------------------------------------------------------------------------------------
# low precision: fp32 math on the upcast inputs


@pytest.mark.parametrize(
    ("dtype", "grad_atol"),
    [(torch.bfloat16, 1e-2), (torch.float16, 1e-3)],  # the gradient is rounded once to the logits' dtype
    ids=["bf16", "fp16"],
)
@pytest.mark.parametrize("temperature", [1.0, 0.9])
def test_low_precision_logits_match_fp64_reference_of_the_same_values(dtype, grad_atol, temperature):
    logits = _leaf(_logits((4, 16, 200), dtype=dtype))
    labels = _labels((4, 16), 200, ignore_every=7)
    adv = torch.randn(4, 16, generator=_gen(14))
    T = temperature

    logp, ent = lmloss.token_logprobs(logits, labels, chunk_size=10, temperature=T, return_entropy=True)
    ce = lmloss.cross_entropy(logits, labels, chunk_size=10, temperature=T, label_smoothing=0.1)
    ((logp * adv).sum() + ent.sum() + ce).backward()

    x64 = _leaf64(logits)  # the exact low-precision values, upcast
    r_lp = _ref_logprobs(x64, labels, temperature=T)
    r_ent = _ref_entropy(x64, temperature=T, labels=labels)
    r_ce = F.cross_entropy((x64 / T).reshape(-1, 200), labels.reshape(-1), label_smoothing=0.1)
    ((r_lp * adv.double()).sum() + r_ent.sum() + r_ce).backward()

    # values are fp32 computations on exactly representable inputs: fp32 rounding only
    torch.testing.assert_close(logp.double(), r_lp.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ce.double(), r_ce.detach(), atol=2e-5, rtol=1e-5)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.double(), x64.grad, atol=grad_atol, rtol=1e-2)
    # the gradient is computed in fp32 and rounded once: within one ulp of the fp64 gradient rounded to dtype
    rounded = x64.grad.to(dtype).double()
    ulp = rounded.abs() * torch.finfo(dtype).eps + 1e-7
    assert ((logits.grad.double() - rounded).abs() <= ulp).all()


# ----------------------------------------------------------------------------------------------------------
# -inf logits (masked vocabulary)


def test_entropy_ignores_minus_inf_masked_columns():
    logits = _logits((4, 10))
    logits[:, 6:] = float("-inf")  # e.g. tokens masked out by the sampler
    logits = _leaf(logits)
    ent = lmloss.token_entropy(logits)
    ent.sum().backward()
    x64 = _leaf64(logits[:, :6])
    ref = _ref_entropy(x64)
    ref.sum().backward()
    torch.testing.assert_close(ent.double(), ref.detach(), **FP32_TOL)
    torch.testing.assert_close(logits.grad[:, :6].double(), x64.grad, **FP32_TOL)
    assert torch.equal(logits.grad[:, 6:], torch.zeros(4, 4))


# ----------------------------------------------------------------------------------------------------------
# bad input


def _ok():
    return torch.randn(3, 4, 10), torch.randint(0, 10, (3, 4))


BAD_INPUTS = [
    # (id, op, kwargs overriding the good call, exception, word the message must contain)
    ("labels_shape", "all_labelled", dict(labels=torch.zeros(3, 5, dtype=torch.long)), ValueError, "labels"),
    ("labels_rank", "all_labelled", dict(labels=torch.zeros(12, dtype=torch.long)), ValueError, "labels"),
    ("int_logits", "all", dict(logits=torch.zeros(3, 4, 10, dtype=torch.long)), TypeError, "logits"),
    ("float_labels", "all_labelled", dict(labels=torch.zeros(3, 4)), TypeError, "labels"),
    ("bool_labels", "all_labelled", dict(labels=torch.zeros(3, 4, dtype=torch.bool)), TypeError, "labels"),
    ("label_equal_vocab", "all_labelled", dict(labels=torch.full((3, 4), 10)), ValueError, "labels"),
    ("label_negative", "all_labelled", dict(labels=torch.full((3, 4), -1)), ValueError, "labels"),
    (
        "label_in_padding",
        "all_labelled",
        dict(labels=torch.full((3, 4), 8), vocab_size=8),
        ValueError,
        "labels",
    ),
    ("chunk_size_zero", "all", dict(chunk_size=0), ValueError, "chunk_size"),
    ("chunk_size_negative", "all", dict(chunk_size=-4), ValueError, "chunk_size"),
    ("temperature_zero", "all", dict(temperature=0.0), ValueError, "temperature"),
    ("temperature_negative", "all", dict(temperature=-1.0), ValueError, "temperature"),
    ("unknown_reduction", "cross_entropy", dict(reduction="avg"), ValueError, "reduction"),
    ("vocab_start_single_process", "all", dict(vocab_start=3), ValueError, "vocab_start"),
    ("vocab_size_too_large", "all", dict(vocab_size=11), ValueError, "vocab_size"),
]


def _call(op, logits, labels, **kwargs):
    if op == "token_entropy":
        return lmloss.token_entropy(logits, **kwargs)
    return getattr(lmloss, op)(logits, labels, **kwargs)


@pytest.mark.parametrize(
    ("case", "ops", "override", "exc", "word"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_raises_naming_the_argument(case, ops, override, exc, word):
    ops = {
        "all": ["token_logprobs", "token_entropy", "cross_entropy"],
        "all_labelled": ["token_logprobs", "cross_entropy"],
        "cross_entropy": ["cross_entropy"],
    }[ops]
    for op in ops:
        logits, labels = _ok()
        kwargs = dict(override)
        logits = kwargs.pop("logits", logits)
        labels = kwargs.pop("labels", labels)
        with pytest.raises(exc, match=word):
            _call(op, logits, labels, **kwargs)


def test_ignore_index_label_is_not_out_of_range():
    logits, labels = _ok()
    labels[0, 0] = -7
    out = lmloss.token_logprobs(logits, labels, ignore_index=-7)
    assert out[0, 0] == 0.0


# ----------------------------------------------------------------------------------------------------------
# odd inputs: a clear error naming the argument, or the right answer


LOGITS_OPS = ["token_logprobs", "token_entropy", "cross_entropy"]


def _triton_or_skip(impl: str) -> None:
    if impl == "triton":
        pytest.importorskip(
            "triton", reason='impl="triton" needs triton (run under TRITON_INTERPRET=1 on CPU)'
        )


@pytest.mark.parametrize("op", LOGITS_OPS)
def test_logits_with_an_empty_vocabulary_dimension_raise_a_clear_value_error(op):
    with pytest.raises(ValueError, match="vocabulary dimension is empty"):
        _call(op, torch.zeros(4, 0), torch.zeros(4, dtype=torch.long))


def test_float64_logits_are_computed_in_float64_and_pass_gradcheck():
    x = _logits((5, 7), seed=11, dtype=torch.float64).requires_grad_()
    labels = torch.tensor([3, -100, 0, 6, 2])
    kw = dict(chunk_size=2, temperature=0.7)
    # gradcheck: finite differences in float64 agree with the analytical gradient (fp32 math would not)
    assert torch.autograd.gradcheck(
        lambda a: lmloss.token_logprobs(a, labels, return_entropy=True, **kw), (x,)
    )
    assert torch.autograd.gradcheck(lambda a: lmloss.token_entropy(a, **kw), (x,))
    for reduction in ("none", "sum", "mean"):
        assert torch.autograd.gradcheck(
            lambda a, r=reduction: lmloss.cross_entropy(a, labels, reduction=r, z_loss=0.01, **kw), (x,)
        )
    logp, ent = lmloss.token_logprobs(x, labels, return_entropy=True, **kw)
    ce = lmloss.cross_entropy(x, labels, label_smoothing=0.1, **kw)
    assert logp.dtype == ent.dtype == ce.dtype == torch.float64
    ref_lp = _ref_logprobs(x.detach(), labels, temperature=0.7)
    ref_ce = F.cross_entropy(x.detach() / 0.7, labels, label_smoothing=0.1)
    torch.testing.assert_close(logp, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, _ref_entropy(x.detach(), temperature=0.7, labels=labels), atol=1e-12, rtol=0)
    torch.testing.assert_close(ce, ref_ce, atol=1e-12, rtol=0)


NON_FINITE_ROWS = {"nan_row": float("nan"), "minus_inf_row": -float("inf"), "plus_inf_row": float("inf")}

LABELLED_CALLS = {
    "logprobs": lambda x, y, impl: lmloss.token_logprobs(x, y, impl=impl, chunk_size=3),
    "logprobs_of_return_entropy": lambda x, y, impl: lmloss.token_logprobs(
        x, y, impl=impl, return_entropy=True
    )[0],
    "ce_none": lambda x, y, impl: lmloss.cross_entropy(x, y, impl=impl, reduction="none"),
    "ce_sum_smoothing_z_loss": lambda x, y, impl: lmloss.cross_entropy(
        x, y, impl=impl, reduction="sum", label_smoothing=0.1, z_loss=1e-2
    ),
    "ce_mean_inplace": lambda x, y, impl: lmloss.cross_entropy(x * 1.0, y, impl=impl, inplace_backward=True),
}


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("row", list(NON_FINITE_ROWS))
@pytest.mark.parametrize("call", list(LABELLED_CALLS))
def test_an_ignored_row_with_non_finite_logits_gives_exactly_zero_value_and_gradient(impl, row, call):
    _triton_or_skip(impl)
    x64 = _logits((5, 9), seed=4, dtype=torch.float64)
    x64[1] = NON_FINITE_ROWS[row]
    x64[3, 2] = NON_FINITE_ROWS[row]  # one non-finite column in another ignored row
    labels = torch.tensor([4, -100, 0, -100, 8])
    x = x64.float().requires_grad_()
    out = LABELLED_CALLS[call](x, labels, impl)
    (out * torch.arange(1.0, 1.0 + out.numel()).view(out.shape)).sum().backward()
    ignored = labels == -100
    assert torch.equal(x.grad[ignored], torch.zeros(2, 9))
    # the other rows are unaffected: the same as the op on the finite rows alone
    kept = _leaf(x64[~ignored].float())
    ref = LABELLED_CALLS[call](kept, labels[~ignored], impl)
    if out.dim() == 1:
        assert torch.equal(out[ignored], torch.zeros(2))
        torch.testing.assert_close(out[~ignored], ref, **FP32_TOL)
    else:  # the summed / mean loss: ignored rows add nothing (mean: nor to the count)
        torch.testing.assert_close(out, ref, **FP32_TOL)
        ref.backward()
        torch.testing.assert_close(x.grad[~ignored], kept.grad, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
def test_small_integer_label_dtypes_give_the_int64_result(dtype):
    x = _logits((6, 11), seed=5)
    labels = torch.tensor([0, 10, 3, 7, 5, 1])
    for op in ("token_logprobs", "cross_entropy"):
        a, b = _leaf(x), _leaf(x)
        want = _call(op, a, labels, chunk_size=4)
        got = _call(op, b, labels.to(dtype), chunk_size=4)
        got.sum().backward()
        want.sum().backward()
        assert torch.equal(got, want) and torch.equal(b.grad, a.grad)
    if dtype != torch.uint8:  # a negative ignore_index in a signed small dtype is still ignored
        ignored = labels.to(dtype).clone()
        ignored[2] = -100
        assert lmloss.token_logprobs(x, ignored)[2] == 0.0


@pytest.mark.parametrize("op", ["token_logprobs", "cross_entropy"])
def test_labels_on_another_device_raise_naming_labels(op):
    x = _logits((3, 5))
    with pytest.raises(ValueError, match="labels are on meta"):
        _call(op, x, torch.zeros(3, dtype=torch.long, device="meta"))


ODD_OPTIONS = [
    # (id, ops, kwargs, exception, the argument the message must name)
    (
        "ignore_index_none",
        ["token_logprobs", "cross_entropy"],
        dict(ignore_index=None),
        TypeError,
        "ignore_index",
    ),
    (
        "ignore_index_float",
        ["token_logprobs", "cross_entropy"],
        dict(ignore_index=2.5),
        TypeError,
        "ignore_index",
    ),
    (
        "ignore_index_bool",
        ["token_logprobs", "cross_entropy"],
        dict(ignore_index=True),
        TypeError,
        "ignore_index",
    ),
    ("vocab_size_float", LOGITS_OPS, dict(vocab_size=10.0), TypeError, "vocab_size"),
    ("vocab_size_bool", LOGITS_OPS, dict(vocab_size=True), TypeError, "vocab_size"),
    ("temperature_overflows", LOGITS_OPS, dict(temperature=1e-40), ValueError, "temperature"),
    ("temperature_inf", LOGITS_OPS, dict(temperature=float("inf")), ValueError, "temperature"),
    ("temperature_bool", LOGITS_OPS, dict(temperature=True), TypeError, "temperature"),
    ("softcap_zero", LOGITS_OPS, dict(softcap=0), ValueError, "softcap"),
    ("softcap_negative", LOGITS_OPS, dict(softcap=-1), ValueError, "softcap"),
    ("softcap_bool", LOGITS_OPS, dict(softcap=True), TypeError, "softcap"),
    (
        "ignore_index_past_int64",
        ["token_logprobs", "cross_entropy"],
        dict(ignore_index=2**64),
        ValueError,
        "ignore_index must fit in int64",
    ),
    (
        "ignore_index_below_int64",
        ["token_logprobs", "cross_entropy"],
        dict(ignore_index=-(2**63) - 1),
        ValueError,
        "ignore_index",
    ),
    (
        "tp_group_a_string",
        LOGITS_OPS,
        dict(tp_group="tp"),
        TypeError,
        "tp_group must be a torch.distributed.ProcessGroup",
    ),
    ("mean_group_a_string", ["cross_entropy"], dict(mean_group="dp"), TypeError, "mean_group must be a"),
    ("tp_group_not_a_member", LOGITS_OPS, dict(tp_group=-100), ValueError, "not a member of tp_group"),
    (
        "inplace_backward_a_string",
        ["cross_entropy"],
        dict(inplace_backward="yes"),
        TypeError,
        "inplace_backward",
    ),
    ("chunk_size_zero", LOGITS_OPS, dict(chunk_size=0), ValueError, "chunk_size"),
    ("chunk_size_bool", LOGITS_OPS, dict(chunk_size=True), TypeError, "chunk_size"),
    ("label_smoothing_bool", ["cross_entropy"], dict(label_smoothing=True), TypeError, "label_smoothing"),
    ("impl_unknown", LOGITS_OPS, dict(impl="cuda"), ValueError, "impl"),
]


@pytest.mark.parametrize(("case", "ops", "kw", "exc", "word"), ODD_OPTIONS, ids=[c[0] for c in ODD_OPTIONS])
def test_odd_option_values_raise_naming_the_option(case, ops, kw, exc, word):
    logits, labels = _ok()
    for op in ops:
        with pytest.raises(exc, match=word):
            _call(op, logits, labels, **kw)


@pytest.mark.parametrize("op", LOGITS_OPS)
def test_double_backward_raises_a_runtime_error_naming_lmloss(op):
    logits, labels = _ok()
    for upstream_requires_grad in (False, True):
        x = _leaf(logits)
        w = torch.ones(3, 4, requires_grad=upstream_requires_grad)
        (g,) = torch.autograd.grad((_call(op, x, labels) * w).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="lmloss ops are differentiable once"):
            g.square().sum().backward()
