"""``cross_entropy(..., inplace_backward=True)``: the gradient is computed in the forward and written over
the logits (declared to autograd: ``ctx.mark_dirty``, or for a view a bump of its version counter).

The logits come from an op (``h @ W.T``, as an LM head's output would), so the gradient continues to the
leaves h and W; every comparison is against the same call with ``inplace_backward=False`` (whose own
correctness against float64 references is tested in test_impls.py), and every misuse must fail loudly.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import lmloss
from impl_params import DTYPES, IMPLS
from lmloss.profiling import peak_memory

IGNORE = -100

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),  # interpreter on -inf rows
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _leaves(dtype, *, lead=(12,), hidden=16, vocab=40, seed=0):
    """hidden ``[*lead, H]`` and weight ``[V, H]`` leaves, and labels ``[*lead]`` (every 4th ignored)."""
    h = torch.randn((*lead, hidden), generator=_gen(seed)).to(dtype).requires_grad_()
    w = (torch.randn((vocab, hidden), generator=_gen(seed + 1)) / 2).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, lead, generator=_gen(seed + 2))
    labels.view(-1)[1::4] = IGNORE
    return h, w, labels


def _clones(*leaves):
    return [t.detach().clone().requires_grad_() for t in leaves]


def _logits(h, w, labels, minus_inf_ignored_row: bool):
    """``h @ W.T``; optionally one ignored row is pushed to -inf (its loss and gradient must stay 0)."""
    logits = h @ w.T
    if minus_inf_ignored_row:
        row_mask = torch.zeros(labels.shape, dtype=logits.dtype)
        row_mask.view(-1)[1] = float("-inf")  # labels.view(-1)[1] is IGNORE
        logits = logits + row_mask[..., None]
    return logits


OPTIONS = {
    "plain": dict(),
    "smoothing_zloss_temperature_softcap_inf_row": dict(
        label_smoothing=0.1, z_loss=0.01, temperature=0.7, softcap=3.0, inf_row=True
    ),
    "leading_dims_ragged_chunks": dict(lead=(3, 4), chunk_size=5, label_smoothing=0.05),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("options", list(OPTIONS), ids=str)
def test_inplace_value_and_gradients_equal_out_of_place(options, reduction, impl, dtype):
    options = dict(OPTIONS[options])
    inf_row, lead = options.pop("inf_row", False), options.pop("lead", (12,))
    h, w, labels = _leaves(dtype, lead=lead)
    h2, w2 = _clones(h, w)

    inplace = lmloss.cross_entropy(
        _logits(h, w, labels, inf_row),
        labels,
        reduction=reduction,
        inplace_backward=True,
        impl=impl,
        **options,
    )
    (inplace * 1.5).backward()
    reference = lmloss.cross_entropy(
        _logits(h2, w2, labels, inf_row), labels, reduction=reduction, impl=impl, **options
    )
    (reference * 1.5).backward()

    assert torch.isfinite(inplace) and inplace.shape == ()
    torch.testing.assert_close(inplace, reference, atol=1e-6, rtol=1e-6)
    for ours, theirs in ((h.grad, h2.grad), (w.grad, w2.grad)):
        assert ours.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
        else:
            # bf16: in place, the d-logits are rounded to bf16 and then scaled by the upstream in bf16 (out of
            # place: scaled, then rounded once), and Triton's interpreter truncates where a GPU rounds; the
            # bf16 matmul into h and W follows. A couple of bf16 ulps of the largest gradient.
            scale = float(theirs.abs().max())
            torch.testing.assert_close(ours.float(), theirs.float(), atol=2**-6 * scale, rtol=2**-7)
    if inf_row:
        assert torch.equal(h.grad[1], torch.zeros_like(h.grad[1]))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("earlier", ["square", "token_logprobs"])
def test_another_op_that_saved_the_logits_raises_at_backward(earlier, impl):
    """An op that saved the logits before the in-place call would compute its gradient with the gradient
    in place of the logits: PyTorch's version counter must stop it."""
    h, w, labels = _leaves(torch.float32)
    logits = h @ w.T
    if earlier == "square":
        other = (logits**2).sum()
    else:
        other = lmloss.token_logprobs(logits, labels, impl=impl).sum()
    loss = lmloss.cross_entropy(logits, labels, reduction="sum", inplace_backward=True, impl=impl)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_reading_the_overwritten_logits_afterwards_raises_at_backward(impl):
    h, w, labels = _leaves(torch.float32)
    logits = h @ w.T
    loss = lmloss.cross_entropy(logits, labels, reduction="mean", inplace_backward=True, impl=impl)
    later = logits.sum()  # logits now hold the gradient
    with pytest.raises(RuntimeError, match="overwrote the logits"):
        (loss + later).backward()


