"""Partition-buffer training: batches cover every edge once, out of core equals in memory, it learns,
and a failing swap surfaces without losing trained rows."""
from __future__ import annotations

import threading

import lightning as L
import numpy as np
import pytest
import torch

from lightning_ooc.embed import ChunkNegatives, OutOfCoreEmbeddingData, PartitionBuffering, init_embeddings
from lightning_ooc.embed.table import EmbeddingTable

#: 8 negatives shared by each chunk of 32 edges
NEG8 = ChunkNegatives(num=8, chunk_size=32)


def planted(n=400, communities=8, train=6000, held=300, seed=0):
    """Edges inside random communities (not aligned with the partitions); val/test held out."""
    rng = np.random.default_rng(seed)
    comm = rng.integers(0, communities, n)
    members = [np.flatnonzero(comm == c) for c in range(communities)]
    pairs = set()
    while len(pairs) < train + 2 * held:
        c = int(rng.integers(0, communities))
        a, b = rng.choice(members[c], 2, replace=False)
        pairs.add((int(a), int(b)))
    e = np.array(sorted(pairs))
    e = e[rng.permutation(len(e))]
    split = {"train": e[:train], "val": e[train : train + held], "test": e[train + held :]}
    return {k: (v[:, 0], v[:, 1]) for k, v in split.items()}


@pytest.fixture(scope="module")
def planted_edges():
    return planted()


def make_table(tmp_path, edges, parts=5, dim=16, name="emb", n=400):
    return init_embeddings(tmp_path / name, num_nodes=n, dim=dim, partitions=parts, edges=edges, init="normal",
                           scale=0.1, seed=0, progress=False)  # fmt: skip


def test_every_edge_once_per_epoch_and_rows_match(tmp_path, planted_edges):
    root = make_table(tmp_path, planted_edges)
    dm = OutOfCoreEmbeddingData(root, batch_size=128, negatives=NEG8)
    dm.setup("fit")
    try:
        with EmbeddingTable(root, writable=False) as ref:
            want = ref.rows(torch.arange(400))[:, :16]
        seen = []
        run = dm.train_dataloader()
        for b in run:
            i, j = b.bucket
            assert set(dm.buffer.resident()) >= {i, j}
            # the rows a batch indexes are the table's rows of its nodes (nothing trained here)
            assert torch.equal(b.weight[b.src_rows], want[b.src]) and torch.equal(b.weight[b.dst_rows], want[b.dst])
            assert torch.equal(b.weight[b.neg_dst_rows], want[b.neg_dst])
            lo_j, hi_j = dm.table.bounds[j], dm.table.bounds[j + 1]
            assert int(b.neg_dst.min()) >= lo_j and int(b.neg_dst.max()) < hi_j  # tails from the dst partition
            seen += list(zip(b.src.tolist(), b.dst.tolist()))
        src, dst = planted_edges["train"]
        assert sorted(seen) == sorted(zip(src.tolist(), dst.tolist()))
        st = dm.last_stats["train"]
        assert st.swaps == dm.order.num_swaps > 0
        assert st.bytes_read > 0
    finally:
        dm.teardown("fit")


def _fit(root, *, in_memory, epochs=3, score="distmult"):
    from lightning_ooc.models.kge import KGEModel

    L.seed_everything(0, workers=False)
    dm = OutOfCoreEmbeddingData(root, batch_size=256, buffer=PartitionBuffering(partitions=3, in_memory=in_memory),
                                negatives=ChunkNegatives(num=32, chunk_size=64, eval=64))  # fmt: skip
    model = KGEModel(num_relations=1, dim=16, score=score, lr=0.1)
    trainer = L.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        deterministic=True)  # fmt: skip
    trainer.fit(model, datamodule=dm)
    swaps = dm.last_stats["train"].swaps
    res = trainer.test(model, datamodule=dm, verbose=False)[0]
    with EmbeddingTable(root, writable=False) as t:
        emb = t.rows(torch.arange(t.num_nodes))
    return emb, res, swaps


