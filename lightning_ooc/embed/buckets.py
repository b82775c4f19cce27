"""Edges grouped into N x N buckets by the partitions of their endpoints (N x M for a relation between two
node types, partitioned apart).

Bucket ``(i, j)`` holds the edges whose source lies in node partition ``i``
and destination in partition ``j``; partition-buffer training trains a
bucket while both partitions are in the buffer. A table directory holds, per
split (``train``, and ``val``/``test`` for evaluation)::

    buckets_{split}.npy           int32 or int64 [E, 2]: (src, dst), bucket after bucket
    buckets_{split}_offsets.npy   int64 [N * N + 1]: bucket (i, j) is rows offsets[i*N + j] : offsets[i*N + j + 1]
    buckets_{split}_rel.npy       only with several relations: int32 [E], each edge's relation id

With ``dst_bounds`` (a relation whose destination type has partitions of its
own) bucket ``(i, j)`` is rows ``offsets[i*M + j]`` of ``M`` destination
partitions; ``EdgeBuckets`` reads ``M`` from the split's metadata.

Inside a bucket edges keep the order they came in; training shuffles each
bucket per epoch. The writer makes two passes over its source (count, then
place each chunk's runs at their bucket's cursor in a memory-mapped output),
so it never holds the edges.

Example::

    >>> import tempfile, numpy as np
    >>> from pathlib import Path
    >>> from lightning_ooc.embed.buckets import ArrayEdges, EdgeBuckets, write_buckets
    >>> d = Path(tempfile.mkdtemp()); files = {}
    >>> src = ArrayEdges(np.array([0, 5, 1, 4]), np.array([4, 1, 0, 5]), None, num_nodes=6)
    >>> info = write_buckets(d, "train", src, np.array([0, 3, 6]), files)
    >>> b = EdgeBuckets(d, "train", info)
    >>> b.count(0, 1), b.edges(0, 1)[0].tolist(), b.edges(0, 1)[1].tolist()
    (1, [0], [4])
    >>> [b.count(i, j) for i in range(2) for j in range(2)]
    [1, 1, 1, 1]
    >>> rel = ArrayEdges(np.array([0, 5, 1]), np.array([1, 0, 1]), None, num_nodes=6)  # 6 sources, 2 targets
    >>> info = write_buckets(d, "rel", rel, np.array([0, 3, 6]), {}, dst_bounds=np.array([0, 1, 2]))
    >>> b = EdgeBuckets(d, "rel", info)
    >>> b.num_partitions, b.dst_partitions, b.count(0, 1), b.count(1, 0)
    (2, 2, 2, 1)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np
import torch

from lightning_ooc.data.format import NpyStreamWriter, index_dtype
from lightning_ooc.errors import InputError
from lightning_ooc.utils.progress import progress_bar
from lightning_ooc.data.edge_sources import DatasetEdgeSource

_CHUNK = 1 << 22


def bucket_files(split: str) -> dict[str, str]:
    return {"edges": f"buckets_{split}.npy", "offsets": f"buckets_{split}_offsets.npy", "rel": f"buckets_{split}_rel.npy"}


class EdgeChunks(Protocol):
    num_edges: int
    num_relations: int
    nbytes: int

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """``(src, dst, rel or None)`` int64 arrays, chunk by chunk, the same on every call."""


class ArrayEdges:
    """Edges given as arrays (``rel`` None for a graph of one relation)."""

    def __init__(self, src: Any, dst: Any, rel: Any | None, *, num_nodes: int, name: str = "edges"):
        self.src = np.asarray(src, dtype=np.int64).reshape(-1)
        self.dst = np.asarray(dst, dtype=np.int64).reshape(-1)
        self.rel = None if rel is None else np.asarray(rel, dtype=np.int64).reshape(-1)
        if self.src.shape != self.dst.shape or (self.rel is not None and self.rel.shape != self.src.shape):
            raise InputError(f"{name}: src, dst (and rel) must have the same length")
        for what, a in (("src", self.src), ("dst", self.dst)):
            if a.size and (a.min() < 0 or a.max() >= num_nodes):
                bad = int(np.flatnonzero((a < 0) | (a >= num_nodes))[0])
                raise InputError(f"{name}: {what}[{bad}] = {int(a[bad])} is outside [0, {num_nodes})")
        if self.rel is not None and self.rel.size and self.rel.min() < 0:
            raise InputError(f"{name}: relation ids must be >= 0")
        self.num_edges = int(self.src.size)
        self.num_relations = int(self.rel.max()) + 1 if self.rel is not None and self.rel.size else 1
        self.nbytes = self.num_edges * 24

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        for s in range(0, self.num_edges, _CHUNK):
            yield self.src[s : s + _CHUNK], self.dst[s : s + _CHUNK], None if self.rel is None else self.rel[s : s + _CHUNK]


class StoredGraphEdges:
    """A dataset's stored graph (every edge, as ``(src, dst)``), or one relation's (a
    :class:`~lightning_ooc.data.hetero_dataset.RelationCSC`, named by ``name``), read in chunks of whole targets of
    about ``chunk_edges`` edges each."""

    def __init__(self, ds: Any, name: str | None = None, chunk_edges: int = _CHUNK):
        self._src = DatasetEdgeSource(ds, chunk_edges=chunk_edges, name=name)
        self.num_edges = int(ds.num_edges)
        self.num_relations = 1
        self.nbytes = self.num_edges * 16

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        for s, d in self._src.chunks():
            yield s, d, None


class _LinkEdges:
    """The positive edges of a dataset's link split (a label of 0 marks a negative, which is skipped)."""

    def __init__(self, ds: Any, name: str):
        self.split = ds.link_split(name)
        self.index = self.split.index  # [2, M]
        self.label = self.split.label
        m = int(self.index.shape[1])
        self.num_edges = m if self.label is None else int((self.label != 0).sum())
        self.num_relations = 1
        self.nbytes = self.num_edges * 16

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        m = int(self.index.shape[1])
        for s in range(0, m, _CHUNK):
            src = self.index[0, s : s + _CHUNK].numpy().astype(np.int64)
            dst = self.index[1, s : s + _CHUNK].numpy().astype(np.int64)
            if self.label is not None:
                keep = self.label[s : s + _CHUNK].numpy() != 0
                src, dst = src[keep], dst[keep]
            yield src, dst, None


