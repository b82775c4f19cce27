"""Epoch time: ours against PyG-style mmap features and all features in RAM.

``lightning-ooc bench epoch ROOT`` trains the same model on the same seed
batches (same sampler, same per-batch sampling seeds) three ways:

* ``ours``: :class:`~lightning_ooc.OutOfCoreNodeData` (direct I/O, tiered
  caches, asynchronous out-of-order pipeline);
* ``mmap``: the synchronous baseline that "PyG with memory-mapped features"
  amounts to: sample, index a NumPy memmap of the feature file, train (the
  kernel's default read-ahead);
* ``mmap-random``: the same with ``madvise(MADV_RANDOM)`` on the mapping (no
  read-ahead), what a user tuning that set-up would pick;
* ``pyg``: PyG's own ``NeighborLoader`` on the same seed batches over the
  memory-mapped features with ``MADV_RANDOM`` (where pyg-lib or torch-sparse
  is installed; :mod:`lightning_ooc.bench.pyg_reference`);
* ``ram``: the same synchronous loop with every feature row in memory (the
  upper bound; skipped when the features do not fit under the memory cap);
* ``device``: ours with every row in the training device's memory instead of
  the hierarchy (the same pipeline, one tier; on a GPU, the "all features in
  GPU memory" reference; host memory is not needed for them).

A roofline closes the report, per setting: the compute-only time (the
``device`` variant: our pipeline with every row in memory), the I/O floor
(ours' SSD reads per batch at the IOPS ``fio`` reaches on the same file,
block size and queue depth, and its bytes at fio's sequential bandwidth),
and ours divided by the larger of the two; the plot draws it over the bars.

Each variant runs in a subprocess, optionally inside a child memory cgroup of
this process's own (``--memory-cap``, root only) and after dropping the page
cache (``--cold``). Three model settings: ``papers`` (GraphSAGE node
classification, 3 layers, hidden 256, fanout 10,10,10, batch 1000), ``light``
(hidden 64, where I/O dominates) and ``link`` (link prediction on the
dataset's link splits: ``LinkPredictor``, hidden 64, fanout 10,10,10, 128
training edges per batch with one binary negative each; ``ours`` is
``OutOfCoreLinkData``, ``mmap``/``mmap-random``/``ram`` the same link batches
read synchronously (``BaselineLinkData``), ``pyg`` PyG's ``LinkNeighborLoader``
on the same edges). Two settings for heterogeneous datasets (``synth --hetero
igbh``): ``rgat`` (R-GAT as MLPerf's GNN benchmark sets it: hidden 512, 4
heads, 3 layers, fanout 15,10,5, 1024 seeds) and ``rgat-light`` (hidden 64,
2 layers, fanout 15,10, 512 seeds: a CPU-sized batch);
``ours`` is ``OutOfCoreHeteroNodeData``, ``mmap``/``mmap-random``/``ram``
``BaselineHeteroNodeData``, ``pyg`` PyG's ``NeighborLoader`` on a
``HeteroData`` of memory-mapped features, ``device``
``DeviceTableHeteroNodeData``. By default every setting the dataset can run:
the node settings when it has labels, ``link`` when it has link splits
(``lightning-ooc prepare --dataset DIR --out DIR2 --split-edges
0.98,0.01,0.01`` adds them), the heterogeneous ones on a heterogeneous dataset.
Prints a table of ratios, writes JSON and a PNG plot.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_ooc.bench.pyg_reference import available as pyg_available
from lightning_ooc.bench.system import MemoryCap, drop_caches, machine_facts, write_results
from lightning_ooc.data.format import human_bytes, parse_bytes
from lightning_ooc.store.memory import memory_limit
from lightning_ooc.bench import pyg_reference
from lightning_ooc.bench.io import run_fio
from lightning_ooc.data.dataset import open_dataset
import torch

SETTINGS = {
    "papers": dict(hidden_channels=256, num_layers=3, num_neighbors=[10, 10, 10], batch_size=1000),
    "light": dict(hidden_channels=64, num_layers=3, num_neighbors=[10, 10, 10], batch_size=1000),
    # link prediction: 128 training edges per batch with one uniform binary negative each (PyG's
    # LinkNeighborLoader shape), about 500 seed nodes: the endpoints of edges are high-degree nodes, so
    # its subgraphs are about as large as those of the node settings' 1,000 seeds; LinkPredictor
    "link": dict(hidden_channels=64, num_layers=3, num_neighbors=[10, 10, 10], batch_size=128, neg_sampling="binary"),
    # heterogeneous node classification (IGBH-shaped data): R-GAT as MLPerf Training's GNN benchmark sets it
    # (hidden 512, 4 heads, fanout 15,10,5, 1024 seeds: on IGBH's hubs, topics and institutes, a batch reaches
    # about 800k nodes, which needs a GPU-sized machine), and a light one for a CPU where I/O dominates
    # (hidden 64, 2 layers, fanout 15,10, 512 seeds: about 90k nodes a batch)
    "rgat": dict(hidden_channels=512, num_layers=3, heads=4, num_neighbors=[15, 10, 5], batch_size=1024),
    "rgat-light": dict(hidden_channels=64, num_layers=2, heads=4, num_neighbors=[15, 10], batch_size=512),
}
LINK_SETTINGS = ("link",)
HETERO_SETTINGS = ("rgat", "rgat-light")
VARIANTS = ("ours", "mmap", "mmap-random", "pyg", "ram", "device")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", type=Path, help="dataset directory")
    p.add_argument("--settings", default="auto",
                   help="comma-separated: papers, light (node classification), link (link prediction), rgat, "
                        "rgat-light (heterogeneous); default: every one the dataset can run")  # fmt: skip
    p.add_argument("--variants", default="ours,mmap,mmap-random,pyg,ram,device",
                   help="comma-separated: ours, mmap, mmap-random (MADV_RANDOM), pyg (PyG's NeighborLoader over the "
                        "MADV_RANDOM mapping; needs pyg-lib or torch-sparse), ram, device (all rows in the "
                        "accelerator's memory, our pipeline)")  # fmt: skip
    p.add_argument("--max-batches", type=int, default=20, help="training batches per measured epoch (0: all)")
    p.add_argument("--mmap-max-batches", type=int,
                   help="batches for the mmap variant, the one with the kernel's read-ahead (default: "
                        "--max-batches); under a memory cap it can take minutes per batch")  # fmt: skip
    p.add_argument("--memory-cap", help="run each variant in a memory cgroup of this size, e.g. 1.5GiB (root)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each variant (root)")
    p.add_argument("--gpu-cache", default="256MiB", help="feature buffer budget for ours")
    p.add_argument("--host-cache", default="256MiB", help="host cache budget for ours")
    p.add_argument("--staging", default="64MiB", help="staging budget for ours")
    p.add_argument("--order", default="out_of_order", choices=["out_of_order", "in_order"])
    p.add_argument("--samplers", type=int, default=4, help="sampler threads for ours")
    p.add_argument("--extractors", type=int, default=4, help="extractor threads for ours")
    p.add_argument("--train-queue", type=int, default=4, help="train queue bound for ours")
    p.add_argument("--extract-queue", type=int, default=6, help="extract queue bound (sampled batches waiting) for ours")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fio", action="store_true", help="leave out the I/O floor of the roofline (no fio run)")
    p.add_argument("--fio-seconds", type=float, default=3.0,
                   help="runtime of each fio job of the roofline (whole seconds, at least 1)")
    p.add_argument("--fio-queue-depth", type=int, default=128, help="queue depth of the random-read fio job")
    p.add_argument("--out", type=Path, default=Path("bench-results/epoch"), help="prefix of the .json and .png")
    p.add_argument("--profile", type=Path,
                   help="directory for the per-stage timelines (Chrome traces) of ours and device, one "
                        "subdirectory per setting and variant")  # fmt: skip
    p.add_argument("--worker", help=argparse.SUPPRESS)


# -- one variant, in its own process ---------------------------------------------------------------
def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    import lightning as L  # lazy: Lightning takes seconds to import

    from lightning_ooc.models import RGAT, GraphSAGE, LinkPredictor  # lazy: it imports Lightning and PyG

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    setting = SETTINGS[spec["setting"]]
    common = dict(batch_size=setting["batch_size"], num_neighbors=setting["num_neighbors"], seed=spec["seed"],
                  progress=False)  # fmt: skip
    profile = spec.get("profile") and str(Path(spec["profile"]) / f"{spec['setting']}-{spec['variant']}")
    link = spec["setting"] in LINK_SETTINGS
    hetero = spec["setting"] in HETERO_SETTINGS
    if link:
        common["neg_sampling"] = setting["neg_sampling"]
    dm = _datamodule(spec, common, profile, "link" if link else "hetero" if hetero else "node")
    times: dict[str, Any] = {"batches": 0, "ends": [], "data_wait": 0.0, "nodes": 0}

    class Clock(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            times["start"] = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # between steps the trainer waits for the loader (all of it for a synchronous one)
            times["data_wait"] += time.perf_counter() - (times["ends"][-1] if times["ends"] else times["start"])
            times["nodes"] += int(batch.num_nodes)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if torch.cuda.is_available() and spec["accelerator"] in ("gpu", "cuda"):
                torch.cuda.synchronize()  # the step's GPU work is done: host time stamps then mean the same for all
            times["batches"] += 1
            times["ends"].append(time.perf_counter())

        def on_train_epoch_end(self, trainer, pl_module):
            times["end"] = time.perf_counter()

    trainer = L.Trainer(
        accelerator=spec["accelerator"], devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        limit_train_batches=spec["max_batches"] or 1.0, callbacks=[Clock()],
    )  # fmt: skip
    dm.trainer = trainer  # set up for the Trainer's device (the feature buffer, the device variant's rows)
    t_setup = time.perf_counter()
    dm.setup("fit")
    setup_s = time.perf_counter() - t_setup
    ds = dm.dataset
    L.seed_everything(spec["seed"], workers=False)
    if link:
        model = LinkPredictor(ds.num_features, hidden_channels=setting["hidden_channels"],
                              num_layers=setting["num_layers"])  # fmt: skip
    elif hetero:
        t = ds.target
        model = RGAT(ds.metadata(), {n: ds.node(n).num_features for n in ds.node_types}, ds.node(t).num_classes,
                     target=t, hidden_channels=setting["hidden_channels"], num_layers=setting["num_layers"],
                     heads=setting["heads"])  # fmt: skip
    else:
        model = GraphSAGE(ds.num_features, max(ds.num_classes, 1), hidden_channels=setting["hidden_channels"],
                          num_layers=setting["num_layers"])  # fmt: skip
    trainer.fit(model, datamodule=dm)
    stats = dm._passes["train"].run.stats if hasattr(dm, "_passes") else None
    out = {
        "setting": spec["setting"], "variant": spec["variant"], "batches": int(times["batches"]),
        "epoch_seconds": times["end"] - times["start"], "setup_seconds": setup_s,
        # steady state: from the end of the first step to the end of the last, per step (leaves out
        # filling the pipeline and Lightning's prefetch of a second batch before the first step)
        "first_batch_seconds": times["ends"][0] - times["start"] if times["ends"] else None,
        "steady_seconds_per_batch": ((times["ends"][-1] - times["ends"][0]) / (len(times["ends"]) - 1)
                                     if len(times["ends"]) > 1 else None),
        "data_wait_seconds": stats.wait_seconds if stats else times["data_wait"],
        "nodes_per_batch": stats.nodes / max(stats.batches, 1) if stats else times["nodes"] / max(times["batches"], 1),
        "threads": torch.get_num_threads(),
    }  # fmt: skip
    if spec["variant"] == "ours":
        out.update({k: v for k, v in stats.as_metrics(getattr(ds, "row_bytes", 0)).items()
                    if k in ("host_cache_hit_rate", "buffer_hit_rate", "ssd_row_rate", "read_amplification")})  # fmt: skip
        # what the roofline's I/O floor charges: this epoch's reads from SSD, per batch
        out["ios_per_batch"] = stats.io.ios / max(stats.batches, 1)
        out["bytes_read_per_batch"] = stats.io.bytes_read / max(stats.batches, 1)
        out["plan"] = dm.plan.format()
    if hasattr(dm, "teardown"):
        dm.teardown("fit")
    return out


def _datamodule(spec: dict[str, Any], common: dict[str, Any], profile: str | None, kind: str) -> Any:
    """The datamodule of one variant: node classification's (``kind="node"``), link prediction's
    (``"link"``) or heterogeneous node classification's (``"hetero"``)."""
    from lightning_ooc import datamodule as dms  # lazy: it imports Lightning and PyG and Triton

    ours_cls, device_cls, base_cls = (dms.DATAMODULES[kind, b] for b in ("tiered", "device_table", "sync"))
    pipeline = dict(order=spec["order"], num_samplers=spec["samplers"], num_extractors=spec["extractors"],
                    train_queue_size=spec["train_queue"], extract_queue_size=spec.get("extract_queue", 6),
                    profile=profile)  # fmt: skip
    v = spec["variant"]
    if v == "ours":
        return ours_cls(spec["root"], gpu_cache=spec["gpu_cache"], host_cache=spec["host_cache"],
                        staging=spec["staging"], **pipeline, **common)  # fmt: skip
    if v == "device":
        return device_cls(spec["root"], **pipeline, **common)
    if v == "pyg":
        if kind == "link":  # PyG is given the edges this epoch trains on: the whole split would only cost it memory
            return pyg_reference.pyg_link_datamodule(spec["root"], max_batches=spec["max_batches"], **common)
        if kind == "hetero":
            return pyg_reference.pyg_hetero_datamodule(spec["root"], **common)
        return pyg_reference.pyg_datamodule(spec["root"], **common)
    if v == "mmap-random":
        return base_cls(spec["root"], features="mmap", madvise_random=True, **common)
    return base_cls(spec["root"], features=v, **common)


