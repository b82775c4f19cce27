"""Building a feature store from its plan: the chain of tiers of one node type (host cache, then the feature buffer
over staging and the SSD reader), allocated and chained.

The plan comes from the planner (:func:`~lightning_ooc.store.planner.plan_store`: the sizes of the tiers fitted
under the memory limit, and the host cache's rows); :func:`build_store` allocates what it says.

Example::

    >>> import tempfile, torch, lightning_ooc
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.io import FeatureReader
    >>> from lightning_ooc.loader.config import NodeDataConfig
    >>> from lightning_ooc.loader.features import Tiered
    >>> from lightning_ooc.store.factory import build_store
    >>> from lightning_ooc.store.planner import plan_store
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=500, avg_degree=4, num_features=8,
    ...                   num_classes=2, progress=False)
    >>> ds = lightning_ooc.open_dataset(root)
    >>> cfg = NodeDataConfig(root, batch_size=10, num_neighbors=[3], progress=False,
    ...                      features=Tiered(gpu_cache="64KiB", host_cache="1KiB", staging="64KiB"))
    >>> reader = FeatureReader.from_dataset(ds)
    >>> presampled = [torch.arange(40), torch.arange(30, 80)]
    >>> plan, hot = plan_store(cfg, ds, reader, torch.device("cpu"), presampled)
    >>> plan.host_rows, plan.max_nodes_per_batch  # 10 seeds + 30 neighbours at most
    (32, 40)
    >>> store = build_store(plan, hot, ds, reader, torch.device("cpu"), progress=False)
    >>> [t.name for t in store.tiers]
    ['host_cache', 'buffer']
    >>> store.close()
"""
from __future__ import annotations

from typing import Any

import torch

from lightning_ooc.store.background import BackgroundFill, DeferredHot
from lightning_ooc.store.feature_buffer import FeatureBuffer
from lightning_ooc.store.host_cache import HostCache, HotSet
from lightning_ooc.store.planner import StorePlan
from lightning_ooc.store.scored_cache import ScoredHostCacheTier, ScoredStore
from lightning_ooc.store.staging import StagingBuffer
from lightning_ooc.store.tier import FeatureTier
from lightning_ooc.store.tiered import TieredFeatureStore
from lightning_ooc.store.tiers import BufferTier, HostCacheTier, ReaderTier

__all__ = ["build_store", "staging_layout_bytes"]


def build_store(plan: StorePlan, hot: HotSet | DeferredHot, ds: Any, reader: Any, device: torch.device, *,
                staging_memory: Any = None, progress: bool = True) -> TieredFeatureStore:  # fmt: skip
    """Allocate the tiers of ``plan`` and chain them: host cache, then the feature buffer over staging + SSD.

    A :class:`~lightning_ooc.store.background.DeferredHot` gives an empty host cache that a thread ranks while
    training runs (started here, stopped when the store closes) and that keeps its rows from the reads of the
    buffer's SSD tier. A scored hot set (``hot.scored``) gives a
    :class:`~lightning_ooc.store.scored_cache.ScoredHostCacheTier` in a
    :class:`~lightning_ooc.store.scored_cache.ScoredStore` (evaluation chains read it frozen).
    """
    cuda = device.type == "cuda"
    fill: BackgroundFill | None = None
    staging = StagingBuffer(plan.staging_bytes, ds.num_features, ds.feature_dtype, chunk_rows=plan.staging_chunk_rows,
                            pin=cuda, memory=staging_memory)  # fmt: skip
    tiers: list[FeatureTier] = []
    try:
        disk = ReaderTier(reader, staging)
        buffer = FeatureBuffer(plan.buffer_slots, ds.num_nodes, ds.num_features, ds.feature_dtype, device,
                               reserve=plan.buffer_reserve)  # fmt: skip
        if plan.host_rows and isinstance(hot, DeferredHot):  # ranked while training runs, kept from its reads
            host = HostCache.empty(plan.host_rows, ds.num_features, ds.feature_dtype, ds.num_nodes, register=cuda)
            # it ranks once the first batch is trained: that batch has the CPU to itself
            fill = BackgroundFill(host, hot.rank, on_done=hot.on_done, wait_batches=1, counter=hot.counter)
            disk.admit = host.admit  # every row the buffer reads is offered to it
            tiers.append(HostCacheTier(host, background=fill))
        elif plan.host_rows:
            host = HostCache.load(reader, hot.ids, ds.num_nodes, register=cuda, progress=progress)
            if hot.scored is not None:
                gamma, interval = hot.scored
                tiers.append(ScoredHostCacheTier(host, reader, ds.in_degree, gamma=gamma, interval=interval))
            else:
                tiers.append(HostCacheTier(host))
        tiers.append(BufferTier(buffer, disk))
    except BaseException:
        for t in tiers:
            t.close()
        staging.close()
        raise
    cls = ScoredStore if isinstance(tiers[0], ScoredHostCacheTier) else TieredFeatureStore
    store = cls(tiers, ds.num_features, ds.feature_dtype)
    if fill is not None:
        fill.start()
    return store


def staging_layout_bytes(plan: StorePlan, ds: Any) -> int:
    """Bytes of the staging buffer ``plan`` asks for (its portion of a shared segment)."""
    return StagingBuffer.layout(plan.staging_bytes, ds.num_features, ds.feature_dtype, plan.staging_chunk_rows)[3]
