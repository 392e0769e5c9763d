"""`lmloss.CrossEntropyLoss` and `lmloss.LinearCrossEntropyLoss` against ``F.cross_entropy`` in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lmloss
from tracking_support import LargestAllocation

pytestmark = pytest.mark.usefixtures("one_thread")

B, S, H, V = 2, 7, 16, 50


def _labels(seed: int = 0) -> torch.Tensor:
    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))
    labels[1, 4:] = -100  # padding
    return labels


def test_cross_entropy_loss_module_matches_f_cross_entropy_values_and_gradients():
    logits = torch.randn(B, S, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = _labels()
    loss_fn = lmloss.CrossEntropyLoss(label_smoothing=0.1, chunk_size=4)
    x = logits.clone().requires_grad_()
    loss_fn(x, labels).backward()
    ref = logits.clone().requires_grad_()
    want = F.cross_entropy(ref.reshape(-1, V), labels.reshape(-1), ignore_index=-100, label_smoothing=0.1)
    want.backward()
    torch.testing.assert_close(loss_fn(logits, labels), want)
    torch.testing.assert_close(x.grad, ref.grad)
    per_token = lmloss.CrossEntropyLoss(reduction="none")(logits, labels)
    want_none = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(B, S)
    assert per_token.shape == (B, S)
    torch.testing.assert_close(per_token, want_none)


def test_shift_scores_each_position_against_the_next_label_like_transformers():
    logits = torch.randn(B, S, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    labels = _labels(3)  # the tokens themselves, as transformers takes them
    got = lmloss.CrossEntropyLoss(shift=True)(logits, labels)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(got, want)


def test_linear_cross_entropy_loss_module_matches_f_cross_entropy_of_the_head_with_shift_and_softcap():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    labels = _labels(5)
    loss_fn = lmloss.LinearCrossEntropyLoss(shift=True, softcap=3.0, reduction="sum", chunk_size=3)
    inputs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss_fn(inputs[0], inputs[1], labels, inputs[2]).backward()
    refs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    z = F.linear(refs[0], refs[1], refs[2])
    capped = 3.0 * torch.tanh(z / 3.0)
    want = F.cross_entropy(capped[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), reduction="sum")
    want.backward()
    torch.testing.assert_close(loss_fn(hidden, weight, labels, bias), want)
    for got, ref in zip(inputs, refs):
        torch.testing.assert_close(got.grad, ref.grad)


def test_modules_hold_no_parameters_show_their_options_and_check_them_at_construction():
    loss_fn = lmloss.LinearCrossEntropyLoss(z_loss=1e-4, shift=True)
    assert list(loss_fn.parameters()) == [] and loss_fn.state_dict() == {}
    assert "z_loss=0.0001" in repr(loss_fn) and "shift=True" in repr(loss_fn)
    with pytest.raises(ValueError, match="reduction"):
        lmloss.CrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        lmloss.LinearCrossEntropyLoss(label_smoothing=2.0)
    with pytest.raises(TypeError, match="shift"):
        lmloss.CrossEntropyLoss(shift=1)
    with pytest.raises(TypeError):
        lmloss.CrossEntropyLoss(-100)  # keyword-only options
    with pytest.raises(ValueError, match="memory_budget_mib"):
        lmloss.LinearCrossEntropyLoss(memory_budget_mib=0)


def test_a_modules_memory_budget_reaches_the_op():
    # a bf16 head below its fp32 [V, H] accumulator's size takes the weight pass: no accumulator held
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=g).bfloat16().requires_grad_()
    w = torch.randn(500, 32, generator=g).bfloat16().requires_grad_()
    y = torch.randint(0, 500, (64,), generator=g)
    accumulator = 500 * 32 * 4
    largest = {}
    for budget in (None, 0.03):
        loss_fn = lmloss.LinearCrossEntropyLoss(memory_budget_mib=budget)
        with LargestAllocation() as tracker:
            loss_fn(h, w, y).backward()
        largest[budget] = tracker.largest
    assert largest[None] >= accumulator > largest[0.03]
    assert "memory_budget_mib=0.03" in repr(lmloss.LinearCrossEntropyLoss(memory_budget_mib=0.03))

