"""linear_token_logprobs / linear_cross_entropy on one process, against plain-PyTorch fp64 references.

Every expected value is written out below in plain PyTorch over the materialized fp64 logits
``(hidden @ weight.T + bias) / T`` restricted to the first ``vocab_size`` columns (log_softmax, gather,
logsumexp), with autograd supplying the reference gradients for hidden, weight and bias. One table of
cases (`CASES`) drives the fused ops *and* the logits ops on the materialized logits, so both paths are
held to the same cases and the same reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lmloss
from lmloss.chunks import MemoryBudgetError, auto_chunk_size

# lmloss computes in fp32 internally: against an fp64 reference of the same inputs we allow fp32 rounding.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)


pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration of the fused ops. V is V_local (= the global columns on one process)."""

    name: str
    shape: tuple[int, ...] = (3, 7)
    hidden_dim: int = 16
    V: int = 40
    bias: bool = False
    temperature: float = 1.0
    ignore_index: int = -100
    ignore_every: int = 0
    vocab_size: int | None = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    chunk_size: int | None = 4

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("plain"),
    Case("bias_low_temperature", bias=True, temperature=0.7, ignore_every=5),
    Case("custom_ignore_index_high_temperature", temperature=2.5, ignore_index=-1, ignore_every=3),
    Case("padded_vocab_with_bias", bias=True, vocab_size=33, ignore_every=4),
    Case("packed_1d_one_chunk", shape=(23,), bias=True, chunk_size=None, vocab_size=37),
    Case(
        "smoothing_zloss_everything",
        shape=(2, 3, 5),
        bias=True,
        temperature=1.3,
        ignore_every=4,
        vocab_size=35,
        label_smoothing=0.1,
        z_loss=1e-3,
        chunk_size=7,
    ),
]


def _problem(case: Case, *, seed: int = 0, dtype=torch.float32):
    """hidden [*shape, H], weight [V, H], bias [V] | None, labels [*shape] (some ignored), two per-token weights.

    Logits have std ~2; padded weight rows (>= vocab_size) are made large so that counting them would show.
    """
    g = _gen(seed)
    hidden = torch.randn(*case.shape, case.hidden_dim, generator=g)
    weight = torch.randn(case.V, case.hidden_dim, generator=g) * (2.0 / case.hidden_dim**0.5)
    bias = torch.randn(case.V, generator=g) if case.bias else None
    real = case.V if case.vocab_size is None else case.vocab_size
    if case.vocab_size is not None:
        weight[real:] *= 10.0
    labels = torch.randint(0, real, case.shape, generator=g)
    if case.ignore_every:
        labels.view(-1)[:: case.ignore_every] = case.ignore_index
    adv = torch.randn(case.shape, generator=g)  # e.g. RL advantages: mixed signs
    ent_w = torch.randn(case.shape, generator=g)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    return hidden, weight, bias, labels, adv, ent_w


def _leaves(*tensors, dtype=None):
    """Fresh leaf copies that require grad (None stays None)."""
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
        else:
            c = t.detach().clone() if dtype is None else t.detach().to(dtype)
            out.append(c.requires_grad_())
    return out


def _ref_logits(h64, w64, b64, *, temperature, vocab_size):
    """fp64 ``(hidden @ weight.T + bias) / T`` over the real vocabulary columns."""
    z = h64 @ w64.T
    if b64 is not None:
        z = z + b64
    return (z / temperature)[..., :vocab_size]


def _ref_outputs(x, labels, *, ignore_index, label_smoothing=0.0, z_loss=0.0):
    """Per-token logprobs, entropy and cross-entropy, each 0 where the label is ignored (an ignored token
    counts for nothing: none of its outputs, no gradient)."""
    logp = torch.log_softmax(x, dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0)
    picked = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    logprobs = torch.where(valid, picked, 0.0)
    entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    loss = (1 - label_smoothing) * -picked + label_smoothing * -logp.mean(-1)
    loss = loss + z_loss * torch.logsumexp(x, dim=-1) ** 2
    loss = torch.where(valid, loss, 0.0)
    return logprobs, entropy, loss


def _fused_kwargs(case: Case) -> dict:
    return dict(
        chunk_size=case.chunk_size,
        temperature=case.temperature,
        ignore_index=case.ignore_index,
        vocab_size=case.vocab_size,
    )


def _ce_kwargs(case: Case) -> dict:
    return dict(**_fused_kwargs(case), label_smoothing=case.label_smoothing, z_loss=case.z_loss)


def _reduce(loss, labels, ignore_index, reduction):
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (labels != ignore_index).sum().clamp(min=1)


def _assert_grads(got, ref, tol=FP32_TOL, what=""):
    for name, g, r in zip(("hidden", "weight", "bias"), got, ref):
        if r is None:
            continue
        assert g.grad is not None, f"{what}: no gradient for {name}"
        assert g.grad.dtype == g.dtype, f"{what}: {name}.grad is {g.grad.dtype}, input {g.dtype}"
        torch.testing.assert_close(g.grad.double(), r.grad, **tol, msg=f"{what}: {name}.grad")


# ----------------------------------------------------------------------------------------------------------
# values and gradients against the reference, one table of cases


