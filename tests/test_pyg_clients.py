"""PyG's own client code over our store pair, as PyG's examples write it: link loaders, the loaders' sampler
options, the splits and metadata PyG's datasets carry, whole-tensor reads, and graph transforms refused."""
import pickle

import numpy as np
import pytest
import torch
import torch_geometric.transforms as T
from torch_geometric.data import Data
from torch_geometric.loader import LinkNeighborLoader as PyGLinkNeighborLoader
from torch_geometric.loader import NeighborLoader as PyGNeighborLoader

from lightning_ooc import open_dataset
from lightning_ooc.data.synth_hetero import synthesize_hetero
from lightning_ooc.errors import InputError
from lightning_ooc.pyg import LinkNeighborLoader, NeighborLoader, PyGStores, StoreTransformError, open_pyg_stores
from lightning_ooc.sampling import PyGNeighborSampler
from lightning_ooc.testing import make_synthetic


@pytest.fixture(scope="module")
def homo(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("clients") / "g", num_nodes=1200, avg_degree=5, num_features=6,
                          num_classes=4)


@pytest.fixture(scope="module")
def hetero(tmp_path_factory):
    root = synthesize_hetero(tmp_path_factory.mktemp("clients") / "h", "igbh", num_nodes=800, num_features=8,
                             num_classes=3, train_frac=0.3, progress=False)
    return open_dataset(root)


def _edge_index(ds):
    dst = torch.repeat_interleave(torch.arange(ds.num_nodes), torch.from_numpy(np.diff(ds.indptr)))
    return torch.stack([torch.from_numpy(np.asarray(ds.indices).astype(np.int64)), dst])


def _data(ds):
    return Data(x=torch.from_numpy(np.array(ds.features_memmap())), y=torch.from_numpy(np.array(ds.labels)),
                edge_index=_edge_index(ds), num_nodes=ds.num_nodes)  # fmt: skip


# -- 1: link loaders -----------------------------------------------------------------------------------------------


