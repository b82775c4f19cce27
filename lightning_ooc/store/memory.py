"""Host memory: the limit this process runs under, what the datamodule allocates, and whether a plan fits.

Three parts, used by :meth:`~lightning_ooc.store.plan.StorePlan.from_budgets`:

* :func:`memory_limit` reads what this process may still allocate: the
  tightest of its memory cgroups (v1 ``memory.limit_in_bytes`` minus
  ``memory.usage_in_bytes``, v2 ``memory.max``/``memory.high`` minus
  ``memory.current``, for its own cgroup and every ancestor it can read) and
  ``MemAvailable`` of ``/proc/meminfo``. File cache (``active_file`` and
  ``inactive_file``: clean pages of mapped or read files, such as the topology
  and the link splits read through the page cache) is given back under
  pressure before anything is killed, so it is not counted as in use; what is
  (anonymous memory, shared memory, the kernel's) cannot be. Counting active
  file pages as in use (the kubelet's "working set") refused link runs whose
  presample had touched a gigabyte of a link split's pages. One kind of file
  page is counted all the same: the code and read-only data of the process's
  executable and libraries (:func:`mapped_code`, ~200 MiB of torch and its
  kin), which the cgroup charges (its ``mapped_file``) and the process touches
  all the time. Taken back, they are read again at once: runs planned as if
  they were free stalled under a 600 MiB cap, threads waiting on page faults
  (D state). The usage already includes this process (Python, torch,
  Lightning, the open dataset, the reader, the presampled batches), so what
  is planned after it is compared with what is left.
* :func:`host_tally` counts the host memory the datamodule allocates from the
  plan on, phase by phase (choosing the host cache's rows, simulating the
  buffer, building the store, training), as a function of the dataset and
  the pipeline's shape (:class:`ProcessShape`): the byte budgets that live in
  host memory, and what comes with them that no budget covers, mostly arrays
  of one entry per node of the graph. The items held before the plan
  (``indptr``, the reader's I/O slots, the presample) are listed too, for
  the record; they are already in the usage.
* :func:`check_fits` compares the peak of the tally plus a reserve for the
  rest of training with the limit; it shrinks the host cache, then (on CPU)
  the feature buffer down to its reserve, and says so, or raises
  :class:`~lightning_ooc.errors.InputError` with one message naming the limit,
  what the plan needs and what to shrink.

Where the numbers come from (``ext/`` and ``lightning_ooc/``; N nodes, s
buffer slots, k host rows, M nodes and E edges per batch):

==========================  ==========================================================  =================
phase                       allocation                                                  bytes
==========================  ==========================================================  =================
before the plan (held)      ``indptr`` (private, or in node-shared memory under "ooc")  8 N
                            the training split, loaded to presample                     8 x train
                            reader I/O slots: workers x queue_depth x 128 KiB           (registered)
                            presampled ``n_id`` and the main thread's sampler workspace
choosing hot rows           ``ds.in_degree`` (``np.diff(indptr)``, a fresh copy)        8 N
(``choose_hot``)            access counts + one ``bincount(minlength=N)`` at a time     8 N + 8 N
                            float64 score + in-degree as float64 + its quotient         24 N
                            ``torch.topk`` (a (value, index) queue of N pairs)          16 N + 16 k
simulating the buffer       counts (kept in the HotSet), a bool "in host" mask, the     8 N + N + 4 N
                            simulated buffer's node -> slot table and slot tables       + 55 s
building the store          node -> slot (int32), host cache node -> row map (int32)    4 N + 4 N
                            counts, still held by the caller until setup returns        8 N
                            per-slot tables: slot2node, stamp, refcount, valid,         54 s
                            failed, standby FIFO of 2 s + 16 (slot, stamp) pairs
                            host rows, staging, buffer rows (on CPU)                    the budgets
training                    an epoch's order of the training seeds: node ids            16 x train
                            (randperm + copy); link edge positions (int32 randperm)     4 x train
                            validation / test seeds (node ids; link edge positions)     8 x eval; 4 x eval
                            one workspace per sampler thread (node map, edge arrays)    ~ 24 E + 32 (M+E)
                            batches in flight (samplers + both queues + extractors +    (64 M + 16 E)
                            trainer and its prefetch): ids, labels, edges, leases       per batch
                            ``x`` of the trainer's two batches and a gather temporary   3 M x row bytes
                            link batches' K negatives (:class:`BatchNegatives`): their  8 K (binary 20 K)
                            indices into ``n_id`` in every batch in flight, and per     per batch
                            sampler thread the ids drawn, the seed set, ``unique``      + 56 x ids
==========================  ==========================================================  =================

The nodes a link batch's negatives bring in (and their features) are in M, presampled with them;
what the model allocates to score the negatives is in the reserve (:func:`training_reserve`), and
:func:`check_negatives` refuses negatives past the limit before the presample draws any.

The peak per node is in ``choose_hot``: 40 B per node (8 in-degree + 8 counts +
24 scores, or + 16 topk), then 16 B per node for as long as the store lives
(plus the 8 B of ``indptr`` held from the start). glibc keeps freed blocks of
up to 32 MiB in its heap (``M_MMAP_THRESHOLD`` grows to the largest block
freed), so while per-node arrays are below that size (N < 4M), freed
temporaries stay resident and are reused only by later allocations of the
same size class. How much stays varies from run to run (most runs: nothing; the
worst of six runs each: 21 B per node at 300k nodes, 48 at 1M, 69 at 3M, none at
6M): :data:`HEAP_SLACK_PER_NODE` counts the worst seen, below 4M nodes only.

Example::

    >>> from lightning_ooc.store.memory import MemoryLimit, ProcessShape, check_fits, host_tally
    >>> shape = ProcessShape(num_nodes=3_000_000, row_bytes=64, max_nodes_per_batch=40_000,
    ...                      max_edges_per_batch=60_000, train_nodes=30_000)
    >>> tally = host_tally(shape, host_rows=0, buffer_slots=1 << 20, staging_bytes=8 << 20)
    >>> {group: size >> 20 for group, size in tally.groups("choosing hot rows").items()}  # MiB
    {'per-node': 114, 'heap slack': 205}
    >>> tally.peak_phase, {group: size >> 20 for group, size in tally.groups().items()}
    ('training', {'per-node': 23, 'per-slot': 54, 'host cache': 0, 'staging': 8, 'buffer': 64, 'batches': 108, 'heap slack': 205})
    >>> fit = check_fits(shape, host_rows=524_288, buffer_slots=1 << 20, min_slots=160_000,
    ...                  staging_bytes=8 << 20, limit=MemoryLimit(4 << 30, "a test"))
    >>> fit.host_rows, fit.shrunk, fit.format()
    (524288, [], '  host memory      499.80 MiB  planned at its peak (training) + 284.25 MiB reserve, of 4.00 GiB available (a test)')
"""
from __future__ import annotations

import ctypes
import gc
import logging
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from lightning_ooc.data.format import human_bytes, parse_bytes
from lightning_ooc.errors import InputError

log = logging.getLogger("lightning_ooc")

__all__ = [
    "MemoryLimit", "memory_limit", "limit_from_setting", "MemoryItem", "HostTally", "ProcessShape", "host_tally", "MemoryFit",
    "check_fits", "edges_per_batch_bound", "sampler_workspace_bytes", "training_reserve", "process_rss", "mapped_code",
    "release_freed_memory",
    "limit_for_plan",
    "RESERVE_FIXED", "RESERVE_PER_BATCH_NODE", "RESERVE_PER_NEGATIVE", "HEAP_SLACK_PER_NODE", "BatchNegatives",
    "check_negatives",
]  # fmt: skip

