"""The feature store of several node types: one tiered store per node type, driven as one store.

Each node type with features has its own chain of tiers (host cache, feature buffer over staging and the SSD
reader of its feature file): rows of different types differ in dimension and dtype. The chains are planned as one
by the planner (:func:`~lightning_ooc.store.planner.plan_hetero_store`: the budgets shared across types by what
the training batches ask of each, the host cache ranked across types, every type's plan fitted under the memory
limit together); :func:`build_hetero_store` allocates every type's tiers of that plan. Reads of all types are in
flight together: :meth:`HeteroFeatureStore.fill` fills every type of a batch at once, one thread per type, each
through its own reader's queue.

:class:`HeteroFeatureStore` has the store protocol the pipeline drives (``claim_batch``, ``fill``, ``pin``,
``attach``, ``release``, ``abandon``, ``without``, ``close``, :mod:`lightning_ooc.store.protocol`), with ``n_id``
and ``x`` per node type; :class:`TypeView` is one node type as the planner and the tiers see a dataset.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lightning_ooc.store.factory import build_store
from lightning_ooc.store.host_cache import HotSet
from lightning_ooc.store.planner import HeteroPlan
from lightning_ooc.store.protocol import missing_type
from lightning_ooc.store.tier import ExtractStats, Fence
from lightning_ooc.store.tiered import Extracted, TieredFeatureStore
from lightning_ooc.utils.cancel import NEVER, CancelToken

__all__ = ["HeteroFeatureStore", "HeteroExtracted", "TypeView", "type_views", "build_hetero_store"]



@dataclass
class HeteroExtracted:
    """One heterogeneous minibatch's claim: an :class:`Extracted` per node type with features."""

    parts: dict[str, Extracted]
    stats: ExtractStats = field(default_factory=ExtractStats)
    released: bool = False


