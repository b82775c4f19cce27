"""The partition buffer: ``capacity`` partitions of an embedding table resident on the training device.

The buffer is one tensor of ``capacity x slot_rows`` rows ``[embedding |
Adagrad state]``; ``weight`` and ``state`` are its two halves (strided views),
which batches index with *buffer rows*: node ``v`` of partition ``p`` in slot
``s`` is row ``s * slot_rows + v - bounds[p]`` (:meth:`PartitionBuffer.row_offset`).
Slots are padded so that each starts on a 4 KiB boundary: on the CPU a
partition file is read straight into its slot with direct I/O and written
back from it; on a GPU the transfer goes through one pinned, page-aligned
host buffer and a side stream.

A *swap* writes back the partition leaving a slot (only if it was trained
since it was loaded: the dirty set) and reads the next one into it. The
buffer's bookkeeping (which partition is where, which are dirty, which slot is
being swapped) is under one lock; the bytes move outside it, on the thread of
the pass that asked (:class:`lightning_ooc.embed.passes.PartitionPass` runs
swaps on a thread of its own). A failed write-back keeps the partition in
its slot, still dirty, so nothing trained is lost; a failed read leaves the
slot empty.

Example::

    >>> import tempfile, torch
    >>> from lightning_ooc.embed.table import init_embeddings, EmbeddingTable
    >>> from lightning_ooc.embed.partition_buffer import PartitionBuffer
    >>> t = EmbeddingTable(init_embeddings(tempfile.mkdtemp() + "/e", num_nodes=12, dim=4, partitions=4, progress=False))
    >>> buf = PartitionBuffer(t, capacity=2)
    >>> buf.ensure([0, 1]); buf.resident()
    [0, 1]
    >>> r = buf.rows_of(torch.tensor([3, 4, 5]))           # the nodes of partition 1
    >>> buf.weight[r] = 1.0; buf.mark_dirty([1])
    >>> buf.swap(evict=1, load=3); buf.resident()          # partition 1 is written back first
    [0, 3]
    >>> t.generation(1), bool((t.rows(torch.tensor([3, 4, 5]))[:, :4] == 1.0).all())
    (1, True)
    >>> buf.close(); t.close()
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from lightning_ooc.data.format import human_bytes
from lightning_ooc.embed.table import ALIGN, EmbeddingTable
from lightning_ooc.errors import InputError
from lightning_ooc.io.bulk import aligned_empty
from lightning_ooc.store.pinning import host_register, host_unregister

log = logging.getLogger("lightning_ooc")


def slot_rows_for(rows: int, row_bytes: int, align: int = ALIGN) -> int:
    """The fewest rows ``>= rows`` whose bytes are a multiple of ``align`` (so every slot starts aligned).

    >>> slot_rows_for(1000, 800), slot_rows_for(3, 32)
    (1024, 128)
    """
    step = math.lcm(int(row_bytes), align) // int(row_bytes)
    return max(step, -(-int(rows) // step) * step)


@dataclass
class SwapStats:
    """What the buffer moved, summed over its life (a pass takes differences)."""

    loads: int = 0
    writebacks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0

    def copy(self) -> "SwapStats":
        return SwapStats(**self.__dict__)

    def minus(self, other: "SwapStats") -> "SwapStats":
        return SwapStats(**{k: getattr(self, k) - getattr(other, k) for k in self.__dict__})


class PartitionBuffer:
    """``capacity`` slots of ``table``'s partitions on ``device`` (host memory on the CPU)."""

    def __init__(self, table: EmbeddingTable, capacity: int, device: torch.device | str | None = None):
        self.table = table
        self.capacity = int(capacity)
        if self.capacity < 1:
            raise InputError(f"the partition buffer needs at least one slot, got capacity={capacity}")
        self.capacity = min(self.capacity, table.num_partitions)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.slot_rows = slot_rows_for(table.max_partition_rows, table.row_bytes)
        self.slot_nbytes = self.slot_rows * table.row_bytes
        dim = table.dim
        total = self.capacity * self.slot_rows
        if self.device.type == "cpu":
            self._host = aligned_empty(self.capacity * self.slot_nbytes)
            self.storage = self._host.view(torch.float32).view(total, 2 * dim)
            self._staging = None
            self._stream = None
        else:
            self.storage = torch.empty(total, 2 * dim, dtype=torch.float32, device=self.device)
            self._staging = aligned_empty(table.max_partition_nbytes)
            self._pinned = host_register(self._staging.data_ptr(), self._staging.numel(), "the partition buffer's staging")
            self._stream = torch.cuda.Stream(device=self.device)
        self.weight = self.storage[:, :dim]
        self.state = self.storage[:, dim:]
        self.nbytes = self.capacity * self.slot_nbytes
        self._mu = threading.Lock()
        self._slots: list[int | None] = [None] * self.capacity
        self._busy: set[int] = set()
        self._dirty: set[int] = set()
        self._offsets = torch.full((table.num_partitions,), -1, dtype=torch.long)
        self.stats = SwapStats()
        self.closed = False

    # -- where rows are ----------------------------------------------------------------
    def resident(self) -> list[int]:
        """The partitions in the buffer, sorted."""
        with self._mu:
            return sorted(p for p in self._slots if p is not None)

    def slot_of(self, p: int) -> int | None:
        with self._mu:
            return self._slots.index(p) if p in self._slots else None

    def row_offset(self, p: int) -> int:
        """What to add to a node id of partition ``p`` to get its buffer row."""
        s = self.slot_of(p)
        if s is None:
            raise KeyError(f"partition {p} is not in the buffer (resident: {self.resident()})")
        return s * self.slot_rows - int(self.table.bounds[p])

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Buffer rows of node ``ids`` (every one's partition must be resident)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        parts = torch.from_numpy(self.table.partition_of(ids.cpu().numpy()))
        off = self._offsets.clone()
        for p in torch.unique(parts).tolist():
            off[p] = self.row_offset(p)
        return ids + off[parts].to(ids.device)

    def mark_dirty(self, parts: Iterable[int]) -> None:
        """Partitions trained since they were loaded (written back when they leave, or at :meth:`flush`)."""
        with self._mu:
            self._dirty.update(int(p) for p in parts)

    def dirty(self) -> list[int]:
        with self._mu:
            return sorted(self._dirty)

    # -- moving partitions -------------------------------------------------------------
    def _slot_view(self, s: int) -> torch.Tensor:
        return self.storage[s * self.slot_rows : (s + 1) * self.slot_rows]

    def _after_compute(self) -> None:
        """Order the side stream after what the calling thread's current stream has queued (the trainer's
        updates of these rows, or its reads of a slot about to be overwritten)."""
        self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def _write_back(self, p: int, s: int) -> None:
        t0 = time.perf_counter()
        view = self._slot_view(s)
        if self._staging is None:
            src = view.view(torch.uint8).reshape(-1)
        else:
            n = self.table.partition_rows(p)
            host = self.table.rows_view(p, self._staging)
            self._after_compute()
            with torch.cuda.stream(self._stream):
                host.copy_(view[:n], non_blocking=True)
            self._stream.synchronize()
            src = self._staging
        self.table.write_partition(p, src)
        with self._mu:
            self._dirty.discard(p)
            self.stats.writebacks += 1
            self.stats.bytes_written += self.table.partition_nbytes(p)
            self.stats.write_seconds += time.perf_counter() - t0

    def _read(self, p: int, s: int) -> None:
        t0 = time.perf_counter()
        view = self._slot_view(s)
        if self._staging is None:
            self.table.read_partition(p, view.view(torch.uint8).reshape(-1))
        else:
            rows = self.table.read_partition(p, self._staging)
            self._after_compute()
            with torch.cuda.stream(self._stream):
                view[: rows.shape[0]].copy_(rows, non_blocking=True)
            self._stream.synchronize()
        with self._mu:
            self.stats.loads += 1
            self.stats.bytes_read += self.table.partition_nbytes(p)
            self.stats.read_seconds += time.perf_counter() - t0

    def _take_slot(self, evict: int | None, keep: set[int]) -> tuple[int, int | None]:
        """Reserve a slot: ``evict``'s, an empty one, or one holding a partition not in ``keep``."""
        with self._mu:
            if evict is not None:
                if evict not in self._slots:
                    raise KeyError(f"partition {evict} is not in the buffer (resident: {sorted(p for p in self._slots if p is not None)})")
                s = self._slots.index(evict)
            else:
                free = [i for i, p in enumerate(self._slots) if p is None and i not in self._busy]
                spare = [i for i, p in enumerate(self._slots) if p is not None and p not in keep and i not in self._busy]
                if not free and not spare:
                    raise RuntimeError(f"no slot to load into: partitions {sorted(keep)} need more than the "
                                       f"{self.capacity} slots of the buffer")  # fmt: skip
                s = (free or spare)[0]
            if s in self._busy:
                raise RuntimeError(f"slot {s} is already being swapped")
            self._busy.add(s)
            return s, self._slots[s]

    def _move(self, s: int, out: int | None, into: int | None) -> None:
        """Write ``out`` back from slot ``s`` (if dirty) and read ``into`` there; the slot is busy throughout."""
        try:
            if out is not None:
                with self._mu:
                    dirty = out in self._dirty
                if dirty:
                    self._write_back(out, s)  # on failure the partition stays in its slot, still dirty
                with self._mu:
                    self._slots[s] = None
                    self._offsets[out] = -1
            if into is not None:
                self._read(into, s)
                with self._mu:
                    self._slots[s] = into
                    self._offsets[into] = s * self.slot_rows - int(self.table.bounds[into])
        finally:
            with self._mu:
                self._busy.discard(s)

    def swap(self, evict: int, load: int) -> None:
        """Replace partition ``evict`` by ``load`` in its slot (``evict`` written back first if dirty)."""
        self._check_open()
        if self.slot_of(load) is not None:
            raise ValueError(f"partition {load} is already in the buffer")
        s, _ = self._take_slot(evict, set())
        self._move(s, evict, load)

    def ensure(self, parts: Iterable[int]) -> None:
        """Make ``parts`` resident, evicting partitions not among them (written back if dirty)."""
        self._check_open()
        want = [int(p) for p in parts]
        if len(set(want)) > self.capacity:
            raise InputError(f"{len(set(want))} partitions cannot be resident in a buffer of {self.capacity}")
        for p in want:
            if self.slot_of(p) is None:
                s, out = self._take_slot(None, set(want))
                self._move(s, out, p)

    def flush(self) -> list[int]:
        """Write back every dirty resident partition (they stay resident); returns them."""
        self._check_open()
        done = []
        for p in self.dirty():
            s = self.slot_of(p)
            if s is None:  # pragma: no cover - dirty partitions are resident
                continue
            with self._mu:
                if s in self._busy:
                    raise RuntimeError(f"partition {p} is being swapped; flush after the pass")
                self._busy.add(s)
            try:
                self._write_back(p, s)
            finally:
                with self._mu:
                    self._busy.discard(s)
            done.append(p)
        return done

    def drop(self) -> list[int]:
        """Forget every resident partition without writing back; returns the dirty ones whose updates are lost."""
        with self._mu:
            lost = sorted(self._dirty)
            self._slots = [None] * self.capacity
            self._dirty.clear()
            self._offsets.fill_(-1)
        return lost

    def describe(self) -> str:
        return (f"partition buffer: {self.capacity} slots x {self.slot_rows} rows ({human_bytes(self.nbytes)}) "
                f"on {self.device}")  # fmt: skip

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the partition buffer was closed")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._staging is not None and getattr(self, "_pinned", False):
            host_unregister(self._staging.data_ptr())
        # the memory goes now, not when the last batch or pass that saw the buffer goes
        self.storage = self.weight = self.state = self._host = self._staging = None  # type: ignore[assignment]


def partitions_of(table: EmbeddingTable, ids: np.ndarray) -> np.ndarray:
    return table.partition_of(ids)
