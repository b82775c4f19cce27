"""The tiers of the storage hierarchy, each behind :class:`~lightning_ooc.store.tier.FeatureTier`.

* :class:`HostCacheTier` -- the hottest rows, fixed at setup, in (pinned) host memory.
* :class:`BufferTier` -- the feature buffer (device memory; host memory on CPU): slots of
  recently used rows, filled on a miss from its ``source``.
* :class:`ReaderTier` -- the staging buffer and the direct-I/O reader: every row, from SSD.

Example::

    >>> import tempfile, torch, lightning_ooc
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.io import FeatureReader
    >>> from lightning_ooc.store.feature_buffer import FeatureBuffer
    >>> from lightning_ooc.store.staging import StagingBuffer
    >>> from lightning_ooc.store.tiers import BufferTier, ReaderTier
    >>> ds = lightning_ooc.open_dataset(synthesize(tempfile.mkdtemp() + "/g", num_nodes=100, avg_degree=4,
    ...                                            num_features=8, num_classes=2, progress=False))
    >>> disk = ReaderTier(FeatureReader.from_dataset(ds), StagingBuffer(4096, 8, ds.feature_dtype))
    >>> buffer = BufferTier(FeatureBuffer(16, ds.num_nodes, 8, ds.feature_dtype), source=disk)
    >>> lease = buffer.claim(torch.tensor([5, 9]))
    >>> buffer.fill(lease)
    >>> bool((buffer.rows(lease, torch.device("cpu")) == ds.read_features(torch.tensor([5, 9]))).all())
    True
    >>> buffer.release(lease); buffer.close(); disk.close()
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from lightning_ooc.store.feature_buffer import FeatureBuffer
from lightning_ooc.store.host_cache import HostCache
from lightning_ooc.store.staging import StagingBuffer
from lightning_ooc.store.tier import ExtractStats, FeatureTier, Fence, Lease, wait_fence
from lightning_ooc.utils import trace
from lightning_ooc.utils.cancel import NEVER, CancelToken
import numpy as np


class HostCacheTier(FeatureTier):
    """Serves the ids the host cache holds; claims nothing else, holds nothing (a row served never changes; one
    ranked in the background comes when a read brings it, :meth:`HostCache.admit
    <lightning_ooc.store.host_cache.HostCache.admit>`)."""

    name = "host_cache"

    def __init__(self, host: HostCache, background: Any = None, observe: bool = True):
        self.host = host
        #: the thread ranking it while training runs (:class:`~lightning_ooc.store.background.BackgroundFill`)
        self.background = background
        #: whether its claims and releases feed the ranking (the training chain's; not its :meth:`frozen` view's)
        self.observe = observe
        self._frozen: HostCacheTier | None = None

    def frozen(self) -> "HostCacheTier":
        """The same cache for passes whose batches must not count towards its ranking (evaluation, serving
        peers): claims that do not observe, releases that do not count as trained batches, a close that closes
        nothing (the training chain closes the cache)."""
        if self.background is None or not self.observe:
            return self
        if self._frozen is None:
            self._frozen = HostCacheTier(self.host, self.background, observe=False)
        return self._frozen

    def claim(self, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        if self.background is not None:
            self.background.raise_error()  # a failed fill fails the run here, in the extractor
            if self.observe:
                self.background.observe(ids)  # the epoch's own batches count towards its ranking
        pos = self.host.lookup(ids)
        mask = pos >= 0
        lease = Lease(self, mask, pos[mask])
        lease.stats.host_hits = int(lease.handle.numel())
        return lease

    def rows(self, lease: Lease, device: torch.device) -> torch.Tensor:
        return self.host.gather(lease.handle, device)

    def release(self, lease: Lease, fence: Fence | None = None) -> None:
        super().release(lease, fence)
        if self.background is not None and self.observe:  # a batch trained: the fill may start (wait_batches)
            self.background.batch_done()

    def pin(self, lease: Lease) -> None:
        lease.handle = lease.handle.pin_memory()

    def gather_into(self, lease: Lease, x: torch.Tensor, positions: torch.Tensor) -> None:
        self.host.gather_into(x, positions, lease.handle)  # zero-copy straight into x on a GPU

    def close(self) -> None:
        if not self.observe:  # a frozen view: the training chain's tier closes the cache
            return
        if self.background is not None:  # it samples with the pass's sampler: stopped before anything closes
            self.background.close()
        self.host.close()


class ReaderTier(FeatureTier):
    """Every row, read from SSD with direct I/O through the staging buffer (the last tier of a chain).

    Claimed on its own (evaluation passes, which hold no buffer slot), it reads the rows
    into a tensor of their own; as the ``source`` of the feature buffer it reads them
    through staging chunks straight into buffer slots (:meth:`load_into`).

    ``admit(ids, rows)``, where given, is offered every row read, in host memory, as its read completes:
    a host cache ranked in the background keeps the rows it expects from reads made anyway
    (:meth:`HostCache.admit <lightning_ooc.store.host_cache.HostCache.admit>`).
    """

    name = "ssd"

    def __init__(self, reader, staging: StagingBuffer, copy_chunk_rows: int = 1024,
                 admit: Callable[[torch.Tensor, torch.Tensor], int] | None = None):  # fmt: skip
        self.reader = reader
        self.staging = staging
        self.copy_chunk_rows = max(1, min(int(copy_chunk_rows), staging.chunk_rows))
        self.admit = admit
        self._streams = threading.local()

    @property
    def num_features(self) -> int:
        return int(self.reader.num_features)

    @property
    def dtype(self) -> torch.dtype:
        return self.reader.dtype

    def claim(self, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        return Lease(self, torch.ones(ids.numel(), dtype=torch.bool), {"ids": ids})

    def fill(self, lease: Lease, cancel: CancelToken = NEVER) -> None:
        ids = lease.handle["ids"]
        cancel.check()
        handle = self.reader.gather_async(ids, pin_memory=torch.cuda.is_available() and self.staging.pinned)
        with trace.span("ssd.read", rows=int(ids.numel())):
            lease.handle["rows"] = handle.wait()
        if self.admit is not None:
            self.admit(ids, lease.handle["rows"])
        st = handle.stats
        s = lease.stats
        s.misses += int(ids.numel())
        s.bytes_requested, s.bytes_read, s.ios = st.bytes_requested, st.bytes_read, st.num_ios

    def rows(self, lease: Lease, device: torch.device) -> torch.Tensor:
        return lease.handle["rows"].to(device, non_blocking=True)

    def release(self, lease: Lease, fence: Fence | None = None) -> None:
        if not lease.released:
            wait_fence(fence)  # the rows may still be in a host-to-device copy
            lease.released = True
            lease.handle.pop("rows", None)

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        s = getattr(self._streams, "s", None)
        if s is None:  # pragma: no cover - needs a GPU
            s = self._streams.s = torch.cuda.Stream(device)
        return s

    @staticmethod
    def _copy_rows(dest: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, stream) -> None:
        """``dest[slots] = rows``: in place on the CPU, else queued on ``stream`` from pinned memory."""
        if stream is None:
            dest.index_copy_(0, slots, rows)
            return
        with torch.cuda.stream(stream):  # pragma: no cover - needs a GPU
            dst_slots = slots.pin_memory().to(dest.device, non_blocking=True)
            dest.index_copy_(0, dst_slots, rows.to(dest.device, non_blocking=True))

    def load_into(self, ids: torch.Tensor, dest: torch.Tensor, slots: torch.Tensor, stats: ExtractStats,
                  cancel: CancelToken = NEVER) -> None:  # fmt: skip
        """Read rows ``ids`` (sorted here, so extents merge) into ``dest[slots]`` through staging chunks.

        Rows are copied out of a chunk as each part of its read completes (a host-to-device
        copy on this thread's side stream when ``dest`` is on a GPU). Each chunk goes back to
        the staging buffer with a fence recorded on that stream after its last copy -- also
        when a read fails halfway -- so it is reused only once its copies are done, while the
        next chunk's reads proceed. On return every row is in ``dest``: the caller publishes
        the slots, and the trainer's stream may read them.
        """
        ids, order = torch.sort(ids)
        slots = slots[order]
        stream = self._stream(dest.device)
        cr = self.staging.chunk_rows
        last: Fence | None = None
        try:
            for s in range(0, ids.numel(), cr):
                part_ids, part_slots = ids[s : s + cr], slots[s : s + cr]
                k = part_ids.numel()
                with trace.span("staging.wait"):
                    chunk = self.staging.acquire(cancel=cancel)
                try:
                    handle = self.reader.gather_async(part_ids, out=chunk.rows[:k], chunk_rows=self.copy_chunk_rows)
                    parts = iter(handle.chunks())
                    while True:
                        with trace.span("ssd.read", rows=k):  # waiting for the next part of the chunk's reads
                            part = next(parts, None)
                        if part is None:
                            break
                        lo, hi, rows = part
                        with trace.span("ssd.copy", rows=hi - lo):
                            self._copy_rows(dest, part_slots[lo:hi], rows, stream)
                            if self.admit is not None:  # from the staging chunk: host memory on a GPU too
                                self.admit(part_ids[lo:hi], rows)
                    st = handle.stats
                    stats.bytes_requested += st.bytes_requested
                    stats.bytes_read += st.bytes_read
                    stats.ios += st.num_ios
                finally:
                    last = Fence.on_stream(stream)  # after this chunk's copies, whether or not all were queued
                    self.staging.release(chunk, last)
        finally:
            # Published rows must be in their slots; and after a failure, no copy may still be queued
            # to land in a slot that the failed lease gives back for another batch.
            wait_fence(last)

    def close(self) -> None:
        self.staging.close()
        self.reader.close()


class BufferTier(FeatureTier):
    """The feature buffer: claims every id it is asked about, filling misses from ``source``.

    A claim references one slot per id (all or nothing, waiting while too few are free);
    :meth:`fill` loads the misses and waits for rows other extractors are loading;
    :meth:`release` hands the slots back once the ``fence`` of their last read completed.
    """

    name = "buffer"

    def __init__(self, buffer: FeatureBuffer, source: ReaderTier):
        self.buffer = buffer
        self.source = source

    def claim(self, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        acq = self.buffer.acquire(ids, cancel=cancel)
        lease = Lease(self, torch.ones(ids.numel(), dtype=torch.bool), acq)
        s = lease.stats
        s.buffer_hits, s.in_flight_hits, s.misses = int(acq.hit.sum()), int(acq.in_flight.sum()), int(acq.miss.sum())
        return lease

    def fill(self, lease: Lease, cancel: CancelToken = NEVER) -> None:
        acq = lease.handle
        if lease.stats.misses:
            miss_slots = acq.slots[acq.miss]
            self.source.load_into(acq.ids[acq.miss], self.buffer.rows, miss_slots, lease.stats, cancel)
            self.buffer.mark_valid(miss_slots)
        if lease.stats.in_flight_hits:
            with trace.span("buffer.wait_in_flight", rows=lease.stats.in_flight_hits):
                self.buffer.wait_valid(acq.slots[acq.in_flight], cancel=cancel)

    def rows(self, lease: Lease, device: torch.device) -> torch.Tensor:
        rows, acq = self.buffer.rows, lease.handle
        slots = (acq.slots if acq.device_slots is None else acq.device_slots).to(rows.device, non_blocking=True)
        out = rows.index_select(0, slots)
        return out if out.device == device else out.to(device, non_blocking=True)  # a host buffer, a GPU trainer

    def pin(self, lease: Lease) -> None:
        lease.handle.device_slots = lease.handle.slots.pin_memory()

    def release(self, lease: Lease, fence: Fence | None = None) -> None:
        if not lease.released:
            wait_fence(fence)  # the slots' last read must be complete before they can be reused
            lease.released = True
            self.buffer.release(lease.handle.slots)

    def abandon(self, lease: Lease) -> None:
        if not lease.released:
            lease.released = True
            self.buffer.abandon(lease.handle)

    def close(self) -> None:
        self.buffer.close()


class DeviceTableTier(FeatureTier):
    """Every row, held in one table in the training device's memory: the "all features in GPU memory"
    reference that benchmarks compare the hierarchy with (it claims every id; nothing to fill or release).
    """

    name = "device_table"

    def __init__(self, table: torch.Tensor):
        self.table = table

    @classmethod
    def load(cls, ds, device: torch.device | str, chunk_bytes: int = 256 << 20) -> "DeviceTableTier":
        """Read the whole feature file into a table on ``device``, ``chunk_bytes`` of host memory at a time."""

        table = torch.empty((ds.num_nodes, ds.num_features), dtype=ds.feature_dtype, device=device)
        step = max(1, chunk_bytes // max(ds.row_bytes, 1))
        for s in range(0, ds.num_nodes, step):
            e = min(ds.num_nodes, s + step)
            table[s:e] = ds.read_features(np.arange(s, e)).to(table.device)
        return cls(table)

    def claim(self, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        return Lease(self, torch.ones(ids.numel(), dtype=torch.bool), ids)

    def pin(self, lease: Lease) -> None:
        lease.handle = lease.handle.pin_memory()

    def rows(self, lease: Lease, device: torch.device) -> torch.Tensor:
        out = self.table.index_select(0, lease.handle.to(self.table.device, non_blocking=True))
        return out if out.device == device else out.to(device, non_blocking=True)

    def close(self) -> None:
        self.table = None  # type: ignore[assignment]
