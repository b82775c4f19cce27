"""Learnable input features: table rows through the tiers, updated by the gradient of x, written back safely."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import lightning as L
import numpy as np
import pytest
import torch

from lightning_ooc import Learnable, OutOfCoreNodeData
from lightning_ooc.data.synth import synthesize
from lightning_ooc.embed.rows import JOURNAL_FILE, TableRows
from lightning_ooc.embed.table import EmbeddingTable, init_embeddings, verify_table
from lightning_ooc.errors import InputError
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.loader.learnable_passes import LearnablePasses


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    d = tmp_path_factory.mktemp("learnable")
    # features of pure noise: what the classes are must be learnt through the graph
    return synthesize(d / "g", num_nodes=6000, avg_degree=8, num_features=4, num_classes=4, homophily=0.9,
                      class_separation=0.0, train_frac=0.3, val_frac=0.1, test_frac=0.1, seed=1,
                      progress=False)  # fmt: skip


def _table(tmp_path, graph, name="emb", dim=16):
    return init_embeddings(tmp_path / name, dataset=graph, dim=dim, init="normal", scale=0.1, seed=0, progress=False)


def test_gradient_of_x_updates_the_rows(tmp_path, graph):
    emb = _table(tmp_path, graph, dim=8)
    with EmbeddingTable(emb, writable=False) as t:
        before = t.rows(torch.arange(t.num_nodes))
    cfg = NodeDataConfig(graph, batch_size=64, num_neighbors=[4], pipeline={"order": "in_order"}, progress=False,
                         features=Learnable(emb, lr=0.05, gpu_cache="1MiB", staging="256KiB"))  # fmt: skip
    passes = LearnablePasses(cfg, ProcessContext())
    try:
        batch = next(iter(passes.run("train", epoch=0)))
        n_id = batch.n_id.clone()
        assert torch.equal(batch.x.detach(), before[n_id, :8])  # x is the embedding half of the rows
        w = torch.linspace(-1, 1, 8)
        (batch.x * w).sum().backward()
    finally:
        passes.close()  # flushes the trained rows
    with EmbeddingTable(emb) as t:
        after = t.rows(torch.arange(t.num_nodes))
        t.verify()
    g = w.expand(n_id.numel(), 8)
    state = g * g
    want = before[n_id, :8] - 0.05 * g / (state.sqrt() + 1e-10)
    assert torch.allclose(after[n_id, :8], want, atol=1e-6)
    assert torch.equal(after[n_id, 8:], state)
    others = torch.ones(after.shape[0], dtype=torch.bool)
    others[n_id] = False
    assert torch.equal(after[others], before[others])  # untouched rows unchanged


def _datamodule(graph, emb, gpu_cache):
    return OutOfCoreNodeData(graph, batch_size=32, num_neighbors=[3, 3], progress=False,
                             features=Learnable(emb, lr=0.1, gpu_cache=gpu_cache, staging="512KiB"),
                             pipeline=dict(order="in_order", num_samplers=2, num_extractors=1, train_queue_size=1))


def _fit(graph, emb, gpu_cache, epochs=2):
    from lightning_ooc.models import GraphSAGE

    L.seed_everything(0, workers=False)
    dm = _datamodule(graph, emb, gpu_cache)
    model = GraphSAGE(dm.num_features, 4, hidden_channels=32, num_layers=2, lr=0.01)
    written = []

    class Count(L.Callback):  # trained rows written back because their slot was reused
        def on_train_epoch_end(self, trainer, pl_module):
            written.append(dm.store.buffer.evicted_dirty)

    trainer = L.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        deterministic=True, callbacks=[Count()])  # fmt: skip
    trainer.fit(model, datamodule=dm)
    written = written[-1]
    res = trainer.test(model, datamodule=dm, verbose=False)[0]
    with EmbeddingTable(emb, writable=False) as t:
        rows = t.rows(torch.arange(t.num_nodes))
    return rows, res, written


def test_small_buffer_equals_large_buffer_and_learns(tmp_path, graph):
    """Rows evicted, written back and read again give the very run a buffer holding every row gives."""
    small = _table(tmp_path, graph, "small")
    large = _table(tmp_path, graph, "large")
    dm = _datamodule(graph, large, "64MiB")
    dm.setup()
    reserve = dm.plan.buffer_reserve  # the fewest slots the pipeline may run with
    dm.teardown()
    assert reserve < 6000 // 2
    rows_s, res_s, written_s = _fit(graph, small, (reserve + 64) * 2 * 16 * 4)
    rows_l, res_l, written_l = _fit(graph, large, "64MiB")
    assert written_s > 0 and written_l == 0  # the small buffer evicted trained rows during the epochs
    assert torch.equal(rows_s, rows_l)
    assert res_s["test_acc"] == res_l["test_acc"]
    assert res_s["test_acc"] > 0.5  # four classes: chance is 0.25; the noise features alone give nothing
    assert verify_table(small) == [] and verify_table(large) == []


def test_learnable_refuses_what_it_cannot_do(tmp_path, graph):
    with pytest.raises(InputError, match="needs its table"):
        OutOfCoreNodeData(graph, features="learnable")
    with pytest.raises(InputError, match="Learnable needs table"):
        OutOfCoreNodeData(graph, features=Learnable(table=""))
    with pytest.raises(InputError, match="features must be a feature backend or one of"):
        OutOfCoreNodeData(graph, features="random")
    emb = init_embeddings(tmp_path / "p2", dataset=graph, dim=4, partitions=2, progress=False)
    with pytest.raises(InputError, match="lr must be > 0"):
        Learnable(emb, lr=0)
    dm = OutOfCoreNodeData(graph, features=Learnable(emb, gpu_cache="1MiB", staging="256KiB"), batch_size=64,
                           num_neighbors=[2], progress=False)  # fmt: skip
    with pytest.raises(InputError, match="--partitions 1"):
        dm.setup()
    other = synthesize(tmp_path / "other", num_nodes=100, avg_degree=3, num_features=2, num_classes=2,
                       train_frac=0.5, progress=False)  # fmt: skip
    dm = OutOfCoreNodeData(other, features=Learnable(_table(tmp_path, graph, "x", 4), gpu_cache="1MiB",
                                                     staging="256KiB"),
                           batch_size=8, num_neighbors=[2], progress=False)  # fmt: skip
    with pytest.raises(InputError, match="6000 nodes"):
        dm.setup()


_ROW_WRITER = textwrap.dedent(
    """
    import sys, torch
    from lightning_ooc.embed.table import EmbeddingTable
    from lightning_ooc.embed.rows import TableRows
    t = EmbeddingTable(sys.argv[1])
    rows = TableRows(t)
    print("ready", flush=True)
    g = torch.Generator().manual_seed(0)
    k = 0
    while True:
        k += 1
        ids = torch.randperm(t.num_nodes, generator=g)[:500]
        rows.write(ids, torch.full((500, t.row_floats), float(k)))
        if k % 7 == 0:
            rows.checkpoint()
    """
)


def test_killed_row_writer_leaves_whole_rows(tmp_path):
    root = init_embeddings(tmp_path / "e", num_nodes=20000, dim=32, partitions=1, init="zeros", progress=False)
    rng = np.random.default_rng(0)
    for _ in range(3):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen([sys.executable, "-c", _ROW_WRITER, str(root)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.1, 0.5)))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        with EmbeddingTable(root) as t:  # replays the journal, checksums again
            rows = t.rows(torch.arange(t.num_nodes))
            t.verify()
        # every row is one write's: all its entries equal
        assert torch.equal(rows, rows[:, :1].expand_as(rows))
        assert (root / JOURNAL_FILE).stat().st_size == 0
        assert verify_table(root) == []


def test_torn_journal_end_is_dropped(tmp_path):
    root = init_embeddings(tmp_path / "e", num_nodes=100, dim=2, partitions=1, init="zeros", progress=False)
    with EmbeddingTable(root) as t:
        rows = TableRows(t)
        rows.write(torch.tensor([3]), torch.full((1, 4), 1.0))  # journalled and written; no checkpoint
        rows._journal.write(b"LOOCJRN1" + b"\x00" * 20)  # the start of a record whose writer died
        rows.close()
    with EmbeddingTable(root) as t:
        got = t.rows(torch.tensor([3, 4]))
        t.verify()
    assert got[0].tolist() == [1.0] * 4 and got[1].tolist() == [0.0] * 4
    assert (root / JOURNAL_FILE).stat().st_size == 0


def test_flush_between_fetch_and_step_keeps_the_update(tmp_path, graph):
    """A checkpoint's flush while a batch is fetched (x gathered) but not trained yet."""
    emb = _table(tmp_path, graph, dim=4)
    cfg = NodeDataConfig(graph, batch_size=64, num_neighbors=[3], pipeline={"order": "in_order"}, progress=False,
                         features=Learnable(emb, gpu_cache="1MiB", staging="256KiB"))  # fmt: skip
    passes = LearnablePasses(cfg, ProcessContext())
    try:
        it = iter(passes.run("train", epoch=0))
        a, b = next(it), next(it)  # Lightning holds the next batch while it trains one
        a.x.sum().backward()
        passes.flush()
        b.x.sum().backward()  # after the flush: still applied
        assert passes.store.updates == 2
        n_b = b.n_id.clone()
        passes.flush()
    finally:
        passes.close()
    with EmbeddingTable(emb, writable=False) as t:
        state = t.rows(n_b)[:, 4:]
    assert bool((state > 0).all())  # every row of the second batch got its Adagrad step


