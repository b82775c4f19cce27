"""Faults between and within stages: a later stage's memory plan (test after fit), a rank that is gone, the PyG
feature store's indices, and the names that messages give a feature file (a RowFile, a file used in place)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import lightning_ooc
from lightning_ooc.errors import InputError
from lightning_ooc.store import limits
from lightning_ooc.store.limits import MemoryLimit
from lightning_ooc.store.planner import check_fits, largest_where
from lightning_ooc.store.tally import RESERVE_FIXED

from jobs import REPO, _env, _killpg

MiB = 1 << 20
GiB = 1 << 30
PYTHON = str(Path(sys.executable))


# ------------------------------------------------------------------------------------------------------------
# a later stage's memory plan
# ------------------------------------------------------------------------------------------------------------
def test_stage_memory_gives_back_what_came_with_the_earlier_stage_and_no_more():
    """What the usage grew by since the earlier stage planned, as far as this process grew, up to the reserve's
    fixed part; nothing across limits of another size, nor for a first stage."""
    from lightning_ooc.store.limits import STAGE_CREDIT_MAX, StageMemory

    assert STAGE_CREDIT_MAX == RESERVE_FIXED  # the part of the reserve a run brings into use

    def lim(used: int, rss: int | None, total: int = 800 * MiB) -> MemoryLimit:
        return MemoryLimit(total - used, "a test cgroup", limit=total, used=used, rss=rss)

    stages = StageMemory()
    stages.begin("fit")
    assert stages.read(lim(590 * MiB, 500 * MiB)).bytes == 210 * MiB  # a first stage: as read
    stages.begin("test")
    later = stages.read(lim(610 * MiB, 520 * MiB))
    assert later.bytes == 210 * MiB and "20.00 MiB of it came with the fit stage" in later.source
    assert stages.read(lim(610 * MiB, 505 * MiB)).bytes == 195 * MiB  # others' memory (the process grew by 5)
    assert stages.read(lim(790 * MiB, 700 * MiB)).bytes == 10 * MiB + RESERVE_FIXED  # at most the fixed reserve
    assert stages.read(lim(900 * MiB, 810 * MiB, total=2 * GiB)).bytes == 2 * GiB - 900 * MiB  # another limit
    assert stages.read(lim(580 * MiB, 480 * MiB)).bytes == 220 * MiB  # less in use: nothing to give back
    assert stages.read(lim(600 * MiB, None)).bytes == 210 * MiB  # the process's own size unknown: the usage's
    stages.begin("validate")  # the earlier stage is the test stage, whose last read is the one above
    assert stages.earlier_stage == "test"


def test_stage_memory_gives_back_no_more_than_the_reserve_the_earlier_stage_kept():
    """With ``memory_reserve`` below the reserve's fixed part, a later stage gets back at most what the earlier
    stage's plan kept free; a plan records its reserve for the stage being set up, and outside one nothing."""
    from lightning_ooc.store.limits import StageMemory, keep_reserve, planning_stage

    def lim(used: int, rss: int) -> MemoryLimit:
        return MemoryLimit(800 * MiB - used, "a test cgroup", limit=800 * MiB, used=used, rss=rss)

    stages = StageMemory()
    with planning_stage(stages, "fit"):
        assert stages.read(lim(500 * MiB, 400 * MiB)).bytes == 300 * MiB
        keep_reserve(10 * MiB)
        keep_reserve(6 * MiB)  # another plan of the stage (a node type's): the largest counts
    with planning_stage(stages, "test"):
        assert stages.earlier_reserve == 10 * MiB
        assert stages.read(lim(600 * MiB, 500 * MiB)).bytes == 200 * MiB + 10 * MiB  # grew by 100, 10 were kept
    keep_reserve(64 * MiB)  # outside a stage: not recorded
    assert stages.reserve is None
    stages.begin("validate")  # the test stage's plans recorded no reserve: at most the fixed part comes back
    assert stages.read(lim(750 * MiB, 700 * MiB)).bytes == 50 * MiB + RESERVE_FIXED  # grew by 150 MiB


