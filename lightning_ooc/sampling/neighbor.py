"""Node-wise uniform neighbour sampling: :class:`NeighborSampler`.

The work is done by the native module ``lightning_ooc._sampler`` (see
``ext/sampler/sampler.cpp``): it reads ``indptr`` from memory and
``indices`` through its memory map, releases the GIL while it samples, and
keeps all its state per call, so one sampler may be used from several
threads at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch_geometric.data import Data

from lightning_ooc.errors import CorruptDatasetError, InputError
from lightning_ooc.sampling.csc import _as_numpy
from lightning_ooc.sampling.temporal import check_temporal, seed_times, temporal_arrays

try:
    from lightning_ooc import _sampler
except ImportError as e:  # pragma: no cover - only without a build
    _sampler = None
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None

_SEED_MASK = (1 << 64) - 1
#: the largest fanout of a hop (the native samplers refuse more: a count past it would overflow their arrays)
MAX_FANOUT = (1 << 31) - 1


@dataclass
class SampledSubgraph:
    """The raw result of sampling one minibatch (what :class:`~torch_geometric.data.Data` is built from).

    Attributes:
        n_id: global ids of the sampled nodes, int64; the seeds first, then
            each hop's new nodes in order of first appearance.
        edge_index: ``(2, E)`` int64 local ids; row 0 is the source (the
            sampled neighbour), row 1 the target, as PyG's message passing
            expects. Edges are grouped by hop, then by target.
        num_sampled_nodes: nodes added per hop, ``[batch_size, hop 1, ...]``.
        num_sampled_edges: edges sampled per hop.
        e_id: position of each edge in ``indices`` (the CSC edge id), or None.
        y: ``labels[n_id]``, or None.
        batch: for disjoint (and temporal) sampling, the position of each
            node's seed (its subgraph); None otherwise.
        seed_time: the time of each seed (temporal sampling), or None.

    Example::

        >>> import torch
        >>> from lightning_ooc.sampling import CSCGraph, NeighborSampler
        >>> g = CSCGraph.from_edge_index(torch.tensor([[1, 2, 2], [0, 0, 1]]), labels=torch.tensor([5, 6, 7]))
        >>> out = NeighborSampler(g, [-1]).sample_subgraph([0, 1], seed=0, labels=True, e_id=True)
        >>> out.batch_size, out.n_id.tolist(), out.edge_index.tolist(), out.e_id.tolist(), out.y.tolist()
        (2, [0, 1, 2], [[1, 2, 2], [0, 0, 1]], [0, 1, 2], [5, 6, 7])
    """

    n_id: torch.Tensor
    edge_index: torch.Tensor
    num_sampled_nodes: list[int]
    num_sampled_edges: list[int]
    e_id: torch.Tensor | None = None
    y: torch.Tensor | None = None
    batch: torch.Tensor | None = None
    seed_time: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.num_sampled_nodes[0]


def check_num_neighbors(num_neighbors: Any) -> list[int]:
    """Validate a fanout list (one int per hop, ``-1`` for all neighbours)."""
    if isinstance(num_neighbors, dict):
        raise InputError("num_neighbors given per edge type; only homogeneous graphs are supported")
    if isinstance(num_neighbors, (int, np.integer)) or not isinstance(num_neighbors, Sequence):
        raise InputError(f"num_neighbors must be a list with one fanout per hop, got {num_neighbors!r}")
    out = []
    for h, k in enumerate(num_neighbors):
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not -1 <= k <= MAX_FANOUT:
            raise InputError(f"num_neighbors[{h}] = {k!r}; use a count in [0, {MAX_FANOUT}], or -1 for all "
                             "neighbours")  # fmt: skip
        out.append(int(k))
    if len(out) > 64:
        raise InputError(f"at most 64 hops, got {len(out)}")
    return out


def as_seeds(seeds: Any, num_nodes: int, node_type: str | None = None) -> torch.Tensor:
    """Seeds as a contiguous 1-D int64 CPU tensor, checked to be node ids in ``[0, num_nodes)``.

    ``node_type`` names the seeds' node type in errors (heterogeneous graphs).
    """
    if isinstance(seeds, torch.Tensor):
        t = seeds.detach()
    else:
        a = np.asarray(seeds)
        if a.size == 0 and a.dtype.kind == "f":  # [] and () come out as float64
            a = a.astype(np.int64)
        if a.dtype.kind not in "iu":
            raise InputError(f"seeds must be integer node ids, got {a.dtype}")
        t = torch.from_numpy(np.array(a, dtype=np.int64, copy=True))
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise InputError(f"seeds must be integer node ids, got {t.dtype}; pass node ids, not a mask")
    if t.dim() > 1:
        raise InputError(f"seeds must be a 1-D list of node ids, got shape {tuple(t.shape)}")
    t = t.reshape(-1).to(device="cpu", dtype=torch.long).contiguous()
    if t.numel():
        lo, hi = torch.aminmax(t)
        if int(lo) < 0 or int(hi) >= num_nodes:
            pos = int(torch.nonzero((t < 0) | (t >= num_nodes))[0])
            if node_type is not None:
                raise InputError(f"seed {int(t[pos])} (position {pos}) is not an id of node type '{node_type}'; it "
                                 f"has {num_nodes} nodes, ids 0..{num_nodes - 1}")  # fmt: skip
            raise InputError(
                f"seed {int(t[pos])} (position {pos}) is not a node id; the graph has {num_nodes} nodes, "
                f"ids 0..{num_nodes - 1}"
            )
    return t


def draw_seed(seed: int | None) -> int:
    """``seed`` as an unsigned 64-bit value, or one drawn from torch's default generator when None."""
    if seed is None:
        return int(torch.randint(0, 1 << 62, (), dtype=torch.long))
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InputError(f"seed must be an int or None, got {seed!r}")
    return int(seed) & _SEED_MASK


