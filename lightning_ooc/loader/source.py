"""``LocalPasses``: everything that runs node-classification passes in this process.

Built from a :class:`~lightning_ooc.loader.config.NodeDataConfig` and a
:class:`~lightning_ooc.loader.context.ProcessContext`, it opens the dataset
(topology in the context's shared memory when there is one), builds the
samplers, presamples minibatches to plan and fill the feature store, prints
the plan once, and starts one :class:`~lightning_ooc.loader.pipeline.EpochRun`
per pass. The datamodule uses it directly; a gather producer process uses it
on the other side of a process boundary. It imports neither.

Example::

    >>> import tempfile
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.loader.config import NodeDataConfig
    >>> from lightning_ooc.loader.context import ProcessContext
    >>> from lightning_ooc.loader.source import LocalPasses
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=2000, avg_degree=5, num_features=8,
    ...                   num_classes=3, train_frac=0.2, progress=False)
    >>> cfg = NodeDataConfig(root, batch_size=100, num_neighbors=[4, 3], gpu_cache="1MiB", host_cache="8KiB",
    ...                      staging="256KiB", progress=False)
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

from lightning_ooc.data.dataset import OnDiskDataset, open_dataset
from lightning_ooc.data.format import SPLITS
from lightning_ooc.errors import CorruptDatasetError, DatasetChangedError, InputError
from lightning_ooc.loader.batches import SeedBatches
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext, SourceDefaults
from lightning_ooc.loader.pipeline import EpochRun, EpochStats
from lightning_ooc.store.factory import build_store, plan_store, staging_layout_bytes
from lightning_ooc.store.memory import ProcessShape, check_negatives, limit_for_plan
from lightning_ooc.store.plan import StorePlan
from lightning_ooc.store.protocol import HOMOGENEOUS, FeatureStore
from lightning_ooc.store.tiered import TieredFeatureStore
from lightning_ooc.io import FeatureReader
from lightning_ooc.sampling import NeighborSampler
from lightning_ooc.store.scored_cache import ScoredHostCacheTier

log = logging.getLogger("lightning_ooc")

#: presampled minibatches held at setup to size the plan and estimate its hit rates (at most)
PLAN_BATCHES = 32


def sampling_seed(cfg: NodeDataConfig, rank: int) -> int:
    """The base seed of a rank's neighbour sampling (ranks draw independent streams)."""
    return cfg.seed + 1_000_033 * rank


def seed_batches(cfg: NodeDataConfig, ds: OnDiskDataset, ctx: ProcessContext) -> SeedBatches:
    """The seed batches of every split for the context's rank."""
    return SeedBatches(ds.split, batch_size=cfg.batch_size, eval_batch_size=cfg.eval_size, shuffle=cfg.shuffle,
                       drop_last=cfg.drop_last, seed=cfg.seed, rank=ctx.rank, world=ctx.world)  # fmt: skip


def hetero_dataset_error(root: Any, node_types: Any) -> InputError:
    """The error of a homogeneous datamodule given a heterogeneous dataset."""
    return InputError(f"{root}: a heterogeneous dataset (node types {', '.join(node_types)}); train it with "
                      "OutOfCoreHeteroNodeData (data.class_path: lightning_ooc.OutOfCoreHeteroNodeData) and a "
                      "relational model (lightning_ooc.models.RGAT or RSAGE): configs/rgat_demo.yaml")  # fmt: skip


def open_for(cfg: NodeDataConfig, ctx: ProcessContext, labelled: bool = True) -> OnDiskDataset:
    """The dataset of ``cfg``, with ``indptr`` in the context's shared memory when it offers some.

    It must be the dataset ``cfg.dataset_identity`` names (when set) and, when ``labelled``
    (node classification), have labels of at least two classes on every node of its splits.
    """
    ds = open_dataset(cfg.root, share=ctx.topology)
    if ds.is_hetero:
        raise hetero_dataset_error(ds.root, ds.node_types)
    if cfg.dataset_identity is not None and ds.identity != cfg.dataset_identity:
        raise DatasetChangedError(
            f"{ds.root}: replaced since this datamodule first opened it (identity {cfg.dataset_identity[:12]}, now "
            f"{ds.identity[:12]}); what was trained or planned belongs to the old dataset; create a new datamodule "
            "(a new run) for the new one",
            ds.root,
        )  # fmt: skip
    if labelled:
        check_labelled(ds)
    return ds


def neighbor_samplers(cfg: NodeDataConfig, ds: Any) -> tuple[Any, Any]:
    """The training and the evaluation neighbour sampler of ``cfg`` (one object when their fanouts agree)."""

    sampler = NeighborSampler(ds, cfg.num_neighbors, replace=cfg.replace)
    return sampler, (sampler if cfg.eval_fanout == cfg.num_neighbors
                     else NeighborSampler(ds, cfg.eval_fanout, replace=cfg.replace))  # fmt: skip


