"""The grouped settings of :class:`~lightning_ooc.embed.OutOfCoreEmbeddingData`: the partition buffer, and negatives.

Each group is a small frozen dataclass that checks its own fields once, at construction, and holds each default
once. The datamodule takes them as ``buffer=PartitionBuffering(...)`` and ``negatives=ChunkNegatives(...)`` (or a
dict of the same fields), and LightningCLI fills them from nested YAML or the command line
(``--data.buffer.partitions 2``)::

    data:
      class_path: lightning_ooc.OutOfCoreEmbeddingData
      init_args:
        table: data/links-emb
        buffer: {partitions: 3, order: auto}
        negatives: {num: 100, chunk_size: 100, eval: 1000}

Example::

    >>> from lightning_ooc.embed.embedding_config import ChunkNegatives, PartitionBuffering, group
    >>> PartitionBuffering(partitions=2).order, ChunkNegatives(chunk_size=50).eval_chunk
    ('auto', 50)
    >>> group("negatives", {"num": 8, "eval": "all"}).eval
    'all'
    >>> PartitionBuffering(partitions=0)
    Traceback (most recent call last):
      ...
    lightning_ooc.errors.InputError: buffer.partitions must be at least 1, got 0
"""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from typing import Any

from lightning_ooc.errors import InputError
from lightning_ooc.utils.groups import plain, settings_group
from lightning_ooc.io.bulk import BULK_BACKENDS

__all__ = ["PartitionBuffering", "ChunkNegatives", "EmbeddingDataConfig", "GROUPS", "group", "plain",
           "ORDER_KINDS", "IO_BACKENDS"]  # fmt: skip

#: the partition orders a datamodule may be given (:func:`~lightning_ooc.embed.order.partition_order`)
ORDER_KINDS = ("auto", "legend", "beta", "greedy")
#: the transfer backends of a table's partitions (:class:`~lightning_ooc.io.bulk.BulkFile`)
IO_BACKENDS = ("auto", *BULK_BACKENDS)


