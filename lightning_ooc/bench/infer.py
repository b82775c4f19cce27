"""infer: outputs for every node, layer-wise out of core under a memory cap, against sampled and in-memory inference.

``lightning-ooc bench infer ROOT --memory-cap 2GiB --workdir DIR`` runs one GraphSAGE (the ``light`` model of
``bench epoch``: 3 layers, hidden 64, the dataset's classes out; weights seeded, as inference's cost does not
depend on them) three ways, each in a child process after dropping the page cache:

1. ``layerwise``: :func:`lightning_ooc.infer.layerwise` over all nodes, in a memory cgroup of ``--memory-cap``,
   with ``--memory`` bytes for its partitions (default: the cap less 768 MiB for the interpreter and its
   libraries). Per layer: seconds, the part spent waiting for I/O, bytes moved against the bytes its
   schedule must move, and the goal's bound: the bytes at the disk's sequential rate plus the compute time.
2. ``sampled``: our datamodule's sampled predict (``OutOfCoreNodeData``, fanout ``--fanout``, the budgets of
   ``bench epoch``'s 16M-node run) over the test split's seeds in the same cgroup, extrapolated to every node
   at the same seconds per seed (a pass over every node would take hours; the figure says so).
3. ``pyg``: PyG in memory and uncapped, where it fits: the features read into memory, then each layer of the
   same model over the whole graph at once with a sparse adjacency (``adj_t``, CSR), which is PyG's fastest
   full-neighbourhood inference when everything fits.

Over a heterogeneous dataset the model is the relational one (``--conv sage`` or ``gat``: R-SAGE or R-GAT,
hidden ``--hidden``, ``--layers`` layers, the target type's classes out), sampled predict runs
``OutOfCoreNodeData`` over the target type's test seeds, PyG in memory runs the model's ``HeteroConv``
layers over every relation's edges at once, and "every node" means every node of the target type.

The disk's sequential rate is measured in the same run: ``--seq-gib`` GiB of the (target type's) feature file
read cold with direct I/O in 16 MiB requests. ``lightning-ooc bench report`` renders the results (``kind: infer``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_ooc.bench.report import format_infer
from lightning_ooc.bench.system import (bench_workdir, code_version, drop_caches, failure_line, machine_facts,
                                        run_capped, write_results)  # fmt: skip
from lightning_ooc.data.dataset import open_dataset, read_meta
from lightning_ooc.data.format import human_bytes, parse_bytes
from lightning_ooc.infer.model import basic_gnn_between
from lightning_ooc.infer.run import SCHEDULES

VARIANTS = ("layerwise", "sampled", "pyg")
RESERVE = 768 << 20  # the interpreter, torch and PyG in a child process


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", type=Path, help="a dataset directory (homogeneous or heterogeneous)")
    p.add_argument("--workdir", type=Path, required=True, help="where the outputs go (removed afterwards)")
    p.add_argument("--memory-cap", default="none", help="memory cgroup limit of the capped runs (e.g. 2GiB; none)")
    p.add_argument("--memory", help="bytes for layer-wise inference's partitions (default: the cap less 768MiB, or "
                   "4GiB without a cap)")  # fmt: skip
    p.add_argument("--schedule", default="auto", choices=list(SCHEDULES))
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--conv", default="sage", choices=["sage", "gat"], help="heterogeneous: R-SAGE or R-GAT")
    p.add_argument("--fanout", default="10,10,10", help="sampled inference's fanout (default 10,10,10)")
    p.add_argument("--batch-size", type=int, default=1000, help="sampled inference's seeds per batch (default 1000)")
    p.add_argument("--workers", type=int, default=2, help="sampled inference's samplers and extractors (default 2 each)")
    p.add_argument("--queues", type=int, help="sampled inference's queue depths, train and extract (default 2 and "
                   "the datamodule's)")  # fmt: skip
    p.add_argument("--memory-limit", default="auto", help="sampled inference's memory_limit: the host memory its "
                   "plan fits in (default auto: the cgroup's limit; lower it to leave the plan headroom)")  # fmt: skip
    p.add_argument("--staging", default="32MiB", help="sampled inference's staging buffer (default 32MiB)")
    p.add_argument("--gpu-cache", default="384MiB", help="sampled inference's device-side budget (default 384MiB; "
                   "the batches in flight must fit it)")  # fmt: skip
    p.add_argument("--seq-gib", type=float, default=4.0, help="GiB read to measure the sequential rate")
    p.add_argument("--timeout", type=float, default=7200, help="seconds a variant may run")
    p.add_argument("--out", type=Path, help="results JSON (default bench-results/infer-DATE.json)")


def _model(spec: dict[str, Any], lightning: bool = False) -> Any:
    """The model: our ``GraphSAGE`` LightningModule for the sampled predict, else the PyG ``GraphSAGE`` it wraps
    (the same layers; a child without Lightning starts seconds sooner)."""
    torch.manual_seed(0)
    if spec.get("hetero"):
        from lightning_ooc.models import HeteroNodeClassifier  # lazy: Lightning and PyG

        module = HeteroNodeClassifier(spec["metadata"], spec["in_channels"], spec["num_classes"], spec["target"],
                                      hidden_channels=spec["hidden"], num_layers=spec["layers"], conv=spec["conv"],
                                      heads=4 if spec["hidden"] % 4 == 0 else 1).eval()  # fmt: skip
        return module if lightning else module.gnn
    if lightning:
        from lightning_ooc.models import GraphSAGE  # lazy: Lightning and PyG

        return GraphSAGE(spec["num_features"], spec["num_classes"], hidden_channels=spec["hidden"],
                         num_layers=spec["layers"]).eval()  # fmt: skip
    from torch_geometric.nn.models import GraphSAGE as PyGGraphSAGE  # lazy: PyG

    return PyGGraphSAGE(spec["num_features"], spec["hidden"], num_layers=spec["layers"],
                        out_channels=spec["num_classes"]).eval()  # fmt: skip


def _child_layerwise(spec: dict[str, Any]) -> dict[str, Any]:
    from lightning_ooc.infer import layerwise  # lazy: PyG

    model = _model(spec)
    t0 = time.perf_counter()
    res = layerwise(model, spec["root"], spec["out"], memory=spec["memory"], schedule=spec["schedule"],
                    overwrite=True, progress=False)  # fmt: skip
    total = time.perf_counter() - t0
    plan = res.plan
    return {"seconds": total, "layers": res.layers, "plan": plan.describe(), "schedule": plan.schedule,
            "partitions": plan.num_partitions,
            "groups": [getattr(lp, "groups", None) or getattr(lp, "group", 0) for lp in plan.layers],
            "alternatives": getattr(plan, "alternatives", {})}  # fmt: skip


def _child_sampled(spec: dict[str, Any]) -> dict[str, Any]:
    import lightning as L  # lazy: Lightning

    from lightning_ooc import OutOfCoreNodeData, Tiered  # lazy: Lightning

    model = _model(spec, lightning=True)
    pipeline = dict(num_samplers=spec["workers"], num_extractors=spec["workers"], train_queue_size=spec["queues"] or 2,
                    **({"extract_queue_size": spec["queues"]} if spec["queues"] else {}))  # fmt: skip
    features = Tiered(gpu_cache=spec["gpu_cache"], host_cache="256MiB", staging=spec["staging"])
    dm = OutOfCoreNodeData(spec["root"], batch_size=spec["batch_size"], num_neighbors=spec["fanout"],
                           features=features, pipeline=pipeline, shuffle=False, progress=False,
                           memory_limit=spec["memory_limit"])  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    t0 = time.perf_counter()
    out = trainer.predict(model, datamodule=dm)
    seconds = time.perf_counter() - t0
    seeds = int(sum(int(o.numel()) for o in out))
    return {"seconds": seconds, "seeds": seeds}


def _child_pyg_hetero(spec: dict[str, Any]) -> dict[str, Any]:
    """The relational model in memory: every type's features read in, every relation's edges as one
    ``edge_index``, each ``HeteroConv`` over the whole graph."""
    ds = open_dataset(spec["root"])
    gnn = _model(spec)
    t0 = time.perf_counter()
    x = {t: torch.from_numpy(np.array(ds.node(t).features_memmap())).float() for t in ds.node_types
         if ds.node(t).has_features}  # fmt: skip
    for t, vec in gnn.type_embedding.items():
        x[t] = vec.detach().unsqueeze(0).expand(ds.num_nodes_dict[t], -1)
    edges = {}  # SAGE: each relation as a sparse CSR adjacency (PyG's spmm, no per-edge messages); GAT: edge_index
    for et, c in ds.csc.items():
        indptr = torch.from_numpy(np.asarray(c.indptr, dtype=np.int64))
        col = torch.from_numpy(np.asarray(c.indices, dtype=np.int64))
        if spec["conv"] == "sage":
            edges[et] = torch.sparse_csr_tensor(indptr, col, torch.ones(col.numel()), (c.num_nodes, c.num_src_nodes))
        else:
            edges[et] = torch.stack([col, torch.repeat_interleave(torch.arange(c.num_nodes), indptr.diff())])
    load = time.perf_counter() - t0

    def between(i: int, h: dict) -> dict:
        return {t: gnn.inference_between(i, v, t) for t, v in h.items()}

    x, layers = _timed_layers(gnn.convs, x, edges, between)
    with torch.no_grad():
        gnn.classifier(x[gnn.target])
    return {"seconds": time.perf_counter() - t0, "load_seconds": load, "layer_seconds": layers}


def _timed_layers(convs: Any, x: Any, adj: Any, between: Any) -> tuple[Any, list[float]]:
    """Each layer over the whole graph at once, ``between`` after all but the last; the seconds of each."""
    seconds = []
    with torch.no_grad():
        for i, conv in enumerate(convs):
            t1 = time.perf_counter()
            x = conv(x, adj)
            if i < len(convs) - 1:
                x = between(i, x)
            seconds.append(time.perf_counter() - t1)
    return x, seconds


def _child_pyg(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("hetero"):
        return _child_pyg_hetero(spec)
    ds = open_dataset(spec["root"])
    model = _model(spec)
    t0 = time.perf_counter()
    x = torch.from_numpy(np.fromfile(ds.features_path, dtype=ds.feature_numpy_dtype, offset=ds.features_offset,
                                     count=ds.num_nodes * ds.num_features).reshape(ds.num_nodes, -1)).float()  # fmt: skip
    indptr = torch.from_numpy(np.asarray(ds.indptr, dtype=np.int64))
    col = torch.from_numpy(np.asarray(ds.indices, dtype=np.int64))
    adj_t = torch.sparse_csr_tensor(indptr, col, torch.ones(col.numel()), (ds.num_nodes, ds.num_nodes))
    load = time.perf_counter() - t0
    x, layers = _timed_layers(model.convs, x, adj_t, lambda i, h: basic_gnn_between(model, i, h))
    return {"seconds": time.perf_counter() - t0, "load_seconds": load, "layer_seconds": layers}


CHILDREN = {"layerwise": _child_layerwise, "sampled": _child_sampled, "pyg": _child_pyg}


def _child(path: str) -> None:
    spec = json.loads(Path(path).read_text())
    result = CHILDREN[spec["variant"]](spec)
    Path(spec["result"]).write_text(json.dumps(result))


def sequential_rate(path: Path, nbytes: int) -> tuple[float, str]:
    """Bytes per second reading the start of ``path`` cold with direct I/O in 16 MiB requests."""
    from lightning_ooc.io.bulk import BulkFile, aligned_empty  # lazy: the native module

    dropped, how = drop_caches([path])
    size = min(int(nbytes), os.path.getsize(path)) // 4096 * 4096
    chunk = min(16 << 20, max(4096, size))
    buf = aligned_empty(chunk)
    total = size // chunk * chunk
    with BulkFile(path, "r") as f:
        t0 = time.perf_counter()
        for off in range(0, total, chunk):
            f.read_into(off, buf)
        seconds = time.perf_counter() - t0
    return total / seconds, f"{human_bytes(total)} read with {f.backend} in {seconds:.1f} s ({how})"


def _run_child(spec: dict[str, Any], cap: int | None, workdir: Path, timeout: float) -> dict[str, Any]:
    spec_path = workdir / f"{spec['variant']}.spec.json"
    spec["result"] = str(workdir / f"{spec['variant']}.result.json")
    spec_path.write_text(json.dumps(spec))
    Path(spec["result"]).unlink(missing_ok=True)
    drop_caches([Path(spec["root"])])
    cmd = [sys.executable, "-c", f"from lightning_ooc.bench.infer import _child; _child({str(spec_path)!r})"]
    r = run_capped(cmd, cap, workdir / f"{spec['variant']}.log", timeout)
    code, wall, tail = r["code"], r["seconds"], r["output"][-1500:]
    if r["timed_out"]:
        return {"ok": False, "returncode": code, "error": f"over --timeout ({timeout:.0f} s)", "wall_seconds": wall}
    if code != 0 or not Path(spec["result"]).exists():
        return {"ok": False, "returncode": code, "error": failure_line(code, tail)[:300],
                "wall_seconds": wall}
    out = json.loads(Path(spec["result"]).read_text())
    return {"ok": True, "wall_seconds": wall, "peak_anon_bytes": r["peak_anon_bytes"],
            "cgroup_peak_bytes": r["cgroup_peak_bytes"], **out}


def run(args: argparse.Namespace) -> int:
    meta = read_meta(args.root)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        print(f"bench infer: unknown variant(s) {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
        return 2
    cap = None if str(args.memory_cap).lower() == "none" else parse_bytes(args.memory_cap)
    memory = parse_bytes(args.memory) if args.memory else (max(256 << 20, cap - RESERVE) if cap else 4 << 30)
    args.workdir = bench_workdir(args.workdir)
    root = args.root.resolve()
    hetero = "node_types" in meta
    base = {"root": str(root), "hidden": args.hidden, "layers": args.layers, "hetero": hetero}
    if hetero:
        ds = open_dataset(root)
        if ds.target is None:
            print(f"bench infer: {root} has no single labelled node type to predict")
            return 2
        node = ds.node(ds.target)
        base.update(target=ds.target, metadata=[ds.node_types, [list(et) for et in ds.edge_types]],
                    in_channels={t: ds.node(t).num_features for t in ds.node_types}, conv=args.conv,
                    num_features=node.num_features, num_classes=node.num_classes)  # fmt: skip
        features, num_nodes = node.features_path, node.num_nodes
        feature_bytes = sum(ds.node(t).num_nodes * ds.node(t).row_bytes for t in ds.node_types)
    else:
        base.update(num_features=int(meta["num_features"]), num_classes=int(meta["num_classes"]))
        features = root / meta["files"]["features"]["name"] if "features" in meta.get("files", {}) else None
        num_nodes, feature_bytes = int(meta["num_nodes"]), int(meta["num_nodes"]) * int(meta["row_bytes"])
    rate, how = sequential_rate(features, int(args.seq_gib * 2**30)) if features else (None, "no features file")
    print(f"sequential read: {rate / 1e6:.0f} MB/s ({how})" if rate else f"sequential read: {how}")
    results: dict[str, Any] = {}
    for v in variants:
        spec = {**base, "variant": v}
        if v == "layerwise":
            spec.update(out=str(args.workdir / "layerwise-out"), memory=memory, schedule=args.schedule)
        elif v == "sampled":
            spec.update(fanout=[int(f) for f in args.fanout.split(",")], batch_size=args.batch_size,
                        gpu_cache=args.gpu_cache, workers=args.workers, queues=args.queues,
                        staging=args.staging, memory_limit=args.memory_limit)  # fmt: skip
        print(f"bench infer: {v} ...", flush=True)
        results[v] = _run_child(spec, None if v == "pyg" else cap, args.workdir, args.timeout)
        r = results[v]
        print(f"  {v}: " + (f"{r['seconds']:.1f} s" if r["ok"] else f"failed: {r['error']}"), flush=True)
    doc = {"kind": "infer", **code_version(), "machine": machine_facts(), "dataset": root.name,
           "num_nodes": num_nodes, "num_edges": int(meta["num_edges"]), "num_features": base["num_features"],
           "feature_bytes": feature_bytes,
           "model": (f"R-{args.conv.upper()} on {base['target']!r}" if hetero else "GraphSAGE"),
           "all_nodes": int(meta["num_nodes"]),
           "memory_cap": cap, "memory": memory, "hidden": args.hidden, "layers": args.layers, "fanout": args.fanout,
           "batch_size": args.batch_size, "workers": args.workers, "queues": args.queues,
           "sampled_memory_limit": args.memory_limit,
           "sequential_bytes_per_s": rate, "sequential_how": how, "results": results}  # fmt: skip
    summarize(doc)
    print(format_infer(doc))
    print(f"lightning_ooc: infer results -> {write_results(doc, args.out, 'infer', hide=[args.workdir, args.root.resolve().parent])}")
    for p in args.workdir.glob("*.result.json"):
        p.unlink()
    shutil.rmtree(args.workdir / "layerwise-out", ignore_errors=True)
    return 0 if all(r["ok"] for r in results.values()) else 1


def summarize(doc: dict[str, Any]) -> None:
    """Add the goal's figures: per layer the bound (bytes at the sequential rate plus compute), and the speed-up
    over sampled inference extrapolated to every node."""
    lw = doc["results"].get("layerwise")
    rate = doc.get("sequential_bytes_per_s")
    if lw and lw.get("ok"):
        for layer in lw["layers"]:
            moved = sum(layer["moved"].values())
            compute = layer["seconds"] - layer["io_seconds"]
            layer["compute_seconds"] = compute
            layer["bound_seconds"] = moved / rate + compute if rate else None
            layer["moved_over_expected"] = moved / max(1, sum(layer["expected"].values()))
            if layer.get("input_table_bytes"):  # the goal's bytes: 3x the input table + every edge's message
                edges = doc["num_edges"] * doc["hidden"] * 4 if layer["kind"] != "node-wise" else 0
                layer["goal_bytes"] = 3 * layer["input_table_bytes"] + edges
                layer["moved_over_goal"] = moved / layer["goal_bytes"]
    sm = doc["results"].get("sampled")
    if sm and sm.get("ok") and sm["seeds"]:
        sm["all_nodes_seconds"] = sm["seconds"] / sm["seeds"] * doc["num_nodes"]
        if lw and lw.get("ok"):
            doc["speedup_over_sampled"] = sm["all_nodes_seconds"] / lw["seconds"]
