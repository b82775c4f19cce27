"""Ranking the host cache while training runs: set-up off the critical path, and no read of its own.

Ranking a host cache's rows needs hundreds of sampled minibatches, and reading them would be one SSD read per
row: hundreds of thousands of reads, as long as many training batches, and most of them repeats of reads the
first batches make anyway. With ``host_cache_fill="background"`` (the default for a host cache of
:data:`BACKGROUND_FILL_BYTES` or more) the set-up sizes the tiers and returns. The rows are then counted over
``presample_batches`` minibatches from two sources at once (:class:`BatchCounter`): the epoch's own batches, as
the host cache tier is looked up with them (free: they are sampled anyway), and batches a thread of the store
presamples beside them (extra sampling, which on a graph whose topology is read from disk costs page faults of
its own). Whichever fills the count first wins: where the topology is in memory the presample is fast, where it
is on disk the epoch's batches make most of the count. The thread then ranks the rows, and the host cache
*expects* them
(:meth:`~lightning_ooc.store.host_cache.HostCache.expect`). From then on every row the feature buffer reads from
SSD is offered to it (:class:`~lightning_ooc.store.tiers.ReaderTier`'s ``admit``) and an expected row is kept
from that read (:meth:`~lightning_ooc.store.host_cache.HostCache.admit`): each hot row costs the one read its
first use needs, and none beside. Training starts at once from SSD and the buffer, and the host cache's share of
the rows grows as batches touch them.

A failure of the thread (a full memory) is raised by the next lookup of the host cache tier, in the pipeline's
extractor, so the run fails within a batch; closing the store stops the thread (between two presampled batches).

Example::

    >>> import torch
    >>> from lightning_ooc.store.host_cache import HostCache, HotSet
    >>> host = HostCache.empty(3, 2, torch.float32, num_nodes=200)
    >>> fill = BackgroundFill(host, lambda check: HotSet(torch.tensor([7, 3, 150]), "presample", None))
    >>> fill.start().wait(timeout=30)
    True
    >>> host.lookup(torch.tensor([3, 4, 7, 150])).tolist()  # ranked: expected, none read yet
    [-1, -1, -1, -1]
    >>> host.admit(torch.tensor([4, 7]), torch.tensor([[4., 4.], [7., 7.]]))  # a read of the buffer's
    1
    >>> host.lookup(torch.tensor([3, 4, 7, 150])).tolist(), fill.rows_filled
    ([-1, -1, 1, -1], 1)
    >>> fill.close()
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from lightning_ooc.errors import LightningOOCError
from lightning_ooc.store.host_cache import HostCache, HotSet
from lightning_ooc.utils.shutdown import forget, stop_at_exit

log = logging.getLogger("lightning_ooc")

#: ``host_cache_fill="auto"`` ranks a host cache of this many bytes or more in the background
BACKGROUND_FILL_BYTES = 64 << 20

#: the most a fill waits for the first batch to be trained before it ranks (see ``BackgroundFill``)
FILL_WAIT_SECONDS = 5.0

#: how long closing waits for the thread (it stops within a presampled batch)
JOIN_SECONDS = 60.0


class HostCacheFillError(LightningOOCError, RuntimeError):
    """The host cache's background ranking failed; the cause is chained."""


class _Stopped(Exception):
    pass


class BatchCounter:
    """Access counts of each node over ``batches`` minibatches, added from several threads: the pipeline's
    extractors give the epoch's batches (``observed=True``) while the ranking thread gives presampled ones; the
    batches past the count are not counted. The counts (int16, 2 B a node; int32 past 32,766 batches) are
    allocated with the first batch and given away by :meth:`take`, after which nothing is counted.

    >>> counter = BatchCounter(num_nodes=5, batches=2)
    >>> counter.add(torch.tensor([1, 3]), observed=True), counter.add(torch.tensor([3])), counter.full
    (True, True, True)
    >>> counter.add(torch.tensor([4]), observed=True)  # past the count
    False
    >>> counter.take().tolist(), counter.observed, counter.presampled
    ([0, 1, 0, 2, 0], 1, 1)
    """

    def __init__(self, num_nodes: int, batches: int):
        self.num_nodes, self.batches = int(num_nodes), max(1, int(batches))
        self.observed = self.presampled = 0
        self._counts: torch.Tensor | None = None
        self._taken = False
        self._lock = threading.Lock()

    @property
    def full(self) -> bool:
        """Whether it counted its batches (or was taken)."""
        return self._taken or self.observed + self.presampled >= self.batches

    def add(self, n_id: torch.Tensor, observed: bool = False) -> bool:
        """Count one batch's node ids (each once: a batch's ``n_id``); ``False`` where it is full already."""
        if self.full:  # the pipeline's fast path once ranked: no lock
            return False
        n_id = n_id.to(torch.int64)
        with self._lock:
            if self.full:
                return False
            if self._counts is None:
                wide = self.batches >= torch.iinfo(torch.int16).max
                self._counts = torch.zeros(self.num_nodes, dtype=torch.int32 if wide else torch.int16)
            self._counts.index_add_(0, n_id, torch.ones(n_id.numel(), dtype=self._counts.dtype))
            if observed:
                self.observed += 1
            else:
                self.presampled += 1
            return True

    def take(self) -> torch.Tensor:
        """The counts so far (zeros where nothing was counted); counting ends here."""
        counts = self.close()
        return counts if counts is not None else torch.zeros(self.num_nodes, dtype=torch.int16)

    def close(self) -> torch.Tensor | None:
        """End counting; the counts so far, if any (given away: the counter keeps none)."""
        with self._lock:
            self._taken = True
            counts, self._counts = self._counts, None
        return counts


