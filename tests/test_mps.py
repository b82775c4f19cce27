"""mps_split and the gather producer process, on CPU.

The MPS control daemon is the one thing replaced: a stand-in `nvidia-cuda-mps-control` script
that behaves like the real one at its boundary (``-d`` creates the control pipe in
``$CUDA_MPS_PIPE_DIRECTORY``; ``quit`` on stdin removes it) and logs every call. Everything
else (the strategy, the producer process, the hand-over of batches) runs for real.
"""
from __future__ import annotations

import logging
import functools
import json
import os
import queue
import signal
import shutil
import stat
import subprocess
import tempfile
import sys
import threading
import types

import lightning as L
import pytest
import torch

from lightning_ooc import OutOfCoreNodeData, Tiered
from lightning_ooc.loader import source
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.models import GraphSAGE
from lightning_ooc.strategy import OutOfCoreStrategy
from lightning_ooc.strategy import mps as mps_mod
from lightning_ooc.strategy.mps import MPSControl
from lightning_ooc.strategy import producer as producer_mod
from lightning_ooc.strategy.producer import GatherProducer, ProducerError

FAKE = """#!/bin/sh
echo "$@ pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY cvd=${{CUDA_VISIBLE_DEVICES-unset}} pct=${{CUDA_MPS_ACTIVE_THREAD_PERCENTAGE-unset}}" >> "{log}"
if [ "$1" = "-d" ]; then
  mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control" && exit 0
  exit 1
fi
read cmd
echo "stdin: $cmd" >> "{log}"
[ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
"""


def _install_control(tmp_path, monkeypatch, script: str) -> None:
    """``script`` as nvidia-cuda-mps-control on PATH, no daemon in the default place, a private temp dir."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "nvidia-cuda-mps-control"
    exe.write_text(script)
    exe.chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps_mod, "DEFAULT_PIPE_DIR", str(tmp_path / "no-default-daemon"))
    monkeypatch.setattr(mps_mod.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    log = tmp_path / "control.log"
    _install_control(tmp_path, monkeypatch, FAKE.format(log=log))
    return log


MPS_KEYS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


@pytest.fixture(autouse=True)
def mps_state(monkeypatch):
    """What mps.prepare() keeps per process, fresh for each test: no daemon prepared, no CUDA_MPS_* set.

    Yields the hooks prepare() registers with atexit (recorded, not registered: the test runs them).
    """
    hooks: list = []
    monkeypatch.setattr(mps_mod, "_state", None, raising=False)
    monkeypatch.setattr(mps_mod, "_hooked", set(), raising=False)
    monkeypatch.setattr(mps_mod, "_atexit_register", hooks.append, raising=False)
    for k in MPS_KEYS:
        monkeypatch.delenv(k, raising=False)  # restored after the test, whatever it set
    yield hooks
    if hasattr(mps_mod, "release"):
        mps_mod.release()


def _calls(log) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_starts_a_private_daemon_and_stops_only_its_own(fake_control, tmp_path):
    first = MPSControl()
    first.ensure()
    assert first.started and first.pipe_dir.startswith(str(tmp_path / "tmp"))
    assert stat.S_ISFIFO(os.stat(os.path.join(first.pipe_dir, "control")).st_mode)
    assert _calls(fake_control)[0].startswith(f"-d pipe={first.pipe_dir} log={first.log_dir}")

    second = MPSControl()  # another rank on the same machine: finds the daemon, does not start one
    second.ensure()
    assert not second.started and second.pipe_dir == first.pipe_dir
    second.stop()
    assert len(_calls(fake_control)) == 1  # no quit from a rank that did not start it

    env = first.env(10)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10" and env["CUDA_MPS_PIPE_DIRECTORY"] == first.pipe_dir
    first.stop()
    assert "stdin: quit" in _calls(fake_control)
    assert not os.path.exists(first.pipe_dir)
    private = tmp_path / "tmp" / f"looc-mps-{os.getuid()}"  # the user's own directory: the lock only is left
    assert os.listdir(tmp_path / "tmp") == [private.name] and os.listdir(private) == [f"looc-mps-{os.getuid()}.lock"]
    assert stat.S_IMODE(private.stat().st_mode) == 0o700


def _plant_foreign_daemon(tmp_path, lock_dir, uid=4242):
    """Another user's advert in ``lock_dir`` (which that user could write into before), pointing to their pipe."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.mkfifo(theirs / "control")
    advert = lock_dir / f"looc-mps-{os.getuid()}.json"
    advert.write_text(json.dumps({"pipe_dir": str(theirs), "log_dir": str(theirs), "pid": 1}))
    for p in (theirs, theirs / "control", advert):
        os.chown(p, uid, uid)
    return theirs


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another user")
def test_a_daemon_whose_control_endpoint_is_a_socket_is_found_and_stopped(tmp_path, monkeypatch, request):
    # CUDA 13's control daemon listens on a Unix socket named control, not a FIFO
    log = tmp_path / "control.log"
    script = FAKE.format(log=log).replace(
        'mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"',
        f'"{sys.executable}" -c "import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])" '
        '"$CUDA_MPS_PIPE_DIRECTORY/control"')  # fmt: skip
    _install_control(tmp_path, monkeypatch, script)
    short = tempfile.mkdtemp(prefix="mps", dir="/tmp")  # a socket's path has at most 107 bytes
    monkeypatch.setattr(mps_mod.tempfile, "tempdir", short)
    request.addfinalizer(lambda: shutil.rmtree(short, ignore_errors=True))
    mps = MPSControl(timeout=10)
    mps.ensure()
    control = os.path.join(mps.pipe_dir, "control")
    assert mps.started and stat.S_ISSOCK(os.stat(control).st_mode)
    again = MPSControl(timeout=10)  # another rank finds the running daemon by its socket
    again.ensure()
    assert not again.started and again.pipe_dir == mps.pipe_dir
    again.stop()
    mps.stop()
    assert "stdin: quit" in _calls(log) and not os.path.exists(mps.pipe_dir)


