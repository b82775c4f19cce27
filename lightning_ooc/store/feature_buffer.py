"""The feature buffer: device-resident rows of the batches in flight plus recently used rows.

This is GNNDrive's buffer manager. A fixed array of ``num_slots`` rows lives
on the training device (host memory when training on CPU). Beside it:

* a mapping table ``node -> slot`` (``-1`` when the node has no slot);
* a reverse map ``slot -> node`` (``-1`` for a never used slot);
* per slot a reference count and a valid bit (the row has been loaded);
* a *standby list* of slots whose reference count fell to zero, reused in
  least-recently-released order. A slot on standby keeps its row and its
  mapping until it is reused, so the next batch that needs the row finds it.

An extractor calls :meth:`FeatureBuffer.acquire` with the unique node ids of a
batch. Every id gets a slot and a reference: ids whose row is valid are
*hits*; ids whose row another extractor is still loading are *in flight* and
are waited for with :meth:`wait_valid`, never read twice; the rest are
*misses*, given slots taken from the standby list, which the caller fills
and then publishes with :meth:`mark_valid`. The trainer reads rows by slot;
the releaser calls :meth:`release` when the batch is done.

The standby list is a FIFO of ``(slot, stamp)`` entries with lazy deletion: a
slot that is hit again while on standby leaves its entry behind, which is
recognised as stale (its reference count is no longer zero or its stamp has
moved on) and skipped when popped. All bookkeeping is vectorised torch code
under one lock; no Python loop runs per node.

No deadlock: allocation is all or nothing (a caller that finds too few free
slots gives back the references it took and waits), so a waiting extractor
holds nothing; and :func:`required_slots` gives the number of slots at which
the pipeline always makes progress (every extractor's batch out of order;
the whole in-order window in order). :class:`FeatureBuffer` refuses to be
built smaller than the reserve it is given.

Example::

    >>> import torch
    >>> from lightning_ooc.store.feature_buffer import FeatureBuffer
    >>> buf = FeatureBuffer(num_slots=4, num_nodes=10, num_features=2)
    >>> a = buf.acquire(torch.tensor([7, 3]))
    >>> a.miss.tolist(), a.hit.tolist()
    ([True, True], [False, False])
    >>> buf.rows[a.slots] = torch.tensor([[7., 7.], [3., 3.]])
    >>> buf.mark_valid(a.slots)
    >>> buf.release(a.slots)              # both rows go on standby, still valid
    >>> b = buf.acquire(torch.tensor([3, 5]))
    >>> b.hit.tolist(), buf.rows[b.slots[0]].tolist()
    ([True, False], [3.0, 3.0])
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from lightning_ooc.errors import LightningOOCError
from lightning_ooc.utils.cancel import NEVER, CancelToken


class BufferClosedError(LightningOOCError, RuntimeError):
    """The buffer was closed (the store is shutting down) while a caller waited on it."""


class RowLoadFailedError(LightningOOCError, RuntimeError):
    """A row this caller waited for was being loaded by another caller whose extraction failed."""


def required_slots(max_nodes_per_batch: int, extractors: int, train_queue: int, order: str = "out_of_order") -> int:
    """Slots the pipeline needs so that extraction can never deadlock.

    Allocation is all or nothing, so a waiting extractor holds no slot, and
    out of order the trainer always makes progress on whatever batch is
    ready: ``extractors`` batches fit at once (GNNDrive's rule, which also
    lets every extractor work at the same time). In order, finished batches
    wait behind a slow one: every batch of the window (``extractors +
    train_queue``), the one being trained and one being released must fit.
    """
    batches = int(extractors) if order == "out_of_order" else int(extractors) + int(train_queue) + 2
    return int(max_nodes_per_batch) * max(1, batches)


@dataclass
class Acquired:
    """The result of :meth:`FeatureBuffer.acquire` for ids ``ids``: one slot each and its state."""

    ids: torch.Tensor
    slots: torch.Tensor
    hit: torch.Tensor  # row valid now
    in_flight: torch.Tensor  # row being loaded by another caller: wait_valid() before reading
    miss: torch.Tensor  # new slot: the caller loads the row, then mark_valid()
    device_slots: torch.Tensor | None = None  # ``slots`` in pinned memory, for the trainer's copy to a GPU
    #: what a subclass noted when slots changed hands in this acquisition (:meth:`FeatureBuffer._reassigned`)
    extra: object = None


class FeatureBuffer:
    """Slots of feature rows with a mapping table, refcounts, valid bits and an LRU standby list.

    Args:
        num_slots: rows held.
        num_nodes: nodes of the graph (size of the mapping table).
        num_features, dtype, device: shape and placement of the row array.
        reserve: minimum number of slots (see :func:`required_slots`); a
            smaller ``num_slots`` raises ``ValueError``.
    """

    def __init__(
        self,
        num_slots: int,
        num_nodes: int,
        num_features: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        reserve: int = 0,
    ):
        if num_slots < 1:
            raise ValueError(f"the feature buffer needs at least one slot, got {num_slots}")
        if num_slots < reserve:
            raise ValueError(
                f"the feature buffer has {num_slots} slots but needs at least {reserve} so that every batch in "
                "flight fits at once (extractors + train queue + 2 batches of max_nodes_per_batch rows); give it "
                "a larger budget or lower extractors, train_queue_size or the batch size"
            )
        self.num_slots = int(num_slots)
        self.num_nodes = int(num_nodes)
        self.rows = torch.empty((self.num_slots, num_features), dtype=dtype, device=device)
        # int32 while slot numbers fit: this table has one entry per node of the graph
        self.node2slot = torch.full((self.num_nodes,), -1, dtype=torch.int32 if num_slots < 2**31 else torch.int64)
        self.slot2node = torch.full((self.num_slots,), -1, dtype=torch.int64)
        self.refcount = torch.zeros(self.num_slots, dtype=torch.int32)
        self.valid = torch.zeros(self.num_slots, dtype=torch.bool)
        self.failed = torch.zeros(self.num_slots, dtype=torch.bool)  # load given up; waiters must not wait
        self.stamp = torch.zeros(self.num_slots, dtype=torch.int64)
        # Standby FIFO: entries [head, tail) of a ring of (slot, stamp); starts with every slot, all free.
        self._cap = 2 * self.num_slots + 16
        self._fifo_slot = torch.empty(self._cap, dtype=torch.int64)
        self._fifo_stamp = torch.empty(self._cap, dtype=torch.int64)
        self._fifo_slot[: self.num_slots] = torch.arange(self.num_slots)
        self._fifo_stamp[: self.num_slots] = 0
        self._head = 0
        self._len = self.num_slots
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = False
        # Counters (read by the pipeline's metrics).
        self.hits = 0
        self.in_flight_hits = 0
        self.misses = 0
        self.evictions = 0

    # -- standby FIFO ------------------------------------------------------------------
    def _fifo_view(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = (torch.arange(start, start + count) % self._cap) if start + count > self._cap else None
        if idx is None:
            return self._fifo_slot[start : start + count], self._fifo_stamp[start : start + count]
        return self._fifo_slot[idx], self._fifo_stamp[idx]

    def _fifo_push(self, slots: torch.Tensor, stamps: torch.Tensor) -> None:
        k = slots.numel()
        if k == 0:
            return
        if self._len + k > self._cap:
            self._fifo_compact()
        if self._len + k > self._cap:  # pragma: no cover - compaction keeps at most num_slots entries
            raise RuntimeError("standby list overflow")
        pos = (self._head + self._len + torch.arange(k)) % self._cap
        self._fifo_slot[pos] = slots
        self._fifo_stamp[pos] = stamps
        self._len += k

    def _fifo_live(self, slots: torch.Tensor, stamps: torch.Tensor) -> torch.Tensor:
        return (self.refcount[slots] == 0) & (self.stamp[slots] == stamps)

    def _fifo_compact(self) -> None:
        slots, stamps = self._fifo_view(self._head, self._len)
        live = self._fifo_live(slots, stamps)
        slots, stamps = slots[live].clone(), stamps[live].clone()
        self._head = 0
        self._len = slots.numel()
        self._fifo_slot[: self._len] = slots
        self._fifo_stamp[: self._len] = stamps

    def _fifo_pop(self, k: int) -> torch.Tensor | None:
        """Take the ``k`` least recently released free slots, or None if fewer are free now."""
        out = []
        got = 0
        while got < k:
            if self._len == 0:
                break
            take = min(self._len, max(2 * (k - got), 64))
            slots, stamps = self._fifo_view(self._head, take)
            live = self._fifo_live(slots, stamps)
            cum = torch.cumsum(live.to(torch.int64), 0)
            need = k - got
            if int(cum[-1]) >= need:
                cut = int(torch.searchsorted(cum, torch.tensor(need))) + 1  # entries consumed
                chosen = slots[:cut][live[:cut]]
            else:
                cut = take
                chosen = slots[live]
            out.append(chosen.clone())
            got += chosen.numel()
            self._head = (self._head + cut) % self._cap
            self._len -= cut
        if got < k:
            # Put back what we took, at the front, in the same order: nothing else ran meanwhile.
            back = torch.cat(out) if out else torch.empty(0, dtype=torch.int64)
            n = back.numel()
            self._head = (self._head - n) % self._cap
            self._len += n
            pos = (self._head + torch.arange(n)) % self._cap
            self._fifo_slot[pos] = back
            self._fifo_stamp[pos] = self.stamp[back]
            return None
        return torch.cat(out) if len(out) > 1 else out[0]

    # -- public API -----------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Slots with no reference (free or on standby)."""
        return int((self.refcount == 0).sum())

    def acquire(self, ids: torch.Tensor, timeout: float | None = None, cancel: CancelToken = NEVER) -> Acquired:
        """Reference a slot for each of the unique node ids ``ids`` (blocks while too few slots are free).

        The wait ends with :class:`~lightning_ooc.utils.cancel.Cancelled` when ``cancel`` is
        cancelled, and with ``TimeoutError`` after ``timeout`` seconds.
        """
        ids = ids.to(torch.int64)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                self._check_open()
                cancel.check()
                slots = self.node2slot[ids].long()
                present = slots >= 0
                held = slots[present]
                self.refcount[held] += 1  # pinned: nothing this batch needs can be evicted below
                miss = ~present
                need = int(miss.sum())
                if need > self.num_slots:
                    self._unref(held)
                    raise ValueError(
                        f"a batch needs {need} new rows but the feature buffer has {self.num_slots} slots; "
                        "give it a larger budget or use smaller batches / fanouts"
                    )
                new = self._fifo_pop(need) if need else slots[:0]
                if new is not None:
                    break
                # Too few free slots: give back what we hold (all or nothing, so a waiting caller
                # never holds slots others need) and wait for a release.
                self._unref(held)
                self._changed.notify_all()
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no free slots for {need} rows within {timeout} s")
                cancel.wait(self._changed)
            extra = None
            if need:
                old = self.slot2node[new]
                new_ids = ids[miss]
                extra = self._reassigned(new, old, new_ids)
                evicted = old[old >= 0]
                self.node2slot[evicted] = -1
                self.evictions += int(evicted.numel())
                self.slot2node[new] = new_ids
                self.node2slot[new_ids] = new.to(self.node2slot.dtype)
                self.valid[new] = False
                self.refcount[new] = 1
                slots[miss] = new
            hit = present.clone()
            hit[present] = self.valid[slots[present]]
            in_flight = present & ~hit
            self.hits += int(hit.sum())
            self.in_flight_hits += int(in_flight.sum())
            self.misses += need
            return Acquired(ids, slots, hit, in_flight, miss, extra=extra)

    def _reassigned(self, slots: torch.Tensor, old_nodes: torch.Tensor, new_nodes: torch.Tensor) -> object:
        """Called under the lock when ``slots`` (holding ``old_nodes``, -1 for none) are given to
        ``new_nodes``, before their rows change; what it returns becomes the acquisition's ``extra``.
        A buffer whose rows are written to (learnable features) saves the rows it must write back here."""
        return None

    def mark_valid(self, slots: torch.Tensor) -> None:
        """Publish loaded rows: waiters on them wake up."""
        with self._changed:
            self.valid[slots] = True
            self._changed.notify_all()

    def wait_valid(self, slots: torch.Tensor, timeout: float | None = None, cancel: CancelToken = NEVER) -> None:
        """Block until every slot in ``slots`` holds a valid row (rows loaded by other callers).

        Raises :class:`RowLoadFailedError` if the caller loading one of them gave up (its
        extraction failed), :class:`~lightning_ooc.utils.cancel.Cancelled` when ``cancel`` is
        cancelled, and ``TimeoutError`` after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                self._check_open()
                cancel.check()
                if bool(self.valid[slots].all()):
                    return
                if bool(self.failed[slots].any()):
                    raise RowLoadFailedError("a row this batch shares with another batch was not loaded: the "
                                             "extraction loading it failed")  # fmt: skip
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError("rows being loaded by another extractor did not arrive in time")
                cancel.wait(self._changed)

    def release(self, slots: torch.Tensor) -> None:
        """Drop one reference from each slot; slots reaching zero go to the back of the standby list."""
        with self._changed:
            self._unref(slots)
            self._changed.notify_all()

    def _unref(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        self.refcount[slots] -= 1
        if bool((self.refcount[slots] < 0).any()):
            bad = slots[self.refcount[slots] < 0]
            self.refcount[bad] = 0
            raise RuntimeError(f"released slots {bad[:5].tolist()} more often than they were acquired")
        zero = slots[self.refcount[slots] == 0]
        if zero.numel():
            # A row that never became valid (its load failed) is forgotten rather than kept.
            dead = zero[~self.valid[zero]]
            if dead.numel():
                nodes = self.slot2node[dead]
                self.node2slot[nodes[nodes >= 0]] = -1
                self.slot2node[dead] = -1
                self.failed[dead] = False
            self.stamp[zero] += 1
            self._fifo_push(zero, self.stamp[zero])

    def abandon(self, acquired: Acquired) -> None:
        """Give back an acquisition whose rows will not be loaded (the extractor failed or was cancelled).

        Its misses that never became valid are unmapped at once, so a later caller loads
        them afresh, and callers already waiting for them get :class:`RowLoadFailedError`
        instead of waiting for rows that will never come.
        """
        with self._changed:
            mine = acquired.slots[acquired.miss]
            broken = mine[~self.valid[mine]]
            if broken.numel():
                nodes = self.slot2node[broken]
                self.node2slot[nodes[nodes >= 0]] = -1
                self.slot2node[broken] = -1
                self.failed[broken] = True
            self._unref(acquired.slots)
            self._changed.notify_all()

    def close(self) -> None:
        """Wake every waiter with :class:`BufferClosedError` (used at shutdown)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("the feature buffer was closed while waiting on it (the pipeline stopped)")

    # -- checks (tests, debugging) -------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the tables disagree with each other."""
        with self._lock:
            assert bool((self.refcount >= 0).all()), "negative refcount"
            mapped = self.slot2node >= 0
            nodes = self.slot2node[mapped]
            assert torch.equal(self.node2slot[nodes].long(), torch.nonzero(mapped).flatten()), "slot -> node -> slot"
            assert nodes.unique().numel() == nodes.numel(), "a node holds two slots"
            has = self.node2slot >= 0
            assert int(has.sum()) == int(mapped.sum()), "node -> slot entries without a reverse entry"
            assert torch.equal(self.slot2node[self.node2slot[has].long()], torch.nonzero(has).flatten()), "node -> slot -> node"
            assert bool((self.refcount[~mapped & ~self.failed] == 0).all()), "referenced slot without a node"
            assert bool((self.refcount[self.failed] > 0).all()), "failed slot nobody holds"
            # every unreferenced slot is reachable from the standby list
            slots, stamps = self._fifo_view(self._head, self._len)
            live = slots[self._fifo_live(slots, stamps)]
            assert live.unique().numel() == live.numel(), "slot twice on standby"
            assert live.numel() == int((self.refcount == 0).sum()), "free slot missing from the standby list"