def _small_plan_dm(root: Path):
    from lightning_ooc import OutOfCoreNodeData, Tiered

    return OutOfCoreNodeData(root, batch_size=64, num_neighbors=[4, 4], progress=False,
                             features=Tiered(gpu_cache="2MiB", host_cache="96KiB", staging="256KiB",
                                             presample_batches=8),
                             pipeline={"num_samplers": 2, "num_extractors": 2})  # fmt: skip


def test_test_after_fit_plans_with_what_fit_gave_back_and_shrinks_as_fit_did(demo_dataset, monkeypatch):
    """Fit plans at its smallest plan, just inside the limit; by the test stage the process holds the model, its
    optimizer state and the code that training ran (in the fit stage's reserve). The test stage does not keep
    that reserve free again on top of it: it plans with what fit gave back and chooses what fit chose."""
    used = {"bytes": 300 * MiB, "rss": 250 * MiB}
    total = {"bytes": 64 * GiB}

    def fake_limit(*args, **kwargs) -> MemoryLimit:
        return MemoryLimit(total["bytes"] - used["bytes"], f"cgroup v1 /test: memory.limit_in_bytes "
                           f"{total['bytes']}, {used['bytes']} in use", limit=total["bytes"], used=used["bytes"],
                           rss=used["rss"])  # fmt: skip

    monkeypatch.setattr(limits, "memory_limit", fake_limit)
    dm = _small_plan_dm(demo_dataset.root)
    dm.setup("fit")  # without a limit that matters: what does the smallest plan need?
    fit = dm.plan.memory_fit
    asked = dict(shape=fit.asked_shape, host_rows=fit.asked_host_rows, buffer_slots=fit.asked_slots,
                 min_slots=fit.min_slots, staging_bytes=fit.staging_bytes)  # fmt: skip

    def fits(avail: int) -> bool:
        try:
            check_fits(**asked, limit=MemoryLimit(avail, "x"), order=dm.config.pipeline.order, warn=False)
            return True
        except InputError:
            return False

    smallest = 1 + largest_where(0, 1 << 40, lambda a: not fits(a))  # the least available memory that plans
    dm.teardown("fit")
    total["bytes"] = used["bytes"] + smallest + MiB  # fit: just inside, at (about) its smallest plan
    dm.setup("fit")
    first = dm.plan
    assert first.memory_fit.shrunk, "fit was expected to shrink to fit"
    dm.teardown("fit")
    used["bytes"] += 24 * MiB  # the model, its optimizer state, the fit loop: in the process now
    used["rss"] += 24 * MiB
    dm.setup("test")  # no InputError "the plan does not fit in memory": the reserve is not counted twice
    second = dm.plan
    assert (second.host_rows, second.buffer_slots, second.buffer_reserve, second.pipeline) == \
        (first.host_rows, first.buffer_slots, first.buffer_reserve, first.pipeline)  # fmt: skip
    assert "24.00 MiB of it came with the fit stage" in second.memory_fit.limit.source
    assert sum(b.batch_size for b in dm.test_dataloader()) == demo_dataset.split("test").numel()
    dm.teardown("test")
    # memory another process took meanwhile is not given back: then the test stage is refused, saying why
    used["bytes"] += 24 * MiB
    with pytest.raises(InputError, match=r"^the plan does not fit in memory: .*cgroup v1 /test"):
        dm.setup("test")


_FIT_THEN_TEST = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
import lightning as L
from lightning_ooc import OutOfCoreNodeData, Tiered
from lightning_ooc.errors import InputError
from lightning_ooc.models import GraphSAGE
from lightning_ooc.store.limits import MemoryLimit
from lightning_ooc.store.planner import check_fits, largest_where
dm = OutOfCoreNodeData(sys.argv[1], batch_size=64, num_neighbors=[5, 5], progress=False,
                       features=Tiered(gpu_cache="64MiB", host_cache="4MiB", staging="1MiB"),
                       pipeline={"num_samplers": 2, "num_extractors": 2})