def _run_variant(spec: dict[str, Any], cap: MemoryCap | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "lightning_ooc.bench.epoch", str(spec["root"]), "--worker", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        if cap is not None:
            cap.add(proc.pid)
        stdout, stderr = proc.communicate()
    except BaseException:  # interrupted: take the worker down with us, so its cgroup can go too
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-8:])
        killed = " (killed: out of memory under the cap?)" if proc.returncode in (-9, 137) else ""
        return {**spec, "error": f"exit {proc.returncode}{killed}: {tail}"}
    last = [ln for ln in stdout.splitlines() if ln.startswith("{")][-1]
    res = json.loads(last)
    if cap is not None:
        res["cgroup_peak_bytes"] = cap.peak_bytes()
    return res


def _per_batch(r: dict[str, Any]) -> float:
    steady = r.get("steady_seconds_per_batch")
    return steady if steady is not None else r["epoch_seconds"] / max(r["batches"], 1)


def format_table(results: list[dict[str, Any]]) -> str:
    head = (f"{'setting':<10} {'variant':<11} {'batches':>7} {'epoch s':>9} {'1st s':>7} {'s/batch':>8} {'data wait':>9} "
            f"{'vs ours':>9}  notes")
    lines = [head, "-" * len(head)]
    ours = {r["setting"]: r for r in results if r.get("variant") == "ours" and "error" not in r}
    for r in results:
        if "error" in r:
            lines.append(f"{r['setting']:<10} {r['variant']:<11} {'':>7} {'':>9} {'':>7} {'':>8} {'':>9} {'':>9}  "
                         f"{r['error'][:120]}")
            continue
        spb = _per_batch(r)
        o = ours.get(r["setting"])
        ratio = ""
        if o is not None and r is not o:
            ratio = f"{spb / _per_batch(o):.2f}x"
        notes = ""
        if r["variant"] == "ours":
            notes = (f"host {r['host_cache_hit_rate']:.0%}, buffer {r['buffer_hit_rate']:.0%}, "
                     f"SSD {r['ssd_row_rate']:.0%} of rows; read amp {r['read_amplification']:.2f}")  # fmt: skip
        first = r.get("first_batch_seconds") or 0.0
        lines.append(
            f"{r['setting']:<10} {r['variant']:<11} {r['batches']:>7} {r['epoch_seconds']:>9.2f} {first:>7.2f} {spb:>8.3f} "
            f"{r['data_wait_seconds'] / max(r['epoch_seconds'], 1e-9):>8.0%} {ratio:>9}  {notes}"
        )
    lines.append("'1st s': epoch start to the end of the first step; 's/batch': steady state, end of the first step "
                 "to the end of the last, per step; 'vs ours': s/batch of the variant / ours (above 1: ours is "
                 "faster); 'data wait': share of the epoch the trainer waited for its batch")  # fmt: skip
    return "\n".join(lines)


