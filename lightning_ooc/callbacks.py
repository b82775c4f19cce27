"""Callbacks: :class:`RunReport` prints what a run achieved (accuracy, throughput) on rank 0.

Example::

    >>> import tempfile, lightning as L
    >>> from lightning_ooc import OutOfCoreNodeData, Tiered
    >>> from lightning_ooc.callbacks import RunReport
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.models import GraphSAGE
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=2000, avg_degree=5, num_features=8,
    ...                   num_classes=3, train_frac=0.2, progress=False)
    >>> dm = OutOfCoreNodeData(root, batch_size=100, num_neighbors=[4, 4], progress=False,
    ...                        features=Tiered(gpu_cache="4MiB", host_cache="16KiB", staging="1MiB"))
    >>> report = RunReport()
    >>> trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
    ...                     enable_progress_bar=False, enable_model_summary=False, callbacks=[report])
    >>> trainer.fit(GraphSAGE(8, 3, hidden_channels=16, num_layers=2), datamodule=dm)  # doctest: +ELLIPSIS
    fit: 1 epoch(s), 399 training seeds per epoch over 1 process(es), ... seeds/s, val_acc ...
    >>> report.seeds_per_epoch == len(dm.dataset.split("train"))
    True
"""
from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch


class RunReport(L.Callback):
    """After ``fit``: epochs, training seeds per second over all processes, last ``val_acc``; after ``test``: ``test_acc``."""

    def __init__(self) -> None:
        self.seeds_per_epoch = 0
        self.seeds_per_second = 0.0
        self._seeds = 0
        self._seconds = 0.0
        self._t0 = 0.0
        self._epoch_seeds = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a run resumed mid-epoch gets no on_train_epoch_start for that epoch
        self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = time.perf_counter()
        self._epoch_seeds = 0

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._epoch_seeds += int(getattr(batch, "batch_size", 0))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seconds = time.perf_counter() - self._t0
        # on the strategy's device: NCCL reduces only tensors on the rank's GPU
        count = torch.tensor(float(self._epoch_seeds), device=trainer.strategy.root_device)
        seeds = int(trainer.strategy.reduce(count, reduce_op="sum").item())
        self.seeds_per_epoch = seeds
        self._seeds += seeds
        self._seconds += seconds

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seeds_per_second = self._seeds / self._seconds if self._seconds else 0.0
        if trainer.is_global_zero:
            val = trainer.callback_metrics.get("val_acc")
            acc = f"val_acc {float(val):.3f}" if val is not None else "no validation"
            print(f"fit: {trainer.current_epoch} epoch(s), {self.seeds_per_epoch:,} training seeds per epoch over "
                  f"{trainer.world_size} process(es), {self.seeds_per_second:,.0f} seeds/s, {acc}", flush=True)  # fmt: skip

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        acc = trainer.callback_metrics.get("test_acc")
        if trainer.is_global_zero and acc is not None:
            sep = "\n" if trainer.progress_bar_callback is not None else ""  # the bar's line may still be open
            print(f"{sep}test: test_acc {float(acc):.3f}", flush=True)
