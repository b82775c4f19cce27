"""``lightning-ooc info``: a readable summary of a dataset."""
from __future__ import annotations

from typing import Any

import numpy as np

from lightning_ooc.data.dataset import OnDiskDataset
from lightning_ooc.data.format import SPLITS, human_bytes
from lightning_ooc.data.hetero_dataset import relation_key
from lightning_ooc.data.in_place import IN_PLACE, read_amplification

_LABEL_CHUNK = 1 << 23


def summarize(ds: OnDiskDataset) -> dict[str, Any]:
    """Facts about a dataset as a JSON-able dict (sizes, degrees, classes, splits)."""
    if ds.is_hetero:
        return _summarize_hetero(ds)
    deg = ds.in_degree
    n = ds.num_nodes
    c = ds.num_classes
    counts = np.zeros(c + 1, dtype=np.int64)  # last slot: unknown (-1)
    out_of_range = 0
    for s in range(0, n, _LABEL_CHUNK):
        part = np.asarray(ds.labels[s : s + _LABEL_CHUNK])
        bad = (part < -1) | (part >= c)
        if bad.any():  # counted apart: a label of 10^12 must not size the histogram
            out_of_range += int(bad.sum())
            part = part[~bad]
        counts += np.bincount(np.where(part < 0, c, part), minlength=counts.size)
    sizes = ds.file_sizes()
    return {
        "root": str(ds.root),
        "format": f"{ds.meta['format']} v{ds.meta['version']}",
        "created_with": ds.meta.get("created_with"),
        "num_nodes": n,
        "num_edges": ds.num_edges,
        "num_features": ds.num_features,
        "feature_dtype": ds.feature_dtype_name,
        "row_bytes": ds.row_bytes,
        "num_classes": ds.num_classes,
        "files": sizes,
        "bytes_on_disk": int(sum(sizes.values())),
        "in_degree": _degrees(deg),
        "class_counts": counts[:-1].tolist(),
        "unlabelled": int(counts[-1]),
        "labels_out_of_range": out_of_range,
        "splits": {s: int(len(ds.split(s))) for s in SPLITS},
        **({"link_splits": ds.link_splits} if ds.has_link_splits else {}),
        **({"partition": _partition(ds)} if getattr(ds, "partition", None) is not None else {}),
        "source": ds.meta.get("source", {}),
        **_in_place(ds.meta),
    }


def _direct_block(path: str) -> int:
    """The alignment of direct reads of ``path`` (what the feature reader's extents are rounded to); 4096 where
    the native reader is missing."""
    try:
        from lightning_ooc.io import FeatureReader  # lazy: io needs the native module, a summary does not

        with FeatureReader(path, 1, "uint8", queue_depth=1) as r:
            return max(1, r.block_size) if r.info["direct"] else 4096
    except Exception:  # noqa: BLE001 - a summary reports what it can; the reader's own errors come at training
        return 4096


def _in_place(meta: dict[str, Any]) -> dict[str, Any]:
    """``{"in_place": {key: facts}}`` for feature files used in place: path, offset, the direct reads' block and
    the read amplification of one-row reads at that offset and at an aligned one (empty without any)."""
    out = {}
    for key, rec in meta.get(IN_PLACE, {}).items():
        block = _direct_block(rec["path"])
        out[key] = {"path": rec["path"], "offset": rec["offset"], "bytes": rec["num_rows"] * rec["row_bytes"],
                    "block": block, "read_amplification": read_amplification(rec["offset"], rec["row_bytes"], block),
                    "aligned_read_amplification": read_amplification(0, rec["row_bytes"], block)}  # fmt: skip
    return {"in_place": out} if out else {}


def _in_place_lines(info: dict[str, Any]) -> list[str]:
    lines = []
    for key, e in info.get("in_place", {}).items():
        aligned = "aligned" if e["offset"] % e["block"] == 0 else f"not a multiple of the {e['block']} B block"
        lines.append(f"in place     {key}: {e['path']} ({human_bytes(e['bytes'])} from offset {e['offset']}, {aligned}); "
                     f"a one-row read costs {e['read_amplification']:.2f}x the row "
                     f"({e['aligned_read_amplification']:.2f}x at an aligned offset)")  # fmt: skip
    return lines


