"""``prepare --from``: OGB, MAG240M, IGB/IGBH and GraphBolt directories, imported bit for bit, features copied
or used in place; the errors a damaged source gives."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import lightning_ooc
from lightning_ooc.cli import main
from lightning_ooc.data import in_place
from lightning_ooc.data.format import meta_digest
from lightning_ooc.data.importers import detect, import_dataset
from lightning_ooc.data.in_place import HEADER_BYTES, _sample_offsets
from lightning_ooc.data.prepare import prepare_from_arrays
from lightning_ooc.data.verify import verify
from lightning_ooc.errors import CorruptDatasetError, DatasetError, InputError
from lightning_ooc.io import FeatureReader
from lightning_ooc.io.backends import probe_file

N, E, F = 600, 3000, 12


def _readers(ds):
    """``(backend, reader)`` of ``ds``'s features for every backend this machine has."""
    for backend in ("uring", "pread", "buffered", "mmap"):
        try:
            yield backend, FeatureReader.from_dataset(ds, backend=backend)
        except lightning_ooc.io.BackendUnavailableError:
            continue


def _graph(seed=0, n=N, e=E, f=F):
    rng = np.random.default_rng(seed)
    ei = rng.integers(0, n, (2, e))
    x = rng.random((n, f)).astype(np.float32)
    y = rng.integers(0, 4, n).astype(np.float64)
    y[::9] = np.nan
    return ei, x, y


def _same(a, b, features=True):
    """Two homogeneous datasets hold the same graph, labels, splits (and features)."""
    a, b = lightning_ooc.open_dataset(a), lightning_ooc.open_dataset(b)
    assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
    assert np.array_equal(a.labels, b.labels) and a.num_classes == b.num_classes
    for s in ("train", "val", "test"):
        assert torch.equal(a.split(s), b.split(s)), s
    if features:
        assert np.array_equal(a.features_memmap(), b.features_memmap())


# -- OGB ----------------------------------------------------------------------------------------------------------
def _ogb_saver(tmp: Path, ei, x, y, split) -> Path:
    saver_mod = pytest.importorskip("ogb.io")
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        saver = saver_mod.DatasetSaver("ogbn-toy", is_hetero=False, version=1, root="sub")
        years = np.random.default_rng(0).integers(1990, 2020, (N, 1))
        saver.save_graph_list([{"edge_index": ei, "num_nodes": N, "node_feat": x, "node_year": years}])
        saver.save_target_labels(y.reshape(-1, 1))
        saver.save_split(split, "random")
        (tmp / "mapping").mkdir(exist_ok=True)
        (tmp / "mapping" / "README.md").write_text("ids")
        saver.copy_mapping_dir(str(tmp / "mapping"))
        saver.save_task_info("multiclass classification", "acc", num_classes=4)
        saver.get_meta_dict()
    finally:
        os.chdir(cwd)
    return tmp / "sub_ogbn_toy" / "toy"


def _split(y):
    lab = np.flatnonzero(~np.isnan(y))
    return {"train": lab[:300], "valid": lab[300:400], "test": lab[400:]}


def test_ogb_binary_from_datasetsaver_matches_arrays(tmp_path, capsys):
    ei, x, y = _graph()
    sp = _split(y)
    root = _ogb_saver(tmp_path, ei, x, y, sp)
    capsys.readouterr()
    assert detect(root) == "ogb"
    out = import_dataset(tmp_path / "imp", root, progress=False)
    ref = prepare_from_arrays(tmp_path / "ref", ei, x, y, train=sp["train"], val=sp["valid"], test=sp["test"],
                              progress=False)  # fmt: skip
    _same(out, ref)
    ds = lightning_ooc.open_dataset(out)  # OGB's node years, as the node times (PyG's time attribute)
    years = np.random.default_rng(0).integers(1990, 2020, (N, 1)).reshape(-1)
    assert np.array_equal(ds.node_time, years)
    from lightning_ooc.data.prepare import prepare_from_dataset
    from lightning_ooc.pyg import open_pyg_stores

    rewritten = lightning_ooc.open_dataset(prepare_from_dataset(tmp_path / "links", out, split_edges=(0.9, 0.05, 0.05),
                                                                progress=False))  # fmt: skip
    assert np.array_equal(rewritten.node_time, years)  # carried over by prepare --dataset
    fs, gs = open_pyg_stores(out)
    with fs:
        got = fs.get_tensor(group_name=None, attr_name="time", index=torch.tensor([5, 1]))
        assert got.tolist() == years[[5, 1]].tolist()


def test_ogb_heterogeneous_from_datasetsaver(tmp_path, capsys):
    saver_mod = pytest.importorskip("ogb.io")
    rng = np.random.default_rng(12)
    counts = {"paper": 300, "author": 120, "field_of_study": 40}
    rels = {("author", "writes", "paper"): (120, 300), ("paper", "cites", "paper"): (300, 300),
            ("paper", "has_topic", "field_of_study"): (300, 40)}  # fmt: skip
    ei = {et: np.stack([rng.integers(0, ns, 800), rng.integers(0, nd, 800)]) for et, (ns, nd) in rels.items()}
    x = rng.random((300, 8)).astype(np.float32)
    years = rng.integers(2000, 2020, (300, 1))
    y = rng.integers(0, 6, (300, 1))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        saver = saver_mod.DatasetSaver("ogbn-toymag", is_hetero=True, version=1, root="sub")
        saver.save_graph_list([{"edge_index_dict": ei, "num_nodes_dict": counts, "node_feat_dict": {"paper": x},
                                "node_year": {"paper": years}}])  # fmt: skip
        saver.save_target_labels({"paper": y})
        saver.save_split({"train": {"paper": np.arange(200)}, "valid": {"paper": np.arange(200, 250)},
                          "test": {"paper": np.arange(250, 300)}}, "time")  # fmt: skip
    finally:
        os.chdir(cwd)
    capsys.readouterr()
    root = tmp_path / "sub_ogbn_toymag" / "toymag"
    ds = lightning_ooc.open_dataset(import_dataset(tmp_path / "imp", root, progress=False))
    assert ds.is_hetero and ds.num_nodes_dict == counts and ds.target == "paper"
    assert set(ds.edge_types) == set(rels)  # as OGB's loader gives them: no reverses unless asked
    paper = ds.node("paper")
    assert np.array_equal(paper.read_features(np.arange(300)).numpy(), x)
    assert np.array_equal(paper.labels, y.reshape(-1)) and np.array_equal(paper.node_time, years.reshape(-1))
    assert paper.split("val").tolist() == list(range(200, 250))
    csc = ds.csc[("author", "writes", "paper")]
    src, dst = ei[("author", "writes", "paper")]
    got = sorted(zip(csc.indices.tolist(), np.repeat(np.arange(300), np.diff(csc.indptr)).tolist()))
    assert got == sorted(zip(src.tolist(), dst.tolist()))
    rev = lightning_ooc.open_dataset(import_dataset(tmp_path / "rev", root, add_reverse=True, progress=False))
    assert ("paper", "rev_writes", "author") in rev.edge_types