def test_a_second_backward_through_the_same_graph_raises():
    h, w, labels = _leaves(torch.float32)
    loss = lmloss.cross_entropy(h @ w.T, labels, reduction="sum", inplace_backward=True, impl="torch")
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()
    assert torch.equal(h.grad, first)


def test_misuse_raises_a_clear_value_error():
    h, w, labels = _leaves(torch.float32, lead=(3, 4))
    leaf = torch.randn(3, 4, 40, requires_grad=True)
    for logits in (leaf, leaf[:, :2]):  # a leaf, and a view of one
        with pytest.raises(ValueError, match="leaf"):
            lmloss.cross_entropy(logits, labels[:, : logits.shape[1]], inplace_backward=True)
    with pytest.raises(ValueError, match="inplace_backward"):
        lmloss.cross_entropy(h @ w.T, labels, reduction="none", inplace_backward=True)
    transposed = (h.transpose(0, 1) @ w.T).transpose(0, 1)  # [3, 4, V] that does not flatten as a view
    with pytest.raises(ValueError, match="view"):
        lmloss.cross_entropy(transposed, labels, inplace_backward=True)
    assert h.grad is None and w.grad is None


#: name -> (leading shape of h, how the loss call takes the lm_head output z, how it takes the labels)
VIEW_FORMS = {
    "view_flat": ((3, 4), lambda z: z.view(-1, z.shape[-1]), lambda y: y.view(-1)),
    "flatten_0_1": ((3, 4), lambda z: z.flatten(0, 1), lambda y: y.flatten(0, 1)),
    "rows_but_last": ((12,), lambda z: z[:-1], lambda y: y[1:]),  # the causal shift of one sequence
    "one_sequence_shifted": (
        (1, 12),
        lambda z: z[:, :-1].reshape(-1, z.shape[-1]),
        lambda y: y[:, 1:].reshape(-1),
    ),
    "vocab_columns_slice": ((12,), lambda z: z[:, :36], lambda y: y.clamp(max=35)),  # padded head columns
}


# the view handling is the autograd wrapper's, the same for both kernels: Triton (slow under the
# interpreter) runs the commonest form only
VIEW_CASES = [(form, "torch") for form in VIEW_FORMS] + [("view_flat", "triton")]


@pytest.mark.parametrize(("form", "impl"), VIEW_CASES, ids=[f"{f}-{i}" for f, i in VIEW_CASES])
def test_inplace_on_a_view_of_the_lm_head_output_equals_out_of_place(form, impl):
    """``cross_entropy(lm_head(h).view(-1, V), y, inplace_backward=True)`` and other views of a non-leaf:
    the loss and the gradients of h and W equal the out-of-place call on the same view."""
    lead, take, take_labels = VIEW_FORMS[form]
    h, w, labels = _leaves(torch.float32, lead=lead)
    h2, w2 = _clones(h, w)
    logits = take(h @ w.T)
    assert logits._is_view()
    inplace = lmloss.cross_entropy(
        logits, take_labels(labels), inplace_backward=True, chunk_size=5, impl=impl
    )
    (inplace * 1.5).backward()
    reference = lmloss.cross_entropy(take(h2 @ w2.T), take_labels(labels), chunk_size=5, impl=impl)
    (reference * 1.5).backward()
    torch.testing.assert_close(inplace, reference, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h.grad, h2.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, atol=1e-6, rtol=1e-5)


def test_inplace_on_a_view_still_stops_an_op_that_saved_the_logits():
    h, w, labels = _leaves(torch.float32, lead=(3, 4))
    logits = h @ w.T
    other = (logits**2).sum()
    loss = lmloss.cross_entropy(logits.view(-1, 40), labels.view(-1), inplace_backward=True, impl="torch")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()


