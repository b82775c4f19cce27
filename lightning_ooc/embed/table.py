"""Trainable embedding tables on SSD: partitions of ``[embedding | optimiser state]`` rows, written back safely.

A table is one directory::

    meta.json                       what the table is (format, counts, dim, partition bounds, edge buckets);
                                    immutable, checksummed like a dataset's
    state.json                      the current generation and checksum of every partition; replaced
                                    atomically (write, fsync, rename, fsync the directory) after each write-back
    part-PPPPP.gGGGGGGGG.bin        partition P at generation G: its rows, row v = [embedding (dim) | Adagrad
                                    state (dim)] as float32, so one read brings both; zero-padded to 4 KiB
    buckets_{split}.npy, ...        the split's edges grouped into N x N buckets (lightning_ooc.embed.buckets)

Node ``v`` belongs to partition ``p`` when ``bounds[p] <= v < bounds[p + 1]``
(``bounds[p] = p * num_nodes // N``: ID ranges of near-equal size).

A write-back never overwrites a partition: it writes the rows to the next
generation's file (space reserved with ``posix_fallocate`` first, so a full
disk fails before anything is written), with direct I/O through
:class:`lightning_ooc.io.bulk.BulkFile` (io_uring where it works), syncs it,
then switches ``state.json`` to it and removes the old file. A process killed
at any point leaves the old generation or the new one in ``state.json``,
each complete; files of an interrupted write-back are removed the next time
the table is opened for writing. A table open for writing is locked
(``state.lock``), so two trainers never write one table.

Example::

    >>> import tempfile, torch
    >>> from lightning_ooc.embed.table import init_embeddings, EmbeddingTable
    >>> root = init_embeddings(tempfile.mkdtemp() + "/emb", num_nodes=10, dim=4, partitions=3, progress=False)
    >>> t = EmbeddingTable(root)
    >>> t.bounds.tolist(), t.row_floats, t.generation(1)
    ([0, 3, 6, 10], 8, 0)
    >>> buf = t.empty_partition()
    >>> rows = t.read_partition(1, buf)            # [rows of partition 1, 2 * dim] float32
    >>> rows.shape, bool((rows[:, 4:] == 0).all())  # state starts at zero
    (torch.Size([3, 8]), True)
    >>> rows[:, :4] += 1.0
    >>> t.write_partition(1, buf)
    1
    >>> torch.equal(t.rows(torch.tensor([3, 4, 5])), rows)
    True
    >>> t.verify(); t.close()
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import xxhash

from lightning_ooc.data.commit import TableLock, fsync_dir
from lightning_ooc.data.format import (
    FORMAT_NAME,
    META_FILE,
    TABLE_FORMAT_NAME,
    TABLE_FORMAT_VERSION,
    checksum_file,
    human_bytes,
    meta_digest,
)
from lightning_ooc.errors import (
    CorruptDatasetError,
    DatasetChangedError,
    DatasetError,
    DatasetNotFoundError,
    FormatVersionError,
    InputError,
    LightningOOCError,
)
from lightning_ooc.data.dataset import open_dataset
from lightning_ooc.data.writer import WriteTarget
from lightning_ooc.embed.buckets import dataset_edge_sources, array_edge_sources, write_buckets
from lightning_ooc.embed.rows import check_journal, replay_journal
from lightning_ooc.io.bulk import BulkFile, aligned_empty
from lightning_ooc.utils.progress import progress_bar

log = logging.getLogger("lightning_ooc")

TABLE_FORMAT = TABLE_FORMAT_NAME
TABLE_VERSION = TABLE_FORMAT_VERSION
STATE_FILE = "state.json"
STATE_PENDING = "state.json.pending"
STATE_FORMAT = "lightning_ooc.embeddings.state"
ALIGN = 4096
INITS = ("normal", "uniform", "zeros")
OPTIMIZERS = ("adagrad",)

_PART_RE = re.compile(r"^part-(\d{5})\.g(\d{8})\.bin$")


def part_name(p: int, generation: int) -> str:
    return f"part-{p:05d}.g{generation:08d}.bin"


def partition_bounds(num_nodes: int, partitions: int) -> np.ndarray:
    """``int64[N + 1]`` ID-range bounds of ``partitions`` near-equal partitions.

    >>> partition_bounds(10, 3).tolist(), partition_bounds(5, 4).tolist()
    ([0, 3, 6, 10], [0, 1, 2, 3, 5])
    """
    n, k = int(num_nodes), int(partitions)
    if k < 1:
        raise InputError(f"partitions must be at least 1, got {k}")
    if n < k:
        raise InputError(f"{n} nodes cannot fill {k} partitions; use at most {n} partitions")
    return (np.arange(k + 1, dtype=np.int64) * n) // k


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-int(n) // align) * align


def _digest(buf: Any) -> str:
    return xxhash.xxh3_128(memoryview(buf).cast("B")).hexdigest()


class EmbeddingTable:
    """An embedding table directory, opened for reading and writing back partitions.

    ``backend`` is the I/O backend of partition transfers (``"auto"``: io_uring
    with direct I/O where it works, logged once otherwise; see
    :class:`lightning_ooc.io.bulk.BulkFile`). ``writable=False`` opens without
    the lock and refuses :meth:`write_partition`.
    """

    def __init__(self, root: str | os.PathLike, *, writable: bool = True, backend: str = "auto", verify: bool = False):
        self.root = Path(root)
        self.backend = backend
        self.writable = bool(writable)
        self.meta = read_table_meta(self.root)
        m = self.meta
        self.num_nodes = int(m["num_nodes"])
        self.dim = int(m["dim"])
        self.num_partitions = int(m["partitions"])
        self.bounds = np.asarray(m["bounds"], dtype=np.int64)
        self.optimizer = str(m["optimizer"])
        self.row_floats = 2 * self.dim
        self.row_bytes = 4 * self.row_floats
        self.num_relations = int(m.get("num_relations", 1))
        sizes = np.diff(self.bounds)
        self.max_partition_rows = int(sizes.max())
        self.max_partition_nbytes = round_up(self.max_partition_rows * self.row_bytes)
        self._mu = threading.Lock()
        #: partition -> the generation whose file was checked against its checksum by this object
        self._verified: dict[int, int] = {}
        st = os.stat(self.root)
        self._identity = (st.st_dev, st.st_ino)
        self._lock = TableLock(self.root).acquire(self._held_by) if self.writable else None
        try:
            self._load_state()
            if self.writable:
                self._sweep()
            self._check_files()
            if self.writable:
                replay_journal(self)
                self._checksum_changed()
            if verify:
                self.verify()
        except BaseException:
            self.close()
            raise
        self.closed = False

    # -- opening -------------------------------------------------------------------
    def _load_state(self) -> None:
        path = self.root / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            raise CorruptDatasetError(f"{path}: missing; the table is incomplete: create it again with "
                                      "`lightning-ooc init-embeddings --overwrite`", path) from None
        except (OSError, ValueError) as e:
            raise CorruptDatasetError(f"{path}: cannot be read ({e}); the table is damaged", path) from None
        if state.get("format") != STATE_FORMAT or state.get("state_checksum") != meta_digest(
            {k: v for k, v in state.items() if k != "state_checksum"}
        ):
            raise CorruptDatasetError(f"{path}: not a valid table state (format or checksum); the table is damaged",
                                      path)  # fmt: skip
        gens, sums = state.get("generations"), state.get("checksums")
        if not (isinstance(gens, list) and isinstance(sums, list) and len(gens) == len(sums) == self.num_partitions):
            raise CorruptDatasetError(f"{path}: holds {len(gens or [])} partitions, {META_FILE} says "
                                      f"{self.num_partitions}", path)  # fmt: skip
        self._gens = [int(g) for g in gens]
        self._sums = [str(s) for s in sums]
        self.updates = int(state.get("updates", 0))

    def _sweep(self) -> None:
        """Remove what interrupted write-backs left: partition files of other generations, a pending state."""
        for name in sorted(os.listdir(self.root)):
            m = _PART_RE.match(name)
            stale = name == STATE_PENDING or (
                m is not None and (int(m.group(1)) >= self.num_partitions or int(m.group(2)) != self._gens[int(m.group(1))])
            )
            if stale:
                log.info("%s: removing %s, left by an interrupted write-back", self.root, name)
                try:
                    os.unlink(self.root / name)
                except FileNotFoundError:
                    pass

    def _checksum_changed(self) -> None:
        """Checksum again the partitions changed row by row by a run that ended before its checkpoint."""

        stale = [p for p in range(self.num_partitions) if not self._sums[p]]
        if stale:
            for p in stale:
                self._sums[p] = checksum_file(self.partition_path(p))
            with self._mu:
                self._commit_state()
            log.info("%s: checksummed partitions %s again (changed row by row by a run that did not finish)",
                     self.root, stale)  # fmt: skip

    def _check_files(self) -> None:
        for p in range(self.num_partitions):
            path = self.partition_path(p)
            want = self.partition_nbytes(p)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                raise CorruptDatasetError(f"{path}: partition {p} (generation {self._gens[p]}) is missing; the "
                                          "table is damaged", path) from None  # fmt: skip
            if size != want:
                raise CorruptDatasetError(f"{path}: {size} bytes, partition {p} needs {want}; the table is damaged",
                                          path)  # fmt: skip

    # -- layout --------------------------------------------------------------------
    def partition_rows(self, p: int) -> int:
        return int(self.bounds[p + 1] - self.bounds[p])

    def partition_nbytes(self, p: int) -> int:
        """Bytes of partition ``p``'s file: its rows, padded to 4 KiB."""
        return round_up(self.partition_rows(p) * self.row_bytes)

    def partition_path(self, p: int) -> Path:
        return self.root / part_name(p, self._gens[p])

    def generation(self, p: int) -> int:
        return self._gens[p]

    def partition_of(self, ids: Any) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        return np.searchsorted(self.bounds, ids, side="right") - 1

    def empty_partition(self) -> torch.Tensor:
        """Page-aligned host memory for the largest partition (``uint8[max_partition_nbytes]``)."""

        return aligned_empty(self.max_partition_nbytes)

    def rows_view(self, p: int, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` (bytes of a partition) seen as partition ``p``'s ``[rows, 2 * dim]`` float32 rows."""
        n = self.partition_rows(p)
        return buf.view(torch.uint8)[: n * self.row_bytes].view(torch.float32).view(n, self.row_floats)

    # -- transfers -----------------------------------------------------------------
    def _bytes(self, p: int, buf: torch.Tensor) -> torch.Tensor:
        flat = buf.view(torch.uint8).reshape(-1) if buf.is_contiguous() else None
        if flat is None or flat.numel() < self.partition_nbytes(p):
            raise InputError(f"partition {p} needs a contiguous buffer of {self.partition_nbytes(p)} bytes "
                             "(EmbeddingTable.empty_partition() makes one)")  # fmt: skip
        return flat[: self.partition_nbytes(p)]

    def read_partition(self, p: int, buf: torch.Tensor) -> torch.Tensor:
        """Read partition ``p`` into ``buf`` (page-aligned host memory) and return its rows view.

        The bytes read are checked against the partition's checksum in ``state.json``: a damaged
        partition raises :class:`~lightning_ooc.errors.CorruptDatasetError` naming its file, so it is
        never trained on, nor written back (and checksummed) as a new generation.
        """

        self._check_open()
        with self._mu:
            path, gen, want = self.partition_path(p), self._gens[p], self._sums[p]
        data = self._bytes(p, buf)
        self._check_same()
        try:
            with BulkFile(path, "r", self.backend) as f:
                f.read_into(0, data)
        except FileNotFoundError:
            raise self._gone(path) from None
        if want:  # empty: changed row by row by a run that did not finish (nothing to compare with)
            got = _digest(data.numpy())
            if got != want:
                raise self._damaged(p, path, got, want)
            with self._mu:
                self._verified[p] = gen
        return self.rows_view(p, buf)

    def check_partition(self, p: int) -> None:
        """Check partition ``p``'s file against its checksum in ``state.json`` (once per generation).

        A whole read of the file; for the paths that read the partition row by row (learnable features,
        :meth:`rows`) rather than whole (:meth:`read_partition`, which checks what it reads).
        """

        self._check_open()
        with self._mu:
            path, gen, want = self.partition_path(p), self._gens[p], self._sums[p]
            if not want or self._verified.get(p) == gen:
                return
        try:
            got = checksum_file(path)
        except FileNotFoundError:
            raise self._gone(path) from None
        if got != want:
            self._check_same()
            raise self._damaged(p, path, got, want)
        with self._mu:
            self._verified[p] = gen

    def _damaged(self, p: int, path: Path, got: str, want: str) -> CorruptDatasetError:
        return CorruptDatasetError(
            f"{path}: partition {p} is damaged (checksum {got}, {STATE_FILE} records {want}); nothing was trained on "
            f"it or written back. Restore the table from a copy, or create it again with `lightning-ooc "
            "init-embeddings --overwrite`", path)

    def _gone(self, path: Path) -> DatasetError:
        """The error for a partition file that vanished under this table: replaced, moved or removed."""
        try:
            st = os.stat(self.root)
            same = (st.st_dev, st.st_ino) == self._identity
        except FileNotFoundError:
            same = False
        if not same:
            return DatasetChangedError(
                f"{self.root}: the embedding table was replaced or removed while this run used it (opened as another "
                "directory); its trained rows since the last write-back are lost with this run. Start the run again "
                "on the table now there", self.root)  # fmt: skip
        return CorruptDatasetError(f"{path}: partition file removed while the table was in use (something other than "
                                   "lightning-ooc deleted it); the table is damaged", path)  # fmt: skip

    def _check_same(self) -> None:
        """Refuse to write into a directory that replaced the one this table opened."""
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            raise self._gone(self.root) from None
        if (st.st_dev, st.st_ino) != self._identity:
            raise self._gone(self.root)

    def write_partition(self, p: int, buf: torch.Tensor) -> int:
        """Write partition ``p``'s rows from ``buf`` as its next generation and switch to it; returns it."""

        self._check_open()
        if not self.writable:
            raise DatasetError(f"{self.root}: opened read-only; write-backs need EmbeddingTable(root, writable=True)",
                               self.root)  # fmt: skip
        data = self._bytes(p, buf)
        nrow = self.partition_rows(p) * self.row_bytes
        if nrow < data.numel():
            data[nrow:].zero_()  # the padding is part of the file and of its checksum
        with self._mu:
            gen = self._gens[p] + 1
        path = self.root / part_name(p, gen)
        self._check_same()
        try:
            with BulkFile(path, "w", self.backend, size=data.numel()) as f:
                f.write_from(0, data)
                f.sync()
        except BaseException:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            raise
        digest = _digest(data.numpy())
        with self._mu:
            old = self.partition_path(p)
            self._gens[p], self._sums[p] = gen, digest
            self._verified[p] = gen
            self.updates += 1
            self._commit_state()
        try:
            os.unlink(old)
        except FileNotFoundError:  # pragma: no cover - removed by hand
            pass
        return gen

    def _commit_state(self) -> None:
        """Replace ``state.json`` by the current generations (under ``self._mu``), never in a directory that
        replaced the one this table opened."""
        self._check_same()
        write_state(self.root, self._gens, self._sums, self.updates)

    # -- reading rows --------------------------------------------------------------
    def rows(self, ids: Any) -> torch.Tensor:
        """``[len(ids), 2 * dim]`` rows (embedding | state) read through the page cache (a reference, not
        the training path)."""
        self._check_open()
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_nodes):
            raise InputError(f"node ids must lie in [0, {self.num_nodes}) for {self.root}")
        out = torch.empty(ids.numel(), self.row_floats, dtype=torch.float32)
        parts = self.partition_of(ids.numpy())
        for p in np.unique(parts):
            sel = np.flatnonzero(parts == p)
            self.check_partition(int(p))
            with self._mu:
                path = self.partition_path(int(p))
            try:
                mm = np.memmap(path, dtype=np.float32, mode="r", shape=(self.partition_rows(int(p)), self.row_floats))
            except FileNotFoundError:
                raise self._gone(path) from None
            out[torch.from_numpy(sel)] = torch.from_numpy(np.array(mm[ids.numpy()[sel] - self.bounds[p]]))
            del mm
        return out

    def embeddings(self) -> torch.Tensor:
        """Every node's embedding, ``[num_nodes, dim]`` (for tables that fit in memory: evaluation, export)."""
        return self.rows(torch.arange(self.num_nodes))[:, : self.dim].contiguous()

    def verify(self) -> None:
        """Check every partition file against the checksum ``state.json`` holds for it."""
        for p in range(self.num_partitions):
            with self._mu:
                path, want = self.partition_path(p), self._sums[p]

            if not want:
                raise CorruptDatasetError(f"{path}: partition {p} was changed row by row after its last checksum by "
                                          "a run that did not finish (its rows are whole: each write-back is "
                                          "journalled); open the table for writing to checksum it again", path)
            got = checksum_file(path)
            if got != want:
                raise CorruptDatasetError(f"{path}: checksum {got} does not match {want} in {STATE_FILE}; partition "
                                          f"{p} is damaged", path)  # fmt: skip

    # -- lifetime ------------------------------------------------------------------
    def _held_by(self, holder: str) -> DatasetError:
        return DatasetError(f"{self.root}: the embedding table is open for writing by pid {holder}; stop that run "
                            "first, or open the table read-only (EmbeddingTable(root, writable=False))", self.root)  # fmt: skip

    def _check_open(self) -> None:
        if getattr(self, "closed", False):
            raise DatasetError(f"{self.root}: the embedding table was closed", self.root)

    def close(self) -> None:
        self.closed = True
        if getattr(self, "_lock", None) is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "EmbeddingTable":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"EmbeddingTable({str(self.root)!r}, nodes={self.num_nodes}, dim={self.dim}, "
                f"partitions={self.num_partitions}, {human_bytes(self.num_nodes * self.row_bytes)})")  # fmt: skip


