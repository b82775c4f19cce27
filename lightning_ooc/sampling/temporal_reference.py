"""A plain-Python reference of temporal (and disjoint) neighbour sampling, written from PyG's semantics.

It follows pyg-lib's ``neighbor_sample`` with ``disjoint=True``: every seed starts a subgraph of its own
(a node is the pair (seed position, node id)); hop by hop, each node first reached at the previous hop
gets, among its in-edges whose time is at most its seed's time (and, with a window, at least the seed's
time minus the window), ``fanout`` of them: the latest ``fanout`` with ``"last"``, all of them for a
fanout of -1 or no more eligible than the fanout, else a uniform choice (made here with Python's
``random``, so only its distribution compares with the native samplers'). Nodes are numbered in order
of first appearance; edges are (source local id, target local id, CSC position), grouped by hop and
target. The times are read one by one with a linear scan, not by binary search, so the reference does
not share the native samplers' assumption that each node's in-edges are sorted; it checks that they are.

Example::

    >>> import numpy as np
    >>> indptr, indices = np.array([0, 3, 3, 3, 3]), np.array([1, 2, 3])
    >>> out = temporal_sample(indptr, indices, [0], [12], [2], edge_time=np.array([5, 10, 20]), strategy="last")
    >>> out["n_id"], out["batch"], out["edges"]
    ([0, 1, 2], [0, 0, 0], [(1, 0, 0), (2, 0, 1)])
"""
from __future__ import annotations

import random
from typing import Any, Sequence


def eligible(lo: int, hi: int, time_at: Any, t: int, window: int | None, k: int, strategy: str) -> list[int]:
    """The CSC positions in ``[lo, hi)`` a seed of time ``t`` may sample from (the latest ``k`` for "last")."""
    times = [time_at(j) for j in range(lo, hi)]
    if any(a > b for a, b in zip(times, times[1:])):
        raise ValueError(f"in-edges {lo}..{hi} are not in time order: {times}")
    out = [j for j, tj in zip(range(lo, hi), times) if tj <= t and (window is None or tj >= t - window)]
    if strategy == "last" and k >= 0:
        out = out[len(out) - k:] if len(out) > k else out
    return out


def choose(pos: list[int], k: int, replace: bool, rng: random.Random) -> list[int]:
    """PyG's cases: every eligible edge, ``k`` with replacement, or a uniform ``k``-subset."""
    if k < 0 or (not replace and k >= len(pos)) or not pos:
        return list(pos)
    if replace:
        return [pos[rng.randrange(len(pos))] for _ in range(k)]
    return sorted(rng.sample(pos, k))


def temporal_sample(indptr: Any, indices: Any, seeds: Sequence[int], seed_time: Sequence[int],
                    fanouts: Sequence[int], *, node_time: Any = None, edge_time: Any = None,
                    strategy: str = "uniform", window: int | None = None, replace: bool = False,
                    rng: random.Random | None = None) -> dict[str, Any]:  # fmt: skip
    """One homogeneous minibatch: ``n_id``, ``batch``, ``edges`` [(row, col, e_id)], per-hop counts."""
    rng = rng or random.Random(0)
    nodes: list[tuple[int, int]] = []
    local: dict[tuple[int, int], int] = {}
    for i, s in enumerate(seeds):
        local[(i, int(s))] = len(nodes)
        nodes.append((i, int(s)))
    edges: list[tuple[int, int, int]] = []
    hop_nodes, hop_edges = [len(nodes)], []
    begin, end = 0, len(nodes)
    for k in fanouts:
        before = len(edges)
        for tgt in range(begin, end):
            b, v = nodes[tgt]
            lo, hi = int(indptr[v]), int(indptr[v + 1])

            def time_at(j: int) -> int:
                return int(edge_time[j]) if edge_time is not None else int(node_time[int(indices[j])])

            if edge_time is None and node_time is None:
                pos = list(range(lo, hi))
            else:
                pos = eligible(lo, hi, time_at, int(seed_time[b]), window, k, strategy)
            for j in choose(pos, k, replace, rng):
                key = (b, int(indices[j]))
                if key not in local:
                    local[key] = len(nodes)
                    nodes.append(key)
                edges.append((local[key], tgt, j))
        hop_nodes.append(len(nodes) - end)
        hop_edges.append(len(edges) - before)
        begin, end = end, len(nodes)
    return {"n_id": [v for _, v in nodes], "batch": [b for b, _ in nodes], "edges": edges,
            "num_sampled_nodes": hop_nodes, "num_sampled_edges": hop_edges}  # fmt: skip


def hetero_temporal_sample(num_nodes: dict[str, int], relations: dict[tuple[str, str, str], tuple[Any, Any, Any]],
                           seeds: Sequence[int], input_type: str, seed_time: Sequence[int],
                           fanouts: dict[tuple[str, str, str], Sequence[int]], *,
                           node_time: dict[str, Any] | None = None, strategy: str = "uniform",
                           window: int | None = None, replace: bool = False,
                           rng: random.Random | None = None) -> dict[str, Any]:  # fmt: skip
    """One heterogeneous minibatch, relations visited in the dict's order at every hop.

    ``relations`` maps an edge type to ``(indptr, indices, edge_time or None)``; a relation whose source type
    has no node time and which has no edge time is sampled uniformly, as PyG does.
    """
    rng = rng or random.Random(0)
    node_time = node_time or {}
    nodes: dict[str, list[tuple[int, int]]] = {t: [] for t in num_nodes}
    local: dict[str, dict[tuple[int, int], int]] = {t: {} for t in num_nodes}
    for i, s in enumerate(seeds):
        local[input_type][(i, int(s))] = len(nodes[input_type])
        nodes[input_type].append((i, int(s)))
    edges: dict[Any, list[tuple[int, int, int]]] = {et: [] for et in relations}
    hop_nodes = {t: [len(nodes[t])] for t in num_nodes}
    hop_edges: dict[Any, list[int]] = {et: [] for et in relations}
    front = {t: (0, len(nodes[t])) for t in num_nodes}
    hops = len(next(iter(fanouts.values()))) if fanouts else 0
    for h in range(hops):
        for et, (indptr, indices, edge_time) in relations.items():
            src, _, dst = et
            k = int(fanouts[et][h])
            before = len(edges[et])
            times = node_time.get(src)
            for tgt in range(*front[dst]):
                b, v = nodes[dst][tgt]
                lo, hi = int(indptr[v]), int(indptr[v + 1])
                if k == 0:
                    continue
                if edge_time is not None:
                    pos = eligible(lo, hi, lambda j: int(edge_time[j]), int(seed_time[b]), window, k, strategy)
                elif times is not None:
                    pos = eligible(lo, hi, lambda j: int(times[int(indices[j])]), int(seed_time[b]), window, k,
                                   strategy)  # fmt: skip
                else:
                    pos = list(range(lo, hi))
                for j in choose(pos, k, replace, rng):
                    key = (b, int(indices[j]))
                    if key not in local[src]:
                        local[src][key] = len(nodes[src])
                        nodes[src].append(key)
                    edges[et].append((local[src][key], tgt, j))
            hop_edges[et].append(len(edges[et]) - before)
        for t in num_nodes:
            hop_nodes[t].append(len(nodes[t]) - front[t][1])
            front[t] = (front[t][1], len(nodes[t]))
    return {"n_id": {t: [v for _, v in ns] for t, ns in nodes.items()},
            "batch": {t: [b for b, _ in ns] for t, ns in nodes.items()}, "edges": edges,
            "num_sampled_nodes": hop_nodes, "num_sampled_edges": hop_edges}  # fmt: skip
