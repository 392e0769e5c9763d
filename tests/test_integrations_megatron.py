"""`lmloss.integrations.megatron` in one process (TP=2 against Megatron's own op:
tests/distributed/test_integrations_parallel.py). References are float64 PyTorch written out here."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import lmloss
from lmloss.integrations import megatron

TOL = dict(atol=1e-5, rtol=1e-5)
S, B, V, H = 5, 3, 40, 8


def _ce64(logits, target, smoothing=0.0):
    """float64 per-token F.cross_entropy of [..., V] logits."""
    flat = F.cross_entropy(
        logits.double().flatten(0, -2), target.flatten(), reduction="none", label_smoothing=smoothing
    )
    return flat.view(target.shape)


def test_tp_group_comes_from_megatrons_parallel_state_only_when_initialized(monkeypatch):
    group = object()
    state = types.SimpleNamespace(
        model_parallel_is_initialized=lambda: state.initialized, get_tensor_model_parallel_group=lambda: group
    )
    # megatron-core not imported: one process, and no import just to look
    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state", raising=False)
    assert megatron.tensor_parallel_group() is None
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", state)
    state.initialized = False
    assert megatron.tensor_parallel_group() is None
    state.initialized = True
    assert megatron.tensor_parallel_group() is group
    assert megatron.tensor_parallel_group(None) is None  # explicit: one process, whatever Megatron says
    other = object()
    assert megatron.tensor_parallel_group(other) is other


def test_drop_in_one_process_is_float64_cross_entropy_in_megatrons_layout():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(S, B, V, generator=g) * 2).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, V, (S, B), generator=g)
    upstream = torch.randn(S, B, generator=g)
    before = logits.detach().clone()
    losses = megatron.vocab_parallel_cross_entropy(logits, target, 0.1, chunk_size=4)
    (losses * upstream).sum().backward()
    ref = logits.detach().double().requires_grad_()
    want = _ce64(ref, target, 0.1)
    (want * upstream.double()).sum().backward()
    assert losses.shape == (S, B) and losses.dtype == torch.float32
    torch.testing.assert_close(losses.double(), want.detach(), **TOL)
    torch.testing.assert_close(logits.grad.double(), ref.grad, atol=1e-2, rtol=1e-2)  # bf16 gradient
    assert torch.equal(logits.detach(), before)  # unlike Megatron's op, the logits are left alone


def test_output_layer_loss_is_masked_per_token_cross_entropy_batch_first():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(S, B, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    bias = torch.randn(V, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, S), generator=g)
    loss_mask = (torch.rand(B, S, generator=g) > 0.4).float()
    losses = megatron.output_layer_loss(hidden, weight, labels, loss_mask, bias=bias, chunk_size=4)
    (losses.sum() / loss_mask.sum()).backward()  # Megatron's loss function

    h, w, b = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    want = _ce64(h @ w.T + b, labels.t()).t() * loss_mask.double()  # [S, B] logits, [B, S] losses
    (want.sum() / loss_mask.sum()).backward()
    assert losses.shape == (B, S) and losses.dtype == torch.float32
    torch.testing.assert_close(losses.double(), want.detach(), **TOL)
    for got, ref in ((hidden, h), (weight, w), (bias, b)):
        torch.testing.assert_close(got.grad.double(), ref.grad, **TOL)
    assert (losses[loss_mask == 0] == 0).all()


def test_output_layer_loss_rejects_megatron_layout_mistakes():
    hidden, weight = torch.randn(S, B, H), torch.randn(V, H)
    labels = torch.randint(0, V, (B, S))
    with pytest.raises(ValueError, match=r"hidden must be \[S, B, H\]"):
        megatron.output_layer_loss(hidden[:, 0], weight, labels)
    with pytest.raises(ValueError, match="loss_mask"):
        megatron.output_layer_loss(hidden, weight, labels, torch.ones(S, B))
    with pytest.raises(ValueError, match=r"labels must be \[B, S\]"):
        megatron.output_layer_loss(hidden, weight, labels.flatten())


MEGATRON = importlib.util.find_spec("megatron") is not None
needs_megatron = pytest.mark.skipif(not MEGATRON, reason="megatron-core is not installed (optional)")


def _packed(cu, cu_padded):
    """What packed_seq_params reads of a PackedBatch, with boundaries in any layout."""
    return types.SimpleNamespace(cu_seqlens=cu, cu_seqlens_padded=cu_padded, max_seqlen=6)


@needs_megatron
def test_packed_seq_params_maps_real_and_padded_boundaries_to_megatrons_names():
    cu = torch.tensor([[0, 3, 8]])  # [1, n] as Megatron's loaders collate it, int64
    cu_padded = torch.tensor([[0, 4, 10]])
    params = megatron.packed_seq_params(_packed(cu, cu_padded))
    assert params.qkv_format == "thd"
    for name, want in (("cu_seqlens_q", [0, 3, 8]), ("cu_seqlens_q_padded", [0, 4, 10])):
        got = getattr(params, name)
        assert got.dtype == torch.int32 and got.tolist() == want
        assert torch.equal(getattr(params, name.replace("_q", "_kv")), got)
    assert params.max_seqlen_q == params.max_seqlen_kv == 6
    with pytest.raises(ValueError, match="sequences"):
        megatron.packed_seq_params(_packed(cu, torch.tensor([0, 10])))


@needs_megatron
def test_packed_seq_params_from_a_packed_batch_with_the_new_field_names():
    batch = lmloss.PackedBatch(
        input_ids=torch.arange(10), labels=torch.full((10,), -100), position_ids=torch.arange(10),
        cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32),
        cu_seqlens_padded=torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen=6,
        loss_mask=torch.zeros(10, dtype=torch.bool),
    )  # fmt: skip
    params = megatron.packed_seq_params(batch)
    assert params.cu_seqlens_q.tolist() == [0, 3, 8]
    assert params.cu_seqlens_kv_padded.tolist() == [0, 4, 10]
