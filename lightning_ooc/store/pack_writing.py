"""Batched packing (DiskGNN, section 5.2): write an epoch pack with sequential reads and large writes only.

:class:`EpochPackWriter` builds one epoch pack (:mod:`lightning_ooc.store.packed_batches`) in two phases:

1. :meth:`~EpochPackWriter.add` takes the epoch's batches one by one as they are sampled: each batch's
   record goes to ``graphs.bin`` through an aligned write buffer, and its cold ids (per node type, sorted)
   are kept, as int32 where ids fit.
2. :meth:`~EpochPackWriter.pack_features` lays the sections out (each batch's cold rows of a type,
   contiguous, starting on a sector) and fills them by streaming each type's feature file once, in
   partitions sized from the memory given: a partition is read with direct I/O while the previous one is
   gathered; for each batch, the rows of the partition it needs (a contiguous run of its sorted ids, so a
   contiguous run of its section) are appended behind what the batch had left over (less than a sector),
   and every whole sector goes out in one direct write at the batch's place in ``chunks.bin``, several
   writes in flight. No row is ever read at random, and each is read once however many batches need it.

:meth:`~EpochPackWriter.commit` makes the files durable, writes ``manifest.json`` and renames the
``.partial`` directory into place; :meth:`~EpochPackWriter.abort` removes it. ``chunks.bin`` is reserved
in full before a byte is written, so a disk without room for it fails at once, naming the sizes. Only the
files a pack holds are ever deleted (:func:`~lightning_ooc.store.packed_batches.remove_pack_files`): a directory where
one is to go that holds anything else is refused, and left as it is.
"""
from __future__ import annotations

import io
import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from lightning_ooc.data.commit import fsync_dir
from lightning_ooc.data.format import human_bytes
from lightning_ooc.data.in_place import recorded_path
from lightning_ooc.errors import InputError
from lightning_ooc.io.bulk import PAGE, BulkFile, aligned_empty, round_up
from lightning_ooc.store.diskcache import CachePlan, members, plan_disk_cache, region_align, row_sums, window_rows
from lightning_ooc.store.packed_batches import (CACHE_INDEX, CHUNKS, GRAPHS, MANIFEST, PACK_FORMAT, PARTIAL,
                                                RECORD_ALIGN, encode_batch, epoch_dirname, ids_digest, remove_pack,
                                                remove_pack_files)  # fmt: skip

log = logging.getLogger("lightning_ooc")

#: bytes of ``graphs.bin`` buffered before one write
GRAPH_BUFFER = 8 << 20
#: direct writes of sections in flight
WRITERS = 4
#: the most bytes of a batch's rows gathered before they are written (fewer, larger writes)
COMBINE = 1 << 20


@dataclass(frozen=True)
class FeatureSource:
    """One node type's feature file: ``num_rows`` rows of ``row_bytes`` from byte ``offset`` of ``path`` (0 for a
    dataset's own file; a ``.npy`` header's length for one used in place)."""

    node_type: str | None
    path: Path
    row_bytes: int
    num_rows: int
    offset: int = 0


@dataclass
class PackReport:
    """What writing a pack took and made."""

    epoch: int
    batches: int
    packed: int
    rows: int
    bytes: int
    sample_seconds: float = 0.0
    pack_seconds: float = 0.0
    partitions: int = 0
    #: the disk cache (0 segments: none): batches per segment, the threshold, rows cached, reorder seconds
    segments: int = 0
    segment_batches: int = 0
    threshold: int = 0
    cached_rows: int = 0
    reorder_seconds: float = 0.0


def _wide(rows: np.ndarray) -> np.ndarray:
    """Rows of bytes as rows of the widest integers their size allows (NumPy's take copies a row element by
    element: 8-byte elements move rows about twice as fast as bytes)."""
    for dt in (np.int64, np.int32, np.int16):
        if rows.shape[1] % np.dtype(dt).itemsize == 0:
            return rows.view(dt)
    return rows


def _not_ours(path: Path) -> InputError:
    """The error for a place a pack is to go that holds what this package did not write."""
    return InputError(f"{path}: holds files this package did not write, where an epoch pack is to go; they were left "
                      "as they are: move or remove them, or give pack_dir a directory of its own")  # fmt: skip


