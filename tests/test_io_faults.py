"""FeatureReader under faults: bad input, short files, device errors, closing, leaks."""
from __future__ import annotations

import errno
import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_ooc.errors import CorruptDatasetError, DatasetNotFoundError, InputError, LightningOOCError
from lightning_ooc.io import BACKENDS, FeatureReader, FeatureReadError, ReaderClosedError, available_backends
from lightning_ooc.io import backends as io_backends

ROWS, DIM = 1000, 128  # 512-byte rows


@pytest.fixture
def feature_file(tmp_path) -> Path:
    path = tmp_path / "features.bin"
    path.write_bytes(np.random.default_rng(0).bytes(ROWS * DIM * 4))
    return path


def rows_of(path: Path, ids) -> bytes:
    rows = os.path.getsize(path) // (DIM * 4)
    mm = np.memmap(path, dtype=np.float32, mode="r", shape=(rows, DIM))
    return np.ascontiguousarray(mm[np.asarray(ids)]).tobytes()


def backends_for(path: Path) -> list[str]:
    return [b for b, (ok, _) in available_backends(path).items() if ok]


@pytest.fixture(params=BACKENDS)
def backend(request, feature_file) -> str:
    ok, why = available_backends(feature_file)[request.param]
    if not ok:
        pytest.skip(f"{request.param}: {why}")
    return request.param


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def ring_count() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "io_uring" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


# -- bad ids -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [ROWS, ROWS + 10**9, -1])
def test_id_out_of_range_names_file_and_position(feature_file, backend, bad):
    with FeatureReader(feature_file, DIM, torch.float32, backend=backend) as r:
        out = torch.zeros((3, DIM))
        with pytest.raises(InputError) as ei:
            r.gather([1, 2, bad], out)
        msg = str(ei.value)
        assert str(feature_file) in msg and "position 2" in msg and str(bad) in msg
        assert not out.any()  # nothing was read for a rejected call
        assert bytes(r.gather([5, 6]).numpy().tobytes()) == rows_of(feature_file, [5, 6])  # still usable


@pytest.mark.parametrize(
    "ids", [[1.5, 2.0], np.zeros((2, 2), dtype=np.int64), torch.tensor([1.0]), torch.tensor([True]), "12"]
)
def test_ids_must_be_1d_integers(feature_file, ids):
    with FeatureReader(feature_file, DIM, torch.float32) as r:
        with pytest.raises(InputError):
            r.gather(ids)


# -- bad destinations ------------------------------------------------------------------------------
def test_destination_checks(feature_file, backend):
    with FeatureReader(feature_file, DIM, torch.float32, backend=backend) as r:
        ids = [1, 2, 3]
        bad = {
            "too small": torch.empty((2, DIM)),
            "wrong dtype (tensor)": torch.empty((3, DIM), dtype=torch.float64),
            "wrong dtype (numpy)": np.empty((3, DIM), dtype=np.float16),
            "wrong width": torch.empty((3, DIM + 1)),
            "1-D": torch.empty(3 * DIM),
            "not contiguous": torch.empty((DIM, 3)).t(),
            "read-only": np.frombuffer(bytes(3 * DIM * 4), dtype=np.float32).reshape(3, DIM),
            "not an array": [[0.0] * DIM] * 3,
        }
        for what, out in bad.items():
            with pytest.raises(InputError, match=str(feature_file)):
                r.gather(ids, out)
                pytest.fail(f"accepted a destination that is {what}")
        assert r.gather(ids, np.empty((3, DIM), np.float32)).numpy().tobytes() == rows_of(feature_file, ids)


# -- short files -----------------------------------------------------------------------------------
def test_file_shorter_than_metadata(feature_file):
    with pytest.raises(CorruptDatasetError, match="shorter than its metadata"):
        FeatureReader(feature_file, DIM, torch.float32, num_rows=ROWS + 1)
    with pytest.raises(CorruptDatasetError, match="whole number"):
        FeatureReader(feature_file, 127, torch.float32)  # 508-byte rows do not divide 512,000 bytes
    with pytest.raises(DatasetNotFoundError):
        FeatureReader(feature_file.with_name("missing.bin"), DIM, torch.float32)
    FeatureReader(feature_file, DIM, torch.float32, num_rows=ROWS - 1).close()  # a longer file is fine


@pytest.mark.parametrize("cut", ["whole rows", "mid row"])
def test_file_truncated_under_an_open_reader(feature_file, backend, cut):
    keep = 500 * DIM * 4 + (0 if cut == "whole rows" else 200)
    with FeatureReader(feature_file, DIM, torch.float32, backend=backend) as r:
        before = r.gather([10, 700]).clone()
        os.truncate(feature_file, keep)
        out = torch.zeros((2, DIM))
        with pytest.raises(FeatureReadError) as ei:
            r.gather([10, 700], out)
        e = ei.value
        assert isinstance(e, OSError) and isinstance(e, LightningOOCError)
        assert e.errno == errno.EIO and e.filename == str(feature_file)
        assert e.offset is not None and e.offset <= 700 * DIM * 4 < e.offset + max(e.length, 1) + 4096
        assert str(feature_file) in str(e) and str(e.offset) in str(e)
        # a row that lies partly past the new end fails too, never comes back zero-filled
        with pytest.raises(FeatureReadError):
            r.gather([500])
        with pytest.raises(FeatureReadError):
            r.gather_async(list(range(400, 600)), chunk_rows=10).wait()
        # still usable for what is left
        got = r.gather([10, 499])
        assert got[0].numpy().tobytes() == before[0].numpy().tobytes()
        assert got.numpy().tobytes() == rows_of(feature_file, [10, 499])


