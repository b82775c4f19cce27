"""``OutOfCoreEmbeddingData``: partition-buffer training of node embeddings larger than memory.

The datamodule opens an embedding table (``lightning-ooc init-embeddings``),
keeps ``buffer.partitions`` of its partitions in a
:class:`~lightning_ooc.embed.partition_buffer.PartitionBuffer` on the training device,
and runs each pass (:class:`~lightning_ooc.embed.passes.PartitionPass`) over
the split's edge buckets in a prefetch-friendly partition order
(:func:`~lightning_ooc.embed.order.partition_order`: Legend's for a buffer of
3). Batches are :class:`~lightning_ooc.embed.batch.EmbeddingBatch` objects for
the knowledge-graph embedding models of :mod:`lightning_ooc.models.kge`,
which update the buffer rows in place.

Dirty partitions are written back when they leave the buffer, when a
checkpoint is saved, and at teardown (also after an exception or Ctrl-C, so
what was trained is kept). ``buffer={"in_memory": True}`` holds every partition at once
(no swaps) but trains the buckets in the very order the out-of-core run
uses: the reference that the out-of-core run equals.

Example::

    >>> import tempfile, numpy as np
    >>> from lightning_ooc.embed import ChunkNegatives, OutOfCoreEmbeddingData, init_embeddings
    >>> rng = np.random.default_rng(0)
    >>> src, dst = rng.integers(0, 60, 400), rng.integers(0, 60, 400)
    >>> root = init_embeddings(tempfile.mkdtemp() + "/e", num_nodes=60, dim=8, partitions=4,
    ...                        edges={"train": (src, dst)}, progress=False)
    >>> dm = OutOfCoreEmbeddingData(root, batch_size=50, negatives=ChunkNegatives(num=10, chunk_size=25))
    >>> dm.setup("fit")
    >>> batches = list(dm.train_dataloader())
    >>> sum(len(b) for b in batches), dm.order.num_swaps, batches[0].weight.shape
    (400, 2, torch.Size([192, 8]))
    >>> dm.teardown("fit")
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from lightning_ooc.data.format import human_bytes
from lightning_ooc.embed.batch import EmbeddingBatch
from lightning_ooc.embed.buckets import EdgeBuckets
from lightning_ooc.embed.partition_buffer import PartitionBuffer
from lightning_ooc.embed.passes import KnownEdges, PartitionPass
from lightning_ooc.embed.embedding_config import ChunkNegatives, EmbeddingDataConfig, PartitionBuffering, plain
from lightning_ooc.embed.table import EmbeddingTable, read_table_meta
from lightning_ooc.errors import InputError
from lightning_ooc.loader.dataloader import PassData, PassLoader
from lightning_ooc.store import limits
from lightning_ooc.utils.shutdown import forget, stop_at_exit
from lightning_ooc.embed.order import partition_order, prefetch_stats, swap_lower_bound
import numpy as np

log = logging.getLogger("lightning_ooc")


class OutOfCoreEmbeddingData(PassData):
    """Edge minibatches over an embedding table's buckets, with the table's partitions swapped through a buffer.

    Args:
        table: an embedding table directory (``lightning-ooc init-embeddings``).
        batch_size: edges per batch (a batch never spans two buckets).
        buffer: the partition buffer (:class:`~lightning_ooc.embed.embedding_config.PartitionBuffering`, or a dict of
            its fields): ``partitions`` resident at once (Legend's and Marius's ``c``; 3 by default),
            ``order`` ``"auto"`` (one state if every partition fits, Legend's order for 3, the greedy prefetch
            order otherwise), ``"legend"``, ``"beta"`` (Marius's) or ``"greedy"``; ``in_memory`` (hold every
            partition at once: the in-memory reference, same bucket order); ``io_backend`` (transfer backend of
            the table; ``"auto"``: io_uring with direct I/O where it works).
        negatives: the negatives (:class:`~lightning_ooc.embed.embedding_config.ChunkNegatives`, or a dict of its
            fields): ``num`` negatives shared by each chunk of ``chunk_size`` edges (100 and 100), heads drawn
            from the source partition and tails from the destination partition; ``eval`` negatives per
            evaluation chunk (1000), or ``"all"`` (rank against every node: needs the whole table in the
            buffer); ``eval_chunk_size`` (edges per evaluation chunk; default ``chunk_size``); ``filtered`` (in
            evaluation, ignore negatives that form a stored edge of any split; true by default).
        memory_limit: host memory a buffer on the CPU must fit in: ``"auto"`` reads the memory cgroup's limit
            and ``MemAvailable``; a size (``"8GiB"``) is this process's total; ``None`` turns the check off. A
            buffer that does not fit is refused at set-up with an error that says what to lower.
        seed: the random streams of shuffling and negatives.

    The settings are checked here, at construction (an :class:`~lightning_ooc.errors.InputError` naming the
    setting: ``buffer.partitions must be at least 1, got 0``), and kept, checked, as :attr:`config`
    (``dm.config.buffer.partitions``); :attr:`buffer` is the partition buffer itself once set up.

    Trained by a knowledge-graph embedding model (:class:`~lightning_ooc.models.DistMult` and its kin) whose
    node rows are the buffer's::

        >>> import tempfile, numpy as np, lightning as L
        >>> from lightning_ooc.embed import init_embeddings
        >>> from lightning_ooc.models import DistMult
        >>> rng = np.random.default_rng(0)
        >>> root = init_embeddings(tempfile.mkdtemp() + "/e", num_nodes=60, dim=8, partitions=4, scale=0.1,
        ...                        edges={"train": (rng.integers(0, 60, 400), rng.integers(0, 60, 400))},
        ...                        progress=False)
        >>> dm = OutOfCoreEmbeddingData(root, batch_size=50, buffer={"partitions": 3},
        ...                             negatives={"num": 10, "chunk_size": 25})
        >>> trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(DistMult(dim=8), datamodule=dm)
        >>> trainer.global_step > 0
        True
    """

    def __init__(
        self,
        table: str | os.PathLike,
        batch_size: int = EmbeddingDataConfig.batch_size,
        buffer: PartitionBuffering | dict[str, Any] | None = None,
        negatives: ChunkNegatives | dict[str, Any] | None = None,
        memory_limit: int | str | None = EmbeddingDataConfig.memory_limit,
        seed: int = EmbeddingDataConfig.seed,
    ):
        super().__init__()
        #: the settings, checked: ``config.buffer`` and ``config.negatives`` are the groups
        self.config = EmbeddingDataConfig(table, batch_size=batch_size, buffer=buffer, negatives=negatives,
                                          memory_limit=memory_limit, seed=seed)  # fmt: skip
        self.table_path = self.config.table
        self.batch_size = self.config.batch_size
        read_table_meta(self.table_path)  # a missing table, or a dataset given as one: said here, not at fit
        self.save_hyperparameters()
        # plain values (the groups as dicts, the table as a string): checkpoints load them with weights_only, and
        # OutOfCoreEmbeddingData(**hparams) builds the same datamodule again
        self.hparams.update(table=self.config.table, buffer=plain(self.config.buffer),
                            negatives=plain(self.config.negatives))  # fmt: skip
        self.save_hyperparameters(dict(self.hparams))  # the loggers' copy (hparams.yaml) plain too
        self.table: EmbeddingTable | None = None
        self.buffer: PartitionBuffer | None = None
        self.order = None
        self.buckets: dict[str, EdgeBuckets] = {}
        self._active: dict[str, PartitionPass] = {}
        self._epoch = 0
        self._known: KnownEdges | None = None

    # -- what the model links to --------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return read_table_meta(self.table_path)

    @property
    def num_relations(self) -> int:
        return self.table.num_relations if self.table is not None else int(self._meta().get("num_relations", 1))

    @property
    def dim(self) -> int:
        return self.table.dim if self.table is not None else int(self._meta()["dim"])

    @property
    def num_features(self) -> int:
        """The table's row width (``dim``): what ``lightning-ooc fit`` links to a model's ``in_channels``."""
        return self.dim

    @property
    def num_classes(self) -> None:
        """Embedding training has no classes (``lightning-ooc fit`` links every model's ``num_classes``)."""
        return None

    @property
    def num_nodes(self) -> int:
        return self.table.num_nodes if self.table is not None else int(self._meta()["num_nodes"])

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.table is not None:
            return

        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.world_size > 1:
            raise InputError("OutOfCoreEmbeddingData trains on one device: one process writes the table back. "
                             "Run it with devices=1")  # fmt: skip
        device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        buf = self.config.buffer
        table = EmbeddingTable(self.table_path, backend=buf.io_backend)
        try:
            n = table.num_partitions
            if buf.partitions < 2 and n > 1:
                raise InputError(f"buffer.partitions={buf.partitions}: a bucket (i, j) needs both of its partitions "
                                 f"resident; use at least 2 (3 by default) for {n} partitions")  # fmt: skip
            c = max(2, min(buf.partitions, n))
            self.order = partition_order(n, c, buf.order)
            capacity = n if buf.in_memory else min(c, n)
            slot_bytes = table.row_bytes * (table.max_partition_rows + 4096)
            if self.config.memory_limit is not None and device.type == "cpu":
                lim = limits.limit_for_plan(self.config.memory_limit)
                need = capacity * slot_bytes
                if not lim.unlimited and need > 0.9 * lim.bytes:
                    raise InputError(
                        f"{self.table_path}: a buffer of {capacity} partitions needs about {human_bytes(need)}, "
                        f"more than this process may allocate ({lim.source}); lower buffer.partitions, or "
                        "create the table with more partitions (lightning-ooc init-embeddings --partitions)"
                        + (", or leave buffer.in_memory off" if buf.in_memory else "")
                    )
            self.buffer = PartitionBuffer(table, capacity, device)
            for split, info in table.meta.get("buckets", {}).items():
                self.buckets[split] = EdgeBuckets(table.root, split, info)
            if "train" not in self.buckets:
                raise InputError(f"{self.table_path}: has no train edge buckets; create it from a dataset or with "
                                 "train edges (init_embeddings(..., edges={'train': ...}))")  # fmt: skip
        except BaseException:
            if self.buffer is not None:
                self.buffer.close()
                self.buffer = None
            table.close()
            raise
        self.table = table
        # a script that trains by hand and ends without teardown() gets its trained partitions written back
        stop_at_exit(self, "teardown")
        st = prefetch_stats(self.order)
        log.info(
            "embedding plan: %d nodes x dim %d in %d partitions (%s on disk, %s each at most); %s; order %s: "
            "%d swaps per epoch (lower bound %d), %d of %d buckets trained while a swap runs%s",
            table.num_nodes, table.dim, n, human_bytes(sum(table.partition_nbytes(p) for p in range(n))),
            human_bytes(table.max_partition_nbytes), self.buffer.describe(), self.order.name,
            self.order.num_swaps, swap_lower_bound(n, c), self.order.hidden_buckets(), n * n,
            " (in memory: no swaps, same bucket order)" if buf.in_memory else "",
        )  # fmt: skip
        del st

    def num_batches(self, split: str) -> int:
        """Batches of a pass over ``split`` (read from the table's files: it sets nothing up)."""
        return self._num_batches(split)

    def _num_batches(self, split: str) -> int:

        path = Path(self.table_path) / f"buckets_{split}_offsets.npy"
        if split not in self._splits() or not path.is_file():
            return 0
        counts = np.diff(np.load(path))
        return int((-(-counts // self.batch_size)).sum())

    # -- passes ---------------------------------------------------------------------------------
    def _start(self, split: str) -> PartitionPass:
        if self.table is None:
            self.setup()
        if split not in self.buckets:
            raise InputError(f"{self.table_path}: has no {split} edges; create the table from a dataset with "
                             f"link splits (lightning-ooc prepare --split-edges), or pass {split} edges")  # fmt: skip
        for other in self._active.values():  # a paused pass (training, during validation) finishes its swap
            other.quiesce()
        trainer = getattr(self, "trainer", None)
        train = split == "train"
        if train:
            epoch = trainer.current_epoch if trainer is not None else self._epoch
            self._epoch = epoch + 1
        else:
            epoch = 0  # evaluation draws the same negatives every time
        neg = self.config.negatives
        if not train and neg.eval == "all" and self.buffer.capacity < self.table.num_partitions:
            n = self.table.num_partitions
            raise InputError(f"negatives.eval='all' ranks against every node, which needs the whole table in the "
                             f"buffer ({n} partitions, capacity {self.buffer.capacity}); set buffer.partitions to "
                             f"{n} or buffer.in_memory, or use a number of sampled negatives")  # fmt: skip
        if not train and neg.filtered and self._known is None:
            self._known = KnownEdges(self.buckets, self.table.num_nodes, self.table.num_relations)
        p = PartitionPass(
            self.buffer, self.buckets[split], self.order, split=split, epoch=epoch, seed=self.config.seed,
            batch_size=self.batch_size, chunk_size=neg.chunk_size if train else neg.eval_chunk,
            num_negatives=neg.num if train else neg.eval, train=train,
            known=None if train or not neg.filtered else self._known, attach_on_next=trainer is None,
            on_end=lambda stats: self._pass_ended(split, stats, stats.as_metrics()),
        )  # fmt: skip
        self._active[split] = p
        return p

    def val_dataloader(self) -> PassLoader | list:
        return self._loader("val") if "val" in self._splits() else []

    def _splits(self) -> set[str]:
        """The splits the table has buckets of (read from its ``meta.json``)."""
        return set(self.table.meta.get("buckets", {}) if self.table is not None else self._meta().get("buckets", {}))

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # right before the step that uses the batch: every earlier batch has been trained
        if isinstance(batch, EmbeddingBatch) and batch.weight is None:
            run = self._active.get(batch.split)
            if run is None:
                raise RuntimeError(f"an embedding batch of the {batch.split} split arrived with no pass running")
            for other in self._active.values():  # a pass left unfinished (limit_val_batches) ends its swap first
                if other is not run:
                    other.quiesce()
            run.attach(batch)
        return batch

    # -- checkpoints, end -------------------------------------------------------------------------
    def flush(self) -> list[int]:
        """Write back every partition trained since it was loaded (they stay resident)."""
        if self.buffer is None:
            return []
        for run in self._active.values():
            run.quiesce()
        return self.buffer.flush()

    def state_dict(self) -> dict[str, Any]:
        """Saving a checkpoint writes the trained partitions back, so the table matches the checkpoint."""
        self.flush()
        t = self.table
        return {"epoch": self._epoch, "table_updates": None if t is None else t.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = int(state.get("epoch", 0))
        want = state.get("table_updates")
        if self.table is not None and want is not None and self.table.updates != want:
            log.warning("%s: the table has had %d write-backs, the checkpoint was taken after %d: its node "
                        "embeddings are the table's current ones, not the checkpoint's", self.table_path,
                        self.table.updates, want)  # fmt: skip

    def on_exception(self, exception: BaseException) -> None:
        # Lightning calls no teardown after an exception: write back what was trained and let the table go
        # now (its lock too), so that neither is lost with the process
        try:
            self.teardown()
        except Exception:  # noqa: BLE001 - the exception that stopped the run is the one to see
            log.exception("%s: writing back the trained partitions after the error failed", self.table_path)

    def teardown(self, stage: str | None = None) -> None:
        forget(self)
        self.close_loaders()
        self._active.clear()
        if self.buffer is not None:
            try:
                written = self.buffer.flush()
                if written:
                    log.info("%s: wrote back partitions %s", self.table_path, written)
            except BaseException:
                log.error("%s: partitions %s could not be written back; what they learnt since they were loaded "
                          "is lost (the table holds their last write-back)", self.table_path, self.buffer.dirty())
                raise
            finally:
                self.buffer.close()
                self.buffer = None
        if self.table is not None:
            self.table.close()
            self.table = None
        self.buckets = {}
        self._known = None
