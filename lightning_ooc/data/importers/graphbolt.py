"""A GraphBolt ``OnDiskDataset`` directory: ``metadata.yaml`` naming the graph's edge files, the feature files
and the tasks' sets.

* ``graph``: ``nodes`` (``type``, ``num``; no ``type`` in a homogeneous graph) and ``edges`` (``type``
  ``"src:rel:dst"``, ``format`` ``csv`` (``src,dst`` lines) or ``numpy`` (``(2, E)``), ``path``);
* ``feature_data``: entries of ``domain`` ``node`` (or ``edge``, not imported), ``type``, ``name``,
  ``format`` ``numpy`` (a ``.npy``: copied or used in place) or ``torch`` (loaded with ``weights_only``),
  ``path``; the node feature named ``feat`` is the features (else the type's only one; ``--graphbolt-feature``
  names another);
* ``tasks``: each with ``name``, ``num_classes`` and ``train_set`` / ``validation_set`` / ``test_set``: lists
  of ``{type, data: [{name, format, path}]}``. Node classification sets hold ``seeds`` (older releases:
  ``seed_nodes``) and ``labels``; link prediction sets hold ``seeds`` of shape ``(M, 2)`` (older:
  ``node_pairs``), with ``labels`` (1/0: positives and negatives as pairs, the ``indexes`` that group them are
  not needed) or ``negative_dsts`` ``(M, K)``. Numpy edge files are ``(2, E)``, as GraphBolt requires.

The first task is imported unless ``--graphbolt-task`` names another. A node task's labels become the
labels of the nodes its sets name. Paths are relative to the directory of ``metadata.yaml`` and lie inside it (a
path that leads out of it, by ``..`` or as an absolute path elsewhere, is refused).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lightning_ooc.data.importers.common import ImportOptions, NodeInput, write_hetero
from lightning_ooc.data.importers.sources import CsvEdgeSource, PairsEdgeSource, as_numpy, load_pt, need, npy_array
from lightning_ooc.data.in_place import npy_rows
from lightning_ooc.data.prepare import _prepare
from lightning_ooc.errors import InputError

NAME = "graphbolt"
META = "metadata.yaml"
_SETS = (("train", "train_set"), ("val", "validation_set"), ("test", "test_set"))


def detect(root: Path) -> str | None:
    return f"it holds {META}" if (root / META).is_file() else None


def _yaml_error(path: Path, e: yaml.YAMLError) -> InputError:
    """A YAML syntax error as one line naming the file and the line (PyYAML's own text takes several)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    why = " ".join(str(getattr(e, "problem", None) or e).split())
    context = getattr(e, "context", None)
    if context and getattr(e, "problem", None):
        why = f"{' '.join(str(context).split())}: {why}"
    return InputError(f"{where}: not valid YAML ({why}); fix the file (GraphBolt's metadata.yaml)")


def _load_meta(root: Path) -> dict[str, Any]:
    path = need(root / META, "GraphBolt's metadata")
    try:
        meta = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: unreadable ({e}); GraphBolt's metadata is a UTF-8 YAML file") from None
    except yaml.YAMLError as e:
        raise _yaml_error(path, e) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("graph"), dict):
        raise InputError(f"{path}: expected a mapping with a 'graph' section (GraphBolt's OnDiskDataset metadata)")
    return meta


def _file(root: Path, entry: dict[str, Any], what: str) -> Path:
    """The file an entry of ``metadata.yaml`` names: a path inside the dataset's directory (relative to it, or
    absolute and under it; checked as written, so a link inside it is followed), else an InputError."""
    rel = entry.get("path")
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise InputError(f"{root / META}: {what} has no path")
    base = os.path.normpath(os.path.abspath(root))
    path = os.path.normpath(os.path.join(base, rel))
    if os.path.commonpath([base, path]) != base:
        raise InputError(f"{root / META}: {what}: the path {rel!r} leads outside the dataset's directory {base}; "
                         "the files of a GraphBolt dataset lie in its directory (write the path relative to "
                         "it)")  # fmt: skip
    return need(root / os.path.relpath(path, base), what)


def _data(root: Path, entry: dict[str, Any], what: str) -> np.ndarray:
    path = _file(root, entry, what)
    fmt = entry.get("format", "numpy")
    if fmt == "numpy":
        return np.asarray(npy_array(path, what))
    if fmt == "torch":
        return as_numpy(load_pt(path, what))
    raise InputError(f"{root / META}: {what} has format {fmt!r}; expected numpy or torch")


def _types(meta: dict[str, Any], root: Path) -> dict[str | None, int]:
    nodes = meta["graph"].get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise InputError(f"{root / META}: graph.nodes must list the node types and their counts")
    out: dict[str | None, int] = {}
    for e in nodes:
        if not isinstance(e, dict) or not isinstance(e.get("num"), int):
            raise InputError(f"{root / META}: each graph.nodes entry needs num, got {e!r}")
        out[e.get("type")] = int(e["num"])
    return out


