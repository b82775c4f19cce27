"""A vectorised torch implementation of the same sampling: :class:`TorchNeighborSampler`.

It is the reference that ``lightning-ooc bench sample`` measures the native
sampler against (pyg-lib and torch-sparse have no wheels for our torch), and
a second, independent implementation for the tests. Per hop it works on
whole tensors:

* fanout -1, or a node with at most ``fanout`` in-edges: every in-edge;
* with replacement: ``floor(U * degree)`` per draw;
* without replacement: every in-edge of the nodes with more than ``fanout``
  gets a random key, a single sort shuffles each node's edges, and the first
  ``fanout`` of each node are kept (a uniform subset);
* relabelling: a dense ``node -> local id`` table of ``num_nodes`` entries
  (one per thread, reset after each call), new nodes numbered in order of
  first appearance with ``torch.unique`` plus a first-occurrence ``amin``.

The output has the same layout and order as the native sampler's; with every
fanout -1 (no randomness) the two agree tensor for tensor.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Sequence

import torch

from lightning_ooc.sampling.csc import _as_numpy
from lightning_ooc.sampling.neighbor import SampledSubgraph, as_seeds, check_num_neighbors, draw_seed

_ABSENT = torch.iinfo(torch.long).max


class TorchNeighborSampler:
    """Uniform neighbour sampling with plain vectorised torch ops (the benchmark's reference).

    Same arguments and output as :meth:`NeighborSampler.sample_subgraph
    <lightning_ooc.sampling.NeighborSampler.sample_subgraph>`, but its random
    stream differs, so only the distribution (and, with fanout -1, the exact
    result) match the native sampler's.

    Example::

        >>> import torch
        >>> from lightning_ooc.sampling import CSCGraph, TorchNeighborSampler
        >>> g = CSCGraph.from_edge_index(torch.tensor([[1, 2, 3, 0], [0, 1, 2, 3]]))
        >>> out = TorchNeighborSampler(g, [-1, -1]).sample_subgraph(torch.tensor([0]), seed=0)
        >>> out.n_id.tolist(), out.edge_index.tolist(), out.num_sampled_edges
        ([0, 1, 2], [[1, 2], [0, 1]], [1, 1])
    """

    def __init__(self, graph: Any, num_neighbors: Sequence[int], replace: bool = False):
        self.num_neighbors = check_num_neighbors(num_neighbors)
        self.replace = bool(replace)
        with warnings.catch_warnings():  # read-only arrays (a memmap): we only ever read them
            warnings.simplefilter("ignore", UserWarning)
            self.indptr = torch.from_numpy(_as_numpy(graph.indptr, "indptr"))
            self.indices = torch.from_numpy(_as_numpy(graph.indices, "indices"))
        self.num_nodes = int(self.indptr.numel() - 1)
        self._local = threading.local()

    def _mapping(self) -> torch.Tensor:
        m = getattr(self._local, "mapping", None)
        if m is None:
            m = self._local.mapping = torch.full((self.num_nodes,), _ABSENT, dtype=torch.long)
        return m

    def sample_subgraph(self, seeds: Any, seed: int | None = None) -> SampledSubgraph:
        seeds_t = as_seeds(seeds, self.num_nodes)
        gen = torch.Generator().manual_seed(draw_seed(seed) & ((1 << 63) - 1))
        mapping = self._mapping()
        b = seeds_t.numel()
        ar = torch.arange(b)
        mapping.scatter_reduce_(0, seeds_t, ar, reduce="amin")  # a repeated seed maps to its first place
        n_ids, rows, cols, eids = [seeds_t], [], [], []
        hop_nodes, hop_edges = [b], []
        frontier, frontier_nodes, n = ar, seeds_t, b
        try:
            for k in self.num_neighbors:
                pos, tgt = self._pick(frontier, frontier_nodes, k, gen)
                cand = self.indices[pos].long()
                loc = mapping[cand]
                new = loc == _ABSENT
                ordered = cand[:0]
                if bool(new.any()):
                    fresh = cand[new]
                    uniq, inv = torch.unique(fresh, return_inverse=True)
                    first = torch.full((uniq.numel(),), fresh.numel(), dtype=torch.long)
                    first.scatter_reduce_(0, inv, torch.arange(fresh.numel()), reduce="amin")
                    ordered = uniq[torch.argsort(first)]
                    mapping[ordered] = torch.arange(n, n + ordered.numel())
                    loc = mapping[cand]
                    n_ids.append(ordered)
                rows.append(loc)
                cols.append(tgt)
                eids.append(pos)
                hop_nodes.append(int(ordered.numel()))
                hop_edges.append(int(pos.numel()))
                frontier = torch.arange(n, n + ordered.numel())
                frontier_nodes = ordered
                n += ordered.numel()
        finally:
            for ids in n_ids:
                mapping[ids] = _ABSENT
        empty = torch.empty(0, dtype=torch.long)
        row = torch.cat(rows) if rows else empty
        col = torch.cat(cols) if cols else empty
        return SampledSubgraph(
            n_id=torch.cat(n_ids),
            edge_index=torch.stack([row, col]),
            num_sampled_nodes=hop_nodes,
            num_sampled_edges=hop_edges,
            e_id=torch.cat(eids) if eids else empty,
        )

    def _pick(
        self, frontier: torch.Tensor, nodes: torch.Tensor, k: int, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """CSC positions of the sampled in-edges of ``nodes``, grouped by target, and their targets (local)."""
        start = self.indptr[nodes]
        deg = self.indptr[nodes + 1] - start
        if k < 0:
            cnt = deg
        elif self.replace:
            cnt = torch.where(deg > 0, k, 0)
        else:
            cnt = torch.clamp(deg, max=k)
        total = int(cnt.sum())
        tgt = torch.repeat_interleave(frontier, cnt, output_size=total)
        out_start = torch.cumsum(cnt, 0) - cnt
        if k < 0:
            return _ranges(start, deg, total), tgt
        if self.replace:
            deg_rep = torch.repeat_interleave(deg, cnt, output_size=total)
            draw = (torch.rand(total, dtype=torch.float64, generator=gen) * deg_rep).long()
            return torch.repeat_interleave(start, cnt, output_size=total) + draw, tgt
        pos = torch.empty(total, dtype=torch.long)
        full = deg <= k
        f_start, f_deg, f_out = start[full], deg[full], out_start[full]
        f_total = int(f_deg.sum())
        pos[_ranges(f_out, f_deg, f_total)] = _ranges(f_start, f_deg, f_total)
        part = ~full
        if bool(part.any()):
            p_start, p_deg, p_out = start[part], deg[part], out_start[part]
            p_total = int(p_deg.sum())
            seg = torch.repeat_interleave(torch.arange(p_deg.numel()), p_deg, output_size=p_total)
            seg_begin = torch.cumsum(p_deg, 0) - p_deg
            offset = torch.arange(p_total) - seg_begin[seg]
            key = seg.double() + torch.rand(p_total, dtype=torch.float64, generator=gen)
            order = torch.argsort(key)  # segments stay in place, each one shuffled
            rank = offset  # the i-th sorted entry is the offset[i]-th of its segment
            keep = rank < k
            s_keep = seg[keep]
            pos[p_out[s_keep] + rank[keep]] = p_start[s_keep] + offset[order][keep]
        return pos, tgt


def _ranges(start: torch.Tensor, length: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenation of ``arange(start[i], start[i] + length[i])`` over i."""
    begin = torch.cumsum(length, 0) - length
    idx = torch.arange(total) - torch.repeat_interleave(begin, length, output_size=total)
    return torch.repeat_interleave(start, length, output_size=total) + idx
