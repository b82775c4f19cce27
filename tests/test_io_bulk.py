"""BulkFile and lightning_ooc._io.transfer: whole ranges read and written with direct I/O, every backend."""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_ooc.errors import InputError
from lightning_ooc.io import (
    BackendUnavailableError,
    BulkFile,
    FeatureReadError,
    FeatureWriteError,
    aligned_empty,
    available_backends,
    round_up,
)
from lightning_ooc.io import backends as io_backends
from lightning_ooc.io.bulk import BULK_BACKENDS

_io = io_backends.native()
pytestmark = pytest.mark.skipif(_io is None, reason="the native module lightning_ooc._io is not built")

MiB = 1 << 20


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bulk")


@pytest.fixture(params=BULK_BACKENDS)
def backend(request, workdir) -> str:
    ok, why = available_backends(workdir)[request.param]
    if not ok:
        pytest.skip(f"{request.param}: {why}")
    return request.param


@pytest.fixture(params=["uring", "pread"])
def direct_backend(request, workdir) -> str:
    ok, why = available_backends(workdir)[request.param]
    if not ok:
        pytest.skip(f"{request.param}: {why}")
    return request.param


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def filled(data: bytes) -> torch.Tensor:
    """Aligned memory holding ``data``."""
    t = aligned_empty(len(data))[: len(data)]
    t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return t


def as_bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


@pytest.fixture
def tmpfs_dir(tmp_path):
    """A 1 MiB tmpfs mounted for the test (needs root and a kernel that lets this process mount)."""
    where = tmp_path / "small"
    where.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip() or out.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


# -- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "offset, nbytes, queue_depth, chunk",
    [
        (0, 4096, 32, MiB),  # one page
        (0, 5 * MiB + 3 * 4096, 32, MiB),  # several MB, not a multiple of the chunk
        (3 * MiB + 8192, 2 * MiB + 4096, 3, 256 * 1024),  # the middle of a file, more requests than slots
    ],
    ids=["page", "5MiB+3pages", "middle"],
)
def test_write_then_read_back_bit_identical(workdir, backend, offset, nbytes, queue_depth, chunk):
    path = workdir / f"rt-{backend}-{offset}-{nbytes}.bin"
    total = offset + nbytes + 2 * MiB  # bytes on both sides of the range must stay as they were
    background = random_bytes(total, seed=1)
    data = random_bytes(nbytes, seed=2)
    with BulkFile(path, "w", backend, size=total, queue_depth=queue_depth, chunk=chunk) as f:
        assert f.backend == backend and f.direct == (backend != "buffered")
        assert f.write_from(0, filled(background)) == total
        assert f.write_from(offset, filled(data)) == nbytes
        f.sync()
    expected = background[:offset] + data + background[offset + nbytes :]
    assert path.read_bytes() == expected  # plain buffered read of what reached the file

    with BulkFile(path, "r", backend, queue_depth=queue_depth, chunk=chunk) as f:
        dest = aligned_empty(nbytes)
        assert f.read_into(offset, dest) == nbytes
        assert as_bytes(dest) == data
        whole = aligned_empty(total).numpy()  # a NumPy destination
        assert f.read_into(0, whole) == total
        assert whole.tobytes() == expected


def test_read_into_a_memoryview_and_write_from_bytes_when_buffered(workdir):
    path = workdir / "buffered-any.bin"
    data = random_bytes(10_000, seed=3)
    with BulkFile(path, "w", "buffered") as f:
        assert f.align == 1  # no alignment through the page cache
        assert f.write_from(0, data) == len(data)  # read-only bytes are fine as a source
        buf = bytearray(777)
        assert f.read_into(123, memoryview(buf)) == 777
    assert bytes(buf) == data[123:900]