def test_fortran_ordered_edge_index_compressed_or_stored(tmp_path):
    """``edge_index`` built as ``pairs.T`` is Fortran-ordered: stored as interleaved (src, dst) pairs."""
    ei, x, y = _graph(14)
    for save in (np.savez, np.savez_compressed):
        root = tmp_path / save.__name__ / "ogbn_toy"
        (root / "raw").mkdir(parents=True)
        save(root / "raw" / "data.npz", edge_index=np.ascontiguousarray(ei.T).T, num_nodes_list=np.array([N]),
             num_edges_list=np.array([E]), node_feat=x)  # fmt: skip
        np.savez(root / "raw" / "node-label.npz", node_label=y.reshape(-1, 1))
        out = import_dataset(tmp_path / save.__name__ / "imp", root, progress=False)
        ref = prepare_from_arrays(tmp_path / save.__name__ / "ref", ei, x, y, progress=False)
        _same(out, ref)


def _gz_csv(path: Path, a, fmt):
    with gzip.open(path, "wt") as f:
        np.savetxt(f, a, delimiter=",", fmt=fmt)


def test_ogb_text_layout_and_reverse_edges_as_ogb_adds_them(tmp_path):
    ei, x, y = _graph(1)
    root = tmp_path / "ogbn_products"  # a name whose OGB loader adds every edge's reverse
    (root / "raw").mkdir(parents=True)
    (root / "split" / "sales_ranking").mkdir(parents=True)
    _gz_csv(root / "raw" / "edge.csv.gz", ei.T, "%d")
    _gz_csv(root / "raw" / "num-node-list.csv.gz", np.array([[N]]), "%d")
    _gz_csv(root / "raw" / "num-edge-list.csv.gz", np.array([[E]]), "%d")
    _gz_csv(root / "raw" / "node-feat.csv.gz", x, "%.9g")
    with gzip.open(root / "raw" / "node-label.csv.gz", "wt") as f:
        f.write("\n".join("nan" if np.isnan(v) else str(int(v)) for v in y) + "\n")
    sp = _split(y)
    for ours, theirs in (("train", "train"), ("val", "valid"), ("test", "test")):
        _gz_csv(root / "split" / "sales_ranking" / f"{theirs}.csv.gz", sp[theirs].reshape(-1, 1), "%d")
    out = import_dataset(tmp_path / "imp", root, "ogb", progress=False)
    ref = prepare_from_arrays(tmp_path / "ref", ei, x, y, train=sp["train"], val=sp["valid"], test=sp["test"],
                              add_reverse=True, progress=False)  # fmt: skip
    _same(out, ref)
    assert lightning_ooc.open_dataset(out).num_edges == 2 * E
    kept = import_dataset(tmp_path / "directed", root, "ogb", add_reverse=False, progress=False)
    assert lightning_ooc.open_dataset(kept).num_edges == E


def test_ogb_link_splits_citation2_and_collab_styles(tmp_path):
    ei, x, _ = _graph(2)
    rng = np.random.default_rng(3)
    for name, parts in (
        ("ogbl_citation2", {s: {"source_node": rng.integers(0, N, 50), "target_node": rng.integers(0, N, 50),
                                **({"target_node_neg": rng.integers(0, N, (50, 20))} if s != "train" else {})}
                            for s in ("train", "valid", "test")}),
        ("ogbl_collab", {s: {"edge": rng.integers(0, N, (40, 2)), "weight": rng.random(40), "year": rng.integers(2000, 2020, 40),
                             **({"edge_neg": rng.integers(0, N, (30, 2))} if s != "train" else {})}
                         for s in ("train", "valid", "test")}),
    ):  # fmt: skip
        root = tmp_path / name
        (root / "raw").mkdir(parents=True)
        (root / "split" / "time").mkdir(parents=True)
        np.savez_compressed(root / "raw" / "data.npz", edge_index=ei, num_nodes_list=np.array([N]),
                            num_edges_list=np.array([E]), node_feat=x)  # fmt: skip
        for s, d in parts.items():
            torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in d.items()}, root / "split" / "time" / f"{s}.pt")
        ds = lightning_ooc.open_dataset(import_dataset(tmp_path / f"{name}-imp", root, progress=False))
        assert ds.has_link_splits
        if name == "ogbl_citation2":
            test = ds.link_split("test")
            d = parts["test"]
            assert np.array_equal(test.index.t().numpy(), np.stack([d["source_node"], d["target_node"]], 1))
            assert np.array_equal(test.neg_dst.numpy(), d["target_node_neg"])
            assert ds.num_edges == E
        else:
            val = ds.link_split("val")
            d = parts["valid"]
            assert np.array_equal(val.index.t().numpy(), np.concatenate([d["edge"], d["edge_neg"]]))
            assert val.label.tolist() == [1.0] * 40 + [0.0] * 30
            assert np.array_equal(val.time.numpy()[:40], d["year"])
            assert ds.num_edges == 2 * E  # collab's loader adds the reverses


