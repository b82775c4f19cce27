"""PyG's FeatureStore / GraphStore over our datasets (lightning_ooc.pyg), checked against PyG's documented semantics
of the interface: every accessor against a Data / HeteroData built in memory from the same arrays, bit for bit, and
PyG's own NeighborLoader over the store pair giving exactly the batches it gives over the in-memory graph."""
import pickle

import numpy as np
import pytest
import torch
from torch_geometric.data import Data, HeteroData
from torch_geometric.loader import NeighborLoader

from lightning_ooc import open_dataset
from lightning_ooc.data.synth_hetero import synthesize_hetero
from lightning_ooc.errors import InputError
from lightning_ooc.pyg import open_pyg_stores
from lightning_ooc.sampling import PyGNeighborSampler
from lightning_ooc.testing import make_synthetic


@pytest.fixture(scope="module")
def homo(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("pyg") / "g", num_nodes=3000, avg_degree=6, num_features=12,
                          num_classes=5)


@pytest.fixture(scope="module")
def hetero(tmp_path_factory):
    root = synthesize_hetero(tmp_path_factory.mktemp("pyg") / "h", "igbh", num_nodes=1500, num_features=8,
                             num_classes=3, train_frac=0.3, progress=False)
    return open_dataset(root)


def _coo(indptr, indices):
    dst = torch.repeat_interleave(torch.arange(len(indptr) - 1), torch.from_numpy(np.diff(indptr)))
    return torch.stack([torch.from_numpy(np.asarray(indices).astype(np.int64)), dst])


def _data(ds):
    """The dataset as an in-memory Data, its edges in CSC order (so CSC positions are edge ids in both)."""
    x = torch.from_numpy(np.array(ds.features_memmap()))
    return Data(x=x, y=torch.from_numpy(np.array(ds.labels)), edge_index=_coo(ds.indptr, ds.indices),
                num_nodes=ds.num_nodes)  # fmt: skip


def _hetero_data(ds):
    data = HeteroData()
    for t in ds.node_types:
        node = ds.node(t)
        data[t].num_nodes = node.num_nodes
        if node.has_features:
            data[t].x = torch.from_numpy(np.array(node.features_memmap()))
        if node.has_labels:
            data[t].y = torch.from_numpy(np.array(node.labels))
    for et, csc in ds.csc.items():
        data[et].edge_index = _coo(csc.indptr, csc.indices)
    return data


def test_feature_accessors_match_data(homo):
    data = _data(homo)
    fs, gs = open_pyg_stores(homo.root, in_memory=False, host_cache="8KiB")  # some rows from the host cache, the rest read
    with fs:
        assert {(a.group_name, a.attr_name) for a in fs.get_all_tensor_attrs()} == {(None, "x"), (None, "y")}
        idx = torch.tensor([2999, 0, 17, 17, 1500])
        for attr in ("x", "y"):
            ref = data[attr]
            assert torch.equal(fs.get_tensor(None, attr, None), ref)  # the whole tensor (index None, as PyG asks)
            assert torch.equal(fs.get_tensor(None, attr, idx), ref[idx])
            assert torch.equal(fs.get_tensor(None, attr, slice(10, 40, 3)), ref[10:40:3])
            assert torch.equal(fs.get_tensor(None, attr, 7), ref[7])
            mask = torch.zeros(homo.num_nodes, dtype=torch.bool)
            mask[[5, 9, 2000]] = True
            assert torch.equal(fs.get_tensor(None, attr, mask), ref[mask])
            assert torch.equal(fs.get_tensor(None, attr, idx.tolist()), ref[idx])  # a list of ids
            assert torch.equal(fs[None, attr, idx], ref[idx])  # PyG's indexing sugar
            assert torch.equal(fs.view(None, attr)[idx], ref[idx])
        assert fs.get_tensor_size(None, "x") == (3000, 12)
        assert fs.get_tensor_size(None, "y") == (3000,)
        assert fs.get_tensor_size(None, "x", idx) == (5, 12)
        xs = fs.multi_get_tensor([(None, "x", idx), (None, "y", idx[:2])])
        assert torch.equal(xs[0], data.x[idx]) and torch.equal(xs[1], data.y[idx[:2]])
        assert fs.get_tensor(None, "x", torch.tensor([], dtype=torch.long)).shape == (0, 12)


