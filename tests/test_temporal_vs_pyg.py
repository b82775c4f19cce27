"""Temporal sampling against PyG's own (pyg-lib): the same subgraphs where PyG is deterministic
(``temporal_strategy="last"``), the same distribution where it draws (``"uniform"``), PyG's own temporal
``NeighborLoader`` over our store pair, and the same predictions and accuracy through the datamodule as
through PyG's loader over an in-memory ``Data``.

PyG samples by time only with pyg-lib, a benchmark reference that is never a dependency: where it is not
installed these tests are skipped (``tests/test_temporal_sampler.py`` compares the sampler with a plain-Python
reference everywhere).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from lightning_ooc import InMemory, OutOfCoreNodeData, open_dataset
from lightning_ooc.data.synth import synthesize
from lightning_ooc.sampling import CSCGraph, HeteroCSCGraph, HeteroNeighborSampler, NeighborSampler


def _pyg_lib() -> bool:
    try:
        __import__("pyg_lib")
    except ImportError:
        return False
    return hasattr(torch.ops.pyg, "neighbor_sample")


pytestmark = [
    pytest.mark.skipif(not _pyg_lib(), reason="PyG samples by time only with pyg-lib, which is not installed"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _hetero(seed: int):
    from torch_geometric.data import HeteroData

    g = torch.Generator().manual_seed(seed)
    data = HeteroData()
    data["user"].num_nodes, data["item"].num_nodes = 40, 25
    for t in ("user", "item"):
        data[t].time = torch.randint(0, 60, (data[t].num_nodes,), generator=g)
    buys = torch.stack([torch.randint(0, 40, (300,), generator=g), torch.randint(0, 25, (300,), generator=g)])
    data["user", "buys", "item"].edge_index = buys
    data["item", "rev_buys", "user"].edge_index = buys.flip(0)
    data["user", "follows", "user"].edge_index = torch.randint(0, 40, (2, 150), generator=g)
    for et in data.edge_types:
        data[et].ts = torch.randint(0, 60, (data[et].edge_index.size(1),), generator=g)
    return data


def _by_subgraph(n_id: dict, batch: dict, edges: dict) -> tuple[Counter, Counter]:
    """Nodes as (subgraph, type, global id) and edges as (subgraph, relation, global source, global target):
    what a sample is, whatever order its nodes are numbered in."""
    nodes = Counter((int(b), t, int(v)) for t in n_id for v, b in zip(n_id[t], batch[t]))
    out = Counter()
    for et, (row, col) in edges.items():
        src, _, dst = et
        for r, c in zip(row.tolist(), col.tolist()):
            out[(int(batch[dst][c]), et, int(n_id[src][r]), int(n_id[dst][c]))] += 1
    return nodes, out


@pytest.mark.parametrize("time_attr", ["time", "ts"])
@pytest.mark.parametrize("graph_seed", range(3))
def test_hetero_last_equals_pyg_lib(time_attr, graph_seed):
    """Heterogeneous, ``"last"``: every seed's subgraph holds the same typed nodes and edges as pyg-lib's."""
    from torch_geometric.sampler import NeighborSampler as PyGSampler, NodeSamplerInput

    data = _hetero(graph_seed)
    ours_attr = "time" if time_attr == "time" else "edge_time"
    graph = HeteroCSCGraph.from_hetero_data(data, time_attr=time_attr)
    ours = HeteroNeighborSampler(graph, [3, 2], time_attr=ours_attr, temporal_strategy="last")
    theirs = PyGSampler(data, [3, 2], time_attr=time_attr, temporal_strategy="last")
    seeds, st = torch.tensor([0, 4, 4, 19, 24]), torch.tensor([55, 10, 40, 25, 5])
    a = ours.sample_subgraph(seeds, "item", seed=0, seed_time=st)
    b = theirs.sample_from_nodes(NodeSamplerInput(input_id=None, node=seeds, time=st, input_type="item"))
    b_edges = {et: (b.row[et], b.col[et]) for et in b.row}
    a_edges = {et: (a.edge_index[et][0], a.edge_index[et][1]) for et in a.edge_index}
    nodes_a, edges_a = _by_subgraph(a.n_id, a.batch, a_edges)
    nodes_b, edges_b = _by_subgraph(b.node, b.batch, b_edges)
    assert nodes_a == nodes_b
    assert edges_a == edges_b and sum(edges_a.values()) > 0
    assert torch.equal(a.n_id["item"][:5], seeds)  # the seeds first, in their order, as PyG's


def test_uniform_matches_pyg_libs_distribution():
    """``"uniform"``: over many draws, each eligible in-edge of a seed is picked as often by ours as by pyg-lib
    (a chi-square test of homogeneity), and neither picks an edge later than the seed's time."""
    from scipy.stats import chi2_contingency
    from torch_geometric.data import Data
    from torch_geometric.sampler import NeighborSampler as PyGSampler, NodeSamplerInput

    # node 0 has 12 in-edges at times 0..11, two of them from node 5 (a source that may be picked twice)
    src = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 5])
    edge_index = torch.stack([src, torch.zeros(12, dtype=torch.long)])
    edge_time = torch.arange(12)
    graph = CSCGraph.from_edge_index(edge_index, 12, edge_time=edge_time)
    ours = NeighborSampler(graph, [3], time_attr="edge_time", temporal_strategy="uniform", return_e_id=True)
    data = Data(edge_index=edge_index, edge_time=edge_time, num_nodes=12)
    theirs = PyGSampler(data, [3], time_attr="edge_time", temporal_strategy="uniform")
    draws, seed_time = 3000, 8  # 9 eligible edges (times 0..8)
    counts = {"ours": Counter(), "pyg": Counter()}
    torch.manual_seed(0)
    for i in range(draws):
        a = ours.sample_subgraph(torch.tensor([0]), seed=i, seed_time=torch.tensor([seed_time]))
        columns = a.e_id if graph.perm is None else graph.perm[a.e_id]  # CSC positions -> input columns
        counts["ours"].update(edge_time[columns].tolist())
        b = theirs.sample_from_nodes(NodeSamplerInput(input_id=None, node=torch.tensor([0]),
                                                      time=torch.tensor([seed_time])))  # fmt: skip
        counts["pyg"].update(edge_time[b.edge].tolist())
    for who, c in counts.items():
        assert set(c) <= set(range(seed_time + 1)), who  # nothing later than the seed
        assert sum(c.values()) == 3 * draws, who  # three distinct edges a draw (9 are eligible)
    table = np.array([[counts[w][t] for t in range(seed_time + 1)] for w in ("ours", "pyg")])
    assert chi2_contingency(table).pvalue > 1e-4
    # and neither is skewed: every eligible edge near 1/3 of the draws
    assert np.all(np.abs(table / draws - 1 / 3) < 0.05)


