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
    >>> from lightning_ooc.loader.features import Tiered
    >>> from lightning_ooc.store.factory import build_store, plan_store
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

import logging
import math
from typing import Any, Callable, Iterable, Iterator

import torch

from lightning_ooc.store.buffer import FeatureBuffer
from lightning_ooc.errors import InputError
from lightning_ooc.store.background import BACKGROUND_FILL_BYTES, BackgroundFill, DeferredHot
from lightning_ooc.data.degree import InDegree
from lightning_ooc.store.host_cache import HostCache, HotSet, choose_hot
from lightning_ooc.data.format import human_bytes
from lightning_ooc.store.memory import budget_setting, largest_where, limit_for_plan
from lightning_ooc.store.plan import StorePlan
from lightning_ooc.store.scored_cache import ScoredHostCacheTier, ScoredStore
from lightning_ooc.store.staging import StagingBuffer
from lightning_ooc.store.tier import FeatureTier
from lightning_ooc.store.tiered import TieredFeatureStore
from lightning_ooc.store.tally import BATCH_BYTES_PER_EDGE, BATCH_BYTES_PER_EDGE_WITH_ID
from lightning_ooc.store.tiers import BufferTier, HostCacheTier, ReaderTier

log = logging.getLogger("lightning_ooc")

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


def size_store(cfg: Any, ds: Any, device: torch.device, presampled: list[torch.Tensor], *,
               seeds_per_batch: int | None = None, processes: int = 1, topology_shared: bool = False,
               background_fill: bool = False, memory: Any = None, num_edges: int | None = None,
               **plan_kwargs: Any) -> StorePlan:  # fmt: skip
    """The sizes of the tiers from the budgets of ``cfg``, fitted under ``memory`` (default: its ``memory_limit``,
    read now), without choosing the host cache's rows: :meth:`StorePlan.from_budgets` with what ``cfg``, the
    dataset and the presampled batches say (what :func:`plan_store` plans with; nothing is logged)."""
    seeds = int(seeds_per_batch or cfg.batch_size)
    scored = cfg.features.host_cache_policy == "scored"  # warm-started like "presample" (and planned like it)
    if memory is None:
        memory = limit_for_plan(getattr(cfg, "memory_limit", "auto"))  # what is live, not what was freed
    max_nodes = max_nodes_per_batch(ds.num_nodes, seeds, cfg.num_neighbors, presampled)
    return StorePlan.from_budgets(
        num_nodes=ds.num_nodes, row_bytes=ds.row_bytes, gpu_cache=cfg.features.gpu_cache,
        host_cache=cfg.features.host_cache, staging=cfg.features.staging, max_nodes_per_batch=max_nodes,
        num_extractors=cfg.pipeline.num_extractors, train_queue_size=cfg.pipeline.train_queue_size, device=str(device),
        order=cfg.pipeline.order, num_samplers=cfg.pipeline.num_samplers,
        extract_queue_size=cfg.pipeline.extract_queue_size, batch_size=seeds,
        num_neighbors=cfg.num_neighbors, num_edges=ds.num_edges if num_edges is None else num_edges,
        replace=cfg.replace, host_cache_policy="presample" if scored else cfg.features.host_cache_policy,
        background_fill=background_fill, topology_shared=topology_shared, processes=processes, memory=memory,
        warn=False,
        edge_bytes=BATCH_BYTES_PER_EDGE_WITH_ID if getattr(cfg, "return_e_id", False) else BATCH_BYTES_PER_EDGE,
        **{"split_sizes": ds.meta.get("split_sizes"), **plan_kwargs},
    )  # fmt: skip