def test_graph_accessors_match_data(homo):
    data = _data(homo)
    fs, gs = open_pyg_stores(homo)
    (attr,) = gs.get_all_edge_attrs()
    assert attr.edge_type is None and attr.layout.value == "csc" and attr.size == (3000, 3000)
    row, colptr = gs.get_edge_index(None, "csc")
    assert row.dtype == colptr.dtype == torch.int64
    assert torch.equal(colptr, torch.from_numpy(homo.indptr)) and torch.equal(row, data.edge_index[0])
    row2, col = gs.get_edge_index(None, "coo")
    assert torch.equal(torch.stack([row2, col]), data.edge_index)
    assert gs.get_edge_index(None, "coo")[1] is col  # built once, kept
    # PyG's own conversions from the stored layout
    csr_ptr, csr_col, perm = gs.csr()
    assert int(csr_ptr[-1]) == homo.num_edges and torch.equal(csr_col, data.edge_index[1][perm])
    fs.close()


def test_hetero_accessors_match_hetero_data(hetero):
    data = _hetero_data(hetero)
    fs, gs = open_pyg_stores(hetero)
    with fs:
        want = {(t, "x") for t in hetero.node_types if hetero.node(t).has_features}
        want |= {(t, "y") for t in hetero.node_types if hetero.node(t).has_labels}
        assert {(a.group_name, a.attr_name) for a in fs.get_all_tensor_attrs()} == want
        for t, a in want:
            ref = data[t][a]
            idx = torch.randperm(ref.shape[0], generator=torch.Generator().manual_seed(1))[:20]
            assert torch.equal(fs.get_tensor(t, a, idx), ref[idx]), (t, a)
            assert fs.get_tensor_size(t, a) == tuple(ref.shape)
        got = {a.edge_type: a for a in gs.get_all_edge_attrs()}
        assert set(got) == set(hetero.edge_types)
        for et in hetero.edge_types:
            src, _, dst = et
            assert got[et].size == (hetero.num_nodes_dict[src], hetero.num_nodes_dict[dst])
            row, col = gs.get_edge_index(et, "coo")
            assert torch.equal(torch.stack([row, col]), data[et].edge_index), et


def _same_batches(a, b, keys):
    n = 0
    for x, y in zip(a, b, strict=True):
        for store_x, store_y in zip(x.stores, y.stores):
            for k in keys:
                if k in store_y:
                    assert k in store_x, k
                    assert torch.equal(torch.as_tensor(store_x[k]), torch.as_tensor(store_y[k])), k
        n += 1
    return n


def test_neighbor_loader_over_stores_gives_the_in_memory_batches(homo):
    data = _data(homo)
    fs, gs = open_pyg_stores(homo.root, in_memory=False, host_cache="16KiB")
    seeds = torch.arange(0, 3000, 5)

    def loader(src, sampler):
        torch.manual_seed(3)  # our sampler draws each batch's seed from torch's generator
        return list(NeighborLoader(src, num_neighbors=[5, 3], input_nodes=seeds, batch_size=128, shuffle=False,
                                   neighbor_sampler=sampler))  # fmt: skip

    ours = loader((fs, gs), PyGNeighborSampler((fs, gs), [5, 3]))
    ref = loader(data, PyGNeighborSampler(data, [5, 3]))
    keys = ["x", "y", "edge_index", "n_id", "e_id", "batch_size", "input_id", "num_sampled_nodes", "num_sampled_edges"]
    assert _same_batches(ours, ref, keys) == 5
    assert ours[0].x.shape == (ours[0].n_id.numel(), 12) and ours[0].batch_size == 128
    fs.close()


def test_hetero_neighbor_loader_over_stores_gives_the_in_memory_batches(hetero):
    data = _hetero_data(hetero)
    fs, gs = open_pyg_stores(hetero, in_memory=False, host_cache="32KiB")
    t = hetero.target
    seeds = torch.arange(200)

    def loader(src, sampler):
        torch.manual_seed(5)
        return list(NeighborLoader(src, num_neighbors=[4, 2], input_nodes=(t, seeds), batch_size=64, shuffle=False,
                                   neighbor_sampler=sampler))  # fmt: skip

    ours = loader((fs, gs), PyGNeighborSampler((fs, gs), [4, 2]))
    ref = loader(data, PyGNeighborSampler(data, [4, 2]))
    assert len(ours) == len(ref) == 4
    for a, b in zip(ours, ref):
        for nt in hetero.node_types:
            for k in ("x", "y", "n_id", "num_sampled_nodes"):
                if k in b[nt]:
                    assert torch.equal(torch.as_tensor(a[nt][k]), torch.as_tensor(b[nt][k])), (nt, k)
        for et in hetero.edge_types:
            for k in ("edge_index", "e_id"):
                assert torch.equal(a[et][k], b[et][k]), (et, k)
        assert a[t].batch_size == b[t].batch_size and torch.equal(a[t].input_id, b[t].input_id)
    assert sum(b[t].batch_size for b in ours) == 200
    fs.close()