def test_an_advert_or_directory_of_another_user_is_never_followed(fake_control, tmp_path):
    lock_dir = tmp_path / "tmp" / f"looc-mps-{os.getuid()}"
    lock_dir.mkdir(mode=0o777)
    lock_dir.chmod(0o777)  # as if world-writable before: another user planted an advert in it
    theirs = _plant_foreign_daemon(tmp_path, lock_dir)
    m = MPSControl()
    m.ensure()
    assert m.started and m.pipe_dir != str(theirs) and m.pipe_dir.startswith(str(lock_dir))
    assert stat.S_IMODE(lock_dir.stat().st_mode) == 0o700  # and nobody else can write into it any more
    m.stop()
    # a lock directory that another user owns is refused, with what to do
    lock_dir.chmod(0o700)
    os.chown(lock_dir, 4242, 4242)
    with pytest.raises(mps_mod.MPSError, match=r"owned by uid 4242, not 0; .* remove it, or pass another lock_dir"):
        MPSControl().ensure()


def test_uses_a_running_daemon_and_never_stops_it(fake_control, tmp_path, monkeypatch):
    running = tmp_path / "system-mps"
    running.mkdir()
    os.mkfifo(running / "control")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(running))
    m = MPSControl()
    m.ensure()
    m.stop()
    assert m.pipe_dir == str(running) and not m.started
    assert _calls(fake_control) == []  # neither started nor quit
    assert (running / "control").exists()


def test_the_daemon_sees_every_gpu_and_clients_keep_their_devices(fake_control, monkeypatch):
    # a rank narrowed to its GPU (as SLURM's per-task binding does): the daemon it starts must not inherit
    # that, or it serves no other rank's GPU and renumbers this rank's ("1" would not exist in a client)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "90")  # this client's cap, not every client's
    m = MPSControl()
    m.ensure()
    try:
        assert _calls(fake_control)[0].endswith("cvd=unset pct=unset")
        assert "CUDA_VISIBLE_DEVICES" not in m.daemon_env()
        assert m.env(10)["CUDA_VISIBLE_DEVICES"] == "1"  # the clients keep theirs
    finally:
        m.stop()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_daemon_left_by_a_killed_run_is_adopted_and_stopped(fake_control, tmp_path):
    killed = MPSControl()  # a run that started a daemon, then was killed before its teardown
    killed.ensure()
    advert = tmp_path / "tmp" / f"looc-mps-{os.getuid()}" / f"looc-mps-{os.getuid()}.json"
    adv = json.loads(advert.read_text())
    dead = _dead_pid()
    adv.update(pid=dead, start=None, users=[[dead, None]])
    advert.write_text(json.dumps(adv))

    m = MPSControl()  # the next run finds its daemon: uses it, and stops it at the end
    m.ensure()
    assert m.pipe_dir == killed.pipe_dir and len(_calls(fake_control)) == 1  # not started again
    assert json.loads(advert.read_text())["users"] == [[os.getpid(), mps_mod._start_time(os.getpid())]]
    m.stop()
    assert "stdin: quit" in _calls(fake_control)
    assert not os.path.exists(killed.pipe_dir) and not advert.exists()
    assert not os.path.exists(os.path.dirname(killed.pipe_dir))  # its private directory is gone too