def at_least_one(name: str, value: Any) -> int:
    """``value`` as an int, or an :class:`~lightning_ooc.errors.InputError` naming ``name``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = int(value) if isinstance(value, float) and value.is_integer() else operator.index(value)
    except TypeError:
        raise InputError(f"{name} must be an integer of at least 1, got {value!r}") from None
    if n < 1:
        raise InputError(f"{name} must be at least 1, got {value!r}")
    return n


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # a frozen group normalizes its own fields once, in __post_init__


@dataclass(frozen=True)
class PartitionBuffering:
    """The partition buffer: how many of the table's partitions are resident at once, and in what order they pass.

    Args:
        partitions: partitions resident at once (Legend's and Marius's ``c``; 3 by default). A bucket ``(i, j)``
            needs both of its partitions resident: a table of more than one partition needs at least 2.
        order: ``"auto"`` (one state if every partition fits, Legend's order for 3, the greedy prefetch order
            otherwise), ``"legend"``, ``"beta"`` (Marius's) or ``"greedy"``.
        in_memory: hold every partition at once (the in-memory reference: no swaps, the same bucket order).
        io_backend: transfer backend of the table (``"auto"``: io_uring with direct I/O where it works;
            ``"uring"``, ``"pread"``, ``"buffered"``).

    >>> PartitionBuffering(order="beta", in_memory=True)
    PartitionBuffering(partitions=3, order='beta', in_memory=True, io_backend='auto')
    """

    partitions: int = 3
    order: str = "auto"
    in_memory: bool = False
    io_backend: str = "auto"

    def __post_init__(self) -> None:
        _set(self, "partitions", at_least_one("buffer.partitions", self.partitions))
        if self.order not in ORDER_KINDS:
            raise InputError(f"buffer.order must be auto, legend, beta or greedy, got {self.order!r}")
        if not isinstance(self.in_memory, bool):
            raise InputError(f"buffer.in_memory must be true or false, got {self.in_memory!r}")
        if self.io_backend not in IO_BACKENDS:
            raise InputError(f"buffer.io_backend must be one of {', '.join(IO_BACKENDS)}, got {self.io_backend!r}")


@dataclass(frozen=True)
class ChunkNegatives:
    """Negatives shared by chunks of edges, in training and in evaluation.

    Args:
        num: negatives shared by each training chunk, heads drawn from the source partition and tails from the
            destination partition.
        chunk_size: edges per training chunk.
        eval: negatives per evaluation chunk, or ``"all"`` (rank against every node: needs the whole table in
            the buffer, ``buffer.partitions`` at least the table's partitions or ``buffer.in_memory``).
        eval_chunk_size: edges per evaluation chunk (None: ``chunk_size``; :attr:`eval_chunk` is the one used).
        filtered: in evaluation, ignore negatives that form a stored edge (of any split).

    >>> ChunkNegatives(num=10, chunk_size=25, eval="all").eval_chunk
    25
    """

    num: int = 100
    chunk_size: int = 100
    eval: int | str = 1000
    eval_chunk_size: int | None = None
    filtered: bool = True

    def __post_init__(self) -> None:
        _set(self, "num", at_least_one("negatives.num", self.num))
        _set(self, "chunk_size", at_least_one("negatives.chunk_size", self.chunk_size))
        if self.eval != "all":
            if isinstance(self.eval, bool) or not isinstance(self.eval, (int, float)):
                raise InputError(f"negatives.eval must be an integer of at least 1 or 'all', got {self.eval!r}")
            _set(self, "eval", at_least_one("negatives.eval", self.eval))
        if self.eval_chunk_size is not None:
            _set(self, "eval_chunk_size", at_least_one("negatives.eval_chunk_size", self.eval_chunk_size))
        if not isinstance(self.filtered, bool):
            raise InputError(f"negatives.filtered must be true or false, got {self.filtered!r}")

    @property
    def eval_chunk(self) -> int:
        """Edges per evaluation chunk: ``eval_chunk_size``, or ``chunk_size`` where that is None."""
        return self.eval_chunk_size or self.chunk_size


#: the groups, by the keyword the datamodule takes them with
GROUPS: dict[str, type] = {"buffer": PartitionBuffering, "negatives": ChunkNegatives}


def group(name: str, given: Any) -> Any:
    """The settings group ``name``: ``given`` as an instance, a dict of its fields, or None for the defaults."""
    return settings_group(GROUPS[name], name, given)


@dataclass(frozen=True)
class EmbeddingDataConfig:
    """The datamodule's arguments, checked (see :class:`~lightning_ooc.embed.OutOfCoreEmbeddingData` for each):
    the groups as instances, ``table`` as a string.

    >>> EmbeddingDataConfig("t", buffer={"partitions": 2}).buffer.partitions
    2
    """

    table: str
    batch_size: int = 1000
    buffer: PartitionBuffering = field(default_factory=PartitionBuffering)
    negatives: ChunkNegatives = field(default_factory=ChunkNegatives)
    #: host memory the buffer must fit in: ``"auto"``, a size (this process's total), or None (no check)
    memory_limit: int | str | None = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        from lightning_ooc.loader.config import check_memory_limit  # the node datamodule's check, the same words

        _set(self, "table", os.fspath(self.table))
        _set(self, "batch_size", at_least_one("batch_size", self.batch_size))
        _set(self, "buffer", group("buffer", self.buffer))
        _set(self, "negatives", group("negatives", self.negatives))
        _set(self, "memory_limit", check_memory_limit(self.memory_limit))
        try:
            if isinstance(self.seed, bool):
                raise TypeError
            _set(self, "seed", operator.index(self.seed))
        except TypeError:
            raise InputError(f"seed must be an integer, got {self.seed!r}") from None