def test_device_read_error_names_file_and_offset(tmp_path, monkeypatch):
    """A read the kernel fails (EISDIR: a directory opened as the feature file)
    raises FeatureReadError with errno and offset, and the reader survives it."""
    d = tmp_path / "not-a-file"
    d.mkdir()
    size = os.stat(d).st_size
    if size < 512:
        pytest.skip("directory size too small to address a row")
    engines = ["threads"] + (["uring"] if io_backends.uring_status()[0] else [])
    for engine in engines:
        if engine == "threads":
            monkeypatch.setenv(io_backends.DISABLE_URING_ENV, "1")
        else:
            monkeypatch.delenv(io_backends.DISABLE_URING_ENV, raising=False)
        with FeatureReader(d, 128, torch.float32, backend="buffered", num_rows=1) as r:
            assert r.info["engine"] == engine
            for _ in range(2):  # a failed call leaves the reader usable (and failing the same way)
                with pytest.raises(FeatureReadError) as ei:
                    r.gather([0, 0])
                assert ei.value.errno == errno.EISDIR and ei.value.offset == 0
                assert str(d) in str(ei.value) and "offset 0" in str(ei.value)


# -- closing -----------------------------------------------------------------------------------------
def test_closed_reader(feature_file, backend):
    r = FeatureReader(feature_file, DIM, torch.float32, backend=backend)
    with r:
        r.gather([1])
    assert r.closed
    r.close()  # idempotent
    with pytest.raises(ReaderClosedError, match=str(feature_file)):
        r.gather([1])


def test_close_with_gathers_in_flight(feature_file, backend):
    r = FeatureReader(feature_file, DIM, torch.float32, backend=backend, queue_depth=4)
    ids = np.random.default_rng(1).integers(0, ROWS, 2000)
    handles = [r.gather_async(ids, chunk_rows=100) for _ in range(6)]
    r.close()
    want = rows_of(feature_file, ids)
    for h in handles:  # each one either finished correctly or says the reader was closed
        try:
            assert h.wait(timeout=60).numpy().tobytes() == want
        except ReaderClosedError:
            pass


def test_dropped_handle_does_not_crash(feature_file):
    with FeatureReader(feature_file, DIM, torch.float32) as r:
        for _ in range(20):
            r.gather_async(np.arange(ROWS)[::-1], chunk_rows=64)
        gc.collect()
        assert r.gather([3]).numpy().tobytes() == rows_of(feature_file, [3])


def test_reader_refuses_use_after_fork(feature_file):
    with FeatureReader(feature_file, DIM, torch.float32) as r:
        r.gather([1])
        pid = os.fork()
        if pid == 0:  # child: the reader's threads were not copied; it must refuse, not hang
            code = 3
            try:
                r.gather([1])
            except ReaderClosedError as e:
                code = 0 if "fork" in str(e) else 4
            except BaseException:  # noqa: BLE001
                code = 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert r.gather([2]).numpy().tobytes() == rows_of(feature_file, [2])


# -- leaks ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_open_gather_close_cycles_leak_nothing(feature_file):
    backends = backends_for(feature_file)
    for b in backends:  # warm-up: one-off allocations (lazy imports, probes) are not leaks
        with FeatureReader(feature_file, DIM, torch.float32, backend=b, queue_depth=4) as r:
            r.gather([0])
    gc.collect()  # what earlier tests left for the collector (a subprocess's pipes) goes before the count
    fds, rings, threads = open_fd_count(), ring_count(), thread_count()
    cycles = {"uring": 10_000}
    for b in backends:
        for i in range(cycles.get(b, 1_000)):
            with FeatureReader(feature_file, DIM, torch.float32, backend=b, queue_depth=4) as r:
                r.gather([i % ROWS, (i * 7) % ROWS])
                if i % 1000 == 0:
                    with pytest.raises(InputError):
                        r.gather([ROWS])
    gc.collect()
    assert open_fd_count() == fds
    assert ring_count() == rings
    # no more threads than before (fewer is no leak: a thread an earlier test started, such as tqdm's
    # monitor, may end meanwhile)
    assert thread_count() <= threads


def test_failed_opens_leak_nothing(tmp_path, feature_file):
    fds, threads = open_fd_count(), thread_count()
    d = tmp_path / "dir"
    d.mkdir()
    for _ in range(200):
        with pytest.raises(CorruptDatasetError):
            FeatureReader(feature_file, DIM, torch.float32, num_rows=ROWS + 1)
        if available_backends(feature_file)["pread"][0]:
            with pytest.raises(LightningOOCError):  # a directory refuses O_DIRECT
                FeatureReader(d, 128, torch.float32, backend="pread", num_rows=0)
    gc.collect()
    assert open_fd_count() == fds and thread_count() == threads
