"""Convert a user's graph to the on-disk format.

Four kinds of input, all streamed into :class:`~lightning_ooc.data.writer.DatasetWriter`:

* a PyG ``Data`` saved with ``torch.save`` (:func:`prepare_from_pyg`);
* NumPy arrays, in memory or ``.npy`` files opened memory-mapped
  (:func:`prepare_from_arrays`);
* a CSV/TSV edge list plus a ``.npy`` feature matrix (:func:`prepare_from_edge_list`);
* a dataset already in the on-disk format, rewritten with other options, e.g.
  with link splits made from its edges (:func:`prepare_from_dataset`).

Options: add reverse edges, drop self-loops, drop duplicate edges, and the
stored feature dtype (float32, float16, bfloat16). Splits come from masks or
index arrays when given; otherwise the labelled nodes are split at random
(``split=(0.8, 0.1, 0.1)`` by default, seeded). A ``split`` given where it would
not be used (node splits given or carried over, no labels) is an error.

Example::

    >>> import tempfile, numpy as np, lightning_ooc
    >>> from lightning_ooc.data.prepare import prepare_from_arrays
    >>> edge_index = np.array([[0, 1, 1, 2], [1, 0, 2, 2]])
    >>> x = np.random.default_rng(0).random((3, 4), dtype=np.float32)
    >>> root = prepare_from_arrays(tempfile.mkdtemp() + "/g", edge_index, x, y=np.array([0, 1, 1]),
    ...                            drop_self_loops=True, progress=False)
    >>> ds = lightning_ooc.open_dataset(root)
    >>> ds.indptr.tolist(), ds.indices.tolist(), ds.num_classes
    ([0, 1, 2, 3], [1, 0, 1], 2)
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from lightning_ooc.data.files import input_file
from lightning_ooc.data.format import FEATURE_DTYPES, SPLITS, feature_dtype_name
from lightning_ooc.data.in_place import RowFile, npy_rows
from lightning_ooc.data.link_splits import EdgeSplit, TimedEdgeSplit, check_link_split, find_leaks, split_fractions
from lightning_ooc.data.edge_lists import edge_list_to_pairs, read_edge_list
from lightning_ooc.data.edge_sources import ArrayEdgeSource, DatasetEdgeSource, PairFileEdgeSource
from lightning_ooc.data.prepare_hetero import is_hetero_data, prepare_from_hetero, reverse_mode
from lightning_ooc.data.pyg_files import _first_graph, _torch_load, load_pyg_data
from lightning_ooc.data.splits import (
    DEFAULT_SPLIT,
    _as_array,
    _labels,
    _random_splits,
    _split_ids,
    check_classes,
    load_npy,
    node_split_fractions,
)
from lightning_ooc.data.writer import DatasetWriter
from lightning_ooc.errors import InputError
from lightning_ooc.data.dataset import open_dataset

_ROW_CHUNK_BYTES = 64 << 20
#: how features reach a dataset: copied into its features.bin, or a user's .npy used where it is
FEATURE_MODES = ("copy", "in-place")
#: the options of every ``prepare_from_*`` left out of a call (those of :func:`prepare_from_arrays`'s signature)
_OPTIONS: dict[str, Any] = dict(num_classes=None, feature_dtype=None, add_reverse=False, drop_self_loops=False,
                                drop_duplicates=False, split=None, seed=0, overwrite=False, progress=True)
#: the options a heterogeneous input takes (:func:`~lightning_ooc.data.prepare_hetero.prepare_from_hetero`)
_HETERO_OPTIONS = ("target", "feature_dtype", "add_reverse", "drop_self_loops", "drop_duplicates", "split", "seed",
                   "overwrite", "progress")  # fmt: skip
#: what to do about a link split's CSV/TSV with more columns than ``src dst``
_LINK_CSV_FIX = ("a link split's edge file holds two columns, `src dst`, per line; give its labels, weights and "
                 "times as .npy files (--link-SPLIT-label, --link-SPLIT-weight, --link-SPLIT-time)")


def _prepare(
    out: str | os.PathLike,
    edges_factory,
    x: Any,
    y: Any,
    splits: dict[str, Any] | None,
    *,
    num_classes: int | None,
    feature_dtype: str | None,
    add_reverse: bool,
    drop_self_loops: bool,
    drop_duplicates: bool,
    split: Sequence[float] | None,
    seed: int,
    overwrite: bool,
    progress: bool,
    source: dict[str, Any],
    bucket_edges: int | None = None,
    link_splits: dict[str, Any] | None = None,
    split_edges: Sequence[float] | None = None,
    link_note: str | None = None,
    features: str = "copy",
    node_time: Any = None,
    neighbor_order: str = "source_id",
    split_time: dict[str, Any] | None = None,
) -> Path:
    fracs = node_split_fractions(split)  # checked whatever the input, before anything is read
    if reverse_mode(add_reverse) == "separate":
        raise InputError(f"{source.get('pyg') or source.get('input', 'the input')}: add_reverse='separate' (--add-reverse "
                         "separate) keeps the reverse edges of a relation within one node type in a rev_ relation of "
                         "their own, which a homogeneous graph (one relation) does not have; use add_reverse=True "
                         "(--add-reverse), or give a HeteroData")  # fmt: skip
    add_reverse = reverse_mode(add_reverse) is not None
    if features not in FEATURE_MODES:
        raise InputError(f"features={features!r}: use one of {', '.join(FEATURE_MODES)}")
    if isinstance(x, (str, os.PathLike)) and features == "in-place":  # the file itself, not an array loaded from it
        x = npy_rows(input_file(x, "the feature matrix", f"{x}: no such file (the feature matrix)"))
    if features == "in-place" and not isinstance(x, RowFile):
        raise InputError(f"features='in-place' keeps a feature file where it is: give the path of a .npy file (or a "
                         f"RowFile), not a {type(x).__name__}")  # fmt: skip
    x = x if hasattr(x, "blocks") else _as_array(x, "feature matrix")
    if x is None or len(x.shape) != 2:
        raise InputError(f"features must be a 2-D matrix (nodes x dim), got shape {None if x is None else tuple(x.shape)}")
    n, f = int(x.shape[0]), int(x.shape[1])
    in_dtype = x.dtype_name if isinstance(x, RowFile) else str(x.dtype).replace("torch.", "")
    if in_dtype not in ("float32", "float16", "bfloat16", "float64", "uint8", "int8"):
        raise InputError(f"features have dtype {in_dtype}; expected a float (or uint8/int8) matrix")
    if feature_dtype is None:  # float64 is halved, unless used in place: such a file is read as it is
        feature_dtype = "float32" if in_dtype == "float64" and features == "copy" else in_dtype
    try:
        dtype_name = feature_dtype_name(feature_dtype)
    except ValueError as e:
        raise InputError(str(e)) from None
    if features == "in-place" and dtype_name != in_dtype:
        raise InputError(f"{x.path}: holds {in_dtype} rows, but the features are to be stored as {dtype_name}; a "
                         "file used in place is read as it is: leave out the dtype option (--dtype), or copy the "
                         "features (--features copy)")  # fmt: skip
    y_arr, found_classes = _labels(_as_array(y, "labels"), n)
    node_time = _as_array(node_time, "node times")
    if node_time is not None:
        node_time = node_time.reshape(-1) if len(node_time.shape) == 2 and node_time.shape[1] == 1 else node_time
        if tuple(node_time.shape) != (n,):
            raise InputError(f"node times must have shape ({n},) to match the feature rows, got {tuple(node_time.shape)}")
    if num_classes is None:
        num_classes = found_classes
    elif y_arr is not None and found_classes > num_classes:
        raise InputError(f"labels go up to {found_classes - 1} but num_classes={num_classes}")
    if y_arr is not None and not link_splits and split_edges is None:  # node classification: two classes or more
        named = y if isinstance(y, (str, os.PathLike)) else getattr(y, "filename", None)  # a path, or a map's file
        check_classes(num_classes, f"{named} (the labels)" if named else "the labels")
    if splits and any(v is not None for v in splits.values()):
        if split is not None:
            given = ", ".join(s for s in SPLITS if splits.get(s) is not None)
            raise InputError(f"--split (split=) draws random node splits, but node splits are given ({given}: from "
                             "--train/--val/--test, train=/val=/test= or the input's masks); leave out one or the "
                             "other")  # fmt: skip
        split_ids = {
            s: _split_ids(splits[s], n, s) if splits.get(s) is not None else np.empty(0, dtype=np.int64) for s in SPLITS
        }
        if y_arr is not None:
            for s, ids in split_ids.items():
                unlabelled = ids[y_arr[ids] < 0]
                if unlabelled.size:
                    raise InputError(
                        f"the {s} split holds {unlabelled.size:,} node(s) without a label (-1 or NaN), e.g. node "
                        f"{int(unlabelled[0])}; give them labels or leave them out of the split"
                    )  # fmt: skip
    else:
        if split is not None and y_arr is None:
            raise InputError("--split (split=) draws random splits of the labelled nodes, and no labels were given "
                             "(--y, y=), so every node split would be empty; leave out --split, or give labels")
        split_ids = _random_splits(y_arr, n, fracs, seed)
    given_links = _given_links(link_splits, n)
    if split_edges is not None:
        if given_links:
            raise InputError("--split-edges (split_edges=) makes new link splits, and link splits were given "
                             "(--link-train/--link-val/--link-test, link_splits=, or a PyG input holding them); "
                             "use one or the other")  # fmt: skip
        split_edges = split_fractions(split_edges)
        source = {**source, "split_edges": list(split_edges), "seed": seed}
    # what was written, repeated beside the input: opening checks meta.json's fields against it
    source = {**source, "num_nodes": n, "num_features": f, "feature_dtype": dtype_name, "num_classes": int(num_classes)}
    est = 0 if features == "in-place" else n * f * FEATURE_DTYPES[dtype_name][1].itemsize
    if features == "in-place":
        source = {**source, "features": "in-place", "features_file": str(x.path)}
    with DatasetWriter(
        out, num_nodes=n, num_features=f, num_classes=num_classes, feature_dtype=dtype_name, overwrite=overwrite,
        source=source, progress=progress, estimated_bytes=est,
    ) as w:  # fmt: skip
        # node data first: its arrays (8 bytes a node, and the split ids) are let go before the edges' sort
        labels = y_arr if y_arr is not None else np.full(n, -1, dtype=np.int64)
        w.write_labels(labels[s : s + (1 << 22)] for s in range(0, n, 1 << 22))
        if node_time is not None:
            w.write_node_time(np.asarray(node_time[s : s + (1 << 22)]) for s in range(0, n, 1 << 22))
        for s in SPLITS:
            w.write_split(s, split_ids[s], (split_time or {}).get(s))
        del labels, y_arr, split_ids
        edges = edges_factory(w)
        if split_edges is not None and getattr(edges, "timed", False):  # by time: the val/test edges are the latest
            graph = TimedEdgeSplit(edges, split_edges, num_nodes=n)
        elif split_edges is not None:
            graph = EdgeSplit(edges, split_edges, seed=seed, num_nodes=n, reverse=add_reverse)
        else:
            graph = edges
        kw = {"bucket_edges": bucket_edges} if bucket_edges else {}
        if neighbor_order == "node_time" and node_time is None:
            raise InputError("--neighbor-order node_time (neighbor_order=) sorts each node's in-edges by their "
                             "sources' times: give the node times (--node-time, node_time=)")  # fmt: skip
        w.write_edges(graph, add_reverse=add_reverse, drop_self_loops=drop_self_loops,
                      drop_duplicates=drop_duplicates, neighbor_order=neighbor_order,
                      node_time=None if node_time is None else np.asarray(node_time), **kw)  # fmt: skip
        _write_links(w, graph, given_links, link_note)
        if isinstance(edges, PairFileEdgeSource):
            edges.path.unlink()  # a scratch file inside the partial directory
        rows = max(1, _ROW_CHUNK_BYTES // max(1, f * 8))
        if features == "in-place":
            w.use_features_in_place(x)
        elif hasattr(x, "blocks"):  # a file's rows, read block by block
            w.write_features(x.blocks(rows))
        else:  # tensors go to the writer as they are: a bfloat16 tensor has no NumPy form
            w.write_features(x[s : s + rows] if isinstance(x, torch.Tensor) else np.asarray(x[s : s + rows])
                             for s in range(0, n, rows))  # fmt: skip
        return w.commit()


def _link_input(value: Any, what: str, edges: bool) -> Any:
    """A link split's array: NumPy, a tensor, a ``.npy`` path, or (for its edges) a CSV/TSV edge list."""
    if edges and isinstance(value, (str, os.PathLike)) and Path(value).suffix.lower() != ".npy":
        # (2, M), PyG's layout: a list of two edges is not read as (M, 2); exactly `src dst` per line
        return read_edge_list(value, columns=2, fix=_LINK_CSV_FIX).T
    return _as_array(value, what)


