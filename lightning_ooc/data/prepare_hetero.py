"""Convert a PyG ``HeteroData`` to a heterogeneous on-disk dataset (``prepare --pyg`` of a ``HeteroData``).

Every node type keeps PyG's per-type ids. Per type: ``x`` (a type without
``x`` is stored without features), ``y`` (float labels with NaN count as
unknown), and ``train_mask``/``val_mask``/``test_mask`` (or ``*_idx``), else
random splits of its labelled nodes. Per relation: ``edge_index`` (source ids
of the source type in row 0), sorted into an in-edge CSC by the external sort
of the homogeneous writer. ``add_reverse`` (:data:`REVERSE_MODES`) does what
PyG's ``ToUndirected`` does: each relation ``(src, rel, dst)`` between two
types gets a reverse relation ``(dst, rev_rel, src)`` (unless the data has one
of that name); a relation within one type (``cites``) gets its reverse edges
added to it with ``"merge"`` (or ``True``; ``ToUndirected(merge=True)``, PyG's
default), and a ``rev_`` relation of its own with ``"separate"``
(``ToUndirected(merge=False)``, as PyG's heterogeneous examples build
ogbn-mag: ``rev_cites`` beside ``cites``).

Example::

    >>> import tempfile, torch, lightning_ooc
    >>> from torch_geometric.data import HeteroData
    >>> from lightning_ooc.data.prepare_hetero import prepare_from_hetero
    >>> data = HeteroData()
    >>> data["paper"].x = torch.ones(3, 4); data["paper"].y = torch.tensor([0, 1, 1])
    >>> data["author"].num_nodes = 2
    >>> data["author", "writes", "paper"].edge_index = torch.tensor([[0, 1, 1], [0, 0, 2]])
    >>> root = prepare_from_hetero(tempfile.mkdtemp() + "/h", data, add_reverse=True, progress=False)
    >>> ds = lightning_ooc.open_dataset(root)
    >>> ds.edge_types
    [('author', 'writes', 'paper'), ('paper', 'rev_writes', 'author')]
    >>> ds.relation("paper__rev_writes__author").indices.tolist(), ds.target
    ([0, 0, 2], 'paper')
    >>> data["paper", "cites", "paper"].edge_index = torch.tensor([[0, 1], [1, 2]])
    >>> root = prepare_from_hetero(tempfile.mkdtemp() + "/h", data, add_reverse="separate", progress=False)
    >>> lightning_ooc.open_dataset(root).edge_types[-2:]
    [('paper', 'cites', 'paper'), ('paper', 'rev_cites', 'paper')]
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from lightning_ooc.data.edge_sources import ArrayEdgeSource
from lightning_ooc.data.format import FEATURE_DTYPES, SPLITS, feature_dtype_name
from lightning_ooc.data.hetero_dataset import HeteroDatasetWriter, check_name
from lightning_ooc.data.splits import (
    _as_array,
    _labels,
    _random_splits,
    _split_ids,
    check_classes,
    node_split_fractions,
)
from lightning_ooc.errors import InputError

_ROW_CHUNK_BYTES = 64 << 20
#: what ``add_reverse`` does to a relation within one node type: add the reverse edges to it, or put them in
#: a ``rev_`` relation of their own (a relation between two types always gets its ``rev_`` relation)
REVERSE_MODES = ("merge", "separate")


def reverse_mode(add_reverse: Any) -> str | None:
    """``add_reverse`` as one of :data:`REVERSE_MODES`, or None (no reverse edges); ``True`` is ``"merge"``.

    >>> reverse_mode(True), reverse_mode(False), reverse_mode("separate")
    ('merge', None, 'separate')
    """
    if add_reverse is None or add_reverse is False:
        return None
    if add_reverse is True:
        return "merge"
    if add_reverse in REVERSE_MODES:
        return add_reverse
    raise InputError(f"add_reverse must be False, True (merge), {' or '.join(repr(m) for m in REVERSE_MODES)}, got "
                     f"{add_reverse!r}")  # fmt: skip


def is_hetero_data(obj: Any) -> bool:
    """Whether ``obj`` is a PyG ``HeteroData`` (without importing PyG where it is not one)."""
    try:
        from torch_geometric.data import HeteroData  # lazy: PyG only where it is used
    except ImportError:  # pragma: no cover - PyG is a dependency
        return False
    return isinstance(obj, HeteroData)


def _random_split_of(store: Any) -> bool:
    """Whether a node type's labelled nodes are split at random: it gives no mask or index of any split."""
    return all(getattr(store, f"{s}_mask", None) is None and getattr(store, f"{s}_idx", None) is None for s in SPLITS)


