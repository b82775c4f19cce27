"""Learnable input features: an embedding table's rows served through the tiers, trained, written back.

``OutOfCoreNodeData(root, features=Learnable(table=TABLE))`` gives a GNN the
rows of an embedding table (``lightning-ooc init-embeddings``) as its input
``x`` and trains them with the model. The chain is the training chain without
the host cache (its rows never change, these do):

* :class:`LearnableTier` -- the feature buffer holding whole table rows
  (``[embedding | Adagrad state]``; ``x`` gets the embedding half), with a
  *dirty* bit per slot. When a slot of a dirty row is reused, the buffer
  copies the row out (under its lock, before the slot changes hands) and
  queues it for write-back; a batch that misses that node meanwhile gets the
  queued copy, never the older row on disk.
* :class:`TableRowsTier` -- staging and the direct-I/O reader over the table's
  partition file (the SSD tier; evaluation passes read past the buffer, after
  :meth:`LearnableFeatureStore.flush`).

:class:`LearnableFeatureStore` makes ``x`` a leaf that requires grad and
hooks it: when the backward pass reaches ``x``, its gradient is applied to the
batch's buffer rows in place by a sparse Adagrad step
(:func:`lightning_ooc.embed.optim.sparse_adagrad_`) and the rows are marked
dirty. A batch's slots stay referenced until then (the pipeline's release
waits for the update), so no row is evicted, or reloaded, with an update
still to come; the buffer's reserve therefore covers the in-order window. A
write-back thread of the store writes the evicted rows through the table's
journal (:class:`lightning_ooc.embed.rows.TableRows`), in eviction order.
:meth:`~LearnableFeatureStore.flush` writes every dirty row and checkpoints
the table: before every evaluation pass, at checkpoints and at the end.

A batch whose ``x`` gets no gradient (a step that returned no loss) is let go
unchanged when the batch two after it is attached, with one warning.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lightning_ooc.store.feature_buffer import Acquired, FeatureBuffer
from lightning_ooc.store.tier import Fence, Lease
from lightning_ooc.store.tiered import Extracted, TieredFeatureStore
from lightning_ooc.store.tiers import BufferTier, ReaderTier
from lightning_ooc.utils import trace
from lightning_ooc.utils.cancel import NEVER, CancelToken
from lightning_ooc.embed.optim import sparse_adagrad_

log = logging.getLogger("lightning_ooc")

#: queued write-back bytes above which extractors wait for the write-back thread
PENDING_CAP_BYTES = 256 << 20


@dataclass
class _WriteBack:
    ids: torch.Tensor  # int64 node ids
    rows: torch.Tensor  # [k, 2 * dim] float32, host memory
    done: bool = False


@dataclass
class _Reassigned:
    """What one acquisition evicted (dirty rows to write back) and what it can load from queued copies."""

    job: _WriteBack | None = None
    pending_pos: torch.Tensor | None = None  # positions among the acquisition's misses
    pending_rows: torch.Tensor | None = None


class LearnableBuffer(FeatureBuffer):
    """A feature buffer of trainable rows: dirty bits, and evicted dirty rows queued for write-back."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.dirty = torch.zeros(self.num_slots, dtype=torch.bool)
        self.jobs: deque[_WriteBack] = deque()
        self._pending_ids = np.zeros(0, np.int64)  # sorted ids with a queued copy
        self._pending_job = np.zeros(0, np.int64)  # for each of them: the job holding its newest copy
        self._pending_row = np.zeros(0, np.int64)  # and the row in that job
        self._pending_jobs: list[_WriteBack] = []
        self.pending_bytes = 0
        #: rows written back, and of those, rows written back because their slot was reused
        self.written_back = 0
        self.evicted_dirty = 0

    def _index_pending(self) -> None:
        """Index the queued copies by node id (a later copy of a node replaces an earlier one)."""
        jobs = list(self.jobs)  # oldest first
        self._pending_jobs = jobs
        if not jobs:
            self._pending_ids = np.zeros(0, np.int64)
            return
        flat = np.concatenate([job.ids.numpy() for job in jobs])
        job_of = np.repeat(np.arange(len(jobs)), [job.ids.numel() for job in jobs])
        row_of = np.concatenate([np.arange(job.ids.numel()) for job in jobs])
        rev_u, rev_first = np.unique(flat[::-1], return_index=True)  # the last occurrence of each id
        last = flat.size - 1 - rev_first
        self._pending_ids, self._pending_job, self._pending_row = rev_u, job_of[last], row_of[last]

    def _reassigned(self, slots: torch.Tensor, old_nodes: torch.Tensor, new_nodes: torch.Tensor) -> _Reassigned:
        out = _Reassigned()
        leaving = (old_nodes >= 0) & self.dirty[slots]
        if bool(leaving.any()):
            gone = slots[leaving]
            out.job = _WriteBack(old_nodes[leaving].clone(), self.rows[gone].to("cpu", copy=True))
            self.dirty[gone] = False
            self.evicted_dirty += int(gone.numel())
            self.jobs.append(out.job)
            self.pending_bytes += out.job.rows.numel() * 4
            self._index_pending()
            self._changed.notify_all()  # the write-back thread waits on this condition
        self.dirty[slots] = False
        if self._pending_ids.size:
            ids = new_nodes.numpy()
            pos = np.clip(np.searchsorted(self._pending_ids, ids), 0, self._pending_ids.size - 1)
            found = np.flatnonzero(self._pending_ids[pos] == ids)
            if found.size:
                job, row = self._pending_job[pos[found]], self._pending_row[pos[found]]
                rows = torch.empty(found.size, self.rows.shape[1], dtype=self.rows.dtype)
                for j in np.unique(job).tolist():
                    sel = np.flatnonzero(job == j)
                    rows[torch.from_numpy(sel)] = self._pending_jobs[j].rows[torch.from_numpy(row[sel])]
                out.pending_pos = torch.from_numpy(found)
                out.pending_rows = rows
        return out

    def apply_(self, slots: torch.Tensor, grad: torch.Tensor, lr: float, eps: float) -> None:
        """A sparse Adagrad step on the embedding half of ``slots`` (held by the caller); marks them dirty."""

        dim = self.rows.shape[1] // 2
        sparse_adagrad_(self.rows[:, :dim], self.rows[:, dim:], slots.to(self.rows.device), grad, lr, eps)
        with self._lock:
            self.dirty[slots.cpu()] = True

    # -- the write-back thread's side ---------------------------------------------------------
    def next_job(self, cancel: CancelToken) -> _WriteBack:
        with self._changed:
            while not self.jobs:
                self._check_open()
                cancel.wait(self._changed)
            return self.jobs[0]

    def job_done(self, job: _WriteBack) -> None:
        with self._changed:
            job.done = True
            if self.jobs and self.jobs[0] is job:
                self.jobs.popleft()
            self.pending_bytes -= job.rows.numel() * 4
            self.written_back += job.ids.numel()
            self._index_pending()
            self._changed.notify_all()

    def wait_drained(self, below: int = 0, cancel: CancelToken = NEVER, error: Any = None) -> None:
        """Block until at most ``below`` bytes wait for write-back (``error()`` raises the writer's failure)."""
        with self._changed:
            while self.pending_bytes > below and self.jobs:
                if error is not None:
                    error()
                self._check_open()
                cancel.wait(self._changed)
        if error is not None:
            error()

    def queue_dirty(self) -> int:
        """Queue every dirty row for write-back behind the rows queued before (for a flush); marks them clean."""
        with self._changed:
            dirty = torch.nonzero(self.dirty & (self.slot2node >= 0) & self.valid).flatten()
            if dirty.numel() == 0:
                return 0
            job = _WriteBack(self.slot2node[dirty].clone(), self.rows[dirty].to("cpu", copy=True))
            self.dirty[dirty] = False
            self.jobs.append(job)
            self.pending_bytes += job.rows.numel() * 4
            self._index_pending()
            self._changed.notify_all()
            return int(dirty.numel())