class BackgroundFill:
    """Rank the host cache's rows with ``rank()`` in a thread and have ``host`` expect them (see the module
    docstring).

    Args:
        host: an empty host cache (:meth:`HostCache.empty`) with room for the rows.
        rank: ``rank(check)`` returns the hot set, hottest first; it runs in the thread (a presample's
            counting) and calls ``check()`` between batches, which stops it early once the fill is closed.
        counter: the counts ``rank`` ranks from, which the host cache tier also adds the epoch's batches to
            (:meth:`observe`) until it is full.
        on_done: called in the thread with the hot set once the host cache expects its rows.
        wait_batches: the thread waits for this many :meth:`batch_done` calls (the host cache tier makes one
            for each batch given back, trained), or ``wait_seconds`` after :meth:`start`, before it ranks: the
            first batches have the CPU to themselves. 0: it ranks at once. ``wait_seconds`` defaults to
            :data:`FILL_WAIT_SECONDS`.
    """

    def __init__(self, host: HostCache, rank: Callable[[Callable[[], None]], HotSet],
                 on_done: Callable[[HotSet, "BackgroundFill"], None] | None = None, wait_batches: int = 0,
                 wait_seconds: float | None = None, counter: BatchCounter | None = None):  # fmt: skip
        self.host, self._rank, self._on_done = host, rank, on_done
        self.counter = counter
        #: batches given back so far (:meth:`batch_done`), and how many had been when the rows were expected
        self.batches_done = 0
        self.ranked_after_batches: int | None = None
        self._batches_left = max(0, int(wait_batches))
        self.wait_seconds = float(FILL_WAIT_SECONDS if wait_seconds is None else wait_seconds)
        self._go = threading.Event()
        if not self._batches_left:
            self._go.set()
        self.error: BaseException | None = None
        #: seconds it waited for the first batch; from then, to the end of ranking
        self.waited: float | None = None
        self.rank_seconds: float | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def rows_filled(self) -> int:
        """Rows the host cache holds so far (kept from the feature buffer's reads)."""
        return int(self.host.admitted_rows)

    def start(self) -> "BackgroundFill":
        self._thread = threading.Thread(target=self._run, name="ooc-host-cache-fill", daemon=True)
        stop_at_exit(self)  # stopped at interpreter exit, before the native sampler goes away under it
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        """Whether the thread has ended (ranked, failed or stopped)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; ``True`` if it has. Raises its error, if it failed."""
        ended = self._done.wait(timeout)
        self.raise_error()
        return ended

    def observe(self, n_id: torch.Tensor) -> None:
        """A batch looked up in the host cache: counted towards the ranking while it counts (see ``counter``)."""
        counter = self.counter
        if counter is not None and not counter.full:
            counter.add(n_id, observed=True)

    def batch_done(self) -> None:
        """One batch given back to the host cache tier (see ``wait_batches``)."""
        self.batches_done += 1  # racy between releasers: a count lost only shifts a figure by one
        if self._batches_left:
            self._batches_left -= 1  # releasers may race here: a count lost only moves the start by a batch
            if self._batches_left <= 0:
                self._go.set()

    def check(self) -> None:
        """Stop the thread here if the fill was closed (called between the ranking's batches)."""
        if self._stop.is_set():
            raise _Stopped()

    def raise_error(self) -> None:
        """Raise the thread's failure in the caller (the host cache tier calls this at every lookup)."""
        if self.error is not None:
            raise HostCacheFillError(f"the host cache's background ranking failed: {self.error}") from self.error

    def _run(self) -> None:
        t0 = time.perf_counter()
        hot: HotSet | None = None
        try:
            while not self._go.wait(0.05) and time.perf_counter() - t0 < self.wait_seconds:
                self.check()
            self.waited = time.perf_counter() - t0
            t0 += self.waited  # the time below counts from the end of the wait
            hot = self._rank(self.check)
            self.check()
            self.host.expect(torch.sort(hot.ids[: self.host.capacity].to(torch.int64)).values)
            self.rank_seconds = time.perf_counter() - t0
            self.ranked_after_batches = self.batches_done
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - raised in the pipeline by the next lookup
            log.error("lightning_ooc: the host cache's background ranking failed: %s", e, exc_info=True)
            self.error = e.with_traceback(None)  # its frames held the ranking (a count per node)
        else:
            if self._on_done is not None:
                try:  # the rows are expected: a failing estimate is a warning, not a failed run
                    self._on_done(hot, self)
                except Exception as e:  # noqa: BLE001
                    log.warning("lightning_ooc: the host cache is ranked; its estimates failed: %s", e)
        finally:
            hot = None
            self._rank = self._on_done = None  # what ranking held (presampled batches) goes with the thread
            if self.counter is not None:
                self.counter.close()  # stopped or failed: the counts go too, and the pipeline stops counting
            forget(self)
            self._done.set()

    def close(self) -> None:
        """Stop the thread and wait for it (it ends within one presampled batch, or 50 ms of waiting for the
        first batch)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(JOIN_SECONDS)
            if t.is_alive():
                log.error("lightning_ooc: the host cache's background fill did not stop within %.0f s", JOIN_SECONDS)


class DeferredHot:
    """The host cache of a plan whose rows are ranked in the background and kept from the buffer's reads: its size
    is fixed at set-up, its rows come from ``rank()`` over ``counter`` (see :class:`BackgroundFill`)."""

    def __init__(self, rank: Callable[[Callable[[], None]], HotSet], on_done: Callable[[HotSet, BackgroundFill], None],
                 counter: BatchCounter | None = None):  # fmt: skip
        self.rank, self.on_done, self.counter = rank, on_done, counter