def prepare_from_hetero(
    out: str | os.PathLike,
    data: Any,
    *,
    target: str | None = None,
    feature_dtype: str | None = None,
    add_reverse: bool | str = False,
    drop_self_loops: bool = False,
    drop_duplicates: bool = False,
    split: Sequence[float] | None = None,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    source: dict[str, Any] | None = None,
    time_attr: str | None = None,
) -> Path:
    """Write a heterogeneous dataset from a PyG ``HeteroData``; return its path.

    ``time_attr`` names a time attribute, as PyG's temporal ``NeighborLoader`` takes it: a node attribute
    becomes each type's node times, and each relation whose source type has them stores its in-edges in the
    sources' time order; an edge attribute becomes each relation's edge times, in-edges in their time order
    (the relations without it keep source id order). Temporal sampling (``time_attr="time"`` /
    ``"edge_time"``) then reads them. A labelled type's ``train_time`` / ``val_time`` / ``test_time`` (one per
    seed of that split) are its seeds' own times.

    ``target`` names the node type a node task predicts (default: the only type with ``y``).
    ``feature_dtype`` is the stored dtype of every type's features (default: each type's own;
    float64 is stored as float32). ``drop_self_loops`` applies to relations within one type.
    ``split`` (default ``(0.8, 0.1, 0.1)``) splits the labelled nodes of each labelled type that
    gives no splits of its own at random; given where no type would use it, it is an error.
    ``add_reverse``: ``False``, ``"merge"`` (or ``True``) or ``"separate"`` (the module docstring).
    """
    node_split_fractions(split)
    mode = reverse_mode(add_reverse)

    node_types: dict[str, dict[str, Any]] = {}
    xs: dict[str, Any] = {}
    ys: dict[str, np.ndarray] = {}
    for t in data.node_types:
        check_name(t, "node type")
        store = data[t]
        n = store.num_nodes
        if n is None:
            raise InputError(f"node type {t!r} has neither x nor num_nodes; set data[{t!r}].num_nodes")
        x = _as_array(getattr(store, "x", None), f"features of node type {t!r}")
        entry: dict[str, Any] = {"num_nodes": int(n)}
        if x is not None:
            if len(x.shape) != 2 or int(x.shape[0]) != n:
                raise InputError(f"node type {t!r}: x must have shape ({n}, dim), got {tuple(x.shape)}")
            in_dtype = str(x.dtype).replace("torch.", "")
            if in_dtype not in FEATURE_DTYPES and in_dtype != "float64":
                raise InputError(f"node type {t!r}: features have dtype {in_dtype}; expected a float (or uint8/int8) "
                                 "matrix")  # fmt: skip
            dt = feature_dtype or ("float32" if in_dtype == "float64" else in_dtype)
            try:
                entry.update(num_features=int(x.shape[1]), feature_dtype=feature_dtype_name(dt))
            except ValueError as e:
                raise InputError(f"node type {t!r}: {e}") from None
            xs[t] = x
        y, classes = _labels(_as_array(getattr(store, "y", None), "labels"), int(n))
        if y is not None:
            entry["num_classes"] = max(classes, 1)
            ys[t] = y
        node_types[t] = entry
    if target is None and len(ys) == 1:
        target = next(iter(ys))
    if target is not None and target not in ys:
        raise InputError(f"target {target!r} is not a node type with labels (y); labelled types: {list(ys)}")
    if target is not None:  # the type a node classifier learns: two classes or more
        check_classes(int(ys[target].max(initial=-1)) + 1, f"node type {target!r} (the target): the labels (y)")
    if split is not None and not any(_random_split_of(data[t]) for t in ys):
        why = "every labelled node type gives its own (train_mask/..., train_idx/...)" if ys else "no node type has labels (y)"
        raise InputError(f"--split (split=) draws random node splits, but {why}, so it would not be used; leave out "
                         "--split")  # fmt: skip

    node_time: dict[str, np.ndarray] = {}
    edge_time: dict[Any, Any] = {}
    if time_attr is not None:
        node_time = {t: np.asarray(_as_array(data[t][time_attr], f"{time_attr} of {t!r}")).reshape(-1)
                     for t in data.node_types if time_attr in data[t]}  # fmt: skip
        edge_time = {et: data[et][time_attr] for et in data.edge_types if time_attr in data[et]}
        if node_time and edge_time:
            raise InputError(f"time attribute {time_attr!r} is both a node and an edge attribute")
        if not node_time and not edge_time:
            raise InputError(f"time attribute {time_attr!r} is neither a node nor an edge attribute of the data")
        for t, tm in node_time.items():
            if tm.size != node_types[t]["num_nodes"]:
                raise InputError(f"node type {t!r}: {tm.size} times ({time_attr}) for {node_types[t]['num_nodes']} "
                                 "nodes")  # fmt: skip
    # (edge type, edge_index, add its reverse edges, edge times)
    relations: list[tuple[tuple[str, str, str], Any, bool, Any]] = []
    given = set(data.edge_types)
    for et in data.edge_types:
        ei = getattr(data[et], "edge_index", None)
        if ei is None:
            raise InputError(f"relation {et} has no edge_index (a CSR/CSC adj_t is not read; give edge_index)")
        merged = mode == "merge" and et[0] == et[2]
        times = edge_time.get(et)
        relations.append((et, ei, merged, times))
        rev = (et[2], f"rev_{et[1]}", et[0])
        if mode is not None and not merged and rev not in given:
            relations.append((rev, ei.flip(0) if isinstance(ei, torch.Tensor) else np.asarray(ei)[::-1], False,
                              times))  # fmt: skip

    est = sum(int(x.shape[0]) * int(x.shape[1]) * FEATURE_DTYPES[node_types[t]["feature_dtype"]][1].itemsize
              for t, x in xs.items())  # fmt: skip
    src = dict(input="pyg HeteroData", add_reverse=mode or False, drop_self_loops=drop_self_loops,
               drop_duplicates=drop_duplicates, **({"time_attr": time_attr} if time_attr else {}),
               **(source or {}))  # fmt: skip
    with HeteroDatasetWriter(out, node_types=node_types, edge_types=[r[0] for r in relations], target=target,
                             overwrite=overwrite, source=src, progress=progress, estimated_bytes=est) as w:
        for et, ei, rev, times in relations:
            edges = ArrayEdgeSource(_as_array(ei, f"edge_index of {et}"), name=f"edge_index of {et}",
                                    times=None if times is None else _as_array(times, f"{time_attr} of {et}"))  # fmt: skip
            order = "edge_time" if times is not None else "node_time" if et[0] in node_time else "source_id"
            w.relation(et).write_edges(edges, add_reverse=rev, drop_self_loops=drop_self_loops and et[0] == et[2],
                                       drop_duplicates=drop_duplicates, neighbor_order=order,
                                       node_time=node_time.get(et[0]))  # fmt: skip
        for t, tm in node_time.items():
            w.node(t).write_node_time(tm[s : s + (1 << 22)] for s in range(0, tm.size, 1 << 22))
        for t, x in xs.items():
            n, f = int(x.shape[0]), int(x.shape[1])
            rows = max(1, _ROW_CHUNK_BYTES // max(1, f * 8))
            w.node(t).write_features(x[s : s + rows] if isinstance(x, torch.Tensor) else np.asarray(x[s : s + rows])
                                     for s in range(0, n, rows))  # fmt: skip
        for t, y in ys.items():
            n = node_types[t]["num_nodes"]
            part = w.node(t)
            part.write_labels([y])
            store = data[t]
            given_splits = {s: getattr(store, f"{s}_mask", None) for s in SPLITS}
            for s in SPLITS:
                if given_splits[s] is None:
                    given_splits[s] = getattr(store, f"{s}_idx", None)
            if any(v is not None for v in given_splits.values()):
                ids = {s: _split_ids(v, n, f"{t} {s}") if v is not None else np.empty(0, np.int64)
                       for s, v in given_splits.items()}  # fmt: skip
                for s, a in ids.items():
                    bad = a[(a >= 0) & (a < n)]
                    bad = bad[y[bad] < 0]
                    if bad.size:
                        raise InputError(f"node type {t!r}: the {s} split holds {bad.size:,} node(s) without a label, "
                                         f"e.g. node {int(bad[0])}; give them labels or leave them out")  # fmt: skip
            else:
                ids = _random_splits(y, n, split, seed)
            for s in SPLITS:
                st = getattr(store, f"{s}_time", None)
                part.write_split(s, ids[s], None if st is None else np.asarray(_as_array(st, f"{t} {s}_time")))
        return w.commit()
