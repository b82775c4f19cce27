"""The asynchronous minibatch pipeline of one process.

::

    batch ids --samplers (threads)--> extract queue (bounded) --extractors (threads)-->
    train queue (bounded; completion order, or sampling order with order="in_order")
    --> the trainer: __next__ gathers x, yields a PyG Data --> release queue --> releaser

Queues carry node ids, small index tensors and slot handles, never feature
rows. Samplers draw batch indices from a shared counter and sample batch ``k``
with a seed derived from ``(seed, epoch, k)``, so a batch's nodes do not
depend on which thread sampled it. In order mode the trainer takes batch
``k`` when it is ready, and samplers do not start batch ``k + window`` before
batch ``k`` is taken, which bounds how many extracted batches can wait (and
hold feature-buffer slots) behind a slow one.

A run owns everything its pass needs: its threads, its hand-over channels,
the leases it holds on the store's tiers, its statistics and its
:class:`~lightning_ooc.utils.cancel.CancelToken`. The first exception in any
thread cancels the token; every blocking wait of the run (channels, buffer
slots, rows in flight, staging chunks) observes it, so every thread stops,
and the exception is re-raised, as the same object, from the trainer's
``__next__``. Closing a run early (``close()``, garbage collection, an
exception in the training loop) cancels it the same way, joins every thread
and gives back every lease. Nothing outside the run is closed: the store and
its tiers stay usable by the next run.

In order, extractors take sampled batches in sampling order and claim their
store leases one batch at a time, in that order: a batch never waits for
buffer slots held by batches after it, so the batch the trainer needs next
always makes progress, however large batches turn out to be.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch_geometric.data import Data, HeteroData

from lightning_ooc.errors import InputError, LightningOOCError
from lightning_ooc.loader.config import ORDERS
from lightning_ooc.store.tier import ExtractStats, Fence
from lightning_ooc.store.protocol import StoreProtocol
from lightning_ooc.utils.cancel import CancelToken, Cancelled
from lightning_ooc.utils import trace
from lightning_ooc.utils.device import resolved, use_device
from lightning_ooc.utils.shutdown import forget, stop_at_exit

log = logging.getLogger("lightning_ooc")

#: how long close() waits for a thread stuck outside every cancel-aware wait before it raises
STOP_TIMEOUT = 120.0


def batch_counts(data: Any) -> tuple[int, int, int]:
    """Seeds, nodes and edges of a minibatch: a ``Data``, or a ``HeteroData`` (summed over its types)."""
    if isinstance(data, HeteroData):
        seeds = sum(int(s.batch_size) for s in data.node_stores if "batch_size" in s)
        nodes = sum(int(s.n_id.numel()) for s in data.node_stores if "n_id" in s)
        edges = sum(int(s.edge_index.shape[1]) for s in data.edge_stores if "edge_index" in s)
        return seeds, nodes, edges
    return int(data.batch_size), int(data.n_id.numel()), int(data.edge_index.shape[1])


def batch_seed(seed: int, epoch: int, k: int) -> int:
    """The sampling seed of batch ``k`` of ``epoch`` (a 63-bit mix of the three)."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + k * 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & ((1 << 64) - 1)
    return (x ^ (x >> 32)) & ((1 << 63) - 1)


