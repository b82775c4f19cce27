"""Cancellation of one run: a token that every blocking wait of the run observes.

A run (one pass over a split) owns a :class:`CancelToken`. Its threads wait
on conditions (free slots in the feature buffer, rows in flight, staging
chunks, queue space) through :meth:`CancelToken.wait`, which returns as soon
as the condition is notified *or* the token is cancelled: cancelling notifies
every condition a thread of the run currently waits on. A wait that sees the
token cancelled raises :class:`Cancelled`, so a closed or failed run stops
its threads within one wake-up, and nothing outside the run (the feature
buffer shared by every pass, the staging buffer) is closed to do it.

Example::

    >>> import threading
    >>> from lightning_ooc.utils.cancel import CancelToken, Cancelled
    >>> token, cond = CancelToken("demo"), threading.Condition()
    >>> t = threading.Thread(target=lambda: token.cancel("stop"))
    >>> with cond:
    ...     t.start()
    ...     try:
    ...         while True:
    ...             token.wait(cond)
    ...     except Cancelled as e:
    ...         print(e)
    run 'demo' was cancelled: stop
    >>> t.join()
"""
from __future__ import annotations

import threading

from lightning_ooc.errors import LightningOOCError

#: the longest a wait sleeps before it looks at the token again (a backstop: cancel() also wakes it)
POLL_SECONDS = 0.25


class Cancelled(LightningOOCError):
    """The run a wait belonged to was cancelled (closed, or failed in another thread)."""


class CancelToken:
    """A one-shot cancel signal shared by the threads of one run."""

    def __init__(self, name: str = "run"):
        self.name = name
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._waiting: dict[int, threading.Condition] = {}  # thread id -> the condition it waits on
        self.reason: str | None = None

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self, reason: str = "closed") -> None:
        """Cancel the run: every current and later wait through this token raises :class:`Cancelled`."""
        with self._lock:
            if self._event.is_set():
                return
            self.reason = reason
            self._event.set()
            conds = list(self._waiting.values())
        for cond in conds:
            # A waiter holds the lock only briefly between waits; never block on it for long here
            # (a poll of POLL_SECONDS is the backstop if the lock is busy).
            if cond.acquire(timeout=0.1):
                try:
                    cond.notify_all()
                finally:
                    cond.release()

    def check(self) -> None:
        """Raise :class:`Cancelled` if the token is cancelled."""
        if self._event.is_set():
            raise Cancelled(f"run {self.name!r} was cancelled: {self.reason}")

    def wait(self, cond: threading.Condition, timeout: float | None = None) -> bool:
        """``cond.wait(timeout)`` that also wakes when the token is cancelled (the caller holds ``cond``).

        Returns what ``cond.wait`` returns; raises :class:`Cancelled` if the token is cancelled
        before or during the wait.
        """
        self.check()
        key = threading.get_ident()
        with self._lock:
            self._waiting[key] = cond
        try:
            step = POLL_SECONDS if timeout is None else min(timeout, POLL_SECONDS)
            woke = cond.wait(step)
        finally:
            with self._lock:
                self._waiting.pop(key, None)
        self.check()
        return woke

    def sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds``, raising :class:`Cancelled` as soon as the token is cancelled."""
        if self._event.wait(seconds):
            self.check()


#: a token that is never cancelled (callers outside any run)
class _Never(CancelToken):
    def cancel(self, reason: str = "closed") -> None:  # pragma: no cover - guarded
        raise RuntimeError("the shared NEVER token cannot be cancelled")


NEVER = _Never("none")
