"""Synchronous reference loaders: the baselines that benchmarks and tests compare against.

``BaselineNodeData(features="mmap")`` is what "PyG with memory-mapped
features" amounts to: sample a batch, index a NumPy memmap of the feature
file (through the page cache), train, repeat; no thread, no cache of ours.
``features="ram"`` holds the whole feature matrix in memory: the upper bound.
Both use the same seed batches and per-batch sampling seeds as
:class:`~lightning_ooc.OutOfCoreNodeData`, so in order mode they produce the
very same minibatches.
"""
from __future__ import annotations

import os
import time
from typing import Iterator

import numpy as np
import torch
from torch_geometric.data import Data

from lightning_ooc.data.dataset import open_dataset
from lightning_ooc.datamodule import OutOfCoreNodeData
from lightning_ooc.loader.pipeline import EpochStats, batch_seed


class _SyncRun:
    def __init__(self, dm: "BaselineNodeData", split: str, batches: list[torch.Tensor], epoch: int):
        self.dm, self.split, self.batches, self.epoch = dm, split, batches, epoch
        self.stats = EpochStats()
        self._it = self._gen()

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> "_SyncRun":
        return self

    def __next__(self) -> Data:
        return next(self._it)

    def close(self) -> None:
        self._it.close()

    def _gen(self) -> Iterator[Data]:
        dm = self.dm
        sampler = dm.sampler if self.split == "train" else dm.eval_sampler
        t0 = time.perf_counter()
        for k, seeds in enumerate(self.batches):
            t1 = time.perf_counter()
            data = sampler.sample(seeds, seed=batch_seed(dm.hparams.seed, self.epoch, k))
            data.batch_index = k
            data.x = dm._rows(data.n_id)
            self.stats.wait_seconds += time.perf_counter() - t1  # the trainer waits for all of it
            self.stats.batches += 1
            self.stats.seeds += int(data.batch_size)
            self.stats.nodes += int(data.n_id.numel())
            self.stats.seconds = time.perf_counter() - t0
            if self.stats.batches == len(self.batches):
                dm.last_stats[self.split] = self.stats
            yield data


class BaselineNodeData(OutOfCoreNodeData):
    """Same batches as :class:`OutOfCoreNodeData`, features read synchronously from RAM or a memmap.

    Example::

        >>> import tempfile
        >>> from lightning_ooc.data.synth import synthesize
        >>> from lightning_ooc.loader.baseline import BaselineNodeData
        >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=500, avg_degree=4, num_features=8,
        ...                   num_classes=2, train_frac=0.2, progress=False)
        >>> dm = BaselineNodeData(root, features="ram", batch_size=50, num_neighbors=[3])
        >>> dm.setup()
        >>> batch = next(iter(dm.train_dataloader()))
        >>> bool((batch.x == dm.dataset.read_features(batch.n_id)).all())
        True
    """

    def __init__(self, root: str | os.PathLike, features: str = "ram", **kwargs):
        if features not in ("ram", "mmap"):
            raise ValueError(f"features must be 'ram' or 'mmap', got {features!r}")
        kwargs.setdefault("order", "in_order")
        root = str(root)
        super().__init__(root, **kwargs)
        self.features = features
        self._x: torch.Tensor | np.ndarray | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.dataset is not None:
            return
        from lightning_ooc.sampling import NeighborSampler

        ds = self.dataset = open_dataset(self.root)
        self.sampler = NeighborSampler(ds, self.num_neighbors, replace=self.hparams.replace)
        self.eval_sampler = self.sampler if self.eval_num_neighbors == self.num_neighbors else NeighborSampler(
            ds, self.eval_num_neighbors, replace=self.hparams.replace)  # fmt: skip
        if self.features == "ram":
            self._x = ds.read_features(np.arange(ds.num_nodes))
        else:
            self._x = ds.features_memmap()

    def _rows(self, n_id: torch.Tensor) -> torch.Tensor:
        if isinstance(self._x, torch.Tensor):
            return self._x.index_select(0, n_id)
        rows = torch.from_numpy(np.ascontiguousarray(self._x[n_id.numpy()]))
        assert self.dataset is not None
        return rows.view(self.dataset.feature_dtype) if self.dataset.feature_dtype == torch.bfloat16 else rows

    def _start(self, split: str):
        if self.dataset is None:
            self.setup()
        trainer = getattr(self, "trainer", None)
        epoch = trainer.current_epoch if trainer is not None and split == "train" else 0
        return _SyncRun(self, split, self._batches(split, epoch), epoch)

    def teardown(self, stage: str | None = None) -> None:
        for p in self._passes.values():
            p.close()