def dataset_edge_sources(ds: Any) -> dict[str, EdgeChunks]:
    """A dataset's edges per split: ``train`` is its link split ``train`` if it has one, else its stored
    graph; ``val`` and ``test`` are its link splits of those names, where present."""
    splits = (ds.link_splits or {}).get("splits", {}) if getattr(ds, "link_splits", None) else {}
    out: dict[str, EdgeChunks] = {"train": _LinkEdges(ds, "train") if "train" in splits else StoredGraphEdges(ds)}
    for name in ("val", "test"):
        if name in splits:
            out[name] = _LinkEdges(ds, name)
    return out


def array_edge_sources(edges: dict[str, Any], num_nodes: int) -> dict[str, EdgeChunks]:
    """``{split: (src, dst)}`` or ``{split: (src, rel, dst)}`` as edge sources."""
    out: dict[str, EdgeChunks] = {}
    for name, e in edges.items():
        if name not in ("train", "val", "test"):
            raise InputError(f"edge split names are train, val and test, got {name!r}")
        if len(e) == 2:
            out[name] = ArrayEdges(e[0], e[1], None, num_nodes=num_nodes, name=f"{name} edges")
        elif len(e) == 3:
            out[name] = ArrayEdges(e[0], e[2], e[1], num_nodes=num_nodes, name=f"{name} edges")
        else:
            raise InputError(f"{name} edges must be (src, dst) or (src, rel, dst)")
    if out and "train" not in out:
        raise InputError("edges for evaluation need train edges too (edges={'train': ..., 'val': ...})")
    return out