#: a limit at or above this many bytes means "no limit" (cgroup v1 writes 2^63 - 4096 for none)
UNLIMITED = 1 << 60

#: kept free for what no plan can see (see :func:`training_reserve`): Lightning's fit loop, the model,
#: its optimizer state, imports made when training starts, allocator fragmentation
RESERVE_FIXED = 128 << 20
#: ... and the activations of the batch being trained, per node of the largest planned batch
RESERVE_PER_BATCH_NODE = 4096
#: ... and the model's scores of a link batch's negatives, per negative: a triplet's destination, a binary
#: pair (two embeddings gathered); see :func:`training_reserve`
RESERVE_PER_NEGATIVE = {"triplet": 4096, "binary": 6144}
#: glibc's heap retention of freed per-node temporaries (the ``bincount`` of every presampled batch,
#: the float64 scores) while they are below its 32 MiB mmap threshold: the worst seen, 69 B at 3M nodes
HEAP_SLACK_PER_NODE = 72
#: glibc's largest dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
_MMAP_THRESHOLD_MAX = 32 << 20
#: bytes per node of a batch in flight: n_id, y (8 + 8) and the store's leases (positions, slots, masks)
BATCH_BYTES_PER_NODE = 64
#: bytes per edge of a batch in flight: edge_index (2 x int64)
BATCH_BYTES_PER_EDGE = 16
#: the reader's largest merged read (a slot of its I/O buffers); see ``ext/io/reader.c``
READER_SLOT_BYTES = 128 << 10
#: bytes per negative of a link batch in flight: its int64 index into ``n_id`` (triplet:
#: ``dst_neg_index``; binary: the pair's two in ``edge_label_index`` and its float32 label)
NEGATIVE_HELD_BYTES = {"triplet": 8, "binary": 20}
#: bytes per negative id a sampler thread allocates while it draws a batch's negatives: the ids, the seed
#: set they join (``torch.cat``), ``unique``'s sort (values and order) and its inverse (51 B measured)
NEGATIVE_SAMPLING_BYTES_PER_ID = 56


# -------------------------------------------------------------------------------------------------
# the limit
# -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryLimit:
    """What this process may still allocate (``bytes``), and where that number comes from.

    ``limit`` and ``used`` are the limit and the usage it was computed from (``None``
    when unknown), ``rss`` this process's resident set size when it was read.

    >>> lim = MemoryLimit(200 << 20, "cgroup v1 /x: limit 600.00 MiB, 400.00 MiB in use")
    >>> lim.unlimited, str(lim)
    (False, '200.00 MiB available (cgroup v1 /x: limit 600.00 MiB, 400.00 MiB in use)')
    """

    bytes: int
    source: str
    limit: int | None = None
    used: int | None = None
    rss: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.bytes >= UNLIMITED

    @classmethod
    def none(cls, why: str = "memory check turned off") -> "MemoryLimit":
        """No limit: :func:`check_fits` accepts every plan."""
        return cls(UNLIMITED, why)

    def __str__(self) -> str:
        if self.unlimited:
            return f"no memory limit ({self.source})"
        return f"{human_bytes(self.bytes)} available ({self.source})"


def mapped_code(root: str | os.PathLike = "/", pid: int | str = "self") -> int | None:
    """Resident file pages of a process's private file mappings: the code and read-only data of its
    executable and shared libraries (the loader maps them private), or None where ``smaps`` cannot be read.

    From ``/proc/PID/smaps``: ``Rss`` less ``Anonymous`` (pages copied on write, already in
    ``RssAnon``) of every private mapping of a file. Shared mappings of files, the way the dataset
    maps its topology, link splits and features (``np.memmap`` read-only), are left out: their pages
    are data read as needed, and reclaiming them costs a read when a batch needs them again, while
    code pages are touched by every call.
    """
    try:
        text = (Path(root) / "proc" / str(pid) / "smaps").read_text()
    except OSError:
        return None
    total = rss = anon = 0
    private = False
    try:
        for line in text.splitlines():
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):  # a mapping: "start-end perms offset dev inode [path]"
                total += max(0, rss - anon) if private else 0
                parts = rest.split(None, 4)
                private = len(parts) >= 4 and parts[0].endswith("p") and parts[3] != "0"  # private, of a file
                rss = anon = 0
            elif private and head == "Rss:":
                rss = int(rest.split()[0]) * 1024
            elif private and head == "Anonymous:":
                anon = int(rest.split()[0]) * 1024
    except (ValueError, IndexError):
        return None
    return total + (max(0, rss - anon) if private else 0)


def process_rss(root: str | os.PathLike = "/", pid: int | str = "self", code: int | None = None) -> int | None:
    """What a process holds resident and needs resident: ``RssAnon + RssShmem`` of ``/proc/PID/status``
    (``VmRSS`` where those are missing) and its mapped code and libraries (:func:`mapped_code`; ``code``
    when the caller read it already), or None. Other pages of mapped files (the rest of ``RssFile``:
    the dataset's maps) are left out: they are given back under pressure and read again when needed."""
    fields = _status(root, pid)
    if fields is None:
        return None
    if "RssAnon" in fields:
        if code is None:
            code = mapped_code(root, pid)
        return fields["RssAnon"] + fields.get("RssShmem", 0) + (code or 0)
    return fields.get("VmRSS")


