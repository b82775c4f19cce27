"""The ``pyg_store`` backend: node classification over any PyG ``(FeatureStore, GraphStore)`` pair.

``OutOfCoreNodeData((feature_store, graph_store), ...)`` trains from the pair of any PyG backend (ours,
:func:`lightning_ooc.pyg.open_pyg_stores`, or a remote or database-backed one) instead of a dataset
directory:

* the topology is the graph store's CSC, taken once (``graph_store.csc()``) and sampled by our native
  sampler in the sampler threads;
* ``x`` comes through the feature store's ``multi_get_tensor``, called by the extractor threads with a
  batch's node ids (:class:`StorePairTier`), so a slow store gets the pipeline's concurrency
  (``num_extractors`` requests at once) and out-of-order batches;
* ``y`` (group ``None``) is read once; the splits are the store's ``train_mask`` / ``val_mask`` /
  ``test_mask`` (PyG's names), or ``train_idx`` / ``val_idx`` / ``test_idx`` (node ids).

It runs in the training process (no gather process: ``mps_split`` is refused) and serves node
classification on a homogeneous graph. The feature store is called from several threads at once: give a
store that is not thread-safe ``num_extractors=1``.

Example (PyG's own in-memory stores standing in for any backend)::

    >>> import torch
    >>> from torch_geometric.distributed import LocalFeatureStore, LocalGraphStore
    >>> from lightning_ooc import OutOfCoreNodeData
    >>> n = 500
    >>> fs = LocalFeatureStore.from_data(torch.arange(n), x=torch.randn(n, 8), y=torch.arange(n) % 3)
    >>> _ = fs.put_tensor(torch.arange(n) < 200, group_name=None, attr_name="train_mask", index=None)
    >>> gs = LocalGraphStore.from_data(None, torch.randint(0, n, (2, 2000)), num_nodes=n)
    >>> dm = OutOfCoreNodeData((fs, gs), batch_size=50, num_neighbors=[4, 4], progress=False)
    >>> dm.num_features, dm.num_classes
    (8, 3)
    >>> dm.setup("fit")
    >>> batch = next(iter(dm.train_dataloader()))
    >>> batch.x.shape[1], batch.batch_size
    (8, 50)
    >>> dm.teardown("fit")
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import numpy as np
import torch

from lightning_ooc.data.format import SPLITS
from lightning_ooc.errors import InputError
from lightning_ooc.loader.source import LocalPasses
from lightning_ooc.loader.tasks import check_labelled
from lightning_ooc.store.protocol import StoreProtocol
from lightning_ooc.store.tier import FeatureTier, Lease
from lightning_ooc.store.tiered import TieredFeatureStore
from lightning_ooc.utils.cancel import NEVER, CancelToken

log = logging.getLogger("lightning_ooc")


def is_store_pair(obj: Any) -> bool:
    """Whether ``obj`` is a PyG ``(FeatureStore, GraphStore)`` pair."""
    if not isinstance(obj, (tuple, list)) or len(obj) != 2:
        return False
    from torch_geometric.data import FeatureStore as PygFeatureStore  # lazy: PyG's base classes
    from torch_geometric.data import GraphStore as PygGraphStore  # lazy: PyG's base classes

    return isinstance(obj[0], PygFeatureStore) and isinstance(obj[1], PygGraphStore)


def _attr(group: Any, name: str, index: Any = None) -> Any:
    from torch_geometric.data import TensorAttr  # lazy: PyG's attribute key

    return TensorAttr(group_name=group, attr_name=name, index=index)


class StorePairGraph:
    """A PyG store pair seen as a homogeneous dataset (what the node task and the sampler read).

    Reads the topology (``graph_store.csc()``), ``y`` and the splits into memory once; ``x`` stays in the
    feature store, read per batch by :class:`StorePairTier`.
    """

    is_hetero = False

    def __init__(self, feature_store: Any, graph_store: Any):
        self.feature_store, self.graph_store = feature_store, graph_store
        self.root = self.name_of(feature_store, graph_store)
        attrs = graph_store.get_all_edge_attrs()
        if not attrs:
            raise InputError(f"{self.root}: the graph store holds no edges")
        types = sorted({str(a.edge_type) for a in attrs})
        if any(a.edge_type is not None for a in attrs):
            raise InputError(f"{self.root}: a heterogeneous graph store (edge types {', '.join(types)}); the store "
                             "pair source serves a homogeneous graph (edge type None)")  # fmt: skip
        have = {(a.group_name, a.attr_name) for a in feature_store.get_all_tensor_attrs()}
        if (None, "x") not in have or (None, "y") not in have:
            raise InputError(f"{self.root}: node classification needs x and y of group None in the feature store; "
                             f"it holds {sorted(have, key=str) or 'nothing'}")  # fmt: skip
        row, colptr, perm = graph_store.csc()
        #: the graph store's edge id of each CSC position (None: the same), what a batch's ``e_id`` gives
        self.edge_perm = None if perm is None else torch.as_tensor(perm).to(torch.int64)
        self.indptr = np.ascontiguousarray(torch.as_tensor(colptr).to(torch.int64).numpy())
        self.indices = np.ascontiguousarray(torch.as_tensor(row).numpy())
        if self.indices.dtype not in (np.int32, np.int64):
            self.indices = self.indices.astype(np.int64)
        self.num_nodes = int(self.indptr.size - 1)
        self.num_edges = int(self.indices.size)
        size = feature_store.get_tensor_size(None, "x", None)
        if size is None or len(size) != 2:
            raise InputError(f"{self.root}: x must be a [num_nodes, num_features] tensor, its size is {size}")
        if int(size[0]) != self.num_nodes:
            raise InputError(f"{self.root}: x has {size[0]} rows, the graph store's CSC {self.num_nodes} nodes")
        self.num_features = int(size[1])
        probe = torch.as_tensor(feature_store.get_tensor(_attr(None, "x", torch.tensor([0]))))
        self.feature_dtype = probe.dtype
        self.row_bytes = self.num_features * probe.element_size()
        y = torch.as_tensor(feature_store.get_tensor(_attr(None, "y", None))).reshape(-1)
        if y.numel() != self.num_nodes or y.dtype.is_floating_point:
            raise InputError(f"{self.root}: y must hold one integer class per node ({self.num_nodes}), got "
                             f"{y.dtype}{list(y.shape)}")  # fmt: skip
        self.labels = y.to(torch.int64).numpy()
        seen = self.labels[self.labels >= 0]
        self.num_classes = int(seen.max()) + 1 if seen.size else 0
        self._splits = {s: self._read_split(s, have) for s in SPLITS}
        self.identity = (f"pyg-stores:{type(feature_store).__name__}:{type(graph_store).__name__}:"
                         f"{self.num_nodes}:{self.num_edges}:{self.num_features}")  # fmt: skip

    @staticmethod
    def name_of(feature_store: Any, graph_store: Any) -> str:
        """The pair in words, where messages name a dataset's directory."""
        return f"PyG store pair ({type(feature_store).__name__}, {type(graph_store).__name__})"

    def _read_split(self, split: str, have: set[Any]) -> torch.Tensor:
        if (None, f"{split}_mask") in have:
            mask = torch.as_tensor(self.feature_store.get_tensor(_attr(None, f"{split}_mask", None))).reshape(-1)
            if mask.dtype != torch.bool or mask.numel() != self.num_nodes:
                raise InputError(f"{self.root}: {split}_mask must be {self.num_nodes} booleans, got "
                                 f"{mask.dtype}{list(mask.shape)}")  # fmt: skip
            return mask.nonzero().view(-1)
        if (None, f"{split}_idx") in have:
            ids = torch.as_tensor(self.feature_store.get_tensor(_attr(None, f"{split}_idx", None))).reshape(-1)
            return ids.to(torch.int64)
        if split == "train":
            raise InputError(f"{self.root}: the feature store has no train_mask or train_idx of group None; put the "
                             "training nodes there (and val_mask, test_mask for evaluation)")  # fmt: skip
        return torch.empty(0, dtype=torch.int64)

    def split(self, name: str) -> torch.Tensor:
        if name not in SPLITS:
            raise KeyError(f"unknown split {name!r}; splits are {', '.join(SPLITS)}")
        return self._splits[name]

    def unlabelled(self, name: str) -> np.ndarray:
        ids = np.sort(self.split(name).numpy())
        y = self.labels[ids]
        return ids[(y < 0) | (y >= self.num_classes)]

    def read_features(self, ids: Any) -> torch.Tensor:
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.int64).reshape(-1)
        return torch.as_tensor(self.feature_store.get_tensor(_attr(None, "x", ids)))

    def __repr__(self) -> str:
        return f"StorePairGraph({self.root}, num_nodes={self.num_nodes}, num_edges={self.num_edges})"


