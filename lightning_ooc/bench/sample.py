"""Neighbour-sampling throughput of the native sampler, against a vectorised torch reference.

``lightning-ooc bench sample ROOT`` samples the same minibatches (uniformly
random seed nodes, ``--batch-size`` each) with the native
:class:`~lightning_ooc.sampling.NeighborSampler` and with
:class:`~lightning_ooc.sampling.TorchNeighborSampler` (the same uniform
sampling written with vectorised torch ops; pyg-lib and torch-sparse have no
wheels for our torch), for every fanout list, thread count and page-cache
state asked for, and reports sampled edges/s and minibatches/s, the ratio
native / reference and each sampler's speed-up over its own single thread.

Threads are Python threads sharing one sampler, each taking the next batch
until all are done; both samplers release the GIL in their heavy parts, and
torch's intra-op parallelism is set to 1 thread so that "2 threads" means
two concurrent minibatches for both.

*warm*: ``indices`` is read once before the run and a warm-up batch is
sampled untimed. *cold*: the page cache is dropped (``sync; echo 3 >
/proc/sys/vm/drop_caches`` as root, else ``posix_fadvise(DONTNEED)`` on the
topology files), the dataset is reopened and timing starts with the first
batch, so the figure includes the page faults that bring ``indices`` back.

Example (about a minute on a 2M-node graph and two cores)::

    lightning-ooc synth --out data/g2m --nodes 2000000 --avg-degree 20 --dim 16 --classes 10 --seed 0
    lightning-ooc bench sample data/g2m --json bench-results/sample.json
"""
from __future__ import annotations

import argparse
import gc
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from lightning_ooc.bench.system import code_version, drop_caches, machine_facts, warm_page_cache, write_results
from lightning_ooc.errors import InputError
from lightning_ooc import open_dataset

REFERENCE_NAME = "TorchNeighborSampler (vectorised torch ops: random-key sort per node, dense relabel table)"


