"""Threads of ours stopped and joined before the interpreter finalises, whatever was left open.

A script that takes one batch and exits (``next(iter(dm.train_dataloader()))``, as PyG's examples do for
their dummy forward pass) leaves a pass running: its sampler and extractor threads are daemon threads, and
at interpreter exit Python ends a daemon thread that wakes up inside a native call by unwinding it, which
aborts the process in C++ code (``terminate called without an active exception``, status 134).

An object that owns such threads registers itself with :func:`stop_at_exit` when it starts them; the
first registration installs an ``atexit`` hook that closes, and so joins, every registered object still
alive. The hook runs after Python has joined the non-daemon threads and before it finalises, while the
daemon threads can still run to their end. The registry holds objects weakly: one closed and collected
is gone from it.

Example::

    >>> from lightning_ooc.utils.shutdown import forget, registered, stop_at_exit
    >>> class Run:
    ...     def close(self):
    ...         forget(self)  # its threads are joined: nothing left to close at exit
    >>> run = stop_at_exit(Run())
    >>> run in registered()  # the hook would close it at exit
    True
    >>> run.close()
    >>> run in registered()
    False
"""
from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any, TypeVar

log = logging.getLogger("lightning_ooc")

T = TypeVar("T")

_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
_LOCK = threading.Lock()
_hooked = False  # a forked child inherits the parent's hook with this flag


def stop_at_exit(obj: T) -> T:
    """Close ``obj`` (it has ``close()``, idempotent) at interpreter exit if it is still alive then."""
    global _hooked
    with _LOCK:
        _LIVE.add(obj)
        if not _hooked:
            _hooked = True
            atexit.register(stop_all)
    return obj


def forget(obj: Any) -> None:
    """``obj`` has stopped its threads: nothing to close at exit."""
    with _LOCK:
        _LIVE.discard(obj)


def registered() -> list[Any]:
    """The objects the hook would close now."""
    with _LOCK:
        return list(_LIVE)


def stop_all() -> int:
    """Close every registered object still alive (errors are logged; the others are closed all the same);
    how many there were."""
    with _LOCK:
        objs = list(_LIVE)
        _LIVE.clear()
    for obj in objs:
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - the others still stop
            log.exception("closing %s at exit", type(obj).__name__)
    return len(objs)