@pytest.mark.parametrize("case", CASES, ids=str)
def test_linear_token_logprobs_and_entropy_match_reference_for_per_token_upstream_gradients(case):
    hidden, weight, bias, labels, adv, ent_w = _problem(case)
    h, w, b = _leaves(hidden, weight, bias)
    logp, ent = lmloss.linear_token_logprobs(h, w, labels, bias=b, return_entropy=True, **_fused_kwargs(case))
    ((logp * adv).sum() + (ent * ent_w).sum()).backward()

    h64, w64, b64 = _leaves(hidden, weight, bias, dtype=torch.float64)
    x = _ref_logits(h64, w64, b64, temperature=case.temperature, vocab_size=case.vocab_size)
    ref_logp, ref_ent, _ = _ref_outputs(x, labels, ignore_index=case.ignore_index)
    ((ref_logp * adv.double()).sum() + (ref_ent * ent_w.double()).sum()).backward()

    assert logp.shape == ent.shape == labels.shape and logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp.detach(), **FP32_TOL)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), **FP32_TOL)
    assert torch.all(logp[labels == case.ignore_index] == 0.0)
    _assert_grads((h, w, b), (h64, w64, b64), what=case.name)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_linear_cross_entropy_matches_reference_loss_and_gradients(case, reduction):
    hidden, weight, bias, labels, adv, _ = _problem(case, seed=1)
    h, w, b = _leaves(hidden, weight, bias)
    loss = lmloss.linear_cross_entropy(h, w, labels, bias=b, reduction=reduction, **_ce_kwargs(case))
    (loss * adv).sum().backward() if reduction == "none" else loss.backward()

    h64, w64, b64 = _leaves(hidden, weight, bias, dtype=torch.float64)
    x = _ref_logits(h64, w64, b64, temperature=case.temperature, vocab_size=case.vocab_size)
    _, _, ref = _ref_outputs(
        x, labels, ignore_index=case.ignore_index, label_smoothing=case.label_smoothing, z_loss=case.z_loss
    )
    if reduction == "none":
        (ref * adv.double()).sum().backward()
    else:
        ref = _reduce(ref, labels, case.ignore_index, reduction)
        ref.backward()

    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    torch.testing.assert_close(loss.double(), ref.detach(), **FP32_TOL)
    _assert_grads((h, w, b), (h64, w64, b64), what=f"{case.name}/{reduction}")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_logits_ops_on_the_materialized_logits_meet_the_same_cases(case):
    """The same table and reference, for lmloss.token_logprobs / cross_entropy over hidden @ W.T + b."""
    hidden, weight, bias, labels, adv, ent_w = _problem(case)
    z = hidden @ weight.T + (0 if bias is None else bias)
    x1, x2 = _leaves(z, z)
    kw = _fused_kwargs(case)
    logp, ent = lmloss.token_logprobs(x1, labels, return_entropy=True, **kw)
    ((logp * adv).sum() + (ent * ent_w).sum()).backward()
    ce = lmloss.cross_entropy(x2, labels, reduction="none", **_ce_kwargs(case))
    (ce * adv).sum().backward()

    z1, z2 = _leaves(z, z, dtype=torch.float64)
    x = (z1 / case.temperature)[..., : case.vocab_size]
    ref_logp, ref_ent, _ = _ref_outputs(x, labels, ignore_index=case.ignore_index)
    ((ref_logp * adv.double()).sum() + (ref_ent * ent_w.double()).sum()).backward()
    x = (z2 / case.temperature)[..., : case.vocab_size]
    _, _, ref_ce = _ref_outputs(
        x, labels, ignore_index=case.ignore_index, label_smoothing=case.label_smoothing, z_loss=case.z_loss
    )
    (ref_ce * adv.double()).sum().backward()

    torch.testing.assert_close(logp.double(), ref_logp.detach(), **FP32_TOL)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), **FP32_TOL)
    torch.testing.assert_close(ce.double(), ref_ce.detach(), **FP32_TOL)
    torch.testing.assert_close(x1.grad.double(), z1.grad, **FP32_TOL)
    torch.testing.assert_close(x2.grad.double(), z2.grad, **FP32_TOL)


def _temp_vocab(case: Case) -> dict:
    return dict(temperature=case.temperature, vocab_size=case.vocab_size)


# ----------------------------------------------------------------------------------------------------------
# argument semantics


def test_rl_advantages_of_mixed_sign_give_correct_gradients_for_hidden_weight_and_bias():
    """Liger-Kernel #968: an upstream gradient that is not all ones must reach all three inputs."""
    case = Case("rl", shape=(4, 9), bias=True, temperature=0.9, ignore_every=6, chunk_size=5)
    hidden, weight, bias, labels, _, _ = _problem(case, seed=7)
    adv = torch.tensor([2.0, -1.0, 0.0, 0.5]).repeat_interleave(9).view(4, 9)  # per-sequence advantages
    ent_coef = torch.full((4, 9), -0.01)  # entropy bonus
    h, w, b = _leaves(hidden, weight, bias)
    logp, ent = lmloss.linear_token_logprobs(h, w, labels, bias=b, return_entropy=True, **_fused_kwargs(case))
    ((logp * adv).sum() + (ent * ent_coef).sum()).backward()

    h64, w64, b64 = _leaves(hidden, weight, bias, dtype=torch.float64)
    x = _ref_logits(h64, w64, b64, **_temp_vocab(case))
    ref_logp, ref_ent, _ = _ref_outputs(x, labels, ignore_index=-100)
    ((ref_logp * adv.double()).sum() + (ref_ent * ent_coef.double()).sum()).backward()
    _assert_grads((h, w, b), (h64, w64, b64), what="rl")
    # the zero-advantage sequence gets only the entropy bonus' gradient, which is small but not zero
    assert 0 < h.grad[2].abs().max() < h.grad[0].abs().max()


