"""FeatureReader: every backend returns exactly the bytes numpy.memmap indexing gives."""
from __future__ import annotations

import itertools
import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_ooc.data.format import FEATURE_DTYPES
from lightning_ooc.io import BACKENDS, FeatureReader, available_backends
from lightning_ooc.io import backends as io_backends

_counter = itertools.count()


def write_random(directory: Path, num_rows: int, num_features: int, dtype: str, seed: int = 0) -> Path:
    """A raw feature file of random bytes (any bit pattern, NaNs included)."""
    itemsize = FEATURE_DTYPES[dtype][1].itemsize
    path = directory / f"features-{next(_counter)}.bin"
    path.write_bytes(np.random.default_rng(seed).bytes(num_rows * num_features * itemsize))
    return path


def reference(path: Path, num_features: int, dtype: str, ids) -> bytes:
    np_dtype = FEATURE_DTYPES[dtype][1]
    mm = np.memmap(path, dtype=np_dtype, mode="r").reshape(-1, num_features)
    return np.ascontiguousarray(mm[np.asarray(ids, dtype=np.int64)]).tobytes()


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def working_backends(path: Path) -> list[str]:
    return [name for name, (ok, _) in available_backends(path).items() if ok]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("io")


@pytest.fixture
def file128(workdir) -> tuple[Path, int]:
    """4096 rows of dim 128 float32: 512-byte rows."""
    return write_random(workdir, 4096, 128, "float32", seed=1), 4096


# -- the property -------------------------------------------------------------------------------
@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(sorted(FEATURE_DTYPES)))
    dim = draw(st.integers(1, 1024))
    num_rows = draw(st.integers(1, 40))
    ids = draw(
        st.one_of(
            st.just([]),
            st.lists(st.integers(0, num_rows - 1), min_size=1, max_size=1),
            st.lists(st.integers(0, num_rows - 1), max_size=90),
            st.lists(st.integers(0, num_rows - 1), max_size=90).map(sorted),
        )
    )
    return dict(
        dtype=dtype,
        dim=dim,
        num_rows=num_rows,
        ids=ids,
        chunk_rows=draw(st.one_of(st.none(), st.integers(1, 25))),
        queue_depth=draw(st.sampled_from([1, 3, 128])),
        max_io=draw(st.sampled_from([0, 4096, 128 * 1024])),
        merge_gap=draw(st.sampled_from([0, 512, 6000])),
        seed=draw(st.integers(0, 2**32 - 1)),
        as_numpy=draw(st.booleans()),
    )


@settings(max_examples=150)
@given(case=cases())
def test_every_backend_matches_memmap(workdir, case):
    path = write_random(workdir, case["num_rows"], case["dim"], case["dtype"], case["seed"])
    try:
        want = reference(path, case["dim"], case["dtype"], case["ids"])
        backends = working_backends(path)
        assert {"buffered", "mmap"} <= set(backends)
        for backend in backends:
            with FeatureReader(
                path, case["dim"], case["dtype"], backend=backend, queue_depth=case["queue_depth"],
                max_io=case["max_io"], merge_gap=case["merge_gap"],
            ) as reader:
                out = None
                if case["as_numpy"]:
                    out = np.full((len(case["ids"]) + 2, case["dim"]), 0x5A, dtype=reader.numpy_dtype)
                if case["chunk_rows"] is None:
                    got = reader.gather(case["ids"], out)
                else:
                    handle = reader.gather_async(case["ids"], out, chunk_rows=case["chunk_rows"])
                    seen = [(lo, hi) for lo, hi, _ in handle.chunks()]
                    got = handle.wait()
                    n, cr = len(case["ids"]), case["chunk_rows"]
                    assert seen == [(lo, min(n, lo + cr)) for lo in range(0, n, cr)]
                assert got.dtype == reader.dtype and tuple(got.shape) == (len(case["ids"]), case["dim"])
                assert as_bytes(got) == want, backend
                stats = reader.last_stats
                assert stats.rows == len(case["ids"])
                assert stats.unique_rows == len(set(case["ids"]))
                assert stats.bytes_requested == stats.unique_rows * reader.row_bytes
                if backend != "mmap":
                    assert stats.bytes_read >= stats.bytes_requested
                if out is not None and len(case["ids"]):
                    assert np.shares_memory(got.numpy() if got.dtype != torch.bfloat16 else got.view(torch.int16).numpy(), out)
    finally:
        path.unlink()


