"""OutOfCoreLinkData / LinkPasses: PyG LinkNeighborLoader's batches, features from the tiers, orders, ranks,
seed-edge exclusion, a link model that learns, and the errors."""
import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lightning_ooc
from lightning_ooc import InputError, Mapped, OutOfCoreLinkData, Tiered
from lightning_ooc.data.prepare import prepare_from_arrays
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.loader.link_task import LinkDataConfig, LinkPasses, LinkTask, SyncLinkPasses

N, CLASSES, DIM = 400, 4, 8
TIERS = dict(gpu_cache="1MiB", host_cache="16KiB", staging="256KiB")
SMALL = dict(features=Tiered(**TIERS), progress=False, memory_limit=None)
ONE = dict(num_samplers=1, num_extractors=1)


def _planted(n=N, classes=CLASSES, dim=DIM, edges=2400, within=0.9, seed=0):
    """Edges mostly inside planted classes, features near their class's centre, labels the classes."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    members = [np.flatnonzero(y == c) for c in range(classes)]
    src = rng.integers(0, n, edges)
    same = rng.random(edges) < within
    dst = np.where(same, [rng.choice(members[y[s]]) for s in src], rng.integers(0, n, edges))
    keep = src != dst
    centres = rng.normal(size=(classes, dim)) * 2
    x = (centres[y] + rng.normal(size=(n, dim))).astype(np.float32)
    return np.stack([src[keep], dst[keep]]).astype(np.int64), x, y


@pytest.fixture(scope="module")
def link_root(tmp_path_factory):
    ei, x, y = _planted()
    return prepare_from_arrays(tmp_path_factory.mktemp("links") / "g", ei, x, y, add_reverse=True,
                               split_edges=(0.8, 0.1, 0.1), progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def labelled_root(tmp_path_factory):
    """Given link splits: train edges with 0/1 labels, val with labels, test with given negative destinations."""
    ei, x, y = _planted(seed=1)
    rng = np.random.default_rng(2)
    m = ei.shape[1]
    links = {"train": {"index": ei[:, : m // 2], "label": rng.integers(0, 2, m // 2)},
             "val": {"index": ei[:, m // 2 : m // 2 + 60], "label": rng.integers(0, 2, 60).astype(np.float32)},
             "test": {"index": ei[:, -50:], "neg_dst": rng.integers(0, N, (50, 3))}}  # fmt: skip
    return prepare_from_arrays(tmp_path_factory.mktemp("given") / "g", ei, x, y, link_splits=links, progress=False)


def _passes(root, rank=0, world=1, pipeline=None, **kw):
    opts = dict(batch_size=64, num_neighbors=[-1, -1], **SMALL)
    opts.update(kw)
    opts["pipeline"] = {"order": "in_order", "num_samplers": 2, "num_extractors": 2, **(pipeline or {})}
    return LinkPasses(LinkDataConfig(str(root), **opts), ProcessContext(rank=rank, world=world))


def _edges(data):
    """The batch's sampled edges as a sorted list of global (src, dst)."""
    g = data.n_id[data.edge_index]
    return sorted(zip(g[0].tolist(), g[1].tolist()))


def _pyg_reference(ds, split, positions, neg, mode, amount, monkeypatch, edge_label=None, num_neighbors=(-1, -1)):
    """PyG's LinkNeighborLoader batch of ``positions`` of ``split`` whose negatives are ``neg`` (src, dst).

    Without pyg-lib or torch-sparse (PyG's own neighbour sampler needs one), the same batch comes from
    PyG's ``LinkLoader`` over our ``PyGNeighborSampler``: PyG's link logic (seeds, negatives, labels and
    their shift, triplet indices) over the node sampling, which with full fanouts has one outcome.
    """
    from torch_geometric.data import Data
    from torch_geometric.loader import LinkLoader, LinkNeighborLoader
    from torch_geometric.sampler import NegativeSampling as PygNegativeSampling

    from lightning_ooc.bench.pyg_reference import available
    from lightning_ooc.sampling import PyGNeighborSampler

    indptr = torch.from_numpy(np.array(ds.indptr))
    dst = torch.repeat_interleave(torch.arange(ds.num_nodes), indptr.diff())
    src = torch.from_numpy(np.array(ds.indices)).long()
    data = Data(x=ds.read_features(torch.arange(ds.num_nodes)), edge_index=torch.stack([src, dst]),
                num_nodes=ds.num_nodes)  # fmt: skip
    neg_src, neg_dst = neg

    def fake(self, num_samples, endpoint, num_nodes=None):
        out = neg_src if endpoint == "src" else neg_dst
        assert out.numel() == num_samples
        return out

    monkeypatch.setattr(PygNegativeSampling, "sample", fake)
    kw = dict(edge_label_index=ds.link_split(split).index, edge_label=edge_label,
              neg_sampling=PygNegativeSampling(mode, amount=amount), batch_size=len(positions))  # fmt: skip
    assert all(f == -1 for f in num_neighbors)  # one outcome whichever sampler draws it
    if available()[0]:
        loader = LinkNeighborLoader(data, num_neighbors=list(num_neighbors), **kw)
    else:
        loader = LinkLoader(data, link_sampler=PyGNeighborSampler(data, list(num_neighbors)), **kw)
    return loader.collate_fn(positions.tolist())


