"""Packed minibatches (DiskGNN): an epoch's batches sampled ahead, each batch's cold rows stored contiguously.

An *epoch pack* is a directory ``epoch-EEEEEE`` written by
:class:`~lightning_ooc.store.pack_writing.EpochPackWriter` and read here. It holds, for every training batch
of one epoch of one rank:

* the sampled batch itself (``graphs.bin``: PyG's ``Data`` / ``HeteroData`` fields, :func:`encode_batch`),
  so training reads it instead of sampling it again;
* per node type with features, the rows of the batch that no cache holds (its *cold* rows, sorted by
  node id), contiguous and sector-aligned (``chunks.bin``): one sequential read per batch and type, with
  no read amplification beyond the last sector;
* where packing every batch's rows apart would take more than ``pack_space``, a disk cache per segment of
  consecutive batches in ``chunks.bin`` too (:mod:`lightning_ooc.store.diskcache`): the rows several of
  the segment's batches share, stored once, laid out so that a batch's rows share few sectors, with their
  ids and a checksum of each row in ``caches.npz``;
* ``manifest.json``, written last: what the pack was made for (its *identity*: the dataset's identity, the
  sampling settings, the rank, the host cache's rows), where each batch's record and sections are, and an
  XXH3 checksum of each. A directory without it is an interrupted write and is never read: the writer
  works in ``epoch-EEEEEE.partial`` and renames it when the manifest is durable.

A pack's identity pins it to the feature files it was packed from (:func:`file_fingerprint`: their size,
modification time, inode and sampled blocks, as a file used in place is pinned), so a file rewritten in place
with ``meta.json`` unchanged makes every pack of it stale. Removing a pack (:func:`remove_pack`) deletes the
files a pack holds (:data:`PACK_FILES`) and nothing else: a file put into a pack directory stays, with it.

:class:`PackedChunkTier` is the tier of the chain that serves a batch's cold rows from its section: it
claims the ids a batch asks for only when they are exactly the section's (same count, same XXH3 of the
sorted ids), reads the section into a buffer of its own in ``fill`` (one direct read, checksum checked)
and writes the rows into ``x`` in ``gather_into``. Ids it does not claim (an epoch without a pack, a
batch left out of one) go on down the chain to the feature buffer and direct reads, as before.

Example::

    >>> import torch
    >>> from torch_geometric.data import Data
    >>> d = Data(n_id=torch.tensor([4, 1, 7]), edge_index=torch.tensor([[1, 2], [0, 0]]), batch_size=1)
    >>> d2 = decode_batch(torch.from_numpy(np.frombuffer(encode_batch(d), dtype=np.uint8).copy()))
    >>> d2.n_id.tolist(), d2.edge_index.tolist(), d2.batch_size
    ([4, 1, 7], [[1, 2], [0, 0]], 1)
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from lightning_ooc.data.format import human_bytes
from lightning_ooc.data.in_place import fingerprint, recorded_path
from lightning_ooc.errors import CorruptDatasetError, DatasetError
from lightning_ooc.io.bulk import PAGE, BulkFile, aligned_empty, round_up
from lightning_ooc.io.reader import FeatureReader
from lightning_ooc.store.diskcache import locate, row_sums
from lightning_ooc.store.pinning import host_register, host_unregister
from lightning_ooc.store.tier import FeatureTier, Fence, Lease, wait_fence
from lightning_ooc.utils import trace
from lightning_ooc.utils.cancel import NEVER, CancelToken

log = logging.getLogger("lightning_ooc")

#: the version of an epoch pack's layout (``manifest.json`` ``format``)
PACK_FORMAT = 2
MANIFEST = "manifest.json"
GRAPHS = "graphs.bin"
CHUNKS = "chunks.bin"
#: the disk caches' index: each cache's ids in file order and each row's checksum (NumPy ``.npz``)
CACHE_INDEX = "caches.npz"
PARTIAL = ".partial"
#: every file an epoch pack holds, and the manifest's name while it is written: the only files a removal deletes
PACK_FILES = (MANIFEST, MANIFEST + ".tmp", GRAPHS, CHUNKS, CACHE_INDEX)
#: records in ``graphs.bin`` start at multiples of this (so tensors decoded in place are aligned)
RECORD_ALIGN = 64
_MAGIC = b"LOOCBAT1"
#: seconds :meth:`SectionBuffers.resize` waits for buffers a closed run still holds
RESIZE_WAIT = 60.0


def epoch_dirname(epoch: int) -> str:
    """The directory name of epoch ``epoch``'s pack."""
    return f"epoch-{int(epoch):06d}"


