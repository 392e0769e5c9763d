"""The PyTorch kernels' folded full KL (`lmloss.kernels.torch_distill`) when its partials take the difference first
(``softmax_partials(..., overwrite=True, difference_into=z)``, the contract's hint): the same bits as the partials
on an intact chunk, and a refusal where what the gradient needs is gone."""

from __future__ import annotations

import pytest
import torch

from lmloss.kernels import ChunkMath, make_kernels

ROWS, COLS, VALID = 6, 300, 290  # the last 10 columns padding


def _chunks(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, COLS, generator=g) * 3
    z = x + 0.2 * torch.randn(ROWS, COLS, generator=g)
    labels = torch.randint(0, VALID, (ROWS,), generator=g)
    return x, z, labels


def _folded(x, z, labels, math, entropy, in_place):
    """partials -> the policy's lse (one process) -> the folded gradient, as the RL objective makes them."""
    kernels = make_kernels("torch", ROWS, COLS, x.device)
    flags = dict(entropy=entropy, target=True, sum_logits=False)
    hint = dict(overwrite=True, difference_into=z) if in_place else {}
    part = kernels.softmax_partials(x, labels, math, **flags, **hint)
    lse = part[:, 0] + part[:, 1].log()
    coef = torch.tensor([[-0.5, 1.0, 0.0, 0.25 if entropy else 0.0]]).expand(ROWS, 4).contiguous()
    ent = (lse - part[:, 2] / part[:, 1] - part[:, 0]) if entropy else None

    def finish(sums):
        return coef, torch.full_like(sums, 0.1), ent

    sums = kernels.softmax_grad_with_difference_(x, labels, z, lse, math, finish, x, uniform_term=False)
    return part, sums, x


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("scale", [1.0, 1 / 0.7])
def test_partials_that_take_the_difference_first_give_the_same_bits(entropy, scale):
    math = ChunkMath(vocab_start=0, valid=VALID, scale=scale)
    x, z, labels = _chunks(1)
    intact = _folded(x.clone(), z.clone(), labels, math, entropy, in_place=False)
    first = _folded(x.clone(), z.clone(), labels, math, entropy, in_place=True)
    for a, b in zip(intact, first):
        assert torch.equal(a, b)
    # against float64: sum p (x - z) over the valid columns
    p = (x[:, :VALID].double() * scale).softmax(-1)
    torch.testing.assert_close(first[1].double(), (p * (x - z)[:, :VALID].double()).sum(-1), rtol=1e-5, atol=1e-6)


def test_a_gradient_whose_exps_were_overwritten_after_partials_that_worked_in_x_is_refused():
    math = ChunkMath(vocab_start=0, valid=VALID, scale=1.0)
    x, z, labels = _chunks(2)
    kernels = make_kernels("torch", ROWS, COLS, x.device)
    part = kernels.softmax_partials(x, labels, math, entropy=True, target=True, sum_logits=False, overwrite=True,
                                    difference_into=z)  # fmt: skip
    kernels.scratch.get("exps", ROWS, VALID, torch.float32)  # another use of the scratch: the exps are gone
    lse = part[:, 0] + part[:, 1].log()
    with pytest.raises(RuntimeError, match="exps its partials left"):
        kernels.softmax_grad_with_difference_(x, labels, z, lse, math, lambda s: (None, None, None), x)


@pytest.mark.parametrize("case", ["softcap", "bf16 reference"])
def test_a_difference_the_partials_cannot_take_leaves_both_chunks_as_they_were(case):
    """Where the difference cannot be taken first (a softcap: the gradient's dy/dx is not the scale; a reference
    chunk in another dtype), the partials neither write it nor work in x, so the gradient can take it itself."""
    x, z, labels = _chunks(3)
    math = ChunkMath(vocab_start=0, valid=VALID, scale=1.0, softcap=30.0 if case == "softcap" else 0.0)
    if case == "bf16 reference":
        z = z.bfloat16()
    x_before, z_before = x.clone(), z.clone()
    kernels = make_kernels("torch", ROWS, COLS, x.device)
    kernels.softmax_partials(x, labels, math, entropy=True, target=True, sum_logits=False, overwrite=True,
                             difference_into=z)  # fmt: skip
    assert torch.equal(x, x_before) and torch.equal(z, z_before)