def test_entropy_alone_is_differentiable_when_logprobs_are_unused():
    case = Case("entropy_only", bias=True, temperature=1.7, vocab_size=36, chunk_size=3)
    hidden, weight, bias, labels, _, ent_w = _problem(case, seed=3)
    h, w, b = _leaves(hidden, weight, bias)
    _, ent = lmloss.linear_token_logprobs(h, w, labels, bias=b, return_entropy=True, **_fused_kwargs(case))
    (ent * ent_w).sum().backward()

    h64, w64, b64 = _leaves(hidden, weight, bias, dtype=torch.float64)
    _, ref_ent, _ = _ref_outputs(_ref_logits(h64, w64, b64, **_temp_vocab(case)), labels, ignore_index=-100)
    (ref_ent * ent_w.double()).sum().backward()
    torch.testing.assert_close(ent.double(), ref_ent.detach(), **FP32_TOL)
    _assert_grads((h, w, b), (h64, w64, b64), what="entropy only")


@pytest.mark.parametrize("op", ["logprobs", "ce_mean", "ce_none"])
def test_ignored_tokens_give_exactly_zero_and_no_hidden_gradient(op):
    case = Case("ignore", shape=(12,), bias=True, temperature=0.8, ignore_every=3, chunk_size=5)
    hidden, weight, bias, labels, adv, _ = _problem(case, seed=4)
    ignored = labels == -100
    h, w, b = _leaves(hidden, weight, bias)
    if op == "logprobs":
        out = lmloss.linear_token_logprobs(h, w, labels, bias=b, **_fused_kwargs(case))
        (out * adv).sum().backward()
        assert torch.all(out[ignored] == 0.0)
    elif op == "ce_none":
        out = lmloss.linear_cross_entropy(h, w, labels, bias=b, reduction="none", label_smoothing=0.2,
                                          z_loss=1e-2, **_fused_kwargs(case))  # fmt: skip
        (out * adv).sum().backward()
        assert torch.all(out[ignored] == 0.0)
    else:
        lmloss.linear_cross_entropy(
            h, w, labels, bias=b, label_smoothing=0.2, z_loss=1e-2, **_fused_kwargs(case)
        ).backward()
    assert torch.all(h.grad[ignored] == 0.0)
    assert torch.all(h.grad[~ignored].abs().sum(-1) > 0)


@pytest.mark.parametrize("path", ["logprobs_entropy", "ce_none", "ce_sum"])
def test_padded_vocab_columns_get_exactly_zero_weight_and_bias_gradient(path):
    case = Case("pad", bias=True, vocab_size=29, temperature=1.1, label_smoothing=0.3, z_loss=1e-2)
    hidden, weight, bias, labels, adv, ent_w = _problem(case, seed=5)
    h, w, b = _leaves(hidden, weight, bias)
    if path == "logprobs_entropy":
        logp, ent = lmloss.linear_token_logprobs(h, w, labels, bias=b, return_entropy=True,
                                                 **_fused_kwargs(case))  # fmt: skip
        ((logp * adv).sum() + (ent * ent_w).sum()).backward()
    else:
        red = path.split("_")[1]
        loss = lmloss.linear_cross_entropy(h, w, labels, bias=b, reduction=red, **_ce_kwargs(case))
        (loss * adv).sum().backward() if red == "none" else loss.backward()
    assert torch.all(w.grad[29:] == 0.0) and torch.all(b.grad[29:] == 0.0)
    assert torch.all(w.grad[:29].abs().sum(-1) > 0) and torch.all(b.grad[:29] != 0.0)


def test_label_smoothing_mixes_in_the_mean_over_the_real_vocabulary_only():
    """smoothing = mean_j(-log p_j) over vocab_size columns: with eps=1 the loss is exactly that mean."""
    case = Case("smooth", vocab_size=30, chunk_size=2)
    hidden, weight, _, labels, _, _ = _problem(case, seed=6)
    loss = lmloss.linear_cross_entropy(hidden, weight, labels, reduction="none", label_smoothing=1.0,
                                       **_fused_kwargs(case))  # fmt: skip
    x = (hidden.double() @ weight.double().T)[..., :30]
    ref = -torch.log_softmax(x, -1).mean(-1)
    torch.testing.assert_close(loss.double(), ref, **FP32_TOL)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_all_ignored_mean_is_zero_with_zero_gradients_not_nan(chunk_size):
    case = Case("all_ignored", bias=True, chunk_size=chunk_size)
    hidden, weight, bias, labels, _, _ = _problem(case)
    labels = torch.full_like(labels, -100)
    h, w, b = _leaves(hidden, weight, bias)
    loss = lmloss.linear_cross_entropy(
        h, w, labels, bias=b, label_smoothing=0.1, z_loss=1e-3, chunk_size=chunk_size
    )
    loss.backward()
    assert loss.item() == 0.0
    for t in (h, w, b):
        assert t.grad is not None and torch.all(t.grad == 0.0)