def _partition(ds: OnDiskDataset) -> dict[str, Any]:
    p = ds.partition
    return {"index": p.index, "parts": p.parts, "num_rows": p.num_rows, "method": p.method,
            "feature_bytes": p.num_rows * ds.row_bytes, "source_identity": p.source_identity}  # fmt: skip


def _degrees(deg: np.ndarray) -> dict[str, Any]:
    n = deg.size
    return {
        "min": int(deg.min()) if n else 0,
        "median": float(np.median(deg)) if n else 0.0,
        "mean": float(deg.mean()) if n else 0.0,
        "p99": float(np.percentile(deg, 99)) if n else 0.0,
        "max": int(deg.max()) if n else 0,
        "zero_in_degree": int((deg == 0).sum()),
    }


def _summarize_hetero(ds: Any) -> dict[str, Any]:
    """:func:`summarize` of a heterogeneous dataset: per node type and per relation."""

    sizes = ds.file_sizes()
    types = {}
    for t in ds.node_types:
        node = ds.node(t)
        entry: dict[str, Any] = {
            "num_nodes": node.num_nodes,
            "num_features": node.num_features,
            "feature_dtype": node.feature_dtype_name if node.has_features else None,
            "row_bytes": node.row_bytes,
            "feature_bytes": node.num_nodes * node.row_bytes,
            "num_classes": node.num_classes,
        }
        if node.has_labels:
            y = np.asarray(node.labels)
            entry["labelled"] = int(((y >= 0) & (y < node.num_classes)).sum())
            entry["splits"] = {s: int(len(node.split(s))) for s in SPLITS}
        types[t] = entry
    rels = {relation_key(et): {"src": et[0], "rel": et[1], "dst": et[2], "num_edges": csc.num_edges,
                               "in_degree": _degrees(csc.in_degree)} for et, csc in ds.csc.items()}  # fmt: skip
    return {
        "root": str(ds.root),
        "format": f"{ds.meta['format']} v{ds.meta['version']}",
        "created_with": ds.meta.get("created_with"),
        "hetero": True,
        "target": ds.target,
        "num_nodes": ds.num_nodes,
        "num_edges": ds.num_edges,
        "node_types": types,
        "relations": rels,
        "files": sizes,
        "bytes_on_disk": int(sum(sizes.values())),
        "source": ds.meta.get("source", {}),
        **_in_place(ds.meta),
    }


def _format_hetero(info: dict[str, Any]) -> list[str]:
    lines = [
        f"dataset      {info['root']}  ({info['format']}, {info['created_with']})",
        f"graph        heterogeneous: {len(info['node_types'])} node types, {len(info['relations'])} relations, "
        f"{info['num_nodes']:,} nodes, {info['num_edges']:,} edges; target {info['target']}",
        f"on disk      {human_bytes(info['bytes_on_disk'])}",
        *_in_place_lines(info),
        "node types",
    ]
    width = max(map(len, info["node_types"]))
    for t, e in info["node_types"].items():
        feats = (f"{e['num_features']} x {e['feature_dtype']} ({human_bytes(e['feature_bytes'])})"
                 if e["num_features"] else "no features")  # fmt: skip
        line = f"  {t:<{width}} {e['num_nodes']:>14,} nodes  {feats}"
        if e["num_classes"]:
            sp = e["splits"]
            line += (f"  {e['num_classes']} classes, {e['labelled']:,} labelled; splits train {sp['train']:,} "
                     f"val {sp['val']:,} test {sp['test']:,}")  # fmt: skip
        lines.append(line)
    lines.append("relations (in-edge CSC per relation: in-degree of the destination type)")
    width = max(map(len, info["relations"]))
    for key, r in info["relations"].items():
        d = r["in_degree"]
        lines.append(f"  {key:<{width}} {r['num_edges']:>14,} edges  in-degree mean {d['mean']:.2f}  "
                     f"p99 {d['p99']:g}  max {d['max']:,}  zero {d['zero_in_degree']:,}")  # fmt: skip
    return lines


