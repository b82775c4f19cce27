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
import json
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from lightning_ooc.data.format import (
    FILES,
    FORMAT_NAME,
    FORMAT_VERSION,
    META_FILE,
    META_PENDING,
    OPTIONAL_FILES,
    TABLE_ENTRY_RE,
    TABLE_FORMAT_NAME,
    TABLE_FORMAT_VERSION,
    TABLE_LOCK_FILE,
    meta_digest,
)
from lightning_ooc.data.link_splits import LINK_FILE_NAMES
from lightning_ooc.errors import DatasetWriteError
from lightning_ooc.utils.proc import pid_alive

log = logging.getLogger("lightning_ooc")

#: The names a dataset directory of ours may hold.
#: a part of a partitioned dataset (``lightning-ooc partition``) holds two files more
PARTITION_FILE_NAMES = frozenset({"nodes.npy", "owner.npy"})
DATASET_ENTRIES = (frozenset(FILES.values()) | frozenset(OPTIONAL_FILES.values()) | LINK_FILE_NAMES
                   | PARTITION_FILE_NAMES | {META_FILE, META_PENDING})  # fmt: skip
_TYPE = r"[A-Za-z0-9][A-Za-z0-9_-]*"
#: a heterogeneous dataset's files: a node type's (``paper.features.bin``...) and a relation's CSC
#: (``author__writes__paper.indptr.npy``)
HETERO_ENTRY_RE = re.compile(
    rf"^(?:{_TYPE}\.(?:{'|'.join(re.escape(n) for n in (*FILES.values(), *OPTIONAL_FILES.values()))})"
    rf"|{_TYPE}__{_TYPE}__{_TYPE}\.(?:indptr|indices)\.npy)$"
)


def _owned(name: str) -> bool:
    """A name a dataset or embedding table directory of ours holds.

    >>> [_owned(n) for n in ("indptr.npy", "paper.features.bin", "author__writes__paper.indices.npy", "notes.txt")]
    [True, True, True, False]
    """
    return name in DATASET_ENTRIES or bool(TABLE_ENTRY_RE.match(name)) or bool(HETERO_ENTRY_RE.match(name))

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


#: ``PID-TOKEN``: the suffix this release gives partial and backup directories.
_SUFFIX = re.compile(r"(\d+)-[0-9a-f]{8}")
#: ``TOKEN``: the suffix older releases gave backups.
_LEGACY_SUFFIX = re.compile(r"[0-9a-f]{8}")


def _leftovers(target: Path, kind: str) -> list[tuple[Path, int | None]]:
    """Real directories named ``.NAME.KIND-PID-TOKEN`` (or, for backups, ``.NAME.old-TOKEN``) beside ``target``.

    Each comes with the pid in its name (None for the older form). Anything else that
    merely starts with the prefix -- a user's ``.NAME.old-keep``, a link -- is not ours.
    """
    prefix = _sibling(target, kind)
    out = []
    for p in target.parent.glob(prefix + "*"):
        suffix = p.name[len(prefix):]
        m = _SUFFIX.fullmatch(suffix)
        if m is None and not (kind == "old" and _LEGACY_SUFFIX.fullmatch(suffix)):
            continue
        try:
            if not stat.S_ISDIR(os.lstat(p).st_mode):
                continue
        except FileNotFoundError:  # removed meanwhile
            continue
        out.append((p, int(m.group(1)) if m else None))
    return out


def _mtime(p: Path) -> float:
    try:
        return os.lstat(p).st_mtime
    except FileNotFoundError:
        return 0.0


def backups(target: str | os.PathLike) -> list[tuple[Path, int | None]]:
    """Backups of ``target`` that a replacement moved aside, with their writer's pid (oldest first)."""
    target = Path(target).absolute()
    return sorted(_leftovers(target, "old"), key=lambda b: _mtime(b[0]))


# -- one writer per target ----------------------------------------------------------
#: the first line of every lock file this package creates; a file without it is never written to or removed
LOCK_MARK = b"lightning_ooc lock\n"
#: a lock file an earlier release wrote: its holder's pid alone
_LEGACY_LOCK = re.compile(rb"\d+\n")


