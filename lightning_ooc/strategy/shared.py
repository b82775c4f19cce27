"""Node-local shared memory: one copy of an array per machine, attached by every rank on it.

The ranks of one machine agree on a name, the lowest local rank creates the
segment in ``/dev/shm`` and fills it, the others map the same pages, and as
soon as every rank has mapped it the creator *unlinks* it. From then on the
memory lives exactly as long as some rank still maps it: nothing can be left
behind in ``/dev/shm`` by a crash, a ``SIGKILL`` or Ctrl-C after set-up. The
short window between creation and unlinking is covered by an ``atexit``
hook, and by a sweep at the next start that removes segments whose creating
process no longer exists (the creator's pid is part of the name).

Every step that can fail on one rank (``/dev/shm`` too small, a fill that
raises) is followed by an exchange of status between all ranks, so a failure
on one rank becomes the same :class:`SharedMemoryError` on every rank instead
of a hang in a barrier.

Example (one process; under the ``"ooc"`` strategy ``exchange`` is an
all-gather over the ranks)::

    >>> import numpy as np
    >>> from lightning_ooc.strategy.shared import NodeShared
    >>> shm = NodeShared(token="doc", local_rank=0, local_world=1)
    >>> a = shm.array("squares", (4,), np.int64, fill=lambda out: np.square(np.arange(4), out=out))
    >>> a.tolist(), a.flags.writeable
    ([0, 1, 4, 9], False)
    >>> shm.segments()  # already unlinked: nothing to clean up
    []
    >>> shm.close()
"""
from __future__ import annotations

import atexit
import logging
import mmap
import os
import re
import shutil
import threading
from typing import Any, Callable

import numpy as np

from lightning_ooc.errors import LightningOOCError
from lightning_ooc.utils.proc import pid_alive

log = logging.getLogger("lightning_ooc")

SHM_DIR = "/dev/shm"
PREFIX = "looc-"
_NAME = re.compile(r"^looc-(\d+)-")
_pending: set[str] = set()  # created and not yet unlinked, in this process
_pending_lock = threading.Lock()


class SharedMemoryError(LightningOOCError):
    """Creating or attaching a node-local shared segment failed (on this rank or another)."""


def _unlink_pending() -> None:
    with _pending_lock:
        paths = list(_pending)
        _pending.clear()
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


atexit.register(_unlink_pending)


def sweep_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove ``looc-<pid>-*`` segments whose creating process is gone; returns the removed paths."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if m and not pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except OSError:
                pass
    if removed:
        log.info("removed %d stale shared-memory segment(s) of dead runs from %s", len(removed), shm_dir)
    return removed


def _single(obj: Any) -> list[Any]:
    return [obj]


