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


def _write_meta(root, meta, sign=True):
    """Write ``meta`` as a writer would (its own checksum recomputed), or as a hand edit would (``sign=False``)."""
    from lightning_ooc.data.format import meta_digest

    if sign:
        meta = {**meta, "meta_checksum": meta_digest(meta)}
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


# -- meta.json is protected and checked field by field ----------------------------------------------
def test_meta_edit_with_same_row_size_is_refused_by_open_and_verify(ds_root):
    meta = _meta(ds_root)
    assert meta["feature_dtype"] == "float32"
    # float16 x 2F has the row size of float32 x F: every size check still agrees
    _write_meta(ds_root, {**meta, "feature_dtype": "float16", "num_features": 2 * meta["num_features"]}, sign=False)
    msg = _open_error(ds_root, CorruptDatasetError)
    assert "meta.json: changed after it was written" in msg and FIX in msg
    report = verify(ds_root, progress=False)
    assert not report.ok and [c.name for c in report.checks if not c.ok] == ["meta.json"]
    assert "all checks passed" not in report.format()


def _as_version_1(meta):
    """``meta`` as a version 1 writer wrote it: no checksum of its own; synth recorded no feature_dtype."""
    meta = {k: v for k, v in meta.items() if k != "meta_checksum"}
    meta["source"] = {k: v for k, v in meta["source"].items() if k != "feature_dtype"}
    return {**meta, "version": 1}


def test_a_version_1_dataset_opens_and_verify_warns(ds_root, tmp_path, capsys):
    from lightning_ooc.cli import main
    from lightning_ooc.data.prepare import prepare_from_arrays

    rng = np.random.default_rng(0)
    prepared = prepare_from_arrays(tmp_path / "p", rng.integers(0, 50, (2, 200)), rng.random((50, 4), np.float32),
                                   rng.integers(0, 3, 50), progress=False)  # fmt: skip
    meta = _meta(prepared)
    meta["source"] = {k: meta["source"][k] for k in ("input", "edge_index", "add_reverse")}  # a v1 prepare's
    _write_meta(prepared, _as_version_1(meta), sign=False)
    _write_meta(ds_root, _as_version_1(_meta(ds_root)), sign=False)
    for root in (ds_root, prepared):
        assert lightning_ooc.open_dataset(root).meta["version"] == 1
        assert main(["info", str(root)]) == 0 and "lightning_ooc.graph v1" in capsys.readouterr().out
        report = verify(root, progress=False)
        assert report.ok and [c.name for c in report.checks if c.warning] == ["meta.json"]


