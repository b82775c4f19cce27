"""Synchronous reference passes: the baselines that benchmarks and tests compare against.

``SyncPasses(features="mmap")`` is what "PyG with memory-mapped features"
amounts to: sample a batch, index a NumPy memmap of the feature file (through
the page cache; ``madvise_random`` turns read-ahead off, the strongest honest
setting for random rows), train, repeat; no thread, no cache of ours.
``features="ram"`` holds the whole feature matrix in memory: the upper bound.
:class:`DeviceTablePasses` is the reference with every row in the training
device's memory: the same pipeline as ours (samplers, extractors, out of
order), with one tier, a table on the device, instead of the hierarchy.
Both use the same seed batches and per-batch sampling seeds as
:class:`~lightning_ooc.loader.source.LocalPasses`, so in order they produce
the very same minibatches. A datamodule runs them with ``features=Mapped(...)``
and ``features=InMemory()`` (:mod:`lightning_ooc.loader.features`).
"""
from __future__ import annotations

import mmap
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch_geometric.data import Data

from lightning_ooc.data.dataset import read_ahead_off
from lightning_ooc.errors import InputError
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext, SourceDefaults
from lightning_ooc.loader.pipeline import EpochStats, batch_counts, batch_seed
from lightning_ooc.loader.source import LocalPasses, sampling_seed
from lightning_ooc.loader.tasks import NodeTask
from lightning_ooc.store.typed_stores import HeteroFeatureStore
from lightning_ooc.store.protocol import HOMOGENEOUS, StoreProtocol
from lightning_ooc.store.tiered import TieredFeatureStore
from lightning_ooc.store.tiers import DeviceTableTier

FEATURES = ("ram", "mmap")


class SyncRun:
    """One synchronous pass: each ``next()`` samples a batch and reads its rows, in the caller's thread."""

    def __init__(self, source: "SyncPasses", split: str, epoch: int, skip: frozenset[int],
                 on_end: Callable[[EpochStats], None] | None, on_batch: Callable[[int], None] | None):  # fmt: skip
        self.source, self.split, self.epoch = source, split, epoch
        self.batches = source.batches.epoch(split, epoch)
        self.todo = [k for k in range(len(self.batches)) if k not in skip]
        self.on_end, self.on_batch = on_end, on_batch
        self.stats = EpochStats()
        self._it = self._gen()

    def __len__(self) -> int:
        return len(self.todo)

    def __iter__(self) -> "SyncRun":
        return self

    def __next__(self) -> Data:
        return next(self._it)

    def close(self) -> None:
        self._it.close()

    def _gen(self) -> Iterator[Data]:
        src = self.source
        seed = sampling_seed(src.cfg, src.ctx.rank)
        t0 = time.perf_counter()
        for k in self.todo:
            seeds = self.batches[k]
            t1 = time.perf_counter()
            data = src.sample(self.split, seeds, batch_seed(seed, self.epoch, k))
            data.batch_index = k
            src.attach(data)
            self.stats.wait_seconds += time.perf_counter() - t1  # the trainer waits for all of it
            seeds_k, nodes_k, _ = batch_counts(data)
            self.stats.batches += 1
            self.stats.seeds += seeds_k
            self.stats.nodes += nodes_k
            self.stats.seconds = time.perf_counter() - t0
            if self.on_batch is not None:
                self.on_batch(k)
            if self.stats.batches == len(self.todo) and self.on_end is not None:
                self.on_end(self.stats)
            yield data


