"""``prepare --dataset``: rewriting a dataset of this format, e.g. with link splits made from its edges."""
import numpy as np
import pytest
import torch

import lightning_ooc
from lightning_ooc import InputError
from lightning_ooc.cli import main
from lightning_ooc.data.prepare import DatasetEdgeSource, prepare_from_arrays, prepare_from_dataset
from lightning_ooc.data.synth import synthesize
from lightning_ooc.data.verify import verify


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("g") / "g", num_nodes=3000, avg_degree=6, num_features=8,
                      num_classes=4, seed=3, progress=False)  # fmt: skip


def _edges(ds) -> set[tuple[int, int]]:
    dst = np.repeat(np.arange(ds.num_nodes), np.diff(ds.indptr))
    return set(zip(np.asarray(ds.indices).tolist(), dst.tolist()))


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_plain_rewrite_keeps_every_byte_of_features_graph_labels_and_splits(graph, tmp_path, dtype):
    src = lightning_ooc.open_dataset(graph)
    if dtype:  # first to bfloat16, then that dataset rewritten: the bfloat16 rows come back unchanged
        src = lightning_ooc.open_dataset(prepare_from_dataset(tmp_path / "bf", graph, feature_dtype=dtype,
                                                              progress=False))  # fmt: skip
        assert src.feature_dtype == torch.bfloat16
    out = lightning_ooc.open_dataset(prepare_from_dataset(tmp_path / "copy", src.root, progress=False))
    assert out.feature_dtype_name == src.feature_dtype_name
    assert out.features_path.read_bytes() == src.features_path.read_bytes()
    assert np.array_equal(out.indptr, src.indptr) and np.array_equal(out.indices, src.indices)
    assert np.array_equal(out.labels, src.labels) and out.num_classes == src.num_classes
    for s in ("train", "val", "test"):
        assert torch.equal(out.split(s), src.split(s))
    assert out.meta["source"]["input"] == "dataset" and out.meta["source"]["dataset_identity"] == src.identity


def test_the_edge_source_yields_every_edge_once_whatever_the_chunk(graph):
    ds = lightning_ooc.open_dataset(graph)
    want = _edges(ds)
    for chunk in (1, 7, 1000, 1 << 22):
        pairs = [(s, d) for src, dst in DatasetEdgeSource(ds, chunk_edges=chunk).chunks()
                 for s, d in zip(src.tolist(), dst.tolist())]  # fmt: skip
        assert len(pairs) == ds.num_edges and set(pairs) == want


def test_split_edges_from_a_dataset_partitions_its_edges_without_leakage(graph, tmp_path, capsys):
    src = lightning_ooc.open_dataset(graph)
    assert main(["prepare", "--dataset", str(graph), "--out", str(tmp_path / "l"), "--split-edges", "0.8,0.1,0.1",
                 "--seed", "5", "--no-progress"]) == 0  # fmt: skip
    ds = lightning_ooc.open_dataset(tmp_path / "l")
    held = {s: set(map(tuple, ds.link_split(s).index.t().tolist())) for s in ("train", "val", "test")}
    assert abs(len(held["val"]) - 0.1 * src.num_edges) <= 1 and abs(len(held["test"]) - 0.1 * src.num_edges) <= 1
    # the train edges are the new graph; with val and test they are the old graph, each edge once
    assert _edges(ds) == held["train"]
    assert held["train"] | held["val"] | held["test"] == _edges(src)
    assert sum(len(v) for v in held.values()) == src.num_edges
    assert ds.link_splits["leakage_free"]
    assert verify(ds.root, progress=False).ok
    # features, labels and node splits are the source's
    assert ds.features_path.read_bytes() == src.features_path.read_bytes()
    assert torch.equal(ds.split("train"), src.split("train"))


def test_link_splits_and_their_fields_are_carried_over_unless_new_ones_are_asked_for(tmp_path):
    rng = np.random.default_rng(0)
    edges = rng.integers(0, 50, (2, 300))
    links = {"train": {"index": rng.integers(0, 50, (2, 40)), "label": rng.integers(0, 2, 40),
                       "weight": rng.random(40).astype(np.float32)},
             "val": {"index": rng.integers(0, 50, (2, 10)), "neg_dst": rng.integers(0, 50, (10, 3))}}  # fmt: skip
    root = prepare_from_arrays(tmp_path / "a", edges, rng.random((50, 4), dtype=np.float32), link_splits=links,
                               progress=False)  # fmt: skip
    a = lightning_ooc.open_dataset(root)
    b = lightning_ooc.open_dataset(prepare_from_dataset(tmp_path / "b", root, progress=False))
    assert sorted(b.link_splits["splits"]) == sorted(a.link_splits["splits"]) == ["train", "val"]
    for s, fields in (("train", ("index", "label", "weight")), ("val", ("index", "neg_dst"))):
        for f in fields:
            assert torch.equal(getattr(b.link_split(s), f), getattr(a.link_split(s), f)), (s, f)
    assert b.link_splits["message_passing"].startswith(a.link_splits["message_passing"])
    c = lightning_ooc.open_dataset(prepare_from_dataset(tmp_path / "c", root, split_edges=(0.8, 0.1, 0.1),
                                                        progress=False))  # fmt: skip
    assert c.link_split("val").num_edges == 30 and c.link_split("val").neg_dst is None


def test_bad_uses_are_refused_with_the_fix(graph, tmp_path, capsys):
    with pytest.raises(InputError, match="another directory"):
        prepare_from_dataset(graph, graph, overwrite=True, progress=False)
    with pytest.raises(SystemExit):
        main(["prepare", "--dataset", str(graph), "--out", str(tmp_path / "x"), "--x", "f.npy"])
    assert "--dataset brings its own features" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert lightning_ooc.open_dataset(graph).num_nodes == 3000  # untouched
