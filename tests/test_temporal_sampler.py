"""Temporal neighbour sampling (PyG's ``time_attr`` / ``temporal_strategy``) in the native samplers.

Checked against the plain-Python reference (``sampling/temporal_reference.py``) always, exactly where the
sampling is deterministic ("last", or every eligible edge) and in distribution for "uniform"; against
pyg-lib where it is installed.
"""
from __future__ import annotations

import collections
import random

import numpy as np
import pytest
import torch
from torch_geometric.data import HeteroData

from lightning_ooc.errors import InputError
from lightning_ooc.sampling import CSCGraph, HeteroCSCGraph, HeteroNeighborSampler, NeighborSampler
from lightning_ooc.sampling.temporal_reference import hetero_temporal_sample, temporal_sample


def _random_graph(n: int, e: int, seed: int, *, t_max: int = 30):
    g = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, n, (2, e), generator=g)
    node_time = torch.randint(0, t_max, (n,), generator=g)
    edge_time = torch.randint(0, t_max, (e,), generator=g)  # many ties: ties must not matter
    return edge_index, node_time, edge_time


def _as_reference(out):
    edges = list(zip(out.edge_index[0].tolist(), out.edge_index[1].tolist(), out.e_id.tolist()))
    return {"n_id": out.n_id.tolist(), "batch": out.batch.tolist(), "edges": edges,
            "num_sampled_nodes": out.num_sampled_nodes, "num_sampled_edges": out.num_sampled_edges}  # fmt: skip