def plan_store(cfg: Any, ds: Any, reader: Any, device: torch.device, presampled: list[torch.Tensor], *,
               processes: int = 1, topology_shared: bool = False,
               counted: Callable[[], Iterable[torch.Tensor]] | None = None, seeds_per_batch: int | None = None,
               counts: torch.Tensor | None = None, in_degree: Any = None, host_cache_fill: str = "setup",
               warn: bool = True, **plan_kwargs: Any) -> tuple[StorePlan, HotSet | DeferredHot]:  # fmt: skip
    """Size every tier from the budgets of ``cfg``, fit them under its ``memory_limit``, choose the host cache's rows.

    ``presampled`` batches size the feature buffer's reserve and give the plan's expected
    hit rates; the host cache's rows are the most accessed over ``counted()`` (batches
    sampled independently of ``presampled``, so the estimates are not measured on the
    batches that chose the rows; default: ``presampled`` themselves).
    ``seeds_per_batch`` is the most seed nodes a batch starts from (default ``cfg.batch_size``;
    a link batch starts from the endpoints of its edges and negatives).
    ``counts``: the host cache's access counts, counted already (instead of over ``counted()``);
    ``in_degree``: the nodes' in-degree (default ``ds.in_degree``).
    ``host_cache_fill``: ``"setup"`` ranks the host cache's rows here; ``"background"`` (and ``"auto"`` for a
    host cache of :data:`~lightning_ooc.store.background.BACKGROUND_FILL_BYTES` or more, with the
    ``"presample"`` policy) returns a :class:`~lightning_ooc.store.background.DeferredHot` instead, whose
    ranking over ``counted()`` runs in the store's fill thread (the split of a shrunk CPU plan is then
    judged with a ranking over half of ``presampled``, on the other half).
    ``processes`` is the number of processes of this machine that plan under the same
    limit at once, ``topology_shared`` whether ``indptr`` lives in node-shared memory;
    ``plan_kwargs`` go to :meth:`~lightning_ooc.store.plan.StorePlan.from_budgets` (through :func:`size_store`).
    ``warn=False``: what was shrunk to fit is not logged (the caller logs it, e.g. once for the plans of every
    node type).
    """
    scored = cfg.features.host_cache_policy == "scored"  # warm-started like "presample" (and planned like it)
    # ranked and read while training runs (then the plan counts its temporaries in the training phase)
    background = (cfg.features.host_cache_policy == "presample" and counts is None
                  and (host_cache_fill == "background"
                       or (host_cache_fill == "auto"
                           and cfg.features.host_cache >= BACKGROUND_FILL_BYTES)))  # fmt: skip
    memory = plan_kwargs.pop("memory", None)
    if memory is None:
        memory = limit_for_plan(getattr(cfg, "memory_limit", "auto"))  # what is live, not what was freed
    num_edges = plan_kwargs.pop("num_edges", ds.num_edges)

    def sized(background_fill: bool) -> StorePlan:
        return size_store(cfg, ds, device, presampled, seeds_per_batch=seeds_per_batch, processes=processes,
                          topology_shared=topology_shared, background_fill=background_fill, memory=memory,
                          num_edges=num_edges, **plan_kwargs)  # fmt: skip

    if background and host_cache_fill == "auto":
        # ranking beside training costs memory the set-up's ranking does not (it runs before the store exists):
        # the ranking and fill stay at set-up where that would not fit, or would shrink budgets that fit as asked
        quiet, log.disabled = log.disabled, True  # trials: what they would shrink is not what will run
        try:
            at_setup = sized(False)
            try:
                beside = sized(True)
                background = not (beside.memory_fit is not None and beside.memory_fit.shrunk
                                  and not (at_setup.memory_fit is not None and at_setup.memory_fit.shrunk))  # fmt: skip
            except InputError:
                background = False
        finally:
            log.disabled = quiet
        plan = sized(background)  # again, to log what it shrinks
    else:
        plan = sized(background)
    fit = plan.memory_fit
    # On CPU both tiers hold rows in host memory: when they had to shrink to fit, the presample
    # decides how that memory is shared between them (the budgets asked for could not be kept anyway).
    split = (fit is not None and bool(fit.shrunk) and fit.shape is not None and fit.shape.buffer_on_host
             and cfg.features.host_cache_policy in ("presample", "scored") and plan.buffer_slots > plan.buffer_reserve
             and cfg.features.host_cache > 0)  # host_cache=0 asks for no host cache at all  # fmt: skip
    most = plan.host_rows
    if split:
        most = largest_where(plan.host_rows, ds.num_nodes, lambda h: fit.fits(h, plan.buffer_reserve)) or most
    plan.backend, plan.backend_reason = reader.backend, reader.backend_reason
    # the ranking's tie-break, a slice at a time (not an array of one entry per node)
    deg = in_degree if in_degree is not None else InDegree(ds.indptr) if hasattr(ds, "indptr") else ds.in_degree
    if background and most > 0:
        plan, deferred = _plan_deferred(plan, cfg, ds, presampled, counted, deg, most, split)
        if warn:
            _warn_shrunk(plan)
        return plan, deferred
    batches_counted = 0

    def counting() -> Iterator[torch.Tensor]:
        nonlocal batches_counted
        for n_id in (counted() if counted is not None else presampled):
            batches_counted += 1
            yield n_id

    hot = choose_hot(most, ds.num_nodes, policy=cfg.features.host_cache_policy, in_degree=deg, presample=counting,
                     counts=counts)  # fmt: skip
    if split:
        hot = split_host_memory(plan, hot, presampled, ds.num_nodes)
    if warn:
        _warn_shrunk(plan)  # once the sizes are final: the same account as the plan's memory line
    if scored:
        hot.scored = (cfg.features.cache_decay, cfg.features.cache_interval)
    plan.host_policy, plan.presample_batches = hot.policy, batches_counted or len(presampled)
    if hot.counts is not None:
        plan.expected_host_hit = host_hit_rate(hot.ids, presampled, ds.num_nodes)
    touched, local = compact_ids(presampled)
    cached = local_positions(touched, hot.ids)
    plan.expected_buffer_hit = simulate_buffer(plan.buffer_slots, touched.numel(), local, cached[cached >= 0])
    return plan, hot


