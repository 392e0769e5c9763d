"""`once_differentiable` whose second differentiation always fails with a message naming lmloss."""

from __future__ import annotations

import functools

import torch

DOUBLE_BACKWARD_MESSAGE = (
    "lmloss ops are differentiable once: their backward is not itself differentiable, so a double backward "
    "(torch.autograd.grad(..., create_graph=True) followed by a backward through that gradient) is not "
    "supported"
)


def once_differentiable(backward):
    """Like `torch.autograd.function.once_differentiable`, but under ``create_graph=True`` the gradients
    always carry a node that raises `DOUBLE_BACKWARD_MESSAGE` when differentiated. PyTorch's version adds
    that node only when an upstream gradient requires grad, so ``grad(loss.sum(), x, create_graph=True)``
    returned gradients without a graph and the second backward failed far away with "element 0 of
    tensors does not require grad"."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        tensors = [o.detach().requires_grad_() if isinstance(o, torch.Tensor) else None for o in outputs]
        raising = torch._C._functions.DelayedError(DOUBLE_BACKWARD_MESSAGE.encode(), len(tensors))(*tensors)
        raising = raising if isinstance(raising, tuple) else (raising,)
        wrapped = tuple(r if isinstance(o, torch.Tensor) else o for r, o in zip(raising, outputs))
        return wrapped[0] if single else wrapped

    return wrapper
