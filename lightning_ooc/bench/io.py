"""Feature-read throughput of each backend, against fio on the same file.

``lightning-ooc bench io ROOT`` gathers batches of random node ids (uniform
and power-law skewed, sorted and unsorted) from a dataset's feature file at
several queue depths with every backend, and reports rows/s (over the run and
for the first, truly cold batch), MB/s of useful feature bytes, I/Os per
second and read amplification, both as the reader counts it and as the kernel
counted bytes fetched from storage (``/proc/self/io``). Beside each line
stands fio's IOPS for the same job (``--rw=randread --direct=1
--ioengine=io_uring``, block size = one row's aligned extent, same queue
depth), measured right before that group of lines, and the ratio ours / fio.

The page cache is dropped before every run when running as root. A file that
fits in memory still ends up cached by the ``mmap`` baseline within a run
(more so with a large ``read_ahead_kb``); ``--cache-limit 512MiB`` caps the
process's memory with a cgroup so that it cannot, as when features exceed RAM.

Also runs on a raw file: ``--file PATH --dim F --dtype float32``.

Example (about three minutes)::

    lightning-ooc bench io data/papers --json bench-results/io.json
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from lightning_ooc.bench.system import MemoryCap, code_version, drop_caches, write_results
from lightning_ooc.data.format import FEATURE_DTYPES, parse_bytes
from lightning_ooc.io import FeatureReader, available_backends
from lightning_ooc.io.backends import probe_file
from lightning_ooc import open_dataset

PATTERNS = ("uniform", "powerlaw")
ORDERS = ("unsorted", "sorted")
DEFAULT_QUEUE_DEPTHS = (1, 32, 128)
DEFAULT_BACKENDS = ("uring", "pread", "buffered", "mmap")


# -- what is read ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FeatureFile:
    path: Path
    num_rows: int
    num_features: int
    dtype: str
    row_bytes: int
    offset: int = 0  # of row 0: a .npy header where the dataset uses its features in place

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FeatureFile":
        if args.file is not None:
            if args.dim is None:
                raise SystemExit("bench io: --file needs --dim (and --dtype unless float32)")
            itemsize = FEATURE_DTYPES[args.dtype][1].itemsize
            row_bytes = args.dim * itemsize
            return cls(args.file, os.path.getsize(args.file) // row_bytes, args.dim, args.dtype, row_bytes)
        if args.root is None:
            raise SystemExit("bench io: give a dataset ROOT or --file PATH --dim F")

        ds = open_dataset(args.root)
        return cls(ds.features_path, ds.num_nodes, ds.num_features, ds.feature_dtype_name, ds.row_bytes,
                   ds.features_offset)


class IdBatches:
    """Reproducible batches of node ids.

    ``uniform``: every row equally likely. ``powerlaw``: rank ``r`` drawn with
    density ~ r^(1/gamma - 1) (gamma = 4: 1% of the rows get ~32% of the
    draws), ranks scattered over the file by a fixed random permutation, as
    hot nodes are in real graphs.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int, gamma: float = 4.0):
        self.num_rows = num_rows
        self.batch_size = min(batch_size, num_rows)
        self.seed = seed
        self.gamma = gamma
        self._perm: np.ndarray | None = None

    def make(self, pattern: str, order: str, count: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, PATTERNS.index(pattern), ORDERS.index(order)])
        out = []
        for _ in range(count):
            if pattern == "uniform":
                ids = rng.integers(0, self.num_rows, self.batch_size, dtype=np.int64)
            else:
                if self._perm is None:
                    self._perm = np.random.default_rng(self.seed).permutation(self.num_rows).astype(np.int64)
                rank = np.minimum((rng.random(self.batch_size) ** self.gamma * self.num_rows).astype(np.int64),
                                  self.num_rows - 1)
                ids = self._perm[rank]
            out.append(np.sort(ids) if order == "sorted" else ids)
        return out