# -- in place -----------------------------------------------------------------------------------------------------
def test_in_place_features_from_arrays_read_bit_identical_and_refused_once_changed(tmp_path):
    ei, x, y = _graph(4, n=8000, f=100)
    x = x.astype(np.float16)  # 200-byte rows after a 128-byte header: every row off the block grid
    np.save(tmp_path / "x.npy", x)
    out = prepare_from_arrays(tmp_path / "g", ei, tmp_path / "x.npy", y, features="in-place", progress=False)
    assert not (out / "features.bin").exists()
    ds = lightning_ooc.open_dataset(out)
    assert ds.features_offset == 128 and ds.meta["version"] == 4
    ids = np.random.default_rng(0).integers(0, 8000, 900)
    for backend, r in _readers(ds):
        with r:
            assert np.array_equal(r.gather(ids).numpy(), x[ids]), backend
    assert verify(out, progress=False, full=True).ok
    # a byte changed where no sampled block lies, the modification time put back: open cannot see it, --full does
    st = os.stat(tmp_path / "x.npy")
    rec = ds.meta["in_place"]["features"]
    sampled = _sample_offsets(rec["offset"], rec["num_rows"] * rec["row_bytes"])
    at = next(p for p in range(rec["offset"], rec["file_bytes"]) if all(not s <= p < s + 4096 for s in sampled))
    with open(tmp_path / "x.npy", "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0xFF]))
    os.utime(tmp_path / "x.npy", ns=(st.st_atime_ns, st.st_mtime_ns))
    lightning_ooc.open_dataset(out)
    report = verify(out, progress=False, full=True)
    assert not report.ok and "differs from" in report.format()
    os.utime(tmp_path / "x.npy")  # now the time says it changed
    with pytest.raises(CorruptDatasetError, match="x.npy.*modified after import"):
        lightning_ooc.open_dataset(out)
    os.remove(tmp_path / "x.npy")
    with pytest.raises(DatasetError, match="x.npy.*no such file"):
        lightning_ooc.open_dataset(out)


def test_in_place_refuses_a_compressed_source_and_a_cast(tmp_path):
    ei, x, y = _graph(5)
    root = _ogb_saver(tmp_path, ei, x, y, _split(y))
    with pytest.raises(InputError, match="cannot be used in place.*--features copy"):
        import_dataset(tmp_path / "imp", root, features="in-place", progress=False)
    np.save(tmp_path / "x.npy", x)
    with pytest.raises(InputError, match="read as it is"):
        prepare_from_arrays(tmp_path / "g", ei, tmp_path / "x.npy", y, features="in-place", feature_dtype="float16",
                            progress=False)  # fmt: skip
    assert not (tmp_path / "g").exists()


def _in_place_dataset(tmp_path: Path) -> tuple[Path, Path, np.ndarray]:
    """A dataset using ``x.npy`` (float32, 1 MB) in place: its directory, the file, the rows."""
    ei, x, y = _graph(12, n=4000, f=64)
    np.save(tmp_path / "x.npy", x)
    out = prepare_from_arrays(tmp_path / "g", ei, tmp_path / "x.npy", y, features="in-place", progress=False)
    return out, tmp_path / "x.npy", x


def _unsampled_byte(rec: dict) -> int:
    """A byte of the rows that neither the header checksum nor a sampled block covers (only --full sees it)."""
    sampled = _sample_offsets(rec["offset"], rec["num_rows"] * rec["row_bytes"])
    return next(p for p in range(HEADER_BYTES, rec["file_bytes"]) if all(not s <= p < s + 4096 for s in sampled))


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0xFF]))


def test_in_place_damaged_file_is_refused_naming_it(tmp_path):
    """A header or a sampled block changed (time put back), a link, a directory, a truncated file: refused at open
    and by ``verify``, naming the file."""
    out, path, x = _in_place_dataset(tmp_path)
    original = path.read_bytes()
    st = os.stat(path)

    def refused(match):
        with pytest.raises(DatasetError, match=match) as e:
            lightning_ooc.open_dataset(out)
        assert "x.npy (the features file)" in str(e.value)
        report = verify(out, progress=False)
        assert not report.ok and "x.npy (the features file)" in report.format()

    for at, what in ((20, "the header"), (len(original) - 10, "a sampled block")):
        _flip(path, at)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        refused(what)
        _flip(path, at)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        lightning_ooc.open_dataset(out)
    os.rename(path, tmp_path / "moved.npy")
    os.symlink(tmp_path / "moved.npy", path)
    refused("now a symbolic link")
    os.remove(path)
    os.mkdir(path)
    refused("not a regular file")
    os.rmdir(path)
    path.write_bytes(original[:-100])
    refused("shorter")


def test_in_place_file_replaced_by_one_of_the_same_size_and_time_is_refused(tmp_path):
    """``cp -p``/``rsync -t``/a restore put a new file at the path: same size, same time, header and sampled blocks
    alike (one row byte differs between them); its inode gives it away at open."""
    out, path, x = _in_place_dataset(tmp_path)
    rec = lightning_ooc.open_dataset(out).meta["in_place"]["features"]
    st = os.stat(path)
    other = tmp_path / "other.npy"
    other.write_bytes(path.read_bytes())
    _flip(other, _unsampled_byte(rec))
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    new = os.stat(path)
    assert (new.st_size, new.st_mtime_ns) == (st.st_size, st.st_mtime_ns) and new.st_ino != st.st_ino
    with pytest.raises(CorruptDatasetError, match=r"x\.npy \(the features file\): another file than the one imported "
                                                  r"\(inode") as e:  # fmt: skip
        lightning_ooc.open_dataset(out)
    assert f"lightning-ooc verify --full --accept {out}" in str(e.value) and "\n" not in str(e.value)
    assert (rec["device"], rec["inode"]) == (st.st_dev, st.st_ino)  # recorded at import
    report = verify(out, progress=False)
    assert not report.ok and "another file than the one imported" in report.format()
    # its bytes are not those imported: --accept refuses it and keeps meta.json as it was
    before = (out / "meta.json").read_bytes()
    report = verify(out, progress=False, full=True, accept=True)
    assert not report.ok and "rows differ from those imported" in report.format() and "meta.json is unchanged" in \
        report.format()  # fmt: skip
    assert (out / "meta.json").read_bytes() == before


