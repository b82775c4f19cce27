"""The staging buffer: bounded, page-aligned host memory that direct-I/O reads land in.

Rows read from SSD go to a staging chunk, then are copied into their slots of
the feature buffer (an asynchronous host-to-device copy on a side CUDA stream
when the buffer is on a GPU). The memory comes from an anonymous ``mmap`` (so
it is page-aligned) and is pinned with ``cudaHostRegister`` when CUDA is
available, so copies from it are true DMA. Its size is fixed: extractors take
chunks from a free list and block while none is free.

Example::

    >>> import torch
    >>> from lightning_ooc.store.staging import StagingBuffer
    >>> st = StagingBuffer(nbytes=1 << 16, num_features=4, dtype=torch.float32, chunk_rows=512)
    >>> st.num_chunks, st.chunk_rows, st.pinned == torch.cuda.is_available()  # pinned where CUDA is
    (8, 512, True)
    >>> chunk = st.acquire()
    >>> chunk.rows.shape, chunk.rows.data_ptr() % 4096
    (torch.Size([512, 4]), 0)
    >>> st.release(chunk); st.close()
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ooc.store.pinning import host_register, host_unregister
from lightning_ooc.utils.cancel import NEVER, CancelToken

log = logging.getLogger("lightning_ooc")


@dataclass
class StagingChunk:
    index: int
    rows: torch.Tensor  # (chunk_rows, num_features) view into the staging memory


class StagingBuffer:
    """At most ``nbytes`` of page-aligned host memory cut into page-aligned chunks of ``chunk_rows`` rows."""

    def __init__(self, nbytes: int, num_features: int, dtype: torch.dtype, chunk_rows: int = 4096, pin: bool | None = None,
                 memory=None):  # fmt: skip
        self.chunk_rows, self.stride, self.num_chunks, size = self.layout(nbytes, num_features, dtype, chunk_rows)
        if memory is None:
            self._mm = mmap.mmap(-1, size)
            memory = self._mm
        else:  # this rank's portion of a segment shared by the ranks of a machine (page-aligned)
            self._mm = None
            have = memoryview(memory).nbytes
            if have < size:
                raise ValueError(f"staging memory of {have} bytes is smaller than {size}")
        self._flat = torch.frombuffer(memory, dtype=torch.uint8, count=size)
        self._dtype, self._f = dtype, num_features
        self.memory = self._flat
        self.nbytes = size
        self.pinned = False
        if pin is None:
            pin = torch.cuda.is_available()
        if pin:
            self.pinned = host_register(self.memory.data_ptr(), size, "staging buffer")
        self._free = list(range(self.num_chunks))
        self._pending: list[tuple[int, Any]] = []  # released chunks whose last copies may still be running
        self._cond = threading.Condition()

    @staticmethod
    def layout(nbytes: int, num_features: int, dtype: torch.dtype, chunk_rows: int = 4096) -> tuple[int, int, int, int]:
        """``(chunk_rows, stride, num_chunks, total bytes)`` of a staging buffer of at most ``nbytes``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        row_bytes = num_features * itemsize
        page = mmap.PAGESIZE
        if int(nbytes) < row_bytes:
            raise ValueError(f"a staging buffer of {nbytes} bytes cannot hold one row of {row_bytes} bytes")
        rows = max(1, min(int(chunk_rows), int(nbytes) // row_bytes))
        stride = (rows * row_bytes + page - 1) // page * page  # every chunk starts on a page boundary
        num = max(1, int(nbytes) // stride)
        return rows, stride, num, num * stride

    def acquire(self, timeout: float | None = None, cancel: CancelToken = NEVER) -> StagingChunk:
        """Take a free chunk (blocks while all are in use; ``cancel`` ends the wait with ``Cancelled``).

        A chunk released with a fence is handed out again only once the fence completed: when
        no other chunk is free, the caller waits on the oldest such fence (never the trainer).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._reclaim()
                if self._free:
                    break
                if self._pending:
                    index, fence = self._pending.pop(0)
                    self._cond.release()
                    try:
                        fence.wait()  # the copies out of that chunk finish; nothing else waits on them
                    finally:
                        self._cond.acquire()
                    self._free.append(index)
                    continue
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no free staging chunk within {timeout} s")
                cancel.wait(self._cond)
            i = self._free.pop()
        raw = self._flat[i * self.stride : i * self.stride + self.chunk_rows * self._f * self._dtype.itemsize]
        return StagingChunk(i, raw.view(self._dtype).view(self.chunk_rows, self._f))

    def release(self, chunk: StagingChunk, fence: Any = None) -> None:
        """Give ``chunk`` back; with a ``fence`` (copies out of it still queued) it is reused only after it."""
        with self._cond:
            if fence is None:
                self._free.append(chunk.index)
            else:
                self._pending.append((chunk.index, fence))
            self._cond.notify()

    def _reclaim(self) -> None:
        """Chunks whose fence completed become free (called holding the lock)."""
        if self._pending:
            still = []
            for index, fence in self._pending:
                if fence.done():
                    self._free.append(index)
                else:
                    still.append((index, fence))
            self._pending = still

    def close(self) -> None:
        with self._cond:
            pending, self._pending = self._pending, []
        for _, fence in pending:  # copies out of the memory must end before it is unpinned and unmapped
            fence.wait()
        if self.pinned:
            host_unregister(self.memory.data_ptr())
            self.pinned = False
        self.memory = self._flat = None  # type: ignore[assignment]
        try:
            if self._mm is not None:
                self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes when it does
            pass
