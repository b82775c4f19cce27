"""Trainable embeddings: partition-buffer training out of core against the whole table in memory.

``lightning-ooc bench embed [TABLE]`` measures three things.

1. **Partition orders** (no I/O): for a range of partition counts ``N`` and
   the buffer capacity ``c`` (``--capacity``, 3 by default), the swaps per
   epoch of Legend's order, Marius's BETA and the greedy prefetch order
   (:mod:`lightning_ooc.embed.order`), the lower bound, the share of the
   ``N x N`` buckets trained while a swap runs, and the swaps that cannot be
   hidden (nothing to train during them). The Legend paper's own counts
   (its Table 6, in buffer states: swaps + 1; its Figure 6 for ``N = 6``:
   8 states, 7 swaps) are printed beside them.
2. **Epoch time**: the same knowledge-graph embedding model
   (:class:`~lightning_ooc.models.kge.KGEModel`, DistMult by default) trained
   by a ``lightning.Trainer`` on the CPU over an embedding table larger than
   the memory cap, two ways:

   * ``ours``: :class:`~lightning_ooc.embed.embedding_data.OutOfCoreEmbeddingData`
     with ``buffer.partitions=c``, once per ``--orders`` entry, each run
     in a child memory cgroup of ``--memory-cap`` (root; the table is about 4x
     the cap by default);
   * ``memory``: the same datamodule with ``buffer.in_memory=True`` (every partition
     resident, the same bucket order as the first of ``--orders``, no swaps),
     without the cap, which it cannot fit under: the reference.

   Each run of a variant trains ``--epochs`` epochs (2 by default) in its own
   process, after dropping the page cache with ``--cold``. Every run is
   charged all it does, like ``ours`` pays its swaps: its epochs (the first
   fill of the buffer, for ``memory`` the load of the whole table, inside
   the first) and its final write-back, the teardown's writing back of what
   was trained after the last epoch (for ``memory`` the whole table, for
   ``ours`` the partitions its buffer still holds), as the buffer timed it.
   Reported per run: seconds per epoch (the epochs and the final write-back
   over the epochs), the load and the final write-back apart, edges/s, swaps,
   the time the swaps took, the time the trainer waited for them, the hidden
   share (``1 - wait / swap time``, from
   :class:`~lightning_ooc.embed.passes.PassStats`), bytes read and written
   (the final write-back's included), and the ratio of seconds per epoch to
   the ``memory`` run of the same repeat.

   The variants run one after another, in an order that rotates: repeat
   ``r`` of ``--repeats`` runs the list (the ``ours`` orders, then
   ``memory``) rotated by ``r`` places, so that no variant always runs first
   or last, on the page cache, the table and the machine another run left;
   with as many repeats as variants each runs once in every place. With more
   than one repeat a line per variant over its runs follows, and Theorem 3
   (below) uses those figures. One repeat (the default) runs the list as it
   is.
3. **Theorem 3 of the Legend paper**, checked with the run's own figures.
   The paper's proof: with its order at least 2 buckets train during each
   exchange, so the I/O is hidden when ``2 t |E| / n^2 >= 2P / w + 2P / r``
   (``t`` the training time per edge, ``w`` / ``r`` the write / read
   bandwidth, ``2P`` the bytes of one partition with its optimiser state).
   Here, per swap ``k``: ``D_k = t x (edges of the buckets trained during
   swap k)`` against ``T_k = S_out / w + S_in / r``, where ``S`` is a
   partition file, ``(|V| / n) x 2 x dim x 4`` bytes (embedding and Adagrad
   state), ``t`` the ``memory`` variant's training seconds per edge and
   ``w``, ``r`` the bandwidth the ``ours`` run's write-backs and reads
   reached (write-backs include their ``fsync`` and the switch of
   ``state.json``). The predicted hidden share is ``sum min(D_k, T_k) /
   sum T_k``, printed next to the measured one, again with ``t`` the ``ours``
   run's own training seconds per edge (its epoch less its waits), and with
   the paper's condition for an average bucket.

Without ``TABLE`` a synthetic table is made in ``--workdir`` (removed after
the run unless ``--keep-table``): ``--nodes`` nodes (default: 4x the memory
cap's worth of ``8 x dim``-byte rows), ``--avg-degree x nodes`` training
edges drawn inside random communities of ``--community`` nodes (not aligned
with the partitions; DistMult can learn them), ``--partitions`` partitions,
embeddings ``N(0, 0.001)``. The variants run one after another on that table
and train it in place: each starts from the embeddings the previous one left
(the speed does not depend on their values). A given ``TABLE`` is trained in
place too.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from lightning_ooc.bench.system import (MemoryCap, bench_workdir, code_version, drop_caches, machine_facts,
                                        parse_choices, save_plot, write_results)  # fmt: skip
from lightning_ooc.data.format import human_bytes, parse_bytes
from lightning_ooc.embed.buckets import EdgeBuckets
from lightning_ooc.embed.order import partition_order, prefetch_stats
from lightning_ooc.embed.table import EmbeddingTable, init_embeddings
import resource
import torch

ORDER_KINDS = ("legend", "beta", "greedy")
VARIANTS = ("ours", "memory")
#: partition counts of the order table (those up to --max-partitions, and --partitions)
ORDER_NS = (4, 6, 8, 10, 12, 14, 16, 24, 32)
#: the Legend paper's Table 6 ("I/O times": buffer states, the initial fill counted as one) per partition
#: count: (BETA, Legend); its Figure 6 walks through the 8 states of N = 6
PAPER_STATES = {6: (8, 8), 8: (15, 16), 10: (24, 24), 12: (34, 36), 14: (48, 50), 16: (63, 66)}
DEFAULT_CAP = "2GiB"
TABLE_TO_CAP = 4.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("table", nargs="?", type=Path,
                   help="an embedding table with train edge buckets (lightning-ooc init-embeddings); it is trained "
                        "in place. Default: a synthetic table made in --workdir")  # fmt: skip
    g = p.add_argument_group("synthetic table (without TABLE)")
    g.add_argument("--nodes", type=int,
                   help=f"nodes (default: {TABLE_TO_CAP:g}x the memory cap's worth of rows, 1,000,000 without a cap)")
    g.add_argument("--avg-degree", type=float, default=1.0,
                   help="training edges per node (1.0: an epoch of each of the 4 default variants takes about 12 "
                        "minutes together on 2 cores)")
    g.add_argument("--community", type=int, default=50, help="nodes per community (edges stay inside one)")
    g.add_argument("--dim", type=int, default=100, help="embedding dimension (rows are embedding | Adagrad state)")
    g.add_argument("--partitions", type=int, default=20,
                   help="node partitions of the table (20: a buffer of 3 is 0.6x the default cap, 2 GiB, with the room "
                        "Python, torch and a batch need)")  # fmt: skip
    g.add_argument("--seed", type=int, default=0, help="seed of the graph, the initial embeddings and the batches")
    g.add_argument("--workdir", type=Path, help="where the table is made (default: beside --out)")
    g.add_argument("--keep-table", action="store_true", help="leave the synthetic table in --workdir")
    p.add_argument("--orders", default="legend,beta,greedy",
                   help="comma-separated partition orders of the ours variant: legend (capacity 3 only), beta, greedy")
    p.add_argument("--capacity", type=int, default=3, help="partitions in the buffer (c)")
    p.add_argument("--max-partitions", type=int, default=32, help="largest N of the order table")
    p.add_argument("--epochs", type=int, default=2,
                   help="epochs per run of a variant (2: the memory variant's load is in the first only, and every "
                        "run pays a final write-back after its last)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every variant; repeat r runs the variants in an order rotated by r places (as many "
                        "repeats as variants: each runs once in every place)")
    p.add_argument("--batch-size", type=int, default=10000, help="edges per batch")
    p.add_argument("--num-negatives", type=int, default=100, help="negatives shared by each chunk")
    p.add_argument("--chunk-size", type=int, default=100, help="edges per chunk of shared negatives")
    p.add_argument("--score", default="distmult", choices=["dot", "distmult", "complex"])
    p.add_argument("--lr", type=float, default=0.1, help="Adagrad learning rate")
    p.add_argument("--memory-cap", default=DEFAULT_CAP,
                   help="run the ours variants in a memory cgroup of this size (root; 'none': no cap); the memory "
                        "variant always runs without it")  # fmt: skip
    p.add_argument("--cold", action="store_true", help="drop the page cache before each variant (root)")
    p.add_argument("--variants", default="ours,memory", help="comma-separated: ours, memory")
    p.add_argument("--out", type=Path, default=Path("bench-results/embed"), help="prefix of the .json and .png")
    p.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    p.add_argument("--worker", help=argparse.SUPPRESS)


# -- 1. orders ---------------------------------------------------------------------------------------
def order_table(capacity: int, max_partitions: int, extra: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """:func:`~lightning_ooc.embed.order.prefetch_stats` of every order kind for each ``N`` (``N > capacity``)."""

    ns = sorted({n for n in ORDER_NS if n <= max_partitions} | {n for n in extra if n})
    rows = []
    for n in ns:
        if n <= capacity:
            continue
        for kind in ORDER_KINDS:
            if kind == "legend" and capacity != 3:
                continue
            st = prefetch_stats(partition_order(n, capacity, kind))
            paper = PAPER_STATES.get(n) if capacity == 3 else None
            if paper is not None and kind in ("beta", "legend"):
                st["paper_states"] = paper[0] if kind == "beta" else paper[1]
                st["paper_swaps"] = st["paper_states"] - 1
            rows.append(st)
    return rows


def format_order_table(rows: list[dict[str, Any]], capacity: int) -> str:
    kinds = [k for k in ORDER_KINDS if any(r["name"] == k for r in rows)]
    by = {(r["num_partitions"], r["name"]): r for r in rows}
    ns = sorted({r["num_partitions"] for r in rows})
    w = 8 * len(kinds)
    head = (f"{'N':>3} | {'swaps per epoch':^{w}} | {'bound':>5} | {'paper swaps':^15} | "
            f"{'buckets during a swap':^{w}} | {'swaps not hideable':^{w}}")  # fmt: skip
    sub = (f"{'':>3} | " + "".join(f"{k:>8}" for k in kinds) + f" | {'':>5} | {'beta':>7}{'legend':>8} | "
           + "".join(f"{k:>8}" for k in kinds) + " | " + "".join(f"{k:>8}" for k in kinds))  # fmt: skip
    lines = [f"partition orders, buffer of {capacity} (swaps exclude the initial fill; no I/O)", head, sub,
             "-" * len(sub)]  # fmt: skip
    for n in ns:
        sw = "".join(f"{by[n, k]['swaps']:>8}" for k in kinds)
        hid = "".join(f"{by[n, k]['hidden_fraction']:>8.0%}" for k in kinds)
        unh = "".join(f"{by[n, k]['unhidden_swaps']:>8}" for k in kinds)
        pb = by.get((n, "beta"), {}).get("paper_swaps")
        pl = by.get((n, "legend"), {}).get("paper_swaps")
        paper = f"{'' if pb is None else pb:>7}{'' if pl is None else pl:>8}"
        bound = by[n, kinds[0]]["lower_bound"]
        lines.append(f"{n:>3} | {sw} | {bound:>5} | {paper} | {hid} | {unh}")
    lines.append("'paper swaps': the Legend paper's Table 6 (its 'I/O times' count buffer states: swaps + 1; "
                 "for N = 6 its Figure 6: 8 states = 7 swaps); 'buckets during a swap': share of the N x N "
                 "buckets trained while a swap runs; 'not hideable': swaps with no bucket to train during them")
    return "\n".join(lines)


# -- the synthetic table --------------------------------------------------------------------------------
def synthetic_edges(nodes: int, num_edges: int, community: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``num_edges`` directed edges inside communities of ``community`` nodes (a random permutation of the
    ids cut into consecutive runs, so communities cut across the ID-range partitions), no self-loops (but in
    a community of one node); deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(nodes)
    src = np.empty(num_edges, np.int64)
    dst = np.empty(num_edges, np.int64)
    step = 1 << 22
    for lo in range(0, num_edges, step):
        hi = min(num_edges, lo + step)
        k = rng.integers(0, nodes, hi - lo)
        base = (k // community) * community
        size = np.minimum(community, nodes - base)
        # another member of k's community: a non-zero shift inside it (a community of one keeps the loop)
        shift = 1 + rng.integers(0, np.maximum(size - 1, 1))
        other = base + (k - base + np.where(size > 1, shift, 0)) % size
        src[lo:hi] = perm[k]
        dst[lo:hi] = perm[other]
    return src, dst


def make_table(args: argparse.Namespace, cap_bytes: int | None) -> tuple[Path, dict[str, Any]]:
    row_bytes = 8 * args.dim
    nodes = args.nodes or (int(TABLE_TO_CAP * cap_bytes // row_bytes) if cap_bytes else 1_000_000)
    edges = int(round(args.avg_degree * nodes))
    workdir = bench_workdir(args.workdir or args.out.parent / "embed-work")
    root = workdir / f"table-n{nodes}-e{edges}-d{args.dim}-p{args.partitions}-s{args.seed}"
    t0 = time.perf_counter()
    src, dst = synthetic_edges(nodes, edges, args.community, args.seed)
    gen_s = time.perf_counter() - t0
    init_embeddings(root, num_nodes=nodes, dim=args.dim, partitions=args.partitions, edges={"train": (src, dst)},
                    init="normal", scale=1e-3, seed=args.seed, overwrite=True, progress=False)  # fmt: skip
    del src, dst
    made = {"nodes": nodes, "edges": edges, "avg_degree": args.avg_degree, "community": args.community,
            "dim": args.dim, "partitions": args.partitions, "seed": args.seed, "edge_seconds": gen_s,
            "seconds": time.perf_counter() - t0}  # fmt: skip
    return root, made


def table_facts(root: Path) -> dict[str, Any]:
    with EmbeddingTable(root, writable=False) as t:
        info = t.meta.get("buckets", {}).get("train")
        if info is None:
            raise SystemExit(f"{root}: the table has no train edge buckets")
        n = t.num_partitions
        b = EdgeBuckets(t.root, "train", info)
        counts = [[b.count(i, j) for j in range(n)] for i in range(n)]
        return {
            "path": str(root), "nodes": t.num_nodes, "dim": t.dim, "partitions": n, "row_bytes": t.row_bytes,
            "partition_bytes": [t.partition_nbytes(p) for p in range(n)],
            "bytes": sum(t.partition_nbytes(p) for p in range(n)), "edges": int(info["edges"]),
            "num_relations": t.num_relations, "bucket_counts": counts,
        }  # fmt: skip


# -- 2. one variant, in its own process -------------------------------------------------------------------
def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    import lightning as L  # lazy: Lightning takes seconds to import

    from lightning_ooc.models.kge import KGEModel  # lazy: it imports Lightning and PyG

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    from lightning_ooc.embed.embedding_data import OutOfCoreEmbeddingData  # lazy: it imports Lightning
    from lightning_ooc.embed.embedding_config import ChunkNegatives, PartitionBuffering  # lazy: beside the datamodule

    buffer = PartitionBuffering(partitions=spec["capacity"], order=spec["order"], in_memory=spec["variant"] == "memory")
    negatives = ChunkNegatives(num=spec["num_negatives"], chunk_size=spec["chunk_size"])
    dm = OutOfCoreEmbeddingData(spec["table"], batch_size=spec["batch_size"], buffer=buffer, negatives=negatives,
                                seed=spec["seed"])  # fmt: skip
    epochs: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}
    last: dict[str, Any] = {}  # the buffer and its counters when the last epoch ended

    class Clock(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            cur.clear()
            cur.update(start=time.perf_counter(), buf0=dm.buffer.stats.copy(), losses=[])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None:
                cur["losses"].append(float(loss))

        def on_train_epoch_end(self, trainer, pl_module):
            end = time.perf_counter()
            st = dm.last_stats["train"]
            moved = dm.buffer.stats.minus(cur["buf0"])
            last.update(buffer=dm.buffer, stats=dm.buffer.stats.copy(), end=end)
            losses = cur["losses"]
            k = max(1, min(10, len(losses) // 10 or 1))
            epochs.append({
                "epoch": trainer.current_epoch, "seconds": end - cur["start"], "batches": st.batches,
                "edges": st.edges, "swaps": st.swaps, "swap_seconds": st.swap_seconds, "wait_seconds": st.wait_seconds,
                "first_load_seconds": st.first_load_seconds, "hidden_fraction": st.hidden_fraction,
                "bytes_read": st.bytes_read, "bytes_written": st.bytes_written,
                "read_seconds": moved.read_seconds, "write_seconds": moved.write_seconds,
                "buffer_bytes_read": moved.bytes_read, "buffer_bytes_written": moved.bytes_written,
                "loads": moved.loads, "writebacks": moved.writebacks,
                "loss_first": float(np.mean(losses[:k])) if losses else None,
                "loss_last": float(np.mean(losses[-k:])) if losses else None,
            })  # fmt: skip

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=spec["epochs"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[Clock()],
    )  # fmt: skip
    L.seed_everything(spec["seed"], workers=False)
    model = KGEModel(num_relations=dm.num_relations, dim=dm.dim, score=spec["score"], lr=spec["lr"])
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    trainer.fit(model, datamodule=dm)  # set-up, the epochs, and the teardown's write-back of what is resident
    done = time.perf_counter()
    fit_s = done - t0
    # the final write-back: what the teardown wrote back after the last epoch (memory: the whole table; ours: the
    # partitions its buffer still held), as the buffer timed it (every write with its fsync)
    final = last["buffer"].stats.minus(last["stats"]) if last else None
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    user_s, sys_s = ru1.ru_utime - ru0.ru_utime, ru1.ru_stime - ru0.ru_stime
    return {
        "variant": spec["variant"], "order": spec["order"], "capacity": spec["capacity"],
        "order_swaps": dm.order.num_swaps, "epochs": epochs, "fit_seconds": fit_s,
        "final_writeback_seconds": final.write_seconds if final else 0.0,
        "final_writeback_bytes": final.bytes_written if final else 0,
        "final_writebacks": final.writebacks if final else 0,
        "after_last_epoch_seconds": done - last["end"] if last else 0.0,
        "cpu_seconds": user_s + sys_s, "user_seconds": user_s, "system_seconds": sys_s,
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": torch.get_num_threads(),
    }  # fmt: skip


def _run_variant(spec: dict[str, Any], cap: MemoryCap | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "lightning_ooc.bench.embed", "--worker", json.dumps(spec)]
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
    peak = cap.peak_bytes() if cap is not None else None
    if proc.returncode != 0:
        # the last lines of the traceback, without Python's caret lines
        tail = "\n".join([ln for ln in stderr.strip().splitlines() if ln.strip(" ^~")][-6:])
        killed = " (killed: out of memory under the cap?)" if proc.returncode in (-9, 137) else ""
        return {**_spec_keys(spec), "error": f"exit {proc.returncode}{killed}: {tail}", "cgroup_peak_bytes": peak}
    last = [ln for ln in stdout.splitlines() if ln.startswith("{")][-1]
    res = json.loads(last)
    res["cgroup_peak_bytes"] = peak
    return res


def _spec_keys(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: spec[k] for k in ("variant", "order", "capacity")}


def summarize(*runs: dict[str, Any]) -> dict[str, Any]:
    """Sums over the epochs of a variant's runs (one per repeat), and per-epoch means. Each run is charged all it
    did: its epochs (the first fills of the buffer, the whole table's load in memory, inside them) and its final
    write-back after the last epoch: ``epoch_seconds`` is their sum over the epochs, ``edges_per_second`` the edges
    over it, ``bytes_written`` includes the final write-back's bytes. ``train_seconds`` leaves the first fills
    and the final write-back out (not a figure to compare variants by)."""
    eps = [e for r in runs for e in r["epochs"]]
    tot = {k: sum(e[k] for e in eps) for k in ("seconds", "edges", "batches", "swaps", "swap_seconds", "wait_seconds",
                                                "first_load_seconds", "bytes_read", "bytes_written", "read_seconds",
                                                "write_seconds", "buffer_bytes_read", "buffer_bytes_written")}  # fmt: skip
    final_s = sum(r.get("final_writeback_seconds", 0.0) for r in runs)
    final_b = sum(r.get("final_writeback_bytes", 0) for r in runs)
    charged = tot["seconds"] + final_s
    n = max(len(eps), 1)
    waited = max(0.0, tot["wait_seconds"] - tot["first_load_seconds"])  # waits for swaps (the first loads apart)
    out = {
        "runs": len(runs), "epochs": len(eps), "run_seconds": charged / max(len(runs), 1),
        "epoch_seconds": charged / n, "load_seconds": tot["first_load_seconds"] / n,
        "final_writeback_seconds": final_s / max(len(runs), 1), "final_writeback_bytes": final_b / max(len(runs), 1),
        "train_seconds": (tot["seconds"] - tot["first_load_seconds"]) / n, "edges": tot["edges"] / n,
        "edges_per_second": tot["edges"] / charged if charged > 0 else 0.0,
        "swaps": tot["swaps"] / n, "swap_seconds": tot["swap_seconds"] / n, "swap_wait_seconds": waited / n,
        "wait_seconds": tot["wait_seconds"] / n,
        "hidden_fraction": (max(0.0, 1.0 - waited / tot["swap_seconds"]) if tot["swap_seconds"] > 0 else None),
        "bytes_read": tot["bytes_read"] / n, "bytes_written": (tot["bytes_written"] + final_b) / n,
        "read_bandwidth": tot["buffer_bytes_read"] / tot["read_seconds"] if tot["read_seconds"] > 0 else None,
        "write_bandwidth": tot["buffer_bytes_written"] / tot["write_seconds"] if tot["write_seconds"] > 0 else None,
        "loss_first": runs[0]["epochs"][0]["loss_first"] if runs and runs[0]["epochs"] else None,
        "loss_last": runs[-1]["epochs"][-1]["loss_last"] if runs and runs[-1]["epochs"] else None,
    }  # fmt: skip
    # seconds per edge of training alone: the epoch less every wait for partitions
    busy = tot["seconds"] - tot["wait_seconds"]
    out["seconds_per_edge"] = busy / tot["edges"] if tot["edges"] else None
    return out


def rotated(plan: list[tuple[str, str]], repeats: int) -> list[tuple[int, int, str, str]]:
    """``(repeat, place, variant, order)`` of every run, in the order they run: repeat ``r`` runs ``plan``
    rotated by ``r`` places, so that no variant always runs first or last (after the same neighbour, on a page
    cache and a table another run left); with as many repeats as variants each runs once in every place.

    >>> [f"{v}/{o}" for _, _, v, o in rotated([("ours", "legend"), ("ours", "beta"), ("memory", "legend")], 2)]
    ['ours/legend', 'ours/beta', 'memory/legend', 'ours/beta', 'memory/legend', 'ours/legend']
    """
    k = len(plan)
    return [(r, i, *plan[(r + i) % k]) for r in range(repeats) for i in range(k)]


def variant_summaries(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant, in the order of the plan: :func:`summarize` over its runs that did not fail (one per repeat),
    the places it ran at, the CPU and fit seconds summed and the largest peak."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        if "error" not in r:
            by.setdefault((r["variant"], r["order"]), []).append(r)
    out = []
    for (v, o), runs in by.items():  # results come in the plan's order in the first repeat
        peaks = [x["cgroup_peak_bytes"] for x in runs if x.get("cgroup_peak_bytes")]
        out.append({"variant": v, "order": o, "capacity": runs[0]["capacity"], "order_swaps": runs[0]["order_swaps"],
                    "places": [x.get("position", 0) + 1 for x in runs], "summary": summarize(*runs),
                    "cpu_seconds": sum(x["cpu_seconds"] for x in runs),
                    "fit_seconds": sum(x["fit_seconds"] for x in runs),
                    "rss_peak_bytes": max(x["rss_peak_bytes"] for x in runs),
                    "cgroup_peak_bytes": max(peaks) if peaks else None})  # fmt: skip
    return out


# -- 3. Theorem 3 -----------------------------------------------------------------------------------------
def theorem3(order: Any, facts: dict[str, Any], t_edge: float, w: float, r: float) -> dict[str, Any]:
    """Per swap of ``order``: training time available during it (``t_edge`` x the edges of its ``during``
    buckets) against the time to write back one partition and read one (at ``w`` and ``r`` bytes/s)."""
    counts = facts["bucket_counts"]
    pbytes = facts["partition_bytes"]
    d, tt = [], []
    for st in order.states[:-1]:
        edges = sum(counts[i][j] for i, j in st.during)
        d.append(t_edge * edges)
        tt.append(pbytes[st.evict] / w + pbytes[st.load] / r)
    hidden = sum(min(a, b) for a, b in zip(d, tt))
    n = facts["partitions"]
    avg_bucket = facts["edges"] / (n * n)
    avg_part = facts["bytes"] / n
    lhs, rhs = 2 * t_edge * avg_bucket, avg_part / w + avg_part / r
    return {
        "order": order.name, "seconds_per_edge": t_edge, "write_bandwidth": w, "read_bandwidth": r,
        "swaps": len(tt), "during_seconds_mean": float(np.mean(d)) if d else 0.0,
        "swap_seconds_mean": float(np.mean(tt)) if tt else 0.0,
        "predicted_hidden_fraction": hidden / sum(tt) if tt else None,
        "swaps_not_covered": sum(1 for a, b in zip(d, tt) if a < b),
        "swaps_with_nothing_during": sum(1 for a in d if a == 0),
        "paper_condition": {"train_2_avg_buckets_seconds": lhs, "exchange_seconds": rhs, "holds": lhs >= rhs},
    }  # fmt: skip


# -- output --------------------------------------------------------------------------------------------
def _gib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def _name(r: dict[str, Any]) -> str:
    return f"{r['variant']}/{r['order']}"


def _where(r: dict[str, Any]) -> str:
    """A run's repeat and its place in it (1-based): ``2.1`` is the first run of the second repeat."""
    return f"{r.get('repeat', 0) + 1}.{r.get('position', 0) + 1}" if "repeat" in r else "all"


def format_results(results: list[dict[str, Any]], variants: list[dict[str, Any]] | None = None) -> str:
    """One line per run (``results``), then, where a variant ran more than once, one per variant over its runs
    (``variants``: :func:`variant_summaries`)."""
    head = (f"{'variant':<14} {'run':>4} {'epoch s':>8} {'load s':>7} {'final wb s':>10} {'w/o load':>8} "
            f"{'edges/s':>9} {'swaps':>6} {'swap s':>7} {'waited s':>8} {'hidden':>7} {'read GiB':>8} {'wrote GiB':>9} "
            f"{'vs memory':>9} {'peak GiB':>8} {'cpu':>5} {'load':>9}")  # fmt: skip
    lines = [head, "-" * len(head)]

    def line(r: dict[str, Any], mem: dict[str, Any] | None) -> str:
        s = r["summary"]
        ratio = ""
        if mem is not None and r is not mem:
            ratio = f"{s['epoch_seconds'] / mem['summary']['epoch_seconds']:.2f}x"
        hid = "-" if s["hidden_fraction"] is None else f"{s['hidden_fraction']:.0%}"
        peak = r.get("cgroup_peak_bytes") or r.get("rss_peak_bytes")
        cpu = f"{r['cpu_seconds'] / r['fit_seconds']:>5.2f}" if "cpu_seconds" in r else f"{'':>5}"
        load = "%.1f-%.1f" % tuple(r["load_average"]) if "load_average" in r else ""
        return (f"{_name(r):<14} {_where(r):>4} {s['epoch_seconds']:>8.1f} {s['load_seconds']:>7.1f} "
                f"{s['final_writeback_seconds']:>10.1f} {s['train_seconds']:>8.1f} {s['edges_per_second']:>9,.0f} "
                f"{s['swaps']:>6.0f} {s['swap_seconds']:>7.1f} {s['swap_wait_seconds']:>8.1f} {hid:>7} "
                f"{_gib(s['bytes_read']):>8} {_gib(s['bytes_written']):>9} {ratio:>9} {_gib(peak):>8} {cpu} "
                f"{load:>9}")  # fmt: skip

    for r in results:
        if "error" in r:
            lines.append(f"{_name(r):<14} {_where(r):>4} {r['error'][:300]}")
            continue
        # against the memory run of the same repeat
        mem = next((m for m in results if m["variant"] == "memory" and "error" not in m
                    and m.get("repeat") == r.get("repeat")), None)  # fmt: skip
        lines.append(line(r, mem))
    several = [v for v in variants or [] if v["summary"]["runs"] > 1]
    if several:
        lines.append("-" * len(head))
        mem = next((v for v in several if v["variant"] == "memory"), None)
        lines += [line(v, mem) for v in several]
    lines.append("per epoch, each run charged all it did: 'epoch s' is its epochs and its final write-back (after "
                 "the last epoch: memory writes the whole table back, ours what its buffer still holds) over the "
                 "epochs, and 'edges/s', 'wrote GiB' and 'vs memory' (the epoch s ratio to the memory run of the "
                 "same repeat; above 1: slower) are of it; 'load s': the buffer's first fill (memory: the whole "
                 "table's load, in its first epoch only), inside the epochs; 'final wb s': the final write-back, once "
                 "per run; 'w/o load': the epochs less the first fills and the final write-back (not a figure to "
                 "compare the variants by); 'swap s': time the swaps took on the swap thread; 'waited s': time the "
                 "trainer waited for swaps; 'hidden': 1 - waited / swap s; 'run': repeat.place (the variants run in "
                 "an order rotated by one place every repeat; 'all': over the variant's repeats); 'peak': the "
                 "cgroup's peak (page cache included) under the cap, else the worker's peak RSS; 'cpu': the worker's "
                 "CPU seconds per second of its fit (2 cores: at most about 2; less when other work took a core); "
                 "'load': the 1-minute load average before and after the run")  # fmt: skip
    return "\n".join(lines)


def format_theorem3(t3: dict[str, Any], measured: float | None) -> str:
    pc = t3["paper_condition"]
    meas = "-" if measured is None else f"{measured:.0%}"
    own = t3.get("predicted_hidden_fraction_own")
    own = (f" ({own:.0%} at this run's own {t3['own_seconds_per_edge'] * 1e6:.1f} us per edge)"
           if own is not None else "")  # fmt: skip
    return (f"Theorem 3 [{t3['order']}]: per swap {t3['during_seconds_mean']:.2f} s of training during it (mean; "
            f"{t3['seconds_per_edge'] * 1e6:.1f} us per edge) against {t3['swap_seconds_mean']:.2f} s to write back "
            f"and read a partition ({t3['write_bandwidth'] / 2**20:,.0f} MiB/s write, {t3['read_bandwidth'] / 2**20:,.0f} "
            f"MiB/s read): predicted hidden {t3['predicted_hidden_fraction']:.0%}{own}, measured {meas}; "
            f"{t3['swaps_not_covered']} of {t3['swaps']} swaps not covered ({t3['swaps_with_nothing_during']} with "
            f"nothing to train during them). The paper's condition (2 average buckets per swap): "
            f"{pc['train_2_avg_buckets_seconds']:.2f} s {'>=' if pc['holds'] else '<'} {pc['exchange_seconds']:.2f} s: "
            f"{'holds' if pc['holds'] else 'does not hold'}")  # fmt: skip


def _plot(results: list[dict[str, Any]], path: Path) -> str:
    try:
        import matplotlib  # lazy: matplotlib only for the plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    ok = [r for r in results if "error" not in r]
    if not ok:
        return "no plot: no variant ran"
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    names = [_name(r) for r in ok]
    load = [r["summary"]["load_seconds"] for r in ok]
    wait = [r["summary"]["swap_wait_seconds"] for r in ok]
    # the final write-back's share of an epoch (it happens once per run, after the last epoch)
    final = [r["summary"]["final_writeback_seconds"] * r["summary"]["runs"] / max(r["summary"]["epochs"], 1)
             for r in ok]  # fmt: skip
    train = [r["summary"]["epoch_seconds"] - a - b - f for r, a, b, f in zip(ok, load, wait, final)]
    ax.bar(names, train, label="training")
    ax.bar(names, wait, bottom=train, label="waiting for swaps")
    ax.bar(names, load, bottom=[a + b for a, b in zip(train, wait)], label="first fill of the buffer")
    ax.bar(names, final, bottom=[a + b + c for a, b, c in zip(train, wait, load)], label="final write-back (share)")
    ax.set_ylabel("seconds per epoch (charged)")
    ax.set_title("lightning-ooc bench embed")
    ax.legend()
    fig.tight_layout()
    save_plot(fig, path)
    return f"plot: {path}"


# -- the run -------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    orders = parse_choices(args.orders, ORDER_KINDS, "order")
    variants = parse_choices(args.variants, VARIANTS, "variant")
    if args.epochs < 1 or args.repeats < 1:
        raise SystemExit(f"--epochs and --repeats take at least 1 (got {args.epochs} and {args.repeats})")
    if args.capacity != 3 and "legend" in orders:
        raise SystemExit(f"the legend order needs --capacity 3 (got {args.capacity}); use --orders beta,greedy")
    cap_bytes = None if str(args.memory_cap).lower() in ("none", "0", "") else parse_bytes(args.memory_cap)
    if cap_bytes is not None and "ours" in variants:
        try:  # fail before making a table when caps cannot be had
            MemoryCap(cap_bytes).close()
        except RuntimeError as e:
            raise SystemExit(f"{e} (or pass --memory-cap none)") from None

    # 1. the order table
    rows = order_table(args.capacity, args.max_partitions, (args.partitions,) if args.table is None else ())
    print(format_order_table(rows, args.capacity), flush=True)

    # 2. the table
    made = None
    if args.table is None:
        print("making the synthetic table...", flush=True)
        root, made = make_table(args, cap_bytes)
    else:
        root = args.table
    facts = table_facts(root)
    if args.table is not None:
        rows += [r for r in order_table(args.capacity, 0, (facts["partitions"],))
                 if (r["num_partitions"], r["name"]) not in {(x["num_partitions"], x["name"]) for x in rows}]  # fmt: skip
    n = facts["partitions"]
    c = min(args.capacity, n)
    part = max(facts["partition_bytes"])
    buffer_bytes = c * part
    print(f"table {root}: {facts['nodes']:,} nodes x dim {facts['dim']} ({human_bytes(facts['bytes'])} with Adagrad "
          f"state, {n} partitions of {human_bytes(part)}), {facts['edges']:,} train edges"
          + (f" (avg degree {made['avg_degree']:g}, communities of {made['community']:,}; made in {made['seconds']:.0f} s)"
             if made else "")
          + (f"; memory cap {human_bytes(cap_bytes)} (table {facts['bytes'] / cap_bytes:.1f}x the cap), buffer of {c} "
             f"partitions {human_bytes(buffer_bytes)}" if cap_bytes else "; no memory cap"), flush=True)  # fmt: skip
    if cap_bytes is not None and buffer_bytes > 0.8 * cap_bytes:
        print(f"warning: the buffer ({human_bytes(buffer_bytes)}) leaves little of the {human_bytes(cap_bytes)} cap "
              "for Python, torch and training; use more --partitions", flush=True)  # fmt: skip
    # the variants, in an order rotated every repeat
    results = []
    plan = [("ours", o) for o in orders if "ours" in variants] + ([("memory", orders[0])] if "memory" in variants else [])
    runs = rotated(plan, args.repeats)
    if args.repeats > 1 and args.repeats < len(plan):
        print(f"note: {args.repeats} repeats of {len(plan)} variants: not every variant runs in every place "
              f"(--repeats {len(plan)} for that)", flush=True)  # fmt: skip
    for rep, place, v, o in runs:
        spec = dict(table=str(root), variant=v, order=o, capacity=c, epochs=args.epochs, batch_size=args.batch_size,
                    num_negatives=args.num_negatives, chunk_size=args.chunk_size, score=args.score, lr=args.lr,
                    seed=args.seed)  # fmt: skip
        how = drop_caches()[1] if args.cold else "warm cache"
        cap = MemoryCap(cap_bytes) if cap_bytes is not None and v == "ours" else None
        how += f"; memory cap {human_bytes(cap_bytes)}" if cap is not None else "; no memory cap"
        print(f"  {v}/{o} (repeat {rep + 1} of {args.repeats}, run {place + 1} of {len(plan)}): running ({how})...",
              flush=True)  # fmt: skip
        load0 = os.getloadavg()[0]
        try:
            res = _run_variant(spec, cap)
        finally:
            if cap is not None:
                cap.close()
        res.update(repeat=rep, position=place, cache=how)
        # other work on the machine shows in the load average (this run's own training counts about 2)
        res["load_average"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        if "error" not in res:
            res["summary"] = summarize(res)
        results.append(res)
    per_variant = variant_summaries(results)
    print(format_results(results, per_variant))
    for r in results:
        if "error" not in r and r["summary"]["loss_first"] is not None:
            s = r["summary"]
            print(f"  {_name(r)} ({_where(r)}): training loss {s['loss_first']:.3f} (first batches) -> "
                  f"{s['loss_last']:.3f} (last batches)")  # fmt: skip

    # 3. Theorem 3, from each variant's figures over its runs
    mem = next((r for r in per_variant if r["variant"] == "memory"), None)
    t3s = []
    for r in per_variant:
        if r["variant"] != "ours":
            continue
        s = r["summary"]
        t_edge = (mem or r)["summary"]["seconds_per_edge"]
        w, rd = s["write_bandwidth"], s["read_bandwidth"]
        order = partition_order(n, c, r["order"])
        if not (t_edge and w and rd and order.num_swaps):
            continue
        t3 = theorem3(order, facts, t_edge, w, rd)
        t3["seconds_per_edge_from"] = "memory" if mem else "ours (no memory variant)"
        # the same model with the seconds per edge this out-of-core run trained at (its epoch less its waits)
        own = theorem3(order, facts, s["seconds_per_edge"], w, rd)
        t3["own_seconds_per_edge"] = s["seconds_per_edge"]
        t3["predicted_hidden_fraction_own"] = own["predicted_hidden_fraction"]
        t3["measured_hidden_fraction"] = s["hidden_fraction"]
        t3["measured_swap_seconds_mean"] = s["swap_seconds"] / s["swaps"] if s["swaps"] else None
        t3s.append(t3)
        print(format_theorem3(t3, s["hidden_fraction"]))
    if t3s and not mem:
        print("(seconds per edge from the ours run itself: run the memory variant for the reference)")

    doc = {"kind": "embed", **code_version(), "machine": machine_facts(), "memory_cap": cap_bytes, "cold": args.cold,
           "capacity": c,
           "settings": {k: getattr(args, k) for k in ("epochs", "repeats", "batch_size", "num_negatives", "chunk_size",
                                                      "score", "lr", "seed", "orders", "variants")},
           "table": {k: v for k, v in facts.items() if k != "bucket_counts"}, "synthetic": made,
           "orders": rows, "results": results, "variants": per_variant, "theorem3": t3s}  # fmt: skip
    print(f"json: {write_results(doc, args.out.with_suffix('.json'), 'embed')}")
    if args.plot:
        print(_plot(per_variant, args.out.with_suffix(".png")))
    if made is not None and not args.keep_table:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if not any("error" in r for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lightning-ooc bench embed", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))), flush=True)
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