def test_r_plus_overwrites_in_place(workdir, backend):
    path = workdir / f"rplus-{backend}.bin"
    before = random_bytes(2 * MiB, seed=4)
    path.write_bytes(before)
    patch = random_bytes(MiB, seed=5)
    with BulkFile(path, "r+", backend) as f:
        f.write_from(MiB // 2, filled(patch))
        f.sync()
    assert path.read_bytes() == before[: MiB // 2] + patch + before[MiB // 2 + MiB :]


# -- creating, reserving --------------------------------------------------------------------------
def test_mode_w_refuses_an_existing_file(workdir):
    path = workdir / "exists.bin"
    path.write_bytes(b"keep me")
    with pytest.raises(FeatureWriteError) as ei:
        BulkFile(path, "w", size=4096)
    assert ei.value.errno == errno.EEXIST and str(path) in str(ei.value) and "r+" in str(ei.value)
    assert path.read_bytes() == b"keep me"


def test_reserving_more_than_is_free_is_refused_up_front(tmpfs_dir):
    path = tmpfs_dir / "part-0.bin"
    with pytest.raises(FeatureWriteError) as ei:
        BulkFile(path, "w", size=2 * MiB)
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC
    assert str(path) in msg and str(2 * MiB) in msg and "free" in msg and "disk is full" in msg
    assert not path.exists()  # nothing left behind
    with BulkFile(path, "w", size=512 * 1024) as f:  # what fits is reserved
        assert f.size == 512 * 1024


def test_full_disk_while_writing_says_so(tmpfs_dir):
    """tmpfs is a memory file system: auto reads and writes it through the page cache."""
    path = tmpfs_dir / "grows.bin"
    with BulkFile(path, "w") as f:
        assert f.backend == "buffered"
        with pytest.raises(FeatureWriteError) as ei:
            f.write_from(0, filled(random_bytes(2 * MiB, seed=6)))
    e = ei.value
    assert e.errno == errno.ENOSPC and 0 <= e.offset < 2 * MiB and e.length > 0
    assert str(path) in str(e) and "disk is full" in str(e) and "free" in str(e)


@pytest.mark.parametrize("name", ["uring", "pread"])
def test_full_disk_through_direct_backends(tmpfs_dir, name):
    """Where the kernel takes O_DIRECT on tmpfs, ENOSPC comes back through each direct engine the same way."""
    ok, why = available_backends(tmpfs_dir)[name]
    if not ok:
        pytest.skip(f"{name} on tmpfs: {why}")
    path = tmpfs_dir / f"grows-{name}.bin"
    with BulkFile(path, "w", name) as f:
        with pytest.raises(FeatureWriteError) as ei:
            f.write_from(0, filled(random_bytes(2 * MiB, seed=7)))
    assert ei.value.errno == errno.ENOSPC and str(path) in str(ei.value) and "free" in str(ei.value)


# -- read errors, bad input ---------------------------------------------------------------------
def test_read_past_the_end_names_the_offset(workdir, backend):
    path = workdir / f"short-{backend}.bin"
    path.write_bytes(random_bytes(MiB, seed=8))
    with BulkFile(path, "r", backend) as f:
        with pytest.raises(FeatureReadError) as ei:
            f.read_into(MiB - 4096, aligned_empty(8192))  # the second page lies past the end
        assert ei.value.offset == MiB and str(path) in str(ei.value) and "short read" in str(ei.value)
        with pytest.raises(FeatureReadError) as ei:
            f.read_into(4 * MiB, aligned_empty(4096))  # wholly past the end
        assert ei.value.offset == 4 * MiB
        dest = aligned_empty(4096)  # still usable
        f.read_into(4096, dest)
        assert as_bytes(dest) == path.read_bytes()[4096:8192]


def test_misaligned_memory_or_length_on_a_direct_file(workdir, direct_backend):
    path = workdir / f"align-{direct_backend}.bin"
    path.write_bytes(random_bytes(MiB, seed=9))
    with BulkFile(path, "r+", direct_backend) as f:
        assert f.direct and f.align > 1
        mem = aligned_empty(3 * 4096)
        with pytest.raises(InputError, match="aligned_empty") as ei:
            f.read_into(0, mem[1 : 1 + 4096])  # memory off by one byte
        assert "aligned to" in str(ei.value)
        with pytest.raises(InputError, match=f"not a multiple of {f.align}"):
            f.read_into(0, mem[:100])  # length
        with pytest.raises(InputError, match=f"not a multiple of {f.align}"):
            f.write_from(100, mem[:4096])  # offset
        with pytest.raises(InputError, match="aligned to"):
            f.write_from(0, mem[1 : 1 + 4096])
    assert path.read_bytes() == random_bytes(MiB, seed=9)  # nothing was written


def test_write_to_a_read_only_file(workdir, backend):
    path = workdir / f"ro-{backend}.bin"
    path.write_bytes(bytes(8192))
    with BulkFile(path, "r", backend) as f:
        with pytest.raises(FeatureWriteError) as ei:
            f.write_from(4096, aligned_empty(4096))
    assert ei.value.errno == errno.EBADF and "r+" in str(ei.value)


# -- the native function ----------------------------------------------------------------------
def engines() -> list[str]:
    ok, _ = io_backends.uring_status()
    return (["uring"] if ok else []) + ["threads"]


@pytest.mark.parametrize("engine", engines())
def test_transfer_write_error_carries_errno_and_offset(workdir, engine):
    path = workdir / f"ebadf-{engine}.bin"
    path.write_bytes(bytes(4 * MiB))
    mem = aligned_empty(2 * MiB)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with pytest.raises(_io.WriteError) as ei:
            _io.transfer(fd, True, MiB, mem.data_ptr(), 2 * MiB, engine=engine)
        kind, err, offset, length, got, message = ei.value.args
        assert (kind, err, got) == (_io.ERR_IO, errno.EBADF, 0)
        assert offset in (MiB, 2 * MiB) and length == MiB  # one of the two 1 MiB requests failed first
        assert "write" in message and os.strerror(errno.EBADF) in message
        # the same fd reads fine, and a read error is a ReadError
        assert _io.transfer(fd, False, MiB, mem.data_ptr(), 2 * MiB, engine=engine) == 2 * MiB
        with pytest.raises(_io.ReadError) as ei:
            _io.transfer(fd, False, 3 * MiB, mem.data_ptr(), 2 * MiB, engine=engine)
        assert ei.value.args[0] == _io.ERR_SHORT and ei.value.args[2] == 4 * MiB
    finally:
        os.close(fd)


def test_transfer_checks_its_arguments_first(workdir):
    path = workdir / "args.bin"
    path.write_bytes(bytes(MiB))
    mem = aligned_empty(8192)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        assert _io.fd_is_direct(fd)
        with pytest.raises(ValueError, match="must be >= 0"):
            _io.transfer(fd, False, 0, mem.data_ptr(), -4096)
        with pytest.raises(ValueError, match="engine"):
            _io.transfer(fd, False, 0, mem.data_ptr(), 4096, engine="aio")
        with pytest.raises(ValueError, match="O_DIRECT.*offset 100"):
            _io.transfer(fd, False, 100, mem.data_ptr(), 4096)
        with pytest.raises(ValueError, match="O_DIRECT.*memory address"):
            _io.transfer(fd, False, 0, mem.data_ptr() + 1, 4096)
        with pytest.raises(ValueError, match="O_DIRECT.*chunk"):
            _io.transfer(fd, False, 0, mem.data_ptr(), 8192, chunk=1000)
        assert _io.transfer(fd, False, 0, mem.data_ptr(), 0) == 0
    finally:
        os.close(fd)
    with pytest.raises(_io.ReadError) as ei:  # a closed fd: errno and offset, like any failed read
        _io.transfer(fd, False, 4096, mem.data_ptr(), 4096)
    assert ei.value.args[1] == errno.EBADF and ei.value.args[2] == 4096


# -- the GIL ----------------------------------------------------------------------------------
def test_gil_is_released_during_a_transfer(workdir, direct_backend):
    """Python code runs in another thread while a 64 MiB read is visibly under way.

    The other thread counts its loop iterations that saw the destination partly filled (first
    byte arrived, last byte not yet). With the GIL held for the whole transfer it could only
    see the memory before or after, never in between.
    """
    n = 64 * MiB
    path = workdir / f"gil-{direct_backend}.bin"
    data = bytearray(random_bytes(n, seed=10))
    data[0] = data[-1] = 0xA5
    path.write_bytes(data)
    dest = aligned_empty(n)
    arr = dest.numpy()
    arr[0] = arr[-1] = 0
    counts = {"loops": 0, "during": 0}
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counts["loops"] += 1
            if arr[0] != 0 and arr[-1] == 0:
                counts["during"] += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    while counts["loops"] == 0:  # it runs before the transfer starts
        time.sleep(0.001)
    with BulkFile(path, "r", direct_backend) as f:
        before = counts["loops"]
        f.read_into(0, dest)
        after = counts["loops"]
    stop.set()
    t.join()
    assert after > before and counts["during"] > 0
    assert arr.tobytes() == bytes(data)


# -- backend choice ---------------------------------------------------------------------------
def test_auto_without_io_uring_falls_back_and_says_so_once(workdir, monkeypatch, caplog):
    path = workdir / "noring.bin"
    path.write_bytes(random_bytes(MiB, seed=11))
    fs = io_backends.probe_file(path)["fs"]
    if not available_backends(path)["pread"][0] or fs in io_backends.MEMORY_FILE_SYSTEMS:
        pytest.skip("auto does not pick a direct backend here")
    monkeypatch.setenv(io_backends.DISABLE_URING_ENV, "1")
    monkeypatch.setattr(io_backends, "_logged", set())
    with caplog.at_level(logging.INFO, logger="lightning_ooc"):
        for _ in range(3):
            with BulkFile(path) as f:
                assert (f.backend, f.engine, f.direct) == ("pread", "threads", True)
                dest = aligned_empty(MiB)
                f.read_into(0, dest)
                assert as_bytes(dest) == path.read_bytes()
    said = [r for r in caplog.records if r.name == "lightning_ooc" and "bulk file backend 'pread'" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert io_backends.DISABLE_URING_ENV in said[0].getMessage()
    with pytest.raises(BackendUnavailableError, match="unavailable"):
        BulkFile(path, backend="uring")


def test_a_ring_that_cannot_start_falls_back_only_under_auto(workdir, monkeypatch, caplog):
    if not available_backends(workdir)["uring"][0]:
        pytest.skip("io_uring with O_DIRECT does not work here")
    path = workdir / "ringfail.bin"
    path.write_bytes(random_bytes(MiB, seed=12))
    real = _io.transfer
    calls = []

    def no_ring(*args, **kw):
        calls.append(kw["engine"])
        if kw["engine"] == "uring":
            raise OSError(errno.ENOMEM, "io_uring_setup failed: Cannot allocate memory")
        return real(*args, **kw)

    monkeypatch.setattr(_io, "transfer", no_ring)
    monkeypatch.setattr(io_backends, "_logged", set())
    dest = aligned_empty(MiB)
    with BulkFile(path, backend="uring") as f:
        with pytest.raises(BackendUnavailableError, match="could not start"):
            f.read_into(0, dest)
    with caplog.at_level(logging.INFO, logger="lightning_ooc"), BulkFile(path) as f:
        if f.backend != "uring":
            pytest.skip(f"auto picks {f.backend} here")
        f.read_into(0, dest)
        assert (f.backend, f.engine) == ("pread", "threads")
    assert as_bytes(dest) == path.read_bytes() and calls[-2:] == ["uring", "threads"]
    assert any("could not start" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


# -- helpers ----------------------------------------------------------------------------------
def test_aligned_empty_and_round_up():
    for n in (0, 1, 4096, 4097, 3 * MiB + 5):
        t = aligned_empty(n)
        assert t.dtype == torch.uint8 and t.numel() == round_up(n) and t.data_ptr() % 4096 == 0
    view = aligned_empty(2 * 4096)[4096:]
    view.fill_(7)  # the mapping lives as long as a view of it
    assert int(view.sum()) == 7 * 4096
    assert round_up(1, 512) == 512 and round_up(1024, 512) == 1024
    with pytest.raises(InputError):
        aligned_empty(-1)