def _lock_text() -> bytes:
    return LOCK_MARK + f"pid {os.getpid()}\n".encode()


def _holder(fd: int) -> str:
    """The pid a lock file of ours names (``unknown`` where it names none)."""
    text = os.pread(fd, 256, 0)
    if _LEGACY_LOCK.fullmatch(text):
        return text.decode().strip()
    if text.startswith(LOCK_MARK):
        for line in text[len(LOCK_MARK):].decode(errors="replace").splitlines():
            if line.startswith("pid "):
                return line[4:].strip() or "unknown"
    return "unknown"


def marked_lock(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a lock file a :class:`LockFile` made: a regular file that starts with :data:`LOCK_MARK`
    (opened without following a link or blocking on a FIFO).

    >>> import tempfile
    >>> marked_lock(tempfile.mkdtemp())
    False
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, len(LOCK_MARK), 0) == LOCK_MARK
    finally:
        os.close(fd)


class LockFile:
    """An exclusive, non-blocking ``flock`` on a file this package created and marked as its own.

    A lock file is made whole before it appears: written and locked under a private name
    (``NAME.PID-TOKEN``), then hard-linked to ``path`` (which fails if anything is there), so no other process
    ever sees it empty or unlocked; on a filesystem without hard links it is created at ``path`` exclusively and
    locked and marked at once. A file already at ``path`` is used only if it carries :data:`LOCK_MARK` (one left
    by a killed holder: the kernel dropped its ``flock``), or is a lock an earlier release wrote (its holder's
    pid alone); anything else there (a user's file, a link, a directory) is refused, never truncated, written or
    removed. :meth:`release` removes the file only when it is still the one locked, and private names that
    killed holders left are removed by the next one.

    Example::

        >>> import tempfile
        >>> from pathlib import Path
        >>> from lightning_ooc.errors import DatasetError
        >>> p = Path(tempfile.mkdtemp()) / ".g.lock"
        >>> held = LockFile(p).acquire(lambda pid: DatasetError(f"held by pid {pid}"))
        >>> LockFile(p).acquire(lambda pid: DatasetError(f"held by pid {pid}"))
        Traceback (most recent call last):
        ...
        lightning_ooc.errors.DatasetError: held by pid ...
        >>> held.release(); p.exists()
        False
        >>> _ = p.write_text("my notes")
        >>> LockFile(p).acquire(lambda pid: DatasetError("held"))
        Traceback (most recent call last):
        ...
        lightning_ooc.errors.DatasetWriteError: ...: is in the way of the writer's lock ...
        >>> p.read_text()
        'my notes'
    """

    #: errors of ``link(2)`` on a filesystem that has no hard links (vfat, exFAT, some FUSE and SMB mounts)
    NO_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK})

    def __init__(self, path: str | os.PathLike, *, remove: bool = True):
        self.path = Path(path)
        #: remove the file at :meth:`release` (a lock beside its target); False keeps it (a table's own lock)
        self.remove = remove
        self.fd: int | None = None
        self._private = re.compile(rf"^{re.escape(self.path.name)}\.(\d+)-[0-9a-f]{{8}}$")

    def _cannot(self, e: OSError) -> DatasetWriteError:
        return DatasetWriteError(f"{self.path}: cannot create the writer's lock file ({e.strerror}); check the "
                                 "directory's permissions, or write elsewhere")  # fmt: skip

    def _in_the_way(self, what: str) -> DatasetWriteError:
        return DatasetWriteError(
            f"{self.path}: is in the way of the writer's lock ({what}, not a lock this package made); it was "
            "left as it is: move or remove it yourself, or write elsewhere"
        )

    def _sweep(self) -> None:
        """Remove the private names of holders killed before they linked them (empty or marked, pid gone)."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self.path.parent):
                m = self._private.match(name)
                if m is None or pid_alive(int(m.group(1))):
                    continue
                p = self.path.parent / name
                with contextlib.suppress(OSError):
                    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                    try:
                        ours = stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, len(LOCK_MARK), 0) in (b"",
                                                                                                          LOCK_MARK)
                    finally:
                        os.close(fd)
                    if ours:
                        os.unlink(p)

    def _create(self) -> int | None:
        """A new lock file at the path, locked and marked (its descriptor), or None if something is there."""
        self._sweep()
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise self._cannot(e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows the name: never blocks
            os.pwrite(fd, _lock_text(), 0)
            os.link(tmp, self.path)
            return fd
        except FileExistsError:
            os.close(fd)
            return None
        except OSError as e:
            os.close(fd)
            if e.errno in self.NO_LINKS:
                return self._create_in_place()
            raise self._cannot(e) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _create_in_place(self) -> int | None:
        """:meth:`_create` where the filesystem has no hard links: an exclusive create at the path, locked and
        marked at once (None if something is there)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return None
        except OSError as e:
            raise self._cannot(e) from None
        try:
            for _ in range(100):  # another process may hold it for an instant, to find it not yet marked
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.01)
            else:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.pwrite(fd, _lock_text(), 0)
        except OSError as e:
            os.close(fd)
            raise self._cannot(e) from None
        return fd

    def acquire(self, busy: Callable[[str], BaseException]) -> "LockFile":
        """Take the lock, or raise ``busy(pid of the holder)`` when another process holds it."""
        while True:
            fd = self._create()
            if fd is not None:
                self.fd = fd
                return self
            try:  # something is at the path: a lock of ours (held, or left by a killed holder), or not ours
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:  # its holder released it meanwhile
                continue
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise self._in_the_way("a symbolic link") from None
                raise self._cannot(e) from None
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                os.close(fd)
                raise self._in_the_way("a directory" if stat.S_ISDIR(mode) else "not a regular file")
            try:  # held first: a lock being made where there are no hard links is held before it is marked
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise busy(holder) from None
            # the holder before us may have removed the file after we opened it: lock the file at the path
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            head = os.pread(fd, 256, 0)
            if not (head.startswith(LOCK_MARK) or _LEGACY_LOCK.fullmatch(head)):
                os.close(fd)
                raise self._in_the_way("a file without the lock's mark")
            self._stamp(fd)
            self.fd = fd
            return self

    def _stamp(self, fd: int) -> None:
        """Write this holder's mark and pid into the lock file held as ``fd`` (ours: for messages only)."""
        with contextlib.suppress(OSError):
            wfd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if os.path.samestat(os.fstat(wfd), os.fstat(fd)):
                    text = _lock_text()
                    os.pwrite(wfd, text, 0)
                    os.ftruncate(wfd, len(text))
            finally:
                os.close(wfd)

    def release(self) -> None:
        if self.fd is None:
            return
        if self.remove:
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(self.fd), os.stat(self.path, follow_symlinks=False)):
                    os.unlink(self.path)  # while still locked, so a waiter re-checks the path and starts afresh
        os.close(self.fd)
        self.fd = None


