"""The by-products of the per-token ops' one pass (issue #42, item 3): the sum of the logits, the argmax and
``log sum p**2`` (``return_logit_sum`` / ``return_argmax`` / ``return_log_sum_sq_probs``), against float64 math
written here, for both implementations (Triton under its interpreter), one process (TP=2 in
tests/distributed/test_vocab_parallel.py).

``z = softcap(logits) / temperature`` is what the softmax sees; the by-products are of z over the valid vocabulary
(the kept set under top-k), 0 (argmax -1) where the label is ignored, without gradient.
"""

from __future__ import annotations

import pytest
import torch

import lmloss
from impl_params import IMPLS
from lmloss.kernels import ChunkMath

pytestmark = pytest.mark.usefixtures("one_thread")

N, V, VALID, T, CAP = 10, 300, 290, 0.7, 6.0  # 10 padded columns; 300 > a Triton block: head, main and tail


def _z(x: torch.Tensor, softcap=CAP, temperature=T) -> torch.Tensor:
    z = x[..., :VALID].double()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def _logits(dtype=torch.float32, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g) * 3
    x[:, VALID:] = 50.0  # padded columns: larger than any real one, so an argmax over them would show
    labels = torch.randint(0, VALID, (N,), generator=g)
    labels[3] = -100
    x[1, 5] = x[1, 250] = 30.0  # a tie, the lower id at the row's head
    x[2, 0] = x[2, VALID - 1] = 31.0  # a tie at the first and the last valid column
    x[4, 7] = x[4, 200] = x[4, 9] = 29.0
    return x.to(dtype), labels


