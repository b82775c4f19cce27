"""OGB's own layout (``ogbn-*`` node property prediction, ``ogbl-*`` link prediction), as downloaded or as
written by ``ogb.io.DatasetSaver``: the dataset directory holds ``raw/`` and ``split/<name>/``.

* graph: ``raw/data.npz`` (binary: ``edge_index``, ``num_nodes_list``, ``node_feat``, ``node_year``...) or
  ``raw/edge.csv.gz``, ``raw/num-node-list.csv.gz``, ``raw/node-feat.csv.gz`` (text);
* labels: ``raw/node-label.npz`` (``node_label``) or ``raw/node-label.csv.gz``; float, NaN where unknown;
* node splits: ``split/<name>/split_dict.pt`` or ``train.csv.gz`` / ``valid.csv.gz`` / ``test.csv.gz``;
* link splits: ``split/<name>/split_dict.pt`` or ``train.pt`` / ``valid.pt`` / ``test.pt``, each a dict of
  ``source_node`` / ``target_node`` / ``target_node_neg`` (ogbl-citation2) or ``edge`` / ``weight`` /
  ``year`` / ``edge_neg`` (ogbl-collab).

Heterogeneous graphs (ogbn-mag) come as ``raw/*_dict.npz`` (binary: ``num_nodes_dict``, ``edge_index_dict``
with ``head___relation___tail`` keys, ``node_feat_dict``, ``node_year``, ``node-label.npz`` per type) or as text
(``num-node-dict.csv.gz``, ``triplet-type-list.csv.gz``, ``relations/H___R___T/edge.csv.gz``,
``node-feat/TYPE/``, ``node-label/TYPE/``, per-type split directories); their relations are stored as given
(``add_reverse`` adds ``rev_`` relations). Node years become the dataset's node times (``node_time``).

OGB's loaders add the reverse of every edge for some datasets (``add_inverse_edge`` of its master table:
ogbn-products, ogbn-proteins, ogbl-ppa, ogbl-collab, ogbl-ddi); the import does the same for those names
unless told otherwise, so the stored graph is the one OGB's loaders build.
"""
from __future__ import annotations

import gzip
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from lightning_ooc.data.importers.common import ImportOptions, NodeInput, in_place_rows, write_hetero
from lightning_ooc.data.importers.sources import (
    CsvEdgeSource,
    NpzEdgeSource,
    as_numpy,
    csv_array,
    csv_rows,
    load_pt,
    need,
    npz_keys,
    npz_member,
)
from lightning_ooc.data.prepare import _prepare
from lightning_ooc.errors import InputError

log = logging.getLogger("lightning_ooc")

NAME = "ogb"
#: datasets whose OGB loader adds every edge's reverse (OGB's master table, ``add_inverse_edge``)
ADD_INVERSE = {"ogbn-proteins", "ogbn-products", "ogbl-ppa", "ogbl-collab", "ogbl-ddi"}


def detect(root: Path) -> str | None:
    """Why ``root`` looks like an OGB dataset directory, or None."""
    raw = root / "raw"
    for f in ("data.npz", "edge.csv.gz"):
        if (raw / f).is_file():
            return f"it holds raw/{f}"
    for f in ("edge_index_dict.npz", "triplet-type-list.csv.gz"):
        if (raw / f).is_file():
            return f"it holds raw/{f} (a heterogeneous OGB graph)"
    return None


def dataset_name(root: Path) -> str:
    """OGB's name of the dataset in ``root``: ``ogbn_products`` -> ``ogbn-products`` (else the directory's name)."""
    name = root.resolve().name
    for prefix in ("ogbn_", "ogbl_"):
        if name.startswith(prefix):
            return prefix[:-1] + "-" + name[len(prefix):]
    return name


def _split_dir(root: Path, opts: ImportOptions) -> Path | None:
    base = root / "split"
    if not base.is_dir():
        return None
    want = opts.extra.get("ogb_split")
    dirs = sorted(p.name for p in base.iterdir() if p.is_dir())
    if want is not None:
        if want not in dirs:
            raise InputError(f"{base}: no split {want!r} (splits: {', '.join(dirs) or 'none'})")
        return base / want
    if len(dirs) == 1:
        return base / dirs[0]
    if not dirs:
        return None
    raise InputError(f"{base}: holds several splits ({', '.join(dirs)}); name one with --ogb-split")


