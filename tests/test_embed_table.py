"""The embedding table on disk: creation, partitions read and written back, crash safety, checks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from lightning_ooc.embed.buckets import EdgeBuckets
from lightning_ooc.embed.table import EmbeddingTable, init_embeddings, partition_bounds, verify_table
from lightning_ooc.errors import CorruptDatasetError, DatasetError, DatasetWriteError, InputError


def _table(tmp_path, n=50, dim=6, parts=4, **kw):
    rng = np.random.default_rng(0)
    edges = kw.pop("edges", {"train": (rng.integers(0, n, 300), rng.integers(0, n, 300))})
    return init_embeddings(tmp_path / "emb", num_nodes=n, dim=dim, partitions=parts, edges=edges, progress=False, **kw)


def test_layout_and_initial_rows(tmp_path):
    root = _table(tmp_path, n=50, dim=6, parts=4, seed=3)
    with EmbeddingTable(root) as t:
        assert t.bounds.tolist() == partition_bounds(50, 4).tolist() == [0, 12, 25, 37, 50]
        rows = t.rows(torch.arange(50))
        assert rows.shape == (50, 12)
        assert torch.all(rows[:, 6:] == 0)  # Adagrad state starts at zero
        std = float(rows[:, :6].std())
        assert 0.5e-3 < std < 2e-3  # normal, std 1e-3
        for p in range(4):
            assert os.path.getsize(t.partition_path(p)) % 4096 == 0
            buf = t.empty_partition()
            assert buf.data_ptr() % 4096 == 0
            got = t.read_partition(p, buf)
            assert torch.equal(got, rows[t.bounds[p] : t.bounds[p + 1]])
    # the same arguments give the same bytes
    again = init_embeddings(tmp_path / "emb2", num_nodes=50, dim=6, partitions=4, seed=3,
                            edges={"train": (np.array([0]), np.array([1]))}, progress=False)  # fmt: skip
    with EmbeddingTable(again) as t2, EmbeddingTable(root, writable=False) as t1:
        assert torch.equal(t1.rows(torch.arange(50)), t2.rows(torch.arange(50)))


def test_write_back_switches_generation(tmp_path):
    root = _table(tmp_path)
    with EmbeddingTable(root) as t:
        buf = t.empty_partition()
        rows = t.read_partition(2, buf)
        rows[:] = 7.5
        assert t.write_partition(2, buf) == 1
        names = sorted(n for n in os.listdir(root) if n.startswith("part-00002"))
        assert names == ["part-00002.g00000001.bin"]  # the old generation is gone
        assert torch.all(t.rows(torch.arange(int(t.bounds[2]), int(t.bounds[3]))) == 7.5)
        assert t.updates == 1
    with EmbeddingTable(root, verify=True) as t:  # reopens at the new state, checksums match
        assert t.generation(2) == 1 and t.generation(1) == 0
    assert verify_table(root) == []


def test_buckets_hold_every_edge_once(tmp_path):
    rng = np.random.default_rng(1)
    src, dst, rel = rng.integers(0, 40, 500), rng.integers(0, 40, 500), rng.integers(0, 3, 500)
    root = init_embeddings(tmp_path / "e", num_nodes=40, dim=4, partitions=3, edges={"train": (src, rel, dst)},
                           progress=False)  # fmt: skip
    with EmbeddingTable(root) as t:
        assert t.num_relations == 3
        b = EdgeBuckets(root, "train", t.meta["buckets"]["train"])
        got = []
        for i in range(3):
            for j in range(3):
                s, d, r = b.edges(i, j)
                assert np.all(t.partition_of(s.numpy()) == i) and np.all(t.partition_of(d.numpy()) == j)
                got += list(zip(s.tolist(), r.tolist(), d.tolist()))
        assert sorted(got) == sorted(zip(src.tolist(), rel.tolist(), dst.tolist()))


def test_table_from_dataset_and_cli(tmp_path, demo_dataset):
    demo_dataset = demo_dataset.root
    from lightning_ooc.cli import main
    from lightning_ooc.data.dataset import open_dataset

    out = tmp_path / "t"
    assert main(["init-embeddings", str(demo_dataset), "--out", str(out), "--dim", "8", "--partitions", "3",
                 "--no-progress"]) == 0  # fmt: skip
    ds = open_dataset(demo_dataset)
    with EmbeddingTable(out) as t:
        assert t.num_nodes == ds.num_nodes and t.meta["buckets"]["train"]["edges"] == ds.num_edges
    assert main(["verify", str(out)]) == 0
    assert main(["info", str(out), "--json"]) == 0
    # an existing table is refused without --overwrite, replaced with it
    with pytest.raises(DatasetWriteError, match="already exists"):
        init_embeddings(out, dataset=demo_dataset, dim=8, partitions=3, progress=False)
    init_embeddings(out, dataset=demo_dataset, dim=4, partitions=2, overwrite=True, progress=False)
    with EmbeddingTable(out) as t:
        assert (t.dim, t.num_partitions) == (4, 2)


def test_bad_input_is_named(tmp_path):
    with pytest.raises(InputError, match="outside"):
        init_embeddings(tmp_path / "a", num_nodes=10, dim=4, partitions=2, edges={"train": ([0, 12], [1, 2])},
                        progress=False)  # fmt: skip
    with pytest.raises(InputError, match="cannot fill"):
        init_embeddings(tmp_path / "b", num_nodes=3, dim=4, partitions=5, edges={"train": ([0], [1])},
                        progress=False)  # fmt: skip
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_damage_is_reported(tmp_path):
    root = _table(tmp_path)
    part = next(root.glob("part-00001.*"))
    with open(part, "r+b") as f:  # flip a byte
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    problems = verify_table(root)
    assert problems and "partition 1" in problems[0]
    os.truncate(part, 4096 * 0 + 8)
    with pytest.raises(CorruptDatasetError, match="bytes, partition 1 needs"):
        EmbeddingTable(root)
    state = json.loads((root / "state.json").read_text())
    state["generations"][0] = 5
    (root / "state.json").write_text(json.dumps(state))
    with pytest.raises(CorruptDatasetError, match="state"):
        EmbeddingTable(root)


def test_one_writer_at_a_time(tmp_path):
    root = _table(tmp_path)
    with EmbeddingTable(root):
        with pytest.raises(DatasetError, match="open for writing by pid"):
            EmbeddingTable(root)
        with EmbeddingTable(root, writable=False) as ro:  # readers are fine
            with pytest.raises(DatasetError, match="read-only"):
                ro.write_partition(0, ro.empty_partition())


def test_full_disk_fails_before_writing(tmp_path, monkeypatch):
    root = _table(tmp_path)
    import lightning_ooc.io.bulk as bulk

    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with EmbeddingTable(root) as t:
        buf = t.empty_partition()
        t.read_partition(0, buf)
        with pytest.raises(OSError) as e:
            t.write_partition(0, buf)
        assert "space" in str(e.value).lower() or e.value.errno == 28
        monkeypatch.setattr(os, "posix_fallocate", real)
        assert t.generation(0) == 0
        assert sorted(n for n in os.listdir(root) if n.startswith("part-00000")) == ["part-00000.g00000000.bin"]
    assert verify_table(root) == []
    del bulk


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from lightning_ooc.embed import table as tbl
    root, mode = sys.argv[1], sys.argv[2]
    if mode == "die-before-switch":      # killed after the new generation is written, before state.json moves
        def die(*a, **k):
            import os; os._exit(9)
        tbl.write_state = die
    elif mode == "die-after-switch":     # killed after state.json moved, before the old file is removed
        real = tbl.write_state
        def die(*a, **k):
            real(*a, **k); import os; os._exit(9)
        tbl.write_state = die
    t = tbl.EmbeddingTable(root)
    buf = t.empty_partition()
    print("ready", flush=True)
    k = 0
    while True:
        k += 1
        for p in range(t.num_partitions):
            t.rows_view(p, buf).fill_(float(k))
            t.write_partition(p, buf)
    """
)