def test_leading_dims_are_kept_and_labels_may_be_int32():
    case = Case("int32", shape=(2, 3, 4), chunk_size=5)
    hidden, weight, _, labels, _, _ = _problem(case)
    out64 = lmloss.linear_token_logprobs(hidden, weight, labels, chunk_size=5)
    out32 = lmloss.linear_token_logprobs(hidden, weight, labels.int(), chunk_size=5)
    assert out64.shape == (2, 3, 4)
    torch.testing.assert_close(out32, out64, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------------
# low precision: gradients in the input dtype, accumulated in fp32

# bf16/fp16 inputs: the reference is fp64 math on the *same* (upcast) low-precision values. The op's matmul
# returns logits rounded to the input dtype (relative 2^-8 for bf16, 2^-11 for fp16) and the returned
# gradients are rounded to it as well, so we allow: values atol LOWP_VALUE_TOL (logits here reach |z| ~ 10),
# gradients within LOWP_GRAD_REL of the largest reference gradient entry. Measured here: bf16 values 3.0e-2,
# grads 5.7e-3; fp16 values 3.4e-3, grads 1.3e-3.
LOWP_VALUE_TOL = {torch.bfloat16: 5e-2, torch.float16: 1e-2}
LOWP_GRAD_REL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("op", ["logprobs_entropy", "ce_mean"])
def test_low_precision_inputs_get_gradients_in_their_dtype_close_to_fp64_reference(dtype, op):
    case = Case("lowp", shape=(64,), hidden_dim=32, V=96, bias=True, temperature=0.9, vocab_size=90,
                ignore_every=7, chunk_size=16, label_smoothing=0.1)  # fmt: skip
    hidden, weight, bias, labels, adv, ent_w = _problem(case, seed=8, dtype=dtype)
    h, w, b = _leaves(hidden, weight, bias)
    h64, w64, b64 = _leaves(hidden, weight, bias, dtype=torch.float64)
    x = _ref_logits(h64, w64, b64, **_temp_vocab(case))
    ref_logp, ref_ent, ref_loss = _ref_outputs(x, labels, ignore_index=-100, label_smoothing=0.1)
    if op == "logprobs_entropy":
        logp, ent = lmloss.linear_token_logprobs(h, w, labels, bias=b, return_entropy=True,
                                                 **_fused_kwargs(case))  # fmt: skip
        ((logp * adv).sum() + (ent * ent_w).sum()).backward()
        ((ref_logp * adv.double()).sum() + (ref_ent * ent_w.double()).sum()).backward()
        pairs = [(logp, ref_logp), (ent, ref_ent)]
    else:
        loss = lmloss.linear_cross_entropy(h, w, labels, bias=b, **_ce_kwargs(case))
        ref = _reduce(ref_loss, labels, -100, "mean")
        loss.backward()
        ref.backward()
        pairs = [(loss, ref)]
    for got, ref in pairs:
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref.detach(), atol=LOWP_VALUE_TOL[dtype], rtol=0)
    for name, t, r in zip(("hidden", "weight", "bias"), (h, w, b), (h64, w64, b64)):
        assert t.grad.dtype == dtype, name
        err = (t.grad.double() - r.grad).abs().max() / r.grad.abs().max()
        assert err <= LOWP_GRAD_REL[dtype], f"{name}: relative error {err:.2e}"


def test_bf16_weight_gradient_over_many_chunks_is_accumulated_in_fp32():
    """128 chunks of 8 tokens: the fp32 accumulator keeps the weight gradient within bf16's final rounding;
    the same sum accumulated in bf16 (written out below) is several times worse."""
    case = Case("acc", shape=(1024,), hidden_dim=16, V=32, chunk_size=8)
    hidden, weight, _, labels, _, _ = _problem(case, seed=9, dtype=torch.bfloat16)
    h, w = _leaves(hidden, weight)
    lmloss.linear_cross_entropy(h, w, labels, reduction="sum", chunk_size=8).backward()

    h64, w64 = _leaves(hidden, weight, dtype=torch.float64)
    _, _, ref = _ref_outputs(h64 @ w64.T, labels, ignore_index=-100)
    ref.sum().backward()
    scale = w64.grad.abs().max()
    err = (w.grad.double() - w64.grad).abs().max() / scale

    # bf16 accumulation of the exact per-chunk contributions (the thing fp32 accumulation avoids)
    with torch.no_grad():
        p = torch.softmax(h64 @ w64.T, -1)
        dz = p - torch.nn.functional.one_hot(labels, 32).double()
        acc = torch.zeros(32, 16, dtype=torch.bfloat16)
        for s in range(0, 1024, 8):
            acc += (dz[s : s + 8].T @ h64[s : s + 8]).to(torch.bfloat16)
    err_bf16_acc = (acc.double() - w64.grad).abs().max() / scale
    assert err <= 2**-8, f"fp32-accumulated error {err:.2e}"
    assert err_bf16_acc > 2 * err, f"bf16 accumulation {err_bf16_acc:.2e} vs lmloss {err:.2e}"


# ----------------------------------------------------------------------------------------------------------
# chunking, the two gradient paths, no_grad


def _grads_for(fn, hidden, weight, bias):
    h, w, b = _leaves(hidden, weight, bias)
    out = fn(h, w, b)
    return out.detach(), [t.grad for t in (h, w, b)]


