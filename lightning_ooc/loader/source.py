"""``LocalPasses``: the tiered backend, which runs a task's passes in this process.

Built from a :class:`~lightning_ooc.loader.config.NodeDataConfig` and a
:class:`~lightning_ooc.loader.context.ProcessContext`, it takes the batches from its task
(:mod:`lightning_ooc.loader.tasks`: the dataset, the seed batches, the samplers and the sample function),
presamples minibatches to plan and fill the feature store (one chain of tiers for a homogeneous graph, one
per node type, planned as one, for several), prints the plan once, and starts one
:class:`~lightning_ooc.loader.pipeline.EpochRun` per pass. The task is the class attribute ``task_type``
(:class:`~lightning_ooc.loader.tasks.NodeTask` here; ``LinkPasses`` and ``HeteroLocalPasses`` name the
other tasks over this backend). The datamodule uses it directly; a gather producer process uses it on the
other side of a process boundary. It imports neither.

Example::

    >>> import tempfile
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.loader.config import NodeDataConfig
    >>> from lightning_ooc.loader.context import ProcessContext
    >>> from lightning_ooc.loader.features import Tiered
    >>> from lightning_ooc.loader.source import LocalPasses
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=2000, avg_degree=5, num_features=8,
    ...                   num_classes=3, train_frac=0.2, progress=False)
    >>> cfg = NodeDataConfig(root, batch_size=100, num_neighbors=[4, 3], progress=False,
    ...                      features=Tiered(gpu_cache="1MiB", host_cache="8KiB", staging="256KiB"))
    >>> passes = LocalPasses(cfg, ProcessContext())
    >>> sum(b.batch_size for b in passes.run("train", epoch=0)) == passes.dataset.split("train").numel()
    True
    >>> passes.close()
"""
from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from lightning_ooc.data.dataset import topology_read_ahead_off
from lightning_ooc.data.format import human_bytes
from lightning_ooc.errors import InputError
from lightning_ooc.loader.batches import SeedBatches
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext, SourceDefaults
from lightning_ooc.loader.pipeline import EpochRun, EpochStats
from lightning_ooc.loader.tasks import NodeTask
from lightning_ooc.store.factory import build_store, staging_layout_bytes
from lightning_ooc.store.limits import MemoryLimit, limit_for_plan
from lightning_ooc.store.planner import StorePlan, check_negatives, plan_hetero_store, plan_store
from lightning_ooc.store.tally import ProcessShape
from lightning_ooc.store.typed_stores import build_hetero_store
from lightning_ooc.store.protocol import HOMOGENEOUS, StoreProtocol
from lightning_ooc.io import FeatureReader
from lightning_ooc.store.scored_cache import ScoredHostCacheTier

log = logging.getLogger("lightning_ooc")

#: presampled minibatches held at setup to size the plan and estimate its hit rates (at most)
PLAN_BATCHES = 32


def sampling_seed(cfg: NodeDataConfig, rank: int) -> int:
    """The base seed of a rank's neighbour sampling (ranks draw independent streams)."""
    return cfg.seed + 1_000_033 * rank