@pytest.mark.skipif(not os.path.isdir(f"/proc/{os.getpid()}/fd"), reason="the checked file is held as /proc/PID/fd/N")
def test_in_place_check_and_reads_see_the_same_file(tmp_path, monkeypatch):
    """A file put at the path after the check (or during it) is not read: the readers open the checked one."""
    out, path, x = _in_place_dataset(tmp_path)
    direct = probe_file(path)["direct"]
    ds = lightning_ooc.open_dataset(out)
    assert os.path.samefile(ds.features_path, path)
    np.save(tmp_path / "other.npy", x + 1)  # other rows, the same shape
    os.replace(tmp_path / "other.npy", path)
    ids = np.random.default_rng(0).integers(0, len(x), 500)
    read = 0
    for backend, r in _readers(ds):
        with r:
            assert np.array_equal(r.gather(ids).numpy(), x[ids]), backend
            if backend in ("uring", "pread") and direct:  # the path to the descriptor is opened with O_DIRECT
                assert r.info["direct"], backend
        read += 1
    assert read >= 2 and ds.features_path != path  # a path to the checked file's descriptor
    assert np.array_equal(ds.read_features(ids).numpy(), x[ids])
    with pytest.raises(CorruptDatasetError, match="x.npy.*another file than the one imported"):
        lightning_ooc.open_dataset(out)
    # the file swapped while the check runs (after it opened the file): what it returns still opens the checked one
    rec = ds.meta["in_place"]["features"]
    np.save(path, x)
    os.utime(path, ns=(0, rec["mtime_ns"]))
    assert verify(out, progress=False, full=True, accept=True).ok  # the inode is the new one
    rec = lightning_ooc.open_dataset(out).meta["in_place"]["features"]
    fingerprint = in_place.fingerprint

    def swap_meanwhile(*args):
        got = fingerprint(*args)
        np.save(tmp_path / "other.npy", x + 2)
        os.replace(tmp_path / "other.npy", path)
        return got

    monkeypatch.setattr(in_place, "fingerprint", swap_meanwhile)
    checked = in_place.check_in_place(rec, "features", out)
    assert np.array_equal(np.load(checked, mmap_mode="r")[ids], x[ids])
    with FeatureReader(checked, 64, torch.float32, offset=rec["offset"], num_rows=len(x)) as r:
        assert np.array_equal(r.gather(ids).numpy(), x[ids])
    # where there is no /proc the recorded path is returned, once it is found to name the checked file
    monkeypatch.setattr(in_place, "fingerprint", fingerprint)
    np.save(path, x)
    os.utime(path, ns=(0, rec["mtime_ns"]))
    assert verify(out, progress=False, full=True, accept=True).ok
    rec = lightning_ooc.open_dataset(out).meta["in_place"]["features"]
    monkeypatch.setattr(in_place, "_fd_path", lambda fd: None)
    assert in_place.check_in_place(rec, "features", out) == Path(rec["path"])
    monkeypatch.setattr(in_place, "fingerprint", swap_meanwhile)
    with pytest.raises(CorruptDatasetError, match="x.npy.*replaced while it was being checked"):
        in_place.check_in_place(rec, "features", out)
    monkeypatch.setattr(in_place, "fingerprint", fingerprint)
    with pytest.raises(CorruptDatasetError, match="another file than the one imported"):
        in_place.check_in_place(rec, "features", out)


def test_in_place_touched_file_is_accepted_by_verify_full_accept_and_a_changed_one_is_not(tmp_path, capsys):
    out, path, x = _in_place_dataset(tmp_path)
    ids = np.arange(len(x))[::-7]
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))  # `touch`: a new time, the same bytes
    with pytest.raises(CorruptDatasetError, match="x.npy.*modified after import") as e:
        lightning_ooc.open_dataset(out)
    assert f"lightning-ooc verify --full --accept {out}" in str(e.value)
    assert main(["verify", "--full", "--no-progress", str(out)]) == 1  # --full alone checks the time too
    with pytest.raises(SystemExit) as exit_:  # --accept checksums every byte: only with --full
        main(["verify", "--accept", "--no-progress", str(out)])
    assert exit_.value.code == 2 and "--accept needs --full" in capsys.readouterr().err
    assert main(["verify", "--full", "--accept", "--no-progress", str(out)]) == 0
    text = capsys.readouterr().out
    assert "accepted: " in text and "modification time" in text and "all checks passed" in text, text
    ds = lightning_ooc.open_dataset(out)
    assert ds.meta["in_place"]["features"]["mtime_ns"] == st.st_mtime_ns + 5 * 10**9
    with FeatureReader.from_dataset(ds) as r:
        assert np.array_equal(r.gather(ids).numpy(), x[ids])
    assert main(["verify", "--full", "--accept", "--no-progress", str(out)]) == 0  # nothing left to accept
    assert "accepted: " not in capsys.readouterr().out
    # a copy without -p of the same bytes: a new inode and time, accepted the same way
    (tmp_path / "copy.npy").write_bytes(path.read_bytes())
    os.replace(tmp_path / "copy.npy", path)
    with pytest.raises(CorruptDatasetError, match="another file than the one imported"):
        lightning_ooc.open_dataset(out)
    assert main(["verify", "--full", "--accept", "--no-progress", str(out)]) == 0
    assert "inode" in capsys.readouterr().out
    assert np.array_equal(lightning_ooc.open_dataset(out).read_features(ids).numpy(), x[ids])
    # the bytes changed (where open does not look) and the time with them: refused, and refused again by --accept
    _flip(path, _unsampled_byte(ds.meta["in_place"]["features"]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 9 * 10**9))
    with pytest.raises(CorruptDatasetError, match="x.npy.*modified after import"):
        lightning_ooc.open_dataset(out)
    before = (out / "meta.json").read_bytes()
    assert main(["verify", "--full", "--accept", "--no-progress", str(out)]) == 1
    text = capsys.readouterr().out
    assert "[FAIL] features (in place)" in text and "rows differ from those imported" in text and \
        "meta.json is unchanged" in text  # fmt: skip
    assert (out / "meta.json").read_bytes() == before and not (out / "meta.json.pending").exists()
    with pytest.raises(CorruptDatasetError, match="modified after import"):
        lightning_ooc.open_dataset(out)