def _edges(meta: dict[str, Any], root: Path, homogeneous: bool) -> list[tuple[tuple[str, str, str] | None, Any]]:
    out = []
    for e in meta["graph"].get("edges") or []:
        et = None
        if not homogeneous:
            parts = str(e.get("type", "")).split(":")
            if len(parts) != 3:
                raise InputError(f"{root / META}: edge type {e.get('type')!r} is not 'src:rel:dst'")
            et = tuple(parts)
        fmt = e.get("format", "csv")
        path = _file(root, e, f"the edges {e.get('type', '')}".strip())
        if fmt == "csv":
            out.append((et, CsvEdgeSource(path)))
        elif fmt == "numpy":
            out.append((et, PairsEdgeSource(npy_array(path, "edges"), str(path), rows=True)))  # GraphBolt's (2, E)
        else:
            raise InputError(f"{root / META}: edges in format {fmt!r}; expected csv or numpy")
    if not out:
        raise InputError(f"{root / META}: graph.edges lists no edge files")
    return out


def _features(meta: dict[str, Any], root: Path, types: dict[str | None, int], opts: ImportOptions) -> dict[Any, Any]:
    """Each node type's feature rows (a RowFile for numpy, a tensor's array for torch)."""
    want = opts.extra.get("graphbolt_feature")
    found: dict[Any, dict[str, dict[str, Any]]] = {}
    for e in meta.get("feature_data") or []:
        if isinstance(e, dict) and e.get("domain") == "node":
            found.setdefault(e.get("type"), {})[str(e.get("name"))] = e
    out = {}
    for t, entries in found.items():
        if t not in types:
            which = "without a type" if t is None else f"of type {t!r}"
            raise InputError(f"{root / META}: a node feature {which}, which graph.nodes does not list")
        owner = "the graph" if t is None else f"node type {t!r}"
        if want is not None and want not in entries:
            raise InputError(f"{root / META}: {owner} has no feature {want!r} (--graphbolt-feature); it has "
                             f"{sorted(entries)}")  # fmt: skip
        name = want or ("feat" if "feat" in entries else (next(iter(entries)) if len(entries) == 1 else None))
        if name is None:
            raise InputError(f"{root / META}: {owner} has features {sorted(entries)}; name the one to use "
                             "with --graphbolt-feature")  # fmt: skip
        e = entries[name]
        path = _file(root, e, f"the node feature {name!r}")
        if e.get("format", "numpy") == "numpy":
            out[t] = npy_rows(path, f"node feature {name!r}")
        else:
            if opts.features == "in-place":
                raise InputError(f"{path}: a torch file cannot be used in place; import it with --features copy")
            a = as_numpy(load_pt(path, f"the node feature {name!r}"))
            out[t] = a.reshape(len(a), -1)
    return out


def _task(meta: dict[str, Any], root: Path, opts: ImportOptions) -> dict[str, Any] | None:
    tasks = meta.get("tasks") or []
    if not tasks:
        return None
    want = opts.extra.get("graphbolt_task")
    if want is None:
        return tasks[0]
    for t in tasks:
        if t.get("name") == want:
            return t
    names = ", ".join(repr(t.get("name")) if t.get("name") is not None else "one without a name" for t in tasks)
    raise InputError(f"{root / META}: no task {want!r} (tasks: {names})")


def _sets(task: dict[str, Any], root: Path) -> dict[str, dict[Any, dict[str, np.ndarray]]]:
    """``{split: {node type: {"seeds": ..., "labels": ..., "negative_dsts": ...}}}``."""
    out: dict[str, dict[Any, dict[str, np.ndarray]]] = {}
    task_name = f"task {task['name']!r}" if task.get("name") is not None else "the task"
    for ours, key in _SETS:
        for item in task.get(key) or []:
            data = {}
            for d in item.get("data") or []:
                name = {"seed_nodes": "seeds", "node_pairs": "seeds"}.get(d.get("name"), d.get("name"))
                data[name] = _data(root, d, f"the {d.get('name')} of {task_name}'s {key}")
            out.setdefault(ours, {})[item.get("type")] = data
    return out


def _set_name(s: str, t: Any) -> str:
    """A task's set as ``metadata.yaml`` names it: ``the validation_set`` (``... of node type 'paper'``)."""
    key = dict(_SETS)[s]
    return f"the {key}" if t is None else f"the {key} of node type {t!r}"


