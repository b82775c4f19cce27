"""The bucketed external sort that turns edges in any order into in-edge CSC segments, in bounded memory.

The writer (:class:`~lightning_ooc.data.writer.PartWriter`) hands it its edge chunks (a callable that
iterates them afresh: they are read twice) and writes the segments it yields:

1. pass 1 counts every node's in-degree;
2. :func:`bucket_bounds` cuts the nodes into consecutive ranges holding at most ``bucket_edges`` in-edges
   each, and pass 2 appends each edge, as a ``(dst, src)`` pair, to the bucket file of its target's range;
3. pass 3 reads one bucket at a time (:func:`read_sorted_bucket`: sorted by ``(dst, src)``, optionally
   without duplicates; the file is removed once read) and yields it as a CSC segment: the in-degrees of its
   nodes and their sources in order.

Memory is one chunk and one bucket (16 bytes an edge while it is sorted), whatever the edge count.

Edges with times (chunks of ``(src, dst, time)``) travel with their time (24 bytes an edge in a bucket), and
come out as ``(counts, sources, times)``. With ``order="edge_time"`` each node's in-edges are sorted by their
time, with ``order="node_time"`` by their sources' times (``node_time``, the source type's); ties by source id.

Example::

    >>> import tempfile, numpy as np
    >>> from pathlib import Path
    >>> from lightning_ooc.data.external_sort import external_sort
    >>> src, dst = np.array([3, 0, 2, 1, 0]), np.array([1, 2, 1, 0, 2])  # 0 -> 2 twice
    >>> segments = external_sort(lambda: iter([(src, dst)]), num_nodes=4, num_src_nodes=4, num_edges=5,
    ...                          workdir=Path(tempfile.mkdtemp()), pair_dtype=np.int32, bucket_edges=2,
    ...                          drop_duplicates=True)
    >>> [(deg.tolist(), srcs.tolist()) for deg, srcs in segments]
    [([1, 2], [1, 2, 3]), ([1], [0]), ([0], [])]
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from lightning_ooc.utils.progress import progress_bar

Chunks = Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]


#: Default number of edges per bucket of the external sort (16 bytes each while sorting).
DEFAULT_BUCKET_EDGES = 1 << 24


def bucket_bounds(deg: np.ndarray, bucket_edges: int) -> np.ndarray:
    """Bucket boundaries: consecutive node ranges holding at most ``bucket_edges`` in-edges each.

    ``bucket_edges`` is raised where needed so that there are at most about 4096 buckets.
    """
    n = deg.size
    cum = np.cumsum(deg)
    e = int(cum[-1]) if n else 0
    bucket_edges = max(int(bucket_edges), 1, -(-e // 4096))  # at most ~4096 bucket files
    cuts = np.searchsorted(cum, np.arange(bucket_edges, e, bucket_edges, dtype=np.int64), side="left") + 1
    return np.unique(np.concatenate([[0], cuts[cuts < n], [n]])).astype(np.int64)


def read_sorted_bucket(
    path: Path, pair_dtype: np.dtype, lo: int, hi: int, n: int, drop_duplicates: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Read (and remove) the bucket file of nodes ``[lo, hi)``; return its ``(dst - lo, src)`` sorted, as int64."""
    pairs = np.fromfile(path, dtype=pair_dtype).reshape(-1, 2)
    path.unlink()
    if (hi - lo) * n < 2**63:
        key = (pairs[:, 0].astype(np.int64) - lo) * n + pairs[:, 1]
        del pairs
        key.sort()
        if drop_duplicates and key.size:
            key = key[np.concatenate([[True], key[1:] != key[:-1]])]
        local, src = np.divmod(key, n)
    else:  # pragma: no cover - needs > 3e9 nodes
        order = np.lexsort((pairs[:, 1], pairs[:, 0]))
        local = pairs[order, 0].astype(np.int64) - lo
        src = pairs[order, 1].astype(np.int64)
        if drop_duplicates and src.size:
            keep = np.concatenate([[True], (local[1:] != local[:-1]) | (src[1:] != src[:-1])])
            local, src = local[keep], src[keep]
    return local, src