model = GraphSAGE(dm.num_features, dm.num_classes, hidden_channels=128, num_layers=2)
trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                    enable_model_summary=False, num_sanity_val_steps=0, enable_progress_bar=False)
trainer.fit(model, datamodule=dm)
fit = dm.plan.memory_fit
asked = dict(shape=fit.asked_shape, host_rows=fit.asked_host_rows, buffer_slots=fit.asked_slots,
             min_slots=fit.min_slots, staging_bytes=fit.staging_bytes)
def fits(avail):
    try:
        check_fits(**asked, limit=MemoryLimit(avail, "x"), order=dm.config.pipeline.order, warn=False)
        return True
    except InputError:
        return False
smallest = 1 + largest_where(0, 1 << 40, lambda a: not fits(a))
print("FIT", fit.limit.used, smallest, flush=True)
trainer.test(model, datamodule=dm, verbose=False)
print("TESTED", dm.plan.memory_fit.limit.source, flush=True)
"""


@pytest.mark.slow
def test_under_a_cgroup_test_after_fit_runs_where_fit_ran_just_inside_the_limit(tmp_path):
    """A real memory cgroup, its limit set just above what fit's smallest plan needs beside what the process held:
    fit shrinks and trains; the test stage, with the fit loop's memory (10-25 MiB, for which the fit stage's
    reserve kept room) in use by then, plans and runs wherever fit ran."""
    from lightning_ooc.bench.system import MemoryCap
    from lightning_ooc.data.synth import synthesize

    if os.geteuid() != 0:
        pytest.skip("needs root to create a memory cgroup")
    root = synthesize(tmp_path / "g", num_nodes=50_000, avg_degree=15, num_features=64, num_classes=10,
                      train_frac=0.05, val_frac=0.02, test_frac=0.05, progress=False)  # as configs/synth/demo.yaml

    def run(limit: int) -> subprocess.CompletedProcess:
        try:
            cap = MemoryCap(limit)
        except RuntimeError as e:
            pytest.skip(f"no writable cgroup memory controller: {e}")
        try:
            cmd = ["sh", "-c", f'echo $$ > "{cap.path}/cgroup.procs" && exec "$@"', "sh", PYTHON, "-c",
                   _FIT_THEN_TEST, str(root)]  # fmt: skip
            return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
        finally:
            cap.close()

    probe = run(4 * GiB)
    assert probe.returncode == 0 and "FIT" in probe.stdout, probe.stderr[-4000:]
    used, smallest = map(int, probe.stdout.split("FIT")[1].split()[:2])
    ran_fit = 0
    for margin in (2 * MiB, 6 * MiB, 10 * MiB, 16 * MiB):  # what the process holds differs a little run to run
        r = run(used + smallest + margin)
        tail = f"\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-4000:]}"
        assert r.returncode != -signal.SIGKILL, tail
        if "FIT" not in r.stdout:  # the fit stage itself did not fit this time: a little more room
            assert "the plan does not fit in memory" in r.stderr, tail
            continue
        ran_fit += 1
        assert r.returncode == 0 and "TESTED" in r.stdout, tail
        assert "came with the fit stage" in r.stdout, tail
    assert ran_fit


# ------------------------------------------------------------------------------------------------------------
# a rank that is gone
# ------------------------------------------------------------------------------------------------------------
def test_how_a_rank_ended_is_said_in_words():
    from lightning_ooc.strategy.signals import ended, peer_lost

    assert ended(-signal.SIGKILL) == "was killed by SIGKILL"
    assert ended(128 + signal.SIGTERM) == "was terminated by SIGTERM (exit status 143)"
    assert ended(128 + signal.SIGSEGV) == "exited with status 139 (128 + SIGSEGV)"
    assert ended(2) == "exited with status 2"

    class Ended:
        def __init__(self, pid: int, code: int | None):
            self.pid, self.code = pid, code

        def poll(self) -> int | None:
            return self.code

    reset = RuntimeError("[/x/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5: Connection reset by peer. "
                         "This is typically caused by a remote worker hanging or bugs in the application.")
    line = peer_lost(reset, 0, [Ended(11, 0), Ended(12, 143)], first_launched_rank=1, wait=0)
    assert line == "lightning-ooc: rank 2 (pid 12) was terminated by SIGTERM (exit status 143); rank 0 stops the job"
    line = peer_lost(reset, 3, [], wait=0, joined=True)
    assert line.startswith("lightning-ooc: rank 3 stops: the connection to another rank of the job closed (Read "
                           "error [127.0.0.1]:5: Connection reset by peer)")  # fmt: skip
    # a launched rank that died is named whatever torch's distributed error said; the run's own error is left
    # alone, even where a launched rank died of it first
    timeout = torch.distributed.DistBackendError("wait timed out after 1800000ms")
    assert "rank 1 (pid 11) was killed by SIGKILL" in peer_lost(timeout, 0, [Ended(11, -9)], wait=0)
    assert peer_lost(RuntimeError("CUDA out of memory"), 0, [Ended(11, 1)], wait=0) is None
    assert peer_lost(ValueError("Connection reset by peer"), 0, [Ended(11, -9)], wait=0) is None


def test_a_start_up_failure_keeps_its_traceback(monkeypatch):
    """Before the default process group is initialised no rank of the job can have gone: a rank that cannot reach
    the store or a peer (a wrong MASTER_ADDR or port) keeps the backend's error, unless a rank it launched has
    already ended."""
    from lightning_ooc.strategy.signals import peer_lost

    class Running:
        pid = 11

        def poll(self) -> int | None:
            return None

    refused = torch.distributed.DistNetworkError("The client socket has failed to connect to any network address "
                                                 "of (10.0.0.9, 29500). Connection refused")  # fmt: skip
    reset = RuntimeError("Read error [127.0.0.1]:5: Connection reset by peer")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # another test may have made a group
    for e in (refused, reset):
        assert peer_lost(e, 0, [Running()], wait=5) is None  # joined read from torch.distributed: not initialised
        assert peer_lost(e, 0, [Running()], wait=0, joined=False) is None
    assert peer_lost(refused, 0, [Running()], wait=0, joined=True) is None  # a refused connection names no peer
    Running.poll = lambda self: -signal.SIGKILL
    assert peer_lost(refused, 0, [Running()], wait=0) == ("lightning-ooc: rank 1 (pid 11) was killed by SIGKILL; "
                                                          "rank 0 stops the job")  # fmt: skip


_GLOO_PAIR = r"""
import datetime, os, subprocess, sys
from pathlib import Path
import torch, torch.distributed as dist
from lightning_ooc.strategy.signals import JobStop, peer_lost, say_instead_of_traceback

