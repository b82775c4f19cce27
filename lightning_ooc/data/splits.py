"""A user's labels and node splits turned into what the writer takes: arrays from tensors, NumPy arrays or
``.npy`` files, the class count, split ids from masks or index arrays, and seeded random splits of the labelled
nodes.

>>> import numpy as np
>>> node_split_fractions(None)
(0.8, 0.1, 0.1)
>>> _split_ids(np.array([True, False, True]), 3, "train").tolist()
[0, 2]
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch

from lightning_ooc.data.files import input_file
from lightning_ooc.data.format import SPLITS, load_npy_file
from lightning_ooc.errors import InputError


#: the fractions of labelled nodes in the random train, val and test splits when ``split`` is not given
DEFAULT_SPLIT = (0.8, 0.1, 0.1)


def load_npy(path: str | os.PathLike, what: str) -> np.ndarray:
    """Open a ``.npy`` file memory-mapped, with an error that names it when that fails."""
    path = input_file(path, f"the {what}", f"{path}: {what} file not found")
    try:
        return load_npy_file(path, "r")
    except (ValueError, OSError, EOFError) as e:
        raise InputError(f"{path}: cannot read the {what} as a .npy array ({e}); save it with numpy.save") from None


def _as_array(a: Any, what: str) -> Any:
    if a is None:
        return None
    if isinstance(a, torch.Tensor):
        return a.detach().cpu()
    if isinstance(a, (str, os.PathLike)):
        return load_npy(a, what)
    return np.asarray(a) if not isinstance(a, np.ndarray) else a


def _numpy(block: Any) -> np.ndarray:
    return block.numpy() if isinstance(block, torch.Tensor) else np.asarray(block)


#: labels converted per chunk of this many (a float array of 100M labels is not copied whole)
_LABEL_CHUNK = 1 << 24


def _labels(y: Any, n: int) -> tuple[np.ndarray | None, int]:
    """Labels as int64 (``-1`` for unknown) and the number of classes."""
    if y is None:
        return None, 0
    y = _numpy(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or y.shape[0] != n:
        raise InputError(f"labels must have shape ({n},) to match the feature rows, got {tuple(y.shape)}")
    if y.dtype.kind == "f":  # OGB-style float labels with NaN for unlabelled nodes: converted a chunk at a time
        out = np.full(n, -1, dtype=np.int64)
        for s in range(0, n, _LABEL_CHUNK):
            part = np.asarray(y[s : s + _LABEL_CHUNK])
            known = ~np.isnan(part)
            vals = part[known]
            bad = np.flatnonzero((vals != np.floor(vals)) | ~np.isfinite(vals) | (vals < -1) | (vals >= 2.0**53))
            if bad.size:  # named as given: a cast of inf or 1e30 to int64 says nothing of the input
                node = s + int(np.flatnonzero(known)[bad[0]])
                raise InputError(f"labels must be whole numbers >= -1 (-1 or NaN = unknown; nothing fractional or "
                                 f"infinite), found {float(vals[bad[0]])!r} at node {node}")  # fmt: skip
            out[s : s + _LABEL_CHUNK][known] = vals.astype(np.int64)
        y = out
    elif y.dtype.kind in "iub":
        y = y.astype(np.int64)
    else:
        raise InputError(f"labels must be integers, got dtype {y.dtype}")
    if y.size and y.min() < -1:
        raise InputError(f"labels must be >= -1 (-1 = unknown), found {int(y.min())} (node {int(np.argmin(y))})")
    num_classes = int(y.max()) + 1 if y.size and y.max() >= 0 else 0
    return y, num_classes


def check_classes(num_classes: int, what: str = "labels") -> None:
    """Labels of ``num_classes`` classes are ones node classification can learn from: two classes or more, else an
    InputError saying what to give instead (``what``: the labels, named).

    >>> check_classes(2)
    >>> try:
    ...     check_classes(1)
    ... except InputError as e:
    ...     print(str(e)[:66])
    labels: 1 class (every labelled node is of class 0); node classifi
    """
    if num_classes >= 2:
        return
    which = "no labelled node (every label is -1 or NaN)" if num_classes < 1 else \
        "1 class (every labelled node is of class 0)"  # fmt: skip
    raise InputError(f"{what}: {which}; node classification needs two classes or more: give labels of two or more "
                     "classes (or num_classes=, --num-classes, of two or more), or leave the labels out")


def _split_ids(value: Any, n: int, name: str) -> np.ndarray:
    """A split given as a boolean mask of length N or as node ids."""
    a = _numpy(value)
    if a.dtype == np.bool_:
        if a.shape != (n,):
            raise InputError(f"{name} mask must have shape ({n},), got {tuple(a.shape)}")
        return np.flatnonzero(a).astype(np.int64)
    if a.dtype.kind not in "iu":
        raise InputError(f"{name} split must be a boolean mask or integer node ids, got dtype {a.dtype}")
    ids = a.reshape(-1).astype(np.int64, copy=False)
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise InputError(f"{name} split: node ids must lie in [0, {n}), got {ids.min()}..{ids.max()}")
    return ids


def node_split_fractions(split: Sequence[float] | None) -> tuple[float, float, float]:
    """``--split`` (``split=``): three finite fractions >= 0 adding up to at most 1; None: :data:`DEFAULT_SPLIT`.

    >>> node_split_fractions(None), node_split_fractions([0.6, 0.2, 0.2])
    ((0.8, 0.1, 0.1), (0.6, 0.2, 0.2))
    """
    if split is None:
        return DEFAULT_SPLIT
    try:
        fracs = tuple(float(f) for f in split)
    except (TypeError, ValueError):
        fracs = ()
    if len(fracs) != 3 or not all(np.isfinite(fracs)) or min(fracs) < 0 or sum(fracs) > 1 + 1e-9:
        raise InputError(f"--split (split=) takes three finite fractions >= 0 adding up to at most 1 (train,val,test "
                         f"shares of the labelled nodes), got {list(split) if fracs else split!r}")  # fmt: skip
    return fracs  # type: ignore[return-value]


def _random_splits(y: np.ndarray | None, n: int, split: Sequence[float] | None, seed: int) -> dict[str, np.ndarray]:
    fracs = node_split_fractions(split)
    if y is None:
        return {s: np.empty(0, dtype=np.int64) for s in SPLITS}
    labelled = np.flatnonzero(y >= 0)
    perm = np.random.default_rng(seed).permutation(labelled)
    a = int(round(fracs[0] * labelled.size))
    b = a + int(round(fracs[1] * labelled.size))
    c = b + int(round(fracs[2] * labelled.size))
    return {"train": np.sort(perm[:a]), "val": np.sort(perm[a:b]), "test": np.sort(perm[b:c])}
