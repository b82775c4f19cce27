"""The "ooc" strategy end to end: real processes launched by `lightning-ooc fit`, by torchrun as two
nodes over loopback, and what is left after a rank dies or the launcher is interrupted."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
EXIT_BOUND = 90  # seconds: a run that does not end within this is hanging, not slow


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    from lightning_ooc.testing import make_synthetic

    ds = make_synthetic(tmp_path_factory.mktemp("strategy") / "g", num_nodes=12000, avg_degree=10, num_features=32,
                        num_classes=5, train_frac=0.1)  # fmt: skip
    return ds


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    # Lightning leaves its rendezvous variables in os.environ after an in-process run: start clean
    for k in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "LOOC_LAUNCHER_PID"):  # fmt: skip
        env.pop(k, None)
    return env


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
        "data": {"root": root, "batch_size": 150, "num_neighbors": [5, 5], "gpu_cache": "16MiB",
                 "host_cache": "128KiB", "staging": "2MiB", "num_samplers": 1, "num_extractors": 1},
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


def _our_segments(pids) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"looc-{p}-") for p in pids)]


def _wait_for(cond, what: str, bound: float = EXIT_BOUND) -> None:
    deadline = time.monotonic() + bound
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _killpg(proc: subprocess.Popen) -> None:
    """Kill whatever is left of the run's session (a test failure must not leave ranks behind)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run(cmd, tmp: Path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, cwd=tmp, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        _killpg(proc)
    assert proc.returncode == 0, out[-3000:] + err[-6000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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
        time.sleep(1.0)
        os.kill(r1["pid"], signal.SIGKILL)
        launcher.wait(timeout=EXIT_BOUND)
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
        out = launcher.communicate(timeout=EXIT_BOUND)[0]
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
