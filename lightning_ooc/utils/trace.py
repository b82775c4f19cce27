"""A per-stage timeline of a pass, written as a Chrome trace (Perfetto, ``chrome://tracing``, TensorBoard).

:class:`Timeline` records spans -- what a thread did, from when to when -- and
writes them in the Trace Event Format: one row per thread (samplers,
extractors, the releaser, the trainer), one box per stage of each minibatch
(``sample``, ``claim``, ``fill`` with ``ssd.read`` and ``ssd.copy`` inside it,
``pin``, ``wait`` for a batch, ``gather``, ``train``, ``release``), with the
batch number in each box's arguments. Code deep in the store records into
the timeline of the pass its thread works for (:func:`span` uses the
thread's current timeline, set by :func:`use`); without one, spans cost a
thread-local lookup.

Example::

    >>> import json, tempfile, time
    >>> from lightning_ooc.utils import trace
    >>> tl = trace.Timeline("example")
    >>> with trace.use(tl), trace.span("sample", batch=0):
    ...     time.sleep(0.001)
    >>> path = tl.write(tempfile.mkdtemp() + "/example.trace.json")
    >>> doc = json.load(open(path))
    >>> [(e["name"], e["ph"], e["args"]) for e in doc["traceEvents"] if e["ph"] == "X"]
    [('sample', 'X', {'batch': 0})]
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

_local = threading.local()


class Timeline:
    """Spans of the threads of one pass; :meth:`write` saves them as a Chrome trace."""

    def __init__(self, name: str, pid: int | None = None):
        self.name = name
        self.pid = os.getpid() if pid is None else int(pid)
        self._t0 = time.perf_counter_ns()
        self._events: list[dict[str, Any]] = []
        self._threads: dict[int, str] = {}
        self._lock = threading.Lock()

    def add(self, name: str, start_ns: int, end_ns: int, args: dict[str, Any] | None = None) -> None:
        """Record a span of the calling thread (``perf_counter_ns`` times)."""
        t = threading.current_thread()
        ev = {"name": name, "ph": "X", "pid": self.pid, "tid": t.ident or 0, "ts": (start_ns - self._t0) / 1000.0,
              "dur": max(0, end_ns - start_ns) / 1000.0, "args": args or {}}  # fmt: skip
        with self._lock:
            self._events.append(ev)
            self._threads.setdefault(t.ident or 0, t.name)

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def totals(self) -> dict[str, float]:
        """Seconds spent in each stage, summed over threads."""
        out: dict[str, float] = {}
        for e in self.events:
            out[e["name"]] = out.get(e["name"], 0.0) + e["dur"] / 1e6
        return out

    def write(self, path: str | os.PathLike) -> Path:
        """Write the Chrome trace to ``path`` (parent directories are made); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            events = list(self._events)
            threads = dict(self._threads)
        meta = [{"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": self.name}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid, "args": {"name": tname}}
                 for tid, tname in threads.items()]  # fmt: skip
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))
        os.replace(tmp, path)
        return path


@contextlib.contextmanager
def use(timeline: Timeline | None) -> Iterator[None]:
    """Make ``timeline`` the calling thread's current one for the block (None: record nothing)."""
    before = getattr(_local, "timeline", None)
    _local.timeline = timeline
    try:
        yield
    finally:
        _local.timeline = before


def current() -> Timeline | None:
    """The calling thread's current timeline, if any."""
    return getattr(_local, "timeline", None)


@contextlib.contextmanager
def span(name: str, **args: Any) -> Iterator[None]:
    """Record the block as a span ``name`` of the calling thread's current timeline (if it has one)."""
    tl = getattr(_local, "timeline", None)
    if tl is None:
        yield
        return
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        tl.add(name, start, time.perf_counter_ns(), args)