class LearnableTier(BufferTier):
    """The feature buffer of a learnable table: loads misses from queued copies or from the table; ``x`` gets
    the embedding half of each row."""

    name = "buffer"

    def __init__(self, buffer: LearnableBuffer, source: "TableRowsTier", dim: int, error: Any = None):
        super().__init__(buffer, source)
        self.dim = int(dim)
        self._error = error  # raises the write-back thread's failure, if any

    def fill(self, lease: Lease, cancel: CancelToken = NEVER) -> None:
        acq: Acquired = lease.handle
        extra: _Reassigned | None = acq.extra
        buf: LearnableBuffer = self.buffer  # type: ignore[assignment]
        if buf.pending_bytes > PENDING_CAP_BYTES:
            with trace.span("writeback.wait"):
                buf.wait_drained(PENDING_CAP_BYTES // 2, cancel, self._error)
        if lease.stats.misses:
            miss_ids, miss_slots = acq.ids[acq.miss], acq.slots[acq.miss]
            from_disk = torch.ones(miss_ids.numel(), dtype=torch.bool)
            if extra is not None and extra.pending_pos is not None:
                from_disk[extra.pending_pos] = False
                dest = miss_slots[extra.pending_pos]
                buf.rows.index_copy_(0, dest.to(buf.rows.device), extra.pending_rows.to(buf.rows.device))
            if bool(from_disk.any()):
                self.source.load_into(miss_ids[from_disk], buf.rows, miss_slots[from_disk], lease.stats, cancel)
            buf.mark_valid(miss_slots)
        if lease.stats.in_flight_hits:
            with trace.span("buffer.wait_in_flight", rows=lease.stats.in_flight_hits):
                buf.wait_valid(acq.slots[acq.in_flight], cancel=cancel)

    def rows(self, lease: Lease, device: torch.device) -> torch.Tensor:
        return super().rows(lease, device)[:, : self.dim]

    def gather_into(self, lease: Lease, x: torch.Tensor, positions: torch.Tensor) -> None:
        rows, acq = self.buffer.rows, lease.handle
        slots = (acq.slots if acq.device_slots is None else acq.device_slots).to(rows.device, non_blocking=True)
        part = rows[:, : self.dim].index_select(0, slots)
        x.index_copy_(0, positions, part if part.device == x.device else part.to(x.device, non_blocking=True))


class TableRowsTier(ReaderTier):
    """Staging and the direct-I/O reader over an embedding table's rows; gives the embedding half."""

    name = "ssd"

    def __init__(self, reader: Any, staging: Any, dim: int, copy_chunk_rows: int = 1024):
        super().__init__(reader, staging, copy_chunk_rows)
        self.dim = int(dim)

    def rows(self, lease: Lease, device: torch.device) -> torch.Tensor:
        return super().rows(lease, device)[:, : self.dim]


@dataclass
class _Batch:
    ext: Extracted
    index: int
    applied: bool = False
    released_by_pipeline: bool = False
    fence: Fence | None = None
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class LearnableFeatureStore(TieredFeatureStore):
    """The training chain of learnable features: ``x`` requires grad; its gradient updates the rows."""

    def __init__(self, tier: LearnableTier, dim: int, writer: Any, lr: float, eps: float = 1e-10):
        super().__init__([tier], dim, torch.float32)
        self.tier = tier
        self.buffer: LearnableBuffer = tier.buffer  # type: ignore[assignment]
        self.writer = writer  # lightning_ooc.embed.rows.TableRows
        self.lr, self.eps = float(lr), float(eps)
        self._mu = threading.Lock()
        self._batches: deque[_Batch] = deque()
        self._count = 0
        self._warned = False
        self._cancel = CancelToken("learnable write-back")
        self._error: BaseException | None = None
        tier._error = self._raise_error
        self._thread = threading.Thread(target=self._write_back_loop, name="looc-writeback", daemon=True)
        self._thread.start()
        self._to_release: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._releaser: threading.Thread | None = None
        self.updates = 0

    # -- trainer side ---------------------------------------------------------------------------
    def attach(self, data: Any, ext: Extracted, device: torch.device | str | None = None) -> None:
        x = self.gather(ext, device)
        b = _Batch(ext, self._count)
        self._count += 1
        with self._mu:
            self._batches.append(b)
            # Lightning fetches one batch ahead: when batch k is attached, batch k - 2 has been trained
            stale = [o for o in self._batches if not o.applied and o.index <= b.index - 2]
        for o in stale:  # its step never reached x (no loss, or x unused): let its rows go unchanged
            if not self._warned:
                log.warning("a minibatch's x received no gradient; its learnable rows were released unchanged "
                            "(a training step that returned no loss?)")  # fmt: skip
                self._warned = True
            self._applied(o, None)
        x.requires_grad_(True)
        x.register_hook(lambda grad, b=b: self._apply(b, grad))
        data.x = x

    def _apply(self, b: _Batch, grad: torch.Tensor) -> None:
        with b.lock:
            if b.applied:
                return None
            lease = next((ls for ls in b.ext.leases if ls.tier is self.tier), None)
            if lease is not None and lease.positions is not None and lease.positions.numel():
                pos = lease.positions.to(grad.device)
                self.buffer.apply_(lease.handle.slots, grad.index_select(0, pos), self.lr, self.eps)
                self.updates += 1
        self._applied(b, Fence.record(grad.device))
        return None

    def _applied(self, b: _Batch, fence: Fence | None) -> None:
        with b.lock:
            if b.applied:
                return
            b.applied = True
            go = b.released_by_pipeline
            if fence is not None:
                b.fence = fence
        if go:
            self._let_go_later(b)

    def _let_go_later(self, b: _Batch) -> None:
        """Let go of ``b``: inline on the CPU; on a GPU from the store's release thread (letting go waits for
        the fence of the update, which the autograd thread must not block on)."""
        if b.fence is None:
            self._let_go(b)
            return
        if self._releaser is None:
            self._releaser = threading.Thread(target=self._release_loop, name="looc-learnable-release", daemon=True)
            self._releaser.start()
        self._to_release.put(b)

    def _release_loop(self) -> None:
        while True:
            b = self._to_release.get()
            if b is None:
                return
            try:
                self._let_go(b)
            except BaseException as e:  # noqa: BLE001 - surfaced at the next flush
                self._error = self._error or e

    def release(self, ext: Extracted, fence: Fence | None = None) -> None:
        with self._mu:
            b = next((o for o in self._batches if o.ext is ext), None)
        if b is None:  # not attached (an evaluation view, or a batch never handed to the trainer)
            super().release(ext, fence)
            return
        with b.lock:
            b.released_by_pipeline = True
            if b.fence is None:
                b.fence = fence
            go = b.applied
        if go:
            self._let_go(b)

    def _let_go(self, b: _Batch) -> None:
        with b.lock:
            if b.done:
                return
            b.done = True
        with self._mu:
            try:
                self._batches.remove(b)
            except ValueError:
                pass
        super().release(b.ext, b.fence)

    def abandon(self, ext: Extracted) -> None:
        with self._mu:
            b = next((o for o in self._batches if o.ext is ext), None)
            if b is not None:
                self._batches.remove(b)
        super().abandon(ext)

    def release_unapplied(self) -> None:
        """Let go of every batch still waiting for its gradient (the pass ended or failed)."""
        with self._mu:
            left = list(self._batches)
        for b in left:
            self._applied(b, None)

    # -- write-back -----------------------------------------------------------------------------
    def _write_back_loop(self) -> None:
        try:
            while True:
                job = self.buffer.next_job(self._cancel)
                self.writer.write(job.ids, job.rows)
                self.buffer.job_done(job)
        except BaseException as e:  # noqa: BLE001 - surfaced in the extractors and at flush
            if not self._cancel.cancelled:
                self._error = e
                log.error("writing back learnable rows failed: %s", e)
            with self.buffer._changed:
                self.buffer._changed.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def flush(self, durable: bool = True) -> int:
        """Write every row trained so far back to the table; with ``durable``, also sync and checksum it
        (checkpoints, the end). The dirty rows are queued behind the rows evicted before (which may hold
        older copies of the same nodes), and the queue is written in order. Batches still waiting for their
        gradient keep their slots: their updates come later. Returns the rows queued here."""
        self._raise_error()
        n = self.buffer.queue_dirty()
        self.buffer.wait_drained(0, error=self._raise_error)
        if durable:
            self.writer.checkpoint()
        return n

    def without(self, name: str) -> TieredFeatureStore:
        return TieredFeatureStore([self.tier.source], self.num_features, self.dtype, owned=[])

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._error is None:
                self.flush()
        finally:
            self._cancel.cancel("closed")
            self.buffer.close()
            self._thread.join()
            if self._releaser is not None:
                self._to_release.put(None)
                self._releaser.join()
            self.writer.close()
            super().close()