@dataclass
class EpochStats:
    """What one pass over a split cost; logged per epoch by the datamodule."""

    batches: int = 0
    seeds: int = 0
    nodes: int = 0
    edges: int = 0
    wait_seconds: float = 0.0  # time the trainer waited for a ready batch
    seconds: float = 0.0
    extract_queue_sum: int = 0
    train_queue_sum: int = 0
    io: ExtractStats = field(default_factory=ExtractStats)
    #: metrics a pass source adds (the row exchange of a partitioned dataset), logged with the others
    extra: dict[str, float] = field(default_factory=dict)

    def as_metrics(self, row_bytes: int) -> dict[str, float]:
        io = self.io
        served = io.host_hits + io.buffer_hits + io.in_flight_hits + io.misses
        b = max(self.batches, 1)
        return {
            "batches_per_s": self.batches / self.seconds if self.seconds else 0.0,
            "trainer_wait_s": self.wait_seconds,
            "trainer_wait_frac": self.wait_seconds / self.seconds if self.seconds else 0.0,
            "host_cache_hit_rate": io.host_hits / served if served else 0.0,
            "buffer_hit_rate": (io.buffer_hits + io.in_flight_hits) / served if served else 0.0,
            "ssd_row_rate": io.misses / served if served else 0.0,
            "bytes_read": float(io.bytes_read),
            "read_amplification": io.bytes_read / io.bytes_requested if io.bytes_requested else 0.0,
            "mean_extract_queue": self.extract_queue_sum / b,
            "mean_train_queue": self.train_queue_sum / b,
            "nodes_per_batch": self.nodes / b,
            **self.extra,
        }


class PipelineStopError(LightningOOCError, RuntimeError):
    """A closed run's threads did not stop (one is stuck in a call that cannot be cancelled)."""