def read_table_meta(root: str | os.PathLike) -> dict[str, Any]:
    """``meta.json`` of the embedding table at ``root``, checked (format, version, its own checksum).

    The one reader of a table's metadata: what opens a table, and what the datamodules and the command line
    read ``dim`` or ``num_relations`` from before opening it. A missing table, a dataset given where a
    table is expected, or an edited file is a one-line error naming the path and the fix.
    """
    root = Path(root)
    path = root / META_FILE
    create = "create one with `lightning-ooc init-embeddings DATASET --out DIR --dim D`"
    if not path.is_file():
        if not root.exists():
            raise DatasetNotFoundError(f"{root}: no such embedding table; {create}", root)
        raise DatasetNotFoundError(f"{root}: not an embedding table (no {META_FILE}); {create}", root)
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CorruptDatasetError(f"{path}: cannot be read as JSON ({e}); the table is damaged: create it "
                                  "again with `lightning-ooc init-embeddings --overwrite`", path) from None
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt == FORMAT_NAME:
        raise FormatVersionError(f"{root}: is a dataset, not an embedding table; make a table of its nodes with "
                                 f"`lightning-ooc init-embeddings {root} --out TABLE --dim D` and give TABLE", path)
    if fmt != TABLE_FORMAT:
        raise FormatVersionError(f"{path}: is not an embedding table (format {fmt!r}); pass the "
                                 "directory that `lightning-ooc init-embeddings` wrote", path)  # fmt: skip
    if meta.get("version") != TABLE_VERSION:
        raise FormatVersionError(f"{path}: embedding table version {meta.get('version')!r} is not readable by "
                                 f"this release (reads version {TABLE_VERSION})", path)
    if meta.get("meta_checksum") != meta_digest(meta):
        raise CorruptDatasetError(f"{path}: its checksum does not match its content (edited or damaged); "
                                  "create the table again", path)
    return meta


