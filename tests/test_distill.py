"""lmloss.distillation_loss / linear_distillation_loss (one process) against float64 references written here.

The reference is TRL GKD's generalized JSD written out on full float64 log-softmaxes: forward KL at beta=0,
reverse KL at beta=1, ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with ``m = (1 - beta) p_s + beta p_t``
in between; the sparse teacher's reference is the KL over the K ids plus one tail bucket (or renormalised
over the K ids). Gradients of the reference come from autograd on float64 leaves.
"""

from __future__ import annotations

import gc
import math
import re
import weakref
from pathlib import Path

import pytest
import torch

import lmloss
from impl_params import IMPLS

pytestmark = pytest.mark.usefixtures("one_thread")

N, V, K = 13, 29, 4  # 13 tokens in chunks of 5: a ragged last chunk
CHUNK = 5
BETAS = [0.0, 0.3, 0.5, 1.0]


def _leaf(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh leaf copy of `t` (in `dtype`) that requires grad."""
    return t.detach().to(dtype or t.dtype).clone().requires_grad_()


def _xlogy_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``sum_j p_j (log p_j - log q_j)`` per row, with ``0 log 0 = 0``."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)


def reference(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """Per-token divergence in float64, written from the definitions."""
    ls = torch.log_softmax(student.double() / temperature, -1)
    lt = torch.log_softmax(teacher.double() / temperature, -1)
    if beta == 0.0:
        return _xlogy_kl(lt, ls)
    if beta == 1.0:
        return _xlogy_kl(ls, lt)
    lm = torch.log((1 - beta) * ls.exp() + beta * lt.exp())
    return beta * _xlogy_kl(lt, lm) + (1 - beta) * _xlogy_kl(ls, lm)


def sparse_reference(student: torch.Tensor, ids, logprobs, tail: bool) -> torch.Tensor:
    ls = torch.log_softmax(student.double(), -1).gather(1, ids)
    lq = logprobs.double()
    if not tail:
        return _xlogy_kl(torch.log_softmax(lq, -1), torch.log_softmax(ls, -1))
    q_tail = 1 - lq.exp().sum(-1)
    p_tail = 1 - ls.exp().sum(-1)
    return (lq.exp() * (lq - ls)).sum(-1) + q_tail * (q_tail.log() - p_tail.log())


def _problem(seed: int = 0, n: int = N, v: int = V):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = -100
    return student, teacher, labels


def _mean_over_valid(per_token: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    valid = labels != -100
    return per_token[valid].sum() / valid.sum()


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_distillation_loss_mean_and_student_grad_match_float64_reference(beta, temperature, dtype):
    student, teacher, labels = _problem()
    x = _leaf(student, dtype)
    loss = lmloss.distillation_loss(
        x, teacher.to(dtype), labels, beta=beta, temperature=temperature, chunk_size=CHUNK
    )
    loss.backward()
    xr = _leaf(student)
    expected = _mean_over_valid(reference(xr, teacher, beta, temperature), labels)
    expected.backward()
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(loss.double(), expected, **tol)
    torch.testing.assert_close(x.grad.double(), xr.grad, **tol)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distillation_none_and_sum_give_per_token_values_and_grads_of_any_upstream(beta):
    student, teacher, labels = _problem(1)
    upstream = torch.linspace(-1.0, 2.0, N, dtype=torch.float64)
    x = _leaf(student)
    per_token = lmloss.distillation_loss(x, teacher, labels, beta=beta, reduction="none", chunk_size=CHUNK)
    (per_token * upstream).sum().backward()
    xr = _leaf(student)
    ref = torch.where(labels != -100, reference(xr, teacher, beta, 1.0), 0.0)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(per_token, ref)
    torch.testing.assert_close(x.grad, xr.grad)
    total = lmloss.distillation_loss(student, teacher, labels, beta=beta, reduction="sum", chunk_size=CHUNK)
    torch.testing.assert_close(total, ref.sum())


def test_bf16_logits_are_computed_in_fp32_and_get_a_bf16_gradient():
    student, teacher, labels = _problem(7)
    x = _leaf(student, torch.bfloat16)
    loss = lmloss.distillation_loss(x, teacher.to(torch.bfloat16), labels, beta=0.5, chunk_size=CHUNK)
    loss.backward()
    # the reference sees the same bf16-rounded logits, in float64
    xr = _leaf(student.to(torch.bfloat16), torch.float64)
    expected = _mean_over_valid(reference(xr, teacher.to(torch.bfloat16), 0.5, 1.0), labels)
    expected.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-4, rtol=1e-2)


def test_distillation_without_labels_averages_over_every_token_of_a_batched_shape():
    student, teacher, _ = _problem(2, n=12)
    loss = lmloss.distillation_loss(student.view(3, 4, V), teacher.view(3, 4, V), beta=0.5)
    torch.testing.assert_close(loss, reference(student, teacher, 0.5, 1.0).mean())


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_padded_vocabulary_columns_take_no_part_and_get_zero_gradient(beta):
    student, teacher, labels = _problem(6)
    vocab_size = V - 3
    student[:, vocab_size:], teacher[:, vocab_size:] = 50.0, -50.0  # would dominate if they were counted
    x = _leaf(student)
    loss = lmloss.distillation_loss(x, teacher, labels, beta=beta, vocab_size=vocab_size, chunk_size=CHUNK)
    loss.backward()
    xr = _leaf(student[:, :vocab_size])
    expected = _mean_over_valid(reference(xr, teacher[:, :vocab_size], beta, 1.0), labels)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(x.grad[:, :vocab_size], xr.grad)
    assert (x.grad[:, vocab_size:] == 0).all()


def test_teacher_gets_no_gradient_and_a_teacher_with_masked_columns_is_finite():
    student, teacher, labels = _problem(3)
    teacher[:, :5] = -math.inf  # columns the teacher rules out: p_t = 0 there
    t = _leaf(teacher)
    x = _leaf(student)
    loss = lmloss.distillation_loss(x, t, labels, beta=0.0)
    loss.backward()
    xr = _leaf(student)
    expected = _mean_over_valid(reference(xr, teacher, 0.0, 1.0), labels)
    expected.backward()
    assert t.grad is None
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_nan_and_inf_in_ignored_rows_give_exactly_zero_gradient_there(beta):
    student, teacher, labels = _problem(4)
    ignored = labels == -100
    poisoned_s, poisoned_t = student.clone(), teacher.clone()
    poisoned_s[ignored.nonzero()[0, 0]] = math.nan
    poisoned_t[ignored.nonzero()[1, 0], 3] = math.inf
    poisoned_s[ignored.nonzero()[2, 0], 0] = -math.inf
    x = _leaf(poisoned_s, torch.float32)
    loss = lmloss.distillation_loss(x, poisoned_t.float(), labels, beta=beta, chunk_size=CHUNK)
    loss.backward()
    assert torch.isfinite(loss)
    assert (x.grad[ignored] == 0).all()
    xr = _leaf(student)
    _mean_over_valid(reference(xr, teacher, beta, 1.0), labels).backward()
    torch.testing.assert_close(x.grad[~ignored].double(), xr.grad[~ignored], atol=2e-6, rtol=1e-5)


def _topk(teacher: torch.Tensor, k: int = K):
    logprobs, ids = torch.log_softmax(teacher, -1).topk(k, dim=-1)
    return ids, logprobs


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_sparse_teacher_forward_kl_matches_reference_with_and_without_tail(tail, dtype):
    student, teacher, labels = _problem(5)
    ids, logprobs = _topk(teacher)
    logprobs[labels == -100] = math.nan  # an ignored token's teacher values are never read
    x = _leaf(student, dtype)
    loss = lmloss.distillation_loss(
        x, None, labels, teacher_topk=(ids, logprobs.to(dtype)), tail=tail, chunk_size=CHUNK
    )
    loss.backward()
    xr = _leaf(student)
    valid = labels != -100
    expected = sparse_reference(xr[valid], ids[valid], logprobs[valid], tail).mean()
    expected.backward()
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(loss.double(), expected, **tol)
    torch.testing.assert_close(x.grad.double(), xr.grad, **tol)


def _check_raises(match: str, **overrides):
    student, teacher, labels = _problem()
    kwargs = dict(student_logits=student, teacher_logits=teacher, labels=labels)
    kwargs.update(overrides)
    with pytest.raises((ValueError, TypeError), match=match):
        lmloss.distillation_loss(**kwargs)


def test_bad_arguments_raise_naming_the_argument():
    student, teacher, labels = _problem()
    ids, logprobs = _topk(teacher)
    _check_raises("teacher_logits shape", teacher_logits=teacher[:, :-1])
    _check_raises("teacher_logits shape", teacher_logits=teacher[:-1])
    _check_raises(r"beta must be in \[0, 1\]", beta=1.5)
    _check_raises(r"beta must be in \[0, 1\]", beta=-0.1)
    _check_raises("beta must be a float", beta="0.5")
    _check_raises("reduction", reduction="batchmean")
    _check_raises("labels shape", labels=labels[:-1])
    _check_raises("exactly one of teacher_logits and teacher_topk", teacher_topk=(ids, logprobs))
    _check_raises("exactly one of teacher_logits and teacher_topk", teacher_logits=None)
    _check_raises("temperature", temperature=0.0)
    _check_raises("tail must be a bool", tail=1)


def test_bad_sparse_teacher_raises_naming_teacher_topk():
    student, teacher, labels = _problem()
    ids, logprobs = _topk(teacher)
    sparse = dict(teacher_logits=None)
    _check_raises(
        "teacher_topk ids must be in", teacher_topk=(ids.where(ids != ids[1, 0], V), logprobs), **sparse
    )
    _check_raises("teacher_topk ids must be in", teacher_topk=(ids - 100, logprobs), **sparse)
    duplicated = ids.clone()
    duplicated[1, 1] = duplicated[1, 0]
    _check_raises("teacher_topk ids must be distinct", teacher_topk=(duplicated, logprobs), **sparse)
    _check_raises("sum to at most 1", teacher_topk=(ids, logprobs + 0.5), **sparse)
    _check_raises(
        "sum to at most 1", teacher_topk=(ids, logprobs.where(ids != ids[1, 0], math.nan)), **sparse
    )
    _check_raises(
        "teacher_topk supports the forward KL only", teacher_topk=(ids, logprobs), beta=0.5, **sparse
    )
    _check_raises("temperature != 1", teacher_topk=(ids, logprobs), temperature=2.0, **sparse)
    _check_raises("logprobs shape", teacher_topk=(ids, logprobs[:, :-1]), **sparse)
    _check_raises("ids shape", teacher_topk=(ids[:-1], logprobs[:-1]), **sparse)
    _check_raises("ids must be an integer tensor", teacher_topk=(ids.double(), logprobs), **sparse)


def test_sparse_teacher_values_at_ignored_tokens_are_not_checked():
    student, teacher, labels = _problem()
    ids, logprobs = _topk(teacher)
    ids[labels == -100] = -1  # padding ids and garbage log-probs where the label is ignored
    logprobs[labels == -100] = 3.0
    loss = lmloss.distillation_loss(student, None, labels, teacher_topk=(ids, logprobs))
    valid = labels != -100
    torch.testing.assert_close(
        loss, sparse_reference(student[valid], ids[valid], logprobs[valid], True).mean()
    )


# ------------------------------------------------------------------------------------------- fused heads

H_S, H_T = 6, 10  # the teacher's hidden size differs from the student's


def _heads(seed: int = 0, n: int = N, v: int = V, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H_S, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, H_S, generator=g, dtype=torch.float64) * 0.8).to(dtype)
    t_hidden = torch.randn(n, H_T, generator=g, dtype=torch.float64).to(dtype)
    t_weight = (torch.randn(v, H_T, generator=g, dtype=torch.float64) * 0.8).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = -100
    return hidden, weight, t_hidden, t_weight, labels


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_linear_distillation_matches_reference_on_materialized_logits(beta, reduction, dtype):
    hidden, weight, t_hidden, t_weight, labels = _heads(dtype=dtype)
    upstream = torch.linspace(-1.0, 2.0, N, dtype=torch.float64)
    h, w = _leaf(hidden), _leaf(weight)
    th, tw = _leaf(t_hidden), _leaf(t_weight)
    out = lmloss.linear_distillation_loss(
        h, w, th, tw, labels, beta=beta, temperature=0.8, reduction=reduction, chunk_size=CHUNK
    )
    total = out if reduction == "mean" else (out.double() * upstream).sum()
    total.backward()
    hr, wr = _leaf(hidden, torch.float64), _leaf(weight, torch.float64)
    per_token = reference(hr @ wr.T, t_hidden.double() @ t_weight.double().T, beta, 0.8)
    if reduction == "mean":
        expected = _mean_over_valid(per_token, labels)
    else:
        expected = (torch.where(labels != -100, per_token, 0.0) * upstream).sum()
    expected.backward()
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(total.double(), expected, **tol)
    torch.testing.assert_close(h.grad.double(), hr.grad, **tol)
    torch.testing.assert_close(w.grad.double(), wr.grad, **tol)
    assert th.grad is None and tw.grad is None


def test_linear_distillation_bf16_accumulates_the_weight_gradient_in_fp32():
    hidden, weight, t_hidden, t_weight, labels = _heads(1, dtype=torch.bfloat16)
    h, w = _leaf(hidden), _leaf(weight)
    lmloss.linear_distillation_loss(h, w, t_hidden, t_weight, labels, beta=0.5, chunk_size=CHUNK).backward()
    hr, wr = _leaf(hidden, torch.float64), _leaf(weight, torch.float64)
    per_token = reference(hr @ wr.T, t_hidden.double() @ t_weight.double().T, 0.5, 1.0)
    _mean_over_valid(per_token, labels).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w.grad.double(), wr.grad, atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(h.grad.double(), hr.grad, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("tail", [True, False])
def test_linear_distillation_sparse_teacher_matches_reference(tail):
    hidden, weight, t_hidden, t_weight, labels = _heads(2)
    ids, logprobs = _topk(t_hidden @ t_weight.T)
    h, w = _leaf(hidden), _leaf(weight)
    loss = lmloss.linear_distillation_loss(
        h, w, None, None, labels, teacher_topk=(ids, logprobs), tail=tail, chunk_size=CHUNK
    )
    loss.backward()
    hr, wr = _leaf(hidden), _leaf(weight)
    valid = labels != -100
    expected = sparse_reference((hr @ wr.T)[valid], ids[valid], logprobs[valid], tail).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(h.grad, hr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_linear_distillation_bad_teacher_head_raises_naming_it():
    hidden, weight, t_hidden, t_weight, labels = _heads()
    with pytest.raises(ValueError, match="teacher_weight must be"):
        lmloss.linear_distillation_loss(hidden, weight, t_hidden, t_weight[:-1], labels)
    with pytest.raises(ValueError, match="teacher_hidden width"):
        lmloss.linear_distillation_loss(hidden, weight, t_hidden[:, :-1], t_weight, labels)
    with pytest.raises(ValueError, match="teacher_hidden leading shape"):
        lmloss.linear_distillation_loss(hidden, weight, t_hidden[:-1], t_weight, labels)
    with pytest.raises(ValueError, match="go together"):
        lmloss.linear_distillation_loss(hidden, weight, t_hidden, None, labels)
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        lmloss.linear_distillation_loss(hidden, weight, t_hidden, t_weight, labels, beta=2.0)


def test_docs_distillation_example_runs_as_written(capsys):
    page = (Path(__file__).resolve().parents[1] / "docs" / "distillation.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    exec(compile(code, "docs/distillation.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.startswith("beta=0.0: ") and "top-20 teacher, tail=False: " in printed


@pytest.mark.parametrize("teacher_dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("path", ["logits", "fused"])
def test_a_teacher_of_another_dtype_than_the_student_is_read_in_the_students_compute_dtype(path, teacher_dtype):
    """An fp32 student beside an fp64 (or bf16) teacher: the loss and the student's gradient equal float64
    math on the teacher's values (rounded to fp32 where the teacher is wider)."""
    g = torch.Generator().manual_seed(21)
    h = torch.randn(6, 5, generator=g).requires_grad_()
    w = torch.randn(24, 5, generator=g).requires_grad_()
    th = torch.randn(6, 3, generator=g).to(teacher_dtype)
    tw = torch.randn(24, 3, generator=g).to(teacher_dtype)
    if path == "logits":
        x = (h @ w.T).detach().requires_grad_()
        loss = lmloss.distillation_loss(x, th @ tw.T, beta=0.5)
        loss.backward()
        got = [x.grad]
    else:
        loss = lmloss.linear_distillation_loss(h, w, th, tw, beta=0.5)
        loss.backward()
        got = [h.grad, w.grad]
    t = (th @ tw.T).float().double()
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    zr = (hr @ wr.T).detach().requires_grad_() if path == "logits" else hr @ wr.T
    ls, lt = zr.log_softmax(-1), t.log_softmax(-1)
    lm = torch.logaddexp(ls + math.log(0.5), lt + math.log(0.5))
    expected = (0.5 * (lt.exp() * (lt - lm)).sum(-1) + 0.5 * (ls.exp() * (ls - lm)).sum(-1)).mean()
    expected.backward()
    refs = [zr.grad] if path == "logits" else [hr.grad, wr.grad]
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(got, refs):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["logits", "fused"])
def test_a_teacher_that_requires_grad_is_detached(path):
    """Only the teacher requires grad: the loss does not, and the teacher's graph is not kept."""
    g = torch.Generator().manual_seed(22)
    th = torch.randn(4, 3, generator=g, requires_grad=True)
    tw = torch.randn(16, 3, generator=g, requires_grad=True)
    h, w = torch.randn(4, 5, generator=g), torch.randn(16, 5, generator=g)
    if path == "logits":
        loss = lmloss.distillation_loss(h @ w.T, th @ tw.T)
    else:
        loss = lmloss.linear_distillation_loss(h, w, th, tw)
    assert not loss.requires_grad and loss.grad_fn is None


