"""The memory limit, the tally of host memory and the plan's check against the limit (lightning_ooc.store.limits,
lightning_ooc.store.tally and lightning_ooc.store.planner)."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_ooc.errors import InputError
from lightning_ooc.store.limits import UNLIMITED, MemoryLimit, memory_limit
from lightning_ooc.store.planner import PlanPart, StorePlan, check_fits, fit_parts
from lightning_ooc.store.tally import (HEAP_SLACK_PER_NODE, ProcessShape, edges_per_batch_bound, host_tally,
                                       sampler_workspace_bytes, training_reserve)

MiB = 1 << 20
GiB = 1 << 30
PYTHON = str(Path(sys.executable))


# ------------------------------------------------------------------------------------------------
# memory_limit against fake /proc and /sys trees
# ------------------------------------------------------------------------------------------------
def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _meminfo(root: Path, avail: int, total: int = 64 * GiB) -> None:
    _write(root / "proc/meminfo", f"MemTotal: {total // 1024} kB\nMemFree: 1000 kB\nMemAvailable: {avail // 1024} kB\n")


def _v1_level(d: Path, limit: int, usage: int, inactive: int = 0, hier: int | None = None) -> None:
    _write(d / "memory.limit_in_bytes", f"{limit}\n")
    _write(d / "memory.usage_in_bytes", f"{usage}\n")
    stat = f"cache 0\nrss {usage}\ntotal_inactive_file {inactive}\n"
    if hier is not None:
        stat = f"hierarchical_memory_limit {hier}\n" + stat
    _write(d / "memory.stat", stat)


V1_NONE = 9223372036854771712  # what cgroup v1 reports for "no limit"


def test_limit_v1_tightest_ancestor(tmp_path):
    _write(tmp_path / "proc/self/cgroup", "9:pids:/\n4:memory:/jobs/run7\n1:cpu:/\n0::/\n")
    _write(tmp_path / "proc/self/mountinfo",
           "30 25 0:27 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
           "31 25 0:28 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")  # fmt: skip
    v1 = tmp_path / "sys/fs/cgroup/memory"
    _v1_level(v1, V1_NONE, 20 * GiB)
    _v1_level(v1 / "jobs", 1 * GiB, 900 * MiB, inactive=100 * MiB)  # the parent is the tight one
    _v1_level(v1 / "jobs/run7", V1_NONE, 300 * MiB, inactive=50 * MiB)
    _meminfo(tmp_path, 8 * GiB)
    _write(tmp_path / "proc/self/status", "Name:\tpython\nVmRSS:\t  307200 kB\n")
    lim = memory_limit(tmp_path)
    assert lim.bytes == 1 * GiB - 800 * MiB
    assert lim.source == "cgroup v1 /sys/fs/cgroup/memory/jobs: memory.limit_in_bytes 1.00 GiB, 800.00 MiB in use"
    assert lim.limit == GiB and lim.used == 800 * MiB and lim.rss == 300 * MiB
    assert str(lim).startswith("224.00 MiB available (cgroup v1 ")


def test_limit_v1_own_cgroup_and_default_mount_without_mountinfo(tmp_path):
    _write(tmp_path / "proc/self/cgroup", "4:memory:/job\n")
    _v1_level(tmp_path / "sys/fs/cgroup/memory", V1_NONE, 5 * GiB)
    _v1_level(tmp_path / "sys/fs/cgroup/memory/job", 600 * MiB, 210 * MiB)
    _meminfo(tmp_path, 8 * GiB)
    lim = memory_limit(tmp_path)
    assert lim.bytes == 390 * MiB
    assert "/sys/fs/cgroup/memory/job: memory.limit_in_bytes 600.00 MiB, 210.00 MiB in use" in lim.source


def test_limit_v1_namespace_uses_mount_and_hierarchical_limit(tmp_path):
    # a container: its cgroup is mounted as the root of the hierarchy; an invisible ancestor limits it
    _write(tmp_path / "proc/self/cgroup", "4:memory:/docker/abc\n")
    _write(tmp_path / "proc/self/mountinfo",
           "30 25 0:27 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n")  # fmt: skip
    _v1_level(tmp_path / "sys/fs/cgroup/memory", V1_NONE, 100 * MiB, hier=512 * MiB)
    _meminfo(tmp_path, 8 * GiB)
    lim = memory_limit(tmp_path)
    assert lim.bytes == 412 * MiB and "hierarchical_memory_limit 512.00 MiB" in lim.source


def test_limit_v2_max_high_and_current(tmp_path):
    _write(tmp_path / "proc/self/cgroup", "0::/user.slice/job\n")
    _write(tmp_path / "proc/self/mountinfo", "24 23 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n")
    cg = tmp_path / "sys/fs/cgroup"
    _write(cg / "cgroup.controllers", "cpu io memory pids\n")
    _write(cg / "user.slice/memory.max", "max\n")
    _write(cg / "user.slice/memory.current", f"{3 * GiB}\n")
    _write(cg / "user.slice/job/memory.max", f"{600 * MiB}\n")
    _write(cg / "user.slice/job/memory.high", "max\n")
    _write(cg / "user.slice/job/memory.current", f"{210 * MiB}\n")
    _write(cg / "user.slice/job/memory.stat", f"anon {150 * MiB}\ninactive_file {10 * MiB}\n")
    _meminfo(tmp_path, 8 * GiB)
    lim = memory_limit(tmp_path)
    assert lim.bytes == 400 * MiB
    assert lim.source == "cgroup v2 /sys/fs/cgroup/user.slice/job: memory.max 600.00 MiB, 200.00 MiB in use"
    _write(cg / "user.slice/job/memory.high", f"{500 * MiB}\n")  # throttled above memory.high: that counts
    assert memory_limit(tmp_path).bytes == 300 * MiB and "memory.high 500.00 MiB" in memory_limit(tmp_path).source


def test_limit_meminfo_when_cgroups_do_not_limit(tmp_path):
    _write(tmp_path / "proc/self/cgroup", "4:memory:/\n0::/\n")
    _v1_level(tmp_path / "sys/fs/cgroup/memory", V1_NONE, 5 * GiB)
    _write(tmp_path / "sys/fs/cgroup/unified/cgroup.procs", "1\n")  # hybrid layout: v2 without memory
    _meminfo(tmp_path, 3 * GiB, total=16 * GiB)
    lim = memory_limit(tmp_path)
    assert lim.bytes == 3 * GiB
    assert lim.source == "MemAvailable 3.00 GiB of MemTotal 16.00 GiB in /proc/meminfo"
    # a cgroup limit looser than MemAvailable loses to it
    _write(tmp_path / "proc/self/cgroup", "4:memory:/big\n")
    _v1_level(tmp_path / "sys/fs/cgroup/memory/big", 10 * GiB, 1 * GiB)
    assert memory_limit(tmp_path).source.startswith("MemAvailable")


def test_limit_nothing_readable_is_unlimited(tmp_path):
    lim = memory_limit(tmp_path)
    assert lim.unlimited and lim.bytes >= UNLIMITED and "no cgroup memory limit" in lim.source
    assert check_fits(_shape(), host_rows=10**6, buffer_slots=10**6, min_slots=1, staging_bytes=GiB,
                      limit=lim).shrunk == []  # fmt: skip


def test_limit_of_this_process():
    lim = memory_limit()
    assert lim.bytes > 0 and lim.source and (lim.rss or 0) > 0


# ------------------------------------------------------------------------------------------------
# the tally
# ------------------------------------------------------------------------------------------------
def _shape(**kw) -> ProcessShape:
    opts = dict(num_nodes=3_000_000, row_bytes=64, max_nodes_per_batch=40_000, max_edges_per_batch=60_000,
                train_nodes=30_000, eval_nodes=45_000)  # fmt: skip
    opts.update(kw)
    return ProcessShape(**opts)


def test_tally_per_node_bytes_by_phase():
    """Above 4M nodes (no heap slack) the per-node bytes per phase are exactly those of the module docstring."""
    n1, n2 = 5_000_000, 10_000_000

    def per_node(phase, **kw):
        t1 = host_tally(_shape(num_nodes=n1, **kw), host_rows=1000, buffer_slots=10**6, staging_bytes=8 * MiB)
        t2 = host_tally(_shape(num_nodes=n2, **kw), host_rows=1000, buffer_slots=10**6, staging_bytes=8 * MiB)
        return (t2.total(phase) - t1.total(phase)) / (n2 - n1)

    assert per_node("choosing hot rows") == 2  # int16 counts; the ranking's temporaries are chunks and k-sized
    assert per_node("choosing hot rows", host_cache_policy="degree") == 0  # the in-degree a slice at a time
    assert per_node("simulating the buffer") == 2 + 1 + 4
    assert per_node("building the store") == 2 + 4 + 4
    assert per_node("training") == 4 + 4
    below = host_tally(_shape(num_nodes=3_000_000), host_rows=0, buffer_slots=1, staging_bytes=MiB)
    assert below.groups("training")["heap slack"] == HEAP_SLACK_PER_NODE * 3_000_000


def test_tally_budgets_and_batches():
    shape = _shape(num_nodes=10**7)
    t = host_tally(shape, host_rows=10**6, buffer_slots=2 * 10**6, staging_bytes=8 * MiB)
    g = t.groups("training")
    assert g["host cache"] == 10**6 * (64 + 8) and g["staging"] == 8 * MiB and g["buffer"] == 2 * 10**6 * 64
    assert g["per-slot"] == 54 * 2 * 10**6 + 256
    assert g["batches"] == (4 * sampler_workspace_bytes(40_000, 60_000, 10**7) + 20 * (64 * 40_000 + 16 * 60_000)
                            + 3 * 40_000 * 64)  # fmt: skip
    on_gpu = host_tally(_shape(num_nodes=10**7, buffer_on_host=False), host_rows=10**6, buffer_slots=2 * 10**6,
                        staging_bytes=8 * MiB).groups("training")  # fmt: skip
    assert "buffer" not in on_gpu and on_gpu["per-slot"] == g["per-slot"]  # slot tables stay in host memory
    assert [i.what for i in t.held][0] == "indptr" and t.held[0].bytes == 8 * (10**7 + 1)
    shared = host_tally(_shape(topology_shared=True), host_rows=0, buffer_slots=1, staging_bytes=MiB)
    assert shared.held[0].bytes == 0


def test_edges_bound_and_workspace():
    assert edges_per_batch_bound(1000, [10, 10, 10], max_nodes=800_000) == 1_110_000
    assert edges_per_batch_bound(1000, [10, 5], max_nodes=2_000) == 20_000
    assert edges_per_batch_bound(1000, [-1], max_nodes=2_000, num_edges=7_000) == 7_000
    assert edges_per_batch_bound(1000, [-1], max_nodes=2_000, num_edges=7_000, replace=True) == 20_000
    assert edges_per_batch_bound(None, None, max_nodes=2_000) == 20_000
    small, big = sampler_workspace_bytes(1_000, 2_000, 10**6), sampler_workspace_bytes(100_000, 200_000, 10**6)
    assert 0 < small < big and big == 8 * (3 * 262_144 + 524_288) + 16 * 1_048_576 * 3 // 2


def _anon_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


_SETUP_CHILD = """
import json, sys
from lightning_ooc import OutOfCoreNodeData, Tiered
dm = OutOfCoreNodeData(sys.argv[1], batch_size=500, num_neighbors=[5, 5], progress=False,
                       features=Tiered(gpu_cache="16MiB", host_cache="4MiB", staging="4MiB", queue_depth=32,
                                       presample_batches=8),
                       pipeline={"num_samplers": 2, "num_extractors": 2})
