"""Heterogeneous datasets: node types and relations (see ``docs/format.md``, "Heterogeneous graphs").

A heterogeneous dataset is one directory, like a homogeneous one, whose
``meta.json`` (format version 3) lists its node types and its relations
(edge types ``(src, rel, dst)``, PyG's triples). Every node type has its own
id range ``[0, num_nodes)`` (PyG's per-type ids) and its own files, named
after it:

* ``{type}.features.bin`` (raw rows of that type's dim and dtype; a type may
  have no features), ``{type}.labels.npy`` and ``{type}.train/val/test.npy``
  (types with labels);
* per relation, ``{src}__{rel}__{dst}.indptr.npy`` and ``.indices.npy``: its
  in-edge CSC over the destination type's ids, holding source-type ids, sorted
  per destination.

:class:`HeteroOnDiskDataset` reads one (:func:`~lightning_ooc.open_dataset`
returns it for such a directory); :class:`HeteroDatasetWriter` writes one with
the same atomic commit as :class:`~lightning_ooc.data.writer.DatasetWriter`.

Example::

    >>> import tempfile, numpy as np, lightning_ooc
    >>> from lightning_ooc.data.hetero_dataset import HeteroDatasetWriter
    >>> from lightning_ooc.data.writer import ArrayEdgeSource
    >>> out = tempfile.mkdtemp() + "/h"
    >>> types = {"paper": dict(num_nodes=3, num_features=2, num_classes=2), "author": dict(num_nodes=2)}
    >>> with HeteroDatasetWriter(out, node_types=types, edge_types=[("author", "writes", "paper")]) as w:
    ...     p = w.node("paper")
    ...     p.write_features([np.ones((3, 2), np.float32)]); p.write_labels([np.array([0, 1, 1])])
    ...     p.write_split("train", np.array([0, 1])); p.write_split("val", np.array([2]))
    ...     p.write_split("test", np.array([], np.int64))
    ...     w.relation(("author", "writes", "paper")).write_edges(ArrayEdgeSource(np.array([[0, 1, 1], [0, 0, 2]])))
    ...     root = w.commit()
    >>> ds = lightning_ooc.open_dataset(root)
    >>> ds.node_types, ds.edge_types, ds.num_nodes_dict
    (['paper', 'author'], [('author', 'writes', 'paper')], {'paper': 3, 'author': 2})
    >>> rel = ds.csc[("author", "writes", "paper")]
    >>> rel.indptr.tolist(), rel.indices.tolist()
    ([0, 2, 2, 3], [0, 1, 1])
    >>> ds.node("paper").read_features([2]).tolist(), ds.node("author").has_features
    ([[1.0, 1.0]], False)
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from lightning_ooc._version import __version__
from lightning_ooc.data.format import (
    CHECKSUM_ALGO,
    FEATURE_DTYPES,
    FORMAT_NAME,
    IN_PLACE_VERSION,
    SPLITS,
    feature_dtype_name,
    index_dtype,
    meta_digest,
)
from lightning_ooc.data.files import (check_entry, check_file, check_neighbor_order, is_int, load_indptr,
                                      too_many_classes)  # fmt: skip
from lightning_ooc.data.in_place import IN_PLACE, check_record, feature_file
from lightning_ooc.errors import CorruptDatasetError, DatasetWriteError, InputError
from lightning_ooc.data.writer import PartWriter, WriteTarget, source_inputs

#: The first format version with heterogeneous datasets (the version they are written with).
HETERO_VERSION = 3
NODE_TYPES = "node_types"
EDGE_TYPES = "edge_types"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_REBUILD = "rebuild it with `lightning-ooc prepare` / `lightning-ooc synth`, or restore it from a copy"
EdgeType = tuple[str, str, str]


def check_name(name: Any, what: str) -> str:
    """A node type's or relation's name: letters, digits, ``_`` and ``-``, no ``__`` (it separates a
    relation's parts in file names, as in PyG's ``EdgeTypeStr``).

    >>> check_name("paper", "node type")
    'paper'
    """
    if not isinstance(name, str) or not _NAME.match(name) or "__" in name:
        raise InputError(f"{what} name {name!r}: use letters, digits, '_' and '-' (starting with a letter or "
                         "digit, no '__'), e.g. 'paper' or 'written_by'")  # fmt: skip
    return name


def relation_key(edge_type: EdgeType) -> str:
    """``src__rel__dst``: a relation's name in file names and ``files`` keys.

    >>> relation_key(("author", "writes", "paper"))
    'author__writes__paper'
    """
    return "__".join(edge_type)


def node_prefix(node_type: str) -> str:
    return f"{node_type}."


def relation_prefix(edge_type: EdgeType) -> str:
    return f"{relation_key(edge_type)}."


def as_edge_type(edge_type: Any) -> EdgeType:
    """A relation given as a ``(src, rel, dst)`` triple (tuple or list) or as ``"src__rel__dst"``."""
    if isinstance(edge_type, str):
        parts = edge_type.split("__")
        if len(parts) != 3:
            raise InputError(f"edge type {edge_type!r}: write it as (src, rel, dst) or 'src__rel__dst'")
        edge_type = parts
    if not isinstance(edge_type, (tuple, list)) or len(edge_type) != 3:
        raise InputError(f"edge type {edge_type!r}: write it as a (src, rel, dst) triple")
    return (str(edge_type[0]), str(edge_type[1]), str(edge_type[2]))


# ---------------------------------------------------------------------------------------------- the schema


def check_hetero_schema(meta: dict[str, Any], meta_path: Path) -> None:
    """``meta.json`` of a heterogeneous dataset: node types, relations naming known types, every file entry."""
    def bad(what: str) -> CorruptDatasetError:
        return CorruptDatasetError(f"{meta_path}: {what}; {_REBUILD}", meta_path)

    if meta.get("version", 0) < HETERO_VERSION:
        raise bad(f"node types in a format version {meta.get('version')} dataset (they came with version "
                  f"{HETERO_VERSION})")  # fmt: skip
    types, rels, files = meta.get(NODE_TYPES), meta.get(EDGE_TYPES), meta.get("files")
    if not isinstance(types, dict) or not types:
        raise bad(f"'{NODE_TYPES}' must map each node type to its counts, got {types!r}")
    if not isinstance(rels, list):
        raise bad(f"'{EDGE_TYPES}' must be a list of relations, got {rels!r}")
    if not isinstance(files, dict):
        raise bad(f"'files' must map each file's key to its entry, got {type(files).__name__}")
    for t, e in types.items():
        try:
            check_name(t, "node type")
        except InputError as err:
            raise bad(str(err)) from None
        if not isinstance(e, dict):
            raise bad(f"node type {t!r}: its entry must be an object, got {e!r}")
        for key, low in (("num_nodes", 0), ("num_features", 0), ("num_classes", 0), ("row_bytes", 0)):
            if not is_int(e.get(key)) or e[key] < low:
                raise bad(f"node type {t!r}: {key} must be an integer >= {low}, got {e.get(key)!r}")
        if too_many_classes(e["num_classes"], e["num_nodes"]):
            raise bad(f"node type {t!r}: {too_many_classes(e['num_classes'], e['num_nodes'])}")
        if e.get("feature_dtype") not in FEATURE_DTYPES:
            raise bad(f"node type {t!r}: unknown feature dtype {e.get('feature_dtype')!r} "
                      f"(known: {', '.join(FEATURE_DTYPES)})")  # fmt: skip
        if e["row_bytes"] != e["num_features"] * FEATURE_DTYPES[e["feature_dtype"]][1].itemsize:
            raise bad(f"node type {t!r}: row_bytes={e['row_bytes']} but {e['num_features']} x {e['feature_dtype']} "
                      f"= {e['num_features'] * FEATURE_DTYPES[e['feature_dtype']][1].itemsize}")  # fmt: skip
        for key in node_file_keys(t, e):
            if key not in meta.get(IN_PLACE, {}):
                check_entry(key, files.get(key), bad, need_length=key.rsplit(".", 1)[1] in SPLITS)
        if node_prefix(t) + "node_time" in files:
            check_entry(node_prefix(t) + "node_time", files[node_prefix(t) + "node_time"], bad, need_length=False)
    seen = set()
    for i, r in enumerate(rels):
        if not isinstance(r, dict) or not all(isinstance(r.get(k), str) for k in ("src", "rel", "dst")):
            raise bad(f"relation {i}: must be an object with 'src', 'rel', 'dst' and 'num_edges', got {r!r}")
        et = (r["src"], r["rel"], r["dst"])
        for end in ("src", "dst"):
            if r[end] not in types:
                raise bad(f"relation {et} names the {'source' if end == 'src' else 'destination'} node type "
                          f"{r[end]!r}, which is not one of the node types {list(types)}")  # fmt: skip
        try:
            check_name(r["rel"], "relation")
        except InputError as err:
            raise bad(f"relation {et}: {err}") from None
        if et in seen:
            raise bad(f"relation {et} is listed twice")
        seen.add(et)
        if not is_int(r.get("num_edges")) or r["num_edges"] < 0:
            raise bad(f"relation {et}: num_edges must be an integer >= 0, got {r.get('num_edges')!r}")
        for key in relation_file_keys(et):
            check_entry(key, files.get(key), bad, need_length=False)
        if relation_prefix(et) + "edge_time" in files:
            check_entry(relation_prefix(et) + "edge_time", files[relation_prefix(et) + "edge_time"], bad,
                        need_length=False)  # fmt: skip
        check_neighbor_order(r.get("neighbor_order"), files, relation_prefix(et),
                             lambda what, et=et: bad(f"relation {et}: {what}"), node_prefix(et[0]))  # fmt: skip
    in_place = meta.get(IN_PLACE, {})
    feature_keys = {node_prefix(t) + "features" for t, e in types.items() if e["num_features"]}
    if not isinstance(in_place, dict) or set(in_place) - feature_keys:
        raise bad(f"'{IN_PLACE}' may hold node types' feature files only ({sorted(feature_keys)}), got "
                  f"{sorted(in_place) if isinstance(in_place, dict) else in_place!r}")  # fmt: skip
    for key, rec in in_place.items():
        check_record(key, rec, bad)
        if key in files:
            raise bad(f"the {key!r} file has both a files entry and an in_place record")
    if in_place and meta.get("version", 0) < IN_PLACE_VERSION:
        raise bad(f"features used in place in a format version {meta.get('version')} dataset (they came with "
                  f"version {IN_PLACE_VERSION})")  # fmt: skip
    target = meta.get("target")
    if target is not None and (target not in types or not types[target]["num_classes"]):
        raise bad(f"target node type {target!r} is not a node type with labels")


def node_file_keys(node_type: str, entry: dict[str, Any]) -> list[str]:
    """The ``files`` keys a node type has: features if it has any, labels and splits if it has classes."""
    p = node_prefix(node_type)
    keys = [p + "features"] if entry["num_features"] else []
    if entry["num_classes"]:
        keys += [p + "labels"] + [p + s for s in SPLITS]
    return keys


def relation_file_keys(edge_type: EdgeType) -> list[str]:
    p = relation_prefix(edge_type)
    return [p + "indptr", p + "indices"]


# ---------------------------------------------------------------------------------------------- reading


class NodeTypeData:
    """One node type's rows: features (on disk), labels and splits, shaped as a homogeneous
    :class:`~lightning_ooc.OnDiskDataset`'s node side (``num_nodes``, ``row_bytes``,
    ``features_path``, ``read_features``...) so feature readers and tiers take it as they are."""

    def __init__(self, root: Path, meta: dict[str, Any], node_type: str, features: tuple[Path, int] | None = None):
        e = meta[NODE_TYPES][node_type]
        self.root = root
        self.meta = meta
        self.node_type = node_type
        self.num_nodes: int = int(e["num_nodes"])
        self.num_features: int = int(e["num_features"])
        self.num_classes: int = int(e["num_classes"])
        self.feature_dtype_name: str = e["feature_dtype"]
        self.feature_dtype: torch.dtype = FEATURE_DTYPES[self.feature_dtype_name][0]
        self.feature_numpy_dtype: np.dtype = FEATURE_DTYPES[self.feature_dtype_name][1]
        self.row_bytes: int = int(e["row_bytes"])
        self.split_sizes: dict[str, int] = dict(e.get("split_sizes", {}))
        p = node_prefix(node_type)
        #: the feature file, as the dataset checked it (None without features): its own, or the path that opens
        #: the checked file used in place (:func:`~lightning_ooc.data.in_place.feature_file`)
        self.features_path: Path | None = None if features is None else features[0]
        #: file offset of row 0 of :attr:`features_path`
        self.features_offset: int = 0 if features is None else int(features[1])
        #: the dataset's identity with the node type: rows of one type of one dataset
        self.identity = f"{meta.get('meta_checksum') or meta_digest(meta)}:{node_type}"
        self.labels: np.ndarray | None = (
            np.load(root / meta["files"][p + "labels"]["name"], mmap_mode="r") if self.num_classes else None
        )
        #: an int64 time of each node of this type (e.g. OGB's paper years), memory-mapped; or None
        self.node_time: np.ndarray | None = (np.load(root / meta["files"][p + "node_time"]["name"], mmap_mode="r")
                                             if p + "node_time" in meta["files"] else None)  # fmt: skip
        self._splits: dict[str, torch.Tensor] = {}

    @property
    def has_features(self) -> bool:
        return self.num_features > 0

    @property
    def has_labels(self) -> bool:
        return self.num_classes > 0

    def split(self, name: str) -> torch.Tensor:
        """Node ids (of this type) of split ``name`` as an int64 tensor."""
        if name not in SPLITS:
            raise KeyError(f"unknown split {name!r}; splits are {', '.join(SPLITS)}")
        if not self.has_labels:
            raise KeyError(f"node type {self.node_type!r} of {self.root} has no labels, so no {name} split")
        if name not in self._splits:
            self._splits[name] = torch.from_numpy(
                np.load(self.root / self.meta["files"][node_prefix(self.node_type) + name]["name"])
            )
        return self._splits[name]

    def split_time(self, name: str) -> torch.Tensor | None:
        """The time of each seed of split ``name`` (aligned with :meth:`split`), or None where it has none."""
        key = node_prefix(self.node_type) + f"{name}_time"
        if name not in SPLITS or key not in self.meta["files"]:
            return None
        if key not in self._splits:
            self._splits[key] = torch.from_numpy(np.load(self.root / self.meta["files"][key]["name"]))
        return self._splits[key]

    def unlabelled(self, name: str) -> np.ndarray:
        """Sorted ids of split ``name`` whose label is not a class in ``[0, num_classes)``."""
        ids = np.sort(self.split(name).numpy())
        y = np.asarray(self.labels[ids])
        return ids[(y < 0) | (y >= self.num_classes)]

    def features_memmap(self) -> np.memmap:
        """This type's feature file as a read-only ``(N, F)`` memmap (through the page cache)."""
        if self.features_path is None:
            raise KeyError(f"node type {self.node_type!r} of {self.root} has no features")
        return np.memmap(self.features_path, dtype=self.feature_numpy_dtype, mode="r", offset=self.features_offset,
                         shape=(self.num_nodes, self.num_features))  # fmt: skip

    def read_features(self, ids: Any) -> torch.Tensor:
        """Rows ``ids`` of this type as a tensor of :attr:`feature_dtype`, through the page cache."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = torch.from_numpy(np.ascontiguousarray(self.features_memmap()[ids]))
        return rows.view(self.feature_dtype) if self.feature_dtype == torch.bfloat16 else rows

    def __repr__(self) -> str:
        feats = f"{self.num_features} x {self.feature_dtype_name}" if self.has_features else "none"
        return f"NodeTypeData({self.node_type!r}, num_nodes={self.num_nodes}, features={feats}, " \
               f"num_classes={self.num_classes})"  # fmt: skip


class RelationCSC:
    """One relation's in-edge CSC: ``indices[indptr[v]:indptr[v + 1]]`` are the source-type ids of the
    edges into destination node ``v``, sorted. ``indptr`` is in memory, ``indices`` memory-mapped."""

    def __init__(self, root: Path, meta: dict[str, Any], entry: dict[str, Any], share: Any = None):
        self.edge_type: EdgeType = (entry["src"], entry["rel"], entry["dst"])
        self.num_edges: int = int(entry["num_edges"])
        self.num_src_nodes: int = int(meta[NODE_TYPES][entry["src"]]["num_nodes"])
        self.num_nodes: int = int(meta[NODE_TYPES][entry["dst"]]["num_nodes"])
        p = relation_prefix(self.edge_type)
        self.indptr_path = root / meta["files"][p + "indptr"]["name"]
        self.indices_path = root / meta["files"][p + "indices"]["name"]
        if share is None:
            self.indptr: np.ndarray = load_indptr(self.indptr_path, self.num_edges)
        else:
            self.indptr = share.array(p + "indptr", (self.num_nodes + 1,), np.int64,
                                      fill=lambda out: load_indptr(self.indptr_path, self.num_edges, out))  # fmt: skip
        self.indices: np.ndarray = np.load(self.indices_path, mmap_mode="r")
        #: how each target's in-edges are ordered ("source_id", or "node_time" / "edge_time" for temporal sampling)
        self.neighbor_order: str = entry.get("neighbor_order") or "source_id"
        #: int64 time of each edge, in CSC order (memory-mapped), or None
        self.edge_time: np.ndarray | None = (np.load(root / meta["files"][p + "edge_time"]["name"], mmap_mode="r")
                                             if p + "edge_time" in meta["files"] else None)  # fmt: skip

    @property
    def in_degree(self) -> np.ndarray:
        return np.diff(self.indptr)

    def __repr__(self) -> str:
        return f"RelationCSC({self.edge_type}, num_edges={self.num_edges})"


class HeteroOnDiskDataset:
    """A heterogeneous graph in the lightning_ooc on-disk format (open it with :func:`~lightning_ooc.open_dataset`).

    Attributes:
        node_types: the node types, in the order of ``meta.json``.
        edge_types: the relations ``(src, rel, dst)``, in order (the order the sampler visits them).
        num_nodes_dict: nodes per type; ids of each type are ``0..n - 1``.
        csc: relation -> :class:`RelationCSC` (what the heterogeneous sampler reads).
        labels: node type -> labels (memory-mapped), for the types that have them.
        target: the node type a node task predicts by default (the one with labels, if only one has).
    """

    is_hetero = True
    link_splits = None
    has_link_splits = False

    def __init__(self, root: Path, meta: dict[str, Any], share: Any = None):
        self.root = root
        self.meta = meta
        self.identity: str = meta.get("meta_checksum") or meta_digest(meta)
        self.node_types: list[str] = list(meta[NODE_TYPES])
        self.edge_types: list[EdgeType] = [(r["src"], r["rel"], r["dst"]) for r in meta[EDGE_TYPES]]
        self.num_nodes_dict: dict[str, int] = {t: int(e["num_nodes"]) for t, e in meta[NODE_TYPES].items()}
        self.num_edges_dict: dict[EdgeType, int] = {et: int(r["num_edges"])
                                                    for et, r in zip(self.edge_types, meta[EDGE_TYPES])}  # fmt: skip
        self.num_nodes: int = sum(self.num_nodes_dict.values())
        self.num_edges: int = sum(self.num_edges_dict.values())
        #: each node type's checked feature file: ``(path, offset of row 0)``, the path of one used in place the one
        #: that opens the checked file (:func:`~lightning_ooc.data.in_place.check_in_place`)
        self._feature_files: dict[str, tuple[Path, int]] = {}
        self._check_files()
        self._nodes = {t: NodeTypeData(root, meta, t, self._feature_files.get(t)) for t in self.node_types}
        self.csc: dict[EdgeType, RelationCSC] = {
            et: RelationCSC(root, meta, r, share) for et, r in zip(self.edge_types, meta[EDGE_TYPES])
        }
        self.labels: dict[str, np.ndarray] = {t: n.labels for t, n in self._nodes.items() if n.labels is not None}
        labelled = [t for t in self.node_types if self._nodes[t].has_labels]
        self.target: str | None = meta.get("target") or (labelled[0] if len(labelled) == 1 else None)

    def _check_files(self) -> None:
        i8 = (np.dtype("<i8"),)
        files = self.meta["files"]
        for t, e in self.meta[NODE_TYPES].items():
            p = node_prefix(t)
            for key in node_file_keys(t, e):
                part = key[len(p):]
                if part == "features":
                    self._feature_files[t] = feature_file(self.root, self.meta, key, int(e["num_nodes"]),
                                                          int(e["row_bytes"]), e["feature_dtype"])  # fmt: skip
                elif part == "labels":
                    check_file(self.root, self.meta, key, (i8, (int(e["num_nodes"]),)))
                else:
                    check_file(self.root, self.meta, key, (i8, (int(files[key]["length"]),)))
            if p + "node_time" in files:
                check_file(self.root, self.meta, p + "node_time", (i8, (int(e["num_nodes"]),)))
            for s in SPLITS:
                if p + f"{s}_time" in files:
                    check_file(self.root, self.meta, p + f"{s}_time", (i8, (int(files[p + s]["length"]),)))
        for r in self.meta[EDGE_TYPES]:
            et = (r["src"], r["rel"], r["dst"])
            p = relation_prefix(et)
            n_dst, n_src = self.meta[NODE_TYPES][r["dst"]]["num_nodes"], self.meta[NODE_TYPES][r["src"]]["num_nodes"]
            check_file(self.root, self.meta, p + "indptr", (i8, (n_dst + 1,)))
            check_file(self.root, self.meta, p + "indices",
                       ((index_dtype(max(n_src, n_dst)),), (int(r["num_edges"]),)))  # fmt: skip
            if p + "edge_time" in files:
                check_file(self.root, self.meta, p + "edge_time", (i8, (int(r["num_edges"]),)))

    # -- public API ----------------------------------------------------------------
    def node(self, node_type: str) -> NodeTypeData:
        """One node type's features, labels and splits."""
        if node_type not in self._nodes:
            raise KeyError(f"no node type {node_type!r} in {self.root} (node types: {', '.join(self.node_types)})")
        return self._nodes[node_type]

    def relation(self, edge_type: Any) -> RelationCSC:
        """One relation's CSC, given as ``(src, rel, dst)`` or ``"src__rel__dst"``."""
        et = as_edge_type(edge_type)
        if et not in self.csc:
            raise KeyError(f"no relation {et} in {self.root} (relations: {self.edge_types})")
        return self.csc[et]

    def metadata(self) -> tuple[list[str], list[EdgeType]]:
        """``(node_types, edge_types)``, as PyG's ``HeteroData.metadata()`` (what ``to_hetero`` takes)."""
        return list(self.node_types), list(self.edge_types)

    def split(self, name: str, node_type: str | None = None) -> torch.Tensor:
        """Node ids of split ``name`` of ``node_type`` (default: :attr:`target`)."""
        t = node_type or self.target
        if t is None:
            raise KeyError(f"{self.root}: name the node type of the split (no single labelled type)")
        return self.node(t).split(name)

    def file_sizes(self) -> dict[str, int]:
        return {k: int(v["bytes"]) for k, v in self.meta["files"].items()}

    def __repr__(self) -> str:
        return (f"HeteroOnDiskDataset(root='{self.root}', num_nodes={self.num_nodes_dict}, "
                f"num_edges={self.num_edges}, relations={len(self.edge_types)}, target={self.target!r})")  # fmt: skip