def external_sort(chunks: Chunks, *, num_nodes: int, num_src_nodes: int, num_edges: int | None, workdir: Path,
                  pair_dtype: np.dtype, bucket_edges: int = DEFAULT_BUCKET_EDGES, drop_duplicates: bool = False,
                  per_input: int = 1, progress: bool = False, timed: bool = False, order: str = "source_id",
                  node_time: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, ...]]:  # fmt: skip
    """The CSC segments (in-degrees of a node range, their sources in order) of the edges ``chunks()`` yields,
    sorted through bucket files in ``workdir``. ``num_edges`` and ``per_input`` (edges a chunk holds per input
    edge: 2 with reverses added) are for the progress bars. ``timed``: the chunks are ``(src, dst, time)`` and
    the segments ``(counts, sources, times)``; ``order`` and ``node_time`` as the module says."""
    deg = _count_in_degrees(chunks, num_nodes, num_edges, per_input, progress)
    total = num_edges * per_input if num_edges is not None else int(deg.sum())  # a CSV's count: known after pass 1
    bounds = bucket_bounds(deg, bucket_edges)
    del deg
    bucket_paths = [workdir / f"bucket-{i:05d}.bin" for i in range(len(bounds) - 1)]
    dtype = np.dtype(np.int64) if timed else pair_dtype
    _scatter_into_buckets(chunks, bounds, bucket_paths, num_edges, per_input, dtype, progress)
    if not timed and order == "source_id":
        yield from _sorted_buckets(bounds, bucket_paths, total, drop_duplicates, pair_dtype,
                                   max(num_nodes, num_src_nodes), progress)  # fmt: skip
        return
    with progress_bar(total, "sort buckets", "edge", progress) as bar:
        for i, path in enumerate(bucket_paths):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            local, src, time = read_timed_bucket(path, dtype, 3 if timed else 2, lo, order, node_time,
                                                 drop_duplicates)  # fmt: skip
            bar.update(len(src))
            counts = np.bincount(local, minlength=hi - lo)
            yield (counts, src, time) if timed else (counts, src)


def read_timed_bucket(path: Path, dtype: np.dtype, columns: int, lo: int, order: str, node_time: np.ndarray | None,
                      drop_duplicates: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:  # fmt: skip
    """Read (and remove) a bucket of ``(dst, src[, time])`` rows; return ``(dst - lo, src, time)`` sorted by
    ``(dst, the order's time, src)`` (``time`` None without a time column)."""
    rows = np.fromfile(path, dtype=dtype).reshape(-1, columns)
    path.unlink()
    dst = rows[:, 0].astype(np.int64) - lo
    src = rows[:, 1].astype(np.int64)
    time = rows[:, 2].astype(np.int64) if columns == 3 else None
    del rows
    if order == "edge_time":
        key = time
    elif order == "node_time":
        key = np.asarray(node_time[src], dtype=np.int64)
    else:
        key = np.zeros_like(src)
    sort = np.lexsort((src,) + (() if time is None else (time,)) + (key, dst))
    dst, src = dst[sort], src[sort]
    time = None if time is None else time[sort]
    if drop_duplicates and src.size:
        same = (dst[1:] == dst[:-1]) & (src[1:] == src[:-1])
        if time is not None:
            same &= time[1:] == time[:-1]
        keep = np.concatenate([[True], ~same])
        dst, src = dst[keep], src[keep]
        time = None if time is None else time[keep]
    return dst, src, time


def _count_in_degrees(chunks: Chunks, num_nodes: int, num_edges: int, per_input: int, progress: bool) -> np.ndarray:
    """Pass 1: the in-degree of every node."""
    deg = np.zeros(num_nodes, dtype=np.int64)
    with progress_bar(num_edges, "count in-degrees", "edge", progress) as bar:
        for src, dst, *_ in chunks():
            deg += np.bincount(dst, minlength=num_nodes)
            bar.update(src.size // per_input)
    return deg


def _scatter_into_buckets(chunks: Chunks, bounds: np.ndarray, bucket_paths: list[Path], num_edges: int,
                          per_input: int, pair_dtype: np.dtype, progress: bool) -> None:  # fmt: skip
    """Pass 2: append each edge, as a ``(dst, src[, time])`` row, to the bucket file of its target's node range."""
    nb = len(bucket_paths)
    handles = [open(p, "wb") for p in bucket_paths]
    try:
        with progress_bar(num_edges, "bucket edges", "edge", progress) as bar:
            for src, dst, *time in chunks():
                b = np.searchsorted(bounds, dst, side="right") - 1
                order = np.argsort(b, kind="stable")
                pairs = np.empty((src.size, 2 + len(time)), dtype=pair_dtype)
                pairs[:, 0] = dst[order]
                pairs[:, 1] = src[order]
                if time:
                    pairs[:, 2] = time[0][order]
                sizes = np.bincount(b, minlength=nb)
                starts = np.concatenate([[0], np.cumsum(sizes)])
                for i in np.flatnonzero(sizes):
                    handles[i].write(memoryview(pairs[starts[i] : starts[i + 1]]).cast("B"))
                bar.update(src.size // per_input)
    finally:
        for h in handles:
            h.close()


def _sorted_buckets(bounds: np.ndarray, bucket_paths: list[Path], total: int, drop_duplicates: bool,
                    pair_dtype: np.dtype, n: int, progress: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """Pass 3: each bucket sorted by ``(dst, src)`` (optionally de-duplicated), as a CSC segment."""
    with progress_bar(total, "sort buckets", "edge", progress) as bar:
        for i, path in enumerate(bucket_paths):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            local, src = read_sorted_bucket(path, pair_dtype, lo, hi, n, drop_duplicates)
            bar.update(len(src))
            yield np.bincount(local, minlength=hi - lo), src
