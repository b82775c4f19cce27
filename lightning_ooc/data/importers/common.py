"""What every importer shares: the options of ``prepare --from``, and one writer for heterogeneous graphs whose
features, edges and labels come as streams (a homogeneous graph goes through the writer of
:mod:`lightning_ooc.data.prepare`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from lightning_ooc.data.format import FEATURE_DTYPES, SPLITS, feature_dtype_name
from lightning_ooc.data.hetero_dataset import HeteroDatasetWriter, check_name
from lightning_ooc.data.importers.sources import NpzRowFile, row_blocks
from lightning_ooc.data.in_place import RowFile
from lightning_ooc.data.prepare import FEATURE_MODES, _ROW_CHUNK_BYTES
from lightning_ooc.data.splits import _labels, _random_splits, _split_ids, check_classes, node_split_fractions
from lightning_ooc.errors import InputError
from lightning_ooc.utils.progress import progress_bar


@dataclass
class ImportOptions:
    """The options every layout takes (``prepare --from``'s command line).

    >>> ImportOptions(features="in-place").add_reverse is None  # None: as the layout's own loader builds it
    True
    >>> ImportOptions(features="linked")
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.InputError: features='linked': use one of copy, in-place
    """

    features: str = "copy"
    feature_dtype: str | None = None
    add_reverse: bool | None = None  # None: as the layout's own loader builds the graph
    split: Sequence[float] | None = None
    seed: int = 0
    overwrite: bool = False
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # a layout's own options (e.g. IGB's label set)

    def __post_init__(self) -> None:
        if self.features not in FEATURE_MODES:
            raise InputError(f"features={self.features!r}: use one of {', '.join(FEATURE_MODES)}")
        node_split_fractions(self.split)


def in_place_rows(rows: Any, what: str, progress: bool = False) -> RowFile:
    """``rows`` if they can be used in place, else an InputError saying why not and what to do; the rows of a stored
    ``.npz`` member are read whole first and checked against the archive's CRC-32 (used in place, they are not
    streamed through the check)."""
    if isinstance(rows, NpzRowFile):
        with progress_bar(rows.member.data_bytes, f"CRC-32 {rows.name}", "B", progress) as bar:
            rows.check_whole(bar)
    if isinstance(rows, RowFile):
        return rows
    why = getattr(rows, "name", what)
    raise InputError(f"{why}: these features cannot be used in place (they are compressed or text, not rows of a "
                     "file); import them with --features copy")  # fmt: skip


@dataclass
class NodeInput:
    """One node type of a heterogeneous import: its count, features (rows of a file, or a stream of
    blocks; None: none), labels (``(N,)`` or ``(N, 1)``, float with NaN or int with -1 for none) and splits
    (``{split: ids or mask}``; None: drawn at random from the labelled nodes) and ``time`` (``(N,)`` integers).

    >>> NodeInput(3, labels=np.array([0, 1, -1])).splits is None
    True
    """

    num_nodes: int
    features: Any = None
    labels: Any = None
    splits: dict[str, Any] | None = None
    time: Any = None  # an integer time of each node (a year), stored as the type's node_time


def write_hetero(out: str | os.PathLike, nodes: dict[str, NodeInput], relations: list[tuple[tuple[str, str, str], Any]],
                 opts: ImportOptions, *, target: str | None, source: dict[str, Any]) -> Path:  # fmt: skip
    """Write a heterogeneous dataset from streamed node types and relations (``(edge type, edge source)``).

    With ``opts.add_reverse`` each relation between two types gets a ``rev_`` relation of its reversed edges
    (unless the layout has it) and a relation within one type gets its reverses added.
    """
    node_types: dict[str, dict[str, Any]] = {}
    labels: dict[str, np.ndarray] = {}
    for t, nd in nodes.items():
        check_name(t, "node type")
        entry: dict[str, Any] = {"num_nodes": int(nd.num_nodes)}
        x = nd.features
        if x is not None:
            if x.shape[0] != nd.num_nodes or len(x.shape) != 2:
                raise InputError(f"node type {t!r}: features of shape {tuple(x.shape)} for {nd.num_nodes} nodes")
            in_dtype = x.dtype_name if isinstance(x, RowFile) else np.dtype(x.dtype).name
            if in_dtype not in FEATURE_DTYPES:
                raise InputError(f"node type {t!r}: features of dtype {in_dtype}; expected a float (or uint8/int8) matrix")
            if opts.features == "in-place":
                in_place_rows(x, f"features of node type {t!r}", opts.progress)
                dt = in_dtype
                if opts.feature_dtype is not None and feature_dtype_name(opts.feature_dtype) != dt:
                    raise InputError(f"{x.path}: holds {dt} rows, but the features are to be stored as "
                                     f"{opts.feature_dtype}; a file used in place is read as it is: leave out the "
                                     "dtype option (--dtype), or copy the features (--features copy)")  # fmt: skip
            else:
                dt = opts.feature_dtype or ("float32" if in_dtype == "float64" else in_dtype)
            entry.update(num_features=int(x.shape[1]), feature_dtype=dt)
        if nd.labels is not None:
            y, classes = _labels(nd.labels, int(nd.num_nodes))
            labels[t] = y
            entry["num_classes"] = max(classes, 1)
        node_types[t] = entry
    if target is None and len(labels) == 1:
        target = next(iter(labels))
    if target in labels:  # the type a node classifier learns: two classes or more
        check_classes(int(labels[target].max(initial=-1)) + 1, f"node type {target!r} (the target): the labels")
    given = {et for et, _ in relations}
    rels: list[tuple[tuple[str, str, str], Any, bool, bool]] = []  # (edge type, source, reverse pairs, add reverses)
    for et, src in relations:
        same = et[0] == et[2]
        rels.append((et, src, False, bool(opts.add_reverse) and same))
        rev = (et[2], f"rev_{et[1]}", et[0])
        if opts.add_reverse and not same and rev not in given:
            rels.append((rev, src, True, False))
    est = 0 if opts.features == "in-place" else sum(
        e["num_nodes"] * e["num_features"] * FEATURE_DTYPES[e["feature_dtype"]][1].itemsize
        for e in node_types.values() if e.get("num_features"))  # fmt: skip
    src_meta = {**source, "add_reverse": bool(opts.add_reverse), "features": opts.features}
    with HeteroDatasetWriter(out, node_types=node_types, edge_types=[r[0] for r in rels], target=target,
                             overwrite=opts.overwrite, source=src_meta, progress=opts.progress,
                             estimated_bytes=est) as w:  # fmt: skip
        # node data first: each type's labels (8 bytes a node) and split ids are let go before the edges' sorts
        for t, nd in nodes.items():
            if nd.time is not None:
                tm = np.asarray(nd.time).reshape(-1)
                if tm.shape[0] != nd.num_nodes:
                    raise InputError(f"node type {t!r}: {tm.shape[0]} node times for {nd.num_nodes} nodes")
                w.node(t).write_node_time(tm[s : s + (1 << 22)] for s in range(0, len(tm), 1 << 22))
        for t in list(labels):
            y = labels.pop(t)
            part = w.node(t)
            part.write_labels([y])
            ids = node_splits(nodes[t].splits, y, node_types[t]["num_nodes"], opts, f"node type {t!r}")
            for s in SPLITS:
                part.write_split(s, ids[s])
            del y, ids
        for et, edges, reverse, add_rev in rels:
            w.relation(et).write_edges(_Reversed(edges) if reverse else edges, add_reverse=add_rev)
        for t, nd in nodes.items():
            x = nd.features
            if x is None:
                continue
            if opts.features == "in-place":
                w.node(t).use_features_in_place(x)
            else:
                rows = max(1, _ROW_CHUNK_BYTES // max(1, int(x.shape[1]) * 8))
                w.node(t).write_features(x.blocks(rows) if hasattr(x, "blocks") else row_blocks(x, rows))
        return w.commit()


def node_splits(given: dict[str, Any] | None, y: np.ndarray, n: int, opts: ImportOptions,
                what: str) -> dict[str, np.ndarray]:  # fmt: skip
    """The layout's own node splits (ids or masks), checked against the labels; else random ones."""
    if given and any(v is not None for v in given.values()):
        if opts.split is not None:
            raise InputError(f"{what}: the layout gives its own node splits, so --split would not be used; leave it out")
        ids = {s: _split_ids(given[s], n, f"{what} {s}") if given.get(s) is not None else np.empty(0, np.int64)
               for s in SPLITS}  # fmt: skip
        for s, a in ids.items():
            bad = a[y[a] < 0]
            if bad.size:
                raise InputError(f"{what}: the {s} split holds {bad.size:,} node(s) without a label, e.g. node "
                                 f"{int(bad[0])}")  # fmt: skip
        return ids
    return _random_splits(y, n, node_split_fractions(opts.split), opts.seed)


class _Reversed:
    """An edge source with every edge turned around (a relation's ``rev_`` relation)."""

    def __init__(self, edges: Any):
        self.edges = edges
        self.name = f"{edges.name} (reversed)"
        self.num_edges = getattr(edges, "num_edges", None)

    def chunks(self):
        for s, d in self.edges.chunks():
            yield d, s