def _given_links(link_splits: dict[str, Any] | None, n: int) -> dict[str, dict[str, np.ndarray]]:
    """Given link splits, checked: ``{split: {"index": (M, 2), field: array, ...}}`` (a bare value is the index)."""
    out = {}
    for name, fields in (link_splits or {}).items():
        if fields is None:
            continue
        if not isinstance(fields, dict):
            fields = {"index": fields}
        arrays = {f: _link_input(v, f"link split {name}: {f}", f == "index") for f, v in fields.items()}
        files = {f: str(v) for f, v in fields.items() if isinstance(v, (str, os.PathLike))}
        out[name] = check_link_split(name, n, files=files, **arrays)
    return out


def _write_links(w: DatasetWriter, graph: Any, given: dict[str, dict[str, np.ndarray]], note: str | None) -> None:
    """Write the link splits (given, or those of an :class:`EdgeSplit`) and what the stored graph holds of them."""
    if isinstance(graph, TimedEdgeSplit):  # every edge stays in the graph at its time: no search needed
        for s, fields in graph.links().items():
            w.write_link_split(s, **{**fields, "index": fields["index"].T})
        w.set_link_note(graph.note(), leakage_free=False)
        return
    if isinstance(graph, EdgeSplit):
        w.write_link_split("train", graph)  # streamed: the edges the graph was built from
        arrays = {s: {"index": graph.held_out(s)} for s in ("val", "test")}
        note = graph.note()
    elif given:
        arrays = given
        note = note or "as given: the input graph"
    else:
        return
    for s, fields in arrays.items():  # checked (M, 2) pairs go to the writer as (2, M): never ambiguous, even for M = 2
        w.write_link_split(s, **{**fields, "index": np.asarray(fields["index"]).T})
    indptr, indices = w.topology()
    by_id = w.neighbor_order == "source_id"
    leaks = {s: find_leaks(indptr, indices, a["index"], a.get("label"), by_id) for s, a in arrays.items()
             if s != "train"}  # fmt: skip
    count = sum(c for c, _ in leaks.values())
    if count:
        s, first = next((s, f) for s, (c, f) in leaks.items() if c)
        src, dst = (int(v) for v in arrays[s]["index"][first])
        note += f"; it holds {count:,} positive val/test edge(s), e.g. {s} edge {src} -> {dst}"
    elif not isinstance(graph, EdgeSplit):
        note += "; checked when written: it holds no positive val/test edge"
    w.set_link_note(note, leakage_free=count == 0)