# ---------------------------------------------------------------------------------------------- writing


class HeteroDatasetWriter:
    """Write a heterogeneous dataset; use as a context manager so a failure removes the partial output.

    ``node_types`` maps each type to its ``num_nodes`` and optionally ``num_features`` (0: no
    features), ``feature_dtype`` and ``num_classes`` (0: no labels, no splits). ``edge_types``
    lists the relations ``(src, rel, dst)``; the order is kept (it is the order the sampler visits
    them). :meth:`node` and :meth:`relation` give each part's writer (the methods of
    :class:`~lightning_ooc.data.writer.DatasetWriter`: ``write_features``, ``write_labels``,
    ``write_split``; ``write_edges`` or ``write_csc_segments``); :meth:`commit` checks that every
    file was written and puts the dataset in place atomically.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        node_types: dict[str, dict[str, Any]],
        edge_types: Iterable[Any],
        target: str | None = None,
        overwrite: bool = False,
        source: dict[str, Any] | None = None,
        progress: bool = False,
        estimated_bytes: int | None = None,
    ):
        if not node_types:
            raise InputError("a heterogeneous dataset needs at least one node type")
        self.node_types: dict[str, dict[str, Any]] = {}
        for t, e in node_types.items():
            check_name(t, "node type")
            e = dict(e)
            unknown = set(e) - {"num_nodes", "num_features", "feature_dtype", "num_classes"}
            if unknown:
                raise InputError(f"node type {t!r}: unknown keys {sorted(unknown)}")
            n, f, c = int(e.get("num_nodes", -1)), int(e.get("num_features", 0)), int(e.get("num_classes", 0))
            if n < 0 or f < 0 or c < 0:
                raise InputError(f"node type {t!r}: num_nodes, num_features and num_classes must be >= 0, got {e}")
            try:
                dt = feature_dtype_name(e.get("feature_dtype", "float32"))
            except ValueError as err:
                raise InputError(f"node type {t!r}: {err}") from None
            self.node_types[t] = {"num_nodes": n, "num_features": f, "feature_dtype": dt, "num_classes": c}
        self.edge_types: list[EdgeType] = []
        for et in edge_types:
            et = as_edge_type(et)
            for end, name in (("source", et[0]), ("destination", et[2])):
                if name not in self.node_types:
                    raise InputError(f"relation {et} names the {end} node type {name!r}, which is not one of the "
                                     f"node types {list(self.node_types)}")  # fmt: skip
            check_name(et[1], "relation")
            if et in self.edge_types:
                raise InputError(f"relation {et} is listed twice")
            self.edge_types.append(et)
        if target is not None and (target not in self.node_types or not self.node_types[target]["num_classes"]):
            raise InputError(f"target {target!r} must be a node type with num_classes > 0")
        self.target = target
        self.source = source or {}
        self._target = WriteTarget(out, overwrite=overwrite, estimated_bytes=estimated_bytes,
                                   inputs=source_inputs(self.source))  # fmt: skip
        self.target_path = self._target.target
        self.tmp = self._target.tmp
        self.files: dict[str, dict[str, Any]] = {}
        self.in_place: dict[str, dict[str, Any]] = {}
        self._nodes = {
            t: PartWriter(self.tmp, self.files, num_nodes=e["num_nodes"], num_features=e["num_features"],
                          num_classes=e["num_classes"], feature_dtype=e["feature_dtype"], prefix=node_prefix(t),
                          progress=progress, in_place=self.in_place)  # fmt: skip
            for t, e in self.node_types.items()
        }
        self._relations = {
            et: PartWriter(self.tmp, self.files, num_nodes=self.node_types[et[2]]["num_nodes"],
                           num_src_nodes=self.node_types[et[0]]["num_nodes"], num_features=0, num_classes=0,
                           prefix=relation_prefix(et), progress=progress)  # fmt: skip
            for et in self.edge_types
        }

    def __enter__(self) -> "HeteroDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._target.exit(exc_type, exc)
        return False

    def abort(self) -> None:
        self._target.abort()

    def node(self, node_type: str):
        """The writer of one node type's features, labels and splits."""
        if node_type not in self._nodes:
            raise InputError(f"no node type {node_type!r} (node types: {list(self._nodes)})")
        return self._nodes[node_type]

    def relation(self, edge_type: Any):
        """The writer of one relation's topology (``write_edges`` with source-type and destination-type ids)."""
        et = as_edge_type(edge_type)
        if et not in self._relations:
            raise InputError(f"no relation {et} (relations: {self.edge_types})")
        return self._relations[et]

    def commit(self) -> Path:
        """Check that every file was written, write ``meta.json`` and rename the dataset into place."""
        missing = [k for t, e in self.node_types.items() for k in node_file_keys(t, e)
                   if k not in self.files and k not in self.in_place]  # fmt: skip
        missing += [k for et in self.edge_types for k in relation_file_keys(et) if k not in self.files]
        if missing:
            raise DatasetWriteError(f"{self.target_path}: cannot commit, nothing was written for {missing}")
        types = {}
        for t, e in self.node_types.items():
            part = self._nodes[t]
            types[t] = {**e, "row_bytes": part.row_bytes}
            if e["num_classes"]:
                types[t]["split_sizes"] = {s: part.split_sizes[s] for s in SPLITS}
        rels = [{"src": et[0], "rel": et[1], "dst": et[2], "num_edges": int(self._relations[et].num_edges or 0),
                 "index_dtype": self._relations[et].index_dtype.name,
                 **({"neighbor_order": self._relations[et].neighbor_order}
                    if self._relations[et].neighbor_order != "source_id" else {})}
                for et in self.edge_types]  # fmt: skip
        meta: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": IN_PLACE_VERSION if self.in_place else HETERO_VERSION,
            "num_nodes": sum(e["num_nodes"] for e in self.node_types.values()),
            "num_edges": sum(r["num_edges"] for r in rels),
            NODE_TYPES: types,
            EDGE_TYPES: rels,
            "target": self.target,
            "id_space": "per type",
            "sorted_neighbors": all(self._relations[et].neighbor_order == "source_id" for et in self.edge_types),
            "checksum_algorithm": CHECKSUM_ALGO,
            "files": dict(self.files),
            **({IN_PLACE: dict(self.in_place)} if self.in_place else {}),
            "created_with": f"lightning_ooc {__version__}",
            "source": self.source,
        }
        return self._target.commit(meta)