port, out = int(sys.argv[1]), Path(sys.argv[2])
rank = int(os.environ.get("PAIR_RANK", "0"))
procs = [] if rank else [subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "PAIR_RANK": "1"})]
assert JobStop(rank=lambda: rank, children=lambda: procs).install()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(minutes=30))
(out / f"pid{rank}").write_text(str(os.getpid()))
if rank == 1:
    import time
    while True:  # in Python, never joining the collective: the test sends it SIGTERM
        time.sleep(0.5)
try:
    dist.all_reduce(torch.ones(4))  # fails once rank 1's connection closes
except RuntimeError as e:  # what the strategy's on_exception does with it
    line = peer_lost(e, 0, procs)
    if line is not None:
        say_instead_of_traceback(e, line)
    raise
raise SystemExit("the all-reduce returned")
"""


def test_a_rank_blocked_in_a_collective_says_in_one_line_which_rank_was_terminated(tmp_path):
    """Rank 0 waits in a gloo all-reduce; its child rank 1 gets SIGTERM. Rank 1 says it received SIGTERM, rank 0
    names rank 1 and how it ended in one line in place of the backend's traceback, and exits with status 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "pair.py"
    script.write_text(_GLOO_PAIR)
    with open(tmp_path / "out.log", "w") as out:
        top = subprocess.Popen([PYTHON, str(script), str(port), str(tmp_path)], env=_env(), stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pid1").exists() and top.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "pid1").exists(), (tmp_path / "out.log").read_text()
        time.sleep(1.0)  # rank 0 enters the all-reduce
        child = int((tmp_path / "pid1").read_text())
        os.kill(child, signal.SIGTERM)
        assert top.wait(timeout=90) == 1
    finally:
        _killpg(top)
    text = (tmp_path / "out.log").read_text()
    assert "Traceback" not in text and "RuntimeError" not in text, text
    lines = [line for line in text.splitlines() if line.startswith("lightning-ooc:")]  # not a library's warnings
    assert lines == [f"lightning-ooc: rank 1 (pid {child}) received SIGTERM; stopping the job",
                     f"lightning-ooc: rank 1 (pid {child}) was terminated by SIGTERM (exit status 143); rank 0 stops "
                     "the job"], lines  # fmt: skip


#: ``lightning-ooc fit`` with Lightning's child-process observer polling once an hour instead of every 5 s: the
#: observer kills rank 0 with SIGKILL where it notices a launched rank's exit before rank 0's collective fails, so
#: slowed it leaves rank 0 to see the failure and exit on its own (the children run this script too)
_FIT_SLOW_OBSERVER = """
from lightning.fabric.strategies.launchers import subprocess_script
assert subprocess_script._ChildProcessObserver.__init__.__defaults__ == (5,)
subprocess_script._ChildProcessObserver.__init__.__defaults__ = (3600,)
from lightning_ooc.cli import main
raise SystemExit(main())
"""


def test_sigterm_to_a_launched_rank_leaves_one_line_on_rank_0_not_a_traceback(tmp_path):
    """`lightning-ooc fit` on two CPU processes of the "ooc" strategy; rank 1 gets SIGTERM while both train. Rank 0's
    collective fails, and rank 0 names rank 1 and how it ended in one line, with no traceback, and exits with 1."""
    import yaml

    from lightning_ooc.testing import make_synthetic

    ds = make_synthetic(tmp_path / "g", num_nodes=6000, avg_degree=8, num_features=16, num_classes=4, train_frac=0.2)
    probe = {"class_path": "ddp_probe.Probe", "init_args": {"out_dir": str(tmp_path / "probe")}}
    cfg = {
        "trainer": {"accelerator": "cpu", "devices": 2, "max_epochs": 1000, "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False, "callbacks": [probe]},
        "data": {"root": str(ds.root), "batch_size": 100, "num_neighbors": [4, 4],
                 "features": {"class_path": "lightning_ooc.Tiered",
                              "init_args": {"gpu_cache": "8MiB", "host_cache": "64KiB", "staging": "1MiB"}},
                 "pipeline": {"num_samplers": 1, "num_extractors": 1}},
        "model": {"class_path": "lightning_ooc.models.GraphSAGE",
                  "init_args": {"hidden_channels": 16, "num_layers": 2}},
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "fit.py").write_text(_FIT_SLOW_OBSERVER)
    cmd = [PYTHON, str(tmp_path / "fit.py"), "fit", "--config", str(REPO / "configs" / "demo.yaml"), "--config",
           str(tmp_path / "run.yaml")]  # fmt: skip
    with open(tmp_path / "out.log", "w") as out:
        top = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
    try:
        import json

        def trained(r: int) -> bool:
            try:
                return len(json.loads((tmp_path / "probe" / f"rank{r}.json").read_text())["params"]) >= 2
            except (OSError, ValueError, KeyError):
                return False

        deadline = time.monotonic() + 300
        while not (trained(0) and trained(1)) and top.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert top.poll() is None and trained(1), (tmp_path / "out.log").read_text()[-6000:]
        child = json.loads((tmp_path / "probe" / "rank1.json").read_text())["pid"]
        os.kill(child, signal.SIGTERM)
        code = top.wait(timeout=120)
    finally:
        _killpg(top)
    out = (tmp_path / "out.log").read_text()
    assert code == 1, out[-6000:]
    assert "Traceback" not in out and "RuntimeError" not in out, out[-6000:]
    assert re.search(rf"^lightning-ooc: rank 1 \(pid {child}\) was terminated by SIGTERM \(exit status 143\); rank 0 "
                     "stops the job$", out, re.MULTILINE), out[-6000:]  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# the PyG feature store's indices
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("index", [np.uint64(2**63 + 5), 2**63 + 5, 2**70, np.array([3, 2**63 + 5], np.uint64),
                                   torch.tensor([2**63 + 5], dtype=torch.uint64), [2, 2**70], np.float64(2.0), 2.5,
                                   np.array([1.0, 2.0]), True, np.bool_(False), np.array([True, False]), "3",
                                   [1, "a"], -1, np.int8(-3)],
                         ids=lambda v: f"{type(v).__name__}-{str(v)[:24]}")  # fmt: skip
def test_every_bad_index_pyg_may_pass_is_an_input_error(demo_dataset, index):
    from lightning_ooc.pyg.dataset_stores import open_pyg_stores

    fs, gs = open_pyg_stores(demo_dataset.root)
    with fs:
        with pytest.raises(InputError, match=r"^x of the graph \(.*\): ") as e:
            fs.get_tensor(group_name=None, attr_name="x", index=index)
        if isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_)):
            assert f"node id {int(index)} is out of range" in str(e.value)  # the id given, not one wrapped round