def test_sampler_over_another_backends_stores(homo):
    """Our sampler over any PyG backend's pair: its CSC taken once from graph_store.csc()."""
    from torch_geometric.testing.feature_store import MyFeatureStore
    from torch_geometric.testing.graph_store import MyGraphStore

    data = _data(homo)
    mfs, mgs = MyFeatureStore(), MyGraphStore()
    mfs.put_tensor(data.x, group_name=None, attr_name="x", index=None)
    # sorted by destination (PyG's sort of an unsorted COO need not keep each node's sources in order)
    mgs.put_edge_index((data.edge_index[0], data.edge_index[1]), edge_type=None, layout="coo", is_sorted=True,
                       size=(homo.num_nodes, homo.num_nodes))  # fmt: skip
    fs, gs = open_pyg_stores(homo)
    seeds = torch.arange(0, 300, 3)

    def loader(src):
        torch.manual_seed(9)
        return list(NeighborLoader(src, num_neighbors=[4, 4], input_nodes=seeds, batch_size=50,
                                   neighbor_sampler=PyGNeighborSampler(src, [4, 4])))  # fmt: skip

    assert _same_batches(loader((mfs, mgs)), loader((fs, gs)), ["x", "edge_index", "n_id", "e_id"]) == 2
    fs.close()


def test_errors_name_what_exists(homo, hetero):
    fs, gs = open_pyg_stores(homo)
    with pytest.raises(KeyError, match=r"no attribute 'z'.*x of the graph, y of the graph"):
        fs.get_tensor(None, "z", None)
    with pytest.raises(KeyError, match=r"no node type 'paper'"):
        fs.get_tensor("paper", "x", None)
    with pytest.raises(InputError, match=r"node id 3000 is out of range; ids must lie in 0..2999"):
        fs.get_tensor(None, "x", torch.tensor([1, 3000]))
    with pytest.raises(InputError, match=r"node id -1"):
        fs.get_tensor(None, "y", torch.tensor([-1]))
    with pytest.raises(InputError, match=r"integers"):
        fs.get_tensor(None, "x", torch.tensor([1.0]))
    with pytest.raises(InputError, match=r"read-only .*embeddings=TABLE, writable=True"):
        fs.put_tensor(torch.zeros(1, 12), group_name=None, attr_name="x", index=torch.tensor([0]))
    with pytest.raises(InputError, match=r"read-only"):
        fs.remove_tensor(None, "x", None)
    with pytest.raises(KeyError, match=r"no edge type .*homogeneous"):
        gs.get_edge_index(("a", "b", "c"), "csc")
    with pytest.raises(InputError, match=r"graph store is read-only"):
        gs.put_edge_index((torch.tensor([0]), torch.tensor([1])), edge_type=None, layout="coo")
    fs.close()
    with pytest.raises(InputError, match=r"closed"):
        fs.get_tensor(None, "x", torch.tensor([0]))
    hfs, hgs = open_pyg_stores(hetero)
    with pytest.raises(KeyError, match=r"no node type 'nope'; node types: 'paper'"):
        hfs.get_tensor("nope", "x", None)
    with pytest.raises(KeyError, match=r"no edge type \('paper', 'x', 'paper'\); edge types: \('paper', 'cites'"):
        hgs.get_edge_index(("paper", "x", "paper"), "csc")
    with pytest.raises(InputError, match=r"name the seeds' node type"):
        next(iter(NeighborLoader((hfs, hgs), num_neighbors=[2], input_nodes=torch.tensor([0]), batch_size=1,
                                 neighbor_sampler=PyGNeighborSampler((hfs, hgs), [2]))))  # fmt: skip
    hfs.close()


