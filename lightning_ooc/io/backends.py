"""Which read backends work here, and which one ``backend="auto"`` picks.

========== ====================================================================
backend    how rows are read
========== ====================================================================
uring      io_uring, ``O_DIRECT``, one ring per reader thread (the real path)
pread      ``O_DIRECT`` ``pread`` from a native thread pool (no io_uring)
buffered   through the page cache (``O_DIRECT`` refused, or a memory file system)
mmap       NumPy memmap fancy indexing: the "PyG with mmap'd features" baseline
========== ====================================================================

``auto`` takes the first of uring, pread, buffered that works on the file,
never a fallback where the real path works, and logs its choice and the
reason once (logger ``"lightning_ooc"``). Setting the environment variable
``LIGHTNING_OOC_DISABLE_IO_URING=1`` makes io_uring count as unavailable
(to compare backends, or inside a sandbox that kills processes using it).
"""
from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
from types import ModuleType
from typing import Any

log = logging.getLogger("lightning_ooc")

BACKENDS = ("uring", "pread", "buffered", "mmap")
DISABLE_URING_ENV = "LIGHTNING_OOC_DISABLE_IO_URING"
#: File systems that hold files in memory: O_DIRECT, where accepted, bypasses nothing there.
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")

_logged: set[tuple[str, str, str]] = set()
_log_lock = threading.Lock()


def native() -> ModuleType | None:
    """The native module ``lightning_ooc._io``, or None if it is not built."""
    return _import_io()[0]


@functools.lru_cache(maxsize=1)
def _import_io() -> tuple[ModuleType | None, str]:
    try:
        from lightning_ooc import _io  # lazy: the native module may not be built
    except ImportError as e:
        return None, f"the native module lightning_ooc._io is not built ({e}); build it with `pip install -e .` or `make ext`"
    return _io, ""


@functools.lru_cache(maxsize=1)
def _uring_probe() -> tuple[bool, str]:
    mod, why = _import_io()
    if mod is None:
        return False, why
    if not mod.build_info()["liburing"]:
        return False, "lightning_ooc._io was built without liburing (install liburing-dev and rebuild)"
    return tuple(mod.uring_probe())  # type: ignore[return-value]


def uring_status() -> tuple[bool, str]:
    """Whether this process can use io_uring, and why not."""
    if os.environ.get(DISABLE_URING_ENV, "") not in ("", "0"):
        return False, f"io_uring disabled by {DISABLE_URING_ENV}={os.environ[DISABLE_URING_ENV]}"
    return _uring_probe()


def probe_file(path: str | os.PathLike) -> dict[str, Any]:
    """File system, alignment and O_DIRECT facts of ``path`` (see ``lightning_ooc._io.probe``)."""
    mod, why = _import_io()
    if mod is None:
        raise RuntimeError(why)
    return mod.probe(os.fspath(path))