@pytest.mark.parametrize("index, bad", [([-1, 2**63], -1), ([3, 2**63], 2**63), ((np.int64(-2), np.uint64(2**63)), -2),
                                        ([[1], [2**64 + 1]], 2**64 + 1), ([4, -7], -7)],
                         ids=["negative-and-2**63", "2**63", "numpy-mixed", "nested", "int64"])  # fmt: skip
def test_a_list_of_ids_is_refused_naming_the_id_out_of_range(demo_dataset, index, bad):
    """A list NumPy would hold as float64 (a negative id beside one of 2**63 or more) names the id out of range,
    as a list of int64 ids does, and not a float dtype."""
    from lightning_ooc.pyg.dataset_stores import open_pyg_stores

    fs, gs = open_pyg_stores(demo_dataset.root)
    with fs:
        with pytest.raises(InputError) as e:
            fs.get_tensor(group_name=None, attr_name="x", index=index)
        assert f": node id {bad} is out of range; ids must lie in 0..{demo_dataset.num_nodes - 1}" in str(e.value)
        assert "float" not in str(e.value)
        assert fs.get_tensor(group_name=None, attr_name="x", index=[]).shape == (0, demo_dataset.num_features)


def test_unsigned_and_numpy_indices_read_the_rows_they_name(demo_dataset):
    """NumPy arrays of several ids pass through the store's TensorAttr (whose field checks do not compare the
    array element by element) and read their rows, as unsigned ids of every width do."""
    from torch_geometric.data import TensorAttr

    from lightning_ooc.pyg.dataset_stores import open_pyg_stores

    x = demo_dataset.read_features(torch.arange(demo_dataset.num_nodes))
    fs, gs = open_pyg_stores(demo_dataset.root)
    with fs:
        for dt in (np.uint8, np.uint16, np.uint32, np.uint64, np.int32):
            got = fs.get_tensor(group_name=None, attr_name="x", index=np.array([7, 2, 7], dtype=dt))
            assert torch.equal(got, x[[7, 2, 7]]), dt
        assert torch.equal(fs.get_tensor(group_name=None, attr_name="x", index=np.uint64(5)), x[5])
        assert torch.equal(fs.get_tensor(group_name=None, attr_name="x",
                                         index=torch.tensor([4, 1], dtype=torch.uint64)), x[[4, 1]])  # fmt: skip
        got = fs.multi_get_tensor([TensorAttr(None, "x", np.array([1, 2])), TensorAttr(None, "y", np.array([3, 4]))])
        assert torch.equal(got[0], x[[1, 2]]) and got[1].shape == (2,)
        assert fs.get_tensor_size(TensorAttr(None, "x", np.array([1, 2, 3]))) == (3, demo_dataset.num_features)
        assert torch.equal(fs[None, "x", np.array([0, 9])], x[[0, 9]])