# -- the machine ---------------------------------------------------------------------------------
def storage_read_bytes() -> int | None:
    """Bytes this process has caused to be fetched from storage (``/proc/self/io`` read_bytes)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def device_facts(path: Path) -> dict[str, Any]:
    st = os.stat(path)
    facts: dict[str, Any] = {"kernel": platform.release(), "cpus": os.cpu_count()}
    sysdir = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if sysdir.exists():
        disk = sysdir.resolve()
        if not (disk / "queue").exists():
            disk = disk.parent
        facts["device"] = disk.name
        for key in ("logical_block_size", "physical_block_size", "rotational", "scheduler", "nr_requests"):
            q = disk / "queue" / key
            if q.exists():
                facts[key] = q.read_text().strip()
        for key in ("model", "vendor"):
            q = disk / "device" / key
            if q.exists():
                facts[key] = q.read_text().strip()
        drv = disk / "device" / "driver"
        if drv.exists():
            facts["driver"] = drv.resolve().name
    try:
        info = probe_file(path)
        facts.update(fs=info["fs"], dio_block=info["block_size"], dio_block_source=info["block_source"])
    except Exception as e:  # noqa: BLE001 - facts are best effort
        facts["probe_error"] = str(e)
    return facts


@contextlib.contextmanager
def _cache_limit(limit: int | None) -> Iterator[str]:
    """Run the body in a memory cgroup of ``limit`` bytes (page cache included), when given and possible."""
    if limit is None:
        yield ""
        return
    try:
        cap = MemoryCap(limit)
    except RuntimeError as e:
        yield f"cache limit not applied: {e}"
        return
    with cap:
        yield f"memory (page cache included) of this process capped at {limit / 2**20:.0f} MiB by {cap.path}"


# -- one measurement -----------------------------------------------------------------------------
def run_reader(ff: FeatureFile, backend: str, queue_depth: int, batches: list[np.ndarray], seconds: float,
               *, max_io: int, merge_gap: int, workers: int, inflight: int, cold: bool) -> dict[str, Any]:
    """Gather batches back to back for ``seconds``, with ``inflight`` of them submitted ahead as a
    training pipeline's extractors do, so the reader's queue stays full across batch boundaries."""
    note = drop_caches()[1] if cold else "warm"
    width = max(len(b) for b in batches)
    outs = [np.empty((width, ff.num_features), dtype=FEATURE_DTYPES[ff.dtype][1]) for _ in range(max(1, inflight))]
    finished = []
    first = 0.0
    dev0 = storage_read_bytes()
    with FeatureReader(ff.path, ff.num_features, ff.dtype, backend=backend, queue_depth=queue_depth,
                       num_rows=ff.num_rows, max_io=max_io, merge_gap=merge_gap, workers=workers,
                       offset=ff.offset) as reader:
        pending: list = []
        submitted = 0
        t0 = time.perf_counter()
        while True:
            if time.perf_counter() - t0 < seconds:
                while len(pending) < len(outs) and submitted < len(batches):
                    pending.append(reader.gather_async(batches[submitted], outs[submitted % len(outs)]))
                    submitted += 1
            if not pending:
                break
            handle = pending.pop(0)
            handle.wait()
            if not finished:
                first = time.perf_counter() - t0
            finished.append(handle)
        elapsed = time.perf_counter() - t0
        info = reader.info
    dev1 = storage_read_bytes()
    stats = [h.stats for h in finished]  # outside the timed loop: the mmap ones cost a np.unique
    rows = sum(s.rows for s in stats)
    req = sum(s.bytes_requested for s in stats)
    read = sum(s.bytes_read for s in stats)
    ios = sum(s.num_ios for s in stats)
    dev = None if dev0 is None or dev1 is None else dev1 - dev0
    return {
        "backend": backend, "queue_depth": queue_depth if backend != "mmap" else None, "batches": len(stats),
        "inflight": inflight, "seconds": elapsed, "rows": rows, "unique_rows": sum(s.unique_rows for s in stats),
        "bytes_requested": req, "bytes_read": read, "num_ios": ios, "storage_read_bytes": dev,
        "rows_per_s": rows / elapsed if elapsed else 0.0,
        "first_batch_rows_per_s": stats[0].rows / first if stats and first > 0 else 0.0,
        "mb_per_s": rows * ff.row_bytes / elapsed / 1e6 if elapsed else 0.0,
        "iops": ios / elapsed if elapsed else 0.0,
        "amplification": read / req if req else 0.0,
        "storage_amplification": dev / req if dev is not None and req else None,
        "cache": note, "engine": info.get("engine"), "block_size": info.get("block_size"),
    }  # fmt: skip


def fio_block_size(ff: FeatureFile, block: int) -> int:
    """fio's block size for 'the same job': one row's aligned extent (a multiple of the device block)."""
    return max(block, math.ceil(ff.row_bytes / block) * block)


def run_fio(path: Path, bs: int, queue_depth: int, seconds: float, *, cold: bool, rw: str = "randread",
            jobs: int = 1) -> dict[str, Any]:  # fmt: skip
    """fio's IOPS for direct reads (``rw``: ``randread`` or sequential ``read``) of ``bs`` bytes at
    ``queue_depth`` over the whole file, by ``jobs`` jobs at once (each with its own ring, as each of our
    extractors has; the figures are their sum)."""
    exe = shutil.which("fio")
    if exe is None:
        return {"iops": None, "why": "fio not installed (apt-get install fio)"}
    size = os.path.getsize(path) // bs * bs
    cmd = [exe, "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", "--direct=1",
           "--ioengine=io_uring", f"--iodepth={queue_depth}", f"--size={size}", f"--runtime={max(1, round(seconds))}",
           "--time_based", "--output-format=json", f"--numjobs={max(1, int(jobs))}", "--group_reporting"]  # fmt: skip
    if cold:
        drop_caches()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"iops": None, "why": f"fio failed: {e}", "command": " ".join(cmd)}
    if p.returncode != 0:
        return {"iops": None, "why": f"fio failed: {(p.stderr or p.stdout).strip()[:200]}", "command": " ".join(cmd)}
    try:
        job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["read"]
    except (ValueError, KeyError, IndexError) as e:
        return {"iops": None, "why": f"cannot parse fio output: {e}", "command": " ".join(cmd)}
    return {"iops": float(job["iops"]), "bw_bytes": float(job["bw_bytes"]), "bs": bs, "jobs": max(1, int(jobs)),
            "lat_mean_us": float(job.get("lat_ns", {}).get("mean", 0.0)) / 1e3, "command": " ".join(["fio", *cmd[1:]])}


# -- the report ------------------------------------------------------------------------------------
def _fmt(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}"


def format_table(results: list[dict[str, Any]]) -> str:
    head = ["ids", "order", "backend", "qd", "rows/s", "1st batch rows/s", "MB/s", "IOPS", "amp", "amp (storage)",
            "fio IOPS", "ours/fio"]  # fmt: skip
    lines = []
    for r in results:
        fio = r.get("fio") or {}
        ratio = r["iops"] / fio["iops"] if fio.get("iops") and r["backend"] in ("uring", "pread") else None
        fio_col = _fmt(fio.get("iops")) if fio.get("iops") else (fio.get("why", "-") if r["backend"] != "mmap" else "-")
        if r["backend"] == "buffered" and fio.get("iops"):
            fio_col = f"({_fmt(fio['iops'])})"  # page-cache reads are not fio's direct job
        lines.append([
            r["pattern"], r["order"], r["backend"], str(r["queue_depth"] or "-"), _fmt(r["rows_per_s"]),
            _fmt(r["first_batch_rows_per_s"]), _fmt(r["mb_per_s"], 1), _fmt(r["iops"]), _fmt(r["amplification"], 3),
            _fmt(r["storage_amplification"], 3), fio_col, _fmt(ratio, 2) if ratio is not None else "-",
        ])  # fmt: skip
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]  # fmt: skip
    for line in lines:
        out.append("| " + " | ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in
                                     enumerate(zip(line, widths))) + " |")  # fmt: skip
    return "\n".join(out)


# -- command line --------------------------------------------------------------------------------------
def _bytes(s: str) -> int:
    return parse_bytes(s)


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", nargs="?", type=Path, help="dataset directory (or use --file)")
    parser.add_argument("--file", type=Path, help="a raw feature file instead of a dataset")
    parser.add_argument("--dim", type=int, help="values per row of --file")
    parser.add_argument("--dtype", default="float32", help="dtype of --file (default float32)")
    parser.add_argument("--backends", type=_csv(str), default=list(DEFAULT_BACKENDS),
                        help="comma-separated (default: uring,pread,buffered,mmap; unavailable ones are skipped)")
    parser.add_argument("--queue-depths", type=_csv(int), default=list(DEFAULT_QUEUE_DEPTHS),
                        help="comma-separated (default 1,32,128)")
    parser.add_argument("--patterns", type=_csv(str), default=list(PATTERNS), help="uniform,powerlaw")
    parser.add_argument("--orders", type=_csv(str), default=list(ORDERS), help="unsorted,sorted")
    parser.add_argument("--batch-size", type=int, default=4096, help="ids per gather (default 4096)")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement (default 2)")
    parser.add_argument("--max-batches", type=int, default=400, help="batches prepared per pattern/order")
    parser.add_argument("--fio-seconds", type=float, default=2.0,
                        help="fio runtime, once per pattern/order/queue depth, right before our runs (default 2)")
    parser.add_argument("--no-fio", action="store_true", help="skip the fio reference")
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache between runs")
    parser.add_argument("--max-io", type=int, default=128 * 1024, help="largest merged read, bytes")
    parser.add_argument("--merge-gap", type=int, default=0, help="merge extents across gaps up to this, bytes")
    parser.add_argument("--workers", type=int, default=1, help="reader threads (rings) per reader")
    parser.add_argument("--inflight", type=int, default=2,
                        help="batches submitted ahead (default 2; 1 = one blocking gather at a time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-limit", type=_bytes, default=None,
                        help="cap this process's memory, page cache included, e.g. 512MiB (a cgroup; needs root): "
                             "the mmap baseline then cannot cache the file, as when features exceed memory")
    parser.add_argument("--json", type=Path, help="where to write the results (default bench-results/io-TIME.json)")


def run(args: argparse.Namespace) -> int:
    ff = FeatureFile.from_args(args)
    avail = available_backends(ff.path)
    backends = []
    for b in args.backends:
        if b not in avail:
            raise SystemExit(f"bench io: unknown backend {b!r}; choose from {', '.join(avail)}")
        if avail[b][0]:
            backends.append(b)
        else:
            print(f"skipping {b}: {avail[b][1]}", file=sys.stderr)
    cold = not args.warm
    cache_note = drop_caches()[1] if cold else "warm page cache (--warm)"
    facts = device_facts(ff.path)
    block = int(facts.get("dio_block") or 512)
    bs = fio_block_size(ff, block)
    print(f"file {ff.path}: {ff.num_rows:,} rows x {ff.row_bytes} B ({ff.num_features} x {ff.dtype}), "
          f"{ff.num_rows * ff.row_bytes / 2**30:.2f} GiB")
    print("machine: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
    print(f"{cache_note}; batches of {args.batch_size} ids, {args.inflight} in flight; {args.seconds:g} s per line; "
          f"fio block size {bs} B")

    # fio runs right before each group of our runs at the same queue depth: on a shared machine
    # the device's speed drifts over the minutes the benchmark takes, so a distant reference lies
    def fio_ref(qd: int) -> dict[str, Any]:
        if args.no_fio:
            return {"iops": None, "why": "skipped (--no-fio)"}
        return run_fio(ff.path, bs, qd, args.fio_seconds, cold=cold)

    # warm-up: the code each backend runs is paged in now, not counted as storage reads of the first run
    for backend in backends:
        run_reader(ff, backend, 2, [np.arange(min(ff.num_rows, 64))] * 2, 0.0, max_io=args.max_io,
                   merge_gap=args.merge_gap, workers=args.workers, inflight=args.inflight, cold=False)
    gen = IdBatches(ff.num_rows, args.batch_size, args.seed)
    results: list[dict[str, Any]] = []
    direct = [b for b in backends if b != "mmap"]
    with _cache_limit(args.cache_limit) as cap_note:
        if cap_note:
            print(cap_note)
        for pattern in args.patterns:
            for order in args.orders:
                batches = gen.make(pattern, order, args.max_batches)
                for qd in args.queue_depths if direct else []:
                    ref = fio_ref(qd)
                    for backend in direct:
                        r = run_reader(ff, backend, qd, batches, args.seconds, max_io=args.max_io,
                                       merge_gap=args.merge_gap, workers=args.workers, inflight=args.inflight,
                                       cold=cold)
                        r.update(pattern=pattern, order=order, fio=ref)
                        results.append(r)
                        print(format_table([r]).splitlines()[-1], flush=True)
                if "mmap" in backends:
                    r = run_reader(ff, "mmap", 1, batches, args.seconds, max_io=args.max_io, merge_gap=args.merge_gap,
                                   workers=args.workers, inflight=1, cold=cold)
                    r.update(pattern=pattern, order=order, fio=None)
                    results.append(r)
                    print(format_table([r]).splitlines()[-1], flush=True)
    table = format_table(results)
    print()
    print(table)
    doc = {
        "kind": "io", **code_version(),
        "file": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(ff).items()},
        "machine": facts, "cache": cache_note, "batch_size": args.batch_size, "seconds": args.seconds,
        "fio_block_size": bs, "cache_limit": args.cache_limit, "cache_limit_note": cap_note, "results": results,
        "backends": {k: list(v) for k, v in avail.items()}, "table": table,
    }  # fmt: skip
    print(f"\nresults written to {write_results(doc, args.json, 'io')}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_ooc.bench.io", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