def _common_source(**kw: Any) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, os.PathLike) else v) for k, v in kw.items()}


def prepare_from_arrays(
    out: str | os.PathLike,
    edge_index: Any,
    x: Any,
    y: Any = None,
    *,
    train: Any = None,
    val: Any = None,
    test: Any = None,
    num_classes: int | None = None,
    feature_dtype: str | None = None,
    add_reverse: bool = False,
    drop_self_loops: bool = False,
    drop_duplicates: bool = False,
    split: Sequence[float] | None = None,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    bucket_edges: int | None = None,
    link_splits: dict[str, Any] | None = None,
    split_edges: Sequence[float] | None = None,
    link_note: str | None = None,
    features: str = "copy",
    node_time: Any = None,
    edge_time: Any = None,
    neighbor_order: str = "source_id",
) -> Path:
    """Write a dataset from arrays (NumPy, tensors, or paths of ``.npy`` files, opened memory-mapped).

    ``edge_index`` has shape ``(2, E)`` (row 0 sources, row 1 targets, as in
    PyG); ``x`` has shape ``(N, F)``; ``y`` has shape ``(N,)`` (``-1`` or NaN
    for unlabelled nodes); ``train``/``val``/``test`` are boolean masks or node
    ids. Node ids must lie in ``[0, N)``. Without them the labelled nodes are
    split at random, ``split`` (train, val, test) fractions of them, seeded by
    ``seed`` (default ``(0.8, 0.1, 0.1)``); ``split`` together with given node
    splits, or without labels, is an :class:`~lightning_ooc.errors.InputError`
    (it would not be used).

    Link-prediction splits (see :mod:`lightning_ooc.data.link_splits`), either given:
    ``link_splits={"train": {"index": E, "label": ..., "weight": ..., "time": ...,
    "neg_dst": ...}, "val": ..., "test": ...}`` (``index`` ``(2, M)`` or ``(M, 2)``,
    also a ``.npy`` or CSV/TSV path; the graph is stored as given, ``link_note``
    says what it holds, and it is checked for val/test positives); or made:
    ``split_edges=(0.85, 0.05, 0.10)`` splits the edges at random (``seed``)
    and removes the val/test edges (with ``add_reverse``, their reverses too)
    from the stored graph.

    ``features="in-place"`` with ``x`` the path of a ``.npy`` file keeps that
    file where it is instead of copying it (see :mod:`lightning_ooc.data.in_place`):
    the dataset records it and refuses to open once it changes.

    ``node_time`` (shape ``(N,)``, integers: a year, a timestamp; PyG's ``time``) is stored as the dataset's
    node times, which PyG's temporal sampling reads through :func:`~lightning_ooc.pyg.open_pyg_stores`;
    ``edge_time`` (shape ``(E,)``, one per column of ``edge_index``) as its edge times, in the stored
    CSC's order. Temporal sampling needs each node's in-edges in time order: ``neighbor_order="edge_time"``
    (by the edges' times) or ``"node_time"`` (by their sources').
    """
    ei = _as_array(edge_index, "edge_index")
    et = _as_array(edge_time, "edge times")
    src_name = str(edge_index) if isinstance(edge_index, (str, os.PathLike)) else "edge_index"
    source = _common_source(
        input="arrays", edge_index=src_name, add_reverse=add_reverse, drop_self_loops=drop_self_loops,
        drop_duplicates=drop_duplicates,
    )  # fmt: skip
    return _prepare(
        out, lambda w: ArrayEdgeSource(ei, name=src_name, times=et), x, y, {"train": train, "val": val, "test": test},
        num_classes=num_classes, feature_dtype=feature_dtype, add_reverse=add_reverse,
        drop_self_loops=drop_self_loops, drop_duplicates=drop_duplicates, split=split, seed=seed,
        overwrite=overwrite, progress=progress, source=source, bucket_edges=bucket_edges, link_splits=link_splits,
        split_edges=split_edges, link_note=link_note, features=features, node_time=node_time,
        neighbor_order=neighbor_order,
    )  # fmt: skip


