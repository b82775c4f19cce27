"""IGB (homogeneous, ``IGB260M``) and IGBH (heterogeneous: MLPerf's R-GAT data), as the ``igb`` package reads them.

The dataset directory (``SIZE/`` of a download: ``tiny``, ``small``, ``medium``, ``large``, ``full``; or its
parent, when it holds one size) holds ``processed/``:

* ``paper/node_feat.npy`` (float32, 1024 wide), ``paper/node_label_19.npy`` and ``paper/node_label_2K.npy``
  (the 19- and 2983-class label sets; float). IGBH adds ``author``, ``institute``, ``fos`` (and, for the
  large sizes, ``journal`` and ``conference``), each with its ``node_feat.npy``;
* edges, ``SRC__REL__DST/edge_index.npy``: int64 ``(E, 2)``: ``paper__cites__paper`` (IGB), and for IGBH also
  ``paper__written_by__author``, ``author__affiliated_to__institute``, ``paper__topic__fos``,
  ``paper__published__journal``, ``paper__venue__conference``.

The full sizes store some of these as raw arrays without a ``.npy`` header; they are read with the shapes the
file sizes give (features 1024 wide, labels one per labelled paper, edges two ids per edge).

Labels cover a prefix of the papers in the full size (227,130,858 of the 19-class set, 157,675,969 of the
2K set); the others are unlabelled. The other sizes label every paper: a label file of fewer labels than papers
is refused (as a truncated one is). Splits: where MLPerf's ``train_idx.pt`` and ``val_idx.pt`` lie in
``processed/``, those (test empty); else as the ``igb`` loader makes them: contiguous 60/20/20 blocks of the
labelled prefix for the full size, a random 60/20/20 of the papers for the others (seeded here by ``seed``;
the loader's own draw is unseeded).
Relations: by default (``add_reverse`` unset) IGBH's get their reverses (``rev_written_by``, ..., and the
citations both ways), as MLPerf's R-GAT reference builds the graph; the ``igb`` package's own loaders keep
them directed (``--keep-directed``). IGB's citations are kept as given unless ``add_reverse`` is asked for.
The ``igb`` loaders also replace self-loops of the citations with one per paper; the import stores the edges
as they are (GraphSAGE and R-GAT here weigh a node's own features separately).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from lightning_ooc.data.format import load_npy_file
from lightning_ooc.data.importers.common import ImportOptions, NodeInput, write_hetero
from lightning_ooc.data.importers.sources import PairsEdgeSource, as_numpy, load_pt, need
from lightning_ooc.data.in_place import RowFile, npy_rows
from lightning_ooc.data.prepare import _prepare
from lightning_ooc.errors import InputError

log = logging.getLogger("lightning_ooc")

NAME = "igb"
SIZES = ("tiny", "experimental", "small", "medium", "large", "full")
#: IGBH's relations, those of the large sizes last
RELATIONS = (("paper", "cites", "paper"), ("paper", "written_by", "author"), ("author", "affiliated_to", "institute"),
             ("paper", "topic", "fos"), ("paper", "published", "journal"), ("paper", "venue", "conference"))  # fmt: skip
FEATURE_DIM = 1024
_MAGIC = b"\x93NUMPY"


def _processed(root: Path, opts: ImportOptions | None = None) -> Path | None:
    if (root / "processed" / "paper").is_dir():
        return root / "processed"
    size = opts.extra.get("igb_size") if opts is not None else None
    sizes = [s for s in SIZES if (root / s / "processed" / "paper").is_dir()]
    if size is not None:
        if size not in sizes:
            raise InputError(f"{root}: no size {size!r} (it holds {', '.join(sizes) or 'none'})")
        return root / size / "processed"
    if len(sizes) == 1:
        return root / sizes[0] / "processed"
    if len(sizes) > 1 and opts is not None:
        raise InputError(f"{root}: holds several sizes ({', '.join(sizes)}); name one with --igb-size")
    return root / sizes[0] / "processed" if sizes else None


def detect(root: Path) -> str | None:
    p = _processed(root)
    if p is not None and (p / "paper__cites__paper").is_dir():
        return f"it holds {p.relative_to(root) / 'paper__cites__paper'}/"
    return None


def _is_npy(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(6) == _MAGIC


def _features(path: Path, what: str) -> RowFile:
    need(path, what)
    if _is_npy(path):
        return npy_rows(path, what.removeprefix("the "))  # npy_rows says "the {what}"
    size = path.stat().st_size
    if size % (FEATURE_DIM * 4):
        raise InputError(f"{path}: a raw feature file of {size} bytes is not a whole number of {FEATURE_DIM} float32 "
                         "rows (truncated?)")  # fmt: skip
    return RowFile(path.absolute(), 0, (size // (FEATURE_DIM * 4), FEATURE_DIM), "float32")


def _array(path: Path, dtype: Any, cols: int, what: str) -> np.ndarray:
    need(path, what)
    if _is_npy(path):
        try:
            return load_npy_file(path, "r")
        except (ValueError, OSError, EOFError) as e:
            raise InputError(f"{path}: not a readable .npy array ({e}); expected {what}") from None
    item = np.dtype(dtype).itemsize * cols
    size = path.stat().st_size
    if size % item:
        raise InputError(f"{path}: a raw array of {size} bytes is not a whole number of {cols} x {np.dtype(dtype)} "
                         f"entries ({what}; truncated?)")  # fmt: skip
    shape = (size // item, cols) if cols > 1 else (size // item,)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape) if size else np.empty(shape, dtype)


def _labels(p: Path, num_papers: int, opts: ImportOptions, full: bool) -> np.ndarray:
    classes = str(opts.extra.get("igb_classes") or 19)
    if classes not in ("19", "2K", "2983"):
        raise InputError(f"--igb-classes {classes}: IGB's label sets are 19 and 2K (2983 classes)")
    name = "node_label_19.npy" if classes == "19" else "node_label_2K.npy"
    y = np.asarray(_array(p / "paper" / name, np.float32, 1, f"the {classes}-class paper labels")).reshape(-1)
    if y.shape[0] > num_papers:
        raise InputError(f"{p / 'paper' / name}: {y.shape[0]} labels for {num_papers} papers")
    # the full size labels a prefix of the papers; every other size labels every paper
    labelled = min(num_papers, FULL_LABELLED["19" if classes == "19" else "2K"]) if full else num_papers
    if y.shape[0] < labelled:
        which = (f"the full size's labelled prefix is its first {labelled:,} papers" if full else
                 "every paper of this size has a label (only the full size labels a prefix of its papers)")  # fmt: skip
        raise InputError(f"{p / 'paper' / name}: {y.shape[0]:,} labels for {num_papers:,} papers, but {which}: the "
                         "label file is truncated or of another size; download it again")  # fmt: skip
    if labelled < num_papers:  # the full size labels a prefix of the papers; what the file holds past it is not labels
        out = np.full(num_papers, np.nan, np.float32)
        for s in range(0, labelled, 1 << 24):
            out[s : min(labelled, s + (1 << 24))] = y[s : min(labelled, s + (1 << 24))]
        y = out
    return y


#: the papers of the full size
FULL_PAPERS = 269_346_174
#: the labelled papers of the full size: a prefix of the ids (the label files span every paper)
FULL_LABELLED = {"19": 227_130_858, "2K": 157_675_969}


def _splits(p: Path, y: np.ndarray, full: bool, seed: int) -> dict[str, Any]:
    if (p / "train_idx.pt").is_file() and (p / "val_idx.pt").is_file():  # MLPerf's split_seeds.py
        return {"train": as_numpy(load_pt(p / "train_idx.pt", "MLPerf's train ids")),
                "val": as_numpy(load_pt(p / "val_idx.pt", "MLPerf's val ids")), "test": np.empty(0, np.int64)}  # fmt: skip
    labelled = int((~np.isnan(y)).sum()) if y.dtype.kind == "f" else int((y >= 0).sum())
    n_train, n_val = int(labelled * 0.6), int(labelled * 0.2)
    # the full size: contiguous blocks of the labelled prefix; the others: a random 60/20/20 of the papers
    ids = np.arange(labelled) if full else np.random.default_rng(seed).permutation(labelled)
    return {"train": ids[:n_train], "val": ids[n_train : n_train + n_val], "test": ids[n_train + n_val :]}


def write(out: str | os.PathLike, root: Path, opts: ImportOptions) -> Path:
    p = _processed(root, opts)
    if p is None:
        raise InputError(f"{root}: no processed/paper/ (or SIZE/processed/paper/); not an IGB dataset directory")
    x = _features(p / "paper" / "node_feat.npy", "the paper features")
    # the full size: by its paper count (a renamed directory too), its directory's name, or --igb-size full
    full = x.shape[0] == FULL_PAPERS or p.parent.name == "full" or opts.extra.get("igb_size") == "full"
    if opts.extra.get("igb_classes") is None:  # MLPerf's splits go with the 2K labels (split_seeds.py's default)
        opts.extra["igb_classes"] = "2K" if (p / "train_idx.pt").is_file() else "19"
        log.info("IGB label set: %s classes (%s)", opts.extra["igb_classes"],
                 "MLPerf's train_idx.pt is there" if opts.extra["igb_classes"] == "2K" else "the default")
    y = _labels(p, x.shape[0], opts, full)
    splits = _splits(p, y, full, opts.seed)
    hetero = any((p / "__".join(et)).is_dir() for et in RELATIONS[1:])
    source = {"input": "igb", "root": str(p.parent.absolute()), "classes": str(opts.extra.get("igb_classes") or 19)}
    if not hetero:
        f = p / "paper__cites__paper" / "edge_index.npy"
        edges = PairsEdgeSource(_array(f, np.int64, 2, "the citations"), str(f), rows=False)  # (E, 2)
        add_reverse = bool(opts.add_reverse)
        return _prepare(out, lambda w: edges, x, y, splits, num_classes=None, feature_dtype=opts.feature_dtype,
                        add_reverse=add_reverse, drop_self_loops=False, drop_duplicates=False, split=opts.split,
                        seed=opts.seed, overwrite=opts.overwrite, progress=opts.progress,
                        source={**source, "add_reverse": add_reverse}, features=opts.features)  # fmt: skip
    nodes: dict[str, NodeInput] = {"paper": NodeInput(x.shape[0], x, y, splits)}
    rels = []
    for et in RELATIONS:
        d = p / "__".join(et)
        if not d.is_dir():
            continue
        for t in (et[0], et[2]):
            if t not in nodes:
                xt = _features(p / t / "node_feat.npy", f"the {t} features")
                nodes[t] = NodeInput(xt.shape[0], xt)
        f = d / "edge_index.npy"
        rels.append((et, PairsEdgeSource(_array(f, np.int64, 2, f"the {et[1]} edges"), str(f), rows=False)))
    if opts.add_reverse is None:
        opts.add_reverse = True
    return write_hetero(out, nodes, rels, opts, target="paper", source=source)
