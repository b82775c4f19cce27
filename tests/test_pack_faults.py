"""Packed minibatches against a changed dataset, a shared pack_dir and a tight memory limit: a pack is never
served for a feature file rewritten in place (size and time kept, other rows); a run removes the pack
directories that a killed run left for an earlier version of its dataset (``synth --overwrite``), and nothing
else in pack_dir: not another dataset's, not a running process's, not a file it did not write; pack_dir goes
through the output check (links resolved); and under a limit where the tiered backend plans, the packed one
lowers pack_memory before it refuses."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import lightning_ooc
import lightning_ooc.loader.packed_passes as packed_loader
import lightning_ooc.store.planner as planner
from lightning_ooc.data.synth import synthesize
from lightning_ooc.datamodule import OutOfCoreNodeData
from lightning_ooc.errors import DatasetWriteError
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.loader.features import Packed
from lightning_ooc.loader.packed_passes import PackedPasses
from lightning_ooc.store.limits import MemoryLimit

MiB = 1 << 20
KW = dict(num_neighbors=[4, 3], progress=False, seed=1,
          pipeline=dict(num_samplers=2, num_extractors=2, order="in_order"))  # fmt: skip
#: the packed backend's settings (its tiered ones and those of packing)
PACKED = dict(gpu_cache="2MiB", host_cache="8KiB", staging="256KiB", presample_batches=4, pack_memory="16MiB",
              pack_space=100)  # fmt: skip

#: runs that pack epoch 0 (and 1 beside it) and are then killed: their directories stay as a kill leaves them
_KILLED = textwrap.dedent("""
    import json, os, signal, sys
    from lightning_ooc.loader.config import NodeDataConfig
    from lightning_ooc.loader.context import ProcessContext
    from lightning_ooc.loader.features import Packed
    from lightning_ooc.loader.packed_passes import PackedPasses
    held = []
    for root, pack_dir, batch_size in json.loads(sys.argv[1]):
        kw = dict(json.loads(sys.argv[2]), batch_size=batch_size)
        features = Packed(pack_dir=pack_dir, **json.loads(sys.argv[3]))
        p = PackedPasses(NodeDataConfig(root, features=features, **kw), ProcessContext())
        list(p.run("train", 0))
        p.finish_packing(1)
        held.append(p)
    print(json.dumps([str(p.pack_dir) for p in held]), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _graph(path: Path, seed: int = 0, overwrite: bool = False) -> Path:
    return synthesize(path, num_nodes=3000, avg_degree=5, num_features=16, num_classes=3, train_frac=0.3, seed=seed,
                      progress=False, overwrite=overwrite)  # fmt: skip


def _killed_runs(*runs: tuple[Path, Path, int]) -> list[Path]:
    """Run ``(dataset, pack_dir, batch_size)`` packing in one process, killed with SIGKILL once they packed; their
    pack directories."""
    env = dict(os.environ, PYTHONPATH=str(Path(lightning_ooc.__file__).parents[1]), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _KILLED, json.dumps([[str(a), str(b), c] for a, b, c in runs]),
                        json.dumps(KW), json.dumps(PACKED)], env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    return [Path(p) for p in json.loads(r.stdout.strip().splitlines()[-1])]


def _passes(root: Path, pack_dir: Path, batch_size: int = 100) -> PackedPasses:
    cfg = NodeDataConfig(str(root), batch_size=batch_size, features=Packed(pack_dir=str(pack_dir), **PACKED), **KW)
    return PackedPasses(cfg, ProcessContext())


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_pack_is_never_served_for_a_feature_file_rewritten_in_place(tmp_path):
    root = _graph(tmp_path / "g")
    packs = tmp_path / "packs"
    (old_dir,) = _killed_runs((root, packs, 100))
    assert {"epoch-000000", "epoch-000001"} <= {p.name for p in old_dir.iterdir()}
    # every row rewritten in place: the same file, size and modification time; meta.json unchanged
    path = root / "features.bin"
    st = os.stat(path)
    rows = np.memmap(path, dtype=np.float32, mode="r+")
    rows[:] = -rows - 1.0
    rows.flush()
    del rows
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_ino, os.stat(path).st_size, os.stat(path).st_mtime_ns) == \
        (st.st_ino, st.st_size, st.st_mtime_ns)  # fmt: skip
    now = np.fromfile(path, dtype=np.float32).reshape(3000, 16)
    passes = _passes(root, packs)
    try:
        served = 0
        for epoch in range(2):
            run = passes.run("train", epoch)
            for batch in run:
                assert torch.equal(batch.x, torch.from_numpy(now[batch.n_id.numpy()])), f"epoch {epoch}: old rows"
                served += 1
            assert run.stats.extra["packed_sections"] == run.stats.batches > 0  # packed again, from the new rows
        assert served > 0
        assert not old_dir.exists()  # the stale packs of the killed run are gone
        assert [p.name for p in packs.iterdir()] == [passes.pack_dir.name]
    finally:
        passes.close()
    assert list(packs.iterdir()) == []