@pytest.mark.parametrize("mode,amount", [("binary", 1), ("binary", 2.5), ("triplet", 1), ("triplet", 3)])
def test_batches_equal_pyg_link_neighbor_loader(link_root, monkeypatch, mode, amount):
    passes = _passes(link_root, neg_sampling={"mode": mode, "amount": amount})
    try:
        ds = passes.dataset
        positions = passes.batches.epoch("train", 0)[1]
        ours = passes.sample_links("train", positions, seed=123)
        b = positions.numel()
        assert ours.batch_size == b and ours.input_id.tolist() == positions.tolist()
        if mode == "binary":
            neg = (ours.n_id[ours.edge_label_index[0, b:]], ours.n_id[ours.edge_label_index[1, b:]])
            assert neg[0].numel() == int(np.ceil(b * amount))
        else:
            neg = (None, ours.n_id[ours.dst_neg_index.reshape(-1)])
        ref = _pyg_reference(ds, "train", positions, neg, mode, amount, monkeypatch)
        given = ds.link_split("train").index[:, positions].reshape(-1)
        seeds = torch.unique(torch.cat([given, *(t for t in neg if t is not None)]))
        u = seeds.numel()
        assert ours.num_sampled_nodes[0] == u
        assert torch.equal(ours.n_id[:u], seeds) and torch.equal(ref.n_id[:u], seeds)
        assert set(ours.n_id.tolist()) == set(ref.n_id.tolist()) and ours.n_id.numel() == ref.n_id.numel()
        assert torch.equal(ours.input_id, ref.input_id)
        assert _edges(ours) == _edges(ref)
        for key in ("num_sampled_nodes", "num_sampled_edges"):  # PyG gives them with pyg-lib only
            if key in ref:
                assert list(ours[key]) == list(ref[key]), key
        assert sum(ours.num_sampled_nodes) == ours.n_id.numel()
        assert sum(ours.num_sampled_edges) == ours.edge_index.shape[1]
        if mode == "binary":
            assert torch.equal(ours.edge_label_index, ref.edge_label_index)
            assert torch.equal(ours.edge_label, ref.edge_label) and ours.edge_label.dtype == ref.edge_label.dtype
            assert "src_index" not in ours
        else:
            for key in ("src_index", "dst_pos_index", "dst_neg_index"):
                assert torch.equal(ours[key], ref[key]), key
                assert ours[key].shape == ref[key].shape
            assert ours.dst_neg_index.shape == ((b,) if amount == 1 else (b, amount))
            assert "edge_label" not in ours and "edge_label_index" not in ours
        # the positives map back to the split's edges through n_id
        pos_pairs = ours.n_id[ours.edge_label_index[:, :b]] if mode == "binary" else torch.stack(
            [ours.n_id[ours.src_index], ours.n_id[ours.dst_pos_index]])  # fmt: skip
        assert torch.equal(pos_pairs, ds.link_split("train").index[:, positions])
    finally:
        passes.close()


