"""lightning_ooc: train graph neural networks on graphs larger than memory.

Features live on SSD and reach the model through a storage hierarchy (device
feature buffer, pinned host cache, bounded staging buffer, direct-I/O reads
through io_uring). See ``docs/architecture.md``.

>>> import lightning_ooc
>>> lightning_ooc.__version__
'0.1.0'
"""
from __future__ import annotations

from lightning_ooc._version import __version__
from lightning_ooc.errors import (
    CorruptDatasetError,
    DatasetChangedError,
    DatasetError,
    DatasetNotFoundError,
    DatasetWriteError,
    FormatVersionError,
    InputError,
    InterruptedAfterCommit,
    LightningOOCError,
)
from lightning_ooc.data.dataset import OnDiskDataset, open_dataset
from lightning_ooc.loader.features import InMemory, Learnable, Mapped, Packed, Partitioned, Tiered
from lightning_ooc.loader.settings import Pipeline, PredictSettings
from lightning_ooc._registry import register_strategy

register_strategy()  # strategy="ooc" for lightning.Trainer, without importing Lightning here


def __getattr__(name: str):
    # Heavy imports (lightning, the native modules) only when asked for.
    if name == "OutOfCoreNodeData":
        from lightning_ooc.datamodule import OutOfCoreNodeData  # lazy: it imports Lightning and PyG and Triton

        return OutOfCoreNodeData
    if name == "OutOfCoreLinkData":
        from lightning_ooc.datamodule import OutOfCoreLinkData  # lazy: it imports Lightning and PyG and Triton

        return OutOfCoreLinkData
    if name == "OutOfCoreHeteroNodeData":
        from lightning_ooc.datamodule import OutOfCoreHeteroNodeData  # lazy: it imports Lightning and PyG and Triton

        return OutOfCoreHeteroNodeData
    if name == "PackedNodeData":
        from lightning_ooc.datamodule import PackedNodeData  # lazy: it imports Lightning and PyG and Triton

        return PackedNodeData
    if name == "OutOfCoreEmbeddingData":
        from lightning_ooc.embed.datamodule import OutOfCoreEmbeddingData  # lazy: it imports Lightning

        return OutOfCoreEmbeddingData
    if name == "OutOfCoreStrategy":
        from lightning_ooc.strategy import OutOfCoreStrategy  # lazy: it imports Lightning

        return OutOfCoreStrategy
    raise AttributeError(f"module 'lightning_ooc' has no attribute {name!r}")

__all__ = [
    "__version__",
    "open_dataset",
    "OutOfCoreNodeData",
    "OutOfCoreLinkData",
    "OutOfCoreHeteroNodeData",
    "OutOfCoreEmbeddingData",
    "PackedNodeData",
    "Tiered",
    "Packed",
    "InMemory",
    "Mapped",
    "Learnable",
    "Partitioned",
    "Pipeline",
    "PredictSettings",
    "OutOfCoreStrategy",
    "OnDiskDataset",
    "LightningOOCError",
    "DatasetError",
    "DatasetNotFoundError",
    "CorruptDatasetError",
    "DatasetChangedError",
    "FormatVersionError",
    "DatasetWriteError",
    "InputError",
    "InterruptedAfterCommit",
]