def _node_labels(sets: dict[str, Any], t: Any, n: int, root: Path) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The labels of the nodes of type ``t`` (None: a homogeneous graph) that the task's sets give, and the sets'
    seeds as node splits."""
    y = np.full(n, -1, np.int64)
    splits: dict[str, Any] = {}
    for s, per_type in sets.items():
        d = per_type.get(t)
        if d is None:
            continue
        name = _set_name(s, t)
        seeds = d.get("seeds")
        if seeds is None:
            raise InputError(f"{root / META}: {name} has no seeds")
        seeds = np.asarray(seeds).reshape(-1).astype(np.int64)
        splits[s] = seeds
        if d.get("labels") is not None:
            lab = np.asarray(d["labels"]).reshape(-1)
            if lab.shape[0] != seeds.shape[0]:
                raise InputError(f"{root / META}: {name} has {seeds.shape[0]} seeds, {lab.shape[0]} labels")
            if seeds.size and (seeds.min() < 0 or seeds.max() >= n):
                raise InputError(f"{root / META}: {name} names nodes outside [0, {n})")
            clash = (y[seeds] >= 0) & (y[seeds] != lab)
            if clash.any():
                node = f"node {int(seeds[clash][0])}" + (f" of type {t!r}" if t is not None else "")
                raise InputError(f"{root / META}: {node} has two labels across the sets")
            y[seeds] = lab
    return (y if (y >= 0).any() else None), splits


def _links(sets: dict[str, Any], root: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for s, per_type in sets.items():
        if len(per_type) != 1:
            raise InputError(f"{root / META}: link sets over several edge types are not supported")
        d = next(iter(per_type.values()))
        seeds = np.asarray(d.get("seeds"))
        if seeds.ndim != 2 or 2 not in seeds.shape:
            raise InputError(f"{root / META}: the {s} link set's seeds must be node pairs (M, 2)")
        pairs = seeds if seeds.shape[1] == 2 else seeds.T
        entry: dict[str, Any] = {"index": pairs}
        if d.get("labels") is not None:
            entry["label"] = np.asarray(d["labels"]).reshape(-1).astype(np.float32)
        if d.get("negative_srcs") is not None:
            raise InputError(f"{root / META}: the {s} link set gives negative sources (negative_srcs); only negative "
                             "destinations (negative_dsts), or seeds with labels, are imported")  # fmt: skip
        if d.get("negative_dsts") is not None:
            entry["neg_dst"] = np.asarray(d["negative_dsts"]).reshape(len(pairs), -1)
        out[s] = entry
    return out


def write(out: str | os.PathLike, root: Path, opts: ImportOptions) -> Path:
    meta = _load_meta(root)
    types = _types(meta, root)
    homogeneous = list(types) == [None]
    edges = _edges(meta, root, homogeneous)
    feats = _features(meta, root, types, opts)
    task = _task(meta, root, opts)
    sets = _sets(task, root) if task is not None else {}
    is_link = any(np.asarray(d.get("seeds")).ndim == 2 for per in sets.values() for d in per.values()
                  if d.get("seeds") is not None)  # fmt: skip
    source = {"input": "graphbolt", "root": str(root.absolute()), "name": meta.get("dataset_name"),
              "task": task.get("name") if task else None}  # fmt: skip
    if homogeneous:
        n = types[None]
        x = feats.get(None)
        if x is None:
            raise InputError(f"{root / META}: the graph has no node features (feature_data of domain node)")
        edge_src = edges[0][1] if len(edges) == 1 else None
        if edge_src is None:
            raise InputError(f"{root / META}: a homogeneous graph with several edge files")
        add_reverse = bool(opts.add_reverse)
        common = dict(num_classes=task.get("num_classes") if task and not is_link else None,
                      feature_dtype=opts.feature_dtype, add_reverse=add_reverse, drop_self_loops=False,
                      drop_duplicates=False, seed=opts.seed, overwrite=opts.overwrite, progress=opts.progress,
                      features=opts.features, source={**source, "add_reverse": add_reverse})  # fmt: skip
        if x.shape[0] != n:
            raise InputError(f"{root / META}: {x.shape[0]} feature rows for the {n} nodes graph.nodes gives")
        if is_link:
            return _prepare(out, lambda w: edge_src, x, None, {}, split=opts.split, link_splits=_links(sets, root),
                            link_note="as given: the GraphBolt graph's edges", **common)  # fmt: skip
        y, splits = _node_labels(sets, None, n, root)
        return _prepare(out, lambda w: edge_src, x, y, splits, split=opts.split, **common)
    if is_link:
        raise InputError(f"{root / META}: link prediction on a heterogeneous graph is not supported")
    nodes = {}
    for t, n in types.items():
        y, splits = _node_labels(sets, t, n, root)
        nodes[t] = NodeInput(n, feats.get(t), y, splits if y is not None else None)
    target = next((t for per in sets.values() for t in per), None)
    if opts.add_reverse is None:
        opts.add_reverse = False
    return write_hetero(out, nodes, edges, opts, target=target, source=source)