def test_a_run_removes_its_datasets_stale_pack_directories_and_nothing_else(tmp_path, caplog):
    root, other = _graph(tmp_path / "g"), _graph(tmp_path / "other", seed=2)
    packs = tmp_path / "packs"
    stale, stale_with_mine, of_other = _killed_runs((root, packs, 100), (root, packs, 120), (other, packs, 100))
    mine = stale_with_mine / "epoch-000000" / "mine.txt"  # a file the package did not write, in a pack of its own
    mine.write_text("notes")
    (packs / "notes.txt").write_text("keep")
    fake = packs / "rank0-0123456789abcdef"  # named like a pack directory, but not one of ours
    fake.mkdir()
    (fake / "data.bin").write_bytes(b"x" * 10)
    live = _passes(root, packs, batch_size=90)  # a run still going on the dataset as it was
    live_dir = live.pack_dir
    try:
        _graph(root, seed=7, overwrite=True)  # synth --overwrite: the same path, another dataset
        with caplog.at_level(logging.INFO, logger="lightning_ooc"):
            now = _passes(root, packs)
        try:
            assert not stale.exists()  # made for the dataset before it was overwritten
            assert mine.read_text() == "notes"  # of its pack, only the package's files went
            assert sorted(p.name for p in stale_with_mine.rglob("*")) == ["epoch-000000", "mine.txt"]
            assert any(str(stale) in r.getMessage() and "removed" in r.getMessage() for r in caplog.records)
            assert (of_other / "epoch-000000" / "manifest.json").is_file()  # another dataset's packs stay
            assert (packs / "notes.txt").read_text() == "keep" and (fake / "data.bin").read_bytes() == b"x" * 10
            assert (live_dir / "lock").is_file()  # held by a running process: left to it
            assert len(list(now.run("train", 0))) > 0
        finally:
            now.close()
    finally:
        live.close()
    assert not live_dir.exists() and not now.pack_dir.exists()  # clean closes remove their own directories


def test_a_file_put_into_a_pack_directory_is_never_deleted(tmp_path):
    root = _graph(tmp_path / "g")
    passes = _passes(root, tmp_path / "packs")
    try:
        list(passes.run("train", 0))
        mine = passes.pack_dir / "epoch-000000" / "mine.txt"
        mine.write_text("notes")
        list(passes.run("train", 1))  # epoch 0's pack goes once epoch 1 trains
        assert not (passes.pack_dir / "epoch-000000").exists()
    finally:
        passes.close()
    (kept,) = [p for p in passes.pack_dir.rglob("mine.txt")]
    assert kept.read_text() == "notes"
    assert _tree(passes.pack_dir) == ["epoch-000000.removed.partial", "epoch-000000.removed.partial/mine.txt"]


def test_pack_dir_is_checked_as_an_output_links_resolved(tmp_path):
    root = _graph(tmp_path / "g")
    (tmp_path / "elsewhere").symlink_to(root)  # a pack_dir spelled through a link into the dataset
    before = _tree(root)
    for given in (tmp_path / "elsewhere" / "packs", root / "packs"):
        with pytest.raises(DatasetWriteError, match="lies inside this command's input .*choose pack_dir outside it"):
            _passes(root, given)
    assert _tree(root) == before  # nothing was written into the dataset