def test_direct_io_backends_are_tested_here(file128):
    """The property above runs the real paths on this machine, not only the fallbacks."""
    path, _ = file128
    if io_backends.native() is None:
        pytest.skip("native module not built")
    info = io_backends.probe_file(path)
    if info["fs"] in io_backends.MEMORY_FILE_SYSTEMS or not info["direct"]:
        pytest.skip(f"{path} is on {info['fs']}: no direct I/O to test")
    got = working_backends(path)
    assert "pread" in got
    if io_backends.uring_status()[0]:
        assert "uring" in got


# -- row layout, merging, duplicates ------------------------------------------------------------
def direct_backends(path: Path) -> list[str]:
    return [b for b in ("uring", "pread") if available_backends(path)[b][0]]


def test_aligned_rows_read_without_amplification(file128):
    path, n = file128
    for backend in direct_backends(path):
        with FeatureReader(path, 128, torch.float32, backend=backend) as r:
            assert r.block_size in (512, 1024, 2048, 4096)
            ids = np.arange(0, n, 7)[::-1]  # no two touching, unsorted
            got = r.gather(ids)
            s = r.last_stats
            assert as_bytes(got) == reference(path, 128, "float32", ids)
            expected_ios = len(ids) if r.block_size <= 512 else len(np.unique(ids * 512 // r.block_size))
            assert s.num_ios == expected_ios
            if r.block_size == 512:
                assert s.bytes_read == s.bytes_requested == len(ids) * 512
                assert s.read_amplification == 1.0


def test_unaligned_rows_read_as_covering_extents(workdir):
    path = write_random(workdir, 3000, 100, "float32", seed=2)  # 400-byte rows
    for backend in direct_backends(path):
        with FeatureReader(path, 100, "float32", backend=backend) as r:
            b = r.block_size
            ids = np.arange(0, 3000, 50)  # far apart: one extent per row
            got = r.gather(ids)
            assert as_bytes(got) == reference(path, 100, "float32", ids)
            s = r.last_stats
            starts, ends = ids * 400 // b * b, -(-(ids * 400 + 400) // b) * b
            assert s.num_ios == len(ids)
            assert s.bytes_read == int((ends - starts).sum())
            assert s.bytes_read % b == 0


def test_touching_extents_merge_up_to_max_io(file128):
    path, _ = file128
    for backend in direct_backends(path):
        ids = np.arange(100)  # 51,200 contiguous bytes
        with FeatureReader(path, 128, torch.float32, backend=backend) as r:
            r.gather(ids[::-1])
            assert r.last_stats.num_ios == 1 and r.last_stats.bytes_read == 51200
        with FeatureReader(path, 128, torch.float32, backend=backend, max_io=4096) as r:
            got = r.gather(ids)
            assert as_bytes(got) == reference(path, 128, "float32", ids)
            assert r.last_stats.num_ios == 13  # ceil(51200 / 4096)


def test_merge_gap(file128):
    path, _ = file128
    for backend in direct_backends(path):
        with FeatureReader(path, 128, torch.float32, backend=backend) as r:
            if r.block_size != 512:
                pytest.skip("gap arithmetic below assumes 512-byte blocks")
            r.gather([0, 3])
            assert (r.last_stats.num_ios, r.last_stats.bytes_read) == (2, 1024)
        with FeatureReader(path, 128, torch.float32, backend=backend, merge_gap=1024) as r:
            got = r.gather([3, 0])
            assert as_bytes(got) == reference(path, 128, "float32", [3, 0])
            assert (r.last_stats.num_ios, r.last_stats.bytes_read) == (1, 2048)
            r.gather([0, 4])  # a 1536-byte gap is wider than merge_gap
            assert r.last_stats.num_ios == 2


def test_duplicates_are_read_once(file128):
    path, _ = file128
    for backend in BACKENDS:
        if not available_backends(path)[backend][0]:
            continue
        with FeatureReader(path, 128, torch.float32, backend=backend) as r:
            ids = [9, 5, 9, 9, 5, 1000] * 20
            got = r.gather(ids)
            assert as_bytes(got) == reference(path, 128, "float32", ids)
            assert r.last_stats.unique_rows == 3
            if backend != "mmap":
                assert r.last_stats.num_ios == 3


def test_duplicates_across_chunks_are_copied_from_the_first_chunk(file128):
    path, _ = file128
    for backend in [b for b in BACKENDS if available_backends(path)[b][0]]:
        with FeatureReader(path, 128, torch.float32, backend=backend) as r:
            ids = [7, 8, 7, 9, 8, 7, 7, 7, 10]
            h = r.gather_async(ids, chunk_rows=2)
            assert h.num_chunks == 5
            assert as_bytes(h.wait()) == reference(path, 128, "float32", ids)
            assert h.stats.unique_rows == 4


def test_bfloat16_and_numpy_destination(workdir):
    path = write_random(workdir, 50, 33, "bfloat16", seed=3)
    for backend in working_backends(path):
        with FeatureReader(path, 33, torch.bfloat16, backend=backend) as r:
            out = np.zeros((10, 33), dtype=np.uint16)
            got = r.gather([4, 49, 0], out)
            assert got.dtype == torch.bfloat16
            assert out[:3].tobytes() == reference(path, 33, "bfloat16", [4, 49, 0])
            assert not out[3:].any()  # rows beyond len(ids) untouched


def test_tensor_destination_larger_than_needed(file128):
    path, _ = file128
    with FeatureReader(path, 128, np.float32) as r:
        out = torch.full((8, 128), -1.0)
        got = r.gather(torch.tensor([3, 1], dtype=torch.int32), out)
        assert got.data_ptr() == out.data_ptr() and got.shape == (2, 128)
        assert as_bytes(out[:2]) == reference(path, 128, "float32", [3, 1])
        assert (out[2:] == -1).all()


def test_pinned_destination(file128):
    path, _ = file128
    try:
        out = torch.empty((4, 128), pin_memory=True)
    except RuntimeError as e:
        pytest.skip(f"no pinned memory on this machine: {e}")
    with FeatureReader(path, 128, torch.float32) as r:
        r.gather([0, 1, 2, 3], out)
    assert as_bytes(out) == reference(path, 128, "float32", [0, 1, 2, 3])


def test_concurrent_gathers_on_one_reader(file128):
    path, n = file128
    errors: list[BaseException] = []
    with FeatureReader(path, 128, torch.float32, workers=2, queue_depth=16) as r:
        def run(seed: int) -> None:
            try:
                rng = np.random.default_rng(seed)
                for _ in range(20):
                    ids = rng.integers(0, n, 300)
                    if as_bytes(r.gather(ids)) != reference(path, 128, "float32", ids):
                        raise AssertionError(f"wrong rows in thread {seed}")
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors


def test_from_dataset(tmp_path):
    from lightning_ooc import open_dataset
    from lightning_ooc.data.synth import synthesize

    root = synthesize(tmp_path / "g", num_nodes=500, avg_degree=4, num_features=100, num_classes=3, seed=1, progress=False)
    ds = open_dataset(root)
    ids = np.random.default_rng(0).integers(0, 500, 200)
    with FeatureReader.from_dataset(ds, queue_depth=8) as r:
        assert r.num_rows == ds.num_nodes and r.dtype == ds.feature_dtype
        assert torch.equal(r.gather(ids), ds.read_features(ids))


# -- alignment comes from the device ---------------------------------------------------------------
def test_block_size_comes_from_the_device(file128):
    path, _ = file128
    if io_backends.native() is None:
        pytest.skip("native module not built")
    info = io_backends.probe_file(path)
    if not info["direct"]:
        pytest.skip(f"{info['fs']} refuses O_DIRECT")
    st = os.stat(path)
    sysfs = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    lbs = None
    for q in (sysfs / "queue/logical_block_size", sysfs / "../queue/logical_block_size"):
        if q.exists():
            lbs = int(q.read_text())
            break
    with FeatureReader(path, 128, torch.float32, backend="pread") as r:
        assert r.block_size == info["block_size"]
        assert "default" not in r.info["block_source"]
        if lbs is not None:
            assert info["device_logical_block_size"] == lbs
            # O_DIRECT alignment is the logical block size on a plain block-device file system
            if info["fs"] in ("ext4", "xfs"):
                assert r.block_size == lbs


# -- choosing a backend ----------------------------------------------------------------------------
def test_available_backends_shape(file128):
    path, _ = file128
    for arg in (None, path):
        b = available_backends(arg)
        assert set(b) == set(BACKENDS)
        for ok, reason in b.values():
            assert isinstance(ok, bool) and isinstance(reason, str) and reason
    assert available_backends(path)["mmap"][0]


def test_available_backends_of_a_directory(workdir, tmp_path):
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "features.bin").write_bytes(bytes(4096))
    for d in (ds, workdir):
        b = available_backends(d)
        assert set(b) == set(BACKENDS) and b["buffered"][0] and b["mmap"][0]
    assert not [p for p in workdir.iterdir() if p.name.startswith(".lightning_ooc-probe-")]


def test_auto_uses_uring_where_it_works(file128):
    path, _ = file128
    avail = available_backends(path)
    if not avail["uring"][0] or io_backends.probe_file(path)["fs"] in io_backends.MEMORY_FILE_SYSTEMS:
        pytest.skip(f"io_uring with O_DIRECT does not work here: {avail['uring'][1]}")
    with FeatureReader(path, 128, torch.float32) as r:
        assert r.backend == "uring"
        assert r.info["engine"] == "uring" and r.info["direct"]


def test_auto_falls_back_to_pread_without_io_uring(file128, monkeypatch, caplog):
    path, _ = file128
    if not available_backends(path)["pread"][0] or io_backends.probe_file(path)["fs"] in io_backends.MEMORY_FILE_SYSTEMS:
        pytest.skip("no O_DIRECT on this file")
    monkeypatch.setenv(io_backends.DISABLE_URING_ENV, "1")
    monkeypatch.setattr(io_backends, "_logged", set())
    with caplog.at_level(logging.INFO, logger="lightning_ooc"):
        for _ in range(3):
            with FeatureReader(path, 128, torch.float32) as r:
                assert r.backend == "pread"
                assert r.gather([1]).shape == (1, 128)
    records = [rec for rec in caplog.records if rec.name == "lightning_ooc" and "'pread'" in rec.getMessage()]
    assert len(records) == 1  # said once
    assert records[0].levelno == logging.WARNING and io_backends.DISABLE_URING_ENV in records[0].getMessage()
    with pytest.raises(Exception, match="unavailable"):
        FeatureReader(path, 128, torch.float32, backend="uring")


def test_auto_falls_back_to_buffered_when_o_direct_is_refused(file128, monkeypatch, caplog):
    path, _ = file128
    mod = io_backends.native()
    if mod is None:
        pytest.skip("native module not built")
    real_probe = mod.probe

    def refusing_probe(p):
        d = dict(real_probe(p))
        d.update(direct=False, direct_errno=22, direct_error="Invalid argument")
        return d

    class Wrapped:
        def __getattr__(self, name):
            return refusing_probe if name == "probe" else getattr(mod, name)

    monkeypatch.setattr(io_backends, "_import_io", lambda: (Wrapped(), ""))
    monkeypatch.setattr(io_backends, "_logged", set())
    with caplog.at_level(logging.INFO, logger="lightning_ooc"):
        with FeatureReader(path, 128, torch.float32) as r:
            assert r.backend == "buffered"
            assert not r.info["direct"]
            assert as_bytes(r.gather([2, 1])) == reference(path, 128, "float32", [2, 1])
    assert any("refuses O_DIRECT" in rec.getMessage() for rec in caplog.records)


def test_memory_file_system_reads_buffered():
    shm = Path("/dev/shm")
    if io_backends.native() is None or not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    path = write_random(shm, 64, 16, "float32", seed=4)
    try:
        if io_backends.probe_file(path)["fs"] not in io_backends.MEMORY_FILE_SYSTEMS:
            pytest.skip("/dev/shm is not a memory file system here")
        with FeatureReader(path, 16, torch.float32) as r:
            assert r.backend == "buffered" and not r.info["direct"]
            assert as_bytes(r.gather([63, 0])) == reference(path, 16, "float32", [63, 0])
    finally:
        path.unlink()