# ------------------------------------------------------------------------------------------------------------
# the names a feature file goes by in messages
# ------------------------------------------------------------------------------------------------------------
def test_a_row_file_is_named_by_its_path_in_messages(tmp_path):
    from lightning_ooc.data.importers.common import in_place_rows
    from lightning_ooc.data.importers.sources import npz_member
    from lightning_ooc.data.in_place import npy_rows

    np.save(tmp_path / "x.npy", np.ones((6, 2), np.float32))
    rows = npy_rows(tmp_path / "x.npy")
    assert str(rows) == str(tmp_path / "x.npy") == rows.name and f"{rows}: bad" == f"{tmp_path / 'x.npy'}: bad"
    assert "RowFile(" not in f"{rows}" and "PosixPath" not in f"{rows}"
    assert in_place_rows(rows, "features") is rows
    np.savez(tmp_path / "s.npz", x=np.ones((6, 2), np.float32))
    member = npz_member(tmp_path / "s.npz", "x").rows()
    assert str(member) == member.name and member.name.endswith("s.npz[x]")


def _in_place_dataset(tmp_path: Path) -> tuple[Path, Path]:
    from lightning_ooc.data.prepare import prepare_from_arrays

    rng = np.random.default_rng(0)
    n = 2000
    np.save(tmp_path / "x.npy", rng.standard_normal((n, 16)).astype(np.float32))
    edges = rng.integers(0, n, size=(2, 12000))
    labels = rng.integers(0, 3, size=n)
    root = prepare_from_arrays(tmp_path / "g", edges, tmp_path / "x.npy", labels, features="in-place",
                               split=[0.6, 0.2, 0.2], progress=False)  # fmt: skip
    return Path(root), tmp_path / "x.npy"


