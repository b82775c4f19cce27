"""The "ooc" strategy end to end: real processes launched by `lightning-ooc fit`, by torchrun as two
nodes over loopback, and what is left after a rank dies or the launcher is interrupted."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ddp_probe import Probe
from jobs import REPO, _env, _killpg, _run

EXIT_BOUND = 90  # seconds: a run that does not end within this is hanging, not slow


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    from lightning_ooc.testing import make_synthetic

    ds = make_synthetic(tmp_path_factory.mktemp("strategy") / "g", num_nodes=12000, avg_degree=10, num_features=32,
                        num_classes=5, train_frac=0.1)  # fmt: skip
    return ds




def _config(tmp: Path, root: str, *, devices: int = 2, epochs: int = 2, stall_after_step: int = -1,
            stall_rank: int = -1, num_nodes: int = 1) -> Path:  # fmt: skip
    cfg = {
        "trainer": {
            "accelerator": "cpu", "devices": devices, "num_nodes": num_nodes, "max_epochs": epochs,
            "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
            "callbacks": [
                {"class_path": "lightning_ooc.callbacks.RunReport"},
                {"class_path": "ddp_probe.Probe", "init_args": {
                    "out_dir": str(tmp / "probe"), "stall_after_step": stall_after_step, "stall_rank": stall_rank}},
            ],
        },
        "data": {"root": root, "batch_size": 150, "num_neighbors": [5, 5],
                 "features": {"class_path": "lightning_ooc.Tiered",
                              "init_args": {"gpu_cache": "16MiB", "host_cache": "128KiB", "staging": "2MiB"}},
                 "pipeline": {"num_samplers": 1, "num_extractors": 1}},
        "model": {"class_path": "lightning_ooc.models.GraphSAGE",
                  "init_args": {"hidden_channels": 32, "num_layers": 2, "lr": 0.01}},
    }  # fmt: skip
    path = tmp / "override.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fit_cmd(cfg: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lightning_ooc", "fit", "--config", str(REPO / "configs" / "demo.yaml"),
            "--config", str(cfg), *extra]  # fmt: skip


def _probe(tmp: Path, rank: int) -> dict:
    path = tmp / "probe" / f"rank{rank}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not a running process
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _stat(pid: int, tid: int | None = None) -> list[str] | None:
    """Fields of /proc/<pid>/stat (of thread ``tid``) after the command name: state, ppid, pgrp, session, ..."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        return Path(path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _helpers_of(pid: int, ranks=()) -> list[int]:
    """Live children of ``pid`` that are not ranks themselves (gather producers, multiprocessing's helpers)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) not in ranks:
            st = _stat(int(d))
            if st is not None and st[0] != "Z" and st[1] == str(pid):
                out.append(int(d))
    return out


def _asleep_and_cpu(pids) -> tuple[bool, int]:
    """Whether every thread of ``pids`` sleeps (state S), and their CPU time so far in clock ticks."""
    ticks, asleep = 0, True
    for pid in pids:
        st = _stat(pid)
        if st is None:
            return False, 0
        ticks += int(st[11]) + int(st[12])  # utime + stime
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return False, 0
        asleep = asleep and all((_stat(pid, int(t)) or ["S"])[0] == "S" for t in tids)
    return asleep, ticks


def _blocked(pid: int, ranks=(), window: float = 0.5) -> bool:
    """Whether rank ``pid`` waits on a peer: it and its helper processes sleep, in every thread, and use no CPU
    over ``window`` seconds. A rank blocked in a collective its peer never joins stays so; one still finishing
    its step, or waiting for a batch its producer is still gathering, does not."""
    pids = [pid, *_helpers_of(pid, ranks)]
    asleep, before = _asleep_and_cpu(pids)
    if not asleep:
        return False
    time.sleep(window)  # the span over which it must use no CPU at all, not a wait for it to get somewhere
    asleep, after = _asleep_and_cpu(pids)
    return asleep and after == before


def _our_segments(pids) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"looc-{p}-") for p in pids)]


def _wait_for(cond, what: str, bound: float = EXIT_BOUND) -> None:
    deadline = time.monotonic() + bound
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)




def _test_acc(stdout: str) -> float:
    line = [ln for ln in stdout.splitlines() if ln.startswith("test: test_acc")][-1]
    return float(line.split()[-1])


def test_two_processes_train_disjoint_seeds_with_identical_parameters(graph, tmp_path):
    import numpy as np

    epochs = 3
    two = tmp_path / "two"
    two.mkdir()
    p = _run(_fit_cmd(_config(two, str(graph.root), devices=2, epochs=epochs)), two)
    r0, r1 = _probe(two, 0), _probe(two, 1)
    assert r0["world"] == r1["world"] == 2 and r0.get("done") and r1.get("done")
    assert r0["pid"] != r1["pid"]  # two processes

    # every epoch: the two ranks' seeds are disjoint and together cover the training split
    train = sorted(graph.split("train").tolist())
    for e in range(epochs):
        s0, s1 = r0["seeds"][str(e)], r1["seeds"][str(e)]
        assert not set(s0) & set(s1)
        assert sorted(s0 + s1) == train
    assert r0["seeds"]["0"] != r0["seeds"]["1"]  # reshuffled per epoch

    # after every optimizer step the parameters are bit-identical on both ranks
    assert len(r0["params"]) == len(r1["params"]) >= epochs * 2
    assert r0["params"] == r1["params"]
    assert len({h.split(":")[1] for h in r0["params"]}) == len(r0["params"])  # they did change each step

    # the topology is resident once: both ranks map the same shared segment, and their
    # proportional shares of it add up to one copy (Pss splits shared pages between mappers)
    i0, i1 = r0["indptr"], r1["indptr"]
    assert i0["path"] == i1["path"] and "/dev/shm/looc-" in i0["path"] and i0["path"].endswith("-indptr (deleted)")
    assert i0["bytes"] == (graph.num_nodes + 1) * 8
    assert i0["Rss"] >= i0["bytes"] - 4096 and i1["Rss"] >= i1["bytes"] - 4096  # fully resident in both...
    assert i0["Pss"] + i1["Pss"] <= i0["Rss"] + 8192  # ...but only once
    assert i0.get("Private_Dirty", 0) == 0 and i1.get("Private_Dirty", 0) == 0
    # the staging buffers are portions of one shared segment too
    assert r0["staging"]["path"] == r1["staging"]["path"] and r0["staging"]["path"].endswith("-staging (deleted)")
    assert not _our_segments([r0["pid"], r1["pid"]])  # unlinked as soon as both ranks had mapped them

    # the same run with one process reaches the same accuracy within noise
    one = tmp_path / "one"
    one.mkdir()
    q = _run(_fit_cmd(_config(one, str(graph.root), devices=1, epochs=epochs)), one)
    acc1, acc2 = _test_acc(q.stdout), _test_acc(p.stdout)
    mlp_level = np.bincount(graph.labels[graph.split("test").numpy()]).max() / len(graph.split("test"))
    assert acc1 > mlp_level + 0.1 and acc2 > mlp_level + 0.1, (acc1, acc2, mlp_level)
    assert abs(acc1 - acc2) < 0.06, (acc1, acc2)


def test_two_nodes_over_loopback_with_torchrun(graph, tmp_path):
    import socket

    copies = []
    for i in range(2):  # each node reads its own local copy of the dataset
        copies.append(shutil.copytree(graph.root, tmp_path / f"node{i}-data"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in range(2):
        d = tmp_path / f"node{node}"
        d.mkdir()
        cfg = _config(tmp_path, str(copies[node]), devices=1, num_nodes=2, epochs=2)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "lightning_ooc", "fit", "--config", str(REPO / "configs" / "demo.yaml"), "--config", str(cfg),
               "--data.root", str(copies[node])]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=d, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))  # fmt: skip
    outs = []
    try:
        for pr in procs:
            outs.append(pr.communicate(timeout=600)[0])
    finally:
        for pr in procs:
            _killpg(pr)
    for pr, out in zip(procs, outs):
        assert pr.returncode == 0, out[-6000:]
    r0, r1 = _probe(tmp_path, 0), _probe(tmp_path, 1)
    assert (r0["node_rank"], r1["node_rank"]) == (0, 1)
    assert (r0["root"], r1["root"]) == (str(copies[0]), str(copies[1]))
    assert r0["world"] == r1["world"] == 2
    train = sorted(graph.split("train").tolist())
    for e in range(2):
        assert sorted(r0["seeds"][str(e)] + r1["seeds"][str(e)]) == train
    assert r0["params"] == r1["params"] and r0["params"]
    # one "machine" each: separate segments, each mapped by its own rank only
    assert r0["indptr"]["path"] != r1["indptr"]["path"]
    assert "-n0-indptr" in r0["indptr"]["path"] and "-n1-indptr" in r1["indptr"]["path"]


def _start_stalled(graph, tmp: Path, stall_rank: int) -> tuple[subprocess.Popen, dict, dict]:
    cfg = _config(tmp, str(graph.root), devices=2, epochs=50, stall_after_step=2, stall_rank=stall_rank)
    launcher = subprocess.Popen(_fit_cmd(cfg), cwd=tmp, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    stalled = [r for r in (0, 1) if stall_rank in (-1, r)]
    try:
        _wait_for(lambda: all(_probe(tmp, r).get("stalled") for r in stalled) or launcher.poll() is not None,
                  "the ranks to reach the stall point", bound=300)  # fmt: skip
    except AssertionError:
        _killpg(launcher)
        raise
    if launcher.poll() is not None:
        _killpg(launcher)
        raise AssertionError("the run ended early:\n" + launcher.communicate(timeout=30)[0][-6000:])
    _wait_for(lambda: _probe(tmp, 0) and _probe(tmp, 1), "both probes")
    return launcher, _probe(tmp, 0), _probe(tmp, 1)


def _exit_output(launcher: subprocess.Popen, pids) -> str:
    """The run's output once it exits; if it does not within EXIT_BOUND, fail with every rank's stacks."""
    try:
        return launcher.communicate(timeout=EXIT_BOUND)[0]
    except subprocess.TimeoutExpired:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGUSR1)  # ddp_probe registered faulthandler on it
        time.sleep(2)
        _killpg(launcher)
        out = launcher.communicate(timeout=30)[0]
        raise AssertionError(f"the run did not exit within {EXIT_BOUND} s; its output and stacks:\n{out[-12000:]}")


def _cleanup(launcher: subprocess.Popen, pids) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    _killpg(launcher)
    launcher.communicate(timeout=30)


def test_a_killed_rank_makes_the_other_exit_instead_of_hanging(graph, tmp_path):
    # rank 1 stalls; rank 0 goes on and blocks in the next gradient all-reduce, waiting for it
    launcher, r0, r1 = _start_stalled(graph, tmp_path, stall_rank=1)
    pids = [r0["pid"], r1["pid"]]
    assert pids[0] == launcher.pid  # rank 0 is the launcher, rank 1 its child
    try:
        _wait_for(lambda: len(_probe(tmp_path, 0)["params"]) >= len(_probe(tmp_path, 1)["params"]),
                  "rank 0 to finish the step rank 1 stalled in")  # fmt: skip
        _wait_for(lambda: _blocked(pids[0], pids), "rank 0 to block in the next step's collectives")
        os.kill(r1["pid"], signal.SIGKILL)
        _exit_output(launcher, pids)  # drains the output, so a full pipe cannot hold the run up
        assert launcher.returncode != 0
        _wait_for(lambda: not any(_alive(p) for p in pids), "every rank to exit", bound=30)
        assert not _our_segments(pids)
    finally:
        _cleanup(launcher, pids)


def test_a_killed_launcher_takes_its_ranks_with_it(graph, tmp_path):
    launcher, r0, r1 = _start_stalled(graph, tmp_path, stall_rank=-1)
    pids = [r0["pid"], r1["pid"]]
    try:
        os.kill(r0["pid"], signal.SIGKILL)
        _wait_for(lambda: not _alive(r1["pid"]), "rank 1 to exit after its launcher died", bound=30)
        assert not _our_segments(pids)
    finally:
        _cleanup(launcher, pids)


def test_ctrl_c_leaves_no_process_and_no_shared_memory(graph, tmp_path):
    launcher, r0, r1 = _start_stalled(graph, tmp_path, stall_rank=-1)
    pids = [r0["pid"], r1["pid"]]
    try:
        os.kill(launcher.pid, signal.SIGINT)
        out = _exit_output(launcher, pids)
        assert launcher.returncode != 0
        assert "KeyboardInterrupt" in out or "graceful shutdown" in out, out[-3000:]
        _wait_for(lambda: not any(_alive(p) for p in pids), "every rank to exit", bound=30)
        assert not _our_segments(pids)
        left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
        assert not left, f"processes still running: {left}"
    finally:
        _cleanup(launcher, pids)


def test_the_multiprocess_example_runs(graph, tmp_path):
    p = _run([sys.executable, str(REPO / "examples" / "train_ddp.py"), str(graph.root), "--devices", "2",
              "--epochs", "1"], tmp_path)  # fmt: skip
    assert "over 2 process(es)" in p.stdout and "test: test_acc" in p.stdout


@pytest.mark.slow  # one process's mid-epoch resume runs in make test (test_training.py)
def test_two_processes_resume_mid_epoch_without_repeating_a_batch(graph, tmp_path):
    ckpts = tmp_path / "ckpt"
    cfg = _config(tmp_path, str(graph.root), devices=2, epochs=1)
    every = ["--trainer.enable_checkpointing", "true", "--trainer.callbacks+=ModelCheckpoint",
             "--trainer.callbacks.dirpath", str(ckpts), "--trainer.callbacks.every_n_train_steps", "2",
             "--trainer.callbacks.save_top_k", "-1", "--test_after_fit", "false"]  # fmt: skip
    first = _run(_fit_cmd(cfg, *every, "--trainer.max_steps", "2"), tmp_path)
    assert first.returncode == 0
    part = [_probe(tmp_path, r)["seeds"]["0"] for r in (0, 1)]
    (tmp_path / "probe").rename(tmp_path / "probe-first")
    ckpt = sorted(ckpts.glob("*.ckpt"))
    assert ckpt, list(ckpts.iterdir())
    _run(_fit_cmd(cfg, "--ckpt_path", str(ckpt[-1]), "--test_after_fit", "false"), tmp_path)
    rest = [_probe(tmp_path, r)["seeds"].get("0", []) for r in (0, 1)]
    for r in (0, 1):
        assert part[r] and rest[r]
        assert not set(part[r]) & set(rest[r])  # nothing trained twice on this rank
    everything = part[0] + part[1] + rest[0] + rest[1]
    assert sorted(everything) == sorted(graph.split("train").tolist())  # and nothing left out


# -- SIGTERM to one rank stops the whole job -----------------------------------------------------------
def _session_processes(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``: the launcher's session holds every process of the job,
    the gather producers and anything re-parented to init after its parent died included."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None and st[0] != "Z" and int(st[3]) == sid:
                out.append(int(d))
    return out


def _producers_of(pid: int) -> list[int]:
    """The gather producers of rank ``pid``: its children started by multiprocessing's spawn (not its resource
    tracker, nor the ranks a launcher started)."""
    out = []
    for c in _helpers_of(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes():
                out.append(c)
        except OSError:
            pass
    return out


class ProducerProbe(Probe):
    """``ddp_probe.Probe`` for a run whose store lives in the gather producers (the ranks load it as
    ``test_strategy.ProducerProbe``): the same records, without the trainer-side store's mappings."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.info["node_rank"] = trainer.node_rank
        self._dump(trainer)


