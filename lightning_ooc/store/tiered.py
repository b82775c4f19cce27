"""The tiered feature store: a chain of tiers, each serving the ids the tiers before it did not.

The store knows only the tier protocol (:mod:`lightning_ooc.store.tier`). For
one minibatch, :meth:`TieredFeatureStore.claim` asks every tier in turn which
of the remaining ids it serves; :meth:`fill` lets each tier make its rows
readable (an extractor thread, blocking on I/O); :meth:`gather` assembles
``x`` on the training device in the trainer; :meth:`release` hands every
tier its part back with the completion fence of the gather. A failure
between claim and fill gives every lease back (:meth:`abandon`), and leaves
the store usable by the next extraction.

The datamodule's training chain is ``host cache -> feature buffer (filled
from staging + reader)``; evaluation passes use the same chain
:meth:`without` the buffer, which reads past it and holds no slot.

Example::

    >>> import tempfile, torch, lightning_ooc
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.store.tiered import TieredFeatureStore
    >>> ds = lightning_ooc.open_dataset(synthesize(tempfile.mkdtemp() + "/g", num_nodes=500, avg_degree=4,
    ...                                            num_features=8, num_classes=2, progress=False))
    >>> store = TieredFeatureStore.create(ds, buffer_slots=64, staging_bytes=8192, host_ids=torch.arange(10))
    >>> [t.name for t in store.tiers], [t.name for t in store.without("buffer").tiers]
    (['host_cache', 'buffer'], ['host_cache', 'ssd'])
    >>> n_id = torch.tensor([3, 250, 7, 499])
    >>> ext = store.extract(n_id)
    >>> bool((store.gather(ext) == ds.read_features(n_id)).all())
    True
    >>> store.release(ext); store.close()
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from lightning_ooc.store.protocol import HOMOGENEOUS, missing_type
from lightning_ooc.store.tier import ExtractStats, FeatureTier, Fence, Lease
from lightning_ooc.utils.cancel import NEVER, CancelToken
from lightning_ooc.io import FeatureReader
from lightning_ooc.store.feature_buffer import FeatureBuffer
from lightning_ooc.store.staging import StagingBuffer


@dataclass
class Extracted:
    """One minibatch's claim on the tiers: a lease per tier that serves part of it."""

    n_id: torch.Tensor
    leases: list[Lease]
    stats: ExtractStats = field(default_factory=ExtractStats)
    released: bool = False
    #: for a batch that names a node more than once (disjoint subgraphs: a node in two seeds' subgraphs), the
    #: tiers are asked for each distinct node once: ``rows`` of them, and ``inverse`` maps ``n_id`` onto them
    inverse: torch.Tensor | None = None
    rows: int = 0


def repeats_nodes(batch: Any) -> bool:
    """Whether a sampled minibatch may name a node more than once: disjoint subgraphs (PyG's ``batch`` vector,
    per node type of a ``HeteroData``), where a node reached from two seeds is in both."""
    if batch is None:
        return False
    stores = batch.node_stores if hasattr(batch, "node_stores") else [batch]
    return any(isinstance(getattr(s, "batch", None), torch.Tensor) for s in stores)