def ids_digest(sorted_ids: torch.Tensor | np.ndarray) -> str:
    """XXH3-64 of sorted node ids as int64: what identifies a batch's cold rows."""
    a = sorted_ids.numpy() if isinstance(sorted_ids, torch.Tensor) else np.asarray(sorted_ids)
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(a, dtype=np.int64).data)


def rows_digest(buf: Any) -> str:
    """XXH3-128 of a section's row bytes."""
    return xxhash.xxh3_128_hexdigest(buf)


# -------------------------------------------------------------------------------------------------
# batches as bytes
# -------------------------------------------------------------------------------------------------
def _store_items(data: Any) -> list[tuple[Any, str, Any]]:
    from torch_geometric.data import HeteroData  # lazy: PyG imports take a second

    items: list[tuple[Any, str, Any]] = []
    if isinstance(data, HeteroData):
        for key, store in data.to_dict().items():
            where = None if key == "_global_store" else (list(key) if isinstance(key, tuple) else key)
            items.extend((where, attr, v) for attr, v in store.items())
    else:
        items.extend((None, attr, v) for attr, v in data.to_dict().items())
    return items


def _plain(value: Any, what: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, what) for v in value]
    raise TypeError(f"a packed batch cannot hold {what} of type {type(value).__name__}: tensors, numbers, strings "
                    "and lists of them only")  # fmt: skip


def encode_batch(data: Any) -> bytes:
    """A sampled batch (PyG ``Data`` or ``HeteroData``) as bytes: a JSON header, then each tensor's bytes.

    Tensors go as raw bytes (dtype and shape in the header), other fields as JSON; ``batch_index`` (set by
    the run) and ``x`` (the features, stored apart) are left out.
    """
    from torch_geometric.data import HeteroData  # lazy: PyG imports take a second

    entries, blobs, off = [], [], 0
    for where, attr, v in _store_items(data):
        if attr in ("batch_index", "x"):
            continue
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            entries.append([where, attr, {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                          "offset": off, "bytes": len(raw)}])  # fmt: skip
            pad = -len(raw) % 8
            blobs.append(raw + b"\0" * pad)
            off += len(raw) + pad
        else:
            entries.append([where, attr, {"value": _plain(v, f"{attr!r}")}])
    header = json.dumps({"kind": "hetero" if isinstance(data, HeteroData) else "data", "entries": entries},
                        separators=(",", ":")).encode()  # fmt: skip
    header += b" " * (-(len(_MAGIC) + 8 + len(header)) % 8)
    return b"".join([_MAGIC, struct.pack("<Q", len(header)), header, *blobs])


def decode_batch(buf: torch.Tensor) -> Any:
    """The batch :func:`encode_batch` wrote, from a uint8 tensor starting at an 8-byte aligned address (its
    tensors are views of ``buf``, which they keep alive)."""
    from torch_geometric.data import Data, HeteroData  # lazy: PyG imports take a second

    raw = buf.numpy()
    if raw[: len(_MAGIC)].tobytes() != _MAGIC:
        raise ValueError("not a packed batch record (bad magic)")
    (hlen,) = struct.unpack("<Q", raw[len(_MAGIC) : len(_MAGIC) + 8].tobytes())
    start = len(_MAGIC) + 8
    head = json.loads(raw[start : start + hlen].tobytes())
    base = start + hlen
    data = HeteroData() if head["kind"] == "hetero" else Data()
    for where, attr, spec in head["entries"]:
        if "value" in spec:
            value = spec["value"]
        else:
            dtype = getattr(torch, spec["dtype"])
            lo = base + spec["offset"]
            if spec["bytes"]:
                value = buf[lo : lo + spec["bytes"]].view(dtype).reshape(spec["shape"])
            else:
                value = torch.empty(spec["shape"], dtype=dtype)
        store = data if where is None else data[tuple(where) if isinstance(where, list) else where]
        setattr(store, attr, value)
    return data


