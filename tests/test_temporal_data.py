"""Temporal node classification out of core: the format, ``synth --temporal``, the datamodule's time options,
and no leakage on any feature backend."""
from __future__ import annotations

import json
import subprocess
import sys

import lightning as L
import numpy as np
import pytest
import torch

from lightning_ooc import InMemory, Mapped, OutOfCoreNodeData, Packed, Tiered, open_dataset
from lightning_ooc.data.synth import synthesize
from lightning_ooc.errors import InputError
from lightning_ooc.models import GraphSAGE

SMALL = dict(gpu_cache="256KiB", host_cache="64KiB", staging="512KiB")


@pytest.fixture(scope="module")
def temporal_graph(tmp_path_factory):
    root = tmp_path_factory.mktemp("temporal") / "g"
    return synthesize(root, num_nodes=3000, avg_degree=8, num_features=8, num_classes=4, train_frac=0.3,
                      val_frac=0.1, test_frac=0.1, temporal=True, homophily=0.5, feature_noise=1.0,
                      progress=False)  # fmt: skip


def test_synth_temporal_writes_times_in_order(temporal_graph, tmp_path):
    ds = open_dataset(temporal_graph)
    assert ds.neighbor_order == "edge_time" and not ds.meta["sorted_neighbors"]
    assert ds.edge_time.shape == (ds.num_edges,) and ds.node_time.shape == (ds.num_nodes,)
    node = np.repeat(np.arange(ds.num_nodes), np.diff(ds.indptr))
    t = np.asarray(ds.edge_time)
    assert not np.any((t[1:] < t[:-1]) & (node[1:] == node[:-1]))  # each node's in-edges in time order
    for split in ("train", "val", "test"):
        assert torch.equal(ds.split_time(split), torch.from_numpy(np.asarray(ds.node_time))[ds.split(split)])
    # the future is more homophilous than the past: what makes sampling without time leak
    y = np.asarray(ds.labels)
    src = np.asarray(ds.indices)
    past = t <= np.asarray(ds.node_time)[node]
    same = y[src] == y[node]
    assert same[~past].mean() > same[past].mean() + 0.3
    # deterministic
    again = synthesize(tmp_path / "again", num_nodes=3000, avg_degree=8, num_features=8, num_classes=4,
                       train_frac=0.3, val_frac=0.1, test_frac=0.1, temporal=True, homophily=0.5,
                       feature_noise=1.0, progress=False)  # fmt: skip
    for name in ("indices.npy", "edge_time.npy", "node_time.npy", "train_time.npy"):
        assert (again / name).read_bytes() == (temporal_graph / name).read_bytes()
    report = subprocess.run([sys.executable, "-m", "lightning_ooc", "verify", str(temporal_graph)],
                            capture_output=True, text=True)  # fmt: skip
    assert report.returncode == 0, report.stdout + report.stderr
    assert "time order" in report.stdout


@pytest.mark.parametrize("features", [Tiered(**SMALL), Packed(**SMALL), InMemory(), Mapped()],
                         ids=["tiered", "packed", "in_memory", "mapped"])  # fmt: skip
@pytest.mark.parametrize("window", [None, 100])
def test_no_batch_of_an_epoch_sees_past_its_seeds_time(temporal_graph, features, window):
    ds = open_dataset(temporal_graph)
    edge_time = torch.from_numpy(np.asarray(ds.edge_time))
    dm = OutOfCoreNodeData(temporal_graph, batch_size=64, num_neighbors=[6, 4], features=features, progress=False, return_e_id=True, memory_limit=None, time={"time_attr": "edge_time", "time_window": window})  # fmt: skip
    dm.setup()
    try:
        for split, loader in (("train", dm.train_dataloader()), ("val", dm.val_dataloader())):
            seen = edges = 0
            for batch in loader:
                b = batch.batch_size
                pos = batch.input_id
                assert torch.equal(batch.n_id[:b], ds.split(split)[pos])
                assert torch.equal(batch.seed_time, ds.split_time(split)[pos])
                src, dst = batch.edge_index
                assert torch.equal(batch.batch[src], batch.batch[dst])  # one subgraph per seed
                t = edge_time[batch.e_id]
                limit = batch.seed_time[batch.batch[dst]]
                assert bool((t <= limit).all()), f"{split}: an edge later than its seed"
                if window is not None:
                    assert bool((t >= limit - window).all()), f"{split}: an edge outside the window"
                assert torch.equal(batch.x, ds.read_features(batch.n_id))
                assert torch.equal(batch.y[:b], torch.from_numpy(np.asarray(ds.labels))[batch.n_id[:b]])
                seen += b
                edges += src.numel()
            assert seen == ds.split(split).numel() and edges > (seen if window is None else 0)
    finally:
        dm.teardown()


