"""Neighbour sampling: the native :class:`NeighborSampler`, its PyG adapter and a torch reference.

* :class:`NeighborSampler` samples minibatches shaped like PyG
  ``NeighborLoader`` output from an on-disk dataset or a :class:`CSCGraph`;
* :class:`PyGNeighborSampler` puts it behind PyG's ``BaseSampler`` so PyG's
  ``NodeLoader`` can drive it over an in-memory ``Data``;
* :class:`TorchNeighborSampler` does the same sampling with vectorised torch
  ops; it is the reference of ``lightning-ooc bench sample``;
* :class:`NegativeSampler` draws the negative edges of link prediction
  (PyG's binary and triplet modes, uniform or by degree, optionally strict).
"""
from lightning_ooc.sampling.csc import CSCGraph
from lightning_ooc.sampling.negative import NegativeSampler, NegativeSampling, Negatives
from lightning_ooc.sampling.neighbor import NeighborSampler, SampledSubgraph, release_thread_workspace
from lightning_ooc.sampling.pyg import PyGNeighborSampler
from lightning_ooc.sampling.reference import TorchNeighborSampler

__all__ = [
    "CSCGraph",
    "NeighborSampler",
    "NegativeSampler",
    "NegativeSampling",
    "Negatives",
    "SampledSubgraph",
    "PyGNeighborSampler",
    "TorchNeighborSampler",
    "release_thread_workspace",
]