@pytest.mark.parametrize("op", ["logprobs_entropy", "ce_mean"])
def test_chunk_size_int_none_and_auto_agree(op, monkeypatch):
    case = Case("chunks", shape=(50,), V=40, bias=True, temperature=0.8, vocab_size=38, ignore_every=6,
                label_smoothing=0.1, z_loss=1e-3)  # fmt: skip
    hidden, weight, bias, labels, adv, ent_w = _problem(case, seed=10)
    # a budget small enough that "auto" really chunks: 0.01 MiB / (2 * 4 bytes * 40 columns) -> 32 tokens
    monkeypatch.setenv("LMLOSS_CHUNK_BUDGET_MIB", "0.01")
    assert auto_chunk_size(50, 40) == 32

    def run(chunk_size):
        def fn(h, w, b):
            kw = dict(_ce_kwargs(case), chunk_size=chunk_size)
            if op == "ce_mean":
                out = lmloss.linear_cross_entropy(h, w, labels, bias=b, **kw)
                out.backward()
                return out
            kw.pop("label_smoothing"), kw.pop("z_loss")
            logp, ent = lmloss.linear_token_logprobs(h, w, labels, bias=b, return_entropy=True, **kw)
            ((logp * adv).sum() + (ent * ent_w).sum()).backward()
            return torch.stack([logp, ent])

        return _grads_for(fn, hidden, weight, bias)

    base_out, base_grads = run(None)
    for chunk_size in (1, 7, 50, 64, "auto"):
        out, grads = run(chunk_size)
        torch.testing.assert_close(out, base_out, **FP32_TOL, msg=f"chunk_size={chunk_size}")
        for g, bg in zip(grads, base_grads):
            torch.testing.assert_close(g, bg, **FP32_TOL, msg=f"chunk_size={chunk_size}")


def test_auto_chunk_size_fits_two_fp32_chunks_in_the_budget(monkeypatch):
    monkeypatch.delenv("LMLOSS_CHUNK_BUDGET_MIB", raising=False)
    # 64 MiB / (2 * 4 bytes * 32000) = 262.1 rows -> 256 (multiple of 64)
    assert auto_chunk_size(10**6, 32000) == 256
    assert auto_chunk_size(100, 32000) == 100  # never more than the tokens
    with pytest.raises(MemoryBudgetError, match=r"memory_budget_mib.*smallest this call can honour, 61035.157 MiB"):
        auto_chunk_size(10**6, 10**9)  # not even chunks of 8 rows: refused, not run in 1-row chunks
    monkeypatch.setenv("LMLOSS_CHUNK_BUDGET_MIB", "128")
    assert auto_chunk_size(10**6, 32000) == 512


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_summed_loss_path_agrees_with_per_token_recompute_path(reduction):
    """reduction mean/sum computes gradients during the forward; "none" then .mean()/.sum() recomputes."""
    case = Case("paths", shape=(5, 6), bias=True, temperature=0.6, vocab_size=37, ignore_every=4,
                label_smoothing=0.15, z_loss=1e-3, chunk_size=4)  # fmt: skip
    hidden, weight, bias, labels, _, _ = _problem(case, seed=11)

    def fused(h, w, b):
        loss = lmloss.linear_cross_entropy(h, w, labels, bias=b, reduction=reduction, **_ce_kwargs(case))
        loss.backward()
        return loss

    def recompute(h, w, b):
        per_tok = lmloss.linear_cross_entropy(h, w, labels, bias=b, reduction="none", **_ce_kwargs(case))
        loss = per_tok.sum() if reduction == "sum" else per_tok.sum() / (labels != -100).sum()
        loss.backward()
        return loss

    out_a, grads_a = _grads_for(fused, hidden, weight, bias)
    out_b, grads_b = _grads_for(recompute, hidden, weight, bias)
    torch.testing.assert_close(out_a, out_b, **FP32_TOL)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, **FP32_TOL)


def test_summed_loss_upstream_gradient_scales_the_forward_computed_gradients():
    case = Case("scale", bias=True, temperature=1.2)
    hidden, weight, bias, labels, _, _ = _problem(case, seed=12)
    h, w, b = _leaves(hidden, weight, bias)
    (lmloss.linear_cross_entropy(h, w, labels, bias=b, reduction="sum", **_ce_kwargs(case)) * -3.0).backward()
    h64, w64, b64 = _leaves(hidden, weight, bias, dtype=torch.float64)
    _, _, ref = _ref_outputs(_ref_logits(h64, w64, b64, **_temp_vocab(case)), labels, ignore_index=-100)
    (ref.sum() * -3.0).backward()
    _assert_grads((h, w, b), (h64, w64, b64), what="scaled")


def test_summed_loss_second_backward_through_the_same_graph_gives_the_same_gradients_again():
    """The summed path hands out its forward-computed gradients on the first backward; a second one
    (retain_graph=True, as gradcheck makes) recomputes them: the same values, bit for bit."""
    case = Case("retain", bias=True)
    hidden, weight, bias, labels, _, _ = _problem(case, seed=13)
    h, w, b = _leaves(hidden, weight, bias)
    loss = lmloss.linear_cross_entropy(h, w, labels, bias=b, reduction="mean")
    first = torch.autograd.grad(loss * 2.0, (h, w, b), retain_graph=True)
    second = torch.autograd.grad(loss * 2.0, (h, w, b))
    for a, c in zip(first, second):
        assert torch.equal(a, c)