def check_labelled(ds: OnDiskDataset) -> None:
    """Node classification needs labels of two classes or more, on every node of every split."""
    if ds.num_classes < 2:
        raise InputError(
            f"{ds.root}: the dataset has {ds.num_classes} class(es); node classification needs labels of at least "
            "two classes (`lightning-ooc prepare --y LABELS.npy`, `lightning-ooc synth --classes 2` or more)"
        )  # fmt: skip
    for split in SPLITS:
        ids = ds.split(split).numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= ds.num_nodes):
            raise CorruptDatasetError(f"{ds.root}: the {split} split holds node ids outside [0, {ds.num_nodes}); "
                                      f"run `lightning-ooc verify {ds.root}`", ds.root)  # fmt: skip
        bad = ds.unlabelled(split)
        if bad.size:
            raise InputError(
                f"{ds.root}: the {split} split holds {bad.size:,} node(s) without a label in [0, {ds.num_classes}), "
                f"e.g. node {int(bad[0])} (label {int(ds.labels[bad[0]])}); label them or leave them out of the split, "
                "and prepare the dataset again"
            )  # fmt: skip


class LocalPasses(SourceDefaults):
    """Dataset, samplers, feature store and pipeline runs of one process (see the module docstring)."""

    def __init__(self, cfg: NodeDataConfig, ctx: ProcessContext, dataset: OnDiskDataset | None = None):
        self.cfg, self.ctx = cfg, ctx
        self._traces_written: dict[str, int] = {}  # timeline files written per split (profile=DIR)
        self._runs: weakref.WeakSet[EpochRun] = weakref.WeakSet()  # runs started, while they exist
        ds = self.dataset = dataset if dataset is not None else open_for(cfg, ctx)
        self.batches = self._seed_batches(ds)
        self.sampler, self.eval_sampler = self._samplers(ds)
        self.device = ctx.device
        self._check_before_presample()
        reader = self._open_reader(ds)
        try:
            n = max(1, cfg.presample_batches)
            presampled = list(self.presample(min(n, PLAN_BATCHES), stream=0))
            self.store: TieredFeatureStore = self._build_store(reader, presampled,
                                                               lambda: self.presample(n, stream=1))  # fmt: skip
        except BaseException:
            self._close_reader(reader)
            raise
        self.eval_store = self.store.without("buffer")
        if ctx.rank == 0:
            log.info("%s", self.describe(presampled))

    def _seed_batches(self, ds: OnDiskDataset) -> SeedBatches:
        """The minibatches of every split (of seed nodes here; a subclass may batch other seeds)."""
        return seed_batches(self.cfg, ds, self.ctx)

    def _samplers(self, ds: Any) -> tuple[Any, Any]:
        return neighbor_samplers(self.cfg, ds)

    def _open_reader(self, ds: Any) -> Any:
        """The SSD reader(s) of the features, handed to :meth:`_build_store`."""

        cfg = self.cfg
        return FeatureReader.from_dataset(ds, backend=cfg.io_backend, queue_depth=cfg.queue_depth,
                                          workers=cfg.num_extractors)  # fmt: skip

    def _close_reader(self, reader: Any) -> None:
        reader.close()

    def _build_store(self, reader: Any, presampled: list[torch.Tensor],
                     counted: Callable[[], Iterator[torch.Tensor]]) -> TieredFeatureStore:  # fmt: skip
        """Plan the tiers from the presampled batches and build them (the reader becomes the SSD tier's);
        the host cache's rows are ranked over the ``counted`` batches."""
        cfg, ctx, ds = self.cfg, self.ctx, self.dataset
        self.plan, hot = plan_store(cfg, ds, reader, self.device, presampled, processes=ctx.local_world,
                                    topology_shared=ctx.topology is not None, counted=counted,
                                    seeds_per_batch=self._seeds_per_batch(), **self._seed_memory())  # fmt: skip
        return build_store(self.plan, hot, ds, reader, self.device, staging_memory=self._staging_memory(self.plan),
                           progress=cfg.progress and ctx.rank == 0)  # fmt: skip

    def _seed_memory(self) -> dict[str, Any]:
        """What the plan counts for the seeds of every split (node ids here: ``meta.json``'s split sizes)
        and for what a batch carries besides its nodes (a link batch's negatives)."""
        return {}

    def _check_before_presample(self) -> None:
        """Refuse at once what no plan can fit, whatever the presample shows: a link batch's negatives
        (:func:`~lightning_ooc.store.memory.check_negatives`), which the presample would draw hundreds
        of times before the plan saw them."""
        negatives = self._seed_memory().get("negatives")
        if negatives is None or self.cfg.memory_limit is None:
            return
        ds, cfg = self.dataset, self.cfg
        limit = limit_for_plan(cfg.memory_limit)
        shape = ProcessShape(num_nodes=ds.num_nodes, row_bytes=ds.row_bytes, max_nodes_per_batch=0,
                             max_edges_per_batch=0, num_samplers=cfg.num_samplers, num_extractors=cfg.num_extractors,
                             extract_queue_size=cfg.extract_queue_size, train_queue_size=cfg.train_queue_size,
                             host_cache_policy="degree", topology_shared=self.ctx.topology is not None, train_nodes=0,
                             seed_order_bytes=0, seeds_held_bytes=0, eval_seed_bytes=0, negatives=negatives)  # fmt: skip
        check_negatives(shape, limit, processes=self.ctx.local_world)

    def _seeds_per_batch(self) -> int:
        """The most seed nodes a training minibatch starts from: what the plan bounds a batch's size by."""
        return self.cfg.batch_size

    def presample(self, n: int, stream: int = 0) -> Iterator[torch.Tensor]:
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

    def _presample_nodes(self, seeds: torch.Tensor, seed: int) -> torch.Tensor:
        """The node ids a training minibatch of ``seeds`` touches (for the plan and the host cache's ranking)."""
        return self.sampler.sample_subgraph(seeds, seed=seed).n_id

    def _staging_memory(self, plan: StorePlan):
        """This rank's portion of the machine's shared staging segment (``None``: private memory)."""
        shared = self.ctx.staging
        if shared is None:
            return None
        size = staging_layout_bytes(plan, self.dataset)
        mm = shared.buffer("staging", size * shared.local_world)
        lo = shared.local_rank * size
        return memoryview(mm)[lo : lo + size]

    def describe(self, presampled: list[torch.Tensor]) -> str:
        cfg, world = self.cfg, self.ctx.world
        seen = max((int(b.numel()) for b in presampled), default=0)
        extra = [
            f"  pipeline        {cfg.num_samplers} samplers, {cfg.num_extractors} extractors, queues "
            f"{cfg.extract_queue_size}/{cfg.train_queue_size}, {cfg.order}",
            f"  minibatches     {self.batches.count('train')} x {cfg.batch_size} seeds per epoch"
            + (f" per process ({world} processes)" if world > 1 else "")
            + f", fanout {cfg.num_neighbors}, up to ~{self.plan.max_nodes_per_batch:,} nodes each "
            f"(presample max {seen:,})",
        ]
        return self.plan.format(extra=extra)

    def run(self, split: str, epoch: int, skip: frozenset[int] = frozenset(),
            on_end: Callable[[EpochStats], None] | None = None, on_batch: Callable[[int], None] | None = None,
            name: str | None = None) -> EpochRun:  # fmt: skip
        """Start a pass over ``split``: training passes use the feature buffer, evaluation passes read past it.

        Every pass runs in ``cfg.order``: in order, evaluation metrics accumulate in the same order
        run to run too, so a run is reproducible to the last bit (the evaluation store holds no
        buffer slots, so its window costs nothing)."""
        cfg = self.cfg
        train = split == "train"
        sample = self._sample_fn(split)
        trace_path: Callable[[], Path] | None = None
        if cfg.profile is not None:  # numbered per split when written (evaluation passes all have epoch 0)
            counts = self._traces_written
            label, rank, where = name or split, self.ctx.rank, Path(cfg.profile)

            def next_trace_path() -> Path:
                n = counts[label] = counts.get(label, -1) + 1
                return where / f"ooc-rank{rank}-{label}-{n:03d}.trace.json"

            trace_path = next_trace_path

        if train and getattr(cfg, "host_cache_policy", None) == "scored":  # its rounds per epoch
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
            seed=sampling_seed(cfg, self.ctx.rank), num_samplers=cfg.num_samplers, num_extractors=cfg.num_extractors,
            extract_queue_size=cfg.extract_queue_size, train_queue_size=cfg.train_queue_size,
            order=cfg.order, device=self.device, skip=skip, on_batch=on_batch,
            on_end=on_end, name=name or split, trace_path=trace_path,
        )  # fmt: skip
        self._runs.add(run)
        return run

    def _scored_host_cache(self) -> Any:
        """This process's own scored host cache tier (``host_cache_policy="scored"``), if its chain has one."""

        store = self.own_store()
        host = store.of(HOMOGENEOUS).tier("host_cache") if HOMOGENEOUS in store.node_types else None
        return host if isinstance(host, ScoredHostCacheTier) else None

    def own_store(self) -> FeatureStore:
        """The store of this process's own rows (a partitioned dataset's: its partition's, without the
        remote tier)."""
        return self.store

    def _sample_fn(self, split: str) -> Callable[[torch.Tensor, int, int], Any]:
        """The pipeline's sampler of ``split``: ``(seeds, seed, k) -> Data`` (``k``: the batch's number)."""
        sampler = self.sampler if split == "train" else self.eval_sampler

        def sample(seeds: torch.Tensor, seed: int, k: int) -> Any:
            return sampler.sample(seeds, seed=seed)

        return sample

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
