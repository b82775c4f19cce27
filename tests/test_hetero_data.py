"""OutOfCoreNodeData: PyG-shaped HeteroData batches with exact rows from the tiers of every node type,
in-order training equal to training from features in memory, budgets shared across types, clear errors,
two processes under strategy="ooc", and the LightningCLI config."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from jobs import _env

import lightning_ooc
from lightning_ooc import InMemory, Mapped, OutOfCoreLinkData, OutOfCoreNodeData, Tiered
from lightning_ooc.data.synth_hetero import synthesize_hetero
from lightning_ooc.errors import InputError
from lightning_ooc.models import RGAT
from lightning_ooc.store.planner import HeteroPlan
from lightning_ooc.store.typed_stores import HeteroFeatureStore

TESTS = Path(__file__).parent
REPO = TESTS.parent


@pytest.fixture(scope="module")
def igbh(tmp_path_factory):
    return synthesize_hetero(tmp_path_factory.mktemp("hd") / "igbh", "igbh", num_nodes=3000, num_features=16,
                             num_classes=4, train_frac=0.3, val_frac=0.1, test_frac=0.2, seed=0, progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def mag(tmp_path_factory):
    return synthesize_hetero(tmp_path_factory.mktemp("hd") / "mag", "mag", num_nodes=3000, num_features=16,
                             num_classes=4, train_frac=0.3, val_frac=0.1, test_frac=0.2, seed=0, progress=False)  # fmt: skip


TIERS = dict(gpu_cache="4MiB", host_cache="128KiB", staging="1MiB", presample_batches=8)


def _dm(cls, root, features=None, tiers=None, order="out_of_order", **kw):
    """A small datamodule: ``features`` a backend, or the tiers with ``tiers`` changed."""
    features = Tiered(**{**TIERS, **(tiers or {})}) if features is None else features
    pipeline = dict(num_extractors=2, num_samplers=2, train_queue_size=2, order=order)
    kw = {**dict(batch_size=128, num_neighbors=[4, 3], features=features, pipeline=pipeline, progress=False,
                 seed=0), **kw}  # fmt: skip
    return cls(root, **kw)


def test_batches_are_pyg_shaped_with_exact_rows(igbh):
    dm = _dm(OutOfCoreNodeData, igbh)
    dm.setup()
    ds = dm.dataset
    assert isinstance(dm.store, HeteroFeatureStore) and set(dm.store.stores) == set(ds.node_types)
    seen = []
    for batch in dm.train_dataloader():
        paper = batch["paper"]
        n = int(paper.batch_size)
        seen += paper.n_id[:n].tolist()
        assert paper.input_id.numel() == n and torch.equal(paper.y, torch.from_numpy(ds.node("paper").labels[paper.n_id.numpy()]))
        for t in ds.node_types:
            store = batch[t]
            assert torch.equal(store.x, ds.node(t).read_features(store.n_id))  # bit-exact from the tiers
            assert len(store.num_sampled_nodes) == 3 and sum(store.num_sampled_nodes) == store.n_id.numel()
            assert torch.unique(store.n_id).numel() == store.n_id.numel()
        for et in ds.edge_types:
            ei = batch[et].edge_index
            assert sum(batch[et].num_sampled_edges) == ei.shape[1]
            if ei.numel():  # local ids into the right types, edges of the relation
                src = batch[et[0]].n_id[ei[0]].numpy()
                dst = batch[et[2]].n_id[ei[1]].numpy()
                csc = ds.relation(et)
                for u, v in zip(src[:50], dst[:50]):
                    assert u in csc.indices[csc.indptr[v]:csc.indptr[v + 1]]
        batch.validate()
    assert sorted(seen) == sorted(ds.split("train").tolist())  # every seed once per epoch
    val = list(dm.val_dataloader())
    assert sum(int(b["paper"].batch_size) for b in val) == ds.split("val").numel()
    assert dm.last_stats["train"].seeds == len(seen) and dm.last_stats["train"].nodes > len(seen)
    dm.teardown()


def _fit(dm, epochs=2, seed=0):
    L.seed_everything(seed, workers=False)
    dm.setup()
    model = RGAT(dm.metadata, dm.in_channels, dm.num_classes, hidden_channels=16, num_layers=2, heads=2, lr=0.01,
                 dropout=0.0)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        deterministic=True)  # fmt: skip
    trainer.fit(model, datamodule=dm)
    acc = trainer.test(model, datamodule=dm, verbose=False)[0]["test_acc"]
    return model, acc


def test_in_order_training_equals_training_from_memory(igbh):
    ours, acc = _fit(_dm(OutOfCoreNodeData, igbh, order="in_order"))
    ram, acc_ram = _fit(_dm(OutOfCoreNodeData, igbh, features=Mapped(in_ram=True)))
    table, acc_table = _fit(_dm(OutOfCoreNodeData, igbh, features=InMemory(), order="in_order"))
    for (k, a), (_, b), (_, c) in zip(ours.state_dict().items(), ram.state_dict().items(), table.state_dict().items()):
        assert torch.equal(a, b) and torch.equal(a, c), k  # bit-identical: the same batches, the same rows
    assert acc == acc_ram == acc_table
    assert acc > 0.5, acc  # 4 classes: it learned
    _, acc_ooo = _fit(_dm(OutOfCoreNodeData, igbh, order="out_of_order"))
    assert acc_ooo > 0.5, acc_ooo


def test_mmap_baseline_gives_the_very_same_batches(igbh):
    ours = _dm(OutOfCoreNodeData, igbh, order="in_order")
    base = _dm(OutOfCoreNodeData, igbh, features=Mapped(madvise="random"))
    ours.setup()
    base.setup()
    assert base.source.features == "mmap"  # the synchronous baseline, not the tiers
    for a, b in zip(ours.train_dataloader(), base.train_dataloader()):
        for t in a.node_types:
            assert torch.equal(a[t].n_id, b[t].n_id) and torch.equal(a[t].x, b[t].x)
        for et in a.edge_types:
            assert torch.equal(a[et].edge_index, b[et].edge_index)
    ours.teardown()
    base.teardown()


def test_budgets_are_shared_across_types(igbh, mag):
    dm = _dm(OutOfCoreNodeData, igbh, tiers=dict(gpu_cache="6MiB", host_cache="256KiB", staging="2MiB"))
    dm.setup()
    plan = dm.plan
    assert isinstance(plan, HeteroPlan) and set(plan.plans) == set(dm.dataset.node_types)
    assert abs(sum(plan.shares.values()) - 1.0) < 1e-9
    assert plan.buffer_bytes <= 6 << 20 and plan.host_bytes <= 256 << 10
    # the types the batches touch most get the most: papers and authors, not the 2 conferences
    assert plan.shares["paper"] > plan.shares["conference"] and plan.shares["author"] > plan.shares["institute"]
    per_slot = {t: p.buffer_slots * p.row_bytes for t, p in plan.plans.items()}
    assert per_slot["paper"] > per_slot["conference"]
    assert "node type paper" in plan.format()
    dm.teardown()
    # types without features get no tiers at all
    dm = _dm(OutOfCoreNodeData, mag)
    dm.setup()
    assert set(dm.store.stores) == {"paper"}
    batch = next(iter(dm.train_dataloader()))
    assert "x" not in batch["author"] and batch["author"].n_id.numel() > 0
    dm.teardown()
    with pytest.raises(InputError, match="across node types"):
        _dm(OutOfCoreNodeData, igbh, tiers={"gpu_cache": "64KiB"}).setup()


def test_clear_errors(igbh, tmp_path):
    from lightning_ooc.data.synth import synthesize

    homo = synthesize(tmp_path / "g", num_nodes=300, avg_degree=3, num_features=4, num_classes=2, progress=False)
    # one datamodule for both kinds: the dataset says which; settings of node types on a homogeneous one, and
    # link prediction on a heterogeneous one, are refused with what to change
    assert _dm(OutOfCoreNodeData, homo).metadata is None and _dm(OutOfCoreNodeData, igbh).metadata is not None
    with pytest.raises(InputError, match="a homogeneous dataset has no node types or relations; input_type"):
        _dm(OutOfCoreNodeData, homo, input_type="paper").setup()
    with pytest.raises(InputError, match="a heterogeneous dataset; link prediction runs on homogeneous datasets"):
        _dm(OutOfCoreLinkData, igbh).setup()
    with pytest.raises(InputError, match="input_type 'author' of .* has no labels"):
        _dm(OutOfCoreNodeData, igbh, input_type="author").setup()
    with pytest.raises(InputError, match="input_type 'venue' is not a node type"):
        _dm(OutOfCoreNodeData, igbh, input_type="venue").setup()
    with pytest.raises(InputError, match="same number of hops"):
        OutOfCoreNodeData(igbh, num_neighbors={"paper__cites__paper": [2], "paper__written_by__author": [2, 2]})


def test_fanout_per_relation(igbh):
    ds = lightning_ooc.open_dataset(igbh)
    fan = {"__".join(et): ([3, 2] if et[1] == "cites" else [0, 0]) for et in ds.edge_types}  # YAML-style keys
    dm = _dm(OutOfCoreNodeData, igbh, num_neighbors=fan)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    for et in ds.edge_types:
        assert (batch[et].edge_index.shape[1] > 0) == (et[1] == "cites"), et
    assert batch["author"].n_id.numel() == 0  # no relation that reaches authors was sampled
    assert dm.hparams["num_neighbors"] == fan
    dm.teardown()


def test_batches_carry_each_relations_stored_edge_ids_on_request(igbh):
    """Issue 34: ``return_e_id=True`` puts ``e_id`` on every relation of a batch, as PyG's loaders do: the id of
    each sampled edge in that relation's stored CSC (none without it)."""
    import numpy as np

    dm = _dm(OutOfCoreNodeData, igbh, return_e_id=True, tiers={"host_cache_policy": "degree"})
    dm.setup("fit")
    try:
        ds, batch = dm.dataset, next(iter(dm.train_dataloader()))
        sampled = 0
        for et in ds.edge_types:
            ei, e_id, rel = batch[et].edge_index, batch[et].e_id, ds.relation(et)
            assert e_id.dtype == torch.int64 and e_id.numel() == ei.shape[1]
            e = e_id.numpy()
            assert (np.asarray(rel.indices)[e] == batch[et[0]].n_id[ei[0]].numpy()).all(), et
            assert (np.searchsorted(np.asarray(rel.indptr), e, side="right") - 1 == batch[et[2]].n_id[ei[1]].numpy()).all()
            sampled += e.size
        assert sampled > 0
    finally:
        dm.teardown("fit")
    dm = _dm(OutOfCoreNodeData, igbh, tiers={"host_cache_policy": "degree"})
    dm.setup("fit")
    try:
        assert all("e_id" not in s for s in next(iter(dm.train_dataloader())).edge_stores)
    finally:
        dm.teardown("fit")