class EpochPackWriter:
    """Write epoch ``epoch``'s pack into ``parent`` (see the module docstring).

    Args:
        parent: the directory of this rank's packs.
        epoch: the epoch packed.
        identity: what the pack is for (checked by :meth:`EpochPack.open
            <lightning_ooc.store.packed_batches.EpochPack.open>`).
        sources: the feature file of each node type with features, in the chains' order.
        memory: host memory packing may use (half of ``pack_memory``): half of it for the cold ids kept from
            phase 1, half for the partition buffers, the write buffers and the batches' leftovers.
        space: the most bytes ``chunks.bin`` may take; the batches past it are left out of the pack (their
            rows are read from the feature file as without packing) with a warning.
        stop: called between steps; raises to stop the write (the caller then calls :meth:`abort`).
    """

    def __init__(self, parent: str | os.PathLike, epoch: int, identity: dict[str, Any],
                 sources: Sequence[FeatureSource], memory: int, space: int | None = None, backend: str = "auto",
                 stop: Callable[[], None] | None = None):  # fmt: skip
        self.parent = Path(parent)
        self.epoch = int(epoch)
        self.identity = identity
        self.sources = list(sources)
        self.memory = int(memory)
        self.space = space
        self.backend = backend
        self._stop = stop or (lambda: None)
        self.final = self.parent / epoch_dirname(epoch)
        self.path = self.parent / (epoch_dirname(epoch) + PARTIAL)
        if not remove_pack_files(self.path):
            raise _not_ours(self.path)
        self.path.mkdir(parents=True)
        try:
            self._graphs: BulkFile | None = BulkFile(self.path / GRAPHS, "w", backend=backend)
        except BaseException:
            remove_pack_files(self.path)
            raise
        self._gbuf = aligned_empty(GRAPH_BUFFER, hugepages=True)
        self._gnp = self._gbuf.numpy()
        self._gfill = 0  # bytes in the buffer
        self._gpos = 0  # file offset of the buffer's first byte
        self._records: dict[int, tuple[int, int, str]] = {}
        self._cold: dict[int, list[np.ndarray]] = {}
        self._cold_bytes = 0
        self._small = [s.num_rows < 2**31 for s in self.sources]
        self.report = PackReport(self.epoch, 0, 0, 0, 0)
        self._plan: CachePlan | None = None
        self._full: dict[int, list[tuple[str, int, int]]] = {}  # with a cache: each batch's (digest, cached, g)
        self._caches: dict[int, list[Any]] = {}
        self._cache_index_digest: str | None = None

    # -- phase 1 ------------------------------------------------------------------------------------
    def add(self, k: int, data: Any, cold: Sequence[np.ndarray]) -> None:
        """Batch ``k`` as sampled and its cold ids per node type (``cold[i]``: sorted, unique)."""
        rec = encode_batch(data)
        rec += b"\0" * (-len(rec) % RECORD_ALIGN)
        offset = self._gpos + self._gfill
        self._records[int(k)] = (offset, len(rec), xxhash.xxh3_128_hexdigest(rec))
        self._append(rec)
        kept = []
        for i, ids in enumerate(cold):
            a = np.asarray(ids)
            a = a.astype(np.int32 if self._small[i] else np.int64, copy=False)
            kept.append(a)
            self._cold_bytes += a.nbytes
        self._cold[int(k)] = kept
        if self._cold_bytes > self.memory // 2:
            raise InputError(f"the cold ids of epoch {self.epoch}'s batches ({human_bytes(self._cold_bytes)} so far) "
                             f"take more than a quarter of pack_memory={human_bytes(2 * self.memory)} (the packer "
                             "has half of it, and keeps the ids in half of that); raise pack_memory")  # fmt: skip

    def _append(self, rec: bytes) -> None:
        view = memoryview(rec)
        while view:
            n = min(len(view), GRAPH_BUFFER - self._gfill)
            self._gnp[self._gfill : self._gfill + n] = np.frombuffer(view[:n], dtype=np.uint8)
            self._gfill += n
            view = view[n:]
            if self._gfill == GRAPH_BUFFER:
                self._graphs.write_from(self._gpos, self._gbuf)
                self._gpos += GRAPH_BUFFER
                self._gfill = 0

    def _finish_graphs(self) -> int:
        """Write the records' last bytes and close ``graphs.bin``; its size."""
        size = self._gpos
        if self._gfill:
            n = round_up(self._gfill)
            self._gnp[self._gfill : n] = 0
            self._graphs.write_from(self._gpos, self._gbuf[:n])
            size += n
        self._graphs.sync()
        self._graphs.close()
        self._graphs = None
        self._gbuf = self._gnp = None  # type: ignore[assignment]
        return size

    # -- phase 2 ------------------------------------------------------------------------------------
    def _order(self) -> list[int]:
        """The keys of ``chunks.bin``'s entries in file order: with a disk cache, each segment's cache (key
        ``-1 - g``) before its batches."""
        keys = sorted(k for k in self._cold if k >= 0)
        if self._plan is None:
            return keys
        out = []
        for g, (lo, hi) in enumerate(self._plan.segments):
            out.append(-1 - g)
            out.extend(keys[lo:hi])
        return out

    def _layout(self, graphs: int) -> tuple[list[int], dict[int, list[int]], int]:
        """Which entries are packed (in order, within ``space`` less the ``graphs`` bytes of the records) and
        each one's section offsets; a segment's cache starts where it can be read as rows of the file."""
        batches, offsets, at = [], {}, 0
        room = None if self.space is None else self.space - graphs
        starts: dict[int, int] = {}
        for k in self._order():
            offs, end = [], at
            for ids, s in zip(self._cold[k], self.sources):
                if k < 0 and len(ids):
                    end = round_up(end, region_align(s.row_bytes))
                offs.append(end)
                end += round_up(len(ids) * s.row_bytes)
            if room is not None and end > room:
                break
            starts[k], at = at, end
            batches.append(k)
            offsets[k] = offs
        if batches and batches[-1] < 0:  # a cache without its batches
            at = starts[batches.pop()]
        return batches, offsets, at

    def _full_bytes(self) -> int:
        return sum(round_up(len(ids) * s.row_bytes) for v in self._cold.values() for ids, s in zip(v, self.sources))

    def _apply_plan(self, plan: CachePlan) -> None:
        """Move each segment's shared rows out of its batches' sections into its cache (an entry of its own)."""
        keys = sorted(self._cold)
        self._full = {}
        for g, (lo, hi) in enumerate(plan.segments):
            for k in keys[lo:hi]:
                full, ded = [], []
                for i, ids in enumerate(self._cold[k]):
                    cache = plan.caches[g][i]
                    shared = members(ids, cache)
                    full.append((ids_digest(ids.astype(np.int64)), int(shared.sum()), g))
                    ded.append(ids[~shared])
                self._full[k] = full
                self._cold[k] = ded
            self._cold[-1 - g] = [c.astype(np.int32 if small else np.int64)
                                  for c, small in zip(plan.caches[g], self._small)]  # fmt: skip
        self._plan = plan
        # what the ids take now: the batches' own, the caches' (twice: sorted and in their layout)
        self._cold_bytes = sum(a.nbytes for v in self._cold.values() for a in v) + sum(
            c.nbytes + lay.nbytes for cs, ls in zip(plan.caches, plan.layouts) for c, lay in zip(cs, ls))

    def pack_features(self) -> None:
        """Phase 2: lay out and fill every batch's sections (see the module docstring); where they would take
        more than ``space``, with a segmented disk cache (:mod:`lightning_ooc.store.diskcache`)."""
        t0 = time.perf_counter()
        graphs = self._finish_graphs()
        nb = len(self._cold)
        if self.space is not None and self._full_bytes() > self.space - graphs:
            plan = plan_disk_cache(self._cold, [s.row_bytes for s in self.sources], self.space - graphs,
                                   windows=[self._window(s) for s in self.sources], seed=self.epoch)  # fmt: skip
            if plan is not None:
                self._apply_plan(plan)
                r = self.report
                r.segments, r.segment_batches, r.threshold = len(plan.segments), plan.segment, plan.threshold
                r.cached_rows = plan.cached_rows
                log.info("lightning_ooc: epoch %d: packing every batch's rows apart would take more than "
                         "pack_space (%s); rows that %d or more of %d consecutive batches need are stored once, "
                         "in a disk cache per segment (%d rows)", self.epoch, human_bytes(self.space),
                         plan.threshold, plan.segment, plan.cached_rows)  # fmt: skip
        entries, offsets, total = self._layout(graphs)
        batches = [k for k in entries if k >= 0]
        if len(batches) < nb:
            log.warning("lightning_ooc: epoch %d: packing all %d batches would take more than pack_space (%s); "
                        "%d are packed, the rest read their rows from the feature file", self.epoch, nb,
                        human_bytes(self.space or 0), len(batches))  # fmt: skip
        self.report.batches, self.report.packed, self.report.bytes = nb, len(batches), total + graphs
        self._sections: dict[int, list[Any]] = {k: [None] * len(self.sources) for k in entries}
        with BulkFile(self.path / CHUNKS, "w", backend=self.backend, size=total) as out:
            for i, src in enumerate(self.sources):
                self._pack_type(out, i, src, entries, offsets)
            if self._plan is not None:
                t1 = time.perf_counter()
                self._reorder_caches(out, [k for k in entries if k < 0])
                self.report.reorder_seconds = time.perf_counter() - t1
            out.sync()
        self.report.rows = sum(len(self._cold[k][i]) for k in entries for i in range(len(self.sources)))
        self.report.pack_seconds = time.perf_counter() - t0

    def _reorder_caches(self, out: BulkFile, caches: list[int]) -> None:
        """Put each cache's rows (written in id order) in their HashOrder, window by window in memory, and make
        each row's checksum; then the cache index (ids in file order, checksums) beside the chunks."""
        index: dict[str, np.ndarray] = {}
        for key in caches:
            g = -1 - key
            entry = []
            for i, src in enumerate(self.sources):
                self._stop()
                rb = src.row_bytes
                start, _nbytes, n = self._sections[key][i][:3]
                ids = self._plan.caches[g][i]
                layout = self._plan.layouts[g][i]
                pos = np.searchsorted(ids, layout)  # for each place on disk, the row in id order it takes
                sums = np.empty(n, dtype=np.uint64)
                w = self._window(src)
                buf = aligned_empty(round_up(min(n, w) * rb) if n else PAGE, hugepages=True)
                for lo in range(0, n, w):
                    hi = min(n, lo + w)
                    span = round_up((hi - lo) * rb)
                    view = buf[:span]
                    out.read_into(start + lo * rb, view)
                    rows = _wide(view.numpy()[: (hi - lo) * rb].reshape(-1, rb))
                    local = pos[lo:hi] - lo
                    if local.size and (local.min() < 0 or local.max() >= hi - lo):
                        raise RuntimeError(f"packing epoch {self.epoch}: the layout of segment {g}'s cache "
                                           "crosses its reordering windows")  # fmt: skip
                    rows[:] = rows[local]
                    sums[lo:hi] = row_sums(view.numpy()[: (hi - lo) * rb].reshape(-1, rb))
                    out.write_from(start + lo * rb, view)
                index[f"ids_{g}_{i}"] = layout.astype(np.int64)
                index[f"sums_{g}_{i}"] = sums
                self._plan.layouts[g][i] = layout[:0]  # kept in the index from here on
                entry.append([int(start), int(n)])
            self._caches[g] = entry
        raw = io.BytesIO()
        np.savez(raw, **index)
        with open(self.path / CACHE_INDEX, "wb") as f:
            f.write(raw.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        self._cache_index_digest = xxhash.xxh3_128_hexdigest(raw.getbuffer())

    def _window(self, src: FeatureSource) -> int:
        """Rows of a cache reordered together: a quarter of the packer's memory."""
        return window_rows(src.row_bytes, self.memory // 4)

    def _sizes(self, src: FeatureSource, nb: int, ratio: float) -> tuple[int, int]:
        """Rows per partition and each batch's write-combining bytes, in what ``memory`` leaves beside the cold
        ids: a third of it combines each batch's rows until a write is worth it (up to :data:`COMBINE`); the
        rest holds two partitions (one read while the other is gathered), two write buffers of about a
        partition each, and the rows the batches take from a partition (``ratio`` times its rows)."""
        per_row = max(1, PAGE // int(np.gcd(src.row_bytes, PAGE)))  # rows whose bytes fill whole sectors
        avail = self.memory - self._cold_bytes
        combine = min(COMBINE, max(PAGE, avail // 3 // (nb + 2) // PAGE * PAGE))  # the batches' and 2 write buffers'
        for combine in dict.fromkeys((combine, PAGE)):  # combining less leaves more for the partitions
            part = (avail - nb * combine - 2 * (combine + 2 * PAGE)) / (4 + ratio)
            rows = int(part) // src.row_bytes // per_row * per_row
            if rows >= per_row:
                break
        else:
            need = self._cold_bytes + nb * PAGE + 2 * (PAGE + 2 * PAGE) + (4 + ratio) * per_row * src.row_bytes
            raise InputError(f"pack_memory={human_bytes(2 * self.memory)} is too small to pack {nb} sections (batches "
                             f"and disk caches) of rows of {src.row_bytes} bytes; raise pack_memory to at least "
                             f"{human_bytes(2 * need)}")  # fmt: skip
        return min(rows, round_up(src.num_rows, per_row)), combine

    def _pack_type(self, out: BulkFile, i: int, src: FeatureSource, batches: list[int],
                   offsets: dict[int, list[int]]) -> None:  # fmt: skip
        rb, nb = src.row_bytes, len(batches)
        cold = [self._cold[k][i] for k in batches]
        refs = sum(len(c) for c in cold)
        if refs == 0:
            for k in batches:
                self._sections[k][i] = (offsets[k][i], 0, 0, ids_digest(np.empty(0, np.int64)),
                                        xxhash.xxh3_128_hexdigest(b""))  # fmt: skip
            return
        avail = self.memory - self._cold_bytes
        ratio = 1.5 * refs / max(src.num_rows, 1)  # rows taken per row of a partition, with a margin
        while True:  # until the rows a partition's batches take (a row once per batch) fit beside the buffers
            prow, combine = self._sizes(src, nb, ratio)
            bounds = np.unique(np.minimum(np.arange(0, src.num_rows + prow, prow, dtype=np.int64), src.num_rows))
            # cuts[b, p]: the first of batch b's sorted ids at or above partition p's first row
            cuts = np.stack([np.searchsorted(c, bounds) for c in cold])
            counts = np.diff(cuts, axis=1)  # rows of each partition each batch takes
            taken = int(counts.sum(axis=0).max()) * rb
            cap = prow * rb + combine + 2 * PAGE  # a write buffer: a batch's pending bytes and its rows of a partition
            if 2 * prow * rb + 2 * cap + taken + nb * combine <= avail or taken <= ratio * prow * rb:
                break
            ratio = 1.25 * taken / (prow * rb)
        nparts = len(bounds) - 1
        self.report.partitions += nparts
        obufs = [aligned_empty(cap, hugepages=True) for _ in range(2)]
        pbufs = [aligned_empty(prow * rb, hugepages=True) for _ in range(2)]
        gathered = np.empty(max(taken, rb), dtype=np.uint8)  # a partition's rows of every batch, batch after batch
        pend = np.zeros((nb, combine), dtype=np.uint8)  # each batch's bytes not written yet (less than combine)
        pend_len = np.zeros(nb, dtype=np.int64)
        # rows that divide a sector keep every batch's pending bytes whole rows: one scatter per partition then
        # appends the rows of all batches that stay under ``combine``
        row_aligned = PAGE % rb == 0
        pend_rows = _wide(pend.reshape(-1, rb)) if row_aligned else None
        cursor = [int(offsets[k][i]) for k in batches]
        hashers = [xxhash.xxh3_128() for _ in batches]
        # direct reads stop at the last whole block of the rows; the rest is read buffered, and so is all of a
        # file whose rows start inside a block (a .npy used in place: its partitions start off the block grid)
        off = int(src.offset)
        aligned_end = (off + src.num_rows * rb) // PAGE * PAGE if off % PAGE == 0 else 0

        def read(p: int) -> np.ndarray:
            lo, hi = off + int(bounds[p]) * rb, off + int(bounds[p + 1]) * rb  # file offsets
            buf = pbufs[p % 2]
            direct_hi = min(hi, aligned_end)
            if direct_hi > lo:
                feat.read_into(lo, buf[: direct_hi - lo])
            if hi > direct_hi:
                start = max(lo, direct_hi)
                with open(src.path, "rb", buffering=0) as f:
                    f.seek(start)
                    view, got = memoryview(buf.numpy())[start - lo : hi - lo], 0
                    while got < hi - start:  # one read(2) moves at most about 2 GiB
                        n = f.readinto(view[got:])
                        if not n:
                            break
                        got += n
                if got != hi - start:
                    raise InputError(f"{recorded_path(src.path)}: the feature file ends at byte {start + got}, inside "
                                     "a row; the dataset is damaged: run `lightning-ooc verify` on it")  # fmt: skip
            return _wide(buf.numpy()[: hi - lo].reshape(-1, rb))

        pending: list[list[Future]] = [[], []]
        state = {"slot": 0, "pos": 0, "writes": []}

        def flush() -> None:  # send the current write buffer's whole sectors, switch to the other buffer
            ob = obufs[state["slot"]]
            pending[state["slot"]] = [writers.submit(out.write_from, off, ob[at : at + n]) for off, at, n in state["writes"]]
            state["slot"] ^= 1
            for f in pending[state["slot"]]:  # its writes must be done before it is filled again
                f.result()
            state["pos"], state["writes"] = 0, []

        def emit(b: int, rows: np.ndarray | None, last: bool = False) -> None:
            """Put batch ``b``'s pending bytes and ``rows`` in the write buffer; hash them; write its whole sectors
            (all of them, the last one padded, when ``last``) and keep the rest pending."""
            tl = int(pend_len[b])
            end = tl + (0 if rows is None else rows.size)
            if state["pos"] + round_up(end) > cap:
                flush()
            obuf, pos = obufs[state["slot"]].numpy(), state["pos"]
            obuf[pos : pos + tl] = pend[b, :tl]
            if rows is not None:
                obuf[pos + tl : pos + end] = rows
            hashers[b].update(obuf[pos + hashed[b] : pos + end].data)  # what was not hashed before
            whole = round_up(end) if last else end // PAGE * PAGE
            if last:
                obuf[pos + end : pos + whole] = 0
            if whole:
                state["writes"].append((cursor[b], pos, whole))
                cursor[b] += whole
            rest = 0 if last else end - whole
            pend[b, :rest] = obuf[pos + whole : pos + end]
            pend_len[b] = hashed[b] = rest
            state["pos"] = pos + round_up(end)

        hashed = [0] * nb  # of each batch's pending bytes, those hashed already (a remainder of a write)
        with BulkFile(src.path, "r", backend=self.backend) as feat, \
                ThreadPoolExecutor(1, thread_name_prefix="looc-pack-read") as reader, \
                ThreadPoolExecutor(WRITERS, thread_name_prefix="looc-pack-write") as writers:  # fmt: skip
            nxt = reader.submit(read, 0)
            for p in range(nparts):
                self._stop()
                part = nxt.result()
                if p + 1 < nparts:
                    nxt = reader.submit(read, p + 1)
                takers = np.flatnonzero(counts[:, p])
                if takers.size == 0:
                    continue
                # every batch's ids of the partition, batch after batch (int64: NumPy's take converts other
                # index types first)
                ids = np.concatenate([cold[b][cuts[b, p] : cuts[b, p + 1]] for b in takers]).astype(np.int64)
                ids -= int(bounds[p])
                n = counts[takers, p]
                first = np.cumsum(n) - n  # each taker's first position in ids
                ends = pend_len[takers] + n * rb
                stay = ends < combine  # under combine: appended to the batch's pending bytes, written later
                if row_aligned and stay.any():
                    b_s, n_s = takers[stay], n[stay]
                    m = int(n_s.sum())
                    within = np.arange(m) - np.repeat(np.cumsum(n_s) - n_s, n_s)
                    rows = _wide(gathered[: m * rb].reshape(-1, rb))
                    np.take(part, ids[np.repeat(first[stay], n_s) + within], axis=0, out=rows)
                    pend_rows[np.repeat(b_s * (combine // rb) + pend_len[b_s] // rb, n_s) + within] = rows
                    pend_len[b_s] = ends[stay]
                    go = ~stay
                else:
                    go = np.ones(takers.size, dtype=bool)
                b_g, n_g = takers[go], n[go]
                if b_g.size == 0:
                    continue
                if not go.all():  # the rows of the batches that go on, together
                    within = np.arange(int(n_g.sum())) - np.repeat(np.cumsum(n_g) - n_g, n_g)
                    ids = ids[np.repeat(first[go], n_g) + within]
                np.take(part, ids, axis=0, out=_wide(gathered[: ids.size * rb].reshape(-1, rb)))
                start = 0
                for b, stop in zip(b_g.tolist(), (np.cumsum(n_g) * rb).tolist()):
                    tl = int(pend_len[b])
                    end = tl + stop - start
                    if end < combine:  # (rows that do not divide a sector) behind the pending bytes
                        pend[b, tl:end] = gathered[start:stop]
                        pend_len[b] = end
                    else:
                        emit(b, gathered[start:stop])
                    start = stop
            for b in range(nb):  # every batch's last bytes, padded to a sector
                if pend_len[b]:
                    emit(b, None, last=True)
            flush()
            flush()  # waits for the other buffer's writes too
        for b, k in enumerate(batches):
            n = len(cold[b])
            start = offsets[k][i]
            if cursor[b] != start + round_up(n * rb):
                raise RuntimeError(f"packing epoch {self.epoch}: batch {k}'s section ends at {cursor[b]}, "
                                   f"expected {start + round_up(n * rb)}")  # fmt: skip
            self._sections[k][i] = (start, round_up(n * rb), n, ids_digest(cold[b].astype(np.int64)),
                                    hashers[b].hexdigest())  # fmt: skip

    # -- the end --------------------------------------------------------------------------------------
    def _section_entry(self, k: int, secs: list[Any]) -> list[Any]:
        """Batch ``k``'s sections as the manifest holds them; with a disk cache, each identified by all its cold
        ids (its own and the cached ones) and followed by how many are cached and in which segment."""
        full = self._full.get(k)
        if full is None:
            return secs
        return [None if s is None else [s[0], s[1], s[2], f[0], s[4], f[1], f[2]] for s, f in zip(secs, full)]

    def commit(self) -> Path:
        """Write the manifest, make everything durable and put the pack in place; its directory."""
        manifest = {
            "format": PACK_FORMAT,
            "identity": self.identity,
            "epoch": self.epoch,
            "types": [s.node_type for s in self.sources],
            "row_bytes": [s.row_bytes for s in self.sources],
            "batches": {
                "graph": {str(k): list(v) for k, v in self._records.items()},
                "sections": {str(k): self._section_entry(k, v) for k, v in self._sections.items() if k >= 0},
            },
            "caches": {"index": [CACHE_INDEX, self._cache_index_digest],
                       "segments": {str(g): v for g, v in self._caches.items()}} if self._caches else None,
            "report": {"batches": self.report.batches, "packed": self.report.packed, "rows": self.report.rows,
                       "bytes": self.report.bytes, "segments": self.report.segments,
                       "segment_batches": self.report.segment_batches, "threshold": self.report.threshold,
                       "cached_rows": self.report.cached_rows},  # fmt: skip
        }
        tmp = self.path / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / MANIFEST)
        fsync_dir(self.path)
        if os.path.lexists(self.final) and not remove_pack(self.final):
            raise _not_ours(self.final)
        os.replace(self.path, self.final)
        fsync_dir(self.parent)
        self._cold = {}
        return self.final

    def abort(self) -> None:
        """Remove what was written (after a failure or a stop)."""
        if self._graphs is not None:
            try:
                self._graphs.close()
            except Exception:  # noqa: BLE001 - removing the files is what matters
                pass
            self._graphs = None
        remove_pack_files(self.path)
        self._cold = {}