def _accuracy(root, time_attr, epochs=10):
    torch.manual_seed(0)
    dm = OutOfCoreNodeData(root, batch_size=128, num_neighbors=[8, 4], features=InMemory(), progress=False, pipeline={"order": "in_order"}, time={"time_attr": time_attr})  # fmt: skip
    model = GraphSAGE(8, 4, hidden_channels=32, num_layers=2)
    trainer = L.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, datamodule=dm)
    return trainer.test(model, datamodule=dm, verbose=False)[0]["test_acc"]


def test_a_model_that_sees_the_future_scores_visibly_higher(temporal_graph):
    honest, leaky = _accuracy(temporal_graph, "edge_time"), _accuracy(temporal_graph, None)
    assert leaky > honest + 0.08, (honest, leaky)  # measured: 0.68 against 0.83
    assert honest > 0.45  # still better than chance (4 classes): the past and the features carry signal


def test_time_options_are_checked(temporal_graph, tmp_path):
    with pytest.raises(InputError, match="temporal_strategy"):
        OutOfCoreNodeData(temporal_graph, time={"time_attr": "edge_time", "temporal_strategy": "newest"})
    with pytest.raises(InputError, match="input_time"):
        OutOfCoreNodeData(temporal_graph, time={"time_attr": "edge_time", "input_time": "seed"})
    dm = OutOfCoreNodeData(temporal_graph, progress=False, memory_limit=None, time={"time_attr": "time"})
    with pytest.raises(InputError, match="edge time order.*--neighbor-order node_time"):
        dm.setup()
    plain = synthesize(tmp_path / "plain", num_nodes=500, avg_degree=4, num_features=8, num_classes=3,
                       train_frac=0.3, progress=False)  # fmt: skip
    dm = OutOfCoreNodeData(plain, progress=False, memory_limit=None, time={"time_attr": "edge_time"})
    with pytest.raises(InputError, match="no edge times"):
        dm.setup()


def test_input_time_node_uses_the_node_times(temporal_graph, tmp_path):
    # a copy whose split times are later than the node times: "split" sees more of the past than "node"
    ds = open_dataset(temporal_graph)
    dm_split = OutOfCoreNodeData(temporal_graph, batch_size=50, num_neighbors=[-1], features=InMemory(),
                                 progress=False, return_e_id=True,
                                 pipeline={"order": "in_order"}, shuffle=False, time={"time_attr": "edge_time", "input_time": "node"})  # fmt: skip
    dm_split.setup()
    batch = next(iter(dm_split.train_dataloader()))
    assert torch.equal(batch.seed_time, torch.from_numpy(np.asarray(ds.node_time))[batch.n_id[:batch.batch_size]])
    dm_split.teardown()