@pytest.fixture(scope="module")
def temporal_graph(tmp_path_factory):
    root = tmp_path_factory.mktemp("vs_pyg") / "g"
    return synthesize(root, num_nodes=2000, avg_degree=6, num_features=8, num_classes=4, train_frac=0.2,
                      val_frac=0.2, test_frac=0.1, temporal=True, progress=False)  # fmt: skip


def _pyg_data(ds):
    """The dataset in memory as a PyG ``Data``: its edges in the stored (time) order, with their times."""
    from torch_geometric.data import Data

    indptr = torch.from_numpy(np.asarray(ds.indptr)).long()
    dst = torch.repeat_interleave(torch.arange(ds.num_nodes), indptr[1:] - indptr[:-1])
    return Data(x=ds.read_features(torch.arange(ds.num_nodes)), y=torch.from_numpy(np.asarray(ds.labels)).long(),
                edge_index=torch.stack([torch.from_numpy(np.asarray(ds.indices)).long(), dst]),
                edge_time=torch.from_numpy(np.asarray(ds.edge_time)).long(),
                time=torch.from_numpy(np.asarray(ds.node_time)).long(), num_nodes=ds.num_nodes)  # fmt: skip


@pytest.mark.parametrize("time_attr", ["edge_time", "time"])
def test_pygs_own_temporal_loader_over_our_stores_equals_it_in_memory(temporal_graph, time_attr):
    """PyG's own ``NeighborLoader(time_attr=...)`` over our FeatureStore/GraphStore pair (its CSC and times
    read from the pair) gives the batches it gives over the same graph in memory. PyG sorts nothing it reads
    from a graph store: by node time, the dataset's in-edges must be in their sources' time order
    (``neighbor_order="node_time"``)."""
    from torch_geometric.loader import NeighborLoader

    from lightning_ooc.data.prepare import prepare_from_dataset
    from lightning_ooc.pyg import open_pyg_stores

    if time_attr == "time":
        temporal_graph = prepare_from_dataset(temporal_graph.parent / "by_node_time", temporal_graph,
                                              neighbor_order="node_time", overwrite=True, progress=False)  # fmt: skip
    ds = open_dataset(temporal_graph)
    data = _pyg_data(ds)
    seeds, times = ds.split("val"), ds.split_time("val")
    kw = dict(num_neighbors=[4, 3], input_nodes=seeds, input_time=times, time_attr=time_attr,
              temporal_strategy="last", batch_size=50, shuffle=False)  # fmt: skip
    fs, gs = open_pyg_stores(temporal_graph)
    try:
        batches = 0
        for a, b in zip(NeighborLoader((fs, gs), **kw), NeighborLoader(data, **kw), strict=True):
            assert torch.equal(a.n_id, b.n_id) and torch.equal(a.batch, b.batch)
            assert torch.equal(a.edge_index, b.edge_index)
            assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
            batches += 1
        assert batches == -(-seeds.numel() // 50)
    finally:
        fs.close()


def test_predictions_and_accuracy_equal_pygs_in_memory_loader(temporal_graph):
    """The datamodule in order (``temporal_strategy="last"``, out of core) and PyG's temporal ``NeighborLoader``
    over an in-memory ``Data`` feed one model the same subgraphs: the same logits for every seed, so the same
    accuracy."""
    from torch_geometric.loader import NeighborLoader
    from torch_geometric.nn import GraphSAGE

    ds = open_dataset(temporal_graph)
    torch.manual_seed(0)
    model = GraphSAGE(ds.num_features, 16, 2, out_channels=ds.num_classes).eval()
    dm = OutOfCoreNodeData(temporal_graph, batch_size=64, num_neighbors=[5, 5], features=InMemory(),
                           pipeline={"order": "in_order"}, progress=False, memory_limit=None,
                           time={"time_attr": "edge_time", "temporal_strategy": "last"})  # fmt: skip
    dm.setup()
    try:
        ours = []
        with torch.no_grad():
            for batch in dm.val_dataloader():
                ours.append((batch.n_id[: batch.batch_size], model(batch.x, batch.edge_index)[: batch.batch_size]))
    finally:
        dm.teardown()
    data = _pyg_data(ds)
    theirs = []
    loader = NeighborLoader(data, num_neighbors=[5, 5], input_nodes=ds.split("val"), input_time=ds.split_time("val"),
                            time_attr="edge_time", temporal_strategy="last", batch_size=64, shuffle=False)  # fmt: skip
    with torch.no_grad():
        for batch in loader:
            theirs.append((batch.n_id[: batch.batch_size], model(batch.x, batch.edge_index)[: batch.batch_size]))
    ids_a, out_a = (torch.cat(v) for v in zip(*ours))
    ids_b, out_b = (torch.cat(v) for v in zip(*theirs))
    assert torch.equal(ids_a, ids_b) and torch.equal(ids_a, ds.split("val"))
    torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-6)
    y = torch.from_numpy(np.asarray(ds.labels))[ids_a].long()
    acc_a, acc_b = (out_a.argmax(-1) == y).float().mean(), (out_b.argmax(-1) == y).float().mean()
    assert acc_a == acc_b


