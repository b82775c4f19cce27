"""Streaming dataset writer with an atomic commit.

:class:`DatasetWriter` builds a dataset in a temporary directory beside the
target and renames it into place only when every file is complete and
fsync'd. Nothing it does holds the whole edge list or feature matrix:

* edges that arrive in any order go through a bucketed external sort: pass 1
  counts in-degrees, pass 2 appends each edge to the bucket file of its
  target's node range (ranges sized so a bucket holds at most
  ``bucket_edges`` edges), pass 3 sorts one bucket at a time and streams the
  sources into ``indices.npy``;
* edges already grouped by target (the synthetic generator) stream straight
  into ``indices.npy``;
* features, labels and splits are written chunk by chunk; link splits
  (:mod:`lightning_ooc.data.link_splits`) from arrays, or a train split streamed
  from an edge source.

One writer at a time holds a target (a lock beside it, see
:mod:`lightning_ooc.data.commit`). An interrupted run leaves only a
``.NAME.partial-*`` directory, never anything at the target path; a later
writer for the same target removes it. ``overwrite`` replaces only an empty
directory or a dataset of ours, by an atomic exchange: the path holds the old
dataset or the new one at every instant.
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from lightning_ooc._version import __version__
from lightning_ooc.data.format import (
    CHECKSUM_ALGO,
    FEATURE_DTYPES,
    FILES,
    FORMAT_NAME,
    HOMOGENEOUS_VERSION,
    IN_PLACE_VERSION,
    OPTIONAL_FILES,
    META_FILE,
    META_PENDING,
    NEIGHBOR_ORDERS,
    SPLITS,
    NpyStreamWriter,
    checksum_file,
    feature_dtype_name,
    meta_digest,
    human_bytes,
    index_dtype,
    new_hasher,
    to_feature_bytes,
)
from lightning_ooc.data.link_splits import (
    LINK_FIELDS,
    LINK_META,
    as_edge_pairs,
    check_ids,
    check_link_split,
    link_file,
    link_key,
)
from lightning_ooc.data.commit import (
    TargetLock,
    check_replaceable,
    deferred_signals,
    fsync_dir,
    TableLock,
    hold_table,
    put_in_place,
    recover,
    remove_dataset,
    write_json_last,
)
from lightning_ooc.data.edge_sources import ArrayEdgeSource, EdgeSource, PairFileEdgeSource
from lightning_ooc.data.external_sort import DEFAULT_BUCKET_EDGES, external_sort
from lightning_ooc.data.in_place import IN_PLACE, RowFile, describe
from lightning_ooc.data.outputs import check_output
from lightning_ooc.errors import DatasetWriteError, InputError, InterruptedAfterCommit
from lightning_ooc.utils.progress import progress_bar

log = logging.getLogger("lightning_ooc")

#: the writer's public names, with the edge sources it takes (their module: data/edge_sources.py)
__all__ = ["DatasetWriter", "PartWriter", "WriteTarget", "ArrayEdgeSource", "PairFileEdgeSource", "EdgeSource",
           "source_inputs"]

#: keys of a writer's recorded ``source`` that name an input it reads (checked against its output)
SOURCE_INPUT_KEYS = ("dataset", "edges", "pyg", "root", "features_file")


def source_inputs(source: dict[str, Any] | None) -> list[Any]:
    """The input paths a writer's ``source`` records (``prepare --dataset/--edges/--pyg``, an imported layout's
    directory, a feature file used in place)."""
    return [source[k] for k in SOURCE_INPUT_KEYS if isinstance((source or {}).get(k), str)]


class WriteTarget:
    """The directory a writer commits to: its lock, the partial directory beside it, the atomic commit.

    Taken at construction (the target's lock, leftovers of killed writers
    removed, a refused ``--overwrite`` or a full disk reported before any
    work); :meth:`commit` writes ``meta.json`` and renames the partial
    directory into place; :meth:`abort` removes it.
    """

    def __init__(self, out: str | os.PathLike, *, overwrite: bool = False, estimated_bytes: int | None = None,
                 inputs: Sequence[str | os.PathLike | None] = ()):  # fmt: skip
        self.target = Path(out).absolute()
        self.overwrite = bool(overwrite)
        self.committed = False
        self._table_lock: TableLock | None = None
        check_output(self.target, inputs=inputs, kind="directory")
        parent = self.target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DatasetWriteError(f"{parent}: cannot create the output's parent directory ({e.strerror})") from None
        self._lock = TargetLock(self.target).acquire()
        try:
            restored = self._recover()  # may put back what an interrupted overwrite moved aside
            if os.path.lexists(self.target):
                if not overwrite:
                    how = f" (put back just now from {restored}, where an interrupted --overwrite had moved it)"
                    raise DatasetWriteError(
                        f"{self.target}: already exists{how if restored else ''}; pass --overwrite (overwrite=True) "
                        "to replace it, or choose another --out"
                    )
                self._check_replaceable()
                # a table a run holds is refused; once held here, no run can open it until it is replaced
                self._table_lock = hold_table(self.target)
            if estimated_bytes is not None:
                free = shutil.disk_usage(parent).free
                if estimated_bytes > free:
                    raise DatasetWriteError(
                        f"{parent}: needs about {human_bytes(estimated_bytes)} of disk but only {human_bytes(free)} "
                        "is free; free some space or write to another disk with --out"
                    )
            self.tmp = parent / f".{self.target.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
            self.tmp.mkdir()
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        """Let the target go: the writer's lock, and the lock of the table it replaces (if one)."""
        if self._table_lock is not None:
            self._table_lock.release()
            self._table_lock = None
        self._lock.release()

    def _recover(self) -> Any:
        """Clear what killed writers of this target left (returns what was put back at the target, if any)."""
        return recover(self.target)

    def _check_replaceable(self) -> None:
        """Raise unless ``--overwrite`` may replace what is at the target."""
        check_replaceable(self.target)

    def abort(self) -> None:
        """Remove the partial output and release the target; the target (if any) is left as it was."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._release()

    def exit(self, exc_type, exc) -> None:
        """A writer's ``__exit__``: abort unless committed; a full disk becomes a DatasetWriteError."""
        if exc_type is not None or not self.committed:
            self.abort()
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise DatasetWriteError(
                f"{self.target.parent}: no space left on device while writing {self.target.name}; nothing was "
                "changed (the partial output was removed). Free some space or write elsewhere with --out"
            ) from exc

    def commit(self, meta: dict[str, Any]) -> Path:
        """Checksum unchecked files, write ``meta`` (its ``meta_checksum`` added), fsync and rename into place."""
        for entry in meta["files"].values():
            if "checksum" not in entry:
                entry["checksum"] = checksum_file(self.tmp / entry["name"])
        meta["meta_checksum"] = meta_digest(meta)
        write_json_last(self.tmp, META_FILE, meta, META_PENDING)
        # From here on the commit runs to its end: a SIGINT/SIGTERM is held and reported after it.
        with deferred_signals(f"committing {self.target}") as held:
            replaced = put_in_place(self.tmp, self.target, self.overwrite)
            fsync_dir(self.target.parent)
            self.committed = True
            if replaced is not None:
                _remove_tree(replaced)
            self._release()
        signum = held.interrupts()
        if signum is not None:  # Ctrl-C (or the CLI's SIGTERM) during the commit: report it, and that it is done
            raise InterruptedAfterCommit(self.target, signum)
        held.redeliver()  # any other handler (a user's, the default action) runs now
        return self.target