@pytest.mark.parametrize("op", ["logprobs_entropy", "ce_none", "ce_mean", "ce_sum"])
def test_no_grad_returns_the_same_values_without_a_graph(op):
    case = Case("nograd", bias=True, temperature=0.9, vocab_size=36)
    hidden, weight, bias, labels, _, _ = _problem(case, seed=14)
    h, w, b = _leaves(hidden, weight, bias)

    def call():
        if op == "logprobs_entropy":
            return torch.stack(lmloss.linear_token_logprobs(h, w, labels, bias=b, return_entropy=True,
                                                            **_fused_kwargs(case)))  # fmt: skip
        return lmloss.linear_cross_entropy(h, w, labels, bias=b, reduction=op[3:], **_fused_kwargs(case))

    with torch.no_grad():
        out = call()
    assert not out.requires_grad and out.grad_fn is None
    assert h.grad is None and w.grad is None and b.grad is None
    torch.testing.assert_close(out, call().detach(), atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------------
# bad input


def _bad_inputs():
    g = _gen(0)
    h = torch.randn(6, 8, generator=g)
    w = torch.randn(10, 8, generator=g)
    b = torch.randn(10, generator=g)
    y = torch.randint(0, 10, (6,), generator=g)
    y_out = y.clone()
    y_out[2] = 10
    y_neg = y.clone()
    y_neg[0] = -5
    y_pad = y.clone()
    y_pad[1] = 9  # in range of the columns but a padding column once vocab_size=9
    return {
        "int_hidden": (TypeError, dict(hidden=h.long())),
        "int_weight": (TypeError, dict(weight=w.long())),
        "width_mismatch": (ValueError, dict(weight=torch.randn(10, 7))),
        "weight_1d": (ValueError, dict(weight=w[:, 0].contiguous())),
        "hidden_bf16_weight_fp32": (TypeError, dict(hidden=h.bfloat16())),
        "bias_dtype": (TypeError, dict(bias=b.double())),
        "bias_shape": (ValueError, dict(bias=b[:9])),
        "bias_2d": (ValueError, dict(bias=b[None])),
        "labels_shape": (ValueError, dict(labels=y[:5])),
        "labels_float": (TypeError, dict(labels=y.float())),
        "label_past_vocab": (ValueError, dict(labels=y_out)),
        "label_negative_not_ignore": (ValueError, dict(labels=y_neg)),
        "label_in_padding": (ValueError, dict(labels=y_pad, vocab_size=9)),
        "chunk_size_0": (ValueError, dict(chunk_size=0)),
        "chunk_size_negative": (ValueError, dict(chunk_size=-4)),
        "chunk_size_big": (TypeError, dict(chunk_size="big")),
        "chunk_size_float": (TypeError, dict(chunk_size=4.0)),
        "temperature_0": (ValueError, dict(temperature=0.0)),
        "temperature_negative": (ValueError, dict(temperature=-1.0)),
        "sequence_parallel_without_group": (ValueError, dict(sequence_parallel=True)),
        "vocab_size_past_columns": (ValueError, dict(vocab_size=11)),
        "vocab_start_without_group": (ValueError, dict(vocab_start=3)),
    }, dict(hidden=h, weight=w, bias=b, labels=y)


BAD = list(_bad_inputs()[0])


@pytest.mark.parametrize("fn", ["linear_token_logprobs", "linear_cross_entropy"])
@pytest.mark.parametrize("name", BAD)
def test_bad_input_raises(fn, name):
    cases, base = _bad_inputs()
    exc, override = cases[name]
    kw = dict(base, **override)
    hidden, weight, labels = kw.pop("hidden"), kw.pop("weight"), kw.pop("labels")
    with pytest.raises(exc):
        getattr(lmloss, fn)(hidden, weight, labels, **kw)


@pytest.mark.parametrize(
    ("kw", "exc"),
    [
        (dict(reduction="avg"), ValueError),
        (dict(label_smoothing=1.5), ValueError),
        (dict(label_smoothing=-0.1), ValueError),
        (dict(z_loss=-1e-3), ValueError),
    ],
    ids=["reduction", "smoothing_above_1", "smoothing_negative", "z_loss_negative"],
)
def test_bad_loss_options_raise(kw, exc):
    _, base = _bad_inputs()
    with pytest.raises(exc):
        lmloss.linear_cross_entropy(base["hidden"], base["weight"], base["labels"], **kw)


# ----------------------------------------------------------------------------------------------------------
# weight-gradient accumulation precision (the field's recurring complaint: bf16 accumulators drift with
# the number of chunks)


def _bf16_weight_grad_errors(chunk_sizes, weight_grad_dtype, memory_budget_mib=None):
    """Relative-norm error of d weight (bf16 inputs) against float64, and of rounding float64's once."""
    g = _gen(7)
    n, h, v = 512, 32, 1024
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * 0.05).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)
    w64 = weight.double().requires_grad_()
    torch.nn.functional.cross_entropy(hidden.double() @ w64.T, labels, reduction="sum").backward()
    exact = w64.grad

    def rel(t):
        return ((t.double() - exact).norm() / exact.norm()).item()

    errors = []
    for chunk in chunk_sizes:
        w = weight.clone().requires_grad_()
        lmloss.linear_cross_entropy(
            hidden, w, labels, reduction="sum", chunk_size=chunk, weight_grad_dtype=weight_grad_dtype,
            memory_budget_mib=memory_budget_mib,
        ).backward()
        errors.append(rel(w.grad))
    return errors, rel(exact.bfloat16())


