"""OGB-LSC MAG240M (``mag240m_kddcup2021``): a heterogeneous graph of papers, authors and institutions.

The directory holds ``meta.pt`` (node counts per type, ``num_classes``), ``split_dict.pt`` (``train``,
``valid``, ``test-dev``, ``test-challenge``: paper ids) and ``processed/``:

* ``paper/node_feat.npy`` float16 ``(papers, 768)`` (about 200 GB: the file to use in place),
  ``paper/node_label.npy`` (float, NaN where unknown), ``paper/node_year.npy``;
* ``author___writes___paper/edge_index.npy``, ``author___affiliated_with___institution/edge_index.npy``,
  ``paper___cites___paper/edge_index.npy``: int64 ``(2, E)``.

Only papers have features and labels. The test papers' labels are hidden, so the test split of the import is
empty; train and val are MAG240M's. Relations are stored as given plus, by default, each one's reverse
(``rev_writes``, ``rev_affiliated_with``, and the reversed citations), as PyG's and DGL's MAG240M examples
build the graph: messages must reach papers from authors and authors from institutions.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from lightning_ooc.data.importers.common import ImportOptions, NodeInput, write_hetero
from lightning_ooc.data.importers.sources import PairsEdgeSource, as_numpy, load_pt, need, npy_array, npy_features
from lightning_ooc.errors import InputError

NAME = "mag240m"
RELATIONS = (("author", "writes", "paper"), ("author", "affiliated_with", "institution"), ("paper", "cites", "paper"))
_DIR = "mag240m_kddcup2021"


def _root(root: Path) -> Path:
    return root / _DIR if not (root / "processed").is_dir() and (root / _DIR).is_dir() else root


def detect(root: Path) -> str | None:
    r = _root(root)
    if (r / "processed" / "paper" / "node_feat.npy").is_file() and (r / "processed" / "author___writes___paper").is_dir():
        return "it holds processed/paper/node_feat.npy and processed/author___writes___paper/"
    return None


def write(out: str | os.PathLike, root: Path, opts: ImportOptions) -> Path:
    r = _root(root)
    meta = load_pt(need(r / "meta.pt", "MAG240M's node counts"), "MAG240M's meta.pt")
    if not isinstance(meta, dict) or not all(isinstance(meta.get(t), int) for t in ("paper", "author", "institution")):
        raise InputError(f"{r / 'meta.pt'}: expected a dict with the paper, author and institution counts")
    split = load_pt(need(r / "split_dict.pt", "MAG240M's splits"), "MAG240M's split_dict.pt")
    if not isinstance(split, dict) or not {"train", "valid"} <= set(split):
        raise InputError(f"{r / 'split_dict.pt'}: expected a dict with train and valid paper ids")
    p = r / "processed"
    x = npy_features(p / "paper" / "node_feat.npy", "the paper features")
    y = np.asarray(npy_array(p / "paper" / "node_label.npy", "the paper labels"))
    if x.shape[0] != meta["paper"] or y.shape[0] != meta["paper"]:
        raise InputError(f"{p / 'paper'}: {x.shape[0]} feature rows and {y.shape[0]} labels for {meta['paper']} "
                         "papers (meta.pt)")  # fmt: skip
    nodes = {
        "paper": NodeInput(meta["paper"], x, y, {"train": as_numpy(split["train"]), "val": as_numpy(split["valid"]),
                                                  "test": np.empty(0, np.int64)},
                           time=npy_array(p / "paper" / "node_year.npy", "the paper years")
                           if (p / "paper" / "node_year.npy").is_file() else None),
        "author": NodeInput(meta["author"]),
        "institution": NodeInput(meta["institution"]),
    }  # fmt: skip
    rels = []
    for et in RELATIONS:
        f = p / "___".join(et) / "edge_index.npy"
        rels.append((et, PairsEdgeSource(npy_array(f, f"the {et[1]} edges"), str(f), rows=True)))  # (2, E)
    if opts.add_reverse is None:
        opts.add_reverse = True
    source = {"input": "mag240m", "root": str(r.absolute()), "test": "empty: MAG240M's test labels are hidden"}
    return write_hetero(out, nodes, rels, opts, target="paper", source=source)
