"""Both implementations of every public op (``impl="torch"`` and ``impl="triton"``) against float64
references written out here in plain PyTorch (``log_softmax``, ``F.cross_entropy``, autograd).

The Triton kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set in
conftest.py before triton is imported). The interpreter costs milliseconds per program, so shapes stay tiny
(<= 12 tokens, <= 70 columns, hidden <= 16) and cases combine several options each.

Tolerances: lmloss computes in fp32 from the inputs' values, so against a float64 reference of the *same*
inputs (bf16 values upcast exactly) the fp32 outputs agree to fp32 rounding in both dtypes; gradients come
back in the inputs' dtype, so bf16 gradients agree to one bf16 rounding (relative 2**-8) of the reference.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

import lmloss
import lmloss.plan
from impl_params import DTYPES, IMPLS
from lmloss.kernels import triton_available

IGNORE = -100
VALUE_TOL = dict(atol=2e-5, rtol=2e-5)  # fp32 outputs, both input dtypes
GRAD_TOL = {torch.float32: dict(atol=2e-6, rtol=2e-5), torch.bfloat16: dict(atol=1e-6, rtol=2**-8)}
# Triton's interpreter converts fp32 -> bf16 by truncation (a GPU rounds to nearest even): a bf16 gradient
# written by a Triton kernel on the CPU is within one bf16 ulp (2**-7 relative) instead of half of one.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_BF16_TOL = dict(atol=1e-6, rtol=2**-7 if INTERPRETED else 2**-8)

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # the interpreter does the kernels' arithmetic in numpy, which warns on the NaN rows that tests feed in
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------------------
# float64 references, written out


def _scaled(x64, *, temperature=1.0, softcap=None, vocab_size=None):
    """``softcap * tanh(x / softcap) / T`` over the first `vocab_size` columns (Gemma's capping first)."""
    y = x64[..., :vocab_size]
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    return y / temperature


def _ref_logprobs(y64, labels):
    valid = labels != IGNORE
    logp = torch.log_softmax(y64, dim=-1)
    picked = logp.gather(-1, torch.where(valid, labels, 0)[..., None]).squeeze(-1)
    return torch.where(valid, picked, 0.0)


def _ref_entropy(y64, labels=None):
    """Entropy of softmax(y); with `labels` (token_logprobs' entropy), 0 where they are ignored."""
    logp = torch.log_softmax(y64, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return entropy if labels is None else torch.where(labels != IGNORE, entropy, 0.0)


def _ref_cross_entropy(y64, labels, *, reduction, label_smoothing=0.0, z_loss=0.0):
    """F.cross_entropy (+ ``z_loss * logsumexp**2`` per non-ignored token), reduced as F.cross_entropy does."""
    flat = y64.reshape(-1, y64.shape[-1])
    per_token = F.cross_entropy(
        flat, labels.reshape(-1), ignore_index=IGNORE, label_smoothing=label_smoothing, reduction="none"
    )
    valid = labels.reshape(-1) != IGNORE
    per_token = per_token + torch.where(valid, z_loss * flat.logsumexp(-1).square(), 0.0)
    if reduction == "none":
        return per_token.view(labels.shape)
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / valid.sum()


# ----------------------------------------------------------------------------------------------------------
# logits cases: each builds a leaf, the (possibly non-contiguous) view handed to lmloss, labels and options


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]  # of the logits handed to lmloss, [..., V]
    layout: str = "contiguous"  # "transposed": [B, S, V] view of an [S, B, V] leaf; "vocab_major": [N, V]
    # view of a [V, N] leaf (vocabulary stride != 1); "sliced": a column window of a wider leaf
    scale: float = 3.0
    pad: int = 0  # trailing columns beyond vocab_size, filled with huge values (and one +inf)
    ignore_every: int = 4
    options: dict = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return self.name

    def build(self, dtype):
        """(leaf with grad, view(t) -> logits seen by lmloss, labels, options)."""
        *lead, V = self.shape
        base = torch.randn(self.shape, generator=_gen(len(self.name)), dtype=torch.float64) * self.scale
        if self.pad:
            base[..., V - self.pad :] = 1e4
            base.view(-1, V)[0, -1] = float("inf")
        labels = torch.randint(0, V - self.pad, tuple(lead), generator=_gen(7))
        if self.ignore_every:
            labels.view(-1)[1 :: self.ignore_every] = IGNORE
        options = dict(self.options, **({"vocab_size": V - self.pad} if self.pad else {}))
        if self.layout == "transposed":
            leaf, view = base.transpose(0, 1).contiguous(), lambda t: t.transpose(0, 1)
        elif self.layout == "vocab_major":
            leaf, view = base.t().contiguous(), lambda t: t.t()
        elif self.layout == "sliced":
            leaf = torch.cat([base[..., :3] - 50.0, base, base[..., :2] + 50.0], dim=-1)
            view = lambda t: t[..., 3 : 3 + V]  # noqa: E731
        else:
            leaf, view = base, lambda t: t
        leaf = leaf.to(dtype).requires_grad_()
        return leaf, view, labels, options


LOGITS_CASES = [
    Case("plain_one_chunk", (7, 37), options=dict(chunk_size=None)),
    Case("temperature_softcap_ragged_chunks", (11, 53), scale=8.0,
         options=dict(temperature=0.7, softcap=4.0, chunk_size=4)),
    Case("padded_vocab_huge_columns", (6, 45), pad=7, options=dict(chunk_size=5, temperature=1.3)),
    Case("leading_dims_transposed_view", (3, 4, 29), layout="transposed", options=dict(chunk_size=5)),
    Case("vocabulary_strided_view", (5, 31), layout="vocab_major", options=dict(softcap=2.0)),
    Case("sliced_view_padded", (6, 33), layout="sliced", pad=4, options=dict(chunk_size=4)),
]  # fmt: skip


def _leaf64(leaf):
    return leaf.detach().double().requires_grad_()


def _scaled_ref(x64, options):
    keep = ("temperature", "softcap", "vocab_size")
    return _scaled(x64, **{k: v for k, v in options.items() if k in keep})


def _check_grad(actual, expected, dtype, *, pad=0, impl="torch"):
    """`impl`: the implementation that wrote `actual` (in its dtype)."""
    assert actual.dtype == dtype
    tol = TRITON_BF16_TOL if impl == "triton" and dtype == torch.bfloat16 else GRAD_TOL[dtype]
    torch.testing.assert_close(actual.double(), expected, **tol)
    if pad:  # padded columns get exactly 0 (the reference's slice gives exactly 0 there too)
        assert torch.equal(actual[..., -pad:], torch.zeros_like(actual[..., -pad:]))


def _check_padded_columns(case: Case, view, leaf):
    if case.pad:
        tail = view(leaf.grad)[..., -case.pad :]
        assert torch.equal(tail, torch.zeros_like(tail))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", LOGITS_CASES, ids=str)
def test_token_logprobs_with_entropy_match_float64(case, impl, dtype):
    leaf, view, labels, options = case.build(dtype)
    up_lp = torch.randn(labels.shape, generator=_gen(3), dtype=torch.float64)  # e.g. RL advantages
    up_h = torch.randn(labels.shape, generator=_gen(4), dtype=torch.float64)

    logprobs, entropy = lmloss.token_logprobs(view(leaf), labels, return_entropy=True, impl=impl, **options)
    (logprobs * up_lp.float() + entropy * up_h.float()).sum().backward()

    leaf64 = _leaf64(leaf)
    y64 = _scaled_ref(view(leaf64), options)
    ref_lp, ref_h = _ref_logprobs(y64, labels), _ref_entropy(y64, labels)
    (ref_lp * up_lp + ref_h * up_h).sum().backward()

    assert logprobs.dtype == entropy.dtype == torch.float32
    assert logprobs.shape == entropy.shape == labels.shape
    torch.testing.assert_close(logprobs.double(), ref_lp, **VALUE_TOL)
    torch.testing.assert_close(entropy.double(), ref_h, **VALUE_TOL)
    assert torch.equal(logprobs[labels == IGNORE], torch.zeros_like(logprobs[labels == IGNORE]))
    _check_grad(leaf.grad, leaf64.grad, dtype, impl=impl)
    _check_padded_columns(case, view, leaf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [LOGITS_CASES[1], LOGITS_CASES[5]], ids=str)
def test_token_entropy_matches_float64(case, impl, dtype):
    leaf, view, _, options = case.build(dtype)
    upstream = torch.randn(view(leaf).shape[:-1], generator=_gen(5))

    entropy = lmloss.token_entropy(view(leaf), impl=impl, **options)
    (entropy * upstream).sum().backward()

    leaf64 = _leaf64(leaf)
    ref = _ref_entropy(_scaled_ref(view(leaf64), options))
    (ref * upstream.double()).sum().backward()

    torch.testing.assert_close(entropy.double(), ref, **VALUE_TOL)
    _check_grad(leaf.grad, leaf64.grad, dtype, impl=impl)
    _check_padded_columns(case, view, leaf)


def _nonfinite_ignored_rows(dtype, shape=(9, 41), pad=0):
    """Logits whose ignored rows hold NaN / -inf / +inf (their labels are IGNORE); returns (leaf, labels,
    ignored row mask)."""
    N, V = shape
    base = torch.randn(shape, generator=_gen(11), dtype=torch.float64) * 3
    labels = torch.randint(0, V - pad, (N,), generator=_gen(12))
    ignored = torch.zeros(N, dtype=torch.bool)
    ignored[[1, 4, 7]] = True
    labels[ignored] = IGNORE
    base[1] = float("nan")
    base[4] = float("-inf")
    base[7, ::2] = float("inf")
    if pad:
        base[:, V - pad :] = 1e4
    return base.to(dtype).requires_grad_(), labels, ignored


def _clean64(leaf, ignored):
    """The float64 leaf and its rows for the reference: ignored rows zeroed (their value must not matter,
    and a where() passes them exactly 0 gradient)."""
    leaf64 = _leaf64(leaf)
    return leaf64, torch.where(ignored[:, None], 0.0, leaf64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_token_logprobs_ignored_rows_are_exactly_zero_even_if_non_finite(impl, dtype):
    leaf, labels, ignored = _nonfinite_ignored_rows(dtype)
    upstream = torch.randn(labels.shape, generator=_gen(13))

    logprobs = lmloss.token_logprobs(leaf, labels, impl=impl, chunk_size=4, temperature=0.9)
    (logprobs * upstream).sum().backward()

    leaf64, x64 = _clean64(leaf, ignored)
    ref = _ref_logprobs(_scaled(x64, temperature=0.9), labels)
    (ref * upstream.double()).sum().backward()

    assert torch.equal(logprobs[ignored], torch.zeros(3))
    assert torch.equal(leaf.grad[ignored], torch.zeros_like(leaf.grad[ignored]))
    torch.testing.assert_close(logprobs.double(), ref, **VALUE_TOL)
    _check_grad(leaf.grad, leaf64.grad, dtype, impl=impl)


CE_OPTIONS = {
    "plain": dict(),
    "smoothing_zloss_temperature_softcap_padded": dict(
        label_smoothing=0.1, z_loss=0.01, temperature=0.8, softcap=5.0, chunk_size=4, pad=6
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("options", list(CE_OPTIONS), ids=str)
def test_cross_entropy_matches_float64(options, reduction, impl, dtype):
    """All reductions, with ignored rows holding NaN / inf (exactly 0 loss and gradient there)."""
    options = dict(CE_OPTIONS[options])
    pad = options.pop("pad", 0)
    leaf, labels, ignored = _nonfinite_ignored_rows(dtype, pad=pad)
    if pad:
        options["vocab_size"] = leaf.shape[-1] - pad
    upstream = torch.randn(labels.shape, generator=_gen(14)) if reduction == "none" else torch.tensor(1.7)

    loss = lmloss.cross_entropy(leaf, labels, reduction=reduction, impl=impl, mean_group=None, **options)
    (loss * upstream).sum().backward()

    leaf64, x64 = _clean64(leaf, ignored)
    y64 = _scaled_ref(x64, options)
    smoothing = {k: options[k] for k in ("label_smoothing", "z_loss") if k in options}
    ref = _ref_cross_entropy(y64, labels, reduction=reduction, **smoothing)
    (ref * upstream.double()).sum().backward()

    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    torch.testing.assert_close(loss.double(), ref, **VALUE_TOL)
    if reduction == "none":
        assert torch.equal(loss[ignored], torch.zeros(3))
    assert torch.equal(leaf.grad[ignored], torch.zeros_like(leaf.grad[ignored]))
    _check_grad(leaf.grad, leaf64.grad, dtype, pad=pad, impl=impl)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_walks_several_ragged_vocabulary_blocks(dtype, monkeypatch):
    """Force 16 / 32-column blocks: 53 valid columns of 60 are 4 forward blocks (the last one partial) and
    2 backward blocks per row, so the online max/sum across blocks and the masks at ragged edges run."""
    from lmloss.kernels import triton_kernels

    monkeypatch.setattr(triton_kernels, "FORWARD_BLOCKS", ((float("inf"), 16, 1),))
    monkeypatch.setattr(triton_kernels, "BACKWARD_BLOCKS", ((float("inf"), 32, 1),))
    leaf, labels, ignored = _nonfinite_ignored_rows(dtype, shape=(9, 60), pad=7)
    # the huge logits sit in later blocks of some rows: the running max must move between blocks
    with torch.no_grad():
        leaf[0, 40] = 30.0
        leaf[2, 20] = 25.0
    options = dict(vocab_size=53, temperature=0.9, softcap=40.0, chunk_size=3)
    up_h = torch.randn(9, generator=_gen(15))

    loss = lmloss.cross_entropy(leaf, labels, reduction="sum", label_smoothing=0.2, impl="triton", **options)
    entropy = lmloss.token_entropy(leaf, impl="triton", **options)
    # each op's bf16 gradient on its own (autograd would add the two in bf16)
    grads = [
        torch.autograd.grad(out, leaf)[0] for out in (loss, (torch.where(ignored, 0.0, entropy) * up_h).sum())
    ]

    leaf64, x64 = _clean64(leaf, ignored)
    y64 = _scaled_ref(x64, options)
    ref_loss = _ref_cross_entropy(y64, labels, reduction="sum", label_smoothing=0.2)
    ref_h = _ref_entropy(y64)
    ref_outs = (ref_loss, (torch.where(ignored, 0.0, ref_h) * up_h.double()).sum())
    ref_grads = [torch.autograd.grad(out, leaf64, retain_graph=True)[0] for out in ref_outs]

    torch.testing.assert_close(loss.double(), ref_loss, **VALUE_TOL)
    torch.testing.assert_close(entropy[~ignored].double(), ref_h[~ignored], **VALUE_TOL)
    for grad, ref_grad in zip(grads, ref_grads):
        _check_grad(grad, ref_grad, dtype, pad=7, impl="triton")


# ----------------------------------------------------------------------------------------------------------
# fused ops: hidden [N, H] @ weight [V, H].T + bias


def _fused_inputs(dtype, *, n=12, hidden=16, vocab=40, pad=0):
    """Inputs on a 1/8 grid (|h|, |W| <= 2/8, bias on a 1/64 grid): every logit is a multiple of 1/64 below
    2 in magnitude, exact in bf16, so the bf16 matmul loses nothing and the float64 reference of the same
    inputs is the exact answer. Padded rows of the weight get a huge bias."""
    h = torch.randint(-2, 3, (n, hidden), generator=_gen(21)).double() / 8
    w = torch.randint(-2, 3, (vocab, hidden), generator=_gen(22)).double() / 8
    b = torch.randint(-32, 33, (vocab,), generator=_gen(23)).double() / 64
    if pad:
        b[vocab - pad :] = 1e4
    labels = torch.randint(0, vocab - pad, (n,), generator=_gen(24))
    labels[2::5] = IGNORE
    return [t.to(dtype).requires_grad_() for t in (h, w, b)], labels


def _fused_ref(h, w, b):
    """float64 leaves and their logits (d-logits kept for the rounding bounds)."""
    h64, w64, b64 = (_leaf64(t) for t in (h, w, b))
    z64 = h64 @ w64.T + b64
    z64.retain_grad()
    return (h64, w64, b64), z64


def _check_fused_grads(ours, refs, z64, dtype):
    """Gradients of hidden, weight, bias against float64. bf16: the weight / bias gradients accumulate in
    fp32 and are rounded once; the hidden gradient ``dz @ W`` multiplies bf16-rounded d-logits, so it is
    within 2**-8 of ``|dz| @ |W|`` elementwise."""
    (h, w, b), (h64, w64, b64) = ours, refs
    _check_grad(w.grad, w64.grad, dtype)
    _check_grad(b.grad, b64.grad, dtype)
    if dtype == torch.float32:
        _check_grad(h.grad, h64.grad, dtype)
        return
    bound = 2**-8 * (z64.grad.abs() @ w64.detach().abs()) + 2**-8 * h64.grad.abs() + 1e-6
    assert h.grad.dtype == dtype
    assert ((h.grad.double() - h64.grad).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_linear_token_logprobs_with_entropy_match_float64(impl, dtype):
    """Per-token path (gradients recomputed in the backward, 4 matmuls) with arbitrary upstreams, entropy,
    temperature, softcap, bias, padded vocabulary and ragged chunks (12 tokens in chunks of 5)."""
    (h, w, b), labels = _fused_inputs(dtype, pad=5)
    options = dict(temperature=0.6, softcap=1.5, vocab_size=35, chunk_size=5)
    up_lp = torch.randn(12, generator=_gen(25))
    up_h = torch.randn(12, generator=_gen(26))

    logprobs, entropy = lmloss.linear_token_logprobs(
        h, w, labels, bias=b, return_entropy=True, impl=impl, **options
    )
    (logprobs * up_lp + entropy * up_h).sum().backward()

    refs, z64 = _fused_ref(h, w, b)
    y64 = _scaled_ref(z64, options)
    ref_lp, ref_h = _ref_logprobs(y64, labels), _ref_entropy(y64, labels)
    (ref_lp * up_lp.double() + ref_h * up_h.double()).sum().backward()

    torch.testing.assert_close(logprobs.double(), ref_lp, **VALUE_TOL)
    torch.testing.assert_close(entropy.double(), ref_h, **VALUE_TOL)
    _check_fused_grads((h, w, b), refs, z64, dtype)
    assert torch.equal(w.grad[-5:], torch.zeros_like(w.grad[-5:]))  # padded rows of the LM head
    assert torch.equal(b.grad[-5:], torch.zeros_like(b.grad[-5:]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_linear_cross_entropy_matches_float64(reduction, impl, dtype):
    """Summed path (gradients computed in the forward, scaled by the upstream scalar) and the per-token
    path, with label smoothing, z-loss, bias, ignored tokens and ragged chunks (12 tokens in chunks of 5)."""
    (h, w, b), labels = _fused_inputs(dtype)
    options = dict(label_smoothing=0.1, z_loss=0.02, temperature=0.7, chunk_size=5)
    upstream = torch.randn(12, generator=_gen(27)) if reduction == "none" else torch.tensor(0.6)

    loss = lmloss.linear_cross_entropy(h, w, labels, bias=b, reduction=reduction, impl=impl, **options)
    (loss * upstream).sum().backward()

    refs, z64 = _fused_ref(h, w, b)
    ref = _ref_cross_entropy(
        _scaled(z64, temperature=0.7), labels, reduction=reduction, label_smoothing=0.1, z_loss=0.02
    )
    (ref * upstream.double()).sum().backward()

    torch.testing.assert_close(loss.double(), ref, **VALUE_TOL)
    _check_fused_grads((h, w, b), refs, z64, dtype)


def _relative_error(actual, expected):
    return float((actual.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("path", ["summed", "per_token"])
def test_weight_grad_dtype_fp32_accumulator_is_at_least_as_close_as_bf16(path, impl):
    """bf16 inputs, 6 chunks of 2 tokens: the fp32 accumulator's weight gradient is within 1.05x of rounding
    the exact gradient once to bf16; the bf16 accumulator (rounded after every chunk) is close but no
    closer."""
    (h, w, b), labels = _fused_inputs(torch.bfloat16)
    errors = {}
    for acc in (torch.float32, torch.bfloat16):
        h_, w_, b_ = (t.detach().clone().requires_grad_() for t in (h, w, b))
        if path == "summed":
            loss = lmloss.linear_cross_entropy(
                h_, w_, labels, bias=b_, reduction="sum", chunk_size=2, weight_grad_dtype=acc, impl=impl
            )
        else:
            lp = lmloss.linear_token_logprobs(
                h_, w_, labels, bias=b_, chunk_size=2, weight_grad_dtype=acc, impl=impl, temperature=0.8
            )
            loss = (lp * torch.linspace(-1.0, 2.0, 12)).sum()
        loss.backward()
        assert w_.grad.dtype == b_.grad.dtype == torch.bfloat16
        errors[acc] = (w_.grad, b_.grad)

    (h64, w64, b64), z64 = _fused_ref(h, w, b)
    if path == "summed":
        ref = _ref_cross_entropy(z64, labels, reduction="sum")
    else:
        ref = (_ref_logprobs(z64 / 0.8, labels) * torch.linspace(-1.0, 2.0, 12).double()).sum()
    ref.backward()
    round_once = _relative_error(w64.grad.to(torch.bfloat16), w64.grad)
    err32 = _relative_error(errors[torch.float32][0], w64.grad)
    err16 = _relative_error(errors[torch.bfloat16][0], w64.grad)
    assert err32 <= 1.05 * round_once + 1e-7, (err32, round_once)
    assert err32 <= err16 <= 2**-5, (err32, err16)
    assert _relative_error(errors[torch.float32][1], b64.grad) <= 2**-8


# ----------------------------------------------------------------------------------------------------------
# choosing the implementation


def _all_ops(x, labels, h, w, impl):
    return [
        lambda: lmloss.token_logprobs(x, labels, impl=impl),
        lambda: lmloss.token_entropy(x, impl=impl),
        lambda: lmloss.cross_entropy(x, labels, impl=impl),
        lambda: lmloss.linear_token_logprobs(h, w, labels, impl=impl),
        lambda: lmloss.linear_cross_entropy(h, w, labels, impl=impl),
    ]


def test_auto_runs_the_torch_kernels_on_cpu_tensors(monkeypatch):
    chosen = []
    real = lmloss.plan.make_kernels

    def recording(impl, *args, **kwargs):
        chosen.append(impl)
        return real(impl, *args, **kwargs)

    monkeypatch.setattr(lmloss.plan, "make_kernels", recording)
    x = torch.randn(4, 9, requires_grad=True)
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(9, 8, requires_grad=True)
    labels = torch.tensor([0, 3, IGNORE, 8])
    for op in _all_ops(x, labels, h, w, "auto"):
        op().sum().backward()
    assert chosen and set(chosen) == {"torch"}, chosen
    if triton_available():  # the recorder sees an explicit choice
        chosen.clear()
        lmloss.token_entropy(x.detach(), impl="triton")
        assert chosen == ["triton"]
    # what auto would pick on a GPU (a pure function of device and dtype)
    expected = "triton" if triton_available() else "torch"
    assert lmloss.kernels.resolve_impl("auto", torch.device("cuda"), torch.bfloat16) == expected
    assert lmloss.kernels.resolve_impl("auto", torch.device("cuda"), torch.float64) == "torch"


@pytest.mark.parametrize(
    "op_index", range(5), ids=["logprobs", "entropy", "ce", "linear_logprobs", "linear_ce"]
)
def test_bad_impl_raises_naming_impl(op_index):
    labels = torch.tensor([0, 3, IGNORE, 8])
    x64, h64, w64 = (
        torch.randn(4, 9, dtype=torch.float64),
        torch.randn(4, 8).double(),
        torch.randn(9, 8).double(),
    )
    x, h, w = x64.float(), h64.float(), w64.float()
    with pytest.raises(ValueError, match="impl"):
        _all_ops(x, labels, h, w, "bogus")[op_index]()
    if triton_available():
        with pytest.raises(ValueError, match="impl"):
            _all_ops(x64, labels, h64, w64, "triton")[op_index]()
    # float64 under the reference is computed in float64
    out = _all_ops(x64, labels, h64, w64, "torch")[op_index]()
    assert out.dtype == torch.float64
