"""Temporal neighbour sampling, as PyG's ``NeighborLoader(time_attr=..., temporal_strategy=...)`` does it.

A minibatch is sampled for seeds that each have a time (``seed_time``; by default the seed's own node
time). An in-edge may be sampled for a seed's subgraph only when its time is at most the seed's time,
and, with ``time_window``, at least the seed's time minus the window. The time of an edge is its own
(``time_attr="edge_time"``, the dataset's ``edge_time`` file) or its source node's (``time_attr="time"``,
the ``node_time`` file). ``temporal_strategy="uniform"`` samples the eligible in-edges uniformly,
``"last"`` takes the latest ``fanout`` of them. Each seed gets a subgraph of its own (``batch`` names a
node's seed), so one seed's future never reaches another's past: the subgraphs are disjoint, as PyG's.

The native samplers find the eligible in-edges of a node with two binary searches, so each node's
in-edges must be stored in time order. A dataset written with ``neighbor_order`` ``"node_time"`` or
``"edge_time"`` (``meta.json``) is; :func:`temporal_arrays` refuses a dataset whose order does not fit the
time asked for and names the command that rewrites it.

Example::

    >>> import torch
    >>> from lightning_ooc.sampling import CSCGraph, NeighborSampler
    >>> # 1, 2, 3 -> 0 at times 5, 10, 20; node 0's seed is at time 12
    >>> g = CSCGraph.from_edge_index(torch.tensor([[1, 2, 3], [0, 0, 0]]), edge_time=torch.tensor([5, 10, 20]))
    >>> s = NeighborSampler(g, [2], time_attr="edge_time", temporal_strategy="last")
    >>> out = s.sample_subgraph([0], seed=0, seed_time=[12])
    >>> out.n_id.tolist(), out.batch.tolist()
    ([0, 1, 2], [0, 0, 0])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_ooc.errors import InputError

#: ``time_attr`` values: the attribute's name in PyG's stores and the dataset file it reads.
TIME_ATTRS = {"time": "node_time", "edge_time": "edge_time"}
TEMPORAL_STRATEGIES = ("uniform", "last")
INT64_MAX = (1 << 63) - 1
#: ``neighbor_order`` of ``meta.json``: how each node's in-edges are ordered (absent: by source id).
NEIGHBOR_ORDERS = ("source_id", "node_time", "edge_time")


@dataclass(frozen=True)
class Temporal:
    """A temporal sampling request: which time, which strategy, which window (None: no window)."""

    time_attr: str
    strategy: str = "uniform"
    window: int | None = None

    @property
    def order(self) -> str:
        """The neighbour order the sampler needs (``node_time`` or ``edge_time``)."""
        return TIME_ATTRS[self.time_attr]

    def native_kwargs(self) -> dict[str, Any]:
        return {"time_window": -1 if self.window is None else int(self.window), "last": self.strategy == "last"}


def check_temporal(time_attr: Any, temporal_strategy: Any = "uniform", time_window: Any = None) -> Temporal | None:
    """The checked temporal request of a sampler's arguments (None: not temporal)."""
    if temporal_strategy not in TEMPORAL_STRATEGIES:
        raise InputError(f"temporal_strategy must be one of {list(TEMPORAL_STRATEGIES)}, got {temporal_strategy!r}")
    if time_attr is None:
        if time_window is not None:
            raise InputError("time_window needs time_attr ('time' for node times, 'edge_time' for edge times)")
        return None
    if time_attr not in TIME_ATTRS:
        raise InputError(f"time_attr must be 'time' (the time of each node) or 'edge_time' (the time of each edge), "
                         f"got {time_attr!r}")  # fmt: skip
    if time_window is not None and (isinstance(time_window, bool) or not isinstance(time_window, (int, np.integer))
                                    or not 0 <= time_window <= INT64_MAX):  # fmt: skip
        raise InputError(f"time_window must be an int in [0, 2**63 - 1] (in the dataset's time unit) or None, got "
                         f"{time_window!r}")  # fmt: skip
    return Temporal(str(time_attr), str(temporal_strategy), None if time_window is None else int(time_window))