def test_link_scores_equal_pygs_temporal_link_loader(temporal_graph, tmp_path):
    """Links by time: the datamodule (each supervision edge's subgraph at its time, ``"last"``, in order) and
    PyG's ``LinkNeighborLoader(edge_label_time=...)`` over the graph in memory give one model the same subgraphs:
    the same score for every validation edge, so the same ranking metrics."""
    from torch_geometric.loader import LinkNeighborLoader
    from torch_geometric.nn import GraphSAGE

    from lightning_ooc import OutOfCoreLinkData
    from lightning_ooc.data.prepare import prepare_from_dataset

    root = prepare_from_dataset(tmp_path / "links", temporal_graph, split_edges=(0.7, 0.15, 0.15), progress=False)
    ds = open_dataset(root)
    torch.manual_seed(0)
    model = GraphSAGE(ds.num_features, 16, 2).eval()

    def scores(batch):
        z = model(batch.x, batch.edge_index)
        src, dst = batch.edge_label_index
        return (z[src] * z[dst]).sum(-1), batch.n_id[src], batch.n_id[dst]

    dm = OutOfCoreLinkData(root, batch_size=40, num_neighbors=[4, 3], features=InMemory(), progress=False,
                           memory_limit=None, pipeline={"order": "in_order"},
                           time={"time_attr": "edge_time", "temporal_strategy": "last"})  # fmt: skip
    dm.setup()
    try:
        with torch.no_grad():
            ours = [scores(b) for b in dm.val_dataloader()]
    finally:
        dm.teardown()
    val = ds.link_split("val")
    loader = LinkNeighborLoader(_pyg_data(ds), num_neighbors=[4, 3], edge_label_index=val.index,
                                edge_label_time=val.time, time_attr="edge_time", temporal_strategy="last",
                                batch_size=40, shuffle=False)  # fmt: skip
    with torch.no_grad():
        theirs = [scores(b) for b in loader]
    a = [torch.cat(v) for v in zip(*ours)]
    b = [torch.cat(v) for v in zip(*theirs)]
    assert torch.equal(a[1], val.index[0]) and torch.equal(a[2], val.index[1])  # every edge once, in order
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
