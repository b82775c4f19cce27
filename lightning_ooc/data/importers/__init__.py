"""Importers of the layouts users already have: ``lightning-ooc prepare --from LAYOUT DIR --out OUT``.

One module per layout, each with ``NAME``, ``detect(root)`` (why the directory looks like that layout, or
None) and ``write(out, root, options)``:

=============  ==================================================================================
``ogb``        OGB's download or ``DatasetSaver`` output: ``raw/`` (binary ``data.npz`` or text ``.csv.gz``)
               and ``split/``; node property prediction and link prediction (:mod:`.ogb`)
``mag240m``    OGB-LSC MAG240M: ``processed/*/*.npy``, ``meta.pt``, ``split_dict.pt`` (:mod:`.mag240m`)
``igb``        IGB (homogeneous) and IGBH (heterogeneous), as the ``igb`` package and MLPerf read them (:mod:`.igb`)
``graphbolt``  a GraphBolt ``OnDiskDataset`` directory (``metadata.yaml``) (:mod:`.graphbolt`)
``tgb``        a TGB dynamic link prediction dataset: ``NAME_edgelist.csv`` with its validation and test
               negatives (``NAME_val_ns.pkl``, ``NAME_test_ns.pkl``), as a graph with time (:mod:`.tgb`)
=============  ==================================================================================

Everything streams: edges go through the writer's external sort, features are copied block by block or used
in place (``features="in-place"``, :mod:`lightning_ooc.data.in_place`), so memory stays bounded whatever the
graph's size.

Example::

    >>> import os, tempfile, numpy as np, lightning_ooc
    >>> from lightning_ooc.data.importers import detect, import_dataset
    >>> src = tempfile.mkdtemp()
    >>> os.makedirs(f"{src}/raw")
    >>> np.savez_compressed(f"{src}/raw/data.npz", edge_index=np.array([[0, 1, 2], [1, 2, 0]]),
    ...                     num_nodes_list=np.array([3]), num_edges_list=np.array([3]),
    ...                     node_feat=np.eye(3, dtype=np.float32))
    >>> np.savez_compressed(f"{src}/raw/node-label.npz", node_label=np.array([[0.0], [1.0], [np.nan]]))
    >>> detect(src)
    'ogb'
    >>> ds = lightning_ooc.open_dataset(import_dataset(f"{src}-imported", src, progress=False))
    >>> ds.num_nodes, ds.num_edges, ds.labels.tolist()
    (3, 3, [0, 1, -1])
"""
from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

from lightning_ooc.data.importers import graphbolt, igb, mag240m, ogb, tgb
from lightning_ooc.data.importers.common import ImportOptions
from lightning_ooc.errors import InputError

#: layout name -> its importer module
LAYOUTS: dict[str, ModuleType] = {m.NAME: m for m in (ogb, mag240m, igb, graphbolt, tgb)}


def detect(root: str | os.PathLike) -> str:
    """The layout of directory ``root``; an InputError when none or several fit (saying what each expects)."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{root}: no such directory (the dataset to import)")
    found = {name: why for name, m in LAYOUTS.items() if (why := m.detect(root)) is not None}
    if len(found) == 1:
        return next(iter(found))
    if not found:
        raise InputError(f"{root}: not a layout this release imports ({', '.join(LAYOUTS)}): found no raw/data.npz or "
                         "raw/edge.csv.gz (ogb), processed/paper/node_feat.npy with author___writes___paper/ "
                         "(mag240m), processed/paper/node_feat.npy with paper__cites__paper/ (igb), or "
                         "metadata.yaml (graphbolt), or NAME_edgelist.csv with NAME_val_ns.pkl (tgb); point at "
                         "the dataset's own directory, or name the layout with --from")  # fmt: skip
    says = "; ".join(f"{k}: {v}" for k, v in found.items())
    raise InputError(f"{root}: fits several layouts ({says}); name one with --from {'|'.join(found)}")


def import_dataset(out: str | os.PathLike, root: str | os.PathLike, layout: str | None = None, **options: Any) -> Path:
    """Write the dataset at ``root`` (in ``layout``, else detected) to ``out``; returns ``out``.

    Options: ``features`` (``"copy"`` or ``"in-place"``), ``feature_dtype``, ``add_reverse`` (None: as the
    layout's own loader builds the graph), ``split`` (random node splits where the layout has none),
    ``seed``, ``overwrite``, ``progress``, and a layout's own in ``extra`` (``ogb_split``, ``igb_classes``).
    """
    root = Path(root)
    if layout is None:
        layout = detect(root)
    elif layout not in LAYOUTS:
        raise InputError(f"unknown layout {layout!r}; this release imports {', '.join(LAYOUTS)}")
    elif not root.is_dir():
        raise InputError(f"{root}: no such directory (the {layout} dataset to import)")
    opts = ImportOptions(**options)
    return LAYOUTS[layout].write(out, root, opts)


__all__ = ["LAYOUTS", "detect", "import_dataset", "ImportOptions"]
