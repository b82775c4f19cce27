"""PyG adapter: :class:`PyGNeighborSampler`, our sampler behind PyG's ``BaseSampler``.

With it, PyG's own ``NodeLoader`` / ``NeighborLoader`` (as ``neighbor_sampler=``) drives the native
sampler over an in-memory ``Data`` or ``HeteroData`` (their CSC is built once with torch ops), or over a
``(FeatureStore, GraphStore)`` pair: ours (:func:`lightning_ooc.pyg.open_pyg_stores`, whose on-disk CSC
the sampler reads as it is) or any other PyG backend's (its CSC taken once from ``graph_store.csc()``).
The minibatches come out exactly as ``NeighborLoader``'s would, edge attributes included (through
:attr:`edge_permutation`). PyG's ``LinkLoader`` drives it too on a homogeneous graph
(:meth:`PyGNeighborSampler.sample_from_edges` runs PyG's own link logic, ``edge_sample``, over the native
node sampling), as ``LinkNeighborLoader`` would, without pyg-lib or torch-sparse.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch_geometric.data import HeteroData
from torch_geometric.sampler import BaseSampler, HeteroSamplerOutput, NodeSamplerInput, SamplerOutput

from lightning_ooc.data.dataset import topology_read_ahead_off
from lightning_ooc.errors import InputError
from lightning_ooc.sampling.csc import CSCGraph, HeteroCSCGraph
from lightning_ooc.sampling.hetero_sampler import HeteroNeighborSampler
from lightning_ooc.sampling.neighbor import NeighborSampler

log = logging.getLogger("lightning_ooc")


def _graph_of(data: Any, time_attr: str | None = None) -> tuple[Any, str | None]:
    """What the native sampler reads for ``data``: a dataset (our stores), or a CSC built once in memory (in time
    order where ``time_attr`` names a time); and which time the sampler samples by (``"time"``: node times,
    ``"edge_time"``: edge times; None)."""
    if isinstance(data, (tuple, list)) and len(data) == 2:
        fs, gs = data
        graph = getattr(gs, "sampling_graph", None)  # a store that offers its CSC as the samplers read it (ours)
        if graph is None:
            if time_attr is not None:
                raise InputError("temporal sampling over another backend's store pair is not supported by the "
                                 "native sampler; over ours (open_pyg_stores) it is")  # fmt: skip
            return _graph_of_store(fs, gs), None
        # PyG's rule over a store pair: the attribute "time" holds node times, any other name edge times
        return graph, None if time_attr is None else ("time" if time_attr == "time" else "edge_time")
    if isinstance(data, HeteroData):
        graph = HeteroCSCGraph.from_hetero_data(data, labels=False, time_attr=time_attr)
        return graph, None if time_attr is None else ("time" if graph.node_time else "edge_time")
    if time_attr is None:
        return CSCGraph.from_data(data), None
    if data.is_node_attr(time_attr):
        return CSCGraph.from_data(data, node_time=data[time_attr]), "time"
    if data.is_edge_attr(time_attr):
        return CSCGraph.from_data(data, edge_time=data[time_attr]), "edge_time"
    raise InputError(f"the time attribute {time_attr!r} is neither a node nor an edge attribute of the data")


def _topology_read_ahead(graph: Any, time_attr: str | None) -> None:
    """Over our store pair the sampler reads the dataset's maps: where its topology (with the times it
    searches) takes more than half what this process may still allocate, read-ahead goes off on them, as the
    datamodule does (a fault reading far around its page would evict what the last ones read)."""
    from lightning_ooc.store.limits import memory_limit  # lazy: with the planner's dependencies

    limit = memory_limit()
    if not limit.unlimited and topology_read_ahead_off(graph, time_attr, limit.bytes // 2):
        log.info("lightning_ooc: the topology is larger than half the memory this process may use (%s): the "
                 "sampler reads it with read-ahead off (MADV_RANDOM)", limit)  # fmt: skip


def _graph_of_store(fs: Any, gs: Any) -> Any:
    """The CSC of another backend's graph store, taken once (``graph_store.csc()``)."""
    from torch_geometric.data import remote_backend_utils  # lazy: PyG's helpers for remote backends

    attrs = gs.get_all_edge_attrs()
    if not attrs:
        raise InputError("the graph store holds no edges")
    if all(a.edge_type is None for a in attrs):
        row, colptr, perm = gs.csc()
        return CSCGraph(colptr.to(torch.int64), row, perm=perm)
    rows, colptrs, perms = gs.csc()
    types = sorted({t for et in rows for t in (et[0], et[2])})
    counts = {t: int(remote_backend_utils.num_nodes(fs, gs, t)) for t in types}
    return HeteroCSCGraph(counts, {et: CSCGraph(colptrs[et].to(torch.int64), rows[et], perm=perms.get(et))
                                   for et in rows})  # fmt: skip