def release_thread_workspace() -> None:
    """Free the calling thread's sampling scratch memory (it is otherwise kept for the next call)."""
    if _sampler is not None:
        _sampler.release_workspace()


def _tensor(buf: Any, n: int) -> torch.Tensor:
    if n == 0:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(buf, dtype=torch.long)  # shares the native buffer, which it keeps alive


class NeighborSampler:
    """Uniform node-wise neighbour sampling over an in-edge CSC, hop by hop.

    For every node first reached at hop ``h`` (the seeds at hop 0), hop
    ``h + 1`` samples ``num_neighbors[h]`` of its in-neighbours (all of them
    for ``-1``; without replacement a node with fewer gets all it has).
    Minibatches look like PyG ``NeighborLoader`` output: ``n_id`` (seeds
    first), ``edge_index`` in local ids (row 0 source, row 1 target), ``y``,
    ``batch_size``, ``input_id``, ``num_sampled_nodes``, ``num_sampled_edges``.
    ``x`` is left to the feature store unless ``load_features=True``.

    Args:
        graph: an :class:`~lightning_ooc.OnDiskDataset` or a
            :class:`~lightning_ooc.sampling.CSCGraph` (anything with
            ``indptr`` and ``indices``; ``labels`` and ``read_features`` are
            used when present).
        num_neighbors: fanout per hop, ``-1`` for all neighbours.
        replace: sample with replacement (then a node with any in-edge gets
            exactly ``fanout`` of them, repeats possible).
        load_features: fill ``x`` with ``graph.read_features(n_id)`` (through
            the page cache; meant for tests and small examples).
        return_e_id: add ``e_id``, the CSC position of each sampled edge.
        disjoint: give each seed a subgraph of its own (PyG's ``disjoint``);
            ``batch`` then names each node's seed. Temporal sampling always is.
        time_attr: sample temporally by ``"time"`` (each node's time, the
            graph's ``node_time``) or ``"edge_time"`` (each edge's, the
            graph's ``edge_time``): a seed's subgraph holds only in-edges no
            later than the seed's time (:mod:`lightning_ooc.sampling.temporal`).
        temporal_strategy: ``"uniform"`` (sample the eligible in-edges
            uniformly) or ``"last"`` (the latest ``fanout`` of them), as PyG's.
        time_window: only in-edges at most this much earlier than the seed
            (in the dataset's time unit); None: no limit.

    The same ``seed`` gives the same minibatch on any thread; ``seed=None``
    draws one from torch's default generator, so ``torch.manual_seed``
    makes a run reproducible. :meth:`sample` may be called from several
    threads at once: it holds the GIL only to set up and wrap the result.
    Each sampling thread keeps its scratch memory (node map, edge arrays; at
    most 512 MiB) for its next call; :func:`release_thread_workspace` frees it.

    Example::

        >>> import torch
        >>> from lightning_ooc.sampling import CSCGraph, NeighborSampler
        >>> ring = torch.tensor([[1, 2, 3, 0], [0, 1, 2, 3]])  # i + 1 -> i
        >>> sampler = NeighborSampler(CSCGraph.from_edge_index(ring), [1, 1])
        >>> batch = sampler.sample(torch.tensor([0]), seed=0)
        >>> batch.n_id.tolist(), batch.edge_index.tolist(), batch.batch_size
        ([0, 1, 2], [[1, 2], [0, 1]], 1)
        >>> batch.num_sampled_nodes, batch.num_sampled_edges
        ([1, 1, 1], [1, 1])
    """

    def __init__(
        self,
        graph: Any,
        num_neighbors: Sequence[int],
        replace: bool = False,
        *,
        load_features: bool = False,
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
        self.graph = graph
        self.num_neighbors = check_num_neighbors(num_neighbors)
        self.replace = bool(replace)
        self.load_features = bool(load_features)
        self.return_e_id = bool(return_e_id)
        self.indptr = _as_numpy(graph.indptr, "indptr")
        self.indices = _as_numpy(graph.indices, "indices")
        if self.indptr.dtype != np.int64 or self.indptr.ndim != 1:
            raise InputError(f"indptr must be 1-D int64, got {self.indptr.dtype}{list(self.indptr.shape)}")
        if self.indices.dtype not in (np.int32, np.int64) or not self.indices.flags.c_contiguous:
            raise InputError(f"indices must be a contiguous int32 or int64 array, got {self.indices.dtype}")
        labels = getattr(graph, "labels", None)
        self.labels = None if labels is None else _as_numpy(labels, "labels")
        if self.labels is not None and self.labels.dtype != np.int64:
            self.labels = self.labels.astype(np.int64)
        if load_features and not hasattr(graph, "read_features"):
            raise InputError("load_features=True needs a graph with read_features(ids), e.g. an OnDiskDataset")
        self.num_nodes = int(self.indptr.size - 1)
        self.temporal = check_temporal(time_attr, temporal_strategy, time_window)
        self.node_time = self.edge_time = None
        if self.temporal is not None:
            self.node_time, self.edge_time = temporal_arrays(graph, self.temporal)
            if self.node_time is not None and self.node_time.size != self.num_nodes:
                raise InputError(f"node_time holds {self.node_time.size} entries for {self.num_nodes} nodes")
        self.disjoint = bool(disjoint) or self.temporal is not None

    def _corrupt(self, e: ValueError) -> CorruptDatasetError | None:
        """The native sampler's "corrupt graph" error, naming the dataset file it found it in (None: keep it)."""
        msg = str(e)
        if not msg.startswith("corrupt graph: "):
            return None
        what = msg[len("corrupt graph: "):]
        meta = getattr(self.graph, "meta", None)
        root = getattr(self.graph, "root", None)
        if root is None or not isinstance(meta, dict):
            return None  # an in-memory graph: no file to name
        key = "indices" if what.startswith("indices[") else "indptr"
        path = Path(root) / meta["files"][key]["name"]
        return CorruptDatasetError(f"{path}: {what}; the dataset is damaged (`lightning-ooc verify {root}` checks "
                                   "all of it); rebuild it with `lightning-ooc prepare` / `lightning-ooc synth`, or "
                                   "restore it from a copy", path)  # fmt: skip

    @property
    def num_hops(self) -> int:
        return len(self.num_neighbors)

    def sample_subgraph(
        self, seeds: Any, seed: int | None = None, *, labels: bool = False, e_id: bool | None = None,
        seed_time: Any = None,
    ) -> SampledSubgraph:
        """Sample one minibatch and return the raw tensors (no ``Data`` object).

        ``labels=True`` gathers ``y = labels[n_id]`` natively; ``e_id``
        defaults to the constructor's ``return_e_id``. ``seed_time`` is the
        time of each seed for temporal sampling (default: the seeds' node
        times, PyG's default).
        """
        seeds_t = as_seeds(seeds, self.num_nodes)
        want_e_id = self.return_e_id if e_id is None else bool(e_id)
        if labels and self.labels is None:
            raise InputError("labels=True but the graph has no labels")
        times: dict[str, Any] = {}
        st = None
        if self.temporal is not None:
            st = seed_times(seeds_t, seed_time, self.node_time, self.temporal.time_attr)
            times = dict(node_time=self.node_time, edge_time=self.edge_time, seed_time=st,
                         **self.temporal.native_kwargs())  # fmt: skip
        elif seed_time is not None:
            raise InputError("seed_time is for temporal sampling; give the sampler time_attr='time' or 'edge_time'")
        try:
            n_id, ei, eid, y, hop_nodes, hop_edges, batch = _sampler.sample(
                self.indptr,
                self.indices,
                seeds_t.numpy(),
                self.num_neighbors,
                self.replace,
                draw_seed(seed),
                want_e_id,
                self.labels if labels else None,
                disjoint=self.disjoint,
                **times,
            )
        except ValueError as e:
            corrupt = self._corrupt(e)
            if corrupt is None:
                raise
            raise corrupt from None
        n = sum(hop_nodes)
        e = sum(hop_edges)
        return SampledSubgraph(
            n_id=_tensor(n_id, n),
            edge_index=_tensor(ei, 2 * e).view(2, e),
            num_sampled_nodes=hop_nodes,
            num_sampled_edges=hop_edges,
            e_id=_tensor(eid, e) if want_e_id else None,
            y=_tensor(y, n) if labels else None,
            batch=_tensor(batch, n) if batch is not None else None,
            seed_time=None if st is None else torch.from_numpy(st),
        )

    def sample(self, seeds: Any, seed: int | None = None, *, input_id: torch.Tensor | None = None,
               seed_time: Any = None) -> Data:  # fmt: skip
        """Sample the minibatch of ``seeds`` and return it as a PyG ``Data``.

        ``input_id`` is the index of each seed in the list the loader draws
        from (PyG's meaning); it defaults to ``arange(batch_size)``.
        Disjoint batches carry ``batch`` and temporal ones ``seed_time``, as
        PyG's ``NeighborLoader``'s do.
        """
        out = self.sample_subgraph(seeds, seed, labels=self.labels is not None, seed_time=seed_time)
        batch_size = out.batch_size
        if input_id is None:
            input_id = torch.arange(batch_size)
        else:
            input_id = torch.as_tensor(input_id, dtype=torch.long).reshape(-1)
            if input_id.numel() != batch_size:
                raise InputError(f"input_id has {input_id.numel()} entries for {batch_size} seeds")
        data = Data(edge_index=out.edge_index, n_id=out.n_id)
        if self.load_features:
            data.x = self.graph.read_features(out.n_id)
        if out.y is not None:
            data.y = out.y
        if out.e_id is not None:
            data.e_id = out.e_id
        if out.batch is not None:
            data.batch = out.batch
        if out.seed_time is not None:
            data.seed_time = out.seed_time
        data.input_id = input_id
        data.batch_size = batch_size
        data.num_sampled_nodes = out.num_sampled_nodes
        data.num_sampled_edges = out.num_sampled_edges
        return data

    __call__ = sample

    def __repr__(self) -> str:
        extra = ", disjoint=True" if self.disjoint and self.temporal is None else ""
        if self.temporal is not None:
            t = self.temporal
            extra += f", time_attr={t.time_attr!r}, temporal_strategy={t.strategy!r}"
            extra += f", time_window={t.window}" if t.window is not None else ""
        return (
            f"NeighborSampler(num_nodes={self.num_nodes}, num_neighbors={self.num_neighbors}, "
            f"replace={self.replace}{extra})"
        )