def test_learnable_x_is_written_back_through_the_journal(homo, tmp_path):
    from lightning_ooc.embed.table import EmbeddingTable, init_embeddings

    table = init_embeddings(tmp_path / "emb", num_nodes=homo.num_nodes, dim=6, partitions=1, progress=False)
    fs, _ = open_pyg_stores(homo, embeddings=table, writable=True)
    before = EmbeddingTable(table, writable=False).rows(torch.arange(homo.num_nodes))
    ids = torch.tensor([5, 2999, 40])
    assert torch.equal(fs.get_tensor(None, "x", ids), before[ids, :6])
    new = torch.randn(3, 6)
    assert fs.put_tensor(new, group_name=None, attr_name="x", index=ids)
    assert torch.equal(fs.get_tensor(None, "x", ids), new)  # read back through direct I/O
    assert (table / "journal.bin").stat().st_size > 0  # journaled before written in place
    fs.close()  # checkpoints: the journal is emptied, the partition checksummed
    assert (table / "journal.bin").stat().st_size == 0
    t = EmbeddingTable(table, writable=False, verify=True)
    after = t.rows(torch.arange(homo.num_nodes))
    assert torch.equal(after[ids, :6], new) and torch.equal(after[ids, 6:], before[ids, 6:])  # state kept
    keep = torch.ones(homo.num_nodes, dtype=torch.bool)
    keep[ids] = False
    assert torch.equal(after[keep], before[keep])
    t.close()
    ro, _ = open_pyg_stores(homo, embeddings=table)
    with pytest.raises(InputError, match=r"read-only .*writable=True"):
        ro.put_tensor(new, group_name=None, attr_name="x", index=ids)
    with pytest.raises(InputError, match=r"needs 3 rows of 6 floats"):
        open_pyg_stores(homo, embeddings=table, writable=True)[0].put_tensor(torch.zeros(2, 6), group_name=None,
                                                                              attr_name="x", index=ids)  # fmt: skip
    ro.close()


def test_loader_workers_read_through_their_own_readers(homo):
    """PyG's loader workers fork the process after it read through the store: each opens its own readers (the
    parent's rings and threads do not exist there) and the batches are those of a loader without workers."""
    fs, gs = open_pyg_stores(homo.root, in_memory=False, host_cache="16KiB")
    fs.get_tensor(None, "x", torch.tensor([1, 2]))  # the parent's reader exists before the fork
    seeds = torch.arange(400)

    def loader(workers):
        torch.manual_seed(1)
        return list(NeighborLoader((fs, gs), num_neighbors=[3, 3], input_nodes=seeds, batch_size=100,
                                   num_workers=workers, neighbor_sampler=PyGNeighborSampler((fs, gs), [3, 3])))  # fmt: skip

    ref = loader(0)
    got = loader(2)
    # workers draw their own sampling seeds: compare what each batch's nodes read, not the samples
    assert len(got) == 4
    for b in got:
        assert torch.equal(b.x, _data(homo).x[b.n_id]) and torch.equal(b.y, torch.from_numpy(np.array(homo.labels))[b.n_id])
    assert len(ref) == 4
    # and the parent still reads after the workers are gone
    assert torch.equal(fs.get_tensor(None, "x", torch.tensor([3])), _data(homo).x[[3]])
    fs.close()


def test_stores_pickle_as_path_and_options(homo):
    fs, gs = open_pyg_stores(homo.root, in_memory=False, host_cache="8KiB")
    fs2, gs2 = pickle.loads(pickle.dumps((fs, gs)))
    assert fs2.options == fs.options and str(fs2.dataset.root) == str(homo.root)
    idx = torch.tensor([9, 8, 7])
    assert torch.equal(fs2.get_tensor(None, "x", idx), fs.get_tensor(None, "x", idx))
    assert torch.equal(gs2.get_edge_index(None, "csc")[1], gs.get_edge_index(None, "csc")[1])
    fs.close()
    fs2.close()


def test_pygs_own_sampler_over_our_graph_store(homo):
    """Where pyg-lib or torch-sparse is installed, PyG's own NeighborSampler runs over the pair (its CSC from
    graph_store.csc()): every sampled edge is an edge of the graph, and x and y are the sampled nodes' rows."""
    from lightning_ooc.bench.pyg_reference import available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    data = _data(homo)
    fs, gs = open_pyg_stores(homo.root)
    edges = set(map(tuple, data.edge_index.t().tolist()))
    n = 0
    for b in NeighborLoader((fs, gs), num_neighbors=[4, 2], input_nodes=torch.arange(0, 3000, 7), batch_size=200):
        assert torch.equal(b.x, data.x[b.n_id]) and torch.equal(b.y, data.y[b.n_id])
        src, dst = b.n_id[b.edge_index[0]], b.n_id[b.edge_index[1]]
        assert all((s, d) in edges for s, d in zip(src.tolist(), dst.tolist()))
        n += b.batch_size
    assert n == len(range(0, 3000, 7))
    fs.close()