class _Graph:
    """The homogeneous graph of ``raw/``: binary (``data.npz``) or text (``*.csv.gz``)."""

    def __init__(self, raw: Path):
        self.raw = raw
        self.binary = os.path.lexists(raw / "data.npz")  # what is there is named if it is not a file
        if self.binary:
            self.npz = need(raw / "data.npz", "OGB's graph")
            self.keys = npz_keys(self.npz)
            for k in ("edge_index", "num_nodes_list"):
                if k not in self.keys:
                    raise InputError(f"{self.npz}: holds no {k!r} (it holds {', '.join(self.keys)}); not an OGB "
                                     "data.npz")  # fmt: skip
            counts = npz_member(self.npz, "num_nodes_list").array()
        else:
            counts = csv_array(need(raw / "num-node-list.csv.gz", "the node count"), np.int64, "the node count")
        counts = np.asarray(counts).reshape(-1)
        if counts.size != 1:
            raise InputError(f"{raw}: holds {counts.size} graphs; node and link property prediction has one")
        self.num_nodes = int(counts[0])

    def edges(self) -> Any:
        if self.binary:
            return NpzEdgeSource(npz_member(self.npz, "edge_index"))
        return CsvEdgeSource(need(self.raw / "edge.csv.gz", "the edge list"))

    def features(self) -> Any:
        if self.binary:
            if "node_feat" not in self.keys:
                raise InputError(f"{self.npz}: holds no node_feat; the graph has no node features to import")
            rows = npz_member(self.npz, "node_feat").rows()
        else:
            rows = csv_rows(need(self.raw / "node-feat.csv.gz", "the node features"), self.num_nodes, np.float32,
                            "the node features")  # fmt: skip
        if rows.shape[0] != self.num_nodes:
            raise InputError(f"{getattr(rows, 'name', rows)}: {rows.shape[0]} feature rows for {self.num_nodes} nodes")
        return rows

    def node_time(self) -> np.ndarray | None:
        """OGB's node years (``node_year``), or None."""
        if self.binary:
            return npz_member(self.npz, "node_year").array() if "node_year" in self.keys else None
        path = self.raw / "node_year.csv.gz"
        return csv_array(path, np.int64, "the node years") if path.is_file() else None

    def labels(self) -> np.ndarray | None:
        if os.path.lexists(self.raw / "node-label.npz"):
            y = npz_member(need(self.raw / "node-label.npz", "the node labels"), "node_label").array()
        elif (self.raw / "node-label.csv.gz").is_file():
            y = csv_array(self.raw / "node-label.csv.gz", np.float64, "the node labels")
        else:
            return None
        y = np.asarray(y)
        if y.ndim == 2 and y.shape[1] != 1:
            raise InputError(f"{self.raw}: {y.shape[1]} labels per node (a multi-task dataset, e.g. ogbn-proteins); "
                             "only one class label per node is supported")  # fmt: skip
        return y.reshape(-1)


def _node_splits(split: Path | None) -> dict[str, Any]:
    if split is None:
        return {}
    if (split / "split_dict.pt").is_file():
        d = load_pt(split / "split_dict.pt", "OGB's split")
        if not isinstance(d, dict) or not {"train", "valid", "test"} <= set(d):
            raise InputError(f"{split / 'split_dict.pt'}: expected a dict of train, valid and test")
        return {"train": as_numpy(d["train"]), "val": as_numpy(d["valid"]), "test": as_numpy(d["test"])}
    out = {}
    for ours, theirs in (("train", "train"), ("val", "valid"), ("test", "test")):
        out[ours] = csv_array(need(split / f"{theirs}.csv.gz", f"the {theirs} split"), np.int64).reshape(-1)
    return out


def _link_split(d: Any, name: str, where: Path) -> dict[str, Any]:
    """One OGB link split (dict) as ours: ``index`` (M, 2), and ``label``/``weight``/``time``/``neg_dst``."""
    if not isinstance(d, dict):
        raise InputError(f"{where}: the {name} split must be a dict, got {type(d).__name__}")
    if "source_node" in d:  # ogbl-citation2 style
        src, dst = as_numpy(d["source_node"]).reshape(-1), as_numpy(d["target_node"]).reshape(-1)
        out: dict[str, Any] = {"index": np.stack([src, dst], 1)}
        if "target_node_neg" in d:
            out["neg_dst"] = as_numpy(d["target_node_neg"]).reshape(len(src), -1)
        return out
    if "edge" in d:  # ogbl-collab / ppa / ddi style
        pos = as_numpy(d["edge"]).reshape(-1, 2)
        out = {"index": pos}
        if "weight" in d:
            out["weight"] = as_numpy(d["weight"]).reshape(-1).astype(np.float32)
        if "year" in d:
            out["time"] = as_numpy(d["year"]).reshape(-1).astype(np.int64)
        if "edge_neg" in d:  # given negatives: edges labelled 0 after the positives labelled 1, weight 0, time -1
            neg = as_numpy(d["edge_neg"]).reshape(-1, 2)
            out["index"] = np.concatenate([pos, neg])
            out["label"] = np.r_[np.ones(len(pos)), np.zeros(len(neg))].astype(np.float32)
            if "weight" in out:
                out["weight"] = np.r_[out["weight"], np.zeros(len(neg), np.float32)]
            if "time" in out:
                out["time"] = np.r_[out["time"], np.full(len(neg), -1, np.int64)]
        return out
    raise InputError(f"{where}: the {name} split holds {sorted(d)}; expected source_node/target_node or edge")


