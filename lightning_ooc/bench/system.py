"""The machine side of benchmarks: page cache, memory caps, facts about the host."""
from __future__ import annotations

import os
import platform
import re
import secrets
import site
import subprocess
import threading
from pathlib import Path
from typing import Any, Sequence
import datetime
import json
import numpy as np
import sys
import time
import torch

from lightning_ooc.data.outputs import check_output, partial_path, sweep_partials
from lightning_ooc.errors import DatasetWriteError

_CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def drop_caches(paths: Sequence[Path] = ()) -> tuple[bool, str]:
    """Empty the page cache: ``sync; echo 3 > /proc/sys/vm/drop_caches`` as root, else
    ``posix_fadvise(DONTNEED)`` on ``paths`` (close their mappings first). Returns (done, how)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True, "page cache dropped"
    except OSError as e:
        why = e.strerror
    if paths:
        try:
            for p in paths:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            return True, "evicted with posix_fadvise(DONTNEED)"
        except (OSError, AttributeError) as e:
            why = str(e)
    return False, f"page cache not dropped ({why}; run as root for cold-cache numbers)"


def warm_page_cache(path: Path) -> None:
    """Read a file once so that it sits in the page cache."""
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass


def machine_facts() -> dict[str, Any]:
    """CPU model and count, memory, kernel, Python and library versions."""

    model = None
    mem = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            mem = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal")), None)
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(), "cpu_model": model, "memory_bytes": mem, "kernel": platform.release(),
        "load_average": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
        "torch": torch.__version__, "numpy": np.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }  # fmt: skip


def private_prefixes(extra: Sequence[str | Path] = ()) -> list[str]:
    """Directories of this host a result should not name (it is kept, and may be committed): the working
    directory, the package's checkout, the Python environment, the home directory, this process's memory
    cgroup, and ``extra``; longest first, each ending in a separator."""
    dirs = [os.getcwd(), Path(__file__).resolve().parents[2], sys.prefix, sys.base_prefix, Path.home(), *extra]
    cgroup = _memory_controller()  # a capped run's refusal names its cgroup: say it from this process's own
    if cgroup is not None:
        dirs.append(cgroup[1])
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # a virtual environment's site module without it
        pass
    out = {str(Path(d)).rstrip(os.sep) + os.sep for d in dirs if d and str(d) not in ("/", "")}
    return sorted(out, key=len, reverse=True)


def scrub(obj: Any, prefixes: Sequence[str]) -> Any:
    """``obj`` (JSON-like) with every string's ``prefixes`` removed: paths become relative to them.

    >>> scrub({"a": ["/home/u/x/g16m", 3], "b": "fio /home/u/x/f.bin"}, ["/home/u/x/"])
    {'a': ['g16m', 3], 'b': 'fio f.bin'}
    """
    if isinstance(obj, str):
        for p in prefixes:
            obj = obj.replace(p, "")
        return obj
    if isinstance(obj, dict):
        return {k: scrub(v, prefixes) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, prefixes) for v in obj]
    return obj


#: the ``Software`` text of every plot a benchmark writes (how a later run knows the file is one of ours)
PLOT_SOFTWARE = "lightning_ooc bench"


#: how every results JSON :func:`write_results` writes begins (its first two keys), and the most bytes one is read
_RESULTS_HEAD = re.compile(rb'^\{\s*"date":\s*"[^"]*",\s*"command":')
RESULTS_MOST = 256 << 20


def bench_output(path: Path) -> bool:
    """Whether the file at ``path`` is a benchmark output this package wrote: a results JSON (an object that starts
    with the ``date`` and ``command`` :func:`write_results` puts first) or a plot marked by :func:`save_plot`. Those a later
    run replaces; any other file at an output path is refused.

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "r.json"
    >>> _ = p.write_text('{"date": "2026-01-01", "command": "lightning-ooc bench io"}')
    >>> bench_output(p), bench_output(Path("/nonexistent"))
    (True, False)
    """
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            if head.startswith(b"\x89PNG"):
                return b"Software\x00" + PLOT_SOFTWARE.encode() in head
            if not _RESULTS_HEAD.match(head):
                return False
            text = head + f.read(RESULTS_MOST)
    except OSError:
        return False
    try:
        doc = json.loads(text.decode())
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(doc, dict) and list(doc)[:2] == ["date", "command"]


def bench_path(path: Path, option: str = "--out") -> Path:
    """``path`` checked as a benchmark's output (:func:`~lightning_ooc.data.outputs.check_output`): never inside a
    dataset, never a file the package did not write; its directory made."""
    check_output(path, option=option, ours=bench_output)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


#: the file that marks a directory as a benchmark's work directory (everything in it is the benchmark's)
WORKDIR_MARK = ".lightning_ooc-bench-workdir"


def bench_workdir(path: Path, option: str = "--workdir") -> Path:
    """``path`` as a benchmark's work directory, where it makes, reuses and removes graphs and outputs by fixed
    names. A new or empty directory is made one (a mark file in it); a directory without the mark that holds
    anything is refused, so nothing of a user's is ever removed; never inside a dataset.

    >>> import tempfile
    >>> w = bench_workdir(Path(tempfile.mkdtemp()) / "w")
    >>> (w / WORKDIR_MARK).is_file(), bench_workdir(w) == w
    (True, True)
    >>> bench_workdir(Path(__file__).parent)
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.DatasetWriteError: ...: holds files no benchmark wrote; ...
    """
    path = check_output(path, kind="workdir", option=option)
    path.mkdir(parents=True, exist_ok=True)
    mark = path / WORKDIR_MARK
    if not mark.is_file():
        if any(path.iterdir()):
            raise DatasetWriteError(f"{path}: holds files no benchmark wrote; a benchmark removes what it makes in "
                                    f"its work directory by name, so give an empty or new {option}")  # fmt: skip
        mark.write_text("a lightning_ooc benchmark's work directory: what is in it may be removed\n")
    return path


def save_plot(fig: Any, path: Path, dpi: int = 120) -> Path:
    """Save a benchmark's figure as a PNG marked as ours, after :func:`bench_path`'s check."""
    fig.savefig(bench_path(path), dpi=dpi, metadata={"Software": PLOT_SOFTWARE})
    return path


def write_results(doc: dict[str, Any], path: Path | None, kind: str, hide: Sequence[str | Path] = (),
                  command: Sequence[str] | None = None) -> Path:  # fmt: skip
    """Write a benchmark's JSON (adding the date and ``command``, by default this process's command line) to
    ``path`` or ``bench-results/KIND-DATE.json``; returns where it went. Paths of this host
    (:func:`private_prefixes`, and ``hide``) are left out of every string. A file already at ``path`` is
    replaced only if it is a benchmark output (:func:`bench_output`)."""

    # the program by its name (where it is installed says nothing about the run)
    argv = list(command) if command else [os.path.basename(sys.argv[0]) if sys.argv else "", *sys.argv[1:]]
    doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(argv), **doc}
    doc = scrub(doc, private_prefixes(hide))
    path = bench_path(path or Path("bench-results") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    sweep_partials(path)
    tmp = partial_path(path)
    try:
        tmp.write_text(json.dumps(doc, indent=2))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def parse_choices(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """A comma-separated option's items, each one of ``allowed``; else a SystemExit naming ``what`` and the choices.

    >>> parse_choices("none, scored", ("none", "static", "scored"), "policy")
    ['none', 'scored']
    """
    items = [s.strip() for s in text.split(",") if s.strip()]
    for s in items:
        if s not in allowed:
            raise SystemExit(f"unknown {what} {s!r}; use {', '.join(allowed)}")
    return items


def _memory_controller() -> tuple[str, Path] | None:
    """(limit file name, this process's own memory cgroup directory), cgroup v1 or v2, or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        for line in lines:
            _, ctrls, rel = line.split(":", 2)
            if "memory" in ctrls.split(","):
                return "memory.limit_in_bytes", v1 / rel.lstrip("/")
    v2 = Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        for line in lines:
            if line.startswith("0::"):
                return "memory.max", v2 / line[3:].lstrip("/")
    return None


#: the root of the hierarchy of each kind of memory cgroup, by its limit file
CGROUP_ROOTS = {"memory.limit_in_bytes": Path("/sys/fs/cgroup/memory"), "memory.max": Path("/sys/fs/cgroup")}


class MemoryCap:
    """A child memory cgroup of this process's own (v1 or v2) with a limit; processes are moved into it.

    Page-cache pages that a process in it faults in are charged to it, so a
    capped run sees the memory pressure of a machine of that size. Use
    :meth:`add` for another process, or ``with MemoryCap(limit) as cap:`` to
    run this process's own body under it (moved back on exit). Removed on
    :meth:`close`. Raises ``RuntimeError`` where cgroups cannot be used (not
    root, no memory controller).
    """

    def __init__(self, limit_bytes: int):
        found = _memory_controller()
        if found is None:
            raise RuntimeError("no cgroup memory controller for this process; run without a memory cap")
        self._limit_file, self.home = found
        # Under this process's own cgroup first; where that one is delegated read-only (a container's or a
        # VM's process cgroup), at the hierarchy's root, which a root user may still write.
        root = CGROUP_ROOTS[self._limit_file]
        errors = []
        for parent in dict.fromkeys((self.home, root)):
            self.parent = parent
            self.path = parent / f"lightning-ooc-bench-{os.getpid()}-{secrets.token_hex(3)}"
            try:
                self.path.mkdir()
                (self.path / self._limit_file).write_text(str(int(limit_bytes)))
                break
            except OSError as e:
                errors.append(f"under {parent}: {e.strerror}")
                self.close()
        else:
            raise RuntimeError(f"cannot create a memory cgroup ({'; '.join(errors)}); run as root")
        self.limit = int(limit_bytes)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def __enter__(self) -> "MemoryCap":
        self.add(os.getpid())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            (self.home / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            pass
        self.close()

    def peak_bytes(self) -> int | None:
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            try:
                return int((self.path / name).read_text())
            except (OSError, ValueError):
                continue
        return None

    def close(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def device_read_bytes(path: Path) -> int | None:
    """Bytes read so far from the block device that holds ``path`` (the kernel's count of sectors read, for
    every process: read it before and after a run on an otherwise quiet machine), or None where the kernel
    does not say."""
    try:
        st = os.stat(path)
        fields = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat").read_text().split()
        return int(fields[2]) * 512  # sectors read; the kernel counts them in 512-byte units
    except (OSError, IndexError, ValueError):
        return None


#: the tracked folder of raw results (relative to the repository root): files there are outputs, not code
RESULTS_DIR = "benchmarks/results/"


def code_version(root: Path | None = None) -> dict[str, Any]:
    """The package's git commit (or that of the checkout at ``root``) and whether its tracked files had changes
    other than results under :data:`RESULTS_DIR` (``None`` outside a git checkout)."""
    root = root or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if head.returncode != 0:
        return {"commit": None, "dirty": None}
    # a result being written under benchmarks/results (the run's own output) is no change to the code
    changed = [line for line in dirty.stdout.splitlines() if line[3:] and not line[3:].startswith(RESULTS_DIR)]
    return {"commit": head.stdout.strip(), "dirty": bool(changed)}


def anon_bytes(cgroup: Path) -> int | None:
    """A cgroup's anonymous memory now (v1 ``rss``, which includes ``rss_huge``; v2 ``anon``): what the page
    cache is not."""
    try:
        stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    if "anon" in stat:
        return int(stat["anon"])
    return int(stat["rss"]) if "rss" in stat else None


class AnonPeak(threading.Thread):
    """Samples a cgroup's anonymous memory every 0.2 s and keeps the largest (the kernel keeps no such peak)."""

    def __init__(self, cgroup: Path):
        super().__init__(daemon=True, name="looc-bench-anon")
        self.cgroup, self.peak, self._stop_event = cgroup, 0, threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.2):
            self.peak = max(self.peak, anon_bytes(self.cgroup) or 0)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return self.peak


def run_capped(cmd: Sequence[str], cap: int | None, log_path: Path, timeout: float | None = None) -> dict[str, Any]:
    """Run ``cmd`` in a child process, in a memory cgroup of ``cap`` bytes (none without ``cap``), its output in
    ``log_path``; killed after ``timeout`` seconds. Returns its exit ``code``, ``seconds``, its own peak RSS
    (``peak_rss_bytes``), the cgroup's peak anonymous memory and peak (``peak_anon_bytes``,
    ``cgroup_peak_bytes``; None without a cap), ``timed_out`` and the ``output``."""
    cg = MemoryCap(cap) if cap else None
    timed_out = False
    try:
        with open(log_path, "w+") as f:
            t0 = time.perf_counter()
            proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT)
            anon = None
            if cg is not None:
                cg.add(proc.pid)
                anon = AnonPeak(cg.path)
                anon.start()
            while True:  # waited here (not by Popen): its own rusage, peak RSS included
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if timeout is not None and not timed_out and time.perf_counter() - t0 > timeout:
                    proc.kill()
                    timed_out = True
                time.sleep(0.05)
            seconds = time.perf_counter() - t0
            peak_anon = anon.stop() if anon is not None else None
            proc.returncode = code = os.waitstatus_to_exitcode(status)
            peak_cgroup = cg.peak_bytes() if cg is not None else None
            f.seek(0)
            output = f.read()
    finally:
        if cg is not None:
            cg.close()
    return {"code": code, "seconds": seconds, "peak_rss_bytes": int(usage.ru_maxrss) * 1024,
            "peak_anon_bytes": peak_anon or None, "cgroup_peak_bytes": peak_cgroup, "timed_out": timed_out,
            "output": output}  # fmt: skip


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt|Exit)\b.*")


