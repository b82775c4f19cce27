"""mps_split and the gather producer process, on CPU.

The MPS control daemon is the one thing replaced: a stand-in `nvidia-cuda-mps-control` script
that behaves like the real one at its boundary (``-d`` creates the control pipe in
``$CUDA_MPS_PIPE_DIRECTORY``; ``quit`` on stdin removes it) and logs every call. Everything
else (the strategy, the producer process, the hand-over of batches) runs for real.
"""
from __future__ import annotations

import logging
import json
import os
import signal
import stat
import threading

import lightning as L
import pytest
import torch

from lightning_ooc import OutOfCoreNodeData
from lightning_ooc.models import GraphSAGE
from lightning_ooc.strategy import OutOfCoreStrategy
from lightning_ooc.strategy import mps as mps_mod
from lightning_ooc.strategy.mps import MPSControl
from lightning_ooc.strategy.producer import ProducerError

FAKE = """#!/bin/sh
echo "$@ pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "{log}"
if [ "$1" = "-d" ]; then
  mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control" && exit 0
  exit 1
fi
read cmd
echo "stdin: $cmd" >> "{log}"
[ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "control.log"
    exe = bindir / "nvidia-cuda-mps-control"
    exe.write_text(FAKE.format(log=log))
    exe.chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps_mod, "DEFAULT_PIPE_DIR", str(tmp_path / "no-default-daemon"))
    monkeypatch.setattr(mps_mod.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return log


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


def _dm(root, **kw):
    opts = dict(batch_size=64, num_neighbors=[4, 4], gpu_cache="4MiB", host_cache="16KiB", staging="256KiB",
                num_samplers=1, num_extractors=1, progress=False)  # fmt: skip
    opts.update(kw)
    return OutOfCoreNodeData(str(root), **opts)


class _Seen(L.Callback):
    """Records the seeds trained and, while training, the producer process's environment."""

    def __init__(self):
        self.seeds: dict[int, list[int]] = {}
        self.producer_env: dict[str, str] = {}
        self.producer_pid = None
        self.trainer_env: dict[str, str] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seeds.setdefault(trainer.current_epoch, []).extend(batch.n_id[: batch.batch_size].tolist())
        prod = trainer.datamodule.source if hasattr(trainer.datamodule.source, "proc") else None
        if prod is not None and not self.producer_env:
            self.producer_pid = prod.proc.pid
            raw = open(f"/proc/{prod.proc.pid}/environ", "rb").read().split(b"\0")
            self.producer_env = dict(x.decode().split("=", 1) for x in raw if b"=" in x)
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


def test_mps_split_runs_the_gather_in_a_capped_producer_and_stops_the_daemon(demo_dataset, fake_control, monkeypatch):
    # CUDA is what this machine lacks; the strategy is told MPS is usable, and the daemon is the stand-in.
    monkeypatch.setattr("lightning_ooc.strategy.ooc.mps_usable", lambda device: (True, ""))
    saved = {k: os.environ.get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                                            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}  # fmt: skip
    seen = _Seen()
    strategy = OutOfCoreStrategy(mps_split=10)
    try:
        trainer = _trainer(strategy, [seen], epochs=2)
        trainer.fit(GraphSAGE(demo_dataset.num_features, demo_dataset.num_classes, hidden_channels=16, num_layers=2),
                    datamodule=_dm(demo_dataset.root))  # fmt: skip
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    # the gather ran in another process, an MPS client capped to 10 % of the SMs; the trainer got 90 %
    assert seen.producer_pid is not None and seen.producer_pid != os.getpid()
    assert seen.producer_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
    assert seen.trainer_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "90"
    pipe = seen.producer_env["CUDA_MPS_PIPE_DIRECTORY"]
    assert seen.trainer_env["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    # every seed trained exactly once per epoch, with rows that crossed from the producer
    for e in range(2):
        assert sorted(seen.seeds[e]) == sorted(demo_dataset.split("train").tolist())
    # teardown: the producer is gone, the daemon the strategy started got `quit`, its directories removed
    assert not os.path.exists(f"/proc/{seen.producer_pid}") or open(f"/proc/{seen.producer_pid}/stat").read().split(
        ")")[-1].split()[0] == "Z"  # fmt: skip
    calls = _calls(fake_control)
    assert calls[0].startswith(f"-d pipe={pipe}") and "stdin: quit" in calls
    assert not os.path.exists(pipe)


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
