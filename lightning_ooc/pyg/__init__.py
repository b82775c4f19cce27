"""PyG interoperability: our dataset and tiers behind PyG's ``FeatureStore`` / ``GraphStore`` interface.

* :func:`open_pyg_stores` opens a dataset as the ``(feature_store, graph_store)`` pair PyG's loaders take
  (:mod:`lightning_ooc.pyg.dataset_stores`), a :class:`PyGStores` with the dataset's splits, classes and
  metadata; ``NeighborLoader((fs, gs), ...)`` reads features through our tiers, with our sampler or PyG's own
  (pyg-lib or torch-sparse, where installed).
* :class:`NeighborLoader` and :class:`LinkNeighborLoader` (:mod:`lightning_ooc.pyg.loaders`): PyG's loaders
  with our native sampler built from their own arguments (``num_neighbors``, ``replace``, ``disjoint``).
"""
from lightning_ooc.pyg.dataset_stores import (OutOfCoreFeatureStore, OutOfCoreGraphStore, PyGStoreOptions, PyGStores,
                                              StoreTransformError, open_pyg_stores)  # fmt: skip
from lightning_ooc.pyg.loaders import LinkNeighborLoader, NeighborLoader

__all__ = ["OutOfCoreFeatureStore", "OutOfCoreGraphStore", "PyGStoreOptions", "PyGStores", "StoreTransformError",
           "open_pyg_stores", "NeighborLoader", "LinkNeighborLoader"]