def write_state(root: Path, gens: Sequence[int], sums: Sequence[str], updates: int) -> None:
    """Write ``state.json`` atomically: a pending file, fsync, rename over the old one, fsync the directory."""
    body = {"format": STATE_FORMAT, "generations": [int(g) for g in gens], "checksums": list(sums),
            "updates": int(updates)}  # fmt: skip
    body["state_checksum"] = meta_digest(body)
    pending = root / STATE_PENDING
    with open(pending, "w") as f:
        json.dump(body, f)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(pending, root / STATE_FILE)
    fsync_dir(root)


# -- creation --------------------------------------------------------------------------
def _init_rows(p: int, lo: int, hi: int, dim: int, init: str, scale: float, seed: int) -> np.ndarray:
    """Rows ``[lo, hi)`` of partition ``p``: a random stream per (seed, partition, chunk start)."""
    g = torch.Generator().manual_seed(int(xxhash.xxh64_intdigest(f"{seed}:{p}:{lo}".encode())) & ((1 << 63) - 1))
    rows = torch.zeros(hi - lo, 2 * dim, dtype=torch.float32)
    if init == "normal":
        rows[:, :dim].normal_(0.0, scale, generator=g)
    elif init == "uniform":
        rows[:, :dim].uniform_(-scale, scale, generator=g)
    return rows.numpy()