def _start_sigterm_job(graph, tmp: Path, stall_rank: int | None) -> tuple[subprocess.Popen, list[int], list[int]]:
    """A 2-process CPU fit with a gather producer per rank, its output in ``tmp/out.log``; returns once both ranks
    trained two steps (``stall_rank`` None) or reached the stall point: (launcher, rank pids, producer pids)."""
    epochs = 1000  # it never ends on its own before the test signals it
    if stall_rank is None:
        cfg = _config(tmp, str(graph.root), devices=2, epochs=epochs)
    else:
        cfg = _config(tmp, str(graph.root), devices=2, epochs=epochs, stall_after_step=2, stall_rank=stall_rank)
    data = yaml.safe_load(cfg.read_text())
    data["trainer"]["strategy"] = {"class_path": "lightning_ooc.strategy.OutOfCoreStrategy",
                                   "init_args": {"gather_process": True}}  # fmt: skip
    for cb in data["trainer"]["callbacks"]:
        if cb["class_path"] == "ddp_probe.Probe":
            cb["class_path"] = "test_strategy.ProducerProbe"
    cfg.write_text(yaml.safe_dump(data))
    with open(tmp / "out.log", "w") as out:
        launcher = subprocess.Popen(_fit_cmd(cfg), cwd=tmp, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip

    def ready() -> bool:
        if launcher.poll() is not None:
            return True
        if stall_rank is not None:
            return all(_probe(tmp, r).get("stalled") for r in (0, 1) if stall_rank in (-1, r))
        return all(len(_probe(tmp, r).get("params", [])) >= 2 for r in (0, 1))

    try:
        _wait_for(ready, "the ranks to train", bound=300)
        if launcher.poll() is not None:
            raise AssertionError("the run ended early:\n" + (tmp / "out.log").read_text()[-6000:])
        _wait_for(lambda: _probe(tmp, 0) and _probe(tmp, 1), "both probes")
        ranks = [_probe(tmp, 0)["pid"], _probe(tmp, 1)["pid"]]
        assert ranks[0] == launcher.pid
        _wait_for(lambda: all(_producers_of(r) for r in ranks), "a gather producer per rank")
        producers = [c for r in ranks for c in _producers_of(r)]
    except BaseException:
        _killpg(launcher)
        raise
    return launcher, ranks, producers


def _kill_job(launcher: subprocess.Popen, pids: list[int]) -> None:
    """Whatever a test leaves alive of a job: its processes, its launcher's group."""
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    _killpg(launcher)
    launcher.wait(timeout=30)


def _check_sigterm_stops_the_job(launcher: subprocess.Popen, tmp: Path, ranks: list[int], producers: list[int],
                                 rank: int) -> None:  # fmt: skip
    try:
        os.kill(ranks[rank], signal.SIGTERM)
        launcher.wait(timeout=EXIT_BOUND)
        assert launcher.returncode != 0
        _wait_for(lambda: not _session_processes(launcher.pid), "every process of the job to exit", bound=60)
        assert not any(_alive(p) for p in ranks + producers)
        assert not _our_segments(ranks + producers)
        out = (tmp / "out.log").read_text()
        assert re.search(rf"rank {rank}\b.*received SIGTERM.*stopping the job", out), out[-6000:]
    finally:
        _kill_job(launcher, ranks + producers)


# (make test keeps Ctrl-C to the whole job and SIGTERM to a rank blocked in a collective, beside)
@pytest.mark.parametrize("rank", [pytest.param(1, marks=pytest.mark.slow), pytest.param(0, marks=pytest.mark.slow)])
def test_sigterm_to_a_training_rank_stops_every_process_of_the_job(graph, tmp_path, rank):
    # the job trains; the signal finds the rank wherever it is (pipeline wait, compute, a collective)
    launcher, ranks, producers = _start_sigterm_job(graph, tmp_path, stall_rank=None)
    _check_sigterm_stops_the_job(launcher, tmp_path, ranks, producers, rank)


# all slow: make test keeps a rank blocked in a collective in the two-rank gloo test below, and SIGTERM to the
# launching rank of a whole job in the test above
@pytest.mark.parametrize("rank, stall_rank", [pytest.param(1, 1, marks=pytest.mark.slow), pytest.param(0, 0, marks=pytest.mark.slow),
                                              pytest.param(1, 0, marks=pytest.mark.slow)],
                         ids=["rank1-peer-in-allreduce", "rank0-peer-in-allreduce", "rank1-itself-in-allreduce"])
def test_sigterm_while_a_rank_waits_in_a_collective_stops_every_process(graph, tmp_path, rank, stall_rank):
    # the stalled rank sits in Python; the other one blocks in the next step's collectives (Lightning's per-step
    # broadcast, or the gradient all-reduce after it), waiting for it
    launcher, ranks, producers = _start_sigterm_job(graph, tmp_path, stall_rank=stall_rank)
    other = 1 - stall_rank
    try:
        _wait_for(lambda: len(_probe(tmp_path, other)["params"]) >= len(_probe(tmp_path, stall_rank)["params"]),
                  "the other rank to finish the step the stalled one stopped in")  # fmt: skip
        _wait_for(lambda: _blocked(ranks[other], ranks), "the other rank to block in the next step's collectives")
    except BaseException:
        _killpg(launcher)
        raise
    _check_sigterm_stops_the_job(launcher, tmp_path, ranks, producers, rank)


_GLOO_PAIR = r"""
import datetime, os, subprocess, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from lightning_ooc.strategy.signals import JobStop

port, out, python_rank = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
rank = int(os.environ.get("PAIR_RANK", "0"))
procs = [] if rank else [subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "PAIR_RANK": "1"})]
assert JobStop(rank=lambda: rank, children=lambda: procs).install()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(minutes=30))
(out / f"pid{rank}").write_text(str(os.getpid()))
if rank == python_rank:
    while True:  # in Python, never joining the collective
        time.sleep(0.5)
dist.all_reduce(torch.ones(4))  # blocks in C with the GIL released: the peer never joins
raise SystemExit("the all-reduce returned")
"""


@pytest.mark.parametrize("signalled", [1, pytest.param(0, marks=pytest.mark.slow)], ids=["child-in-collective", "launcher-in-collective"])
def test_sigterm_stops_a_rank_blocked_in_a_collective_and_never_loops_back(tmp_path, signalled):
    """``JobStop`` alone, on two gloo ranks: the signalled one waits in an all-reduce the other never joins."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "pair.py"
    script.write_text(_GLOO_PAIR)
    with open(tmp_path / "out.log", "w") as out:
        top = subprocess.Popen([sys.executable, str(script), str(port), str(tmp_path), str(1 - signalled)],
                               env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        _wait_for(lambda: (tmp_path / "pid0").exists() and (tmp_path / "pid1").exists() or top.poll() is not None,
                  "both ranks to join the process group")  # fmt: skip
        assert top.poll() is None, (tmp_path / "out.log").read_text()
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        _wait_for(lambda: _blocked(pids[signalled], pids), f"rank {signalled} to block in the all-reduce")
        os.kill(pids[signalled], signal.SIGTERM)
        _wait_for(lambda: not _alive(pids[signalled]), f"rank {signalled} to exit")
        _wait_for(lambda: not _alive(pids[1]), "rank 1 to exit", bound=30)
        if signalled == 0:  # the launcher forwarded the signal to rank 1, waited for it, and exited
            assert top.wait(timeout=30) != 0
        else:  # a rank never signals its parent: rank 0 goes on, untouched, in Python
            assert _alive(pids[0]) and _stat(pids[0])[0] in "RS"
        out = (tmp_path / "out.log").read_text()
        assert re.search(rf"rank {signalled} \(pid {pids[signalled]}\) received SIGTERM; stopping the job", out), out
        assert len(re.findall(r"received SIGTERM", out)) == (2 if signalled == 0 else 1), out
        assert "the all-reduce returned" not in out
    finally:
        _killpg(top)
        top.wait(timeout=30)


def test_sigterm_stays_lightnings_under_slurm_with_auto_requeue(monkeypatch):
    """There SIGTERM announces a requeue: Lightning's handler (which lets the job save and requeue) is kept."""
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose

    from lightning_ooc.strategy import OutOfCoreStrategy
    from lightning_ooc.strategy.lightning_adapter import StrategySignalConnector

    monkeypatch.setattr(OutOfCoreStrategy, "world_size", property(lambda self: 2))
    before = signal.getsignal(signal.SIGTERM)
    slurm = OutOfCoreStrategy(cluster_environment=SLURMEnvironment(auto_requeue=True))
    slurm._take_over_sigterm()
    assert not slurm.owns_sigterm and signal.getsignal(signal.SIGTERM) is before
    trainer = SimpleNamespace(strategy=slurm,
                              _accelerator_connector=SimpleNamespace(cluster_environment=slurm.cluster_environment))
    connector = StrategySignalConnector(trainer)
    connector.register_signal_handlers()
    try:  # Lightning's requeue handlers, SIGTERM bypassed
        term = signal.getsignal(signal.SIGTERM)
        assert isinstance(term, _HandlersCompose) and connector._sigterm_handler_fn in term.signal_handlers
        assert isinstance(signal.getsignal(signal.SIGUSR1), _HandlersCompose)
    finally:
        connector.teardown()
    assert signal.getsignal(signal.SIGTERM) is before

    # anywhere else the strategy's JobStop takes SIGTERM, and Lightning's connector leaves it alone
    plain = OutOfCoreStrategy(cluster_environment=LightningEnvironment())
    plain._take_over_sigterm()
    try:
        assert plain.owns_sigterm
        ours = signal.getsignal(signal.SIGTERM)
        connector = StrategySignalConnector(SimpleNamespace(strategy=plain))
        connector.register_signal_handlers()
        assert signal.getsignal(signal.SIGTERM) == ours
        connector.teardown()
        assert signal.getsignal(signal.SIGTERM) == ours
    finally:
        plain._job_stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before


def test_gather_producers_die_with_their_rank_when_it_is_killed_outright(graph, tmp_path):
    # SIGKILL leaves a rank no chance to stop its producer: the producer asked at start to die with it
    launcher, ranks, producers = _start_sigterm_job(graph, tmp_path, stall_rank=-1)
    try:
        os.kill(launcher.pid, signal.SIGKILL)  # rank 1 dies with it, and each producer with its rank
        launcher.wait(timeout=30)
        _wait_for(lambda: not _session_processes(launcher.pid), "every process of the job to exit", bound=60)
        assert not _our_segments(ranks + producers)
    finally:
        _kill_job(launcher, ranks + producers)


def test_lightning_adapter_finds_every_private_name_it_uses_and_installs_its_connector(caplog):
    """The one module that reaches past Lightning's public surface: what it needs is in the installed release,
    and where it is not, it says so and changes nothing."""
    from types import SimpleNamespace

    import lightning as L

    from lightning_ooc.strategy import lightning_adapter
    from lightning_ooc.strategy.lightning_adapter import StrategySignalConnector

    assert lightning_adapter.missing() == []
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert not isinstance(trainer._signal_connector, StrategySignalConnector)
    assert lightning_adapter.leave_sigterm(trainer)
    assert isinstance(trainer._signal_connector, StrategySignalConnector)
    assert trainer._signal_connector.trainer is trainer
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        assert not lightning_adapter.leave_sigterm(SimpleNamespace())
    assert "Lightning's SIGTERM handler stays installed" in caplog.text and "_signal_connector" in caplog.text


def test_job_stop_forwards_signals_through_the_launchers_kill(tmp_path):
    """SIGTERM goes to the launched ranks through the launcher's public ``kill``; a rank that outlives the grace
    period gets SIGKILL from both it and the stop itself."""
    from lightning_ooc.strategy.signals import JobStop

    sent = []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stop = JobStop(rank=lambda: 0, children=lambda: [child], kill=sent.append)
        stop._signal([child], signal.SIGTERM)
        assert sent == [signal.SIGTERM] and child.poll() is None  # the launcher's kill did it, not the stop
        stop._signal([child], signal.SIGKILL)
        assert sent == [signal.SIGTERM, signal.SIGKILL]
        assert child.wait(timeout=30) == -signal.SIGKILL
        plain = JobStop(rank=lambda: 0)  # no launcher: each child gets it directly
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        plain._signal([other], signal.SIGTERM)
        assert other.wait(timeout=30) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()
