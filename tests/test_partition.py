"""Partitioned datasets: the partitioners, `lightning-ooc partition`, reading and verifying the parts."""
import doctest
import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch

import lightning_ooc
from lightning_ooc.cli import main
from lightning_ooc.data.synth import synthesize
from lightning_ooc.data.verify import verify
from lightning_ooc.partitioned import partition as part
from lightning_ooc.partitioned.partition import partition_dataset, partition_nodes
from lightning_ooc.errors import CorruptDatasetError, DatasetWriteError, InputError

N = 2000
METHODS = ["metis", "fennel", "ldg", "random", "range"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    # planted partition: 4 classes, 70% of the edges inside a class
    return synthesize(tmp_path_factory.mktemp("src") / "g", num_nodes=N, avg_degree=8, num_features=6, num_classes=4,
                      train_frac=0.2, val_frac=0.05, test_frac=0.05, seed=3, progress=False)


@pytest.fixture(scope="module")
def ds(root):
    return lightning_ooc.open_dataset(root)


@pytest.fixture(scope="module")
def outputs(root, tmp_path_factory):
    """Every method into 2 and 4 parts (written once for the module)."""
    base = tmp_path_factory.mktemp("parts")
    return {(m, p): partition_dataset(root, p, base / f"{m}-{p}", method=m, seed=1, progress=False)
            for m in METHODS for p in (2, 4)}


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("method", ["fennel", "ldg", "metis"])
def test_partitioners_cut_fewer_edges_than_random(ds, method, parts):
    rnd = partition_nodes(ds, parts, "random", seed=0, progress=False)
    r = partition_nodes(ds, parts, method, seed=0, progress=False)
    assert r.method == method
    assert r.owner.shape == (N,) and r.owner.dtype == np.int16
    assert r.owner.min() >= 0 and r.owner.max() < parts
    assert sum(r.part_nodes) == N and len(r.part_nodes) == parts
    assert r.edge_cut < 0.8 * rnd.edge_cut, (r.edge_cut, rnd.edge_cut)
    assert r.balance["nodes"] <= 1.1
    assert r.balance["train"] <= 1.1
    # the reported cut is the edges whose endpoints have different owners
    dst = np.repeat(np.arange(N), np.diff(ds.indptr))
    assert r.edge_cut == int((r.owner[np.asarray(ds.indices)] != r.owner[dst]).sum())


def test_random_and_range(ds):
    r = partition_nodes(ds, 3, "random", seed=5, progress=False)
    assert r.balance["nodes"] <= 1.001 + 1 / (N / 3) and r.balance["train"] < 1.02
    assert np.array_equal(r.owner, partition_nodes(ds, 3, "random", seed=5, progress=False).owner)
    rg = partition_nodes(ds, 3, "range", progress=False)
    assert np.all(np.diff(rg.owner) >= 0) and rg.part_nodes == [667, 667, 666]
    assert partition_nodes(ds, 1, "fennel", progress=False).edge_cut == 0


def test_bad_arguments(ds):
    with pytest.raises(InputError, match="unknown partition method"):
        partition_nodes(ds, 2, "kl", progress=False)
    with pytest.raises(InputError, match="--parts"):
        partition_nodes(ds, 0, "random", progress=False)
    with pytest.raises(InputError, match="more than"):
        partition_nodes(ds, N + 1, "random", progress=False)


def test_auto_falls_back_to_fennel_without_pymetis(ds, monkeypatch, caplog):
    def missing():
        raise ImportError("No module named 'pymetis'")

    monkeypatch.setattr(part, "_import_pymetis", missing)
    with caplog.at_level(logging.INFO, logger="lightning_ooc"):
        r = partition_nodes(ds, 2, "auto", progress=False)
    assert r.method == "fennel"
    assert any("METIS is not installed" in m and "pip install pymetis" in m for m in caplog.messages)
    with pytest.raises(InputError, match="pip install pymetis"):
        partition_nodes(ds, 2, "metis", progress=False)


def test_auto_uses_metis_when_installed(ds):
    pytest.importorskip("pymetis")
    assert partition_nodes(ds, 2, "auto", progress=False).method == "metis"


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_round_trip(ds, outputs, method, parts):
    out = outputs[(method, parts)]
    manifest = json.loads((out / "partition.json").read_text())
    assert manifest["format"] == "lightning-ooc-partition" and manifest["version"] == 1
    assert manifest["parts"] == parts and manifest["method"] == method and manifest["num_nodes"] == N
    assert manifest["source_identity"] == ds.identity
    assert manifest["dirs"] == [f"part-{k:05d}" for k in range(parts)]
    owner = np.load(out / "owner.npy")
    assert owner.dtype == np.int16 and owner.shape == (N,)
    assert manifest["part_nodes"] == np.bincount(owner, minlength=parts).tolist()
    dst = np.repeat(np.arange(N), np.diff(ds.indptr))
    cut = int((owner[np.asarray(ds.indices)] != owner[dst]).sum())
    assert manifest["edge_cut"] == cut and manifest["edge_cut_fraction"] == pytest.approx(cut / ds.num_edges)
    seen = np.zeros(N, dtype=np.int64)
    split_seen = {s: [] for s in ("train", "val", "test")}
    src_mm = ds.features_memmap()
    for k in range(parts):
        pdir = out / f"part-{k:05d}"
        p = lightning_ooc.open_dataset(pdir)
        assert verify(pdir, progress=False).ok, verify(pdir, progress=False).format()
        info = p.partition
        assert (info.index, info.parts, info.method) == (k, parts, method)
        assert info.source_identity == ds.identity
        nodes = np.asarray(info.nodes)
        assert nodes.dtype == np.int64 and np.all(np.diff(nodes) > 0)
        assert np.array_equal(nodes, np.flatnonzero(owner == k))
        assert np.array_equal(info.owner, owner)
        assert info.num_rows == nodes.size == p.num_rows and p.num_nodes == N
        seen[nodes] += 1
        # topology and labels whole, rows byte-identical
        assert np.array_equal(p.indptr, ds.indptr) and np.array_equal(p.indices, ds.indices)
        assert np.array_equal(p.labels, ds.labels)
        assert p.features_memmap().shape == (nodes.size, ds.num_features)
        assert np.asarray(p.features_memmap()).tobytes() == np.asarray(src_mm[nodes]).tobytes()
        assert torch.equal(p.read_features(nodes[::-1].copy()), ds.read_features(nodes[::-1].copy()))
        local = info.local(nodes[::3])
        assert np.array_equal(local, np.arange(nodes.size)[::3])
        assert torch.equal(p.rows.read_features(local), ds.read_features(nodes[::3]))
        for s in split_seen:
            ids = p.split(s).numpy()
            assert np.all(np.diff(ids) > 0) and np.all(owner[ids] == k)
            split_seen[s].append(ids)
    assert np.all(seen == 1)  # every node owned by exactly one part
    for s, lists in split_seen.items():
        assert np.array_equal(np.sort(np.concatenate(lists)), np.sort(ds.split(s).numpy()))


def test_rows_view_feeds_readers_and_tiered_store(ds, outputs):
    from lightning_ooc.io import FeatureReader
    from lightning_ooc.store.tiered import TieredFeatureStore

    p = lightning_ooc.open_dataset(outputs[("metis", 4)] / "part-00002")
    rows = p.rows
    nodes = np.asarray(p.partition.nodes)
    assert rows.num_nodes == nodes.size and rows.identity == p.identity + ":rows"
    assert np.array_equal(rows.in_degree, np.diff(ds.indptr)[nodes])
    local = torch.tensor([0, nodes.size - 1, 7, 3, 7])
    with FeatureReader.from_dataset(rows) as r:
        assert torch.equal(r.gather(local), ds.read_features(nodes[local.numpy()]))
    store = TieredFeatureStore.create(rows, buffer_slots=64, staging_bytes=4096, host_ids=torch.arange(5))
    try:
        for batch in (local, torch.arange(nodes.size - 40, nodes.size), torch.tensor([1, 2, 3, 4, 200])):
            ext = store.extract(batch)
            x = store.gather(ext)
            assert x.numpy().tobytes() == ds.read_features(nodes[batch.numpy()]).numpy().tobytes()
            store.release(ext)
    finally:
        store.close()


def test_plan_store_reads_what_rows_provides(ds, outputs):
    p = lightning_ooc.open_dataset(outputs[("fennel", 2)] / "part-00001")
    rows = p.rows
    for attr in ("num_nodes", "num_edges", "row_bytes", "num_features", "feature_dtype", "meta", "in_degree",
                 "features_path", "feature_numpy_dtype", "root"):
        assert getattr(rows, attr) is not None
    assert rows.meta.get("split_sizes") == p.meta["split_sizes"]
    # a plain dataset's rows are its own
    assert ds.partition is None and ds.rows.num_nodes == N and torch.equal(ds.rows.read_features([3]),
                                                                           ds.read_features([3]))


def test_read_features_of_a_node_not_owned(outputs):
    out = outputs[("range", 4)]
    p = lightning_ooc.open_dataset(out / "part-00001")
    assert p.partition.local([0, 499, 500, 999, 1000]).tolist() == [-1, -1, 0, 499, -1]
    with pytest.raises(InputError, match="node 3 is owned by part 0"):
        p.read_features([500, 3, 1200])
    with pytest.raises(InputError, match=f"outside \\[0, {N}\\)"):
        p.read_features([N + 5])


@pytest.mark.parametrize("name", ["nodes.npy", "features.bin", "owner.npy"])
def test_truncated_file_names_it(outputs, tmp_path, name):
    pdir = tmp_path / "p"
    shutil.copytree(outputs[("random", 2)] / "part-00000", pdir)
    size = (pdir / name).stat().st_size
    os.truncate(pdir / name, size - 8)
    with pytest.raises(CorruptDatasetError, match=name.replace(".", "\\.")):
        lightning_ooc.open_dataset(pdir)
    assert not verify(pdir, progress=False).ok


def test_verify_catches_foreign_rows(outputs, tmp_path):
    """A nodes.npy of the right size whose ids belong to another part (checksum aside) fails verify."""
    from lightning_ooc.data.verify import VerifyReport, _verify_partition

    pdir = tmp_path / "p"
    shutil.copytree(outputs[("range", 2)] / "part-00000", pdir)
    p = lightning_ooc.open_dataset(pdir)
    p.partition.nodes = np.asarray(p.partition.nodes) + N // 2  # the other part's rows
    report = VerifyReport(pdir)
    _verify_partition(p, report)
    assert not report.ok and "belong to other parts" in report.format()


def test_cli_partition_info_and_overwrite(root, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["partition", str(root), "--parts", "3", "--out", str(out), "--method", "fennel", "--seed", "2",
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "3 parts, method fennel" in text and "edge cut" in text and "balance" in text
    assert text.count("part-0000") == 3
    assert main(["info", str(out)]) == 0
    assert "edge cut" in capsys.readouterr().out
    assert main(["info", "--json", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parts"] == 3 and len(info["per_part"]) == 3 and info["per_part"][0]["bytes"] > 0
    assert main(["info", str(out / "part-00001")]) == 0
    assert "part 1 of 3 (fennel)" in capsys.readouterr().out
    # refused without --overwrite: one line, exit status 2, output untouched
    before = (out / "partition.json").read_text()
    assert main(["partition", str(root), "--parts", "2", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert (out / "partition.json").read_text() == before
    # --overwrite replaces our own output, and nothing is left beside it
    assert main(["partition", str(root), "--parts", "2", "--out", str(out), "--method", "range", "--overwrite",
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(out)) == ["owner.npy", "part-00000", "part-00001", "partition.json"]
    assert sorted(os.listdir(tmp_path)) == ["out"]
    # but not a directory of the user's
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(DatasetWriteError, match="not a lightning-ooc partition output"):
        partition_dataset(root, 2, mine, method="range", overwrite=True, progress=False)
    (out / "part-00000" / "notes.txt").write_text("keep")
    with pytest.raises(DatasetWriteError, match="notes.txt"):
        partition_dataset(root, 2, out, method="range", overwrite=True, progress=False)
    assert (mine / "notes.txt").read_text() == "keep" and (out / "part-00000" / "notes.txt").exists()


def test_interrupted_run_leaves_nothing(root, tmp_path, monkeypatch):
    calls = []

    def failing(w):
        calls.append(w)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(w)

    real = part._commit_part
    monkeypatch.setattr(part, "_commit_part", failing)
    with pytest.raises(KeyboardInterrupt):
        partition_dataset(root, 3, tmp_path / "out", method="range", progress=False)
    assert os.listdir(tmp_path) == []  # no output, no partial directory, no lock


def test_refuses_link_splits_and_partitions(tmp_path, outputs):
    from lightning_ooc.data.writer import ArrayEdgeSource, DatasetWriter

    with DatasetWriter(tmp_path / "l", num_nodes=4, num_features=2, num_classes=2) as w:
        w.write_edges(ArrayEdgeSource(np.array([[0, 1, 2], [1, 2, 3]])))
        w.write_features([np.zeros((4, 2), np.float32)])
        w.write_labels([np.array([0, 1, 0, 1])])
        for s in ("train", "val", "test"):
            w.write_split(s, np.array([], dtype=np.int64))
        w.write_link_split("val", np.array([[0, 3]]))
        w.commit()
    with pytest.raises(InputError, match="homogeneous node classification"):
        partition_dataset(tmp_path / "l", 2, tmp_path / "o", method="random", progress=False)
    with pytest.raises(InputError, match="partition the source"):
        partition_dataset(outputs[("range", 2)] / "part-00000", 2, tmp_path / "o", method="random", progress=False)
    assert not (tmp_path / "o").exists()


def test_refuses_heterogeneous(tmp_path):
    from lightning_ooc.data.synth_hetero import synthesize_hetero

    h = synthesize_hetero(tmp_path / "h", "mag", num_nodes=200, num_features=4, progress=False)
    with pytest.raises(InputError, match="heterogeneous.*homogeneous node classification"):
        partition_dataset(h, 2, tmp_path / "o", progress=False)


def test_opening_the_output_directory_points_at_its_parts(outputs):
    from lightning_ooc.errors import DatasetNotFoundError

    with pytest.raises(DatasetNotFoundError, match="part-NNNNN"):
        lightning_ooc.open_dataset(outputs[("range", 2)])


def test_docstring_examples():
    for mod in (part, lightning_ooc.data.dataset):
        result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0


def test_parts_keep_the_node_times(tmp_path):
    """A source with node times (an OGB import's years) lost them in every part: PyG's temporal sampling over a
    part then had no times. Each part holds them whole, by global id, as it holds the labels."""
    from lightning_ooc.data.prepare import prepare_from_arrays

    rng = np.random.default_rng(0)
    n = 600
    years = rng.integers(1990, 2024, n)
    src = prepare_from_arrays(tmp_path / "g", rng.integers(0, n, (2, 4000)), rng.random((n, 4), np.float32),
                              rng.integers(0, 3, n), split=(0.5, 0.2, 0.3), node_time=years, progress=False)  # fmt: skip
    out = partition_dataset(src, 2, tmp_path / "parts", method="random", seed=0, progress=False)
    for k in range(2):
        d = lightning_ooc.open_dataset(out / part.part_dir_name(k))
        assert d.node_time is not None and np.array_equal(np.asarray(d.node_time), years)
    assert verify(out / part.part_dir_name(0), progress=False, full=True).ok