def test_out_of_core_equals_in_memory(tmp_path, planted_edges):
    a = make_table(tmp_path, planted_edges, name="ooc")
    b = make_table(tmp_path, planted_edges, name="mem")
    emb_ooc, res_ooc, swaps_ooc = _fit(a, in_memory=False)
    emb_mem, res_mem, swaps_mem = _fit(b, in_memory=True)
    assert swaps_ooc > 0 and swaps_mem == 0
    assert torch.equal(emb_ooc, emb_mem)  # embeddings and Adagrad state, bit for bit
    assert res_ooc["test_mrr"] == res_mem["test_mrr"]
    # and it learned: well above a random ranking among 64 negatives (filtered)
    from lightning_ooc.models.link_predictor import random_mrr

    assert res_ooc["test_mrr"] > 4 * random_mrr(64)


class _FailingWrite(Exception):
    pass


def test_failed_write_back_surfaces_and_keeps_rows(tmp_path, planted_edges, monkeypatch):
    root = make_table(tmp_path, planted_edges)
    dm = OutOfCoreEmbeddingData(root, batch_size=128, negatives=NEG8)
    dm.setup("fit")
    table = dm.table
    real = type(table).write_partition
    calls = {"n": 0}

    def failing(self, p, buf):
        calls["n"] += 1
        raise _FailingWrite(f"disk gone while writing partition {p}")

    monkeypatch.setattr(type(table), "write_partition", failing)
    before = threading.active_count()
    trained = {}
    with pytest.raises(_FailingWrite):
        for b in dm.train_dataloader():  # a plain loop attaches in next(); "train" by changing rows
            with torch.no_grad():
                b.weight[b.src_rows] += 1.0
            b.done()
            trained.update({p: True for p in b.bucket})
    assert calls["n"] == 1
    evicted = dm.order.states[0].evict
    # the partition whose write-back failed is still in the buffer, still dirty: nothing was lost
    assert evicted in dm.buffer.resident() and evicted in dm.buffer.dirty()
    assert threading.active_count() <= before  # the pass's swap thread is gone
    monkeypatch.setattr(type(table), "write_partition", real)
    rows_before = dm.buffer.weight[dm.buffer.rows_of(torch.arange(int(table.bounds[evicted]),
                                                                  int(table.bounds[evicted + 1])))].clone()  # fmt: skip
    n = sum(1 for _ in dm.train_dataloader())  # the next pass runs
    assert n == dm.num_batches("train")
    dm.teardown("fit")
    with EmbeddingTable(root, writable=False) as t:
        lo, hi = int(t.bounds[evicted]), int(t.bounds[evicted + 1])
        assert torch.equal(t.rows(torch.arange(lo, hi))[:, :16], rows_before)


