"""import: time and peak memory of `prepare --from` on a synthetic graph in IGB's layout, against reading its files once.

``lightning-ooc bench import --nodes 100000000 --edges 1000000000 --memory-cap 4GiB --workdir DIR``

1. writes (once; kept and reused while its parameters stay) a homogeneous IGB-layout graph under
   ``DIR/igb-N-E-F``: ``processed/paper/node_feat.npy`` (N x F float32), ``node_label_19.npy`` and
   ``paper__cites__paper/edge_index.npy`` (E x 2 int64; sources uniform, targets skewed towards low ids, so
   in-degrees vary as in a real graph);
2. the reference: reads every input file once, sequentially, from a cold page cache (the least any import
   must do);
3. runs ``lightning-ooc prepare --from igb`` on it in a child process under a memory cgroup of ``--memory-cap``
   (cold cache), ``--features in-place`` by default (``--features copy`` copies them), and reports its time, its
   peak anonymous memory (sampled from the cgroup: what no page cache counts in), the child's peak resident set
   (which counts the pages of memory-mapped inputs) and the cgroup's peak (which counts page cache too).

A run that the cap kills is reported as such. The output dataset is removed afterwards unless ``--keep``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from lightning_ooc.bench.system import (bench_workdir, code_version, drop_caches, machine_facts, run_capped,
                                        write_results)  # fmt: skip
from lightning_ooc.data.format import NpyStreamWriter, human_bytes, parse_bytes

_CHUNK = 1 << 25  # edges (or rows) generated per step


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=100_000_000)
    p.add_argument("--edges", type=int, default=1_000_000_000)
    p.add_argument("--dim", type=int, default=16, help="feature width (float32; default 16)")
    p.add_argument("--workdir", type=Path, required=True, help="where the synthetic layout and the output go")
    p.add_argument("--memory-cap", default="4GiB",
                   help="memory cgroup limit of the import (default 4GiB; none: no cgroup, where there are none)")
    p.add_argument("--features", choices=["in-place", "copy"], default="in-place")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the imported dataset")
    p.add_argument("--out", type=Path, help="results JSON (default bench-results/import-DATE.json)")


def synth_igb(root: Path, nodes: int, edges: int, dim: int, seed: int) -> Path:
    """Write (or reuse) a homogeneous IGB-layout graph; returns its directory."""
    stamp = {"nodes": nodes, "edges": edges, "dim": dim, "seed": seed, "layout": "igb"}
    marker = root / "synth.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        print(f"bench import: reusing {root}")
        return root
    if root.exists():
        shutil.rmtree(root)
    p = root / "processed"
    (p / "paper").mkdir(parents=True)
    (p / "paper__cites__paper").mkdir()
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    w = NpyStreamWriter(p / "paper" / "node_feat.npy", np.float32, nodes, (dim,))
    rows = max(1, (256 << 20) // (4 * dim))
    for s in range(0, nodes, rows):
        w.write(rng.random((min(rows, nodes - s), dim), dtype=np.float32))
    w.close()
    w = NpyStreamWriter(p / "paper" / "node_label_19.npy", np.float32, nodes)
    for s in range(0, nodes, _CHUNK):
        w.write(rng.integers(0, 19, min(_CHUNK, nodes - s)).astype(np.float32))
    w.close()
    w = NpyStreamWriter(p / "paper__cites__paper" / "edge_index.npy", np.int64, edges, (2,))
    for s in range(0, edges, _CHUNK):
        k = min(_CHUNK, edges - s)
        pairs = np.empty((k, 2), np.int64)
        pairs[:, 0] = rng.integers(0, nodes, k)
        pairs[:, 1] = (rng.random(k) ** 2 * nodes).astype(np.int64)  # targets skewed: in-degrees vary
        w.write(pairs)
    w.close()
    marker.write_text(json.dumps(stamp))
    print(f"bench import: wrote {root} in {time.perf_counter() - t0:.0f} s")
    return root


def read_once(paths: list[Path]) -> float:
    """Seconds to read ``paths`` sequentially once (1 MiB reads)."""
    buf = bytearray(1 << 20)
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def run_import(src: Path, out: Path, cap: int | None, features: str) -> dict[str, Any]:
    """``prepare --from igb`` in a child process under a memory cgroup (none without ``cap``); its time, peak
    anonymous memory, peak RSS, cgroup peak and status."""
    cmd = [sys.executable, "-m", "lightning_ooc", "prepare", "--from", "igb", str(src), "--out", str(out),
           "--features", features, "--no-progress", "--overwrite"]  # fmt: skip
    log = out.parent / f".{out.name}.log"
    try:
        r = run_capped(cmd, cap, log)
    finally:
        log.unlink(missing_ok=True)
    code, seconds, output = r["code"], r["seconds"], r["output"]
    killed = code < 0 or code == 137
    return {"seconds": seconds, "returncode": code, "killed": killed,
            "peak_rss_bytes": r["peak_rss_bytes"], "cgroup_peak_bytes": r["cgroup_peak_bytes"],
            "peak_anon_bytes": r["peak_anon_bytes"],
            "output_tail": output[-2000:]}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    cap = None if str(args.memory_cap).lower() == "none" else parse_bytes(args.memory_cap)
    args.workdir = bench_workdir(args.workdir)
    src = synth_igb(args.workdir / f"igb-{args.nodes}-{args.edges}-{args.dim}", args.nodes, args.edges, args.dim,
                    args.seed)  # fmt: skip
    p = src / "processed"
    inputs = [p / "paper" / "node_feat.npy", p / "paper" / "node_label_19.npy",
              p / "paper__cites__paper" / "edge_index.npy"]  # fmt: skip
    in_bytes = sum(f.stat().st_size for f in inputs)
    dropped, how = drop_caches(inputs)
    floor = read_once(inputs)
    print(f"reference: reading the {human_bytes(in_bytes)} of input once took {floor:.1f} s "
          f"({in_bytes / floor / 1e6:.0f} MB/s; {how})")
    out = args.workdir / "imported"
    shutil.rmtree(out, ignore_errors=True)  # what a run before left: the sizes below are this run's
    drop_caches(inputs)
    res = run_import(src, out, cap, args.features)
    made = sum(f.stat().st_size for f in out.iterdir()) if out.is_dir() else 0
    if res["returncode"] != 0:
        print(f"import FAILED (exit {res['returncode']}{', killed: over the memory cap?' if res['killed'] else ''}) "
              f"after {res['seconds']:.1f} s:\n{res['output_tail']}")  # fmt: skip
    else:
        print(f"import (--features {args.features}) of {args.nodes:,} nodes, {args.edges:,} edges "
              f"{'under a ' + human_bytes(cap) + ' cap' if cap else 'without a memory cap'}: {res['seconds']:.1f} s = {res['seconds'] / floor:.2f}x reading the input "
              f"once; peak anonymous memory {human_bytes(res['peak_anon_bytes'] or 0)}, peak RSS (mapped input "
              f"pages included) {human_bytes(res['peak_rss_bytes'])}, cgroup peak (page cache included) "
              f"{human_bytes(res['cgroup_peak_bytes'] or 0)}; wrote {human_bytes(made)}")  # fmt: skip
    doc = {"kind": "import", **code_version(), "machine": machine_facts(), "nodes": args.nodes, "edges": args.edges,
           "dim": args.dim, "features": args.features, "memory_cap": cap, "cold": dropped, "input_bytes": in_bytes,
           "output_bytes": made, "read_once_seconds": floor, "import": {k: v for k, v in res.items()
                                                                       if k != "output_tail"},
           "ratio_to_read_once": res["seconds"] / floor if floor else None}  # fmt: skip
    print(f"lightning_ooc: import results -> {write_results(doc, args.out, 'import', hide=[args.workdir])}")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return 0 if res["returncode"] == 0 else 1