@pytest.mark.parametrize("backend", ["auto", "pread", "mmap"])
def test_a_feature_file_used_in_place_and_truncated_during_fit_is_named_by_its_own_path(tmp_path, backend):
    """The readers open a file used in place through the descriptor its check holds (``/proc/PID/fd/N``); the
    error of a truncation while training names the user's file (its recorded path), not that descriptor."""
    from lightning_ooc import OutOfCoreNodeData, Tiered
    from lightning_ooc.io.io_errors import FeatureReadError

    root, path = _in_place_dataset(tmp_path)
    dm = OutOfCoreNodeData(root, batch_size=64, num_neighbors=[4, 4], progress=False,
                           features=Tiered(gpu_cache="128KiB", host_cache="0", staging="64KiB", io_backend=backend))
    dm.setup("fit")
    try:
        assert str(dm.dataset.features_path).startswith("/proc/")
        os.truncate(path, 128 + 100 * 64)  # the header and 100 rows left
        with pytest.raises(FeatureReadError) as e:
            for _ in dm.train_dataloader():
                pass
    finally:
        dm.teardown("fit")
    assert str(e.value).startswith(f"{os.path.realpath(path)}: short read"), str(e.value)
    assert e.value.filename == os.path.realpath(path) and "/proc/" not in str(e.value)


def test_bulk_reads_and_reader_errors_of_a_file_used_in_place_name_the_recorded_path(tmp_path):
    from lightning_ooc.errors import CorruptDatasetError
    from lightning_ooc.io import BulkFile, FeatureReader

    root, path = _in_place_dataset(tmp_path)
    ds = lightning_ooc.open_dataset(root)
    real = os.path.realpath(path)
    with BulkFile(ds.features_path, "r") as f:
        assert str(f.name) == real and real in repr(f)
    os.truncate(path, 128 + 10 * 64)
    with pytest.raises(CorruptDatasetError, match=f"^{re.escape(real)}: .* shorter than its metadata says") as e:
        FeatureReader.from_dataset(ds, backend="pread")  # opened after the truncation: refused at once
    assert e.value.path == Path(real)
    with FeatureReader(ds.features_path, ds.num_features, ds.feature_dtype, backend="pread",
                       offset=ds.features_offset) as r:  # fmt: skip
        assert real in repr(r) and r.num_rows == 10
        with pytest.raises(InputError, match=f"^{re.escape(real)}: id 1500 at position 0 is out of range"):
            r.gather([1500])
