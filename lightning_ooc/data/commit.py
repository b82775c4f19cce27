"""Putting a finished dataset directory in place without losing the one it replaces.

A writer builds its dataset in ``.NAME.partial-PID-TOKEN`` beside the target
(see :mod:`lightning_ooc.data.writer`). This module holds the steps around
that directory:

* :class:`TargetLock`: one writer per target at a time. The lock is
  ``.NAME.lock`` beside the target (``flock``, released by the kernel when
  the process dies, removed on release); a second writer is refused at once
  with the first one's pid.
* :func:`check_replaceable`: ``overwrite`` replaces only an empty directory
  or a dataset of ours (a directory holding nothing but dataset files). A
  user's directory, a file or a symbolic link is refused, never deleted.
* :func:`recover`: run by each writer under the lock. A backup
  (``.NAME.old-PID-TOKEN``) left by a replacement that was killed halfway is
  put back when the target is missing and removed once the target is a
  complete dataset; partial directories of dead writers are removed.
* :func:`put_in_place`: the commit. A new target is renamed in with
  ``RENAME_NOREPLACE``; an existing one is swapped with ``RENAME_EXCHANGE``,
  so the path holds the old dataset or the new one at every instant. Where the
  filesystem has no ``renameat2`` the old dataset is moved to a backup first
  (which :func:`recover` and :func:`backups` report and restore).
* :func:`deferred_signals`: SIGINT and SIGTERM that arrive inside the commit
  are held until it is finished, so the exit status and the message say what
  happened to the dataset.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import secrets
import shutil
import signal
import stat
import threading
from pathlib import Path
from typing import Iterator

from lightning_ooc.data.format import FILES, META_FILE, META_PENDING
from lightning_ooc.errors import DatasetWriteError
from lightning_ooc.utils.proc import pid_alive

log = logging.getLogger("lightning_ooc")

#: The names a dataset directory of ours may hold.
DATASET_ENTRIES = frozenset(FILES.values()) | {META_FILE, META_PENDING}

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def _libc_renameat2():
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # no glibc >= 2.28, or not Linux
        return None


_renameat2_fn = _libc_renameat2()


def renameat2(src: Path, dst: Path, flags: int) -> None:
    """``renameat2(2)``; raises ``OSError`` (``ENOSYS`` where the C library lacks it)."""
    if _renameat2_fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(src))
    if _renameat2_fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(src), None, str(dst))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sibling(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-"


def _leftovers(target: Path, kind: str) -> list[tuple[Path, int | None]]:
    """``.NAME.KIND-*`` beside ``target`` with the pid in their name (None for names without one)."""
    prefix = _sibling(target, kind)
    out = []
    for p in target.parent.glob(prefix + "*"):
        parts = p.name[len(prefix):].split("-")
        pid = int(parts[0]) if len(parts) == 2 and parts[0].isdigit() else None
        out.append((p, pid))
    return out


def backups(target: str | os.PathLike) -> list[Path]:
    """Backups of ``target`` that a replacement moved aside and has not removed (oldest first)."""
    target = Path(target).absolute()
    found = [p for p, _ in _leftovers(target, "old") if p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: p.stat().st_mtime)


# -- one writer per target ----------------------------------------------------------
class TargetLock:
    """An exclusive, non-blocking lock on writing ``target`` (``.NAME.lock`` beside it).

    Example::

        >>> import tempfile
        >>> from pathlib import Path
        >>> t = Path(tempfile.mkdtemp()) / "g"
        >>> with TargetLock(t):
        ...     TargetLock(t).acquire()
        Traceback (most recent call last):
        ...
        lightning_ooc.errors.DatasetWriteError: ...: another writer (pid ...) is writing it; ...
    """

    def __init__(self, target: Path):
        self.target = Path(target)
        self.path = self.target.parent / f".{self.target.name}.lock"
        self.fd: int | None = None

    def acquire(self) -> "TargetLock":
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise DatasetWriteError(
                    f"{self.path}: cannot open the writer's lock file ({e.strerror}); remove it if it is not a "
                    "regular file, or write elsewhere with --out"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                finally:
                    os.close(fd)
                raise DatasetWriteError(
                    f"{self.target}: another writer (pid {holder}) is writing it; wait for it to finish, or "
                    "choose another --out"
                ) from None
            # The holder before us may have removed the file after we opened it: lock the file at the path.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                with contextlib.suppress(OSError):  # the pid is for messages only; a full disk may refuse it
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self.fd = fd
                return self
            os.close(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # while still locked, so a waiter re-checks the path and starts afresh
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "TargetLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# -- what may be replaced -----------------------------------------------------------
def check_replaceable(target: Path) -> None:
    """Raise unless ``target`` is missing, an empty directory, or a dataset directory of ours."""
    if not os.path.lexists(target):
        return
    fix = "remove or rename it yourself, or choose another --out"
    if os.path.islink(target):
        raise DatasetWriteError(f"{target}: is a symbolic link; --overwrite replaces only a dataset directory; {fix}")
    if not target.is_dir():
        raise DatasetWriteError(f"{target}: is a file, not a dataset directory; --overwrite will not delete it; {fix}")
    entries = sorted(os.listdir(target))
    if not entries:
        return
    if META_FILE not in entries and META_PENDING not in entries:
        raise DatasetWriteError(
            f"{target}: is not a lightning_ooc dataset (it has no {META_FILE}); --overwrite replaces only a dataset "
            f"or an empty directory, so nothing was touched; {fix}"
        )
    foreign = []
    for name in entries:
        st = os.lstat(target / name)
        if name not in DATASET_ENTRIES or not stat.S_ISREG(st.st_mode):
            foreign.append(name + ("/" if stat.S_ISDIR(st.st_mode) else ""))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise DatasetWriteError(
            f"{target}: holds {shown}, which a lightning_ooc dataset does not; --overwrite would delete them, so "
            f"nothing was touched; move them out of the directory, or choose another --out"
        )


def _complete(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / META_FILE).is_file()


# -- leftovers of interrupted writers -----------------------------------------------------
def recover(target: Path) -> None:
    """Put back or remove what killed writers of ``target`` left (call it holding the :class:`TargetLock`)."""
    for p, pid in _leftovers(target, "partial"):
        if pid is not None and not pid_alive(pid):
            log.info("removing %s left by an interrupted run", p)
            shutil.rmtree(p, ignore_errors=True)
    stale = [p for p, pid in _leftovers(target, "old") if pid is None or not pid_alive(pid)]
    if not stale:
        return
    stale.sort(key=lambda p: p.stat().st_mtime)
    if not os.path.lexists(target):
        keep = next((p for p in reversed(stale) if _complete(p)), None)
        if keep is not None:
            os.rename(keep, target)
            fsync_dir(target.parent)
            log.warning("%s: restored the dataset that an interrupted --overwrite had moved to %s", target, keep.name)
            stale.remove(keep)
    if _complete(target):
        for p in stale:
            log.info("removing %s, the dataset an interrupted --overwrite had already replaced", p)
            shutil.rmtree(p, ignore_errors=True)
    else:
        for p in stale:
            log.warning("%s: kept %s (a dataset moved aside by an interrupted --overwrite); inspect it and "
                        "remove or restore it yourself", target, p.name)  # fmt: skip


# -- the commit -----------------------------------------------------------------------
_warned_no_exchange = False


def put_in_place(tmp: Path, target: Path, overwrite: bool) -> Path | None:
    """Rename the finished directory ``tmp`` to ``target``.

    Returns the directory now holding the replaced dataset (to be removed by
    the caller), or None when there was none. Raises :class:`DatasetWriteError`
    if ``target`` appeared and ``overwrite`` is off, or is not replaceable.
    """
    global _warned_no_exchange
    exists = os.path.lexists(target)
    if exists and not overwrite:
        raise DatasetWriteError(
            f"{target}: appeared while this dataset was being written; it was left as it is and the new dataset "
            "was discarded; pass --overwrite to replace it, or choose another --out"
        )
    if exists:
        check_replaceable(target)
    try:
        renameat2(tmp, target, _RENAME_EXCHANGE if exists else _RENAME_NOREPLACE)
        return tmp if exists else None
    except OSError as e:
        if e.errno == errno.EEXIST:
            raise DatasetWriteError(f"{target}: appeared while committing; it was left as it is; choose another "
                                    "--out or pass --overwrite") from None  # fmt: skip
        if e.errno not in _UNSUPPORTED:
            raise
    if not _warned_no_exchange:
        log.info("%s: the filesystem has no atomic rename exchange; replacing through a backup directory",
                 target.parent)  # fmt: skip
        _warned_no_exchange = True
    backup = None
    if exists:
        backup = target.parent / f"{_sibling(target, 'old')}{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(target, backup)
    os.rename(tmp, target)
    return backup


class Deferred:
    """The signals held by :func:`deferred_signals` (``received`` lists their numbers)."""

    def __init__(self) -> None:
        self.received: list[int] = []


@contextlib.contextmanager
def deferred_signals(what: str, signals=(signal.SIGINT, signal.SIGTERM)) -> Iterator[Deferred]:
    """Hold SIGINT/SIGTERM until the block ends (main thread only; elsewhere a no-op).

    The caller decides what a held signal means once the block is done; see
    :class:`lightning_ooc.errors.InterruptedAfterCommit`.
    """
    d = Deferred()
    if threading.current_thread() is not threading.main_thread():
        yield d
        return

    def hold(signum, frame):
        if not d.received:
            log.warning("%s received while %s; finishing that first", signal.Signals(signum).name, what)
        d.received.append(signum)

    # A handler installed outside Python (getsignal() is None) cannot be put back, so it is left alone.
    previous = {s: signal.signal(s, hold) for s in signals if signal.getsignal(s) is not None}
    try:
        yield d
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