def test_cli_synth_temporal(tmp_path):
    out = tmp_path / "g"
    r = subprocess.run([sys.executable, "-m", "lightning_ooc", "synth", "--out", str(out), "--nodes", "400",
                        "--avg-degree", "4", "--dim", "4", "--classes", "2", "--temporal", "--time-span", "50",
                        "--no-progress"], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["neighbor_order"] == "edge_time" and meta["source"]["time_span"] == 50
    assert int(np.load(out / "edge_time.npy").max()) < 50
    r = subprocess.run([sys.executable, "-m", "lightning_ooc", "synth", "--out", str(tmp_path / "h"), "--hetero", "mag",
                        "--nodes", "400", "--dim", "4", "--temporal", "--time-span", "50", "--no-progress"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    ds = open_dataset(tmp_path / "h")
    assert ds.relation(("author", "writes", "paper")).neighbor_order == "edge_time"
    assert int(np.asarray(ds.node("author").node_time).max()) < 50


def _users_and_items(seed, users, items, edges, classes):
    """Users buying items (items labelled), as a ``HeteroData``, and its random generator."""
    from torch_geometric.data import HeteroData

    g = torch.Generator().manual_seed(seed)
    data = HeteroData()
    data["user"].x = torch.randn(users, 4, generator=g)
    data["item"].x = torch.randn(items, 4, generator=g)
    data["item"].y = torch.randint(0, classes, (items,), generator=g)
    data["user", "buys", "item"].edge_index = torch.stack([torch.randint(0, users, (edges,), generator=g),
                                                          torch.randint(0, items, (edges,), generator=g)])  # fmt: skip
    return data, g


def _relational(tmp_path, level="node"):
    """A small relational graph (users buy items; an item's class depends on its buyers), with times."""
    from lightning_ooc.data.prepare_hetero import prepare_from_hetero

    data, g = _users_and_items(0, 300, 200, 2000, 3)
    if level == "node":
        data["user"].time = torch.randint(0, 100, (300,), generator=g)
        data["item"].time = torch.randint(0, 100, (200,), generator=g)
    else:
        data["user", "buys", "item"].time = torch.randint(0, 100, (2000,), generator=g)
    return prepare_from_hetero(tmp_path / f"rel-{level}", data, add_reverse="separate", time_attr="time",
                               progress=False)  # fmt: skip


@pytest.mark.parametrize("time_attr", ["time", "edge_time"])
@pytest.mark.parametrize("features", [Tiered(**SMALL), InMemory()], ids=["tiered", "in_memory"])
def test_relational_batches_see_only_their_seeds_past(tmp_path, time_attr, features):
    root = _relational(tmp_path, "node" if time_attr == "time" else "edge")
    ds = open_dataset(root)
    rel = ("user", "buys", "item")
    assert ds.relation(rel).neighbor_order == ("node_time" if time_attr == "time" else "edge_time")
    dm = OutOfCoreNodeData(root, batch_size=32, num_neighbors=[4, 3], features=features, progress=False, return_e_id=True, memory_limit=None, time={"time_attr": time_attr})  # fmt: skip
    if time_attr == "edge_time":  # no node times: each seed needs its own
        with pytest.raises(InputError, match="needs the time of each seed"):
            dm.setup()
        return
    dm.setup()
    try:
        node_time = {t: torch.from_numpy(np.asarray(ds.node(t).node_time)) for t in ds.node_types}
        n = 0
        for batch in dm.train_dataloader():
            b = batch["item"].batch_size
            seed_t = batch["item"].seed_time
            assert torch.equal(seed_t, node_time["item"][batch["item"].n_id[:b]])
            for et in batch.edge_types:
                src, dst = batch[et].edge_index
                bs, bd = batch[et[0]].batch[src], batch[et[2]].batch[dst]
                assert torch.equal(bs, bd)
                assert bool((node_time[et[0]][batch[et[0]].n_id[src]] <= seed_t[bd]).all()), et
                n += src.numel()
            for t in ds.node_types:
                assert torch.equal(batch[t].x, ds.node(t).read_features(batch[t].n_id))
        assert n > 0
    finally:
        dm.teardown()


def test_relational_edge_times_with_seed_times(tmp_path):
    from lightning_ooc.data.prepare_hetero import prepare_from_hetero

    data, g = _users_and_items(1, 100, 80, 600, 2)
    data["user", "buys", "item"].ts = torch.randint(0, 50, (600,), generator=g)
    # RelBench-like: the same item is a seed at several times
    data["item"].train_idx = torch.tensor([0, 0, 1, 2, 3, 3, 4])
    data["item"].train_time = torch.tensor([10, 40, 20, 30, 5, 45, 49])
    data["item"].val_idx = torch.tensor([5, 6])
    data["item"].val_time = torch.tensor([49, 49])
    data["item"].test_idx = torch.tensor([7])
    data["item"].test_time = torch.tensor([49])
    root = prepare_from_hetero(tmp_path / "r", data, add_reverse="separate", time_attr="ts", progress=False)
    ds = open_dataset(root)
    edge_time = {et: torch.from_numpy(np.asarray(ds.relation(et).edge_time)) for et in ds.edge_types}
    dm = OutOfCoreNodeData(root, batch_size=3, num_neighbors=[-1, -1], features=InMemory(), progress=False, return_e_id=True, shuffle=False, memory_limit=None,
                           pipeline={"order": "in_order"}, time={"time_attr": "edge_time"})  # fmt: skip
    dm.setup()
    try:
        times = []
        for batch in dm.train_dataloader():
            seed_t = batch["item"].seed_time
            times += seed_t.tolist()
            for et in batch.edge_types:
                dst = batch[et].edge_index[1]
                assert bool((edge_time[et][batch[et].e_id] <= seed_t[batch[et[2]].batch[dst]]).all())
        assert times == [10, 40, 20, 30, 5, 45, 49]
    finally:
        dm.teardown()


def test_prepare_rewrites_a_dataset_in_time_order(tmp_path):
    """A dataset with node times in source id order (OGB's years) becomes samplable by node time."""
    rng = np.random.default_rng(0)
    n = 400
    ei = rng.integers(0, n, (2, 3000))
    years = rng.integers(2000, 2020, n)
    from lightning_ooc.data.prepare import prepare_from_arrays

    plain = prepare_from_arrays(tmp_path / "plain", ei, rng.random((n, 4), dtype=np.float32), rng.integers(0, 3, n),
                                node_time=years, progress=False)  # fmt: skip
    dm = OutOfCoreNodeData(plain, progress=False, memory_limit=None, time={"time_attr": "time"})
    with pytest.raises(InputError, match="source id order.*--neighbor-order node_time"):
        dm.setup()
    r = subprocess.run([sys.executable, "-m", "lightning_ooc", "prepare", "--dataset", str(plain), "--out",
                        str(tmp_path / "timed"), "--neighbor-order", "node_time", "--no-progress"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    ds, before = open_dataset(tmp_path / "timed"), open_dataset(plain)
    assert ds.neighbor_order == "node_time" and ds.num_edges == before.num_edges
    node = np.repeat(np.arange(n), np.diff(ds.indptr))
    t = years[np.asarray(ds.indices)]
    assert not np.any((t[1:] < t[:-1]) & (node[1:] == node[:-1]))
    # the same edges, each node's in-edges reordered
    key = lambda d: np.sort(np.repeat(np.arange(n), np.diff(d.indptr)) * n + np.asarray(d.indices))  # noqa: E731
    assert np.array_equal(key(ds), key(before))
    dm = OutOfCoreNodeData(tmp_path / "timed", batch_size=40, num_neighbors=[5, 5], features=InMemory(), progress=False, return_e_id=True, time={"time_attr": "time", "temporal_strategy": "last"})  # fmt: skip
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    src, dst = batch.edge_index
    assert bool((torch.from_numpy(years)[batch.n_id[src]] <= batch.seed_time[batch.batch[dst]]).all())
    dm.teardown()
    # edge times from arrays, and back through --dataset with them
    et = rng.integers(0, 100, ei.shape[1])
    timed = prepare_from_arrays(tmp_path / "et", ei, rng.random((n, 4), dtype=np.float32), rng.integers(0, 3, n),
                                edge_time=et, neighbor_order="edge_time", progress=False)  # fmt: skip
    d2 = open_dataset(timed)
    assert np.array_equal(np.sort(np.asarray(d2.edge_time)), np.sort(et)) and d2.neighbor_order == "edge_time"
    from lightning_ooc.data.prepare import prepare_from_dataset

    d3 = open_dataset(prepare_from_dataset(tmp_path / "et2", timed, neighbor_order="edge_time", progress=False))
    assert np.array_equal(np.asarray(d3.edge_time), np.asarray(d2.edge_time))
    assert np.array_equal(np.asarray(d3.indices), np.asarray(d2.indices))


def test_pyg_loaders_sample_by_time_over_the_store_pair_and_in_memory(temporal_graph):
    """Our PyG NeighborLoader with time_attr over the pair (edge times served as `edge_time`) and over a Data."""
    from torch_geometric.data import Data

    from lightning_ooc.pyg import NeighborLoader, open_pyg_stores

    ds = open_dataset(temporal_graph)
    edge_time = torch.from_numpy(np.asarray(ds.edge_time))
    stores = open_pyg_stores(temporal_graph)
    fs = stores[0]
    assert any(a.attr_name == "edge_time" for a in fs.get_all_tensor_attrs())
    assert torch.equal(fs.get_tensor(None, "edge_time", index=torch.tensor([0, 5])), edge_time[[0, 5]])
    seeds, times = ds.split("train")[:64], ds.split_time("train")[:64]
    loader = NeighborLoader(stores, num_neighbors=[5, 5], input_nodes=seeds, input_time=times, batch_size=32,
                            time_attr="edge_time", temporal_strategy="last")  # fmt: skip
    n = 0
    for batch in loader:
        src, dst = batch.edge_index
        limit = batch.seed_time[batch.batch[dst]]
        assert bool((edge_time[batch.e_id] <= limit).all()) and src.numel() > 0
        assert torch.equal(batch.x, ds.read_features(batch.n_id))
        n += batch.batch_size
    assert n == 64
    stores.close()
    # in memory: a Data with an edge attribute `time`, in any edge order
    ei = torch.stack([torch.from_numpy(np.asarray(ds.indices)).long(),
                      torch.repeat_interleave(torch.arange(ds.num_nodes), torch.from_numpy(np.diff(ds.indptr)))])
    perm = torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(0))
    data = Data(x=ds.read_features(torch.arange(ds.num_nodes)), edge_index=ei[:, perm], time=edge_time[perm])
    data.num_nodes = ds.num_nodes
    loader = NeighborLoader(data, num_neighbors=[-1], input_nodes=seeds, input_time=times, batch_size=64,
                            time_attr="time")  # fmt: skip
    batch = next(iter(loader))
    dst = batch.edge_index[1]
    assert bool((data.time[batch.e_id] <= batch.seed_time[batch.batch[dst]]).all())
    # every eligible in-edge of the seeds (fanout -1) is there
    eligible = sum(int((edge_time[ds.indptr[s]:ds.indptr[s + 1]] <= t).sum()) for s, t in zip(seeds.tolist(),
                                                                                             times.tolist()))
    assert batch.num_sampled_edges[0] == eligible


def test_pyg_link_loader_samples_each_edge_at_its_time(temporal_graph):
    from lightning_ooc.pyg import LinkNeighborLoader, open_pyg_stores

    ds = open_dataset(temporal_graph)
    edge_time = torch.from_numpy(np.asarray(ds.edge_time))
    stores = open_pyg_stores(temporal_graph)
    dst = torch.repeat_interleave(torch.arange(ds.num_nodes), torch.from_numpy(np.diff(ds.indptr)))[:200]
    src = torch.from_numpy(np.asarray(ds.indices[:200])).long()
    loader = LinkNeighborLoader(stores, num_neighbors=[4, 4], edge_label_index=(None, torch.stack([src, dst])),
                                edge_label_time=edge_time[:200], batch_size=50, time_attr="edge_time",
                                neg_sampling_ratio=1.0)  # fmt: skip
    seen = 0
    for batch in loader:
        d = batch.edge_index[1]
        # PyG's disjoint link batches: batch is the positive edge each node's subgraph belongs to
        assert bool((edge_time[batch.e_id] <= batch.edge_label_time[batch.batch[d]]).all())
        assert batch.edge_label_index.shape[1] == 2 * batch.input_id.numel()
        seen += batch.input_id.numel()
    assert seen == 200
    stores.close()


def test_a_batch_naming_nodes_many_times_reads_each_row_once(temporal_graph):
    """Disjoint subgraphs repeat nodes: a batch may name more rows than the graph has nodes. The tiers are asked
    for each distinct row once (the feature buffer holds at most one slot per node)."""
    ds = open_dataset(temporal_graph)
    dm = OutOfCoreNodeData(temporal_graph, batch_size=600, num_neighbors=[10, 10], features=Tiered(**SMALL),
                           progress=False, memory_limit=None, time={"time_attr": "edge_time"})  # fmt: skip
    dm.setup()
    try:
        buffer = dm.source.own_store().of(None).tier("buffer").buffer
        biggest = 0
        for batch in dm.train_dataloader():
            biggest = max(biggest, batch.n_id.numel())
            assert torch.equal(batch.x, ds.read_features(batch.n_id))
            buffer.check_invariants()  # one slot per node, whatever a batch names twice
        assert biggest > ds.num_nodes  # more rows than nodes: only distinct rows fit the buffer
    finally:
        dm.teardown()


def _timed_links(tmp_path, n=500, e=6000, k=5):
    """A graph of timestamped edges (all of them pass messages, each at its time) and chronological link splits:
    the latest 15 % of the edges validate and test, with given negatives, as TGB evaluates."""
    from lightning_ooc.data.prepare import prepare_from_arrays

    rng = np.random.default_rng(3)
    ei = rng.integers(0, n, (2, e))
    t = np.sort(rng.integers(0, 10_000, e))
    cut1, cut2 = int(e * 0.7), int(e * 0.85)
    splits = {
        "train": {"index": ei[:, :cut1], "time": t[:cut1] - 1},
        "val": {"index": ei[:, cut1:cut2], "time": t[cut1:cut2] - 1, "neg_dst": rng.integers(0, n, (cut2 - cut1, k))},
        "test": {"index": ei[:, cut2:], "time": t[cut2:] - 1, "neg_dst": rng.integers(0, n, (e - cut2, k))},
    }  # fmt: skip
    return prepare_from_arrays(tmp_path / "links", ei, rng.random((n, 8), dtype=np.float32), edge_time=t,
                               neighbor_order="edge_time", link_splits=splits,
                               link_note="every edge, each at its time", progress=False)  # fmt: skip


@pytest.mark.parametrize("features", [Tiered(**SMALL), InMemory()], ids=["tiered", "in_memory"])
def test_link_batches_see_only_what_precedes_each_edge(tmp_path, features):
    from lightning_ooc import OutOfCoreLinkData

    root = _timed_links(tmp_path)
    ds = open_dataset(root)
    edge_time = torch.from_numpy(np.asarray(ds.edge_time))
    dm = OutOfCoreLinkData(root, batch_size=100, num_neighbors=[5, 5], neg_sampling="binary", features=features, return_e_id=True, progress=False, memory_limit=None, time={"time_attr": "edge_time"})  # fmt: skip
    dm.setup()
    try:
        for split, loader in (("train", dm.train_dataloader()), ("val", dm.val_dataloader())):
            ls = ds.link_split(split)
            edges = 0
            for batch in loader:
                d = batch.edge_index[1]
                limit = batch.seed_time[batch.batch[d]]
                assert bool((edge_time[batch.e_id] <= limit).all()), split
                assert torch.equal(batch.edge_label_time[: batch.batch_size] if split == "train"
                                   else batch.edge_label_time, ls.time[batch.input_id])  # fmt: skip
                assert torch.equal(batch.x, ds.read_features(batch.n_id))
                edges += batch.batch_size
                if split == "val":  # the split's own negatives: a triplet batch, TGB's evaluation
                    assert batch.dst_neg_index.shape == (batch.batch_size, 5)
            assert edges == ls.num_edges
    finally:
        dm.teardown()


def test_link_time_needs_timed_splits(tmp_path):
    from lightning_ooc import OutOfCoreLinkData
    from lightning_ooc.data.prepare import prepare_from_arrays

    rng = np.random.default_rng(0)
    root = prepare_from_arrays(tmp_path / "g", rng.integers(0, 100, (2, 800)), rng.random((100, 4), dtype=np.float32),
                               edge_time=rng.integers(0, 50, 800), neighbor_order="edge_time",
                               link_splits={"train": rng.integers(0, 100, (2, 50))}, progress=False)  # fmt: skip
    dm = OutOfCoreLinkData(root, batch_size=10, num_neighbors=[3], progress=False,
                           memory_limit=None, time={"time_attr": "edge_time"})  # fmt: skip
    with pytest.raises(InputError, match="link split.*train have no times"):
        dm.setup()


def test_split_edges_on_timed_edges_splits_by_time_and_keeps_every_edge(tmp_path):
    """``--split-edges`` on edges with times: val/test are the latest edges (TGB's quantiles), every edge stays
    in the graph at its time, each link edge is supervised at its time minus one, the order is kept when a
    dataset is rewritten, and a temporal link batch then never sees its own edge or a later one."""
    from lightning_ooc import OutOfCoreLinkData
    from lightning_ooc.data.prepare import prepare_from_arrays, prepare_from_dataset

    rng = np.random.default_rng(7)
    n, e = 300, 4000
    ei = rng.integers(0, n, (2, e))
    t = rng.integers(0, 1000, e)
    x = rng.random((n, 4), dtype=np.float32)
    base = prepare_from_arrays(tmp_path / "g", ei, x, edge_time=t, neighbor_order="edge_time", progress=False)
    root = prepare_from_dataset(tmp_path / "gl", base, split_edges=(0.7, 0.15, 0.15), progress=False)
    ds = open_dataset(root)
    assert ds.neighbor_order == "edge_time" and ds.num_edges == e  # every edge kept, still sorted by time
    q1, q2 = np.quantile(t, [0.7, 0.85])
    expect = {"train": t <= q1, "val": (t > q1) & (t <= q2), "test": t > q2}
    for s, mask in expect.items():
        ls = ds.link_split(s)
        got = np.asarray(ls.index).T  # (2, M), as PyG holds edges
        assert ls.num_edges == int(mask.sum()) > 0, s
        assert sorted(map(tuple, np.c_[got, np.asarray(ls.time) + 1].tolist())) == \
            sorted(map(tuple, np.c_[ei[:, mask].T, t[mask]].tolist())), s  # fmt: skip
        assert np.all(np.diff(np.asarray(ls.time)) >= 0), s  # in time order, as events are
    assert not ds.link_splits["leakage_free"] and "every edge at its time" in ds.link_splits["message_passing"]
    edge_time = torch.from_numpy(np.asarray(ds.edge_time))
    dm = OutOfCoreLinkData(root, batch_size=64, num_neighbors=[4, 4], neg_sampling="binary", return_e_id=True,
                           features=InMemory(), progress=False, memory_limit=None, time={"time_attr": "edge_time"})  # fmt: skip
    dm.setup()
    try:
        for batch in dm.val_dataloader():
            limit = batch.seed_time[batch.batch[batch.edge_index[1]]]
            assert bool((edge_time[batch.e_id] <= limit).all())  # only edges before the supervised one
    finally:
        dm.teardown()


def test_synth_hetero_temporal_a_relational_schema_with_time(tmp_path):
    """``synth --hetero igbh --temporal``: node times on every type, edge times on every relation (reverses and
    the symmetric citations included), each target's in-edges in time order, the papers' splits at their node
    times, later edges more homophilous than earlier ones; and a temporal epoch sees no edge past its seed."""
    from lightning_ooc.data.synth_hetero import synthesize_hetero

    root = synthesize_hetero(tmp_path / "h", "igbh", num_nodes=3000, num_features=8, num_classes=4, seed=1,
                             homophily=0.3, train_frac=0.1, val_frac=0.05, temporal=True, time_span=200,
                             progress=False)  # fmt: skip
    report = subprocess.run([sys.executable, "-m", "lightning_ooc", "verify", str(root)], capture_output=True,
                            text=True)  # fmt: skip
    assert report.returncode == 0, report.stdout + report.stderr
    ds = open_dataset(root)
    paper = ds.node("paper")
    for s in ("train", "val", "test"):
        assert torch.equal(paper.split_time(s), torch.from_numpy(np.asarray(paper.node_time))[paper.split(s)])
    y = np.asarray(paper.labels)
    for et in ds.edge_types:
        rel = ds.relation(et)
        assert rel.neighbor_order == "edge_time" and rel.edge_time is not None, et
        node = np.repeat(np.arange(len(rel.indptr) - 1), np.diff(rel.indptr))
        t = np.asarray(rel.edge_time)
        assert not np.any((t[1:] < t[:-1]) & (node[1:] == node[:-1])), et
    cites = ds.relation(("paper", "cites", "paper"))
    node = np.repeat(np.arange(len(cites.indptr) - 1), np.diff(cites.indptr))
    later = np.asarray(cites.edge_time) > np.asarray(paper.node_time)[node]
    same = y[np.asarray(cites.indices)] == y[node]
    # generated edges: 0.3 inside a class before the target's time, 0.95 after (the reverses dilute both)
    assert same[later].mean() > same[~later].mean() + 0.2, (same[later].mean(), same[~later].mean())
    edge_time = {et: torch.from_numpy(np.asarray(ds.relation(et).edge_time)) for et in ds.edge_types}
    dm = OutOfCoreNodeData(root, batch_size=64, num_neighbors=[4, 3], features=InMemory(), progress=False,
                           return_e_id=True, memory_limit=None, time={"time_attr": "edge_time"})  # fmt: skip
    dm.setup()
    try:
        edges = 0
        for batch in dm.train_dataloader():
            seed_t = batch["paper"].seed_time
            for et in batch.edge_types:
                dst = batch[et].edge_index[1]
                assert bool((edge_time[et][batch[et].e_id] <= seed_t[batch[et[2]].batch[dst]]).all()), et
                edges += dst.numel()
        assert edges > 0
    finally:
        dm.teardown()


def test_a_relational_model_that_sees_the_future_scores_visibly_higher(tmp_path):
    """On ``synth --hetero igbh --temporal`` too, R-SAGE sampling without time scores visibly higher than with it:
    the future's citations, authors and topics are more homophilous than the past's."""
    from lightning_ooc.data.synth_hetero import synthesize_hetero
    from lightning_ooc.models.relational import RSAGE

    root = synthesize_hetero(tmp_path / "h", "igbh", num_nodes=5000, num_features=8, num_classes=4, seed=0,
                             homophily=0.3, train_frac=0.3, val_frac=0.1, test_frac=0.1, temporal=True,
                             progress=False)  # fmt: skip

    def accuracy(time_attr):
        torch.manual_seed(0)
        dm = OutOfCoreNodeData(root, batch_size=128, num_neighbors=[8, 4], features=InMemory(), progress=False,
                               pipeline={"order": "in_order"}, time={"time_attr": time_attr})  # fmt: skip
        dm.setup()
        model = RSAGE(dm.metadata, dm.in_channels, num_classes=4, hidden_channels=32, num_layers=2, lr=1e-2)
        trainer = L.Trainer(accelerator="cpu", max_epochs=8, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        trainer.fit(model, datamodule=dm)
        return trainer.test(model, datamodule=dm, verbose=False)[0]["test_acc"]

    honest, leaky = accuracy("edge_time"), accuracy(None)
    assert leaky > honest + 0.05, (honest, leaky)  # measured: 0.88 against 0.98
    assert honest > 0.45  # better than chance (4 classes): the past and the features carry signal