def test_a_pid_reused_by_another_process_does_not_keep_a_daemon(fake_control, tmp_path):
    first = MPSControl()
    first.ensure()
    advert = tmp_path / "tmp" / f"looc-mps-{os.getuid()}" / f"looc-mps-{os.getuid()}.json"
    adv = json.loads(advert.read_text())
    adv["users"] = [[os.getpid(), "1"]]  # a live pid, but not the process that registered (another start time)
    advert.write_text(json.dumps(adv))
    second = MPSControl()
    second.ensure()
    second.stop()
    assert "stdin: quit" in _calls(fake_control)


def test_the_last_user_stops_the_daemon_whoever_started_it(fake_control):
    starter, other = MPSControl(), MPSControl()  # two ranks of a machine
    starter.ensure()
    other.ensure()
    starter.stop()  # the starter ends first: the other rank still uses the daemon
    assert not any(c.startswith("stdin") for c in _calls(fake_control))
    assert stat.S_ISFIFO(os.stat(os.path.join(other.pipe_dir, "control")).st_mode)
    other.stop()
    assert "stdin: quit" in _calls(fake_control) and not os.path.exists(other.pipe_dir)


def test_a_daemon_whose_advert_is_gone_is_swept(fake_control, tmp_path):
    killed = MPSControl()
    killed.ensure()
    os.unlink(os.path.join(killed.pipe_dir, "control"))  # the daemon died with its run
    advert = tmp_path / "tmp" / f"looc-mps-{os.getuid()}" / f"looc-mps-{os.getuid()}.json"
    adv = json.loads(advert.read_text())
    dead = _dead_pid()
    adv["users"] = [[dead, None]]
    advert.write_text(json.dumps(adv))
    m = MPSControl()
    m.ensure()
    assert m.started and m.pipe_dir != killed.pipe_dir
    assert not os.path.exists(os.path.dirname(killed.pipe_dir))  # the dead run's directories are swept
    m.stop()


def test_a_daemon_that_fails_to_start_is_a_clear_error(tmp_path, monkeypatch):
    exe = tmp_path / "nvidia-cuda-mps-control"
    exe.write_text("#!/bin/sh\necho 'cannot start: no GPU' >&2\nexit 3\n")
    exe.chmod(stat.S_IRWXU)
    m = MPSControl(control=str(exe), default_pipe_dir=str(tmp_path / "none"), lock_dir=str(tmp_path))
    with pytest.raises(mps_mod.MPSError, match="exited with 3: cannot start: no GPU"):
        m.ensure()
    assert not m.started


def _trainer(strategy, callbacks=(), epochs=2):
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=epochs, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, callbacks=list(callbacks))  # fmt: skip


def _dm(root, pipeline=None, **kw):
    """A small datamodule: ``pipeline`` changes the pipeline's settings."""
    opts = dict(batch_size=64, num_neighbors=[4, 4], progress=False,
                features=Tiered(gpu_cache="4MiB", host_cache="16KiB", staging="256KiB"),
                pipeline={"num_samplers": 1, "num_extractors": 1, **(pipeline or {})})  # fmt: skip
    return OutOfCoreNodeData(str(root), **{**opts, **kw})


