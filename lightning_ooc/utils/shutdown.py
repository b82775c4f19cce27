"""What is left open when the script ends: threads stopped and joined, trained rows written back.

A script that takes one batch and exits (``next(iter(dm.train_dataloader()))``, as PyG's examples do for
their dummy forward pass) leaves a pass running: its sampler and extractor threads are daemon threads, and
at interpreter exit Python ends a daemon thread that wakes up inside a native call by unwinding it, which
aborts the process in C++ code (``terminate called without an active exception``, status 134). A script
that trains by hand (a plain loop over ``train_dataloader()``) and ends without ``teardown()`` leaves
trained rows in memory only: learnable features' buffer, the embedding datamodule's partition buffer.

An object that owns such threads or rows registers itself with :func:`stop_at_exit` when it starts them;
the first registration installs an ``atexit`` hook that closes every registered object still alive, the
last registered first (a pass before the store it reads, a store before its table), so its threads are
joined and what it holds is written back. The hook runs after Python has joined the non-daemon threads and
before it finalises, while the daemon threads can still run to their end. The registry holds objects
weakly: one closed and collected is gone from it.

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
import itertools
import logging
import threading
import weakref
from typing import Any, TypeVar

log = logging.getLogger("lightning_ooc")

T = TypeVar("T")

#: registration number -> (the object, weakly; the name of its closing method), in registration order
_LIVE: dict[int, tuple[weakref.ref, str]] = {}
_BY_ID: dict[int, int] = {}  # id(object) -> its registration number
_LOCK = threading.Lock()
_COUNT = itertools.count()
_hooked = False  # a forked child inherits the parent's hook with this flag


def _prune() -> None:
    """Drop the entries of objects collected without closing (under ``_LOCK``)."""
    for key in [k for k, (ref, _) in _LIVE.items() if ref() is None]:
        del _LIVE[key]
    for oid in [o for o, k in _BY_ID.items() if k not in _LIVE]:
        del _BY_ID[oid]


def stop_at_exit(obj: T, method: str = "close") -> T:
    """Call ``obj.<method>()`` (idempotent: it may have been called already) at interpreter exit if ``obj`` is
    still registered and alive then. Registering an object again keeps its first place."""
    global _hooked
    if not callable(getattr(obj, method, None)):
        raise TypeError(f"{type(obj).__name__} has no method {method}() to call at exit")
    with _LOCK:
        oid = id(obj)
        key = _BY_ID.get(oid)
        if key is not None and key in _LIVE and _LIVE[key][0]() is obj:
            return obj
        _prune()
        key = next(_COUNT)
        _LIVE[key] = (weakref.ref(obj), method)
        _BY_ID[oid] = key
        if not _hooked:
            _hooked = True
            atexit.register(stop_all)
    return obj


def forget(obj: Any) -> None:
    """``obj`` has stopped its threads and let go of what it held: nothing to do at exit."""
    with _LOCK:
        key = _BY_ID.pop(id(obj), None)
        if key is not None:
            _LIVE.pop(key, None)


def registered() -> list[Any]:
    """The objects the hook would close now, in the order it would close them."""
    with _LOCK:
        objs = [ref() for ref, _ in reversed(_LIVE.values())]
    return [o for o in objs if o is not None]


def stop_all() -> int:
    """Close every registered object still alive, the last registered first (errors are logged; the others are
    closed all the same); how many there were."""
    with _LOCK:
        items = [(ref(), method) for ref, method in reversed(_LIVE.values())]
        _LIVE.clear()
        _BY_ID.clear()
    n = 0
    for obj, method in items:
        if obj is None:
            continue
        n += 1
        try:
            getattr(obj, method)()
        except Exception:  # noqa: BLE001 - the others still stop
            log.exception("closing %s at exit", type(obj).__name__)
    return n