class TieredFeatureStore:
    """A chain of :class:`~lightning_ooc.store.tier.FeatureTier`; the last one serves every id left.

    Args:
        tiers: the chain, first asked first.
        num_features, dtype: shape of a row.
        owned: the tiers this store closes in :meth:`close` (default: the chain and their sources).
    """

    def __init__(self, tiers: Sequence[FeatureTier], num_features: int, dtype: torch.dtype,
                 owned: Sequence[FeatureTier] | None = None):  # fmt: skip
        if not tiers:
            raise ValueError("a feature store needs at least one tier")
        self.tiers = list(tiers)
        self.num_features = int(num_features)
        self.dtype = dtype
        if owned is None:
            owned = []
            for t in self.tiers:
                while t is not None and t not in owned:
                    owned.append(t)
                    t = t.source
        self._owned = list(owned)
        self._closed = False

    @classmethod
    def create(cls, ds, *, buffer_slots: int, staging_bytes: int, host_ids: torch.Tensor | None = None,
               device: str | torch.device = "cpu", reserve: int = 0, backend: str = "auto",
               workers: int = 1, progress: bool = False) -> "TieredFeatureStore":  # fmt: skip
        """Build the usual chain for a dataset (for tests and scripts; the datamodule plans the sizes)."""
        from lightning_ooc.store.host_cache import HostCache  # lazy: it imports Triton
        from lightning_ooc.store.tiers import BufferTier, HostCacheTier, ReaderTier  # lazy: it imports Triton

        reader = FeatureReader.from_dataset(ds, backend=backend, workers=workers)
        device = torch.device(device)
        buffer = FeatureBuffer(buffer_slots, ds.num_nodes, ds.num_features, ds.feature_dtype, device, reserve)
        staging = StagingBuffer(staging_bytes, ds.num_features, ds.feature_dtype, pin=device.type == "cuda")
        tiers: list[FeatureTier] = []
        if host_ids is not None and host_ids.numel():
            host = HostCache.load(reader, host_ids, ds.num_nodes, register=device.type == "cuda", progress=progress)
            tiers.append(HostCacheTier(host))
        tiers.append(BufferTier(buffer, ReaderTier(reader, staging)))
        return cls(tiers, ds.num_features, ds.feature_dtype)

    #: the one node type of a homogeneous graph (the store protocol: :mod:`lightning_ooc.store.protocol`)
    node_types: tuple[str | None, ...] = (HOMOGENEOUS,)

    def of(self, node_type: str | None) -> "TieredFeatureStore":
        """This store, the chain of the one node type ``None``."""
        if node_type is not HOMOGENEOUS:
            raise missing_type(node_type, self.node_types)
        return self

    def tier(self, name: str) -> FeatureTier | None:
        """The tier of the chain (or a source of one) called ``name``."""
        return next((t for t in self._owned if t.name == name), None)

    def without(self, name: str) -> "TieredFeatureStore":
        """The same chain with tier ``name`` replaced by its source (it closes nothing of this store), for passes
        that must not change what the training chain learns from its lookups (evaluation): a tier with a
        ``frozen()`` view (a scored host cache, a host cache ranked from the epoch's batches) is read through it."""
        tiers = [t.source if t.name == name else t for t in self.tiers]
        tiers = [t.frozen() if hasattr(t, "frozen") else t for t in tiers if t is not None]
        return TieredFeatureStore(tiers, self.num_features, self.dtype, owned=[])

    def inserted(self, tier: FeatureTier, after: str | None = None) -> "TieredFeatureStore":
        """This chain with ``tier`` put right after tier ``after`` (first where the chain has no such tier); the
        store returned owns this one's tiers and ``tier`` (close it instead of this one)."""
        at = next((i + 1 for i, t in enumerate(self.tiers) if t.name == after), 0)
        return TieredFeatureStore(self.tiers[:at] + [tier] + self.tiers[at:], self.num_features, self.dtype,
                                  owned=self._owned + [tier])  # fmt: skip

    # -- extractor side ---------------------------------------------------------------------
    def claim_batch(self, data: Any, cancel: CancelToken = NEVER) -> Extracted:
        """Claim the rows of a minibatch (its ``n_id``): what the pipeline calls."""
        return self.claim(data.n_id, cancel, batch=data)

    def claim(self, n_id: torch.Tensor, cancel: CancelToken = NEVER, batch: Any = None) -> Extracted:
        """Ask each tier in turn which of the ids left it serves (may wait for room in a tier); ``batch``, the
        sampled minibatch the ids are of, goes to each tier's ``claim_for``."""
        n_id = n_id.to(torch.int64)
        distinct, inverse = (torch.unique(n_id, return_inverse=True) if repeats_nodes(batch)
                             else (n_id, None))  # fmt: skip
        left = torch.arange(distinct.numel())
        ext = Extracted(n_id, [], inverse=inverse, rows=distinct.numel())
        try:
            for tier in self.tiers:
                if left.numel() == 0:
                    break
                ids = distinct[left]
                lease = tier.claim(ids, cancel) if batch is None else tier.claim_for(batch, ids, cancel)
                lease.positions = left[lease.mask]
                left = left[~lease.mask]
                ext.leases.append(lease)
            if left.numel():
                raise RuntimeError(f"no tier of the store served {left.numel()} ids (the last tier must serve all)")
        except BaseException:
            self.abandon(ext)
            raise
        return ext

    def fill(self, ext: Extracted, cancel: CancelToken = NEVER) -> None:
        """Make every claimed row readable (I/O); on failure every lease is given back."""
        try:
            for lease in ext.leases:
                lease.tier.fill(lease, cancel)
        except BaseException:
            self.abandon(ext)
            raise
        for lease in ext.leases:
            ext.stats.add_tier(lease.tier.name, lease.stats)

    def extract(self, n_id: torch.Tensor, cancel: CancelToken = NEVER) -> Extracted:
        """:meth:`claim` then :meth:`fill`."""
        ext = self.claim(n_id, cancel)
        self.fill(ext, cancel)
        return ext

    def pin(self, ext: Extracted) -> None:
        """Pin the minibatch's index tensors (extractor side, for a CUDA trainer): see :meth:`gather`."""
        for lease in ext.leases:
            if lease.positions is not None:
                lease.positions = lease.positions.pin_memory()
            lease.tier.pin(lease)
        if ext.inverse is not None:
            ext.inverse = ext.inverse.pin_memory()

    # -- trainer side -------------------------------------------------------------------------
    def attach(self, data: Any, ext: Extracted, device: torch.device | str | None = None) -> None:
        """Set the minibatch's ``x`` from its claimed rows, on ``device``: what the pipeline calls."""
        data.x = self.gather(ext, device)

    def gather(self, ext: Extracted, device: torch.device | str | None = None) -> torch.Tensor:
        """``x`` for the minibatch, on ``device`` (default: the CPU).

        Each tier writes its rows straight into ``x``. On a GPU every copy is queued on the
        current stream without waiting (index tensors pinned by :meth:`pin`), so a batch
        costs the trainer no host synchronisation.
        """
        device = torch.device(device) if device is not None else torch.device("cpu")
        rows = ext.n_id.numel() if ext.inverse is None else ext.rows
        x = torch.empty((rows, self.num_features), dtype=self.dtype, device=device)
        for lease in ext.leases:
            if lease.positions is not None and lease.positions.numel():
                lease.tier.gather_into(lease, x, lease.positions.to(device, non_blocking=True))
        if ext.inverse is not None:  # each distinct row once from the tiers, then where n_id names it
            x = x.index_select(0, ext.inverse.to(device, non_blocking=True))
        return x

    def release(self, ext: Extracted, fence: Fence | None = None) -> None:
        """Done with the minibatch: every tier gets its lease back, to be reused after ``fence``."""
        if not ext.released:
            ext.released = True
            for lease in ext.leases:
                lease.tier.release(lease, fence)

    def abandon(self, ext: Extracted) -> None:
        """Give back a minibatch whose rows were never all filled (a failed or cancelled extraction)."""
        if not ext.released:
            ext.released = True
            for lease in ext.leases:
                lease.tier.abandon(lease)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._owned:
            t.close()
