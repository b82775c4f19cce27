"""Partitioning a dataset's nodes across machines (``lightning-ooc partition``).

Several machines train one graph whose features do not fit one machine's
disk: the topology (CSC) is replicated, the feature rows are partitioned. Each
machine gets one part directory, a dataset of the usual format holding the
full topology and labels (and node times, where the source has them), the
splits restricted to the nodes it owns, the rows of those nodes only
(``features.bin``, ascending global id), and two files more: ``nodes.npy``
(the global id of each row) and ``owner.npy`` (the part of every node). See
``docs/format.md``, "Partitioned datasets".

Partitioners (:func:`partition_nodes`):

* ``metis``: METIS (the ``pymetis`` package) on the symmetrised graph, with
  two balance constraints (node count and training seeds);
* ``fennel``: streaming, edge-cut reducing (Tsourakakis et al., WSDM'14): node
  ``v`` goes to the part ``p`` maximising ``|N(v) & P_p| - alpha gamma |P_p|^(gamma-1)``
  (``gamma = 1.5``, ``alpha = sqrt(P) E / N^1.5``), under a hard capacity of
  ``1.05 N / P`` nodes and ``1.05 T / P`` training seeds per part;
* ``ldg``: linear deterministic greedy (Stanton and Kliot, KDD'12):
  ``|N(v) & P_p| (1 - |P_p| / C)``, same capacities;
* ``random`` (seeded, node and training-seed counts balanced exactly) and
  ``range`` (contiguous id ranges);
* ``auto``: ``metis`` when ``pymetis`` imports, else ``fennel``.

The streaming partitioners take the nodes in a seeded random order, in chunks:
the in-neighbours (``indices`` of the CSC, memory-mapped) of a chunk's nodes
are counted per part at once (assignments made before the chunk), then the
chunk's nodes are placed one by one against the live part sizes.

Writing (:func:`partition_dataset`) builds the whole output directory beside
its target (``.DIR.partial-PID-TOKEN``, under the target's lock, as every
writer of :mod:`lightning_ooc.data.writer` does), each part directory itself
with a :class:`~lightning_ooc.data.writer.DatasetWriter` inside it, and
``partition.json`` last; the directory is then renamed into place in one
step, so a killed run never leaves an output that looks complete.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lightning_ooc.data.format import (
    META_FILE,
    SPLITS,
    NpyStreamWriter,
    new_hasher,
)
from lightning_ooc.errors import (
    CorruptDatasetError,
    DatasetNotFoundError,
    DatasetWriteError,
    FormatVersionError,
    InputError,
    InterruptedAfterCommit,
)
from lightning_ooc.data.writer import DatasetWriter, WriteTarget
from lightning_ooc.utils.progress import progress_bar
from lightning_ooc.data.commit import (
    _foreign_entries,
    backups,
    deferred_signals,
    fsync_dir,
    put_in_place,
    recover,
    remove_dataset,
    write_json_last,
)
from lightning_ooc.data.dataset import open_dataset, partition_owner_dtype

log = logging.getLogger("lightning_ooc")

MANIFEST = "partition.json"
MANIFEST_FORMAT = "lightning-ooc-partition"
MANIFEST_VERSION = 1
OWNER_FILE = "owner.npy"
NODES_FILE = "nodes.npy"
METHODS = ("auto", "metis", "fennel", "ldg", "random", "range")
METIS_FIX = "install it with `pip install pymetis` (or `pip install lightning_ooc[partition]`)"
#: capacity of a part, relative to the mean (nodes and training seeds), for the streaming partitioners
CAPACITY = 1.05
#: passes of the streaming partitioners over the nodes: one, then restreams
STREAM_PASSES = 5
FENNEL_GAMMA = 1.5
#: at most this many (node, part) neighbour counts per streamed chunk
_CHUNK_CELLS = 1 << 22
_MAX_CHUNK = 4096
_EDGE_CHUNK = 1 << 24
#: feature bytes read from the source per step while writing the parts
_FEATURE_CHUNK_BYTES = 64 << 20
#: part directories written in one pass over the source's features (each holds an open file)
_PARTS_PER_PASS = 64


def part_dir_name(k: int) -> str:
    return f"part-{k:05d}"


def owner_dtype(parts: int) -> np.dtype:
    """Dtype of ``owner.npy``: int16 below 32768 parts, else int32."""

    return partition_owner_dtype(parts)


@dataclass
class PartitionResult:
    """What :func:`partition_nodes` found: the part of every node and how good it is."""

    owner: np.ndarray
    method: str
    edge_cut: int
    balance: dict[str, float]
    seconds: float
    num_edges: int = 0
    part_nodes: list[int] = field(default_factory=list)
    part_train: list[int] = field(default_factory=list)

    @property
    def edge_cut_fraction(self) -> float:
        return self.edge_cut / self.num_edges if self.num_edges else 0.0


# -- partitioners ------------------------------------------------------------------
def _open(ds: Any) -> Any:
    if isinstance(ds, (str, os.PathLike)):
        ds = open_dataset(ds)
    return ds


def _check_partitionable(ds: Any) -> None:
    if getattr(ds, "is_hetero", False):
        raise InputError(f"{ds.root}: a heterogeneous dataset; partitioning supports homogeneous node "
                         "classification datasets only (for now)")  # fmt: skip
    if getattr(ds, "has_link_splits", False):
        raise InputError(f"{ds.root}: holds link splits; partitioning supports homogeneous node classification "
                         "datasets only (for now): partition a copy without them (`lightning-ooc prepare --dataset`)")
    if getattr(ds, "partition", None) is not None:
        p = ds.partition
        raise InputError(f"{ds.root}: is part {p.index} of {p.parts} of a partitioned dataset (it holds only its own "
                         "rows); partition the source dataset instead")  # fmt: skip


def _train_mask(ds: Any) -> np.ndarray:
    mask = np.zeros(ds.num_nodes, dtype=bool)
    mask[ds.split("train").numpy()] = True
    return mask


def _import_pymetis():
    import pymetis  # noqa: F401  (optional: the ``partition`` extra)

    return pymetis


def resolve_method(method: str) -> str:
    """The partitioner ``method`` names (``auto``: metis if pymetis imports, else fennel, logged)."""
    if method not in METHODS:
        raise InputError(f"unknown partition method {method!r}; choose one of {', '.join(METHODS)}")
    if method not in ("auto", "metis"):
        return method
    try:
        _import_pymetis()
    except ImportError:
        if method == "metis":
            raise InputError(f"--method metis needs METIS, which is not installed: {METIS_FIX}; or choose "
                             "--method fennel") from None  # fmt: skip
        log.info("METIS is not installed, partitioning with fennel instead; for METIS's smaller edge cut, %s",
                 METIS_FIX)  # fmt: skip
        return "fennel"
    return "metis"


def partition_nodes(ds: Any, parts: int, method: str = "auto", seed: int = 0, progress: bool = True) -> PartitionResult:
    """Assign every node of ``ds`` (an opened dataset or its path) to one of ``parts`` parts.

    Returns a :class:`PartitionResult` with ``owner`` (int16/int32 per node), the
    method used, the edge cut (edges whose endpoints lie in different parts) and
    the balance (``max / mean`` of the nodes and of the training seeds per part).

    >>> import tempfile
    >>> from lightning_ooc.data.synth import synthesize
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=2000, avg_degree=8, num_features=4,
    ...                   num_classes=4, train_frac=0.2, progress=False)
    >>> r = partition_nodes(root, 4, method="fennel", progress=False)
    >>> r.owner.shape, r.method, r.balance["nodes"] <= 1.05
    ((2000,), 'fennel', True)
    """
    ds = _open(ds)
    _check_partitionable(ds)
    if not isinstance(parts, (int, np.integer)) or isinstance(parts, bool) or parts < 1:
        raise InputError(f"--parts must be an integer >= 1, got {parts!r}")
    parts = int(parts)
    if parts > ds.num_nodes:
        raise InputError(f"--parts {parts} is more than the {ds.num_nodes} nodes of {ds.root}")
    method = resolve_method(method)
    t0 = time.perf_counter()
    train = _train_mask(ds)
    if parts == 1:
        owner = np.zeros(ds.num_nodes, dtype=np.int64)
    elif method == "range":
        owner = np.arange(ds.num_nodes, dtype=np.int64) * parts // ds.num_nodes
    elif method == "random":
        owner = _random(ds.num_nodes, parts, train, seed)
    elif method == "metis":
        owner = _metis(ds, parts, train, seed, progress)
    else:
        owner = _stream(ds, parts, train, seed, method, progress)
    seconds = time.perf_counter() - t0
    owner = owner.astype(owner_dtype(parts))
    cut = edge_cut(ds.indptr, ds.indices, owner, progress)
    part_nodes = np.bincount(owner, minlength=parts)
    part_train = np.bincount(owner[train], minlength=parts)
    return PartitionResult(owner, method, cut, _balance(part_nodes, part_train), seconds, ds.num_edges,
                           part_nodes.tolist(), part_train.tolist())  # fmt: skip


def _balance(part_nodes: np.ndarray, part_train: np.ndarray) -> dict[str, float]:
    def ratio(c: np.ndarray) -> float:
        mean = c.sum() / max(c.size, 1)
        return float(c.max() / mean) if mean > 0 else 1.0

    return {"nodes": ratio(part_nodes), "train": ratio(part_train)}


def edge_cut(indptr: np.ndarray, indices: np.ndarray, owner: np.ndarray, progress: bool = False) -> int:
    """Edges whose source and destination have different owners (streams over ``indices``)."""
    n = indptr.size - 1
    e = int(indptr[-1])
    cut = 0
    with progress_bar(e, "edge cut", "edge", progress) as bar:
        lo = 0
        while lo < n:
            # nodes [lo, hi) holding about _EDGE_CHUNK edges (at least one node)
            hi = int(np.searchsorted(indptr, indptr[lo] + _EDGE_CHUNK, side="right")) - 1
            hi = min(n, max(hi, lo + 1))
            a, b = int(indptr[lo]), int(indptr[hi])
            dst_owner = np.repeat(owner[lo:hi], np.diff(indptr[lo : hi + 1]))
            src_owner = owner[np.asarray(indices[a:b])]
            cut += int(np.count_nonzero(src_owner != dst_owner))
            bar.update(b - a)
            lo = hi
    return cut


def _random(n: int, parts: int, train: np.ndarray, seed: int) -> np.ndarray:
    """Seeded random parts with exactly balanced node and training-seed counts (round robin over shuffles)."""
    rng = np.random.default_rng(seed)
    owner = np.empty(n, dtype=np.int64)
    start = 0
    for group in (np.flatnonzero(train), np.flatnonzero(~train)):
        perm = rng.permutation(group)
        owner[perm] = (np.arange(perm.size) + start) % parts
        start += perm.size  # the second group continues where the first ended, so node counts stay balanced
    return owner


def _stream(ds: Any, parts: int, train: np.ndarray, seed: int, method: str, progress: bool,
            passes: int = STREAM_PASSES) -> np.ndarray:  # fmt: skip
    """Fennel or LDG over a seeded random stream of the nodes, chunk by chunk (see the module's docstring).

    The first pass places each node against the assignments made before its chunk; each later pass
    (restreaming, Nishimura and Ugander, KDD'13) takes every node out of its part and places it
    again against the current part of all its in-neighbours.
    """
    n = ds.num_nodes
    indptr, indices = ds.indptr, ds.indices
    cap = math.ceil(CAPACITY * n / parts)
    num_train = int(train.sum())
    tcap = max(1, math.ceil(CAPACITY * num_train / parts))
    fennel = method == "fennel"
    alpha = math.sqrt(parts) * max(ds.num_edges, 1) / n**1.5
    ag = alpha * FENNEL_GAMMA
    eps = 0.5 / (cap * cap)  # LDG tie-break towards the smaller part, below any difference of scores (1/cap)

    owner = np.full(n, -1, dtype=np.int64)
    sizes = [0] * parts
    tsizes = [0] * parts
    room = np.ones(parts)  # ldg: 1 - |P_p| / cap
    # added to a node's neighbour counts: fennel's -alpha gamma |P_p|^(gamma - 1) (ldg: -eps |P_p|), -inf
    # where a part is full; tbias also -inf where a part holds its share of training seeds
    bias = np.zeros(parts)
    tbias = np.zeros(parts)
    inf = -np.inf
    sqrt = math.sqrt

    def resize(p: int, k: int, tk: int) -> None:
        sizes[p] = k
        tsizes[p] = tk
        if fennel:
            b = -ag * sqrt(k)
        else:
            room[p] = 1.0 - k / cap
            b = -eps * k
        if k >= cap:
            b = inf
        bias[p] = b
        tbias[p] = inf if tk >= tcap else b

    rng = np.random.default_rng(seed)
    # chunks small beside the graph: a chunk's nodes do not see each other's assignments
    chunk = int(max(16, min(_MAX_CHUNK, n // 256, _CHUNK_CELLS // parts)))
    with progress_bar(n * passes, f"partition ({method})", "node", progress) as bar:
        for _ in range(passes):
            order = rng.permutation(n)
            for s in range(0, n, chunk):
                vs = order[s : s + chunk]
                c = vs.size
                counts = _neighbour_counts(indptr, indices, owner, vs, parts)
                is_train = train[vs].tolist()
                old = owner[vs].tolist()
                for i in range(c):
                    t = is_train[i]
                    q = old[i]
                    if q >= 0:  # restreaming: take the node out of its part first
                        resize(q, sizes[q] - 1, tsizes[q] - t)
                    row = counts[i] if fennel else counts[i] * room
                    sc = row + (tbias if t else bias)
                    p = int(sc.argmax())
                    if sc[p] == inf:  # no part has room for both: keep the node capacity, then anything
                        sc = row + bias
                        p = int(sc.argmax()) if sc.max() > inf else int(np.argmin(sizes))
                    owner[vs[i]] = p
                    resize(p, sizes[p] + 1, tsizes[p] + t)
                bar.update(c)
    return owner


def _neighbour_counts(indptr: np.ndarray, indices: np.ndarray, owner: np.ndarray, vs: np.ndarray,
                      parts: int) -> np.ndarray:  # fmt: skip
    """``(len(vs), parts)`` float64: how many in-neighbours of each node of ``vs`` each part owns (-1: none)."""
    c = vs.size
    st = indptr[vs]
    deg = indptr[vs + 1] - st
    total = int(deg.sum())
    if not total:
        return np.zeros((c, parts))
    rows = np.repeat(np.arange(c), deg)
    pos = np.arange(total) - np.repeat(np.cumsum(deg) - deg, deg) + np.repeat(st, deg)
    nb_owner = owner[np.asarray(indices[pos])]
    keep = nb_owner >= 0
    counts = np.bincount(rows[keep] * parts + nb_owner[keep], minlength=c * parts)
    return counts.reshape(c, parts).astype(np.float64)


def _rebalance(ds: Any, owner: np.ndarray, parts: int, train: np.ndarray) -> int:
    """Move nodes out of parts above the capacity (``CAPACITY`` x the mean of training seeds, then of nodes)
    to parts with room, those that lose the fewest in-neighbours first; returns how many moved.

    METIS balances within its own tolerance, which a small graph with hubs, or a second constraint,
    can exceed by far; this brings every part within the same capacities as the streaming partitioners.
    """
    n = owner.size
    cap = math.ceil(CAPACITY * n / parts)
    tcap = max(1, math.ceil(CAPACITY * int(train.sum()) / parts))
    loads = np.bincount(owner, minlength=parts)
    tloads = np.bincount(owner[train], minlength=parts)
    moved = 0
    for kind in ("train", "nodes"):
        over = np.flatnonzero(tloads > tcap) if kind == "train" else np.flatnonzero(loads > cap)
        for p in over:
            # training seeds to fix the seeds' balance; other nodes (seeds' balance kept) for the nodes'
            is_p = owner == p
            cand = np.flatnonzero(is_p & train) if kind == "train" else np.flatnonzero(is_p & ~train)
            if kind == "nodes" and cand.size < loads[p] - cap:
                cand = np.flatnonzero(is_p)
            counts = _neighbour_counts(ds.indptr, ds.indices, owner, cand, parts)
            gain = counts - counts[:, p : p + 1]
            order = np.argsort(-gain.max(axis=1), kind="stable")
            for i in order:
                if (tloads[p] <= tcap) if kind == "train" else (loads[p] <= cap):
                    break
                t = bool(train[cand[i]])
                room = (loads < cap) & (~t | (tloads < tcap))
                room[p] = False
                if not room.any():
                    room = loads < cap
                    room[p] = False
                    if not room.any():
                        break
                q = int(np.where(room, gain[i], -np.inf).argmax())
                owner[cand[i]] = q
                loads[p] -= 1
                loads[q] += 1
                if t:
                    tloads[p] -= 1
                    tloads[q] += 1
                moved += 1
    return moved


def _metis(ds: Any, parts: int, train: np.ndarray, seed: int, progress: bool) -> np.ndarray:
    """METIS k-way on the symmetrised graph (no self-loops, no repeats), balancing nodes and training seeds."""
    pymetis = _import_pymetis()
    n = ds.num_nodes
    with progress_bar(None, "partition (metis)", "step", progress) as bar:
        dst = np.repeat(np.arange(n, dtype=np.int64), np.diff(ds.indptr))
        src = np.asarray(ds.indices).astype(np.int64)
        keep = src != dst
        src, dst = src[keep], dst[keep]
        if n < 2**31:
            keys = np.concatenate([src * n + dst, dst * n + src])
            del src, dst, keep
            keys = np.unique(keys)
            a, b = np.divmod(keys, n)
            del keys
        else:  # pragma: no cover - needs more than 2^31 nodes
            pairs = np.unique(np.stack([np.concatenate([src, dst]), np.concatenate([dst, src])], 1), axis=0)
            a, b = pairs[:, 0], pairs[:, 1]
        bar.update(1)
        xadj = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(a, minlength=n), out=xadj[1:])
        del a
        if train.any() and not train.all():
            vweights = np.stack([np.ones(n, dtype=np.int64), train.astype(np.int64)], 1).reshape(-1)
        else:
            vweights = None
        opts = pymetis.Options(seed=int(seed))
        _, membership = pymetis.part_graph(parts, pymetis.CSRAdjacency(xadj, b), vweights=vweights, options=opts)
        bar.update(1)
    owner = np.asarray(membership, dtype=np.int64)
    moved = _rebalance(ds, owner, parts, train)
    if moved:
        log.debug("partition: moved %d nodes to bring METIS's parts within %.2f x the mean", moved, CAPACITY)
    return owner


# -- writing ------------------------------------------------------------------------
def _is_part_dir_name(name: str) -> bool:
    return name.startswith("part-") and len(name) == 10 and name[5:].isdigit()


def _foreign_in_output(path: Path) -> list[str]:
    """Entries of a partition output directory that :func:`partition_dataset` does not write."""

    foreign = []
    for name in _foreign_entries(path):  # what a dataset directory would not hold: the parts and our files
        part = name.rstrip("/")
        if name.endswith("/") and _is_part_dir_name(part):
            foreign += [f"{part}/{e}" for e in _foreign_entries(path / part)]
        elif not (name in (MANIFEST, MANIFEST + ".pending") and stat.S_ISREG(os.lstat(path / name).st_mode)):
            foreign.append(name)
    return foreign


def _check_output_replaceable(target: Path) -> None:
    """``--overwrite`` replaces only an empty directory or a partition output of ours."""
    fix = "remove or rename it yourself, or choose another --out"
    if os.path.islink(target):
        raise DatasetWriteError(f"{target}: is a symbolic link; --overwrite replaces only a partition output "
                                f"directory; {fix}")  # fmt: skip
    if not target.is_dir():
        raise DatasetWriteError(f"{target}: is a file, not a partition output directory; --overwrite will not "
                                f"delete it; {fix}")  # fmt: skip
    entries = os.listdir(target)
    if not entries:
        return
    if MANIFEST not in entries:
        raise DatasetWriteError(f"{target}: is not a lightning-ooc partition output (it has no {MANIFEST}); "
                                f"--overwrite replaces only one of those or an empty directory, so nothing was "
                                f"touched; {fix}")  # fmt: skip
    foreign = _foreign_in_output(target)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise DatasetWriteError(f"{target}: holds {shown}, which a partition output does not; --overwrite would "
                                "delete them, so nothing was touched; move them out, or choose another --out")


def _remove_output(path: Path) -> None:
    """Delete a partition output of ours (what it holds that we did not write is kept, with a warning)."""

    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return
    for name in names:
        p = path / name
        if _is_part_dir_name(name) and stat.S_ISDIR(os.lstat(p).st_mode):
            for extra in (NODES_FILE, OWNER_FILE):
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    if stat.S_ISREG(os.lstat(p / extra).st_mode):
                        os.unlink(p / extra)
            remove_dataset(p)
        elif name in (MANIFEST, MANIFEST + ".pending", OWNER_FILE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
    try:
        os.rmdir(path)
    except OSError:
        log.warning("%s: kept, because it holds %s, which no partition writer put there", path,
                    ", ".join(_foreign_in_output(path)[:5]))  # fmt: skip


class _OutputTarget(WriteTarget):
    """The partition output directory: its lock, the partial directory beside it, the atomic commit.

    A :class:`~lightning_ooc.data.writer.WriteTarget` (the same lock, partial directory names and rename
    steps of :mod:`lightning_ooc.data.commit`) for a directory of part directories and a
    ``partition.json`` rather than a dataset.
    """

    def _recover(self) -> Any:
        recover(self.target)  # partial directories of dead writers
        # a partition output moved aside by a replacement killed halfway (no renameat2 here)
        stale = [p for p, _ in backups(self.target) if (p / MANIFEST).is_file() and not _foreign_in_output(p)]
        keep = None
        if stale and not os.path.lexists(self.target):
            keep = stale.pop()
            os.rename(keep, self.target)
            fsync_dir(self.target.parent)
            log.warning("%s: restored the partition output that an interrupted --overwrite had moved to %s",
                        self.target, keep.name)  # fmt: skip
        for p in stale:
            _remove_output(p)
        return keep

    def _check_replaceable(self) -> None:
        _check_output_replaceable(self.target)

    def __enter__(self) -> "_OutputTarget":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.exit(exc_type, exc)
        return False

    def commit(self, manifest: dict[str, Any]) -> Path:
        """Write ``partition.json`` (last), fsync, and rename the directory into place."""
        write_json_last(self.tmp, MANIFEST, manifest)
        with deferred_signals(f"committing {self.target}") as held:
            replaced = self._put_in_place()
            fsync_dir(self.target.parent)
            self.committed = True
            if replaced is not None:
                _remove_output(replaced)
            self._lock.release()
        signum = held.interrupts()
        if signum is not None:
            raise InterruptedAfterCommit(self.target, signum)
        held.redeliver()
        return self.target

    def _put_in_place(self) -> Path | None:
        return put_in_place(self.tmp, self.target, self.overwrite, check=_check_output_replaceable, what="output",
                            writing="the partitions were being written")


def _copy_file(src: Path, dst: Path) -> dict[str, Any]:
    """Copy ``src`` to ``dst`` (fsync'd), returning its ``files`` entry (name, bytes, checksum)."""
    h = new_hasher()
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    with open(src, "rb", buffering=0) as fi, open(dst, "wb") as fo:
        while True:
            k = fi.readinto(buf)
            if not k:
                break
            fo.write(view[:k])
            h.update(view[:k])
        fo.flush()
        os.fsync(fo.fileno())
    return {"name": dst.name, "bytes": dst.stat().st_size, "checksum": h.hexdigest()}


def _write_npy(path: Path, a: np.ndarray) -> dict[str, Any]:
    w = NpyStreamWriter(path, a.dtype, len(a))
    try:
        w.write(a)
        return {"name": path.name, "bytes": w.close()}
    except BaseException:
        w.abort()
        raise


def partition_dataset(root: str | os.PathLike, parts: int, out: str | os.PathLike, method: str = "auto",
                      seed: int = 0, overwrite: bool = False, progress: bool = True) -> Path:  # fmt: skip
    """Partition the dataset at ``root`` into ``parts`` part directories under ``out``; returns ``out``.

    ``out`` holds ``partition.json`` (the method, the edge cut, the balance, every
    part's rows), ``owner.npy`` and ``part-00000`` ... ``part-{P-1:05d}``, each a
    dataset that :func:`~lightning_ooc.open_dataset` opens (its ``partition``
    says which rows it holds). The whole directory appears at once, or not at all.
    """

    root = Path(root)
    ds = open_dataset(root)
    _check_partitionable(ds)
    t0 = time.perf_counter()
    result = partition_nodes(ds, parts, method, seed, progress)
    parts = int(parts)
    owner = result.owner
    n = ds.num_nodes
    row_bytes = ds.row_bytes
    topo_bytes = sum(int(ds.meta["files"][k]["bytes"]) for k in _whole_files(ds))
    estimated = parts * (topo_bytes + owner.nbytes + 4096) + n * row_bytes + 8 * n + owner.nbytes
    splits = {s: np.sort(ds.split(s).numpy()) for s in SPLITS}
    order = np.argsort(owner, kind="stable")  # nodes grouped by part, ascending id within each
    bounds = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=parts))])
    part_meta = {"parts": parts, "method": result.method, "source_identity": ds.identity}
    with _OutputTarget(out, overwrite=overwrite, estimated_bytes=estimated, inputs=[root]) as target:
        _write_npy(target.tmp / OWNER_FILE, owner)
        with progress_bar(parts * topo_bytes + n * row_bytes, "write parts", "B", progress) as bar:
            for first in range(0, parts, _PARTS_PER_PASS):
                group = range(first, min(parts, first + _PARTS_PER_PASS))
                _write_parts(ds, target.tmp, group, owner, order, bounds, splits, part_meta, seed, bar)
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "parts": parts,
            "method": result.method,
            "seed": int(seed),
            "num_nodes": n,
            "num_edges": ds.num_edges,
            "row_bytes": row_bytes,
            "source": str(root.absolute()),
            "source_identity": ds.identity,
            "edge_cut": int(result.edge_cut),
            "edge_cut_fraction": result.edge_cut_fraction,
            "balance": result.balance,
            "part_nodes": result.part_nodes,
            "part_train": result.part_train,
            "dirs": [part_dir_name(k) for k in range(parts)],
            "partition_seconds": round(result.seconds, 3),
            "seconds": round(time.perf_counter() - t0, 3),
        }
        path = target.commit(manifest)
    log.info("partition: %d parts (%s), edge cut %d (%.1f%%), balance nodes %.3f train %.3f in %.1f s -> %s",
             parts, result.method, result.edge_cut, 100 * result.edge_cut_fraction, result.balance["nodes"],
             result.balance["train"], manifest["seconds"], path)  # fmt: skip
    return path


