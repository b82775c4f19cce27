"""Whole files read and written in large aligned ranges with direct I/O.

Trainable embedding tables live on SSD in partition files of hundreds of MB;
a partition is read whole into page-aligned host memory and written back
from it. :class:`BulkFile` moves such ranges with ``O_DIRECT`` through one
io_uring per call (``lightning_ooc._io.transfer``): the range is cut into
``chunk``-byte requests, ``queue_depth`` of them in flight, straight between
the file and the caller's memory (no staging copy), with the GIL released.

========== ====================================================================
backend    how ranges move
========== ====================================================================
uring      io_uring with ``O_DIRECT`` (the real path)
pread      ``O_DIRECT`` ``pread`` / ``pwrite`` from a few native threads
buffered   through the page cache (``O_DIRECT`` refused, or a memory file system)
========== ====================================================================

``auto`` takes the first that works on the file, chosen and logged once
(logger ``"lightning_ooc"``) as :mod:`lightning_ooc.io.backends` does for
the feature reader; ``LIGHTNING_OOC_DISABLE_IO_URING=1`` counts io_uring as
unavailable. With ``O_DIRECT`` offsets, lengths and memory addresses must be
multiples of :attr:`BulkFile.align`; :func:`aligned_empty` gives memory that
is, and :func:`round_up` sizes.

Example::

    >>> import os, tempfile, torch
    >>> from lightning_ooc.io.bulk import BulkFile, aligned_empty
    >>> path = os.path.join(tempfile.mkdtemp(), "part-0.bin")
    >>> src = aligned_empty(3 << 20)
    >>> _ = src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8))
    >>> with BulkFile(path, "w", size=src.numel()) as f:  # reserves the space first
    ...     f.write_from(0, src)
    ...     f.sync()
    3145728
    >>> dst = aligned_empty(1 << 20)
    >>> with BulkFile(path) as f:
    ...     f.read_into(2 << 20, dst)
    1048576
    >>> bool((dst == src[2 << 20:]).all())
    True
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import operator
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_ooc.data.in_place import recorded_path
from lightning_ooc.errors import InputError
from lightning_ooc.io import backends as _backends
from lightning_ooc.io.io_errors import BackendUnavailableError, FeatureReadError, FeatureWriteError, ReaderClosedError

#: Alignment of :func:`aligned_empty` memory and the default of :func:`round_up`: a page, which
#: meets every direct-I/O requirement of the file systems in use (512 or 4096 bytes).
PAGE = 4096
DEFAULT_QUEUE_DEPTH = 32
DEFAULT_CHUNK = 1 << 20
MAX_CHUNK = 1 << 30  # one request's length must fit an io_uring SQE
BULK_BACKENDS = ("uring", "pread", "buffered")
MODES = ("r", "r+", "w")


def round_up(n: int, align: int = PAGE) -> int:
    """``n`` rounded up to a multiple of ``align``.

    >>> round_up(1), round_up(4096), round_up(5000, 512), round_up(0)
    (4096, 4096, 5120, 0)
    """
    n, align = operator.index(n), operator.index(align)
    if align < 1 or n < 0:
        raise InputError(f"round_up needs n >= 0 and align >= 1, got n={n}, align={align}")
    return -(-n // align) * align


def aligned_empty(nbytes: int, hugepages: bool = False) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``round_up(nbytes, 4096)`` bytes on page-aligned memory.

    The memory is an anonymous mapping that lives as long as the tensor (or
    any view of it) does, so it suits ``O_DIRECT`` transfers of any file.
    ``hugepages`` asks for transparent huge pages (``MADV_HUGEPAGE``) where the
    kernel has them: buffers that direct I/O moves gigabytes through then have
    far fewer pages to pin per transfer.

    >>> t = aligned_empty(5000)
    >>> t.numel(), t.data_ptr() % 4096, t.dtype
    (8192, 0, torch.uint8)
    """
    nbytes = operator.index(nbytes)
    if nbytes < 0:
        raise InputError(f"aligned_empty needs nbytes >= 0, got {nbytes}")
    n = round_up(nbytes)
    # a private mapping starts on a page boundary; frombuffer keeps a reference to it (the tensor's
    # storage holds the mapping alive, and nothing else can close it since it is not handed out)
    buf = mmap.mmap(-1, max(n, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hugepages and n >= 4 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    t = torch.frombuffer(buf, dtype=torch.uint8)
    return t[:n] if n < t.numel() else t


def _memory(obj: Any, *, writable: bool, where: str) -> tuple[int, int, Any]:
    """``(address, nbytes, keep)`` of a C-contiguous CPU tensor, NumPy array or buffer (memoryview, bytearray,
    mmap). ``keep`` must stay referenced while the address is used: for a buffer it holds an export, so that a
    bytearray cannot be resized (and its memory moved) under a transfer."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise InputError(f"{where} is on {obj.device}; pass CPU memory (e.g. from aligned_empty) and copy it over")
        if not obj.is_contiguous():
            raise InputError(f"{where} is not contiguous; pass a contiguous tensor (e.g. from aligned_empty)")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InputError(f"{where} is not C-contiguous; pass a contiguous array")
        if writable and not obj.flags.writeable:
            raise InputError(f"{where} is read-only; pass writable memory")
        return obj.ctypes.data, obj.nbytes, obj
    try:
        mv = memoryview(obj)
    except TypeError:
        raise InputError(
            f"{where} is a {type(obj).__name__}; pass a CPU tensor, a NumPy array or a buffer (memoryview, "
            "bytearray, mmap), e.g. from aligned_empty"
        ) from None
    if not mv.c_contiguous:
        raise InputError(f"{where} is not C-contiguous; pass a contiguous buffer")
    if writable and mv.readonly:
        raise InputError(f"{where} is read-only; pass writable memory")
    if mv.nbytes == 0:
        return 0, 0, mv
    arr = np.frombuffer(mv.cast("B"), dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes, arr


class BulkFile:
    """A file read and written in large aligned ranges with direct I/O.

    Args:
        path: the file.
        mode: ``"r"`` opens an existing file for reading, ``"r+"`` for
            reading and writing; ``"w"`` creates a new file (an existing one
            is an error, never truncated) that can also be read.
        backend: ``"auto"`` (default), ``"uring"``, ``"pread"`` or
            ``"buffered"``; see the module docstring. An explicit backend that
            cannot work raises :class:`~lightning_ooc.io.BackendUnavailableError`.
        size: with ``mode="w"``, bytes to reserve (``posix_fallocate``) before
            anything is written, so a full disk is reported up front.
        queue_depth: requests in flight (io_uring entries, or threads up to 16).
        chunk: bytes per request (a multiple of :attr:`align`).

    :meth:`read_into` / :meth:`write_from` move exactly the bytes of the
    memory given, or raise :class:`~lightning_ooc.io.FeatureReadError` /
    :class:`~lightning_ooc.io.io_errors.FeatureWriteError` naming the file,
    errno and offset. Several threads may transfer at once (each call has its
    own ring); do not :meth:`close` while one runs.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        mode: str = "r",
        backend: str = "auto",
        *,
        size: int | None = None,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        chunk: int = DEFAULT_CHUNK,
    ):
        self.path = Path(path)
        #: the file as errors name it: the recorded path of a feature file used in place, opened through its
        #: held descriptor (:func:`~lightning_ooc.data.in_place.recorded_path`); else :attr:`path`
        self.name = recorded_path(self.path)
        self._fd = -1
        if mode not in MODES:
            raise InputError(f"{self.name}: mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        if backend not in ("auto", *BULK_BACKENDS):
            raise InputError(
                f"{self.name}: unknown backend {backend!r}; use 'auto' or one of {', '.join(BULK_BACKENDS)}"
            )
        if not 1 <= int(queue_depth) <= 4096:
            raise InputError(f"{self.name}: queue_depth must be in 1..4096, got {queue_depth}")
        if not 1 <= int(chunk) <= MAX_CHUNK:
            raise InputError(f"{self.name}: chunk must be in 1..{MAX_CHUNK} bytes, got {chunk}")
        if size is not None and (mode != "w" or int(size) < 0):
            raise InputError(f"{self.name}: size= reserves space for a new file: it needs mode='w' and size >= 0")
        self.mode = mode
        self.queue_depth = int(queue_depth)
        self.chunk = int(chunk)
        self._auto = backend == "auto"
        mod = _backends.native()
        if mod is None:
            raise BackendUnavailableError(f"{self.name}: {_backends._import_io()[1]}")
        created = False
        try:
            if mode == "w":
                try:
                    self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                except FileExistsError:
                    raise FeatureWriteError(
                        errno.EEXIST, "exists already; mode='w' creates a new file: remove it first, or open it "
                        "with mode='r+' to overwrite it in place", self.name,
                    ) from None
                created = True
                if size:
                    self._reserve(int(size))
            else:
                flags = os.O_RDONLY if mode == "r" else os.O_RDWR
                self._fd = os.open(self.path, flags | os.O_CLOEXEC)
            self._open_backend(mod, backend)
        except BaseException:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if created:  # leave nothing behind for a file this call made
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
            raise

    # -- opening ------------------------------------------------------------------------
    def _reserve(self, size: int) -> None:
        """Allocate ``size`` bytes, or raise a write error saying the disk is full and what to do."""
        # checked first: some file systems (ext4) allocate what they can before failing, which would
        # fill the disk for everyone until the file is removed; the blocks reserved for root are left
        # alone, as a training job should not take them
        free = self._free_bytes()
        if size > free:
            raise self._no_space(size, free)
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._no_space(size, self._free_bytes(), e.errno) from None
            raise FeatureWriteError(
                e.errno, f"cannot reserve {size} bytes: {e.strerror}", self.name, offset=0, length=size
            ) from None

    def _free_bytes(self) -> int:
        st = os.fstatvfs(self._fd)
        return st.f_bavail * st.f_frsize

    def _no_space(self, size: int, free: int, err: int = errno.ENOSPC) -> FeatureWriteError:
        what = "the disk quota leaves" if err == errno.EDQUOT else "the disk is full: its file system has"
        return FeatureWriteError(
            err, f"cannot reserve {size} bytes ({size / 2**20:.1f} MiB): {what} only {free} bytes "
            f"({free / 2**20:.1f} MiB) free; free space there, or write the file to another directory",
            self.name, offset=0, length=size,
        )  # fmt: skip

    def _open_backend(self, mod: Any, backend: str) -> None:
        uring_ok, uring_why = _backends.uring_status()
        if backend == "auto":
            backend, self.backend_reason = _backends.choose_backend(self.path, what="bulk file")
            if backend not in BULK_BACKENDS:
                raise BackendUnavailableError(
                    f"{self.name}: no direct or buffered backend works: {self.backend_reason}"
                )
        else:
            self.backend_reason = "asked for explicitly"
        if backend == "uring" and not uring_ok:
            raise BackendUnavailableError(
                f"{self.name}: backend 'uring' is unavailable: {uring_why}; use backend='auto' or 'pread'"
            )
        self.backend = backend
        self.direct = backend in ("uring", "pread")
        # buffered goes through io_uring too where it works, as the feature reader's buffered backend does
        self.engine = "uring" if backend == "uring" or (backend == "buffered" and uring_ok) else "threads"
        if self.direct:
            try:
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) | os.O_DIRECT)
            except OSError as e:
                raise BackendUnavailableError(
                    f"{self.name}: the file system refuses O_DIRECT ({e.strerror}); use backend='auto' or 'buffered'"
                ) from None
            if not mod.fd_is_direct(self._fd):
                raise BackendUnavailableError(
                    f"{self.name}: the file system ignores O_DIRECT; use backend='auto' or 'buffered'"
                )
            info = mod.probe(os.fspath(self.path))
            self.align = max(int(info["block_size"]), int(info["mem_align"]))
            self.align_source = str(info["block_source"])
            if self.chunk % self.align:
                raise InputError(
                    f"{self.name}: chunk={self.chunk} is not a multiple of {self.align} bytes, the direct-I/O "
                    f"alignment of this file ({self.align_source}); use e.g. chunk={round_up(self.chunk, self.align)}"
                )
        else:
            self.align, self.align_source = 1, "buffered I/O needs no alignment"

    # -- transfers ----------------------------------------------------------------------
    def read_into(self, offset: int, dest: Any) -> int:
        """Fill ``dest`` (all its bytes) from the file at ``offset``; return the bytes read.

        ``dest``: a C-contiguous CPU tensor, NumPy array or writable buffer.
        Raises :class:`~lightning_ooc.io.FeatureReadError` when the file ends
        before ``offset + len(dest)`` or the device fails, and
        :class:`~lightning_ooc.errors.InputError` for unaligned offset,
        length or memory on a direct file.
        """
        self._check_open()
        addr, nbytes, keep = _memory(dest, writable=True, where=f"{self.name}: destination")
        try:
            return self._transfer(False, offset, addr, nbytes, "destination")
        finally:
            del keep  # referenced until the transfer is over

    def write_from(self, offset: int, src: Any) -> int:
        """Write all bytes of ``src`` to the file at ``offset``; return the bytes written.

        ``src``: a C-contiguous CPU tensor, NumPy array or buffer. Raises
        :class:`~lightning_ooc.io.io_errors.FeatureWriteError` (a full disk says
        so), and :class:`~lightning_ooc.errors.InputError` as :meth:`read_into`.
        Call :meth:`sync` to make the bytes durable.
        """
        self._check_open()
        addr, nbytes, keep = _memory(src, writable=False, where=f"{self.name}: source")
        if self.mode == "r":
            raise FeatureWriteError(
                errno.EBADF, "opened with mode='r', for reading only; open it with mode='r+' to write", self.name,
                offset=operator.index(offset), length=nbytes,
            )  # fmt: skip
        try:
            return self._transfer(True, offset, addr, nbytes, "source")
        finally:
            del keep  # referenced until the transfer is over

    def _transfer(self, write: bool, offset: int, addr: int, nbytes: int, what: str) -> int:
        offset = operator.index(offset)
        if offset < 0:
            raise InputError(f"{self.name}: offset must be >= 0, got {offset}")
        if self.direct:
            a = self.align
            why = f"direct I/O on this file ({self.backend}) moves whole {a}-byte blocks ({self.align_source})"
            if offset % a:
                raise InputError(f"{self.name}: offset {offset} is not a multiple of {a}: {why}; "
                                 f"use an aligned offset, e.g. round_up(offset, {a})")  # fmt: skip
            if nbytes % a:
                raise InputError(f"{self.name}: the {what} holds {nbytes} bytes, not a multiple of {a}: {why}; "
                                 f"size it with round_up(n, {a}) (aligned_empty does)")  # fmt: skip
            if addr % a:
                raise InputError(f"{self.name}: the {what} memory at 0x{addr:x} is not aligned to {a} bytes: {why} "
                                 "to and from aligned memory; allocate it with aligned_empty()")  # fmt: skip
        if nbytes == 0:
            return 0
        mod = _backends.native()
        while True:
            try:
                return int(mod.transfer(self._fd, write, offset, addr, nbytes, engine=self.engine,
                                        queue_depth=self.queue_depth, chunk=self.chunk))  # fmt: skip
            except mod.ReadError as e:
                raise self._translate(e, write=False) from None
            except mod.WriteError as e:
                raise self._translate(e, write=True) from None
            except ValueError as e:
                raise InputError(f"{self.name}: {e}") from None
            except OSError as e:  # the engine could not start; nothing was moved
                self._engine_failed(e)

    def _engine_failed(self, e: OSError) -> None:
        """io_uring could not be set up for a transfer: fall back where that is allowed, else raise."""
        if self.engine != "uring" or (self.backend == "uring" and not self._auto):
            raise BackendUnavailableError(
                f"{self.name}: the {self.engine} engine could not start: {e.strerror}"
                + ("; use backend='auto' or 'pread'" if self.engine == "uring" else "")
            ) from None
        # the probe said io_uring works, yet no ring can be made now (e.g. memory limits): the real
        # path cannot work here, so go on with threads, and say so once
        fallback = "pread" if self.backend == "uring" else self.backend
        reason = f"io_uring could not start ({e.strerror}); falling back to native threads with pread / pwrite"
        _backends._log_once(fallback, f"ring set-up failed: {e.strerror}", reason, fallback=True, what="bulk file")
        self.backend, self.engine, self.backend_reason = fallback, "threads", reason

    def _translate(self, e: Exception, *, write: bool) -> Exception:
        """A native ``ReadError`` / ``WriteError(kind, errno, offset, length, got, message)`` as our exception."""
        mod = _backends.native()
        kind, err, offset, length, _got, message = e.args
        if kind == mod.ERR_NOMEM:
            return MemoryError(f"{self.name}: {message}")
        if write and err in (errno.ENOSPC, errno.EDQUOT):
            what = "the disk quota is exhausted" if err == errno.EDQUOT else "the disk is full"
            fix = (f"{what}: free space on the file system that holds this file, or write it elsewhere "
                   "(BulkFile(..., mode='w', size=...) reserves the space up front)")  # fmt: skip
        elif err == errno.EBADF:
            fix = "the file descriptor is not open for " + ("writing" if write else "reading")
        else:
            fix = {
                mod.ERR_SHORT: (f"the file holds {os.fstat(self._fd).st_size} bytes: check its size against "
                                "what was written") if not write else
                               "the device accepted nothing more: check free space and the disk (dmesg)",
                mod.ERR_IO: "the device reported an error: check the disk (dmesg) and retry",
                mod.ERR_RING: "close this file and open a new one, or use backend='pread'",
            }.get(kind, "retry, or use another backend")  # fmt: skip
        cls = FeatureWriteError if write else FeatureReadError
        return cls(err, f"{message}; {fix}", self.name, offset=offset, length=length)

    # -- state ----------------------------------------------------------------------------
    def sync(self) -> None:
        """Make the written bytes durable (``fdatasync``); a write-back error surfaces here."""
        self._check_open()
        try:
            os.fdatasync(self._fd)
        except OSError as e:
            raise FeatureWriteError(
                e.errno, f"fdatasync failed: {e.strerror}; bytes written may not be on the disk", self.name
            ) from None

    @property
    def size(self) -> int:
        """The file's size in bytes now."""
        self._check_open()
        return os.fstat(self._fd).st_size

    def fileno(self) -> int:
        self._check_open()
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def _check_open(self) -> None:
        if self._fd < 0:
            raise ReaderClosedError(f"{self.name}: the BulkFile is closed; open a new one")

    def close(self) -> None:
        """Close the file (without syncing: call :meth:`sync` first for durability). Idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> "BulkFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            self.close()

    def __repr__(self) -> str:
        if self.closed:
            state = "closed"
        else:
            state = f"backend={getattr(self, 'backend', '?')}, align={getattr(self, 'align', '?')}"
        return f"BulkFile('{self.name}', mode={getattr(self, 'mode', '?')!r}, {state})"
