"""A plain-Python reference of heterogeneous neighbour sampling: :class:`HeteroReferenceSampler`.

It follows the definition in :mod:`lightning_ooc.sampling.hetero_sampler` line by
line, with Python lists, dicts and :class:`random.Random`, and is meant for
tests on small graphs: the native
:class:`~lightning_ooc.sampling.HeteroNeighborSampler` must give exactly its
output when every fanout is ``-1`` (no randomness), and the same
distribution otherwise (the random streams differ).
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from lightning_ooc.errors import InputError
from lightning_ooc.sampling.csc import EdgeType, check_edge_type
from lightning_ooc.sampling.hetero_sampler import HeteroSampledSubgraph, check_hetero_num_neighbors
from lightning_ooc.sampling.neighbor import as_seeds, draw_seed


class HeteroReferenceSampler:
    """Heterogeneous neighbour sampling in plain Python (slow; for tests).

    Same arguments as :class:`~lightning_ooc.sampling.HeteroNeighborSampler`
    and the same :meth:`sample_subgraph` output (``e_id`` always included).

    Example::

        >>> import torch
        >>> from torch_geometric.data import HeteroData
        >>> from lightning_ooc.sampling import HeteroCSCGraph
        >>> from lightning_ooc.sampling.hetero_reference import HeteroReferenceSampler
        >>> data = HeteroData()
        >>> data['paper'].num_nodes, data['author'].num_nodes = 3, 2
        >>> data['author', 'writes', 'paper'].edge_index = torch.tensor([[0, 1, 1], [0, 0, 2]])
        >>> ref = HeteroReferenceSampler(HeteroCSCGraph.from_hetero_data(data), [-1])
        >>> out = ref.sample_subgraph([0, 2], 'paper')
        >>> out.n_id['author'].tolist(), out.edge_index['author', 'writes', 'paper'].tolist()
        ([0, 1], [[0, 1, 1], [0, 0, 1]])
        >>> out.num_sampled_nodes, out.e_id['author', 'writes', 'paper'].tolist()
        ({'paper': [2, 0], 'author': [0, 2]}, [0, 1, 2])
    """

    def __init__(self, graph: Any, num_neighbors: Any, replace: bool = False):
        self.node_types: list[str] = list(graph.node_types)
        self.num_nodes_dict = {t: int(graph.num_nodes_dict[t]) for t in self.node_types}
        self.edge_types: list[EdgeType] = [check_edge_type(et, self.num_nodes_dict) for et in graph.edge_types]
        self.num_neighbors, self.num_hops = check_hetero_num_neighbors(num_neighbors, self.edge_types)
        self.replace = bool(replace)
        self.indptr = {et: np.asarray(graph.csc[et].indptr).tolist() for et in self.edge_types}
        self.indices = {et: np.asarray(graph.csc[et].indices).tolist() for et in self.edge_types}

    def _choose(self, rng: random.Random, start: int, deg: int, k: int) -> list[int]:
        """CSC positions of the in-edges chosen for one target whose in-edges are ``[start, start + deg)``."""
        if k < 0 or (not self.replace and k >= deg):
            return list(range(start, start + deg))
        if self.replace:
            return [start + rng.randrange(deg) for _ in range(k)] if deg > 0 else []
        return [start + j for j in rng.sample(range(deg), k)]

    def sample_subgraph(self, seeds: Any, input_type: str, seed: int | None = None) -> HeteroSampledSubgraph:
        if input_type not in self.num_nodes_dict:
            raise InputError(f"input type {input_type!r} is not a node type of the graph")
        rng = random.Random(draw_seed(seed))
        seed_list = as_seeds(seeds, self.num_nodes_dict[input_type], node_type=input_type).tolist()

        n_id: dict[str, list[int]] = {t: [] for t in self.node_types}  # local id -> global id, per type
        local: dict[str, dict[int, int]] = {t: {} for t in self.node_types}  # global id -> local id, per type
        for i, s in enumerate(seed_list):
            local[input_type].setdefault(s, i)  # a repeated seed maps to its first place
            n_id[input_type].append(s)
        hop_nodes = {t: [len(n_id[t])] for t in self.node_types}
        rows: dict[EdgeType, list[int]] = {et: [] for et in self.edge_types}
        cols: dict[EdgeType, list[int]] = {et: [] for et in self.edge_types}
        eids: dict[EdgeType, list[int]] = {et: [] for et in self.edge_types}
        hop_edges: dict[EdgeType, list[int]] = {et: [] for et in self.edge_types}
        frontier = {t: range(0, len(n_id[t])) for t in self.node_types}

        for h in range(self.num_hops):
            for et in self.edge_types:
                src, _, dst = et
                indptr, indices, k = self.indptr[et], self.indices[et], self.num_neighbors[et][h]
                before = len(rows[et])
                for target in frontier[dst]:  # fixed at the start of the hop
                    v = n_id[dst][target]
                    for e in self._choose(rng, indptr[v], indptr[v + 1] - indptr[v], k):
                        u = indices[e]
                        if u not in local[src]:
                            local[src][u] = len(n_id[src])
                            n_id[src].append(u)
                        rows[et].append(local[src][u])
                        cols[et].append(target)
                        eids[et].append(e)
                hop_edges[et].append(len(rows[et]) - before)
            for t in self.node_types:  # what each type gained is its next frontier
                frontier[t] = range(frontier[t].stop, len(n_id[t]))
                hop_nodes[t].append(len(frontier[t]))

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long)

        return HeteroSampledSubgraph(
            n_id={t: tensor(ids) for t, ids in n_id.items()},
            edge_index={et: torch.stack([tensor(rows[et]), tensor(cols[et])]) for et in self.edge_types},
            num_sampled_nodes=hop_nodes,
            num_sampled_edges=hop_edges,
            input_type=input_type,
            e_id={et: tensor(eids[et]) for et in self.edge_types},
        )
