"""Where a dataset's edges come from while it is written: in-memory arrays, a binary file of ``src dst`` pairs, or
the CSC of a dataset already on disk (its edges, or its edges reversed), each read in chunks.

Each is an :class:`EdgeSource`: a ``name`` for messages, ``num_edges``, and ``chunks()`` that reads the edges
afresh every time (the writer's external sort reads them twice).

>>> import os, tempfile, numpy as np
>>> [(s.tolist(), d.tolist()) for s, d in ArrayEdgeSource(np.array([[0, 1], [1, 2]])).chunks()]
[([0, 1], [1, 2])]
>>> path = os.path.join(tempfile.mkdtemp(), "edges.bin")
>>> np.array([[0, 1], [1, 2], [2, 0]], dtype="<i8").tofile(path)  # (src, dst) pairs
>>> pairs = PairFileEdgeSource(path, "edges.bin", chunk_edges=2)
>>> isinstance(pairs, EdgeSource), pairs.num_edges, [(s.tolist(), d.tolist()) for s, d in pairs.chunks()]
(True, 3, [([0, 1], [1, 2]), ([2], [0])])
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Protocol, runtime_checkable

import numpy as np

from lightning_ooc.errors import InputError


@runtime_checkable
class EdgeSource(Protocol):
    """Something that yields the edge list in chunks, and can do so more than once."""

    name: str
    num_edges: int

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(src, dst)`` int64 arrays."""
        ...


class ArrayEdgeSource:
    """Edges from a ``(2, E)`` array-like (NumPy, memmap or tensor), read in chunks.

    Row 0 holds sources, row 1 targets, as in PyG's ``edge_index``. ``times`` (one per edge) makes the
    source timed: its chunks are ``(src, dst, time)``.
    """

    def __init__(self, edge_index: Any, name: str = "edge_index", chunk_edges: int = 1 << 22, times: Any = None):
        shape = tuple(edge_index.shape)
        if len(shape) != 2 or shape[0] != 2:
            raise InputError(f"{name}: edge_index must have shape (2, E), got {shape}")
        self.edge_index = edge_index
        self.name = name
        self.num_edges = int(shape[1])
        self.chunk_edges = int(chunk_edges)
        if times is not None and tuple(times.shape) not in ((self.num_edges,), (self.num_edges, 1)):
            raise InputError(f"{name}: {tuple(times.shape)} edge times for {self.num_edges} edges")
        self.times = times
        #: whether chunks carry each edge's time
        self.timed = times is not None

    def chunks(self) -> Iterator[tuple[np.ndarray, ...]]:
        for s in range(0, self.num_edges, self.chunk_edges):
            block = self.edge_index[:, s : s + self.chunk_edges]
            block = block.numpy() if hasattr(block, "numpy") else np.asarray(block)
            if self.times is None:
                yield block[0], block[1]
            else:
                t = self.times[s : s + self.chunk_edges]
                yield block[0], block[1], (t.numpy() if hasattr(t, "numpy") else np.asarray(t)).reshape(-1)


class PairFileEdgeSource:
    """Edges stored as raw little-endian int64 ``(src, dst)`` pairs in a file."""

    def __init__(self, path: Path, name: str, chunk_edges: int = 1 << 22):
        self.path = Path(path)
        self.name = name
        self.num_edges = self.path.stat().st_size // 16
        self.chunk_edges = chunk_edges

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        mm = np.memmap(self.path, dtype="<i8", mode="r", shape=(self.num_edges, 2)) if self.num_edges else None
        for s in range(0, self.num_edges, self.chunk_edges):
            block = np.array(mm[s : s + self.chunk_edges])
            yield block[:, 0], block[:, 1]


class DatasetEdgeSource:
    """The edges of an on-disk dataset (or of any CSC), read from its CSC in chunks of whole target nodes;
    ``reverse=True`` gives them reversed (a reverse relation's edges).

    >>> import tempfile, numpy as np, lightning_ooc
    >>> from lightning_ooc.data.prepare import prepare_from_arrays
    >>> root = prepare_from_arrays(tempfile.mkdtemp() + "/g", np.array([[0, 2, 1], [1, 1, 2]]),
    ...                            np.zeros((3, 2), np.float32), progress=False)
    >>> [(s.tolist(), d.tolist()) for s, d in DatasetEdgeSource(lightning_ooc.open_dataset(root)).chunks()]
    [([0, 2, 1], [1, 1, 2])]
    """

    def __init__(self, ds: Any, chunk_edges: int = 1 << 22, *, reverse: bool = False, name: str | None = None):
        self.ds = ds  # anything with indptr, indices, num_nodes, num_edges: a dataset, a relation's CSC
        self.name = name or f"{ds.root} (its stored graph)"
        self.num_edges = int(ds.num_edges)
        self.chunk_edges = int(chunk_edges)
        #: yield every edge reversed, ``(dst, src)``: the edges of the reverse relation
        self.reverse = bool(reverse)
        #: whether chunks carry each edge's time (the CSC's ``edge_time``, where it has one)
        self.timed = getattr(ds, "edge_time", None) is not None

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        indptr, n = self.ds.indptr, self.ds.num_nodes
        lo = 0
        while lo < n:
            # whole targets, about chunk_edges edges (one target with more in-edges is a chunk of its own)
            hi = int(np.searchsorted(indptr, indptr[lo] + self.chunk_edges, side="right")) - 1
            hi = min(n, max(hi, lo + 1))
            src = np.asarray(self.ds.indices[indptr[lo] : indptr[hi]], dtype=np.int64)
            dst = np.repeat(np.arange(lo, hi, dtype=np.int64), np.diff(indptr[lo : hi + 1]))
            pair = (dst, src) if self.reverse else (src, dst)
            if self.timed:
                yield pair + (np.asarray(self.ds.edge_time[indptr[lo] : indptr[hi]], dtype=np.int64),)
            else:
                yield pair
            lo = hi