def _writer(root, mode="loop"):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root), mode], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"ready"
    return proc


def _complete(root):
    """Reopen (sweeping leftovers) and check the table is a complete state: each partition whole."""
    with EmbeddingTable(root, verify=True) as t:
        values = []
        for p in range(t.num_partitions):
            emb = t.rows(torch.arange(int(t.bounds[p]), int(t.bounds[p + 1])))
            # a partition is one write-back's bytes, never a mix of two
            assert torch.unique(emb).numel() == 1, f"partition {p} is torn"
            values.append(float(emb[0, 0]))
        names = [n for n in os.listdir(root) if n.startswith("part-")]
        assert len(names) == t.num_partitions, names  # leftovers of the killed writer were removed
    assert verify_table(root) == []
    return values


@pytest.mark.parametrize("mode,gen", [("die-before-switch", 0), ("die-after-switch", 1)])
def test_killed_at_the_switch(tmp_path, mode, gen):
    root = _table(tmp_path, parts=3, init="zeros")
    proc = _writer(root, mode)
    assert proc.wait(timeout=60) == 9
    with EmbeddingTable(root) as t:
        assert t.generation(0) == gen
    # before the switch the table keeps the initial rows of partition 0; after it, the written ones
    assert _complete(root) == [float(gen), 0.0, 0.0]


