"""Pass sources whose input features are an embedding table's trainable rows (``features=Learnable(...)``).

:class:`LearnableMixin` changes three hooks of a pass source and keeps the
rest (seed batches, samplers, presample, plan, pipeline runs): the reader is
the table's (its partition file, rows of ``[embedding | Adagrad state]``), the
store is a :class:`~lightning_ooc.store.learnable_rows.LearnableFeatureStore`
(the feature buffer over staging and that reader; no host cache, whose rows
could not change), and every evaluation pass first flushes the trained rows
to the table, so that it reads them. :class:`LearnablePasses` is it over
:class:`~lightning_ooc.loader.source.LocalPasses` (node classification),
:class:`LearnableLinkPasses` is the same backend over the link task.

Example::

    >>> import tempfile, torch
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.embed.table import init_embeddings
    >>> from lightning_ooc.loader.config import NodeDataConfig
    >>> from lightning_ooc.loader.features import Learnable
    >>> from lightning_ooc.loader.context import ProcessContext
    >>> from lightning_ooc.loader.learnable_passes import LearnablePasses
    >>> d = tempfile.mkdtemp()
    >>> root = synthesize(d + "/g", num_nodes=500, avg_degree=4, num_features=4, num_classes=2, train_frac=0.2,
    ...                   progress=False)
    >>> emb = init_embeddings(d + "/e", dataset=root, dim=8, progress=False)
    >>> cfg = NodeDataConfig(root, batch_size=50, num_neighbors=[3], progress=False, pipeline={"order": "in_order"},
    ...                      features=Learnable(emb, gpu_cache="1MiB", staging="256KiB"))
    >>> passes = LearnablePasses(cfg, ProcessContext())
    >>> batch = next(iter(passes.run("train", epoch=0)))
    >>> batch.x.shape[1], batch.x.requires_grad
    (8, True)
    >>> batch.x.sum().backward()            # the gradient of x updates the rows in the buffer
    >>> passes.close()                      # trained rows are written back to the table
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import torch

from lightning_ooc.errors import InputError
from lightning_ooc.loader.link_task import LinkTask, LinkPassesMixin
from lightning_ooc.loader.source import LocalPasses
from lightning_ooc.store.planner import plan_store
from lightning_ooc.embed.rows import TableRows
from lightning_ooc.embed.table import EmbeddingTable
from lightning_ooc.io import FeatureReader
from lightning_ooc.store.learnable_rows import LearnableBuffer, LearnableFeatureStore, LearnableTier, TableRowsTier
from lightning_ooc.store.staging import StagingBuffer
from lightning_ooc.utils.shutdown import forget, stop_at_exit

log = logging.getLogger("lightning_ooc")


class _TableView:
    """A dataset whose features are an embedding table's rows (for the plan: row size, reader, reference)."""

    def __init__(self, ds: Any, table: Any):
        self._ds, self._table = ds, table
        self.num_features = table.row_floats
        self.feature_dtype = torch.float32
        self.row_bytes = table.row_bytes
        self.features_path = table.partition_path(0)

    def read_features(self, ids: Any) -> torch.Tensor:
        return self._table.rows(ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ds, name)


def open_table(cfg: Any, ds: Any) -> Any:
    """The embedding table of ``cfg.features.table``, open for writing, checked against the dataset."""

    if cfg.features.table is None:
        raise InputError("features=Learnable(table=TABLE) needs a table (from `lightning-ooc init-embeddings`)")
    return open_feature_table(cfg.features.table, ds, backend=cfg.features.io_backend)


def open_feature_table(path: Any, ds: Any, backend: str = "auto", writable: bool = True) -> Any:
    """The embedding table at ``path`` as the input features of ``ds``: one row per node, one partition, the
    partition checked whole (rows are read one by one from then on, unchecked)."""
    table = EmbeddingTable(path, backend=backend, writable=writable)
    try:
        if table.num_nodes != ds.num_nodes:
            raise InputError(f"{table.root}: the embedding table has {table.num_nodes} nodes, the dataset "
                             f"{ds.root} {ds.num_nodes}; create it for this dataset (lightning-ooc init-embeddings "
                             f"{ds.root})")  # fmt: skip
        if table.num_partitions != 1:
            raise InputError(f"{table.root}: learnable features read rows from a table of one partition, this one has "
                             f"{table.num_partitions}; create it with `lightning-ooc init-embeddings --partitions 1`")  # fmt: skip
        # rows are read one by one from here on, unchecked: the whole partition is checked once, before any
        table.check_partition(0)
    except BaseException:
        table.close()
        raise
    return table