def _whole_files(ds: Any) -> tuple[str, ...]:
    """The files every part holds whole, as in the source: the topology, the labels and, where the source has
    them, the node times (PyG's temporal sampling reads them by global id)."""
    return ("indptr", "indices", "labels") + (("node_time",) if "node_time" in ds.meta["files"] else ())


def _write_parts(ds: Any, tmp: Path, group: range, owner: np.ndarray, order: np.ndarray, bounds: np.ndarray,
                 splits: dict[str, np.ndarray], part_meta: dict[str, Any], seed: int, bar: Any) -> None:  # fmt: skip
    """Write the part directories of ``group``: one pass over the source's features for all of them."""

    writers: dict[int, DatasetWriter] = {}
    files: dict[int, Any] = {}
    hashers: dict[int, Any] = {}
    try:
        for k in group:
            nodes = order[bounds[k] : bounds[k + 1]].astype(np.int64)  # ascending: the sort was stable
            w = DatasetWriter(tmp / part_dir_name(k), num_nodes=ds.num_nodes, num_features=ds.num_features,
                              num_classes=ds.num_classes, feature_dtype=ds.feature_dtype_name,
                              source={"partition_of": ds.meta.get("source", {}), **part_meta, "seed": int(seed),
                                      "index": k})  # fmt: skip
            writers[k] = w
            for key in _whole_files(ds):
                w.files[key] = _copy_file(ds._path(key), w.tmp / ds.meta["files"][key]["name"])
                bar.update(w.files[key]["bytes"])
            w.num_edges = ds.num_edges
            owned = owner == k
            for s in SPLITS:
                w.write_split(s, splits[s][owned[splits[s]]])
            w.files["nodes"] = _write_npy(w.tmp / NODES_FILE, nodes)
            w.files["owner"] = _write_npy(w.tmp / OWNER_FILE, owner)
            w.partition = {"index": k, "num_rows": int(nodes.size), **part_meta}
            files[k] = open(w.tmp / "features.bin", "wb")
            hashers[k] = new_hasher()
        # one pass over the source's rows: each chunk's rows go to the files of their parts, in id order
        mm = ds.features_memmap().view(np.uint8).reshape(ds.num_nodes, ds.row_bytes)
        step = max(1, _FEATURE_CHUNK_BYTES // max(ds.row_bytes, 1))
        lo_part, hi_part = group.start, group.stop
        for s in range(0, ds.num_nodes, step):
            e = min(ds.num_nodes, s + step)
            own = owner[s:e]
            sel = np.flatnonzero((own >= lo_part) & (own < hi_part))
            if not sel.size:
                continue
            block = np.asarray(mm[s:e])
            grouped = sel[np.argsort(own[sel], kind="stable")]
            cuts = np.concatenate([[0], np.cumsum(np.bincount(own[grouped] - lo_part, minlength=len(group)))])
            for i, k in enumerate(group):
                if cuts[i + 1] > cuts[i]:
                    rows = np.ascontiguousarray(block[grouped[cuts[i] : cuts[i + 1]]])
                    mv = memoryview(rows).cast("B")
                    files[k].write(mv)
                    hashers[k].update(mv)
                    bar.update(len(mv))
        for k, w in writers.items():
            f = files.pop(k)
            f.flush()
            os.fsync(f.fileno())
            f.close()
            w.files["features"] = {"name": "features.bin", "bytes": (w.tmp / "features.bin").stat().st_size,
                                   "checksum": hashers[k].hexdigest()}  # fmt: skip
            _commit_part(w)
    except BaseException:
        for f in files.values():
            f.close()
        for w in writers.values():
            if not w._target.committed:
                w.abort()
        raise


def _commit_part(w: Any) -> Path:
    """Commit a part's DatasetWriter with the ``partition`` key added to its meta.json."""
    target = w._target
    commit = target.commit

    def with_partition(meta: dict[str, Any]) -> Path:
        meta["partition"] = w.partition
        return commit(meta)

    target.commit = with_partition
    try:
        return w.commit()
    finally:
        del target.commit


# -- reading an output ------------------------------------------------------------------
def is_partition_output(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory written by :func:`partition_dataset` (it holds ``partition.json``)."""
    p = Path(path)
    return (p / MANIFEST).is_file() and not (p / META_FILE).exists()


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """``partition.json`` of a partition output, checked for its format and version."""

    file = Path(path) / MANIFEST
    fix = "partition the dataset again with `lightning-ooc partition ROOT --parts P --out DIR --overwrite`"
    try:
        m = json.loads(file.read_text())
    except FileNotFoundError:
        raise DatasetNotFoundError(f"{file}: missing; {Path(path)} is not a partition output; {fix}", file) from None
    except (OSError, ValueError) as e:
        raise CorruptDatasetError(f"{file}: not readable JSON ({e}); {fix}", file) from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise CorruptDatasetError(f"{file}: not a {MANIFEST_FORMAT} manifest; {fix}", file)
    if not isinstance(m.get("version"), int) or not 1 <= m["version"] <= MANIFEST_VERSION:
        raise FormatVersionError(f"{file}: manifest version {m.get('version')!r} is not supported by this release "
                                 f"(reads 1..{MANIFEST_VERSION}); upgrade lightning_ooc", file)  # fmt: skip
    for key in ("parts", "num_nodes", "edge_cut", "part_nodes", "dirs", "balance"):
        if key not in m:
            raise CorruptDatasetError(f"{file}: missing key {key!r}; {fix}", file)
    return m
