"""What a layer-wise run keeps on disk: layer tables read and written by partition, the work directory.

:class:`_RowRanges` reads rows ``[a, b)`` of a row-major file (a dataset's
features or a layer's table) with direct I/O, checking a table's partitions
against their checksums; :class:`_TableWriter` writes one layer's table
partition by partition and commits it (truncate, fsync, rename);
:class:`_Work` is the work directory beside the output (``state.json``:
the run's key and the committed layers). :mod:`lightning_ooc.infer.run`
(homogeneous) and :mod:`lightning_ooc.infer.hetero_layerwise` (a table per node type)
run on them.

A stopped run resumes at its first layer not committed when the work directory's key is this run's
(:func:`_run_key`). The key covers the dataset's identity, the plan (each layer's kind and widths, the
partitions), the module's ``repr``, weights and buffers, the code of what comes between layers, and a probe:
the outputs of every layer and of what comes between them on a small fixed graph with seeded rows
(:func:`_probe_digest`). So a change that no weight shows (an activation, a value a ``between`` closure
captured, an attribute ``inference_between`` reads) changes the key wherever it changes an output on the probe,
and the run starts over. What the probe cannot see: behaviour that its rows do not exercise (a ``between``
that depends on the number of rows, on node ids or on state outside the model), and a model whose outputs
are not deterministic, which never resumes (its probe differs each time). ``layerwise(..., resume=False)``
starts over whatever the key says.

The work directory holds only what a run wrote (:data:`_WORK_NAMES`); one without a ``state.json`` of ours that
holds anything is refused, and only files of those names are ever removed from it.

    >>> work_dir_for(Path("/data/out")).name
    '.out.layerwise'
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import xxhash
from torch import Tensor, nn

from lightning_ooc.data.commit import fsync_dir, write_json_last
from lightning_ooc.data.format import NpyStreamWriter, human_bytes
from lightning_ooc.data.outputs import check_output, partial_path, sweep_partials
from lightning_ooc.data.writer import WriteTarget
from lightning_ooc.embed.buckets import EdgeBuckets, StoredGraphEdges
from lightning_ooc.errors import DatasetWriteError, InputError, LightningOOCError
from lightning_ooc.io.bulk import PAGE, BulkFile, aligned_empty, round_up
from lightning_ooc.io.io_errors import FeatureReadError


log = logging.getLogger("lightning_ooc")

__all__ = ["TableChecksumError", "LayerwiseResult", "work_dir_for"]

STATE_FILE = "state.json"

STATE_PENDING = ".state.json.partial"

WORK_VERSION = 3  # 2: edge buckets recorded by name; 3: the key holds the probe's outputs

#: what a run writes in its work directory: nothing else there is ever removed
_WORK_NAMES = re.compile(r"state\.json|\.state\.json\.partial|layer-\d+(\.[^/]+)?\.bin(\.partial)?|acc-\d+\.bin|"
                         r"messages-\d+\.bin(\.partial)?|"
                         r"gcn_degree\.npy(\.partial)?|buckets(-[^/]+)?(\.partial)?")

#: the probe graph: nodes (of every type), edges (of every relation), the seed of its edges and rows
PROBE_NODES = 16
PROBE_EDGES = 48
PROBE_SEED = 0


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


class ReadAhead:
    """``fn(item)`` for each of ``items`` in order, yielded as ``(item, value)``, the next one computed in a thread
    while the caller works on the current one (two values alive at a time). ``waited``: the seconds the caller
    waited for a value (what the overlap did not hide). A failure of ``fn`` is raised in the caller; closing the
    iteration early waits for the one value in flight.

        >>> ahead = ReadAhead(lambda i: i * i, range(4))
        >>> [v for _, v in ahead], ahead.waited >= 0
        ([0, 1, 4, 9], True)
    """

    def __init__(self, fn: Callable[[Any], Any], items: Iterable[Any]):
        self.fn, self.items = fn, list(items)
        self.waited = 0.0

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        if not self.items:
            return
        grad = torch.is_grad_enabled()  # per thread: the caller's (no_grad in inference) holds in the worker too

        def run(item: Any) -> Any:
            with torch.set_grad_enabled(grad):
                return self.fn(item)

        pool = ThreadPoolExecutor(1, thread_name_prefix="looc-infer-read")
        pending: Future | None = pool.submit(run, self.items[0])
        try:
            for k, item in enumerate(self.items):
                t0 = time.perf_counter()
                value = pending.result()
                self.waited += time.perf_counter() - t0
                pending = pool.submit(run, self.items[k + 1]) if k + 1 < len(self.items) else None
                yield item, value
                del value
        finally:
            if pending is not None:
                pending.cancel()
            pool.shutdown(wait=True)


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


def _probe_edges(num_src: int = PROBE_NODES, num_dst: int = PROBE_NODES) -> Tensor:
    """The probe graph's edges ``[2, PROBE_EDGES]``: seeded, with repeated targets, self-loops where both ends
    are one type, and a target without in-edges (the last).

        >>> e = _probe_edges()
        >>> tuple(e.shape), bool((e[1] < PROBE_NODES - 1).all()), torch.equal(e, _probe_edges())
        ((2, 48), True, True)
    """
    g = torch.Generator().manual_seed(PROBE_SEED)
    src = torch.randint(0, num_src, (PROBE_EDGES,), generator=g)
    dst = torch.randint(0, num_dst - 1, (PROBE_EDGES,), generator=g)
    if num_src == num_dst:
        src[:4] = dst[:4]
    return torch.stack([src, dst])


def _probe_rows(width: int, seed: int) -> Tensor:
    """``PROBE_NODES`` seeded rows of ``width`` columns, of both signs and several magnitudes."""
    g = torch.Generator().manual_seed(PROBE_SEED + 1 + seed)
    return torch.randn(PROBE_NODES, width, generator=g) * 3


def _probe_digest(module: nn.Module, run: Callable[[], list[Tensor]]) -> str:
    """The outputs of ``run()`` (the model's layers and what comes between them on the probe graph) hashed, their
    exact bytes (a run on other hardware that differs in the last bit recomputes its layers, nothing worse), or a
    random string where it fails or gives something not a tensor: then no run of this model resumes, and a
    warning says so and why. A layer's caches (``_cached*`` attributes: GCN's normalisation) are put back after it.

        >>> from torch import nn
        >>> lin = nn.Linear(4, 2)
        >>> _probe_digest(lin, lambda: [lin(_probe_rows(4, 0))]) == _probe_digest(lin, lambda: [lin(_probe_rows(4, 0))])
        True
    """
    saved = [(m, k, v) for m in module.modules() for k, v in vars(m).items() if k.startswith("_cached")]
    h = hashlib.sha256()
    try:
        with torch.no_grad():
            for t in run():
                h.update(str(tuple(t.shape)).encode())
                h.update(t.detach().cpu().to(torch.float32).contiguous().numpy().tobytes())
    except Exception as e:
        why = (str(e).strip().splitlines() or [""])[0]
        log.warning("layer-wise inference: resume is off for this model: it does not run on the probe graph that "
                    "keys a resumable run (%s: %s), so a stopped run starts over", type(e).__name__, why)  # fmt: skip
        return secrets.token_hex(16)
    finally:
        for m, k, v in saved:
            setattr(m, k, v)
    return h.hexdigest()


def _run_key(steps: Any, ds: Any, plan: Any, probe: str) -> str:
    """What identifies a run for resuming: the dataset, the plan's layers and partitions, the module (its
    ``repr``, weights and buffers), the code of what comes between layers, and ``probe``
    (:func:`_probe_digest`: the outputs on a fixed graph, which see what no weight shows)."""
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
    h.update(probe.encode())
    return h.hexdigest()


def work_dir_for(out: Path) -> Path:
    """Where a run writing ``out`` keeps its layer tables and buckets until it commits (beside ``out``).

    >>> work_dir_for(Path("/data/pred")).as_posix()
    '/data/.pred.layerwise'
    """
    return out.parent / f".{out.name}.layerwise"


class _Work:
    """The work directory: ``state.json`` (the run's key, the committed layers), the buckets, layer tables.

    Taken only where it is new, empty, or holds a ``state.json`` of ours (anything else is refused, nothing
    touched); another run's layers there (another key) are removed, by name (:data:`_WORK_NAMES`), and so is
    this run's where ``resume`` is False.
    """

    def __init__(self, root: Path, key: str, *, resume: bool = True):
        self.root = root
        self.key = key
        if os.path.lexists(root) and not stat.S_ISDIR(os.lstat(root).st_mode):
            raise DatasetWriteError(f"{root}: is a file or a link, where layer-wise inference keeps its layers (beside "
                                    "out=), so nothing was touched: move it away or choose another out=")  # fmt: skip
        root.mkdir(parents=True, exist_ok=True)
        state = self._read()
        if state is None:
            foreign = sorted(p.name for p in root.iterdir() if p.name != STATE_PENDING)
            if foreign:
                raise DatasetWriteError(
                    f"{root}: holds files layer-wise inference did not write ({', '.join(foreign[:3])}"
                    f"{', ...' if len(foreign) > 3 else ''}) and no state.json of its own; it keeps its layers "
                    "there (beside out=) and removes them, so nothing was touched: move them away or choose another "
                    "out="
                )  # fmt: skip
        if state is None or state.get("key") != key or state.get("version") != WORK_VERSION or not resume:
            if state is not None:
                same = state.get("key") == key and state.get("version") == WORK_VERSION
                why = ("this run's layers and resume=False" if same else
                       "another run's layers (other dataset, model, what comes between layers, weights or partitions)")
                log.info("layer-wise inference: %s holds %s; starting over", root, why)
            self._clear()
            state = {"version": WORK_VERSION, "key": key, "layers": [], "buckets": {}}
            self._write(state)
        self.state = state
        # what an interrupted layer (or bucketing) left
        for p in [*root.glob("*.partial"), *root.glob("acc-*.bin"), *root.glob("messages-*.bin")]:
            self._remove(p)

    @staticmethod
    def _remove(p: Path) -> None:
        """Remove ``p`` (a file or a directory) if a run writes one of its name (:data:`_WORK_NAMES`)."""
        if not _WORK_NAMES.fullmatch(p.name):
            return
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)

    def _clear(self) -> None:
        """Remove what a run wrote here, ``state.json`` last."""
        for p in sorted(self.root.iterdir(), key=lambda p: p.name == STATE_FILE):
            self._remove(p)

    def remove(self) -> None:
        """Remove the work directory after a commit: what a run wrote, then the directory if nothing else is in it
        (else it is left, and the log says so)."""
        try:
            self._clear()
            self.root.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            log.info("layer-wise inference: %s also holds files it did not write; left there", self.root)

    def _read(self) -> dict | None:
        """The ``state.json`` here if it is ours (a run's key and layers), else None (absent); one that is not ours
        is refused."""
        path = self.root / STATE_FILE
        if not os.path.lexists(path):
            return None
        try:
            state = json.loads(path.read_text()) if stat.S_ISREG(os.lstat(path).st_mode) else None
        except (OSError, ValueError, UnicodeDecodeError):
            state = None
        if not (isinstance(state, dict) and isinstance(state.get("key"), str) and isinstance(state.get("layers"), list)
                and isinstance(state.get("version"), int)):  # fmt: skip
            raise DatasetWriteError(f"{path}: is not the state of a layer-wise run; {self.root} is where one keeps "
                                    "its layers (beside out=), so nothing was touched: move it away or choose "
                                    "another out=")  # fmt: skip
        state.setdefault("buckets", {})
        return state

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
        """The committed layers, in order, up to the last whose tables are all there: a layer whose tables were
        dropped (:meth:`drop_tables_before`) counts as done where a later one's are there."""
        done, usable = [], 0
        for k, entry in enumerate(self.state["layers"]):
            tables = entry["tables"].values() if "tables" in entry else [entry]
            if entry["index"] != k:
                break
            present = all((self.root / t["file"]).exists() for t in tables)
            if not present and not entry.get("dropped"):
                break
            done.append(entry)
            if present:
                usable = len(done)
        return done[:usable]

    def drop_tables_before(self, index: int) -> None:
        """Remove the tables of the committed layers before ``index`` (no later layer reads them: layer
        ``index + 1`` reads layer ``index``'s), recording them as dropped first, so that a run stopped in between
        still resumes from layer ``index``."""
        entries = [e for e in self.state["layers"] if e["index"] < index and not e.get("dropped")]
        if not entries:
            return
        for e in entries:
            e["dropped"] = True
        self._write(self.state)
        for e in entries:
            for tab in (e["tables"].values() if "tables" in e else [e]):
                self._remove(self.root / tab["file"])


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


def _check_npy(npy: str | os.PathLike, inputs: list[Any], out: Path, overwrite: bool) -> Path:
    """``npy=`` as an output (:func:`~lightning_ooc.data.outputs.check_output`: never an input of the run, a file
    a dataset uses in place included, never inside a dataset, an existing file only with ``overwrite``), and never
    inside ``out`` or the work directory beside it; returns it absolute."""
    path = check_output(npy, inputs=inputs, overwrite=overwrite, option="npy=")
    at, o = path.resolve(), Path(os.path.abspath(out))
    for d in (o.resolve(), work_dir_for(o).resolve()):
        if at == d or at.is_relative_to(d):
            raise DatasetWriteError(f"{path}: npy= lies in {d}, which this run writes, so nothing was touched; choose "
                                    "npy= outside it")  # fmt: skip
    return path


def _export_npy(table: Path, num_rows: int, width: int, npy: Path, overwrite: bool, inputs: list[Any]) -> Path:
    """The table as the ``.npy`` file ``npy``, written beside it under a name of this writer's own
    (:func:`~lightning_ooc.data.outputs.partial_path`; what killed writers left there is removed first,
    :func:`~lightning_ooc.data.outputs.sweep_partials`) and renamed into place once
    :func:`~lightning_ooc.data.outputs.check_output` allows it again."""
    npy.parent.mkdir(parents=True, exist_ok=True)
    sweep_partials(npy)
    part = partial_path(npy)
    w = NpyStreamWriter(part, np.float32, num_rows, row_shape=(width,))
    try:
        rows_per = max(1, (64 << 20) // (4 * width))
        data = np.memmap(table, dtype=np.float32, mode="r", shape=(num_rows, width))
        for a in range(0, num_rows, rows_per):
            w.write(np.asarray(data[a : a + rows_per]))
        del data
        w.close()
        check_output(npy, inputs=inputs, overwrite=overwrite, option="npy=")
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


#: bytes per edge that bucketing holds while it sorts a chunk of edges (the ids, their keys, the order, the
#: sorted copies: measured 67)
BUCKET_BYTES_PER_EDGE = 80


def _graph_edges(csc: Any, memory: int, name: str | None = None) -> StoredGraphEdges:
    """A stored graph's edges (a dataset's, or one relation's CSC, named by ``name``) as
    :func:`~lightning_ooc.embed.buckets.write_buckets` reads them, in chunks of :func:`_bucket_chunk` edges."""
    return StoredGraphEdges(csc, name=name, chunk_edges=_bucket_chunk(memory))


def _bucket_chunk(memory: int) -> int:
    """Edges per chunk that bucketing sorts at a time: about ``memory / 2 / BUCKET_BYTES_PER_EDGE`` (64K to 4M),
    so that its temporaries stay within half the run's memory.

        >>> _bucket_chunk(1 << 20), _bucket_chunk(1 << 40)
        (65536, 4194304)
    """
    return int(min(1 << 22, max(1 << 16, memory // 2 // BUCKET_BYTES_PER_EDGE)))


def check_disk(root: Path, need: dict[str, int]) -> None:
    """Refuse, in one line naming ``root`` and the parts, a run whose writes (``need``: bytes by what they hold)
    do not fit the free space of ``root``'s file system: before any work, rather than hours in.

        >>> import tempfile
        >>> check_disk(Path(tempfile.mkdtemp()), {"edge buckets": 1 << 20}) is None
        True
        >>> check_disk(Path(tempfile.mkdtemp()), {"edge buckets": 1 << 60, "layer tables": 1 << 60})
        Traceback (most recent call last):
        ...
        lightning_ooc.errors.DatasetWriteError: layer-wise inference needs about 2097152.00 TiB of disk at ... (edge buckets 1048576.00 TiB, layer tables 1048576.00 TiB), and its file system has ... free: free space there, or write out= (its work directory sits beside it) on a file system with room
    """
    total = sum(need.values())
    free = shutil.disk_usage(root).free
    if total <= free:
        return
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in need.items() if v)
    raise DatasetWriteError(f"layer-wise inference needs about {human_bytes(total)} of disk at {root} ({parts}), and "
                            f"its file system has {human_bytes(free)} free: free space there, or write out= (its "
                            "work directory sits beside it) on a file system with room")  # fmt: skip


def _run_layers(ds: Any, plan: Any, key: str, out: Path, *, overwrite: bool, keep_work: bool,
                start: Callable[[_Work], Callable[[Any, list], dict]],
                commit: Callable[[_Work, dict, WriteTarget], Path],
                export: Callable[[_Work, dict], Path | None], resume: bool = True) -> LayerwiseResult:  # fmt: skip
    """What every layer-wise run does around its layers: take ``out`` (its lock, and a refused overwrite reported
    before any work), open the work directory keyed by ``key`` (checked as an output of the run: never an input,
    never a directory of someone else's) and resume after its committed layers (unless ``resume`` is False), run
    the others (``start(work)`` gives ``run(layer_plan, done)``), then ``commit`` the last layer's record as the
    dataset at ``out`` and ``export`` it; a failure leaves nothing at ``out``, the committed layers in the work
    directory."""
    target = WriteTarget(out, overwrite=overwrite, inputs=[Path(ds.root)])
    stats: list[dict[str, Any]] = []
    try:
        root = check_output(work_dir_for(target.target), inputs=[Path(ds.root)], kind="directory", option="out=")
        work = _Work(root, key, resume=resume)
        done = work.done_layers()
        resumed = len(done)
        if hasattr(plan, "disk_need"):
            check_disk(work.root, plan.disk_need(resumed, buckets_written=bool(work.state.get("buckets")),
                                                 keep_work=keep_work))  # fmt: skip
        if resumed:
            log.info("layer-wise inference: resuming at layer %d of %d (%s holds the ones before)", resumed + 1,
                     len(plan.layers), work.root)  # fmt: skip
        with torch.no_grad():
            run = start(work)
            for lp in plan.layers[resumed:]:
                stats.append(run(lp, done))
                if not keep_work:  # the tables no later layer reads: two layers' tables on disk at most
                    work.drop_tables_before(lp.index)
                done = work.done_layers()
        path = commit(work, done[-1], target)
        npy_path = export(work, done[-1])
    except BaseException:
        if not target.committed:
            target.abort()
        raise
    if not keep_work:
        work.remove()
    return LayerwiseResult(path, npy_path, plan, stats, resumed)
