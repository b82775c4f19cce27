"""What a layer-wise run keeps on disk: layer tables read and written by partition, the work directory.

:class:`_RowRanges` reads rows ``[a, b)`` of a row-major file (a dataset's
features or a layer's table) with direct I/O, checking a table's partitions
against their checksums; :class:`_TableWriter` writes one layer's table
partition by partition and commits it (truncate, fsync, rename);
:class:`_Work` is the work directory beside the output (``state.json``:
the run's key and the committed layers). :mod:`lightning_ooc.infer.run`
(homogeneous) and :mod:`lightning_ooc.infer.hetero` (a table per node type)
run on them.

    >>> work_dir_for(Path("/data/out")).name
    '.out.layerwise'
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import xxhash
from torch import Tensor

from lightning_ooc.data.commit import fsync_dir, write_json_last
from lightning_ooc.data.format import NpyStreamWriter
from lightning_ooc.data.writer import WriteTarget
from lightning_ooc.embed.buckets import EdgeBuckets
from lightning_ooc.errors import InputError, LightningOOCError
from lightning_ooc.io.bulk import PAGE, BulkFile, aligned_empty, round_up
from lightning_ooc.io.errors import FeatureReadError

log = logging.getLogger("lightning_ooc")

__all__ = ["TableChecksumError", "LayerwiseResult", "work_dir_for"]

STATE_FILE = "state.json"

STATE_PENDING = ".state.json.partial"

WORK_VERSION = 2  # 2: edge buckets recorded by name


class TableChecksumError(LightningOOCError):
    """A layer's table on disk no longer holds what was written to it.

        >>> issubclass(TableChecksumError, LightningOOCError)
        True
    """


@dataclass
class LayerwiseResult:
    """What :func:`layerwise` did: the dataset written, the plan, and per layer seconds and bytes moved.

        >>> LayerwiseResult(Path("x"), None, None, []).resumed_from
        0
    """

    out: Path
    npy: Path | None
    plan: Any  # the LayerwisePlan (or the HeteroLayerwisePlan) it ran
    layers: list[dict[str, Any]]
    resumed_from: int = 0


class _RowRanges:
    """Rows ``[a, b)`` of a row-major file (dataset features or a layer's table) as float32, with direct I/O."""

    def __init__(self, path: Path, offset: int, width: int, np_dtype: np.dtype, torch_dtype: torch.dtype,
                 num_rows: int, checksums: list[str] | None = None):  # fmt: skip
        self.path, self.offset, self.width = path, int(offset), int(width)
        self.np_dtype, self.torch_dtype = np.dtype(np_dtype), torch_dtype
        self.row_bytes = self.width * self.np_dtype.itemsize
        self.size = self.offset + num_rows * self.row_bytes
        actual = path.stat().st_size
        if actual < self.size:
            fix = ("remove the work directory it is in and run the inference again" if checksums is not None else
                   "the dataset's feature file was truncated: check it with lightning-ooc verify")
            raise FeatureReadError(0, f"holds {actual} bytes, fewer than its {num_rows} rows need ({self.size}); "
                                   f"{fix}", path)  # fmt: skip
        self.file = BulkFile(path, "r")
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.checksums = checksums  # per partition, for a layer's table (read with ``part``)
        self.bytes_read = 0
        self.seconds = 0.0

    def read(self, a: int, b: int, part: int | None = None) -> Tensor:
        t0 = time.perf_counter()
        try:
            return self._read(a, b, part)
        finally:
            self.seconds += time.perf_counter() - t0

    def _read(self, a: int, b: int, part: int | None) -> Tensor:
        start, end = self.offset + a * self.row_bytes, self.offset + b * self.row_bytes
        align = max(self.file.align, 1)
        s0 = start // align * align
        e_direct = min(round_up(end, align), self.size // align * align)
        e_direct = max(e_direct, s0)
        buf = aligned_empty(max(round_up(end, align) - s0, 1))
        if e_direct > s0:
            self.file.read_into(s0, buf[: e_direct - s0])
        if end > e_direct:  # the file's unaligned tail
            tail = os.pread(self.fd, end - e_direct, e_direct)
            if len(tail) != end - e_direct:
                raise FeatureReadError(0, f"ended early at byte {e_direct + len(tail)}", self.path)
            buf[e_direct - s0 : end - s0] = torch.frombuffer(bytearray(tail), dtype=torch.uint8)
        self.bytes_read += max(e_direct - s0, 0) + max(end - e_direct, 0)
        raw = buf[start - s0 : end - s0]
        if self.checksums is not None and part is not None:
            got = xxhash.xxh3_128_hexdigest(raw.numpy())
            if got != self.checksums[part]:
                raise TableChecksumError(f"{self.path}: partition {part} (rows {a}..{b}) does not match the checksum "
                                         "written with it: the file changed on disk; remove it (or its whole "
                                         "work directory) and run the inference again")  # fmt: skip
        t = raw.view(torch.uint8)
        if self.torch_dtype == torch.bfloat16:
            rows = t.view(torch.int16).view(torch.bfloat16)
        else:
            rows = torch.from_numpy(raw.numpy().view(self.np_dtype))
        return rows.reshape(b - a, self.width).float()

    def close(self) -> None:
        self.file.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _TableWriter:
    """One layer's output table: float32 rows written partition by partition with direct I/O, then committed."""

    def __init__(self, path: Path, num_rows: int, width: int, bounds: np.ndarray):
        self.path, self.width, self.bounds = path, int(width), bounds
        self.row_bytes = 4 * self.width
        self.size = num_rows * self.row_bytes
        self.partial = path.with_name(path.name + ".partial")
        if self.partial.exists():
            self.partial.unlink()
        self.file = BulkFile(self.partial, "w", size=round_up(self.size))
        self.checksums: list[str | None] = [None] * (len(bounds) - 1)
        self.bytes_written = 0
        self.seconds = 0.0

    def write(self, part: int, rows: Tensor) -> None:
        t0 = time.perf_counter()
        try:
            self._write(part, rows)
        finally:
            self.seconds += time.perf_counter() - t0

    def _write(self, part: int, rows: Tensor) -> None:
        a, b = int(self.bounds[part]), int(self.bounds[part + 1])
        data = rows.detach().to(torch.float32).contiguous()
        if tuple(data.shape) != (b - a, self.width):
            raise InputError(f"layer output for partition {part} has shape {tuple(data.shape)}; expected "
                             f"({b - a}, {self.width})")  # fmt: skip
        n = data.numel() * 4
        buf = aligned_empty(n)
        buf[:n].copy_(data.view(-1).view(torch.uint8))
        if round_up(n) > n:
            buf[n:].zero_()
        self.bytes_written += self.file.write_from(a * self.row_bytes, buf[: round_up(n)])
        self.checksums[part] = xxhash.xxh3_128_hexdigest(data.numpy())

    def commit(self) -> list[str]:
        missing = [p for p, c in enumerate(self.checksums) if c is None]
        if missing:
            raise LightningOOCError(f"{self.partial}: partitions {missing[:5]} were never written")
        self.file.sync()
        self.file.close()
        os.truncate(self.partial, self.size)
        fd = os.open(self.partial, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(self.partial, self.path)
        fsync_dir(self.path.parent)
        return [str(c) for c in self.checksums]

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        try:
            self.partial.unlink()
        except FileNotFoundError:
            pass


def _row_unit(widths: list[int]) -> int:
    """Rows per partition step so every float32 table's partition starts on a page."""
    unit = 1
    for w in widths:
        rb = 4 * max(int(w), 1)
        u = PAGE // math.gcd(PAGE, rb)
        unit = unit * u // math.gcd(unit, u)
    return unit


def _bounds(n_nodes: int, part_nodes: int, unit: int) -> np.ndarray:
    """Partition bounds: about ``part_nodes`` nodes each, every start a multiple of ``unit`` (the last ends at
    ``n_nodes``)."""
    n = max(1, math.ceil(n_nodes / max(1, part_nodes)))
    step = max(unit, -(-math.ceil(n_nodes / n) // unit) * unit)
    bounds = np.unique(np.minimum(np.arange(0, n_nodes + step, step, dtype=np.int64), n_nodes))
    if bounds[-1] != n_nodes:
        bounds = np.append(bounds, n_nodes)
    return bounds


def _run_key(steps: Any, ds: Any, plan: Any) -> str:
    """What identifies a run for resuming: the dataset, the layers and their weights, the partitions."""
    h = hashlib.sha256()
    h.update(str(ds.identity).encode())
    h.update(plan.layout().encode())
    h.update(repr(steps.module).encode())
    fn = getattr(steps.between, "__func__", steps.between)  # what comes between layers: its name and code
    h.update(getattr(fn, "__qualname__", repr(fn)).encode())
    code = getattr(fn, "__code__", None)
    if code is not None:
        h.update(code.co_code)
        h.update(repr(code.co_consts).encode())
    for name, t in sorted(steps.module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def work_dir_for(out: Path) -> Path:
    """Where a run writing ``out`` keeps its layer tables and buckets until it commits (beside ``out``).

    >>> work_dir_for(Path("/data/pred")).as_posix()
    '/data/.pred.layerwise'
    """
    return out.parent / f".{out.name}.layerwise"


class _Work:
    """The work directory: ``state.json`` (the run's key, the committed layers), the buckets, layer tables."""

    def __init__(self, root: Path, key: str):
        self.root = root
        self.key = key
        root.mkdir(parents=True, exist_ok=True)
        state = self._read()
        if state is None or state.get("key") != key or state.get("version") != WORK_VERSION:
            if state is not None:
                log.info("layer-wise inference: %s holds another run's layers (other dataset, weights or "
                         "partitions); starting over", root)  # fmt: skip
            for p in root.iterdir():
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            state = {"version": WORK_VERSION, "key": key, "layers": [], "buckets": {}}
            self._write(state)
        self.state = state
        for p in root.glob("*.partial"):  # what an interrupted layer (or bucketing) left
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
        for p in root.glob("acc-*.bin"):
            p.unlink()

    def _read(self) -> dict | None:
        try:
            return json.loads((self.root / STATE_FILE).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def _write(self, state: dict) -> None:
        write_json_last(self.root, STATE_FILE, state, STATE_PENDING)
        fsync_dir(self.root)

    def commit_layer(self, index: int, **entry: Any) -> None:
        """Record layer ``index`` as done: one table (``file``, ``width``, ``checksums``) or one per node type
        (``tables``: type -> such a record)."""
        layers = [e for e in self.state["layers"] if e["index"] < index]
        layers.append({"index": index, **entry})
        self.state["layers"] = layers
        self._write(self.state)

    def edge_buckets(self, name: str, write: Callable[[Path], dict]) -> EdgeBuckets:
        """The edge buckets ``name`` of this run (the stored graph's, or one relation's), written once: ``write(dir)``
        fills a partial directory and returns their metadata, the directory is renamed into place and recorded in
        ``state.json``. Buckets a stopped run left unrecorded are written again."""
        root = self.root / name
        info = self.state["buckets"].get(name)
        if info is None:
            part = self.root / f"{name}.partial"
            for p in (root, part):
                if p.exists():
                    shutil.rmtree(p)
            part.mkdir()
            info = write(part)
            os.replace(part, root)
            fsync_dir(self.root)
            self.state["buckets"][name] = info
            self._write(self.state)
        return EdgeBuckets(root, "graph", info)

    def done_layers(self) -> list[dict]:
        done = []
        for k, entry in enumerate(self.state["layers"]):
            tables = entry["tables"].values() if "tables" in entry else [entry]
            if entry["index"] != k or not all((self.root / t["file"]).exists() for t in tables):
                break
            done.append(entry)
        return done


def _verify_table(path: Path, entry: dict, bounds: np.ndarray) -> None:
    """Read a layer's table partition by partition against its checksums (:class:`TableChecksumError` if one
    changed)."""
    rows = _RowRanges(path, 0, entry["width"], np.dtype(np.float32), torch.float32, int(bounds[-1]),
                      entry["checksums"])  # fmt: skip
    try:
        for p in range(len(bounds) - 1):
            rows.read(int(bounds[p]), int(bounds[p + 1]), p)
    finally:
        rows.close()


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _export_npy(table: Path, num_rows: int, width: int, npy: Path, overwrite: bool) -> Path:
    part = npy.with_name(f".{npy.name}.partial")
    w = NpyStreamWriter(part, np.float32, num_rows, row_shape=(width,))
    try:
        rows_per = max(1, (64 << 20) // (4 * width))
        data = np.memmap(table, dtype=np.float32, mode="r", shape=(num_rows, width))
        for a in range(0, num_rows, rows_per):
            w.write(np.asarray(data[a : a + rows_per]))
        del data
        w.close()
        if npy.exists() and not overwrite:
            raise InputError(f"{npy} exists; remove it or pass overwrite=True (--overwrite)")
        os.replace(part, npy)
        fsync_dir(npy.parent)
    except BaseException:
        try:
            part.unlink()
        except FileNotFoundError:
            pass
        raise
    return npy


def _edge_chunks(runner: Any, buckets: Any, a: int, b: int, chunk: int, counters: dict, bar: Any) -> Any:
    """The stored bucket rows ``[a, b)`` as ``(src, dst)``, ``chunk`` edges at a time: their bytes counted in
    ``counters["edges"]``, the seconds reading them in ``runner.edge_seconds``, the edges on ``bar``."""
    for c0 in range(a, b, chunk):
        t0 = time.perf_counter()
        s, d, _ = buckets.rows(c0, min(b, c0 + chunk))
        runner.edge_seconds += time.perf_counter() - t0
        counters["edges"] += int(s.numel()) * buckets.edge_bytes
        bar.update(int(s.numel()))
        yield s, d


def _run_layers(ds: Any, plan: Any, key: str, out: Path, *, overwrite: bool, keep_work: bool,
                start: Callable[[_Work], Callable[[Any, list], dict]],
                commit: Callable[[_Work, dict, WriteTarget], Path],
                export: Callable[[_Work, dict], Path | None]) -> LayerwiseResult:  # fmt: skip
    """What every layer-wise run does around its layers: take ``out`` (its lock, and a refused overwrite reported
    before any work), open the work directory keyed by ``key`` and resume after its committed layers, run the
    others (``start(work)`` gives ``run(layer_plan, done)``), then ``commit`` the last layer's record as the
    dataset at ``out`` and ``export`` it; a failure leaves nothing at ``out``, the committed layers in the work
    directory."""
    target = WriteTarget(out, overwrite=overwrite, inputs=[Path(ds.root)])
    stats: list[dict[str, Any]] = []
    try:
        work = _Work(work_dir_for(target.target), key)
        done = work.done_layers()
        resumed = len(done)
        if resumed:
            log.info("layer-wise inference: resuming at layer %d of %d (%s holds the ones before)", resumed + 1,
                     len(plan.layers), work.root)  # fmt: skip
        with torch.no_grad():
            run = start(work)
            for lp in plan.layers[resumed:]:
                stats.append(run(lp, done))
                done = work.done_layers()
        path = commit(work, done[-1], target)
        npy_path = export(work, done[-1])
    except BaseException:
        if not target.committed:
            target.abort()
        raise
    if not keep_work:
        shutil.rmtree(work.root, ignore_errors=True)
    return LayerwiseResult(path, npy_path, plan, stats, resumed)