def test_fp32_weight_grad_accumulator_adds_no_error_beyond_one_bf16_rounding():
    errors, once = _bf16_weight_grad_errors([512, 64, 8], torch.float32)
    for err in errors:  # 1, 8 and 64 chunks
        assert err <= 1.05 * once, (errors, once)


def test_the_weight_pass_within_a_budget_below_the_accumulator_adds_no_error_beyond_one_bf16_rounding():
    """The budget (0.05 MiB) is below the fp32 accumulator (128 KiB): each block of the weight gradient is
    summed over every token in fp32 (in one GEMM, or in a block accumulator over chunks) and rounded once."""
    errors, once = _bf16_weight_grad_errors(["auto", 64, 8], torch.float32, memory_budget_mib=0.05)
    for err in errors:
        assert err <= 1.05 * once, (errors, once)


def test_bf16_weight_grad_accumulator_error_grows_with_the_number_of_chunks():
    # with a bf16 accumulator the d-logits are bf16 too (rounded once more than the fp32 path's)
    errors, once = _bf16_weight_grad_errors([512, 64, 8], torch.bfloat16)
    assert once < errors[0] < errors[1] < errors[2], (errors, once)  # 1, 8, 64 chunks: drift
    assert errors[2] > 2 * once


# ----------------------------------------------------------------------------------------------------------
# odd inputs: a clear error naming the argument, or the right answer

FUSED_OPS = ["linear_token_logprobs", "linear_cross_entropy"]


