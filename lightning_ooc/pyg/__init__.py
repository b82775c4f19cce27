"""PyG interoperability: our dataset and tiers behind PyG's ``FeatureStore`` / ``GraphStore`` interface.

* :func:`open_pyg_stores` opens a dataset as the ``(feature_store, graph_store)`` pair PyG's loaders take
  (:mod:`lightning_ooc.pyg.dataset_stores`): ``NeighborLoader((fs, gs), ...)`` reads features through our tiers,
  with our sampler (:class:`~lightning_ooc.sampling.PyGNeighborSampler` as ``neighbor_sampler=``) or
  PyG's own (pyg-lib or torch-sparse, where installed).
"""
from lightning_ooc.pyg.dataset_stores import (OutOfCoreFeatureStore, OutOfCoreGraphStore, PyGStoreOptions,
                                              open_pyg_stores)  # fmt: skip

__all__ = ["OutOfCoreFeatureStore", "OutOfCoreGraphStore", "PyGStoreOptions", "open_pyg_stores"]