class HeteroFeatureStore:
    """A :class:`~lightning_ooc.store.tiered.TieredFeatureStore` per node type, driven as one store.

    Example::

        >>> import tempfile, torch, lightning_ooc
        >>> from lightning_ooc.data.synth_hetero import synthesize_hetero
        >>> ds = lightning_ooc.open_dataset(synthesize_hetero(tempfile.mkdtemp() + "/h", "mag", num_nodes=500,
        ...                                                   num_features=8, progress=False))
        >>> paper = ds.node("paper")
        >>> store = HeteroFeatureStore({"paper": TieredFeatureStore.create(paper, buffer_slots=64, staging_bytes=4096)})
        >>> n_id = {"paper": torch.tensor([3, 250, 7]), "author": torch.tensor([0, 1])}
        >>> ext = store.extract(n_id)  # a HeteroExtracted: a claim per type with a store
        >>> isinstance(ext, HeteroExtracted), sorted(ext.parts)
        (True, ['paper'])
        >>> x = store.gather(ext)
        >>> sorted(x), bool((x["paper"] == paper.read_features(n_id["paper"])).all())
        (['paper'], True)
        >>> store.release(ext); store.close()
    """

    def __init__(self, stores: dict[str, TieredFeatureStore], parent: "HeteroFeatureStore | None" = None):
        if not stores:
            raise ValueError("a heterogeneous feature store needs a store for at least one node type")
        self.stores = dict(stores)
        #: the node types with features, each with its chain (the store protocol: :mod:`lightning_ooc.store.protocol`)
        self.node_types: tuple[str | None, ...] = tuple(self.stores)
        #: the store this one is a view of (:meth:`without`): it owns the tiers and the fill threads
        self._parent = parent
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False

    # -- the protocol the pipeline drives ------------------------------------------------------------
    def of(self, node_type: str | None) -> TieredFeatureStore:
        """The chain of tiers of ``node_type``."""
        if node_type not in self.stores:
            raise missing_type(node_type, self.node_types)
        return self.stores[node_type]

    def claim_batch(self, data: Any, cancel: CancelToken = NEVER) -> HeteroExtracted:
        """Claim the rows of a ``HeteroData`` batch (its ``n_id`` per node type)."""
        return self.claim({t: data[t].n_id for t in self.stores if t in data.node_types}, cancel, batch=data)

    def attach(self, data: Any, ext: HeteroExtracted, device: torch.device | str | None = None) -> None:
        """Set ``x`` of every node type with features from the claimed rows, on ``device``."""
        for t, x in self.gather(ext, device).items():
            data[t].x = x

    def claim(self, n_id: dict[str, torch.Tensor], cancel: CancelToken = NEVER, batch: Any = None) -> HeteroExtracted:
        """Claim each type's rows in its store (types without a store, i.e. without features, are skipped);
        ``batch``: the sampled minibatch, for tiers that keep rows per batch."""
        ext = HeteroExtracted({})
        try:
            for t, store in self.stores.items():
                ids = n_id.get(t)
                if ids is not None:
                    ext.parts[t] = store.claim(ids, cancel, batch=batch)
        except BaseException:
            self.abandon(ext)
            raise
        return ext

    def fill(self, ext: HeteroExtracted, cancel: CancelToken = NEVER) -> None:
        """Fill every type's rows at once (one thread per type); on any failure every lease is given back."""
        parts = list(ext.parts.items())
        try:
            if len(parts) <= 1:
                for t, part in parts:
                    self.stores[t].fill(part, cancel)
            else:
                pool = self._executor()
                futures = [pool.submit(self.stores[t].fill, part, cancel) for t, part in parts]
                errors = [f.exception() for f in futures]  # waits for all: none is left reading
                first = next((e for e in errors if e is not None), None)
                if first is not None:
                    raise first
        except BaseException:
            self.abandon(ext)
            raise
        for _, part in parts:
            ext.stats.add(part.stats)

    def extract(self, n_id: dict[str, torch.Tensor], cancel: CancelToken = NEVER) -> HeteroExtracted:
        ext = self.claim(n_id, cancel)
        self.fill(ext, cancel)
        return ext

    def pin(self, ext: HeteroExtracted) -> None:
        for t, part in ext.parts.items():
            self.stores[t].pin(part)

    def gather(self, ext: HeteroExtracted, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """``x`` of every type of the batch with features, on ``device`` (default: the CPU)."""
        return {t: self.stores[t].gather(part, device) for t, part in ext.parts.items()}

    def release(self, ext: HeteroExtracted, fence: Fence | None = None) -> None:
        if not ext.released:
            ext.released = True
            for t, part in ext.parts.items():
                self.stores[t].release(part, fence)

    def abandon(self, ext: HeteroExtracted) -> None:
        if not ext.released:
            ext.released = True
            for t, part in ext.parts.items():
                self.stores[t].abandon(part)

    def without(self, name: str) -> "HeteroFeatureStore":
        """Every type's chain with tier ``name`` replaced by its source (evaluation reads past the buffer)."""
        return HeteroFeatureStore({t: s.without(name) for t, s in self.stores.items()}, parent=self._parent or self)

    def tier(self, name: str) -> dict[str, Any]:
        """Tier ``name`` of each type's chain."""
        return {t: s.tier(name) for t, s in self.stores.items()}

    def _executor(self) -> ThreadPoolExecutor:
        if self._parent is not None:
            return self._parent._executor()
        with self._pool_lock:
            if self._closed:
                raise RuntimeError("the feature store is closed")
            if self._pool is None:
                # every extractor may fill a batch at once: a thread per type for each
                self._pool = ThreadPoolExecutor(max_workers=4 * len(self.stores), thread_name_prefix="ooc-fill")
            return self._pool

    def close(self) -> None:
        if self._closed:
            return
        with self._pool_lock:
            self._closed = True
        if self._parent is not None:
            return  # a view: the parent closes the tiers and the threads
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for s in self.stores.values():
            s.close()



class TypeView:
    """One node type as the planner and the tiers see a dataset: its rows (the attributes of its
    :class:`~lightning_ooc.data.hetero_dataset.NodeTypeData`), and the edges of every relation into it.

    >>> import tempfile, lightning_ooc
    >>> from lightning_ooc.data.synth_hetero import synthesize_hetero
    >>> ds = lightning_ooc.open_dataset(synthesize_hetero(tempfile.mkdtemp() + "/h", "mag", num_nodes=500,
    ...                                                   num_features=8, progress=False))
    >>> paper = type_views(ds)["paper"]  # in MAG only papers have features
    >>> isinstance(paper, TypeView), paper.num_nodes == ds.node("paper").num_nodes
    (True, True)
    >>> int(paper.in_degree.sum()) == paper.num_edges
    True
    """

    def __init__(self, ds: Any, node_type: str):
        self.node = ds.node(node_type)
        self._into = [csc for et, csc in ds.csc.items() if et[2] == node_type]
        self.num_edges = sum(csc.num_edges for csc in self._into)

    @property
    def in_degree(self) -> np.ndarray:
        """In-degree over every relation into the type (computed on each access, not kept)."""
        deg = np.zeros(self.node.num_nodes, dtype=np.int64)
        for csc in self._into:
            deg += np.diff(csc.indptr)
        return deg

    def __getattr__(self, name: str) -> Any:
        return getattr(self.node, name)


def type_views(ds: Any) -> dict[str, TypeView]:
    """A :class:`TypeView` of every node type with features."""
    return {t: TypeView(ds, t) for t in ds.node_types if ds.node(t).has_features}


def build_hetero_store(plan: HeteroPlan, hots: dict[str, HotSet], views: dict[str, TypeView],
                       readers: dict[str, Any], device: torch.device, *,
                       progress: bool = True) -> HeteroFeatureStore:  # fmt: skip
    """Allocate every type's tiers of ``plan`` (a failure closes what was built)."""
    stores: dict[str, TieredFeatureStore] = {}
    try:
        for t, p in plan.plans.items():
            stores[t] = build_store(p, hots[t], views[t], readers[t], device, progress=progress)
    except BaseException:
        for s in stores.values():
            s.close()
        raise
    return HeteroFeatureStore(stores)