def _warn_shrunk(plan: StorePlan) -> None:
    """Log what the plan changed to fit in memory, from its final sizes (after a split of host memory)."""
    line = plan.memory_fit.warning() if plan.memory_fit is not None else None
    if line:
        log.warning("%s", line)


def _plan_deferred(plan: StorePlan, cfg: Any, ds: Any, presampled: list[torch.Tensor],
                   counted: Callable[[], Iterable[torch.Tensor]] | None, deg: Any, most: int,
                   split: bool) -> tuple[StorePlan, DeferredHot]:  # fmt: skip
    """:func:`plan_store`'s sizes for a host cache ranked and filled in the background: the split of a shrunk CPU
    plan judged with a ranking over half of the presampled batches, on the other half; the ranking over
    ``counted()`` deferred to the fill thread."""
    if split:  # judged on batches its ranking did not count
        half = len(presampled) // 2
        rank_on, judge_on = (presampled[:half], presampled[half:]) if half else (presampled, presampled)
        hot = choose_hot(most, ds.num_nodes, policy="presample", in_degree=deg, presample=lambda: iter(rank_on))
        split_host_memory(plan, hot, judge_on, ds.num_nodes, candidates=3)  # on the critical path: fewer tried
        del hot
    plan.host_policy, plan.host_fill = "presample", "background"
    plan.presample_batches = int(cfg.features.presample_batches) or len(presampled)
    size = plan.host_rows

    def rank(check: Callable[[], None]) -> HotSet:
        counted_n = 0

        def counting() -> Iterator[torch.Tensor]:
            nonlocal counted_n
            for n_id in (counted() if counted is not None else presampled):
                check()
                counted_n += 1
                yield n_id

        ranked = choose_hot(size, ds.num_nodes, policy="presample", in_degree=deg, presample=counting,
                            ordered=False)  # the fill reads them in id order  # fmt: skip
        plan.presample_batches = counted_n or plan.presample_batches
        return HotSet(ranked.ids, ranked.policy, ranked.expected_hit_rate)  # the counts go before the reads

    def done(ranked: HotSet, fill: Any) -> None:  # the estimate too is off the critical path
        # the host cache's hit rate only: simulating the buffer beside the running one would cost its tables twice
        plan.expected_host_hit = host_hit_rate(ranked.ids, presampled, ds.num_nodes)
        log.info("lightning_ooc: host cache filled in the background: %s rows (%s) in %.1f s (ranked over %d "
                 "presampled batches in %.1f s), expected host cache hit rate %.1f%%",
                 f"{fill.rows_filled:,}", human_bytes(fill.rows_filled * ds.row_bytes), fill.seconds,
                 plan.presample_batches, fill.rank_seconds, 100 * (plan.expected_host_hit or 0.0))  # fmt: skip

    return plan, DeferredHot(rank, done)


