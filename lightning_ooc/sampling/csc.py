"""In-memory CSC topology: :class:`CSCGraph`, built from a PyG ``edge_index``, and
:class:`HeteroCSCGraph`, one CSC per edge type of a PyG ``HeteroData``.

The samplers read any object with ``indptr`` (int64, ``N + 1``) and
``indices`` (int32 or int64, ``E``) in the in-edge CSC layout of the on-disk
format: the sources of the edges into ``v`` are
``indices[indptr[v]:indptr[v + 1]]``. An :class:`~lightning_ooc.OnDiskDataset`
is one (``indices`` memory-mapped); :class:`CSCGraph` is the in-memory one,
built with torch ops from a PyG ``edge_index``. In a heterogeneous graph each
edge type ``(src, rel, dst)`` has such a CSC over per-type ids: ``N`` is the
number of ``dst`` nodes and ``indices`` holds ids of ``src`` nodes.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

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
        node_time: Any = None,
        edge_time: Any = None,
        neighbor_order: str = "source_id",
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
        #: int64 time of each node (PyG's ``time``), or None
        self.node_time = None if node_time is None else _as_numpy(node_time, "node_time").astype(np.int64, copy=False)
        #: int64 time of each edge, by CSC position, or None
        self.edge_time = None if edge_time is None else _as_numpy(edge_time, "edge_time").astype(np.int64, copy=False)
        if self.edge_time is not None and self.edge_time.shape != (self.num_edges,):
            raise InputError(f"edge_time must have shape ({self.num_edges},), got {tuple(self.edge_time.shape)}")
        #: how each node's in-edges are ordered: "source_id", "node_time" or "edge_time" (temporal sampling)
        self.neighbor_order = neighbor_order

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
        num_src_nodes: int | None = None,
        node_time: Any = None,
        edge_time: Any = None,
    ) -> "CSCGraph":
        """Build the in-edge CSC of a PyG ``edge_index`` (row 0 sources, row 1 targets).

        Sources are sorted per target; repeated edges are kept. ``dtype`` is
        that of ``indices`` (default: int32 below 2^31 nodes, as on disk).
        ``num_src_nodes`` is for a bipartite edge type (sources and targets
        of different node types): sources are then ids in
        ``[0, num_src_nodes)`` and targets in ``[0, num_nodes)``; by default
        both are ids of the same ``num_nodes`` nodes.

        For temporal sampling give ``edge_time`` (one per column of
        ``edge_index``) or ``node_time`` (one per source node): each target's
        in-edges are then sorted by that time instead (ties in the order of
        ``edge_index``, as PyG sorts them), and ``edge_time`` is kept in CSC
        order.
        """
        edge_index = torch.as_tensor(edge_index)
        if edge_index.dim() != 2 or edge_index.size(0) != 2:
            raise InputError(f"edge_index must have shape (2, E), got {tuple(edge_index.shape)}")
        if edge_index.dtype.is_floating_point or edge_index.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise InputError(f"edge_index must hold integers, got {edge_index.dtype}")
        edge_index = edge_index.to(device="cpu", dtype=torch.long)
        src, dst = edge_index[0], edge_index[1]
        if num_nodes is None:
            ids = edge_index if num_src_nodes is None else dst
            num_nodes = int(ids.max()) + 1 if ids.numel() else 0
        n = int(num_nodes)
        if n < 1:
            raise InputError(f"a graph needs at least one node, got num_nodes={n}")
        if num_src_nodes is None:
            ns = n
            if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= n):
                raise InputError(
                    f"edge_index holds node ids {int(edge_index.min())}..{int(edge_index.max())}, "
                    f"outside [0, num_nodes={n})"
                )
        else:
            ns = int(num_src_nodes)
            if ns < 0:
                raise InputError(f"num_src_nodes must be >= 0, got {ns}")
            for row, ids, count, name in ((0, src, ns, "num_src_nodes"), (1, dst, n, "num_nodes")):
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= count):
                    raise InputError(f"edge_index[{row}] holds node ids {int(ids.min())}..{int(ids.max())}, "
                                     f"outside [0, {name}={count})")  # fmt: skip
        if node_time is not None and edge_time is not None:
            raise InputError("give node_time or edge_time, not both: the in-edges are sorted by one of them")
        order = "source_id"
        if edge_time is not None or node_time is not None:
            order = "edge_time" if edge_time is not None else "node_time"
            t = torch.as_tensor(edge_time if edge_time is not None else node_time).reshape(-1)
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise InputError(f"{order} must hold integers, got {t.dtype}")
            t = t.to(torch.long)
            want = src.numel() if edge_time is not None else ns
            if t.numel() != want:
                raise InputError(f"{order} holds {t.numel()} entries, expected {want}")
            key = t if edge_time is not None else t[src]
            perm = torch.sort(key, stable=True).indices
            perm = perm[torch.sort(dst[perm], stable=True).indices]
        elif max(n, ns) < 3_000_000_000:  # n * ns fits in int64: one sort on (dst, src)
            perm = torch.sort(dst * max(ns, 1) + src, stable=True).indices
        else:  # pragma: no cover - needs billions of nodes
            perm = torch.sort(src, stable=True).indices
            perm = perm[torch.sort(dst[perm], stable=True).indices]
        if dtype is None:
            dtype = torch.int32 if index_dtype(ns) == np.int32 else torch.int64  # indices hold source ids
        indices = src[perm].to(dtype)
        indptr = torch.zeros(n + 1, dtype=torch.long)
        torch.cumsum(torch.bincount(dst, minlength=n), 0, out=indptr[1:])
        return cls(indptr, indices, labels=labels, perm=perm, neighbor_order=order,
                   node_time=None if node_time is None else torch.as_tensor(node_time).reshape(-1).long(),
                   edge_time=None if edge_time is None else key[perm])  # fmt: skip

    @classmethod
    def from_data(cls, data: Any, **kwargs: Any) -> "CSCGraph":
        """The CSC of a homogeneous PyG ``Data`` (its ``edge_index`` and ``num_nodes``)."""
        if getattr(data, "edge_index", None) is None:
            raise InputError("the Data object has no edge_index; the sampler needs one (adj_t is not supported)")
        return cls.from_edge_index(data.edge_index, data.num_nodes, **kwargs)

    def __repr__(self) -> str:
        return f"CSCGraph(num_nodes={self.num_nodes}, num_edges={self.num_edges}, index_dtype={self.indices.dtype})"


EdgeType = tuple[str, str, str]


class HeteroCSCGraph:
    """One in-edge CSC per edge type of a heterogeneous graph, held in memory, as
    :class:`~lightning_ooc.sampling.HeteroNeighborSampler` reads it.

    Each node type has its own ids ``0 .. num_nodes_dict[t] - 1``. The CSC of
    an edge type ``(src, rel, dst)`` is a :class:`CSCGraph` over ``dst``
    nodes whose ``indices`` hold ``src`` ids; its ``perm`` maps CSC positions
    back to columns of that edge type's ``edge_index`` (PyG's
    ``edge_permutation``).

    Args:
        num_nodes_dict: node type -> number of nodes; its order is the order
            of :attr:`node_types`.
        csc: edge type -> :class:`CSCGraph` (or anything with ``indptr`` and
            ``indices``); its order is the order of :attr:`edge_types`, the
            order the sampler visits the edge types in.
        labels: node type -> int64 labels (one per node) of the node types
            that have them.
        node_time: node type -> int64 time of each node, for the node types
            that have one (temporal sampling by ``time_attr="time"``).

    Example::

        >>> import torch
        >>> from torch_geometric.data import HeteroData
        >>> from lightning_ooc.sampling import HeteroCSCGraph
        >>> data = HeteroData()
        >>> data['paper'].num_nodes = 2
        >>> data['author'].num_nodes = 3
        >>> data['paper'].y = torch.tensor([1, 0])
        >>> data['author', 'writes', 'paper'].edge_index = torch.tensor([[2, 0, 1], [0, 0, 1]])
        >>> g = HeteroCSCGraph.from_hetero_data(data)
        >>> g.node_types, g.edge_types, g.num_nodes_dict
        (['paper', 'author'], [('author', 'writes', 'paper')], {'paper': 2, 'author': 3})
        >>> csc = g.csc['author', 'writes', 'paper']  # author 2 -> paper 1 although there are 2 papers
        >>> csc.indptr.tolist(), csc.indices.tolist(), csc.perm.tolist()
        ([0, 2, 3], [0, 2, 1], [1, 0, 2])
        >>> {t: y.tolist() for t, y in g.labels.items()}
        {'paper': [1, 0]}
    """

    def __init__(
        self,
        num_nodes_dict: Mapping[str, int],
        csc: Mapping[EdgeType, Any],
        *,
        labels: Mapping[str, Any] | None = None,
        node_time: Mapping[str, Any] | None = None,
    ):
        self.num_nodes_dict: dict[str, int] = {}
        for t, n in num_nodes_dict.items():
            if not isinstance(t, str):
                raise InputError(f"node types must be strings, got {t!r}")
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise InputError(f"node type '{t}' has {n!r} nodes; give a count >= 0")
            self.num_nodes_dict[t] = int(n)
        self.csc: dict[EdgeType, CSCGraph] = {}
        for et, g in csc.items():
            et = check_edge_type(et, self.num_nodes_dict)
            if not isinstance(g, CSCGraph):
                g = CSCGraph(g.indptr, g.indices, perm=getattr(g, "perm", None),
                             edge_time=getattr(g, "edge_time", None),
                             neighbor_order=getattr(g, "neighbor_order", None) or "source_id")  # fmt: skip
            if g.num_nodes != self.num_nodes_dict[et[2]]:
                raise InputError(f"the CSC of edge type {et} has {g.num_nodes} targets, but node type '{et[2]}' has "
                                 f"{self.num_nodes_dict[et[2]]} nodes")  # fmt: skip
            self.csc[et] = g
        self.labels: dict[str, np.ndarray] = self._per_type(labels, "labels")
        self.node_time: dict[str, np.ndarray] = self._per_type(node_time, "node_time")

    def _per_type(self, values: Mapping[str, Any] | None, what: str) -> dict[str, np.ndarray]:
        """``values`` (node type -> one integer per node), checked, as int64 arrays."""
        out: dict[str, np.ndarray] = {}
        for t, v in (values or {}).items():
            if t not in self.num_nodes_dict:
                raise InputError(f"{what} given for node type '{t}', which is not one of {self.node_types}")
            v = _as_numpy(v, f"{what} of '{t}'")
            if v.shape != (self.num_nodes_dict[t],) or v.dtype.kind not in "iu":
                raise InputError(f"{what} of node type '{t}' must be {self.num_nodes_dict[t]} integers (one per "
                                 f"node), got {v.dtype}{list(v.shape)}")  # fmt: skip
            out[t] = v.astype(np.int64, copy=False)
        return out

    @property
    def node_types(self) -> list[str]:
        return list(self.num_nodes_dict)

    @property
    def edge_types(self) -> list[EdgeType]:
        return list(self.csc)

    @property
    def perm(self) -> dict[EdgeType, torch.Tensor | None]:
        """Edge type -> CSC position to column of its ``edge_index`` (PyG's ``edge_permutation``)."""
        return {et: g.perm for et, g in self.csc.items()}

    @classmethod
    def from_hetero_data(cls, data: Any, *, labels: bool = True, dtype: torch.dtype | None = None,
                         time_attr: str | None = None) -> "HeteroCSCGraph":  # fmt: skip
        """The CSCs of a PyG ``HeteroData``: every edge type's ``edge_index``, every node type's ``num_nodes``.

        With ``labels``, the ``y`` of each node type that has one becomes its
        labels (it must hold one integer per node). ``dtype`` is that of
        every ``indices`` (default: int32 below 2^31 source nodes).
        ``time_attr`` names a time attribute for temporal sampling, as PyG's
        ``NeighborLoader`` takes it: a node attribute (``data[t].time``)
        sorts each edge type's in-edges by their sources' times, an edge
        attribute by the edges' own (kept as each CSC's ``edge_time``).
        """
        num_nodes: dict[str, int] = {}
        for t in data.node_types:
            with warnings.catch_warnings():  # PyG warns before it gives up inferring a count; we raise instead
                warnings.simplefilter("ignore", UserWarning)
                n = data[t].num_nodes
            if n is None:
                raise InputError(f"node type '{t}' has no num_nodes (set data['{t}'].num_nodes or give it x)")
            num_nodes[t] = int(n)
        node_time = {}
        if time_attr is not None:
            node_time = {t: data[t][time_attr] for t in data.node_types if time_attr in data[t]}
            edge_level = any(time_attr in data[et] for et in data.edge_types)
            if node_time and edge_level:
                raise InputError(f"time attribute {time_attr!r} is both a node and an edge attribute")
            if not node_time and not edge_level:
                raise InputError(f"time attribute {time_attr!r} is neither a node nor an edge attribute")
        csc: dict[EdgeType, CSCGraph] = {}
        for et in data.edge_types:
            src, _, dst = check_edge_type(et, num_nodes)
            edge_index = getattr(data[et], "edge_index", None)
            if edge_index is None:
                raise InputError(f"edge type {et} has no edge_index; the sampler needs one (adj_t is not supported)")
            times = {}
            if src in node_time:
                times["node_time"] = node_time[src]
            elif time_attr is not None and time_attr in data[et]:
                times["edge_time"] = data[et][time_attr]
            try:
                csc[et] = CSCGraph.from_edge_index(edge_index, num_nodes[dst], dtype=dtype,
                                                   num_src_nodes=num_nodes[src], **times)  # fmt: skip
            except InputError as e:
                raise InputError(f"edge type {et}: {e}") from None
        y = {}
        if labels:
            y = {t: data[t].y for t in data.node_types if getattr(data[t], "y", None) is not None}
        return cls(num_nodes, csc, labels=y, node_time=node_time)

    def __repr__(self) -> str:
        return (f"HeteroCSCGraph(num_nodes_dict={self.num_nodes_dict}, "
                f"num_edges={ {et: g.num_edges for et, g in self.csc.items()} })")  # fmt: skip


def check_edge_type(edge_type: Any, num_nodes_dict: Mapping[str, int] | Sequence[str]) -> EdgeType:
    """``edge_type`` as a ``(src, rel, dst)`` tuple of strings whose node types are known."""
    three_strings = isinstance(edge_type, (tuple, list)) and len(edge_type) == 3
    if not three_strings or not all(isinstance(p, str) for p in edge_type):
        raise InputError(f"an edge type is a (src, rel, dst) tuple of strings, got {edge_type!r}")
    et = (edge_type[0], edge_type[1], edge_type[2])
    for t in (et[0], et[2]):
        if t not in num_nodes_dict:
            raise InputError(f"edge type {et} names node type '{t}', which the graph does not have "
                             f"(node types: {list(num_nodes_dict)})")  # fmt: skip
    return et

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