# -------------------------------------------------------------------------------------------------
# one committed epoch pack
# -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Section:
    """Where one batch's cold rows of one node type are: ``rows`` rows at ``offset`` of ``chunks.bin``
    (``nbytes`` sector-aligned bytes), checked by ``checksum``, and ``cached`` more in the disk cache of
    segment ``segment``; all of them identified by ``ids`` (:func:`ids_digest` of their sorted ids)."""

    offset: int
    nbytes: int
    rows: int
    ids: str
    checksum: str
    cached: int = 0
    segment: int = -1


@dataclass(frozen=True)
class CacheSegment:
    """One segment's disk cache of one node type: rows ``row_start ...`` of ``chunks.bin`` seen as rows;
    ``sorted_ids`` its ids in order, ``sorted_pos`` where each is in the cache, ``sums`` each row's
    :func:`~lightning_ooc.store.diskcache.row_sums` in file order."""

    row_start: int
    sorted_ids: np.ndarray
    sorted_pos: np.ndarray
    sums: np.ndarray


class EpochPack:
    """A committed epoch pack (see the module docstring), opened for reading.

    ``open`` returns ``None`` for a directory that is not a pack of ``identity`` (another dataset, other
    sampling settings, another host cache): such a pack is never read.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], backend: str = "auto"):
        self.path = Path(path)
        self.manifest = manifest
        self.epoch = int(manifest["epoch"])
        self.types: list[str | None] = list(manifest["types"])
        b = manifest["batches"]
        self._graph = {int(k): tuple(v) for k, v in b["graph"].items()}
        self._sections = {int(k): [None if s is None else Section(*s) for s in v] for k, v in b["sections"].items()}
        self._cache_meta = manifest.get("caches")
        self._cache_segments: dict[tuple[int, int], CacheSegment] | None = None
        self._readers: dict[int, FeatureReader] = {}
        self._backend = backend
        self._files: dict[str, BulkFile] = {}
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def open(cls, path: str | os.PathLike, identity: dict[str, Any], backend: str = "auto") -> "EpochPack | None":
        path = Path(path)
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            if manifest.get("format") != PACK_FORMAT or manifest.get("identity") != identity:
                return None
            pack = cls(path, manifest, backend)
            # files cut short (a removal that a kill interrupted) are not a pack
            graphs = max((o + n for o, n, _ in pack._graph.values()), default=0)
            chunks = max((s.offset + s.nbytes for secs in pack._sections.values() for s in secs if s is not None),
                         default=0)  # fmt: skip
            if pack._cache_meta:
                rbs = manifest["row_bytes"]
                chunks = max([chunks] + [start + round_up(n * rbs[i]) for entry in pack._cache_meta["segments"].values()
                                         for i, (start, n) in enumerate(entry)])  # fmt: skip
                if not (path / pack._cache_meta["index"][0]).is_file():
                    return None
            if (path / GRAPHS).stat().st_size < graphs or (path / CHUNKS).stat().st_size < chunks:
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return pack

    @property
    def batches(self) -> list[int]:
        """The batches of the epoch that the pack holds, in order."""
        return sorted(self._graph)

    def has(self, k: int) -> bool:
        return k in self._graph

    def section(self, k: int, type_index: int) -> Section | None:
        s = self._sections.get(k)
        return None if s is None else s[type_index]

    @property
    def has_caches(self) -> bool:
        """Whether the pack has disk caches (its batches may have rows in them)."""
        return bool(self._cache_meta)

    def load_caches(self) -> None:
        """Read the disk caches' index once (checksum checked): before a run, not on its first batch."""
        with self._lock:
            if self._cache_segments is not None or not self._cache_meta:
                return
            name, digest = self._cache_meta["index"]
            raw = (self.path / name).read_bytes()
            if xxhash.xxh3_128_hexdigest(raw) != digest:
                raise CorruptDatasetError(f"{self.path / name}: does not match its checksum; the pack is damaged: "
                                          "delete the directory (it is rebuilt)", self.path)  # fmt: skip
            arrays = np.load(io.BytesIO(raw))
            rbs = self.manifest["row_bytes"]
            segs = {}
            for g, entry in self._cache_meta["segments"].items():
                for i, (start, _n) in enumerate(entry):
                    ids = arrays[f"ids_{g}_{i}"]
                    order = np.argsort(ids, kind="stable")
                    segs[(int(g), i)] = CacheSegment(start // rbs[i], ids[order], order.astype(np.int64),
                                                     arrays[f"sums_{g}_{i}"])  # fmt: skip
            self._cache_segments = segs

    def cache(self, segment: int, type_index: int) -> CacheSegment:
        """Segment ``segment``'s disk cache of node type ``type_index``."""
        self.load_caches()
        return self._cache_segments[(int(segment), int(type_index))]

    def rows_reader(self, type_index: int, num_features: int, dtype: torch.dtype) -> FeatureReader:
        """A reader of ``chunks.bin`` as rows of node type ``type_index`` (its disk caches are read through it:
        whole blocks, touching rows merged into one read); opened once, closed with the pack."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.path}: the epoch pack is closed")
            r = self._readers.get(type_index)
            if r is None:
                path = self.path / CHUNKS
                row_bytes = self.manifest["row_bytes"][type_index]
                r = self._readers[type_index] = FeatureReader(path, num_features, dtype, backend=self._backend,
                                                              num_rows=os.path.getsize(path) // row_bytes)  # fmt: skip
            return r

    @property
    def max_section_bytes(self) -> list[int]:
        """The largest section of each node type."""
        out = [0] * len(self.types)
        for secs in self._sections.values():
            for i, s in enumerate(secs):
                if s is not None:
                    out[i] = max(out[i], s.nbytes)
        return out

    def _file(self, name: str) -> BulkFile:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.path}: the epoch pack is closed")
            f = self._files.get(name)
            if f is None:
                f = self._files[name] = BulkFile(self.path / name, "r", backend=self._backend)
            return f

    def load_batch(self, k: int) -> Any:
        """Batch ``k`` as it was sampled (one read of its record, checksum checked)."""
        offset, length, checksum = self._graph[k]
        lo = offset - offset % PAGE
        buf = aligned_empty(round_up(offset + length) - lo)
        with trace.span("packed.graph", bytes=buf.numel()):
            self._file(GRAPHS).read_into(lo, buf)
        rec = buf[offset - lo : offset - lo + length]
        if rows_digest(rec.numpy().data) != checksum:
            raise CorruptDatasetError(f"{self.path / GRAPHS}: the record of batch {k} does not match its checksum; "
                                      "the pack is damaged: delete the directory (it is rebuilt)", self.path)  # fmt: skip
        return decode_batch(rec)

    def read_section(self, sec: Section, out: torch.Tensor, row_bytes: int) -> torch.Tensor:
        """Read a section into ``out`` (aligned, at least ``sec.nbytes``); its row bytes, checksum checked."""
        self._file(CHUNKS).read_into(sec.offset, out[: sec.nbytes])
        rows = out[: sec.rows * row_bytes]
        if rows_digest(rows.numpy().data) != sec.checksum:
            raise CorruptDatasetError(f"{self.path / CHUNKS}: a section at offset {sec.offset} does not match its "
                                      "checksum; the pack is damaged: delete the directory (it is rebuilt)",
                                      self.path)  # fmt: skip
        return rows

    def close(self) -> None:
        with self._lock:
            files, self._files = list(self._files.values()), {}
            readers, self._readers = list(self._readers.values()), {}
            self._closed = True
        for f in files:
            f.close()
        for r in readers:
            r.close()


def file_fingerprint(path: str | os.PathLike, offset: int, data_bytes: int) -> dict[str, Any]:
    """What pins a pack to the feature file it was packed from (rows of ``data_bytes`` from byte ``offset``),
    as :mod:`~lightning_ooc.data.in_place` pins a file used in place: its size, modification time and inode, and
    checksums of its first bytes and of blocks sampled over its rows, all read through one descriptor. The device
    number is left out, as there: network and virtual file systems get a new one at every mount.

    >>> import tempfile
    >>> f = Path(tempfile.mkdtemp()) / "features.bin"
    >>> _ = f.write_bytes(bytes(range(256)) * 64)
    >>> before = file_fingerprint(f, 0, 16384)
    >>> with open(f, "r+b") as out:  # rewritten in place: the same size, other rows
    ...     _ = out.write(bytes(16384))
    >>> after = file_fingerprint(f, 0, 16384)
    >>> after["bytes"] == before["bytes"], after["sample"] == before["sample"]
    (True, False)
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        name = recorded_path(path)
        raise DatasetError(f"{name}: the feature file cannot be read to pin packs to it ({e.strerror}); check its "
                           "permissions", name) from None  # fmt: skip
    try:
        st = os.fstat(fd)
        header, sample = fingerprint(fd, int(offset), int(data_bytes))
    finally:
        os.close(fd)
    return {"bytes": int(st.st_size), "mtime_ns": int(st.st_mtime_ns), "inode": int(st.st_ino), "header": header,
            "sample": sample}  # fmt: skip


