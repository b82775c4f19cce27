"""Opening a damaged dataset raises one of our errors naming the file and the fix; verify finds the rest."""
import json
import shutil

import numpy as np
import pytest

import lightning_ooc
from lightning_ooc import CorruptDatasetError, DatasetNotFoundError, FormatVersionError
from lightning_ooc.data.verify import verify
from lightning_ooc.testing import make_synthetic

FIX = "lightning-ooc prepare"


@pytest.fixture
def ds_root(tmp_path, demo_dataset):
    root = tmp_path / "g"
    shutil.copytree(demo_dataset.root, root)
    return root


def _meta(root):
    return json.loads((root / "meta.json").read_text())


def _write_meta(root, meta):
    (root / "meta.json").write_text(json.dumps(meta))


def _open_error(root, cls):
    with pytest.raises(cls) as ei:
        lightning_ooc.open_dataset(root)
    assert isinstance(ei.value, lightning_ooc.DatasetError)
    return str(ei.value)


def test_missing_directory(tmp_path):
    msg = _open_error(tmp_path / "nope", DatasetNotFoundError)
    assert "nope" in msg and "lightning-ooc synth" in msg


def test_not_a_dataset(tmp_path):
    msg = _open_error(tmp_path, DatasetNotFoundError)
    assert "meta.json" in msg and "not a lightning_ooc dataset" in msg


def test_unreadable_meta(ds_root):
    (ds_root / "meta.json").write_text("{ not json")
    msg = _open_error(ds_root, CorruptDatasetError)
    assert "meta.json" in msg and FIX in msg


def test_foreign_format(ds_root):
    _write_meta(ds_root, {**_meta(ds_root), "format": "ogb"})
    msg = _open_error(ds_root, FormatVersionError)
    assert "'ogb'" in msg and "prepare" in msg


def test_newer_format_version(ds_root):
    _write_meta(ds_root, {**_meta(ds_root), "version": 99})
    msg = _open_error(ds_root, FormatVersionError)
    assert "version 99" in msg and "upgrade lightning_ooc" in msg


@pytest.mark.parametrize("name", ["indptr.npy", "indices.npy", "features.bin", "labels.npy", "val.npy"])
def test_missing_file(ds_root, name):
    (ds_root / name).unlink()
    msg = _open_error(ds_root, DatasetNotFoundError)
    assert name in msg and "missing" in msg and FIX in msg


@pytest.mark.parametrize("name", ["indices.npy", "features.bin", "labels.npy", "indptr.npy"])
def test_truncated_file(ds_root, name):
    path = ds_root / name
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 7)
    msg = _open_error(ds_root, CorruptDatasetError)
    assert name in msg and "truncated" in msg and str(size) in msg and FIX in msg


def test_wrong_dtype_in_npy(ds_root):
    labels = np.load(ds_root / "labels.npy")
    np.save(ds_root / "labels.npy", labels.astype(np.float64))  # same size, other dtype
    msg = _open_error(ds_root, CorruptDatasetError)
    assert "labels.npy" in msg and "float64" in msg and "int64" in msg


def test_garbage_npy_header(ds_root):
    path = ds_root / "labels.npy"
    data = bytearray(path.read_bytes())
    data[:6] = b"XXXXXX"
    path.write_bytes(bytes(data))
    msg = _open_error(ds_root, CorruptDatasetError)
    assert "labels.npy" in msg and "not a readable .npy" in msg


def test_non_monotone_indptr(ds_root):
    indptr = np.load(ds_root / "indptr.npy")
    v = int(np.argmax(np.diff(indptr) > 0))  # a node with in-edges
    indptr[v + 1] = indptr[v] - 1 if indptr[v] > 0 else indptr[v + 2] + 1
    np.save(ds_root / "indptr.npy", indptr)
    msg = _open_error(ds_root, CorruptDatasetError)
    assert "indptr.npy" in msg and "not monotone" in msg and FIX in msg


def test_indptr_end_mismatch(ds_root):
    indptr = np.load(ds_root / "indptr.npy")
    indptr[-1] -= 1
    np.save(ds_root / "indptr.npy", indptr)
    msg = _open_error(ds_root, CorruptDatasetError)
    assert "indptr.npy" in msg and "num_edges" in msg


def test_row_bytes_mismatch(ds_root):
    _write_meta(ds_root, {**_meta(ds_root), "row_bytes": 3})
    msg = _open_error(ds_root, CorruptDatasetError)
    assert "row_bytes=3" in msg


def test_interrupted_commit_is_named(ds_root):
    (ds_root / "meta.json").rename(ds_root / "meta.json.pending")
    msg = _open_error(ds_root, CorruptDatasetError)
    assert "interrupted" in msg


def test_verify_passes_on_good_dataset(demo_dataset):
    report = verify(demo_dataset.root, progress=False)
    assert report.ok, report.format()
    assert any(c.name == "neighbour order" and c.ok for c in report.checks)


def test_verify_finds_flipped_feature_byte(ds_root):
    path = ds_root / "features.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    lightning_ooc.open_dataset(ds_root)  # the cheap checks cannot see it...
    report = verify(ds_root, progress=False)  # ...verify does
    assert not report.ok
    bad = [c for c in report.checks if not c.ok]
    assert [c.name for c in bad] == ["features.bin"] and "checksum" in bad[0].detail


def _rewrite_indices(root, fn):
    indices = np.load(root / "indices.npy")
    fn(indices)
    np.save(root / "indices.npy", indices)
    meta = _meta(root)
    from lightning_ooc.data.format import checksum_file

    meta["files"]["indices"]["checksum"] = checksum_file(root / "indices.npy")
    _write_meta(root, meta)


def test_verify_finds_out_of_range_index(ds_root):
    def poke(a):
        a[5] = 10**6

    _rewrite_indices(ds_root, poke)
    report = verify(ds_root, progress=False)
    bad = {c.name: c.detail for c in report.checks if not c.ok}
    assert "indices" in bad and "1 ids outside" in bad["indices"]


def test_verify_finds_unsorted_neighbours(ds_root):
    ds = lightning_ooc.open_dataset(ds_root)
    v = int(np.argmax(ds.in_degree >= 3))
    s = int(ds.indptr[v])

    def swap(a):
        a[s], a[s + 1] = a[s + 1], a[s]

    _rewrite_indices(ds_root, swap)
    report = verify(ds_root, progress=False)
    bad = {c.name: c.detail for c in report.checks if not c.ok}
    assert set(bad) == {"neighbour order"} and bad["neighbour order"].startswith("1 ")


def test_verify_reports_missing_file_without_raising(ds_root):
    (ds_root / "test.npy").unlink()
    report = verify(ds_root, progress=False)
    assert not report.ok
    assert any(c.name == "test.npy" and c.detail == "missing" for c in report.checks)


def test_synthetic_has_no_overlapping_splits(tmp_path):
    ds = make_synthetic(tmp_path / "g", num_nodes=5000, train_frac=0.3, val_frac=0.3, test_frac=0.3)
    report = verify(ds.root, progress=False)
    assert report.ok and not any(c.warning for c in report.checks)
