"""Link-prediction edge splits beside the graph: prepare (arrays, PyG, CSV, --split-edges), open, info, verify."""
import json

import numpy as np
import pytest
import torch

import lightning_ooc
from lightning_ooc import CorruptDatasetError, InputError
from lightning_ooc.cli import main
from lightning_ooc.data.link_splits import LINK_FILE_NAMES, EdgeSplit
from lightning_ooc.data.prepare import prepare_from_arrays, prepare_from_edge_list, prepare_from_pyg
from lightning_ooc.data.verify import verify
from lightning_ooc.data.writer import ArrayEdgeSource, DatasetWriter
from lightning_ooc.testing import reference_csc

N = 80


def _unique_edges(seed=0, n=N, e=600, upward=False):
    """``e`` distinct directed edges without self-loops (``upward``: each from a smaller id), as a (2, e) array."""
    rng = np.random.default_rng(seed)
    keys = rng.choice(n * n, size=3 * e, replace=False)
    src, dst = np.divmod(keys, n)
    keep = src < dst if upward else src != dst
    return np.stack([src[keep][:e], dst[keep][:e]]).astype(np.int64)


def _x(n=N, seed=0):
    return np.random.default_rng(seed).random((n, 4), dtype=np.float32)


def _meta(root):
    return json.loads((root / "meta.json").read_text())


def _edge_set(index):
    """The edges of a (2, M) array or tensor as a sorted list of (src, dst) tuples (repeats kept)."""
    return sorted(zip(*np.asarray(index).tolist()))


def _csc_edges(ds):
    """The stored graph's edges as a set of (src, dst)."""
    dst = np.repeat(np.arange(ds.num_nodes), np.diff(ds.indptr))
    return set(zip(np.asarray(ds.indices).tolist(), dst.tolist()))


def _problems(report):
    return {c.name: c.detail for c in report.checks if not c.ok}


# -- round trips -----------------------------------------------------------------------------------------
def test_link_splits_from_arrays_round_trip_bit_exact(tmp_path):
    ei = _unique_edges()
    rng = np.random.default_rng(1)
    train = ei[:, :50]  # (2, M) as PyG gives it
    val = rng.integers(0, N, (7, 2))  # (M, 2)
    test = rng.integers(0, N, (2, 9))
    fields = {
        "train": {"label": rng.integers(0, 2, 50).astype(np.float64), "weight": rng.random(50, dtype=np.float32),
                  "time": rng.integers(0, 10**12, 50)},
        "val": {"label": rng.integers(0, 2, 7), "neg_dst": rng.integers(0, N, (7, 5))},
        "test": {"neg_dst": torch.from_numpy(rng.integers(0, N, (9, 3)))},
    }  # fmt: skip
    np.save(tmp_path / "test_index.npy", test)
    links = {"train": {"index": torch.from_numpy(train), **fields["train"]},
             "val": {"index": val, **fields["val"]},
             "test": {"index": tmp_path / "test_index.npy", **fields["test"]}}  # fmt: skip
    prepare_from_arrays(tmp_path / "g", ei, _x(), link_splits=links, progress=False)
    ds = lightning_ooc.open_dataset(tmp_path / "g")
    assert ds.has_link_splits
    want_index = {"train": train, "val": val.T, "test": test}
    for s in ("train", "val", "test"):
        ls = ds.link_split(s)
        assert ls.index.dtype == torch.int64 and ls.index.shape == (2, want_index[s].shape[1])
        np.testing.assert_array_equal(ls.index.numpy(), want_index[s])
    tr, va, te = (ds.link_split(s) for s in ("train", "val", "test"))
    assert tr.label.dtype == torch.float32 and tr.label.numpy().tobytes() == fields["train"]["label"].astype(
        np.float32).tobytes()  # fmt: skip
    assert tr.weight.numpy().tobytes() == fields["train"]["weight"].tobytes()
    assert tr.time.dtype == torch.int64 and tr.time.tolist() == fields["train"]["time"].tolist()
    assert tr.neg_dst is None and te.label is None and te.weight is None
    assert va.label.dtype == torch.int64 and va.label.tolist() == fields["val"]["label"].tolist()
    np.testing.assert_array_equal(va.neg_dst.numpy(), fields["val"]["neg_dst"])
    np.testing.assert_array_equal(te.neg_dst.numpy(), fields["test"]["neg_dst"].numpy())
    meta = _meta(tmp_path / "g")
    assert meta["version"] == 2
    assert meta["link_splits"]["splits"] == {
        "train": {"edges": 50, "fields": ["label", "weight", "time"]},
        "val": {"edges": 7, "fields": ["label", "neg_dst"], "neg_per_edge": 5},
        "test": {"edges": 9, "fields": ["neg_dst"], "neg_per_edge": 3},
    }
    assert meta["files"]["link_val_neg_dst"]["name"] == "link_val_neg_dst.npy"
    assert meta["files"]["link_val_neg_dst"]["length"] == 7 and "checksum" in meta["files"]["link_val_neg_dst"]
    assert {e["name"] for e in meta["files"].values()} - {p.name for p in (tmp_path / "g").iterdir()} == set()
    assert verify(tmp_path / "g", progress=False).ok
    np.testing.assert_array_equal(ds.indptr, reference_csc(ei[0], ei[1], N)[0])  # the graph is as given