@pytest.mark.parametrize("time_attr", ["time", "edge_time"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("fanouts", [[3, 2], [-1, 2], [1, 1, 1]])
def test_last_equals_the_reference_exactly(time_attr, window, fanouts):
    edge_index, node_time, edge_time = _random_graph(60, 500, seed=len(fanouts) + (window or 0))
    kw = {"node_time": node_time} if time_attr == "time" else {"edge_time": edge_time}
    g = CSCGraph.from_edge_index(edge_index, 60, **kw)
    sampler = NeighborSampler(g, fanouts, time_attr=time_attr, temporal_strategy="last", time_window=window,
                              return_e_id=True)  # fmt: skip
    seeds = torch.tensor([0, 5, 5, 17, 33, 59])
    seed_time = torch.tensor([10, 3, 25, 29, 0, 15])
    out = sampler.sample_subgraph(seeds, seed=1, seed_time=seed_time)
    ref = temporal_sample(g.indptr, g.indices, seeds.tolist(), seed_time.tolist(), fanouts,
                          node_time=g.node_time if time_attr == "time" else None,
                          edge_time=g.edge_time if time_attr == "edge_time" else None, strategy="last",
                          window=window)  # fmt: skip
    assert _as_reference(out) == ref
    assert out.seed_time.tolist() == seed_time.tolist()


@pytest.mark.parametrize("time_attr", ["time", "edge_time"])
def test_no_edge_later_than_its_seed_and_none_outside_the_window(time_attr):
    edge_index, node_time, edge_time = _random_graph(200, 3000, seed=3, t_max=100)
    kw = {"node_time": node_time} if time_attr == "time" else {"edge_time": edge_time}
    g = CSCGraph.from_edge_index(edge_index, 200, **kw)
    for window in (None, 20):
        sampler = NeighborSampler(g, [5, 5], time_attr=time_attr, time_window=window, return_e_id=True)
        seeds = torch.arange(0, 200, 3)
        st = torch.randint(0, 100, (seeds.numel(),), generator=torch.Generator().manual_seed(4))
        out = sampler.sample_subgraph(seeds, seed=9, seed_time=st)
        src, dst = out.edge_index
        assert torch.equal(out.batch[src], out.batch[dst])  # a subgraph per seed
        t_edge = (torch.from_numpy(g.edge_time)[out.e_id] if time_attr == "edge_time"
                  else torch.from_numpy(g.node_time)[out.n_id[src]])  # fmt: skip
        limit = st[out.batch[dst]]
        assert out.e_id.numel() > 100
        assert bool((t_edge <= limit).all())
        if window is not None:
            assert bool((t_edge >= limit - window).all())
        # and nothing eligible was left out where the fanout allowed all of it
        ref = temporal_sample(g.indptr, g.indices, seeds.tolist(), st.tolist(), [-1],
                              node_time=g.node_time if time_attr == "time" else None,
                              edge_time=g.edge_time if time_attr == "edge_time" else None, window=window)  # fmt: skip
        full = NeighborSampler(g, [-1], time_attr=time_attr, time_window=window, return_e_id=True)
        assert _as_reference(full.sample_subgraph(seeds, seed=0, seed_time=st)) == ref


def test_uniform_samples_every_eligible_edge_equally_often():
    # node 0 has 40 in-edges at times 0..39; a seed at time 24 may see 25 of them; fanout 5
    edge_index = torch.stack([torch.arange(1, 41), torch.zeros(40, dtype=torch.long)])
    g = CSCGraph.from_edge_index(edge_index, 41, edge_time=torch.arange(40))
    for replace in (False, True):
        sampler = NeighborSampler(g, [5], replace=replace, time_attr="edge_time", return_e_id=True)
        counts = collections.Counter()
        draws = 4000
        for s in range(draws):
            out = sampler.sample_subgraph([0], seed=s, seed_time=[24])
            assert out.e_id.numel() == 5
            counts.update(out.e_id.tolist())
        assert set(counts) == set(range(25))  # positions 0..24 hold times 0..24
        expected = draws * 5 / 25
        chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
        assert chi2 < 60, chi2  # 24 degrees of freedom: p < 1e-4 for a uniform sampler
    # the reference draws from the same set
    ref = collections.Counter()
    rng = random.Random(0)
    for _ in range(200):
        out = temporal_sample(g.indptr, g.indices, [0], [24], [5], edge_time=g.edge_time, rng=rng)
        ref.update(e for _, _, e in out["edges"])
    assert set(ref) <= set(range(25))


def test_seed_time_defaults_to_the_seed_node_time_and_edge_time_needs_it():
    edge_index = torch.tensor([[1, 2, 3], [0, 0, 0]])
    g = CSCGraph.from_edge_index(edge_index, 4, node_time=torch.tensor([2, 1, 2, 3]))
    out = NeighborSampler(g, [-1], time_attr="time").sample_subgraph([0], seed=0)
    assert sorted(out.n_id.tolist()) == [0, 1, 2] and out.seed_time.tolist() == [2]
    ge = CSCGraph.from_edge_index(edge_index, 4, edge_time=torch.tensor([1, 2, 3]))
    with pytest.raises(InputError, match="give each seed its time"):
        NeighborSampler(ge, [-1], time_attr="edge_time").sample_subgraph([0], seed=0)


def test_disjoint_without_time_gives_each_seed_its_own_nodes():
    edge_index = torch.tensor([[1, 2, 2], [0, 0, 3]])
    g = CSCGraph.from_edge_index(edge_index, 4)
    data = NeighborSampler(g, [-1], disjoint=True).sample(torch.tensor([0, 3]), seed=0)
    assert data.n_id.tolist() == [0, 3, 1, 2, 2] and data.batch.tolist() == [0, 1, 0, 0, 1]
    assert data.edge_index.tolist() == [[2, 3, 4], [0, 0, 1]]


def test_bad_requests_are_refused_in_one_line():
    edge_index, node_time, edge_time = _random_graph(10, 30, seed=0)
    plain = CSCGraph.from_edge_index(edge_index, 10)
    with pytest.raises(InputError, match="no node times"):
        NeighborSampler(plain, [2], time_attr="time")
    plain.node_time = node_time.numpy()
    with pytest.raises(InputError, match="source id order.*from_edge_index"):
        NeighborSampler(plain, [2], time_attr="time")
    g = CSCGraph.from_edge_index(edge_index, 10, node_time=node_time)
    with pytest.raises(InputError, match="temporal_strategy"):
        NeighborSampler(g, [2], time_attr="time", temporal_strategy="latest")
    with pytest.raises(InputError, match="time_attr must be"):
        NeighborSampler(g, [2], time_attr="year")
    with pytest.raises(InputError, match="time_window"):
        NeighborSampler(g, [2], time_attr="time", time_window=-1)
    with pytest.raises(InputError, match="time_window needs time_attr"):
        NeighborSampler(g, [2], time_window=3)
    with pytest.raises(InputError, match="seed_time is for temporal"):
        NeighborSampler(g, [2]).sample_subgraph([0], seed_time=[1])
    with pytest.raises(InputError, match="2 seed times for 1 seeds"):
        NeighborSampler(g, [2], time_attr="time").sample_subgraph([0], seed_time=[1, 2])
    # a graph that claims time order but is not in it: an error naming the node, never a wrong sample
    g.indices = np.ascontiguousarray(g.indices[::-1])
    bad = NeighborSampler(g, [-1], time_attr="time")
    v = int(np.flatnonzero(np.diff(g.indptr) > 1)[0])
    with pytest.raises(ValueError, match="not in time order"):
        for s in range(10):
            bad.sample_subgraph([s], seed_time=[100])
    assert v >= 0


def _hetero(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    data = HeteroData()
    data["user"].num_nodes = 30
    data["item"].num_nodes = 20
    data["user"].time = torch.randint(0, 50, (30,), generator=g)
    data["item"].time = torch.randint(0, 50, (20,), generator=g)
    data["user", "buys", "item"].edge_index = torch.stack([torch.randint(0, 30, (200,), generator=g),
                                                          torch.randint(0, 20, (200,), generator=g)])  # fmt: skip
    data["item", "rev_buys", "user"].edge_index = data["user", "buys", "item"].edge_index.flip(0)
    data["user", "follows", "user"].edge_index = torch.randint(0, 30, (2, 100), generator=g)
    for et in data.edge_types:
        data[et].ts = torch.randint(0, 50, (data[et].edge_index.size(1),), generator=g)
    return data


@pytest.mark.parametrize("time_attr", ["time", "ts"])
@pytest.mark.parametrize("window", [None, 10])
def test_hetero_last_equals_the_reference_exactly(time_attr, window):
    data = _hetero(1)
    graph = HeteroCSCGraph.from_hetero_data(data, time_attr=time_attr)
    ours = "time" if time_attr == "time" else "edge_time"
    sampler = HeteroNeighborSampler(graph, [3, 2], time_attr=ours, temporal_strategy="last", time_window=window,
                                    return_e_id=True)  # fmt: skip
    seeds, st = torch.tensor([0, 4, 4, 19]), torch.tensor([40, 10, 49, 25])
    out = sampler.sample_subgraph(seeds, "item", seed=3, seed_time=st)
    rels = {et: (c.indptr, c.indices, c.edge_time) for et, c in graph.csc.items()}
    ref = hetero_temporal_sample(graph.num_nodes_dict, rels, seeds.tolist(), "item", st.tolist(),
                                 {et: [3, 2] for et in graph.edge_types},
                                 node_time=graph.node_time if ours == "time" else None, strategy="last",
                                 window=window)  # fmt: skip
    assert {t: v.tolist() for t, v in out.n_id.items()} == ref["n_id"]
    assert {t: v.tolist() for t, v in out.batch.items()} == ref["batch"]
    for et in graph.edge_types:
        got = list(zip(*(x.tolist() for x in (out.edge_index[et][0], out.edge_index[et][1], out.e_id[et]))))
        assert got == ref["edges"][et], et
    assert out.num_sampled_nodes == ref["num_sampled_nodes"]
    data_out = sampler.sample(seeds, "item", seed=3, seed_time=st)
    assert data_out["item"].seed_time.tolist() == st.tolist() and data_out["user"].batch is not None


def test_hetero_relation_without_times_is_sampled_uniformly_as_pyg_does():
    data = _hetero(2)
    del data["user"].time  # relations from users have no source time: PyG samples them without a time limit
    graph = HeteroCSCGraph.from_hetero_data(data, time_attr="time")
    sampler = HeteroNeighborSampler(graph, [-1], time_attr="time")
    out = sampler.sample_subgraph(torch.tensor([3]), "item", seed=0, seed_time=torch.tensor([0]))
    buys = graph.csc["user", "buys", "item"]
    assert out.edge_index["user", "buys", "item"].size(1) == buys.indptr[4] - buys.indptr[3] > 0
    with pytest.raises(InputError, match="no relation of the graph has node times"):
        del data["item"].time
        HeteroNeighborSampler(HeteroCSCGraph.from_hetero_data(data), [-1], time_attr="time")


def _pyg_lib():
    try:
        __import__("pyg_lib")  # a reference only: never a dependency
    except ImportError:
        return False
    return hasattr(torch.ops.pyg, "neighbor_sample")


@pytest.mark.skipif(not _pyg_lib(), reason="pyg-lib is not installed: compared with the plain-Python reference only")
@pytest.mark.parametrize("time_attr", ["time", "edge_time"])
def test_last_equals_pyg_lib(time_attr):
    from torch_geometric.data import Data
    from torch_geometric.sampler import NeighborSampler as PyGSampler, NodeSamplerInput

    edge_index, node_time, edge_time = _random_graph(80, 600, seed=11)
    data = Data(edge_index=edge_index, num_nodes=80)
    kw = {}
    if time_attr == "time":
        data.time = node_time
        kw["node_time"] = node_time
    else:
        data.edge_time = edge_time
        kw["edge_time"] = edge_time
    ours = NeighborSampler(CSCGraph.from_edge_index(edge_index, 80, **kw), [3, 2], time_attr=time_attr,
                           temporal_strategy="last")  # fmt: skip
    theirs = PyGSampler(data, [3, 2], time_attr=time_attr, temporal_strategy="last")
    seeds, st = torch.tensor([1, 7, 7, 40, 79]), torch.tensor([12, 3, 29, 20, 8])
    a = ours.sample_subgraph(seeds, seed=0, seed_time=st)
    b = theirs.sample_from_nodes(NodeSamplerInput(input_id=None, node=seeds, time=st))
    assert a.n_id.tolist() == b.node.tolist() and a.batch.tolist() == b.batch.tolist()
    assert a.edge_index[0].tolist() == b.row.tolist() and a.edge_index[1].tolist() == b.col.tolist()


def test_out_of_range_counts_and_times_are_refused_not_wrapped():
    from lightning_ooc import _sampler

    g = CSCGraph.from_edge_index(torch.tensor([[1, 2, 3], [0, 0, 0]]), 4, edge_time=torch.tensor([1, 2, 3]))
    for k in (2**61, 2**63 - 1):  # counts whose arrays would overflow: refused before anything is allocated
        with pytest.raises(InputError, match="num_neighbors"):
            NeighborSampler(g, [k], replace=True)
        with pytest.raises(ValueError, match="fanout of hop 0"):
            _sampler.sample(g.indptr, g.indices, np.array([0]), [k], True, 0, False)
        with pytest.raises(ValueError, match="fanouts"):
            _sampler.sample_hetero([4], [(g.indptr, g.indices, 0, 0, [k], "r")], np.array([0]), 0, 1, True, 0, False)
    s = NeighborSampler(g, [-1], time_attr="edge_time")
    with pytest.raises(InputError, match="past the largest int64 time"):
        s.sample_subgraph([0], seed_time=np.array([2**63], dtype=np.uint64))
    assert s.sample_subgraph([0], seed_time=np.array([2], dtype=np.uint64)).n_id.tolist() == [0, 1, 2]
    with pytest.raises(InputError, match="time_window must be an int in"):
        NeighborSampler(g, [-1], time_attr="edge_time", time_window=2**63)
    assert NeighborSampler(g, [-1], time_attr="edge_time", time_window=2**63 - 1).temporal.window == 2**63 - 1


def test_a_seed_type_without_node_times_is_named_as_such():
    data = _hetero(4)
    del data["item"].time  # seeds are items; users keep their times
    sampler = HeteroNeighborSampler(HeteroCSCGraph.from_hetero_data(data, time_attr="time"), [2], time_attr="time")
    with pytest.raises(InputError, match="node time, and the seeds' node type has no node times"):
        sampler.sample_subgraph(torch.tensor([0]), "item")
    by_edge = HeteroNeighborSampler(HeteroCSCGraph.from_hetero_data(_hetero(4), time_attr="ts"), [2],
                                    time_attr="edge_time")  # fmt: skip
    with pytest.raises(InputError, match="samples by edge time"):  # as PyG: by edge time each seed's time is given
        by_edge.sample_subgraph(torch.tensor([0]), "item")