def test_cli_fit_with_the_rgat_config(tmp_path):
    root = synthesize_hetero(tmp_path / "igbh-demo", "igbh", num_nodes=2000, num_features=8, num_classes=4,
                             train_frac=0.2, val_frac=0.05, test_frac=0.1, seed=0, progress=False)  # fmt: skip
    cmd = [sys.executable, "-m", "lightning_ooc", "fit", "--config", str(REPO / "configs" / "rgat_demo.yaml"),
           "--data.init_args.root", str(root), "--trainer.max_epochs", "1", "--trainer.logger", "false",
           "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.enable_checkpointing", "false"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "Testing DataLoader 0: 100%" in r.stdout  # test_after_fit ran the test pass too
    assert "node type paper" in r.stdout + r.stderr  # the plan, per node type


def test_a_failing_node_type_surfaces_and_leaves_the_store_usable(igbh):
    import threading

    dm = _dm(OutOfCoreNodeData, igbh)
    dm.setup()
    author = dm.store.stores["author"]

    def broken(ext, cancel=None):
        raise OSError(5, "injected read error in the author rows")

    author.fill = broken
    with pytest.raises(Exception, match="injected read error in the author rows"):
        list(dm.train_dataloader())
    del author.fill  # the instance's own method again
    seen = sum(int(b["paper"].batch_size) for b in dm.train_dataloader())  # every lease was given back
    assert seen == dm.dataset.split("train").numel()
    dm.teardown()
    assert not [t for t in threading.enumerate() if t.name.startswith("ooc-")]  # fill threads included
