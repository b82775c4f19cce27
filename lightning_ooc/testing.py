"""Helpers for tests: small datasets and NumPy reference implementations.

Example::

    >>> import numpy as np
    >>> from lightning_ooc.testing import reference_csc
    >>> indptr, indices = reference_csc(np.array([0, 2, 2]), np.array([1, 1, 0]), num_nodes=3)
    >>> indptr.tolist(), indices.tolist()
    ([0, 1, 3, 3], [2, 0, 2])
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from lightning_ooc.data.dataset import OnDiskDataset, open_dataset
from lightning_ooc.data.synth import synthesize


def reference_csc(
    src: np.ndarray,
    dst: np.ndarray,
    num_nodes: int,
    *,
    add_reverse: bool = False,
    drop_self_loops: bool = False,
    drop_duplicates: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The in-edge CSC of an edge list, built in memory with plain NumPy (sources sorted per target)."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if drop_self_loops:
        keep = src != dst
        src, dst = src[keep], dst[keep]
    if add_reverse:
        src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    if drop_duplicates and src.size:
        pairs = np.unique(np.stack([dst, src], 1), axis=0)
        dst, src = pairs[:, 0], pairs[:, 1]
    order = np.lexsort((src, dst))
    indices = src[order]
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=num_nodes), out=indptr[1:])
    return indptr, indices


def make_synthetic(root: str | os.PathLike, **kwargs) -> OnDiskDataset:
    """Synthesize a small graph (defaults: 2,000 nodes, degree 8, dim 16, 4 classes) and open it."""

    opts = dict(num_nodes=2000, avg_degree=8, num_features=16, num_classes=4, seed=0, progress=False, overwrite=True)
    opts.update(kwargs)
    return open_dataset(synthesize(Path(root), **opts))


def dataset_files_bytes(root: str | os.PathLike) -> dict[str, bytes]:
    """Every file of a dataset directory, by name (for byte-for-byte comparisons)."""
    root = Path(root)
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}
