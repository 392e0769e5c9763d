"""Every public op under ``torch.compile(fullgraph=True)`` on CPU: the same values and gradients as eager.

``fullgraph=True`` makes any graph break an error, so these tests fail if an op syncs the host (a
data-dependent ``bool(tensor)``), queries threads, or calls something dynamo cannot trace. Most cases use
the ``aot_eager`` backend (dynamo's full graph and AOT autograd's forward/backward split, then eager
kernels: seconds per case); one case goes through the default inductor backend (code generation, tens
of seconds on a small CPU). The reference is the same op run eagerly on the same inputs.
"""

from __future__ import annotations

import pytest
import torch

import lmloss

pytestmark = pytest.mark.usefixtures("one_thread")

N, H, V = 6, 8, 12
TOL = dict(atol=1e-6, rtol=1e-6)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g) * 2
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    bias = torch.randn(V, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[2] = -100
    upstream = torch.randn(N, generator=g)
    return logits, hidden, weight, bias, labels, upstream


def _lp(x, y, u):
    return (lmloss.token_logprobs(x, y, chunk_size=4, temperature=0.9) * u).sum()


def _lp_entropy(x, y, u):
    logp, ent = lmloss.token_logprobs(x, y, chunk_size=4, softcap=5.0, return_entropy=True)
    return (logp * u).sum() - 0.1 * ent.sum()


def _entropy(x, y, u):
    return (lmloss.token_entropy(x, chunk_size=4) * u).sum()


def _ce_mean(x, y, u):
    return lmloss.cross_entropy(x, y, chunk_size=4, label_smoothing=0.1, z_loss=1e-3)


def _ce_inplace(x, y, u):
    # the logits an op produced (not a leaf): eagerly their gradient is written over them during the
    # forward; compiled, the op runs out of place, with the same value and gradient
    return lmloss.cross_entropy(x * 1.5, y, chunk_size=4, inplace_backward=True)


def _linear_lp(h, w, b, y, u):
    logp, ent = lmloss.linear_token_logprobs(h, w, y, bias=b, chunk_size=4, return_entropy=True)
    return (logp * u).sum() + 0.1 * ent.sum()


def _linear_ce(h, w, b, y, u):
    return lmloss.linear_cross_entropy(h, w, y, bias=b, chunk_size=4, temperature=1.2)


LOGITS_CASES = {"token_logprobs": _lp, "token_logprobs_entropy": _lp_entropy, "token_entropy": _entropy,
                "cross_entropy_mean": _ce_mean, "cross_entropy_inplace_backward": _ce_inplace}  # fmt: skip
FUSED_CASES = {"linear_token_logprobs_entropy": _linear_lp, "linear_cross_entropy_mean": _linear_ce}


def _values_and_grads(fn, leaves, rest):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves, *rest)
    out.backward()
    return out.detach(), [t.grad for t in leaves]


def _assert_compiled_matches_eager(fn, leaves, rest, backend):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    want, want_grads = _values_and_grads(fn, leaves, rest)
    got, got_grads = _values_and_grads(compiled, leaves, rest)
    torch.testing.assert_close(got, want, **TOL)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **TOL)
    # run again on new values: the compiled graph is reused (no recompile) and still right
    leaves = [t + 0.25 for t in leaves]
    want, want_grads = _values_and_grads(fn, leaves, rest)
    got, got_grads = _values_and_grads(compiled, leaves, rest)
    torch.testing.assert_close(got, want, **TOL)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("case", list(LOGITS_CASES))
def test_logits_op_compiled_with_fullgraph_matches_eager(case):
    logits, _, _, _, labels, upstream = _inputs()
    _assert_compiled_matches_eager(LOGITS_CASES[case], [logits], [labels, upstream], "aot_eager")


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_op_compiled_with_fullgraph_matches_eager(case):
    _, hidden, weight, bias, labels, upstream = _inputs()
    _assert_compiled_matches_eager(FUSED_CASES[case], [hidden, weight, bias], [labels, upstream], "aot_eager")


def test_token_entropy_compiled_with_inductor_matches_eager():
    logits, _, _, _, labels, upstream = _inputs(seed=1)
    # its kernels compiled in this process: a pool of compile workers costs seconds of start-up (each imports
    # torch) and compiles no faster on 2 cores
    with torch._inductor.config.patch(compile_threads=1):
        _assert_compiled_matches_eager(_entropy, [logits], [labels, upstream], "inductor")


def test_label_out_of_range_raises_value_error_eagerly_and_fails_at_run_time_when_compiled():
    logits, hidden, weight, _, labels, _ = _inputs(seed=2)
    labels[4] = V  # one past the vocabulary
    with pytest.raises(ValueError, match="labels must be in"):
        lmloss.token_logprobs(logits, labels)
    with pytest.raises(ValueError, match="labels must be in"):
        lmloss.linear_cross_entropy(hidden, weight, labels)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: lmloss.token_logprobs(x, y), fullgraph=True, backend="aot_eager")
    # inside a compiled region the check is a device-side assert: no host sync, a run-time error
    with pytest.raises(RuntimeError, match="outside"):
        compiled(logits, labels)
    labels[4] = 3
    torch.testing.assert_close(compiled(logits, labels), lmloss.token_logprobs(logits, labels), **TOL)