def _want(x, labels, *, top_k=None):
    """float64 logit sum, argmax and log sum p^2 over the valid columns (the top_k largest with top_k)."""
    z = _z(x)
    if top_k is not None:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = torch.where(z >= kth, z, float("-inf"))
    finite = torch.where(torch.isfinite(z), z, 0.0)
    top = torch.where(z == z.amax(-1, keepdim=True), torch.arange(VALID), VALID).amin(-1)  # the lowest id
    lsq = torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)
    valid = labels != -100
    return torch.where(valid, finite.sum(-1), 0.0), torch.where(valid, top, -1), torch.where(valid, lsq, 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_token_logprobs_by_products_match_float64_and_leave_the_gradient_alone(impl):
    x, labels = _logits()
    x.requires_grad_(True)
    opts = dict(temperature=T, softcap=CAP, vocab_size=VALID, impl=impl, chunk_size=4)
    lp, ent, total, top, lsq = lmloss.token_logprobs(
        x, labels, return_entropy=True, return_logit_sum=True, return_argmax=True, return_log_sum_sq_probs=True,
        **opts,
    )  # fmt: skip
    want_sum, want_top, want_lsq = _want(x.detach(), labels)
    assert top.dtype == torch.int64 and torch.equal(top, want_top)
    assert top[3] == -1 and top[1] == 5 and top[2] == 0 and top[4] == 7
    torch.testing.assert_close(total.double(), want_sum, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(lsq.double(), want_lsq, rtol=1e-5, atol=1e-5)
    assert not (total.requires_grad or top.requires_grad or lsq.requires_grad) and lp.requires_grad
    # the outputs and the gradient of the differentiable ones are those without the by-products
    (lp.sum() + ent.sum()).backward()
    y = x.detach().clone().requires_grad_(True)
    lp0, ent0 = lmloss.token_logprobs(y, labels, return_entropy=True, **opts)
    (lp0.sum() + ent0.sum()).backward()
    assert torch.equal(lp, lp0) and torch.equal(ent, ent0) and torch.equal(x.grad, y.grad)


@pytest.mark.parametrize("impl", IMPLS)
def test_under_top_k_the_by_products_are_of_the_kept_set(impl):
    x, labels = _logits(seed=1)
    kept = _z(x).topk(6, dim=-1).indices
    labels = torch.where(labels == -100, labels, kept[:, 2])  # labels the sampler could have drawn
    _, total, top, lsq = lmloss.token_logprobs(
        x, labels, temperature=T, softcap=CAP, vocab_size=VALID, impl=impl, top_k=6, return_logit_sum=True,
        return_argmax=True, return_log_sum_sq_probs=True,
    )  # fmt: skip
    want_sum, want_top, want_lsq = _want(x, labels, top_k=6)
    assert torch.equal(top, want_top)
    torch.testing.assert_close(total.double(), want_sum, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lsq.double(), want_lsq, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_token_entropy_and_the_fused_head_give_them_at_every_counted_position(impl):
    """`token_entropy` (no labels: every position) and `linear_token_logprobs` (the head's matmul per chunk)."""
    x, labels = _logits(seed=2)
    entropy, total, top = lmloss.token_entropy(
        x, temperature=T, softcap=CAP, vocab_size=VALID, impl=impl, return_logit_sum=True, return_argmax=True
    )
    want_sum, want_top, _ = _want(x, torch.zeros_like(labels))
    assert torch.equal(top, want_top) and entropy.shape == (N,)
    torch.testing.assert_close(total.double(), want_sum, rtol=1e-5, atol=1e-3)

    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(N, 16, generator=g), torch.randn(V, 16, generator=g)
    lp, top, lsq = lmloss.linear_token_logprobs(
        hidden, weight, labels, temperature=T, vocab_size=VALID, impl=impl, chunk_size=3, return_argmax=True,
        return_log_sum_sq_probs=True,
    )  # fmt: skip
    z = (hidden.double() @ weight.double().T)[:, :VALID] / T
    valid = labels != -100
    assert torch.equal(top, torch.where(valid, z.argmax(-1), -1))
    want = torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)
    torch.testing.assert_close(lsq.double(), torch.where(valid, want, 0.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_invariant_mode_gives_the_same_bits_for_every_chunking_and_refuses_the_sum_of_squares(impl):
    x, labels = _logits(seed=4)
    opts = dict(temperature=T, softcap=CAP, vocab_size=VALID, impl=impl, invariant=True, return_logit_sum=True,
                return_argmax=True)  # fmt: skip
    whole = lmloss.token_logprobs(x, labels, chunk_size=None, **opts)
    want_sum, want_top, _ = _want(x, labels)
    assert torch.equal(whole[2], want_top)
    torch.testing.assert_close(whole[1].double(), want_sum, rtol=1e-5, atol=1e-3)
    for chunk in (1, 3):
        assert all(torch.equal(a, b) for a, b in zip(lmloss.token_logprobs(x, labels, chunk_size=chunk, **opts), whole))
    alone = lmloss.token_logprobs(x[5:6], labels[5:6], chunk_size=None, **opts)
    assert all(torch.equal(a, b[5:6]) for a, b in zip(alone, whole))
    with pytest.raises(ValueError, match="return_log_sum_sq_probs=True with invariant=True"):
        lmloss.token_logprobs(x, labels, invariant=True, return_log_sum_sq_probs=True, impl=impl)


def test_kernels_contract_columns_agree_between_implementations():
    """`softmax_partials(..., sum_sq=True, argmax=True)`: the eight columns, PyTorch against Triton, on a shard
    (vocab_start 100) with padded columns and the kept set of a threshold."""
    if not lmloss.kernels.triton_available():
        pytest.skip("triton is not installed")
    from lmloss.kernels.torch_ref import TorchKernels
    from lmloss.kernels.triton_kernels import TritonKernels

    x, labels = _logits(seed=5)
    math = ChunkMath(vocab_start=100, valid=VALID, scale=1 / T, softcap=CAP)
    keep = x[:, :VALID].topk(9, dim=-1).values[:, -1]
    keep[6] = float("inf")  # a row with no kept column on this shard: max -inf, id -1
    for keep_min in (None, keep):
        kw = dict(entropy=True, target=True, sum_logits=True, sum_sq=True, argmax=True, keep_min=keep_min)
        got = TritonKernels().softmax_partials(x, labels + 100, math, **kw)
        want = TorchKernels(N, V, x.device).softmax_partials(x, labels + 100, math, **kw)
        assert got.shape == want.shape == (N, 8)
        assert torch.equal(got[:, 7], want[:, 7]) and want[1, 7] == 105 and want[2, 7] == 100
        rows = torch.arange(N) != 6 if keep_min is not None else torch.ones(N, dtype=torch.bool)
        if keep_min is not None:
            assert want[6, 7] == -1 and want[6, 6] == float("-inf") == got[6, 6]
        # the softcap's tanh rounds differently in the two (lmloss.kernels.triton_kernels._tanh)
        torch.testing.assert_close(got[rows, 5:7], want[rows, 5:7], rtol=1e-5, atol=0)


def test_triton_argmax_takes_the_lowest_column_of_many_ties_in_the_main_loop_and_the_edge():
    """Integer logits (ties everywhere) over 301 columns: the rows start at different 16-byte offsets (head columns
    walked after the main blocks), 16-column blocks give a long main loop; the id is PyTorch's first max."""
    if not lmloss.kernels.triton_available():
        pytest.skip("triton is not installed")
    from lmloss.kernels import triton_kernels as tk

    g = torch.Generator().manual_seed(6)
    x = torch.randint(0, 6, (8, 301), generator=g).float()
    math = ChunkMath(vocab_start=7, valid=297)
    for block_v in (16, None):
        got = tk.softmax_partials(x, None, math, entropy=False, target=False, sum_logits=False, argmax=True,
                                  sum_sq=True, block_v=block_v)  # fmt: skip
        assert torch.equal(got[:, 7].long(), x[:, :297].argmax(-1) + 7), block_v
        want = torch.exp(2 * (x[:, :297] - x[:, :297].amax(-1, keepdim=True))).sum(-1)
        torch.testing.assert_close(got[:, 5], want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kept", [{}, {"top_k": 20}], ids=["full", "top_k"])
def test_the_by_products_hold_nothing_chunk_sized(kept):
    """Live-tensor peak of the PyTorch kernels (chunks of 32 rows x 4096 columns, the auto chunk's buffers) with
    the three by-products and the entropy against the entropy alone: only per-token vectors more."""
    from lmloss.profiling import peak_memory

    g = torch.Generator().manual_seed(7)
    x, labels = torch.randn(256, 4096, generator=g), torch.randint(0, 4096, (256,), generator=g)
    peaks = []
    for asked in (False, True):
        with peak_memory() as mem:
            lmloss.token_logprobs(x, labels, return_entropy=True, chunk_size=32, impl="torch", return_logit_sum=asked,
                                  return_argmax=asked, return_log_sum_sq_probs=asked, **kept)  # fmt: skip
        peaks.append(mem.peak_bytes)
    chunk = 32 * 4096 * 4
    assert peaks[0] >= 2 * chunk and peaks[1] - peaks[0] <= 256 * 8 * 4, peaks


def test_the_by_products_name_their_argument_when_refused():
    x, labels = _logits()
    with pytest.raises(TypeError, match="return_argmax must be a bool"):
        lmloss.token_logprobs(x, labels, return_argmax=1)
    with pytest.raises(ValueError, match="return_logit_sum=True with support="):
        lmloss.token_logprobs(x, labels, support=torch.arange(2).repeat(N, 1), return_logit_sum=True)


def test_the_hf_scorer_passes_them_through_aligned_with_the_tokens():
    """`lmloss.integrations.hf.token_logprobs` (what the TRL patches score with) of a tiny Llama, against its own
    logits: position t holds the by-products of the distribution that predicts token t (-1 / 0 at t = 0 and where
    the label is ignored)."""
    transformers = pytest.importorskip("transformers")
    from lmloss.integrations import hf

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    ids = torch.randint(0, 96, (2, 7))
    labels = ids.clone()
    labels[0, 3] = -100
    _, _, total, top, lsq = hf.token_logprobs(model, ids, labels, temperature=0.5, return_entropy=True, return_argmax=True,
                                              return_logit_sum=True, return_log_sum_sq_probs=True)  # fmt: skip
    with torch.no_grad():
        z = model(ids).logits.double()[:, :-1] / 0.5
    scored = torch.nn.functional.pad(labels[:, 1:] != -100, (1, 0))
    want_top = torch.nn.functional.pad(z.argmax(-1), (1, 0), value=-1)
    assert top.dtype == torch.int64 and torch.equal(top, torch.where(scored, want_top, -1))
    want_sum = torch.nn.functional.pad(z.sum(-1), (1, 0))
    torch.testing.assert_close(total.double(), torch.where(scored, want_sum, 0.0), rtol=1e-5, atol=1e-4)
    want_lsq = torch.nn.functional.pad(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1), (1, 0))
    torch.testing.assert_close(lsq.double(), torch.where(scored, want_lsq, 0.0), rtol=1e-5, atol=1e-5)
