"""The feature reader: rows of a raw row-major file, by id, with direct I/O.

:class:`FeatureReader` turns each row into the aligned extents that cover it,
drops duplicate ids, merges neighbouring extents of the sorted batch into
larger reads (up to ``max_io`` bytes, across gaps of at most ``merge_gap``
bytes), keeps up to ``queue_depth`` reads in flight on the reader's own
threads (the GIL is free meanwhile) and copies each row to its place in the
destination. :meth:`FeatureReader.gather_async` returns a
:class:`GatherHandle` that reports the destination chunk by chunk, so copies
to a device can start before the whole batch is read.
"""
from __future__ import annotations

import errno
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from lightning_ooc.data.in_place import recorded_path
from lightning_ooc.errors import CorruptDatasetError, DatasetNotFoundError, InputError
from lightning_ooc.io import backends as _backends
from lightning_ooc.io.buffers import Destination, as_ids, destination, resolve_dtype
from lightning_ooc.io.io_errors import BackendUnavailableError, FeatureReadError, ReaderClosedError
from lightning_ooc.io.mmap import MmapRows
from lightning_ooc.io.stats import ReadStats

if TYPE_CHECKING:  # pragma: no cover
    from lightning_ooc.data.dataset import OnDiskDataset

DEFAULT_QUEUE_DEPTH = 128
DEFAULT_MAX_IO = 128 * 1024
#: Waits are sliced so that Ctrl-C reaches the main thread while a read is in flight.
_WAIT_SLICE = 0.2


