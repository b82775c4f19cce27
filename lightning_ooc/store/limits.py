"""The host memory this process may still allocate: its memory cgroups (v1 and v2, its own and every ancestor
it can read) and ``MemAvailable``, file cache given back under pressure not counted, the code of the process's
executable and libraries counted (below); a setting read as a limit; freed memory
handed back to the kernel before a plan reads what is in use; the part of an earlier stage's reserve that a later
stage of the same process finds in use (:class:`StageMemory`).

:func:`memory_limit` reads what this process may still allocate: the
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

>>> limit_from_setting("8GiB").limit == 8 << 30
True
>>> limit_from_setting(None).unlimited
True
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from lightning_ooc.data.format import human_bytes, parse_bytes
from lightning_ooc.store.tally import RESERVE_FIXED

log = logging.getLogger("lightning_ooc")

#: a limit at or above this many bytes means "no limit" (cgroup v1 writes 2^63 - 4096 for none)
UNLIMITED = 1 << 60


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
        """No limit: :func:`~lightning_ooc.store.planner.check_fits` accepts every plan."""
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
    limit is read again after it. Inside :func:`planning_stage` the limit is that stage's
    (:meth:`StageMemory.read`): what an earlier stage's reserve kept room for, and is in use now, counts once.
    """
    if setting is None:
        return MemoryLimit.none("memory_limit=None")
    release_freed_memory(collect=False)
    limit = limit_from_setting(setting, root)
    if not limit.unlimited and limit.bytes < COLLECT_BELOW and release_freed_memory(collect=True):
        limit = limit_from_setting(setting, root)
    stages = _STAGES.get()
    return limit if stages is None else stages.read(limit)


#: the most of an earlier stage's reserve that a later stage finds in use and takes as its own: the reserve's fixed
#: part (:data:`~lightning_ooc.store.tally.RESERVE_FIXED`: the fit loop, the model, its optimizer state, the code
#: that training imports and runs); the activations of a batch come and go with every step
STAGE_CREDIT_MAX = RESERVE_FIXED


class StageMemory:
    """What the stages of one datamodule (fit, then test, ...) planned with in this process.

    A plan keeps a reserve free beyond its own tally (:func:`~lightning_ooc.store.tally.training_reserve`): the
    fit loop, the model and its optimizer state, the code training imports and runs, the activations of a step.
    Once a stage has run, much of that is in use: the next stage's plan reads it in the usage of its limit, and
    a plan that kept the whole reserve free again would count it twice, and refuse, just past the limit, what
    the stage before it fitted (a test stage after a fit that had to shrink to fit).

    :meth:`read` takes each limit a plan of the current stage reads (:func:`limit_for_plan`) and gives back to
    the stage what the usage grew by since the earlier stage's plan read it: no more than this process's own
    resident memory grew by, at most :data:`STAGE_CREDIT_MAX`, and at most the reserve the earlier stage's plans
    kept where it is known (:meth:`kept`, :func:`keep_reserve`; a ``memory_reserve`` below the fixed part). That
    is memory that came with the earlier stage's run, for which its reserve kept room. The plan is then made, and
    shrunk, as every plan is.

    >>> lim = lambda used, rss: MemoryLimit((800 << 20) - used, "a test", limit=800 << 20, used=used, rss=rss)
    >>> stages = StageMemory()
    >>> stages.begin("fit")
    >>> stages.read(lim(590 << 20, 500 << 20)).bytes >> 20
    210
    >>> stages.begin("test")  # the fit loop, the model and its optimizer state are live now
    >>> later = stages.read(lim(610 << 20, 518 << 20))
    >>> later.bytes >> 20, later.source
    (208, 'a test; 18.00 MiB of it came with the fit stage, whose reserve kept room for it')

    Where the earlier stage's plan kept a smaller reserve (``memory_reserve="10MiB"``), no more than it comes back:

    >>> stages.kept(10 << 20)  # the test stage's plan keeps 10 MiB free
    >>> stages.begin("validate")
    >>> stages.read(lim(650 << 20, 560 << 20)).bytes >> 20  # the usage grew by 40 MiB since the test stage read it
    160
    """

    def __init__(self) -> None:
        self.stage: str | None = None
        #: the limit the current stage's plan read last, and the earlier stage's (with its name)
        self.last: MemoryLimit | None = None
        self.earlier: MemoryLimit | None = None
        self.earlier_stage: str | None = None
        #: the largest reserve a plan of the current stage kept free, and the earlier stage's (None: not recorded)
        self.reserve: int | None = None
        self.earlier_reserve: int | None = None

    def begin(self, stage: str | None) -> None:
        """A new stage sets up (``stage``: its name, Lightning's ``"fit"``, ``"test"``...): what the stage before it
        read last, and the reserve its plans kept, are the earlier stage's."""
        if self.last is not None:
            self.earlier, self.earlier_stage, self.earlier_reserve = self.last, self.stage, self.reserve
        self.stage = None if stage is None else str(getattr(stage, "value", stage))  # Lightning's TrainerFn
        self.last, self.reserve = None, None

    def kept(self, reserve: int) -> None:
        """A plan of the current stage keeps ``reserve`` bytes free for training: the largest such is recorded, and
        a later stage gets back no more than it (:meth:`credit`)."""
        self.reserve = max(int(reserve), self.reserve or 0)

    def credit(self, limit: MemoryLimit) -> int:
        """The bytes of ``limit``'s usage that the earlier stage's reserve kept room for (0: none known): what the
        usage and this process grew by since then, at most :data:`STAGE_CREDIT_MAX` and the earlier stage's
        reserve where recorded."""
        before = self.earlier
        if before is None or limit.unlimited or before.unlimited or limit.limit != before.limit:
            return 0
        if limit.used is None or before.used is None:
            return 0
        grown = limit.used - before.used
        if limit.rss is not None and before.rss is not None:
            grown = min(grown, limit.rss - before.rss)
        most = STAGE_CREDIT_MAX if self.earlier_reserve is None else min(STAGE_CREDIT_MAX, self.earlier_reserve)
        return max(0, min(grown, most))

    def read(self, limit: MemoryLimit) -> MemoryLimit:
        """``limit`` as the current stage plans with it (see the class docstring)."""
        self.last = limit
        credit = self.credit(limit)
        if not credit:
            return limit
        stage = f"the {self.earlier_stage} stage" if self.earlier_stage else "the stage before"
        return MemoryLimit(limit.bytes + credit, f"{limit.source}; {human_bytes(credit)} of it came with {stage}, "
                           "whose reserve kept room for it", limit=limit.limit, used=limit.used, rss=limit.rss)


_STAGES: ContextVar[StageMemory | None] = ContextVar("lightning_ooc_stage_memory", default=None)


def keep_reserve(reserve: int) -> None:
    """Record that the plan being made keeps ``reserve`` bytes free for training: inside :func:`planning_stage`,
    for that stage (:meth:`StageMemory.kept`); outside one, nothing is recorded."""
    stages = _STAGES.get()
    if stages is not None:
        stages.kept(reserve)


@contextmanager
def planning_stage(stages: StageMemory, stage: str | None) -> Iterator[StageMemory]:
    """Set up stage ``stage`` of ``stages``: every limit a plan reads meanwhile (:func:`limit_for_plan`, the path
    of every plan's limit) is that stage's (:meth:`StageMemory.read`)."""
    stages.begin(stage)
    token = _STAGES.set(stages)
    try:
        yield stages
    finally:
        _STAGES.reset(token)


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