def _odd_base(dtype=torch.float32):
    g = _gen(7)
    hidden = torch.randn(6, 8, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(10, 8, generator=g, dtype=torch.float64).to(dtype)
    labels = torch.tensor([3, -100, 9, 0, -100, 5])
    return hidden, weight, labels


@pytest.mark.parametrize("fn", FUSED_OPS)
def test_a_weight_with_no_rows_raises_a_clear_value_error(fn):
    hidden, _, labels = _odd_base()
    with pytest.raises(ValueError, match="vocabulary dimension is empty"):
        getattr(lmloss, fn)(hidden, torch.zeros(0, 8), labels)


def test_float64_fused_ops_are_computed_in_float64_and_pass_gradcheck():
    hidden, weight, labels = _odd_base(torch.float64)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    bias = torch.randn(10, generator=_gen(8), dtype=torch.float64, requires_grad=True)
    kw = dict(bias=bias, chunk_size=4, temperature=0.8, softcap=3.0)
    assert torch.autograd.gradcheck(
        lambda a, b: lmloss.linear_token_logprobs(a, b, labels, return_entropy=True, **kw), (h, w)
    )
    assert torch.autograd.gradcheck(
        lambda a, b: lmloss.linear_cross_entropy(a, b, labels, reduction="none", **kw), (h, w)
    )
    # gradients made in the forward, a second backward (gradcheck's reentrancy check) recomputes them;
    # fast mode (random directions) keeps the finite differences cheap
    for reduction in ("sum", "mean"):
        assert torch.autograd.gradcheck(
            lambda a, b, r=reduction: lmloss.linear_cross_entropy(
                a, b, labels, reduction=r, z_loss=0.01, **kw
            ),
            (h, w),
            fast_mode=True,
        )
    loss = lmloss.linear_cross_entropy(h, w, labels, label_smoothing=0.1, **kw)
    assert loss.dtype == torch.float64
    (got_h, got_w, got_b) = torch.autograd.grad(loss, (h, w, bias))
    z = 3.0 * torch.tanh((h @ w.T + bias) / 3.0) / 0.8
    ref = torch.nn.functional.cross_entropy(z, labels, label_smoothing=0.1)
    ref_grads = torch.autograd.grad(ref, (h, w, bias))
    torch.testing.assert_close(loss, ref, atol=1e-12, rtol=0)
    for got, want in zip((got_h, got_w, got_b), ref_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    logp = lmloss.linear_token_logprobs(h, w, labels, **kw)
    ref_lp = torch.log_softmax(z, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    torch.testing.assert_close(logp, torch.where(labels != -100, ref_lp, 0.0), atol=1e-12, rtol=0)


FUSED_CALLS = {
    "logprobs": lambda h, w, y, impl: lmloss.linear_token_logprobs(h, w, y, impl=impl, chunk_size=2),
    "ce_none": lambda h, w, y, impl: lmloss.linear_cross_entropy(h, w, y, impl=impl, reduction="none"),
    "ce_mean_smoothing_z_loss": lambda h, w, y, impl: lmloss.linear_cross_entropy(
        h, w, y, impl=impl, label_smoothing=0.1, z_loss=1e-2, chunk_size=4
    ),
}


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("call", list(FUSED_CALLS))
def test_an_ignored_row_whose_logits_overflow_gives_exactly_zero_value_and_hidden_gradient(impl, call):
    if impl == "triton":
        pytest.importorskip(
            "triton", reason='impl="triton" needs triton (run under TRITON_INTERPRET=1 on CPU)'
        )
    hidden, weight, labels = _odd_base()
    hidden[1] = 3e38  # its logits overflow to +-inf (and NaN where they meet): an ignored row
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = FUSED_CALLS[call](h, w, labels, impl)
    assert not torch.isfinite(h[1:2].detach() @ weight.T).all()
    (out * torch.arange(1.0, 1.0 + out.numel()).view(out.shape)).sum().backward()
    assert torch.equal(h.grad[1], torch.zeros(8))
    kept = labels != -100
    kept[4] = True  # the finite ignored row stays: only the overflowing row is dropped
    h2, w2 = hidden[kept].clone().requires_grad_(), weight.clone().requires_grad_()
    ref = FUSED_CALLS[call](h2, w2, labels[kept], impl)
    if out.dim() == 1:
        assert out[1] == 0.0
        torch.testing.assert_close(out[kept], ref, **FP32_TOL)
        (ref * torch.arange(1.0, 1.0 + out.numel())[kept]).sum().backward()
    else:
        torch.testing.assert_close(out, ref, **FP32_TOL)
        ref.backward()
    # the weight gradient gets 0 * 3e38 = 0 from that row, not NaN
    torch.testing.assert_close(w.grad, w2.grad, **FP32_TOL)
    torch.testing.assert_close(h.grad[kept], h2.grad, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
def test_fused_small_integer_label_dtypes_give_the_int64_result(dtype):
    hidden, weight, labels = _odd_base()
    labels = labels.clamp(min=0)
    for fn in FUSED_OPS:
        want = getattr(lmloss, fn)(hidden, weight, labels)
        got = getattr(lmloss, fn)(hidden, weight, labels.to(dtype))
        assert torch.equal(got, want)


@pytest.mark.parametrize("fn", FUSED_OPS)
def test_fused_labels_on_another_device_raise_naming_labels(fn):
    hidden, weight, labels = _odd_base()
    with pytest.raises(ValueError, match="labels are on meta"):
        getattr(lmloss, fn)(hidden, weight, labels.to("meta"))


FUSED_ODD_OPTIONS = [
    # (id, kwargs, exception, the argument the message must name); each for both fused ops
    ("ignore_index_none", dict(ignore_index=None), TypeError, "ignore_index"),
    ("ignore_index_float", dict(ignore_index=2.5), TypeError, "ignore_index"),
    ("ignore_index_past_int64", dict(ignore_index=2**64), ValueError, "ignore_index must fit in int64"),
    (
        "tp_group_a_string",
        dict(tp_group="tp"),
        TypeError,
        "tp_group must be a torch.distributed.ProcessGroup",
    ),
    ("vocab_size_float", dict(vocab_size=10.0), TypeError, "vocab_size"),
    ("vocab_size_bool", dict(vocab_size=True), TypeError, "vocab_size"),
    ("temperature_overflows", dict(temperature=1e-40), ValueError, "temperature"),
    ("temperature_bool", dict(temperature=True), TypeError, "temperature"),
    ("softcap_zero", dict(softcap=0), ValueError, "softcap"),
    ("softcap_negative", dict(softcap=-1), ValueError, "softcap"),
    ("chunk_size_zero", dict(chunk_size=0), ValueError, "chunk_size"),
    ("chunk_size_bool", dict(chunk_size=True), TypeError, "chunk_size"),
    ("sequence_parallel_int", dict(sequence_parallel=1), TypeError, "sequence_parallel"),
    ("weight_grad_dtype_fp16", dict(weight_grad_dtype=torch.float16), ValueError, "weight_grad_dtype"),
]


@pytest.mark.parametrize("fn", FUSED_OPS)
@pytest.mark.parametrize(
    ("case", "kw", "exc", "word"), FUSED_ODD_OPTIONS, ids=[c[0] for c in FUSED_ODD_OPTIONS]
)
def test_fused_odd_option_values_raise_naming_the_option(fn, case, kw, exc, word):
    hidden, weight, labels = _odd_base()
    with pytest.raises(exc, match=word):
        getattr(lmloss, fn)(hidden, weight, labels, **kw)


def test_fused_mean_group_a_string_and_a_bad_chunk_budget_raise_naming_them(monkeypatch):
    hidden, weight, labels = _odd_base()
    with pytest.raises(TypeError, match="mean_group must be a"):
        lmloss.linear_cross_entropy(hidden, weight, labels, mean_group="dp")
    monkeypatch.setenv("LMLOSS_CHUNK_BUDGET_MIB", "-3")
    for fn in FUSED_OPS:
        with pytest.raises(ValueError, match="LMLOSS_CHUNK_BUDGET_MIB must be a positive number"):
            getattr(lmloss, fn)(hidden, weight, labels, chunk_size="auto")


def test_fused_label_smoothing_bool_raises_naming_it():
    hidden, weight, labels = _odd_base()
    with pytest.raises(TypeError, match="label_smoothing"):
        lmloss.linear_cross_entropy(hidden, weight, labels, label_smoothing=True)


@pytest.mark.parametrize(
    ("fn", "kw"),
    [("linear_token_logprobs", {}), ("linear_cross_entropy", dict(reduction="none")),
     ("linear_cross_entropy", dict(reduction="sum"))],
    ids=["logprobs", "ce_none", "ce_sum"],
)  # fmt: skip
def test_fused_double_backward_raises_a_runtime_error_naming_lmloss(fn, kw):
    hidden, weight, labels = _odd_base()
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    (g,) = torch.autograd.grad(getattr(lmloss, fn)(h, w, labels, **kw).sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match="lmloss ops are differentiable once"):
        g.square().sum().backward()