@pytest.mark.parametrize("which", ["logits", "view_base"])
def test_retain_grad_on_the_logits_is_refused_with_a_clear_value_error(which):
    h, w, labels = _leaves(torch.float32, lead=(3, 4))
    z = h @ w.T
    logits = z if which == "logits" else z.view(-1, 40)
    z.retain_grad()
    with pytest.raises(ValueError, match=r"retain_grad\(\)"):
        lmloss.cross_entropy(logits, labels.view(logits.shape[:-1]), inplace_backward=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_without_gradients_the_logits_are_left_unchanged(impl):
    h, w, labels = _leaves(torch.float32)
    expected = lmloss.cross_entropy((h @ w.T).detach(), labels, reduction="sum", impl=impl)
    with torch.no_grad():
        logits = h @ w.T
        before = logits.clone()
        loss = lmloss.cross_entropy(logits, labels, reduction="sum", inplace_backward=True, impl=impl)
    assert torch.equal(logits, before)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    detached = (h @ w.T).detach()  # grad mode on, but nothing to differentiate
    before = detached.clone()
    lmloss.cross_entropy(detached, labels, reduction="mean", inplace_backward=True, impl=impl)
    assert torch.equal(detached, before)


# ----------------------------------------------------------------------------------------------------------
# memory (the PyTorch implementation: Triton's CPU interpreter copies each kernel argument's whole storage,
# so its figure here would measure the interpreter, not the kernels)

N, V, H, C = 256, 512, 16, 32  # logits 512 KiB in fp32; one fp32 chunk C x V x 4 = 64 KiB
PER_TOKEN_SLACK = 64  # bytes per token: lse, per-token losses, masks, coefficients


@pytest.mark.parametrize(
    ("dtype", "options", "fp32_chunks"),
    [
        (torch.float32, dict(), 1),
        (torch.float32, dict(softcap=5.0, label_smoothing=0.1, z_loss=0.01, temperature=0.8), 1),
        (torch.bfloat16, dict(), 1),
        (torch.bfloat16, dict(softcap=5.0, label_smoothing=0.1), 2),  # the softcap slope beside the work
        (torch.float32, dict(view=True), 1),  # lm_head(h).view(-1, V): the gradient goes back without a copy
    ],
    ids=["fp32", "fp32_all_options", "bf16", "bf16_softcap", "fp32_view"],
)
def test_inplace_peak_is_one_chunk_where_out_of_place_holds_a_gradient_buffer(dtype, options, fp32_chunks):
    """Forward + backward of the loss, the logits made before the measured block: in place, the peak above
    them is the fp32 chunk work (``fp32_chunks * C * V * 4``), per-token vectors and the small gradients of
    h and W; out of place it is at least a whole ``[N, V]`` gradient buffer more."""
    options = dict(options)
    view = options.pop("view", False)
    h, w, labels = _leaves(dtype, lead=(N,), hidden=H, vocab=V)
    matmul_grads = 2 * (N + V) * H * h.element_size()  # h.grad and W.grad, with room for a temporary
    bound = fp32_chunks * C * V * 4 + PER_TOKEN_SLACK * N + matmul_grads
    peaks = {}
    for inplace in (True, False):
        h_, w_ = _clones(h, w)
        logits = (h_ @ w_.T).view(-1, V) if view else h_ @ w_.T
        with peak_memory() as mem:
            loss = lmloss.cross_entropy(
                logits,
                labels,
                reduction="mean",
                chunk_size=C,
                inplace_backward=inplace,
                impl="torch",
                **options,
            )
            loss.backward()
        del logits, loss
        assert h_.grad is not None and w_.grad is not None
        peaks[inplace] = mem.peak_bytes
    assert peaks[True] <= bound, f"in place: {peaks[True]} bytes above the logits, bound {bound}"
    gradient_buffer = N * V * h.element_size()
    assert peaks[False] >= peaks[True] + gradient_buffer, peaks


class _OpsOverTensorsOf(TorchDispatchMode):
    """Records every op that is not a view (``detach`` is one) and touches a tensor of >= `numel` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not func.is_view and any(t.numel() >= self.numel for t in tensors):
            self.ops.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_backward_at_upstream_one_runs_nothing_over_the_logits_and_other_upstreams_stay_exact(impl, reduction):
    """The mean's 1 / count is folded into the gradient in the forward: ``loss.backward()`` (upstream 1.0)
    hands the stored gradient on with no op over ``[N, V]``; 0.5, 3.0 and a multiply inside the graph
    (``loss * -0.25``) still give the exact gradient of ``F.cross_entropy`` in float64."""
    n, vocab = 12, 40
    labels = torch.randint(0, vocab, (n,), generator=_gen(3))
    labels[1::4] = IGNORE
    base = torch.randn(n, vocab, generator=_gen(4)).requires_grad_()
    for upstream, in_graph in ((1.0, 1.0), (0.5, 1.0), (3.0, 1.0), (1.0, -0.25)):
        logits = base.clone()  # an op's output (clone's backward hands the gradient on as it is)
        loss = lmloss.cross_entropy(logits, labels, reduction=reduction, inplace_backward=True, impl=impl)
        with _OpsOverTensorsOf(n * vocab) as recorder:
            scaled = loss * in_graph if in_graph != 1.0 else loss
            (grad,) = torch.autograd.grad(scaled, base, torch.tensor(upstream))
        base64 = base.detach().double().requires_grad_()
        ref = torch.nn.functional.cross_entropy(base64, labels, ignore_index=IGNORE, reduction=reduction)
        (expected,) = torch.autograd.grad(ref * (upstream * in_graph), base64)
        torch.testing.assert_close(grad.double(), expected, atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-6, rtol=1e-6)
        if upstream == 1.0 and in_graph == 1.0:
            assert recorder.ops == [], recorder.ops
        elif in_graph == 1.0:
            assert recorder.ops == ["aten.mul_.Tensor"], recorder.ops  # one pass, in place, nothing else
