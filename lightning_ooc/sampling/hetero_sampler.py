"""Heterogeneous neighbour sampling: :class:`HeteroNeighborSampler`.

The work is done by the native module ``lightning_ooc._sampler``
(``sample_hetero``, see ``ext/sampler/hetero.cpp``), which shares its node
map, edge choice and random stream with the homogeneous
:class:`~lightning_ooc.sampling.NeighborSampler`: it reads each edge type's
``indptr`` from memory and its ``indices`` through whatever array holds them
(a memory map included), releases the GIL while it samples, and keeps all its
state per call, so one sampler may be used from several threads at once.

The sampling is PyG's for a ``HeteroData`` (pyg-lib's and torch-sparse's
``hetero_neighbor_sample``, not disjoint, not temporal):

* every node type has its own list of sampled nodes (``n_id``); the seeds,
  all of the input type, come first (a repeated seed keeps its first place);
* at hop ``h`` the frontier of every node type is fixed first: the nodes that
  type gained at hop ``h - 1`` (the seeds at hop 0);
* then, edge type by edge type in the graph's order, every frontier node of
  the edge type's destination type gets ``num_neighbors[edge_type][h]`` of its
  in-edges of that type (all of them for ``-1``, none for ``0``), uniformly
  with or without replacement; each source joins its own node type's list
  when it is new there, in order of first appearance;
* nodes gained during hop ``h`` are sampled from at hop ``h + 1`` only.

Edges of an edge type come out in local ids (row 0 the source, of the source
type; row 1 the target, of the destination type), grouped by hop, then by
target.

pyg-lib visits the edge types in the graph's order, as here; torch-sparse
visits them sorted by their ``'src__rel__dst'`` names, so with it the same
nodes and edges come out numbered in another order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
from torch_geometric.data import HeteroData

from lightning_ooc.errors import CorruptDatasetError, InputError
from lightning_ooc.sampling.csc import EdgeType, _as_numpy, check_edge_type
from lightning_ooc.sampling.neighbor import (
    _IMPORT_ERROR,
    _sampler,
    _tensor,
    as_seeds,
    check_num_neighbors,
    draw_seed,
)
from lightning_ooc.sampling.temporal import check_temporal, seed_times, temporal_arrays


@dataclass
class HeteroSampledSubgraph:
    """The raw result of sampling one heterogeneous minibatch (what the ``HeteroData`` is built from).

    Every node type and edge type of the graph has an entry, empty where
    nothing was sampled.

    Attributes:
        n_id: node type -> global (per-type) ids of its sampled nodes, int64;
            for the input type the seeds first; then each hop's new nodes in
            order of first appearance.
        edge_index: edge type -> ``(2, E)`` int64 local ids; row 0 indexes
            ``n_id`` of the source type, row 1 ``n_id`` of the destination
            type. Edges are grouped by hop, then by target.
        num_sampled_nodes: node type -> nodes added per hop,
            ``[seeds, hop 1, ...]`` (``0`` seeds but for the input type).
        num_sampled_edges: edge type -> edges sampled per hop.
        input_type: the node type of the seeds.
        e_id: edge type -> position of each edge in that edge type's
            ``indices`` (its CSC edge id), or None.
        y: node type -> ``labels[n_id]`` for the node types with labels, or None.
        batch: node type -> the position of each node's seed (disjoint and
            temporal sampling), or None.
        seed_time: the time of each seed (temporal sampling), or None.
    """

    n_id: dict[str, torch.Tensor]
    edge_index: dict[EdgeType, torch.Tensor]
    num_sampled_nodes: dict[str, list[int]]
    num_sampled_edges: dict[EdgeType, list[int]]
    input_type: str
    e_id: dict[EdgeType, torch.Tensor] | None = None
    y: dict[str, torch.Tensor] | None = None
    batch: dict[str, torch.Tensor] | None = None
    seed_time: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.num_sampled_nodes[self.input_type][0]


def _edge_type_key(key: Any, edge_types: list[EdgeType]) -> EdgeType:
    """A ``num_neighbors`` key as an edge type tuple: ``(src, rel, dst)``, ``(src, dst)`` or ``'src__rel__dst'``."""
    from torch_geometric.typing import EdgeTypeStr  # lazy: PyG only where it is used

    try:
        return tuple(EdgeTypeStr(key).to_tuple())  # type: ignore[return-value]
    except (ValueError, TypeError, IndexError):
        raise InputError(f"num_neighbors: {key!r} is not an edge type; use (src, rel, dst) tuples, one of "
                         f"{edge_types}") from None  # fmt: skip


def check_hetero_num_neighbors(num_neighbors: Any, edge_types: list[EdgeType]) -> tuple[dict[EdgeType, list[int]], int]:
    """Validate heterogeneous fanouts as PyG's ``NumNeighbors`` takes them; returns (per edge type, number of hops).

    ``num_neighbors`` is one list (one fanout per hop, ``-1`` for all
    neighbours) used for every edge type; a dict edge type -> list (keys as
    ``(src, rel, dst)`` tuples, ``(src, dst)`` pairs or ``'src__rel__dst'``
    strings) naming every edge type of the graph and no other; or a PyG
    ``NumNeighbors`` (whose ``default`` stands in for the edge types its dict
    leaves out). Every edge type must get the same number of hops.
    """
    from torch_geometric.sampler.base import NumNeighbors  # lazy: PyG only where it is used

    values, default = num_neighbors, None
    if isinstance(num_neighbors, NumNeighbors):
        values, default = num_neighbors.values, num_neighbors.default
    if not isinstance(values, Mapping):
        if default is not None:
            raise InputError("num_neighbors: a default is only for a dict of fanouts per edge type")
        fanouts = check_num_neighbors(values)
        return {et: list(fanouts) for et in edge_types}, len(fanouts)

    given: dict[EdgeType, list[int]] = {}
    for key, fanouts in values.items():
        et = _edge_type_key(key, edge_types)
        if et in given:
            raise InputError(f"num_neighbors gives edge type {et} twice")
        try:
            given[et] = check_num_neighbors(fanouts)
        except InputError as e:
            raise InputError(f"edge type {et}: {e}") from None
    unknown = [et for et in given if et not in edge_types]
    if unknown:
        raise InputError(f"num_neighbors names edge types the graph does not have: {unknown}; its edge types are "
                         f"{edge_types}")  # fmt: skip
    if default is not None:
        try:
            default = check_num_neighbors(default)
        except InputError as e:
            raise InputError(f"the default of num_neighbors: {e}") from None
    missing = [et for et in edge_types if et not in given]
    if missing and default is None:
        raise InputError(f"num_neighbors has no fanouts for edge types {missing}; give one list per edge type of "
                         "the graph, or a single list for all of them")  # fmt: skip
    out = {et: list(given.get(et, default)) for et in edge_types}  # type: ignore[arg-type]
    hops = {et: len(f) for et, f in out.items()}
    lengths = set(hops.values()) | ({len(default)} if default is not None else set())
    if len(lengths) > 1:
        extra = f" and a default of {len(default)}" if default is not None else ""
        raise InputError(f"num_neighbors: every edge type needs the same number of hops, got {hops}{extra}")
    return out, next(iter(lengths), 0)


class HeteroNeighborSampler:
    """Uniform node-wise neighbour sampling over a heterogeneous graph, as PyG's ``NeighborLoader`` on ``HeteroData``.

    Minibatches are ``HeteroData`` objects shaped as ``NeighborLoader`` makes
    them: every node type and edge type of the graph present (empty where
    nothing was sampled), ``n_id`` per node type, ``edge_index`` per edge type
    in local ids, ``num_sampled_nodes`` / ``num_sampled_edges`` per type,
    ``input_id`` and ``batch_size`` on the input type, ``y`` for the node
    types with labels, and ``e_id`` per edge type when asked for. ``x`` is
    left to the caller (``batch[t].x = features[t][batch[t].n_id]``). See
    :mod:`lightning_ooc.sampling.hetero_sampler` for the sampling itself.

    Args:
        graph: a :class:`~lightning_ooc.sampling.HeteroCSCGraph`, or anything
            with ``node_types`` (list of str), ``edge_types`` (list of
            ``(src, rel, dst)``), ``num_nodes_dict`` (node type -> count),
            ``csc`` (edge type -> object with ``indptr`` and ``indices``, the
            in-edge CSC over per-type ids) and optionally ``labels`` (node
            type -> int64 array).
        num_neighbors: fanout per hop, ``-1`` for all neighbours: one list for
            every edge type, or a dict edge type -> list naming every edge
            type (or a PyG ``NumNeighbors``); see
            :func:`check_hetero_num_neighbors`.
        replace: sample with replacement (then a node with any in-edge of a
            type gets exactly ``fanout`` of them, repeats possible).
        return_e_id: add ``e_id`` per edge type, the position of each sampled
            edge in that edge type's CSC (:attr:`HeteroCSCGraph.perm
            <lightning_ooc.sampling.HeteroCSCGraph.perm>` maps it to a column
            of the original ``edge_index``).

    The same ``seed`` gives the same minibatch on any thread; ``seed=None``
    draws one from torch's default generator. :meth:`sample` may be called
    from several threads at once: it holds the GIL only to set up and wrap
    the result.

    Example::

        >>> import torch
        >>> from torch_geometric.data import HeteroData
        >>> from lightning_ooc.sampling import HeteroCSCGraph, HeteroNeighborSampler
        >>> data = HeteroData()
        >>> data['paper'].num_nodes, data['author'].num_nodes = 3, 2
        >>> data['paper', 'cites', 'paper'].edge_index = torch.tensor([[1, 2, 2], [0, 0, 1]])
        >>> data['author', 'writes', 'paper'].edge_index = torch.tensor([[0, 1], [0, 2]])
        >>> data['paper', 'rev_writes', 'author'].edge_index = torch.tensor([[0, 2], [0, 1]])
        >>> sampler = HeteroNeighborSampler(HeteroCSCGraph.from_hetero_data(data), [-1, -1])
        >>> batch = sampler.sample(torch.tensor([0]), 'paper', seed=0)
        >>> batch['paper'].n_id.tolist(), batch['author'].n_id.tolist(), batch['paper'].batch_size
        ([0, 1, 2], [0, 1], 1)
        >>> batch['paper', 'cites', 'paper'].edge_index.tolist()
        [[1, 2, 2], [0, 0, 1]]
        >>> batch['author', 'writes', 'paper'].edge_index.tolist()  # author 1 -> paper 2, found at hop 2
        [[0, 1], [0, 2]]
        >>> batch['paper'].num_sampled_nodes, batch['author'].num_sampled_nodes
        ([1, 2, 0], [0, 1, 1])
        >>> batch['paper', 'rev_writes', 'author'].num_sampled_edges
        [0, 1]

    ``sample_subgraph`` gives the raw result instead, a :class:`HeteroSampledSubgraph` (what the presample
    of a datamodule's plan counts):

        >>> from lightning_ooc.sampling.hetero_sampler import HeteroSampledSubgraph
        >>> sub = sampler.sample_subgraph(torch.tensor([0]), 'paper', seed=0)
        >>> isinstance(sub, HeteroSampledSubgraph), sub.n_id['author'].tolist(), sub.input_type
        (True, [0, 1], 'paper')
    """

    def __init__(
        self,
        graph: Any,
        num_neighbors: Any,
        replace: bool = False,
        *,
        return_e_id: bool = False,
        disjoint: bool = False,
        time_attr: str | None = None,
        temporal_strategy: str = "uniform",
        time_window: int | None = None,
    ):
        if _sampler is None:  # pragma: no cover
            raise ImportError(
                "the native sampler lightning_ooc._sampler is not built; run `pip install -e .` or "
                "`python setup.py build_ext --inplace`"
            ) from _IMPORT_ERROR
        if not isinstance(getattr(graph, "csc", None), Mapping):
            raise InputError(f"the graph ({type(graph).__name__}) has no dict of CSCs per edge type (`csc`); for a "
                             "PyG HeteroData pass HeteroCSCGraph.from_hetero_data(data)")  # fmt: skip
        self.graph = graph
        self.node_types: list[str] = list(graph.node_types)
        if len(set(self.node_types)) != len(self.node_types) or not all(isinstance(t, str) for t in self.node_types):
            raise InputError(f"node_types must be distinct strings, got {self.node_types}")
        if not self.node_types:
            raise InputError("the graph has no node types")
        counts = graph.num_nodes_dict
        self.num_nodes_dict: dict[str, int] = {}
        for t in self.node_types:
            n = counts.get(t)
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise InputError(f"num_nodes_dict['{t}'] is {n!r}; every node type needs a count >= 0")
            self.num_nodes_dict[t] = int(n)
        self.edge_types: list[EdgeType] = [check_edge_type(et, self.num_nodes_dict) for et in graph.edge_types]
        if len(set(self.edge_types)) != len(self.edge_types):
            raise InputError(f"edge_types holds an edge type twice: {self.edge_types}")
        self.num_neighbors, self.num_hops = check_hetero_num_neighbors(num_neighbors, self.edge_types)
        if self.num_hops > 64:
            raise InputError(f"at most 64 hops, got {self.num_hops}")
        self.replace = bool(replace)
        self.return_e_id = bool(return_e_id)
        self._type_index = {t: i for i, t in enumerate(self.node_types)}
        self.indptr: dict[EdgeType, np.ndarray] = {}
        self.indices: dict[EdgeType, np.ndarray] = {}
        self._relations = []
        for et in self.edge_types:
            src, _, dst = et
            csc = graph.csc.get(et)
            if csc is None:
                raise InputError(f"the graph has no CSC for edge type {et} (graph.csc is keyed by (src, rel, dst))")
            indptr = _as_numpy(csc.indptr, f"indptr of {et}")
            indices = _as_numpy(csc.indices, f"indices of {et}")
            if indptr.dtype != np.int64 or indptr.shape != (self.num_nodes_dict[dst] + 1,):
                raise InputError(f"indptr of edge type {et} must be int64 with num_nodes['{dst}'] + 1 = "
                                 f"{self.num_nodes_dict[dst] + 1} entries, got "
                                 f"{indptr.dtype}{list(indptr.shape)}")  # fmt: skip
            if indices.dtype not in (np.int32, np.int64) or indices.ndim != 1:
                raise InputError(f"indices of edge type {et} must be a 1-D int32 or int64 array, got {indices.dtype}"
                                 f"{list(indices.shape)}")  # fmt: skip
            self.indptr[et], self.indices[et] = indptr, indices
            self._relations.append((indptr, indices, self._type_index[src], self._type_index[dst],
                                    self.num_neighbors[et], str(et)))  # fmt: skip
        self.labels: dict[str, np.ndarray] = {}
        for t, y in (getattr(graph, "labels", None) or {}).items():
            if t not in self.num_nodes_dict:
                raise InputError(f"labels given for node type '{t}', which is not one of {self.node_types}")
            y = _as_numpy(y, f"labels of '{t}'")
            if y.shape != (self.num_nodes_dict[t],):
                raise InputError(f"labels of node type '{t}' must have shape ({self.num_nodes_dict[t]},), got "
                                 f"{tuple(y.shape)}")  # fmt: skip
            self.labels[t] = y if y.dtype == np.int64 else y.astype(np.int64)
        self._num_nodes = [self.num_nodes_dict[t] for t in self.node_types]
        self.temporal = check_temporal(time_attr, temporal_strategy, time_window)
        self.disjoint = bool(disjoint) or self.temporal is not None
        self.node_time: dict[str, np.ndarray] = {}
        self._node_time_list: list[np.ndarray | None] | None = None
        if self.temporal is not None:
            self._set_times(graph)

    def _set_times(self, graph: Any) -> None:
        """Each relation's times for temporal sampling; a relation without them is sampled uniformly (PyG's rule)."""
        t = self.temporal
        assert t is not None
        if hasattr(graph, "node") and not isinstance(getattr(graph, "node_time", None), Mapping):
            times = {nt: graph.node(nt).node_time for nt in self.node_types}  # an on-disk dataset
        else:
            times = dict(getattr(graph, "node_time", None) or {})
        self.node_time = {nt: np.ascontiguousarray(tm, dtype=np.int64) for nt, tm in times.items() if tm is not None}
        root = getattr(graph, "root", None)
        timed = 0
        for r, et in enumerate(self.edge_types):
            csc = graph.csc[et]
            what = f"relation {'__'.join(et)}"
            if t.time_attr == "time":
                if et[0] not in self.node_time:
                    continue
                node_time, _ = temporal_arrays(csc, t, node_time=self.node_time[et[0]], what=what, root=root)
                if node_time.size != self.num_nodes_dict[et[0]]:
                    raise InputError(f"node_time of '{et[0]}' holds {node_time.size} entries for "
                                     f"{self.num_nodes_dict[et[0]]} nodes")  # fmt: skip
            else:
                if getattr(csc, "edge_time", None) is None:
                    continue
                _, edge_time = temporal_arrays(csc, t, what=what, root=root)
                self._relations[r] = self._relations[r][:6] + (edge_time,)
            timed += 1
        if not timed:
            which = "node times (node_time.npy)" if t.time_attr == "time" else "edge times (edge_time.npy)"
            raise InputError(f"time_attr={t.time_attr!r} but no relation of the graph has {which}")
        if t.time_attr == "time":
            self._node_time_list = [self.node_time.get(nt) for nt in self.node_types]

    def _corrupt(self, e: ValueError) -> CorruptDatasetError | None:
        """The native sampler's "corrupt graph: relation ..." error, naming the relation's file in the dataset
        (None for an in-memory graph, which has no file to name: the error is kept as it is)."""
        msg = str(e)
        for et in self.edge_types:
            head = f"corrupt graph: relation {et}: "
            if not msg.startswith(head):
                continue
            what = msg[len(head):]
            csc = self.graph.csc.get(et)
            path = getattr(csc, "indices_path" if what.startswith("indices[") else "indptr_path", None)
            if path is None:
                return None
            root = getattr(self.graph, "root", path.parent)
            return CorruptDatasetError(
                f"{path}: relation {'__'.join(et)}: {what}; the dataset is damaged (`lightning-ooc verify {root}` "
                "checks all of it); rebuild it with `lightning-ooc prepare` / `lightning-ooc synth`, or restore it "
                "from a copy", path)  # fmt: skip
        return None

    def _input_type(self, input_type: Any) -> int:
        if not isinstance(input_type, str) or input_type not in self._type_index:
            raise InputError(f"input type {input_type!r} is not a node type of the graph; its node types are "
                             f"{self.node_types}")  # fmt: skip
        return self._type_index[input_type]

    def sample_subgraph(
        self,
        seeds: Any,
        input_type: str,
        seed: int | None = None,
        *,
        labels: bool = False,
        e_id: bool | None = None,
        seed_time: Any = None,
    ) -> HeteroSampledSubgraph:
        """Sample the minibatch of ``seeds`` (ids of node type ``input_type``) and return the raw tensors.

        ``labels=True`` adds ``y`` for every node type with labels; ``e_id``
        defaults to the constructor's ``return_e_id``. ``seed_time`` is the
        time of each seed for temporal sampling (default: the seeds' node
        times).
        """
        t_in = self._input_type(input_type)
        seeds_t = as_seeds(seeds, self.num_nodes_dict[input_type], node_type=input_type)
        want_e_id = self.return_e_id if e_id is None else bool(e_id)
        if labels and not self.labels:
            raise InputError("labels=True but the graph has no labels")
        times: dict[str, Any] = {}
        st = None
        if self.temporal is not None:
            by_node = self.temporal.time_attr == "time"  # by edge time each seed's time is given, as PyG asks
            st = seed_times(seeds_t, seed_time, self.node_time.get(input_type) if by_node else None,
                            self.temporal.time_attr)  # fmt: skip
            times = dict(node_time=self._node_time_list, seed_time=st, **self.temporal.native_kwargs())
        elif seed_time is not None:
            raise InputError("seed_time is for temporal sampling; give the sampler time_attr='time' or 'edge_time'")
        try:
            n_id, edge_index, eid, hop_nodes, hop_edges, batch = _sampler.sample_hetero(
                self._num_nodes,
                self._relations,
                seeds_t.numpy(),
                t_in,
                self.num_hops,
                self.replace,
                draw_seed(seed),
                want_e_id,
                disjoint=self.disjoint,
                **times,
            )
        except ValueError as e:
            corrupt = self._corrupt(e)
            if corrupt is None:
                raise
            raise corrupt from None
        nodes = {t: _tensor(n_id[i], sum(hop_nodes[i])) for i, t in enumerate(self.node_types)}
        num_edges = [sum(h) for h in hop_edges]
        out = HeteroSampledSubgraph(
            n_id=nodes,
            edge_index={et: _tensor(edge_index[r], 2 * num_edges[r]).view(2, num_edges[r])
                        for r, et in enumerate(self.edge_types)},  # fmt: skip
            num_sampled_nodes=dict(zip(self.node_types, hop_nodes)),
            num_sampled_edges=dict(zip(self.edge_types, hop_edges)),
            input_type=input_type,
            seed_time=None if st is None else torch.from_numpy(st),
        )
        if batch is not None:
            out.batch = {t: _tensor(batch[i], sum(hop_nodes[i])) for i, t in enumerate(self.node_types)}
        if want_e_id:
            out.e_id = {et: _tensor(eid[r], num_edges[r]) for r, et in enumerate(self.edge_types)}
        if labels:
            out.y = {t: torch.from_numpy(np.take(y, nodes[t].numpy())) for t, y in self.labels.items()}
        return out

    def sample(
        self,
        seeds: Any,
        input_type: str,
        seed: int | None = None,
        *,
        input_id: torch.Tensor | None = None,
        seed_time: Any = None,
    ) -> HeteroData:
        """Sample the minibatch of ``seeds`` (ids of node type ``input_type``) and return it as a PyG ``HeteroData``.

        ``input_id`` is the index of each seed in the list the loader draws
        from (PyG's meaning); it defaults to ``arange(batch_size)``. Disjoint
        batches carry ``batch`` per node type and temporal ones
        ``seed_time`` on the input type, as PyG's ``NeighborLoader``'s do.
        """
        out = self.sample_subgraph(seeds, input_type, seed, labels=bool(self.labels), seed_time=seed_time)
        batch_size = out.batch_size
        if input_id is None:
            input_id = torch.arange(batch_size)
        else:
            input_id = torch.as_tensor(input_id, dtype=torch.long).reshape(-1)
            if input_id.numel() != batch_size:
                raise InputError(f"input_id has {input_id.numel()} entries for {batch_size} seeds")
        data = HeteroData()
        for t in self.node_types:
            data[t].n_id = out.n_id[t]
            if out.y is not None and t in out.y:
                data[t].y = out.y[t]
            if out.batch is not None:
                data[t].batch = out.batch[t]
        for et in self.edge_types:
            data[et].edge_index = out.edge_index[et]
            if out.e_id is not None:
                data[et].e_id = out.e_id[et]
        data.set_value_dict("num_sampled_nodes", out.num_sampled_nodes)
        data.set_value_dict("num_sampled_edges", out.num_sampled_edges)
        data[input_type].input_id = input_id
        data[input_type].batch_size = batch_size
        if out.seed_time is not None:
            data[input_type].seed_time = out.seed_time
        return data

    __call__ = sample

    def __repr__(self) -> str:
        extra = ", disjoint=True" if self.disjoint and self.temporal is None else ""
        if self.temporal is not None:
            t = self.temporal
            extra += f", time_attr={t.time_attr!r}, temporal_strategy={t.strategy!r}"
            extra += f", time_window={t.window}" if t.window is not None else ""
        return (f"HeteroNeighborSampler(num_nodes_dict={self.num_nodes_dict}, num_neighbors={self.num_neighbors}, "
                f"replace={self.replace}{extra})")  # fmt: skip