class SyncPasses(SourceDefaults):
    """A task's batches with features in RAM or a memmap, one table per node type; passes run synchronously
    in the caller. The task is the class attribute ``task_type`` (the node task here)."""

    #: the task whose batches the passes carry (:mod:`lightning_ooc.loader.tasks`)
    task_type: type[NodeTask] = NodeTask

    def __init__(self, cfg: NodeDataConfig, ctx: ProcessContext, features: str = "ram", madvise_random: bool = False):
        self.cfg, self.ctx = cfg, ctx
        self.features = self.check_features(features)
        self.task = self.task_type(cfg, ctx)
        ds = self.dataset = self.task.dataset
        self.batches = self.task.seed_batches(ds)
        self.sampler, self.eval_sampler = self.task.samplers()
        # each node type's table and row dtype, looked up once here rather than per batch
        self._tables: dict[str | None, tuple[Any, torch.dtype]] = {
            t: (self.load_rows(view, self.features, madvise_random), view.feature_dtype)
            for t, view in self.task.feature_views().items()
        }  # fmt: skip

        if madvise_random:  # what is read at random is read without read-ahead: the topology's maps too
            self._random_topology(ds)

    def _random_topology(self, ds: Any) -> None:
        """Read-ahead off on the maps the sampler reads at random: ``indices``, and the times temporal sampling
        searches (a map read with read-ahead under a memory cap evicts what the last faults read)."""
        times = {"edge_time": getattr(ds, "edge_time", None), "time": getattr(ds, "node_time", None)}
        for a in (getattr(ds, "indices", None), times.get(getattr(self.cfg, "time_attr", None))):
            if isinstance(a, np.ndarray):
                read_ahead_off(a)

    @staticmethod
    def load_rows(ds: Any, features: str, madvise_random: bool) -> torch.Tensor | np.ndarray:
        """Every feature row of ``ds`` in RAM, or its memmap (read-ahead off with ``madvise_random``)."""
        if features == "ram":
            return ds.read_features(np.arange(ds.num_nodes))
        x = ds.features_memmap()
        if madvise_random and getattr(x, "_mmap", None) is not None:
            x._mmap.madvise(mmap.MADV_RANDOM)
        return x

    def sample(self, split: str, seeds: torch.Tensor, seed: int) -> Any:
        """The minibatch of ``seeds`` of ``split``, drawn with ``seed`` (no ``x``)."""
        return self.task.sample(split, self.sampler if split == "train" else self.eval_sampler, seeds, seed)

    @staticmethod
    def check_features(features: str) -> str:
        if features not in FEATURES:
            raise InputError(f"features must be one of {', '.join(FEATURES)}, got {features!r}")
        return features

    @staticmethod
    def take_rows(x: torch.Tensor | np.ndarray, n_id: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``n_id`` of a table in RAM or a memmap, as a tensor of ``dtype``."""
        if isinstance(x, torch.Tensor):
            return x.index_select(0, n_id)
        rows = torch.from_numpy(np.ascontiguousarray(x[n_id.numpy()]))
        return rows.view(dtype) if dtype == torch.bfloat16 else rows

    def attach(self, data: Any) -> None:
        """Set the batch's ``x``, of every node type with features (read in the caller's thread)."""
        for t, (table, dtype) in self._tables.items():
            part = data if t is HOMOGENEOUS else data[t]
            part.x = self.take_rows(table, part.n_id, dtype)

    def run(self, split: str, epoch: int, skip: frozenset[int] = frozenset(),
            on_end: Callable[[EpochStats], None] | None = None, on_batch: Callable[[int], None] | None = None,
            **_: Any) -> SyncRun:  # fmt: skip
        return SyncRun(self, split, epoch, skip, on_end, on_batch)

    def close(self) -> None:
        self._tables = {}


class DeviceTablePasses(LocalPasses):
    """:class:`~lightning_ooc.loader.source.LocalPasses` whose store is one table of every row in the
    training device's memory per node type (:class:`~lightning_ooc.store.tiers.DeviceTableTier`): the same
    pipeline, none of the hierarchy. On a GPU it is the "all features in GPU memory" reference."""

    def _check_before_presample(self) -> None:
        """No plan, no memory check: the reference holds every row."""

    def _presample_batches(self) -> int:
        return 1

    def _open_reader(self, ds: Any) -> dict[str | None, Any]:
        """No SSD reader: the table is read whole from each view at :meth:`_build_store`."""
        if not self.task.feature_views(ds):
            raise InputError(f"{ds.root}: no node type has features; there is nothing to hold in memory")
        return {}

    def _build_store(self, reader: Any, presampled: Any, counted: Any = None) -> StoreProtocol:
        self.plan = None
        stores = {t: TieredFeatureStore([DeviceTableTier.load(v, self.device)], v.num_features, v.feature_dtype)
                  for t, v in self.task.feature_views().items()}  # fmt: skip
        return stores[HOMOGENEOUS] if self.task.node_types == (HOMOGENEOUS,) else HeteroFeatureStore(stores)

    def describe(self, presampled: Any) -> str:
        rows = ", ".join(f"{'' if t is HOMOGENEOUS else t + ' '}{v.num_nodes:,} x {v.row_bytes} B"
                         for t, v in self.task.feature_views().items())  # fmt: skip
        p = self.cfg.pipeline
        return (f"lightning_ooc reference: every feature row ({rows}) in {self.device} "
                f"memory; {p.num_samplers} samplers, {p.num_extractors} extractors, {p.order}")