def test_an_error_writes_back_and_releases_the_table(tmp_path, graph):
    from lightning_ooc.models import GraphSAGE

    class Stop(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 5:
                raise RuntimeError("stopped by the test")

    emb = _table(tmp_path, graph, dim=8)
    dm = _datamodule(graph, emb, "4MiB")
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Stop()])  # fmt: skip
    with pytest.raises(RuntimeError, match="stopped by the test"):
        trainer.fit(GraphSAGE(8, 4, hidden_channels=8, num_layers=2), datamodule=dm)
    with EmbeddingTable(emb) as t:  # the lock is free, and the rows trained by 6 batches are on disk
        assert t.rows(torch.arange(t.num_nodes))[:, 8:].abs().sum() > 0
        t.verify()


def test_a_torn_journal_append_writes_nothing_in_place(tmp_path, monkeypatch):
    import lightning_ooc.embed.rows as rows_mod
    from lightning_ooc.io.io_errors import FeatureWriteError

    root = init_embeddings(tmp_path / "e", num_nodes=100, dim=2, partitions=1, init="zeros", progress=False)
    real = os.write

    def half(fd, data):  # the disk fills up in the middle of the record
        real(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    with EmbeddingTable(root) as t:
        rows = TableRows(t)
        rows.write(torch.tensor([1]), torch.full((1, 4), 1.0))
        size = (root / JOURNAL_FILE).stat().st_size
        monkeypatch.setattr(rows_mod.os, "write", half)
        with pytest.raises(FeatureWriteError, match=r"journal\.bin: cannot journal 1 row write-back.*No space") as err:
            rows.write(torch.tensor([2]), torch.full((1, 4), 2.0))
        assert err.value.errno == 28
        monkeypatch.setattr(rows_mod.os, "write", real)
        assert (root / JOURNAL_FILE).stat().st_size == size  # the torn record was cut off again
        rows.write(torch.tensor([3]), torch.full((1, 4), 3.0))  # and the next one follows a whole one
        rows.close()
    with EmbeddingTable(root) as t:  # replay: rows 1 and 3, never 2
        assert t.rows(torch.tensor([1, 2, 3]))[:, 0].tolist() == [1.0, 0.0, 3.0]


def test_a_damaged_table_is_refused_before_training(tmp_path, graph):
    from lightning_ooc.embed.table import verify_table
    from lightning_ooc.errors import CorruptDatasetError
    from lightning_ooc.models import GraphSAGE

    emb = _table(tmp_path, graph, dim=8)
    part = next(emb.glob("part-00000.*"))
    with open(part, "r+b") as f:
        f.seek(4096)
        f.write(b"\xff\xff\xff\x7f")
    dm = _datamodule(graph, emb, "4MiB")
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with pytest.raises(CorruptDatasetError, match="partition 0 is damaged"):
        trainer.fit(GraphSAGE(8, 4, hidden_channels=8, num_layers=2), datamodule=dm)
    assert any("partition 0" in p and "checksum" in p for p in verify_table(emb))  # not checksummed as good
    with EmbeddingTable(emb):  # the table was released
        pass