def available_backends(path: str | os.PathLike | None = None) -> dict[str, tuple[bool, str]]:
    """Map each backend to ``(works, reason)``.

    Without ``path`` this says what the build and the kernel allow; with a
    file it also tries an ``O_DIRECT`` read of that file; with a dataset
    directory, of its ``features.bin``; with another directory, of a small
    scratch file created there (and removed).

    >>> b = available_backends()
    >>> sorted(b) == sorted(BACKENDS) and b["mmap"][0]
    True
    """
    out: dict[str, tuple[bool, str]] = {}
    mod, why = _import_io()
    mmap_reason = "NumPy memmap fancy indexing through the page cache (baseline)"
    if mod is None:
        for name in ("uring", "pread", "buffered"):
            out[name] = (False, why)
        out["mmap"] = (True, mmap_reason)
        return out
    uring_ok, uring_why = uring_status()
    if path is None:
        direct_why = "O_DIRECT support depends on the file system; pass a path to check a file"
        out["uring"] = (uring_ok, f"{uring_why}; {direct_why}" if uring_ok else uring_why)
        out["pread"] = (True, f"O_DIRECT pread thread pool; {direct_why}")
        out["buffered"] = (True, "page-cache reads (pread / io_uring without O_DIRECT)")
        out["mmap"] = (True, mmap_reason)
        return out
    path = os.fspath(path)
    if os.path.isdir(path):  # a dataset directory: its feature file, else a scratch file on that file system
        features = os.path.join(path, "features.bin")
        if os.path.isfile(features):
            return available_backends(features)
        return _probe_directory(path)
    try:
        info = mod.probe(path)
    except OSError as e:
        reason = f"{path}: {e.strerror}"
        return {name: (False, reason) for name in BACKENDS}
    fs = info["fs"]
    if info["direct"]:
        direct_why = f"O_DIRECT works on {fs} (read alignment {info['block_size']} B from {info['block_source']})"
    else:
        direct_why = f"{fs} refuses O_DIRECT on {path}: {info['direct_error']}"
    if not uring_ok:
        out["uring"] = (False, uring_why)
    elif not info["direct"]:
        out["uring"] = (False, direct_why)
    else:
        out["uring"] = (True, f"io_uring with {direct_why}")
    out["pread"] = (bool(info["direct"]), f"pread thread pool with {direct_why}" if info["direct"] else direct_why)
    if fs in MEMORY_FILE_SYSTEMS:
        note = f"; {fs} keeps files in memory, so auto prefers 'buffered' here"
        out["uring"] = (out["uring"][0], out["uring"][1] + note)
        out["pread"] = (out["pread"][0], out["pread"][1] + note)
    engine = "io_uring" if uring_ok else "a pread thread pool"
    out["buffered"] = (os.access(path, os.R_OK), f"page-cache reads through {engine} on {fs}")
    out["mmap"] = (True, mmap_reason)
    return out


def _probe_directory(path: str) -> dict[str, tuple[bool, str]]:
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".lightning_ooc-probe-") as f:
            f.write(b"\0" * 65536)
            f.flush()
            return available_backends(f.name)
    except OSError as e:
        reason = f"{path}: cannot create a probe file ({e.strerror}); pass a file on this file system"
        out = {name: (False, reason) for name in BACKENDS}
        out["mmap"] = (True, "NumPy memmap fancy indexing through the page cache (baseline)")
        return out


def choose_backend(path: str | os.PathLike, *, what: str = "feature reader") -> tuple[str, str]:
    """The backend ``auto`` uses for ``path`` and why; logs the choice once per situation.

    ``what`` names the user in the log line (``"bulk file"`` for :mod:`lightning_ooc.io.bulk`).
    """
    avail = available_backends(path)
    fs = ""
    if native() is not None:
        try:
            fs = probe_file(path)["fs"]
        except OSError:
            fs = ""
    if fs in MEMORY_FILE_SYSTEMS and avail["buffered"][0]:
        choice, situation = "buffered", f"memory file system {fs}"
        reason = (f"{path} is on {fs}, which keeps files in memory: direct I/O would bypass nothing, "
                  f"so rows are read through the page cache ({avail['buffered'][1]})")
    elif avail["uring"][0]:
        choice, situation = "uring", "io_uring with O_DIRECT"
        reason = avail["uring"][1]
    elif avail["pread"][0]:
        choice, situation = "pread", avail["uring"][1]
        reason = f"io_uring is unavailable ({avail['uring'][1]}); falling back to {avail['pread'][1]}"
    elif avail["buffered"][0]:
        choice, situation = "buffered", f"no O_DIRECT on {fs}"
        reason = f"direct I/O is unavailable ({avail['pread'][1]}); falling back to {avail['buffered'][1]}"
    else:
        choice, situation = "mmap", avail["buffered"][1]
        reason = f"no native backend works ({avail['buffered'][1]}); falling back to NumPy memmap"
    _log_once(choice, situation, reason, fallback=choice != "uring", what=what)
    return choice, reason


def _log_once(backend: str, situation: str, reason: str, *, fallback: bool, what: str = "feature reader") -> None:
    """Log a choice once per distinct situation (not once per reader or per file)."""
    key = (what, backend, situation)
    with _log_lock:
        if key in _logged:
            return
        _logged.add(key)
    level = logging.WARNING if fallback else logging.INFO
    log.log(level, "%s backend %r: %s", what, backend, reason)
