"""In-memory CSC topology: :class:`CSCGraph`, built from a PyG ``edge_index``.

The samplers read any object with ``indptr`` (int64, ``N + 1``) and
``indices`` (int32 or int64, ``E``) in the in-edge CSC layout of the on-disk
format: the sources of the edges into ``v`` are
``indices[indptr[v]:indptr[v + 1]]``. An :class:`~lightning_ooc.OnDiskDataset`
is one (``indices`` memory-mapped); :class:`CSCGraph` is the in-memory one,
built with torch ops from a PyG ``edge_index``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lightning_ooc.data.format import index_dtype
from lightning_ooc.errors import InputError


class CSCGraph:
    """An in-edge CSC held in memory, as the samplers read it.

    ``perm[i]`` is the column of the original ``edge_index`` that became CSC
    position ``i`` (PyG's ``edge_permutation``), so sampled edge ids can be
    mapped back to edge attributes.

    Example::

        >>> import torch
        >>> from lightning_ooc.sampling import CSCGraph
        >>> g = CSCGraph.from_edge_index(torch.tensor([[1, 2, 0, 2], [0, 0, 1, 1]]), num_nodes=3)
        >>> g.indptr.tolist(), g.indices.tolist(), g.perm.tolist()
        ([0, 2, 4, 4], [1, 2, 0, 2], [0, 1, 2, 3])
        >>> CSCGraph.from_edge_index(torch.tensor([[2, 0], [0, 0]])).indices.tolist()  # sorted per target
        [0, 2]
    """

    def __init__(
        self,
        indptr: Any,
        indices: Any,
        *,
        labels: Any = None,
        perm: torch.Tensor | None = None,
    ):
        self.indptr = _as_numpy(indptr, "indptr")
        self.indices = _as_numpy(indices, "indices")
        if self.indptr.dtype != np.int64 or self.indptr.ndim != 1 or self.indptr.size < 1:
            raise InputError(f"indptr must be a 1-D int64 array of num_nodes + 1 entries, got {self.indptr.dtype}"
                             f"{list(self.indptr.shape)}")  # fmt: skip
        if self.indices.dtype not in (np.int32, np.int64) or self.indices.ndim != 1:
            raise InputError(f"indices must be a 1-D int32 or int64 array, got {self.indices.dtype}"
                             f"{list(self.indices.shape)}")  # fmt: skip
        if self.indptr[0] != 0 or self.indptr[-1] != self.indices.size:
            raise InputError(
                f"indptr must start at 0 and end at len(indices)={self.indices.size}, "
                f"got {int(self.indptr[0])}..{int(self.indptr[-1])}"
            )
        self.labels = None if labels is None else _as_numpy(labels, "labels").astype(np.int64, copy=False)
        if self.labels is not None and self.labels.shape != (self.num_nodes,):
            raise InputError(f"labels must have shape ({self.num_nodes},), got {tuple(self.labels.shape)}")
        self.perm = perm

    @property
    def num_nodes(self) -> int:
        return int(self.indptr.size - 1)

    @property
    def num_edges(self) -> int:
        return int(self.indices.size)

    @classmethod
    def from_edge_index(
        cls,
        edge_index: torch.Tensor,
        num_nodes: int | None = None,
        *,
        labels: Any = None,
        dtype: torch.dtype | None = None,
    ) -> "CSCGraph":
        """Build the in-edge CSC of a PyG ``edge_index`` (row 0 sources, row 1 targets).

        Sources are sorted per target; repeated edges are kept. ``dtype`` is
        that of ``indices`` (default: int32 below 2^31 nodes, as on disk).
        """
        edge_index = torch.as_tensor(edge_index)
        if edge_index.dim() != 2 or edge_index.size(0) != 2:
            raise InputError(f"edge_index must have shape (2, E), got {tuple(edge_index.shape)}")
        if edge_index.dtype.is_floating_point or edge_index.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise InputError(f"edge_index must hold integers, got {edge_index.dtype}")
        edge_index = edge_index.to(device="cpu", dtype=torch.long)
        src, dst = edge_index[0], edge_index[1]
        if num_nodes is None:
            num_nodes = int(edge_index.max()) + 1 if edge_index.numel() else 0
        n = int(num_nodes)
        if n < 1:
            raise InputError(f"a graph needs at least one node, got num_nodes={n}")
        if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= n):
            raise InputError(
                f"edge_index holds node ids {int(edge_index.min())}..{int(edge_index.max())}, "
                f"outside [0, num_nodes={n})"
            )
        if n < 3_000_000_000:  # n * n fits in int64: one sort on (dst, src)
            perm = torch.sort(dst * n + src, stable=True).indices
        else:  # pragma: no cover - needs billions of nodes
            perm = torch.sort(src, stable=True).indices
            perm = perm[torch.sort(dst[perm], stable=True).indices]
        if dtype is None:
            dtype = torch.int32 if index_dtype(n) == np.int32 else torch.int64
        indices = src[perm].to(dtype)
        indptr = torch.zeros(n + 1, dtype=torch.long)
        torch.cumsum(torch.bincount(dst, minlength=n), 0, out=indptr[1:])
        return cls(indptr, indices, labels=labels, perm=perm)

    @classmethod
    def from_data(cls, data: Any, **kwargs: Any) -> "CSCGraph":
        """The CSC of a homogeneous PyG ``Data`` (its ``edge_index`` and ``num_nodes``)."""
        if getattr(data, "edge_index", None) is None:
            raise InputError("the Data object has no edge_index; the sampler needs one (adj_t is not supported)")
        return cls.from_edge_index(data.edge_index, data.num_nodes, **kwargs)

    def __repr__(self) -> str:
        return f"CSCGraph(num_nodes={self.num_nodes}, num_edges={self.num_edges}, index_dtype={self.indices.dtype})"


def _as_numpy(a: Any, name: str) -> np.ndarray:
    """A C-contiguous NumPy view of ``a`` (no copy for contiguous tensors, arrays and memmaps)."""
    if isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            raise InputError(f"{name} must live in host memory, got a tensor on {a.device}")
        a = a.detach().contiguous().numpy()
    a = np.asarray(a)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a