def roofline(results: list[dict[str, Any]], fio_random: dict[str, Any] | None,
             fio_seq: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per setting: the compute-only time (the ``device`` variant: our pipeline, every row in memory),
    the I/O floor (ours' SSD reads per batch at fio's random IOPS, and its bytes at fio's sequential
    bandwidth, on the same file), the larger of the two, and ours divided by it."""
    ok = {(r["setting"], r["variant"]): r for r in results if "error" not in r}
    out: dict[str, dict[str, Any]] = {}
    for s in SETTINGS:
        ours, dev = ok.get((s, "ours")), ok.get((s, "device"))
        if ours is None:
            continue
        line: dict[str, Any] = {"ours": _per_batch(ours), "compute": _per_batch(dev) if dev else None}
        iops = (fio_random or {}).get("iops")
        seq = (fio_seq or {}).get("bw_bytes")
        if iops and seq and "ios_per_batch" in ours:
            line["io_floor"] = max(ours["ios_per_batch"] / iops, ours["bytes_read_per_batch"] / seq)
            line["io_detail"] = (f"{ours['ios_per_batch']:,.0f} reads/batch at fio's {iops:,.0f} IOPS, "
                                 f"{ours['bytes_read_per_batch'] / 2**20:,.1f} MiB/batch at fio's "
                                 f"{seq / 2**20:,.0f} MiB/s sequential")  # fmt: skip
        else:
            line["io_floor"] = None
        parts = [v for v in (line["compute"], line["io_floor"]) if v]
        line["roofline"] = max(parts) if parts else None
        line["ratio"] = line["ours"] / line["roofline"] if line["roofline"] else None
        out[s] = line
    return out


def format_roofline(lines: dict[str, dict[str, Any]], why_no_fio: str | None = None) -> str:
    rows = []
    for s, ln in lines.items():
        compute = f"{ln['compute']:.3f}" if ln["compute"] else "- (run the device variant)"
        io = (f"{ln['io_floor']:.3f} ({ln['io_detail']})" if ln["io_floor"] is not None
              else f"- ({why_no_fio or 'no fio figure'})")  # fmt: skip
        verdict = f"ours {ln['ours']:.3f} s/batch = {ln['ratio']:.2f}x the roofline" if ln["ratio"] else "no roofline"
        rows.append(f"roofline [{s}]: compute-only {compute} s/batch, I/O floor {io} s/batch -> {verdict}")
    return "\n".join(rows)


def _plot(results: list[dict[str, Any]], path: Path, lines: dict[str, dict[str, Any]] | None = None) -> str:
    try:
        import matplotlib  # lazy: matplotlib only for the plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    ok = [r for r in results if "error" not in r]
    settings = sorted({r["setting"] for r in ok}, key=list(SETTINGS).index)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    present = [v for v in VARIANTS if any(r["variant"] == v for r in ok)]
    width = 0.8 / max(len(present), 1)
    for j, v in enumerate(present):
        ys = [next((_per_batch(r) for r in ok if r["setting"] == s and r["variant"] == v), float("nan"))
              for s in settings]  # fmt: skip
        ax.bar([i + j * width for i in range(len(settings))], ys, width, label=v)
    for i, s in enumerate(settings):  # the roofline of each setting across its group of bars
        top = (lines or {}).get(s, {}).get("roofline")
        if top:
            ax.hlines(top, i - width / 2, i + width * (len(present) - 0.5), colors="black", linestyles="dashed",
                      label="roofline" if i == 0 else None)  # fmt: skip
    ax.set_xticks([i + width * (len(present) - 1) / 2 for i in range(len(settings))], settings)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per training batch\n(steady state, log scale)")
    ax.set_title("lightning-ooc bench epoch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}"


def choose_settings(ds: Any, asked: str) -> list[str]:
    """The settings to run: those asked for (comma-separated), checked against the dataset, or with
    ``"auto"`` every one it can run (the node settings with labels, ``link`` with link splits)."""
    hetero = getattr(ds, "is_hetero", False)
    if asked == "auto":
        if hetero:
            return list(HETERO_SETTINGS)
        settings = ([s for s in SETTINGS if s not in LINK_SETTINGS + HETERO_SETTINGS] if ds.num_classes > 1
                    else []) + (list(LINK_SETTINGS) if ds.has_link_splits else [])  # fmt: skip
        if not settings:
            raise SystemExit(f"{ds.root}: no setting can run: the dataset has neither node labels nor link splits")
        return settings
    settings = [s.strip() for s in asked.split(",") if s.strip()]
    for s in settings:
        if s not in SETTINGS:
            raise SystemExit(f"unknown setting {s!r}; use {', '.join(SETTINGS)}")
        if (s in HETERO_SETTINGS) != hetero:
            raise SystemExit(f"{ds.root}: the {s} setting needs a {'heterogeneous' if s in HETERO_SETTINGS else 'homogeneous'} "
                             f"dataset; this one is {'heterogeneous' if hetero else 'homogeneous'} (settings for it: "
                             f"{', '.join(HETERO_SETTINGS) if hetero else 'papers, light, link'})")  # fmt: skip
        if hetero:
            continue
        if s in LINK_SETTINGS and not ds.has_link_splits:
            raise SystemExit(f"{ds.root}: the {s} setting trains on link splits and the dataset has none; add them "
                             f"with `lightning-ooc prepare --dataset {ds.root} --out DIR --split-edges "
                             "0.98,0.01,0.01` and bench DIR")  # fmt: skip
        if s not in LINK_SETTINGS and ds.num_classes < 2:
            raise SystemExit(f"{ds.root}: the {s} setting is node classification and the dataset has no node "
                             "labels; use --settings link")  # fmt: skip
    return settings


def run(args: argparse.Namespace) -> int:
    ds = open_dataset(args.root)
    settings = choose_settings(ds, args.settings)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; use {', '.join(VARIANTS)}")
    cap_bytes = parse_bytes(args.memory_cap) if args.memory_cap else None
    feats = ([ds.node(t) for t in ds.node_types if ds.node(t).has_features] if getattr(ds, "is_hetero", False)
             else [ds])  # fmt: skip
    feat_bytes = sum(f.num_nodes * f.row_bytes for f in feats)
    largest = max(feats, key=lambda f: f.num_nodes * f.row_bytes)  # fio reads the largest feature file
    print(f"dataset {args.root}: {ds.num_nodes:,} nodes, {ds.num_edges:,} edges, features {human_bytes(feat_bytes)}"
          + (f"; memory cap {human_bytes(cap_bytes)} ({feat_bytes / cap_bytes:.1f}x smaller than the features)"
             if cap_bytes else "; no memory cap"))  # fmt: skip
    fio_random = fio_seq = None
    why_no_fio = "--no-fio" if args.no_fio else None
    if not args.no_fio:  # the machine's limit for the roofline, on the same file, before the variants

        bs = max(512, -(-largest.row_bytes // 512) * 512)
        fio_random = run_fio(largest.features_path, bs, args.fio_queue_depth, args.fio_seconds, cold=args.cold)
        seq_bs = max(4096, min(1 << 20, largest.num_nodes * largest.row_bytes // 4096 * 4096))
        fio_seq = run_fio(largest.features_path, seq_bs, 32, args.fio_seconds, cold=args.cold, rw="read")
        why_no_fio = fio_random.get("why") or fio_seq.get("why")
        if fio_random.get("iops") and fio_seq.get("bw_bytes"):
            print(f"fio on {largest.features_path.name}: {fio_random['iops']:,.0f} IOPS random {bs} B reads at queue depth "
                  f"{args.fio_queue_depth}; {fio_seq['bw_bytes'] / 2**20:,.0f} MiB/s sequential")  # fmt: skip
    results = []
    for s in settings:
        for v in variants:
            mm = v == "mmap"
            batches = args.mmap_max_batches if mm and args.mmap_max_batches is not None else args.max_batches
            spec = dict(root=str(args.root), setting=s, variant=v, seed=args.seed, max_batches=batches,
                        gpu_cache=args.gpu_cache, host_cache=args.host_cache, staging=args.staging,
                        order=args.order, accelerator=args.accelerator, samplers=args.samplers,
                        extractors=args.extractors, train_queue=args.train_queue, extract_queue=args.extract_queue,
                        profile=str(args.profile) if args.profile else None)  # fmt: skip
            if v == "pyg" and not pyg_available()[0]:
                results.append({**spec, "error": f"skipped: {pyg_available()[1]}"})
                continue
            if v == "device" and args.accelerator == "cpu" and feat_bytes > 0.8 * memory_limit().bytes:
                results.append({**spec, "error": f"skipped: the features ({human_bytes(feat_bytes)}) do not fit in "
                                                 "this machine's available memory"})  # fmt: skip
                continue
            if v == "ram" and cap_bytes is not None and feat_bytes > cap_bytes:
                results.append({**spec, "error": f"skipped: the features ({human_bytes(feat_bytes)}) exceed the cap"})
                continue
            note = drop_caches()[1] if args.cold else "warm cache"
            # the compute-only reference keeps every row in memory: on the CPU that needs more than a cap
            # smaller than the features, so it runs without one (it measures compute, not memory)
            uncapped = v == "device" and args.accelerator == "cpu" and cap_bytes is not None and feat_bytes > cap_bytes
            cap = MemoryCap(cap_bytes) if cap_bytes and not uncapped else None
            if uncapped:
                note += "; no memory cap (compute-only reference)"
            try:
                print(f"  {s}/{v}: running ({note})...", flush=True)
                res = _run_variant(spec, cap)
            finally:
                if cap is not None:
                    cap.close()
            res["cache"] = note
            results.append(res)
    print(format_table(results))
    lines = roofline(results, fio_random, fio_seq)
    if lines:
        print(format_roofline(lines, why_no_fio))
    plans = {r["setting"]: r.get("plan") for r in results if r.get("plan")}
    for s, plan in plans.items():
        print(f"[{s}] {plan}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine_facts(), "dataset": str(args.root), "memory_cap": cap_bytes, "cold": args.cold,
           "results": results, "fio": {"random": fio_random, "sequential": fio_seq}, "roofline": lines}  # fmt: skip
    print(f"json: {write_results(doc, args.out.with_suffix('.json'), 'epoch')}")
    print(_plot(results, args.out.with_suffix(".png"), lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lightning-ooc bench epoch", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))), flush=True)
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