def test_in_place_record_without_identity_still_opens(tmp_path):
    """A record written before the inode was recorded opens as before; ``verify --full --accept`` records it."""
    out, path, x = _in_place_dataset(tmp_path)
    meta = json.loads((out / "meta.json").read_text())
    for k in ("device", "inode"):
        meta["in_place"]["features"].pop(k, None)
    meta["meta_checksum"] = meta_digest(meta)
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    ds = lightning_ooc.open_dataset(out)
    assert "inode" not in ds.meta["in_place"]["features"]
    assert np.array_equal(ds.read_features(np.arange(50)).numpy(), x[:50])
    assert verify(out, progress=False).ok and verify(out, progress=False, full=True).ok
    report = verify(out, progress=False, full=True, accept=True)
    assert report.ok and "identity (device" in report.format()
    assert lightning_ooc.open_dataset(out).meta["in_place"]["features"]["inode"] == os.stat(path).st_ino
    # recorded now: a new file of the same size and time is refused
    st = os.stat(path)
    np.save(tmp_path / "other.npy", x)
    os.utime(tmp_path / "other.npy", ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp_path / "other.npy", path)
    with pytest.raises(CorruptDatasetError, match="another file than the one imported"):
        lightning_ooc.open_dataset(out)


def test_stored_npz_member_is_used_in_place_at_its_unaligned_offset(tmp_path):
    ei, x, y = _graph(6)
    root = tmp_path / "ogbn_toy"
    (root / "raw").mkdir(parents=True)
    np.savez(root / "raw" / "data.npz", edge_index=ei, num_nodes_list=np.array([N]), num_edges_list=np.array([E]),
             node_feat=x)  # np.savez: members stored, not deflated
    np.savez(root / "raw" / "node-label.npz", node_label=y.reshape(-1, 1))
    out = import_dataset(tmp_path / "imp", root, features="in-place", progress=False)
    ds = lightning_ooc.open_dataset(out)
    assert os.path.samefile(ds.features_path, root / "raw" / "data.npz") and ds.features_offset % 512
    with FeatureReader.from_dataset(ds) as r:
        assert np.array_equal(r.gather(np.arange(N)[::-1]).numpy(), x[::-1])
    info = subprocess.run([sys.executable, "-m", "lightning_ooc", "info", str(out)], capture_output=True, text=True)
    assert "in place" in info.stdout and "data.npz" in info.stdout and "one-row read costs" in info.stdout


# -- MAG240M, IGB ------------------------------------------------------------------------------------------------
def test_mag240m_layout_in_place(tmp_path):
    rng = np.random.default_rng(7)
    counts = {"paper": 300, "author": 200, "institution": 20}
    r = tmp_path / "mag240m_kddcup2021"
    p = r / "processed"
    (p / "paper").mkdir(parents=True)
    x = rng.random((300, 24)).astype(np.float16)
    np.save(p / "paper" / "node_feat.npy", x)
    y = rng.integers(0, 5, 300).astype(np.float32)
    y[200:] = np.nan
    np.save(p / "paper" / "node_label.npy", y)
    edges = {("author", "writes", "paper"): (200, 300), ("author", "affiliated_with", "institution"): (200, 20),
             ("paper", "cites", "paper"): (300, 300)}  # fmt: skip
    for et, (ns, nd) in edges.items():
        (p / "___".join(et)).mkdir()
        np.save(p / "___".join(et) / "edge_index.npy", np.stack([rng.integers(0, ns, 500), rng.integers(0, nd, 500)]))
    torch.save({**counts, "num_classes": 5}, r / "meta.pt")
    torch.save({"train": np.arange(150), "valid": np.arange(150, 200), "test": np.arange(200, 300)}, r / "split_dict.pt")
    assert detect(tmp_path) == "mag240m"
    ds = lightning_ooc.open_dataset(import_dataset(tmp_path / "imp", tmp_path, features="in-place", progress=False))
    assert ds.is_hetero and ds.num_nodes_dict == counts
    paper = ds.node("paper")
    assert np.array_equal(paper.read_features(np.arange(300)).numpy(), x)
    assert paper.split("train").tolist() == list(range(150)) and paper.split("test").numel() == 0
    assert ("paper", "rev_writes", "author") in ds.edge_types and ds.num_edges_dict[("paper", "cites", "paper")] == 1000
    # a heterogeneous dataset (with node times) is replaced by --overwrite, leaving nothing of the old one
    again = import_dataset(tmp_path / "imp", tmp_path, overwrite=True, add_reverse=False, progress=False)
    ds = lightning_ooc.open_dataset(again)
    assert ("paper", "rev_writes", "author") not in ds.edge_types and ds.node("paper").node_time is None
    assert sorted(os.listdir(tmp_path)) == ["imp", "mag240m_kddcup2021"]
    assert not any("rev_" in f for f in os.listdir(again))


