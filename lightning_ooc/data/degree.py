"""In-degree a slice at a time: what ranks and tie-breaks need from ``indptr`` without an array of one entry
per node (``np.diff(indptr)`` is 8 B per node, 128 MiB at 16M nodes)."""
from __future__ import annotations

import numpy as np


class InDegree:
    """The in-degree of the nodes of ``indptr`` (or of ``nodes``, global ids, one per row), computed a slice at a
    time: what the ranking breaks ties with, without an array of one entry per node.

    >>> deg = InDegree(np.array([0, 2, 2, 5]))
    >>> len(deg), deg[0:3].tolist(), deg[1:2].tolist()
    (3, [2, 0, 3], [0])
    >>> InDegree(np.array([0, 2, 2, 5]), nodes=np.array([2, 0]))[0:2].tolist()
    [3, 2]
    """

    def __init__(self, indptr: np.ndarray, nodes: np.ndarray | None = None):
        self.indptr, self.nodes = indptr, nodes

    def __len__(self) -> int:
        return len(self.indptr) - 1 if self.nodes is None else len(self.nodes)

    def __getitem__(self, s: slice) -> np.ndarray:
        lo, hi, _ = s.indices(len(self))
        hi = max(lo, hi)
        if self.nodes is None:
            return np.diff(np.asarray(self.indptr[lo : hi + 1], dtype=np.int64))
        v = np.asarray(self.nodes[lo:hi], dtype=np.int64)
        return np.asarray(self.indptr[v + 1], dtype=np.int64) - np.asarray(self.indptr[v], dtype=np.int64)