class TargetLock:
    """An exclusive, non-blocking lock on writing ``target`` (``.NAME.lock`` beside it, a :class:`LockFile`).

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
        self._file = LockFile(self.target.parent / f".{self.target.name}.lock")
        self.path = self._file.path

    def acquire(self) -> "TargetLock":
        self._file.acquire(lambda holder: DatasetWriteError(
            f"{self.target}: another writer (pid {holder}) is writing it; wait for it to finish, or choose "
            "another --out"
        ))  # fmt: skip
        return self

    def release(self) -> None:
        self._file.release()

    def __enter__(self) -> "TargetLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# -- what may be replaced -----------------------------------------------------------
def _foreign_entries(path: Path) -> list[str]:
    """Entries of directory ``path`` that a dataset of ours does not hold (directories end in ``/``)."""
    foreign = []
    for name in sorted(os.listdir(path)):
        try:
            mode = os.lstat(path / name).st_mode
        except FileNotFoundError:
            continue
        if not _owned(name) or not stat.S_ISREG(mode):
            foreign.append(name + ("/" if stat.S_ISDIR(mode) else ""))
    return foreign


def check_replaceable(target: Path) -> None:
    """Raise unless ``target`` is missing, an empty directory, or a dataset directory of ours."""
    if not os.path.lexists(target):
        return
    fix = "remove or rename it yourself, or choose another --out"
    if os.path.islink(target):
        raise DatasetWriteError(f"{target}: is a symbolic link; --overwrite replaces only a dataset directory; {fix}")
    if not target.is_dir():
        raise DatasetWriteError(f"{target}: is a file, not a dataset directory; --overwrite will not delete it; {fix}")
    entries = os.listdir(target)
    if not entries:
        return
    if META_FILE not in entries and META_PENDING not in entries:
        raise DatasetWriteError(
            f"{target}: is not a lightning_ooc dataset (it has no {META_FILE}); --overwrite replaces only a dataset "
            f"or an empty directory, so nothing was touched; {fix}"
        )
    foreign = _foreign_entries(target)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise DatasetWriteError(
            f"{target}: holds {shown}, which a lightning_ooc dataset does not; --overwrite would delete them, so "
            f"nothing was touched; move them out of the directory, or choose another --out"
        )
    # the names are ours; the metadata must be too (a user's own meta.json is not a dataset of ours)
    why = _parse_ours(target / (META_FILE if META_FILE in entries else META_PENDING))
    if why is not None:
        raise DatasetWriteError(
            f"{target}: is not a lightning_ooc dataset or embedding table ({why}); --overwrite replaces only "
            f"those or an empty directory, so nothing was touched; {fix}"
        )


class TableLock:
    """The writer's lock of an embedding table: ``flock`` on its ``state.lock``, one writer at a time (the kernel
    releases it when the holder dies). A training run holds it while the table is open for writing; a writer
    replacing the table (``--overwrite``) holds it until the new table is in place.

    Example::

        >>> import tempfile
        >>> from pathlib import Path
        >>> from lightning_ooc.errors import DatasetError
        >>> t = Path(tempfile.mkdtemp())
        >>> held = TableLock(t).acquire(lambda pid: DatasetError(f"held by pid {pid}"))
        >>> TableLock(t).acquire(lambda pid: DatasetError(f"held by pid {pid}"))
        Traceback (most recent call last):
        ...
        lightning_ooc.errors.DatasetError: held by pid ...
        >>> held.release()
    """

    def __init__(self, root: Path):
        self._file = LockFile(Path(root) / TABLE_LOCK_FILE, remove=False)
        self.path = self._file.path

    @property
    def fd(self) -> int | None:
        return self._file.fd

    def acquire(self, refused: Callable[[str], BaseException]) -> "TableLock":
        """Take it, or raise ``refused(pid of the holder)``. The file is created if no run ever opened the table
        for writing (it stays: it is harmless), so that none can while the lock is held."""
        self._file.acquire(refused)
        return self

    def release(self) -> None:
        self._file.release()  # the lock goes with the descriptor; the file stays


def hold_table(target: Path) -> TableLock | None:
    """Take the writer's lock of the embedding table at ``target``, if it is one.

    Returns the held :class:`TableLock` (release it once the table is replaced or the write abandoned), or
    None when ``target`` is no table. A table a run holds open for writing is refused with the run's pid:
    replacing it under the run would have the run write its partitions into the new table.
    """
    if not os.path.isfile(target / "state.json"):  # a table's state file; a dataset has none
        return None
    return TableLock(target).acquire(lambda holder: DatasetWriteError(
        f"{target}: the embedding table is open for writing by pid {holder} (a training run); --overwrite "
        "would pull it from under that run, so nothing was touched; stop the run first, or choose another --out"
    ))  # fmt: skip


def _parse_ours(path: Path) -> str | None:
    """Why ``path`` (a ``meta.json``) is not the metadata of a dataset or table of ours; None when it is.

    Ours means: a JSON object naming one of our formats, with a valid ``meta_checksum``, or (datasets
    written before checksums, format version 1) none and that known version.
    """


    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"its {path.name} cannot be read as JSON ({e.__class__.__name__})"
    if not isinstance(meta, dict):
        return f"its {path.name} is not a JSON object"
    fmt, version = meta.get("format"), meta.get("version")
    known = {FORMAT_NAME: range(1, FORMAT_VERSION + 1), TABLE_FORMAT_NAME: range(1, TABLE_FORMAT_VERSION + 1)}
    if fmt not in known:
        return f"its {path.name} names no format of ours (format {fmt!r})"
    if not isinstance(version, int) or version not in known[fmt]:
        return f"its {path.name} has a version this release does not know ({version!r})"
    if "meta_checksum" in meta:
        if meta["meta_checksum"] != meta_digest(meta):
            return f"its {path.name} does not match its own checksum (edited or damaged)"
    elif not (fmt == FORMAT_NAME and version == 1):  # only version-1 datasets were written without one
        return f"its {path.name} has no checksum"
    return None


def remove_dataset(path: Path) -> bool:
    """Delete a dataset directory of ours (its dataset files, then the directory).

    Anything else found in it (put there after it was checked) is kept, with a warning,
    and the directory with it. Returns whether the directory is gone.
    """
    try:
        listed = os.listdir(path)
    except FileNotFoundError:
        return True
    patterned = {n for n in listed if TABLE_ENTRY_RE.match(n) or HETERO_ENTRY_RE.match(n)}
    for name in sorted(DATASET_ENTRIES | patterned):
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            if stat.S_ISREG(os.lstat(path / name).st_mode):
                os.unlink(path / name)
    try:
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        log.warning("%s: kept, because it holds %s, which no dataset writer put there", path,
                    ", ".join(_foreign_entries(path)[:5]))  # fmt: skip
        return False


def _complete(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / META_FILE).is_file()


def _ours(path: Path) -> bool:
    """A directory holding a dataset of ours and nothing else."""
    return _complete(path) and not _foreign_entries(path)


# -- leftovers of interrupted writers -----------------------------------------------------
def recover(target: Path) -> str | None:
    """Put back or remove what killed writers of ``target`` left; call it holding the :class:`TargetLock`.

    Holding the lock means no writer of this release is working on ``target``: every backup
    named by this release is stale, whatever process now has the pid in its name. Partial
    directories are removed when their process is gone (or is this one), since a writer of
    an older release, which took no lock, may still be filling one. Returns the name of a
    backup put back at ``target``, if one was.
    """
    for p, pid in _leftovers(target, "partial"):
        if pid is not None and (pid == os.getpid() or not pid_alive(pid)):
            log.info("removing %s left by an interrupted run", p)
            shutil.rmtree(p, ignore_errors=True)
    stale = [p for p, _ in backups(target) if _ours(p)]
    restored = None
    if stale and not os.path.lexists(target):
        keep = stale.pop()  # the newest
        os.rename(keep, target)
        fsync_dir(target.parent)
        restored = keep.name
        log.warning("%s: restored the dataset that an interrupted --overwrite had moved to %s", target, keep.name)
    for p in stale:
        if _complete(target):
            log.info("removing %s, the dataset an interrupted --overwrite had already replaced", p)
            remove_dataset(p)
        else:
            log.warning("%s: kept %s (a dataset moved aside by an interrupted --overwrite); inspect it and "
                        "remove or restore it yourself", target, p.name)  # fmt: skip
    return restored


# -- the commit -----------------------------------------------------------------------
def write_json_last(directory: Path, name: str, obj: Any, pending: str | None = None) -> None:
    """Write ``obj`` as JSON to ``directory/name`` the way the file that completes an output is written: to
    ``pending`` (``name.pending`` by default) first, fsync'd, renamed into place, the directory fsync'd.

    >>> import tempfile, json
    >>> d = Path(tempfile.mkdtemp())
    >>> write_json_last(d, "meta.json", {"a": 1})
    >>> json.loads((d / "meta.json").read_text()), sorted(p.name for p in d.iterdir())
    ({'a': 1}, ['meta.json'])
    """
    tmp = directory / (pending or f"{name}.pending")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, directory / name)
    fsync_dir(directory)


_warned_no_exchange = False


def put_in_place(tmp: Path, target: Path, overwrite: bool, *, check: Callable[[Path], None] | None = None,
                 what: str = "dataset", writing: str = "this dataset was being written") -> Path | None:
    """Rename the finished directory ``tmp`` to ``target``.

    Returns the directory now holding the replaced dataset (to be removed by
    the caller), or None when there was none. Raises :class:`DatasetWriteError`
    if ``target`` appeared and ``overwrite`` is off, or is not replaceable
    (``check``, :func:`check_replaceable` by default; ``what`` and ``writing``
    word the messages for another kind of output, such as a partition output).
    """
    global _warned_no_exchange
    exists = os.path.lexists(target)
    if exists and not overwrite:
        raise DatasetWriteError(
            f"{target}: appeared while {writing}; it was left as it is and the new {what} "
            "was discarded; pass --overwrite to replace it, or choose another --out"
        )
    if exists:
        (check or check_replaceable)(target)
    try:
        renameat2(tmp, target, _RENAME_EXCHANGE if exists else _RENAME_NOREPLACE)
        return tmp if exists else None
    except OSError as e:
        if e.errno == errno.EEXIST:  # a target appeared between the check above and the rename
            raise DatasetWriteError(f"{target}: appeared while committing; it was left as it is and the new {what} "
                                    "was discarded; choose another --out") from None  # fmt: skip
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
    try:
        os.rename(tmp, target)
    except OSError as e:
        if backup is not None:
            os.rename(backup, target)  # put the old dataset back before reporting
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise DatasetWriteError(f"{target}: appeared while committing; it was left as it is and the new dataset "
                                    "was discarded; choose another --out") from None  # fmt: skip
        raise
    return backup


class Deferred:
    """The signals held by :func:`deferred_signals`.

    ``received`` lists their numbers; ``handlers`` maps each held signal to the handler it had.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self.handlers: dict[int, Any] = {}

    def interrupts(self) -> int | None:
        """The first held signal whose handler would have raised ``KeyboardInterrupt`` or ended the program
        by an exception (``signal.default_int_handler``, or a handler marked ``interrupts_writers``)."""
        for s in self.received:
            h = self.handlers.get(s)
            if h is signal.default_int_handler or getattr(h, "interrupts_writers", False):
                return s
        return None

    def redeliver(self) -> None:
        """Send again the held signals whose handler is another one (the default action, a user's handler)."""
        for s in dict.fromkeys(self.received):
            h = self.handlers.get(s)
            if not (h is signal.default_int_handler or getattr(h, "interrupts_writers", False)):
                signal.raise_signal(s)


@contextlib.contextmanager
def deferred_signals(what: str, signals=(signal.SIGINT, signal.SIGTERM)) -> Iterator[Deferred]:
    """Hold SIGINT/SIGTERM until the block ends (main thread only; elsewhere a no-op).

    Ignored signals stay ignored; a handler installed outside Python (``getsignal()`` is
    None) cannot be put back, so that signal is left alone. What a held signal means once
    the block is done is the caller's decision: see :meth:`Deferred.interrupts` and
    :meth:`Deferred.redeliver`.
    """
    d = Deferred()
    if threading.current_thread() is not threading.main_thread():
        yield d
        return

    def hold(signum, frame):
        if not d.received:
            log.warning("%s received while %s; finishing that first", signal.Signals(signum).name, what)
        d.received.append(signum)

    for s in signals:
        h = signal.getsignal(s)
        if h is not None and h is not signal.SIG_IGN:
            d.handlers[s] = h
            signal.signal(s, hold)
    try:
        yield d
    finally:
        for s, h in d.handlers.items():
            signal.signal(s, h)