class LocalPasses(SourceDefaults):
    """A task's passes over the tiered store, in this process (see the module docstring)."""

    #: the task whose batches the passes carry (:mod:`lightning_ooc.loader.tasks`)
    task_type: type[NodeTask] = NodeTask

    def __init__(self, cfg: NodeDataConfig, ctx: ProcessContext, dataset: Any = None):
        self.cfg, self.ctx = cfg, ctx
        self._traces_written: dict[str, int] = {}  # timeline files written per split (profile=DIR)
        self._runs: weakref.WeakSet[EpochRun] = weakref.WeakSet()  # runs started, while they exist
        self.task = self.task_type(cfg, ctx, dataset)
        ds = self.dataset = self.task.dataset
        self.batches = self._seed_batches(ds)
        self.sampler, self.eval_sampler = self._samplers(ds)
        self.device = ctx.device
        self._check_before_presample()
        reader = self._open_reader(ds)
        try:
            n = max(1, self._presample_batches())
            presampled = list(self.presample(min(n, PLAN_BATCHES), stream=0))
            self.store: StoreProtocol = self._build_store(reader, presampled, lambda: self.presample(n, stream=1))
        except BaseException:
            self._close_reader(reader)
            raise
        fit = getattr(getattr(self, "plan", None), "memory_fit", None)
        if fit is not None:  # after the presample: on a cold page cache its faults gain from reading around
            self._topology_read_ahead(ds, fit.limit)
        lowered = getattr(getattr(self, "plan", None), "pipeline", None)
        if lowered:  # the plan fitted the memory limit with fewer batches in flight: the passes run with those
            self.cfg = cfg.with_settings(pipeline=lowered)  # the datamodule's own settings are left as given
        self.eval_store = self.store.without("buffer")
        if ctx.rank == 0:
            log.info("%s", self.describe(presampled))

    def _topology_read_ahead(self, ds: Any, limit: MemoryLimit) -> None:
        """Sample with the kernel's read-ahead off on the topology's maps (``indices``, and the time the sampler
        searches for temporal sampling: ``edge_time`` or ``node_time``) where together they are larger than half
        what this process may still allocate under ``limit``: their pages cannot stay cached beside the tiers,
        and each fault reading far around its page would evict what the last ones read (on a graph of
        papers100M's shape under an 8 GiB cap: 1.1 GB/s of reads, nearly all of it evicted unused; an 8M-node
        graph with edge times under a 0.95 GiB cap read 450 GB in six minutes). Where the topology fits,
        read-ahead stays: it caches the files in a few large reads. It is decided after the set-up's presample,
        once the tiers are planned: the presample's faults find the page cache empty, where reading around
        fills it (27 s of set-up on that graph; 100 s with read-ahead off from the start). A heterogeneous
        dataset's relations keep their maps as they are."""
        if limit.unlimited:
            return
        time_attr = getattr(self.cfg, "time_attr", None)
        total = topology_read_ahead_off(ds, time_attr, limit.bytes // 2)
        if total:
            what = "indices" + (" and times" if time_attr is not None else "")
            log.info("lightning_ooc: the topology's %s (%s) are larger than half the memory this process may use "
                     "(%s): sampling reads them with read-ahead off (MADV_RANDOM)", what, human_bytes(total),
                     limit)  # fmt: skip

    def _presample_batches(self) -> int:
        """Minibatches sampled at set-up to rank the host cache's rows (the plan holds up to :data:`PLAN_BATCHES`
        of them); a backend without a host cache presamples one, for its description."""
        return self.cfg.features.presample_batches

    # -- the task's part (a subclass may replace one: a partitioned dataset's seeds are its machine's) -----
    def _seed_batches(self, ds: Any) -> SeedBatches:
        """The minibatches of every split."""
        return self.task.seed_batches(ds)

    def _samplers(self, ds: Any) -> tuple[Any, Any]:
        return self.task.samplers()

    def _seeds_per_batch(self) -> int:
        return self.task.seeds_per_batch()

    def _seed_memory(self) -> dict[str, Any]:
        return self.task.seed_memory()

    def _presample_nodes(self, seeds: torch.Tensor, seed: int) -> Any:
        """The node ids a training minibatch of ``seeds`` touches (for the plan and the host cache's ranking)."""
        return self.task.presample_nodes(self.sampler, seeds, seed)

    def _sample_fn(self, split: str) -> Callable[[torch.Tensor, int, int], Any]:
        """The pipeline's sampler of ``split``: ``(seeds, seed, k) -> batch`` (``k``: the batch's number)."""
        sampler = self.sampler if split == "train" else self.eval_sampler
        task = self.task

        def sample(seeds: torch.Tensor, seed: int, k: int) -> Any:
            return task.sample(split, sampler, seeds, seed)

        return sample

    def _batch_source(self, split: str) -> Callable[[torch.Tensor, int, int], Any]:
        """Where a pass's batches come from, ``(seeds, seed, k) -> batch``: the task's sampler (a backend that
        sampled them ahead reads them instead, :mod:`lightning_ooc.loader.packed_passes`)."""
        return self._sample_fn(split)

    # -- the store: one chain of tiers per node type with features -------------------------------------
    def _open_reader(self, ds: Any) -> dict[str | None, Any]:
        """The SSD reader of every node type's features, handed to :meth:`_build_store`."""
        cfg = self.cfg
        readers: dict[str | None, Any] = {}
        try:
            for t, view in self.task.feature_views(ds).items():
                readers[t] = FeatureReader.from_dataset(view, backend=cfg.features.io_backend,
                                                        queue_depth=cfg.features.queue_depth,
                                                        workers=cfg.pipeline.num_extractors)  # fmt: skip
        except BaseException:
            self._close_reader(readers)
            raise
        if not readers:
            raise InputError(f"{ds.root}: no node type has features; there is nothing to read from SSD")
        return readers

    def _close_reader(self, reader: dict[str | None, Any]) -> None:
        for r in reader.values():
            r.close()

    def _build_store(self, reader: dict[str | None, Any], presampled: list[Any],
                     counted: Callable[[], Iterator[Any]]) -> StoreProtocol:  # fmt: skip
        """Plan the tiers from the presampled batches and build them (each reader becomes its type's SSD tier);
        the host cache's rows are ranked over the ``counted`` batches. Several node types are planned as one
        (:func:`~lightning_ooc.store.planner.plan_hetero_store`)."""
        cfg, ctx, ds = self.cfg, self.ctx, self.dataset
        memory = self._plan_memory()
        if self.task.node_types != (HOMOGENEOUS,):
            views = self.task.feature_views(ds)
            self.plan, hots = plan_hetero_store(cfg, views, reader, self.device, presampled, counted=counted,
                                                seeds_per_batch=self._seeds_per_batch(), processes=ctx.local_world,
                                                topology_shared=ctx.topology is not None, memory=memory,
                                                **self.task.plan_inputs())  # fmt: skip
            return build_hetero_store(self.plan, hots, views, reader, self.device,
                                      progress=cfg.progress and ctx.rank == 0)  # fmt: skip
        self.plan, hot = plan_store(cfg, ds, reader[HOMOGENEOUS], self.device, presampled, processes=ctx.local_world,
                                    topology_shared=ctx.topology is not None, counted=counted,
                                    seeds_per_batch=self._seeds_per_batch(),
                                    host_cache_fill=cfg.features.host_cache_fill,
                                    **({} if memory is None else {"memory": memory}), **self._seed_memory())  # fmt: skip
        return build_store(self.plan, hot, ds, reader[HOMOGENEOUS], self.device,
                           staging_memory=self._staging_memory(self.plan),
                           progress=cfg.progress and ctx.rank == 0)  # fmt: skip

    def _plan_memory(self) -> MemoryLimit | None:
        """The memory limit the plan fits the tiers under (``None``: the plan reads ``cfg.memory_limit``); a
        backend that keeps memory of its own besides the tiers gives less."""
        return None

    def _check_before_presample(self) -> None:
        """Refuse at once what no plan can fit, whatever the presample shows: a link batch's negatives
        (:func:`~lightning_ooc.store.planner.check_negatives`), which the presample would draw hundreds
        of times before the plan saw them."""
        negatives = self._seed_memory().get("negatives")
        if negatives is None or self.cfg.memory_limit is None:
            return
        ds, cfg = self.dataset, self.cfg
        limit = limit_for_plan(cfg.memory_limit)
        p = cfg.pipeline
        shape = ProcessShape(num_nodes=ds.num_nodes, row_bytes=ds.row_bytes, max_nodes_per_batch=0,
                             max_edges_per_batch=0, num_samplers=p.num_samplers, num_extractors=p.num_extractors,
                             extract_queue_size=p.extract_queue_size, train_queue_size=p.train_queue_size,
                             host_cache_policy="degree", topology_shared=self.ctx.topology is not None, train_nodes=0,
                             seed_order_bytes=0, seeds_held_bytes=0, eval_seed_bytes=0, negatives=negatives)  # fmt: skip
        check_negatives(shape, limit, processes=self.ctx.local_world)

    def presample(self, n: int, stream: int = 0) -> Iterator[Any]:
        """``n`` training minibatches' node ids, sampled one at a time from this process's training seeds.

        The seeds are drawn in an order of their own, not in any epoch's, so that no epoch
        starts with the very batches the caches were chosen from; ``stream`` gives independent
        draws (the plan's estimates come from one, the host cache's ranking from another).
        """
        base = sampling_seed(self.cfg, self.ctx.rank) * 7919 + 104_729 * (stream + 1)
        bs, k = self.cfg.batch_size, 0
        total = self.batches.size("train")
        if self.ctx.world == 1 and total >= 4 * n * bs:
            # a small part of many seeds (link splits: tens of millions of edges): distinct seeds drawn
            # without permuting them all (NumPy's choice needs no arange below 1/50 of them)
            rng = np.random.default_rng(base & (2**64 - 1))  # a negative seed is a valid config seed
            pick = torch.from_numpy(rng.choice(total, size=n * bs, replace=False))
            order = self.batches.take("train", pick)
            for k in range(n):
                yield self._presample_nodes(order[k * bs : (k + 1) * bs], seed=base + k)
            return
        seeds = self.batches.epoch("train", 0).cat()
        if seeds.numel() == 0:
            return
        g = torch.Generator().manual_seed(base)
        while True:  # as many passes over the seeds as n batches take
            order = seeds[torch.randperm(seeds.numel(), generator=g)]
            for s in range(0, order.numel(), bs):
                if k >= n:
                    return
                yield self._presample_nodes(order[s : s + bs], seed=base + k)
                k += 1

    def _staging_memory(self, plan: StorePlan):
        """This rank's portion of the machine's shared staging segment (``None``: private memory)."""
        shared = self.ctx.staging
        if shared is None:
            return None
        size = staging_layout_bytes(plan, self.dataset)
        mm = shared.buffer("staging", size * shared.local_world)
        lo = shared.local_rank * size
        return memoryview(mm)[lo : lo + size]

    def describe(self, presampled: list[Any]) -> str:
        cfg, world = self.cfg, self.ctx.world
        p = cfg.pipeline
        pipeline = (f"  pipeline        {p.num_samplers} samplers, {p.num_extractors} extractors, queues "
                    f"{p.extract_queue_size}/{p.train_queue_size}, {p.order}")  # fmt: skip
        batches = (f"  minibatches     {self.batches.count('train')} x {cfg.batch_size} {self.task.per_epoch()}"
                   + (f" per process ({world} processes)" if world > 1 else "") + f", fanout {cfg.num_neighbors}")
        if self.task.node_types != (HOMOGENEOUS,):
            seen = max((sum(int(v.numel()) for v in b.values()) for b in presampled), default=0)
            batches += f", up to {seen:,} nodes of all types in the presample"
        else:
            seen = max((int(b.numel()) for b in presampled), default=0)
            batches += f", up to ~{self.plan.max_nodes_per_batch:,} nodes each (presample max {seen:,})"
        return self.plan.format(extra=[pipeline, batches])

    def run(self, split: str, epoch: int, skip: frozenset[int] = frozenset(),
            on_end: Callable[[EpochStats], None] | None = None, on_batch: Callable[[int], None] | None = None,
            name: str | None = None) -> EpochRun:  # fmt: skip
        """Start a pass over ``split``: training passes use the feature buffer, evaluation passes read past it.

        Every pass runs in ``cfg.pipeline.order``: in order, evaluation metrics accumulate in the same order
        run to run too, so a run is reproducible to the last bit (the evaluation store holds no
        buffer slots, so its window costs nothing)."""
        cfg = self.cfg
        train = split == "train"
        sample = self._batch_source(split)
        trace_path: Callable[[], Path] | None = None
        if cfg.pipeline.profile is not None:  # numbered per split when written (evaluation passes all have epoch 0)
            counts = self._traces_written
            label, rank, where = name or split, self.ctx.rank, Path(cfg.pipeline.profile)

            def next_trace_path() -> Path:
                n = counts[label] = counts.get(label, -1) + 1
                return where / f"ooc-rank{rank}-{label}-{n:03d}.trace.json"

            trace_path = next_trace_path

        if train and getattr(cfg.features, "host_cache_policy", None) == "scored":  # its rounds per epoch
            host = self._scored_host_cache()
            user_end = on_end

            def on_end(stats: EpochStats) -> None:
                # the keys on every process alike (the logger averages them over ranks), also on one whose plan
                # left no room for a host cache
                took = host.take_stats() if host is not None else {"rounds": 0, "replaced": 0}
                stats.extra.update({"host_cache_eviction_rounds": float(took["rounds"]),
                                    "host_cache_replaced_rows": float(took["replaced"])})  # fmt: skip
                if user_end is not None:
                    user_end(stats)

        run = EpochRun(
            self.batches.epoch(split, epoch), sample, self.store if train else self.eval_store, epoch=epoch,
            seed=sampling_seed(cfg, self.ctx.rank), num_samplers=cfg.pipeline.num_samplers,
            num_extractors=cfg.pipeline.num_extractors, extract_queue_size=cfg.pipeline.extract_queue_size,
            train_queue_size=cfg.pipeline.train_queue_size, order=cfg.pipeline.order, device=self.device, skip=skip,
            on_batch=on_batch, on_end=on_end, name=name or split, trace_path=trace_path,
        )  # fmt: skip
        self._runs.add(run)
        return run

    def _scored_host_cache(self) -> Any:
        """This process's own scored host cache tier (``host_cache_policy="scored"``), if its chain has one."""

        store = self.own_store()
        host = store.of(HOMOGENEOUS).tier("host_cache") if HOMOGENEOUS in store.node_types else None
        return host if isinstance(host, ScoredHostCacheTier) else None

    def own_store(self) -> StoreProtocol:
        """The store of this process's own rows (a partitioned dataset's: its partition's, without the
        remote tier)."""
        return self.store

    def close(self) -> None:
        """Close every run still going (its threads use the store), then the store."""
        try:
            for run in list(self._runs):
                try:
                    run.close()
                except Exception:  # noqa: BLE001 - the others and the store are closed all the same
                    log.exception("closing a pass's run")
        finally:
            self.store.close()