class _HoldsActivation(torch.autograd.Function):
    """The identity, whose graph node holds `activation` (as a teacher layer's saved activations would)."""

    @staticmethod
    def forward(ctx, x, activation):
        ctx.activation = activation
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("path", ["logits", "fused"])
def test_the_students_loss_does_not_keep_the_teachers_graph_alive(path, reduction):
    """While the student's loss (and its graph, for the backward) lives, the teacher's autograd graph (its
    layers' saved activations) may be freed: the op keeps the teacher's values, detached, not its graph."""
    g = torch.Generator().manual_seed(24)
    th = torch.randn(4, 3, generator=g, requires_grad=True)
    tw = torch.randn(16, 3, generator=g, requires_grad=True)
    h = torch.randn(4, 5, generator=g, requires_grad=True)
    w = torch.randn(16, 5, generator=g, requires_grad=True)
    activations = [torch.zeros(8) for _ in range(2)]
    alive = [weakref.ref(a) for a in activations]
    if path == "logits":
        teacher_head = (_HoldsActivation.apply(th @ tw.T, activations[0]),)
        loss = lmloss.distillation_loss(h @ w.T, *teacher_head, reduction=reduction)
    else:  # the teacher's hidden states and head weight, each the output of a graph
        teacher_head = tuple(_HoldsActivation.apply(t, a) for t, a in zip((th, tw), activations))
        loss = lmloss.linear_distillation_loss(h, w, *teacher_head, reduction=reduction)
    del teacher_head, activations
    gc.collect()
    assert [ref() for ref in alive] == [None, None]
    loss.sum().backward()  # the student's graph is intact
    assert h.grad is not None and w.grad is not None and th.grad is None and tw.grad is None


