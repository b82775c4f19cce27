"""PyG adapter: :class:`PyGNeighborSampler`, our sampler behind PyG's ``BaseSampler``.

With it, PyG's own ``NodeLoader`` drives the native sampler over an
in-memory ``Data`` (its CSC is built once with torch ops), and the
minibatches come out exactly as ``NeighborLoader``'s would, edge attributes
included (through :attr:`edge_permutation`). PyG's ``LinkLoader`` drives it
too (:meth:`PyGNeighborSampler.sample_from_edges` runs PyG's own link logic,
``edge_sample``, over the native node sampling), as ``LinkNeighborLoader``
would, without pyg-lib or torch-sparse.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch_geometric.sampler import BaseSampler, NodeSamplerInput, SamplerOutput

from lightning_ooc.errors import InputError
from lightning_ooc.sampling.csc import CSCGraph
from lightning_ooc.sampling.neighbor import NeighborSampler


class PyGNeighborSampler(BaseSampler):
    """A PyG ``BaseSampler`` whose ``sample_from_nodes`` runs :class:`NeighborSampler`.

    Args:
        data: a homogeneous PyG ``Data`` held in memory (its ``edge_index`` is
            turned into an in-edge CSC), or a ready :class:`NeighborSampler`
            (then ``num_neighbors`` and ``replace`` come from it).
        num_neighbors: fanout per hop, ``-1`` for all neighbours.
        replace: sample with replacement.

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
    """

    def __init__(self, data: Any, num_neighbors: Sequence[int] | None = None, replace: bool = False):
        if isinstance(data, NeighborSampler):
            if num_neighbors is not None:
                raise InputError("pass num_neighbors either to the NeighborSampler or here, not both")
            self.sampler = data
            self._perm = getattr(data.graph, "perm", None)
        else:
            if num_neighbors is None:
                raise InputError("num_neighbors is required when sampling from a Data object")
            if hasattr(data, "node_types") and len(getattr(data, "node_types", [])) > 1:
                raise InputError("heterogeneous graphs are not supported; pass a homogeneous Data")
            graph = CSCGraph.from_data(data)
            self.sampler = NeighborSampler(graph, num_neighbors, replace)
            self._perm = graph.perm
        self.num_neighbors = self.sampler.num_neighbors
        self.replace = self.sampler.replace

    @staticmethod
    def _homogeneous(index: Any) -> None:
        if index.input_type is not None:
            raise InputError("heterogeneous sampling is not supported")
        if index.time is not None:
            raise InputError("temporal sampling is not supported")

    def _sample(self, seeds: torch.Tensor, seed_time: Any = None) -> SamplerOutput:
        out = self.sampler.sample_subgraph(seeds, e_id=True)
        return SamplerOutput(node=out.n_id, row=out.edge_index[0], col=out.edge_index[1], edge=out.e_id,
                             num_sampled_nodes=out.num_sampled_nodes, num_sampled_edges=out.num_sampled_edges)  # fmt: skip

    def sample_from_nodes(self, index: NodeSamplerInput, **kwargs: Any) -> SamplerOutput:
        self._homogeneous(index)
        out = self._sample(index.node)
        out.metadata = (index.input_id, index.time)
        return out

    def sample_from_edges(self, index: Any, neg_sampling: Any = None) -> SamplerOutput:
        """Seed edges and their negatives, through PyG's ``edge_sample`` (not disjoint, homogeneous)."""
        from torch_geometric.sampler.neighbor_sampler import edge_sample  # lazy: PyG only where it is used

        self._homogeneous(index)
        return edge_sample(index, self._sample, self.sampler.num_nodes, False, None, neg_sampling)

    @property
    def edge_permutation(self) -> torch.Tensor | None:
        """CSC position -> column of the original ``edge_index`` (None for an on-disk graph)."""
        return self._perm
