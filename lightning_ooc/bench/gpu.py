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
   both need root), ours against the mmap baseline (goal: >= 10x faster) and against every row in
   GPU memory (goal: <= 1.1x), on a synthetic graph made once under ``--epoch-dir`` (or
   ``--epoch-root``);
4. at the end: no CUDA error pending and a kernel still runs.

It writes ``OUT.json`` (and ``OUT-epoch.json``) and prints a table. Without CUDA it prints one line
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
from lightning_ooc.data.synth import synthesize
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
    p.add_argument("--hugepages-row", action="store_true",
                   help="time the first row shape once more with the table on transparent huge pages")
    p.add_argument("--no-epoch", action="store_true", help="leave out the epoch figures")
    p.add_argument("--epoch-root", type=Path, help="dataset for the epoch figures (default: one made under --epoch-dir)")
    p.add_argument("--epoch-dir", type=Path, default=Path("data/gpu-check"), help="where the synthetic graph is kept")
    p.add_argument("--epoch-features", default="16GiB", help="feature bytes of the synthetic graph")
    p.add_argument("--epoch-max-batches", type=int, default=40, help="training batches per measured epoch")
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


def _epoch_figures(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """``bench epoch`` on the GPU, under a cap of a quarter of the features where this process may set one."""

    root = args.epoch_root
    if root is None:
        dim = 128
        nodes = max(10_000, parse_bytes(args.epoch_features) // (dim * 4))
        root = args.epoch_dir / f"g-{nodes}x{dim}"
        if not (root / "meta.json").exists():
            print(f"gpu-check: writing a synthetic graph of {nodes:,} nodes x {dim} float32 to {root} (once)",
                  flush=True)  # fmt: skip
            synthesize(root, num_nodes=nodes, avg_degree=15, num_features=dim, num_classes=32, train_frac=0.01,
                       val_frac=0.001, test_frac=0.001, progress=True)  # fmt: skip
    ds = open_dataset(root)
    feat = ds.num_nodes * ds.row_bytes
    cap = feat // 4
    root_user = os.geteuid() == 0
    cmd = [sys.executable, "-m", "lightning_ooc", "bench", "epoch", str(root), "--accelerator", "gpu",
           "--variants", "ours,mmap,device", "--settings", "papers,light", "--max-batches", str(args.epoch_max_batches),
           "--mmap-max-batches", str(min(args.epoch_max_batches, 10)), "--gpu-cache", "8GiB",
           "--host-cache", human_bytes(cap // 4).replace(" ", ""), "--staging", "256MiB", "--samplers", "8",
           "--extractors", "8", "--out", str(out)]  # fmt: skip
    if root_user:
        cmd += ["--memory-cap", str(cap), "--cold"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    doc: dict[str, Any] = {"command": " ".join(cmd), "returncode": r.returncode, "features_bytes": feat,
                           "memory_cap": cap if root_user else None, "output_tail": (r.stdout + r.stderr)[-6000:]}  # fmt: skip
    path = out.with_suffix(".json")
    if r.returncode == 0 and path.exists():
        doc["results"] = json.loads(path.read_text())["results"]
    return doc


def _epoch_lines(e: dict[str, Any]) -> list[str]:
    cap = e.get("memory_cap")
    lines = [f"  epoch (GraphSAGE)     features {human_bytes(e['features_bytes'])}, "
             + (f"host memory cap {human_bytes(cap)} (4x smaller), cold cache" if cap else
                "NO memory cap (needs root): the figures are not the acceptance run")]  # fmt: skip
    if "results" not in e:
        why = e.get("error") or f"bench epoch failed (exit {e['returncode']}); see the JSON"
        return lines + [f"                        {why}"]
    lines.append("                        setting  ours s/batch  mmap / ours (goal >= 10)  ours / in-GPU (goal <= 1.1)")
    by = {(r["setting"], r["variant"]): r for r in e["results"] if "error" not in r}

    def per_batch(r: dict[str, Any] | None) -> float | None:
        if not r:
            return None
        return r.get("steady_seconds_per_batch") or (r["epoch_seconds"] / r["batches"] if r.get("batches") else None)

    for s in ("papers", "light"):
        o, m, d = (per_batch(by.get((s, v))) for v in ("ours", "mmap", "device"))
        if not o:
            lines.append(f"                        {s:<8} no figure")
            continue
        lines.append(f"                        {s:<8} {o:>12.4f}  {(m / o if m else float('nan')):>24.2f}  "
                     f"{(o / d if d else float('nan')):>27.2f}")  # fmt: skip
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
    doc["tests"] = {"ran": False, "reason": "--skip-tests"} if args.skip_tests else _run_gpu_tests()
    table_bytes = parse_bytes(args.table_bytes)
    from lightning_ooc.store import uva  # lazy: it imports Triton

    doc["bandwidth"] = []
    for c, d in ROW_SHAPES:
        if not uva.HAVE_TRITON:
            doc["bandwidth"].append({"cols": c, "dtype": d, "error": "Triton is missing: no zero-copy kernel to time"})
            continue
        try:
            doc["bandwidth"].append(_bandwidth(c, d, table_bytes, args.gather_rows, args.repeats))
        except Exception as e:  # noqa: BLE001 - recorded, and the rest still runs
            doc["bandwidth"].append({"cols": c, "dtype": d, "error": f"{type(e).__name__}: {e}"})
    if uva.HAVE_TRITON and args.hugepages_row:
        try:  # the first shape again, the table on transparent huge pages
            doc["bandwidth"].append(_bandwidth(*ROW_SHAPES[0], table_bytes, args.gather_rows, args.repeats, True))
        except Exception as e:  # noqa: BLE001
            doc["bandwidth"].append({"cols": ROW_SHAPES[0][0], "dtype": ROW_SHAPES[0][1], "error": str(e)})
    if not args.no_epoch:
        try:
            doc["epoch"] = _epoch_figures(args, Path(str(args.out) + "-epoch"))
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