class PartWriter:
    """Writes the files of one graph part into a writer's partial directory.

    A homogeneous dataset is one part (:class:`DatasetWriter`); a heterogeneous
    one has a part per node type (features, labels, splits) and per relation
    (its CSC), each with its own file prefix (:mod:`lightning_ooc.data.hetero_dataset`).
    ``num_src_nodes`` is the id range of edge sources (a relation's source
    type; the node count itself in a homogeneous graph).
    """

    def __init__(
        self,
        tmp: Path,
        files: dict[str, dict[str, Any]],
        *,
        num_nodes: int,
        num_features: int,
        num_classes: int,
        feature_dtype: object = "float32",
        num_src_nodes: int | None = None,
        prefix: str = "",
        progress: bool = False,
        in_place: dict[str, dict[str, Any]] | None = None,
    ):
        self.tmp = tmp
        self.files = files
        #: feature files used in place (meta.json's ``in_place``), shared by the parts of one dataset like ``files``
        self.in_place: dict[str, dict[str, Any]] = {} if in_place is None else in_place
        self.prefix = prefix
        self.num_nodes = int(num_nodes)
        self.num_src_nodes = int(num_nodes if num_src_nodes is None else num_src_nodes)
        self.num_features = int(num_features)
        self.num_classes = int(num_classes)
        try:
            self.dtype_name = feature_dtype_name(feature_dtype)
        except ValueError as e:
            raise InputError(str(e)) from None
        self.row_bytes = self.num_features * FEATURE_DTYPES[self.dtype_name][1].itemsize
        self.index_dtype = index_dtype(max(self.num_nodes, self.num_src_nodes))
        self.progress = progress
        self.num_edges: int | None = None
        self.split_sizes: dict[str, int] = {}
        #: per link split: its ``edges``, ``fields`` and ``neg_per_edge`` (meta.json's ``link_splits.splits``)
        self.link_splits: dict[str, dict[str, Any]] = {}
        self._link_note: tuple[str, bool] | None = None
        #: how each node's in-edges are ordered (meta.json's ``neighbor_order``; format.NEIGHBOR_ORDERS)
        self.neighbor_order = "source_id"

    def _key(self, key: str) -> str:
        """The ``files`` key of this part's file ``key`` (e.g. ``paper.features``)."""
        return self.prefix + key

    def _name(self, key: str) -> str:
        """The file name of this part's file ``key`` (e.g. ``paper.features.bin``)."""
        return self.prefix + (FILES.get(key) or OPTIONAL_FILES[key])

    # -- topology ----------------------------------------------------------------
    def write_csc_segments(self, segments: Iterable[tuple[np.ndarray, ...]], *,
                           neighbor_order: str = "source_id") -> None:  # fmt: skip
        """Write topology given as consecutive node ranges in order.

        Each segment is ``(counts, sources)``: the in-degree of each node of the
        next range, and the concatenated sources of their in-edges, sorted by
        source id; or ``(counts, sources, times)`` with the time of each edge
        (the ``edge_time`` file). ``neighbor_order`` says how each node's
        in-edges are ordered (``node_time`` / ``edge_time``: by time, for
        temporal sampling); ``edge_time`` order is checked here.
        """
        if neighbor_order not in NEIGHBOR_ORDERS:
            raise InputError(f"neighbor_order must be one of {list(NEIGHBOR_ORDERS)}, got {neighbor_order!r}")
        deg = np.zeros(self.num_nodes, dtype=np.int64)
        w = NpyStreamWriter(self.tmp / self._name("indices"), self.index_dtype, None)
        tw: NpyStreamWriter | None = None
        pos = 0
        try:
            for counts, sources, *times in segments:
                counts = np.asarray(counts, dtype=np.int64)
                if pos + counts.size > self.num_nodes:
                    raise InputError(f"segments cover more than num_nodes={self.num_nodes} nodes")
                if int(counts.sum()) != len(sources):
                    raise InputError("segment counts do not add up to its number of sources")
                if times:
                    if tw is None:
                        if w.count:
                            raise InputError("edge times must come with every segment or with none")
                        tw = NpyStreamWriter(self.tmp / self._name("edge_time"), np.int64, None)
                    t = _edge_times(times[0], len(sources))
                    if neighbor_order == "edge_time":
                        _check_time_order(counts, t, pos)
                    tw.write(t)
                elif tw is not None:
                    raise InputError("edge times must come with every segment or with none")
                deg[pos : pos + counts.size] = counts
                pos += counts.size
                w.write(sources)
            if pos != self.num_nodes:
                raise InputError(f"segments cover {pos} nodes, expected num_nodes={self.num_nodes}")
            if neighbor_order == "edge_time" and tw is None:
                raise InputError("neighbor_order='edge_time' needs the time of each edge in the segments")
            self.files[self._key("indices")] = {"name": self._name("indices"), "bytes": w.close()}
            if tw is not None:
                self.files[self._key("edge_time")] = {"name": self._name("edge_time"), "bytes": tw.close()}
        except BaseException:
            w.abort()
            if tw is not None:
                tw.abort()
            raise
        self.neighbor_order = neighbor_order
        self.num_edges = w.count
        indptr = np.zeros(self.num_nodes + 1, dtype=np.int64)
        np.cumsum(deg, out=indptr[1:])
        self._write_npy("indptr", [indptr], np.int64, self.num_nodes + 1)

    def write_edges(
        self,
        edges: EdgeSource,
        *,
        add_reverse: bool = False,
        drop_self_loops: bool = False,
        drop_duplicates: bool = False,
        bucket_edges: int = DEFAULT_BUCKET_EDGES,
        neighbor_order: str = "source_id",
        node_time: np.ndarray | None = None,
    ) -> None:
        """Build the in-edge CSC from an edge list in any order (bucketed external sort).

        An edge source with ``timed = True`` yields ``(src, dst, time)`` chunks: the times become the
        ``edge_time`` file. ``neighbor_order`` ``"edge_time"`` sorts each node's in-edges by their times,
        ``"node_time"`` by ``node_time`` of their sources (ties by source id), for temporal sampling.
        """
        timed = bool(getattr(edges, "timed", False))
        if neighbor_order == "edge_time" and not timed:
            raise InputError(f"{edges.name}: neighbor_order='edge_time' needs edges with times")
        if neighbor_order == "node_time" and node_time is None:
            raise InputError("neighbor_order='node_time' needs the node times of the sources")

        def chunks() -> Iterator[tuple[np.ndarray, ...]]:
            return self._checked_edges(edges, add_reverse=add_reverse, drop_self_loops=drop_self_loops)

        # Passes 1 and 2 count input edges on their progress bars (a chunk holds each twice with add_reverse).
        per_input = 2 if add_reverse else 1
        self.write_csc_segments(external_sort(
            chunks, num_nodes=self.num_nodes, num_src_nodes=self.num_src_nodes, num_edges=edges.num_edges,
            per_input=per_input, workdir=self.tmp, pair_dtype=self.index_dtype, bucket_edges=bucket_edges,
            drop_duplicates=drop_duplicates, progress=self.progress, timed=timed, order=neighbor_order,
            node_time=node_time,
        ), neighbor_order=neighbor_order)  # fmt: skip

    def _checked_edges(
        self, edges: EdgeSource, *, add_reverse: bool, drop_self_loops: bool
    ) -> Iterator[tuple[np.ndarray, ...]]:
        """The chunks of ``edges`` as int64 ``(src, dst[, time])``, ids checked, self-loops dropped and reverses
        added."""
        seen = 0
        for src, dst, *time in edges.chunks():
            src = np.asarray(src)
            dst = np.asarray(dst)
            for arr in (src, dst):
                if arr.dtype.kind not in "iu":
                    raise InputError(f"{edges.name}: edge ids must be integers, got dtype {arr.dtype}")
            src = src.astype(np.int64, copy=False)
            dst = dst.astype(np.int64, copy=False)
            for arr, n, end in ((src, self.num_src_nodes, "source"), (dst, self.num_nodes, "target")):
                if arr.size and (arr.min() < 0 or arr.max() >= n):
                    bad = int(np.flatnonzero((arr < 0) | (arr >= n))[0])
                    raise InputError(
                        f"{edges.name}: edge {seen + bad} is ({int(src[bad])} -> {int(dst[bad])}) but {end} ids "
                        f"must lie in [0, {n}); check the node count (it comes from the feature matrix's rows)"
                    )
            t = _edge_times(time[0], src.size, f"{edges.name}: ") if time else None
            seen += src.size
            if drop_self_loops:
                keep = src != dst
                src, dst = src[keep], dst[keep]
                t = None if t is None else t[keep]
            if add_reverse:
                src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
                t = None if t is None else np.concatenate([t, t])
            yield (src, dst) if t is None else (src, dst, t)

    # -- node data ---------------------------------------------------------------
    def write_features(self, chunks: Iterable[np.ndarray]) -> None:
        """Write feature rows, chunk by chunk, in node order (any float/int input is cast)."""
        path = self.tmp / self._name("features")
        h = new_hasher()
        rows = 0
        with open(path, "wb") as f, progress_bar(
            self.num_nodes * self.row_bytes, "write features", "B", self.progress
        ) as bar:
            for chunk in chunks:
                if chunk.ndim != 2 or chunk.shape[1] != self.num_features:
                    raise InputError(
                        f"feature chunk has shape {tuple(chunk.shape)}; expected (rows, {self.num_features})"
                    )
                if rows + chunk.shape[0] > self.num_nodes:
                    raise InputError(f"more than num_nodes={self.num_nodes} feature rows")
                data = to_feature_bytes(chunk, self.dtype_name)
                mv = memoryview(data).cast("B")
                f.write(mv)
                h.update(mv)
                rows += chunk.shape[0]
                bar.update(len(mv))
            if rows != self.num_nodes:
                raise InputError(f"got {rows} feature rows, expected num_nodes={self.num_nodes}")
            f.flush()
            os.fsync(f.fileno())
        self.files[self._key("features")] = {"name": self._name("features"), "bytes": path.stat().st_size,
                                             "checksum": h.hexdigest()}

    def use_features_in_place(self, src: RowFile) -> None:
        """Record ``src`` (a user's file, e.g. a ``.npy`` from :func:`~lightning_ooc.data.in_place.npy_rows`) as
        this part's features instead of writing a copy; reads it once for its checksum.

        Its rows must be this part's rows in its stored dtype: nothing is cast or moved.
        """
        want = (self.num_nodes, self.num_features)
        if tuple(src.shape) != want:
            raise InputError(f"{src.path}: holds {src.shape[0]} x {src.shape[1]} rows; expected {want[0]} x {want[1]} "
                             "(nodes x features)")  # fmt: skip
        if src.dtype_name != self.dtype_name:
            raise InputError(f"{src.path}: holds {src.dtype_name} rows, but the features are to be stored as "
                             f"{self.dtype_name}; a file used in place is read as it is: leave out the dtype "
                             "option (--dtype), or copy the features (--features copy)")  # fmt: skip
        self.in_place[self._key("features")] = describe(src, progress=self.progress)

    def write_labels(self, chunks: Iterable[np.ndarray]) -> None:
        """Write the class of each node (int, ``-1`` for unknown), chunk by chunk."""

        def checked() -> Iterator[np.ndarray]:
            seen = 0
            for c in chunks:
                c = np.asarray(c)
                if c.dtype.kind not in "iu":
                    raise InputError(f"labels must be integers, got dtype {c.dtype}")
                if c.size and (c.min() < -1 or c.max() >= max(self.num_classes, 0)):
                    bad = int(np.flatnonzero((c < -1) | (c >= self.num_classes))[0])
                    raise InputError(
                        f"label of node {seen + bad} is {int(c[bad])}; labels must lie in [-1, {self.num_classes})"
                    )
                seen += c.size
                yield c

        self._write_npy("labels", checked(), np.int64, self.num_nodes)

    def write_node_time(self, chunks: Iterable[np.ndarray]) -> None:
        """Write an integer time of each node (a year, a timestamp), chunk by chunk: the optional ``node_time``."""

        def checked() -> Iterator[np.ndarray]:
            for c in chunks:
                c = np.asarray(c).reshape(-1)
                if c.size and c.dtype.kind not in "iu":
                    if c.dtype.kind != "f" or not np.all(c == np.floor(c)):
                        raise InputError(f"node times must be integers, got dtype {c.dtype}")
                yield c

        self._write_npy("node_time", checked(), np.int64, self.num_nodes)

    def write_split(self, name: str, ids: np.ndarray, time: np.ndarray | None = None) -> None:
        """Write the node ids of split ``name`` (``train``, ``val`` or ``test``).

        ``time`` gives each seed its time (its prediction time, as in RelBench's tables): the sampler then
        sees only what precedes it, and a node may be a seed once per time.
        """
        if name not in SPLITS:
            raise InputError(f"unknown split {name!r}; splits are {', '.join(SPLITS)}")
        ids = np.asarray(ids)
        if ids.size and ids.dtype.kind not in "iu":
            raise InputError(f"{name} split: node ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_nodes):
            raise InputError(f"{name} split: node ids must lie in [0, {self.num_nodes}), got {ids.min()}..{ids.max()}")
        t = None if time is None else _edge_times(time, ids.size, f"{name} split: seed ")
        if t is None:
            srt = np.sort(ids)
            dup = srt.size > 1 and np.any(srt[1:] == srt[:-1])
        else:
            dup = ids.size > 1 and np.unique(np.stack([ids, t], 1), axis=0).shape[0] < ids.size
        if dup:
            raise InputError(f"{name} split: holds duplicate node ids" + ("" if t is None else " at the same time"))
        self.split_sizes[name] = int(ids.size)
        self._write_npy(name, [ids], np.int64, ids.size)
        self.files[self._key(name)]["length"] = int(ids.size)
        if t is not None:
            self._write_npy(f"{name}_time", [t], np.int64, ids.size)

    # -- link splits -----------------------------------------------------------------
    def write_link_split(
        self, name: str, index: Any, *, label: Any = None, weight: Any = None, time: Any = None, neg_dst: Any = None
    ) -> None:
        """Write the supervision edges of link split ``name`` (``train``, ``val`` or ``test``) and their fields.

        ``index`` holds the ``(src, dst)`` of ``M`` edges as ``(2, M)`` (PyG's
        ``edge_label_index``) or ``(M, 2)``; ``label`` (float or int, e.g. 1/0),
        ``weight`` and ``time`` have ``M`` entries; ``neg_dst`` is ``(M, K)``:
        negative destinations paired with each edge's source. ``index`` may also
        be an edge source (``chunks()`` yielding ``(src, dst)``), streamed without
        holding it; it then comes without fields.
        """
        if name in self.link_splits:
            raise InputError(f"link split {name}: written twice")
        fields = {"label": label, "weight": weight, "time": time, "neg_dst": neg_dst}
        if hasattr(index, "chunks"):
            if any(v is not None for v in fields.values()) or name not in SPLITS:
                raise InputError(f"link split {name!r}: a streamed index takes no fields and must be one of {SPLITS}")
            arrays: dict[str, np.ndarray] = {}
            m = self._write_link_stream(name, index)
        else:
            arrays = check_link_split(name, self.num_nodes, index, **fields)
            m = len(arrays["index"])
            for field, a in arrays.items():
                self._write_npy(link_key(name, field), [a], a.dtype, m, link_file(name, field), a.shape[1:])
        for field in ("index", *arrays):
            self.files[link_key(name, field)]["length"] = m
        entry: dict[str, Any] = {"edges": m, "fields": [f for f in LINK_FIELDS if f in arrays]}
        if "neg_dst" in arrays:
            entry["neg_per_edge"] = int(arrays["neg_dst"].shape[1])
        self.link_splits[name] = entry

    def _write_link_stream(self, name: str, edges: Any) -> int:
        what = f"link split {name}"

        def rows() -> Iterator[np.ndarray]:
            for src, dst in edges.chunks():
                pairs = as_edge_pairs(np.stack([np.asarray(src), np.asarray(dst)]), what)
                check_ids(pairs, self.num_nodes, what)
                yield pairs

        return self._write_npy(link_key(name, "index"), rows(), np.int64, None, link_file(name, "index"), (2,))

    def set_link_note(self, message_passing: str, leakage_free: bool) -> None:
        """Say which edges the stored graph holds relative to the link splits (meta.json's ``link_splits``).

        ``leakage_free=True`` claims that no positive val/test edge is an edge of
        the stored graph; ``verify`` checks it. Without a note the graph is
        described as given and not checked.
        """
        self._link_note = (str(message_passing), bool(leakage_free))

    def topology(self) -> tuple[np.ndarray, np.ndarray]:
        """``indptr`` and ``indices`` as written (after :meth:`write_edges`), memory-mapped, before the commit."""
        if self._key("indptr") not in self.files:
            raise DatasetWriteError(f"{self.tmp}: no topology written yet for {self.prefix or 'the graph'}")
        return (np.load(self.tmp / self._name("indptr"), mmap_mode="r"),
                np.load(self.tmp / self._name("indices"), mmap_mode="r"))

    def edge_time(self) -> np.ndarray | None:
        """``edge_time`` as written (in the CSC's order), memory-mapped, before the commit; None without times."""
        if self._key("edge_time") not in self.files:
            return None
        return np.load(self.tmp / self._name("edge_time"), mmap_mode="r")

    def _link_meta(self) -> dict[str, Any]:
        note, free = self._link_note or ("as given by its writer; val/test edges were not checked", False)
        splits = {s: self.link_splits[s] for s in SPLITS if s in self.link_splits}
        return {"splits": splits, "message_passing": note, "leakage_free": free}

    def _write_npy(
        self, key: str, chunks: Iterable[np.ndarray], dtype, length: int | None, name: str | None = None,
        row_shape: tuple[int, ...] = (),
    ) -> int:
        """Write ``chunks`` as the ``.npy`` file of ``key`` (named as :meth:`_name` says unless ``name``); returns its rows."""
        name = name or self._name(key)
        w = NpyStreamWriter(self.tmp / name, dtype, length, row_shape)
        try:
            for c in chunks:
                w.write(c)
            self.files[self._key(key)] = {"name": name, "bytes": w.close()}
            return w.count
        except ValueError as e:
            w.abort()
            raise InputError(str(e)) from None
        except BaseException:
            w.abort()
            raise


class DatasetWriter(PartWriter):
    """Write one dataset; use as a context manager so a failure removes the partial output.

    Example::

        >>> import tempfile, numpy as np, lightning_ooc
        >>> from lightning_ooc.data.writer import DatasetWriter, ArrayEdgeSource
        >>> out = tempfile.mkdtemp() + "/tiny"
        >>> with DatasetWriter(out, num_nodes=3, num_features=2, num_classes=2) as w:
        ...     w.write_edges(ArrayEdgeSource(np.array([[0, 1, 2], [1, 2, 0]])))
        ...     w.write_features([np.eye(3, 2, dtype=np.float32)])
        ...     w.write_labels([np.array([0, 1, 0])])
        ...     w.write_split("train", np.array([0, 1])); w.write_split("val", np.array([2]))
        ...     w.write_split("test", np.array([], dtype=np.int64))
        ...     path = w.commit()
        >>> ds = lightning_ooc.open_dataset(path)
        >>> ds.indptr.tolist(), ds.indices.tolist()
        ([0, 1, 2, 3], [2, 0, 1])

    It is a :class:`PartWriter` (the files of one graph part) over a :class:`WriteTarget` (the lock, the partial
    directory beside the target and the atomic commit); a heterogeneous dataset's writer has a part per node
    type and relation over one target:

        >>> target = WriteTarget(tempfile.mkdtemp() + "/other")
        >>> part = PartWriter(target.tmp, {}, num_nodes=3, num_features=2, num_classes=2)
        >>> part.write_features([np.ones((3, 2), dtype=np.float32)])
        >>> sorted(p.name for p in target.tmp.iterdir())
        ['features.bin']
        >>> target.abort()  # nothing is left at the target, nor beside it
        >>> target.target.exists(), target.tmp.exists()
        (False, False)
    """

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        num_nodes: int,
        num_features: int,
        num_classes: int,
        feature_dtype: object = "float32",
        overwrite: bool = False,
        source: dict[str, Any] | None = None,
        progress: bool = False,
        estimated_bytes: int | None = None,
        inputs: Sequence[str | os.PathLike | None] = (),
    ):
        if num_nodes < 1:
            raise InputError(f"a dataset needs at least one node, got num_nodes={num_nodes}")
        if num_features < 1:
            raise InputError(f"features need at least one column, got num_features={num_features}")
        try:
            feature_dtype_name(feature_dtype)
        except ValueError as e:
            raise InputError(str(e)) from None
        self.source = source or {}
        self._target = WriteTarget(out, overwrite=overwrite, estimated_bytes=estimated_bytes,
                                   inputs=[*inputs, *source_inputs(self.source)])  # fmt: skip
        self.target = self._target.target
        self.overwrite = self._target.overwrite
        super().__init__(self._target.tmp, {}, num_nodes=num_nodes, num_features=num_features,
                         num_classes=num_classes, feature_dtype=feature_dtype, progress=progress)  # fmt: skip

    # -- context management ------------------------------------------------------
    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._target.exit(exc_type, exc)
        return False

    def _recover(self) -> Any:
        """Clear what killed writers of this target left (returns what was put back at the target, if any)."""
        return recover(self.target)

    def _check_replaceable(self) -> None:
        """Raise unless ``--overwrite`` may replace what is at the target."""
        check_replaceable(self.target)

    def abort(self) -> None:
        """Remove the partial output and release the target; the target (if any) is left as it was."""
        self._target.abort()

    # -- commit --------------------------------------------------------------------
    def commit(self) -> Path:
        """Checksum, write the metadata, fsync and rename into place. Returns the target path."""
        missing = [k for k in FILES if k not in self.files and k not in self.in_place]
        if missing:
            raise DatasetWriteError(f"{self.target}: cannot commit, nothing was written for {missing}")
        meta = {
            "format": FORMAT_NAME,
            "version": HOMOGENEOUS_VERSION,
            "num_nodes": self.num_nodes,
            "num_edges": int(self.num_edges or 0),
            "num_features": self.num_features,
            "num_classes": self.num_classes,
            "feature_dtype": self.dtype_name,
            "row_bytes": self.row_bytes,
            "index_dtype": self.index_dtype.name,
            "sorted_neighbors": self.neighbor_order == "source_id",
            **({"neighbor_order": self.neighbor_order} if self.neighbor_order != "source_id" else {}),
            "checksum_algorithm": CHECKSUM_ALGO,
            "split_sizes": self.split_sizes,
        }
        if self.link_splits:
            meta[LINK_META] = self._link_meta()
        if self.in_place:
            meta.update(version=IN_PLACE_VERSION, **{IN_PLACE: dict(self.in_place)})
        files = {k: self.files[k] for k in FILES if k in self.files}
        files.update((k, v) for k, v in self.files.items() if k not in FILES)  # the link files, as written
        meta.update(files=files, created_with=f"lightning_ooc {__version__}", source=self.source)
        return self._target.commit(meta)


def _remove_tree(path: Path) -> None:
    """Delete the dataset a commit replaced (its dataset files; anything else is kept, with a warning)."""
    remove_dataset(path)




def _edge_times(t: Any, n: int, what: str = "") -> np.ndarray:
    """``t`` as ``n`` int64 times (integers, or whole floats)."""
    t = np.asarray(t).reshape(-1)
    if t.size != n:
        raise InputError(f"{what}times: {t.size} for {n} entries")
    if t.size and t.dtype.kind not in "iu":
        if t.dtype.kind != "f" or not np.all(t == np.floor(t)):
            raise InputError(f"{what}times must be integers, got dtype {t.dtype}")
    return t.astype(np.int64, copy=False)


def _check_time_order(counts: np.ndarray, t: np.ndarray, first: int) -> None:
    """Each node's in-edges in time order (a segment of nodes from ``first``), or an error naming the node."""
    if t.size < 2:
        return
    node = np.repeat(np.arange(counts.size), counts)
    bad = np.flatnonzero((t[1:] < t[:-1]) & (node[1:] == node[:-1]))
    if bad.size:
        raise InputError(f"the in-edges of node {first + int(node[bad[0]])} are not in time order")
