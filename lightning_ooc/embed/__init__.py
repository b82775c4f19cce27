"""Trainable node embeddings larger than memory: partition-buffer training over a table on SSD.

* :mod:`~lightning_ooc.embed.table`: the table on disk (``[embedding | Adagrad state]`` rows in
  partitions, written back by generations) and :func:`init_embeddings`;
* :mod:`~lightning_ooc.embed.buckets`: edges grouped into N x N buckets;
* :mod:`~lightning_ooc.embed.order`: the partition orders (Legend's, Marius's BETA, greedy);
* :mod:`~lightning_ooc.embed.partition_buffer`: the partition buffer on the training device;
* :mod:`~lightning_ooc.embed.passes`: one pass over a split's buckets (batches, swaps, statistics);
* :mod:`~lightning_ooc.embed.embedding_data`: :class:`OutOfCoreEmbeddingData`, with its settings groups
  :class:`PartitionBuffering` and :class:`ChunkNegatives` (:mod:`~lightning_ooc.embed.embedding_config`);
* :mod:`~lightning_ooc.embed.optim`: the sparse Adagrad step applied to buffer rows.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EmbeddingTable": "table", "init_embeddings": "table", "EdgeBuckets": "buckets",
    "PartitionBuffer": "partition_buffer",
    "EmbeddingBatch": "batch", "PartitionPass": "passes", "OutOfCoreEmbeddingData": "embedding_data",
    "partition_order": "order", "legend_order": "order", "beta_order": "order", "greedy_order": "order",
    "swap_lower_bound": "order", "sparse_adagrad_": "optim", "PartitionBuffering": "embedding_config",
    "ChunkNegatives": "embedding_config",
}  # fmt: skip

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # the datamodule imports Lightning: only when asked for
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"lightning_ooc.embed.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'lightning_ooc.embed' has no attribute {name!r}")