def _status(root: str | os.PathLike, pid: int | str) -> dict[str, int] | None:
    """``VmRSS``, ``RssAnon``, ``RssFile`` and ``RssShmem`` of ``/proc/PID/status`` in bytes (those present)."""
    fields: dict[str, int] = {}
    try:
        for line in (Path(root) / "proc" / str(pid) / "status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return fields


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, *keys: str) -> int | None:
    """The first of ``keys`` found in a ``memory.stat`` file."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    values = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            values[parts[0]] = int(parts[1])
    return next((values[k] for k in keys if k in values), None)


def _file_cache(path: Path, prefix: str) -> int | None:
    """The clean file cache of a ``memory.stat``: ``active_file + inactive_file`` less the pages
    still to be written (``dirty`` and ``writeback``, v2's ``file_dirty`` and ``file_writeback``),
    v1's hierarchical ``total_`` figures where present: pages the kernel reclaims before it kills."""
    parts = [_stat_value(path, f"{prefix}{k}", k) for k in ("active_file", "inactive_file")]
    if all(p is None for p in parts):
        return None
    unwritten = sum(_stat_value(path, f"{prefix}{k}", k, f"file_{k}") or 0 for k in ("dirty", "writeback"))
    return max(0, sum(p or 0 for p in parts) - unwritten)


def _unescape(path: str) -> str:
    """Undo the octal escapes of ``/proc/*/mountinfo`` (``\\040`` for a space)."""
    if "\\" not in path:
        return path
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and i + 4 <= len(path) and path[i + 1 : i + 4].isdigit():
            out.append(chr(int(path[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def _mounts(root: Path, pid: str) -> list[tuple[str, str, str, str]]:
    """``(fstype, super options, mount root, mount point)`` of every cgroup mount, from mountinfo."""
    try:
        lines = (root / "proc" / pid / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        try:
            sep = parts.index("-", 6)
            fstype, opts = parts[sep + 1], parts[sep + 3] if len(parts) > sep + 3 else ""
        except (ValueError, IndexError):
            continue
        if fstype in ("cgroup", "cgroup2"):
            out.append((fstype, opts, _unescape(parts[3]), _unescape(parts[4])))
    return out


def _cgroup_dirs(root: Path, pid: str) -> list[tuple[str, Path, Path]]:
    """``(version, leaf directory, mount point)`` of this process's memory cgroups (v1 and/or v2)."""
    try:
        lines = (root / "proc" / pid / "cgroup").read_text().splitlines()
    except OSError:
        return []
    v1_path = v2_path = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            v1_path = parts[2]
        elif parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
    mounts = _mounts(root, pid)
    found = []
    for version, path in (("v1", v1_path), ("v2", v2_path)):
        if path is None:
            continue
        if version == "v1":
            cands = [(r, mp) for t, o, r, mp in mounts if t == "cgroup" and "memory" in o.split(",")]
            cands = cands or [("/", "/sys/fs/cgroup/memory")]
        else:
            cands = [(r, mp) for t, o, r, mp in mounts if t == "cgroup2"]
            cands = cands or [("/", "/sys/fs/cgroup"), ("/", "/sys/fs/cgroup/unified")]
        for mnt_root, mnt_point in cands:
            top = root / mnt_point.lstrip("/")
            rel = os.path.relpath(path, mnt_root) if path.startswith(mnt_root) else "."
            leaf = (top / rel).resolve() if rel != "." else top
            if not str(leaf).startswith(str(top)) or not leaf.is_dir():
                leaf = top  # a cgroup namespace or a mount of this cgroup only: the mount is the cgroup
            if not top.is_dir():
                continue
            if version == "v2" and not (leaf / "memory.current").exists() and not (leaf / "memory.max").exists():
                continue  # a v2 hierarchy without the memory controller (hybrid systemd layouts)
            found.append((version, leaf, top))
            break
    return found


def _shown(root: Path, path: Path) -> str:
    """``path`` as the process sees it (without a test's fake root)."""
    try:
        return "/" + str(path.relative_to(root.resolve() if root != Path("/") else root)).lstrip("/")
    except ValueError:
        return str(path)


def _mapped_file(path: Path, prefix: str) -> int:
    """Pages of files mapped by the cgroup's processes that it is charged for, shared memory left out
    (``mapped_file``, v2's ``file_mapped``, count both; shared memory is anonymous to the LRU lists, so
    in use already)."""
    mapped = _stat_value(path, f"{prefix}mapped_file", "mapped_file", "file_mapped") or 0
    shmem = _stat_value(path, f"{prefix}shmem", "shmem") or 0
    return max(0, mapped - shmem)


def _cgroup_limits(root: Path, pid: str, code: int = 0, data: int = 0) -> list[MemoryLimit]:
    """One :class:`MemoryLimit` per limit of every readable memory cgroup level of the process.

    In use at a level: its usage less its clean file cache, plus the process's mapped code
    (``code`` bytes, see :func:`mapped_code`) as far as the level is charged for mapped file
    pages other than the process's data maps (``data`` bytes): a page is charged to the cgroup
    that first faulted it in, so libraries another cgroup loaded first are not charged here."""
    out = []
    for version, leaf, top in _cgroup_dirs(root, pid):
        d = leaf
        leaf_used = None
        levels = []
        while True:
            levels.append(d)
            if d == top or top not in d.parents:
                break
            d = d.parent
        for d in levels:
            prefix = "total_" if version == "v1" else ""
            if version == "v1":
                files = [("memory.limit_in_bytes", _read_int(d / "memory.limit_in_bytes"))]
                usage = _read_int(d / "memory.usage_in_bytes")
            else:
                files = [("memory.max", _read_int(d / "memory.max")), ("memory.high", _read_int(d / "memory.high"))]
                usage = _read_int(d / "memory.current")
            if usage is None:
                continue
            cache = _file_cache(d / "memory.stat", prefix) or 0
            # the process's code and libraries, where this level is charged for them (never more than
            # the file cache taken off: they are part of it)
            charged = min(code, max(0, _mapped_file(d / "memory.stat", prefix) - data), cache) if code else 0
            used = max(0, usage - cache + charged)
            if leaf_used is None:
                leaf_used = used
            of_it = f" ({human_bytes(charged)} of it mapped code and libraries)" if charged else ""
            for name, limit in files:
                if limit is None or limit >= UNLIMITED:
                    continue
                out.append(MemoryLimit(
                    max(0, limit - used), f"cgroup {version} {_shown(root, d)}: {name} {human_bytes(limit)}, "
                    f"{human_bytes(used)} in use{of_it}", limit=limit, used=used,
                ))  # fmt: skip
        if version == "v1" and leaf_used is not None:  # ancestors this process cannot see (a namespace)
            limit = _stat_value(leaf / "memory.stat", "hierarchical_memory_limit")
            if limit is not None and limit < UNLIMITED and all(m.limit != limit for m in out):
                out.append(MemoryLimit(
                    max(0, limit - leaf_used), f"cgroup v1 {_shown(root, leaf)}: hierarchical_memory_limit "
                    f"{human_bytes(limit)}, {human_bytes(leaf_used)} in use here", limit=limit, used=leaf_used,
                ))  # fmt: skip
    return out


def _meminfo_limit(root: Path, code: int = 0) -> MemoryLimit | None:
    """``MemAvailable`` less the process's mapped code (``code`` bytes): MemAvailable counts the page
    cache as available, the pages of the libraries this process runs included."""
    try:
        lines = (root / "proc" / "meminfo").read_text().splitlines()
    except OSError:
        return None
    kb = {}
    for line in lines:
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            kb[parts[0]] = int(parts[1]) * 1024
    total = kb.get("MemTotal")
    if "MemAvailable" in kb:
        avail, what = kb["MemAvailable"], "MemAvailable"
    elif "MemFree" in kb:  # kernels before 3.14
        avail, what = kb["MemFree"] + kb.get("Buffers", 0) + kb.get("Cached", 0), "MemFree + Buffers + Cached"
    else:
        return None
    of = f" of MemTotal {human_bytes(total)}" if total else ""
    less = f" less {human_bytes(code)} of this process's mapped code and libraries" if code else ""
    left = max(0, avail - code)
    return MemoryLimit(left, f"{what} {human_bytes(avail)}{of} in /proc/meminfo{less}", limit=total,
                       used=None if total is None else total - left)  # fmt: skip


def memory_limit(root: str | os.PathLike = "/", pid: int | str = "self") -> MemoryLimit:
    """What this process may still allocate: the tightest of its memory cgroups and ``MemAvailable``.

    Every level from the process's own memory cgroup up to the root of the
    mounted hierarchy is read (cgroup v1: ``memory.limit_in_bytes`` minus
    ``memory.usage_in_bytes``; v2: ``memory.max`` and ``memory.high`` minus
    ``memory.current``; "max" or ~2^63 means no limit), with clean file cache
    (active or inactive, less dirty and writeback pages) counted as free, except the
    process's mapped code and libraries where the cgroup is charged for them
    (``mapped_file``); then ``MemAvailable`` of ``/proc/meminfo``, less that code. ``root`` is
    where ``/proc`` and ``/sys`` are found (tests point it at a fake tree).

    >>> import tempfile, pathlib
    >>> fake = pathlib.Path(tempfile.mkdtemp())
    >>> (fake / "proc/self").mkdir(parents=True)
    >>> _ = (fake / "proc/self/cgroup").write_text("4:memory:/job\\n")
    >>> _ = (fake / "proc/meminfo").write_text("MemTotal: 8388608 kB\\nMemAvailable: 4194304 kB\\n")
    >>> job = fake / "sys/fs/cgroup/memory/job"
    >>> job.mkdir(parents=True)
    >>> for name, value in [("limit_in_bytes", 600 << 20), ("usage_in_bytes", 250 << 20)]:
    ...     _ = (job / f"memory.{name}").write_text(str(value))
    >>> _ = (job / "memory.stat").write_text("total_inactive_file 52428800\\n")
    >>> lim = memory_limit(fake)
    >>> lim.bytes >> 20, lim.source
    (400, 'cgroup v1 /sys/fs/cgroup/memory/job: memory.limit_in_bytes 600.00 MiB, 200.00 MiB in use')
    """
    root_p = Path(root)
    pid_s = str(pid)
    code = mapped_code(root_p, pid_s) or 0
    status = _status(root_p, pid_s) or {}
    data = max(0, status.get("RssFile", 0) - code)  # pages of shared file maps: the dataset's
    cands = _cgroup_limits(root_p, pid_s, code, data)
    mem = _meminfo_limit(root_p, code)
    if mem is not None:
        cands.append(mem)
    rss = process_rss(root_p, pid_s, code)
    if not cands:
        return MemoryLimit(UNLIMITED, "no cgroup memory limit and no /proc/meminfo found", rss=rss)
    best = min(cands, key=lambda m: m.bytes)  # stable: a cgroup wins a tie with MemAvailable
    return MemoryLimit(best.bytes, best.source, best.limit, best.used, rss)


def limit_from_setting(setting: int | str | None, root: str | os.PathLike = "/") -> MemoryLimit:
    """The limit a ``memory_limit`` setting stands for: ``"auto"`` (:func:`memory_limit`), a size (this
    process's total, less what it already holds) or ``None`` (no check).

    >>> limit_from_setting(None).unlimited
    True
    >>> lim = limit_from_setting("64GiB")
    >>> lim.limit == 64 << 30 and lim.bytes == lim.limit - (lim.rss or 0) and lim.source.startswith("memory_limit=64GiB")
    True
    """
    if setting is None:
        return MemoryLimit.none("memory_limit=None")
    if setting == "auto":
        return memory_limit(root)
    total = parse_bytes(setting)
    rss = process_rss(root) or 0
    return MemoryLimit(max(0, total - rss), f"memory_limit={setting}, {human_bytes(rss)} held by this process",
                       limit=total, used=rss, rss=rss or None)  # fmt: skip


#: below this much available memory a plan pays for a full garbage collection before it reads the limit
COLLECT_BELOW = 4 << 30


def limit_for_plan(setting: int | str | None, root: str | os.PathLike = "/") -> MemoryLimit:
    """The limit a plan is checked against, read after freed memory went back to the kernel.

    Freed heap pages are always handed back first (``malloc_trim``: cheap). A full garbage
    collection, which also frees what a closed stage left in reference cycles, costs a
    fraction of a second in a process holding torch and Lightning, so it runs only where the
    limit is tight enough for it to matter (under :data:`COLLECT_BELOW` available), and the
    limit is read again after it.
    """
    if setting is None:
        return MemoryLimit.none("memory_limit=None")
    release_freed_memory(collect=False)
    limit = limit_from_setting(setting, root)
    if not limit.unlimited and limit.bytes < COLLECT_BELOW and release_freed_memory(collect=True):
        limit = limit_from_setting(setting, root)
    return limit


_malloc_trim = None


def release_freed_memory(collect: bool = True) -> bool:
    """Hand the memory freed so far back to the kernel, so that the usage a plan reads next is what is live.

    ``collect`` runs the garbage collector first (a closed store or pipeline run in a reference
    cycle is freed then, not at some later collection). Then glibc's ``malloc_trim(0)``: glibc
    keeps freed blocks in its arenas (one per thread that allocated, up to 8 per core: each
    sampler, extractor and release thread of a pipeline gets one) and, once its mmap threshold
    has grown to the largest block freed (up to 32 MiB), also the blocks of a batch's tensors.
    Those pages stay resident and charged to the cgroup after the pass that used them: after a
    ``fit`` under a 600 MiB cap, 90-110 MiB more was in use than when it planned, and the ``test``
    stage's plan refused. ``malloc_trim(0)`` gives every whole free page of every arena back
    (``MADV_DONTNEED``), so what stays is what is live. This is done where a stage's memory goes
    (a pass source closed) and before a plan reads the limit; it costs a walk over the free
    lists, milliseconds. Bounding the arenas instead (``M_ARENA_MAX``) would make the pipeline's
    threads contend for them all run long and still keep the free pages of the arenas left, and
    a fixed mmap threshold (``M_MMAP_THRESHOLD``) would map and fault in every batch tensor
    afresh; what a stage retains while it runs is counted instead (:data:`HEAP_SLACK_PER_NODE`,
    :data:`RESERVE_FIXED`). Returns whether memory was trimmed (False without glibc).
    """
    global _malloc_trim
    if collect:
        gc.collect()
    if _malloc_trim is None:
        _malloc_trim = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None).malloc_trim  # glibc only (not musl, not macOS)
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
                _malloc_trim = fn
            except (OSError, AttributeError):
                pass
    if not _malloc_trim:
        return False
    _malloc_trim(0)
    return True


# -------------------------------------------------------------------------------------------------
# the tally
# -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryItem:
    """One allocation: ``group`` is "per-node", "per-slot", "buffer", "host cache", "staging",
    "batches", "negatives" or "heap slack"."""

    group: str
    what: str
    bytes: int


@dataclass
class HostTally:
    """Host memory of one process from the plan on, phase by phase, and what was held before it."""

    num_nodes: int
    phases: dict[str, list[MemoryItem]]
    held: list[MemoryItem] = field(default_factory=list)

    def total(self, phase: str) -> int:
        return sum(i.bytes for i in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        """The phase that needs the most (the first of equals)."""
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        """Bytes the plan still allocates at its peak (compare with :attr:`MemoryLimit.bytes`)."""
        return self.total(self.peak_phase)

    @property
    def held_bytes(self) -> int:
        return sum(i.bytes for i in self.held)

    @property
    def per_node_bytes(self) -> int:
        """Bytes of per-node structures (and the heap slack they leave) at the peak phase."""
        return sum(i.bytes for i in self.phases[self.peak_phase] if i.group in ("per-node", "heap slack"))

    def groups(self, phase: str | None = None) -> dict[str, int]:
        """Bytes per group in ``phase`` (default: the peak)."""
        out: dict[str, int] = {}
        for i in self.phases[phase or self.peak_phase]:
            out[i.group] = out.get(i.group, 0) + i.bytes
        return out

    def format(self) -> str:
        """Every phase with its items, and what was held before the plan (for logs and reports)."""
        lines = []
        for name, items in [("held before the plan", self.held)] + list(self.phases.items()):
            mark = " (peak)" if name == self.peak_phase else ""
            lines.append(f"{name}: {human_bytes(sum(i.bytes for i in items))}{mark}")
            lines += [f"  {i.group:10s} {human_bytes(i.bytes):>11}  {i.what}" for i in items if i.bytes]
        return "\n".join(lines)


@dataclass(frozen=True)
class BatchNegatives:
    """The negatives of the largest link minibatch: ``edges`` positive edges, ``per_edge`` negatives each.

    ``mode`` is ``"triplet"`` (a destination per negative, ``per_edge`` whole) or ``"binary"`` (a
    source-destination pair and a label per negative, ``per_edge`` a ratio); ``edges_option`` and
    ``per_edge_option`` say how they are set (``"batch_size"``, ``"neg_sampling amount"``; given
    negatives: the split's own, which only a smaller batch makes fewer).

    >>> neg = BatchNegatives(512, 1000)
    >>> neg.count, neg.ids, neg.describe()
    (512000, 512000, 'batch_size=512 x neg_sampling amount=1000 (triplet): 512,000 negatives per batch')
    """

    edges: int
    per_edge: float
    mode: str = "triplet"
    edges_option: str = "batch_size"
    per_edge_option: str = "neg_sampling amount"

    @property
    def count(self) -> int:
        """Negatives of the batch (as :meth:`~lightning_ooc.sampling.negative.NegativeSampling.count`)."""
        if self.mode == "binary":
            return math.ceil(self.edges * self.per_edge)
        return int(self.edges) * int(self.per_edge)

    @property
    def ids(self) -> int:
        """Node ids the negatives draw (a binary pair has two)."""
        return 2 * self.count if self.mode == "binary" else self.count

    @property
    def reserve(self) -> int:
        """What the model's scores of them take (:data:`RESERVE_PER_NEGATIVE` each)."""
        return RESERVE_PER_NEGATIVE[self.mode] * self.count

    def describe(self) -> str:
        return (f"{self.edges_option}={self.edges:,} x {self.per_edge_option}={self.per_edge:g} ({self.mode}): "
                f"{self.count:,} negatives per batch")  # fmt: skip


@dataclass(frozen=True)
class ProcessShape:
    """What, besides the byte budgets, decides the host memory of one process.

    Attributes:
        num_nodes, row_bytes: of the dataset.
        max_nodes_per_batch, max_edges_per_batch: of the largest planned minibatch
            (see :func:`edges_per_batch_bound`).
        buffer_on_host: the feature buffer's rows live in host memory (training on CPU).
        num_samplers, num_extractors, extract_queue_size, train_queue_size: the pipeline.
        host_cache_policy: "presample" or "degree" (their temporaries differ).
        topology_shared: ``indptr`` lives in node-shared memory (the "ooc" strategy).
        train_nodes, eval_nodes: seeds of the training split and of validation + test
            (``None``: every node is a training seed, the most it can be); link prediction:
            edges of its link splits.
        seed_order_bytes, seeds_held_bytes, eval_seed_bytes: bytes per training seed of an
            epoch's order (node ids: ``randperm`` int64 and the shuffled copy, 16; link edge
            positions: the int32 permutation itself, 4), per training seed held all along (node
            ids 8; positions 0: they are a count) and per evaluation seed of a pass (node ids 8;
            positions 4, an int32 ``arange``).
        reader_workers, reader_queue_depth, presampled_nodes: for the record of what was held
            before the plan.
        negatives: of the largest link minibatch (:class:`BatchNegatives`; ``None``: no link batches).
    """

    num_nodes: int
    row_bytes: int
    max_nodes_per_batch: int
    max_edges_per_batch: int
    buffer_on_host: bool = True
    num_samplers: int = 4
    num_extractors: int = 4
    extract_queue_size: int = 6
    train_queue_size: int = 4
    host_cache_policy: str = "presample"
    topology_shared: bool = False
    train_nodes: int | None = None
    eval_nodes: int = 0
    reader_workers: int = 0
    reader_queue_depth: int = 0
    presampled_nodes: int = 0
    seed_order_bytes: int = 16
    seeds_held_bytes: int = 8
    eval_seed_bytes: int = 8
    negatives: BatchNegatives | None = None

    @property
    def negative_count(self) -> int:
        return self.negatives.count if self.negatives is not None else 0

    @property
    def batches_in_flight(self) -> int:
        """Sampled batches alive at once: being sampled, queued, extracted, trained (with Lightning's prefetch)."""
        return self.num_samplers + self.extract_queue_size + self.num_extractors + self.train_queue_size + 2


def edges_per_batch_bound(batch_size: int | None, num_neighbors: Sequence[int] | None, max_nodes: int,
                          num_edges: int | None = None, replace: bool = False) -> int:  # fmt: skip
    """An upper bound of the edges of one sampled batch.

    Each node is in one hop's frontier at most and adds at most that hop's fanout of edges,
    so ``E <= max_nodes * max(fanout)`` and ``E <= batch_size * sum_h prod_{i<=h} fanout_i``;
    without replacement an edge is drawn once at most (``E <= num_edges``). Without a fanout,
    10 edges per node (GNNDrive's fanout) is assumed.

    >>> edges_per_batch_bound(1000, [10, 5], max_nodes=40_000)
    60000
    >>> edges_per_batch_bound(1000, [-1], max_nodes=40_000, num_edges=30_000)
    30000
    """
    bound = math.inf
    if num_neighbors is not None and len(num_neighbors):
        fan = [int(f) for f in num_neighbors]
        if all(f >= 0 for f in fan):
            bound = min(bound, max_nodes * max(fan))
            if batch_size is not None:
                reach, tree = int(batch_size), 0
                for f in fan:
                    reach *= f
                    tree += reach
                bound = min(bound, tree)
    else:
        bound = max_nodes * 10
    if num_edges is not None and not replace:
        bound = min(bound, int(num_edges))
    if bound == math.inf:  # all neighbours with replacement and no edge count: as many as nodes x 10
        bound = max_nodes * 10
    return int(bound)


def _vec_cap(n: int) -> int:
    """Capacity the sampler's growable arrays reach for ``n`` items (1024 doubled)."""
    c = 1024
    while c < n:
        c *= 2
    return c


def sampler_workspace_bytes(max_nodes: int, max_edges: int, num_nodes: int) -> int:
    """One sampling thread's workspace at its largest (``ext/sampler/sampler.cpp``).

    Edge positions, targets and sources (3 x int64 per edge), the node list, and the
    open-addressing node map (16 B per entry, at most half full, power of two; 1.5 x while
    it grows). Each thread keeps it for its next call.

    >>> sampler_workspace_bytes(40_000, 60_000, 3_000_000) >> 20
    8
    """
    m, e = int(max_nodes), int(max_edges)
    entries = min(m + e, num_nodes)
    need = 2 * max(entries, 1)
    slots = 16
    while slots < need:
        slots *= 2
    return 8 * (3 * _vec_cap(e) + _vec_cap(m + e)) + 16 * slots * 3 // 2


def host_tally(shape: ProcessShape, *, host_rows: int, buffer_slots: int, staging_bytes: int) -> HostTally:
    """Host memory the datamodule allocates from the plan on, phase by phase (see the module docstring).

    >>> shape = ProcessShape(num_nodes=1_000_000, row_bytes=128, max_nodes_per_batch=20_000,
    ...                      max_edges_per_batch=50_000, train_nodes=10_000)
    >>> t = host_tally(shape, host_rows=100_000, buffer_slots=200_000, staging_bytes=8 << 20)
    >>> list(t.phases)
    ['choosing hot rows', 'simulating the buffer', 'building the store', 'training']
    >>> t.groups("building the store")["per-node"] // 1_000_000, t.groups("training")["per-node"] // 1_000_000
    (16, 8)
    """
    n, rb, k, s = int(shape.num_nodes), int(shape.row_bytes), int(host_rows), int(buffer_slots)
    m, e = int(shape.max_nodes_per_batch), int(shape.max_edges_per_batch)
    idx = 4 if s < 2**31 else 8  # FeatureBuffer.node2slot: int32 while slot numbers fit
    presample = shape.host_cache_policy == "presample"
    train = n if shape.train_nodes is None else int(shape.train_nodes)
    slot_tables = 8 + 8 + 4 + 1 + 1 + 2 * 2 * 8  # slot2node, stamp, refcount, valid, failed, FIFO (2 s + 16 pairs)
    node = "per-node"

    # glibc: freed blocks below its mmap threshold (which grows to the largest freed block, up to
    # 32 MiB) stay in the heap; per-node arrays of 8 B cross it at N = 4M
    slack = HEAP_SLACK_PER_NODE * n if 8 * n < _MMAP_THRESHOLD_MAX else 0
    heap = [MemoryItem("heap slack", "freed per-node temporaries glibc keeps in its heap (arrays < 32 MiB)", slack)]

    # choose_hot: in_degree (np.diff, a copy), access counts, scores, topk's queue of N (value, index) pairs
    hot: list[MemoryItem] = [MemoryItem(node, f"in-degree of {n:,} nodes (np.diff(indptr))", 8 * n)]
    if presample:
        temp = max(8 * n, 24 * n, (8 * n + 16 * n + 16 * k) if k else 0)
        hot += [MemoryItem(node, "access counts over the presampled batches", 8 * n),
                MemoryItem(node, "scores: bincount / float64 score + in-degree as float64 / topk queue", temp)]  # fmt: skip
    elif k:
        hot += [MemoryItem(node, "topk over the in-degree (queue of N pairs, result)", 16 * n + 16 * k)]
    hot += heap

    counts = [MemoryItem(node, "access counts (held until setup ends)", 8 * n)] if presample else []
    sim = counts + [
        MemoryItem("host cache", f"ids of the {k:,} hot rows", 8 * k),
        MemoryItem(node, "buffer simulation: in-host mask, node -> slot", (1 + idx) * n),
        MemoryItem("per-slot", f"buffer simulation: tables of {s:,} slots", (slot_tables + 1) * s + 256),
    ] + heap

    store = [
        MemoryItem(node, f"feature buffer node -> slot (int{8 * idx}) of {n:,} nodes", idx * n),
        MemoryItem(node, f"host cache node -> row map (int32) of {n:,} nodes", 4 * n),
        MemoryItem("per-slot", f"feature buffer tables of {s:,} slots", slot_tables * s + 256),
        MemoryItem("host cache", f"{k:,} rows of {rb} B", k * rb),
        MemoryItem("host cache", "ids of the hot rows", 8 * k),
        MemoryItem("staging", "staging buffer", int(staging_bytes)),
    ]
    if shape.buffer_on_host:
        store.append(MemoryItem("buffer", f"feature buffer: {s:,} rows of {rb} B (host memory on CPU)", s * rb))
    load = [MemoryItem("host cache", "filling it: sorted ids, sort order, positions, reader plans",
                       20 * k + 64 * min(k, 1 << 16))]  # fmt: skip
    build = counts + store + load + heap

    batch = BATCH_BYTES_PER_NODE * m + BATCH_BYTES_PER_EDGE * e
    training = store + [
        MemoryItem(node, f"epoch order of {train:,} training seeds", shape.seed_order_bytes * train),
        MemoryItem(node, f"validation and test seeds ({shape.eval_nodes:,})",
                   shape.eval_seed_bytes * int(shape.eval_nodes)),
        MemoryItem("batches", f"{shape.num_samplers} sampler workspaces (batches of {m:,} nodes, {e:,} edges)",
                   shape.num_samplers * sampler_workspace_bytes(m, e, n)),
        MemoryItem("batches", f"{shape.batches_in_flight} batches in flight (ids, labels, edges, leases)",
                   shape.batches_in_flight * batch),
        MemoryItem("batches", "x of the trainer's batches and a gather temporary", 3 * m * rb),
    ] + _negative_items(shape) + heap

    held = [
        MemoryItem(node, "indptr" + (" (node-shared memory)" if shape.topology_shared else ""),
                   0 if shape.topology_shared else 8 * (n + 1)),
        MemoryItem(node, f"training seeds ({train:,})", shape.seeds_held_bytes * train),
        MemoryItem("reader", f"reader I/O slots: {shape.reader_workers} workers x {shape.reader_queue_depth} x "
                   f"{READER_SLOT_BYTES >> 10} KiB", shape.reader_workers * shape.reader_queue_depth * READER_SLOT_BYTES),
        MemoryItem("batches", f"presampled node ids ({shape.presampled_nodes:,})", 8 * int(shape.presampled_nodes)),
        MemoryItem("batches", "the main thread's sampler workspace", sampler_workspace_bytes(m, e, n)),
    ]  # fmt: skip
    phases = {"choosing hot rows": hot, "simulating the buffer": sim, "building the store": build,
              "training": training}  # fmt: skip
    return HostTally(n, phases, held)


def _negative_items(shape: ProcessShape) -> list[MemoryItem]:
    """What a link batch's negatives cost while training: their indices in every batch in flight, and the
    sampler threads drawing them (the nodes they bring, and those nodes' features, are in the batch's
    node count, presampled with them; what the model allocates to score them is in the reserve)."""
    neg = shape.negatives
    if neg is None or not neg.count:
        return []
    labels = ", labels" if neg.mode == "binary" else ""
    return [
        MemoryItem("negatives", f"{shape.batches_in_flight} batches in flight with {neg.count:,} negatives each "
                   f"(indices into n_id{labels})", shape.batches_in_flight * neg.count * NEGATIVE_HELD_BYTES[neg.mode]),
        MemoryItem("negatives", f"{shape.num_samplers} sampler threads drawing {neg.ids:,} negative ids each (the ids, "
                   "the seed set, unique's sort and inverse)", shape.num_samplers * neg.ids * NEGATIVE_SAMPLING_BYTES_PER_ID),
    ]  # fmt: skip


# -------------------------------------------------------------------------------------------------
# the check
# -------------------------------------------------------------------------------------------------
def training_reserve(max_nodes_per_batch: int, negatives: BatchNegatives | None = None) -> int:
    """Bytes kept free for the rest of training: :data:`RESERVE_FIXED` + :data:`RESERVE_PER_BATCH_NODE` per
    node + :data:`RESERVE_PER_NEGATIVE` per negative of a link batch.

    What the plan cannot see is the model: its parameters and optimizer state are small,
    its activations are not. Measured on a 3M-node graph (batches of 1000 seeds, fanout
    [10, 5], up to 38.7k nodes planned, ~31k seen), ``Trainer.fit`` of a 2-layer GraphSAGE
    peaked above ``setup()`` by 103 / 185 / 437 MiB with hidden 16 / 64 / 256, of which
    the tally's training phase counts ~180 MiB (buffer rows filled, batches in flight,
    sampler workspaces); activations grow by ~44 B per hidden unit per batch node. 128 MiB
    + 4 KiB per planned batch node (279 MiB there) covers all three, i.e. 2-layer models up
    to hidden ~256 on such batches; pass ``memory_reserve`` for wider or deeper models.

    A link batch's negatives are scored apart from its nodes: ``LinkPredictor`` gathers an
    embedding per negative (``h[dst_neg_index]``, ``[B, K, hidden]``), multiplies it with its
    source's, and the backward pass allocates as much again: a training step peaked at 13 B per
    negative per hidden unit (triplet, dot decoder), 17 B per binary pair, 21-25 B with the MLP
    decoder (hidden 64); evaluation without gradients at 9 B. 4 KiB per triplet negative and 6 KiB
    per binary pair are the dot decoder up to hidden ~256, as for the nodes (fit peaks of a cgroup
    measured below the plan with it, 512 edges per batch, hidden 256: 775 of 803 MiB with 100
    triplet negatives each, 2.37 of 2.64 GiB with 1000, 1.46 of 1.53 GiB with 300 binary pairs;
    at hidden 64, 1000 triplet negatives peaked at 1.15 GiB). 512 x 1000 triplet negatives: 2 GiB.

    >>> training_reserve(40_000) >> 20
    284
    >>> training_reserve(20_000, BatchNegatives(512, 1000)) >> 20
    2206
    """
    return (RESERVE_FIXED + RESERVE_PER_BATCH_NODE * int(max_nodes_per_batch)
            + (negatives.reserve if negatives is not None else 0))  # fmt: skip


@dataclass
class MemoryFit:
    """The outcome of :func:`check_fits`: the sizes to use and what was shrunk."""

    host_rows: int
    buffer_slots: int
    tally: HostTally
    limit: MemoryLimit
    allowed: int  # bytes this process may plan (its share of what is available, less the reserve)
    reserve: int
    shrunk: list[str] = field(default_factory=list)
    #: what the tally was computed from, so that other sizes can be checked against the same limit
    shape: ProcessShape | None = None
    staging_bytes: int = 0

    @property
    def need(self) -> int:
        return self.tally.peak

    def fits(self, host_rows: int, buffer_slots: int) -> bool:
        """Whether these sizes fit under the same limit, with the same reserve (always, without a limit)."""
        if self.limit.unlimited:
            return True
        if self.shape is None:
            raise ValueError("this fit was built without its process shape")
        tally = host_tally(self.shape, host_rows=host_rows, buffer_slots=buffer_slots, staging_bytes=self.staging_bytes)
        return tally.peak <= self.allowed

    def resize(self, host_rows: int, buffer_slots: int) -> None:
        """Take other sizes (checked with :meth:`fits` by the caller) and the tally that goes with them."""
        if self.shape is None:
            raise ValueError("this fit was built without its process shape")
        self.host_rows, self.buffer_slots = int(host_rows), int(buffer_slots)
        self.tally = host_tally(self.shape, host_rows=self.host_rows, buffer_slots=self.buffer_slots,
                                staging_bytes=self.staging_bytes)  # fmt: skip

    def format(self) -> str:
        """The plan's memory line."""
        if self.limit.unlimited:
            return (f"  host memory     {human_bytes(self.need):>11}  planned at its peak ({self.tally.peak_phase}), "
                    f"{self.limit}")  # fmt: skip
        return (f"  host memory     {human_bytes(self.need):>11}  planned at its peak ({self.tally.peak_phase}) "
                f"+ {human_bytes(self.reserve)} reserve, of {self.limit}")  # fmt: skip


def largest_where(lo: int, hi: int, fits) -> int | None:
    """The largest x in [lo, hi] with fits(x) (fits is monotone: true up to some x), or None."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_fits(shape: ProcessShape, *, host_rows: int, buffer_slots: int, min_slots: int, staging_bytes: int,
               limit: MemoryLimit, reserve: int | None = None, processes: int = 1) -> MemoryFit:  # fmt: skip
    """Fit the plan into ``limit``, shrinking the host cache, then (CPU) the feature buffer, or refuse.

    The peak of :func:`host_tally` plus ``reserve`` (default :func:`training_reserve`)
    must fit into this process's share of what is available (``limit.bytes /
    processes``: ranks of one machine plan at the same time, under the same limit).
    If it does not, the host cache gets the rows that fit (a warning says from what
    to what and why); if none fit, the feature buffer on CPU shrinks towards
    ``min_slots``; if even that does not fit, :class:`~lightning_ooc.errors.InputError`
    says what the plan needs and what to shrink.

    >>> shape = ProcessShape(num_nodes=100_000, row_bytes=4096, max_nodes_per_batch=5_000,
    ...                      max_edges_per_batch=20_000, train_nodes=1_000)
    >>> fit = check_fits(shape, host_rows=100_000, buffer_slots=50_000, min_slots=20_000,
    ...                  staging_bytes=8 << 20, limit=MemoryLimit(600 << 20, "a test"))
    >>> fit.host_rows < 100_000, fit.buffer_slots, fit.shrunk[0].split(" (")[0]
    (True, 50000, 'host_cache shrunk from 390.62 MiB to 157.82 MiB')
    >>> check_fits(shape, host_rows=0, buffer_slots=50_000, min_slots=20_000, staging_bytes=8 << 20,
    ...            limit=MemoryLimit(100 << 20, "a test"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.InputError: the plan does not fit in memory: ...
    """
    default_reserve = reserve is None
    reserve = training_reserve(shape.max_nodes_per_batch, shape.negatives) if reserve is None else int(reserve)
    processes = max(1, int(processes))
    rb = shape.row_bytes

    def need(h: int, sl: int) -> int:
        return host_tally(shape, host_rows=h, buffer_slots=sl, staging_bytes=staging_bytes).peak

    tally = host_tally(shape, host_rows=host_rows, buffer_slots=buffer_slots, staging_bytes=staging_bytes)
    if limit.unlimited:
        return MemoryFit(host_rows, buffer_slots, tally, limit, UNLIMITED, reserve, shape=shape,
                         staging_bytes=staging_bytes)  # fmt: skip
    allowed = limit.bytes // processes - reserve
    share = f", a 1/{processes} share for each of {processes} processes" if processes > 1 else ""
    why = (f"{limit}{share}; as asked, the plan needs {human_bytes(tally.peak)} at its peak ({tally.peak_phase}) "
           f"+ {human_bytes(reserve)} kept for training")  # fmt: skip
    fit = MemoryFit(host_rows, buffer_slots, tally, limit, allowed, reserve, shape=shape, staging_bytes=staging_bytes)
    if tally.peak <= allowed:
        return fit
    h = largest_where(0, host_rows, lambda x: need(x, buffer_slots) <= allowed)
    slots = buffer_slots
    if h is None and shape.buffer_on_host and min_slots < buffer_slots:
        h = 0
        got = largest_where(min_slots, buffer_slots, lambda x: need(0, x) <= allowed)
        if got is not None:
            slots = got
        else:
            h = None
    if h is None:
        raise InputError(_refusal(shape, limit, reserve, processes, host_rows, buffer_slots, min_slots,
                                  staging_bytes, allowed, default_reserve))  # fmt: skip
    if h < host_rows:
        fit.shrunk.append(f"host_cache shrunk from {human_bytes(host_rows * rb)} to {human_bytes(h * rb)} "
                          f"({host_rows:,} -> {h:,} rows)")  # fmt: skip
    if slots < buffer_slots:
        fit.shrunk.append(f"gpu_cache shrunk from {human_bytes(buffer_slots * rb)} to {human_bytes(slots * rb)} "
                          f"({buffer_slots:,} -> {slots:,} slots of the feature buffer, in host memory on CPU; "
                          f"its reserve is {min_slots:,})")  # fmt: skip
    fit.host_rows, fit.buffer_slots = h, slots
    fit.tally = host_tally(shape, host_rows=h, buffer_slots=slots, staging_bytes=staging_bytes)
    settings = [f"host_cache={budget_setting(h * rb)}"]
    if slots < buffer_slots:
        settings.append(f"gpu_cache={budget_setting(slots * rb)}")
    log.warning("lightning_ooc: %s to fit in memory: %s; set %s to plan this without a warning",
                "; ".join(fit.shrunk), why, " and ".join(settings))  # fmt: skip
    return fit


def _negatives_cost(shape: ProcessShape, slots: int, staging_bytes: int, reserve: int | None) -> int:
    """The peak of the smallest plan with these negatives, plus the reserve (default: with its share for them)."""
    tally = host_tally(shape, host_rows=0, buffer_slots=slots, staging_bytes=staging_bytes)
    return tally.peak + (training_reserve(shape.max_nodes_per_batch, shape.negatives) if reserve is None
                         else reserve)  # fmt: skip


def _fewer_negatives(shape: ProcessShape, slots: int, staging_bytes: int, room: int, reserve: int | None) -> str | None:
    """How far to lower a link batch's negatives for the smallest plan to fit in ``room`` (reserve included),
    or None (no negatives, or none too many: nothing else would fit even without them)."""
    neg = shape.negatives
    if neg is None or not neg.count:
        return None

    def fits(n: BatchNegatives) -> bool:
        return _negatives_cost(replace(shape, negatives=n), slots, staging_bytes, reserve) <= room

    if not fits(replace(neg, per_edge=0)):
        return None
    none = replace(shape, negatives=None)
    cost = (_negatives_cost(shape, slots, staging_bytes, reserve)
            - _negatives_cost(none, slots, staging_bytes, None if reserve is None else reserve))  # fmt: skip
    scale = 100 if neg.mode == "binary" else 1  # a ratio to two decimals; whole negatives per edge
    amount = largest_where(0, int(neg.per_edge * scale), lambda a: fits(replace(neg, per_edge=a / scale)))
    edges = largest_where(1, neg.edges, lambda b: fits(replace(neg, edges=b)))
    ways = []
    if amount and neg.per_edge_option == "neg_sampling amount":
        ways.append(f"{neg.per_edge_option}={amount / scale:g} with {neg.edges_option}={neg.edges:,}")
    if edges:
        ways.append(f"{neg.edges_option}={edges:,} with {neg.per_edge_option}={neg.per_edge:g}")
    what = f"lower {neg.per_edge_option} or {neg.edges_option}" if neg.per_edge_option == "neg_sampling amount" \
        else f"lower {neg.edges_option}"
    fit = f"; at most {', or '.join(ways)}, fits" if ways else ""
    scores = (f", and {human_bytes(RESERVE_PER_NEGATIVE[neg.mode])} each kept for the model's scores" if reserve is None
              else "")  # fmt: skip
    return (f"{what} ({neg.describe()}, {human_bytes(cost)} with what they take: indices in every batch in flight, "
            f"the samplers drawing them{scores}{fit})")  # fmt: skip


def check_negatives(shape: ProcessShape, limit: MemoryLimit, processes: int = 1) -> None:
    """Refuse a link batch's negatives that cannot fit, before anything is sampled to plan with.

    The presample draws hundreds of batches with their negatives (minutes, and a batch of 5M
    negatives is ~300 MiB to draw), so the plan cannot wait for it to see them. ``shape`` is a
    lower bound of the plan's (no host cache, buffer or staging; nodes and edges per batch as
    known before the presample, e.g. 0): when it fits without the negatives and not with them,
    :class:`~lightning_ooc.errors.InputError` says so, with the numbers and how far to lower
    ``neg_sampling`` amount or ``batch_size``. Otherwise the plan decides later.

    >>> shape = ProcessShape(num_nodes=20_000, row_bytes=128, max_nodes_per_batch=0, max_edges_per_batch=0,
    ...                      negatives=BatchNegatives(512, 1000))
    >>> check_negatives(shape, MemoryLimit(600 << 20, "a test"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.InputError: the plan does not fit in memory: ... at most neg_sampling amount=214 with batch_size=512, or batch_size=110 with ...
    """
    if limit.unlimited or shape.negatives is None or not shape.negative_count:
        return
    processes = max(1, int(processes))
    room = limit.bytes // processes
    need = _negatives_cost(shape, 0, 0, None)
    if need <= room or _negatives_cost(replace(shape, negatives=None), 0, 0, None) > room:
        return
    fix = _fewer_negatives(shape, 0, 0, room, None)
    share = f" (1/{processes} of it per process: {processes} processes plan at once)" if processes > 1 else ""
    held = (f"; this process already holds {human_bytes(limit.rss)} (anonymous and shared memory, mapped code and "
            "libraries)" if limit.rss else "")  # fmt: skip
    raise InputError(
        f"the plan does not fit in memory: {limit}{share}{held}; a link batch's negatives alone take it past that: "
        f"{human_bytes(need)} at least with them, {human_bytes(need - room)} too much; to fit, {fix}, or raise the "
        f"memory limit by {human_bytes((need - room) * processes)}, or set memory_limit=None to skip this check "
        "(the kernel may then kill the run)"
    )


def budget_setting(nbytes: int) -> str:
    """A byte count as a budget setting, rounded down (``"167MiB"``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0 or nbytes >= 10 << shift:
            return f"{nbytes >> shift}{unit}"
    return str(int(nbytes))


def _refusal(shape: ProcessShape, limit: MemoryLimit, reserve: int, processes: int, host_rows: int,
             buffer_slots: int, min_slots: int, staging_bytes: int, allowed: int,
             default_reserve: bool = False) -> str:  # fmt: skip
    """One line: the limit and its source, the smallest plan broken down, and what to shrink by how much."""
    rb = shape.row_bytes
    slots = min_slots if shape.buffer_on_host else buffer_slots
    small = host_tally(shape, host_rows=0, buffer_slots=slots, staging_bytes=staging_bytes)
    phase = small.peak_phase
    g = small.groups(phase)
    over = small.peak - allowed
    parts = [f"per-node structures for {shape.num_nodes:,} nodes {human_bytes(g.get('per-node', 0))}"]
    for name in ("heap slack", "per-slot", "buffer", "host cache", "staging", "batches", "negatives"):
        if g.get(name):
            parts.append(f"{name} {human_bytes(g[name])}")
    fixes = []
    fewer = _fewer_negatives(shape, slots, staging_bytes, allowed + reserve, None if default_reserve else reserve)
    if fewer:
        fixes.append(fewer)
    if phase == "choosing hot rows":  # per-node temporaries: no budget makes them smaller
        if shape.host_cache_policy == "presample":
            deg = ProcessShape(**{**shape.__dict__, "host_cache_policy": "degree"})
            saved = small.peak - host_tally(deg, host_rows=0, buffer_slots=slots, staging_bytes=staging_bytes).peak
            fixes.append(f"set host_cache_policy='degree' (saves {human_bytes(saved)})")
    else:
        if g.get("staging", 0) > (1 << 20):
            fixes.append(f"lower staging ({human_bytes(g['staging'])} now; 1MiB is enough)")
        batch = f"batches of up to {shape.max_nodes_per_batch:,} nodes: {human_bytes(g.get('batches', 0))} in flight"
        if shape.buffer_on_host:
            batch += f", a feature buffer reserve of {human_bytes(min_slots * rb)}"
        fixes.append(f"lower batch_size / num_neighbors ({batch})")
        fixes.append(f"lower num_samplers / extract_queue_size / train_queue_size / num_extractors "
                     f"({shape.batches_in_flight} batches in flight)")  # fmt: skip
        if not shape.buffer_on_host and g.get("per-slot", 0) > (16 << 20):
            fixes.append(f"lower gpu_cache (its {buffer_slots:,} slots keep {human_bytes(g['per-slot'])} of tables "
                         "in host memory)")  # fmt: skip
    fixes.append(f"raise the memory limit by {human_bytes(over * processes)}")
    fixes.append("set memory_limit=None to skip this check (the kernel may then kill the run)")
    held = (f"; this process already holds {human_bytes(limit.rss)} (anonymous and shared memory, mapped code and "
            "libraries)" if limit.rss else "")  # fmt: skip
    share = f" (1/{processes} of it per process: {processes} processes plan at once)" if processes > 1 else ""
    asked = f"host_cache {human_bytes(host_rows * rb)}, gpu_cache {human_bytes(buffer_slots * rb)}"
    return (
        f"the plan does not fit in memory: {limit}{share}{held}; even with no host cache"
        + (f" and the smallest feature buffer ({min_slots:,} slots)" if shape.buffer_on_host else "")
        + f" it needs {human_bytes(small.peak)} while {phase} ({', '.join(parts)}) + {human_bytes(reserve)} "
        f"kept for training, {human_bytes(over)} too much (asked: {asked}); to fit, "
        + ", or ".join(fixes)
    )
