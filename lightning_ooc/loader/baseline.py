"""Synchronous reference passes: the baselines that benchmarks and tests compare against.

``SyncPasses(features="mmap")`` is what "PyG with memory-mapped features"
amounts to: sample a batch, index a NumPy memmap of the feature file (through
the page cache; ``madvise_random`` turns read-ahead off, the strongest honest
setting for random rows), train, repeat; no thread, no cache of ours.
``features="ram"`` holds the whole feature matrix in memory: the upper bound;
``features="device"`` holds it in the training device's memory (on a GPU:
every row already there, gathered by ``index_select`` on the GPU).
Both use the same seed batches and per-batch sampling seeds as
:class:`~lightning_ooc.loader.source.LocalPasses`, so in order they produce
the very same minibatches. :class:`~lightning_ooc.datamodule.BaselineNodeData`
is the datamodule that runs them.
"""
from __future__ import annotations

import mmap
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch_geometric.data import Data

from lightning_ooc.errors import InputError
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.loader.pipeline import EpochStats, batch_seed
from lightning_ooc.loader.source import open_for, sampling_seed, seed_batches

FEATURES = ("ram", "mmap", "device")


class SyncRun:
    """One synchronous pass: each ``next()`` samples a batch and reads its rows, in the caller's thread."""

    def __init__(self, source: "SyncPasses", split: str, epoch: int, skip: frozenset[int],
                 on_end: Callable[[EpochStats], None] | None, on_batch: Callable[[int], None] | None):  # fmt: skip
        self.source, self.split, self.epoch = source, split, epoch
        batches = source.batches.epoch(split, epoch)
        self.todo = [(k, b) for k, b in enumerate(batches) if k not in skip]
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
        sampler = src.sampler if self.split == "train" else src.eval_sampler
        seed = sampling_seed(src.cfg, src.ctx.rank)
        t0 = time.perf_counter()
        for k, seeds in self.todo:
            t1 = time.perf_counter()
            data = sampler.sample(seeds, seed=batch_seed(seed, self.epoch, k))
            data.batch_index = k
            data.x = src.rows(data.n_id)
            self.stats.wait_seconds += time.perf_counter() - t1  # the trainer waits for all of it
            self.stats.batches += 1
            self.stats.seeds += int(data.batch_size)
            self.stats.nodes += int(data.n_id.numel())
            self.stats.seconds = time.perf_counter() - t0
            if self.on_batch is not None:
                self.on_batch(k)
            if self.stats.batches == len(self.todo) and self.on_end is not None:
                self.on_end(self.stats)
            yield data


class SyncPasses:
    """Dataset, samplers and features in RAM or a memmap; passes run synchronously in the caller."""

    def __init__(self, cfg: NodeDataConfig, ctx: ProcessContext, features: str = "ram", madvise_random: bool = False):
        from lightning_ooc.sampling import NeighborSampler

        self.cfg, self.ctx = cfg, ctx
        self.features = self.check_features(features)
        ds = self.dataset = open_for(cfg, ctx)
        self.batches = seed_batches(cfg, ds, ctx)
        self.sampler = NeighborSampler(ds, cfg.num_neighbors, replace=cfg.replace)
        self.eval_sampler = (self.sampler if cfg.eval_fanout == cfg.num_neighbors
                             else NeighborSampler(ds, cfg.eval_fanout, replace=cfg.replace))  # fmt: skip
        self._x: torch.Tensor | np.ndarray
        if self.features == "ram":
            self._x = ds.read_features(np.arange(ds.num_nodes))
        elif self.features == "device":
            self._x = torch.empty((ds.num_nodes, ds.num_features), dtype=ds.feature_dtype, device=ctx.device)
            step = max(1, (256 << 20) // max(ds.row_bytes, 1))  # 256 MiB of host memory at a time
            for s in range(0, ds.num_nodes, step):
                e = min(ds.num_nodes, s + step)
                self._x[s:e] = ds.read_features(np.arange(s, e)).to(ctx.device)
        else:
            self._x = ds.features_memmap()
            if madvise_random and getattr(self._x, "_mmap", None) is not None:
                self._x._mmap.madvise(mmap.MADV_RANDOM)

    @staticmethod
    def check_features(features: str) -> str:
        if features not in FEATURES:
            raise InputError(f"features must be one of {', '.join(FEATURES)}, got {features!r}")
        return features

    def rows(self, n_id: torch.Tensor) -> torch.Tensor:
        if isinstance(self._x, torch.Tensor):
            return self._x.index_select(0, n_id.to(self._x.device))
        rows = torch.from_numpy(np.ascontiguousarray(self._x[n_id.numpy()]))
        ds = self.dataset
        return rows.view(ds.feature_dtype) if ds.feature_dtype == torch.bfloat16 else rows

    def run(self, split: str, epoch: int, skip: frozenset[int] = frozenset(),
            on_end: Callable[[EpochStats], None] | None = None, on_batch: Callable[[int], None] | None = None,
            **_: Any) -> SyncRun:  # fmt: skip
        return SyncRun(self, split, epoch, skip, on_end, on_batch)

    def close(self) -> None:
        self._x = None  # type: ignore[assignment]