def _link_splits(split: Path) -> dict[str, dict[str, Any]]:
    if (split / "split_dict.pt").is_file():
        d = load_pt(split / "split_dict.pt", "OGB's link split")
        parts = {s: d.get(s) for s in ("train", "valid", "test")} if isinstance(d, dict) else {}
    else:
        parts = {s: load_pt(need(split / f"{s}.pt", f"the {s} link split"), f"the {s} link split")
                 for s in ("train", "valid", "test")}  # fmt: skip
    return {ours: _link_split(parts[theirs], theirs, split)
            for ours, theirs in (("train", "train"), ("val", "valid"), ("test", "test")) if parts.get(theirs) is not None}


def is_link(split: Path | None, name: str) -> bool:
    if name.startswith("ogbl-"):
        return True
    if split is None:
        return False
    if (split / "train.pt").is_file():
        return True
    if (split / "split_dict.pt").is_file():
        d = load_pt(split / "split_dict.pt", "OGB's split")
        return isinstance(d, dict) and isinstance(d.get("train"), dict)
    return False


def _text_table(path: Path, what: str) -> list[list[str]]:
    """The rows of a small gzip CSV of names (OGB's ``num-node-dict``, ``triplet-type-list``...)."""
    try:
        with gzip.open(need(path, what), "rt") as f:
            return [line.strip().split(",") for line in f if line.strip()]
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise InputError(f"{path}: unreadable ({e}); expected {what}") from None


def _npz_dict(path: Path, what: str) -> dict[str, Any]:
    """Every member of an ``.npz`` of OGB's per-type dicts (counts, labels: small) or their members (large)."""
    return {k: npz_member(need(path, what), k) for k in npz_keys(path)}


def _hetero_write(out: str | os.PathLike, root: Path, opts: ImportOptions) -> Path:
    """OGB's heterogeneous layout (ogbn-mag): binary (``*_dict.npz``) or text (``relations/``, ``node-feat/``...)."""
    raw = root / "raw"
    binary = (raw / "edge_index_dict.npz").is_file()
    if binary:
        counts = {t: int(np.asarray(m.array()).reshape(-1)[0]) for t, m in _npz_dict(raw / "num_nodes_dict.npz",
                                                                                     "the node counts").items()}
        rels = [(tuple(k.split("___")), NpzEdgeSource(m))
                for k, m in _npz_dict(raw / "edge_index_dict.npz", "the edges").items()]  # fmt: skip
        feats = ({t: m.rows() for t, m in _npz_dict(raw / "node_feat_dict.npz", "the node features").items()}
                 if (raw / "node_feat_dict.npz").is_file() else {})  # fmt: skip
        years = ({t: m.array() for t, m in _npz_dict(raw / "node_year.npz", "the node years").items()}
                 if (raw / "node_year.npz").is_file() else {})  # fmt: skip
        labels = ({t: m.array() for t, m in _npz_dict(raw / "node-label.npz", "the node labels").items()}
                  if (raw / "node-label.npz").is_file() else {})  # fmt: skip
    else:
        head, row = _text_table(raw / "num-node-dict.csv.gz", "the node counts")[:2]
        counts = {t: int(v) for t, v in zip(head, row)}
        rels = []
        for h, r, t in (tuple(x) for x in _text_table(raw / "triplet-type-list.csv.gz", "the relations")):
            rels.append(((h, r, t), CsvEdgeSource(raw / "relations" / f"{h}___{r}___{t}" / "edge.csv.gz")))
        feats, years, labels = {}, {}, {}
        for t, n in counts.items():
            d = raw / "node-feat" / t
            if (d / "node-feat.csv.gz").is_file():
                feats[t] = csv_rows(d / "node-feat.csv.gz", n, np.float32, f"the {t} features")
            if (d / "node_year.csv.gz").is_file():
                years[t] = csv_array(d / "node_year.csv.gz", np.int64, f"the {t} years")
        if (raw / "nodetype-has-label.csv.gz").is_file():
            head, row = _text_table(raw / "nodetype-has-label.csv.gz", "which types have labels")[:2]
            for t, has in zip(head, row):
                if has.strip().lower() == "true":
                    labels[t] = csv_array(raw / "node-label" / t / "node-label.csv.gz", np.float64, f"the {t} labels")
    for t, y in labels.items():
        if np.asarray(y).ndim == 2 and np.asarray(y).shape[1] != 1:
            raise InputError(f"{raw}: {np.asarray(y).shape[1]} labels per {t} node; one class label per node is supported")
    split = _split_dir(root, opts)
    given = _hetero_splits(split, list(labels)) if split is not None else {}
    if opts.features == "in-place":
        feats = {t: in_place_rows(x, f"{raw}: the {t} features", opts.progress) for t, x in feats.items()}
    nodes = {t: NodeInput(n, feats.get(t), labels.get(t), given.get(t), years.get(t)) for t, n in counts.items()}
    target = next(iter(labels)) if len(labels) == 1 else None
    if opts.add_reverse is None:
        opts.add_reverse = False  # OGB's loaders keep each relation as given
    source = {"input": "ogb", "name": dataset_name(root), "root": str(root.absolute()), "binary": binary}
    return write_hetero(out, nodes, rels, opts, target=target, source=source)