def test_packed_plans_under_a_limit_where_the_tiered_backend_does(tmp_path, monkeypatch, caplog):
    # The proportions of 1.6 GiB over 12M nodes with default settings: the tiered plan fits as asked; with the
    # default pack_memory (256 MiB) taken first, even the packed one's smallest plan is about 4% of the limit short
    # (62 MiB there; 19 MiB of 456 here), so it lowers pack_memory and plans.
    root = synthesize(tmp_path / "g", num_nodes=20_000, avg_degree=5, num_features=32, num_classes=4,
                      train_frac=0.3, val_frac=0.1, test_frac=0.1, seed=0, progress=False)  # fmt: skip
    limit = MemoryLimit(456 * MiB, "a faked limit of 456 MiB")
    monkeypatch.setattr(planner, "limit_for_plan", lambda setting, root="/": limit)
    monkeypatch.setattr(packed_loader, "limit_for_plan", lambda setting, root="/": limit)
    tiered = OutOfCoreNodeData(str(root), progress=False)
    dm = OutOfCoreNodeData(str(root), features=Packed(pack_dir=str(tmp_path / "packs")), progress=False)
    tiered.setup()
    try:
        assert tiered.source.plan.memory_fit.shrunk == []
        with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
            dm.setup()
        try:
            src = dm.source
            assert src.pack_memory < 256 * MiB
            assert any("pack_memory lowered from 256.00 MiB" in r.getMessage()
                       and "set features.pack_memory=" in r.getMessage() for r in caplog.records)  # fmt: skip
            fit = src.plan.memory_fit
            assert fit.need + fit.reserve + src.pack_memory <= limit.bytes
            assert all(t.buffers.budget <= src.pack_memory // 2 for t in src.packed_tiers())
            got = {int(b.batch_index): b for b in src.run("train", 0)}  # out of order, as the default runs
            want = {int(b.batch_index): b for b in tiered.source.run("train", 0)}
            assert sorted(got) == sorted(want) == list(range(tiered.source.batches.count("train")))
            for k, b in want.items():
                assert torch.equal(got[k].n_id, b.n_id) and torch.equal(got[k].x, b.x), k
        finally:
            dm.teardown()
    finally:
        tiered.teardown()


def _in_place_graph(tmp_path: Path) -> tuple[Path, Path]:
    """A dataset that uses ``x.npy`` (2000 rows of 16 float32) in place: its directory and the file."""
    from lightning_ooc.data.prepare import prepare_from_arrays

    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((2000, 16)).astype(np.float32))
    root = prepare_from_arrays(tmp_path / "g", rng.integers(0, 2000, size=(2, 10000)), tmp_path / "x.npy",
                               rng.integers(0, 3, size=2000), features="in-place", progress=False)  # fmt: skip
    return Path(root), tmp_path / "x.npy"


@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "in_place"])
def test_a_feature_file_changed_while_it_is_packed_gives_no_pack(tmp_path, monkeypatch, in_place):
    """The pack is discarded, and the message names the feature file by the path the user knows it by (for a file
    used in place, its recorded path, not the held descriptor ``/proc/PID/fd/N`` the readers open)."""
    from lightning_ooc.loader.packed_passes import PackingError
    from lightning_ooc.store.pack_writing import EpochPackWriter

    root, path = _in_place_graph(tmp_path) if in_place else (_graph(tmp_path / "g"), tmp_path / "g" / "features.bin")
    passes = _passes(root, tmp_path / "packs")
    pack_features = EpochPackWriter.pack_features

    def rewritten_meanwhile(self):
        pack_features(self)
        with open(path, "r+b") as f:  # another writer, while the rows were being packed
            f.seek(128 if in_place else 0)  # past the .npy header: rows only
            f.write(bytes(64 << 10))

    monkeypatch.setattr(EpochPackWriter, "pack_features", rewritten_meanwhile)
    try:
        with pytest.raises(PackingError, match="changed while epoch 0 was packed") as e:
            passes.run("train", 0)
        assert [p.name for p in passes.pack_dir.iterdir() if p.name.startswith("epoch-")] == []
    finally:
        passes.close()
    assert f"failed: {os.path.realpath(path)}: a feature file changed" in str(e.value), str(e.value)
    assert "/proc/" not in str(e.value)


def test_a_feature_file_used_in_place_that_cannot_be_pinned_is_named_by_its_recorded_path(tmp_path, monkeypatch):
    from lightning_ooc.errors import DatasetError
    from lightning_ooc.store.packed_batches import file_fingerprint

    root, path = _in_place_graph(tmp_path)
    held = str(lightning_ooc.open_dataset(root).features_path)
    assert held.startswith("/proc/")
    real_open = os.open

    def refused(p, *args, **kwargs):
        if os.fspath(p) == held:
            raise PermissionError(13, "Permission denied", p)
        return real_open(p, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(DatasetError) as e:
        file_fingerprint(held, 128, 2000 * 64)
    assert str(e.value).startswith(f"{os.path.realpath(path)}: the feature file cannot be read to pin"), str(e.value)
    assert e.value.path == Path(os.path.realpath(path)) and "/proc/" not in str(e.value)