class NodeShared:
    """Shared segments among the ``local_world`` ranks of one machine.

    Args:
        token: the same string on every rank of the run (the strategy broadcasts one).
        local_rank, local_world: this rank's index on its machine, and the number of ranks there.
        exchange: an all-gather of a picklable object over *all* ranks (every rank calls each
            method of this class in the same order); the default suits a single process.
        node: this machine's index (so two "machines" on one host never share a name).
        shm_dir: where segments live (``/dev/shm``).
    """

    def __init__(self, token: str, local_rank: int, local_world: int, exchange: Callable[[Any], list[Any]] = _single,
                 node: int = 0, shm_dir: str = SHM_DIR):  # fmt: skip
        self.token, self.local_rank, self.local_world, self.node = str(token), int(local_rank), int(local_world), int(node)
        self.exchange = exchange
        self.shm_dir = shm_dir
        self._maps: list[mmap.mmap] = []
        self._fds: dict[str, tuple[int, int]] = {}  # key -> (open fd, bytes): lets helper processes attach
        if self.local_rank == 0:
            sweep_stale(shm_dir)

    def _path(self, key: str, creator_pid: int) -> str:
        return os.path.join(self.shm_dir, f"{PREFIX}{creator_pid}-{self.token}-n{self.node}-{key}")

    def _agree(self, err: str | None, what: str) -> None:
        errors = [e for e in self.exchange(err) if e]
        if errors:
            raise SharedMemoryError(f"{what} failed: " + "; ".join(dict.fromkeys(errors)))

    def buffer(self, key: str, nbytes: int, fill: Callable[[memoryview], None] | None = None) -> mmap.mmap:
        """One zero-initialised (or ``fill``-ed) segment of ``nbytes`` bytes, mapped on every local rank."""
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"a shared segment needs a positive size, got {nbytes}")
        err: str | None = None
        mm: mmap.mmap | None = None
        path = None
        exc: Exception | None = None
        if self.local_rank == 0:
            path = self._path(key, os.getpid())
            mm, err, exc = self._create(key, path, nbytes, fill)
        creators = self._share_creation(err, exc)
        if self.local_rank != 0:
            pid = next(c for (n, c, _) in creators if n == self.node and c is not None)
            path = self._path(key, pid)
            mm, err = self._attach(key, path, nbytes)
        try:
            self._agree(err, f"attaching shared segment {key!r}")
        finally:
            if self.local_rank == 0 and path is not None:
                self._unlink(path)  # every local rank maps it now (or the run is failing)
        assert mm is not None
        self._maps.append(mm)
        return mm

    def _create(
        self, key: str, path: str, nbytes: int, fill: Callable[[memoryview], None] | None
    ) -> tuple[mmap.mmap | None, str | None, Exception | None]:
        """Create, reserve, map and fill the segment at ``path`` (local rank 0); returns ``(map, error, exception)``.

        A failure is returned rather than raised, so that every rank can learn of it first; the partial
        segment is removed then.
        """
        mm: mmap.mmap | None = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            with _pending_lock:
                _pending.add(path)
            mm = self._reserve_and_map(fd, path, nbytes)
            self._fds[key] = (fd, nbytes)
            if fill is not None:
                fill(memoryview(mm))
            return mm, None, None
        except Exception as e:  # reported to every rank by the caller; this rank re-raises it as it is
            err = f"node {self.node} creating {key!r}: {e}"
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # the failed fill's traceback still views it: unmapped when that goes
                    pass
            fd_size = self._fds.pop(key, None)
            if fd_size is not None:
                os.close(fd_size[0])
            self._unlink(path)
            return None, err, e

    def _reserve_and_map(self, fd: int, path: str, nbytes: int) -> mmap.mmap:
        """Reserve ``nbytes`` for the new segment open as ``fd`` and map them; ``fd`` is closed on failure."""
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)  # reserve now: a full tmpfs fails here, not with SIGBUS later
            except OSError as e:
                free = shutil.disk_usage(self.shm_dir).free
                raise SharedMemoryError(
                    f"{path}: cannot reserve {nbytes:,} bytes of shared memory ({e.strerror}; "
                    f"{free:,} bytes free in {self.shm_dir}); enlarge {self.shm_dir} (for containers: "
                    "--shm-size) or lower the budgets"
                ) from None
            return mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise

    def _share_creation(self, err: str | None, exc: Exception | None) -> list[tuple[int, int | None, str | None]]:
        """Tell every rank which process created this node's segment, and whether it worked.

        Returns the ``(node, creator pid, error)`` of every rank; raises on every rank if a creation failed
        (the creating rank its own exception, as it is).
        """
        creator = os.getpid() if self.local_rank == 0 else None
        creators = self.exchange((self.node, creator, err))
        errs = [e for (_, _, e) in creators if e]
        if exc is not None:
            raise exc
        if errs:
            raise SharedMemoryError("creating shared memory failed: " + "; ".join(dict.fromkeys(errs)))
        return creators

    def _attach(self, key: str, path: str, nbytes: int) -> tuple[mmap.mmap | None, str | None]:
        """Map the segment another local rank created at ``path``; returns ``(map, error)``."""
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, nbytes)
            except BaseException:
                os.close(fd)
                raise
            self._fds[key] = (fd, nbytes)
            return mm, None
        except (OSError, ValueError) as e:
            return None, f"attaching {path}: {e}"

    def array(self, key: str, shape: tuple[int, ...], dtype: Any, fill: Callable[[np.ndarray], Any] | None = None,
              writeable: bool = False) -> np.ndarray:  # fmt: skip
        """A NumPy array in a node-local segment; ``fill(out)`` runs on the creating rank only."""
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)

        def _fill(view: memoryview) -> None:
            if fill is not None:
                fill(np.frombuffer(view, dtype=dtype, count=int(np.prod(shape, dtype=np.int64))).reshape(shape))

        mm = self.buffer(key, nbytes, _fill)
        out = np.frombuffer(mm, dtype=dtype, count=int(np.prod(shape, dtype=np.int64))).reshape(shape)
        if not writeable:
            out.flags.writeable = False
        return out

    def handles(self) -> dict[str, tuple[str, int]]:
        """``{key: (path, bytes)}`` through which a child of this process can map the same segments."""
        return {k: (f"/proc/{os.getpid()}/fd/{fd}", n) for k, (fd, n) in self._fds.items()}

    def _unlink(self, path: str | None) -> None:
        if path is None:
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        with _pending_lock:
            _pending.discard(path)

    def segments(self) -> list[str]:
        """Segments of this run still present in ``/dev/shm`` (empty once set-up is over)."""
        try:
            names = os.listdir(self.shm_dir)
        except OSError:
            return []
        return sorted(n for n in names if n.startswith(PREFIX) and f"-{self.token}-n{self.node}-" in n)

    def close(self) -> None:
        """Drop this rank's mappings (the memory goes when the last rank drops its own)."""
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # an array still views it: the mapping goes with that array
                pass
        self._maps.clear()
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
        _unlink_pending()


class AttachedShared:
    """The segments of a :class:`NodeShared` as seen from a helper process (same ``array``/``buffer`` API).

    Built from :meth:`NodeShared.handles` of the parent process; it creates nothing.
    """

    def __init__(self, handles: dict[str, tuple[str, int]], local_rank: int = 0, local_world: int = 1):
        self._handles = dict(handles)
        self.local_rank, self.local_world = int(local_rank), int(local_world)
        self._maps: list[mmap.mmap] = []

    def buffer(self, key: str, nbytes: int, fill: Callable[[memoryview], None] | None = None) -> mmap.mmap:
        if key not in self._handles:
            raise SharedMemoryError(f"no shared segment {key!r} was handed to this process")
        path, size = self._handles[key]
        if size < int(nbytes):
            raise SharedMemoryError(f"shared segment {key!r} holds {size} bytes, {nbytes} were asked for")
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._maps.append(mm)
        return mm

    def array(self, key: str, shape: tuple[int, ...], dtype: Any, fill: Callable[[np.ndarray], Any] | None = None,
              writeable: bool = False) -> np.ndarray:  # fmt: skip
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        out = np.frombuffer(self.buffer(key, count * dtype.itemsize), dtype=dtype, count=count).reshape(shape)
        if not writeable:
            out.flags.writeable = False
        return out

    def close(self) -> None:
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass
        self._maps.clear()