def test_given_labels_shift_as_pyg_with_binary_negatives(labelled_root, monkeypatch):
    passes = _passes(labelled_root, neg_sampling="binary")
    try:
        ds = passes.dataset
        label = ds.link_split("train").label
        assert label.min() == 0  # PyG moves labels up by one: 0 then means "sampled negative"
        positions = passes.batches.epoch("train", 0)[0]
        ours = passes.sample_links("train", positions, seed=7)
        b = positions.numel()
        neg = (ours.n_id[ours.edge_label_index[0, b:]], ours.n_id[ours.edge_label_index[1, b:]])
        ref = _pyg_reference(ds, "train", positions, neg, "binary", 1, monkeypatch, edge_label=label)
        assert torch.equal(ours.edge_label, ref.edge_label) and ours.edge_label.dtype == ref.edge_label.dtype
        assert torch.equal(ours.edge_label[:b], label[positions] + 1) and (ours.edge_label[b:] == 0).all()
        assert torch.equal(ours.edge_label_index, ref.edge_label_index)
        assert _edges(ours) == _edges(ref)
    finally:
        passes.close()


def test_evaluation_splits_use_their_own_labels_and_negatives(labelled_root, link_root):
    passes = _passes(labelled_root, neg_sampling="binary")
    try:
        val, test = passes.dataset.link_split("val"), passes.dataset.link_split("test")
        pos = torch.arange(20)
        v = passes.sample_links("val", pos, seed=1)  # stored labels: no sampled negatives, no shift
        assert v.edge_label_index.shape == (2, 20) and torch.equal(v.edge_label, val.label[:20])
        assert torch.equal(v.n_id[v.edge_label_index], val.index[:, :20])
        t = passes.sample_links("test", pos, seed=1)  # stored negatives: triplets with them
        assert t.dst_neg_index.shape == (20, 3)
        assert torch.equal(t.n_id[t.dst_neg_index], test.neg_dst[:20])
        assert torch.equal(t.n_id[t.src_index], test.index[0, :20])
    finally:
        passes.close()
    passes = _passes(link_root, neg_sampling={"mode": "binary", "amount": 2})
    try:  # a split of positives only: negatives drawn as for training
        v = passes.sample_links("val", torch.arange(10), seed=1)
        assert v.edge_label.tolist() == [1.0] * 10 + [0.0] * 20
    finally:
        passes.close()
    with pytest.raises(InputError, match="triplet"):
        _passes(labelled_root, neg_sampling="triplet")


@pytest.mark.parametrize("order", ["in_order", "out_of_order"])
def test_features_come_bit_exact_from_the_tiers(link_root, order):
    dm = OutOfCoreLinkData(link_root, batch_size=50, num_neighbors=[4, 3], neg_sampling="triplet", node_labels=True,
                           pipeline=dict(order=order, num_samplers=2, num_extractors=2), **SMALL)  # fmt: skip
    dm.setup()
    try:
        ds = dm.dataset
        assert ds.num_classes > 0
        for split in ("train", "val", "test"):
            count = 0
            for batch in dm._loader(split):
                assert torch.equal(batch.x, ds.read_features(batch.n_id))
                assert batch.y.tolist() == ds.labels[batch.n_id.numpy()].tolist()
                count += 1
            assert count == dm._num_batches(split) >= 1
            assert dm.last_stats[split].seeds == ds.link_split(split).num_edges
    finally:
        dm.teardown()


def _fields(data):
    keys = ("n_id", "edge_index", "input_id", "edge_label_index", "edge_label", "x")
    return {k: data[k].clone() for k in keys if k in data}


def test_in_order_repeats_and_out_of_order_gives_the_same_batches(link_root):
    runs = {}
    for order in ("in_order", "in_order", "out_of_order"):
        passes = _passes(link_root, num_neighbors=[5, 3], neg_sampling="binary",
                         pipeline=dict(order=order, num_samplers=3))
        try:
            runs.setdefault(order, []).append([(int(b.batch_index), _fields(b)) for b in passes.run("train", 1)])
        finally:
            passes.close()
    first, second = runs["in_order"]
    assert [k for k, _ in first] == list(range(len(first)))
    assert len(first) == len(second)
    for (k1, a), (k2, b) in zip(first, second):
        assert k1 == k2 and a.keys() == b.keys() and all(torch.equal(a[f], b[f]) for f in a)
    ooo = dict(runs["out_of_order"][0])
    assert sorted(ooo) == [k for k, _ in first]
    for k, a in first:
        assert all(torch.equal(a[f], ooo[k][f]) for f in a)


