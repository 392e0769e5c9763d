"""The Triton two-distribution kernels (`lmloss.kernels.triton_distill`) through the ops, against the float64
references of test_distill.py.

Runs on the CPU under ``TRITON_INTERPRET=1`` (conftest.py); with ``TRITON_INTERPRET=0`` and a GPU on CUDA. The
interpreter costs about a millisecond per program, so shapes stay tiny and a 16-column block forces several
vocabulary blocks per row (29 columns: one full block and a ragged one).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from test_distill import _leaf, _mean_over_valid, _problem, reference, sparse_reference
from triton_support import compile_for_h100, kernel_test_device

pytest.importorskip("triton", reason="the Triton kernels need triton installed")

import lmloss  # noqa: E402
from lmloss.kernels import triton_distill  # noqa: E402

DEVICE = kernel_test_device()
#: numpy warns about -inf - -inf and log(0) in masked-off lanes that the interpreter still evaluates
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
TOL = dict(atol=2e-6, rtol=1e-5)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(triton_distill, "BLOCKS", ((math.inf, 16, 4),))


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_triton_divergence_matches_float64_reference_with_padding_and_temperature(beta):
    student, teacher, labels = _problem(11, n=6)
    vocab_size = student.shape[1] - 2
    student[:, vocab_size:] = math.nan  # padded columns are never read into a result
    x = _leaf(student, torch.float32).to(DEVICE)
    x.retain_grad()
    loss = lmloss.distillation_loss(
        x, teacher.float().to(DEVICE), labels.to(DEVICE), beta=beta, temperature=0.7, vocab_size=vocab_size,
        chunk_size=4, impl="triton",
    )  # fmt: skip
    loss.backward()
    xr = _leaf(student[:, :vocab_size])
    expected = _mean_over_valid(reference(xr, teacher[:, :vocab_size], beta, 0.7), labels)
    expected.backward()
    torch.testing.assert_close(loss.double().cpu(), expected, **TOL)
    torch.testing.assert_close(x.grad[:, :vocab_size].double().cpu(), xr.grad, **TOL)
    assert (x.grad[:, vocab_size:] == 0).all()


def test_triton_divergence_gives_exactly_zero_gradient_to_ignored_rows_with_nan():
    student, teacher, labels = _problem(12, n=6)
    ignored = labels == -100
    poisoned = student.clone()
    poisoned[ignored] = math.nan
    x = _leaf(poisoned, torch.float32).to(DEVICE)
    x.retain_grad()
    loss = lmloss.distillation_loss(x, teacher.float().to(DEVICE), labels.to(DEVICE), beta=0.5, impl="triton")
    loss.backward()
    xr = _leaf(student)
    expected = _mean_over_valid(reference(xr, teacher, 0.5, 1.0), labels)
    expected.backward()
    torch.testing.assert_close(loss.double().cpu(), expected, **TOL)
    assert (x.grad[ignored] == 0).all()
    torch.testing.assert_close(x.grad[~ignored].double().cpu(), xr.grad[~ignored], **TOL)


def test_triton_fused_distillation_writes_the_gradient_over_its_chunk():
    g = torch.Generator().manual_seed(13)
    n, h_s, h_t, v = 6, 6, 9, 29
    hidden, weight = torch.randn(n, h_s, generator=g), torch.randn(v, h_s, generator=g) * 0.8
    t_hidden, t_weight = torch.randn(n, h_t, generator=g), torch.randn(v, h_t, generator=g) * 0.8
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::3] = -100
    h, w = _leaf(hidden).to(DEVICE), _leaf(weight).to(DEVICE)
    h.retain_grad()
    w.retain_grad()
    loss = lmloss.linear_distillation_loss(
        h,
        w,
        t_hidden.to(DEVICE),
        t_weight.to(DEVICE),
        labels.to(DEVICE),
        beta=0.3,
        chunk_size=4,
        impl="triton",
    )
    loss.backward()
    hr, wr = _leaf(hidden, torch.float64), _leaf(weight, torch.float64)
    expected = _mean_over_valid(
        reference(hr @ wr.T, t_hidden.double() @ t_weight.double().T, 0.3, 1.0), labels
    )
    expected.backward()
    torch.testing.assert_close(loss.double().cpu(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.grad.double().cpu(), hr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double().cpu(), wr.grad, atol=1e-5, rtol=1e-5)


def test_triton_sparse_teacher_with_tail_matches_reference():
    student, teacher, labels = _problem(14, n=5)
    logprobs, ids = torch.log_softmax(teacher, -1).topk(3, dim=-1)
    x = _leaf(student, torch.float32).to(DEVICE)
    x.retain_grad()
    loss = lmloss.distillation_loss(
        x, None, labels.to(DEVICE), teacher_topk=(ids.to(DEVICE), logprobs.float().to(DEVICE)), impl="triton"
    )
    loss.backward()
    xr = _leaf(student)
    valid = labels != -100
    expected = sparse_reference(xr[valid], ids[valid], logprobs[valid], True).mean()
    expected.backward()
    torch.testing.assert_close(loss.double().cpu(), expected, **TOL)
    torch.testing.assert_close(x.grad.double().cpu(), xr.grad, **TOL)


AOT_SCRIPT = """
from lmloss.kernels import triton_distill as td

def ptx(fn, signature, constexprs, num_warps):
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
               if name.endswith(("_ptr", "_stride")) or name in ("valid", "n_cols")}
    src = ASTSource(fn, {**signature, **{k: "constexpr" for k in constexprs}}, constexprs, aligned)
    code = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
    return sorted(set(re.findall(r"(?:ld|st)[.]global[.]\\w+", code)))

rows = {"xs_ptr": "*bf16", "xs_stride": "i32", "xt_ptr": "*bf16", "xt_stride": "i32", "lse_ptr": "*fp32"}
beta = {"log1m_beta": "fp32", "log_beta": "fp32"}
fwd = {**rows, "out_ptr": "*fp32", "valid": "i32", "scale": "fp32", **beta}
bwd = {**rows, "coef_ptr": "*fp32", "out_ptr": "*bf16", "out_stride": "i32", "valid": "i32", "n_cols": "i32",
       "scale": "fp32", "one_minus_beta": "fp32", **beta}
json.dump({f"{kind}{mode}": ptx(kernel, sig, dict(MODE=mode, BLOCK_V=4096), 8)
           for kind, kernel, sig in (("forward", td._divergence_partials_kernel, fwd),
                                     ("backward", td._divergence_grad_kernel, bwd))
           for mode in (2,)}, sys.stdout)
"""


@pytest.mark.skipif(
    os.environ.get("LMLOSS_AOT_COMPILE_TEST") != "1",
    reason="about 25 s on the shared 2-core machine (a child process compiles for sm_90); "
    "LMLOSS_AOT_COMPILE_TEST=1 runs it",
)
def test_divergence_kernels_compile_for_h100_with_16_byte_memory_access(tmp_path):
    """Both kernels compile for sm_90 (in the JSD mode, which has every term of the other two), and stream
    the two bf16 chunks (and the gradient) with 128-bit accesses when the JIT sees aligned pointers."""
    access = compile_for_h100(AOT_SCRIPT, tmp_path)
    assert "ld.global.v4" in access["forward2"], access
    assert "ld.global.v4" in access["backward2"] and "st.global.v4" in access["backward2"], access