def test_link_loader_as_pygs_unsupervised_example_writes_it(homo):
    """graph_sage_unsup.py's loader, the data source and the import changed: every positive is an edge of the
    graph, and the batches equal those over the in-memory Data (same seeds, same sampler)."""
    stores = open_pyg_stores(homo.root)
    edges = set(map(tuple, _edge_index(homo).t().tolist()))
    torch.manual_seed(3)
    over_stores = list(LinkNeighborLoader(stores, batch_size=256, shuffle=True, neg_sampling_ratio=1.0,
                                          num_neighbors=[10, 10]))  # fmt: skip
    torch.manual_seed(3)
    data = _data(homo)
    in_memory = list(LinkNeighborLoader(data, batch_size=256, shuffle=True, neg_sampling_ratio=1.0,
                                        num_neighbors=[10, 10]))  # fmt: skip
    assert len(over_stores) == len(in_memory) == -(-homo.num_edges // 256)
    for a, b in zip(over_stores, in_memory):
        for key in ("n_id", "edge_index", "e_id", "edge_label_index", "edge_label", "x", "y"):
            assert torch.equal(a[key], b[key]), key
        pos = a.edge_label_index[:, a.edge_label == 1]
        assert all((int(a.n_id[s]), int(a.n_id[d])) in edges for s, d in pos.t().tolist())
    seen = torch.cat([b.input_id for b in over_stores])
    assert torch.equal(seen.sort().values, torch.arange(homo.num_edges))  # every edge a seed once
    stores.close()


def test_pygs_own_link_loader_over_the_pair_with_a_relation_named(homo):
    """PyG's own LinkNeighborLoader with (None, None): its coo([None]) is served as dicts, edges in CSC order."""
    stores = open_pyg_stores(homo.root)
    fs, gs = stores
    row, col, perm = gs.coo([None])
    assert list(row) == [None] and perm == {None: None}
    assert torch.equal(torch.stack([row[None], col[None]]), _edge_index(homo))
    r, c, p = gs.coo()  # a homogeneous graph asked for everything: PyG's tuple
    assert torch.equal(r, row[None]) and torch.equal(c, col[None]) and p is None
    loader = PyGLinkNeighborLoader(stores, num_neighbors=[3], batch_size=100, edge_label_index=(None, None),
                                   neighbor_sampler=PyGNeighborSampler(stores, [3]))  # fmt: skip
    batch = next(iter(loader))
    assert batch.edge_label_index.shape == (2, 100)
    assert not gs._cache  # the COO is built for PyG's copy, not kept beside it
    stores.close()


# -- 2: the loaders' sampler options -------------------------------------------------------------------------------


def test_loader_arguments_reach_the_sampler(homo):
    stores = open_pyg_stores(homo.root)
    loader = NeighborLoader(stores, num_neighbors=[1, 1], replace=True, batch_size=50,
                            input_nodes=stores.split("train"))  # fmt: skip
    s = loader.node_sampler
    assert isinstance(s, PyGNeighborSampler) and list(s.num_neighbors) == [1, 1] and s.replace
    b = next(iter(loader))
    assert b.num_sampled_edges[0] <= 50 and b.num_sampled_edges[1] <= b.num_sampled_nodes[1]
    stores.close()


def test_a_disagreeing_sampler_is_refused_in_one_line(homo):
    stores = open_pyg_stores(homo.root)
    with pytest.raises(InputError, match=r"num_neighbors=\[10, 10\] but the sampler's \[4, 2\]") as e:
        NeighborLoader(stores, num_neighbors=[10, 10], batch_size=8,
                       neighbor_sampler=PyGNeighborSampler(stores, [4, 2]))  # fmt: skip
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="disjoint=True but the sampler's False"):
        NeighborLoader(stores, num_neighbors=[4, 2], batch_size=8, disjoint=True,
                       neighbor_sampler=PyGNeighborSampler(stores, [4, 2]))  # fmt: skip
    agreeing = PyGNeighborSampler(stores, [4, 2])
    assert NeighborLoader(stores, num_neighbors=[4, 2], batch_size=8, neighbor_sampler=agreeing).node_sampler \
        is agreeing
    for kwargs, what in ((dict(subgraph_type="induced"), "subgraph_type='induced'"),
                         (dict(weight_attr="w"), "weight_attr='w'"),
                         (dict(time_attr="time", input_time=torch.zeros(3)), "time_attr='time'")):  # fmt: skip
        with pytest.raises(InputError, match=what):
            NeighborLoader(stores, num_neighbors=[2], batch_size=8, **kwargs)
    stores.close()


def test_disjoint_gives_every_seed_its_own_subgraph(homo):
    """With every neighbour taken, seed j's subgraph is exactly its in-edges: checked against the CSC."""
    stores = open_pyg_stores(homo.root)
    seeds = torch.tensor([5, 17, 5, 300])  # a repeated seed gets two subgraphs
    b = next(iter(NeighborLoader(stores, num_neighbors=[-1], batch_size=4, input_nodes=seeds, disjoint=True)))
    assert torch.equal(b.n_id[:4], seeds) and torch.equal(b.batch[:4], torch.arange(4))
    indptr, indices = homo.indptr, np.asarray(homo.indices)
    for j, seed in enumerate(seeds.tolist()):
        mine = (b.batch == j).nonzero().view(-1)
        nbrs = indices[indptr[seed] : indptr[seed + 1]]
        assert sorted(b.n_id[mine[1:]].tolist()) == sorted(set(nbrs.tolist()) - {seed})
        edges = (b.batch[b.edge_index[1]] == j)
        assert bool((b.batch[b.edge_index[0][edges]] == j).all())  # no edge crosses two seeds' subgraphs
        assert int(edges.sum()) == nbrs.size and bool((b.edge_index[1][edges] == j).all())
        assert sorted(b.n_id[b.edge_index[0][edges]].tolist()) == sorted(nbrs.tolist())
    assert b.num_sampled_nodes[0] == 4 and sum(b.num_sampled_nodes) == b.n_id.numel()
    # nodes come hop by hop, seed by seed within a hop
    hop1 = b.batch[4:]
    assert bool((hop1[1:] >= hop1[:-1]).all())
    stores.close()