def test_killed_during_write_backs(tmp_path):
    root = _table(tmp_path, n=4000, dim=64, parts=4, init="zeros")  # ~0.5 MiB partitions: kills land mid-write
    rng = np.random.default_rng(0)
    for _ in range(4):
        proc = _writer(root)
        time.sleep(float(rng.uniform(0.05, 0.4)))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        _complete(root)  # every partition holds what one write-back (or the creation) wrote


def _flip(path, offset, n=4):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(n)
        f.seek(offset)
        f.write(bytes(x ^ 0xFF for x in b))


def test_a_damaged_partition_is_never_read_nor_checksummed_again(tmp_path):
    from lightning_ooc.embed.partition_buffer import PartitionBuffer

    root = _table(tmp_path, n=400, dim=16, parts=2)  # 200 rows of 128 bytes a partition
    part = next(root.glob("part-00001.*"))
    _flip(part, 4096)
    assert any("partition 1" in p for p in verify_table(root))
    with EmbeddingTable(root) as t:
        with pytest.raises(CorruptDatasetError, match=r"part-00001\..*partition 1 is damaged"):
            t.read_partition(1, t.empty_partition())
        with pytest.raises(CorruptDatasetError, match="partition 1 is damaged"):
            t.rows(torch.tensor([250]))
        assert t.rows(torch.tensor([5])).shape == (1, 32)  # the sound partition still reads
        buf = PartitionBuffer(t, capacity=2)
        try:
            with pytest.raises(CorruptDatasetError, match="partition 1 is damaged"):
                buf.ensure([0, 1])
            assert buf.resident() == [0]
            buf.mark_dirty([0])
            buf.flush()  # the sound one is written back; the damaged one never entered the buffer
        finally:
            buf.close()
        assert t.generation(1) == 0 and t.generation(0) == 1
    problems = verify_table(root)  # still reported: nothing re-checksummed it as good
    assert len(problems) == 1 and "partition 1" in problems[0]


def test_row_writes_refuse_a_damaged_partition(tmp_path):
    from lightning_ooc.embed.rows import TableRows

    root = _table(tmp_path, n=400, dim=16, parts=2)
    _flip(next(root.glob("part-00000.*")), 4096)
    with EmbeddingTable(root) as t:
        rows = TableRows(t)
        try:
            with pytest.raises(CorruptDatasetError, match="partition 0 is damaged"):
                rows.write(torch.tensor([3]), torch.zeros(1, 32))
            rows.checkpoint()
        finally:
            rows.close()
    assert any("partition 0" in p and "checksum" in p for p in verify_table(root))


def test_a_table_held_by_a_run_is_never_replaced(tmp_path):
    """`init-embeddings --overwrite` of a table a trainer holds open is refused with the trainer's pid; the
    trainer's table and its writes stay as they were."""
    root = _table(tmp_path, n=40, dim=4, parts=2)
    with EmbeddingTable(root) as held:
        with pytest.raises(DatasetWriteError, match=rf"open for writing by pid {os.getpid()}.*nothing was touched"):
            _table(tmp_path, n=40, dim=4, parts=2, overwrite=True, seed=5)
        buf = held.empty_partition()
        held.read_partition(0, buf)
        assert held.write_partition(0, buf) == 1  # the run goes on writing into its own table
    assert verify_table(root) == []
    again = _table(tmp_path, n=40, dim=4, parts=2, overwrite=True, seed=5)  # released: replaced
    with EmbeddingTable(again) as t:
        assert t.generation(0) == 0


def test_a_writer_replacing_a_table_keeps_runs_out_until_it_is_done(tmp_path, monkeypatch):
    """While --overwrite writes the new table, a run cannot open the old one for writing."""
    from lightning_ooc.data.writer import WriteTarget

    root = _table(tmp_path, n=40, dim=4, parts=2)
    target = WriteTarget(root, overwrite=True)
    try:
        with pytest.raises(DatasetError, match=f"open for writing by pid {os.getpid()}"):
            EmbeddingTable(root)
    finally:
        target.abort()
    with EmbeddingTable(root):  # the abandoned write released it
        pass


def test_a_table_replaced_under_a_run_is_named(tmp_path):
    """Something that takes no lock swaps the directory: the run's next write-back or read says so, and
    writes nothing into the new directory."""
    import shutil

    root = _table(tmp_path, n=40, dim=4, parts=2)
    with EmbeddingTable(root) as t:
        buf = t.empty_partition()
        t.read_partition(0, buf)
        shutil.move(root, tmp_path / "moved")
        _table(tmp_path, n=40, dim=4, parts=2, seed=7)
        names = sorted(os.listdir(root))
        from lightning_ooc.errors import DatasetChangedError

        with pytest.raises(DatasetChangedError, match="replaced or removed while this run used it"):
            t.write_partition(0, buf)
        with pytest.raises(DatasetChangedError, match="replaced or removed"):
            t.read_partition(1, buf)
        assert sorted(os.listdir(root)) == names
    assert verify_table(root) == []