def _is_dir(path: Path) -> bool:
    """Whether ``path`` is a directory itself (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_pack_files(path: str | os.PathLike) -> bool:
    """Delete the files of an epoch pack in ``path`` (the regular files named in :data:`PACK_FILES`) and the
    directory once that empties it; whether nothing is left at ``path``. Anything else in it (a file this package
    did not write) stays, and the directory with it, with a warning."""
    path = Path(path)
    if not _is_dir(path):
        return not os.path.lexists(path)
    for name in PACK_FILES:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(path / name).st_mode):
                os.unlink(path / name)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        try:
            others = sorted(os.listdir(path))
        except OSError:
            others = []
        log.warning("lightning_ooc: %s holds files this package did not write (%s); they were left as they are, "
                    "with the directory: move or remove them", path, ", ".join(others[:3]) + (
                        ", ..." if len(others) > 3 else ""))  # fmt: skip
        return False
    return True


def remove_pack(path: str | os.PathLike) -> bool:
    """Remove an epoch pack: renamed to a ``.partial`` name first (one step), so that a kill during the removal
    leaves a directory that is never read and is removed at the next start, not a manifest without its data.
    Only the pack's own files are deleted (:func:`remove_pack_files`); whether nothing is left at ``path``."""
    path = Path(path)
    if not _is_dir(path):  # a file or a link of that name is not a pack of ours
        return not os.path.lexists(path)
    # not the name a writer of the same epoch works under (epoch-N.partial): that one may be about to replace it
    doomed = path.with_name(path.name + ".removed" + PARTIAL) if not path.name.endswith(PARTIAL) else path
    if doomed != path:
        if os.path.lexists(doomed) and not remove_pack_files(doomed):
            return remove_pack_files(path)  # no room to move it aside: its files go where they are
        try:
            os.replace(path, doomed)
        except FileNotFoundError:
            return True
        except OSError:
            return remove_pack_files(path)
    remove_pack_files(doomed)
    return True