def test_disjoint_link_loader_gives_a_batch_vector(homo):
    stores = open_pyg_stores(homo.root)
    b = next(iter(LinkNeighborLoader(stores, num_neighbors=[2], batch_size=16, disjoint=True)))
    # PyG's disjoint link batches: a subgraph per seed edge, both of its endpoints in it
    assert b.batch.shape == b.n_id.shape and int(b.batch.max()) == 16 - 1
    ends = b.edge_label_index
    assert torch.equal(b.batch[ends[0]], b.batch[ends[1]])
    stores.close()


# -- 3: what PyG's datasets carry ----------------------------------------------------------------------------------


def test_the_pair_carries_splits_classes_and_metadata(homo, hetero):
    stores = open_pyg_stores(homo.root)
    assert isinstance(stores, PyGStores) and isinstance(stores, tuple) and len(stores) == 2
    assert stores.num_classes == homo.num_classes and stores.num_features == homo.num_features
    assert stores.num_nodes == homo.num_nodes
    split = stores.get_idx_split()
    assert sorted(split) == ["test", "train", "valid"]
    for ours, theirs in (("train", "train"), ("valid", "val"), ("test", "test")):
        assert torch.equal(split[ours], homo.split(theirs))
    assert torch.equal(stores.split("val"), stores.split("valid"))
    assert torch.equal(stores.train_mask.nonzero().view(-1), homo.split("train").sort().values)
    with pytest.raises(InputError, match="metadata\\(\\) describes a heterogeneous"):
        stores.metadata()
    with pytest.raises(InputError, match="no split 'dev'"):
        stores.split("dev")
    again = pickle.loads(pickle.dumps(stores))
    assert isinstance(again, PyGStores) and again.num_classes == stores.num_classes
    again.close()
    stores.close()
    h = open_pyg_stores(hetero.root)
    assert h.metadata() == hetero.metadata() and h.target == hetero.target
    assert h.num_classes == hetero.node(hetero.target).num_classes
    assert torch.equal(h.get_idx_split()["valid"][hetero.target], hetero.split("val"))
    assert set(h.num_features) == set(hetero.node_types)
    h.close()


# -- 5 and 6: whole tensors, transforms ------------------------------------------------------------------------------


def test_get_tensor_without_an_index_is_every_row(homo):
    stores = open_pyg_stores(homo.root)
    fs, _ = stores
    x = torch.from_numpy(np.array(homo.features_memmap()))
    assert torch.equal(fs.get_tensor(None, "x"), x)
    assert torch.equal(fs.get_tensor(group_name=None, attr_name="y"), torch.from_numpy(np.array(homo.labels)))
    assert torch.equal(fs.get_tensor(None, "x", index=torch.tensor([3])), x[3:4])
    got = fs.multi_get_tensor([fs._tensor_attr_cls.cast(None, "x")])
    assert torch.equal(got[0], x)
    stores.close()


def test_a_graph_transform_on_the_pair_is_refused_naming_prepare(homo):
    stores = open_pyg_stores(homo.root)
    for transform in (T.ToUndirected(), T.AddSelfLoops(), T.NormalizeFeatures()):
        with pytest.raises(StoreTransformError, match="--add-reverse merge") as e:
            transform(stores)
        assert "\n" not in str(e.value) and isinstance(e.value, InputError)
    assert not hasattr(stores, "edge_index")  # an AttributeError too: hasattr stays False
    with pytest.raises(StoreTransformError, match="cannot take attribute 'x'"):
        stores.x = torch.zeros(1)
    # the loaders' own transform= applies to the batches
    loader = PyGNeighborLoader(stores, num_neighbors=[2], batch_size=10, transform=T.ToUndirected(),
                               input_nodes=torch.arange(10),
                               neighbor_sampler=PyGNeighborSampler(stores, [2]))  # fmt: skip
    assert next(iter(loader)).is_undirected()
    stores.close()


