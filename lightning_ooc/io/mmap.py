"""The ``mmap`` backend: NumPy memmap fancy indexing, through the page cache.

This is what "PyG with memory-mapped features" amounts to, kept as the
baseline that benchmarks compare with and as the last resort when the native
module is missing. It behaves like a native engine that finishes every job
before ``submit`` returns.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np

from lightning_ooc.io.io_errors import FeatureReadError

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MmapJob:
    """A finished gather, with the same surface as ``lightning_ooc._io.Job``."""

    def __init__(self, ids: np.ndarray, row_bytes: int, num_chunks: int, seconds: float, offset: int = 0):
        self._ids = ids
        self._row_bytes = row_bytes
        self._offset = offset
        self.num_chunks = num_chunks
        self.chunks_done = num_chunks
        self.done = True
        self._seconds = seconds

    def wait(self, chunk: int = -1, timeout: float = -1.0) -> bool:
        return True

    def stats(self) -> dict:
        # distinct rows, and the distinct pages they span (what page faults must bring in at least)
        rows = np.unique(self._ids)
        rb = self._row_bytes
        first, last = (self._offset + rows * rb) // PAGE, (self._offset + rows * rb + rb - 1) // PAGE
        spans = last - first + 1
        # every page of every row: first page + 0, 1, ..., span - 1
        starts = np.repeat(np.cumsum(spans) - spans, spans)
        pages = np.unique(np.repeat(first, spans) + (np.arange(int(spans.sum())) - starts)).size
        return {
            "rows": int(self._ids.size),
            "unique_rows": int(rows.size),
            "bytes_requested": int(rows.size) * rb,
            "bytes_read": int(pages) * PAGE,
            "num_ios": int(pages),
            "seconds": self._seconds,
        }


class MmapRows:
    """Rows of a raw feature file by NumPy memmap indexing."""

    engine = "numpy memmap"
    direct = False
    block_size = 1
    block_source = "page cache"

    def __init__(self, path: Path, row_bytes: int, num_rows: int, num_features: int, numpy_dtype: np.dtype,
                 offset: int = 0, name: str | os.PathLike | None = None):  # fmt: skip
        self.path = path
        self.name = path if name is None else name  # what errors call the file
        self.row_bytes = row_bytes
        self.offset = offset
        self.num_rows = num_rows
        # our own descriptor, to notice a file that shrank before touching it (a fault past EOF is SIGBUS)
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._mm = (
                np.memmap(path, dtype=numpy_dtype, mode="r", offset=offset, shape=(num_rows, num_features))
                if num_rows else None
            )
        except BaseException:
            os.close(self._fd)
            raise
        self.closed = False

    def submit(self, ids: np.ndarray, out: np.ndarray, chunk_rows: int, now) -> MmapJob:
        t0 = now()
        n = ids.size
        if n:
            bad = np.flatnonzero((ids < 0) | (ids >= self.num_rows))
            if bad.size:
                raise IndexError(int(bad[0]), int(ids[bad[0]]))
            size = os.fstat(self._fd).st_size
            top = int(ids.max())
            if self.offset + (top + 1) * self.row_bytes > size:
                first = int(ids[np.flatnonzero(self.offset + (ids + 1) * self.row_bytes > size)[0]])
                off = self.offset + first * self.row_bytes
                raise FeatureReadError(
                    errno.EIO,
                    f"short read: row {first} at offset {off} lies beyond the end of the file ({size} bytes), "
                    "so it is shorter than its metadata says (truncated or replaced while open?)",
                    self.name,
                    offset=off,
                    length=self.row_bytes,
                )
            np.take(self._mm, ids, axis=0, out=out)
        chunks = -(-n // chunk_rows) if chunk_rows > 0 and n else (1 if n else 0)
        return MmapJob(ids, self.row_bytes, chunks, now() - t0, self.offset)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._mm = None
            os.close(self._fd)