def _hetero_splits(split: Path, types: list[str]) -> dict[str, dict[str, Any]]:
    """``{type: {split: ids}}`` of OGB's heterogeneous node split (``split_dict.pt``, or per-type CSVs)."""
    names = (("train", "train"), ("val", "valid"), ("test", "test"))
    if (split / "split_dict.pt").is_file():
        d = load_pt(split / "split_dict.pt", "OGB's split")
        return {t: {ours: as_numpy(d[theirs][t]) for ours, theirs in names if t in d.get(theirs, {})} for t in types}
    out = {}
    for t in types:
        if (split / t).is_dir():
            out[t] = {ours: csv_array(need(split / t / f"{theirs}.csv.gz", f"the {t} {theirs} split"), np.int64)
                      .reshape(-1) for ours, theirs in names}  # fmt: skip
    return out


def write(out: str | os.PathLike, root: Path, opts: ImportOptions) -> Path:
    raw = root / "raw"
    if (raw / "edge_index_dict.npz").is_file() or (raw / "triplet-type-list.csv.gz").is_file():
        return _hetero_write(out, root, opts)
    name = dataset_name(root)
    graph = _Graph(raw)
    split = _split_dir(root, opts)
    add_reverse = name in ADD_INVERSE if opts.add_reverse is None else opts.add_reverse
    if opts.add_reverse is None:
        why = ("OGB's loader adds them for it" if add_reverse else "OGB's loader keeps it directed") \
            if name.startswith(("ogbn-", "ogbl-")) else f"{name!r} is not an OGB name (from its directory's name)"
        log.info("%s: reverse edges %s (%s; --add-reverse / --keep-directed decide otherwise)", name,
                 "added" if add_reverse else "not added", why)  # fmt: skip
    x = graph.features()
    if opts.features == "in-place":
        x = in_place_rows(x, f"{raw}: node_feat", opts.progress)
    source = {"input": "ogb", "name": name, "root": str(root.absolute()), "binary": graph.binary, "add_reverse": add_reverse}
    common = dict(num_classes=None, feature_dtype=opts.feature_dtype, add_reverse=add_reverse, drop_self_loops=False,
                  drop_duplicates=False, seed=opts.seed, overwrite=opts.overwrite, progress=opts.progress,
                  features=opts.features, node_time=graph.node_time())  # fmt: skip
    if is_link(split, name):
        if split is None:
            raise InputError(f"{root}: a link prediction dataset without split/; nothing says which edges to predict")
        links = _link_splits(split)
        y = graph.labels()
        return _prepare(out, lambda w: graph.edges(), x, y, {}, split=opts.split, source=source,
                        link_splits=links, link_note="as given: OGB's graph (raw/), the message-passing edges",
                        **common)  # fmt: skip
    y = graph.labels()
    if y is None:
        raise InputError(f"{raw}: no node-label.npz or node-label.csv.gz; a node property prediction dataset needs "
                         "labels")  # fmt: skip
    splits = _node_splits(split)
    return _prepare(out, lambda w: graph.edges(), x, y, splits, split=opts.split, source=source, **common)