def write_buckets(
    out_dir: Path, split: str, source: EdgeChunks, bounds: np.ndarray, files: dict[str, Any], progress: bool = False,
    dst_bounds: np.ndarray | None = None,
) -> dict[str, Any]:
    """Write ``source``'s edges grouped into buckets under ``out_dir``; returns the split's metadata.

    Entries for the files are added to ``files`` (as a dataset's ``meta.json``
    lists them; the caller's commit checksums them). ``dst_bounds``: the
    destinations' partitions where they differ from the sources' (``bounds``).
    """
    bounds = np.asarray(bounds, dtype=np.int64)
    dbounds = bounds if dst_bounds is None else np.asarray(dst_bounds, dtype=np.int64)
    n, m = len(bounds) - 1, len(dbounds) - 1
    names = bucket_files(split)
    idt = index_dtype(max(int(bounds[-1]), int(dbounds[-1])))
    with_rel = source.num_relations > 1
    counts = np.zeros(n * m, dtype=np.int64)
    total = 0
    bar = progress_bar(2 * source.num_edges, f"buckets {split}", unit="edge", enabled=progress)
    for src, dst, _ in source.chunks():
        key = _keys(src, dst, bounds, dbounds)
        counts += np.bincount(key, minlength=n * m)
        total += int(src.size)
        bar.update(src.size)
    if total != source.num_edges:
        raise InputError(f"{split} edges: the source gave {total} edges, expected {source.num_edges}")
    offsets = np.zeros(n * m + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    edges_path = out_dir / names["edges"]
    # write the header with the final shape, then fill the body through a map
    w = NpyStreamWriter(edges_path, idt, total, row_shape=(2,))
    w.write(np.zeros((0, 2), idt))
    header = w._header_len
    w._f.truncate(header + total * 2 * idt.itemsize)
    w.count = total
    w.close()
    emap = np.memmap(edges_path, dtype=idt, mode="r+", offset=header, shape=(total, 2)) if total else None
    rmap = None
    if with_rel:
        rel_path = out_dir / names["rel"]
        rw = NpyStreamWriter(rel_path, np.int32, total)
        rw.write(np.zeros(0, np.int32))
        rheader = rw._header_len
        rw._f.truncate(rheader + total * 4)
        rw.count = total
        rw.close()
        rmap = np.memmap(rel_path, dtype=np.int32, mode="r+", offset=rheader, shape=(total,)) if total else None
    cursor = offsets[:-1].copy()
    for src, dst, rel in source.chunks():
        key = _keys(src, dst, bounds, dbounds)
        order = _stable_order(key, n * m)
        key_s = key[order]
        present, starts, lens = np.unique(key_s, return_index=True, return_counts=True)
        s_sorted, d_sorted = src[order], dst[order]
        r_sorted = None if rel is None else rel[order]
        for b, st, ln in zip(present.tolist(), starts.tolist(), lens.tolist()):
            c = int(cursor[b])
            emap[c : c + ln, 0] = s_sorted[st : st + ln]
            emap[c : c + ln, 1] = d_sorted[st : st + ln]
            if rmap is not None:
                rmap[c : c + ln] = 0 if r_sorted is None else r_sorted[st : st + ln]
            cursor[b] += ln
        bar.update(src.size)
    bar.close()
    for mm in (emap, rmap):
        if mm is not None:
            mm.flush()
            del mm
    for path in [edges_path] + ([out_dir / names["rel"]] if with_rel else []):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    ow = NpyStreamWriter(out_dir / names["offsets"], np.int64, n * m + 1)
    ow.write(offsets)
    ow.close()
    for key in ("edges", "offsets") + (("rel",) if with_rel else ()):
        files[f"buckets_{split}_{key}"] = {"name": names[key], "bytes": os.path.getsize(out_dir / names[key])}
    info = {"edges": total, "relations": int(source.num_relations), "with_rel": with_rel}
    if dst_bounds is not None:
        info["dst_partitions"] = m
    return info


def _keys(src: np.ndarray, dst: np.ndarray, bounds: np.ndarray, dbounds: np.ndarray) -> np.ndarray:
    for what, a, b in (("source", src, bounds), ("destination", dst, dbounds)):
        if a.size and (a.min() < 0 or a.max() >= int(b[-1])):
            raise InputError(f"an edge {what} id is outside [0, {int(b[-1])})")
    return _partition_of(src, bounds) * (len(dbounds) - 1) + _partition_of(dst, dbounds)


def _partition_of(ids: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The partition of each id: a division where the partitions but the last are of one size and the last is not
    larger (as layer-wise inference cuts them), a binary search of ``bounds`` otherwise.

        >>> _partition_of(np.array([0, 3, 4, 9, 10]), np.array([0, 4, 8, 11])).tolist()
        [0, 0, 1, 2, 2]
        >>> _partition_of(np.array([0, 3, 4, 9]), np.array([0, 2, 9, 10])).tolist()
        [0, 1, 1, 2]
    """
    step = int(bounds[1] - bounds[0]) if len(bounds) > 1 else 0
    sizes = np.diff(bounds)
    if step > 0 and int(bounds[0]) == 0 and bool((sizes[:-1] == step).all()) and int(sizes[-1]) <= step:
        return ids // step
    return np.searchsorted(bounds, ids, side="right") - 1


def _stable_order(key: np.ndarray, num_keys: int) -> np.ndarray:
    """The stable sort order of ``key`` (values below ``num_keys``): a radix sort where they fit 16 bits."""
    if num_keys <= 1 << 16:
        return np.argsort(key.astype(np.uint16), kind="stable")
    return np.argsort(key, kind="stable")


class EdgeBuckets:
    """The buckets of one split of a table, memory-mapped; :meth:`edges` reads one bucket into memory."""

    def __init__(self, root: str | os.PathLike, split: str, info: dict[str, Any]):
        self.root = Path(root)
        self.split = split
        names = bucket_files(split)
        self.offsets = np.load(self.root / names["offsets"])
        #: destination partitions (as many as the sources' unless the split was written with ``dst_bounds``)
        self.dst_partitions = int(info.get("dst_partitions") or round((self.offsets.size - 1) ** 0.5))
        #: source partitions
        self.num_partitions = (self.offsets.size - 1) // max(1, self.dst_partitions)
        self.num_edges = int(info["edges"])
        self._edges = np.load(self.root / names["edges"], mmap_mode="r")
        self._rel = np.load(self.root / names["rel"], mmap_mode="r") if info.get("with_rel") else None

    def _range(self, i: int, j: int) -> tuple[int, int]:
        k = i * self.dst_partitions + j
        return int(self.offsets[k]), int(self.offsets[k + 1])

    def count(self, i: int, j: int) -> int:
        a, b = self._range(i, j)
        return b - a

    @property
    def edge_bytes(self) -> int:
        """Bytes one stored edge takes (its source and destination)."""
        return 2 * int(self._edges.dtype.itemsize)

    def span(self, i: int, j0: int, j1: int) -> tuple[int, int]:
        """The stored rows ``[a, b)`` of buckets ``(i, j0)`` ... ``(i, j1 - 1)``, which lie next to each other
        (read them with :meth:`rows`)."""
        return self._range(i, j0)[0], self._range(i, j1 - 1)[1]

    def edges(self, i: int, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(src, dst, rel)`` of bucket ``(i, j)`` as int64 tensors (``rel`` zeros with one relation)."""
        return self.rows(*self._range(i, j))

    def rows(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(src, dst, rel)`` of the stored rows ``[a, b)`` (several buckets, or part of one)."""
        e = np.asarray(self._edges[a:b], dtype=np.int64)
        rel = np.zeros(b - a, np.int64) if self._rel is None else np.asarray(self._rel[a:b], dtype=np.int64)
        return torch.from_numpy(np.ascontiguousarray(e[:, 0])), torch.from_numpy(np.ascontiguousarray(e[:, 1])), \
            torch.from_numpy(rel)