def init_embeddings(
    out: str | os.PathLike,
    *,
    num_nodes: int | None = None,
    dim: int = 100,
    partitions: int = 1,
    init: str = "normal",
    scale: float = 1e-3,
    seed: int = 0,
    dataset: str | os.PathLike | None = None,
    edges: dict[str, Any] | None = None,
    num_relations: int | None = None,
    optimizer: str = "adagrad",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Create an embedding table at ``out`` and return its path.

    The nodes are those of ``dataset`` (an on-disk dataset; its training edges
    are grouped into edge buckets: the link split ``train`` if it has one, else
    its stored graph, and its ``val``/``test`` link splits as evaluation
    buckets), or ``num_nodes`` with ``edges``: ``{split: (src, dst)}`` or
    ``{split: (src, rel, dst)}`` arrays. Embeddings start ``normal`` (std
    ``scale``), ``uniform`` in ``[-scale, scale]`` or ``zeros``; the Adagrad
    state starts at zero. The same arguments give byte-identical partitions.
    Written like a dataset: in a partial directory beside ``out``, put in
    place by an atomic rename, nothing left behind on failure.
    """

    if init not in INITS:
        raise InputError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    if optimizer not in OPTIMIZERS:
        raise InputError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    dim = int(dim)
    if dim < 1:
        raise InputError(f"dim must be at least 1, got {dim}")
    if not math.isfinite(float(scale)) or float(scale) < 0:
        raise InputError(f"scale (--init-scale) must be a finite number >= 0, got {scale}")
    source: dict[str, Any] = {"init": init, "scale": float(scale), "seed": int(seed)}
    if dataset is not None:
        ds = open_dataset(dataset)
        if getattr(ds, "is_hetero", False):
            raise InputError(f"{dataset}: is a heterogeneous dataset (node types {', '.join(ds.node_types)}); "
                             "embedding tables hold the nodes of a homogeneous graph: prepare one graph of one node "
                             "type, or give num_nodes= and edges= for one type")  # fmt: skip
        if num_nodes is not None and int(num_nodes) != ds.num_nodes:
            raise InputError(f"num_nodes={num_nodes} disagrees with {dataset}, which has {ds.num_nodes} nodes")
        num_nodes = ds.num_nodes
        sources = dataset_edge_sources(ds)
        source["dataset"] = str(Path(dataset).absolute())
        source["dataset_identity"] = ds.identity
    elif num_nodes is not None:
        sources = array_edge_sources(edges or {}, int(num_nodes))
    else:
        raise InputError("init_embeddings needs a dataset or num_nodes")
    bounds = partition_bounds(int(num_nodes), partitions)
    rels = max([s.num_relations for s in sources.values()] + [1])
    if num_relations is not None:
        if int(num_relations) < rels:
            raise InputError(f"num_relations={num_relations} but the edges use relation ids up to {rels - 1}")
        rels = int(num_relations)
    row_bytes = 8 * dim
    total = sum(round_up(int(b) * row_bytes) for b in np.diff(bounds))
    target = WriteTarget(out, overwrite=overwrite, estimated_bytes=total + sum(s.nbytes for s in sources.values()),
                         inputs=[dataset])  # fmt: skip
    try:
        tmp = target.tmp
        bar = progress_bar(total, f"init-embeddings {Path(out).name}", unit="B", enabled=progress)
        sums = []
        chunk = max(1, (64 << 20) // row_bytes)
        for p in range(int(partitions)):
            n = int(bounds[p + 1] - bounds[p])
            h = xxhash.xxh3_128()
            with open(tmp / part_name(p, 0), "wb") as f:
                for lo in range(0, n, chunk):
                    rows = _init_rows(p, lo, min(n, lo + chunk), dim, init, float(scale), int(seed))
                    f.write(memoryview(rows).cast("B"))
                    h.update(memoryview(rows).cast("B"))
                    bar.update(rows.nbytes)
                pad = round_up(n * row_bytes) - n * row_bytes
                f.write(b"\0" * pad)
                h.update(b"\0" * pad)
                bar.update(pad)
                f.flush()
                os.fsync(f.fileno())
            sums.append(h.hexdigest())
        bar.close()
        files: dict[str, Any] = {}
        buckets = {name: write_buckets(tmp, name, src, bounds, files, progress=progress)
                   for name, src in sources.items()}  # fmt: skip
        write_state(tmp, [0] * int(partitions), sums, 0)
        meta = {
            "format": TABLE_FORMAT, "version": TABLE_VERSION, "num_nodes": int(num_nodes), "dim": dim,
            "dtype": "float32", "optimizer": optimizer, "row_layout": "embedding|state",
            "partitions": int(partitions), "bounds": bounds.tolist(), "num_relations": rels,
            "buckets": buckets, "files": files, "source": source,
        }  # fmt: skip
        path = target.commit(meta)
    except BaseException as e:
        target.exit(type(e), e)
        raise
    return path


def table_info(root: str | os.PathLike) -> dict[str, Any]:
    """What ``lightning-ooc info`` prints for a table."""
    with EmbeddingTable(root, writable=False) as t:
        return {
            "path": str(t.root), "num_nodes": t.num_nodes, "dim": t.dim, "partitions": t.num_partitions,
            "rows_per_partition": [t.partition_rows(p) for p in range(t.num_partitions)],
            "bytes": human_bytes(sum(t.partition_nbytes(p) for p in range(t.num_partitions))),
            "generations": list(t._gens), "updates": t.updates, "num_relations": t.num_relations,
            "buckets": {k: v["edges"] for k, v in t.meta.get("buckets", {}).items()},
        }  # fmt: skip


def iter_partitions(table: EmbeddingTable, buf: torch.Tensor | None = None) -> Iterable[tuple[int, torch.Tensor]]:
    """``(p, rows)`` for every partition in turn, through one buffer."""
    buf = table.empty_partition() if buf is None else buf
    for p in range(table.num_partitions):
        yield p, table.read_partition(p, buf)


def verify_table(root: str | os.PathLike) -> list[str]:
    """Every problem of a table in words (an empty list: it is sound).

    Opens it read-only (the open checks ``meta.json``, ``state.json`` and the
    partition sizes), then checks every partition and bucket file against its
    checksum and the bucket offsets against the edge counts.
    """

    try:
        t = EmbeddingTable(root, writable=False)
    except LightningOOCError as e:
        return [str(e)]
    problems: list[str] = []
    with t:
        pending = check_journal(t)
        if pending:
            problems.append(pending)
        try:
            t.verify()
        except LightningOOCError as e:
            problems.append(str(e))
        for key, entry in t.meta.get("files", {}).items():
            path = t.root / entry["name"]
            if not path.is_file():
                problems.append(f"{path}: missing ({key})")
            elif os.path.getsize(path) != int(entry["bytes"]) or checksum_file(path) != entry.get("checksum"):
                problems.append(f"{path}: size or checksum differs from {META_FILE}; the file is damaged")
        for split, info in t.meta.get("buckets", {}).items():
            path = t.root / f"buckets_{split}_offsets.npy"
            if not path.is_file():
                continue  # reported above as missing
            try:
                off = np.load(path)
            except (OSError, ValueError) as e:
                problems.append(f"{path}: cannot be read ({e})")
                continue
            n = t.num_partitions
            if off.size != n * n + 1 or off[0] != 0 or off[-1] != int(info["edges"]) or np.any(np.diff(off) < 0):
                problems.append(f"{t.root}: the {split} bucket offsets do not describe {info['edges']} edges in "
                                f"{n} x {n} buckets")  # fmt: skip
    return problems