def failure_line(code: int, output: str) -> str:
    """Why a child process failed, in one line: killed by SIGKILL (what the kernel does to a cgroup over its
    memory limit; the output's last line then says nothing), else its exit status and :func:`error_line`.

        >>> failure_line(-9, "UserWarning: something deprecated")
        'exit -9 (killed: out of memory under the cap?)'
        >>> failure_line(1, "Traceback (most recent call last):\\nKeyError: 'nope'")
        "exit 1: KeyError: 'nope'"
    """
    if code in (-9, 137):
        return f"exit {code} (killed: out of memory under the cap?)"
    line = error_line(output)
    return f"exit {code}: {line}" if line else f"exit {code}"


def error_line(output: str) -> str:
    """The one line that says why a child process failed: its exception's last line (``KeyError: 'x'``, a
    package error naming the file and the fix) or the command line's ``lightning-ooc: error: ...``, not the
    traceback above it; else its last line.

        >>> error_line("Traceback (most recent call last):\\n  File x.py, line 1\\nKeyError: 'nope'\\n")
        "KeyError: 'nope'"
    """
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("lightning-ooc: error:") or _EXCEPTION_LINE.match(ln):
            return ln
    return lines[-1] if lines else ""


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (field 3 of proc(5) first), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone, or not Linux
        return None
    return text[text.rindex(")") + 2:].split()


def process_cpu_seconds(pid: int | None = None) -> float | None:
    """User + system CPU seconds of a process and every process below it: all their threads, the children
    already waited for (the kernel adds those to the parent's count) and the ones alive now (PyG's loader
    workers), from ``/proc``; None where ``/proc`` is not there.

        >>> t = process_cpu_seconds()
        >>> t is None or t > 0
        True
    """
    pid = os.getpid() if pid is None else int(pid)
    own = _stat_fields(pid)
    if own is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry.name)
            if fields is not None:
                parents.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        fields = own if p == pid else _stat_fields(p)
        if fields is not None:  # utime, stime, cutime, cstime: fields 14-17 of proc(5)
            total += sum(int(v) for v in fields[11:15])
        todo += parents.get(p, [])
    return total / tick