def _pos_neg(pos: Any, neg: Any) -> dict[str, torch.Tensor]:
    """Positive edges labelled 1 and given negatives labelled 0, in one split (as RandomLinkSplit stores them)."""
    neg = pos.new_empty((2, 0)) if neg is None else neg
    label = torch.cat([torch.ones(pos.shape[1]), torch.zeros(neg.shape[1])])
    return {"index": torch.cat([pos, neg], dim=1), "label": label}


def _label_split(d: Any) -> dict[str, Any]:
    """The link split of one Data of a RandomLinkSplit triple (``edge_label_index``, or ``split_labels=True``'s)."""
    if getattr(d, "edge_label_index", None) is not None:
        return {"index": d.edge_label_index, "label": getattr(d, "edge_label", None)}
    return _pos_neg(d.pos_edge_label_index, getattr(d, "neg_edge_label_index", None))


def _pyg_links(obj: Any, name: object) -> tuple[Any, Any, dict[str, Any] | None, str | None]:
    """``(graph, edge_index, link splits, note)`` of a PyG link-prediction input; the splits are None for a plain graph.

    A tuple of three ``Data`` with ``edge_label_index`` (``RandomLinkSplit``'s
    train, val, test) gives their supervision edges, and the train Data's
    ``edge_index`` as the graph; a ``Data`` with ``train_pos_edge_index`` etc.
    (``train_test_split_edges``) gives positives labelled 1 and the given
    negatives labelled 0, and ``edge_index`` (else ``train_pos_edge_index``) as
    the graph.
    """
    has = lambda d, k: getattr(d, k, None) is not None  # noqa: E731
    if isinstance(obj, (tuple, list)) and len(obj) == 3 and all(
        has(d, "edge_label_index") or has(d, "pos_edge_label_index") for d in obj
    ):
        links = {s: _label_split(d) for s, d in zip(SPLITS, obj)}
        return obj[0], obj[0].edge_index, links, "train edges only: the edge_index of RandomLinkSplit's train Data"
    if has(obj, "train_pos_edge_index"):
        links = {s: _pos_neg(getattr(obj, f"{s}_pos_edge_index"), getattr(obj, f"{s}_neg_edge_index", None))
                 for s in SPLITS if has(obj, f"{s}_pos_edge_index")}  # fmt: skip
        if has(obj, "edge_index"):
            return obj, obj.edge_index, links, "as given: the edge_index of the input Data"
        return obj, obj.train_pos_edge_index, links, "train edges only: train_pos_edge_index (train_test_split_edges)"
    graph = _first_graph(obj, name)
    return graph, graph.edge_index, None, None


