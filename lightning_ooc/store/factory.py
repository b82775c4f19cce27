"""From budgets to a feature store: sizing (the plan) and building the chain of tiers.

:func:`max_nodes_per_batch` bounds a minibatch's node count from the
presampled batches; :func:`plan_store` turns the byte budgets into tier sizes
(:class:`~lightning_ooc.store.plan.StorePlan`) and chooses the host cache's
rows; :func:`build_store` allocates the tiers and chains them.

Example::

    >>> import tempfile, torch, lightning_ooc
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.io import FeatureReader
    >>> from lightning_ooc.loader.config import NodeDataConfig
    >>> from lightning_ooc.store.factory import build_store, plan_store
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=500, avg_degree=4, num_features=8,
    ...                   num_classes=2, progress=False)
    >>> ds = lightning_ooc.open_dataset(root)
    >>> cfg = NodeDataConfig(root, batch_size=10, num_neighbors=[3], gpu_cache="64KiB", host_cache="1KiB",
    ...                      staging="64KiB", progress=False)
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

import math
from typing import Any

import torch

from lightning_ooc.store.buffer import FeatureBuffer
from lightning_ooc.store.host_cache import HostCache, HotSet, choose_hot
from lightning_ooc.store.memory import limit_from_setting
from lightning_ooc.store.plan import StorePlan
from lightning_ooc.store.staging import StagingBuffer
from lightning_ooc.store.tier import FeatureTier
from lightning_ooc.store.tiered import TieredFeatureStore
from lightning_ooc.store.tiers import BufferTier, HostCacheTier, ReaderTier

#: margin over the largest presampled batch when sizing the buffer's reserve
BATCH_MARGIN, BATCH_SLACK = 1.25, 64


def max_nodes_per_batch(num_nodes: int, batch_size: int, fanout: list[int], presampled: list[torch.Tensor]) -> int:
    """The node count the plan reserves per batch: the presampled maximum with a margin, within the hard bound.

    A batch may still exceed it (the run then waits for slots in order, never deadlocks);
    it only sizes the reserve of the feature buffer.
    """
    seen = max((int(b.numel()) for b in presampled), default=1)
    bound = reach = batch_size
    for f in fanout:
        reach = reach * (f if f >= 0 else num_nodes)
        bound += reach
    return int(min(num_nodes, bound, math.ceil(seen * BATCH_MARGIN) + BATCH_SLACK))


def plan_store(cfg: Any, ds: Any, reader: Any, device: torch.device, presampled: list[torch.Tensor], *,
               processes: int = 1, topology_shared: bool = False, **plan_kwargs: Any) -> tuple[StorePlan, HotSet]:  # fmt: skip
    """Size every tier from the budgets of ``cfg``, fit them under its ``memory_limit``, choose the host cache's rows.

    ``processes`` is the number of processes of this machine that plan under the same
    limit at once, ``topology_shared`` whether ``indptr`` lives in node-shared memory;
    ``plan_kwargs`` go to :meth:`~lightning_ooc.store.plan.StorePlan.from_budgets`.
    """
    max_nodes = max_nodes_per_batch(ds.num_nodes, cfg.batch_size, cfg.num_neighbors, presampled)
    memory = plan_kwargs.pop("memory", None) or limit_from_setting(getattr(cfg, "memory_limit", "auto"))
    plan = StorePlan.from_budgets(
        num_nodes=ds.num_nodes, row_bytes=ds.row_bytes, gpu_cache=cfg.gpu_cache, host_cache=cfg.host_cache,
        staging=cfg.staging, max_nodes_per_batch=max_nodes, num_extractors=cfg.num_extractors,
        train_queue_size=cfg.train_queue_size, device=str(device), order=cfg.order,
        num_samplers=cfg.num_samplers, extract_queue_size=cfg.extract_queue_size, batch_size=cfg.batch_size,
        num_neighbors=cfg.num_neighbors, num_edges=ds.num_edges, replace=cfg.replace,
        host_cache_policy=cfg.host_cache_policy, topology_shared=topology_shared,
        split_sizes=ds.meta.get("split_sizes"), processes=processes, memory=memory, **plan_kwargs,
    )  # fmt: skip
    hot = choose_hot(plan.host_rows, ds.num_nodes, policy=cfg.host_cache_policy, in_degree=ds.in_degree,
                     presample=lambda: presampled)  # fmt: skip
    plan.host_policy, plan.presample_batches = hot.policy, len(presampled)
    plan.backend, plan.backend_reason = reader.backend, reader.backend_reason
    if hot.counts is not None:
        plan.expected_host_hit = hot.expected_hit_rate
    plan.expected_buffer_hit = simulate_buffer(plan.buffer_slots, ds.num_nodes, presampled, hot.ids)
    return plan, hot


def build_store(plan: StorePlan, hot: HotSet, ds: Any, reader: Any, device: torch.device, *,
                staging_memory: Any = None, progress: bool = True) -> TieredFeatureStore:  # fmt: skip
    """Allocate the tiers of ``plan`` and chain them: host cache, then the feature buffer over staging + SSD."""
    cuda = device.type == "cuda"
    staging = StagingBuffer(plan.staging_bytes, ds.num_features, ds.feature_dtype, chunk_rows=plan.staging_chunk_rows,
                            pin=cuda, memory=staging_memory)  # fmt: skip
    tiers: list[FeatureTier] = []
    try:
        disk = ReaderTier(reader, staging)
        buffer = FeatureBuffer(plan.buffer_slots, ds.num_nodes, ds.num_features, ds.feature_dtype, device,
                               reserve=plan.buffer_reserve)  # fmt: skip
        if plan.host_rows:
            host = HostCache.load(reader, hot.ids, ds.num_nodes, register=cuda, progress=progress)
            tiers.append(HostCacheTier(host))
        tiers.append(BufferTier(buffer, disk))
    except BaseException:
        for t in tiers:
            t.close()
        staging.close()
        raise
    return TieredFeatureStore(tiers, ds.num_features, ds.feature_dtype)


def staging_layout_bytes(plan: StorePlan, ds: Any) -> int:
    """Bytes of the staging buffer ``plan`` asks for (its portion of a shared segment)."""
    return StagingBuffer.layout(plan.staging_bytes, ds.num_features, ds.feature_dtype, plan.staging_chunk_rows)[3]


def simulate_buffer(slots: int, num_nodes: int, batches: list[torch.Tensor], host_ids: torch.Tensor) -> float | None:
    """Hit rate an LRU buffer of ``slots`` rows would have over the presampled batches (host rows excluded)."""
    if not batches:
        return None
    in_host = torch.zeros(num_nodes, dtype=torch.bool)
    in_host[host_ids] = True
    sim = FeatureBuffer(slots, num_nodes, 1, torch.uint8, "cpu")
    hits = total = 0
    for n_id in batches:
        rest = n_id[~in_host[n_id]]
        if rest.numel() > slots:
            return None
        a = sim.acquire(rest)
        hits += int(a.hit.sum())
        total += rest.numel()
        sim.mark_valid(a.slots)
        sim.release(a.slots)
    return hits / total if total else 0.0