class _Seen(L.Callback):
    """Records the seeds trained and, while training, the producer process's environment."""

    def __init__(self):
        self.seeds: dict[int, list[int]] = {}
        self.producer_env: dict[str, str] = {}
        self.producer_pid = None
        self.producer = None
        self.trainer_env: dict[str, str] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seeds.setdefault(trainer.current_epoch, []).extend(batch.n_id[: batch.batch_size].tolist())
        prod = trainer.datamodule.source if hasattr(trainer.datamodule.source, "proc") else None
        if prod is not None and not self.producer_env:
            self.producer, self.producer_pid = prod, prod.proc.pid
            self.producer_env = dict(prod.client_env)  # what the producer set before CUDA starts, as it reports
            self.trainer_env = {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")}


def test_mps_split_without_cuda_warns_once_and_gathers_in_the_trainer(demo_dataset, caplog):
    seen = _Seen()
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        trainer = _trainer(OutOfCoreStrategy(mps_split=10), [seen], epochs=1)
        trainer.fit(GraphSAGE(demo_dataset.num_features, demo_dataset.num_classes, hidden_channels=16, num_layers=2),
                    datamodule=_dm(demo_dataset.root))  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if "CUDA MPS is not usable" in r.getMessage()]
    assert len(warnings) == 1 and "cpu, not a CUDA GPU" in warnings[0]
    assert seen.producer_pid is None  # gathered in the training process
    assert sorted(seen.seeds[0]) == sorted(demo_dataset.split("train").tolist())