class FeatureReader:
    """Read rows ``ids`` of a raw row-major feature file (no header, no padding).

    Args:
        path: the feature file (``features.bin`` of a dataset).
        num_features: values per row.
        dtype: torch or NumPy dtype (or its name) of the values; bfloat16 is
            held as uint16 on the NumPy side.
        backend: ``"auto"`` (default), ``"uring"``, ``"pread"``,
            ``"buffered"`` or ``"mmap"``; see :mod:`lightning_ooc.io.backends`.
            An explicit backend that cannot work raises
            :class:`~lightning_ooc.io.BackendUnavailableError`.
        queue_depth: reads kept in flight (io_uring entries, or pread threads).
        num_rows: rows the file must hold (from the dataset metadata); by
            default the file size divided by the row size.
        max_io: largest merged read in bytes.
        merge_gap: extents separated by at most this many bytes are read as
            one (the gap is read and thrown away); 0 merges only touching or
            overlapping extents, which keeps read amplification minimal.
        workers: reader threads, each with its own ring (or pread pool);
            concurrent gathers are served by different workers.
        offset: file offset of row 0, for rows that follow a header (a
            ``.npy`` file's, e.g.); it need not be aligned: each row's read is
            the aligned extent around it, as for any row.
        name: what errors call the file (default: ``path``, or for a file a dataset
            uses in place, opened through its held descriptor ``/proc/PID/fd/N``,
            the path recorded at import: see
            :func:`~lightning_ooc.data.in_place.recorded_path`).

    Rows are returned bit-identical to ``numpy.memmap`` indexing whatever the
    backend. ``gather`` / ``gather_async`` may be called from several threads.

    Example::

        >>> import os, tempfile, numpy as np, torch
        >>> from lightning_ooc.io import FeatureReader
        >>> path = os.path.join(tempfile.mkdtemp(), "features.bin")
        >>> np.arange(30, dtype=np.float32).reshape(10, 3).tofile(path)
        >>> with FeatureReader(path, 3, torch.float32) as reader:
        ...     rows = reader.gather([7, 2, 7])
        ...     stats = reader.last_stats
        >>> rows
        tensor([[21., 22., 23.],
                [ 6.,  7.,  8.],
                [21., 22., 23.]])
        >>> stats.rows, stats.unique_rows
        (3, 2)
    """

    def __init__(
        self,
        path: str | os.PathLike,
        num_features: int,
        dtype: Any,
        backend: str = "auto",
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        *,
        num_rows: int | None = None,
        max_io: int = DEFAULT_MAX_IO,
        merge_gap: int = 0,
        workers: int = 1,
        offset: int = 0,
        name: str | os.PathLike | None = None,
    ):
        self.path = Path(path)
        #: the file as errors name it (:attr:`path` is what is opened)
        self.name = Path(name) if name is not None else recorded_path(self.path)
        if int(offset) < 0:
            raise InputError(f"offset must be >= 0, got {offset}")
        self.offset = int(offset)
        self._engine: Any = None
        self.dtype_name, self.dtype, self.numpy_dtype = resolve_dtype(dtype)
        if int(num_features) < 1:
            raise InputError(f"num_features must be >= 1, got {num_features}")
        self.num_features = int(num_features)
        self.row_bytes = self.num_features * self.numpy_dtype.itemsize
        if not 1 <= int(queue_depth) <= 4096:
            raise InputError(f"queue_depth must be in 1..4096, got {queue_depth}")
        self.queue_depth = int(queue_depth)
        if int(max_io) < 0 or int(merge_gap) < 0 or int(workers) < 1:
            raise InputError(f"max_io and merge_gap must be >= 0 and workers >= 1 (got {max_io}, {merge_gap}, {workers})")
        self.num_rows = self._check_size(num_rows)
        if backend not in ("auto", *_backends.BACKENDS):
            raise InputError(f"unknown backend {backend!r}; use 'auto' or one of {', '.join(_backends.BACKENDS)}")
        if backend == "auto":
            self.backend, self.backend_reason = _backends.choose_backend(self.path)
        else:
            self.backend, self.backend_reason = backend, "asked for explicitly"
        self._engine = self._open_engine(int(max_io), int(merge_gap), int(workers))
        self._closed = False
        self._last: GatherHandle | None = None
        self._pid = os.getpid()  # the reader's threads do not survive a fork

    @classmethod
    def from_dataset(cls, ds: "OnDiskDataset", **kw: Any) -> "FeatureReader":
        """A reader of a dataset's features (``num_rows`` checked against its metadata).

        >>> import tempfile, lightning_ooc
        >>> from lightning_ooc.data.synth import synthesize
        >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=100, avg_degree=3, num_features=8,
        ...                   num_classes=2, progress=False)
        >>> ds = lightning_ooc.open_dataset(root)
        >>> with FeatureReader.from_dataset(ds) as r:
        ...     bool((r.gather([5, 1]) == ds.read_features([5, 1])).all())
        True
        """
        kw.setdefault("offset", getattr(ds, "features_offset", 0))
        return cls(ds.features_path, ds.num_features, ds.feature_dtype, num_rows=ds.num_nodes, **kw)

    # -- opening ------------------------------------------------------------------------
    def _check_size(self, num_rows: int | None) -> int:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            raise DatasetNotFoundError(
                f"{self.name}: no such feature file; check the path, or create the dataset with "
                "`lightning-ooc synth` / `lightning-ooc prepare`",
                self.name,
            ) from None
        what = f"{self.num_features} x {self.dtype_name}"
        if size < self.offset:
            raise CorruptDatasetError(f"{self.name}: {size} bytes, shorter than the offset {self.offset} of its first "
                                      "row (truncated?)", self.name)  # fmt: skip
        size -= self.offset
        if num_rows is None:
            if size % self.row_bytes:
                raise CorruptDatasetError(
                    f"{self.name}: {size} bytes is not a whole number of {self.row_bytes}-byte rows ({what}); "
                    "check num_features and dtype, or the file is truncated",
                    self.name,
                )
            return size // self.row_bytes
        num_rows = int(num_rows)
        if num_rows < 0:
            raise InputError(f"num_rows must be >= 0, got {num_rows}")
        if size < num_rows * self.row_bytes:
            at = f" after offset {self.offset}" if self.offset else ""
            raise CorruptDatasetError(
                f"{self.name}: {size} bytes{at} but {num_rows} rows x {self.row_bytes} bytes ({what}) = "
                f"{num_rows * self.row_bytes}: the file is shorter than its metadata says (truncated?); "
                "rebuild it with `lightning-ooc synth` / `lightning-ooc prepare`, or restore it from a copy",
                self.name,
            )
        return num_rows

    def _open_engine(self, max_io: int, merge_gap: int, workers: int) -> Any:
        if self.backend == "mmap":
            return MmapRows(self.path, self.row_bytes, self.num_rows, self.num_features, self.numpy_dtype, self.offset,
                            name=self.name)  # fmt: skip
        mod = _backends.native()
        if mod is None:
            raise BackendUnavailableError(f"backend {self.backend!r}: {_backends._import_io()[1]}")
        uring_ok, uring_why = _backends.uring_status()
        if self.backend == "uring":
            if not uring_ok:
                raise BackendUnavailableError(
                    f"{self.name}: backend 'uring' is unavailable: {uring_why}; use backend='auto' or 'pread'"
                )
            engine, direct = "uring", True
        elif self.backend == "pread":
            engine, direct = "threads", True
        else:  # buffered
            engine, direct = ("uring" if uring_ok else "threads"), False
        try:
            return mod.Reader(
                os.fspath(self.path), self.row_bytes, self.num_rows, engine, direct, self.queue_depth, max_io,
                merge_gap, workers, self.offset,
            )
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                raise BackendUnavailableError(
                    f"{self.name}: the file system refuses O_DIRECT ({e.strerror}); use backend='auto' or 'buffered'"
                ) from None
            raise BackendUnavailableError(
                f"{self.name}: backend {self.backend!r} could not start: {e.strerror}"
                + ("; use backend='auto' or 'pread'" if engine == "uring" else "")
            ) from None

    # -- reading --------------------------------------------------------------------------
    def gather(self, ids: Any, out: torch.Tensor | np.ndarray | None = None) -> torch.Tensor:
        """Rows ``ids[i]`` into ``out[i]``; returns the filled rows as a tensor.

        ``ids``: a 1-D integer sequence, array or tensor (duplicates and any
        order allowed). ``out``: ``None`` (a new tensor), or a C-contiguous
        CPU tensor (pinned or not) or NumPy array of shape ``(>= len(ids),
        num_features)`` and the reader's dtype; the result then shares its
        memory. Raises :class:`~lightning_ooc.errors.InputError` for bad ids
        or destination and :class:`~lightning_ooc.io.FeatureReadError` when a
        read fails; nothing partial is ever returned.
        """
        return self._submit(as_ids(ids), out, None, pin_memory=False).wait()

    def gather_async(
        self, ids: Any, out: torch.Tensor | np.ndarray | None = None, *, chunk_rows: int | None = None,
        pin_memory: bool = False,
    ) -> "GatherHandle":
        """Start a gather and return at once; see :class:`GatherHandle`.

        With ``chunk_rows`` the output is reported in chunks of that many rows,
        in order: chunk ``k`` holds rows ``[k * chunk_rows, (k + 1) * chunk_rows)``
        and its reads are issued before those of later chunks. Each distinct
        id is read once, by the first chunk that needs it. The ids are copied;
        ``out`` must not be touched until the handle is done. ``pin_memory``
        pins the tensor allocated when ``out`` is None.
        """
        if chunk_rows is not None and int(chunk_rows) < 1:
            raise InputError(f"chunk_rows must be >= 1, got {chunk_rows}")
        return self._submit(as_ids(ids, copy=True), out, chunk_rows, pin_memory=pin_memory)

    def _submit(self, ids: np.ndarray, out: Any, chunk_rows: int | None, *, pin_memory: bool) -> "GatherHandle":
        self._check_open()
        n = int(ids.size)
        dest = destination(out, n, self.num_features, self.dtype, self.numpy_dtype, self.name, pin_memory=pin_memory)
        cr = int(chunk_rows) if chunk_rows else 0
        try:
            if isinstance(self._engine, MmapRows):
                job = self._engine.submit(ids, dest.numpy(), cr, time.perf_counter)
            else:
                job = self._engine.submit(ids, ids.ctypes.data, n, dest.keep, dest.address, dest.nbytes, cr)
        except IndexError as e:
            pos, value = e.args
            raise InputError(
                f"{self.name}: id {value} at position {pos} is out of range: the file holds {self.num_rows} rows, "
                f"so ids must lie in 0..{self.num_rows - 1}"
            ) from None
        except ValueError as e:
            if self._engine.closed:
                raise ReaderClosedError(f"{self.name}: the reader is closed; open a new FeatureReader") from None
            raise InputError(f"{self.name}: {e}") from None
        return GatherHandle(self, job, dest, n, cr or max(n, 1))

    # -- errors, state --------------------------------------------------------------------
    def _translate(self, e: Exception) -> Exception:
        """A native ``ReadError(kind, errno, offset, length, got, message)`` as one of our exceptions."""
        mod = _backends.native()
        kind, err, offset, length, _got, message = e.args
        if kind == mod.ERR_CLOSED:
            return ReaderClosedError(f"{self.name}: {message}; open a new FeatureReader")
        if kind == mod.ERR_NOMEM:
            return MemoryError(f"{self.name}: {message}; gather fewer ids per call")
        fix = {
            mod.ERR_SHORT: "check the file against its dataset (`lightning-ooc verify`), rebuild or restore it",
            mod.ERR_IO: "the device reported an error: check the disk (dmesg) and retry",
            mod.ERR_RING: "close this reader and open a new one, or use backend='pread'",
        }.get(kind, "retry, or use another backend")
        return FeatureReadError(err, f"{message}; {fix}", self.name, offset=offset, length=length)

    def _check_open(self) -> None:
        if self._closed:
            raise ReaderClosedError(f"{self.name}: the reader is closed; open a new FeatureReader")
        if os.getpid() != self._pid:
            raise ReaderClosedError(
                f"{self.name}: this FeatureReader was opened in process {self._pid} and its reader threads do not "
                "exist in this forked process; open a FeatureReader in each process (e.g. in worker_init_fn)"
            )

    @property
    def last_stats(self) -> ReadStats | None:
        """Counters of the most recent gather that completed (from any thread), or None."""
        last = self._last
        return last.stats if last is not None else None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def block_size(self) -> int:
        """Alignment of file offsets and lengths of reads (1 for buffered / mmap)."""
        return int(self._engine.block_size)

    @property
    def info(self) -> dict[str, Any]:
        """How the reader reads: backend and why, engine, alignment and its source, limits."""
        e = self._engine
        d: dict[str, Any] = {
            "path": os.fspath(self.path),
            "backend": self.backend,
            "reason": self.backend_reason,
            "engine": e.engine,
            "direct": bool(e.direct),
            "block_size": int(e.block_size),
            "block_source": e.block_source,
            "row_bytes": self.row_bytes,
            "offset": self.offset,
            "num_rows": self.num_rows,
            "queue_depth": self.queue_depth,
        }
        if not isinstance(e, MmapRows):
            d.update(
                max_io=int(e.max_io), merge_gap=int(e.merge_gap), workers=int(e.workers),
                registered_files=bool(e.registered_files), registered_buffers=bool(e.registered_buffers),
                engine_note=e.engine_note,
            )
        return d

    def close(self) -> None:
        """Finish reads in flight, release the file, rings and threads. Idempotent."""
        if self._engine is not None and not self._closed:
            self._closed = True
            self._engine.close()

    def __enter__(self) -> "FeatureReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if getattr(self, "_closed", True) else self.backend
        return (f"FeatureReader('{self.name}', num_features={self.num_features}, dtype={self.dtype_name}, "
                f"num_rows={self.num_rows}, backend={state})")