def test_two_ranks_get_disjoint_training_edges_covering_the_split(link_root):
    ids = []
    for rank in (0, 1):
        passes = _passes(link_root, rank=rank, world=2, num_neighbors=[2], neg_sampling="binary", batch_size=100)
        try:
            got = [b.input_id for b in passes.run("train", 0)]
            assert len(got) == passes.batches.count("train")
            ids.append(torch.cat(got))
            m = passes.dataset.link_split("train").num_edges
        finally:
            passes.close()
    a, b = (set(t.tolist()) for t in ids)
    assert not a & b and a | b == set(range(m)) and len(a) + len(b) == m


def test_exclude_seed_edges_hides_positives_whose_labels_pyg_shifts(labelled_root):
    """Train labels 0/1 with binary negatives: PyG shifts them to 1/2, so raw 0 is a positive too."""
    excl = _passes(labelled_root, exclude_seed_edges=True, neg_sampling="binary", num_neighbors=[-1], batch_size=64)
    try:
        index = excl.dataset.link_split("train").index
        for positions in excl.batches.epoch("train", 0)[:3]:
            b = excl.sample_links("train", positions, seed=3)
            assert bool((b.edge_label[: positions.numel()] >= 1).all())  # every seed edge is a positive
            src, dst = index[:, positions].tolist()
            assert not (set(zip(src, dst)) | set(zip(dst, src))) & set(_edges(b))
    finally:
        excl.close()


def test_exclude_seed_edges_removes_the_batch_positives_only(link_root):
    kw = dict(num_neighbors=[-1, 5], neg_sampling="binary", batch_size=40)
    plain, excl = _passes(link_root, **kw), _passes(link_root, exclude_seed_edges=True, **kw)
    try:
        index = plain.dataset.link_split("train").index
        removed = 0
        for positions in plain.batches.epoch("train", 0)[:4]:
            a = plain.sample_links("train", positions, seed=5)
            b = excl.sample_links("train", positions, seed=5)
            src, dst = index[:, positions].tolist()
            seeds = set(zip(src, dst)) | set(zip(dst, src))
            want = [e for e in _edges(a) if e not in seeds]
            assert _edges(b) == want
            assert sum(b.num_sampled_edges) == b.edge_index.shape[1]
            assert torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_label_index, b.edge_label_index)
            removed += len(_edges(a)) - len(want)
        assert removed > 0  # the positives were in the message-passing graph, and are gone
    finally:
        plain.close()
        excl.close()


class _LinkSAGE(L.LightningModule):
    """A GraphSAGE encoder and a dot-product decoder, written for PyG's LinkNeighborLoader batches."""

    def __init__(self, in_channels):
        super().__init__()
        from torch_geometric.nn import GraphSAGE

        self.encoder = GraphSAGE(in_channels, 32, num_layers=2)
        self.losses = []

    def step(self, batch):
        h = self.encoder(batch.x, batch.edge_index)
        src, dst = batch.edge_label_index
        return F.binary_cross_entropy_with_logits((h[src] * h[dst]).sum(-1), batch.edge_label.float())

    def training_step(self, batch, _):
        loss = self.step(batch)
        self.losses.append((self.current_epoch, loss.item()))
        return loss

    def validation_step(self, batch, _):
        self.log("val_loss", self.step(batch), batch_size=batch.batch_size)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_a_link_model_trains_and_its_loss_goes_down(link_root):
    torch.manual_seed(0)
    dm = OutOfCoreLinkData(link_root, batch_size=128, num_neighbors=[5, 5], neg_sampling="binary",
                           pipeline=dict(num_samplers=2, num_extractors=2), **SMALL)  # fmt: skip
    model = _LinkSAGE(dm.num_features)
    trainer = L.Trainer(max_epochs=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, datamodule=dm)
    per_epoch = [np.mean([v for e, v in model.losses if e == k]) for k in range(4)]
    assert len(model.losses) == 4 * dm._num_batches("train")
    assert per_epoch[-1] < per_epoch[0]
    assert "val_loss" in trainer.callback_metrics