def prepare_from_pyg(out: str | os.PathLike, data: Any, **kwargs: Any) -> Path:
    """Write a dataset from a PyG ``Data`` or the path of one saved with ``torch.save``.

    Uses ``data.edge_index``, ``data.x``, ``data.y`` and, when present,
    ``train_mask``/``val_mask``/``test_mask`` (or ``train_idx``/...). Other
    keyword arguments are those of :func:`prepare_from_arrays`, and ``allow_pickle``
    of :func:`load_pyg_data`.

    Link splits are taken from the input where it holds them: a tuple of the
    three ``Data`` that ``RandomLinkSplit`` returns (the graph is the train
    Data's ``edge_index``), or a ``Data`` with ``train_pos_edge_index``,
    ``val_pos_edge_index``, ``val_neg_edge_index``, ... (``train_test_split_edges``).

    A ``HeteroData`` becomes a heterogeneous dataset
    (:func:`~lightning_ooc.data.prepare_hetero.prepare_from_hetero`; ``target=`` names the node type to predict).
    """
    allow_pickle = kwargs.pop("allow_pickle", False)
    name = data if isinstance(data, (str, os.PathLike)) else type(data).__name__
    if isinstance(data, (str, os.PathLike)):
        data = _torch_load(Path(data), allow_pickle)
    if kwargs.get("target") is not None and not is_hetero_data(data):
        raise InputError(f"{name}: target= names a node type of a HeteroData; this is a {type(data).__name__}")
    kwargs = {k: v for k, v in kwargs.items() if k != "target"} if not is_hetero_data(data) else kwargs
    if is_hetero_data(data):
        given = [k for k in ("num_classes", "link_splits", "split_edges", "link_note", "bucket_edges", "y", *SPLITS)
                 if kwargs.get(k) is not None]  # fmt: skip
        if given:
            raise InputError(f"{name}: a HeteroData brings its labels, classes and splits per node type (y, "
                             f"train_mask, ... of each type), and link splits of heterogeneous graphs are not "
                             f"supported; leave out {', '.join(given)}")  # fmt: skip
        opts = {k: v for k, v in {**_OPTIONS, **kwargs}.items() if k in _HETERO_OPTIONS}
        return prepare_from_hetero(out, data, source={"pyg": str(name)}, **opts)
    data, edge_index, links, note = _pyg_links(data, name)
    if getattr(data, "x", None) is None:
        raise InputError(f"{name}: holds a {type(data).__name__} without x (the node features); expected a PyG Data")
    if links is not None:
        if kwargs.get("link_splits") or kwargs.get("split_edges") is not None:
            raise InputError(f"{name}: holds link splits ({', '.join(links)}); do not give others (--link-*, "
                             "--split-edges, link_splits=, split_edges=) with it")  # fmt: skip
        kwargs.update(link_splits=links, link_note=note)
    get = lambda k: getattr(data, k, None)  # noqa: E731
    for s in SPLITS:
        if kwargs.get(s) is None:
            kwargs[s] = get(f"{s}_mask") if get(f"{s}_mask") is not None else get(f"{s}_idx")
    kwargs.setdefault("y", get("y"))
    return prepare_from_arrays(out, edge_index, data.x, **kwargs)