def test_mps_split_runs_the_gather_in_a_capped_producer_and_keeps_the_daemon_until_exit(demo_dataset, fake_control,
                                                                                        monkeypatch, mps_state):  # fmt: skip
    # CUDA is what this machine lacks; the strategy is told MPS is usable, and the daemon is the stand-in.
    monkeypatch.setattr("lightning_ooc.strategy.ooc.mps_usable", lambda device: (True, ""))
    seen = _Seen()
    strategy = OutOfCoreStrategy(mps_split=10)
    at_quit: list[bool] = []
    stop = MPSControl.stop

    def watched_stop(self):
        at_quit.append(seen.producer is not None and seen.producer.proc.is_alive())
        stop(self)

    monkeypatch.setattr(MPSControl, "stop", watched_stop)
    trainer = _trainer(strategy, [seen], epochs=2)
    trainer.fit(GraphSAGE(demo_dataset.num_features, demo_dataset.num_classes, hidden_channels=16, num_layers=2),
                datamodule=_dm(demo_dataset.root))  # fmt: skip
    # the gather ran in another process, an MPS client capped to 10 % of the SMs; the trainer got 90 %
    assert seen.producer_pid is not None and seen.producer_pid != os.getpid()
    assert seen.producer_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
    assert seen.trainer_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "90"
    pipe = seen.producer_env["CUDA_MPS_PIPE_DIRECTORY"]
    assert seen.trainer_env["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    # every seed trained exactly once per epoch, with rows that crossed from the producer
    for e in range(2):
        assert sorted(seen.seeds[e]) == sorted(demo_dataset.split("train").tolist())
    # teardown stopped the producer, but not the daemon: this process is its client and may hold a CUDA context
    # until it exits (a daemon that quits takes its clients' server with it); a second run would use it
    assert not os.path.exists(f"/proc/{seen.producer_pid}") or open(f"/proc/{seen.producer_pid}/stat").read().split(
        ")")[-1].split()[0] == "Z"  # fmt: skip
    calls = _calls(fake_control)
    assert calls[0].startswith(f"-d pipe={pipe}") and "stdin: quit" not in calls and at_quit == []
    assert stat.S_ISFIFO(os.stat(os.path.join(pipe, "control")).st_mode)
    assert mps_state == [mps_mod.release]  # left at exit: the hook quits it as its last user
    mps_state[0]()
    assert at_quit == [False] and "stdin: quit" in _calls(fake_control) and not os.path.exists(pipe)


def test_producer_rows_match_the_file(demo_dataset):
    import numpy as np

    class Check(L.Callback):
        checked = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            want = demo_dataset.read_features(batch.n_id)
            assert torch.equal(batch.x, want)
            Check.checked += 1

    _trainer(OutOfCoreStrategy(gather_process=True), [Check()], epochs=1).fit(
        GraphSAGE(demo_dataset.num_features, demo_dataset.num_classes, hidden_channels=16, num_layers=2),
        datamodule=_dm(demo_dataset.root))  # fmt: skip
    assert Check.checked == int(np.ceil(len(demo_dataset.split("train")) / 64))


def test_a_dead_producer_is_an_error_in_the_trainer_not_a_hang(demo_dataset):
    class Kill(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                os.kill(trainer.datamodule.source.proc.pid, signal.SIGKILL)

    result: dict = {}

    def fit():
        try:
            _trainer(OutOfCoreStrategy(gather_process=True), [Kill()], epochs=50).fit(
                GraphSAGE(demo_dataset.num_features, demo_dataset.num_classes, hidden_channels=16, num_layers=2),
                datamodule=_dm(demo_dataset.root, batch_size=16))  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            result["error"] = e

    t = threading.Thread(target=fit)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the trainer hung after its producer died"
    assert isinstance(result.get("error"), ProducerError)
    assert "exited with code -9" in str(result["error"])


def test_the_producer_selects_its_gpu_before_any_other_cuda_call(monkeypatch):
    """The producer's entry point, run here with CUDA stood in for: env, then set_device, in every thread."""
    calls: list[tuple] = []

    def record(what, *args):
        calls.append((what, threading.current_thread().name, *args))

    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "90")  # inherited from the trainer; restored after
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: record(
        "set_device", d, os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: record("cuda-init"))
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)

    class Run:  # stands in for a pass: iterating it is where gathers run on the GPU
        stats = None
        cancel = types.SimpleNamespace(cancel=lambda why: None)

        def __len__(self):
            return 2

        def __iter__(self):
            record("gather")
            yield from (1, 2)

        def close(self):
            pass

    class Passes:  # stands in for LocalPasses: building the feature store allocates on the GPU
        def __init__(self, cfg, ctx):
            record("store", str(ctx.device))

        def run(self, split, epoch, skip, name):
            return Run()

        def close(self):
            pass

    from lightning_ooc.loader import registry
    from lightning_ooc.loader.config import NodeDataConfig

    monkeypatch.setitem(registry.SOURCES, ("node", "tiered"), Passes)  # the producer's pass source, looked up there
    monkeypatch.setattr(registry, "is_typed", lambda root, stores=None: False)  # no dataset: a homogeneous one
    commands, out = queue.Queue(), queue.Queue()
    spec = {"rank": 1, "world": 2, "device": "cuda:1", "handles": {}, "local": (1, 2), "parent": None,
            "env": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"}}  # fmt: skip
    main = threading.Thread(target=producer_mod._main, args=(NodeDataConfig(root="unused"), spec, commands, out),
                            name="producer-main")  # fmt: skip
    main.start()
    try:
        assert out.get(timeout=30)[0] == "ready"
        commands.put(("start", 1, "train", 0, frozenset()))
        commands.put(("credit", 1, 4))
        got = [out.get(timeout=30) for _ in range(4)]
        assert [m[0] for m in got] == ["started", "batch", "batch", "end"]
    finally:
        commands.put(None)
        main.join(timeout=30)
    assert not main.is_alive()
    # the main thread: the rank's GPU first, with the MPS settings already in place; then the store
    assert calls[0] == ("set_device", "producer-main", 1, "10")
    assert ("store", "producer-main", "cuda:1") in calls
    # the pass thread: its own set_device before its first gather
    in_pass = [c for c in calls if c[1] == "ooc-producer-run-1"]
    assert in_pass[0][:3] == ("set_device", "ooc-producer-run-1", 1) and in_pass[1][0] == "gather"


def test_a_producer_gets_its_env_without_touching_this_process_environ(demo_dataset, monkeypatch):
    writes: list = []
    monkeypatch.setattr(os, "putenv", lambda k, v: writes.append(("put", k)))
    monkeypatch.setattr(os, "unsetenv", lambda k: writes.append(("unset", k)))
    before = dict(os.environ)
    prod = GatherProducer(_dm(demo_dataset.root).config, rank=0, world=1, device="cpu", handles={},
                          env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10", "CUDA_MPS_PIPE_DIRECTORY": "/x"})  # fmt: skip
    try:
        assert writes == [] and dict(os.environ) == before  # the trainer's threads never see a changed environ
        assert prod.client_env == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10", "CUDA_MPS_PIPE_DIRECTORY": "/x"}
    finally:
        prod.close()
    prod.close()  # a second close (the datamodule's, after the strategy's) does nothing


def _plan_lowers_the_train_queue(monkeypatch, depth):
    """The producer's memory plan fits its limit with a train queue of ``depth`` (as a plan under a tight cap
    chooses: test_memory.py plans one), the other settings as asked."""
    plan_store = source.plan_store

    def lowered(*args, **kwargs):
        plan, hot = plan_store(*args, **kwargs)
        plan.pipeline = {"train_queue_size": depth}
        return plan, hot

    monkeypatch.setattr(source, "plan_store", lowered)


class _InThisProcess:
    """Stands in for the spawn context of :class:`GatherProducer`: its entry point runs in a thread of this
    process, so a plan patched here is the producer's plan. Everything else (the entry point, the passes, the
    store, the messages and credits) is the producer's own."""

    class Queue(queue.Queue):
        def close(self):
            pass

        def cancel_join_thread(self):
            pass

    class Process(threading.Thread):
        exitcode = None

        def __init__(self, target, name, daemon, args):
            super().__init__(target=target, name=name, daemon=daemon, args=args)

        @property
        def pid(self):
            return os.getpid()

        def kill(self):
            raise AssertionError("the producer's main loop did not stop when asked")


def test_the_producer_reports_the_train_queue_its_plan_settled_on(demo_dataset, monkeypatch):
    """The producer's entry point, with a plan that lowered the train queue from 3 to 1: its ready message
    names 1 credit, the depth the memory was planned for."""
    _plan_lowers_the_train_queue(monkeypatch, 1)
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    cfg = _dm(demo_dataset.root, pipeline={"train_queue_size": 3}).config
    assert isinstance(cfg, NodeDataConfig) and cfg.pipeline.train_queue_size == 3
    commands, out = queue.Queue(), queue.Queue()
    spec = {"rank": 0, "world": 1, "device": "cpu", "handles": {}, "local": (0, 1), "parent": None, "env": {}}
    main = threading.Thread(target=producer_mod._main, args=(cfg, spec, commands, out), name="producer-main")
    main.start()
    try:
        kind, _, payload = out.get(timeout=120)
        assert kind == "ready", payload
        assert payload["credits"] == 1
    finally:
        commands.put(None)
        main.join(timeout=60)
    assert not main.is_alive()
    assert cfg.pipeline.train_queue_size == 3  # the datamodule's settings stay as given


def test_a_producer_grants_the_credits_of_the_queue_its_plan_settled_on(demo_dataset, monkeypatch):
    """A tight memory cap lowered the train queue in the producer's plan (4 -> 2); the trainer granted each
    pass the configured 4 credits all the same, so more batches could wait than memory was planned for. It
    now grants the planned 2, then one per batch taken; an explicit ``credits`` still wins."""
    _plan_lowers_the_train_queue(monkeypatch, 2)
    monkeypatch.setattr(producer_mod, "mp", types.SimpleNamespace(get_context=lambda method: _InThisProcess))
    monkeypatch.setattr(producer_mod, "die_with_parent", lambda parent: None)  # this process has no producer parent
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    cfg = _dm(demo_dataset.root, pipeline={"train_queue_size": 4}).config
    prod = GatherProducer(cfg, rank=0, world=1, device="cpu", handles={})
    try:
        assert prod.credits == 2
        sent: list[tuple] = []
        send = prod._send
        monkeypatch.setattr(prod, "_send", lambda *cmd: (sent.append(cmd), send(*cmd))[1])
        run = prod.run("train", 0)
        batches = list(run)
        assert len(batches) == -(-len(demo_dataset.split("train")) // 64)
        credits = [c for c in sent if c[0] == "credit"]
        assert credits[0] == ("credit", run.run_id, 2)  # the pass starts with the planned depth
        assert all(c[2] == 1 for c in credits[1:])  # then one per batch taken
    finally:
        prod.close()
    assert not prod.proc.is_alive()
    explicit = GatherProducer(cfg, rank=0, world=1, device="cpu", handles={}, credits=5)
    try:
        assert explicit.credits == 5
    finally:
        explicit.close()


def test_a_daemon_that_fails_to_start_means_no_split_and_one_warning(demo_dataset, tmp_path, monkeypatch, caplog):
    _install_control(tmp_path, monkeypatch, "#!/bin/sh\necho 'cannot start:' >&2\necho '  no GPU' >&2\nexit 3\n")
    monkeypatch.setattr("lightning_ooc.strategy.ooc.mps_usable", lambda device: (True, ""))
    seen = _Seen()
    strategy = OutOfCoreStrategy(mps_split=10)
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        _trainer(strategy, [seen], epochs=1).fit(
            GraphSAGE(demo_dataset.num_features, demo_dataset.num_classes, hidden_channels=16, num_layers=2),
            datamodule=_dm(demo_dataset.root))  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if "mps_split" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "exited with 3: cannot start: no GPU" in warnings[0] and "side stream" in warnings[0]
    assert strategy.mps is None and not strategy.gather_in_producer and seen.producer_pid is None
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ
    assert sorted(seen.seeds[0]) == sorted(demo_dataset.split("train").tolist())


# -- the training process as an MPS client: prepare() before CUDA starts -----------------------------------------
def test_mps_usable_never_initialises_cuda(fake_control, tmp_path, monkeypatch):
    def initialises(*a, **kw):
        raise AssertionError("initialises CUDA: too late for this process to become an MPS client")

    monkeypatch.setattr(torch.cuda, "is_available", initialises)
    monkeypatch.setattr(torch.cuda, "device_count", initialises)
    monkeypatch.setattr(torch.cuda, "_lazy_init", initialises)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    node = tmp_path / "nvidiactl"
    node.touch()
    monkeypatch.setattr(mps_mod, "NVIDIACTL", str(node), raising=False)
    assert mps_mod.mps_usable("cuda:1") == (True, "")
    node.unlink()
    ok, why = mps_mod.mps_usable("cuda:1")
    assert not ok and "nvidiactl is missing" in why
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    assert mps_mod.mps_usable("cuda") == (False, "this PyTorch is built without CUDA")


CHILD = """
import sys
from lightning_ooc.strategy import mps
mps.mps_usable = lambda device, control=None: (True, "")
m = mps.prepare(10)
print(m.pipe_dir, m.started, flush=True)
sys.stdin.readline()
"""


def test_prepare_makes_this_process_a_client_and_the_last_user_quits_the_daemon_at_exit(fake_control, tmp_path,
                                                                                         monkeypatch, mps_state):  # fmt: skip
    monkeypatch.setattr(mps_mod, "mps_usable", lambda device, control=None: (True, ""))
    mps = mps_mod.prepare(10)
    assert mps is not None and mps.started
    # this process's client settings, in place before anything initialises CUDA
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "90"
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == mps.pipe_dir and os.environ["CUDA_MPS_LOG_DIRECTORY"] == mps.log_dir
    advert = tmp_path / "tmp" / f"looc-mps-{os.getuid()}" / f"looc-mps-{os.getuid()}.json"
    me = [os.getpid(), mps_mod._start_time(os.getpid())]
    assert json.loads(advert.read_text())["users"] == [me]
    assert mps_mod.prepare(10) is mps and mps_state == [mps_mod.release]  # again: the same, one hook
    # a process started with these settings (a rank Lightning launches re-runs the command, which prepares
    # again): it joins the same daemon as a user, and its own atexit hook leaves it
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(mps_mod.__file__))))
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert child.stdout.readline().split() == [mps.pipe_dir, "False"]
        assert [u[0] for u in json.loads(advert.read_text())["users"]] == [os.getpid(), child.pid]
        assert len([c for c in _calls(fake_control) if c.startswith("-d")]) == 1  # not started again
        mps_state[0]()  # this process exits first: the child still uses the daemon
        assert "stdin: quit" not in _calls(fake_control)
        assert stat.S_ISFIFO(os.stat(os.path.join(mps.pipe_dir, "control")).st_mode)
    finally:
        child.communicate("\n", timeout=60)
    assert child.returncode == 0
    assert "stdin: quit" in _calls(fake_control)  # the child, the last user, quit it at its exit
    assert not os.path.exists(mps.pipe_dir) and not advert.exists()


