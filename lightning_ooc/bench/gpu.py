"""GPU acceptance: the checks of ``make gpu-check`` and the zero-copy bandwidth, in one table and one JSON.

``lightning-ooc bench gpu`` (what ``make gpu-check`` runs) does, on a machine with CUDA:

1. the tests marked ``gpu`` (``pytest -m gpu``: bit-exact rows from every tier on the GPU, the Triton
   kernel, no CUDA error after a failed registration, no host synchronisation per batch, a one-GPU
   ``strategy="ooc"`` fit, ``mps_split`` with the real MPS daemon), in a subprocess;
2. the zero-copy gather's bandwidth -- GPU threads reading rows of a registered host table straight
   into device memory -- against pinned ``cudaMemcpy`` of the same number of bytes, measured in the
   same run, for rows of 128 x float32, 100 x float32 and 256 x float16 (PyTorch-Direct reaches
   0.88-0.93 of ``cudaMemcpy``; the goal is >= 0.9);
3. the epoch figures: ``lightning-ooc bench epoch`` on the GPU (GraphSAGE, the papers setting and a
   light one) with features 4x the host memory given to each run (a memory cgroup, cold page cache;
   both need root): ours against the ``MADV_RANDOM`` memory map and PyG's ``NeighborLoader`` at its best
   ``num_workers`` where PyG can sample there (goal: >= 10x faster), against every row in GPU memory
   (goal: <= 1.1x), and the GPU memory ours used at its peak beside what its plan put on the device;
   then the papers setting with ours under each ``--mps-split`` against ours without one, in the same
   ``bench epoch``. Each run stops after ``--epoch-run-timeout`` seconds (a lower bound then). The
   synthetic graph (12 GiB of features by default) is written once under ``--epoch-dir`` (or given as
   ``--epoch-root``), by a child process that runs beside the tests;
4. at the end: no CUDA error pending and a kernel still runs.

It writes ``OUT.json`` (and ``OUT-epoch.json``, ``OUT-epoch-mps.json``) and prints a table. Without CUDA it prints one line
and exits 0.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_ooc.bench.system import machine_facts, write_results
from lightning_ooc.data.dataset import open_dataset
from lightning_ooc.data.format import human_bytes, parse_bytes
from lightning_ooc.store.pinning import host_register, host_unregister
import json
import torch

#: (columns, dtype name) of the bandwidth rows
ROW_SHAPES = ((128, "float32"), (100, "float32"), (256, "float16"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--table-bytes", default="4GiB", help="size of the registered host table the gather reads")
    p.add_argument("--gather-rows", type=int, default=1 << 20, help="rows gathered per timed call")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per figure (after 2 warm-up calls)")
    p.add_argument("--skip-tests", action="store_true", help="do not run the tests marked gpu")
    p.add_argument("--no-bandwidth", action="store_true", help="leave out the zero-copy bandwidth")
    p.add_argument("--hugepages-row", action="store_true",
                   help="time the first row shape once more with the table on transparent huge pages")
    p.add_argument("--no-epoch", action="store_true", help="leave out the epoch figures")
    p.add_argument("--epoch-root", type=Path, help="dataset for the epoch figures (default: one made under --epoch-dir)")
    p.add_argument("--epoch-dir", type=Path, default=Path("data/gpu-check"), help="where the synthetic graph is kept")
    p.add_argument("--epoch-features", default="12GiB",
                   help="feature bytes of the synthetic graph (the cap is a quarter: a CUDA process holds about 1 GiB "
                        "of host memory before planning)")  # fmt: skip
    p.add_argument("--epoch-max-batches", type=int, default=40, help="training batches per measured epoch")
    p.add_argument("--epoch-run-timeout", type=float, default=150,
                   help="seconds one epoch run may take (a run stopped is a lower bound in the table)")
    p.add_argument("--mps-split", default="10,20,30",
                   help="SM percentages for the gather producer, each an epoch run of ours against none ('' : none)")
    p.add_argument("--out", type=Path, default=Path("gpu-check"), help="prefix of the .json")


def _run_gpu_tests() -> dict[str, Any]:
    repo = Path(__file__).resolve().parents[2]
    tests = repo / "tests"
    if not tests.is_dir():
        return {"ran": False, "reason": f"no tests directory at {tests}"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-m", "gpu", "-p", "no:cacheprovider", str(tests)],
                       cwd=repo, capture_output=True, text=True)  # fmt: skip
    tail = (r.stdout + r.stderr).strip().splitlines()
    summary = next((ln for ln in reversed(tail) if " passed" in ln or " failed" in ln or " error" in ln), "")
    return {"ran": True, "returncode": r.returncode, "summary": summary.strip("= "), "seconds": time.perf_counter() - t0,
            "output_tail": "\n".join(tail[-60:])}  # fmt: skip


def _bandwidth(cols: int, dtype_name: str, table_bytes: int, gather_rows: int, repeats: int,
               hugepages: bool = False) -> dict[str, Any]:  # fmt: skip
    from lightning_ooc.io.bulk import aligned_empty  # lazy: the native module
    from lightning_ooc.store import uva  # lazy: it imports Triton

    dtype = getattr(torch, dtype_name)
    itemsize = torch.empty((), dtype=dtype).element_size()
    row_bytes = cols * itemsize
    n_rows = max(gather_rows, table_bytes // row_bytes)
    dev = torch.device("cuda", torch.cuda.current_device())
    raw = aligned_empty(n_rows * row_bytes, hugepages=hugepages)
    host = raw[: n_rows * row_bytes].view(dtype).view(n_rows, cols)
    words = raw[: (raw.numel() // 8) * 8].view(torch.int64)
    torch.mul(torch.arange(words.numel(), dtype=torch.int64), -7046029254386353131, out=words)  # any bytes, fast
    if not host_register(host.data_ptr(), host.numel() * itemsize, "bandwidth table"):
        return {"error": "cudaHostRegister failed"}
    try:
        g = torch.Generator().manual_seed(0)
        pos = torch.randint(0, n_rows, (gather_rows,), generator=g).pin_memory()
        out_rows = torch.arange(gather_rows).pin_memory()
        x = torch.empty((gather_rows, cols), dtype=dtype, device=dev)
        nbytes = gather_rows * row_bytes
        # the reference: one pinned, contiguous host-to-device copy of as many bytes
        src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)

        def timed(fn) -> float:
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0 / repeats

        pos_d, rows_d = pos.to(dev), out_rows.to(dev)
        zc = timed(lambda: uva.gather_rows_into(x, rows_d, host, pos_d, zero_copy=True))  # as the tiers call it
        ok = torch.equal(x[:1000].cpu().view(torch.uint8), host[pos[:1000]].view(torch.uint8))  # bytes: NaNs too
        sort_min, uva.SORT_MIN = uva.SORT_MIN, 1 << 62
        try:  # the same rows read in the batch's own (random) order
            unsorted = timed(lambda: uva.gather_rows_into(x, rows_d, host, pos_d, zero_copy=True))
        finally:
            uva.SORT_MIN = sort_min
        ref = timed(lambda: dst.copy_(src, non_blocking=True))
        return {"cols": cols, "dtype": dtype_name, "row_bytes": row_bytes, "table_bytes": n_rows * row_bytes,
                "hugepages": hugepages, "gathered_bytes": nbytes, "zero_copy_gbps": nbytes / zc / 1e9,
                "memcpy_gbps": nbytes / ref / 1e9, "fraction": ref / zc, "unsorted_gbps": nbytes / unsorted / 1e9,
                "unsorted_fraction": ref / unsorted, "rows_equal": bool(ok)}  # fmt: skip
    finally:
        torch.cuda.synchronize()
        host_unregister(host.data_ptr())


class _Graph:
    """The synthetic graph of the epoch figures, written by a child process that starts before the tests (it
    needs the CPUs and the disk, the tests the GPU): :meth:`ready` waits for it."""

    def __init__(self, args: argparse.Namespace):
        self.proc: subprocess.Popen | None = None
        self.log = ""
        if args.epoch_root is not None:
            self.root = Path(args.epoch_root)
            return
        dim = 128
        nodes = max(10_000, parse_bytes(args.epoch_features) // (dim * 4))
        self.root = Path(args.epoch_dir) / f"g-{nodes}x{dim}"
        if (self.root / "meta.json").exists():
            return
        print(f"gpu-check: writing a synthetic graph of {nodes:,} nodes x {dim} float32 to {self.root} (once; "
              "beside the tests)", flush=True)  # fmt: skip
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_ooc", "synth", "--out", str(self.root), "--nodes", str(nodes),
             "--avg-degree", "15", "--dim", str(dim), "--classes", "32", "--train-frac", "0.01", "--val-frac",
             "0.001", "--test-frac", "0.001", "--overwrite", "--no-progress"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip

    def ready(self) -> float | None:
        """Wait for the graph; the seconds it took to write (None: it was there). Raises if writing it failed."""
        if self.proc is None:
            return None
        self.log = self.proc.communicate()[0]
        if self.proc.returncode != 0:
            raise RuntimeError(f"writing {self.root} failed (exit {self.proc.returncode}): {self.log[-2000:]}")
        self.proc = None
        return time.perf_counter() - self.t0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _bench_epoch(args: argparse.Namespace, root: Path, out: Path, extra: list[str],
                 accelerator: str = "gpu") -> dict[str, Any]:  # fmt: skip
    """One ``bench epoch`` on the GPU under a cap of a quarter of the features (where this process may set one,
    cold), each run stopped after ``--epoch-run-timeout`` seconds (then recorded as a lower bound)."""
    ds = open_dataset(root)
    feat = ds.num_nodes * ds.row_bytes
    cap = feat // 4
    root_user = os.geteuid() == 0
    cmd = [sys.executable, "-m", "lightning_ooc", "bench", "epoch", str(root), "--accelerator", accelerator,
           "--max-batches", str(args.epoch_max_batches), "--mmap-max-batches", str(min(args.epoch_max_batches, 5)),
           "--gpu-cache", "8GiB", "--host-cache", human_bytes(cap // 4).replace(" ", ""), "--staging", "256MiB",
           "--samplers", "8", "--extractors", "8", "--pyg-workers", "0,4,8", "--no-floor",
           "--run-timeout", str(args.epoch_run_timeout), "--out", str(out), *extra]  # fmt: skip
    if root_user:
        cmd += ["--memory-cap", str(cap), "--cold"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    doc: dict[str, Any] = {"command": " ".join(cmd), "returncode": r.returncode, "features_bytes": feat,
                           "memory_cap": cap if root_user else None, "seconds": time.perf_counter() - t0,
                           "output_tail": (r.stdout + r.stderr)[-6000:]}  # fmt: skip
    path = out.with_suffix(".json")
    if r.returncode == 0 and path.exists():
        doc["results"] = json.loads(path.read_text())["results"]
    return doc


def _epoch_figures(args: argparse.Namespace, graph: _Graph, out: Path) -> dict[str, Any]:
    """The epoch figures: papers and light with ours, the ``MADV_RANDOM`` memory map, PyG's loader (where it
    can sample) and every row in GPU memory; then papers with ours and ours under each ``--mps-split``."""
    doc = _bench_epoch(args, graph.root, out, ["--variants", "ours,mmap-random,pyg,device", "--settings",
                                                "papers,light"])  # fmt: skip
    if args.mps_split and "results" in doc:
        mps = _bench_epoch(args, graph.root, Path(str(out) + "-mps"),
                           ["--variants", "ours", "--settings", "papers", "--mps-split", args.mps_split])  # fmt: skip
        doc["mps"] = mps
        if "results" not in mps:
            doc["error"] = f"bench epoch --mps-split failed (exit {mps['returncode']}); see the JSON"
    return doc


def _per_batch(r: dict[str, Any] | None) -> float | None:
    if not r:
        return None
    return r.get("steady_seconds_per_batch") or (r["epoch_seconds"] / r["batches"] if r.get("batches") else None)


def _gib(b: Any) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def _epoch_lines(e: dict[str, Any]) -> list[str]:
    cap = e.get("memory_cap")
    lines = [f"  epoch (GraphSAGE)     features {human_bytes(e['features_bytes'])}, "
             + (f"host memory cap {human_bytes(cap)} (4x smaller), cold cache" if cap else
                "NO memory cap (needs root): the figures are not the acceptance run")]  # fmt: skip
    if "results" not in e:
        why = e.get("error") or f"bench epoch failed (exit {e['returncode']}); see the JSON"
        return lines + [f"                        {why}"]
    lines.append("                        setting  ours s/batch  mmap-random / ours  PyG best / ours (goal >= 10)  "
                 "ours / in-GPU (goal <= 1.1)   GPU GiB peak / plan")  # fmt: skip
    results = e["results"]
    by = {(r["setting"], r.get("label", r["variant"])): r for r in results if "error" not in r}
    for s in ("papers", "light"):
        o_run = by.get((s, "ours"))
        o, m, d = _per_batch(o_run), _per_batch(by.get((s, "mmap-random"))), _per_batch(by.get((s, "device")))
        pyg = [(lbl, _per_batch(r)) for (st, lbl), r in by.items() if st == s and lbl.startswith("pyg-w")]
        best = min((p for p in pyg if p[1]), key=lambda p: p[1], default=None)
        if not o:
            why = next((r["error"] for r in results if r["setting"] == s and r.get("label") == "ours" and "error" in r),
                       "no figure")  # fmt: skip
            lines.append(f"                        {s:<8} {why[:120]}")
            continue
        pyg_cell = f"{best[1] / o:.2f} ({best[0]})" if best else "no run"
        lines.append(f"                        {s:<8} {o:>12.4f}  {(m / o if m else float('nan')):>18.2f}  "
                     f"{pyg_cell:>28}  {(o / d if d else float('nan')):>27.2f}   "
                     f"{_gib(o_run.get('gpu_peak_allocated_bytes'))} / {_gib(o_run.get('plan_gpu_bytes'))}")  # fmt: skip
    stopped = [f"{r['setting']}/{r.get('label', r['variant'])}" for r in results if r.get("timed_out")]
    if stopped:
        lines.append(f"                        stopped by the run timeout (figures are lower bounds): {', '.join(stopped)}")
    mps = e.get("mps")
    if mps is not None:
        if "results" not in mps:
            lines.append(f"  mps_split (papers)    bench epoch failed (exit {mps['returncode']}); see the JSON")
            return lines
        mb = {r.get("label", r["variant"]): r for r in mps["results"] if "error" not in r}
        base = _per_batch(mb.get("ours"))
        cells = []
        for label, r in mb.items():
            if label == "ours":
                continue
            pb = _per_batch(r)
            active = (r.get("mps") or {}).get("active")
            cells.append(f"{label[5:]}: {(pb / base if pb and base else float('nan')):.2f}"
                         + ("" if active else " (MPS not in force)"))  # fmt: skip
        lines.append(f"  mps_split (papers)    s/batch against none ({base if base else float('nan'):.4f}): "
                     + ("; ".join(cells) or "no run"))  # fmt: skip
    return lines


def _cuda_state() -> dict[str, Any]:
    torch.cuda.synchronize()
    try:
        y = torch.ones(8, device="cuda") + 1  # a kernel launch reports any error left pending
        torch.cuda.synchronize()
        return {"pending_error": None, "kernel_ok": bool(float(y.sum()) == 16.0)}
    except RuntimeError as e:
        return {"pending_error": str(e), "kernel_ok": False}


def run(args: argparse.Namespace) -> int:

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False); nothing to check")
        return 0
    doc: dict[str, Any] = {"machine": machine_facts(), "device": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "cuda": torch.version.cuda}  # fmt: skip
    try:
        import triton  # lazy: Triton only on a GPU path

        doc["triton"] = triton.__version__
    except ImportError:
        doc["triton"] = None
    graph = None if args.no_epoch else _Graph(args)  # written while the tests run
    try:
        doc["tests"] = {"ran": False, "reason": "--skip-tests"} if args.skip_tests else _run_gpu_tests()
        graph_error = None
        if graph is not None:  # the bandwidth is measured with the machine otherwise idle
            try:
                doc["graph_seconds"] = graph.ready()
            except RuntimeError as e:
                graph_error = str(e)
    except BaseException:
        if graph is not None:
            graph.stop()
        raise
    table_bytes = parse_bytes(args.table_bytes)
    from lightning_ooc.store import uva  # lazy: it imports Triton

    doc["bandwidth"] = []
    for c, d in () if args.no_bandwidth else ROW_SHAPES:
        if not uva.HAVE_TRITON:
            doc["bandwidth"].append({"cols": c, "dtype": d, "error": "Triton is missing: no zero-copy kernel to time"})
            continue
        try:
            doc["bandwidth"].append(_bandwidth(c, d, table_bytes, args.gather_rows, args.repeats))
        except Exception as e:  # noqa: BLE001 - recorded, and the rest still runs
            doc["bandwidth"].append({"cols": c, "dtype": d, "error": f"{type(e).__name__}: {e}"})
    if uva.HAVE_TRITON and args.hugepages_row and not args.no_bandwidth:
        try:  # the first shape again, the table on transparent huge pages
            doc["bandwidth"].append(_bandwidth(*ROW_SHAPES[0], table_bytes, args.gather_rows, args.repeats, True))
        except Exception as e:  # noqa: BLE001
            doc["bandwidth"].append({"cols": ROW_SHAPES[0][0], "dtype": ROW_SHAPES[0][1], "error": str(e)})
    if not args.no_epoch:
        try:
            if graph_error:
                raise RuntimeError(graph_error)
            doc["epoch"] = _epoch_figures(args, graph, Path(str(args.out) + "-epoch"))
        except Exception as e:  # noqa: BLE001
            doc["epoch"] = {"error": f"{type(e).__name__}: {e}", "features_bytes": 0, "returncode": None}
    doc["cuda_state"] = _cuda_state()
    path = write_results(doc, Path(str(args.out) + ".json"), "gpu")

    lines = [f"gpu-check on {doc['device']} (torch {doc['torch']}, CUDA {doc['cuda']}, Triton {doc['triton']})"]
    t = doc["tests"]
    lines.append(f"  tests marked gpu      {t.get('summary') or t.get('reason')}"
                 + ("" if not t.get("ran") else f"  (exit {t['returncode']})"))  # fmt: skip
    lines.append("  zero-copy gather      row                 GB/s   pinned memcpy GB/s   fraction (goal >= 0.9)"
                 "   in batch order")  # fmt: skip
    for b in doc["bandwidth"]:
        if "error" in b:
            lines.append(f"                        {b['cols']:>4} x {b['dtype']:<8} {b['error']}")
            continue
        lines.append(f"                        {b['cols']:>4} x {b['dtype']:<8} {b['zero_copy_gbps']:>8.2f}   "
                     f"{b['memcpy_gbps']:>18.2f}   {b['fraction']:>8.2f}   {b['unsorted_fraction']:>22.2f}"
                     + ("  (huge pages)" if b["hugepages"] else "")
                     + ("" if b["rows_equal"] else "   ROWS DIFFER"))  # fmt: skip
    if "epoch" in doc:
        lines += _epoch_lines(doc["epoch"])
    cs = doc["cuda_state"]
    lines.append(f"  after the run         CUDA error pending: {cs['pending_error'] or 'none'}; a kernel runs: "
                 f"{'yes' if cs['kernel_ok'] else 'NO'}")  # fmt: skip
    lines.append(f"  written to {path}")
    print("\n".join(lines))
    failed = (t.get("ran") and t.get("returncode") not in (0, 5)) or cs["pending_error"] or not cs["kernel_ok"] or any(
        "error" in b or not b["rows_equal"] for b in doc["bandwidth"]) or "error" in doc.get("epoch", {})  # fmt: skip
    if failed and t.get("ran") and t.get("returncode") not in (0, 5):
        print(t["output_tail"], file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