class GatherHandle:
    """A gather in flight, from :meth:`FeatureReader.gather_async`.

    :meth:`wait` returns the whole result; :meth:`chunks` yields
    ``(start, stop, rows)`` for each chunk of the destination as soon as it
    and all chunks before it are complete, so a host-to-device copy of one
    chunk overlaps the reads of the next. If a read fails, the call waiting
    for an unfinished chunk raises; chunks reported before stay valid.

    Example::

        >>> import os, tempfile, numpy as np, torch
        >>> from lightning_ooc.io import FeatureReader
        >>> path = os.path.join(tempfile.mkdtemp(), "features.bin")
        >>> np.arange(400, dtype=np.float32).reshape(100, 4).tofile(path)
        >>> with FeatureReader(path, 4, torch.float32) as reader:
        ...     handle = reader.gather_async(torch.arange(99, -1, -1), chunk_rows=40)
        ...     spans = [(lo, hi, float(rows[0, 0])) for lo, hi, rows in handle.chunks()]
        ...     full = handle.wait()
        >>> spans
        [(0, 40, 396.0), (40, 80, 236.0), (80, 100, 76.0)]
        >>> handle.stats.rows, full.shape
        (100, torch.Size([100, 4]))
    """

    def __init__(self, reader: FeatureReader, job: Any, dest: Destination, n: int, chunk_rows: int):
        self._reader = reader
        self._job = job
        self._dest = dest
        self.rows = n
        self.chunk_rows = chunk_rows
        self.num_chunks = math.ceil(n / chunk_rows) if n else 0
        self._stats: ReadStats | None = None

    @property
    def out(self) -> torch.Tensor:
        """The destination rows (complete only once :meth:`wait` has returned)."""
        return self._dest.tensor

    def chunk_range(self, k: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of chunk ``k``."""
        if not 0 <= k < self.num_chunks:
            raise IndexError(f"chunk {k} out of range (0..{self.num_chunks - 1})")
        return k * self.chunk_rows, min(self.rows, (k + 1) * self.chunk_rows)

    def done(self) -> bool:
        """Whether the gather has ended (successfully or not); never blocks."""
        return bool(self._job.done)

    @property
    def chunks_done(self) -> int:
        """Number of leading chunks that are complete."""
        return int(self._job.chunks_done)

    def _wait(self, chunk: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        mod = _backends.native()
        while True:
            step = _WAIT_SLICE if deadline is None else max(0.0, min(_WAIT_SLICE, deadline - time.monotonic()))
            try:
                ok = self._job.wait(chunk, step)
            except Exception as e:
                if mod is not None and isinstance(e, mod.ReadError):
                    raise self._reader._translate(e) from None
                raise
            if ok:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self._reader.name}: gather of {self.rows} rows not done after {timeout} s")

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until every row is in place and return them; raise if any read failed."""
        self._wait(-1, timeout)
        self._reader._last = self
        return self._dest.tensor

    def wait_chunk(self, k: int, timeout: float | None = None) -> torch.Tensor:
        """Block until chunk ``k`` (and every chunk before it) is complete; return its rows."""
        lo, hi = self.chunk_range(k)
        self._wait(k, timeout)
        return self._dest.tensor[lo:hi]

    def chunks(self, timeout: float | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yield ``(start, stop, rows)`` per chunk, in order, as each completes."""
        for k in range(self.num_chunks):
            rows = self.wait_chunk(k, timeout)
            lo, hi = self.chunk_range(k)
            yield lo, hi, rows
        if self.num_chunks:
            self.wait(timeout)

    @property
    def stats(self) -> ReadStats:
        """Counters of this gather (waits for it to end)."""
        if self._stats is None:
            self._wait(-1, None)
            self._stats = ReadStats.from_job_stats(self._reader.backend, self._job.stats())
        return self._stats