print("READY", flush=True)
sys.stdin.readline()
dm.setup()
p, ds, cfg = dm.plan, dm.dataset, dm.config
print(json.dumps(dict(slots=p.buffer_slots, host_rows=p.host_rows, staging=p.staging_bytes,
                      max_nodes=p.max_nodes_per_batch, num_edges=ds.num_edges, splits=ds.meta["split_sizes"],
                      row_bytes=ds.row_bytes, batch_size=cfg.batch_size, fanout=cfg.num_neighbors)), flush=True)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc to read RssAnon")
def test_tally_against_rss_of_setup(tmp_path):
    """The RSS growth of ``setup()`` in a fresh process is what the tally counts (per node: 16-40 B, not ~80 B)."""
    from lightning_ooc.data.synth import synthesize

    n = 1_000_000
    root = synthesize(tmp_path / "g", num_nodes=n, avg_degree=4, num_features=8, num_classes=4, progress=False)
    proc = subprocess.Popen([PYTHON, "-c", _SETUP_CHILD, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "READY"
        base = peak = _anon_bytes(proc.pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        while proc.poll() is None:
            peak = max(peak, _anon_bytes(proc.pid) or 0)
            time.sleep(0.0005)
        out = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, out
    info = json.loads(out.strip().splitlines()[-1])
    shape = ProcessShape(
        num_nodes=n, row_bytes=info["row_bytes"], max_nodes_per_batch=info["max_nodes"],
        max_edges_per_batch=edges_per_batch_bound(info["batch_size"], info["fanout"], info["max_nodes"],
                                                  info["num_edges"]),
        num_samplers=2, num_extractors=2, train_nodes=info["splits"]["train"], reader_workers=2, reader_queue_depth=32,
        presampled_nodes=8 * info["max_nodes"],
    )  # fmt: skip
    tally = host_tally(shape, host_rows=info["host_rows"], buffer_slots=info["slots"], staging_bytes=info["staging"])
    untouched = info["slots"] * info["row_bytes"] + info["staging"]  # setup allocates but does not touch these
    setup = [p for p in tally.phases if p != "training"]
    slack = tally.groups(setup[0]).get("heap slack", 0)
    counted = tally.held_bytes + max(tally.total(p) - (untouched if p == "building the store" else 0) for p in setup)
    measured = peak - base
    # never more than counted with glibc's worst heap slack; without it, no more than ~25 % below (the
    # FIFO halves and the fill temporaries counted for the store are not all touched yet at setup)
    assert 0.75 * (counted - slack) <= measured <= counted, (measured / MiB, (counted - slack) / MiB, counted / MiB)


# ------------------------------------------------------------------------------------------------
# shrink or refuse
# ------------------------------------------------------------------------------------------------
def _lim(mib: float, source: str = "cgroup v1 /sys/fs/cgroup/memory/t: memory.limit_in_bytes 600.00 MiB, x in use"):
    return MemoryLimit(int(mib * MiB), source, rss=350 * MiB)


def test_fits_unchanged():
    shape = _shape()
    fit = check_fits(shape, host_rows=500_000, buffer_slots=1 << 20, min_slots=160_000, staging_bytes=8 * MiB,
                     limit=_lim(4096))  # fmt: skip
    assert (fit.host_rows, fit.buffer_slots, fit.shrunk) == (500_000, 1 << 20, [])
    assert fit.reserve == training_reserve(40_000) and fit.need + fit.reserve <= fit.limit.bytes


def test_shrinks_host_cache_with_warning(caplog):
    shape = _shape(num_nodes=5_000_000, row_bytes=512)
    full = host_tally(shape, host_rows=5_000_000, buffer_slots=200_000, staging_bytes=8 * MiB).peak
    limit = _lim((full + training_reserve(40_000)) / MiB - 1024)  # 1 GiB short
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        fit = check_fits(shape, host_rows=5_000_000, buffer_slots=200_000, min_slots=160_000, staging_bytes=8 * MiB,
                         limit=limit)  # fmt: skip
    assert fit.buffer_slots == 200_000 and 0 < fit.host_rows < 5_000_000
    assert fit.need + fit.reserve <= limit.bytes  # the shrunk plan fits ...
    assert host_tally(shape, host_rows=fit.host_rows + 1, buffer_slots=200_000,  # ... and is the largest that does
                      staging_bytes=8 * MiB).peak + fit.reserve > limit.bytes  # fmt: skip
    (msg,) = [r.getMessage() for r in caplog.records]
    assert msg.startswith("lightning_ooc: host_cache shrunk from 2.38 GiB to ")
    assert "to fit in memory: " in msg and limit.source in msg and "kept for training" in msg
    assert f"set features.host_cache={fit.host_rows * 512 >> 20}MiB to plan this without a warning" in msg


def test_shrinks_cpu_buffer_after_host_cache(caplog):
    shape = _shape(num_nodes=5_000_000, row_bytes=512)
    at_reserve = host_tally(shape, host_rows=0, buffer_slots=160_000, staging_bytes=8 * MiB).peak
    limit = _lim((at_reserve + training_reserve(40_000)) / MiB + 50)
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        fit = check_fits(shape, host_rows=1_000_000, buffer_slots=1_000_000, min_slots=160_000,
                         staging_bytes=8 * MiB, limit=limit)  # fmt: skip
    assert fit.host_rows == 0 and 160_000 < fit.buffer_slots < 1_000_000
    assert fit.need + fit.reserve <= limit.bytes
    assert [s.split(" (")[0] for s in fit.shrunk] == [
        "host_cache shrunk from 488.28 MiB to 0 B",
        f"gpu_cache shrunk from 488.28 MiB to {fit.buffer_slots * 512 / MiB:.2f} MiB",
    ]
    assert "set features.host_cache=0 and features.gpu_cache=" in caplog.records[0].getMessage()


def test_gpu_buffer_is_not_shrunk_and_refusal_names_everything():
    shape = _shape(num_nodes=5_000_000, row_bytes=512, buffer_on_host=False)
    with pytest.raises(InputError) as e:
        check_fits(shape, host_rows=1_000_000, buffer_slots=4_000_000, min_slots=160_000, staging_bytes=64 * MiB,
                   limit=_lim(400))  # fmt: skip
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("the plan does not fit in memory: 400.00 MiB available (cgroup v1 /sys/fs/cgroup/memory/t")
    assert "this process already holds 350.00 MiB (anonymous and shared memory, mapped code and libraries)" in msg
    assert "per-node structures for 5,000,000 nodes" in msg and "staging 64.00 MiB" in msg and "batches" in msg
    assert "asked: host_cache 488.28 MiB, gpu_cache 1.91 GiB" in msg
    assert "lower features.staging (64.00 MiB now; 1MiB is enough)" in msg
    assert "lower features.gpu_cache (its 4,000,000 slots keep 205.99 MiB of tables in host memory)" in msg
    assert "raise the memory limit by " in msg


def test_refusal_says_how_much_and_what_to_shrink_on_cpu():
    shape = _shape(num_nodes=2_000_000, row_bytes=4096)
    small = host_tally(shape, host_rows=0, buffer_slots=160_000, staging_bytes=8 * MiB).peak
    limit = _lim((small + training_reserve(40_000)) / MiB - 100)  # 100 MiB short even at the minimum
    with pytest.raises(InputError) as e:
        check_fits(shape, host_rows=500_000, buffer_slots=400_000, min_slots=160_000, staging_bytes=8 * MiB,
                   limit=limit)  # fmt: skip
    msg = str(e.value)
    assert "even with no host cache and the smallest feature buffer (160,000 slots)" in msg
    assert "buffer 625.00 MiB" in msg and "100.00 MiB too much" in msg and "raise the memory limit by 100.00 MiB" in msg
    assert "lower batch_size / num_neighbors (batches of up to 40,000 nodes" in msg
    assert "a feature buffer reserve of 625.00 MiB" in msg


def test_refusal_where_per_node_structures_alone_do_not_fit_names_them():
    shape = _shape(num_nodes=50_000_000, max_nodes_per_batch=1000, max_edges_per_batch=1000, train_nodes=1000)
    # 10 B per node while the store is built (counts, node -> slot, host cache map), the ranking's keys a chunk at
    # a time
    with pytest.raises(InputError, match=r"while building the store \(per-node structures for 50,000,000 nodes "
                                         r"476\.84 MiB.* raise the memory limit by"):  # fmt: skip
        check_fits(shape, host_rows=0, buffer_slots=4000, min_slots=4000, staging_bytes=MiB, limit=_lim(500))


def test_processes_share_the_limit():
    shape = _shape()
    need = host_tally(shape, host_rows=0, buffer_slots=200_000, staging_bytes=8 * MiB).peak + training_reserve(40_000)
    limit = _lim(need / MiB + 10)
    assert check_fits(shape, host_rows=0, buffer_slots=200_000, min_slots=200_000, staging_bytes=8 * MiB,
                      limit=limit).shrunk == []  # fmt: skip
    with pytest.raises(InputError, match=r"1/2 of it per process: 2 processes plan at once"):
        check_fits(shape, host_rows=0, buffer_slots=200_000, min_slots=200_000, staging_bytes=8 * MiB, limit=limit,
                   processes=2)  # fmt: skip


def test_from_budgets_keeps_old_callers_and_prints_memory_line(caplog):
    kw = dict(num_nodes=10**6, row_bytes=512, gpu_cache="256MiB", host_cache="64MiB", staging="32MiB",
              max_nodes_per_batch=20000, num_extractors=4, train_queue_size=4, device="cpu")  # fmt: skip
    plan = StorePlan.from_budgets(**kw)  # reads this process's limit
    assert plan.buffer_slots == 256 * MiB // 512 and plan.host_rows == 64 * MiB // 512
    line = plan.format().splitlines()[-1]
    assert line.startswith("  host memory ") and "planned at its peak" in line
    assert plan.memory_fit is not None and plan.memory_fit.limit.source in line
    # a tight limit shrinks the host cache and says so in the plan
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        tight = StorePlan.from_budgets(**kw, memory=MemoryLimit(700 * MiB, "a test limit"),
                                       split_sizes={"train": 10**4})  # fmt: skip
    assert tight.host_rows < plan.host_rows and "host_cache shrunk from 64.00 MiB to" in tight.format()
    assert "a test limit" in caplog.records[0].getMessage()
    off = StorePlan.from_budgets(**kw, memory=MemoryLimit.none())
    assert off.host_rows == plan.host_rows and "no memory limit (memory check turned off)" in off.format()
    with pytest.raises(InputError, match="the plan does not fit in memory: 100.00 MiB available"):
        StorePlan.from_budgets(**kw, memory=MemoryLimit(100 * MiB, "a test limit"))


def test_a_tight_cap_lowers_the_batches_in_flight_before_it_refuses(caplog):
    """Under a 700 MiB cap the plan wanted 16 batches in flight (~470 MiB with these batches) and refused with a
    paragraph, then, the queues lowered by hand, the buffer's reserve, then memory again. It now lowers the queues,
    samplers and extractors (and so the buffer's reserve) itself, says what it chose in one line, and refuses only
    where the smallest pipeline does not fit either."""
    kw = dict(num_nodes=10**6, row_bytes=512, gpu_cache="1GiB", host_cache="256MiB", staging="8MiB",
              max_nodes_per_batch=50_000, num_samplers=2, extract_queue_size=6, num_extractors=2, train_queue_size=4,
              device="cpu", batch_size=4096, num_neighbors=[15, 10], num_edges=20_000_000,
              split_sizes={"train": 100_000})  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        plan = StorePlan.from_budgets(**kw, memory=MemoryLimit(700 * MiB, "a test limit"))
    fit = plan.memory_fit
    assert plan.pipeline == {"extract_queue_size": 1, "train_queue_size": 1, "num_samplers": 1, "num_extractors": 1}
    assert plan.buffer_reserve == 50_000 and plan.buffer_slots >= plan.buffer_reserve  # one extractor's batch
    assert fit.shape.batches_in_flight == 6 and fit.need + fit.reserve <= 700 * MiB
    [line] = [r.getMessage() for r in caplog.records]
    assert ("pipeline shrunk from 2 samplers, queues 6/4, 2 extractors: 16 batches in flight to 1 sampler, queues 1/1, "
            "1 extractor: 6 batches in flight") in line  # fmt: skip
    assert "pipeline.num_samplers=1 and pipeline.num_extractors=1 to plan this without a warning" in line
    assert "pipeline shrunk from" in plan.format().splitlines()[-1]
    with pytest.raises(InputError, match=r"and the smallest pipeline \(1 sampler, queues 1/1, 1 extractor: 6 batches"):
        StorePlan.from_budgets(**kw, memory=MemoryLimit(600 * MiB, "a test limit"))


def test_memory_limit_setting():
    from lightning_ooc.loader.config import NodeDataConfig
    from lightning_ooc.store.limits import limit_from_setting

    for bad in ("lots", 0, -5, True, "0GiB"):
        with pytest.raises(InputError, match=r"memory_limit must be 'auto' .* or None \(no memory check\)"):
            NodeDataConfig(root="g", memory_limit=bad)
    assert NodeDataConfig(root="g", memory_limit="8GiB").memory_limit == "8GiB"
    assert limit_from_setting(None).unlimited
    own = limit_from_setting("2GiB")
    assert own.limit == 2 * GiB and own.bytes == 2 * GiB - own.rss and "memory_limit=2GiB" in own.source
    # what a plan made under a setting is checked against: the setting, not the machine
    shape = _shape()
    with pytest.raises(InputError, match=r"memory_limit=1GiB, .* held by this process"):
        check_fits(shape, host_rows=0, buffer_slots=10**7, min_slots=10**7, staging_bytes=8 * MiB,
                   limit=limit_from_setting("1GiB"))  # fmt: skip


# ------------------------------------------------------------------------------------------------
# end to end: a real memory cgroup
# ------------------------------------------------------------------------------------------------
_E2E_CHILD = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
from lightning_ooc import OutOfCoreNodeData, Tiered
TIERS = dict(gpu_cache="32MiB", host_cache="2GiB", staging="4MiB", queue_depth=32, presample_batches=4)
PIPELINE = dict(num_samplers=2, num_extractors=2)
dm = OutOfCoreNodeData(sys.argv[1], batch_size=64, num_neighbors=[4, 4], features=Tiered(**TIERS),
                       pipeline=PIPELINE, progress=False)
if sys.argv[2] == "probe":
    print("PROBED", flush=True)
    sys.exit(0)
dm.setup()
print("SETUP DONE", dm.plan.host_rows, flush=True)
batches = sum(1 for _ in dm.train_dataloader())
print("EPOCH DONE", batches, flush=True)
dm.teardown()
"""


def _cgroup_or_skip(limit: int):
    from lightning_ooc.bench.system import MemoryCap

    if os.geteuid() != 0:
        pytest.skip("needs root to create a memory cgroup")
    try:
        return MemoryCap(limit)
    except RuntimeError as e:
        pytest.skip(f"no writable cgroup memory controller: {e}")



def test_a_memory_cap_falls_back_to_the_hierarchy_root_where_its_own_cgroup_is_read_only(tmp_path, monkeypatch):
    # a VM's or container's process cgroup may refuse children while the root of the hierarchy takes them
    from lightning_ooc.bench import system

    home = tmp_path / "process_api" / "abc"
    home.parent.mkdir()
    home.write_text("")  # not a directory: a child cannot be made in it, as in a delegated read-only cgroup
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setattr(system, "_memory_controller", lambda: ("memory.max", home))
    monkeypatch.setitem(system.CGROUP_ROOTS, "memory.max", root)
    cap = system.MemoryCap(300 * MiB)
    try:
        assert cap.parent == root and cap.path.parent == root and cap.home == home
        assert (cap.path / "memory.max").read_text() == str(300 * MiB)
        assert [p.name for p in root.iterdir()] == [cap.path.name]
    finally:
        for f in cap.path.iterdir():
            f.unlink()
        cap.close()
    assert list(root.iterdir()) == []
    monkeypatch.setitem(system.CGROUP_ROOTS, "memory.max", tmp_path / "no-such-root")
    with pytest.raises(RuntimeError, match=f"under {home}: .*under {tmp_path / 'no-such-root'}: .*run as root"):
        system.MemoryCap(300 * MiB)

def _run_in(cap, *args: str, child: str = _E2E_CHILD) -> subprocess.CompletedProcess:
    """Run the child script inside ``cap`` from its first instruction on (the shell joins, then execs Python)."""
    cmd = ["sh", "-c", f'echo $$ > "{cap.path}/cgroup.procs" && exec "$@"', "sh", PYTHON, "-c", child, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def _oom_kills(cap) -> int:
    for name in ("memory.oom_control", "memory.events"):
        try:
            for line in (cap.path / name).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except OSError:
            continue
    return 0


def _check_not_killed(cap, r, limit):
    kills, peak = _oom_kills(cap), cap.peak_bytes()
    tail = f"\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-4000:]}"
    assert r.returncode != -signal.SIGKILL and kills == 0, (
        f"killed by the kernel under a {limit / MiB:.0f} MiB cgroup (oom_kill {kills}, peak {peak}): the plan did "
        f"not keep setup within the memory limit{tail}"
    )
    return tail


@pytest.mark.slow
def test_capped_3m_nodes_small_budgets_run_or_are_refused(tmp_path):
    """3M nodes, 64/32/8 MiB budgets, a 600 MiB cgroup: before the plan counted its per-node structures this was
    killed by the kernel with no message; now it runs, or setup says what does not fit and what to shrink."""
    from lightning_ooc.data.synth import synthesize

    root = synthesize(tmp_path / "g3m", num_nodes=3_000_000, avg_degree=5, num_features=16, num_classes=4,
                      train_frac=0.01, progress=False)  # fmt: skip
    child = _E2E_CHILD
    for old, new in (("batch_size=64, num_neighbors=[4, 4],", "batch_size=256, num_neighbors=[10, 10],"),
                     ('TIERS = dict(gpu_cache="32MiB", host_cache="2GiB", staging="4MiB", queue_depth=32, '
                      'presample_batches=4)', 'TIERS = dict(gpu_cache="64MiB", host_cache="32MiB", staging="8MiB")'),
                     ("PIPELINE = dict(num_samplers=2, num_extractors=2)", "PIPELINE = None")):  # fmt: skip
        assert child.count(old) == 1, old
        child = child.replace(old, new)  # the datamodule's defaults otherwise
    limit = 600 * MiB
    cap = _cgroup_or_skip(limit)
    try:
        r = _run_in(cap, str(root), "run", child=child)
        tail = _check_not_killed(cap, r, limit)
    finally:
        cap.close()
    if r.returncode == 0:
        assert "EPOCH DONE" in r.stdout, tail
    else:
        last = r.stderr.strip().splitlines()[-1]
        assert "InputError: the plan does not fit in memory: " in last and "600.00 MiB" in last, tail
        assert "per-node structures for 3,000,000 nodes" in last and "to fit, " in last, tail


@pytest.mark.slow
def test_capped_setup_shrinks_or_refuses_never_killed(tmp_path):
    """host_cache="2GiB" of 586 MiB of features, under a cap ~330 MiB above the process's own size.

    Before the plan checked memory this was OOM-killed (SIGKILL, oom_kill 1) while filling the
    host cache; now setup shrinks the host cache with a warning and an epoch runs, or setup raises
    an InputError that says what to shrink.
    """
    from lightning_ooc.data.synth import synthesize

    root = synthesize(tmp_path / "wide", num_nodes=100_000, avg_degree=5, num_features=1536, num_classes=4,
                      progress=False)  # fmt: skip
    features = (root / "features.bin").stat().st_size
    probe = _cgroup_or_skip(64 * GiB)  # no real limit: how much does the process hold before setup?
    try:
        r = _run_in(probe, str(root), "probe")
        assert r.returncode == 0 and "PROBED" in r.stdout, r.stderr[-3000:]
        base = probe.peak_bytes()
    finally:
        probe.close()
    assert base is not None
    limit = base + 330 * MiB
    assert features > limit - base  # the host cache asked for cannot fit
    cap = _cgroup_or_skip(limit)
    try:
        r = _run_in(cap, str(root), "run")
        tail = _check_not_killed(cap, r, limit)
    finally:
        cap.close()
    if r.returncode == 0:
        assert "SETUP DONE" in r.stdout and "EPOCH DONE" in r.stdout, tail
        assert "host_cache shrunk from 585.94 MiB to " in r.stderr and "to fit in memory: " in r.stderr, tail
        assert "cgroup v1 " in r.stderr or "cgroup v2 " in r.stderr, tail
    else:
        last = r.stderr.strip().splitlines()[-1]
        assert "InputError: the plan does not fit in memory: " in last and "to fit, " in last, tail


def test_file_cache_active_or_not_is_not_in_use_and_mapped_file_pages_are_not_held(tmp_path):
    """Pages of mapped files (topology, link splits) are given back under pressure: neither the cgroup's
    active nor inactive file cache counts as in use, nor does a process's RssFile count as held by it
    (with no smaps to read, none of it is known to be code)."""
    _write(tmp_path / "proc/self/cgroup", "4:memory:/job\n")
    _v1_level(tmp_path / "sys/fs/cgroup/memory", V1_NONE, 5 * GiB)
    job = tmp_path / "sys/fs/cgroup/memory/job"
    _v1_level(job, 2 * GiB, 1500 * MiB)
    _write(job / "memory.stat", f"total_active_file {700 * MiB}\ntotal_inactive_file {100 * MiB}\n"
                                f"active_file {1}\ninactive_file {1}\n")  # fmt: skip
    _write(tmp_path / "proc/self/status",
           "Name:\tpython\nVmRSS:\t 1048576 kB\nRssAnon:\t  409600 kB\nRssFile:\t  614400 kB\nRssShmem:\t   24576 kB\n")
    _meminfo(tmp_path, 8 * GiB)
    lim = memory_limit(tmp_path)
    assert lim.used == 700 * MiB and lim.bytes == 2 * GiB - 700 * MiB  # 1500 in use less 800 of file cache
    assert lim.rss == 424 * MiB  # anonymous + shared, not the 600 MiB of mapped file pages
    _write(tmp_path / "proc/self/status", "Name:\tpython\nVmRSS:\t  307200 kB\n")  # an old kernel: VmRSS
    assert memory_limit(tmp_path).rss == 300 * MiB
    # pages still to be written are not free: dirty and writeback count as in use
    _write(job / "memory.stat", f"total_active_file {700 * MiB}\ntotal_inactive_file {100 * MiB}\n"
                                f"total_dirty {60 * MiB}\ntotal_writeback {40 * MiB}\n")  # fmt: skip
    assert memory_limit(tmp_path).used == 800 * MiB


def _smaps(*maps: tuple[str, str, int, int]) -> str:
    """A ``/proc/PID/smaps`` of ``(perms, path, Rss, Anonymous)`` mappings (a path "" is anonymous memory)."""
    out = []
    for i, (perms, path, rss, anon) in enumerate(maps):
        inode = 0 if not path or path.startswith("[") else 1000 + i
        out.append(f"{0x7f0000000000 + i * 2**32:x}-{0x7f0000000000 + i * 2**32 + rss:x} {perms} 00000000 fe:00 "
                   f"{inode}    {path}\nSize: {rss // 1024} kB\nRss: {rss // 1024} kB\nPss: {rss // 1024} kB\n"
                   f"Anonymous: {anon // 1024} kB\nVmFlags: rd mr mw me\n")  # fmt: skip
    return "".join(out)


def test_mapped_code_charged_to_the_cgroup_is_in_use(tmp_path):
    """The cgroup charges the pages of the libraries a process runs (~170 MiB of torch and its kin) as
    mapped file cache; the plan counted them as free, so runs planned up to the limit stalled, their code
    read back from disk page by page. They are in use where the cgroup is charged for them, and held by
    the process; the dataset's shared maps and copied-on-write pages are not code."""
    _write(tmp_path / "proc/self/cgroup", "4:memory:/job\n")
    _v1_level(tmp_path / "sys/fs/cgroup/memory", V1_NONE, 5 * GiB)
    job = tmp_path / "sys/fs/cgroup/memory/job"
    _v1_level(job, 600 * MiB, 520 * MiB)
    stat = (f"total_active_file {180 * MiB}\ntotal_inactive_file {40 * MiB}\ntotal_shmem {10 * MiB}\n"
            f"total_mapped_file {220 * MiB}\n")  # libraries 170 + the dataset's maps 40 + shared memory 10
    _write(job / "memory.stat", stat)
    _write(tmp_path / "proc/self/smaps", _smaps(
        ("r--p", "/venv/lib/libtorch_cpu.so", 20 * MiB, 0), ("r-xp", "/venv/lib/libtorch_cpu.so", 132 * MiB, 0),
        ("rw-p", "/venv/lib/libtorch_cpu.so", 12 * MiB, 2 * MiB),  # 2 MiB copied on write: anonymous already
        ("r-xp", "/usr/lib/libc.so.6", 8 * MiB, 0),
        ("r--s", "/data/g/links/train.bin", 40 * MiB, 0),  # the dataset's map: data, given back under pressure
        ("rw-p", "", 300 * MiB, 300 * MiB), ("r-xp", "[vdso]", 8192, 0),
    ))  # fmt: skip
    _write(tmp_path / "proc/self/status", "Name:\tpython\nVmRSS:\t 522240 kB\nRssAnon:\t  307200 kB\n"
                                          "RssFile:\t  215040 kB\nRssShmem:\t   10240 kB\n")  # fmt: skip
    _meminfo(tmp_path, 8 * GiB)
    lim = memory_limit(tmp_path)
    # 520 in use less 220 of clean file cache, plus the 170 of code the cgroup is charged for
    assert lim.used == 470 * MiB and lim.bytes == 130 * MiB, lim
    assert lim.source.endswith("470.00 MiB in use (170.00 MiB of it mapped code and libraries)")
    from lightning_ooc.store.limits import mapped_code, process_rss

    assert mapped_code(tmp_path) == 170 * MiB
    assert lim.rss == process_rss(tmp_path) == (300 + 10 + 170) * MiB
    # the libraries were loaded first by another cgroup (charged there): only the dataset's maps are charged here
    _write(job / "memory.stat", stat.replace(f"total_mapped_file {220 * MiB}", f"total_mapped_file {50 * MiB}"))
    lim = memory_limit(tmp_path)
    assert lim.used == 300 * MiB and lim.bytes == 300 * MiB and lim.rss == 480 * MiB
    # no cgroup limit: MemAvailable counts the page cache as available, this process's code included
    _v1_level(job, V1_NONE, 520 * MiB)
    _write(job / "memory.stat", stat)
    lim = memory_limit(tmp_path)
    assert lim.bytes == 8 * GiB - 170 * MiB and "less 170.00 MiB of this process's mapped code" in lim.source


_MAPPED_CHILD = """
import mmap, os, sys
from lightning_ooc.store.limits import memory_limit
size, where = 64 << 20, sys.argv[1]
def written(name):  # written here: the page cache is charged to this cgroup, as a library read first here is
    path = os.path.join(where, name)
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20) * 64)
        f.flush()
        os.fsync(f.fileno())  # clean: file cache the kernel could take back
    return open(path, "rb")
def touch(m):
    return sum(m[i] for i in range(0, size, 4096))
lib, data = written("lib.so"), written("data.bin")
before = memory_limit()
code = mmap.mmap(lib.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_EXEC)  # as ld.so
touch(code)
with_code = memory_limit()
shared = mmap.mmap(data.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)  # as np.memmap(mode="r")
touch(shared)
with_data = memory_limit()
print("MIB", before.used >> 20, with_code.used >> 20, with_data.used >> 20, before.rss >> 20, with_code.rss >> 20,
      flush=True)
"""


def test_mapped_code_counted_under_a_real_cgroup(tmp_path):
    """A file mapped as the loader maps a library, its pages faulted in inside the cgroup: what the cgroup
    charges, the plan counts (before, 64 MiB of such pages were free to it); a data map stays free."""
    cap = _cgroup_or_skip(2 * GiB)
    try:
        r = _run_in(cap, str(tmp_path), child=_MAPPED_CHILD)
        stat = {k: int(v) for k, v in (line.split() for line in (cap.path / "memory.stat").read_text().splitlines())}
    finally:
        cap.close()
    assert r.returncode == 0, r.stderr[-3000:]
    before, with_code, with_data, rss0, rss1 = map(int, r.stdout.split("MIB")[1].split())
    assert with_code - before >= 56, r.stdout  # the 64 MiB of code pages the cgroup is charged for
    assert rss1 - rss0 >= 56, r.stdout  # and held by the process
    assert with_data - with_code <= 16, r.stdout  # pages of a data map are given back under pressure
    assert stat.get("cache", 0) >= 100 * MiB  # the two files were charged to this cgroup


# ------------------------------------------------------------------------------------------------
# a stage's memory goes with it (fit, then test, in one process)
# ------------------------------------------------------------------------------------------------
def test_a_closed_stage_lets_its_store_go_and_hands_freed_memory_back(demo_dataset, monkeypatch):
    """After ``fit`` the store was still held by the closed runs Lightning's loaders keep (a buffer, a host
    cache, slot tables) while the test stage planned beside it; now it goes at teardown, and the memory the
    stage freed is handed back to the kernel before the test stage plans."""
    import gc
    import weakref

    import lightning as L

    import lightning_ooc.datamodule as datamodule
    from lightning_ooc import OutOfCoreNodeData, Tiered
    from lightning_ooc.models import GraphSAGE

    released = []
    real = getattr(datamodule, "release_freed_memory", lambda *a, **k: None)
    monkeypatch.setattr(datamodule, "release_freed_memory", lambda *a, **k: released.append(1) or real(*a, **k),
                        raising=False)  # fmt: skip
    stores = []

    class Watch(L.Callback):
        def on_train_start(self, trainer, pl_module):
            stores.append(weakref.ref(trainer.datamodule.store))

    dm = OutOfCoreNodeData(demo_dataset.root, batch_size=64, num_neighbors=[4, 4], progress=False,
                           features=Tiered(gpu_cache="1MiB", host_cache="64KiB", staging="256KiB", presample_batches=4),
                           pipeline={"num_samplers": 2, "num_extractors": 2})  # fmt: skip
    model = GraphSAGE(dm.num_features, dm.num_classes, hidden_channels=16, num_layers=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=3, limit_val_batches=2,
                        logger=False, enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                        enable_progress_bar=False, callbacks=[Watch()])  # fmt: skip
    trainer.fit(model, datamodule=dm)
    gc.collect()
    assert stores and stores[0]() is None, "the fit stage's store outlived its teardown"
    assert released, "teardown did not hand the freed memory back"
    released.clear()
    trainer.test(model, datamodule=dm, verbose=False)
    assert released  # before the test stage's plan read what is in use


_FIT_TEST_CHILD = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
import lightning as L
from lightning_ooc import OutOfCoreNodeData, Tiered
from lightning_ooc.models import GraphSAGE
dm = OutOfCoreNodeData(sys.argv[1], batch_size=256, num_neighbors=[10, 10], progress=False,
                       features=Tiered(gpu_cache="64MiB", host_cache="4MiB", staging="8MiB", presample_batches=32),
                       pipeline={"num_samplers": 2, "num_extractors": 2})
model = GraphSAGE(dm.num_features, dm.num_classes, hidden_channels=128, num_layers=2)
trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                    enable_model_summary=False, num_sanity_val_steps=0, enable_progress_bar=False)
trainer.fit(model, datamodule=dm)
fit = dm.plan.memory_fit.limit
trainer.test(model, datamodule=dm, verbose=False)
test = dm.plan.memory_fit.limit
print("USED", fit.used >> 20, test.used >> 20, flush=True)
"""


def test_fit_then_test_in_one_process_plans_against_what_is_live(tmp_path):
    """Under a cgroup, the memory in use when the test stage plans is what the fit stage's plan saw plus
    what stayed live (model, optimizer, Lightning): ~28 MiB here. Before, the store kept by the closed
    runs and glibc's arenas (16 of them, one per pipeline thread) added 90-110 MiB, and under a 600 MiB
    cap the test stage refused, 3 runs of 3, after a fit that had run."""
    from lightning_ooc.data.synth import synthesize

    root = synthesize(tmp_path / "g", num_nodes=50_000, avg_degree=15, num_features=64, num_classes=10,
                      train_frac=0.05, val_frac=0.02, test_frac=0.05, progress=False)  # as configs/synth/demo.yaml
    cap = _cgroup_or_skip(4 * GiB)
    try:
        r = _run_in(cap, str(root), child=_FIT_TEST_CHILD)
    finally:
        cap.close()
    assert r.returncode == 0 and "USED" in r.stdout, r.stderr[-4000:]
    fit_used, test_used = map(int, r.stdout.split("USED")[1].split())
    assert test_used - fit_used <= 56, (fit_used, test_used)


_ARENA_CHILD = """
import threading
from lightning_ooc.store.limits import release_freed_memory
def anon():
    return next(int(l.split()[1]) >> 10 for l in open("/proc/self/status") if l.startswith("RssAnon"))
kept = []
def work():  # a pipeline thread: blocks of its own arena, freed between blocks that stay
    big = [(bytearray(48 << 10), bytearray(600)) for _ in range(800)]
    kept.extend(small for _, small in big)
    del big
threads = [threading.Thread(target=work) for _ in range(4)]
base = anon()
for t in threads:
    t.start()
for t in threads:
    t.join()
freed = anon()
trimmed = release_freed_memory()
print("MIB", base, freed, anon(), trimmed, flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc")
def test_release_freed_memory_gives_back_what_the_arenas_keep():
    """Blocks freed between blocks that stay are kept by glibc's arenas (the top of a heap goes back on
    its own, the middle does not); release_freed_memory hands their pages back."""
    r = subprocess.run([PYTHON, "-c", _ARENA_CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    base, freed, after, trimmed = r.stdout.split("MIB")[1].split()
    if trimmed != "True":
        pytest.skip("no glibc malloc_trim here")
    assert int(freed) - int(base) >= 100  # 4 x 800 x 48 KiB freed, still resident
    assert int(freed) - int(after) >= 100, r.stdout


# ------------------------------------------------------------------------------------------------
# a link batch's negatives
# ------------------------------------------------------------------------------------------------
def test_the_tally_counts_a_link_batchs_negatives_and_the_plan_shrinks_or_refuses():
    """512 edges x 1000 triplet negatives: the plan said 59 MiB while a fit took 1.2 GB (hidden 64) and was
    killed under a cap. Their indices ride in every batch in flight, the samplers draw them, and the model's
    scores of them take ~13-17 B per hidden unit each: counted, the host cache shrinks to make room, and
    what cannot fit is refused with the numbers and the options to lower."""
    from lightning_ooc.store.tally import (NEGATIVE_HELD_BYTES, NEGATIVE_SAMPLING_BYTES_PER_ID, RESERVE_PER_NEGATIVE,
                                           BatchNegatives)  # fmt: skip

    neg = BatchNegatives(512, 1000)
    shape = _shape(num_nodes=20_000, max_nodes_per_batch=20_000, max_edges_per_batch=80_000, negatives=neg)
    tally = host_tally(shape, host_rows=0, buffer_slots=40_000, staging_bytes=8 * MiB)
    inflight = shape.batches_in_flight * 512_000 * NEGATIVE_HELD_BYTES["triplet"]
    drawing = shape.num_samplers * 512_000 * NEGATIVE_SAMPLING_BYTES_PER_ID
    assert tally.groups("training")["negatives"] == inflight + drawing
    assert training_reserve(20_000, neg) == training_reserve(20_000) + 512_000 * RESERVE_PER_NEGATIVE["triplet"]
    binary = BatchNegatives(512, 3.5, "binary")
    assert binary.count == 1792 and binary.ids == 3584
    # the host cache gives way to the negatives
    small = _shape(num_nodes=20_000, row_bytes=1024, max_nodes_per_batch=2_000, max_edges_per_batch=8_000)
    plain = check_fits(small, host_rows=20_000, buffer_slots=8_000, min_slots=4_000, staging_bytes=MiB,
                       limit=_lim(225))  # fmt: skip
    fit = check_fits(replace_shape(small, BatchNegatives(256, 50)), host_rows=20_000, buffer_slots=8_000,
                     min_slots=4_000, staging_bytes=MiB, limit=_lim(225))  # fmt: skip
    assert plain.host_rows == 20_000 and 0 < fit.host_rows < 20_000 and fit.buffer_slots == 8_000
    assert fit.reserve == training_reserve(2_000, BatchNegatives(256, 50))
    # too many to fit: refused, naming the options and how far to lower them
    with pytest.raises(InputError) as e:
        check_fits(shape, host_rows=0, buffer_slots=40_000, min_slots=40_000, staging_bytes=MiB, limit=_lim(1000))
    msg = str(e.value)
    assert "batch_size=512 x neg_sampling amount=1000 (triplet): 512,000 negatives per batch" in msg, msg
    assert "lower neg_sampling amount or batch_size" in msg and "at most neg_sampling amount=" in msg, msg
    most = int(msg.split("at most neg_sampling amount=")[1].split()[0])
    assert 0 < most < 1000
    fits = check_fits(replace_shape(shape, BatchNegatives(512, most)), host_rows=0, buffer_slots=40_000,
                      min_slots=40_000, staging_bytes=MiB, limit=_lim(1000))  # fmt: skip
    assert fits.buffer_slots == 40_000
    with pytest.raises(InputError):
        check_fits(replace_shape(shape, BatchNegatives(512, most + 1)), host_rows=0, buffer_slots=40_000,
                   min_slots=40_000, staging_bytes=MiB, limit=_lim(1000))  # fmt: skip


def replace_shape(shape: ProcessShape, negatives) -> ProcessShape:
    import dataclasses

    return dataclasses.replace(shape, negatives=negatives)


def _link_graph(root: Path) -> Path:
    import numpy as np

    from lightning_ooc.data.prepare import prepare_from_arrays

    rng = np.random.default_rng(0)
    return prepare_from_arrays(root, rng.integers(0, 5000, (2, 30000)), rng.random((5000, 16), dtype=np.float32),
                               split_edges=(0.8, 0.1, 0.1), progress=False)  # fmt: skip


def test_link_negatives_past_the_limit_are_refused_before_the_presample(tmp_path):
    """Triplet negatives x2000 on batches of 256 edges need ~2 GiB to score: set-up refuses under 1 GiB at
    once, naming neg_sampling's amount and batch_size with the numbers, instead of presampling and planning
    as if they cost nothing; the plan of a run that fits counts them."""
    from lightning_ooc import OutOfCoreLinkData, Tiered
    from lightning_ooc.loader.context import ProcessContext
    from lightning_ooc.loader.link_task import LinkDataConfig, LinkPasses

    root = _link_graph(tmp_path / "links")
    opts = dict(batch_size=256, num_neighbors=[5, 5], progress=False,
                features=Tiered(gpu_cache="8MiB", host_cache="1MiB", staging="1MiB", presample_batches=2),
                pipeline={"num_samplers": 2, "num_extractors": 2})  # fmt: skip
    dm = OutOfCoreLinkData(root, neg_sampling={"mode": "triplet", "amount": 2000}, memory_limit="1GiB", **opts)
    with pytest.raises(InputError) as e:
        dm.setup("fit")
    msg = str(e.value)
    assert msg.startswith("the plan does not fit in memory: ") and "memory_limit=1GiB" in msg, msg
    assert "batch_size=256 x neg_sampling amount=2000 (triplet): 512,000 negatives per batch" in msg, msg
    assert "lower neg_sampling amount or batch_size" in msg and "at most neg_sampling amount=" in msg, msg
    # a run that fits: its plan counts the negatives (in flight, drawn, and the reserve for their scores)
    cfg = LinkDataConfig(str(root), neg_sampling={"mode": "binary", "amount": 4}, memory_limit="64GiB", **opts)
    passes = LinkPasses(cfg, ProcessContext())
    try:
        fit = passes.plan.memory_fit
        assert fit.shape.negatives.count == 1024 and fit.tally.groups("training")["negatives"] > 0
        assert fit.reserve == training_reserve(passes.plan.max_nodes_per_batch, fit.shape.negatives)
    finally:
        passes.close()


_NEG_CHILD = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
import lightning as L
from lightning_ooc import OutOfCoreLinkData, Tiered
from lightning_ooc.models import LinkPredictor
dm = OutOfCoreLinkData(sys.argv[1], batch_size=512, num_neighbors=[10, 5], neg_sampling={"mode": "triplet",
                       "amount": 1000}, progress=False,
                       features=Tiered(gpu_cache="64MiB", host_cache="4MiB", staging="8MiB", presample_batches=4),
                       pipeline={"num_samplers": 2, "num_extractors": 2})
dm.setup("fit")
print("SETUP DONE", flush=True)
model = LinkPredictor(dm.num_features, hidden_channels=64, num_layers=2)
trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=4, limit_val_batches=0,
                    logger=False, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
trainer.fit(model, datamodule=dm)
print("FIT DONE", flush=True)
"""


def test_link_negatives_under_a_cap_are_refused_not_killed(tmp_path):
    """Under a 600 MiB cgroup, 512 edges x 1000 triplet negatives: set-up used to plan ~60 MiB, then the fit
    (batches in flight, the model's scores of their negatives) was killed by the kernel; now set-up refuses
    with the numbers, before the presample draws a batch."""
    root = _link_graph(tmp_path / "links")
    limit = 600 * MiB
    cap = _cgroup_or_skip(limit)
    try:
        r = _run_in(cap, str(root), child=_NEG_CHILD)
        tail = _check_not_killed(cap, r, limit)
    finally:
        cap.close()
    assert r.returncode != 0 and "SETUP DONE" not in r.stdout, tail
    last = r.stderr.strip().splitlines()[-1]
    assert "InputError: the plan does not fit in memory: " in last and "600.00 MiB" in last, tail
    assert "neg_sampling amount=1000" in last and "lower neg_sampling amount or batch_size" in last, tail


def test_parts_of_one_process_place_every_smallest_plan_before_any_budget():
    """fit_parts (a heterogeneous plan's node types): a part of a few nodes keeps what it needs whatever its share
    of the budgets; the large part's budgets give way; the rooms add up to at most the limit."""
    big = PlanPart(ProcessShape(num_nodes=50_000, row_bytes=4096, max_nodes_per_batch=2_000,
                                max_edges_per_batch=20_000),
                   host_rows=20_000, buffer_slots=40_000, min_slots=20_000, staging_bytes=8 * MiB)  # fmt: skip
    tiny = PlanPart(ProcessShape(num_nodes=2, row_bytes=4096, max_nodes_per_batch=2, max_edges_per_batch=0),
                    host_rows=2, buffer_slots=2, min_slots=2, staging_bytes=16 << 10)  # fmt: skip
    parts = {"paper": big, "institute": tiny}
    fixed = {t: p.smallest(p.shape, "out_of_order").peak for t, p in parts.items()}
    need = {t: p.tally().peak for t, p in parts.items()}
    limit = MemoryLimit(fixed["paper"] + fixed["institute"] + (need["paper"] - fixed["paper"]) // 4, "a test")
    joint = fit_parts(parts, limit=limit, reserve=0, order="out_of_order")
    assert joint.pipeline == {} and joint.fixed == fixed
    assert joint.rooms["institute"] >= fixed["institute"] and joint.rooms["paper"] >= fixed["paper"]
    assert sum(joint.rooms.values()) <= limit.bytes
    assert joint.rooms["paper"] < need["paper"]
    # below the smallest plans with the pipeline asked: fewer batches in flight, for every part at once
    tight = MemoryLimit(fixed["paper"] + fixed["institute"] - MiB, "a test")
    lowered = fit_parts(parts, limit=tight, reserve=0, order="out_of_order")
    assert lowered.pipeline and sum(lowered.rooms.values()) <= tight.bytes
    assert all(lowered.rooms[t] >= lowered.fixed[t] for t in parts)
    with pytest.raises(InputError, match="does not fit in memory: .*; even with no host cache, the smallest feature "
                       "buffers its 2 node types need .* too much; to fit, .* or lower pipeline.num_samplers"):
        fit_parts(parts, limit=tight, reserve=0, order=None)  # a pipeline that may not be lowered


# -- one planner: a homogeneous plan is the one-part case of the joint fit ----------------------------
@pytest.mark.parametrize("buffer_on_host", [True, False])
@pytest.mark.parametrize("limit_mib", [4096, 900, 600, 400, 300, 250, 200, 150, 100])
def test_a_homogeneous_plan_is_the_one_part_case_of_the_joint_fit(buffer_on_host, limit_mib):
    """A homogeneous plan (``check_fits``) and a heterogeneous plan of one node type (``fit_parts`` gives the type
    its room and the pipeline, then the type's sizes are fitted in that room with that pipeline, as
    ``plan_hetero_store`` plans each type) agree field by field, and refuse the same limits."""
    from dataclasses import replace

    shape = ProcessShape(num_nodes=100_000, row_bytes=4096, max_nodes_per_batch=5_000, max_edges_per_batch=20_000,
                         train_nodes=1_000, buffer_on_host=buffer_on_host)  # fmt: skip
    asked = dict(host_rows=100_000, buffer_slots=50_000, min_slots=20_000, staging_bytes=8 << 20)
    limit = MemoryLimit(limit_mib << 20, "a test")
    reserve = training_reserve(shape.max_nodes_per_batch)
    try:
        homogeneous = check_fits(shape, **asked, limit=limit, order="out_of_order", warn=False)
    except InputError:
        homogeneous = None
    part = PlanPart(shape, **asked)
    try:
        joint = fit_parts({"paper": part}, limit=limit, reserve=reserve, order="out_of_order")
    except InputError:
        assert homogeneous is None, f"the one-part fit refused {limit}, the homogeneous plan fitted it"
        return
    assert homogeneous is not None, f"the homogeneous plan refused {limit}, the one-part fit fitted it"
    assert joint.rooms == {"paper": homogeneous.allowed}  # a single part's room is all that is allowed
    typed = check_fits(replace(shape, **joint.pipeline), host_rows=asked["host_rows"],
                       buffer_slots=asked["buffer_slots"], min_slots=part.reserve_at(joint.shape, "out_of_order"),
                       staging_bytes=asked["staging_bytes"], limit=MemoryLimit(joint.rooms["paper"] + reserve, "room"),
                       reserve=reserve, warn=False)  # fmt: skip
    in_room = joint.fit("paper")
    for fit in (typed, in_room):
        assert (fit.host_rows, fit.buffer_slots, fit.min_slots, fit.shape, fit.need, fit.allowed) == (
            homogeneous.host_rows, homogeneous.buffer_slots, homogeneous.min_slots, homogeneous.shape,
            homogeneous.need, homogeneous.allowed)
    assert joint.pipeline == homogeneous.pipeline
    assert [s.split(" (")[0] for s in in_room.shrunk] == [s.split(" (")[0] for s in homogeneous.shrunk]