def test_a_dataset_without_link_splits_is_as_before(tmp_path):
    ei = _unique_edges()
    prepare_from_arrays(tmp_path / "g", ei, _x(), progress=False)
    meta = _meta(tmp_path / "g")
    assert "link_splits" not in meta
    assert list(meta["files"]) == ["indptr", "indices", "features", "labels", "train", "val", "test"]
    assert not {p.name for p in (tmp_path / "g").iterdir()} & LINK_FILE_NAMES
    ds = lightning_ooc.open_dataset(tmp_path / "g")
    assert not ds.has_link_splits and ds.link_splits is None
    with pytest.raises(KeyError, match="no link split 'val'.*--split-edges"):
        ds.link_split("val")
    assert not any(c.name.startswith("link") for c in verify(tmp_path / "g", progress=False).checks)


def test_link_splits_from_a_random_link_split_triple(tmp_path, capsys):
    import torch_geometric.transforms as T
    from torch_geometric.data import Data

    ei = torch.from_numpy(_unique_edges(2))
    data = Data(x=torch.from_numpy(_x()), edge_index=ei, y=torch.arange(N) % 3)
    torch.manual_seed(0)
    triple = T.RandomLinkSplit(num_val=0.1, num_test=0.2)(data)
    torch.save(triple, tmp_path / "split.pt")
    assert main(["prepare", "--out", str(tmp_path / "g"), "--pyg", str(tmp_path / "split.pt"), "--no-progress"]) == 0
    ds = lightning_ooc.open_dataset(tmp_path / "g")
    for s, d in zip(("train", "val", "test"), triple):
        ls = ds.link_split(s)
        np.testing.assert_array_equal(ls.index.numpy(), d.edge_label_index.numpy())
        assert ls.label.dtype == d.edge_label.dtype and torch.equal(ls.label, d.edge_label)
    train_ei = triple[0].edge_index.numpy()
    indptr, indices = reference_csc(train_ei[0], train_ei[1], N)
    np.testing.assert_array_equal(ds.indptr, indptr)
    np.testing.assert_array_equal(np.asarray(ds.indices), indices)
    assert ds.num_classes == 3
    links = ds.link_splits
    assert links["leakage_free"] is True and "RandomLinkSplit's train Data" in links["message_passing"]
    assert verify(tmp_path / "g", progress=False).ok
    assert main(["info", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    assert "link splits  train " in out and "RandomLinkSplit" in out and "no leakage" in out


class _Crafted:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os

        return (os.mkdir, (self.path,))


def test_a_file_that_needs_the_defaultdict_path_still_cannot_run_code(tmp_path, capsys):
    from collections import defaultdict

    marker = tmp_path / "ran"
    # torch's weights-only unpickler cannot fill the defaultdict (a safe global once PyG is imported; a
    # RandomLinkSplit Data holds one), so its subclass that can reads the file; the global after it is refused
    torch.save((defaultdict(set, {"a": {1}}), _Crafted(str(marker))), tmp_path / "g.pt")
    rc = main(["prepare", "--out", str(tmp_path / "o"), "--pyg", str(tmp_path / "g.pt"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and not marker.exists() and not (tmp_path / "o").exists()
    assert "not loaded: it names posix.mkdir" in err and "Traceback" not in err


def _raw(*ops: bytes) -> bytes:
    return b"\x80\x02" + b"".join(ops) + b"."


def _str(s: str) -> bytes:
    return b"X" + len(s).to_bytes(4, "little") + s.encode()


def test_the_defaultdict_unpickler_keeps_every_other_check_of_torchs_weights_only_one(tmp_path):
    """What it reads beyond torch's weights-only unpickler is SETITEM(S) into a defaultdict, nothing else."""
    import collections
    import io
    import pickle

    from lightning_ooc.data.pyg_files import _defaultdict_pickle, _pyg_safe_globals

    mod = _defaultdict_pickle()
    with torch.serialization.safe_globals([*_pyg_safe_globals(), collections.defaultdict]):
        dd = mod.load(io.BytesIO(pickle.dumps(collections.defaultdict(dict, {"a": {"b": 1}}), protocol=2)))
        assert type(dd) is collections.defaultdict and dd == {"a": {"b": 1}}
        name = collections.Counter.__name__
        crafted = {
            # BUILD with (None, slotstate) on a class: renames collections.Counter for the whole process
            "BUILD on a class": _raw(b"ccollections\nCounter\n", b"N}", _str("__name__"), _str("pwned"), b"s\x86b"),
            # a persistent id other than ("storage", ...): torch's legacy loader writes a file for "module"
            "a persistent id": _raw(_str("module"), _str("x.py"), _str("text"), b"\x87Q"),
            # a global outside the allowed list
            "a global": _raw(b"cposix\nsystem\n", _str("true"), b"\x85R"),
            # OBJ builds any allowed class without its constructor checks
            "OBJ": _raw(b"(ccollections\nOrderedDict\no"),
        }
        for what, raw in crafted.items():
            with pytest.raises(pickle.UnpicklingError):
                mod.load(io.BytesIO(raw))
        assert collections.Counter.__name__ == name


def _split_edges_style(ei, rng, with_edge_index):
    """A Data with the fields of PyG's train_test_split_edges, made by hand."""
    from torch_geometric.data import Data

    e = ei.shape[1]
    perm = rng.permutation(e)
    val, test, train = ei[:, perm[:40]], ei[:, perm[40:100]], ei[:, perm[100:]]
    t = torch.from_numpy
    data = Data(x=t(_x()), train_pos_edge_index=t(train), val_pos_edge_index=t(val),
                val_neg_edge_index=t(rng.integers(0, N, (2, 40))), test_pos_edge_index=t(test),
                test_neg_edge_index=t(rng.integers(0, N, (2, 60))))  # fmt: skip
    if with_edge_index:
        data.edge_index = t(ei)  # the whole graph: val/test edges included
    return data


def test_link_splits_from_train_test_split_edges_fields(tmp_path, capsys):
    ei = _unique_edges(3)
    data = _split_edges_style(ei, np.random.default_rng(0), with_edge_index=False)
    prepare_from_pyg(tmp_path / "g", data, progress=False)
    ds = lightning_ooc.open_dataset(tmp_path / "g")
    for s in ("val", "test"):
        ls = ds.link_split(s)
        pos, neg = data[f"{s}_pos_edge_index"], data[f"{s}_neg_edge_index"]
        np.testing.assert_array_equal(ls.index.numpy(), torch.cat([pos, neg], 1).numpy())
        assert ls.label.tolist() == [1.0] * pos.shape[1] + [0.0] * neg.shape[1]
    tr = ds.link_split("train")
    np.testing.assert_array_equal(tr.index.numpy(), data.train_pos_edge_index.numpy())
    assert tr.label.tolist() == [1.0] * tr.num_edges
    assert _csc_edges(ds) == set(_edge_set(data.train_pos_edge_index))
    assert ds.link_splits["leakage_free"] is True
    assert "train_pos_edge_index" in ds.link_splits["message_passing"]
    assert verify(tmp_path / "g", progress=False).ok

    # with edge_index holding every edge, the graph is as given, and it leaks: said in meta.json, info and verify
    data = _split_edges_style(ei, np.random.default_rng(0), with_edge_index=True)
    torch.save(data, tmp_path / "d.pt")
    prepare_from_pyg(tmp_path / "h", tmp_path / "d.pt", progress=False)
    links = lightning_ooc.open_dataset(tmp_path / "h").link_splits
    assert links["leakage_free"] is False
    assert "as given" in links["message_passing"] and "it holds 100 positive val/test edge(s)" in links["message_passing"]
    assert main(["info", str(tmp_path / "h")]) == 0
    assert "not leakage-free" in capsys.readouterr().out
    report = verify(tmp_path / "h", progress=False)
    assert report.ok
    warned = {c.name: c.detail for c in report.checks if c.warning}
    assert "40 positive edge(s) are edges of the message-passing graph" in warned["link split val leakage"]


def test_link_splits_from_csv_and_tsv(tmp_path):
    ei = _unique_edges(4)
    (tmp_path / "val.csv").write_text("src,dst\n1,2\n3,4\n# a comment\n5,6\n")
    (tmp_path / "test.tsv").write_text("7\t8\n9\t10\n")
    np.save(tmp_path / "val_label.npy", np.array([1, 0, 1]))
    prepare_from_edge_list(tmp_path / "g", _write_csv(tmp_path, ei), _x(), progress=False,
                           link_splits={"val": {"index": tmp_path / "val.csv", "label": tmp_path / "val_label.npy"},
                                        "test": str(tmp_path / "test.tsv")})  # fmt: skip
    ds = lightning_ooc.open_dataset(tmp_path / "g")
    assert ds.link_split("val").index.tolist() == [[1, 3, 5], [2, 4, 6]]
    assert ds.link_split("val").label.tolist() == [1, 0, 1]
    assert ds.link_split("test").index.tolist() == [[7, 9], [8, 10]]  # two edges: not mistaken for (2, M)
    assert set(ds.link_splits["splits"]) == {"val", "test"}
    assert not list((tmp_path / "g").glob("*.pairs"))
    assert verify(tmp_path / "g", progress=False).ok


def _write_csv(tmp_path, ei, name="edges.csv"):
    (tmp_path / name).write_text("".join(f"{s},{d}\n" for s, d in ei.T))
    return tmp_path / name


# -- --split-edges ---------------------------------------------------------------------------------------
def _prepare_split(tmp_path, name, ei, seed=0, *extra):
    np.save(tmp_path / "ei.npy", ei)
    np.save(tmp_path / "x.npy", _x())
    argv = ["prepare", "--out", str(tmp_path / name), "--edge-index", str(tmp_path / "ei.npy"), "--x",
            str(tmp_path / "x.npy"), "--split-edges", "0.85,0.05,0.10", "--seed", str(seed), "--no-progress", *extra]
    assert main(argv) == 0
    return lightning_ooc.open_dataset(tmp_path / name)


def test_split_edges_through_the_cli(tmp_path, capsys):
    ei = _unique_edges(5, e=1000)
    ds = _prepare_split(tmp_path, "g", ei)
    parts = {s: ds.link_split(s).index.numpy() for s in ("train", "val", "test")}
    assert {s: p.shape[1] for s, p in parts.items()} == {"train": 850, "val": 50, "test": 100}
    assert _edge_set(np.concatenate(list(parts.values()), 1)) == _edge_set(ei)  # a partition of the input
    assert _csc_edges(ds) == set(_edge_set(parts["train"]))  # the graph: the train edges, nothing else
    links = ds.link_splits
    assert links["leakage_free"] is True and links["splits"]["val"] == {"edges": 50, "fields": []}
    assert links["message_passing"] == "train edges only: val/test edges removed (prepare --split-edges 0.85,0.05,0.1, seed 0)"
    assert ds.meta["source"]["split_edges"] == [0.85, 0.05, 0.1]
    assert verify(ds.root, progress=False).ok
    capsys.readouterr()
    assert main(["info", str(ds.root)]) == 0
    out = capsys.readouterr().out
    assert "link splits  train 850 / val 50 / test 100 edges" in out
    assert "message passing: train edges only: val/test edges removed" in out and "no leakage" in out

    # deterministic for a seed: the same bytes; another seed, another split
    again = _prepare_split(tmp_path, "again", ei)
    for name in ("link_val_index.npy", "link_test_index.npy", "link_train_index.npy", "indices.npy"):
        assert (ds.root / name).read_bytes() == (again.root / name).read_bytes()
    other = _prepare_split(tmp_path, "other", ei, 1)
    assert _edge_set(other.link_split("val").index) != _edge_set(parts["val"])


def test_split_edges_with_add_reverse_keeps_no_val_test_edge_nor_its_reverse(tmp_path):
    ei = _unique_edges(6, e=800, upward=True)
    ei = np.concatenate([ei, ei[::-1, :200]], 1)  # some edges come with their reverse already (no repeats)
    ds = _prepare_split(tmp_path, "g", ei, 2, "--add-reverse")
    parts = {s: _edge_set(ds.link_split(s).index) for s in ("train", "val", "test")}
    assert len(parts["val"]) == round(0.05 * 1000) and len(parts["test"]) == 100
    graph = _csc_edges(ds)
    held = parts["val"] + parts["test"]
    assert not graph & set(held) and not graph & {(d, s) for s, d in held}
    train = set(parts["train"])
    assert graph == train | {(d, s) for s, d in train}
    # every input edge is in a split, or was dropped because its reverse is held out
    dropped = set(_edge_set(ei)) - train - set(held)
    assert dropped and all((d, s) in set(held) for s, d in dropped)
    assert f"{len(dropped)} more input edges dropped as copies or reverses of them" in ds.link_splits["message_passing"]
    assert "with their reverses" in ds.link_splits["message_passing"]
    assert verify(ds.root, progress=False).ok


def test_edge_split_streams_and_does_not_depend_on_chunking():
    ei = _unique_edges(7, e=1000)
    ei = np.concatenate([ei, ei[:, :30]], 1)  # repeats: every copy of a held-out edge leaves the graph
    whole = EdgeSplit(ArrayEdgeSource(ei), (0.7, 0.2, 0.1), seed=5, num_nodes=N)
    small = EdgeSplit(ArrayEdgeSource(ei, chunk_edges=37), (0.7, 0.2, 0.1), seed=5, num_nodes=N)
    for s in ("val", "test"):
        np.testing.assert_array_equal(whole.held_out(s), small.held_out(s))
    assert [len(whole.held_out(s)) for s in ("val", "test")] == [206, 103]
    chunks = list(small.chunks())
    assert len(chunks) == -(-ei.shape[1] // 37)
    train = np.concatenate([np.stack(c, 1) for c in chunks])
    held = {tuple(p) for s in ("val", "test") for p in small.held_out(s).tolist()}
    assert not held & set(map(tuple, train.tolist()))
    assert len(train) + 206 + 103 + small.dropped == ei.shape[1]
    assert list(small.chunks())[0][0].tolist() == chunks[0][0].tolist()  # every pass yields the same


# -- errors ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "links, message",
    [
        ({"val": {"index": np.array([[0, 1], [2, N]])}}, f"link split val: edge 1 is (1 -> {N}), but node ids must lie in [0, {N})"),
        ({"test": {"index": np.array([[0, -1]])}}, "link split test: edge 0 is (0 -> -1)"),
        ({"val": {"index": np.zeros((2, 5), np.int64), "label": np.ones(4)}},
         "link split val: label must have shape (5,), one per edge of the split, got (4,)"),
        ({"train": {"index": np.zeros((2, 5), np.int64), "neg_dst": np.zeros((4, 3), np.int64)}},
         "link split train: neg_dst must have shape (5, K)"),
        ({"test": {"index": np.zeros((2, 3), np.int64), "neg_dst": np.full((3, 2), N)}},
         "link split test: neg_dst[0, 0] is 80"),
        ({"val": {"index": np.zeros((2, 3), np.int64), "time": np.ones(3)}}, "link split val: time must hold integers"),
        ({"val": {"index": np.zeros((3, 3), np.int64)}}, "link split val: index: edges must have shape (2, M) or (M, 2)"),
        ({"val": {"index": np.zeros((2, 3)), "colour": np.ones(3)}}, "link split val: unknown fields ['colour']"),
        ({"valid": np.zeros((2, 3), np.int64)}, "unknown link split 'valid'"),
    ],
)
def test_bad_link_splits_are_refused_naming_the_split(tmp_path, links, message):
    with pytest.raises(InputError) as e:
        prepare_from_arrays(tmp_path / "g", _unique_edges(), _x(), link_splits=links, progress=False)
    assert message in str(e.value)
    assert not (tmp_path / "g").exists() and not list(tmp_path.glob(".g.*"))


def test_bad_link_inputs_on_the_command_line(tmp_path, capsys):
    np.save(tmp_path / "ei.npy", _unique_edges())
    np.save(tmp_path / "x.npy", _x())
    base = ["prepare", "--out", str(tmp_path / "g"), "--edge-index", str(tmp_path / "ei.npy"), "--x",
            str(tmp_path / "x.npy"), "--no-progress"]  # fmt: skip
    (tmp_path / "bad.csv").write_text("1,2\n3,x\n")
    assert main(base + ["--link-val", str(tmp_path / "bad.csv")]) == 2
    assert "bad.csv:2: 'x' is not an integer node id" in capsys.readouterr().err
    np.save(tmp_path / "val.npy", np.array([[1, 2], [3, 4], [5, 6]]))
    np.save(tmp_path / "neg.npy", np.zeros((2, 4), np.int64))
    assert main(base + ["--link-val", str(tmp_path / "val.npy"), "--link-val-neg", str(tmp_path / "neg.npy")]) == 2
    assert f"link split val: neg_dst ({tmp_path / 'neg.npy'}) must have shape (3, K)" in capsys.readouterr().err
    assert main(base + ["--link-val", str(tmp_path / "missing.npy")]) == 2
    assert "missing.npy" in capsys.readouterr().err
    assert main(base + ["--split-edges", "0.8,0.1,0.2"]) == 2
    assert "adding up to 1" in capsys.readouterr().err
    for argv, message in [
        (["--link-val", str(tmp_path / "val.npy"), "--split-edges", "0.8,0.1,0.1"], "not both"),
        (["--link-test-label", str(tmp_path / "neg.npy")], "--link-test-label needs --link-test"),
        (["--split-edges", "a,b,c"], "--split-edges must be three comma-separated fractions"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(base + argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("label, bad", [
    (np.array([1, 0, np.nan, 1], np.float32), "label[2] is nan (1 of the 4 labels is not 0 or 1)"),
    (np.array([2.0, 2.0, 1.0, 0.0]), "label[0] is 2.0 (2 of the 4 labels are not 0 or 1)"),
    (np.array([1, 0, 1, -1]), "label[3] is -1 (1 of the 4 labels is not 0 or 1)"),
    (np.array([0.0, 0.5, 1.0, np.inf]), "label[1] is 0.5 (2 of the 4 labels are not 0 or 1)"),
])  # fmt: skip
def test_link_labels_other_than_0_or_1_are_refused_naming_the_split_file_and_value(tmp_path, capsys, label, bad):
    """NaN or 2.0 labels used to be stored, and read differently by every reader (val_auc 0.0)."""
    with pytest.raises(InputError) as e:
        prepare_from_arrays(tmp_path / "g", _unique_edges(), _x(), progress=False,
                            link_splits={"val": {"index": np.zeros((2, 4), np.int64), "label": label}})  # fmt: skip
    assert f"link split val: label: {bad}; link labels must be 0 (a negative edge) or 1 (a positive one)" in str(e.value)
    np.save(tmp_path / "ei.npy", _unique_edges())
    np.save(tmp_path / "x.npy", _x())
    np.save(tmp_path / "val.npy", np.zeros((4, 2), np.int64))
    np.save(tmp_path / "val_label.npy", label)
    assert main(["prepare", "--out", str(tmp_path / "g"), "--edge-index", str(tmp_path / "ei.npy"), "--x",
                 str(tmp_path / "x.npy"), "--link-val", str(tmp_path / "val.npy"), "--link-val-label",
                 str(tmp_path / "val_label.npy"), "--no-progress"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert f"link split val: label ({tmp_path / 'val_label.npy'}): {bad}" in err and err.count("\n") == 1
    assert not (tmp_path / "g").exists() and not list(tmp_path.glob(".g.*"))


def test_link_labels_other_than_0_or_1_on_disk_are_refused_on_use_and_reported_by_verify(tmp_path, monkeypatch):
    """A dataset written before labels were checked: its checksums match, its val labels are 2.0 and NaN."""
    import lightning_ooc.data.link_splits as links
    from lightning_ooc import OutOfCoreLinkData, Tiered

    with monkeypatch.context() as m:  # as an older release wrote it
        m.setattr(links, "bad_label_text", lambda label: None)
        root = prepare_from_arrays(tmp_path / "g", _unique_edges(), _x(), progress=False, link_splits={
            "train": _unique_edges(1)[:, :40], "val": {"index": np.zeros((2, 3), np.int64),
                                                       "label": np.array([1.0, 2.0, np.nan], np.float32)}})  # fmt: skip
    ds = lightning_ooc.open_dataset(root)  # opening reads no labels
    with pytest.raises(CorruptDatasetError) as e:
        ds.link_split("val")
    msg = str(e.value)
    assert "link_val_label.npy: label[1] is 2.0 (2 of the 3 labels are not 0 or 1)" in msg and "--link-val-label" in msg
    with pytest.raises(CorruptDatasetError, match="link_val_label.npy: label"):
        ds.link_split("val", random_access=True)
    assert ds.link_split("train").label is None and ds.link_split("val", check_labels=False).label.shape == (3,)
    dm = OutOfCoreLinkData(root, batch_size=8, num_neighbors=[2], neg_sampling="binary", progress=False,
                           features=Tiered(gpu_cache="1MiB", host_cache="16KiB", staging="256KiB"),
                           memory_limit=None)  # fmt: skip
    with pytest.raises(CorruptDatasetError, match="link_val_label.npy: label"):
        dm.setup("fit")
    report = verify(root, progress=False)
    assert _problems(report) == {"link split val labels": "label[1] is 2.0 (2 of the 3 labels are not 0 or 1), but "
                                 "link labels must be 0 (a negative edge) or 1 (a positive one)"}  # fmt: skip


@pytest.mark.parametrize("text, line", [("0,1,1\n2,3,0\n", 1), ("src,dst,label\n0,1,1\n", 2), ("0 1\n", None)])
def test_a_link_csv_must_have_two_columns(tmp_path, capsys, text, line):
    """A third column (a label, say) used to be dropped without a word."""
    (tmp_path / "val.csv").write_text(text)
    if line is None:
        prepare_from_arrays(tmp_path / "g", _unique_edges(), _x(), link_splits={"val": tmp_path / "val.csv"},
                            progress=False)  # fmt: skip
        assert lightning_ooc.open_dataset(tmp_path / "g").link_split("val").index.tolist() == [[0], [1]]
        return
    with pytest.raises(InputError) as e:
        prepare_from_arrays(tmp_path / "g", _unique_edges(), _x(), link_splits={"val": tmp_path / "val.csv"},
                            progress=False)  # fmt: skip
    assert f"val.csv:{line}: 3 columns ('0 1 1'); a link split's edge file holds two columns" in str(e.value)
    assert "--link-SPLIT-label" in str(e.value)
    np.save(tmp_path / "ei.npy", _unique_edges())
    np.save(tmp_path / "x.npy", _x())
    assert main(["prepare", "--out", str(tmp_path / "g"), "--edge-index", str(tmp_path / "ei.npy"), "--x",
                 str(tmp_path / "x.npy"), "--link-val", str(tmp_path / "val.csv"), "--no-progress"]) == 2  # fmt: skip
    assert f"val.csv:{line}: 3 columns" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()


def test_given_splits_and_split_edges_are_exclusive(tmp_path):
    from torch_geometric.data import Data

    with pytest.raises(InputError, match="use one or the other"):
        prepare_from_arrays(tmp_path / "g", _unique_edges(), _x(), link_splits={"val": np.zeros((2, 1), np.int64)},
                            split_edges=(0.8, 0.1, 0.1), progress=False)  # fmt: skip
    data = _split_edges_style(_unique_edges(), np.random.default_rng(0), with_edge_index=False)
    with pytest.raises(InputError, match="holds link splits \\(train, val, test\\); do not give others"):
        prepare_from_pyg(tmp_path / "g", data, split_edges=(0.8, 0.1, 0.1), progress=False)
    assert isinstance(data, Data) and not (tmp_path / "g").exists()


# -- damage ----------------------------------------------------------------------------------------------
def _with_links(tmp_path):
    ei = _unique_edges()
    prepare_from_arrays(tmp_path / "g", ei, _x(), split_edges=(0.8, 0.1, 0.1), progress=False)
    return tmp_path / "g"


def test_a_truncated_link_file_is_refused_on_open_and_reported_by_verify(tmp_path):
    root = _with_links(tmp_path)
    path = root / "link_val_index.npy"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 8)
    with pytest.raises(CorruptDatasetError) as e:
        lightning_ooc.open_dataset(root)
    assert "link_val_index.npy" in str(e.value) and "truncated" in str(e.value)
    report = verify(root, progress=False)
    bad = _problems(report)
    assert "link_val_index.npy" in bad and "meta.json records" in bad["link_val_index.npy"]
    assert "open" in bad and "truncated" in bad["open"]


def test_a_link_file_of_the_wrong_dtype_is_refused_on_open(tmp_path):
    root = _with_links(tmp_path)
    index = np.load(root / "link_test_index.npy")
    np.save(root / "link_test_index.npy", index.astype(np.float64))  # same size, other dtype
    with pytest.raises(CorruptDatasetError, match=r"link_test_index\.npy: holds float64\[.*\] but meta.json says int64"):
        lightning_ooc.open_dataset(root)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["link_splits"].update(leakage_free="yes"), "'leakage_free' (true or false)"),
        (lambda m: m["link_splits"]["splits"].update(valid={"edges": 1, "fields": []}), "link_splits.splits must map"),
        (lambda m: m["link_splits"]["splits"]["val"].update(edges="8"), "link_splits.splits.val.edges must be an integer"),
        (lambda m: m["link_splits"]["splits"]["val"].update(fields=["colour"]), "link_splits.splits.val.fields"),
        (lambda m: m["files"].pop("link_test_index"), "no entry for the 'link_test_index' file"),
        (lambda m: m["files"]["link_val_index"].update(length=3), "the 'link_val_index' file's length 3 differs"),
        (lambda m: m["files"]["link_val_index"].update(name="../x.npy"), "'link_val_index' file's name must be a plain"),
    ],
)
def test_bad_link_meta_is_one_error_naming_meta_json(tmp_path, edit, message):
    from lightning_ooc.data.format import meta_digest

    root = _with_links(tmp_path)
    meta = _meta(root)
    edit(meta)
    meta["meta_checksum"] = meta_digest(meta)
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CorruptDatasetError) as e:
        lightning_ooc.open_dataset(root)
    assert message in str(e.value) and "meta.json" in str(e.value)
    assert message in verify(root, progress=False).format()


def test_verify_catches_a_leak_in_a_dataset_said_to_be_leakage_free(tmp_path):
    out = tmp_path / "g"
    with DatasetWriter(out, num_nodes=5, num_features=2, num_classes=0) as w:
        w.write_edges(ArrayEdgeSource(np.array([[0, 1, 2, 3], [1, 2, 3, 4]])))
        w.write_features([np.zeros((5, 2), np.float32)])
        w.write_labels([np.full(5, -1)])
        for s in ("train", "val", "test"):
            w.write_split(s, np.empty(0, np.int64))
        w.write_link_split("train", np.array([[0, 1], [1, 2]]))
        # val: 3 -> 4 is in the graph but labelled 0 (a negative: no leak); 2 -> 3 is a positive in the graph
        w.write_link_split("val", np.array([[4, 3, 2], [0, 4, 3]]), label=np.array([1, 0, 1]))
        w.write_link_split("test", np.array([[4], [1]]))
        w.set_link_note("train edges only (so its writer says)", leakage_free=True)
        w.commit()
    lightning_ooc.open_dataset(out)  # opening does not read the edges
    report = verify(out, progress=False)
    assert _problems(report) == {"link split val leakage": "1 positive edge(s) are edges of the message-passing graph, "
                                                           "e.g. 2 -> 3 (row 2), but meta.json says leakage_free"}
    assert main(["verify", "--no-progress", str(out)]) == 1


def test_verify_reports_a_link_id_out_of_range(tmp_path):
    from lightning_ooc.data.format import checksum_file, meta_digest

    root = _with_links(tmp_path)
    index = np.load(root / "link_test_index.npy")
    index[2, 1] = N + 5
    np.save(root / "link_test_index.npy", index)
    meta = _meta(root)
    meta["files"]["link_test_index"]["checksum"] = checksum_file(root / "link_test_index.npy")
    meta["meta_checksum"] = meta_digest(meta)
    (root / "meta.json").write_text(json.dumps(meta))
    bad = f"edge 2 is ({index[2, 0]} -> {N + 5}): a node id outside [0, {N})"
    assert _problems(verify(root, progress=False)) == {"link split test": bad}


def test_overwrite_replaces_a_dataset_with_link_splits(tmp_path):
    root = _with_links(tmp_path)
    prepare_from_arrays(root, _unique_edges(1), _x(), overwrite=True, progress=False)
    assert not {p.name for p in root.iterdir()} & LINK_FILE_NAMES
    assert not lightning_ooc.open_dataset(root).has_link_splits