def split_host_memory(plan: StorePlan, ranked: HotSet, presampled: list[torch.Tensor], num_nodes: int,
                      candidates: int = 5) -> HotSet:  # fmt: skip
    """Share the host memory of a shrunk CPU plan between the host cache and the feature buffer.

    ``ranked`` holds the hot rows, hottest first, for the largest host cache that fits
    beside a buffer at its reserve. Buffer sizes from ``plan.buffer_slots`` down to the
    reserve are tried (``candidates`` of them, evenly spaced), each with the largest host
    cache that fits beside it; the pair that serves the most rows of the ``presampled``
    batches from memory (host hits, then LRU buffer hits over the rest) is taken, the
    plan's first pair on a tie. ``plan`` and its memory fit are resized in place, and
    ``plan.split_note`` says what was chosen; returns the hot set (a prefix of ``ranked``).

    A static cache of the most accessed rows usually serves more per byte than the buffer,
    which keeps only what recent batches touched, so this mostly moves memory from the
    buffer to the host cache; on access patterns without hot rows it keeps the buffer.
    """
    fit = plan.memory_fit
    assert fit is not None
    lo, hi = plan.buffer_reserve, plan.buffer_slots
    sizes = sorted({hi - (hi - lo) * i // (candidates - 1) for i in range(candidates)}, reverse=True)
    best = None
    # the simulations run over the nodes the presample touched, renumbered (the same order, so the same hits)
    touched, local = compact_ids(presampled)
    pos = local_positions(touched, ranked.ids)  # each ranked row's new number, -1 where no batch touched it
    for slots in sizes:
        h = plan.host_rows if slots == hi else largest_where(0, ranked.ids.numel(), lambda x: fit.fits(x, slots))
        if h is None:
            continue
        cached = pos[:h][pos[:h] >= 0]
        host_hit = host_hit_rate(cached, local, touched.numel())
        buf_hit = simulate_buffer(slots, touched.numel(), local, cached) or 0.0
        served = host_hit + (1.0 - host_hit) * buf_hit
        if best is None or served > best[0] + 1e-9:
            best = (served, slots, h)
    assert best is not None  # the plan's own pair always fits
    served, slots, h = best
    first = sizes[0]
    if slots != hi:
        fit.resize(h, slots)
        plan.host_rows, plan.buffer_slots = h, slots
    rb = plan.row_bytes
    note = (f"host memory shared by expected hits over the presample: host_cache {human_bytes(h * rb)}, gpu_cache "
            f"{human_bytes(slots * rb)} serve {served:.1%} of the rows (of {len(sizes)} splits tried"
            f"{'' if slots != first else ', the first kept'})")  # fmt: skip
    log.info("lightning_ooc: %s; set features.host_cache=%s and features.gpu_cache=%s to plan this directly", note,
             budget_setting(h * rb), budget_setting(slots * rb))  # fmt: skip
    counts = ranked.counts
    hit = float(counts[ranked.ids[:h]].sum()) / max(int(counts.sum()), 1) if counts is not None else None
    plan.split_note = note
    return HotSet(ranked.ids[:h], ranked.policy, hit, counts)


def compact_ids(batches: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The distinct node ids of ``batches`` (ascending) and the batches renumbered into them: simulations over
    a presample then need tables of the nodes it touched, not of the graph's.

    >>> touched, local = compact_ids([torch.tensor([90, 7]), torch.tensor([7, 30])])
    >>> touched.tolist(), [b.tolist() for b in local]
    ([7, 30, 90], [[2, 0], [0, 1]])
    """
    if not batches:
        return torch.empty(0, dtype=torch.int64), []
    touched, inverse = torch.unique(torch.cat([b.to(torch.int64) for b in batches]), return_inverse=True)
    return touched, list(inverse.split([int(b.numel()) for b in batches]))


def local_positions(touched: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each of ``ids``' position in the sorted ``touched``, ``-1`` where it is not there.

    >>> local_positions(torch.tensor([7, 30, 90]), torch.tensor([30, 8, 90, 100])).tolist()
    [1, -1, 2, -1]
    """
    ids = ids.to(torch.int64)
    if touched.numel() == 0:
        return torch.full_like(ids, -1)
    at = torch.searchsorted(touched, ids).clamp_(max=touched.numel() - 1)
    return torch.where(touched[at] == ids, at, torch.full_like(at, -1))


def host_hit_rate(ids: torch.Tensor, batches: list[torch.Tensor], num_nodes: int) -> float | None:
    """Share of the node accesses of ``batches`` that a host cache of ``ids`` serves (None without batches)."""
    total = sum(int(b.numel()) for b in batches)
    if not total:
        return None
    cached = torch.zeros(num_nodes, dtype=torch.bool)
    cached[ids] = True
    return sum(int(cached[b].sum()) for b in batches) / total


def build_store(plan: StorePlan, hot: HotSet | DeferredHot, ds: Any, reader: Any, device: torch.device, *,
                staging_memory: Any = None, progress: bool = True) -> TieredFeatureStore:  # fmt: skip
    """Allocate the tiers of ``plan`` and chain them: host cache, then the feature buffer over staging + SSD.

    A :class:`~lightning_ooc.store.background.DeferredHot` gives an empty host cache that a thread ranks and fills
    while training runs (started here, stopped when the store closes). A scored hot set (``hot.scored``) gives a :class:`~lightning_ooc.store.scored_cache.ScoredHostCacheTier`
    in a :class:`~lightning_ooc.store.scored_cache.ScoredStore` (evaluation chains read it frozen).
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
        if plan.host_rows and isinstance(hot, DeferredHot):  # ranked and read while training runs
            host = HostCache.empty(plan.host_rows, ds.num_features, ds.feature_dtype, ds.num_nodes, register=cuda)
            # it ranks once the first batch is trained: that batch has the CPU and the SSD to itself
            fill = BackgroundFill(host, reader, hot.rank, on_done=hot.on_done, wait_batches=1)
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
