"""Killing a writer never leaves a directory that opens as a dataset, nor damages an existing one."""
import errno
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import lightning_ooc
from lightning_ooc.data.verify import verify
from lightning_ooc.testing import dataset_files_bytes

CLI = [sys.executable, "-m", "lightning_ooc"]
BIG = ["--nodes", "600000", "--avg-degree", "10", "--dim", "48", "--classes", "4", "--no-progress"]


def _wait_for(pred, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def _partials(parent, name="g"):
    return list(parent.glob(f".{name}.partial-*"))


def _start(args, tmp_path):
    return subprocess.Popen(CLI + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path)


def _assert_nothing_opens(tmp_path):
    for d in [p for p in tmp_path.iterdir() if p.is_dir()]:
        with pytest.raises(lightning_ooc.DatasetError):
            lightning_ooc.open_dataset(d)


@pytest.mark.parametrize("stage", ["indices.npy", "features.bin", "labels.npy"])
def test_sigkill_synth_leaves_nothing_that_opens(tmp_path, stage):
    proc = _start(["synth", "--out", "g", *BIG], tmp_path)
    try:
        assert _wait_for(lambda: any((p / stage).exists() for p in _partials(tmp_path)) or proc.poll() is not None)
        assert proc.poll() is None, "the writer finished before it could be interrupted"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    assert not (tmp_path / "g").exists()
    assert _partials(tmp_path)  # left behind by SIGKILL...
    _assert_nothing_opens(tmp_path)  # ...but it does not open as a dataset
    # The next run for the same target cleans it up and succeeds.
    out = subprocess.run(CLI + ["synth", "--out", "g", "--nodes", "500", "--avg-degree", "3", "--dim", "4",
                                "--classes", "2", "--no-progress"], cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert not _partials(tmp_path) and lightning_ooc.open_dataset(tmp_path / "g").num_nodes == 500


def test_sigkill_during_overwrite_keeps_existing_dataset(tmp_path):
    small = ["--nodes", "3000", "--avg-degree", "4", "--dim", "8", "--classes", "3", "--no-progress"]
    assert subprocess.run(CLI + ["synth", "--out", "g", *small], cwd=tmp_path).returncode == 0
    before = dataset_files_bytes(tmp_path / "g")
    proc = _start(["synth", "--out", "g", "--overwrite", "--seed", "5", *BIG], tmp_path)
    try:
        assert _wait_for(lambda: any((p / "features.bin").exists() for p in _partials(tmp_path)))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    assert dataset_files_bytes(tmp_path / "g") == before
    assert verify(tmp_path / "g", progress=False).ok
    for p in _partials(tmp_path):
        with pytest.raises(lightning_ooc.DatasetError):
            lightning_ooc.open_dataset(p)


def test_sigkill_prepare_leaves_nothing_that_opens(tmp_path):
    rng = np.random.default_rng(0)
    n, e = 300_000, 4_000_000
    np.save(tmp_path / "ei.npy", rng.integers(0, n, (2, e)))
    np.save(tmp_path / "x.npy", rng.random((n, 32), dtype=np.float32))
    proc = _start(["prepare", "--out", "g", "--edge-index", "ei.npy", "--x", "x.npy", "--add-reverse",
                   "--drop-duplicates", "--no-progress"], tmp_path)  # fmt: skip
    try:
        assert _wait_for(lambda: any(list(p.glob("bucket-*")) for p in _partials(tmp_path)) or proc.poll() is not None)
        assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    assert not (tmp_path / "g").exists()
    _assert_nothing_opens(tmp_path)


def test_sigterm_removes_partial_output(tmp_path):
    proc = _start(["synth", "--out", "g", *BIG], tmp_path)
    try:
        assert _wait_for(lambda: any((p / "indices.npy").exists() for p in _partials(tmp_path)))
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        proc.kill()
    assert rc == 128 + signal.SIGTERM
    assert not _partials(tmp_path) and not (tmp_path / "g").exists()


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs, to run out of space for real (needs root)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    yield mnt
    subprocess.run(["umount", str(mnt)])


def test_disk_full_is_a_clear_error_and_cleans_up(tiny_fs):
    from lightning_ooc.data.writer import DatasetWriter, ArrayEdgeSource

    n = 10_000
    with pytest.raises(lightning_ooc.DatasetWriteError, match="no space left on device") as ei:
        with DatasetWriter(tiny_fs / "g", num_nodes=n, num_features=64, num_classes=2) as w:
            w.write_edges(ArrayEdgeSource(np.stack([np.arange(n), np.arange(n)[::-1]])))
            w.write_features([np.zeros((n, 64), dtype=np.float32)])  # 2.5 MiB > 1 MiB
    assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.ENOSPC
    assert list(tiny_fs.iterdir()) == []


def test_not_enough_space_is_refused_up_front(tiny_fs):
    from lightning_ooc.data.synth import synthesize

    with pytest.raises(lightning_ooc.DatasetWriteError, match="only .* is free"):
        synthesize(tiny_fs / "g", num_nodes=20_000, avg_degree=5, num_features=32, num_classes=2, progress=False)
    assert list(tiny_fs.iterdir()) == []