# -- 7: MAG's featureless types --------------------------------------------------------------------------------------


def test_mag_with_every_type_featured_runs_a_to_hetero_model_and_without_says_what_is_missing(tmp_path, caplog):
    import logging

    from torch_geometric.nn import SAGEConv, to_hetero

    class GNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = SAGEConv((-1, -1), 16), SAGEConv((-1, -1), 3)

        def forward(self, x, edge_index):
            return self.conv2(self.conv1(x, edge_index).relu(), edge_index)

    bare = synthesize_hetero(tmp_path / "bare", "mag", num_nodes=600, num_features=8, train_frac=0.3, progress=False)
    full = synthesize_hetero(tmp_path / "full", "mag", num_nodes=600, num_features=8, train_frac=0.3,
                             feature_dtype="float32", all_features=True, progress=False)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        stores = open_pyg_stores(bare)
        NeighborLoader(stores, num_neighbors=[4, 4], batch_size=16, input_nodes=("paper", stores.split("train")))
        NeighborLoader(stores, num_neighbors=[4, 4], batch_size=16, input_nodes=("paper", stores.split("train")))
    said = [r.getMessage() for r in caplog.records if "have no features" in r.getMessage()]
    assert len(said) == 1 and "author, institution" in said[0] and "--all-features" in said[0]
    assert "x of paper is torch.float16" in said[0]
    stores.close()
    caplog.clear()
    stores = open_pyg_stores(full)
    assert set(stores.num_features.values()) == {8}
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        loader = NeighborLoader(stores, num_neighbors=[4, 4], batch_size=16,
                                input_nodes=("paper", stores.split("train")))  # fmt: skip
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    batch = next(iter(loader))
    model = to_hetero(GNN(), stores.metadata(), aggr="sum")
    with torch.no_grad():
        out = model(batch.x_dict, batch.edge_index_dict)
    assert out["paper"].shape == (batch["paper"].num_nodes, 3) and bool(torch.isfinite(out["paper"]).all())
    stores.close()


# -- 4: features that fit the memory given are served from memory ------------------------------------------------------


def test_features_that_fit_are_held_in_memory_and_served_as_the_tiers_serve_them(homo, tmp_path, monkeypatch):
    from lightning_ooc.pyg import dataset_stores

    ids = torch.tensor([5, 0, 1199, 5, 77])
    tiered = open_pyg_stores(homo.root, in_memory=False)
    held = open_pyg_stores(homo.root)  # "auto": 29 KB of features fit
    assert not tiered[0].in_memory and held[0].in_memory
    assert held[0]._rows[None]._reader is None  # no reader was opened: rows come from memory
    for attr in (dict(index=ids), dict(index=None), dict(index=slice(3, 9))):
        assert torch.equal(held[0].get_tensor(None, "x", **attr), tiered[0].get_tensor(None, "x", **attr))
    torch.manual_seed(1)
    a = next(iter(NeighborLoader(held, num_neighbors=[5, 5], batch_size=64)))
    torch.manual_seed(1)
    b = next(iter(NeighborLoader(tiered, num_neighbors=[5, 5], batch_size=64)))
    assert torch.equal(a.x, b.x) and torch.equal(a.n_id, b.n_id)
    with pytest.raises(InputError, match="in_memory must be True, False or 'auto'"):
        open_pyg_stores(homo.root, in_memory="yes")
    # "auto" where the features take more than half of what the process may allocate: the tiers
    from lightning_ooc.store.limits import MemoryLimit

    monkeypatch.setattr("lightning_ooc.store.limits.memory_limit",
                        lambda: MemoryLimit(2 * homo.num_nodes * homo.row_bytes - 1, "a test"))  # fmt: skip
    assert not open_pyg_stores(homo.root)[0].in_memory
    assert dataset_stores.IN_MEMORY_SHARE == 0.5
    for s in (tiered, held):
        s.close()
