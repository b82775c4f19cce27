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

Failure: the first exception in any thread stops every thread (queues are
polled with a short timeout, buffer waiters are woken by closing it) and is
re-raised, as the same exception object, from the trainer's ``__next__``.
Closing an epoch early (``close()``, garbage collection, an exception in the
training loop) joins every thread and releases every slot.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch_geometric.data import Data

from lightning_ooc.store.buffer import BufferClosedError
from lightning_ooc.store.tiered import ExtractStats, Extracted, TieredFeatureStore

log = logging.getLogger("lightning_ooc")

_POLL = 0.05
ORDERS = ("out_of_order", "in_order")


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
        }


class _Stop(Exception):
    pass


class EpochRun(Iterator[Data]):
    """One pass over a list of seed batches; iterate it to get minibatches with ``x`` filled in."""

    def __init__(
        self,
        batches: Sequence[torch.Tensor],
        sample: Callable[[torch.Tensor, int, int], Data],
        store: TieredFeatureStore,
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
    ):
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self.batches = batches
        self.todo = [k for k in range(len(batches)) if k not in skip]
        self._sample = sample
        self.store = store
        self.epoch = epoch
        self.seed = seed
        self.order = order
        self.device = device
        self.on_batch = on_batch
        self.on_end = on_end
        self.stats = EpochStats()
        self._extract_q: queue.Queue = queue.Queue(maxsize=max(1, extract_queue_size))
        self._train_q: queue.Queue = queue.Queue(maxsize=max(1, train_queue_size))
        self._ready: dict[int, tuple[Data, Extracted]] = {}  # in order mode
        self._ready_cv = threading.Condition()
        self._release_q: queue.SimpleQueue = queue.SimpleQueue()
        self._next_pos = 0  # next position in self.todo to hand to a sampler
        self._taken = 0  # batches handed to the trainer
        self._window = num_extractors + train_queue_size
        self._dispatch_cv = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._samplers_left = num_samplers
        self._num_extractors = num_extractors
        self._extractors_left = num_extractors
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
        self._releaser.start()
        for t in self._threads:
            t.start()

    # -- worker threads -------------------------------------------------------------------------
    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except _Stop:
            pass
        except BufferClosedError:
            if not self._stop.is_set():  # pragma: no cover - the buffer is only closed on stop
                self._fail(RuntimeError("the feature buffer was closed while the pipeline ran"))
        except BaseException as e:  # noqa: BLE001 - re-raised in the trainer
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        with self._count_lock:
            if self._error is None:
                self._error = e
        self._stop.set()
        self.store.buffer.close()  # wake extractors blocked on slots or on rows in flight
        with self._ready_cv:
            self._ready_cv.notify_all()
        with self._dispatch_cv:
            self._dispatch_cv.notify_all()

    def _put(self, q: queue.Queue, item: Any) -> None:
        while True:
            if self._stop.is_set():
                raise _Stop
            try:
                q.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue

    def _get(self, q: queue.Queue) -> Any:
        while True:
            if self._stop.is_set():
                raise _Stop
            try:
                return q.get(timeout=_POLL)
            except queue.Empty:
                continue

    def _next_batch(self) -> int | None:
        with self._dispatch_cv:
            while True:
                if self._stop.is_set():
                    raise _Stop
                if self._next_pos >= len(self.todo):
                    return None
                if self.order == "out_of_order" or self._next_pos < self._taken + self._window:
                    k = self.todo[self._next_pos]
                    self._next_pos += 1
                    return k
                self._dispatch_cv.wait(_POLL)

    def _sampler_loop(self) -> None:
        try:
            while True:
                k = self._next_batch()
                if k is None:
                    break
                data = self._sample(self.batches[k], batch_seed(self.seed, self.epoch, k), k)
                data.batch_index = k
                self._put(self._extract_q, (k, data))
        finally:
            with self._count_lock:
                self._samplers_left -= 1
                last = self._samplers_left == 0
            if last:  # one end marker per extractor; stop-aware, so close() can always join us
                try:
                    for _ in range(self._num_extractors):
                        self._put(self._extract_q, None)
                except _Stop:
                    pass

    def _extractor_loop(self) -> None:
        try:
            while True:
                item = self._get(self._extract_q)
                if item is None:
                    break
                k, data = item
                ext = self.store.extract(data.n_id)
                try:
                    if self.order == "in_order":
                        with self._ready_cv:
                            self._ready[k] = (data, ext)
                            self._ready_cv.notify_all()
                    else:
                        self._put(self._train_q, (k, data, ext))
                except BaseException:
                    self.store.release(ext)
                    raise
        finally:
            with self._count_lock:
                self._extractors_left -= 1
                last = self._extractors_left == 0
            if last and self.order == "out_of_order":
                try:
                    self._put(self._train_q, None)
                except _Stop:
                    pass

    def _release_loop(self) -> None:
        while True:
            ext = self._release_q.get()
            if ext is None:
                return
            try:
                self.store.release(ext)
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

    def _take(self) -> tuple[int, Data, Extracted] | None:
        if self._taken >= len(self.todo):
            return None
        if self.order == "in_order":
            k = self.todo[self._taken]
            with self._ready_cv:
                while k not in self._ready:
                    self._raise_if_failed()
                    self._ready_cv.wait(_POLL)
                data, ext = self._ready.pop(k)
            return k, data, ext
        while True:
            self._raise_if_failed()
            try:
                item = self._train_q.get(timeout=_POLL)
            except queue.Empty:
                continue
            if item is None:  # pragma: no cover - every batch arrives before the end marker
                self._raise_if_failed()
                return None
            return item

    def __next__(self) -> Data:
        if self._closed:
            raise StopIteration
        t0 = time.perf_counter()
        self.stats.extract_queue_sum += self._extract_q.qsize()
        self.stats.train_queue_sum += self._train_q.qsize() if self.order == "out_of_order" else len(self._ready)
        item = self._take()
        if item is None:
            self._raise_if_failed()
            self._finish()
            raise StopIteration
        k, data, ext = item
        self.stats.wait_seconds += time.perf_counter() - t0
        with self._dispatch_cv:
            self._taken += 1
            self._dispatch_cv.notify_all()
        try:
            data.x = self.store.gather(ext, self.device)
        finally:
            self._release_q.put(ext)
        st = self.stats
        st.batches += 1
        st.seeds += int(data.batch_size)
        st.nodes += int(data.n_id.numel())
        st.edges += int(data.edge_index.shape[1])
        st.io.add(ext.stats)
        st.seconds = time.perf_counter() - self._t0
        if self.on_batch is not None:
            self.on_batch(k)
        if self._taken == len(self.todo):  # the last batch: loaders that know the length stop here
            self._finish()
        return data

    def _finish(self) -> None:
        ended = not self._closed
        self.close()
        if ended and self.on_end is not None:
            self.on_end(self.stats)

    def close(self) -> None:
        """Stop every thread, release every slot still held; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.stats.seconds = time.perf_counter() - self._t0
        self._stop.set()
        with self._dispatch_cv:
            self._dispatch_cv.notify_all()
        # Give back what was extracted and not trained, repeatedly: an extractor blocked on free
        # slots gets them from these releases, sees the stop flag and exits.
        deadline = time.monotonic() + 30
        while True:
            self._drain()
            for t in self._threads:
                t.join(timeout=_POLL)
            if not any(t.is_alive() for t in self._threads) or time.monotonic() > deadline:
                break
        self._drain()
        self._release_q.put(None)
        self._releaser.join(timeout=30)
        alive = [t.name for t in self._threads + [self._releaser] if t.is_alive()]
        if alive:  # pragma: no cover - a thread stuck in a native call
            log.warning("pipeline threads still running after close: %s", alive)

    def _drain(self) -> None:
        while True:
            try:
                item = self._train_q.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self.store.release(item[2])
        with self._ready_cv:
            ready = list(self._ready.values())
            self._ready.clear()
        for _, ext in ready:
            self.store.release(ext)

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