def test_kge_from_yaml(tmp_path, planted_edges, capsys):
    """`lightning-ooc fit --config configs/kge_demo.yaml`: the datamodule named by class_path, dim and
    num_relations of the model taken from the table, test metrics after fit."""
    from pathlib import Path

    import yaml

    import lightning_ooc
    from lightning_ooc.cli import main

    src, rel = planted_edges["train"][0], np.arange(len(planted_edges["train"][0])) % 2
    edges = dict(planted_edges, train=(src, rel, planted_edges["train"][1]))
    root = init_embeddings(tmp_path / "t", num_nodes=400, dim=8, partitions=4, edges=edges, scale=0.1, progress=False)
    config = Path(lightning_ooc.__file__).resolve().parents[1] / "configs" / "kge_demo.yaml"
    assert yaml.safe_load(config.read_text())["data"]["class_path"] == "lightning_ooc.OutOfCoreEmbeddingData"
    out = tmp_path / "run"
    rc = main(["fit", "--config", str(config), "--data.table", str(root), "--data.batch_size", "256",
               "--data.negatives.eval", "50", "--trainer.max_epochs", "2", "--trainer.accelerator", "cpu",
               "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
               "--trainer.enable_progress_bar", "false", f"--trainer.default_root_dir={out}"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err[-3000:]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["init_args"]["num_relations"] == 2  # filled in from the table
    with EmbeddingTable(root, writable=False) as t:
        assert t.updates > 0  # trained partitions were written back


def test_buffer_over_the_memory_limit_is_refused(tmp_path, planted_edges, monkeypatch):
    from lightning_ooc.errors import InputError
    from lightning_ooc.store import limits

    root = make_table(tmp_path, planted_edges)
    monkeypatch.setattr(limits, "memory_limit", lambda *a, **k: limits.MemoryLimit(20_000, "a test limit of 20 KB"))
    dm = OutOfCoreEmbeddingData(root, batch_size=128)
    with pytest.raises(InputError, match="lower buffer.partitions.*--partitions"):
        dm.setup("fit")
    with EmbeddingTable(root):  # the refused set-up released the table
        pass


def _trainer(**kw):
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, deterministic=True, **kw)


def test_swaps_overlap_training_under_a_trainer(tmp_path, planted_edges):
    from lightning_ooc.models.kge import KGEModel

    root = make_table(tmp_path, planted_edges, parts=6)
    dm = OutOfCoreEmbeddingData(root, batch_size=64, negatives=NEG8)
    _trainer(max_epochs=1).fit(KGEModel(dim=16), datamodule=dm)
    st = dm.last_stats["train"]
    # every swap of Legend's order for 6 partitions has buckets to train while it runs, and a Trainer's
    # batches (moved to the device by Lightning) start it there
    assert st.swaps == dm.order.num_swaps == 7
    assert st.overlapped == sum(1 for s in dm.order.states if s.evict is not None and s.during) == 7


class _StopAt(L.Callback):
    def __init__(self, n):
        self.n = n

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.n:
            raise RuntimeError("stopped by the test")


def test_an_error_writes_back_and_releases_the_table(tmp_path, planted_edges):
    from lightning_ooc.models.kge import KGEModel

    root = make_table(tmp_path, planted_edges)
    with EmbeddingTable(root, writable=False) as t:
        before = t.rows(torch.arange(400))
    dm = OutOfCoreEmbeddingData(root, batch_size=64, negatives=NEG8)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        _trainer(max_epochs=1, callbacks=[_StopAt(20)]).fit(KGEModel(dim=16), datamodule=dm)
    assert dm.buffer is None  # let go
    with EmbeddingTable(root) as t:  # the lock is free; what the 20 batches trained is on disk
        after = t.rows(torch.arange(400))
        assert t.updates > 0
    assert not torch.equal(after, before)


def test_a_checkpoint_between_fetch_and_step_loses_nothing(tmp_path, planted_edges):
    """A flush (checkpoint) while Lightning holds the next batch, fetched and not trained yet."""
    from lightning_ooc.models.kge import KGEModel

    class Flush(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx % 3 == 0:
                trainer.datamodule.state_dict()  # what saving a checkpoint calls

    rows = []
    for name, callbacks in (("plain", []), ("flushed", [Flush()])):
        root = make_table(tmp_path, planted_edges, name=name)
        L.seed_everything(0, workers=False)
        dm = OutOfCoreEmbeddingData(root, batch_size=64, negatives=NEG8)
        _trainer(max_epochs=1, callbacks=callbacks).fit(KGEModel(dim=16), datamodule=dm)
        with EmbeddingTable(root, writable=False) as t:
            rows.append(t.rows(torch.arange(400)))
    assert torch.equal(rows[0], rows[1])


def test_filtered_ranking_against_every_node_looks_in_every_bucket(tmp_path):
    # 2 partitions ([0, 5), [5, 10)); the val edge 0 -> 1; train edges 0 -> 2 (same bucket) and 0 -> 7 (another)
    root = init_embeddings(tmp_path / "f", num_nodes=10, dim=4, partitions=2, progress=False,
                           edges={"train": ([0, 0], [2, 7]), "val": ([0], [1])})  # fmt: skip
    dm = OutOfCoreEmbeddingData(root, buffer={"partitions": 2}, negatives={"eval": "all", "filtered": True})
    dm.setup()
    try:
        (b,) = list(dm.val_dataloader())
        tails = sorted(b.neg_dst[0, b.dst_filter[1]].tolist())
        assert tails == [1, 2, 7]  # the edge itself and both stored edges of (0, r), whatever their partition
    finally:
        dm.teardown()


def test_fit_on_a_damaged_partition_stops_and_names_it(tmp_path, planted_edges):
    """A flipped word in a partition: the fit stops with an error naming it, instead of training on it and
    writing it back (NaN spreading, then checksummed as good)."""
    from lightning_ooc.embed.table import verify_table
    from lightning_ooc.errors import CorruptDatasetError
    from lightning_ooc.models.kge import KGEModel

    root = make_table(tmp_path, planted_edges, parts=4)  # 100 rows of 128 bytes a partition
    part = next(root.glob("part-00002.*"))
    with open(part, "r+b") as f:
        f.seek(4096)
        f.write(np.frombuffer(b"\xff\xff\xff\x7f", dtype=np.uint8).tobytes())  # a NaN
    dm = OutOfCoreEmbeddingData(root, batch_size=128, negatives=NEG8)
    with pytest.raises(CorruptDatasetError, match=r"part-00002\..*partition 2 is damaged"):
        _trainer(max_epochs=2).fit(KGEModel(dim=16), datamodule=dm)
    problems = verify_table(root)
    assert len(problems) == 1 and "partition 2" in problems[0]
    with EmbeddingTable(root) as t:  # released, and the damaged partition was never written back
        assert t.generation(2) == 0


@pytest.fixture()
def small_graph_and_table(tmp_path):
    from lightning_ooc.data.synth import synthesize

    g = synthesize(tmp_path / "g", num_nodes=300, avg_degree=4, num_features=4, num_classes=2, progress=False)
    t = init_embeddings(tmp_path / "t", dataset=g, dim=4, partitions=2, progress=False)
    return g, t


@pytest.mark.parametrize("case", ["missing table", "dataset as table", "GraphSAGE on a table",
                                  "learnable, missing table", "learnable, dataset as table"])  # fmt: skip
def test_wrong_tables_are_one_line(small_graph_and_table, tmp_path, capsys, case):
    from pathlib import Path

    import lightning_ooc
    from lightning_ooc.cli import main

    g, t = small_graph_and_table
    configs = Path(lightning_ooc.__file__).resolve().parents[1] / "configs"
    run = ["--trainer.max_epochs", "1", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
           "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
           f"--trainer.default_root_dir={tmp_path / 'run'}"]  # fmt: skip
    kge = ["fit", "--config", str(configs / "kge_demo.yaml"), "--data.batch_size", "64", "--data.negatives.eval", "8"]
    node = ["fit", "--config", str(configs / "demo.yaml"), "--data.root", str(g), "--data.features", "Learnable"]
    argv, want = {
        "missing table": (kge + ["--data.table", str(tmp_path / "nope")], "no such embedding table"),
        "dataset as table": (kge + ["--data.table", str(g)], "is a dataset, not an embedding table"),
        "GraphSAGE on a table": (kge + ["--data.table", str(t), "--model.class_path", "lightning_ooc.models.GraphSAGE"],
                                 "gives embedding batches.*KGE model"),
        "learnable, missing table": (node + ["--data.features.table", str(tmp_path / "nope")],
                                     "no such embedding table"),
        "learnable, dataset as table": (node + ["--data.features.table", str(g)],
                                        "is a dataset, not an embedding table"),
    }[case]
    rc = main(argv + run)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    line = [x for x in err.splitlines() if x.startswith("lightning-ooc: error:")]
    assert len(line) == 1 and __import__("re").search(want, line[0]), err[-3000:]


def test_init_embeddings_refuses_bad_options_in_one_line(small_graph_and_table, tmp_path, capsys):
    from lightning_ooc.cli import main
    from lightning_ooc.data.synth_hetero import synthesize_hetero

    g, _ = small_graph_and_table
    for scale in ("-1", "nan", "inf"):
        assert main(["init-embeddings", str(g), "--out", str(tmp_path / "e"), "--dim", "4", "--init-scale", scale]) == 2
        assert "--init-scale" in capsys.readouterr().err
    h = synthesize_hetero(tmp_path / "h", "igbh", num_nodes=200, progress=False)
    assert main(["init-embeddings", str(h), "--out", str(tmp_path / "e"), "--dim", "4"]) == 2
    assert "heterogeneous dataset" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
