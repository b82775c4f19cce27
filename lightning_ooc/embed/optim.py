"""Sparse Adagrad for embedding rows held in a partition buffer.

Node embeddings trained out of core are not ``nn.Parameter``\\ s: their rows
and Adagrad state (the running sum of squared gradients) live in the
partition buffer's tensors, and a step updates only the rows a batch used.
:func:`sparse_adagrad_` does that step in place. It is the step that
``torch.optim.Adagrad`` (``initial_accumulator_value=0``, ``lr_decay=0``,
``weight_decay=0``) takes on a dense parameter whose gradient is zero outside
``rows`` (a zero gradient leaves a row and its state unchanged), with the same
arithmetic in the same order, so on CPU the two agree bit for bit.

Example::

    >>> import torch
    >>> from lightning_ooc.embed.optim import sparse_adagrad_
    >>> buf = torch.zeros(4, 4)                       # one tensor holding rows and state side by side
    >>> weight, state = buf[:, :2], buf[:, 2:]         # strided views, updated in place
    >>> weight.fill_(1.0)
    tensor([[1., 1.],
            [1., 1.],
            [1., 1.],
            [1., 1.]])
    >>> rows, grad = torch.tensor([2, 0, 2]), torch.tensor([[1.0, 2.0], [3.0, 4.0], [1.0, 2.0]])
    >>> sparse_adagrad_(weight, state, rows, grad, lr=0.5)
    >>> buf                                            # row 2's gradients were summed to (2, 4) first
    tensor([[ 0.5000,  0.5000,  9.0000, 16.0000],
            [ 1.0000,  1.0000,  0.0000,  0.0000],
            [ 0.5000,  0.5000,  4.0000, 16.0000],
            [ 1.0000,  1.0000,  0.0000,  0.0000]])
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sparse_adagrad_"]


@torch.no_grad()
def sparse_adagrad_(weight: Tensor, state: Tensor, rows: Tensor, grad: Tensor, lr: float, eps: float = 1e-10) -> None:
    """One Adagrad step on ``weight[rows]`` in place, ``state`` holding the sum of squared gradients.

    Args:
        weight: ``[R, dim]`` embedding rows (any strides: a view such as ``buf[:, :dim]`` is updated in place).
        state: ``[R, dim]`` Adagrad state of the same rows, updated in place.
        rows: row indices (any shape, ``N`` in all); they may repeat.
        grad: the gradient of each entry of ``rows``, ``[N, dim]`` (or ``rows.shape + (dim,)``).
        lr: learning rate.
        eps: added to the square root of the state.

    The gradients of a repeated row are summed first (in the order they come, so the result is
    deterministic on CPU), then for every distinct row ``u`` with summed gradient ``g``:
    ``state[u] += g * g`` and ``weight[u] -= lr * g / (sqrt(state[u]) + eps)``.
    On CUDA the summation uses ``index_add_`` (atomic adds), which is not bitwise deterministic
    unless ``torch.use_deterministic_algorithms(True)`` is set.
    """
    if weight.shape != state.shape or weight.dim() != 2:
        raise ValueError(f"weight and state must both be [R, dim], got {tuple(weight.shape)} and {tuple(state.shape)}")
    rows = rows.reshape(-1)
    n, dim = rows.numel(), weight.shape[1]
    if grad.numel() != n * dim:
        raise ValueError(f"grad must hold a [{dim}] gradient per row: {n} rows, grad of shape {tuple(grad.shape)}")
    if n == 0:
        return
    grad = grad.reshape(n, dim).to(state.dtype)
    rows = rows.to(device=weight.device, dtype=torch.long)
    unique, inverse = torch.unique(rows, return_inverse=True)
    g = torch.zeros(unique.numel(), dim, dtype=grad.dtype, device=grad.device).index_add_(0, inverse, grad)
    s = state.index_select(0, unique)
    s.addcmul_(g, g, value=1)
    std = s.sqrt().add_(eps)
    w = weight.index_select(0, unique)
    w.addcdiv_(g.to(w.dtype), std.to(w.dtype), value=-lr)
    state.index_copy_(0, unique, s)
    weight.index_copy_(0, unique, w)
