"""Heterogeneous datasets: the format, `synth --hetero`, `prepare --pyg` of a HeteroData, `info`, `verify`,
and the errors of bad schemas."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch_geometric.data import HeteroData

import lightning_ooc
from lightning_ooc.data.format import meta_digest
from lightning_ooc.data.hetero_dataset import HeteroDatasetWriter, HeteroOnDiskDataset, relation_key
from lightning_ooc.data.prepare import prepare_from_pyg
from lightning_ooc.data.prepare_hetero import prepare_from_hetero
from lightning_ooc.data.dataset_summary import format_summary, summarize
from lightning_ooc.data.synth_hetero import SCHEMAS, hetero_node_counts, synthesize_hetero
from lightning_ooc.data.verify import verify
from lightning_ooc.data.writer import ArrayEdgeSource
from lightning_ooc.errors import CorruptDatasetError, InputError


def _edges(csc) -> set[tuple[int, int]]:
    """A relation's edges as (source id, destination id) pairs."""
    dst = np.repeat(np.arange(csc.num_nodes), np.diff(csc.indptr))
    return set(zip(np.asarray(csc.indices).tolist(), dst.tolist()))


@pytest.fixture(scope="module")
def igbh(tmp_path_factory):
    return synthesize_hetero(tmp_path_factory.mktemp("h") / "igbh", "igbh", num_nodes=4000, num_features=8,
                             seed=1, progress=False)  # fmt: skip


def test_igbh_schema_and_relations(igbh):
    ds = lightning_ooc.open_dataset(igbh)
    assert isinstance(ds, HeteroOnDiskDataset) and ds.is_hetero and ds.meta["version"] == 3
    spec = SCHEMAS["igbh"]
    assert ds.node_types == [t.name for t in spec.node_types]
    assert ds.num_nodes_dict == hetero_node_counts(spec, 4000)
    assert len(ds.edge_types) == 11 and ds.target == "paper"
    assert ds.metadata() == (ds.node_types, ds.edge_types)
    for t in ds.node_types:
        node = ds.node(t)
        assert node.num_features == 8 and node.features_path.stat().st_size == node.num_nodes * 32
        assert node.read_features([0, node.num_nodes - 1]).shape == (2, 8)
    # every reverse relation holds exactly the reversed edges of its relation; cites is symmetric
    for r in spec.relations:
        fwd = _edges(ds.relation((r.src, r.rel, r.dst)))
        assert fwd, r
        if r.reverse:
            assert _edges(ds.relation((r.dst, r.reverse, r.src))) == {(d, s) for s, d in fwd}
        if r.symmetric:
            assert fwd == {(d, s) for s, d in fwd} and all(s != d for s, d in fwd)
    # ids of each relation are of its source type
    for et, csc in ds.csc.items():
        assert csc.indptr.size == ds.num_nodes_dict[et[2]] + 1
        assert int(np.asarray(csc.indices).max()) < ds.num_nodes_dict[et[0]]
    paper = ds.node("paper")
    y = np.asarray(paper.labels)
    assert paper.num_classes == 19 and y.min() >= 0 and len(np.unique(y)) == 19
    assert ds.split("train").numel() > 0 and not (set(ds.split("train").tolist()) & set(ds.split("test").tolist()))


def test_planted_classes_are_homophilous_across_types(igbh):
    """A paper's authors' features point to the paper's class: what a relational GNN learns from."""
    ds = lightning_ooc.open_dataset(igbh)
    rel = ds.relation(("author", "rev_written_by", "paper"))
    y = np.asarray(ds.node("paper").labels)
    authors = ds.node("author").read_features(np.arange(ds.num_nodes_dict["author"])).numpy()
    deg = np.diff(rel.indptr)
    v = np.flatnonzero(deg > 0)
    mean_author = np.stack([authors[rel.indices[rel.indptr[i]:rel.indptr[i + 1]]].mean(0) for i in v])
    # authors have centres of their own type: the mean author of a class-k paper clusters by k
    centres = np.stack([mean_author[y[v] == k].mean(0) for k in range(19)])
    guess = np.argmax(mean_author @ centres.T - 0.5 * (centres ** 2).sum(1), axis=1)
    assert (guess == y[v]).mean() > 0.3  # 19 classes: chance is ~0.05


