"""The row exchange: feature rows of other machines' nodes, over a torch.distributed process group of its own.

Every process of a partitioned run owns the rows of its machine's partition
and asks the owners for the others. :class:`RowExchange` runs one thread per
process that takes part in *rounds* with the same thread of every other
machine, over a gloo process group created for it alone (so an exchange never
waits behind, or blocks, the gradient collectives of the training group):

1. ``all_gather`` of a header: how many rows this process asks of each peer,
   and whether it wants to stop. Every process then knows the whole round.
2. ``all_to_all_single`` of the requested node ids.
3. Each owner serves what it was asked through ``serve`` (its ordinary tiers:
   host cache, then SSD) and ``all_to_all_single`` sends the rows back, as
   raw bytes, so every feature dtype travels the same way.

Requests from any number of extractor threads are folded into the next round
(:meth:`RowExchange.request` returns a :class:`Ticket`). A round in which
nobody asked anything is followed by a short sleep that grows while the
machines stay idle, the same on every process, since all of them see the
same header. Rounds continue until every process asked to stop
(:meth:`RowExchange.close`), so a process still training is served to the end;
:meth:`RowExchange.abort` leaves at once (after an error), and the peers'
next collective fails instead of waiting.

A peer that dies closes its sockets: the collective in progress fails on the
other processes, the exchange records the error, and every waiting and later
request raises :class:`ExchangeError`, which the pipeline surfaces in the
trainer within seconds. A peer that hangs is an error after ``timeout``.

Example (one process: a group of one serves itself; a process that already has its default group, as one
that ran a Trainer under a DDP strategy does, keeps it)::

    >>> import torch, torch.distributed as dist
    >>> created = not dist.is_initialized()
    >>> if created:
    ...     dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    >>> table = torch.arange(20, dtype=torch.float32).reshape(10, 2)
    >>> ex = RowExchange(dist.new_group([dist.get_rank()], backend="gloo"), owner=torch.zeros(10, dtype=torch.int32),
    ...                  me=0, serve=lambda ids: table[ids], num_features=2, dtype=torch.float32)
    >>> ex.request(torch.tensor([7, 3])).result().tolist()
    [[14.0, 15.0], [6.0, 7.0]]
    >>> ex.close()
    >>> if created:
    ...     dist.destroy_process_group()
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from lightning_ooc.errors import LightningOOCError
from lightning_ooc.utils.cancel import NEVER, CancelToken
from lightning_ooc.utils.shutdown import forget, stop_at_exit

log = logging.getLogger("lightning_ooc")

#: the longest sleep between two rounds in which no machine asked anything (seconds)
IDLE_MAX = 0.02
#: rows one round carries from one process at most (more waits for the next round)
ROUND_ROWS = 1 << 20
#: seconds an exchange left open when the script ends waits at exit for the other processes to stop too
EXIT_TIMEOUT = 30.0


class ExchangeError(LightningOOCError, RuntimeError):
    """The row exchange with other machines failed (a machine died or stopped answering)."""


class Ticket:
    """The rows of one request, once its round completed (:meth:`result`)."""

    def __init__(self, ids: torch.Tensor, by_owner: list[torch.Tensor], order: torch.Tensor):
        self.ids = ids
        self.by_owner = by_owner  # ids asked of each peer
        self.order = order  # position in ``ids`` of each row of the concatenation of by_owner
        self.rows: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # time between the request and its rows
        self._t0 = time.perf_counter()
        self._done = threading.Event()

    def _finish(self, rows: torch.Tensor | None, error: BaseException | None = None) -> None:
        self.rows, self.error = rows, error
        self.seconds = time.perf_counter() - self._t0
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, cancel: CancelToken = NEVER) -> torch.Tensor:
        """The rows of the requested ids, in their order (waits for the round; cancel-aware)."""
        while not self._done.wait(0.05):
            cancel.check()
        if self.error is not None:
            raise self.error
        assert self.rows is not None
        return self.rows


class RowExchange:
    """Rounds of row requests between the processes of a group (see the module docstring).

    Args:
        group: the process group of the exchange (one process per machine; gloo).
        owner: the machine (group rank) owning each node, indexed by global node id.
        me: this process's rank in ``group``.
        serve: global ids owned here -> their rows (``[n, num_features]`` of ``dtype``, on the CPU).
        num_features, dtype: a row's shape.
        name: for the thread and the log.
    """

    def __init__(self, group: Any, owner: np.ndarray | torch.Tensor, me: int,
                 serve: Callable[[torch.Tensor], torch.Tensor], num_features: int, dtype: torch.dtype,
                 name: str = "rows", thread_init: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.group = group
        self._thread_init = thread_init
        self.world = dist.get_world_size(group)
        self.me = int(me)
        self.owner = owner if isinstance(owner, torch.Tensor) else torch.from_numpy(np.asarray(owner))
        self.serve = serve
        self.num_features, self.dtype = int(num_features), dtype
        self.row_bytes = torch.empty((), dtype=dtype).element_size() * self.num_features
        self._lock = threading.Condition()
        self._pending: list[Ticket] = []
        self._inflight: list[Ticket] = []  # the tickets of the round in progress
        self._closing = False
        self._aborted = False
        self._error: BaseException | None = None
        # what crossed the wire, counted by the exchange thread (read for per-epoch metrics)
        self.rounds = 0
        self.rows_sent = 0
        self.rows_received = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.serve_seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"ooc-exchange-{name}", daemon=True)
        self._thread.start()
        # left open when the script ends, the thread would be ended inside a collective call (an abort)
        stop_at_exit(self, "_close_at_exit")

    # -- callers ---------------------------------------------------------------------------------
    def request(self, ids: torch.Tensor) -> Ticket:
        """Ask the owners for the rows of ``ids`` (global ids none of which this process owns)."""
        ids = ids.to(torch.int64).reshape(-1)
        own = self.owner[ids].to(torch.int64)
        order = torch.argsort(own, stable=True)
        counts = torch.bincount(own, minlength=self.world).tolist()
        by_owner = list(torch.split(ids[order], counts))
        ticket = Ticket(ids, by_owner, order)
        with self._lock:
            if self._error is not None:
                ticket._finish(None, self._failure())
            elif self._closing or self._aborted:
                ticket._finish(None, ExchangeError("the row exchange is closed"))
            elif ids.numel() == 0:
                ticket._finish(torch.empty((0, self.num_features), dtype=self.dtype))
            else:
                self._pending.append(ticket)
                self._lock.notify_all()
        return ticket

    def fetch(self, ids: torch.Tensor, cancel: CancelToken = NEVER) -> torch.Tensor:
        """:meth:`request` then wait for the rows."""
        return self.request(ids).result(cancel)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def counters(self) -> dict[str, float]:
        """What the exchange carried so far (rows and bytes both ways, rounds)."""
        return {"rounds": self.rounds, "rows_sent": self.rows_sent, "rows_received": self.rows_received,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "serve_seconds": self.serve_seconds}  # fmt: skip

    def close(self, timeout: float | None = None) -> None:
        """Stop taking part once every other process asked to stop as well (they may still need rows)."""
        forget(self)
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the row exchange did not stop within %.0f s (another machine is still running or "
                        "stopped answering); leaving it", timeout or 0)  # fmt: skip
            self.abort()
            self._thread.join(5.0)
        if not self._thread.is_alive():
            self._destroy_group()

    def _close_at_exit(self) -> None:
        self.close(EXIT_TIMEOUT)

    @property
    def stopped(self) -> bool:
        """Whether the exchange thread has ended (nothing of it still uses ``serve``)."""
        return not self._thread.is_alive()

    def _destroy_group(self) -> None:
        group, self.group = self.group, None
        destroy_group(group)

    def abort(self) -> None:
        """Leave now (after an error): the other processes' next exchange fails instead of waiting."""
        with self._lock:
            self._aborted = True
            self._fail_all(ExchangeError("the row exchange was stopped"))
            self._lock.notify_all()

    def _fail_all(self, error: BaseException) -> None:
        """Fail every ticket not finished yet, in flight or waiting (under the lock)."""
        for t in self._inflight + self._pending:
            if not t.done():
                t._finish(None, error)
        self._pending.clear()

    # -- the exchange thread ----------------------------------------------------------------------
    def _failure(self) -> ExchangeError:
        e = self._error
        text = str(e).split(". This is typically")[0]
        return ExchangeError(
            f"the row exchange with the other machines failed ({type(e).__name__}: {text}); a machine of the run "
            "died or stopped answering: see its log"
        )  # fmt: skip

    def _take(self) -> list[Ticket]:
        """The requests of the next round (up to ROUND_ROWS rows; whole tickets)."""
        taken, rows = [], 0
        while self._pending and (not taken or rows + self._pending[0].ids.numel() <= ROUND_ROWS):
            t = self._pending.pop(0)
            taken.append(t)
            rows += t.ids.numel()
        return taken

    def _loop(self) -> None:
        idle = 0.0
        try:
            if self._thread_init is not None:
                self._thread_init()
            while True:
                with self._lock:
                    if self._aborted:
                        break
                    if idle and not self._pending and not self._closing:
                        self._lock.wait(idle)  # a request wakes us early: we ask, the peers answer next round
                    self._inflight = self._take()
                    closing = self._closing
                if not self._round(self._inflight, closing):
                    return
                idle = 0.0 if self._inflight or self._busy else min(IDLE_MAX, max(idle * 2, 0.0005))
        except BaseException as e:  # noqa: BLE001 - recorded, and raised in every waiting caller
            with self._lock:
                aborted = self._aborted
                if not aborted:
                    self._error = e
                    self._fail_all(self._failure())
            if not aborted:
                log.error("%s", self._failure())
        finally:
            with self._lock:
                self._fail_all(ExchangeError("the row exchange was stopped"))
        # left after an error or an abort: the peers' next round with us fails now (their connections to this
        # process close) instead of waiting for the group's timeout
        self._destroy_group()

    def _round(self, tickets: list[Ticket], closing: bool) -> bool:
        """One round with every peer; False once every process asked to stop."""
        w = self.world
        started = time.perf_counter()
        send_ids = [torch.cat([t.by_owner[p] for t in tickets]) if tickets else torch.empty(0, dtype=torch.int64)
                    for p in range(w)]  # fmt: skip
        header = torch.tensor([x.numel() for x in send_ids] + [int(closing)], dtype=torch.int64)
        headers = [torch.empty_like(header) for _ in range(w)]
        dist.all_gather(headers, header, group=self.group)
        h = torch.stack(headers)  # [from, to... | closing]
        asked = h[:, :w]
        self._busy = bool(asked.any())
        if not self._busy:
            self._moved(started, 0, 0, busy=False)
            return not bool(h[:, w].all())
        self.rounds += 1
        in_splits = asked[self.me].tolist()  # what I ask of each peer
        out_splits = asked[:, self.me].tolist()  # what each peer asks of me
        theirs = torch.empty(sum(out_splits), dtype=torch.int64)
        dist.all_to_all_single(theirs, torch.cat(send_ids), out_splits, in_splits, group=self.group)
        t0 = time.perf_counter()
        if theirs.numel():
            rows = self.serve(theirs)
            if rows.shape != (theirs.numel(), self.num_features) or rows.dtype != self.dtype:
                raise RuntimeError(f"serving {theirs.numel()} rows gave {tuple(rows.shape)} {rows.dtype}")
            rows = rows.contiguous()
        else:
            rows = torch.empty((0, self.num_features), dtype=self.dtype)
        served = time.perf_counter() - t0
        self.serve_seconds += served
        got = self._send_rows(rows.view(torch.uint8).reshape(-1, self.row_bytes), in_splits, out_splits, served)
        self.rows_sent += theirs.numel()
        self.rows_received += got.shape[0]
        # ids go out with the requests, rows come back: each side counts what left it and what reached it
        sent = sum(in_splits) * 8 + theirs.numel() * self.row_bytes
        received = theirs.numel() * 8 + got.shape[0] * self.row_bytes
        self.bytes_sent += sent
        self.bytes_received += received
        self._moved(started, sent, received, busy=True)
        got = got.view(self.dtype).reshape(-1, self.num_features)
        # hand each ticket its rows: the round's rows come grouped by peer, each peer's in ticket order
        starts = np.concatenate([[0], np.cumsum(in_splits)])
        offset = [int(s) for s in starts[:-1]]
        for t in tickets:
            parts = []
            for p in range(w):
                n = t.by_owner[p].numel()
                parts.append(got[offset[p] : offset[p] + n])
                offset[p] += n
            grouped = torch.cat(parts)
            rows_t = torch.empty_like(grouped)
            rows_t[t.order] = grouped
            t._finish(rows_t)
        return True

    def _send_rows(self, rows: torch.Tensor, in_splits: list[int], out_splits: list[int],
                   served: float) -> torch.Tensor:  # fmt: skip
        """The round's last collective: ``rows`` (raw bytes, ``[sum(out_splits), row_bytes]``, grouped by the peer
        that asked for them) go out, the rows asked of each peer (``in_splits``) come back, ``[sum(in_splits),
        row_bytes]`` uint8. ``served``: the seconds ``serve`` took for ``rows`` here; unused here, a subclass may
        send it along with the rows (``bench distributed --links`` adds the owners' serve time to a modelled
        round)."""
        got = torch.empty((sum(in_splits), self.row_bytes), dtype=torch.uint8)
        dist.all_to_all_single(got, rows, in_splits, out_splits, group=self.group)
        return got

    def _moved(self, started: float, sent: int, received: int, busy: bool) -> None:
        """A round (begun at ``started``, ``time.perf_counter``; ``busy``: it moved ids and rows, else only the
        header) sent and received these bytes; its rows are handed out next. Nothing here; a subclass may model
        a slower network by waiting (``bench distributed --links``)."""

    _busy = False


def exchange_group(ranks: list[int], timeout: float) -> Any:
    """A gloo process group of ``ranks`` for row exchanges (every process of the run must call this, in the
    same order, for every group; see :func:`torch.distributed.new_group`)."""
    return dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))


def destroy_group(group: Any) -> None:
    """Let an exchange group's connections go (never the default group: it is not the exchange's)."""
    if group is None or group is dist.group.WORLD or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - the group may be broken already; its sockets go with it
        pass