class StorePairTier(FeatureTier):
    """Every row, from a PyG feature store: one ``multi_get_tensor`` of the batch's ids per batch, called by
    the extractor thread that fills the batch."""

    name = "pyg_store"

    def __init__(self, graph: StorePairGraph):
        self.graph = graph

    def claim(self, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        return Lease(self, torch.ones(ids.numel(), dtype=torch.bool), {"ids": ids})

    def fill(self, lease: Lease, cancel: CancelToken = NEVER) -> None:
        g = self.graph
        ids = lease.handle["ids"]
        cancel.check()
        (rows,) = g.feature_store.multi_get_tensor([_attr(None, "x", ids)])
        rows = torch.as_tensor(rows)
        if rows.shape != (ids.numel(), g.num_features):
            raise InputError(f"{g.root}: multi_get_tensor of x for {ids.numel()} ids returned "
                             f"{list(rows.shape)}, not [{ids.numel()}, {g.num_features}]")  # fmt: skip
        lease.handle["rows"] = rows.to(g.feature_dtype)
        lease.stats.misses += int(ids.numel())

    def rows(self, lease: Lease, device: torch.device) -> torch.Tensor:
        return lease.handle["rows"].to(device, non_blocking=True)

    def release(self, lease: Lease, fence: Any = None) -> None:
        lease.released = True
        lease.handle.pop("rows", None)


class StorePairPasses(LocalPasses):
    """A task's passes over a PyG store pair (see the module docstring): the tiered pipeline, with one tier,
    the feature store."""

    def __init__(self, cfg: Any, ctx: Any, stores: Any = None):
        if isinstance(stores, StorePairGraph):
            graph = stores
        elif stores is not None and is_store_pair(stores):
            graph = StorePairGraph(*stores)
        else:
            raise InputError("the pyg_store backend needs stores=(feature_store, graph_store)")
        if ctx.remote is not None:
            raise InputError("a PyG store pair runs its passes in the training process; mps_split (a gather "
                             "process) is not supported with one: leave mps_split unset")  # fmt: skip
        check_labelled(graph)
        super().__init__(cfg, ctx, dataset=graph)

    def _check_before_presample(self) -> None:
        """No plan: the rows stay in the feature store."""

    def _presample_batches(self) -> int:
        return 1

    def _open_reader(self, ds: Any) -> None:
        return None

    def _close_reader(self, reader: Any) -> None:
        pass

    def _build_store(self, reader: Any, presampled: Any, counted: Callable[[], Iterator[Any]] | None = None
                     ) -> StoreProtocol:  # fmt: skip
        self.plan = None
        g = self.dataset
        return TieredFeatureStore([StorePairTier(g)], g.num_features, g.feature_dtype)

    def describe(self, presampled: Any) -> str:
        g, cfg = self.dataset, self.cfg
        p = cfg.pipeline
        return (f"lightning_ooc over {g.root}: {g.num_nodes:,} nodes, {g.num_edges:,} edges, x {g.num_features} x "
                f"{g.feature_dtype} through its multi_get_tensor; {p.num_samplers} samplers, {p.num_extractors} "
                f"extractors, {p.order}")  # fmt: skip
