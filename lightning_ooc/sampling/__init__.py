"""Neighbour sampling: the native :class:`NeighborSampler` and :class:`HeteroNeighborSampler`, a PyG adapter and references.

* :class:`NeighborSampler` samples minibatches shaped like PyG
  ``NeighborLoader`` output from an on-disk dataset or a :class:`CSCGraph`;
* :class:`HeteroNeighborSampler` does the same for a heterogeneous graph
  (a :class:`HeteroCSCGraph`, one CSC per edge type): ``HeteroData``
  minibatches shaped like ``NeighborLoader``'s on a ``HeteroData``;
* :class:`PyGNeighborSampler` puts both behind PyG's ``BaseSampler`` so PyG's
  loaders can drive them (``neighbor_sampler=``) over an in-memory ``Data`` or
  ``HeteroData``, or a ``(FeatureStore, GraphStore)`` pair;
* :class:`TorchNeighborSampler` does the same sampling with vectorised torch
  ops; it is the reference of ``lightning-ooc bench sample``;
* :class:`~lightning_ooc.sampling.hetero_reference.HeteroReferenceSampler`
  is the plain-Python reference of the heterogeneous sampling (for tests);
* :class:`NegativeSampler` draws the negative edges of link prediction
  (PyG's binary and triplet modes, uniform or by degree, optionally strict).
"""
from lightning_ooc.sampling.csc import CSCGraph, HeteroCSCGraph
from lightning_ooc.sampling.hetero_sampler import (HeteroNeighborSampler, HeteroSampledSubgraph,
                                                   check_hetero_num_neighbors)  # fmt: skip
from lightning_ooc.sampling.negative import NegativeSampler, NegativeSampling, Negatives
from lightning_ooc.sampling.neighbor import NeighborSampler, SampledSubgraph, release_thread_workspace
from lightning_ooc.sampling.pyg import PyGNeighborSampler
from lightning_ooc.sampling.reference import TorchNeighborSampler

__all__ = [
    "CSCGraph",
    "HeteroCSCGraph",
    "HeteroNeighborSampler",
    "HeteroSampledSubgraph",
    "NeighborSampler",
    "NegativeSampler",
    "NegativeSampling",
    "Negatives",
    "SampledSubgraph",
    "PyGNeighborSampler",
    "TorchNeighborSampler",
    "check_hetero_num_neighbors",
    "release_thread_workspace",
]
