"""Damaged and unusual input files given to ``prepare`` (and read by ``info`` / ``verify``): each is one line naming
the file and what is wrong with it, and nothing is written."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml

import lightning_ooc
from lightning_ooc.cli import main
from lightning_ooc.data.importers import import_dataset, ogb
from lightning_ooc.data.importers.sources import npz_member
from lightning_ooc.data.prepare import prepare_from_arrays
from lightning_ooc.data.verify import verify
from lightning_ooc.errors import InputError
from lightning_ooc.testing import make_synthetic

N, E, F = 600, 3000, 12


def _error(capsys) -> str:
    """The one ``lightning-ooc: error:`` line a failed command printed (and no traceback)."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("lightning-ooc: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _spoil_header(path: Path) -> None:
    """A byte that is not ASCII in place of the ``.npy`` header's opening brace (NumPy's parser: a TokenError)."""
    data = bytearray(path.read_bytes())
    data[10] = 0xE9
    path.write_bytes(bytes(data))


# -- .npz members stored without compression: checked against the archive's CRC-32 --------------------------------
def _ogb(root: Path, damage: str | None) -> Path:
    """An OGB layout of stored (np.savez) archives; ``damage``: the member one bit of whose data is flipped."""
    rng = np.random.default_rng(0)
    (root / "raw").mkdir(parents=True)
    y = rng.integers(0, 4, N).astype(np.float64)
    np.savez(root / "raw" / "data.npz", edge_index=rng.integers(0, N, (2, E)), num_nodes_list=np.array([N]),
             num_edges_list=np.array([E]), node_feat=rng.random((N, F)).astype(np.float32))  # fmt: skip
    np.savez(root / "raw" / "node-label.npz", node_label=y.reshape(-1, 1))
    if damage is not None:
        path = root / "raw" / ("node-label.npz" if damage == "node_label" else "data.npz")
        m = npz_member(path, damage)
        data = bytearray(path.read_bytes())
        data[m.offset + int(np.prod(m.shape)) * m.dtype.itemsize // 2] ^= 0x40
        path.write_bytes(bytes(data))
        with pytest.raises(zipfile.BadZipFile, match="CRC"):  # NumPy refuses the member
            np.load(path)[damage]
    return root


@pytest.mark.parametrize("member", ["node_feat", "edge_index", "node_label"])
@pytest.mark.parametrize("features", ["copy", "in-place"])
def test_a_stored_npz_member_with_a_bad_crc_is_refused(tmp_path, member, features):
    root = _ogb(tmp_path / "ogbn_toy", member)
    with pytest.raises(InputError, match=rf"\[{member}\]: its bytes do not match the archive's CRC-32") as e:
        import_dataset(tmp_path / "out", root, features=features, progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_stored_members_without_damage_import_and_a_fortran_edge_index_is_checked_too(tmp_path):
    root = _ogb(tmp_path / "ogbn_toy", None)
    ei = np.load(root / "raw" / "data.npz")["edge_index"]
    out = import_dataset(tmp_path / "out", root, features="in-place", progress=False)
    assert lightning_ooc.open_dataset(out).num_edges == E
    x = np.load(root / "raw" / "data.npz")["node_feat"]
    np.savez(root / "raw" / "data.npz", edge_index=np.asfortranarray(ei), num_nodes_list=np.array([N]),
             num_edges_list=np.array([E]), node_feat=x)  # fmt: skip
    assert lightning_ooc.open_dataset(import_dataset(tmp_path / "f", root, progress=False)).num_edges == E
    m = npz_member(root / "raw" / "data.npz", "edge_index")
    data = bytearray((root / "raw" / "data.npz").read_bytes())
    data[m.offset + 8] ^= 1  # the first pair's target
    (root / "raw" / "data.npz").write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"\[edge_index\]: its bytes do not match the archive's CRC-32"):
        import_dataset(tmp_path / "g", root, progress=False)


def test_verify_full_checks_a_member_used_in_place_against_its_crc(tmp_path, monkeypatch):
    good = import_dataset(tmp_path / "good", _ogb(tmp_path / "ogbn_good", None), features="in-place", progress=False)
    report = verify(good, progress=False, full=True)
    assert report.ok and "the member 'node_feat' matches the archive's CRC-32" in report.format()
    with monkeypatch.context() as m:  # imported with the member's CRC-32 left unchecked: verify --full finds it
        m.setattr(ogb, "in_place_rows", lambda rows, *args, **kwargs: rows)
        bad = import_dataset(tmp_path / "bad", _ogb(tmp_path / "ogbn_bad", "node_feat"), features="in-place",
                             progress=False)  # fmt: skip
    assert verify(bad, progress=False).ok  # the checks of every open sample the rows
    report = verify(bad, progress=False, full=True)
    failed = [c for c in report.checks if not c.ok]
    assert [c.name for c in failed] == ["features (in place)"]
    assert "data.npz[node_feat]: its bytes do not match the archive's CRC-32" in failed[0].detail


# -- IGB: every paper of a size other than full has a label ------------------------------------------------------
def _igb(root: Path, labels: int) -> Path:
    rng = np.random.default_rng(1)
    p = root / "small" / "processed"
    (p / "paper").mkdir(parents=True)
    (p / "paper__cites__paper").mkdir()
    np.save(p / "paper" / "node_feat.npy", rng.random((N, 8)).astype(np.float32))
    np.save(p / "paper" / "node_label_19.npy", rng.integers(0, 19, labels).astype(np.float32))
    np.save(p / "paper__cites__paper" / "edge_index.npy", rng.integers(0, N, (E, 2)))
    return root


def test_igb_labels_for_part_of_the_papers_of_a_size_other_than_full_are_refused(tmp_path):
    root = _igb(tmp_path / "igb", N // 2)
    with pytest.raises(InputError, match=r"node_label_19.npy: 300 labels for 600 papers, but every paper of this size "
                                         r"has a label"):  # fmt: skip
        import_dataset(tmp_path / "out", root, progress=False)
    assert not (tmp_path / "out").exists()


# -- .npy headers that do not parse ---------------------------------------------------------------------------------
def test_a_npy_header_that_does_not_parse_is_one_line_naming_the_file(tmp_path, capsys):
    ds = make_synthetic(tmp_path / "ds", num_nodes=200, avg_degree=3, num_features=4, seed=0).root
    _spoil_header(ds / "labels.npy")
    assert main(["info", str(ds)]) == 2
    assert _error(capsys).startswith(f"lightning-ooc: error: {ds / 'labels.npy'}: not a readable .npy file (its "
                                     "header does not parse")  # fmt: skip
    assert main(["verify", "--no-progress", str(ds)]) == 1
    assert f"{ds / 'labels.npy'}: not a readable .npy file (its header does not parse" in capsys.readouterr().out
    rng = np.random.default_rng(2)
    good = {"x": rng.random((6, 3)).astype(np.float32), "edge-index": np.array([[0, 1, 2], [1, 2, 3]]),
            "y": np.array([0, 1, 0, 1, 0, 1]), "train": np.array([0, 1])}  # fmt: skip
    for k, a in good.items():
        np.save(tmp_path / f"{k}.npy", a)
    for k in good:
        bad = tmp_path / f"bad-{k}.npy"
        bad.write_bytes((tmp_path / f"{k}.npy").read_bytes())
        _spoil_header(bad)
        args = [a for o in good for a in (f"--{o}", str(bad if o == k else tmp_path / f"{o}.npy"))]
        assert main(["prepare", "--out", str(tmp_path / "out"), *args, "--no-progress"]) == 2, k
        assert _error(capsys).startswith(f"lightning-ooc: error: {bad}: "), k
    igb = _igb(tmp_path / "igb", N)
    for f in ("paper/node_feat.npy", "paper/node_label_19.npy", "paper__cites__paper/edge_index.npy"):
        path = igb / "small" / "processed" / f
        keep = path.read_bytes()
        _spoil_header(path)
        assert main(["prepare", "--from", "igb", str(igb), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
        assert _error(capsys).startswith(f"lightning-ooc: error: {path}: not a readable .npy"), f
        path.write_bytes(keep)
    assert not (tmp_path / "out").exists()


# -- input files that are not regular files -------------------------------------------------------------------------
def test_links_loops_fifos_and_devices_as_input_files_say_what_they_are(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.ones((4, 2), np.float32))
    np.save(tmp_path / "ei.npy", np.array([[0, 1], [1, 2]]))
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    os.mkfifo(tmp_path / "fifo")
    out = ["--out", str(tmp_path / "out"), "--no-progress"]
    cases = {("--x", "a"): "a symbolic link loop", ("--x", "/dev/zero"): "a character device, not a regular file",
             ("--y", "fifo"): "a FIFO (named pipe), not a regular file", ("--x", "fifo"): "a FIFO (named pipe)",
             ("--edge-index", "/dev/zero"): "a character device"}  # fmt: skip
    for (opt, name), says in cases.items():
        path = name if name.startswith("/") else str(tmp_path / name)
        given = {"--x": str(tmp_path / "x.npy"), "--edge-index": str(tmp_path / "ei.npy"), opt: path}
        assert main(["prepare", *[a for kv in given.items() for a in kv], *out]) == 2
        assert _error(capsys).startswith(f"lightning-ooc: error: {path}: {says}"), (opt, name)
    assert main(["prepare", "--edges", str(tmp_path / "fifo"), "--x", str(tmp_path / "x.npy"), *out]) == 2
    assert "fifo: a FIFO (named pipe), not a regular file (the edge list)" in _error(capsys)
    (tmp_path / "ogb" / "raw").mkdir(parents=True)
    os.mkfifo(tmp_path / "ogb" / "raw" / "data.npz")
    assert main(["prepare", "--from", "ogb", str(tmp_path / "ogb"), *out]) == 2
    assert "data.npz: a FIFO (named pipe), not a regular file (OGB's graph)" in _error(capsys)
    # used in place, a FIFO is not opened (opening it would wait for a writer): a separate process, so a wait
    # cannot hang the tests
    cmd = [sys.executable, "-m", "lightning_ooc", "prepare", "--edge-index", str(tmp_path / "ei.npy"), "--x",
           str(tmp_path / "fifo"), "--features", "in-place", *out]  # fmt: skip
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("opening the FIFO given as --x waited for a writer")
    assert run.returncode == 2 and "fifo: a FIFO (named pipe), not a regular file" in run.stderr
    assert not (tmp_path / "out").exists()


# -- GraphBolt -------------------------------------------------------------------------------------------------
def _graphbolt(root: Path, labels: int = 20, edges: str = "edges.npy") -> Path:
    rng = np.random.default_rng(3)
    root.mkdir()
    np.save(root / "edges.npy", rng.integers(0, 50, (2, 200)))
    np.save(root / "feat.npy", rng.random((50, 4)).astype(np.float32))
    np.save(root / "seeds.npy", np.arange(20))
    np.save(root / "labels.npy", rng.integers(0, 3, labels))
    data = [{"name": "seeds", "format": "numpy", "path": "seeds.npy"},
            {"name": "labels", "format": "numpy", "path": "labels.npy"}]  # fmt: skip
    meta = {"graph": {"nodes": [{"num": 50}], "edges": [{"format": "numpy", "path": edges}]},
            "feature_data": [{"domain": "node", "name": "feat", "format": "numpy", "path": "feat.npy"}],
            "tasks": [{"name": "nc", "num_classes": 3, "train_set": [{"data": data}]}]}  # fmt: skip
    (root / "metadata.yaml").write_text(yaml.safe_dump(meta))
    return root


def test_graphbolt_yaml_error_is_one_line_naming_the_file_and_line(tmp_path, capsys):
    root = tmp_path / "gb"
    root.mkdir()
    (root / "metadata.yaml").write_text("graph:\n  nodes: [ {num: 3}\n  edges: - x\n")
    assert main(["prepare", "--from", "graphbolt", str(root), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert _error(capsys).startswith(f"lightning-ooc: error: {root / 'metadata.yaml'}:3:3: not valid YAML (while "
                                     "parsing a flow sequence: expected ',' or ']'")  # fmt: skip


def test_graphbolt_paths_outside_the_dataset_directory_are_refused(tmp_path):
    outside = tmp_path / "elsewhere.npy"
    np.save(outside, np.zeros((2, 5), np.int64))
    for path in ("../../../etc/passwd", str(outside), "../elsewhere.npy"):
        root = _graphbolt(tmp_path / f"gb{len(path)}", edges=path)
        with pytest.raises(InputError, match=f"the path {path!r} leads outside the dataset's directory"):
            import_dataset(tmp_path / "out", root, progress=False)
    inside = _graphbolt(tmp_path / "gb", edges=str(tmp_path / "gb" / "sub" / ".." / "edges.npy"))
    assert lightning_ooc.open_dataset(import_dataset(tmp_path / "out", inside, progress=False)).num_edges == 200


def test_graphbolt_errors_name_the_set_as_metadata_yaml_does(tmp_path):
    root = _graphbolt(tmp_path / "gb", labels=19)
    with pytest.raises(InputError, match=r"metadata.yaml: the train_set has 20 seeds, 19 labels$") as e:
        import_dataset(tmp_path / "out", root, progress=False)
    assert "None" not in str(e.value)


# -- labels ----------------------------------------------------------------------------------------------------
def test_labels_of_fewer_than_two_classes_are_refused(tmp_path, capsys):
    ei, x = np.array([[0, 1, 2], [1, 2, 3]]), np.ones((6, 2), np.float32)
    for y, says in ((np.zeros(6, np.int64), "1 class"), (np.full(6, np.nan), "no labelled node")):
        with pytest.raises(InputError, match=f"the labels: {says}.*node classification needs two classes or more"):
            prepare_from_arrays(tmp_path / "g", ei, x, y, progress=False)
    np.save(tmp_path / "y.npy", np.array([0, 0, -1, 0, 0, 0]))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "ei.npy", ei)
    assert main(["prepare", "--edge-index", str(tmp_path / "ei.npy"), "--x", str(tmp_path / "x.npy"), "--y",
                 str(tmp_path / "y.npy"), "--out", str(tmp_path / "g"), "--no-progress"]) == 2  # fmt: skip
    assert f"{tmp_path / 'y.npy'} (the labels): 1 class" in _error(capsys)
    assert not (tmp_path / "g").exists()
    two = prepare_from_arrays(tmp_path / "g", ei, x, np.array([0, 1, 0, 1, 0, 1]), progress=False)
    assert lightning_ooc.open_dataset(two).num_classes == 2


@pytest.mark.parametrize("value, shown", [(np.inf, "inf"), (-np.inf, "-inf"), (1e30, "1e+30"), (0.5, "0.5")])
def test_a_label_that_is_not_a_whole_number_is_reported_as_given(tmp_path, value, shown):
    y = np.array([0.0, 1.0, value, 1.0, 0.0, 1.0])
    with pytest.raises(InputError, match=rf"found {re.escape(shown)} at node 2$"):
        prepare_from_arrays(tmp_path / "g", np.array([[0, 1], [1, 2]]), np.ones((6, 2), np.float32), y, progress=False)
