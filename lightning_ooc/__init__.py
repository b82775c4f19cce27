"""lightning_ooc: train graph neural networks on graphs larger than memory.

Features live on SSD and reach the model through a storage hierarchy (device
feature buffer, pinned host cache, bounded staging buffer, direct-I/O reads
through io_uring). See ``docs/architecture.md``.

>>> import lightning_ooc
>>> lightning_ooc.__version__
'0.1.0'
"""
from __future__ import annotations

import importlib

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


#: what is imported on first use (Lightning, PyG, Triton and the native modules load with it): name -> module
_LAZY = {
    "OutOfCoreNodeData": "lightning_ooc.datamodule",
    "OutOfCoreLinkData": "lightning_ooc.datamodule",
    "OutOfCoreEmbeddingData": "lightning_ooc.embed.embedding_data",
    "PartitionBuffering": "lightning_ooc.embed.embedding_config",
    "ChunkNegatives": "lightning_ooc.embed.embedding_config",
    "OutOfCoreStrategy": "lightning_ooc.strategy",
    # earlier names, each a function that warns once with the new spelling
    "OutOfCoreHeteroNodeData": "lightning_ooc.datamodule",
    "PackedNodeData": "lightning_ooc.datamodule",
}


def __getattr__(name: str):
    # Heavy imports (lightning, the native modules) only when asked for.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_ooc' has no attribute {name!r}")


__all__ = [
    "__version__",
    "open_dataset",
    "OutOfCoreNodeData",
    "OutOfCoreLinkData",
    "OutOfCoreEmbeddingData",
    "OutOfCoreHeteroNodeData",
    "PackedNodeData",
    "Tiered",
    "Packed",
    "InMemory",
    "Mapped",
    "Learnable",
    "Partitioned",
    "Pipeline",
    "PredictSettings",
    "PartitionBuffering",
    "ChunkNegatives",
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