def test_synth_is_deterministic_and_verifies(tmp_path, igbh):
    again = synthesize_hetero(tmp_path / "again", "igbh", num_nodes=4000, num_features=8, seed=1, progress=False)
    a, b = json.loads((igbh / "meta.json").read_text()), json.loads((again / "meta.json").read_text())
    assert a["meta_checksum"] == b["meta_checksum"]  # covers every file's checksum
    other = synthesize_hetero(tmp_path / "other", "igbh", num_nodes=4000, num_features=8, seed=2, progress=False)
    assert json.loads((other / "meta.json").read_text())["meta_checksum"] != a["meta_checksum"]
    report = verify(igbh, progress=False)
    assert report.ok, report.format()
    names = {c.name for c in report.checks}
    assert "author__rev_written_by__paper indices" in names and "paper split train" in names


def test_mag_schema(tmp_path):
    root = synthesize_hetero(tmp_path / "mag", "mag", num_nodes=3000, num_features=4, seed=0, progress=False)
    ds = lightning_ooc.open_dataset(root)
    assert ds.node_types == ["paper", "author", "institution"]
    assert not ds.node("author").has_features and ds.node("author").features_path is None
    with pytest.raises(KeyError, match="no features"):
        ds.node("author").read_features([0])
    paper = ds.node("paper")
    assert paper.feature_dtype == torch.float16 and paper.num_classes == 153
    y = np.asarray(paper.labels)
    in_splits = np.concatenate([paper.split(s).numpy() for s in ("train", "val", "test")])
    assert (y[in_splits] >= 0).all() and (y >= 0).sum() == in_splits.size  # labels only on the splits' papers
    assert not (root / "author.features.bin").exists()
    assert verify(root, progress=False).ok


def test_info_covers_every_type(igbh):
    ds = lightning_ooc.open_dataset(igbh)
    info = summarize(ds)
    assert info["hetero"] and set(info["node_types"]) == set(ds.node_types) and len(info["relations"]) == 11
    assert info["relations"]["paper__cites__paper"]["num_edges"] == ds.num_edges_dict[("paper", "cites", "paper")]
    text = format_summary(info)
    for t in ds.node_types:
        assert f"  {t} " in text
    for et in ds.edge_types:
        assert relation_key(et) in text


