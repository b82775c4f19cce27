"""The tiered feature store: feature buffer over host cache over staging over the direct-I/O reader.

:meth:`TieredFeatureStore.extract` runs in an extractor thread for one
minibatch: nodes in the host cache are served from it at gather time; the
rest get feature-buffer slots (hits, rows another extractor is loading, or
misses); misses are read from SSD, sorted, through staging chunks and copied
into their slots as each part of the read completes; then rows loaded by
others are waited for. :meth:`gather` runs in the trainer and assembles ``x``
from the two tiers on the training device; :meth:`release` hands the slots
back (they go on standby and keep their rows).

Example::

    >>> import tempfile, torch, lightning_ooc
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.store.tiered import TieredFeatureStore
    >>> ds = lightning_ooc.open_dataset(synthesize(tempfile.mkdtemp() + "/g", num_nodes=500, avg_degree=4,
    ...                                            num_features=8, num_classes=2, progress=False))
    >>> store = TieredFeatureStore.create(ds, buffer_slots=64, staging_bytes=8192, host_ids=torch.arange(10))
    >>> n_id = torch.tensor([3, 250, 7, 499])
    >>> ext = store.extract(n_id)
    >>> bool((store.gather(ext) == ds.read_features(n_id)).all())
    True
    >>> store.release(ext); store.close()
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from lightning_ooc.store.buffer import Acquired, FeatureBuffer
from lightning_ooc.store.host_cache import HostCache
from lightning_ooc.store.staging import StagingBuffer


@dataclass
class ExtractStats:
    """What one extraction found in each tier and read from SSD."""

    host_hits: int = 0
    buffer_hits: int = 0
    in_flight_hits: int = 0
    misses: int = 0
    bytes_requested: int = 0
    bytes_read: int = 0
    ios: int = 0

    def add(self, o: "ExtractStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(o, k))


@dataclass
class Extracted:
    """One minibatch's features, ready to gather: host-cache positions and buffer slots."""

    n_id: torch.Tensor
    in_host: torch.Tensor  # bool per node
    host_pos: torch.Tensor  # positions of in_host nodes in the host cache
    acquired: Acquired | None  # buffer slots of the other nodes, in order
    stats: ExtractStats = field(default_factory=ExtractStats)
    direct_rows: torch.Tensor | None = None  # rows of the other nodes, read past the buffer
    released: bool = False