def prepare_from_edge_list(
    out: str | os.PathLike,
    edges: str | os.PathLike,
    x: Any,
    y: Any = None,
    *,
    delimiter: str | None = None,
    header: str = "auto",
    **kwargs: Any,
) -> Path:
    """Write a dataset from a CSV/TSV edge list (``src dst`` per line) and a feature matrix.

    The number of nodes is the number of feature rows. Other keyword arguments
    are those of :func:`prepare_from_arrays`.
    """
    edges = Path(edges)
    progress = kwargs.get("progress", True)

    def factory(w: DatasetWriter) -> PairFileEdgeSource:
        dest = w.tmp / "edges.pairs"
        edge_list_to_pairs(edges, dest, delimiter=delimiter, header=header, progress=progress)
        return PairFileEdgeSource(dest, name=str(edges))

    source = _common_source(
        input="edge_list", edges=str(edges), add_reverse=kwargs.get("add_reverse", False),
        drop_self_loops=kwargs.get("drop_self_loops", False), drop_duplicates=kwargs.get("drop_duplicates", False),
    )  # fmt: skip
    splits = {s: kwargs.pop(s, None) for s in SPLITS}
    return _prepare(out, factory, x, y, splits, source=source, **{**_OPTIONS, **kwargs})


def prepare_from_dataset(out: str | os.PathLike, root: str | os.PathLike, **kwargs: Any) -> Path:
    """Rewrite the on-disk dataset at ``root`` into ``out`` with other options, e.g. link splits.

    The features (in their stored dtype unless ``feature_dtype`` says
    otherwise), labels, node splits and graph of ``root`` are read back in
    chunks and written through the same path as every other input, so
    ``split_edges=(0.98, 0.01, 0.01)`` makes link splits from the stored edges
    and removes the val/test edges from the new graph, and ``drop_duplicates``,
    ``add_reverse`` and the like apply as they do to arrays. Link splits that
    ``root`` holds are carried over unless new ones are asked for (``split_edges``
    or ``link_splits``). Its node splits are carried over too unless ``train``/``val``/``test``
    are given (``split`` is then an error: it would not be used). Other keyword arguments are those of
    :func:`prepare_from_arrays`; ``out`` must not be ``root``. Node times (``node_time``), edge times and
    the splits' seed times are carried over too, and so is the neighbour order; ``neighbor_order`` rewrites the
    in-edges in another order (``"node_time"`` / ``"edge_time"`` for temporal sampling). On edges with times,
    ``split_edges`` splits by time (:class:`~lightning_ooc.data.link_splits.TimedEdgeSplit`).

    Example::

        >>> import tempfile, lightning_ooc
        >>> from lightning_ooc.data.synth import synthesize
        >>> tmp = tempfile.mkdtemp()
        >>> g = synthesize(tmp + "/g", num_nodes=500, avg_degree=6, num_features=8, num_classes=4, progress=False)
        >>> root = prepare_from_dataset(tmp + "/links", g, split_edges=(0.9, 0.05, 0.05), progress=False)
        >>> ds = lightning_ooc.open_dataset(root)
        >>> ds.link_split("val").num_edges == ds.link_split("test").num_edges > 0, ds.num_classes
        (True, 4)
    """

    node_split_fractions(kwargs.get("split"))  # a bad --split is named as such before anything else
    ds = open_dataset(root)
    if Path(out).resolve() == ds.root.resolve():
        raise InputError(f"{out}: the output must be another directory than the dataset it is made from")
    with warnings.catch_warnings():  # a read-only map: the tensor over it is only read
        warnings.simplefilter("ignore", UserWarning)
        mm = torch.from_numpy(ds.features_memmap())  # no copy: rows are read in chunks as they are written
    x = mm.view(torch.bfloat16) if ds.feature_dtype == torch.bfloat16 else mm
    labelled = ds.num_classes > 0
    y = ds.labels if labelled else None
    if "link_splits" not in kwargs and kwargs.get("split_edges") is None and ds.has_link_splits:
        carried = {}
        for s in ds.link_splits.get("splits", {}):
            ls = ds.link_split(s)
            carried[s] = {"index": ls.index, **{f: getattr(ls, f) for f in ("label", "weight", "time", "neg_dst")
                                                if getattr(ls, f) is not None}}  # fmt: skip
        kwargs["link_splits"] = carried
        kwargs.setdefault("link_note", ds.link_splits.get("message_passing"))
    splits = {s: kwargs.pop(s, None) for s in SPLITS}
    if not any(v is not None for v in splits.values()) and labelled:
        if kwargs.get("split") is not None:
            raise InputError(f"--split (split=) draws random node splits, but the node splits of {ds.root} are "
                             "carried over (its train, val and test); leave out --split, or replace them with "
                             "--train/--val/--test")  # fmt: skip
        splits = {s: ds.split(s) for s in SPLITS}
        kwargs.setdefault("split_time", {s: ds.split_time(s) for s in SPLITS if ds.split_time(s) is not None})
    source = _common_source(
        input="dataset", dataset=str(ds.root), dataset_identity=ds.identity,
        add_reverse=kwargs.get("add_reverse", False), drop_self_loops=kwargs.get("drop_self_loops", False),
        drop_duplicates=kwargs.get("drop_duplicates", False),
    )  # fmt: skip
    opts = {**_OPTIONS, "num_classes": ds.num_classes if labelled else None, "feature_dtype": ds.feature_dtype_name,
            **kwargs}  # fmt: skip
    if ds.node_time is not None:  # carried over like the labels
        opts.setdefault("node_time", ds.node_time)
    if opts.get("neighbor_order") is None and ds.neighbor_order != "source_id":
        opts["neighbor_order"] = ds.neighbor_order  # kept: a graph sorted by time stays sampleable by time
    return _prepare(out, lambda w: DatasetEdgeSource(ds), x, y, splits, source=source, **opts)


__all__ = [
    "prepare_from_arrays",
    "prepare_from_dataset",
    "DatasetEdgeSource",
    "prepare_from_pyg",
    "prepare_from_edge_list",
    "load_pyg_data",
    "edge_list_to_pairs",
    "read_edge_list",
    "load_npy",
    "node_split_fractions",
    "DEFAULT_SPLIT",
]
