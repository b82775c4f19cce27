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
* ``pyg-ram``: ``pyg`` with the features read into memory first: PyG's ``NeighborLoader`` over an in-memory
  ``Data``, what a user whose graph fits runs (node settings; skipped where the features do not fit the cap);
* ``pyg-store``: PyG's own loaders (``NeighborLoader``, ``LinkNeighborLoader``) over our store pair
  (:func:`lightning_ooc.pyg.open_pyg_stores`: features held in memory where they fit (``--store-in-memory``),
  else read through our tiers, ``--store-host-cache`` of
  the highest in-degree rows in host memory, none by default) with our sampler as ``neighbor_sampler=``,
  once per ``--pyg-workers`` count like ``pyg``; a user who keeps PyG's loaders and swaps the ``Data``
  for our stores;
* ``ram``: the same synchronous loop with every feature row in memory (the
  upper bound; skipped when the features do not fit under the memory cap);
* ``device``: ours with every row in the training device's memory instead of
  the hierarchy (the same pipeline, one tier; on a GPU, the "all features in
  GPU memory" reference; host memory is not needed for them);
* ``defaults``: ``OutOfCoreNodeData(root, batch_size=..., num_neighbors=...)`` as a user first writes it: no
  budget, no pipeline setting (the plan picks them under the memory there is); ``ours`` is the same with the
  budget and pipeline flags of this command;
* ``packed``: ours with packed minibatches (:mod:`lightning_ooc.loader.packed_passes`, DiskGNN): the epoch's
  batches sampled ahead and each batch's cold rows packed for one sequential read, with the same budgets
  and ``--pack-memory`` taken from the memory left to the tiers. Its full epoch includes packing that
  epoch up front (``--first-epoch pack``) or training it on direct reads (``random``); while it trains, the
  next epoch is packed, and the run waits for that to finish after its last step. Reported beside it:
  the packing times, the disk the pack takes (a multiple of the feature files), bytes read per batch and
  read amplification, and the *packed epoch*: an epoch whose pack is ready, with the next one's packing
  included (the training time less the wait for its own pack, plus however long the next pack ran past
  the last step).

What is timed is what a user waits for: a full epoch (``--max-batches 0``, the default), from the moment the
datamodule starts its set-up (opening the dataset, presampling, planning, filling caches; PyG's building its
graph) to the end of the last training step, every batch. A pass starts at the loader's first ``next()``:
Lightning's ``iter()`` probe starts nothing (:class:`~lightning_ooc.loader.dataloader.PassLoader`). Reported
per run: the set-up, the time to the first trained batch, the full epoch, the steady state per batch (end
of the first step to the end of the last), nodes per batch and the bytes the disk read during the run
(the kernel's count for the block device, set-up included), with every batch's end time kept in the JSON,
and the CPU seconds the run's process and its children spent (user + system, every thread, from ``/proc``)
from the clock's start, at the end of the first step and at the end of the last: how many cores feeding
one accelerator takes.
PyG's loaders run with each ``--pyg-workers`` count (``num_workers`` 0, 1 and 2, persistent workers by
default), each reported (``pyg-w1`` ...), the best of them named.

``--repeats N`` runs the whole list N times, interleaved (ours, pyg, ..., ours, pyg, ...); figures are the
median over the repeats with their range. ``fio`` measures the disk before the first run and after each
(random ``--fio-queue-depth`` reads of one row's size by one job per extractor of ours, each with its own
ring, as ours reads; sequential reads once at the start): each run is charged the mean of the figures
around it.

The floor (:mod:`lightning_ooc.bench.floor`) does not depend on our design: the epoch's batches are
replayed offline (same seeds, no feature read), and the fewest reads that serve them, in the order each run
of ours trained them (out of order: as they completed), with the memory its plan gives to feature rows
(host cache plus feature buffer) are computed with Belady's rule, cold, a cache's fill counted. Per setting: the I/O floor (those reads at fio's IOPS), the compute-only time
(the ``device`` variant's epoch without its set-up: every row already in memory), the roofline (the
larger of the two), and ours' full epoch against it, split into *reads over optimal* (our reads, the host
cache's fill included, over the optimal reads: 1 is the best any cache could do) and *engine efficiency*
(our reads at fio's IOPS over our full epoch: 1 is the disk busy at fio's rate from start to end); the
roofline ratio is reads over optimal / engine efficiency when I/O bounds it. ``lightning-ooc bench report``
rebuilds the tables from the JSON.

Each variant runs in a subprocess, optionally inside a child memory cgroup of
this process's own (``--memory-cap``, root only) and after dropping the page
cache (``--cold``). Three model settings: ``papers`` (GraphSAGE node
classification, 3 layers, hidden 256, fanout 10,10,10, batch 1000), ``light``
(hidden 64, where I/O dominates), ``loader`` (the same batches, no model: each step reads every byte of
``x`` and trains nothing, so the epoch is the loader's alone, what a GPU that trains a batch in milliseconds
sees; run only when named) and ``link`` (link prediction on the
dataset's link splits: ``LinkPredictor``, hidden 64, fanout 10,10,10, 128
training edges per batch with one binary negative each; ``ours`` is
``OutOfCoreLinkData``, ``mmap``/``mmap-random``/``ram`` the same link batches
read synchronously (``features=Mapped(...)``), ``pyg`` PyG's ``LinkNeighborLoader``
on the same edges). Two settings for heterogeneous datasets (``synth --hetero
igbh``): ``rgat`` (R-GAT as MLPerf's GNN benchmark sets it: hidden 512, 4
heads, 3 layers, fanout 15,10,5, 1024 seeds) and ``rgat-light`` (hidden 64,
2 layers, fanout 15,10, 512 seeds: a CPU-sized batch);
``ours`` is ``OutOfCoreNodeData``, ``mmap``/``mmap-random``/``ram``
the same with ``features=Mapped(...)``, ``pyg`` PyG's ``NeighborLoader`` on a
``HeteroData`` of memory-mapped features, ``device`` the same with
``features=InMemory()``. By default every setting the dataset can run:
the node settings when it has labels, ``link`` when it has link splits
(``lightning-ooc prepare --dataset DIR --out DIR2 --split-edges
0.98,0.01,0.01`` adds them), the heterogeneous ones on a heterogeneous dataset.
Prints a table of ratios, writes JSON and a PNG plot.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_ooc.bench import pyg_reference
from lightning_ooc.bench.floor import best_static_reads, compulsory_reads, optimal_reads, replay_epoch
from lightning_ooc.bench.io import run_fio
from lightning_ooc.bench.pyg_reference import available as pyg_available
from lightning_ooc.bench.report import LOADER_SETTINGS, epoch_roofline, floor_key, format_epoch, summarize_epoch
from lightning_ooc.bench.system import (MemoryCap, code_version, device_read_bytes, drop_caches, failure_line,
                                        machine_facts, process_cpu_seconds, save_plot, write_results)  # fmt: skip
from lightning_ooc.data.dataset import open_dataset
from lightning_ooc.data.format import human_bytes, parse_bytes
from lightning_ooc.store.limits import memory_limit

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
    # the loader alone: the node settings' batches, and a step that reads every byte of x and trains nothing
    # (on a GPU the light model trains a batch in milliseconds: the epoch is what the loader delivers)
    "loader": dict(num_neighbors=[10, 10, 10], batch_size=1000),
    # time (a dataset with edge times, in-edges in time order: synth --temporal, prepare --from tgb): the light
    # model's node classification and the link setting, each seed's subgraph only what precedes its time
    "temporal": dict(hidden_channels=64, num_layers=3, num_neighbors=[10, 10, 10], batch_size=1000,
                     time_attr="edge_time"),
    "temporal-link": dict(hidden_channels=64, num_layers=3, num_neighbors=[10, 10, 10], batch_size=128,
                          neg_sampling="binary", time_attr="edge_time"),
}
LINK_SETTINGS = ("link", "temporal-link")
#: the settings that sample by time (the dataset needs edge times)
TEMPORAL_SETTINGS = ("temporal", "temporal-link")
HETERO_SETTINGS = ("rgat", "rgat-light")
VARIANTS = ("ours", "defaults", "mmap", "mmap-random", "pyg", "pyg-ram", "pyg-store", "ram", "device", "packed")
#: the variants that run PyG's loaders, once per --pyg-workers count
PYG_LOADERS = ("pyg", "pyg-ram", "pyg-store")
#: the variants that run our tiered store (their hit rates, reads and plans are recorded)
TIERED = ("ours", "defaults", "packed")
#: the variants whose reads are compared with the optimal reads for the memory their plan kept
FLOORED = ("ours", "defaults")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", type=Path, help="dataset directory")
    p.add_argument("--settings", default="auto",
                   help="comma-separated: papers, light (node classification), loader (their batches, no model: "
                        "the loader alone), link (link prediction), rgat, rgat-light (heterogeneous); default: "
                        "every one the dataset can run but loader")  # fmt: skip
    p.add_argument("--variants", default="ours,mmap,mmap-random,pyg,ram,device",
                   help="comma-separated: ours, defaults (ours without budget or pipeline settings: the plan "
                        "picks them), mmap, mmap-random (MADV_RANDOM), pyg (PyG's NeighborLoader over the "
                        "MADV_RANDOM mapping, once per --pyg-workers count; needs pyg-lib or torch-sparse), "
                        "pyg-store (PyG's loaders over our FeatureStore/GraphStore pair, our sampler), ram, "
                        "device (all rows in the accelerator's memory, our pipeline), packed (ours with packed "
                        "minibatches; not run unless named)")  # fmt: skip
    p.add_argument("--max-batches", type=int, default=0, help="training batches per measured epoch (0: all of it)")
    p.add_argument("--mmap-max-batches", type=int,
                   help="batches for the mmap variant, the one with the kernel's read-ahead (default: "
                        "--max-batches); under a memory cap it can take minutes per batch")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every variant, interleaved (ours, pyg, ..., ours, pyg, ...); median and range")
    p.add_argument("--pyg-workers", default="0,1,2",
                   help="comma-separated num_workers of PyG's loaders, each a run of its own (persistent workers)")
    p.add_argument("--memory-cap", help="run each variant in a memory cgroup of this size, e.g. 1.5GiB (root)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each variant (root)")
    p.add_argument("--gpu-cache", default="256MiB", help="feature buffer budget for ours")
    p.add_argument("--host-cache", default="256MiB", help="host cache budget for ours")
    p.add_argument("--staging", default="64MiB", help="staging budget for ours")
    p.add_argument("--store-in-memory", default="auto", choices=["auto", "true", "false"],
                   help="the pyg-store variant's open_pyg_stores(in_memory=): auto (features held in memory where "
                        "they fit half of what the process may use), true, or false (always the tiers)")  # fmt: skip
    p.add_argument("--store-host-cache", default="0",
                   help="host cache of the pyg-store variant (rows of the highest in-degree, filled when the store "
                        "opens); on graphs without hubs it reads more at set-up than it saves")  # fmt: skip
    p.add_argument("--host-cache-fill", default="auto", choices=["auto", "setup", "background"],
                   help="when ours ranks its host cache: before training (and reads it then) or while it runs "
                        "(keeping its rows from the epoch's own reads)")  # fmt: skip
    p.add_argument("--pack-memory", default="256MiB", help="host memory for packing and packed sections (packed)")
    p.add_argument("--pack-space", type=float, default=3.0,
                   help="most disk one epoch's pack may take, a multiple of the feature files (packed)")
    p.add_argument("--pack-dir", type=Path, help="where packs go (packed; default: DATASET.packed beside it)")
    p.add_argument("--first-epoch", default="pack", choices=["pack", "random"],
                   help="packed: the first epoch waits for its pack, or trains on direct reads while packing")
    p.add_argument("--order", default="out_of_order", choices=["out_of_order", "in_order"])
    p.add_argument("--samplers", type=int, default=4, help="sampler threads for ours")
    p.add_argument("--extractors", type=int, default=4, help="extractor threads for ours")
    p.add_argument("--train-queue", type=int, default=4, help="train queue bound for ours")
    p.add_argument("--extract-queue", type=int, default=6, help="extract queue bound (sampled batches waiting) for ours")
    p.add_argument("--mps-split", default="",
                   help="comma-separated percentages of the GPU's SMs for the gather producer (e.g. 10,20,30): ours "
                        "once more per split, under OutOfCoreStrategy(mps_split=...) (ours-mps10 ...), against ours "
                        "without one; each run records whether MPS was active or why not")  # fmt: skip
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fio", action="store_true", help="leave out the I/O floor of the roofline (no fio run)")
    p.add_argument("--no-floor", action="store_true", help="leave out the replay that computes the optimal reads")
    p.add_argument("--fio-seconds", type=float, default=3.0,
                   help="runtime of each fio job of the roofline (whole seconds, at least 1)")
    p.add_argument("--fio-queue-depth", type=int, default=128, help="queue depth of each random-read fio job")
    p.add_argument("--fio-jobs", type=int,
                   help="random-read fio jobs at once (default: --extractors, one ring per extractor as ours reads)")
    p.add_argument("--out", type=Path, default=Path("bench-results/epoch"), help="prefix of the .json and .png")
    p.add_argument("--profile", type=Path,
                   help="directory for the per-stage timelines (Chrome traces) of ours and device, one "
                        "subdirectory per setting and variant")  # fmt: skip
    p.add_argument("--run-timeout", type=float,
                   help="stop a run after this many seconds and record it as longer than that (a lower bound)")
    p.add_argument("--finish", type=Path,
                   help="a result JSON of runs stopped before the end (written after every run): compute its floor "
                        "and tables from the runs it holds, and write the finished result to --out")  # fmt: skip
    p.add_argument("--worker", help=argparse.SUPPRESS)


# -- one variant, in its own process ---------------------------------------------------------------
def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("replay"):
        return _replay(spec)
    import lightning as L  # lazy: Lightning takes seconds to import

    importlib.import_module("lightning_ooc.datamodule")  # before the clock, like the models
    from lightning_ooc.models import RGAT, GraphSAGE, LinkPredictor  # lazy: it imports Lightning and PyG

    # the clock: a user waits from here, the set-up included (imports are not: any script pays them the same)
    t0 = time.perf_counter()
    cpu0 = process_cpu_seconds()
    print(f"clock {time.time()}", flush=True)  # where a run stopped by --run-timeout started its clock

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    setting = SETTINGS[spec["setting"]]
    profile = spec.get("profile") and str(Path(spec["profile"]) / f"{spec['setting']}-{spec['label']}")
    kind = _kind(spec["setting"])
    dm = _datamodule(spec, _common(spec), profile, kind)
    times: dict[str, Any] = {"batches": 0, "ends": [], "data_wait": 0.0, "nodes": 0, "order": [], "cpu": []}
    hosts: list[Any] = []  # ours' host caches (a background one keeps rows during the epoch: counted at its end)
    fills: list[Any] = []  # their background rankings, if any

    class Clock(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            times["start"] = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # between steps the trainer waits for the loader (all of it for a synchronous one)
            times["data_wait"] += time.perf_counter() - (times["ends"][-1] if times["ends"] else times["start"])
            times["nodes"] += int(batch.num_nodes)
            if hasattr(batch, "batch_index"):  # the order batches were trained in (out of order: completion)
                times["order"].append(int(batch.batch_index))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if torch.cuda.is_available() and spec["accelerator"] in ("gpu", "cuda"):
                torch.cuda.synchronize()  # the step's GPU work is done: host time stamps then mean the same for all
            times["batches"] += 1
            times["ends"].append(time.perf_counter())
            if times["batches"] == 1:  # the CPU spent to the first trained batch (set-up included)
                times["cpu"].append(process_cpu_seconds())

        def on_train_epoch_end(self, trainer, pl_module):
            times["end"] = time.perf_counter()
            times["cpu"].append(process_cpu_seconds())
            times["fill"] = (sum(int(h.fill_ios) for h in hosts), sum(int(h.fill_rows) for h in hosts),
                             sum(int(h.admitted_rows) for h in hosts))
            times["ranked"] = [_ranking(f) for f in fills]
            if spec["variant"] == "packed":  # after the clock stopped, before the teardown lets the packs go
                times["packing"] = _packing(dm, times)

    strategy: Any = "auto"
    if spec.get("mps_split"):
        from lightning_ooc.strategy import OutOfCoreStrategy, mps  # lazy: the strategy only for the split runs

        mps.prepare(spec["mps_split"])  # before CUDA starts here: this process becomes a client of the daemon
        strategy = OutOfCoreStrategy(mps_split=spec["mps_split"])
    trainer = L.Trainer(
        accelerator=spec["accelerator"], devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        limit_train_batches=spec["max_batches"] or 1.0, callbacks=[Clock()], strategy=strategy,
    )  # fmt: skip
    dm.trainer = trainer  # set up for the Trainer's device (the feature buffer, the device variant's rows)
    on_gpu = spec["accelerator"] in ("gpu", "cuda") and torch.cuda.is_available()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    t_setup = time.perf_counter()
    dm.setup("fit")
    setup_s = time.perf_counter() - t_setup
    ds = dm.dataset
    # the rows ours' plan keeps in memory; the Trainer's teardown lets go of the store
    capacity = None
    if spec["variant"] in TIERED:
        hosts += _host_caches(dm)
        fills += _fills(dm)
        capacity = _capacity_rows(dm)
    L.seed_everything(spec["seed"], workers=False)
    if kind == "link":
        model = LinkPredictor(ds.num_features, hidden_channels=setting["hidden_channels"],
                              num_layers=setting["num_layers"])  # fmt: skip
    elif kind == "hetero":
        t = ds.target
        model = RGAT(ds.metadata(), {n: ds.node(n).num_features for n in ds.node_types}, ds.node(t).num_classes,
                     target=t, hidden_channels=setting["hidden_channels"], num_layers=setting["num_layers"],
                     heads=setting["heads"])  # fmt: skip
    elif spec["setting"] in LOADER_SETTINGS:
        model = _touch_model()
    else:
        model = GraphSAGE(ds.num_features, max(ds.num_classes, 1), hidden_channels=setting["hidden_channels"],
                          num_layers=setting["num_layers"])  # fmt: skip
    trainer.fit(model, datamodule=dm)
    packing = times.get("packing")
    run = dm.current_pass("train") if hasattr(dm, "current_pass") else None  # none for PyG's loaders
    stats = run.stats if run is not None else None
    ends = times["ends"]
    out = {
        "setting": spec["setting"], "variant": spec["variant"], "label": spec["label"], "repeat": spec["repeat"],
        "batches": int(times["batches"]), "setup_seconds": setup_s,
        # the full epoch: set-up included, to the end of the last step
        "full_seconds": times["end"] - t0,
        # the epoch as the Trainer runs it (from its start, set-up done) and the time to the first trained batch
        "epoch_seconds": times["end"] - times["start"],
        "first_trained_seconds": ends[0] - t0 if ends else None,
        # steady state: from the end of the first step to the end of the last, per step
        "steady_seconds_per_batch": (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else None,
        "data_wait_seconds": stats.wait_seconds if stats else times["data_wait"],
        "nodes_per_batch": stats.nodes / max(stats.batches, 1) if stats else times["nodes"] / max(times["batches"], 1),
        "threads": torch.get_num_threads(),
        # each step's end, seconds from the clock's start
        "batch_ends": [round(e - t0, 4) for e in ends],
        **_cpu(cpu0, times["cpu"], len(ends)),
    }  # fmt: skip
    if packing is not None:
        out["packing"] = packing
    if spec["setting"] in LOADER_SETTINGS:  # the sum of every x the steps read: the same batches, the same sum
        out["touched"] = model.touched
    if on_gpu:  # the GPU memory the run used at its peak, beside what ours' plan put on the device
        out["gpu_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        out["gpu_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        plan = getattr(dm, "plan", None)
        if spec["variant"] in TIERED and hasattr(plan, "buffer_slots"):
            out["plan_gpu_bytes"] = int(plan.buffer_slots) * int(plan.row_bytes)
    if spec.get("mps_split"):  # whether the split was in force, or the run fell back (and so measures no split)
        st = trainer.strategy
        out["mps"] = {"split": spec["mps_split"], "active": bool(st._mps_active),
                      "gather_in_producer": bool(st.gather_in_producer)}  # fmt: skip
    if spec["variant"] in TIERED:
        out.update({k: v for k, v in stats.as_metrics(getattr(ds, "row_bytes", 0)).items()
                    if k in ("host_cache_hit_rate", "buffer_hit_rate", "ssd_row_rate", "read_amplification")})  # fmt: skip
        fill_ios, fill_rows, admitted = times["fill"]
        out["epoch_ios"], out["fill_ios"] = int(stats.io.ios), fill_ios
        out["epoch_rows_read"], out["fill_rows"] = int(stats.io.misses), fill_rows
        out["host_rows_admitted"] = admitted  # kept from the epoch's own reads (no read of their own)
        if times.get("ranked"):  # a host cache ranked in the background: over what, and when in the epoch
            out["host_ranking"] = times["ranked"]
        # what the floor compares: every row read from SSD, the host cache's fill included (a read of
        # adjacent rows at once counts each of them, as the floor does)
        out["ios"] = int(stats.io.misses) + fill_rows
        out["ios_per_batch"] = stats.io.ios / max(stats.batches, 1)
        out["bytes_read_per_batch"] = stats.io.bytes_read / max(stats.batches, 1)
        # the cgroup's directory is this host's, not the plan's: the limit and its use stay
        out["plan"] = re.sub(r"(cgroup v[12]) /\S+:", r"\1:", dm.plan.format())
        out["capacity_rows"] = capacity
        out["trained_order"] = times["order"]
    if hasattr(dm, "teardown"):
        dm.teardown("fit")
    return out


def _touch_model() -> Any:
    """The ``loader`` setting's model: each step reads every byte of the batch's ``x`` (a sum) and trains
    nothing, so the epoch is what the loader delivers."""
    import lightning as L  # lazy: Lightning takes seconds to import

    class TouchBatch(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False  # nothing to optimize
            self.touched = 0.0

        def training_step(self, batch: Any, batch_idx: int) -> None:
            xs = batch.x_dict.values() if hasattr(batch, "x_dict") else [batch.x]
            self.touched += float(sum(x.sum(dtype=torch.float32) for x in xs))  # float(): the read is done
            return None

        def configure_optimizers(self) -> Any:
            return None

    return TouchBatch()


def _cpu(start: float | None, marks: list[float | None], batches: int) -> dict[str, Any]:
    """The CPU seconds of a run (its process and children, every thread) from the clock's start: in all, per
    trained batch, to the first trained batch, and per batch after it (the steady state).

        >>> _cpu(1.0, [3.0, 12.0], 10)
        {'cpu_seconds': 11.0, 'cpu_seconds_per_batch': 1.1, 'cpu_first_seconds': 2.0, 'steady_cpu_seconds_per_batch': 1.0}
        >>> _cpu(None, [], 0)
        {}
    """
    if start is None or not marks or marks[-1] is None or not batches:
        return {}
    first, last = marks[0], marks[-1]
    return {"cpu_seconds": last - start, "cpu_seconds_per_batch": (last - start) / batches,
            "cpu_first_seconds": first - start,
            "steady_cpu_seconds_per_batch": (last - first) / (batches - 1) if batches > 1 else None}  # fmt: skip


def _packing(dm: Any, times: dict[str, Any]) -> dict[str, Any]:
    """What packing cost a ``packed`` run: its first epoch's pack (sampled and packed up front, or none), the
    next epoch's (packed beside training: waited for here, after the last step), the disk a pack takes, and
    the packed epoch (this epoch's training without the wait for its own pack, plus however long the next
    pack ran past the last step)."""
    src = dm.source
    first = dict(src.last_pack)
    nxt = src.finish_packing(first["epoch"] + 1)
    overhang = max(0.0, nxt["finished"] - times["end"]) if nxt.get("finished") else None
    feature_bytes = src.feature_bytes
    return {
        "first": first, "next": {k: v for k, v in nxt.items() if k not in ("started", "finished")},
        "next_overhang_seconds": overhang, "feature_bytes": feature_bytes,
        "space_ratio": (nxt.get("bytes") or first.get("bytes") or 0) / max(feature_bytes, 1),
        # only an epoch that trained on its pack is a packed epoch (first_epoch="random" trains the first on reads)
        "packed_epoch_seconds": (times["end"] - times["start"] - first["waited_seconds"] + overhang
                                 if overhang is not None and first.get("packed") else None),
    }  # fmt: skip


def _in_memory(text: str) -> Any:
    """``--store-in-memory`` as ``open_pyg_stores`` takes it.

        >>> _in_memory("auto"), _in_memory("true"), _in_memory("false")
        ('auto', True, False)
    """
    return {"true": True, "false": False}.get(text, text)


def _kind(setting: str) -> str:
    return "link" if setting in LINK_SETTINGS else "hetero" if setting in HETERO_SETTINGS else "node"


def _common(spec: dict[str, Any]) -> dict[str, Any]:
    setting = SETTINGS[spec["setting"]]
    common = dict(batch_size=setting["batch_size"], num_neighbors=setting["num_neighbors"], seed=spec["seed"],
                  progress=False)  # fmt: skip
    if spec["setting"] in LINK_SETTINGS:
        common["neg_sampling"] = setting["neg_sampling"]
    if "time_attr" in setting:
        common["time"] = {"time_attr": setting["time_attr"]}
    return common


def _host_caches(dm: Any) -> list[Any]:
    """Ours' host caches, of every node type (their ``fill_ios`` and ``fill_rows`` count the reads that filled
    them at set-up; ``admitted_rows`` the rows a cache ranked in the background kept from the epoch's reads)."""
    store = dm.source.own_store()
    hosts = [getattr(store.of(t).tier("host_cache"), "host", None) for t in store.node_types]
    return [h for h in hosts if h is not None]


def _fills(dm: Any) -> list[Any]:
    """Ours' background rankings of host caches (:class:`~lightning_ooc.store.background.BackgroundFill`)."""
    store = dm.source.own_store()
    fills = [getattr(store.of(t).tier("host_cache"), "background", None) for t in store.node_types]
    return [f for f in fills if f is not None]


def _ranking(fill: Any) -> dict[str, Any]:
    """What a background ranking counted and when it ended (``None`` where it had not by the epoch's end)."""
    counter = fill.counter
    return {"batches_observed": counter.observed if counter is not None else None,
            "batches_presampled": counter.presampled if counter is not None else None,
            "after_batches": fill.ranked_after_batches,
            "seconds": None if fill.rank_seconds is None else round(fill.waited + fill.rank_seconds, 3)}  # fmt: skip


def _capacity_rows(dm: Any) -> int | None:
    """The rows ours' plan keeps in memory between batches (host cache plus feature buffer) on a graph of one
    node type; None for several (their rows differ in size: the floor is not computed)."""
    plan = dm.plan
    if not hasattr(plan, "host_rows"):
        return None
    return int(plan.host_rows) + int(plan.buffer_slots)


def _replay(spec: dict[str, Any]) -> dict[str, Any]:
    """The optimal reads of the epoch's batches (no feature read) for each run of ``spec["runs"]``: its
    capacity, in the order it trained the batches (out of order: as they completed), and in index order."""
    from lightning_ooc import datamodule as dms  # lazy: it imports Lightning and PyG and Triton

    kind = _kind(spec["setting"])
    t0 = time.perf_counter()
    nodes = [b if isinstance(b, dict) else np.unique(b.numpy())
             for b in replay_epoch(dms.datamodule_for(kind), spec["root"], spec["max_batches"],
                                   **_common(spec))]  # fmt: skip
    if nodes and isinstance(nodes[0], dict):
        return {"setting": spec["setting"], "batches": len(nodes),
                "why": "several node types of different row sizes: no optimal count"}  # fmt: skip
    out = {"setting": spec["setting"], "batches": len(nodes), "accesses": int(sum(b.size for b in nodes)),
           "compulsory": compulsory_reads(nodes), "optimal": {}, "optimal_index_order": {}, "best_static": {}}
    for run in spec["runs"]:
        trained = [nodes[k] for k in run.get("order") or range(len(nodes))]
        out["optimal"][run["key"]] = optimal_reads(trained, run["capacity"])
        out["best_static"][run["key"]] = best_static_reads(trained, run["capacity"])
    for c in sorted({run["capacity"] for run in spec["runs"]}):
        out["optimal_index_order"][str(c)] = optimal_reads(nodes, c)
    out["seconds"] = time.perf_counter() - t0
    return out


def _datamodule(spec: dict[str, Any], common: dict[str, Any], profile: str | None, kind: str) -> Any:
    """The datamodule of one variant: node classification's (``kind="node"``), link prediction's
    (``"link"``) or heterogeneous node classification's (``"hetero"``)."""
    from lightning_ooc import datamodule as dms  # lazy: it imports Lightning and PyG and Triton

    from lightning_ooc.loader.features import InMemory, Mapped, Packed, Tiered  # lazy: beside the datamodules

    data = dms.datamodule_for(kind)
    pipeline = dict(order=spec["order"], num_samplers=spec["samplers"], num_extractors=spec["extractors"],
                    train_queue_size=spec["train_queue"], extract_queue_size=spec.get("extract_queue", 6),
                    profile=profile)  # fmt: skip
    tiers = dict(gpu_cache=spec["gpu_cache"], host_cache=spec["host_cache"], staging=spec["staging"])
    v = spec["variant"]
    if v == "packed":
        packed = Packed(pack_memory=spec["pack_memory"], pack_space=spec["pack_space"], pack_dir=spec.get("pack_dir"),
                        first_epoch=spec["first_epoch"], **tiers)  # fmt: skip
        return data(spec["root"], features=packed, pipeline=pipeline, **common)
    if v == "ours":
        tiered = Tiered(host_cache_fill=spec.get("host_cache_fill", "auto"), **tiers)
        return data(spec["root"], features=tiered, pipeline=pipeline, **common)
    if v == "device":
        return data(spec["root"], features=InMemory(), pipeline=pipeline, **common)
    if v == "defaults":  # as a user first writes it: the plan picks the budgets and the pipeline
        return data(spec["root"], **common)
    if v in PYG_LOADERS:
        # over the memory map (pyg), or over our store pair with our sampler (pyg-store)
        src = dict(num_workers=int(spec.get("num_workers", 0)),
                   stores={"host_cache": spec.get("store_host_cache", 0),
                           "in_memory": _in_memory(spec.get("store_in_memory", "auto"))}
                   if v == "pyg-store" else None)  # fmt: skip
        if v == "pyg-ram":
            if kind != "node":
                raise SystemExit("the pyg-ram variant is node classification's (PyG's NeighborLoader over a Data "
                                 "held in memory)")  # fmt: skip
            src["in_ram"] = True
        if kind == "link":  # PyG is given the edges this epoch trains on: the whole split would only cost it memory
            return pyg_reference.pyg_link_datamodule(spec["root"], max_batches=spec["max_batches"], **src, **common)
        if kind == "hetero":
            return pyg_reference.pyg_hetero_datamodule(spec["root"], **src, **common)
        return pyg_reference.pyg_datamodule(spec["root"], **src, **common)
    mapped = Mapped(madvise="random" if v == "mmap-random" else "normal", in_ram=v == "ram")
    return data(spec["root"], features=mapped, pipeline={"order": "in_order"}, **common)


def _run_variant(spec: dict[str, Any], cap: MemoryCap | None, timeout: float | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "lightning_ooc.bench.epoch", str(spec["root"]), "--worker", json.dumps(spec)]
    # a session of its own: stopping it stops its children too (PyG's loader workers)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        if cap is not None:
            cap.add(proc.pid)
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stopped = time.time()
        _kill_group(proc)
        stdout, _ = proc.communicate()
        clock = [float(ln.split()[1]) for ln in stdout.splitlines() if ln.startswith("clock ")]
        longer = stopped - clock[0] if clock else 0.0
        return {**spec, "error": f"stopped by --run-timeout after {longer:.0f} s of its epoch", "timed_out": True,
                "lower_bound_seconds": longer}  # fmt: skip
    except BaseException:  # interrupted: take the worker down with us, so its cgroup can go too
        _kill_group(proc)
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-8:])
        # where the code is installed says nothing about the failure: paths from the package and the environment
        for where, name in ((str(Path(__file__).resolve().parents[2]) + os.sep, ""), (sys.prefix, "<env>")):
            tail = tail.replace(where, name)
        # the table's cell gets the error's one line; the traceback's tail stays in the JSON
        return {**spec, "error": failure_line(proc.returncode, tail), "error_tail": tail}
    last = [ln for ln in stdout.splitlines() if ln.startswith("{")][-1]
    res = json.loads(last)
    if cap is not None:
        res["cgroup_peak_bytes"] = cap.peak_bytes()
    return res


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except OSError:  # gone already
        proc.kill()


def choose_settings(ds: Any, asked: str) -> list[str]:
    """The settings to run: those asked for (comma-separated), checked against the dataset, or with
    ``"auto"`` every one it can run (the node settings with labels, ``link`` with link splits)."""
    hetero = getattr(ds, "is_hetero", False)
    if asked == "auto":
        if hetero:
            return list(HETERO_SETTINGS)
        timed = getattr(ds, "edge_time", None) is not None
        node = [s for s in SETTINGS if s not in LINK_SETTINGS + HETERO_SETTINGS + LOADER_SETTINGS
                and (s not in TEMPORAL_SETTINGS or timed)]  # fmt: skip
        link = [s for s in LINK_SETTINGS if s not in TEMPORAL_SETTINGS or timed]
        settings = (node if ds.num_classes > 1 else []) + (link if ds.has_link_splits else [])
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
                             f"{', '.join(HETERO_SETTINGS) if hetero else 'papers, light, loader, link'})")  # fmt: skip
        if hetero:
            continue
        if s in TEMPORAL_SETTINGS and getattr(ds, "edge_time", None) is None:
            raise SystemExit(f"{ds.root}: the {s} setting samples by edge time, and the dataset has no edge times "
                             "(make one with `lightning-ooc synth --temporal` or `prepare --from tgb`)")  # fmt: skip
        if s in LINK_SETTINGS and not ds.has_link_splits:
            raise SystemExit(f"{ds.root}: the {s} setting trains on link splits and the dataset has none; add them "
                             f"with `lightning-ooc prepare --dataset {ds.root} --out DIR --split-edges "
                             "0.98,0.01,0.01` and bench DIR")  # fmt: skip
        if s not in LINK_SETTINGS and ds.num_classes < 2:
            raise SystemExit(f"{ds.root}: the {s} setting is node classification and the dataset has no node "
                             "labels; use --settings link")  # fmt: skip
    return settings


def _runs(variants: list[str], pyg_workers: list[int], mps_splits: list[int] = ()) -> list[tuple[str, str, int, int | None]]:
    """(variant, label, num_workers, mps_split) of each run of a repeat: ``pyg`` and ``pyg-store`` once per worker
    count, ``ours`` once without a split and once per ``mps_splits`` percentage.

        >>> _runs(["ours", "pyg"], [0, 2], [10])
        [('ours', 'ours', 0, None), ('ours', 'ours-mps10', 0, 10), ('pyg', 'pyg-w0', 0, None), ('pyg', 'pyg-w2', 2, None)]
    """
    out = []
    for v in variants:
        if v in PYG_LOADERS:
            out += [(v, f"{v}-w{w}", w, None) for w in pyg_workers]
        else:
            out.append((v, v, 0, None))
            if v == "ours":
                out += [(v, f"ours-mps{m}", 0, m) for m in mps_splits]
    return out


def _mps_splits(text: str) -> list[int]:
    """The percentages of ``--mps-split``; a clear exit for anything else."""
    try:
        splits = [int(m) for m in text.split(",") if m.strip()]
    except ValueError:
        splits = [-1]
    if any(not 0 < m < 100 for m in splits):
        raise SystemExit(f"--mps-split takes comma-separated percentages between 1 and 99, e.g. 10,20,30; got {text!r}")
    return splits


class _Disk:
    """fio on the feature file between runs (random reads at matched concurrency), and the device's read count."""

    def __init__(self, args: argparse.Namespace, largest: Any):
        self.args, self.path = args, largest.features_path
        self.bs = max(512, -(-largest.row_bytes // 512) * 512)
        self.jobs = args.fio_jobs or args.extractors
        self.size = largest.num_nodes * largest.row_bytes
        self.random: list[dict[str, Any]] = []  # every measurement, in order
        self.sequential: dict[str, Any] | None = None
        self.why = "--no-fio" if args.no_fio else None

    def measure(self) -> dict[str, Any] | None:
        if self.args.no_fio:
            return None
        a = self.args
        if self.sequential is None:
            seq_bs = max(4096, min(1 << 20, self.size // 4096 * 4096))
            self.sequential = run_fio(self.path, seq_bs, 32, a.fio_seconds, cold=a.cold, rw="read")
        r = run_fio(self.path, self.bs, a.fio_queue_depth, a.fio_seconds, cold=a.cold, jobs=self.jobs)
        r["at"] = time.time()
        self.random.append(r)
        self.why = self.why or r.get("why") or self.sequential.get("why")
        return r

    def read_bytes(self) -> int | None:
        return device_read_bytes(self.path)


def run(args: argparse.Namespace) -> int:
    ds = open_dataset(args.root)
    if args.finish is not None:  # runs stopped before the end: their floor and tables
        doc = json.loads(Path(args.finish).read_text())
        if doc.get("kind") != "epoch":
            raise SystemExit(f"{args.finish}: not a result of bench epoch")
        settings = list(dict.fromkeys(r["setting"] for r in doc["results"]))
        return _finish(args, doc, settings)
    settings = choose_settings(ds, args.settings)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; use {', '.join(VARIANTS)}")
    try:
        pyg_workers = [int(w) for w in args.pyg_workers.split(",") if w.strip()]
    except ValueError:
        raise SystemExit(f"--pyg-workers takes comma-separated counts, e.g. 0,1,2; got {args.pyg_workers!r}") from None
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    cap_bytes = parse_bytes(args.memory_cap) if args.memory_cap else None
    feats = ([ds.node(t) for t in ds.node_types if ds.node(t).has_features] if getattr(ds, "is_hetero", False)
             else [ds])  # fmt: skip
    feat_bytes = sum(f.num_nodes * f.row_bytes for f in feats)
    largest = max(feats, key=lambda f: f.num_nodes * f.row_bytes)  # fio reads the largest feature file
    print(f"dataset {args.root}: {ds.num_nodes:,} nodes, {ds.num_edges:,} edges, features {human_bytes(feat_bytes)}"
          + (f"; memory cap {human_bytes(cap_bytes)} ({feat_bytes / cap_bytes:.1f}x smaller than the features)"
             if cap_bytes else "; no memory cap"))  # fmt: skip
    disk = _Disk(args, largest)
    results: list[dict[str, Any]] = []

    def document() -> dict[str, Any]:
        return {"kind": "epoch", **code_version(), "machine": machine_facts(), "dataset": str(args.root),
                "dataset_facts": {"nodes": ds.num_nodes, "edges": ds.num_edges, "feature_bytes": feat_bytes,
                                  "seeds": ((getattr(ds, "meta", None) or {}).get("split_sizes") or {}).get("train")},
                "memory_cap": cap_bytes, "cold": args.cold, "repeats": args.repeats, "results": results,
                "fio": {"random": disk.random, "sequential": disk.sequential, "jobs": disk.jobs, "bs": disk.bs,
                        "queue_depth": args.fio_queue_depth, "why": disk.why},
                "partial": True}  # fmt: skip

    first = disk.measure()
    if first and first.get("iops") and disk.sequential and disk.sequential.get("bw_bytes"):
        print(f"fio on {largest.features_path.name}: {first['iops']:,.0f} IOPS random {disk.bs} B reads, {disk.jobs} "
              f"job(s) at queue depth {args.fio_queue_depth}; {disk.sequential['bw_bytes'] / 2**20:,.0f} MiB/s "
              "sequential")  # fmt: skip
    mps_splits = _mps_splits(args.mps_split)
    if mps_splits and "ours" not in variants:
        raise SystemExit("--mps-split runs ours under a split: add ours to --variants")
    plan = [(r, s, v, label, w, m) for r in range(args.repeats) for s in settings
            for v, label, w, m in _runs(variants, pyg_workers, mps_splits)]  # fmt: skip
    for r, s, v, label, w, m in plan:
        mm = v in ("mmap", "mmap-random")
        batches = args.mmap_max_batches if mm and args.mmap_max_batches is not None else args.max_batches
        spec = dict(root=str(args.root), setting=s, variant=v, label=label, num_workers=w, repeat=r, seed=args.seed,
                    max_batches=batches, gpu_cache=args.gpu_cache, host_cache=args.host_cache, staging=args.staging,
                    store_host_cache=args.store_host_cache, store_in_memory=args.store_in_memory,
                    host_cache_fill=args.host_cache_fill, pack_memory=args.pack_memory, pack_space=args.pack_space,
                    pack_dir=str(args.pack_dir) if args.pack_dir else None, first_epoch=args.first_epoch,
                    order=args.order, accelerator=args.accelerator, samplers=args.samplers,
                    extractors=args.extractors, train_queue=args.train_queue, extract_queue=args.extract_queue,
                    profile=str(args.profile) if args.profile and r == 0 else None, mps_split=m)  # fmt: skip
        if v in ("pyg", "pyg-ram") and not pyg_available()[0]:
            results.append({**spec, "error": f"skipped: {pyg_available()[1]}"})
            continue
        if v == "device" and args.accelerator == "cpu" and feat_bytes > 0.8 * memory_limit().bytes:
            results.append({**spec, "error": f"skipped: the features ({human_bytes(feat_bytes)}) do not fit in "
                                             "this machine's available memory"})  # fmt: skip
            continue
        if v in ("ram", "pyg-ram") and cap_bytes is not None and feat_bytes > cap_bytes:
            results.append({**spec, "error": f"skipped: the features ({human_bytes(feat_bytes)}) exceed the cap"})
            continue
        note = drop_caches()[1] if args.cold else "warm cache"
        # the compute-only reference keeps every row in memory: on the CPU that needs more than a cap
        # smaller than the features, so it runs without one (it measures compute, not memory)
        uncapped = v == "device" and args.accelerator == "cpu" and cap_bytes is not None and feat_bytes > cap_bytes
        cap = MemoryCap(cap_bytes) if cap_bytes and not uncapped else None
        if uncapped:
            note += "; no memory cap (compute-only reference)"
        before = disk.read_bytes()
        try:
            print(f"  [{r + 1}/{args.repeats}] {s}/{label}: running ({note})...", flush=True)
            res = _run_variant(spec, cap, args.run_timeout)
        finally:
            if cap is not None:
                cap.close()
        after = disk.read_bytes()
        res.update(label=label, repeat=r, cache=note)
        if before is not None and after is not None:
            res["device_read_bytes"] = after - before
        fio_before = disk.random[-1] if disk.random else None
        fio_after = disk.measure()
        res["fio_iops"] = [f.get("iops") for f in (fio_before, fio_after) if f is not None]
        results.append(res)
        _write(args, document())  # after every run: a run stopped later keeps what was measured (--finish)
    return _finish(args, document(), settings)


def _write(args: argparse.Namespace, doc: dict[str, Any]) -> Path:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # the dataset's directory is named as given, relative to where it lies
    hide = [Path(args.root).resolve().parent]
    # a finished result keeps the date and command of its runs (they come after these in the dict)
    return write_results(doc, args.out.with_suffix(".json"), "epoch", hide=hide,
                         command=getattr(args, "command_line", None))  # fmt: skip


def _finish(args: argparse.Namespace, doc: dict[str, Any], settings: list[str]) -> int:
    """The floor, the tables, the JSON and the plot of a result whose runs are done."""
    results = doc["results"]
    doc["floor"] = {} if args.no_floor else _floors(args, settings, results)
    doc.pop("partial", None)
    doc["summary"] = summarize_epoch(doc)
    doc["roofline"] = epoch_roofline(doc)
    print(format_epoch(doc))
    for s in settings:
        plan_text = next((x.get("plan") for x in results if x["setting"] == s and x.get("plan")), None)
        if plan_text:
            print(f"[{s}] {plan_text}")
    print(f"json: {_write(args, doc)}")
    print(_plot(doc, args.out.with_suffix(".png")))
    return 0


def _floors(args: argparse.Namespace, settings: list[str], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting, the replay's compulsory reads and, for each run of ours, the optimal reads with the
    memory its plan kept, in the order it trained the batches."""
    out = {}
    for s in settings:
        ours = [r for r in results if r["setting"] == s and r.get("label", r.get("variant")) in FLOORED
                and "error" not in r]  # fmt: skip
        runs = [{"key": floor_key(r), "capacity": r["capacity_rows"], "order": r.get("trained_order")}
                for r in ours if r.get("capacity_rows") is not None]  # fmt: skip
        if not runs:
            if ours:
                out[s] = {"setting": s, "why": "several node types of different row sizes: no optimal count"}
            continue
        print(f"  {s}: replaying the epoch's batches for the optimal reads...", flush=True)
        # every batch a run trained (out of order, a run cut short may have trained batches past its count)
        last = max((max(r["order"]) + 1 for r in runs if r["order"]), default=args.max_batches)
        spec = dict(replay=True, root=str(args.root), setting=s, seed=args.seed,
                    max_batches=max(last, args.max_batches) if args.max_batches else 0, runs=runs)  # fmt: skip
        out[s] = _run_variant(spec, None)
    return out


def _plot(doc: dict[str, Any], path: Path) -> str:
    try:
        import matplotlib  # lazy: matplotlib only for the plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    summary, lines = doc["summary"], doc.get("roofline") or {}
    settings = [s for s in SETTINGS if any(x["setting"] == s for x in summary)]
    labels = list(dict.fromkeys(x["label"] for x in summary))
    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    width = 0.8 / max(len(labels), 1)
    for j, label in enumerate(labels):
        rows = [next((x for x in summary if x["setting"] == s and x["label"] == label), None) for s in settings]
        ys = [x["full_seconds"]["median"] if x else float("nan") for x in rows]
        lo = [x["full_seconds"]["median"] - x["full_seconds"]["min"] if x else 0 for x in rows]
        hi = [x["full_seconds"]["max"] - x["full_seconds"]["median"] if x else 0 for x in rows]
        ax.bar([i + j * width for i in range(len(settings))], ys, width, yerr=[lo, hi], label=label, capsize=2)
    for i, s in enumerate(settings):  # the roofline of each setting across its group of bars
        top = (lines.get(s, {}).get("roofline") or {}).get("median")
        if top:
            ax.hlines(top, i - width / 2, i + width * (len(labels) - 0.5), colors="black", linestyles="dashed",
                      label="roofline" if i == 0 else None)  # fmt: skip
    ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(settings))], settings)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per epoch, set-up included\n(median and range, log scale)")
    ax.set_title("lightning-ooc bench epoch")
    if labels:
        ax.legend(fontsize="small")
    fig.tight_layout()
    save_plot(fig, path)
    return f"plot: {path}"


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