def neighbor_order(part: Any) -> str:
    """How a CSC's in-edges are ordered: ``meta`` of a dataset or relation, or the graph's attribute."""
    order = getattr(part, "neighbor_order", None)
    if order is None:
        meta = getattr(part, "meta", None)
        order = meta.get("neighbor_order") if isinstance(meta, dict) else None
    return order or "source_id"


def rewrite_hint(root: Any, order: str) -> str:
    """The command that rewrites a dataset with its in-edges in ``order``."""
    if root is None:
        return (f"build the graph with its in-edges in {order.replace('_', ' ')} order "
                f"(CSCGraph.from_edge_index(..., {order}=...))")  # fmt: skip
    return f"rewrite it with `lightning-ooc prepare --dataset {root} --out NEW --neighbor-order {order}`"


def temporal_arrays(graph: Any, temporal: Temporal, *, node_time: Any = None, what: str | None = None,
                    root: Any = None) -> tuple[np.ndarray | None, np.ndarray | None]:  # fmt: skip
    """``(node_time, edge_time)`` of ``graph`` for ``temporal`` (one of them None), checked.

    ``node_time`` overrides the graph's own node times (a heterogeneous relation's come from its source
    type). The graph's in-edges must be in the order the time asks for.
    """
    what = what or "the graph"
    if root is None:
        root = getattr(graph, "root", None)
    if temporal.time_attr == "time":
        times = getattr(graph, "node_time", None) if node_time is None else node_time
        if times is None:
            raise InputError(f"time_attr='time' but {what} has no node times (node_time.npy); write them with "
                             "`prepare` (--node-time) or use time_attr='edge_time'")  # fmt: skip
    else:
        times = getattr(graph, "edge_time", None)
        if times is None:
            raise InputError(f"time_attr='edge_time' but {what} has no edge times (edge_time.npy); write them "
                             "with `prepare` (edge lists with a time column) or use time_attr='time'")  # fmt: skip
    times = _int64(times, temporal.time_attr)
    order = neighbor_order(graph)
    if order != temporal.order:
        raise InputError(f"time_attr={temporal.time_attr!r} needs each node's in-edges in {temporal.order} order, "
                         f"but {what} has them in {order.replace('_', ' ')} order; "
                         f"{rewrite_hint(root, temporal.order)}")  # fmt: skip
    return (times, None) if temporal.time_attr == "time" else (None, times)


def seed_times(seeds: torch.Tensor, seed_time: Any, node_time: np.ndarray | None, time_attr: str) -> np.ndarray:
    """The int64 time of each seed: ``seed_time`` where given, else the seeds' node times."""
    if seed_time is None:
        if node_time is None:
            why = ("samples by edge time" if time_attr == "edge_time"
                   else "samples by node time, and the seeds' node type has no node times")  # fmt: skip
            raise InputError(f"time_attr={time_attr!r} {why}: give each seed its time (seed_time=, input_time=, or "
                             "times in the split)")  # fmt: skip
        return np.ascontiguousarray(np.asarray(node_time[seeds.numpy()], dtype=np.int64))
    t = seed_time.detach().cpu().numpy() if isinstance(seed_time, torch.Tensor) else np.asarray(seed_time)
    if t.dtype.kind not in "iu":
        raise InputError(f"seed times must be integers (the dataset's time unit), got {t.dtype}")
    t = _fits_int64(t.reshape(-1), "seed times")
    if t.size != seeds.numel():
        raise InputError(f"{t.size} seed times for {seeds.numel()} seeds")
    return t


def _int64(a: Any, name: str) -> np.ndarray:
    a = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else a
    if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1:
        a = np.asarray(a)
        if a.dtype.kind not in "iu" or a.ndim != 1:
            raise InputError(f"{name} must be a 1-D integer array, got {a.dtype}{list(a.shape)}")
        a = _fits_int64(a, name)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _fits_int64(a: np.ndarray, name: str) -> np.ndarray:
    """``a`` as contiguous int64, refusing unsigned values past 2**63 - 1 (they would wrap to negative times)."""
    if a.dtype.kind == "u" and a.size and int(a.max()) > INT64_MAX:
        raise InputError(f"{name} hold {int(a.max())}, past the largest int64 time (2**63 - 1)")
    return np.ascontiguousarray(a, dtype=np.int64)