def _link_lines(links: dict[str, Any]) -> list[str]:
    """The link splits: edges per split, each split's fields, what the stored graph holds."""
    splits = links["splits"]
    lines = ["link splits  " + " / ".join(f"{s} {e['edges']:,}" for s, e in splits.items()) + " edges"]
    for s, e in splits.items():
        fields = ", ".join(e["fields"]) or "no fields"
        neg = f" ({e['neg_per_edge']:,} negatives per edge)" if e.get("neg_per_edge") else ""
        lines.append(f"  {s:<10} {fields}{neg}")
    leak = "no leakage" if links["leakage_free"] else "not leakage-free"
    lines.append(f"  message passing: {links['message_passing']}; {leak}")
    return lines


def format_summary(info: dict[str, Any], backends: dict[str, tuple[bool, str]] | None = None) -> str:
    """Render :func:`summarize` output as aligned text."""
    if info.get("hetero"):
        lines = _format_hetero(info)
        src = info.get("source") or {}
        if src:
            lines.append("source       " + ", ".join(f"{k}={v}" for k, v in src.items()))
        return "\n".join(lines + _backend_lines(backends))
    n = info["num_nodes"]
    d = info["in_degree"]
    lines = [
        f"dataset      {info['root']}  ({info['format']}, {info['created_with']})",
        f"nodes        {n:,}",
        f"edges        {info['num_edges']:,}  (in-edge CSC, mean in-degree {d['mean']:.2f})",
        f"features     {info['num_features']} x {info['feature_dtype']}  ({info['row_bytes']} B per row)",
        f"classes      {info['num_classes']}" + (f"  ({info['unlabelled']:,} nodes unlabelled)" if info["unlabelled"] else ""),
        f"on disk      {human_bytes(info['bytes_on_disk'])}",
    ]
    width = max(10, *map(len, info["files"]))  # link files have longer keys
    for key, size in sorted(info["files"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {key:<{width}} {human_bytes(size):>12}")
    lines += _in_place_lines(info)
    lines.append(
        f"in-degree    min {d['min']:,}  median {d['median']:g}  mean {d['mean']:.2f}  p99 {d['p99']:g}  "
        f"max {d['max']:,}  zero in-degree {d['zero_in_degree']:,}"
    )
    if info.get("labels_out_of_range"):
        lines.append(f"labels       {info['labels_out_of_range']:,} outside [-1, {info['num_classes']}): the dataset is "
                     "damaged; run `lightning-ooc verify`")  # fmt: skip
    counts = info["class_counts"]
    if counts:
        labelled = max(1, sum(counts))
        if len(counts) <= 16:
            lines.append("class balance " + "  ".join(f"{c}:{k / labelled:.1%}" for c, k in enumerate(counts)))
        else:
            lines.append(
                f"class balance smallest {min(counts):,} ({min(counts) / labelled:.2%}), "
                f"largest {max(counts):,} ({max(counts) / labelled:.2%}) of {labelled:,} labelled"
            )
    lines.append(
        "splits       " + "  ".join(f"{s} {k:,} ({k / max(n, 1):.2%})" for s, k in info["splits"].items())
    )
    if info.get("link_splits"):
        lines += _link_lines(info["link_splits"])
    if info.get("partition"):
        p = info["partition"]
        lines.append(f"partition    part {p['index']} of {p['parts']} ({p['method']}): the feature rows of "
                     f"{p['num_rows']:,} of the {n:,} nodes ({human_bytes(p['feature_bytes'])}); topology, labels "
                     "whole; splits: its own nodes")  # fmt: skip
    src = info.get("source") or {}
    if src:
        lines.append("source       " + ", ".join(f"{k}={v}" for k, v in src.items()))
    return "\n".join(lines + _backend_lines(backends))


def _backend_lines(backends: dict[str, tuple[bool, str]] | None) -> list[str]:
    lines = []
    if backends:
        lines.append("io backends  " + "  ".join(f"{b}:{'yes' if ok else 'no'}" for b, (ok, _) in backends.items()))
        for b, (ok, why) in backends.items():
            if not ok:
                lines.append(f"  {b}: {why}")
    return lines
