"""The summary `lightning-ooc info` prints for a partition output: its manifest, method, parts and their rows.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_ooc.data.format import human_bytes
from lightning_ooc.partitioned.partition import read_manifest


def summarize_partition_output(path: Any) -> dict[str, Any]:
    """Facts about a ``lightning-ooc partition`` output directory: its ``partition.json`` and each part's size."""
    root = Path(path)
    m = read_manifest(root)
    per_part = []
    for k, name in enumerate(m["dirs"]):
        entry: dict[str, Any] = {"dir": name, "rows": int(m["part_nodes"][k]),
                                 "train": int(m["part_train"][k]) if "part_train" in m else None}  # fmt: skip
        entry["feature_bytes"] = entry["rows"] * int(m.get("row_bytes", 0))
        try:  # the bytes each part directory holds, as its meta.json records them
            meta = json.loads((root / name / "meta.json").read_text())
            entry["bytes"] = int(sum(int(e["bytes"]) for e in meta["files"].values()))
        except (OSError, ValueError, KeyError, TypeError):
            entry["bytes"] = None
        per_part.append(entry)
    return {"root": str(root), **m, "per_part": per_part}


def format_partition_output(info: dict[str, Any]) -> str:
    """Render :func:`summarize_partition_output` as text (also what ``lightning-ooc partition`` prints)."""
    b = info["balance"]
    lines = [
        f"partition    {info['root']}  ({info['parts']} parts, method {info['method']}, seed {info.get('seed', 0)})",
        f"source       {info.get('source', '?')}  (identity {info.get('source_identity')})",
        f"graph        {info['num_nodes']:,} nodes, {info.get('num_edges', 0):,} edges (topology and labels in every "
        "part)",
        f"edge cut     {info['edge_cut']:,} edges ({info['edge_cut_fraction']:.2%}) join nodes of different parts",
        f"balance      nodes {b['nodes']:.3f}  train seeds {b['train']:.3f}  (largest part / mean)",
    ]
    if "seconds" in info:
        lines.append(f"took         {info['seconds']:.1f} s ({info.get('partition_seconds', 0):.1f} s partitioning)")
    lines.append("parts        dir            rows         train    features       on disk")
    for e in info["per_part"]:
        train = f"{e['train']:,}" if e["train"] is not None else "?"
        disk = human_bytes(e["bytes"]) if e["bytes"] is not None else "?"
        lines.append(f"  {e['dir']:<12} {e['rows']:>14,} {train:>13} {human_bytes(e['feature_bytes']):>11} "
                     f"{disk:>13}")  # fmt: skip
    return "\n".join(lines)