class LearnableMixin:
    """The hooks of a pass source that make its features an embedding table's trainable rows."""

    table: Any = None

    def _open_reader(self, ds: Any) -> Any:
        cfg = self.cfg  # type: ignore[attr-defined]
        if self.ctx.remote is not None or self.ctx.world > 1:  # type: ignore[attr-defined]
            raise InputError("features=Learnable(...) trains in one process on one device (one writer per table); "
                             "use devices=1 and no gather process (mps_split)")  # fmt: skip
        self.table = open_table(cfg, ds)
        try:
            return FeatureReader(self.table.partition_path(0), self.table.row_floats, torch.float32,
                                 backend=cfg.features.io_backend, queue_depth=cfg.features.queue_depth,
                                 num_rows=self.table.num_nodes, workers=cfg.pipeline.num_extractors)  # fmt: skip
        except BaseException:
            self.table.close()
            raise

    def _close_reader(self, reader: Any) -> None:
        reader.close()
        if self.table is not None:
            self.table.close()

    def _build_store(self, reader: Any, presampled: list[torch.Tensor],
                     counted: Callable[[], Iterator[torch.Tensor]]) -> Any:  # fmt: skip

        cfg, ctx, table = self.cfg, self.ctx, self.table  # type: ignore[attr-defined]
        view = _TableView(self.dataset, table)  # type: ignore[attr-defined]
        # no host cache (its rows never change); slots stay held until a batch's update, as in order
        plan_cfg = cfg.with_settings(features={"host_cache": 0}, pipeline={"order": "in_order"})
        self.plan, _ = plan_store(plan_cfg, view, reader, self.device, presampled, processes=ctx.local_world,
                                  topology_shared=ctx.topology is not None,  # no host cache: nothing to rank
                                  seeds_per_batch=self._seeds_per_batch(), **self._seed_memory())  # type: ignore[attr-defined]  # fmt: skip
        plan = self.plan
        cuda = self.device.type == "cuda"  # type: ignore[attr-defined]
        staging = StagingBuffer(plan.staging_bytes, table.row_floats, torch.float32,
                                chunk_rows=plan.staging_chunk_rows, pin=cuda)  # fmt: skip
        writer = None
        try:
            buffer = LearnableBuffer(plan.buffer_slots, table.num_nodes, table.row_floats, torch.float32, self.device,
                                     reserve=plan.buffer_reserve)  # type: ignore[attr-defined]  # fmt: skip
            tier = LearnableTier(buffer, TableRowsTier(reader, staging, table.dim), table.dim)
            writer = TableRows(table)
            store = LearnableFeatureStore(tier, table.dim, writer, lr=cfg.features.lr)
            # a script that trains by hand and ends without closing gets its trained rows written back
            stop_at_exit(self)
            return store
        except BaseException:
            staging.close()
            if writer is not None:
                writer.close()
            raise

    def run(self, split: str, *args: Any, **kw: Any) -> Any:
        if split != "train":  # evaluation reads past the buffer: the table must hold the trained rows
            self.store.flush(durable=False)  # type: ignore[attr-defined]
        return super().run(split, *args, **kw)  # type: ignore[misc]

    @property
    def close_after_error(self) -> str:  # Lightning calls no teardown after an error: the trained rows go back now
        return f"writing the trained feature rows back to {self.cfg.features.table}"  # type: ignore[attr-defined]

    def flush(self) -> None:
        """Write every trained row back to the table (checkpoints, the end of a run)."""
        self.store.flush()  # type: ignore[attr-defined]

    def close(self) -> None:
        forget(self)
        try:
            super().close()  # type: ignore[misc]  # closes the store, which flushes
        finally:
            if self.table is not None:
                self.table.close()

    def describe(self, presampled: list[torch.Tensor]) -> str:
        text = super().describe(presampled)  # type: ignore[misc]
        t = self.table
        lr = self.cfg.features.lr  # type: ignore[attr-defined]
        return (f"{text}\n  features        learnable: {t.root} ({t.num_nodes:,} x {t.dim} float32 with Adagrad state, "
                f"lr {lr}); trained rows written back through its journal")  # fmt: skip


class LearnablePasses(LearnableMixin, LocalPasses):
    """Node-classification passes over an embedding table's trainable rows."""


class LearnableLinkPasses(LinkPassesMixin, LearnablePasses):
    """Link-prediction passes over an embedding table's trainable rows (the learnable backend over the link task)."""

    task_type = LinkTask