def _strategy(split=10):
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator

    return OutOfCoreStrategy(mps_split=split, parallel_devices=[torch.device("cpu")], accelerator=CPUAccelerator(),
                             cluster_environment=LightningEnvironment())  # fmt: skip


def test_prepare_after_cuda_started_warns_once_and_the_strategy_uses_it(fake_control, monkeypatch, caplog):
    monkeypatch.setattr(mps_mod, "mps_usable", lambda device, control=None: (True, ""))
    monkeypatch.setattr("lightning_ooc.strategy.ooc.mps_usable", lambda device: (True, ""))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        mps = mps_mod.prepare(10)
        strategy = _strategy()
        strategy._start_mps()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "CUDA was initialised in this process before it could become a CUDA MPS client" in warnings[0]
    assert "lightning_ooc.strategy.mps.prepare(10) before anything uses CUDA" in warnings[0]
    assert "lightning-ooc fit" in warnings[0]
    # the producer, a fresh process, is still a client capped to 10 % of the daemon prepared
    assert strategy.mps is mps and strategy.producer_env()["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"


def test_a_script_without_prepare_after_cuda_started_gets_one_warning_naming_the_fix(fake_control, monkeypatch,
                                                                                      caplog):  # fmt: skip
    monkeypatch.setattr("lightning_ooc.strategy.ooc.mps_usable", lambda device: (True, ""))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    strategy = _strategy()
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        strategy._start_mps()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "the training process is not one" in warnings[0]
    assert "time-slice" in warnings[0] and "lightning_ooc.strategy.mps.prepare(10)" in warnings[0]
    assert "lightning-ooc fit" in warnings[0]
    assert strategy.gather_in_producer  # as before: the producer runs under MPS with its cap
    assert strategy.producer_env()["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"


def test_teardown_keeps_the_daemon_of_a_client_and_a_second_run_uses_it(fake_control, monkeypatch, mps_state):
    monkeypatch.setattr("lightning_ooc.strategy.ooc.mps_usable", lambda device: (True, ""))
    first = _strategy()
    first._start_mps()  # nothing has initialised CUDA here: this process becomes a client
    pipe = first.mps.pipe_dir
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "90"
    first.teardown()
    assert "stdin: quit" not in _calls(fake_control)
    assert stat.S_ISFIFO(os.stat(os.path.join(pipe, "control")).st_mode)
    second = _strategy()  # test_after_fit, or another fit in this process
    second._start_mps()
    assert second.mps.pipe_dir == pipe and len([c for c in _calls(fake_control) if c.startswith("-d")]) == 1
    second.teardown()
    assert "stdin: quit" not in _calls(fake_control)
    assert mps_state == [mps_mod.release]
    mps_state[0]()  # at exit
    assert "stdin: quit" in _calls(fake_control) and not os.path.exists(pipe)


MPS_STRATEGY = {"class_path": "lightning_ooc.OutOfCoreStrategy", "init_args": {"mps_split": 10}}


def test_the_cli_prepares_mps_before_the_trainer_exactly_when_the_strategy_has_mps_split(demo_dataset, monkeypatch):
    from lightning.pytorch.trainer.trainer import Trainer

    from lightning_ooc import lightning_cli
    from lightning_ooc.models import NodeClassifier

    order: list = []
    monkeypatch.setattr(mps_mod, "prepare", lambda split: order.append(("prepare", split)))
    # the hook, on parsed configs
    assert lightning_cli.prepare_mps({"trainer": {"strategy": MPS_STRATEGY}}) is None and order == [("prepare", 10)]
    order.clear()
    for trainer in ({"strategy": "ooc"}, {"strategy": {"class_path": "lightning_ooc.OutOfCoreStrategy",
                                                       "init_args": {"mps_split": None}}},
                    {"strategy": MPS_STRATEGY, "accelerator": "cpu"}, {}):  # fmt: skip
        lightning_cli.prepare_mps({"trainer": trainer})
    assert order == []
    # the command: before the Trainer is built
    init = Trainer.__init__

    @functools.wraps(init)  # the CLI reads the Trainer's arguments from its signature
    def built(self, *args, **kwargs):
        order.append("trainer")
        init(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "__init__", built)
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.yaml")
    common = ["--config", config, "--data.root", str(demo_dataset.root)]
    monkeypatch.setattr(sys, "argv", ["lightning-ooc"])
    for extra, want in (([], ["trainer"]), (["--trainer.strategy", "lightning_ooc.OutOfCoreStrategy",
                                             "--trainer.strategy.mps_split", "10"], [("prepare", 10), "trainer"])):  # fmt: skip
        order.clear()
        cli = lightning_cli.OutOfCoreCLI(NodeClassifier, OutOfCoreNodeData, subclass_mode_model=True, run=False,
                                         args=common + extra)  # fmt: skip
        assert order == want
        assert isinstance(cli.trainer.strategy, OutOfCoreStrategy)
        assert cli.trainer.strategy.mps_split == (10 if extra else None)