class TieredFeatureStore:
    """Composes a :class:`FeatureBuffer`, an optional :class:`HostCache`, a :class:`StagingBuffer`
    and a :class:`~lightning_ooc.io.FeatureReader`."""

    def __init__(self, reader, buffer: FeatureBuffer, staging: StagingBuffer, host: HostCache | None = None,
                 copy_chunk_rows: int = 1024):  # fmt: skip
        self.reader = reader
        self.buffer = buffer
        self.staging = staging
        self.host = host
        self.device = buffer.rows.device
        self.copy_chunk_rows = max(1, min(int(copy_chunk_rows), staging.chunk_rows))
        self._streams = threading.local()
        self._closed = False

    @classmethod
    def create(cls, ds, *, buffer_slots: int, staging_bytes: int, host_ids: torch.Tensor | None = None,
               device: str | torch.device = "cpu", reserve: int = 0, backend: str = "auto",
               workers: int = 1, progress: bool = False) -> "TieredFeatureStore":  # fmt: skip
        """Build every tier for a dataset (mostly for tests and scripts; the datamodule plans the sizes)."""
        from lightning_ooc.io import FeatureReader

        reader = FeatureReader.from_dataset(ds, backend=backend, workers=workers)
        device = torch.device(device)
        buffer = FeatureBuffer(buffer_slots, ds.num_nodes, ds.num_features, ds.feature_dtype, device, reserve)
        staging = StagingBuffer(staging_bytes, ds.num_features, ds.feature_dtype, pin=device.type == "cuda")
        host = None
        if host_ids is not None and host_ids.numel():
            host = HostCache.load(reader, host_ids, ds.num_nodes, register=device.type == "cuda", progress=progress)
        return cls(reader, buffer, staging, host)

    # -- extractor side ---------------------------------------------------------------------
    def _stream(self):
        if self.device.type != "cuda":
            return None
        s = getattr(self._streams, "s", None)
        if s is None:  # pragma: no cover - needs a GPU
            s = self._streams.s = torch.cuda.Stream(self.device)
        return s

    def extract(self, n_id: torch.Tensor, timeout: float | None = None, use_buffer: bool = True) -> Extracted:
        """Make every row of ``n_id`` available to :meth:`gather` (blocks on I/O).

        ``use_buffer=False`` reads the rows the host cache lacks straight into
        a tensor of their own, holding no buffer slot (evaluation passes,
        which may run while a training pass holds the buffer).
        """
        n_id = n_id.to(torch.int64)
        stats = ExtractStats()
        if self.host is not None:
            pos = self.host.lookup(n_id)
            in_host = pos >= 0
            host_pos = pos[in_host]
            rest = n_id[~in_host]
        else:
            in_host = torch.zeros(n_id.numel(), dtype=torch.bool)
            host_pos = n_id[:0]
            rest = n_id
        stats.host_hits = int(host_pos.numel())
        if not use_buffer:
            handle = self.reader.gather_async(rest, pin_memory=self.device.type == "cuda")
            rows = handle.wait()
            st = handle.stats
            stats.misses = int(rest.numel())
            stats.bytes_requested, stats.bytes_read, stats.ios = st.bytes_requested, st.bytes_read, st.num_ios
            return Extracted(n_id, in_host, host_pos, None, stats, direct_rows=rows)
        acq = self.buffer.acquire(rest, timeout=timeout)
        try:
            stats.buffer_hits = int(acq.hit.sum())
            stats.in_flight_hits = int(acq.in_flight.sum())
            stats.misses = int(acq.miss.sum())
            if stats.misses:
                self._load(acq.ids[acq.miss], acq.slots[acq.miss], stats)
            if stats.in_flight_hits:
                self.buffer.wait_valid(acq.slots[acq.in_flight], timeout=timeout)
        except BaseException:
            self.buffer.abandon(acq)
            raise
        return Extracted(n_id, in_host, host_pos, acq, stats)

    def _load(self, ids: torch.Tensor, slots: torch.Tensor, stats: ExtractStats) -> None:
        """Read rows ``ids`` from SSD (sorted, so extents merge) into buffer ``slots`` via staging."""
        ids, order = torch.sort(ids)
        slots = slots[order]
        stream = self._stream()
        cr = self.staging.chunk_rows
        for s in range(0, ids.numel(), cr):
            part_ids, part_slots = ids[s : s + cr], slots[s : s + cr]
            k = part_ids.numel()
            chunk = self.staging.acquire()
            try:
                handle = self.reader.gather_async(part_ids, out=chunk.rows[:k], chunk_rows=self.copy_chunk_rows)
                for lo, hi, rows in handle.chunks():
                    if stream is None:
                        self.buffer.rows.index_copy_(0, part_slots[lo:hi], rows)
                    else:  # pragma: no cover - needs a GPU
                        with torch.cuda.stream(stream):
                            dst_slots = part_slots[lo:hi].to(self.device, non_blocking=True)
                            self.buffer.rows.index_copy_(0, dst_slots, rows.to(self.device, non_blocking=True))
                st = handle.stats
                stats.bytes_requested += st.bytes_requested
                stats.bytes_read += st.bytes_read
                stats.ios += st.num_ios
                if stream is not None:  # pragma: no cover - needs a GPU
                    stream.synchronize()  # the chunk is reused once its copies are done
            finally:
                self.staging.release(chunk)
        self.buffer.mark_valid(slots)

    # -- trainer side -------------------------------------------------------------------------
    def gather(self, ext: Extracted, device: torch.device | str | None = None) -> torch.Tensor:
        """``x`` for the minibatch, on ``device`` (default: the buffer's device)."""
        device = torch.device(device) if device is not None else self.device
        n = ext.n_id.numel()
        x = torch.empty((n, self.buffer.rows.shape[1]), dtype=self.buffer.rows.dtype, device=device)
        if ext.host_pos.numel():
            x[ext.in_host.to(device)] = self.host.gather(ext.host_pos, device)  # type: ignore[union-attr]
        if ext.direct_rows is not None:
            x[(~ext.in_host).to(device)] = ext.direct_rows.to(device)
        elif ext.acquired is not None and ext.acquired.slots.numel():
            rows = self.buffer.rows.index_select(0, ext.acquired.slots.to(self.buffer.rows.device))
            x[(~ext.in_host).to(device)] = rows.to(device)
        return x

    def release(self, ext: Extracted) -> None:
        """Give the minibatch's slots back (its rows stay on standby until reused)."""
        if not ext.released:
            ext.released = True
            if ext.acquired is not None:
                self.buffer.release(ext.acquired.slots)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.buffer.close()
        if self.host is not None:
            self.host.close()
        self.staging.close()
        self.reader.close()