def test_cli_synth_info_verify(tmp_path):
    out = tmp_path / "m"
    cli = [sys.executable, "-m", "lightning_ooc"]
    run = lambda *a: subprocess.run([*cli, *a], capture_output=True, text=True, timeout=300)  # noqa: E731
    r = run("synth", "--hetero", "mag", "--nodes", "2000", "--dim", "4", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    r = run("info", str(out))
    assert r.returncode == 0 and "heterogeneous: 3 node types, 5 relations" in r.stdout, r.stdout + r.stderr
    r = run("verify", str(out), "--no-progress")
    assert r.returncode == 0 and "all checks passed" in r.stdout
    r = run("synth", "--hetero", "mag", "--nodes", "2000", "--avg-degree", "3", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "--degree-scale" in r.stderr


def _random_hetero(seed: int = 0) -> HeteroData:
    g = torch.Generator().manual_seed(seed)
    data = HeteroData()
    data["paper"].x = torch.randn(50, 6, generator=g)
    data["paper"].y = torch.randint(0, 4, (50,), generator=g)
    data["paper"].train_mask = torch.arange(50) < 30
    data["author"].x = torch.randn(40, 3, generator=g, dtype=torch.float64)
    data["field"].num_nodes = 7
    data["paper", "cites", "paper"].edge_index = torch.randint(0, 50, (2, 200), generator=g)
    data["author", "writes", "paper"].edge_index = torch.stack(
        [torch.randint(0, 40, (120,), generator=g), torch.randint(0, 50, (120,), generator=g)])
    data["paper", "about", "field"].edge_index = torch.stack(
        [torch.randint(0, 50, (60,), generator=g), torch.randint(0, 7, (60,), generator=g)])
    return data


def test_prepare_hetero_round_trip(tmp_path):
    data = _random_hetero()
    path = tmp_path / "h.pt"
    torch.save(data, path)
    root = prepare_from_pyg(tmp_path / "h", path, progress=False)  # a HeteroData file goes the hetero way
    ds = lightning_ooc.open_dataset(root)
    assert ds.node_types == ["paper", "author", "field"] and ds.edge_types == data.edge_types
    assert ds.target == "paper" and not ds.node("field").has_features
    assert torch.equal(ds.node("paper").read_features(np.arange(50)), data["paper"].x)
    author = ds.node("author")
    assert author.feature_dtype == torch.float32  # float64 is stored as float32
    assert torch.allclose(author.read_features(np.arange(40)), data["author"].x.float())
    for et in data.edge_types:
        ei = data[et].edge_index
        assert _edges(ds.relation(et)) == set(zip(ei[0].tolist(), ei[1].tolist()))
    assert ds.split("train").tolist() == list(range(30)) and ds.split("val").numel() == 0
    assert np.array_equal(np.asarray(ds.node("paper").labels), data["paper"].y.numpy())
    assert verify(root, progress=False).ok


def test_prepare_hetero_add_reverse(tmp_path):
    data = _random_hetero(1)
    root = prepare_from_hetero(tmp_path / "h", data, add_reverse=True, drop_duplicates=True, progress=False)
    ds = lightning_ooc.open_dataset(root)
    assert ("paper", "rev_writes", "author") in ds.edge_types and ("field", "rev_about", "paper") in ds.edge_types
    ei = data["author", "writes", "paper"].edge_index
    assert _edges(ds.relation("paper__rev_writes__author")) == set(zip(ei[1].tolist(), ei[0].tolist()))
    cites = _edges(ds.relation(("paper", "cites", "paper")))
    assert cites == {(d, s) for s, d in cites}  # a relation within one type gets its reverse edges
    # a split given where every labelled type gives its own masks would not be used: an error
    with pytest.raises(InputError, match=r"--split \(split=\) draws random node splits, but every labelled node "
                                         r"type gives its own"):  # fmt: skip
        prepare_from_hetero(tmp_path / "s", data, split=(0.5, 0.2, 0.2), progress=False)
    with pytest.raises(InputError, match=r"--split \(split=\) takes three finite fractions"):
        prepare_from_hetero(tmp_path / "s", data, split=(0.9, 0.9, 0.9), progress=False)
    assert not (tmp_path / "s").exists()
    # splits drawn at random among the labelled papers when no mask is given
    del data["paper"].train_mask
    root = prepare_from_hetero(tmp_path / "r", data, split=(0.5, 0.2, 0.2), progress=False)
    sizes = {s: lightning_ooc.open_dataset(root).split(s).numel() for s in ("train", "val", "test")}
    assert sizes == {"train": 25, "val": 10, "test": 10}


def test_prepare_pyg_add_reverse_merges_or_separates_a_relation_within_one_type(tmp_path, capsys):
    """Issue 34: ``prepare --pyg --add-reverse`` merged the reverse citations into ``cites`` (``ToUndirected()``)
    where PyG's heterogeneous examples keep them apart (``ToUndirected(merge=False)``: ``rev_cites``); both now."""
    from torch_geometric.transforms import ToUndirected

    from lightning_ooc.cli import main

    data = _random_hetero(2)
    path = tmp_path / "h.pt"
    torch.save(data, path)
    run = lambda out, *a: main(["prepare", "--pyg", str(path), "--out", str(tmp_path / out), "--no-progress", *a])  # noqa: E731
    assert run("m", "--add-reverse") == 0 and run("s", "--add-reverse", "separate") == 0
    for out, merge in (("m", True), ("s", False)):
        ds, want = lightning_ooc.open_dataset(tmp_path / out), ToUndirected(merge=merge)(data.clone())
        assert sorted(ds.edge_types) == sorted(want.edge_types), out
        for et in want.edge_types:  # the same edges as PyG's transform (its merge also drops duplicates)
            ei = want[et].edge_index
            assert _edges(ds.relation(et)) == set(zip(ei[0].tolist(), ei[1].tolist())), (out, et)
        assert ds.meta["source"]["add_reverse"] == ("merge" if merge else "separate")
    cites = data["paper", "cites", "paper"].edge_index
    assert _edges(lightning_ooc.open_dataset(tmp_path / "s").relation(("paper", "cites", "paper"))) == set(
        zip(cites[0].tolist(), cites[1].tolist()))  # kept as given beside rev_cites
    # separate has no meaning for a homogeneous graph: one line, status 2, nothing written
    np.save(tmp_path / "x.npy", np.ones((5, 2), np.float32))
    np.save(tmp_path / "ei.npy", np.array([[0, 1], [1, 2]]))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--out", str(tmp_path / "g"), "--edge-index", str(tmp_path / "ei.npy"), "--x",
              str(tmp_path / "x.npy"), "--add-reverse", "separate", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err.splitlines()[-1]
    assert e.value.code == 2 and "--add-reverse separate" in err and "HeteroData given with --pyg" in err
    with pytest.raises(InputError, match="add_reverse='separate'.*a homogeneous graph"):
        prepare_from_pyg(tmp_path / "g", _homogeneous_data(tmp_path), add_reverse="separate", progress=False)
    with pytest.raises(InputError, match="add_reverse must be False, True \\(merge\\), 'merge' or 'separate'"):
        prepare_from_hetero(tmp_path / "g", data, add_reverse="both", progress=False)
    assert not (tmp_path / "g").exists()


def _homogeneous_data(tmp_path):
    from torch_geometric.data import Data

    return Data(x=torch.ones(5, 2), edge_index=torch.tensor([[0, 1], [1, 2]]))


def test_prepare_hetero_errors(tmp_path):
    data = _random_hetero()
    data["author", "writes", "paper"].edge_index[0, 5] = 40  # one past the last author
    with pytest.raises(InputError, match=r"source ids must lie in \[0, 40\)"):
        prepare_from_hetero(tmp_path / "a", data, progress=False)
    assert not (tmp_path / "a").exists()
    data = _random_hetero()
    data["venue"].y = torch.zeros(3, dtype=torch.long)
    with pytest.raises(InputError, match=r"neither x nor num_nodes; set data\['venue'\].num_nodes"):
        prepare_from_hetero(tmp_path / "b", data, progress=False)
    data["venue"].num_nodes = 3
    with pytest.raises(InputError, match="target"):
        prepare_from_hetero(tmp_path / "b", data, target="field", progress=False)
    with pytest.raises(InputError, match="link splits of heterogeneous graphs"):
        prepare_from_pyg(tmp_path / "c", _random_hetero(), split_edges=(0.8, 0.1, 0.1), progress=False)


def test_writer_schema_errors(tmp_path):
    types = {"paper": dict(num_nodes=3, num_features=2, num_classes=2), "author": dict(num_nodes=2)}
    with pytest.raises(InputError, match="'papr', which is not one of the node types"):
        HeteroDatasetWriter(tmp_path / "a", node_types=types, edge_types=[("author", "writes", "papr")])
    with pytest.raises(InputError, match="node type name"):
        HeteroDatasetWriter(tmp_path / "b", node_types={"pa__per": dict(num_nodes=3)}, edge_types=[])
    with pytest.raises(InputError, match="listed twice"):
        HeteroDatasetWriter(tmp_path / "c", node_types=types,
                            edge_types=[("author", "w", "paper"), ("author", "w", "paper")])  # fmt: skip
    with HeteroDatasetWriter(tmp_path / "d", node_types=types, edge_types=[("author", "w", "paper")]) as w:
        w.relation(("author", "w", "paper")).write_edges(ArrayEdgeSource(np.array([[0], [2]])))
        with pytest.raises(Exception, match="nothing was written for"):
            w.commit()  # paper's features, labels and splits are missing
    assert not (tmp_path / "d").exists()


def _resign(root, edit) -> None:
    """Edit meta.json and record its new checksum, as a writer with a bug (not a stray edit) would."""
    meta = json.loads((root / "meta.json").read_text())
    edit(meta)
    meta["meta_checksum"] = meta_digest(meta)
    (root / "meta.json").write_text(json.dumps(meta))


@pytest.fixture
def small(tmp_path):
    return synthesize_hetero(tmp_path / "s", "mag", num_nodes=500, num_features=4, seed=0, progress=False)


def test_relation_naming_unknown_type(small):
    _resign(small, lambda m: m["edge_types"][0].update(src="writer"))
    with pytest.raises(CorruptDatasetError, match="names the source node type 'writer', which is not one of"):
        lightning_ooc.open_dataset(small)
    assert not verify(small, progress=False).ok


def test_feature_file_of_wrong_size_for_its_type(small):
    f = small / "paper.features.bin"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 8)  # two float16 rows' worth short of 500 x 4
    with pytest.raises(CorruptDatasetError, match="truncated"):
        lightning_ooc.open_dataset(small)
    _resign(small, lambda m: m["files"]["paper.features"].update(bytes=size - 8))  # a wrong size, recorded
    with pytest.raises(CorruptDatasetError, match=r"paper.features.bin: 3992 bytes but 500 rows x 8 bytes = 4000"):
        lightning_ooc.open_dataset(small)


def test_other_schema_errors(small):
    meta = json.loads((small / "meta.json").read_text())
    cases = [
        (lambda m: m["node_types"]["paper"].update(row_bytes=7), "row_bytes=7 but 4 x float16 = 8"),
        (lambda m: m["node_types"]["author"].update(feature_dtype="complex"), "unknown feature dtype"),
        (lambda m: m.update(target="author"), "not a node type with labels"),
        (lambda m: m["edge_types"].append(dict(m["edge_types"][0])), "listed twice"),
        (lambda m: m.update(version=2), "node types in a format version 2 dataset"),
        (lambda m: m["files"].pop("author__writes__paper.indices"), "no entry for the 'author__writes__paper.indices'"),
        (lambda m: m["node_types"]["paper"].update(num_classes=10**30),
         f"node type 'paper': num_classes={10**30} is absurd for 500 nodes"),  # info: "Maximum dimension exceeded"
    ]
    for edit, message in cases:
        (small / "meta.json").write_text(json.dumps(meta))
        _resign(small, edit)
        with pytest.raises(CorruptDatasetError, match=message):
            lightning_ooc.open_dataset(small)


def test_corrupt_relation_found_by_verify(small):
    path = small / "author__writes__paper.indices.npy"
    raw = bytearray(path.read_bytes())
    raw[-4:] = np.array([10**6], dtype="<i4").tobytes()  # a source id far past the authors
    path.write_bytes(bytes(raw))
    report = verify(small, progress=False)
    assert not report.ok
    bad = {c.name for c in report.checks if not c.ok}
    assert bad == {"author__writes__paper.indices.npy", "author__writes__paper indices"}, report.format()


def test_a_relation_index_out_of_range_names_its_file_when_sampled(small):
    """R-GAT's set-up presamples: a source id past its type's nodes was a ValueError from the native sampler."""
    import torch

    from lightning_ooc.sampling import HeteroNeighborSampler

    path = small / "author__writes__paper.indices.npy"
    raw = bytearray(path.read_bytes())
    raw[-4:] = np.array([10**6], dtype="<i4").tobytes()
    path.write_bytes(bytes(raw))
    ds = lightning_ooc.open_dataset(small)
    with pytest.raises(CorruptDatasetError) as e:
        HeteroNeighborSampler(ds, [-1]).sample(torch.arange(500), "paper", seed=0)
    msg = str(e.value)
    assert msg.startswith(f"{path}: relation author__writes__paper: indices[") and "= 1000000 is not a node id" in msg
    assert f"lightning-ooc verify {small}" in msg


def test_homogeneous_datasets_unchanged(tmp_path):
    from lightning_ooc.data.synth import synthesize

    root = synthesize(tmp_path / "g", num_nodes=500, avg_degree=4, num_features=4, num_classes=3, progress=False)
    ds = lightning_ooc.open_dataset(root)
    assert not ds.is_hetero and ds.meta["version"] == 2  # still written as version 2 for older readers