# -------------------------------------------------------------------------------------------------
# the tier
# -------------------------------------------------------------------------------------------------
class SectionBuffers:
    """Aligned host buffers for sections being read and gathered; ``acquire`` waits (cancel-aware) for one.

    Up to ``count`` buffers of the largest section each, as many as ``budget`` bytes hold (at least one),
    allocated by :meth:`resize` between runs; pinned on a GPU so the trainer's copies out of them are
    asynchronous.
    """

    def __init__(self, count: int, pin: bool = False, budget: int | None = None):
        self.most = max(1, int(count))
        self.count = self.most
        #: bytes the buffers may take together (at least one buffer is made whatever its size)
        self.budget = budget
        self.nbytes = 0
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self._pinned: list[int] = []
        self._cond = threading.Condition()

    def resize(self, nbytes: int) -> None:
        """Buffers of at least ``nbytes`` (call only while none is handed out)."""
        nbytes = round_up(max(int(nbytes), PAGE))
        with self._cond:
            if nbytes <= self.nbytes:
                return
            deadline = time.monotonic() + RESIZE_WAIT
            while len(self._free) != len(self._all):  # a closed run's releaser may still be handing some back
                if time.monotonic() > deadline:
                    raise RuntimeError(f"section buffers still in use after {RESIZE_WAIT:.0f} s: a run that used "
                                       "them was not closed")  # fmt: skip
                self._cond.wait(0.1)
            self._unpin()
            self.count = self.most if self.budget is None else max(1, min(self.most, self.budget // nbytes))
            if self.count < min(2, self.most):
                log.warning("lightning_ooc: a packed section takes %s, so half of pack_memory (%s per node type) holds "
                            "one section buffer: batches read their sections one at a time; raise pack_memory to "
                            "at least %s", human_bytes(nbytes), human_bytes(self.budget or 0),
                            human_bytes(4 * nbytes))  # fmt: skip
            self._all = [aligned_empty(nbytes, hugepages=True) for _ in range(self.count)]
            self._free = list(self._all)
            self.nbytes = nbytes
            if self.pin:
                self._pinned = [b.data_ptr() for b in self._all if host_register(b.data_ptr(), nbytes, "packed sections")]

    def acquire(self, cancel: CancelToken = NEVER) -> torch.Tensor:
        with self._cond:
            while not self._free:
                cancel.wait(self._cond)
            return self._free.pop()

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify_all()

    def _unpin(self) -> None:
        for ptr in self._pinned:
            host_unregister(ptr)
        self._pinned = []

    def close(self) -> None:
        with self._cond:
            self._unpin()
            self._all, self._free, self.nbytes = [], [], 0


class PackedChunkTier(FeatureTier):
    """Serves a batch's cold rows of one node type from its section of the current epoch pack.

    The pass source sets the pack of the training run with :meth:`use` (``None``: nothing packed, every
    claim is empty). A claim needs the batch (:meth:`claim_for`, which the store calls with the sampled
    batch): its ``batch_index`` names the section. Rows go through ``count`` section buffers; a buffer goes
    back after the gather's fence.
    """

    name = "packed"

    def __init__(self, node_type: str | None, type_index: int, num_features: int, dtype: torch.dtype,
                 row_bytes: int, buffers: SectionBuffers):  # fmt: skip
        self.node_type = node_type
        self.type_index = int(type_index)
        self.num_features = int(num_features)
        self.dtype = dtype
        self.row_bytes = int(row_bytes)
        self.buffers = buffers
        self.pack: EpochPack | None = None
        #: sections served and batches whose rows differed from their section's, since :meth:`take_counts`
        self._counts = {"sections": 0, "mismatched": 0}
        self._count_lock = threading.Lock()
        self._warned = False

    def _count(self, name: str) -> None:
        with self._count_lock:
            self._counts[name] += 1

    def take_counts(self) -> dict[str, int]:
        """Sections served and batches not served for a mismatch, since the last call."""
        with self._count_lock:
            out, self._counts = self._counts, {"sections": 0, "mismatched": 0}
        return out

    def use(self, pack: EpochPack | None) -> None:
        """Serve the sections of ``pack`` from now on (between runs)."""
        self.pack = pack
        if pack is not None:
            self.buffers.resize(pack.max_section_bytes[self.type_index])
            pack.load_caches()

    def _none(self, ids: torch.Tensor) -> Lease:
        return Lease(self, torch.zeros(ids.numel(), dtype=torch.bool), None)

    def claim(self, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        return self._none(ids)  # without the batch there is no section to serve from

    def _mismatch(self, k: int, pack: EpochPack, asked: int, held: int) -> None:
        self._count("mismatched")
        if not self._warned:
            self._warned = True
            log.warning("lightning_ooc: batch %d of epoch %d asks for other rows (%d) than its packed section "
                        "holds (%d); its rows are read from the feature file instead", k, pack.epoch, asked, held)
        return None

    def claim_for(self, batch: Any, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        pack, k = self.pack, getattr(batch, "batch_index", None)
        sec = pack.section(int(k), self.type_index) if pack is not None and k is not None else None
        if sec is None:
            return self._none(ids)
        sorted_ids, order = torch.sort(ids.to(torch.int64))
        if sec.rows + sec.cached != ids.numel() or ids_digest(sorted_ids) != sec.ids:
            self._mismatch(int(k), pack, ids.numel(), sec.rows + sec.cached)
            return self._none(ids)
        handle = {"sec": sec, "order": order, "pack": pack}
        if sec.cached:
            seg = pack.cache(sec.segment, self.type_index)
            s = sorted_ids.numpy()
            cached, at = locate(s, seg.sorted_ids)
            if int(cached.sum()) != sec.cached:
                self._mismatch(int(k), pack, ids.numel(), sec.rows + sec.cached)
                return self._none(ids)
            where = seg.sorted_pos[at[cached]]  # place in the cache of each cached id, in id order
            c = torch.from_numpy(cached)
            handle.update(order=order[~c], cache_order=order[c], cache_rows=seg.row_start + where,
                          cache_sums=seg.sums[where])  # fmt: skip
        handle["buf"] = self.buffers.acquire(cancel)
        return Lease(self, torch.ones(ids.numel(), dtype=torch.bool), handle)

    def fill(self, lease: Lease, cancel: CancelToken = NEVER) -> None:
        h = lease.handle
        if h is None:
            return
        cancel.check()
        sec: Section = h["sec"]
        with trace.span("packed.read", bytes=sec.nbytes):
            h["rows"] = h["pack"].read_section(sec, h["buf"], self.row_bytes)
        s = lease.stats  # rows read from SSD, as the direct reads count them
        s.misses, s.bytes_requested, s.bytes_read, s.ios = sec.rows, sec.rows * self.row_bytes, sec.nbytes, 1
        if sec.cached:
            cancel.check()
            with trace.span("packed.cache", rows=sec.cached):
                reader = h["pack"].rows_reader(self.type_index, self.num_features, self.dtype)
                got = reader.gather_async(h["cache_rows"], pin_memory=self.buffers.pin)
                rows = got.wait()
            raw = rows.view(torch.uint8).numpy().reshape(-1, self.row_bytes)
            if not np.array_equal(row_sums(raw), h["cache_sums"]):
                raise CorruptDatasetError(f"{h['pack'].path / CHUNKS}: rows of segment {sec.segment}'s disk cache "
                                          "do not match their checksums; the pack is damaged: delete the directory "
                                          "(it is rebuilt)", h["pack"].path)  # fmt: skip
            h["cached_rows"] = rows
            st = got.stats
            s.misses += sec.cached
            s.bytes_requested += sec.cached * self.row_bytes
            s.bytes_read += st.bytes_read
            s.ios += st.num_ios
        self._count("sections")

    def _rows(self, lease: Lease) -> torch.Tensor:
        h = lease.handle
        return h["rows"].view(self.dtype).view(-1, self.num_features)

    def rows(self, lease: Lease, device: torch.device) -> torch.Tensor:
        h = lease.handle
        out = torch.empty((h["sec"].rows + h["sec"].cached, self.num_features), dtype=self.dtype, device=device)
        out[h["order"].to(device)] = self._rows(lease).to(device, non_blocking=True)
        if h["sec"].cached:
            out[h["cache_order"].to(device)] = h["cached_rows"].to(device, non_blocking=True)
        return out

    def pin(self, lease: Lease) -> None:
        h = lease.handle
        if h is not None:
            for key in ("order", "cache_order"):
                if key in h:
                    h[key] = h[key].pin_memory()

    def gather_into(self, lease: Lease, x: torch.Tensor, positions: torch.Tensor) -> None:
        # section row j is the j-th smallest of the batch's own ids: it goes where that id is in the batch
        h = lease.handle
        order = h["order"].to(x.device, non_blocking=True)
        x.index_copy_(0, positions[order], self._rows(lease).to(x.device, non_blocking=True))
        if h["sec"].cached:  # cached row j: the j-th smallest of its cached ids
            order = h["cache_order"].to(x.device, non_blocking=True)
            x.index_copy_(0, positions[order], h["cached_rows"].to(x.device, non_blocking=True))

    def release(self, lease: Lease, fence: Fence | None = None) -> None:
        if lease.released:
            return
        wait_fence(fence)  # the rows may still be in a host-to-device copy
        lease.released = True
        if lease.handle is not None:
            buf, lease.handle = lease.handle["buf"], None
            self.buffers.release(buf)

    def close(self) -> None:
        self.pack = None
        self.buffers.close()