def test_a_sparse_teacher_certain_of_one_token_gives_the_students_cross_entropy_on_it():
    """A teacher log-prob of exactly 0 (probability 1; its other ids at -inf) is a valid top-k: the forward KL
    is then the student's cross-entropy on that token, its gradient ``p_s - onehot``."""
    student, _, labels = _problem(7)
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    logprobs = torch.full((N, K), -math.inf, dtype=torch.float64)
    logprobs[:, 0] = 0.0
    x = _leaf(student)
    loss = lmloss.distillation_loss(x, None, labels, teacher_topk=(ids, logprobs), chunk_size=CHUNK)
    loss.backward()
    xr = _leaf(student)
    expected = torch.nn.functional.cross_entropy(xr, torch.where(labels == -100, -100, ids[:, 0]))
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", ["logits", "fused"])
def test_a_sparse_teacher_whose_top_k_mass_is_a_little_above_one_gets_the_gradient_of_its_loss(path):
    """An engine's top-k probabilities may sum a little above 1 (by up to TOPK_MASS_TOLERANCE): the teacher's
    tail bucket is then empty (mass 0), the loss the KL over the K ids, and the student's gradient that
    loss's gradient (float64 autograd of it), as at a mass of exactly 1 or below."""
    g = torch.Generator().manual_seed(25)
    hidden = torch.randn(3, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(V, 6, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(V, generator=g)[:3] for _ in range(3)])
    probs = torch.tensor([[0.5, 0.3, 0.2008], [0.5, 0.25, 0.25], [0.4, 0.2, 0.1]], dtype=torch.float64)
    assert 1.0 < probs[0].sum() < 1.0 + lmloss.distill.TOPK_MASS_TOLERANCE
    h, w = _leaf(hidden), _leaf(weight)
    if path == "logits":
        z = (h @ w.T).detach().requires_grad_()
        loss = lmloss.distillation_loss(z, None, teacher_topk=(ids, probs.log()), reduction="sum")
        leaves = [z]
    else:
        loss = lmloss.linear_distillation_loss(h, w, None, None, teacher_topk=(ids, probs.log()), reduction="sum")
        leaves = [h, w]
    loss.backward()
    hr, wr = _leaf(hidden), _leaf(weight)
    zr = (hr @ wr.T).detach().requires_grad_() if path == "logits" else hr @ wr.T
    ls = zr.log_softmax(-1).gather(1, ids)
    q_tail = (1.0 - probs.sum(-1)).clamp(min=0.0)
    p_tail = 1.0 - ls.exp().sum(-1)
    expected = ((probs * (probs.log() - ls)).sum(-1) + torch.xlogy(q_tail, q_tail) - q_tail * p_tail.log()).sum()
    expected.backward()
    refs = [zr.grad] if path == "logits" else [hr.grad, wr.grad]
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    for got, want in zip([t.grad for t in leaves], refs):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _kl_where_p_has_mass(log_p, log_q):
    """``KL(p || q) = sum over the columns where p > 0 of p (log p - log q)``, plain float64: +inf where q has
    no mass (log q = -inf) under some column of p's; a column without p's mass adds 0 (as ``0 log 0 = 0``)."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_infinite_divergence_comes_out_infinite_as_in_plain_pytorch(impl):
    g = torch.Generator().manual_seed(40)
    s, t = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g)
    s[0, 2] = -math.inf  # the student has no mass where the teacher has: forward KL(t || s) = inf
    t[1, 5] = -math.inf  # the teacher has no mass where the student has: reverse KL(s || t) = inf
    s[2, 1] = t[2, 1] = -math.inf  # neither has mass there: finite
    ls, lt = s.double().log_softmax(-1), t.double().log_softmax(-1)
    forward = lmloss.distillation_loss(s, t, beta=0.0, reduction="none", impl=impl)
    reverse = lmloss.distillation_loss(s, t, beta=1.0, reduction="none", impl=impl)
    full_kl = lmloss.rl.full_kl(s, t, impl=impl)
    for got, want in ((forward, _kl_where_p_has_mass(lt, ls)), (reverse, _kl_where_p_has_mass(ls, lt)),
                      (full_kl, _kl_where_p_has_mass(ls, lt))):  # fmt: skip
        assert torch.isinf(want).tolist() == [v == math.inf for v in got.tolist()]
        finite = torch.isfinite(want)
        torch.testing.assert_close(got.double()[finite], want[finite], rtol=1e-5, atol=1e-6)
    assert forward[0] == math.inf and reverse[1] == math.inf
    assert lmloss.distillation_loss(s, t, beta=0.0, reduction="mean", impl=impl) == math.inf
    jsd = lmloss.distillation_loss(s, t, beta=0.5, reduction="none", impl=impl)  # the mixture has mass: finite
    assert torch.isfinite(jsd).all()