def test_a_dataset_without_link_splits_is_an_input_error(tmp_path):
    from lightning_ooc.testing import make_synthetic

    ds = make_synthetic(tmp_path / "g", num_nodes=300, num_features=4)
    dm = OutOfCoreLinkData(ds.root, batch_size=10, num_neighbors=[2], **SMALL)
    with pytest.raises(InputError, match=r"no link-prediction edge splits.*--split-edges 0\.85,0\.05,0\.10") as e:
        dm.setup()
    assert str(ds.root) in str(e.value)


@pytest.mark.parametrize("train, what", [(None, r"no training link split \(its link splits: val, test\)"),
                                         (np.empty((2, 0), np.int64), "its link split train holds no edges")])
def test_fit_without_training_edges_is_an_input_error_and_evaluation_still_works(tmp_path, train, what):
    """Only val/test link splits: fit used to train nothing and stop with "No training batches", status 0."""
    ei, x, y = _planted(seed=3)
    links = {"val": ei[:, :60], "test": ei[:, 60:120], **({"train": train} if train is not None else {})}
    root = prepare_from_arrays(tmp_path / "g", ei, x, y, link_splits=links, progress=False)
    dm = OutOfCoreLinkData(root, batch_size=32, num_neighbors=[2], neg_sampling="binary", pipeline=ONE,
                           **SMALL)  # fmt: skip
    model = _LinkSAGE(dm.num_features)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with pytest.raises(InputError, match=what) as e:
        trainer.fit(model, datamodule=dm)
    assert str(root) in str(e.value) and "--split-edges" in str(e.value) and "--link-train" in str(e.value)
    assert dm.source is None  # refused before anything was set up
    trainer.validate(model, datamodule=dm, verbose=False)  # evaluation needs no training split
    assert "val_loss" in trainer.callback_metrics and dm.last_stats["val"].batches == -(-60 // 32)


def test_invalid_negative_sampling_is_an_input_error(link_root):
    with pytest.raises(InputError, match="triplet negative sampling needs an integer amount"):
        OutOfCoreLinkData(link_root, neg_sampling={"mode": "triplet", "amount": 1.5})
    with pytest.raises(InputError, match="neg_sampling must be"):
        OutOfCoreLinkData(link_root, neg_sampling=3)
    with pytest.raises(InputError, match="exclude_seed_edges"):
        OutOfCoreLinkData(link_root, exclude_seed_edges="yes")


def test_checkpoint_hyperparameters_are_plain(link_root):
    """A path given as root is kept as a str: checkpoints load with weights_only."""
    from pathlib import Path

    from lightning_ooc import OutOfCoreNodeData

    dm = OutOfCoreLinkData(Path(link_root), neg_sampling={"mode": "binary", "amount": 2})
    assert type(dm.hparams["root"]) is str and dm.hparams["neg_sampling"]["amount"] == 2
    mapped = OutOfCoreNodeData(Path(link_root), features=Mapped(madvise="normal"))
    assert type(mapped.hparams["root"]) is str
    assert mapped.hparams["features"] == {"class_path": "lightning_ooc.Mapped", "init_args": {"madvise": "normal"}}


def test_link_data_is_exported():
    assert "OutOfCoreLinkData" in lightning_ooc.__all__ and lightning_ooc.OutOfCoreLinkData is OutOfCoreLinkData


def test_a_gather_producer_runs_link_passes(link_root):
    from lightning_ooc.strategy.producer import GatherProducer

    dm = OutOfCoreLinkData(link_root, batch_size=100, num_neighbors=[3, 2], neg_sampling="triplet",
                           pipeline=ONE, **SMALL)  # fmt: skip
    producer = GatherProducer(dm.config, rank=0, world=1, device="cpu", handles={})
    try:
        batches = list(producer.run("train", epoch=0))
        ds = lightning_ooc.open_dataset(link_root)
        m = ds.link_split("train").num_edges
        assert sorted(torch.cat([b.input_id for b in batches]).tolist()) == list(range(m))
        for b in batches:
            assert torch.equal(b.x, ds.read_features(b.n_id)) and b.dst_neg_index.shape == (b.batch_size,)
    finally:
        producer.close()
    assert not producer.proc.is_alive()


def test_the_plan_is_presampled_from_link_batches(link_root):
    calls = []

    class SpyTask(LinkTask):
        def sample(self, split, sampler, positions, seed):
            data = super().sample(split, sampler, positions, seed)
            calls.append((split, data.n_id.numel()))
            return data

    class Spy(LinkPasses):
        task_type = SpyTask

    cfg = LinkDataConfig(str(link_root), batch_size=32, num_neighbors=[2], neg_sampling="binary",
                         **{**SMALL, "features": Tiered(presample_batches=5, **TIERS)})  # fmt: skip
    passes = Spy(cfg, ProcessContext())
    try:
        assert len(calls) == 10 and {s for s, _ in calls} == {"train"}  # 5 for the plan's estimates, 5 ranked
        assert "edges per epoch (binary negatives x1 (uniform))" in passes.describe([])
        # a link batch starts from its edges' endpoints and negatives: the plan bounds batches by those
        assert passes.plan.max_nodes_per_batch >= max(n for _, n in calls)
    finally:
        passes.close()


@pytest.mark.parametrize("mode, amount, seeds", [("binary", 3, 2 * (256 + 768)), ("triplet", 2, 2 * 256 + 512)])
def test_the_plan_counts_a_link_batchs_seed_nodes_so_a_small_buffer_is_refused_at_setup(link_root, mode, amount,
                                                                                            seeds):  # fmt: skip
    cfg = LinkDataConfig(str(link_root), batch_size=256, num_neighbors=[2], neg_sampling={"mode": mode, "amount": amount},
                         **{**SMALL, "features": Tiered(presample_batches=3, **TIERS)})  # fmt: skip
    passes = LinkPasses(cfg, ProcessContext())
    try:
        assert passes._seeds_per_batch() == seeds
        biggest = max(int(passes.sample_links("train", p, seed=k).n_id.numel())
                      for k, p in enumerate(passes.batches.epoch("train", 0)[:4]))  # fmt: skip
        assert passes.plan.max_nodes_per_batch >= biggest
    finally:
        passes.close()



def test_a_buffer_too_small_for_link_batches_is_refused_at_setup(tmp_path):
    """1,000 slots hold a node batch of 256 seeds with fanout [2] (768 nodes), not a link batch of 256 edges."""
    rng = np.random.default_rng(0)
    root = prepare_from_arrays(tmp_path / "g", rng.integers(0, 20000, (2, 40000)),
                               rng.random((20000, 8), dtype=np.float32), split_edges=(0.8, 0.1, 0.1), progress=False)
    small = LinkDataConfig(str(root), batch_size=256, num_neighbors=[2], neg_sampling={"mode": "binary", "amount": 3},
                           pipeline={"num_extractors": 1},
                           **{**SMALL, "features": Tiered(**{**TIERS, "gpu_cache": 32000})})  # fmt: skip
    with pytest.raises(InputError, match="set features.gpu_cache to at least"):  # not a failure in the middle of an epoch
        LinkPasses(small, ProcessContext())


def test_degree_weighted_strict_negatives_are_no_edges(link_root):
    passes = _passes(link_root, num_neighbors=[2], neg_sampling={"mode": "binary", "amount": 2, "weight": "degree",
                                                                 "strict": True})  # fmt: skip
    try:
        ds = passes.dataset
        stored = set(zip(np.asarray(ds.indices).tolist(),
                         np.repeat(np.arange(ds.num_nodes), np.diff(ds.indptr)).tolist()))  # fmt: skip
        for positions in passes.batches.epoch("train", 0)[:3]:
            data = passes.sample_links("train", positions, seed=11)
            b = positions.numel()
            neg = data.n_id[data.edge_label_index[:, b:]]
            assert neg.shape == (2, 2 * b) and (data.edge_label[b:] == 0).all()
            assert not set(zip(*neg.tolist())) & stored
    finally:
        passes.close()


@pytest.mark.parametrize("mapped,features", [({}, "mmap"), ({"madvise": "normal"}, "mmap"), ({"in_ram": True}, "ram")],
                         ids=["mmap-random", "mmap-normal", "ram"])  # fmt: skip
@pytest.mark.parametrize("neg", ["binary", "triplet"])
def test_the_synchronous_link_baseline_gives_the_very_batches_of_ours_in_order(link_root, mapped, features, neg):
    """features=Mapped(...) (bench epoch's mmap link baseline) and the tiers in order: field for field equal."""
    kw = dict(batch_size=50, num_neighbors=[4, 3], neg_sampling=neg, seed=3)
    ours = OutOfCoreLinkData(link_root, pipeline=dict(order="in_order", num_samplers=2, num_extractors=2), **kw,
                             **SMALL)  # fmt: skip
    base = OutOfCoreLinkData(link_root, features=Mapped(**mapped), pipeline={"order": "in_order"}, progress=False,
                             **kw)  # fmt: skip
    ours.setup("fit")
    base.setup("fit")
    try:
        for split in ("train", "val"):
            a_all = list(getattr(ours, f"{split}_dataloader")())
            b_all = list(getattr(base, f"{split}_dataloader")())
            assert len(a_all) == len(b_all) > 1
            for a, b in zip(a_all, b_all):
                assert set(a.keys()) == set(b.keys()), split
                for key in a.keys():
                    va, vb = a[key], b[key]
                    if isinstance(va, torch.Tensor):
                        assert torch.equal(va, vb), (split, key)
                    else:
                        assert va == vb, (split, key)
        assert base.source.features == features
        assert isinstance(base.source, SyncLinkPasses)
    finally:
        ours.teardown()
        base.teardown()


def test_link_batches_carry_node_labels_only_when_asked(link_root):
    kw = dict(batch_size=50, num_neighbors=[3], neg_sampling="binary", **SMALL)
    for asked in (False, True):
        dm = OutOfCoreLinkData(link_root, node_labels=asked, **kw)
        dm.setup()
        try:
            batch = next(iter(dm.train_dataloader()))
            assert ("y" in batch) == asked
            if asked:
                assert batch.y.tolist() == dm.dataset.labels[batch.n_id.numpy()].tolist()
        finally:
            dm.teardown()
    with pytest.raises(InputError, match="node_labels"):
        OutOfCoreLinkData(link_root, node_labels="yes")


def _check_stored_edges(batch_edge_index, n_id_src, n_id_dst, e_id, indptr, indices):
    """Every batch edge ``(src, dst)`` is the stored edge ``e_id`` of a CSC: ``indices[e_id]`` its source, the
    column holding ``e_id`` its destination."""
    assert e_id.dtype == torch.int64 and e_id.numel() == batch_edge_index.shape[1] > 0
    e = e_id.numpy()
    src, dst = n_id_src[batch_edge_index[0]].numpy(), n_id_dst[batch_edge_index[1]].numpy()
    assert (np.asarray(indices)[e] == src).all()
    assert (np.searchsorted(np.asarray(indptr), e, side="right") - 1 == dst).all()


def test_batches_carry_the_stored_edge_ids_on_request(link_root):
    """Issue 34: batches carried no ``e_id``, so a model reading edge features through it could not run;
    ``return_e_id=True`` gives the stored edges' ids, as PyG's loaders do (node and link batches, with the
    seed edges excluded too)."""
    from lightning_ooc import OutOfCoreNodeData

    quick = dict(pipeline=ONE, **{**SMALL, "features": Tiered(host_cache_policy="degree", **TIERS)})
    for dm in (OutOfCoreNodeData(link_root, batch_size=50, num_neighbors=[3, 2], return_e_id=True, **quick),
               OutOfCoreLinkData(link_root, batch_size=50, num_neighbors=[-1, 3], neg_sampling="binary",
                                 exclude_seed_edges=True, return_e_id=True, **quick)):  # fmt: skip
        dm.setup("fit")
        try:
            ds = dm.dataset
            for batch in (next(iter(dm.train_dataloader())), next(iter(dm.val_dataloader()))):
                _check_stored_edges(batch.edge_index, batch.n_id, batch.n_id, batch.e_id, ds.indptr, ds.indices)
            assert dm.plan.memory_fit.shape.edge_bytes == 24  # the plan counts e_id in the batches in flight
        finally:
            dm.teardown("fit")
    dm = OutOfCoreNodeData(link_root, batch_size=50, num_neighbors=[3, 2], **quick)  # off by default
    dm.setup("fit")
    try:
        assert "e_id" not in next(iter(dm.train_dataloader())) and dm.plan.memory_fit.shape.edge_bytes == 16
    finally:
        dm.teardown("fit")
    with pytest.raises(InputError, match="return_e_id must be true or false"):
        OutOfCoreLinkData(link_root, return_e_id="yes")