class _Channel:
    """A hand-over between the threads of one run; every wait observes the run's cancel token.

    FIFO with a bound (``capacity``), or, given ``order``, handing items out in that
    sequence of keys whatever order they arrive in (unbounded: the run's window bounds it).
    ``get()`` returns ``None`` once the channel is closed and nothing is left for it.
    """

    def __init__(self, cancel: CancelToken, capacity: int | None = None, order: Sequence[int] | None = None):
        self._cancel = cancel
        self._cond = threading.Condition()
        self._capacity = capacity
        self._fifo: list[tuple[int, Any]] = []
        self._order = list(order) if order is not None else None
        self._keyed: dict[int, Any] = {}
        self._next = 0
        self._closed = False

    def put(self, key: int, item: Any) -> None:
        with self._cond:
            if self._order is not None:
                self._keyed[key] = item
            else:
                while self._capacity is not None and len(self._fifo) >= self._capacity:
                    self._cancel.wait(self._cond)
                self._fifo.append((key, item))
            self._cond.notify_all()

    def get(self) -> tuple[int, Any] | None:
        with self._cond:
            while True:
                if self._order is not None:
                    if self._next >= len(self._order):
                        return None
                    key = self._order[self._next]
                    if key in self._keyed:
                        self._next += 1
                        self._cond.notify_all()
                        return key, self._keyed.pop(key)
                elif self._fifo:
                    item = self._fifo.pop(0)
                    self._cond.notify_all()
                    return item
                if self._closed:
                    return None
                self._cancel.wait(self._cond)

    def close(self) -> None:
        """No more puts: getters get ``None`` once the items left are taken."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def qsize(self) -> int:
        return len(self._keyed) if self._order is not None else len(self._fifo)

    def drain(self) -> list[Any]:
        with self._cond:
            items = list(self._keyed.values()) if self._order is not None else [it for _, it in self._fifo]
            self._keyed.clear()
            self._fifo.clear()
            return items


class EpochRun(Iterator[Data]):
    """One pass over a list of seed batches; iterate it to get minibatches with ``x`` filled in.

    Args:
        batches: the seed batches of the pass.
        sample: ``(seeds, seed, k) -> Data``, the sampler of batch ``k``.
        store: the feature store the pass extracts from (the run holds leases on its tiers).
        epoch, seed: batch ``k`` is sampled with :func:`batch_seed` ``(seed, epoch, k)``.
        num_samplers, num_extractors, extract_queue_size, train_queue_size: the pipeline shape (each >= 1).
        order: ``"out_of_order"`` or ``"in_order"``.
        device: where ``x`` is gathered.
        skip: batch indices not to run (already trained before a resume).
        on_batch, on_end: called with the index of every batch handed out, and the stats at the end.
        name: names the run's threads and its cancel token.
        trace_path: where to write the run's per-stage timeline (:mod:`lightning_ooc.utils.trace`) when
            it closes (a path, or a function giving it then); None records none. A run that handed out
            no batch (Lightning starts one to check that the loader iterates) writes nothing.
    """

    def __init__(
        self,
        batches: Sequence[torch.Tensor],
        sample: Callable[[torch.Tensor, int, int], Data],
        store: StoreProtocol,
        *,
        epoch: int,
        seed: int,
        num_samplers: int,
        num_extractors: int,
        extract_queue_size: int,
        train_queue_size: int,
        order: str,
        device: torch.device,
        skip: frozenset[int] = frozenset(),
        on_batch: Callable[[int], None] | None = None,
        on_end: Callable[[EpochStats], None] | None = None,
        name: str = "train",
        trace_path: str | Path | Callable[[], Path] | None = None,
    ):
        if order not in ORDERS:
            raise InputError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        for what, v in (("num_samplers", num_samplers), ("num_extractors", num_extractors),
                        ("extract_queue_size", extract_queue_size), ("train_queue_size", train_queue_size)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{what} must be an integer >= 1, got {v!r}")
        self.batches = batches
        self.todo = [k for k in range(len(batches)) if k not in skip]
        self._sample = sample
        self.store = store
        self.epoch = epoch
        self.seed = seed
        self.order = order
        self.device = resolved(device)  # "cuda" pinned to this thread's GPU, for the threads below
        self._to_gpu = self.device is not None and self.device.type == "cuda"
        self.on_batch = on_batch
        self.on_end = on_end
        self.name = name
        self.stats = EpochStats()
        self.trace_path = trace_path
        self.timeline = trace.Timeline(f"lightning_ooc {name} epoch {epoch}") if trace_path is not None else None
        self._handed_out_ns: int | None = None  # when the trainer got its last batch (the train span starts)
        self.cancel = CancelToken(name)
        in_order = order == "in_order"
        self._sampled = _Channel(self.cancel, extract_queue_size, order=self.todo if in_order else None)
        self._extracted = _Channel(self.cancel, train_queue_size, order=self.todo if in_order else None)
        # In order, take-and-claim happens one extractor at a time, in sampling order.
        self._claim_turn = threading.Lock() if in_order else None
        self._release_q: queue.SimpleQueue = queue.SimpleQueue()
        self._held: dict[int, Any] = {}  # every extraction claimed and not yet given back
        self._held_lock = threading.Lock()
        self._next_pos = 0  # next position in self.todo to hand to a sampler
        self._taken = 0  # batches handed to the trainer
        self._window = num_extractors + train_queue_size
        self._dispatch = threading.Condition()
        self._error: BaseException | None = None
        self._left = {"samplers": num_samplers, "extractors": num_extractors}
        self._count_lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._guard, args=(self._sampler_loop,), name=f"ooc-{name}-sampler-{i}", daemon=True)
            for i in range(num_samplers)
        ] + [
            threading.Thread(target=self._guard, args=(self._extractor_loop,), name=f"ooc-{name}-extractor-{i}",
                             daemon=True)  # fmt: skip
            for i in range(num_extractors)
        ]
        self._releaser = threading.Thread(target=self._release_loop, name=f"ooc-{name}-releaser", daemon=True)
        stop_at_exit(self)  # a run left going when the script ends is closed before the interpreter finalises
        self._releaser.start()
        for t in self._threads:
            t.start()

    # -- worker threads -------------------------------------------------------------------------
    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            use_device(self.device)  # before anything here touches CUDA: a new thread starts on GPU 0
            with trace.use(self.timeline):
                fn()
        except Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - re-raised in the trainer
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        with self._count_lock:
            if self._error is None:
                self._error = e
        self.cancel.cancel(f"{type(e).__name__}: {e}")

    def _last(self, role: str) -> bool:
        with self._count_lock:
            self._left[role] -= 1
            return self._left[role] == 0

    def _next_batch(self) -> int | None:
        with self._dispatch:
            while True:
                self.cancel.check()
                if self._next_pos >= len(self.todo):
                    return None
                if self.order == "out_of_order" or self._next_pos < self._taken + self._window:
                    k = self.todo[self._next_pos]
                    self._next_pos += 1
                    return k
                self.cancel.wait(self._dispatch)

    def _sampler_loop(self) -> None:
        try:
            while True:
                k = self._next_batch()
                if k is None:
                    break
                with trace.span("sample", batch=k):
                    data = self._sample(self.batches[k], batch_seed(self.seed, self.epoch, k), k)
                data.batch_index = k
                self._sampled.put(k, data)
        finally:
            if self._last("samplers"):
                self._sampled.close()

    @contextlib.contextmanager
    def _turn(self):
        """In order: one extractor at a time takes the next batch and claims its leases."""
        if self._claim_turn is None:
            yield
            return
        while not self._claim_turn.acquire(timeout=0.25):
            self.cancel.check()
        try:
            yield
        finally:
            self._claim_turn.release()

    def _extractor_loop(self) -> None:
        try:
            while True:
                with self._turn():
                    item = self._sampled.get()
                    if item is None:
                        break
                    k, data = item
                    with trace.span("claim", batch=k):
                        ext = self.store.claim_batch(data, self.cancel)
                    self._track(ext)
                try:
                    with trace.span("fill", batch=k, nodes=batch_counts(data)[1]):
                        self.store.fill(ext, self.cancel)
                except BaseException:
                    if self._untrack(ext):
                        self.store.abandon(ext)  # its rows never all arrived: waiters on them must not wait
                    raise
                if self._to_gpu:  # pinned here, so the trainer's copies to the GPU never wait
                    with trace.span("pin", batch=k):
                        data = data.pin_memory()
                        self.store.pin(ext)
                self._extracted.put(k, (data, ext))
        finally:
            if self._last("extractors"):
                self._extracted.close()

    def _track(self, ext: Any) -> None:
        with self._held_lock:
            self._held[id(ext)] = ext

    def _untrack(self, ext: Any) -> bool:
        with self._held_lock:
            return self._held.pop(id(ext), None) is not None

    def _give_back(self, ext: Any, fence: Fence | None = None) -> None:
        if self._untrack(ext):
            self.store.release(ext, fence)

    def _release_loop(self) -> None:
        try:
            use_device(self.device)  # it waits on the trainer's CUDA events
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
        while True:
            item = self._release_q.get()
            if item is None:
                return
            try:
                with trace.use(self.timeline), trace.span("release"):
                    self._give_back(*item)
            except BaseException as e:  # noqa: BLE001
                self._fail(e)

    # -- trainer side -----------------------------------------------------------------------------
    def __iter__(self) -> "EpochRun":
        return self

    def __len__(self) -> int:
        return len(self.todo)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            self.close()
            raise err

    def _take(self) -> tuple[int, Data, Any] | None:
        try:
            item = self._extracted.get()
        except Cancelled:
            self._raise_if_failed()
            return None  # closed from another thread
        if item is None:
            self._raise_if_failed()
            return None
        k, (data, ext) = item
        return k, data, ext

    def __next__(self) -> Data:
        if self._closed:
            raise StopIteration
        self._raise_if_failed()
        if self._taken >= len(self.todo):
            self._finish()
            raise StopIteration
        tl = self.timeline
        t0 = time.perf_counter()
        if tl is not None and self._handed_out_ns is not None:  # the trainer's step on the previous batch
            tl.add("train", self._handed_out_ns, time.perf_counter_ns())
            self._handed_out_ns = None
        w0 = time.perf_counter_ns()
        self.stats.extract_queue_sum += self._sampled.qsize()
        self.stats.train_queue_sum += self._extracted.qsize()
        item = self._take()
        if tl is not None:
            tl.add("wait", w0, time.perf_counter_ns())
        if item is None:
            self._finish()
            raise StopIteration
        k, data, ext = item
        self.stats.wait_seconds += time.perf_counter() - t0
        with self._dispatch:
            self._taken += 1
            self._dispatch.notify_all()
        g0 = time.perf_counter_ns()
        try:
            if self._to_gpu:  # every tensor of the batch from pinned memory, queued without a host sync
                data = data.to(self.device, non_blocking=True)
            self.store.attach(data, ext, self.device)
        finally:
            if tl is not None:
                tl.add("gather", g0, time.perf_counter_ns(), {"batch": k})
            # after whatever the gather queued, also when it failed halfway: the leases' memory is reused after it
            self._release_q.put((ext, Fence.record(self.device)))
        st = self.stats
        st.batches += 1
        seeds, nodes, edges = batch_counts(data)
        st.seeds += seeds
        st.nodes += nodes
        st.edges += edges
        st.io.add(ext.stats)
        st.seconds = time.perf_counter() - self._t0
        if self.on_batch is not None:
            self.on_batch(k)
        if self._taken == len(self.todo):  # the last batch: loaders that know the length stop here
            self._finish()
        self._handed_out_ns = time.perf_counter_ns()
        return data

    def _finish(self) -> None:
        ended = not self._closed and self._error is None
        self.close()
        if ended and self.on_end is not None:
            self.on_end(self.stats)

    def close(self) -> None:
        """Cancel the run, join its threads, give back every lease it holds; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.stats.seconds = time.perf_counter() - self._t0
        self.cancel.cancel("closed")
        try:
            self._join(self._threads)
        finally:
            self._release_q.put(None)
            self._join([self._releaser])
            for item in self._extracted.drain():
                self._give_back(item[1])
            with self._held_lock:
                left = list(self._held.values())
                self._held.clear()
            for ext in left:  # claimed by a thread that stopped before handing the batch on
                self.store.abandon(ext)
            self._write_trace()
            forget(self)
        # Every thread stopped: let the store, the sampling function (a link source's, which holds the
        # whole source) and the epoch's seed order go with the run's last user, not with the run, which
        # stays readable for its stats (a datamodule keeps its last run per split).
        self.store = None  # type: ignore[assignment]
        self._sample = None  # type: ignore[assignment]
        self.batches = ()

    def _write_trace(self) -> None:
        """Save the timeline, if the run records one. The run ends when its last batch is handed out, so
        the timeline holds the training step of every batch but the last."""
        tl = self.timeline
        if tl is None or self._taken == 0:
            return
        try:
            assert self.trace_path is not None  # a timeline is kept only with a path for it
            path = tl.write(self.trace_path() if callable(self.trace_path) else self.trace_path)
            log.info("timeline of the %s pass, epoch %d: %s", self.name, self.epoch, path)
        except OSError as e:  # a timeline is a diagnostic: it never fails the run
            log.warning("could not write the timeline %s: %s", self.trace_path, e)

    def _join(self, threads: list[threading.Thread]) -> None:
        """Join ``threads``; they all observe the cancel token, so this ends within one wake-up."""
        deadline = time.monotonic() + STOP_TIMEOUT
        warned = time.monotonic()
        while True:
            alive = [t for t in threads if t.is_alive()]
            if not alive:
                return
            alive[0].join(timeout=1.0)
            now = time.monotonic()
            if now >= deadline:
                raise PipelineStopError(
                    f"pipeline threads of run {self.name!r} did not stop within {STOP_TIMEOUT:.0f} s of close(): "
                    f"{[t.name for t in alive]}; they are stuck in:\n{_stacks(alive)}"
                )
            if now - warned >= 10:
                warned = now
                log.warning("run %r: waiting for threads %s to stop", self.name, [t.name for t in alive])

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def _stacks(threads: list[threading.Thread]) -> str:
    frames = sys._current_frames()
    out = []
    for t in threads:
        f = frames.get(t.ident or -1)
        if f is not None:
            out.append(f"{t.name}:\n" + "".join(traceback.format_stack(f)[-4:]))
    return "\n".join(out)