def _igb(tmp_path: Path, hetero: bool) -> tuple[Path, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(8)
    p = tmp_path / "small" / "processed"
    (p / "paper").mkdir(parents=True)
    x = rng.random((400, 1024)).astype(np.float32)
    np.save(p / "paper" / "node_feat.npy", x)
    y = rng.integers(0, 19, 400).astype(np.float32)
    np.save(p / "paper" / "node_label_19.npy", y)
    np.save(p / "paper" / "node_label_2K.npy", rng.integers(0, 2983, 400).astype(np.float32))
    (p / "paper__cites__paper").mkdir()
    np.save(p / "paper__cites__paper" / "edge_index.npy", rng.integers(0, 400, (2000, 2)))
    if hetero:
        for t, n in (("author", 100), ("institute", 10), ("fos", 30)):
            (p / t).mkdir()
            np.save(p / t / "node_feat.npy", rng.random((n, 1024)).astype(np.float32))
        for et, ns, nd in ((("paper", "written_by", "author"), 400, 100), (("author", "affiliated_to", "institute"), 100, 10),
                           (("paper", "topic", "fos"), 400, 30)):  # fmt: skip
            (p / "__".join(et)).mkdir()
            np.save(p / "__".join(et) / "edge_index.npy", np.stack([rng.integers(0, ns, 700), rng.integers(0, nd, 700)], 1))
    return tmp_path, x, y


def test_igb_homogeneous_splits_as_igb_makes_them(tmp_path):
    root, x, y = _igb(tmp_path, hetero=False)
    assert detect(root) == "igb"
    ds = lightning_ooc.open_dataset(import_dataset(tmp_path / "imp", root, progress=False))
    assert not ds.is_hetero and np.array_equal(ds.features_memmap(), x)
    perm = np.random.default_rng(0).permutation(400)  # a random 60/20/20 of the papers, seeded
    for s, ids in (("train", perm[:240]), ("val", perm[240:320]), ("test", perm[320:])):
        assert sorted(ds.split(s).tolist()) == sorted(ids.tolist()), s
    assert np.array_equal(ds.labels, y.astype(np.int64))
    two_k = lightning_ooc.open_dataset(import_dataset(tmp_path / "imp2k", root, extra={"igb_classes": "2K"},
                                                      progress=False))  # fmt: skip
    assert two_k.num_classes > 19


def test_igb_full_size_raw_files_and_its_labelled_prefix(tmp_path, monkeypatch):
    """The full size's paper features and labels are raw float32 without a .npy header; only a prefix of the
    papers is labelled, and the splits are IGB's contiguous blocks of it."""
    from lightning_ooc.data.importers import igb

    monkeypatch.setitem(igb.FULL_LABELLED, "19", 300)
    rng = np.random.default_rng(13)
    p = tmp_path / "full" / "processed"
    (p / "paper").mkdir(parents=True)
    x = rng.random((400, 1024)).astype(np.float32)
    x.tofile(p / "paper" / "node_feat.npy")  # raw, as the full size ships it
    y = rng.integers(0, 19, 400).astype(np.float32)
    y.tofile(p / "paper" / "node_label_19.npy")
    (p / "paper__cites__paper").mkdir()
    np.save(p / "paper__cites__paper" / "edge_index.npy", rng.integers(0, 400, (1500, 2)))
    ds = lightning_ooc.open_dataset(import_dataset(tmp_path / "imp", tmp_path, features="in-place", progress=False))
    assert ds.features_offset == 0 and np.array_equal(ds.read_features(np.arange(400)).numpy(), x)
    assert np.array_equal(ds.labels[:300], y[:300].astype(np.int64)) and (np.asarray(ds.labels[300:]) == -1).all()
    assert ds.split("train").tolist() == list(range(180)) and ds.split("test").tolist() == list(range(240, 300))


def test_igbh_heterogeneous_in_place_with_reverse_relations(tmp_path):
    root, x, _ = _igb(tmp_path, hetero=True)
    ds = lightning_ooc.open_dataset(import_dataset(tmp_path / "imp", root, features="in-place", progress=False))
    assert set(ds.node_types) == {"paper", "author", "institute", "fos"}
    assert ("author", "rev_written_by", "paper") in ds.edge_types
    assert np.array_equal(ds.node("paper").read_features(np.arange(400)).numpy(), x)
    assert not any(f.endswith("features.bin") for f in os.listdir(tmp_path / "imp"))
    # another file put at the path after the open is not read: the node type reads the checked one
    feat = root / "small" / "processed" / "paper" / "node_feat.npy"
    np.save(tmp_path / "other.npy", x + 1)
    os.replace(tmp_path / "other.npy", feat)
    assert np.array_equal(ds.node("paper").read_features(np.arange(400)).numpy(), x)
    with FeatureReader.from_dataset(ds.node("paper")) as r:
        assert np.array_equal(r.gather(np.arange(400)[::-3]).numpy(), x[::-3])
    with pytest.raises(CorruptDatasetError, match="node_feat.npy.*another file than the one imported"):
        lightning_ooc.open_dataset(tmp_path / "imp")
    # --accept is all or nothing: a touched author file is not accepted while the paper file's rows differ
    os.utime(root / "small" / "processed" / "author" / "node_feat.npy")
    before = (tmp_path / "imp" / "meta.json").read_bytes()
    report = verify(tmp_path / "imp", progress=False, full=True, accept=True)
    text = report.format()
    assert not report.ok and "[ok  ] author.features (in place): accepted" in text and \
        "[FAIL] paper.features (in place)" in text and "nothing accepted, meta.json is unchanged" in text  # fmt: skip
    assert (tmp_path / "imp" / "meta.json").read_bytes() == before
    np.save(feat, x)  # the paper rows back, in a file of another inode and time: both accepted now
    assert verify(tmp_path / "imp", progress=False, full=True, accept=True).ok
    again = lightning_ooc.open_dataset(tmp_path / "imp")
    assert np.array_equal(again.node("paper").read_features(np.arange(400)).numpy(), x)


# -- GraphBolt ---------------------------------------------------------------------------------------------------
def test_graphbolt_node_classification_matches_arrays(tmp_path):
    ei, x, y = _graph(9)
    root = tmp_path / "gb"
    (root / "data").mkdir(parents=True)
    np.savetxt(root / "data" / "edges.csv", ei.T, delimiter=",", fmt="%d")
    np.save(root / "data" / "feat.npy", x)
    lab = np.flatnonzero(~np.isnan(y))
    sets = {"train_set": lab[:300], "validation_set": lab[300:400], "test_set": lab[400:]}
    meta = {"dataset_name": "toy", "graph": {"nodes": [{"num": N}], "edges": [{"format": "csv", "path": "data/edges.csv"}]},
            "feature_data": [{"domain": "node", "name": "feat", "format": "numpy", "in_memory": False, "path": "data/feat.npy"}],
            "tasks": [{"name": "node_classification", "num_classes": 4}]}  # fmt: skip
    for key, ids in sets.items():
        np.save(root / "data" / f"{key}-seeds.npy", ids)
        np.save(root / "data" / f"{key}-labels.npy", y[ids].astype(np.int64))
        meta["tasks"][0][key] = [{"data": [{"name": "seeds", "format": "numpy", "path": f"data/{key}-seeds.npy"},
                                            {"name": "labels", "format": "numpy", "path": f"data/{key}-labels.npy"}]}]  # fmt: skip
    (root / "metadata.yaml").write_text(yaml.safe_dump(meta))
    assert detect(root) == "graphbolt"
    out = import_dataset(tmp_path / "imp", root, features="in-place", progress=False)
    ref = prepare_from_arrays(tmp_path / "ref", ei, x, y, train=sets["train_set"], val=sets["validation_set"],
                              test=sets["test_set"], progress=False)  # fmt: skip
    _same(out, ref)


def test_graphbolt_link_prediction_sets(tmp_path):
    ei, x, _ = _graph(10)
    root = tmp_path / "gb"
    root.mkdir()
    np.save(root / "edges.npy", ei)
    np.save(root / "feat.npy", x)
    pairs = np.random.default_rng(0).integers(0, N, (60, 2))
    np.save(root / "pairs.npy", pairs)
    np.save(root / "labels.npy", np.r_[np.ones(30), np.zeros(30)])
    data = [{"name": "seeds", "format": "numpy", "path": "pairs.npy"}, {"name": "labels", "format": "numpy", "path": "labels.npy"}]
    meta = {"graph": {"nodes": [{"num": N}], "edges": [{"format": "numpy", "path": "edges.npy"}]},
            "feature_data": [{"domain": "node", "name": "feat", "format": "numpy", "path": "feat.npy"}],
            "tasks": [{"name": "link_prediction", **{k: [{"data": data}] for k in ("train_set", "validation_set", "test_set")}}]}  # fmt: skip
    (root / "metadata.yaml").write_text(yaml.safe_dump(meta))
    ds = lightning_ooc.open_dataset(import_dataset(tmp_path / "imp", root, progress=False))
    assert np.array_equal(ds.link_split("val").index.t().numpy(), pairs)
    assert ds.link_split("test").label.tolist() == [1.0] * 30 + [0.0] * 30


# -- errors -------------------------------------------------------------------------------------------------------
def test_truncated_and_mismatched_sources_are_one_line_errors_naming_the_file(tmp_path):
    ei, x, y = _graph(11)
    root = tmp_path / "ogbn_toy"
    (root / "raw").mkdir(parents=True)
    np.savez_compressed(root / "raw" / "data.npz", edge_index=ei, num_nodes_list=np.array([N]),
                        num_edges_list=np.array([E]), node_feat=x)  # fmt: skip
    np.savez_compressed(root / "raw" / "node-label.npz", node_label=y[:-5].reshape(-1, 1))  # a label short
    with pytest.raises(InputError, match=r"labels must have shape \(600,\)"):
        import_dataset(tmp_path / "a", root, progress=False)
    np.savez_compressed(root / "raw" / "node-label.npz", node_label=y.reshape(-1, 1))
    data = (root / "raw" / "data.npz").read_bytes()
    (root / "raw" / "data.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="data.npz") as e:
        import_dataset(tmp_path / "b", root, progress=False)
    assert "\n" not in str(e.value)
    igb_root, _, _ = _igb(tmp_path / "igb", hetero=False)
    feat = igb_root / "small" / "processed" / "paper" / "node_feat.npy"
    feat.write_bytes(feat.read_bytes()[:-4096])
    with pytest.raises(InputError, match="node_feat.npy.*truncated"):
        import_dataset(tmp_path / "c", igb_root, progress=False)
    for out in ("a", "b", "c"):
        assert not (tmp_path / out).exists()


def test_detect_names_what_it_found_or_expected(tmp_path):
    with pytest.raises(InputError, match="not a layout this release imports"):
        detect(tmp_path)
    (tmp_path / "raw").mkdir()
    np.savez(tmp_path / "raw" / "data.npz", edge_index=np.zeros((2, 0), np.int64))
    (tmp_path / "metadata.yaml").write_text("graph: {}\n")
    with pytest.raises(InputError, match="fits several layouts.*--from"):
        detect(tmp_path)


def test_cli_prepare_from(tmp_path):
    root, x, y = _igb(tmp_path, hetero=False)
    cmd = [sys.executable, "-m", "lightning_ooc", "prepare", "--from", "igb", str(root), "--out", str(tmp_path / "imp"),
           "--features", "in-place", "--no-progress"]  # fmt: skip
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0
    assert lightning_ooc.open_dataset(tmp_path / "imp").features_offset == 128
    bad = subprocess.run([*cmd[:6], "--x", "x.npy", "--out", str(tmp_path / "other")], capture_output=True, text=True)
    assert bad.returncode == 2 and "--from imports the layout's own" in bad.stderr


# -- training on an import ---------------------------------------------------------------------------------------
def _write_layout(layout: str, ds, tmp: Path) -> Path:
    """The graph of dataset ``ds`` written in ``layout`` (features where they can be used in place)."""
    dst = np.repeat(np.arange(ds.num_nodes), np.diff(ds.indptr))
    ei = np.stack([np.asarray(ds.indices, np.int64), dst])
    x = np.asarray(ds.features_memmap())
    y = np.asarray(ds.labels).astype(np.float64)
    y[y < 0] = np.nan
    splits = {s: ds.split(s).numpy() for s in ("train", "val", "test")}
    if layout == "ogb":
        root = tmp / "ogbn_syn"
        (root / "raw").mkdir(parents=True)
        (root / "split" / "planted").mkdir(parents=True)
        np.savez(root / "raw" / "data.npz", edge_index=ei, num_nodes_list=np.array([ds.num_nodes]),
                 num_edges_list=np.array([ds.num_edges]), node_feat=x)  # members stored: usable in place
        np.savez(root / "raw" / "node-label.npz", node_label=y.reshape(-1, 1))
        torch.save({"train": splits["train"], "valid": splits["val"], "test": splits["test"]},
                   root / "split" / "planted" / "split_dict.pt")  # fmt: skip
    elif layout == "igb":
        root = tmp / "igb"
        p = root / "small" / "processed"
        (p / "paper").mkdir(parents=True)
        (p / "paper__cites__paper").mkdir()
        np.save(p / "paper" / "node_feat.npy", x)
        np.save(p / "paper" / "node_label_19.npy", np.full(len(y), 3, np.float32))
        np.save(p / "paper" / "node_label_2K.npy", y.astype(np.float32))  # MLPerf's splits go with the 2K set
        np.save(p / "paper__cites__paper" / "edge_index.npy", ei.T.copy())
        torch.save(torch.from_numpy(splits["train"]), p / "train_idx.pt")  # MLPerf's split files
        torch.save(torch.from_numpy(splits["val"]), p / "val_idx.pt")
    else:
        root = tmp / "gb"
        root.mkdir()
        np.save(root / "edges.npy", ei)
        np.save(root / "feat.npy", x)
        meta = {"graph": {"nodes": [{"num": ds.num_nodes}], "edges": [{"format": "numpy", "path": "edges.npy"}]},
                "feature_data": [{"domain": "node", "name": "feat", "format": "numpy", "path": "feat.npy"}],
                "tasks": [{"name": "nc", "num_classes": ds.num_classes}]}  # fmt: skip
        for ours, key in (("train", "train_set"), ("val", "validation_set"), ("test", "test_set")):
            np.save(root / f"{key}.npy", splits[ours])
            np.save(root / f"{key}-y.npy", np.asarray(ds.labels)[splits[ours]])
            meta["tasks"][0][key] = [{"data": [{"name": "seeds", "format": "numpy", "path": f"{key}.npy"},
                                               {"name": "labels", "format": "numpy", "path": f"{key}-y.npy"}]}]  # fmt: skip
        (root / "metadata.yaml").write_text(yaml.safe_dump(meta))
    return root


# OGB's layout in `make test`; the others (the same training path over another importer) in `make test-all`
@pytest.mark.parametrize("layout", ["ogb", pytest.param("igb", marks=pytest.mark.slow),
                                    pytest.param("graphbolt", marks=pytest.mark.slow)])
def test_training_on_an_in_place_import_equals_training_on_the_arrays(tmp_path, layout):
    """A synthetic graph written in each layout, imported with its features used in place (a .npy header or a
    stored .npz member before the rows) and trained on: the same model, bit for bit, as trained on the same
    graph prepared from arrays with the same splits."""
    import lightning as L

    from lightning_ooc import OutOfCoreNodeData, Tiered
    from lightning_ooc.models import GraphSAGE
    from lightning_ooc.testing import make_synthetic

    g = make_synthetic(tmp_path / "g", num_nodes=3000, avg_degree=6, num_features=16, num_classes=4, train_frac=0.3,
                       val_frac=0.05, test_frac=0.3, seed=2)  # fmt: skip
    ds = lightning_ooc.open_dataset(g.root)
    imported = lightning_ooc.open_dataset(import_dataset(tmp_path / "imp", _write_layout(layout, ds, tmp_path),
                                                         features="in-place", progress=False))  # fmt: skip
    assert imported.features_offset > 0 and not (imported.root / "features.bin").exists()
    dst = np.repeat(np.arange(ds.num_nodes), np.diff(ds.indptr))
    y = np.asarray(imported.labels)
    if layout == "graphbolt":  # labels come with the sets: the nodes of no set have none
        in_sets = np.concatenate([ds.split(s).numpy() for s in ("train", "val", "test")])
        assert np.array_equal(y[in_sets], np.asarray(ds.labels)[in_sets]) and (np.delete(y, in_sets) == -1).all()
    else:
        assert np.array_equal(y, ds.labels)
    ref = prepare_from_arrays(tmp_path / "ref", np.stack([np.asarray(ds.indices, np.int64), dst]),
                              np.asarray(ds.features_memmap()), y,
                              **{s: imported.split(s).numpy() for s in ("train", "val", "test")},
                              num_classes=ds.num_classes, progress=False)  # fmt: skip
    _same(imported.root, ref)

    def fit(path):
        L.seed_everything(0, workers=False)
        dm = OutOfCoreNodeData(path, batch_size=128, num_neighbors=[5, 5], progress=False, seed=0,
                               features=Tiered(gpu_cache="1MiB", host_cache="128KiB", staging="1MiB"),
                               pipeline=dict(num_extractors=2, num_samplers=1, order="in_order"))  # fmt: skip
        model = GraphSAGE(16, 4, hidden_channels=32, num_layers=2, lr=0.01)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            deterministic=True)  # fmt: skip
        trainer.fit(model, datamodule=dm)
        metric = "test_acc" if imported.split("test").numel() else "val_acc"
        res = trainer.test(model, datamodule=dm, verbose=False) if metric == "test_acc" else \
            trainer.validate(model, datamodule=dm, verbose=False)  # fmt: skip
        return model, res[0][metric]

    ours, acc = fit(imported.root)
    theirs, acc_ref = fit(ref)
    for (k, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), k
    assert acc == acc_ref and acc > 0.5, (acc, acc_ref)