# -- one measurement -------------------------------------------------------------------------------
def make_batches(num_nodes: int, batch_size: int, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` batches of distinct uniformly random seed nodes (distinct across batches while they last)."""
    rng = np.random.default_rng(seed)
    need = batch_size * count
    ids = np.concatenate([rng.permutation(num_nodes) for _ in range(-(-need // num_nodes))])[:need]
    return [torch.from_numpy(ids[i * batch_size : (i + 1) * batch_size].copy()) for i in range(count)]


def timed_run(
    sample: Callable[..., Any], batches: list[torch.Tensor], threads: int, warmup: torch.Tensor | None = None
) -> dict[str, Any]:
    """Sample every batch once with ``threads`` threads; wall time from the first start to the last end.

    With ``warmup``, each thread first samples it untimed (per-thread workspaces, allocator).
    """
    lock = threading.Lock()
    state = {"next": 0, "edges": 0, "nodes": 0, "error": None}
    latency = [0.0] * len(batches)
    barrier = threading.Barrier(threads + 1)

    def worker() -> None:
        try:
            if warmup is not None:
                sample(warmup, seed=-1)
        finally:
            barrier.wait()
        edges = nodes = 0
        try:
            while True:
                with lock:
                    i = state["next"]
                    state["next"] += 1
                if i >= len(batches):
                    break
                t = time.perf_counter()
                out = sample(batches[i], seed=i)
                latency[i] = time.perf_counter() - t
                edges += sum(out.num_sampled_edges)
                nodes += out.n_id.numel()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            state["error"] = e
        with lock:
            state["edges"] += edges
            state["nodes"] += nodes

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - c0
    if state["error"] is not None:
        raise state["error"]
    return {
        "batches": len(batches), "seconds": seconds, "edges": state["edges"], "nodes": state["nodes"],
        "edges_per_s": state["edges"] / seconds, "batches_per_s": len(batches) / seconds,
        "cpu_seconds": cpu,  # of the whole process: cpu / seconds ~ threads when they really ran at once
        "first_batch_ms": 1e3 * latency[0], "median_batch_ms": 1e3 * float(np.median(latency)),
    }  # fmt: skip


def measure(root: Path, impl: str, fanouts: list[int], threads: int, cold: bool, batches: list[torch.Tensor],
            replace: bool) -> dict[str, Any]:  # fmt: skip
    from lightning_ooc.sampling import NeighborSampler, TorchNeighborSampler  # lazy: it imports PyG

    cache = "warm"
    if cold:
        gc.collect()  # our old mappings of indices must be gone for the drop to evict them
        ds = open_dataset(root)
        paths = [ds.root / ds.meta["files"][k]["name"] for k in ("indices", "indptr", "labels")]
        del ds
        gc.collect()
        cache = "cold: " + drop_caches(paths)[1]
    ds = open_dataset(root)
    cls = NeighborSampler if impl == "native" else TorchNeighborSampler
    sampler = cls(ds, fanouts, replace=replace)
    warmup = None
    if not cold:
        warm_page_cache(ds.root / ds.meta["files"]["indices"]["name"])
        warmup = batches[-1]
    r = timed_run(sampler.sample_subgraph, batches, threads, warmup)
    r.update(impl=impl, fanouts=fanouts, threads=threads, cache=cache)
    return r


# -- report ----------------------------------------------------------------------------------------
def _num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def format_table(results: list[dict[str, Any]]) -> str:
    """One line per (fanouts, cache, threads): both samplers, their ratio and each one's thread speed-up."""
    by_key: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in results:
        key = (",".join(map(str, r["fanouts"])), r["cache"].split(":")[0], r["threads"])
        by_key.setdefault(key, {})[r["impl"]] = r
    one = {(k[0], k[1], impl): v[impl]["edges_per_s"] for k, v in by_key.items() if k[2] == 1 for impl in v}
    head = ["fanouts", "cache", "threads", "native edges/s", "native batches/s", "ref edges/s", "ref batches/s",
            "native/ref", "native xT", "ref xT", "1st batch ms"]  # fmt: skip
    lines = []
    for (fan, cache, threads), v in by_key.items():
        nat, ref = v.get("native"), v.get("reference")
        ratio = nat["edges_per_s"] / ref["edges_per_s"] if nat and ref else None
        n1, r1 = one.get((fan, cache, "native")), one.get((fan, cache, "reference"))
        lines.append([
            fan, cache, str(threads),
            _num(nat and nat["edges_per_s"]), _num(nat and nat["batches_per_s"], 2),
            _num(ref and ref["edges_per_s"]), _num(ref and ref["batches_per_s"], 2),
            _num(ratio, 1) + "x" if ratio else "-",
            _num(nat["edges_per_s"] / n1, 2) + "x" if nat and n1 else "-",
            _num(ref["edges_per_s"] / r1, 2) + "x" if ref and r1 else "-",
            " / ".join(_num(x.get("first_batch_ms")) for x in (nat, ref) if x),
        ])  # fmt: skip
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]  # fmt: skip
    for line in lines:
        out.append("| " + " | ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in
                                     enumerate(zip(line, widths))) + " |")  # fmt: skip
    return "\n".join(out)


# -- command line ----------------------------------------------------------------------------------
def _fanouts(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"fanouts must look like 10,10,10, got {s!r}") from None
    if not out or min(out) < -1:
        raise argparse.ArgumentTypeError(f"fanouts must be counts >= 0 or -1, got {s!r}")
    return out


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", type=Path, help="dataset directory")
    parser.add_argument("--fanouts", type=_fanouts, nargs="+", default=[[10, 10, 10], [15, 10, 5]],
                        help="one or more fanout lists (default: 10,10,10 15,10,5)")
    parser.add_argument("--batch-size", type=int, default=1000, help="seed nodes per minibatch (default 1000)")
    parser.add_argument("--threads", type=_ints, default=[1, 2], help="comma-separated thread counts (default 1,2)")
    parser.add_argument("--batches", type=int, default=100, help="minibatches per native measurement (default 100)")
    parser.add_argument("--reference-batches", type=int, default=10,
                        help="minibatches per reference measurement (default 10; it is slower)")
    parser.add_argument("--cache", choices=("warm", "cold", "both"), default="both",
                        help="page-cache state of indices (default both)")
    parser.add_argument("--replace", action="store_true", help="sample with replacement")
    parser.add_argument("--no-reference", action="store_true", help="measure the native sampler only")
    parser.add_argument("--seed", type=int, default=0, help="seed of the seed-node batches")
    parser.add_argument("--json", type=Path, help="where to write the results (default bench-results/sample-TIME.json)")


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.batches < 1 or args.reference_batches < 1:
        raise InputError("--batch-size, --batches and --reference-batches must be >= 1")
    if not args.threads or min(args.threads) < 1:
        raise InputError(f"--threads must be >= 1, got {args.threads}")
    ds = open_dataset(args.root)
    dataset = {
        "root": str(ds.root), "num_nodes": ds.num_nodes, "num_edges": ds.num_edges,
        "index_dtype": str(ds.indices.dtype), "indices_bytes": int(ds.indices.nbytes),
        "mean_in_degree": ds.num_edges / max(ds.num_nodes, 1), "max_in_degree": int(ds.in_degree.max()),
    }  # fmt: skip
    del ds
    caches = {"warm": [False], "cold": [True], "both": [False, True]}[args.cache]
    impls = ["native"] + ([] if args.no_reference else ["reference"])
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    facts = machine_facts()
    print(f"dataset {dataset['root']}: {dataset['num_nodes']:,} nodes, {dataset['num_edges']:,} edges "
          f"(mean in-degree {dataset['mean_in_degree']:.1f}, max {dataset['max_in_degree']:,}), "
          f"indices {dataset['index_dtype']} {dataset['indices_bytes'] / 2**20:,.0f} MiB")  # fmt: skip
    print("machine: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
    print(f"batch size {args.batch_size}, seeds uniform over all nodes, "
          f"{'with' if args.replace else 'without'} replacement; torch intra-op threads 1")
    print(f"reference: {REFERENCE_NAME}")
    results: list[dict[str, Any]] = []
    try:
        for fanouts in args.fanouts:
            for cold in caches:
                for impl in impls:
                    count = args.batches if impl == "native" else args.reference_batches
                    for threads in args.threads:
                        # fresh seeds per cold run, so no batch finds its pages cached by an earlier run
                        seed = args.seed + (1000 * len(results) if cold else 0)
                        batches = make_batches(dataset["num_nodes"], args.batch_size, count, seed)
                        r = measure(args.root, impl, fanouts, threads, cold, batches, args.replace)
                        results.append(r)
                        print(f"  {impl:9s} fanouts {','.join(map(str, fanouts)):9s} {r['cache']:24s} "
                              f"threads {threads}: {_num(r['edges_per_s'])} edges/s, "
                              f"{r['batches_per_s']:.2f} batches/s ({r['batches']} batches, {r['seconds']:.2f} s; "
                              f"{r['cpu_seconds'] / r['seconds']:.2f} cores busy, "
                              f"{1e3 * r['cpu_seconds'] / r['batches']:.1f} CPU ms/batch; first batch "
                              f"{r['first_batch_ms']:.0f} ms, median {r['median_batch_ms']:.0f} ms)",
                              flush=True)  # fmt: skip
    finally:
        torch.set_num_threads(prev_threads)
    facts["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average before {facts['load_average']}, after {facts['load_average_after']} "
          f"(other work on the machine shares its {facts['cpus']} cores)")
    table = format_table(results)
    print()
    print(table)
    print("\nnative/ref: native edges/s over the reference's; xT: edges/s over the same sampler's 1-thread figure;"
          "\n1st batch ms: latency of the first minibatch (native / reference), where a cold cache shows most."
          "\nCPU ms/batch (above) staying flat from 1 to 2 threads while cores busy stays below 2 means the"
          "\nthreads were waiting for a core (other load), not for each other.")
    doc = {
        "kind": "sample", **code_version(), "dataset": dataset, "machine": facts, "reference": REFERENCE_NAME,
        "batch_size": args.batch_size, "replace": args.replace, "torch_intra_op_threads": 1,
        "results": results, "table": table,
    }  # fmt: skip
    print(f"\nresults written to {write_results(doc, args.json, 'sample')}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_ooc.bench.sample", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