@pytest.mark.parametrize(
    "edit, message",
    [  # the edit: float16 x 2F reads the bytes of float32 x F, so every size check agrees
        (lambda m: m.update(feature_dtype="float16", num_features=32), "num_features=32 but source.num_features=16"),
        (lambda m: m.update(feature_dtype="int8", num_features=64, row_bytes=64),
         "num_features=64 but source.num_features=16"),
        (lambda m: m.update(num_classes=9), "num_classes=9 but source.num_classes=4"),
        (lambda m: m.update(index_dtype="int64"), "index_dtype='int64' but num_nodes=3000 gives 'int32'"),
        (lambda m: m["split_sizes"].update(val=1), "split_sizes.val=1 but files.val.length="),
        (lambda m: m.update(meta_checksum="0" * 32), "version 1 but it holds its own checksum ('meta_checksum')"),
    ],
)
def test_a_version_1_meta_that_contradicts_itself_is_refused_by_open_info_and_verify(ds_root, capsys, edit,
                                                                                     message):
    """Downgrading meta.json to version 1 drops the checksum; what it records twice must still agree."""
    from lightning_ooc.cli import main

    meta = _as_version_1(_meta(ds_root))
    edit(meta)
    _write_meta(ds_root, meta, sign=False)
    msg = _open_error(ds_root, CorruptDatasetError)
    assert message in msg and "meta.json: contradicts itself" in msg and "version 1" in msg and FIX in msg
    assert main(["info", str(ds_root)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    report = verify(ds_root, progress=False)  # never raises
    assert not report.ok and [c.name for c in report.checks if not c.ok] == ["meta.json"]
    assert message in report.format()


def test_writers_record_what_they_wrote_in_source(tmp_path):
    """synth and prepare repeat the counts and dtype in source, so a version 1 edit of them is a contradiction."""
    from lightning_ooc.data.prepare import prepare_from_arrays

    ds = make_synthetic(tmp_path / "s", num_nodes=300, num_features=6, feature_dtype="float16")
    assert {k: ds.meta["source"][k] for k in ("num_nodes", "num_features", "num_classes", "feature_dtype")} == \
        {"num_nodes": 300, "num_features": 6, "num_classes": 4, "feature_dtype": "float16"}
    rng = np.random.default_rng(0)
    root = prepare_from_arrays(tmp_path / "p", rng.integers(0, 50, (2, 200)), rng.random((50, 4), np.float32),
                               feature_dtype="bfloat16", progress=False)  # fmt: skip
    src = lightning_ooc.open_dataset(root).meta["source"]
    assert (src["num_nodes"], src["num_features"], src["num_classes"], src["feature_dtype"]) == (50, 4, 0, "bfloat16")


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/hostname", "sub/features.bin", "..", ""])
def test_file_names_outside_the_directory_are_refused(ds_root, name):
    (ds_root.parent / "outside.bin").write_bytes((ds_root / "features.bin").read_bytes())
    meta = _meta(ds_root)
    meta["files"]["features"]["name"] = name
    _write_meta(ds_root, meta)  # signed: the name itself must be refused, not only the edit
    msg = _open_error(ds_root, CorruptDatasetError)
    assert "'features' file's name must be a plain file name inside the dataset directory" in msg
    report = verify(ds_root, progress=False)
    assert not report.ok and "all checks passed" not in report.format()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(num_nodes="abc"), "num_nodes must be an integer >= 0, got 'abc'"),
        (lambda m: m.update(num_edges=-1), "num_edges must be an integer >= 0, got -1"),
        (lambda m: m.update(row_bytes=256.5), "row_bytes must be an integer >= 1, got 256.5"),
        (lambda m: m.update(files=[1, 2]), "'files' must map each file's key to its entry, got list"),
        (lambda m: m["files"]["indices"].pop("bytes"), "the 'indices' file's 'bytes' must be an integer >= 0, got None"),
        (lambda m: m["files"].update(labels=None), "no entry for the 'labels' file"),
        (lambda m: m["files"].update(labels=[3]), "the 'labels' file's entry must be an object"),
        (lambda m: m["files"]["train"].update(length="7"), "the 'train' file's 'length' must be an integer >= 0"),
        (lambda m: m.update(split_sizes=[1]), "split_sizes must map split names to counts"),
        # info allocated a histogram that wide ("Maximum allowed dimension exceeded", or terabytes), as did a model
        (lambda m: (m.update(num_classes=10**30), m["source"].update(num_classes=10**30)),
         f"num_classes={10**30} is absurd for 3000 nodes: it may be at most the node count or 65536"),
        (lambda m: (m.update(num_classes=10**12), m["source"].update(num_classes=10**12)),
         f"num_classes={10**12} is absurd for 3000 nodes"),
    ],
)
def test_wrong_field_types_are_one_error_in_open_info_and_verify(ds_root, capsys, edit, message):
    from lightning_ooc.cli import main

    meta = _meta(ds_root)
    edit(meta)
    _write_meta(ds_root, meta)
    msg = _open_error(ds_root, CorruptDatasetError)
    assert message in msg and "meta.json" in msg
    assert main(["info", str(ds_root)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    report = verify(ds_root, progress=False)  # never raises
    assert not report.ok and message in report.format()


def test_features_that_are_a_directory_or_a_link_are_named_as_such(ds_root, tmp_path):
    features = ds_root / "features.bin"
    features.unlink()
    features.mkdir()
    assert "features.bin: a directory" in _open_error(ds_root, CorruptDatasetError)
    features.rmdir()
    features.symlink_to("/dev/zero")
    msg = _open_error(ds_root, CorruptDatasetError)
    assert "features.bin: a symbolic link (to /dev/zero)" in msg and "missing" not in msg
    report = verify(ds_root, progress=False)  # returns (does not read /dev/zero forever)
    assert [c.detail for c in report.checks if c.name == "features.bin"] == [
        "not a regular file of the dataset (a link, a directory or a device)"]


def test_info_with_labels_out_of_range_reports_them(ds_root, capsys):
    from lightning_ooc.cli import main

    labels = np.load(ds_root / "labels.npy")
    labels[3] = 3 * 10**11  # a bincount over it would allocate terabytes
    np.save(ds_root / "labels.npy", labels)
    assert main(["info", str(ds_root)]) == 0
    out = capsys.readouterr().out
    assert "1 outside [-1, " in out and "lightning-ooc verify" in out


def test_an_index_out_of_range_names_the_file_when_sampled(ds_root):
    import torch

    from lightning_ooc.sampling import NeighborSampler

    def poke(a):
        a[5] = 10**6

    _rewrite_indices(ds_root, poke)
    ds = lightning_ooc.open_dataset(ds_root)
    target = int(np.searchsorted(ds.indptr, 5, side="right") - 1)
    with pytest.raises(CorruptDatasetError, match=r"indices\.npy: indices\[5\] = 1000000 is not a node id") as e:
        NeighborSampler(ds, [-1]).sample(torch.tensor([target]), seed=0)
    assert "lightning-ooc verify" in str(e.value)


# -- labels a node-classification run needs ----------------------------------------------------------
def test_prepare_refuses_unlabelled_nodes_in_a_given_split(tmp_path):
    from lightning_ooc.data.prepare import prepare_from_arrays

    y = np.array([0, 1, -1, 1, 0, 1])
    with pytest.raises(lightning_ooc.InputError, match=r"the train split holds 1 node\(s\) without a label .* node 2"):
        prepare_from_arrays(tmp_path / "g", np.array([[0, 1, 2], [1, 2, 3]]), np.ones((6, 2), np.float32), y,
                            train=np.array([0, 2, 3]), progress=False)  # fmt: skip
    assert not (tmp_path / "g").exists()


def test_unlabelled_split_nodes_fail_verify_and_setup(ds_root):
    from lightning_ooc import OutOfCoreNodeData, Tiered
    from lightning_ooc.data.format import checksum_file

    train = np.load(ds_root / "train.npy")
    labels = np.load(ds_root / "labels.npy")
    labels[train[3]] = -1
    np.save(ds_root / "labels.npy", labels)
    meta = _meta(ds_root)
    meta["files"]["labels"]["checksum"] = checksum_file(ds_root / "labels.npy")
    _write_meta(ds_root, meta)
    report = verify(ds_root, progress=False)
    bad = {c.name: c.detail for c in report.checks if not c.ok}
    assert bad == {"split train": f"1 nodes without a label in [0, {meta['num_classes']})"}
    dm = OutOfCoreNodeData(ds_root, batch_size=64, num_neighbors=[3], progress=False,
                           features=Tiered(gpu_cache="1MiB", host_cache=0, staging="256KiB"))  # fmt: skip
    with pytest.raises(lightning_ooc.InputError, match=rf"the train split holds 1 node\(s\) without a label .* "
                                                       rf"node {train[3]} \(label -1\)"):  # fmt: skip
        dm.setup()


def test_a_dataset_without_labels_is_refused_for_node_classification(tmp_path):
    from lightning_ooc import OutOfCoreNodeData, Tiered
    from lightning_ooc.data.prepare import prepare_from_arrays

    prepare_from_arrays(tmp_path / "g", np.array([[0, 1, 2], [1, 2, 3]]), np.ones((6, 2), np.float32), progress=False)
    dm = OutOfCoreNodeData(tmp_path / "g", batch_size=4, num_neighbors=[2], progress=False,
                           features=Tiered(gpu_cache="64KiB", host_cache=0, staging="64KiB"))  # fmt: skip
    with pytest.raises(lightning_ooc.InputError, match="has 0 class.* needs labels of at least two classes"):
        dm.setup()


def test_a_dataset_replaced_after_setup_is_an_error_at_the_next_setup(tmp_path):
    from lightning_ooc import DatasetChangedError, OutOfCoreNodeData, Tiered

    root = make_synthetic(tmp_path / "g", num_nodes=600, avg_degree=4, num_features=4, seed=0).root
    dm = OutOfCoreNodeData(root, batch_size=50, num_neighbors=[3], progress=False,
                           features=Tiered(gpu_cache="256KiB", host_cache=0, staging="64KiB"))  # fmt: skip
    dm.setup("fit")
    first = dm.dataset.identity
    dm.teardown("fit")
    make_synthetic(root, num_nodes=600, avg_degree=4, num_features=4, seed=0, overwrite=True)  # the same bytes
    dm.setup("test")  # a byte-identical rebuild is the same dataset
    assert dm.dataset.identity == first
    dm.teardown("test")
    make_synthetic(root, num_nodes=600, avg_degree=4, num_features=4, seed=1, overwrite=True)  # another graph
    with pytest.raises(DatasetChangedError, match="replaced since this datamodule first opened it"):
        dm.setup("test")
