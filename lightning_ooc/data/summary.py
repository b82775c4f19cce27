"""``lightning-ooc info``: a readable summary of a dataset."""
from __future__ import annotations

from typing import Any

import numpy as np

from lightning_ooc.data.dataset import OnDiskDataset
from lightning_ooc.data.format import SPLITS, human_bytes

_LABEL_CHUNK = 1 << 23


def summarize(ds: OnDiskDataset) -> dict[str, Any]:
    """Facts about a dataset as a JSON-able dict (sizes, degrees, classes, splits)."""
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
        "in_degree": {
            "min": int(deg.min()) if n else 0,
            "median": float(np.median(deg)) if n else 0.0,
            "mean": float(deg.mean()) if n else 0.0,
            "p99": float(np.percentile(deg, 99)) if n else 0.0,
            "max": int(deg.max()) if n else 0,
            "zero_in_degree": int((deg == 0).sum()),
        },
        "class_counts": counts[:-1].tolist(),
        "unlabelled": int(counts[-1]),
        "labels_out_of_range": out_of_range,
        "splits": {s: int(len(ds.split(s))) for s in SPLITS},
        **({"link_splits": ds.link_splits} if ds.has_link_splits else {}),
        "source": ds.meta.get("source", {}),
    }


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
    src = info.get("source") or {}
    if src:
        lines.append("source       " + ", ".join(f"{k}={v}" for k, v in src.items()))
    if backends:
        lines.append("io backends  " + "  ".join(f"{b}:{'yes' if ok else 'no'}" for b, (ok, _) in backends.items()))
        for b, (ok, why) in backends.items():
            if not ok:
                lines.append(f"  {b}: {why}")
    return "\n".join(lines)