class PyGNeighborSampler(BaseSampler):
    """A PyG ``BaseSampler`` whose ``sample_from_nodes`` runs :class:`NeighborSampler` (or, on a heterogeneous
    graph, :class:`HeteroNeighborSampler`).

    Args:
        data: what the loader loads from: a PyG ``Data`` or ``HeteroData`` held in memory (its edges are
            turned into an in-edge CSC once), a ``(feature_store, graph_store)`` pair (ours reads the on-disk
            CSC; another backend's CSC is taken from its ``csc()`` once), or a ready
            :class:`NeighborSampler` / :class:`HeteroNeighborSampler` (then ``num_neighbors`` and
            ``replace`` come from it).
        num_neighbors: fanout per hop, ``-1`` for all neighbours (on a heterogeneous graph: one list for
            every edge type, or a dict per edge type).
        replace: sample with replacement.
        disjoint: PyG's ``disjoint=True``: every seed gets a subgraph of its own (a node reached from two
            seeds appears twice), ``batch`` giving each node's seed; nodes ordered hop by hop, each hop's
            seed by seed, as PyG's sampler orders them.
        time_attr, temporal_strategy, time_window: temporal sampling, as PyG's ``NeighborSampler`` takes it:
            ``time_attr`` names a node or an edge attribute of a ``Data``/``HeteroData`` (over our store pair:
            ``"time"`` is the node times, another name the edge times); seeds' times come from the loader's
            ``input_time`` / ``edge_label_time``, else their node times. Always disjoint.

    Each call draws its random seed from torch's default generator, so
    ``torch.manual_seed`` (and PyG's per-worker seeding) make it reproducible.

    Example::

        >>> import torch
        >>> from torch_geometric.data import Data
        >>> from torch_geometric.loader import NodeLoader
        >>> from lightning_ooc.sampling import PyGNeighborSampler
        >>> data = Data(x=torch.randn(4, 3), edge_index=torch.tensor([[1, 2, 3, 0], [0, 1, 2, 3]]))
        >>> loader = NodeLoader(data, PyGNeighborSampler(data, [2, 2]), input_nodes=torch.tensor([0, 2]), batch_size=2)
        >>> batch = next(iter(loader))
        >>> batch.n_id.tolist(), batch.batch_size, batch.num_sampled_nodes
        ([0, 2, 1, 3], 2, [2, 2, 0])
        >>> batch.x.shape, batch.edge_index.tolist()
        (torch.Size([4, 3]), [[2, 3, 1, 0], [0, 1, 2, 3]])

    On a ``HeteroData``, as ``NeighborLoader``'s ``neighbor_sampler=``:

        >>> from torch_geometric.data import HeteroData
        >>> from torch_geometric.loader import NeighborLoader
        >>> h = HeteroData()
        >>> h['paper'].x, h['author'].x = torch.randn(3, 2), torch.randn(2, 2)
        >>> h['author', 'writes', 'paper'].edge_index = torch.tensor([[0, 1, 1], [0, 1, 2]])
        >>> h['paper', 'rev_writes', 'author'].edge_index = torch.tensor([[0, 1, 2], [0, 1, 1]])
        >>> loader = NeighborLoader(h, num_neighbors=[-1, -1], input_nodes=('paper', torch.tensor([2])),
        ...                         batch_size=1, neighbor_sampler=PyGNeighborSampler(h, [-1, -1]))
        >>> b = next(iter(loader))
        >>> b['paper'].n_id.tolist(), b['author'].n_id.tolist(), b['paper'].batch_size
        ([2, 1], [1], 1)
    """

    def __init__(self, data: Any, num_neighbors: Any = None, replace: bool = False, disjoint: bool = False,
                 time_attr: str | None = None, temporal_strategy: str = "uniform", time_window: int | None = None):
        if isinstance(data, (NeighborSampler, HeteroNeighborSampler)):
            if num_neighbors is not None or time_attr is not None:
                raise InputError("pass num_neighbors and time options either to the sampler or here, not both")
            self.sampler = data
            graph = data.graph
        else:
            if num_neighbors is None:
                raise InputError("num_neighbors is required when sampling from a graph")
            graph, ours = _graph_of(data, time_attr)
            if isinstance(data, (tuple, list)):
                _topology_read_ahead(graph, ours)
            options = dict(disjoint=disjoint, time_attr=ours, temporal_strategy=temporal_strategy,
                           time_window=time_window)  # fmt: skip
            if getattr(graph, "is_hetero", False) or isinstance(graph, HeteroCSCGraph):
                self.sampler = HeteroNeighborSampler(graph, num_neighbors, replace, **options)
            else:
                self.sampler = NeighborSampler(graph, num_neighbors, replace, **options)
        #: whether the graph has several node and edge types (the sampler gives ``HeteroSamplerOutput``)
        self.is_hetero = isinstance(self.sampler, HeteroNeighborSampler)
        perm = getattr(graph, "perm", None)
        if self.is_hetero and perm is not None and all(p is None for p in perm.values()):
            perm = None
        self._perm = perm
        self.num_neighbors = self.sampler.num_neighbors
        self.replace = self.sampler.replace
        #: temporal sampling (the native sampler's request; None: none)
        self.temporal = self.sampler.temporal
        self.disjoint = bool(self.sampler.disjoint)

    @property
    def is_temporal(self) -> bool:
        return self.temporal is not None

    def _check(self, index: Any) -> None:
        if index.time is not None and self.temporal is None:
            raise InputError("seed times (input_time / edge_label_time) are given, but the sampler samples without "
                             "time: give the loader time_attr")  # fmt: skip
        if self.is_hetero and index.input_type is None:
            raise InputError(f"the graph is heterogeneous: name the seeds' node type (input_nodes=(node_type, ids); "
                             f"node types: {self.sampler.node_types})")  # fmt: skip
        if not self.is_hetero and index.input_type is not None:
            raise InputError(f"the graph is homogeneous, but the seeds name node type {index.input_type!r}")

    def _sample(self, seeds: torch.Tensor, seed_time: Any = None) -> SamplerOutput:
        """One native call; disjoint subgraphs come out as PyG's disjoint sampler lays them out: the nodes hop by
        hop and, within a hop, seed by seed; the edges likewise; ``batch`` each node's seed."""
        times = {} if self.temporal is None else {"seed_time": seed_time}
        out = self.sampler.sample_subgraph(seeds, e_id=True, **times)
        return SamplerOutput(node=out.n_id, row=out.edge_index[0], col=out.edge_index[1], edge=out.e_id,
                             batch=out.batch, num_sampled_nodes=out.num_sampled_nodes,
                             num_sampled_edges=out.num_sampled_edges)  # fmt: skip

    def _sample_hetero(self, seeds: torch.Tensor, input_type: str, seed_time: Any = None) -> HeteroSamplerOutput:
        times = {} if self.temporal is None else {"seed_time": seed_time}
        out = self.sampler.sample_subgraph(seeds, input_type, e_id=True, **times)
        return HeteroSamplerOutput(
            node=out.n_id, row={et: ei[0] for et, ei in out.edge_index.items()},
            col={et: ei[1] for et, ei in out.edge_index.items()}, edge=out.e_id, batch=out.batch,
            num_sampled_nodes=out.num_sampled_nodes, num_sampled_edges=out.num_sampled_edges,
        )  # fmt: skip

    def sample_from_nodes(self, index: NodeSamplerInput, **kwargs: Any) -> SamplerOutput | HeteroSamplerOutput:
        self._check(index)
        if self.is_hetero:
            out = self._sample_hetero(index.node, index.input_type, index.time)
        else:
            out = self._sample(index.node, index.time)
        seed_time = index.time
        if seed_time is None and self.temporal is not None:
            seed_time = self._seed_times(out)
        out.metadata = (index.input_id, seed_time)
        return out

    def _seed_times(self, out: Any) -> torch.Tensor | None:
        """The seeds' node times (PyG's default seed times), for the batch's ``seed_time``."""
        if self.is_hetero:
            return None
        times = self.sampler.node_time
        if times is None:
            return None
        seeds = out.node[: out.num_sampled_nodes[0]]
        return torch.from_numpy(times[seeds.numpy()].astype("int64"))

    def sample_from_edges(self, index: Any, neg_sampling: Any = None) -> SamplerOutput:
        """Seed edges and their negatives, through PyG's ``edge_sample`` (not disjoint, homogeneous)."""
        from torch_geometric.sampler.neighbor_sampler import edge_sample  # lazy: PyG only where it is used

        if self.is_hetero:
            raise InputError("link sampling on a heterogeneous graph is not supported by this sampler; use PyG's "
                             "own LinkNeighborLoader sampler (pyg-lib or torch-sparse)")  # fmt: skip
        self._check(index)
        node_time = None if self.sampler.node_time is None else torch.from_numpy(self.sampler.node_time)
        return edge_sample(index, self._sample, self.sampler.num_nodes, self.disjoint, node_time, neg_sampling)

    @property
    def edge_permutation(self) -> Any:
        """CSC position -> column of the original ``edge_index`` (a dict per edge type on a heterogeneous graph;
        None for an on-disk graph, whose CSC positions are its edge ids)."""
        return self._perm

