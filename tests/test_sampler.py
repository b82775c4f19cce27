"""The native neighbour sampler: correctness, statistics, determinism, the PyG adapter, input checks.

Statistical tests use fixed seeds and a chi-square test at significance
0.001 (critical values from the Wilson-Hilferty approximation, within 1% of
the exact quantile for these degrees of freedom): a correct sampler fails
one of them with probability about 1e-3 per test *for some seed*, and since
the seeds are fixed the outcome is reproducible. A biased sampler (say, the
first ``k`` neighbours, or a modulo-biased draw) exceeds the critical value
by orders of magnitude.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_geometric.data import Data
from torch_geometric.loader import NodeLoader

import lightning_ooc
from lightning_ooc.data.writer import ArrayEdgeSource, DatasetWriter
from lightning_ooc.errors import InputError
from lightning_ooc.sampling import (
    CSCGraph,
    NeighborSampler,
    PyGNeighborSampler,
    TorchNeighborSampler,
    release_thread_workspace,
)

# ----------------------------------------------------------------------------- helpers


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Upper quantile of the chi-square law (Wilson-Hilferty); z = 3.0902 is the normal 0.999 quantile."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: np.ndarray) -> float:
    """Pearson's statistic for equal cell probabilities (multinomial counts: draws with replacement)."""
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


def inclusion_chi2_stat(counts: np.ndarray, trials: int, k: int) -> float:
    """Chi-square statistic (df = d - 1) for how often each of d neighbours was in a uniform k-subset.

    Each neighbour is included with p = k / d, variance p(1 - p) per trial and covariance
    -p(1 - p) / (d - 1) between two neighbours, so the counts' covariance is
    trials p (1 - p) d / (d - 1) (I - J / d): scaled this way the statistic is chi-square with
    d - 1 degrees of freedom. (Pearson's form would be too lenient by 1 - p.)
    """
    d = counts.size
    p = k / d
    return float(((counts - trials * p) ** 2).sum() / (trials * p * (1 - p)) * (d - 1) / d)


def python_khop(indptr, indices, seeds, hops):
    """Plain Python reference of fanout -1 sampling: every in-neighbour, relabelled in hop order."""
    local: dict[int, int] = {}
    n_id = [int(s) for s in seeds]
    for i, s in enumerate(n_id):
        local.setdefault(s, i)
    rows, cols, hop_nodes, hop_edges = [], [], [len(n_id)], []
    fb, fe = 0, len(n_id)
    for _ in range(hops):
        before = len(rows)
        for t in range(fb, fe):
            v = n_id[t]
            for u in indices[indptr[v] : indptr[v + 1]]:
                u = int(u)
                if u not in local:
                    local[u] = len(n_id)
                    n_id.append(u)
                rows.append(local[u])
                cols.append(t)
        hop_edges.append(len(rows) - before)
        hop_nodes.append(len(n_id) - fe)
        fb, fe = fe, len(n_id)
    return n_id, [rows, cols], hop_nodes, hop_edges


def khop_edge_multiset(edge_index: np.ndarray, num_nodes: int, seeds, hops: int) -> Counter:
    """The in-edges (src, dst) of every node within hops - 1 in-steps of a seed, by plain BFS."""
    in_nbrs: dict[int, list[int]] = {v: [] for v in range(num_nodes)}
    for s, d in edge_index.T.tolist():
        in_nbrs[d].append(s)
    dist = {int(s): 0 for s in seeds}
    level = list(dist)
    for h in range(1, hops):
        nxt = []
        for v in level:
            for u in in_nbrs[v]:
                if u not in dist:
                    dist[u] = h
                    nxt.append(u)
        level = nxt
    return Counter((u, v) for v in (dist if hops > 0 else []) for u in in_nbrs[v])


def check_invariants(graph, out, fanouts, replace):
    """Properties every sample must have, whatever the random draws."""
    indptr, indices = np.asarray(graph.indptr), np.asarray(graph.indices)
    n_id, (row, col) = out.n_id.numpy(), out.edge_index.numpy()
    e_id = out.e_id.numpy()
    assert out.n_id.dtype == out.edge_index.dtype == torch.int64
    assert len(out.num_sampled_nodes) == len(fanouts) + 1 and len(out.num_sampled_edges) == len(fanouts)
    assert sum(out.num_sampled_nodes) == n_id.size and sum(out.num_sampled_edges) == row.size
    assert np.unique(n_id[out.batch_size :]).size == n_id.size - out.batch_size  # no node twice
    assert not set(n_id[out.batch_size :].tolist()) & set(n_id[: out.batch_size].tolist())
    node_start = np.cumsum([0] + out.num_sampled_nodes)
    edge_start = np.cumsum([0] + out.num_sampled_edges)
    for h, k in enumerate(fanouts):
        sl = slice(edge_start[h], edge_start[h + 1])
        r, c, e = row[sl], col[sl], e_id[sl]
        # targets of hop h+1 are the nodes first reached at hop h, in order
        lo, hi = node_start[h], node_start[h + 1]
        assert np.all((c >= lo) & (c < hi)) and np.all(np.diff(c) >= 0)
        # every edge exists: its source sits at its CSC position among the target's in-edges
        tv = n_id[c]
        assert np.all((e >= indptr[tv]) & (e < indptr[tv + 1]))
        assert np.array_equal(indices[e], n_id[r])
        # new nodes of this hop are numbered in order of first appearance
        new = r[r >= hi]
        first = new[np.sort(np.unique(new, return_index=True)[1])]
        assert np.array_equal(first, np.arange(hi, hi + first.size)) and hi + first.size == node_start[h + 2]
        # each target gets min(fanout, degree) neighbours (fanout if any, with replacement)
        deg = indptr[n_id[lo:hi] + 1] - indptr[n_id[lo:hi]]
        got = np.bincount(c - lo, minlength=hi - lo)
        if k < 0:
            want = deg
        elif replace:
            want = np.where(deg > 0, k, 0)
        else:
            want = np.minimum(deg, k)
        assert np.array_equal(got, want)
        if not replace:  # no edge twice for a target
            pairs = c.astype(np.int64) * (indices.size + 1) + e
            assert np.unique(pairs).size == pairs.size


def random_edge_index(n: int, m: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, n, size=(2, m))


def write_dataset(root, edge_index: np.ndarray, num_nodes: int, num_classes: int = 3, *, simple: bool = True):
    rng = np.random.default_rng(0)
    with DatasetWriter(root, num_nodes=num_nodes, num_features=4, num_classes=num_classes) as w:
        w.write_edges(ArrayEdgeSource(edge_index), drop_duplicates=simple, drop_self_loops=simple)
        w.write_features([rng.standard_normal((num_nodes, 4)).astype(np.float32)])
        w.write_labels([rng.integers(0, num_classes, num_nodes)])
        w.write_split("train", np.arange(num_nodes // 2))
        w.write_split("val", np.arange(num_nodes // 2, num_nodes))
        w.write_split("test", np.array([], dtype=np.int64))
        return lightning_ooc.open_dataset(w.commit())


HUB_DEGREE = 50


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """2000 nodes, about 10 random in-edges each (simple graph); node 7 has exactly HUB_DEGREE in-neighbours."""
    n = 2000
    ei = random_edge_index(n, 20_000, seed=1)
    ei = ei[:, ei[1] != 7]
    hub_src = np.random.default_rng(2).choice(np.arange(8, n), HUB_DEGREE, replace=False)
    ei = np.concatenate([ei, np.stack([hub_src, np.full(HUB_DEGREE, 7)])], axis=1)
    ds = write_dataset(tmp_path_factory.mktemp("sampler") / "g", ei, n)
    assert ds.indices.dtype == np.int32 and isinstance(ds.indices, np.memmap)
    assert ds.in_degree[7] == HUB_DEGREE
    return ds


# ----------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("fanouts", [[5, 3, 2], [15, 10, 5], [0, 4], [2, -1], []])
def test_invariants_on_disk(dataset, fanouts, replace):
    sampler = NeighborSampler(dataset, fanouts, replace=replace, return_e_id=True)
    seeds = torch.from_numpy(np.random.default_rng(3).choice(dataset.num_nodes, 64, replace=False))
    for seed in range(5):
        out = sampler.sample_subgraph(seeds, seed=seed)
        assert torch.equal(out.n_id[: out.batch_size], seeds) and out.batch_size == 64
        check_invariants(dataset, out, fanouts, replace)
        if not replace:  # a simple graph: no neighbour twice for a target
            ei = out.edge_index.numpy()
            g = np.stack([out.n_id.numpy()[ei[0]], ei[1]])
            assert np.unique(g, axis=1).shape[1] == g.shape[1]


def test_large_fanouts_take_both_large_k_paths(dataset):
    """k > 32 uses selection sampling when degree <= 4k and Floyd with a hash set otherwise."""
    ei = np.stack([np.arange(1, 501), np.zeros(500, dtype=np.int64)])  # node 0 <- 1..500
    ei = np.concatenate([ei, np.stack([np.arange(2, 62), np.ones(60, dtype=np.int64)])], axis=1)  # node 1 <- 2..61
    g = CSCGraph.from_edge_index(torch.from_numpy(ei), num_nodes=501)
    sampler = NeighborSampler(g, [40], return_e_id=True)
    for seed in range(20):
        out = sampler.sample_subgraph([0, 1], seed=seed)
        check_invariants(g, out, [40], False)
        assert out.num_sampled_edges == [80]


def test_repeated_seeds_keep_their_places():
    g = CSCGraph.from_edge_index(torch.tensor([[1, 2, 3, 0], [0, 0, 1, 2]]), num_nodes=4)
    out = NeighborSampler(g, [-1, -1], return_e_id=True).sample_subgraph([0, 2, 0], seed=0)
    assert out.n_id.tolist()[:3] == [0, 2, 0] and out.batch_size == 3
    n_id, ei, nodes, edges = python_khop(g.indptr, g.indices, [0, 2, 0], 2)
    assert out.n_id.tolist() == n_id and out.edge_index.tolist() == ei
    assert out.num_sampled_nodes == nodes and out.num_sampled_edges == edges
    # each seed position is a target of its own: both copies of node 0 get its two in-edges
    assert Counter(out.edge_index[1].tolist()[:5]) == {0: 2, 1: 1, 2: 2}


# ----------------------------------------------------------------------------- fanout -1: exact k-hop


@settings(max_examples=60)
@given(
    n=st.integers(1, 40),
    m=st.integers(0, 160),
    graph_seed=st.integers(0, 2**16),
    hops=st.integers(0, 3),
    num_seeds=st.integers(1, 8),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_all_neighbours_equal_python_reference(n, m, graph_seed, hops, num_seeds, dtype):
    ei = random_edge_index(n, m, graph_seed)  # repeated edges and self-loops included
    g = CSCGraph.from_edge_index(torch.from_numpy(ei), num_nodes=n, dtype=dtype)
    seeds = np.random.default_rng(graph_seed).choice(n, min(num_seeds, n), replace=False)
    out = NeighborSampler(g, [-1] * hops, return_e_id=True).sample_subgraph(seeds, seed=graph_seed)
    n_id, edge_index, nodes, edges = python_khop(g.indptr, g.indices, seeds, hops)
    assert out.n_id.tolist() == n_id
    assert out.edge_index.tolist() == edge_index  # edge for edge, in order
    assert out.num_sampled_nodes == nodes and out.num_sampled_edges == edges
    # and, in global ids, the multiset of edges is the exact k-hop in-neighbourhood
    glob = Counter(zip(out.n_id[out.edge_index[0]].tolist(), out.n_id[out.edge_index[1]].tolist()))
    assert glob == khop_edge_multiset(ei, n, seeds, hops)
    check_invariants(g, out, [-1] * hops, False)
    # the torch reference sampler agrees tensor for tensor
    ref = TorchNeighborSampler(g, [-1] * hops).sample_subgraph(seeds, seed=0)
    assert torch.equal(ref.n_id, out.n_id) and torch.equal(ref.edge_index, out.edge_index)
    assert torch.equal(ref.e_id, out.e_id) and ref.num_sampled_nodes == out.num_sampled_nodes


def test_all_neighbours_on_disk_memmap(dataset):
    seeds = [7, 0, 1999, 500]
    out = NeighborSampler(dataset, [-1, -1]).sample_subgraph(seeds, seed=0)
    n_id, edge_index, nodes, edges = python_khop(dataset.indptr, dataset.indices, seeds, 2)
    assert out.n_id.tolist() == n_id and out.edge_index.tolist() == edge_index
    assert out.num_sampled_nodes == nodes and out.num_sampled_edges == edges


@settings(max_examples=40)
@given(
    n=st.integers(1, 40),
    m=st.integers(0, 160),
    graph_seed=st.integers(0, 2**16),
    fanouts=st.lists(st.integers(-1, 4), max_size=3),
    replace=st.booleans(),
)
def test_invariants_random_graphs(n, m, graph_seed, fanouts, replace):
    g = CSCGraph.from_edge_index(torch.from_numpy(random_edge_index(n, m, graph_seed)), num_nodes=n)
    seeds = np.random.default_rng(graph_seed).choice(n, min(5, n), replace=False)
    for sampler in (
        NeighborSampler(g, fanouts, replace=replace, return_e_id=True),
        TorchNeighborSampler(g, fanouts, replace=replace),
    ):
        out = sampler.sample_subgraph(seeds, seed=graph_seed)
        assert out.n_id[: out.batch_size].tolist() == seeds.tolist()
        check_invariants(g, out, fanouts, replace)


# ----------------------------------------------------------------------------- uniformity


def _neighbour_counts(sampler, node, trials, start):
    counts = Counter()
    for seed in range(trials):
        out = sampler.sample_subgraph([node], seed=seed, e_id=True)
        counts.update((out.e_id - start).tolist())
    return counts


@pytest.mark.parametrize("replace", [False, True])
def test_hub_neighbours_uniform(dataset, replace):
    """Node 7 (50 in-neighbours), fanout 5, 4000 draws of 5: each neighbour expected 400 times.

    Chi-square over the 50 neighbours, df = 49, significance 0.001 (critical value ~85.4);
    Pearson's statistic with replacement, the inclusion-count statistic without.
    """
    k, trials = 5, 4000
    start = int(dataset.indptr[7])
    counts = _neighbour_counts(NeighborSampler(dataset, [k], replace=replace), 7, trials, start)
    c = np.array([counts.get(j, 0) for j in range(HUB_DEGREE)])
    assert c.sum() == k * trials and len(counts) == HUB_DEGREE
    stat = chi2_stat(c) if replace else inclusion_chi2_stat(c, trials, k)
    assert stat < chi2_critical(HUB_DEGREE - 1)


@pytest.mark.parametrize("degree,k", [(60, 40), (500, 40)])
def test_large_fanout_uniform(degree, k):
    """The k > 32 paths (selection sampling; Floyd with a hash set); chi-square at 0.001, df = degree - 1."""
    ei = np.stack([np.arange(1, degree + 1), np.zeros(degree, dtype=np.int64)])
    g = CSCGraph.from_edge_index(torch.from_numpy(ei), num_nodes=degree + 1)
    trials = 400 * degree // k  # each neighbour expected 400 times
    counts = _neighbour_counts(NeighborSampler(g, [k]), 0, trials, 0)
    c = np.array([counts.get(j, 0) for j in range(degree)])
    assert c.sum() == k * trials
    assert inclusion_chi2_stat(c, trials, k) < chi2_critical(degree - 1)


def test_pairs_uniform():
    """Without replacement every 2-subset of 6 neighbours is equally likely: 15 cells, 6000 draws, df = 14.

    Critical value at 0.001 ~36.1. Catches a sampler with uniform marginals but correlated picks.
    """
    ei = np.stack([np.arange(1, 7), np.zeros(6, dtype=np.int64)])
    sampler = NeighborSampler(CSCGraph.from_edge_index(torch.from_numpy(ei), num_nodes=7), [2], return_e_id=True)
    counts = Counter()
    for seed in range(6000):
        counts[tuple(sorted(sampler.sample_subgraph([0], seed=seed).e_id.tolist()))] += 1
    assert len(counts) == 15 and all(a != b for a, b in counts)
    assert chi2_stat(np.array(list(counts.values()))) < chi2_critical(14)


def test_reference_sampler_uniform(dataset):
    """The benchmark's torch reference draws uniformly too (same chi-square test as the native sampler)."""
    k, trials = 5, 2000
    start = int(dataset.indptr[7])
    counts = Counter()
    ref = TorchNeighborSampler(dataset, [k])
    for seed in range(trials):
        counts.update((ref.sample_subgraph([7], seed=seed).e_id - start).tolist())
    c = np.array([counts.get(j, 0) for j in range(HUB_DEGREE)])
    assert c.sum() == k * trials
    assert inclusion_chi2_stat(c, trials, k) < chi2_critical(HUB_DEGREE - 1)


# ----------------------------------------------------------------------------- determinism, threads


def test_same_seed_same_sample_on_any_thread(dataset):
    sampler = NeighborSampler(dataset, [10, 5, 3], return_e_id=True)
    rng = np.random.default_rng(5)
    jobs = [(rng.choice(dataset.num_nodes, 200, replace=False), s) for s in range(24)]
    serial = [sampler.sample_subgraph(b, seed=s) for b, s in jobs]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda job: sampler.sample_subgraph(job[0], seed=job[1]), jobs * 3))
    for i, out in enumerate(threaded):
        ref = serial[i % len(jobs)]
        assert torch.equal(out.n_id, ref.n_id) and torch.equal(out.edge_index, ref.edge_index)
        assert torch.equal(out.e_id, ref.e_id) and out.num_sampled_edges == ref.num_sampled_edges
    # and different seeds give different samples
    a, b = sampler.sample_subgraph(jobs[0][0], seed=1), sampler.sample_subgraph(jobs[0][0], seed=2)
    assert not torch.equal(a.e_id, b.e_id)
    # a thread's workspace is only scratch: freeing it changes nothing
    release_thread_workspace()
    again = sampler.sample_subgraph(jobs[0][0], seed=jobs[0][1])
    assert torch.equal(again.edge_index, serial[0].edge_index) and torch.equal(again.n_id, serial[0].n_id)


def test_node_map_survives_many_calls_in_one_thread():
    """The per-thread node map is reused from call to call, told apart by a 16-bit epoch.

    Call 0 leaves entries of epoch 1 in the table; 65534 calls on a one-node graph touch only
    key 0; call 65535 is epoch 1 again, and must not see call 0's entries.
    """
    from lightning_ooc import _sampler

    ei = random_edge_index(30, 90, seed=11)
    g = CSCGraph.from_edge_index(torch.from_numpy(ei), num_nodes=30)
    seeds = np.array([3, 17], dtype=np.int64)
    want = python_khop(g.indptr, g.indices, seeds, 2)
    tiny_indptr, tiny_indices, zero = np.zeros(2, dtype=np.int64), np.zeros(0, dtype=np.int32), np.zeros(1, np.int64)
    release_thread_workspace()  # also restarts the epoch
    _sampler.sample(g.indptr, g.indices, np.array([5, 8, 21], dtype=np.int64), [-1, -1], False, 0, False)
    for call in range(1, 65_535):
        _sampler.sample(tiny_indptr, tiny_indices, zero, [], False, call, False)
    for call in range(65_535, 65_540):
        n_id, ei_buf, _, _, nodes, edges, _ = _sampler.sample(g.indptr, g.indices, seeds, [-1, -1], False, call, False)
        assert np.frombuffer(n_id, dtype=np.int64).tolist() == want[0]
        assert np.frombuffer(ei_buf, dtype=np.int64).reshape(2, -1).tolist() == want[1]


def test_seed_none_follows_torch_manual_seed(dataset):
    sampler = NeighborSampler(dataset, [5, 5])
    torch.manual_seed(3)
    a = sampler.sample([1, 2, 3])
    torch.manual_seed(3)
    b = sampler.sample([1, 2, 3])
    c = sampler.sample([1, 2, 3])
    assert torch.equal(a.edge_index, b.edge_index) and not torch.equal(b.edge_index, c.edge_index)


def test_indices_are_not_copied(dataset):
    sampler = NeighborSampler(dataset, [5])
    assert np.shares_memory(sampler.indices, dataset.indices)
    assert sampler.indices.__array_interface__["data"][0] == dataset.indices.__array_interface__["data"][0]


# ----------------------------------------------------------------------------- minibatch fields


def test_minibatch_fields_like_neighbor_loader(dataset):
    seeds = torch.tensor([7, 3, 11, 42])
    batch = NeighborSampler(dataset, [4, 2]).sample(seeds, seed=0, input_id=torch.tensor([10, 11, 12, 13]))
    assert set(batch.keys()) == {"n_id", "edge_index", "y", "batch_size", "input_id", "num_sampled_nodes",
                                 "num_sampled_edges"}  # fmt: skip
    assert "x" not in batch
    assert batch.batch_size == 4 and torch.equal(batch.n_id[:4], seeds)
    assert torch.equal(batch.y, torch.from_numpy(np.asarray(dataset.labels)[batch.n_id.numpy()]))
    assert batch.input_id.tolist() == [10, 11, 12, 13]
    assert batch.num_nodes == batch.n_id.numel() == sum(batch.num_sampled_nodes)
    assert batch.edge_index.size(1) == sum(batch.num_sampled_edges)
    assert isinstance(batch.num_sampled_nodes, list) and isinstance(batch.num_sampled_nodes[0], int)
    assert int(batch.edge_index.max()) < batch.num_nodes
    default = NeighborSampler(dataset, [4, 2]).sample(seeds, seed=0)
    assert default.input_id.tolist() == [0, 1, 2, 3] and torch.equal(default.edge_index, batch.edge_index)


def test_load_features_fills_x(dataset):
    batch = NeighborSampler(dataset, [3], load_features=True, return_e_id=True).sample([5, 6], seed=0)
    assert torch.equal(batch.x, dataset.read_features(batch.n_id))
    assert batch.x.shape == (batch.n_id.numel(), dataset.num_features)
    assert "e_id" in batch


def test_empty_batch(dataset):
    out = NeighborSampler(dataset, [3, 3]).sample_subgraph([], seed=0)
    assert out.n_id.numel() == 0 and out.edge_index.shape == (2, 0)
    assert out.num_sampled_nodes == [0, 0, 0] and out.num_sampled_edges == [0, 0]


# ----------------------------------------------------------------------------- PyG adapter


def test_node_loader_adapter_matches_the_data():
    n = 300
    ei = torch.from_numpy(random_edge_index(n, 3000, seed=4))
    data = Data(x=torch.randn(n, 5), y=torch.randint(0, 3, (n,)), edge_index=ei, edge_attr=torch.randn(ei.size(1), 2))
    train = torch.arange(0, n, 3)
    torch.manual_seed(0)
    loader = NodeLoader(data, PyGNeighborSampler(data, [4, 3]), input_nodes=train, batch_size=32, shuffle=True)
    seen = []
    for batch in loader:
        bs = batch.batch_size
        assert torch.equal(batch.n_id[:bs], train[batch.input_id])
        assert torch.equal(batch.x, data.x[batch.n_id]) and torch.equal(batch.y, data.y[batch.n_id])
        # e_id names the original edge: endpoints and attributes agree after the CSC permutation
        src, dst = batch.n_id[batch.edge_index[0]], batch.n_id[batch.edge_index[1]]
        assert torch.equal(ei[0, batch.e_id], src) and torch.equal(ei[1, batch.e_id], dst)
        assert torch.equal(batch.edge_attr, data.edge_attr[batch.e_id])
        assert len(batch.num_sampled_nodes) == 3 and len(batch.num_sampled_edges) == 2
        assert batch.edge_index.size(1) == sum(batch.num_sampled_edges)
        seen.append(batch.input_id)
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(train.numel()))


def test_adapter_all_neighbours_equal_python_reference():
    n = 60
    ei = random_edge_index(n, 200, seed=9)
    data = Data(edge_index=torch.from_numpy(ei), num_nodes=n)
    loader = NodeLoader(data, PyGNeighborSampler(data, [-1, -1]), input_nodes=torch.tensor([3, 1, 4]), batch_size=3)
    batch = next(iter(loader))
    g = CSCGraph.from_edge_index(torch.from_numpy(ei), num_nodes=n)
    n_id, edge_index, nodes, edges = python_khop(g.indptr, g.indices, [3, 1, 4], 2)
    assert batch.n_id.tolist() == n_id and batch.edge_index.tolist() == edge_index
    assert batch.num_sampled_nodes == nodes and batch.num_sampled_edges == edges


def test_adapter_wraps_an_on_disk_sampler(dataset):
    sampler = PyGNeighborSampler(NeighborSampler(dataset, [3, 3]))
    from torch_geometric.sampler import NodeSamplerInput

    out = sampler.sample_from_nodes(NodeSamplerInput(input_id=torch.arange(2), node=torch.tensor([7, 8])))
    assert out.node[:2].tolist() == [7, 8] and out.metadata[0].tolist() == [0, 1]
    assert torch.equal(torch.from_numpy(np.asarray(dataset.indices)[out.edge.numpy()]), out.node[out.row])
    assert sampler.edge_permutation is None
    # seed edges go through PyG's own link logic (edge_sample): the labelled pairs map back through n_id
    from torch_geometric.sampler import EdgeSamplerInput

    edges = EdgeSamplerInput(input_id=torch.arange(2), row=torch.tensor([7, 3]), col=torch.tensor([8, 7]))
    out = sampler.sample_from_edges(edges)
    input_id, edge_label_index = out.metadata[0], out.metadata[1]
    assert input_id.tolist() == [0, 1] and out.node[edge_label_index].tolist() == [[7, 3], [8, 7]]
    assert out.node[:3].tolist() == [3, 7, 8]  # PyG's seeds: the unique endpoints, sorted


# ----------------------------------------------------------------------------- input checks


@pytest.mark.parametrize(
    "seeds,match",
    [
        ([0, 2000], "seed 2000 \\(position 1\\) is not a node id"),
        ([-1], "seed -1"),
        (torch.tensor([0.0, 1.0]), "integer node ids"),
        (np.array([0.5]), "integer node ids"),
        (torch.ones(2000, dtype=torch.bool), "not a mask"),
        (np.ones(3, dtype=bool), "integer node ids"),
        (torch.zeros(2, 2, dtype=torch.long), "1-D"),
    ],
)
def test_bad_seeds(dataset, seeds, match):
    with pytest.raises(InputError, match=match):
        NeighborSampler(dataset, [2]).sample(seeds)


@pytest.mark.parametrize("fanouts", [[-2], [1.5], 5, {("a", "b", "c"): [1]}, [True]])
def test_bad_fanouts(dataset, fanouts):
    with pytest.raises(InputError, match="num_neighbors"):
        NeighborSampler(dataset, fanouts)


def test_corrupt_graph_raises_instead_of_crashing():
    g = CSCGraph(np.array([0, 1, 2], dtype=np.int64), np.array([1, 5], dtype=np.int32))  # 5 is not a node
    with pytest.raises(ValueError, match="indices\\[1\\] = 5"):
        NeighborSampler(g, [-1, -1]).sample_subgraph([0], seed=0)
    with pytest.raises(InputError, match="end at len\\(indices\\)"):
        CSCGraph(np.array([0, 3], dtype=np.int64), np.array([0], dtype=np.int32))


def test_seed_types_accepted(dataset):
    sampler = NeighborSampler(dataset, [2])
    ref = sampler.sample_subgraph(torch.tensor([4, 5]), seed=1)
    for seeds in ([4, 5], (4, 5), np.array([4, 5], dtype=np.int32), np.array([4, 5], dtype=np.uint16),
                  torch.tensor([4, 5], dtype=torch.int32)):  # fmt: skip
        out = sampler.sample_subgraph(seeds, seed=1)
        assert torch.equal(out.edge_index, ref.edge_index) and torch.equal(out.n_id, ref.n_id)
    assert sampler.sample_subgraph(torch.tensor(4), seed=1).n_id[0] == 4  # a single id


# ----------------------------------------------------------------------------- docstring examples


@pytest.mark.parametrize("name", ["csc", "neighbor", "pyg", "reference"])
def test_docstring_examples(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"lightning_ooc.sampling.{name}"), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------------- the benchmark command


def test_bench_sample_runs_and_writes_json(dataset, tmp_path, capsys):
    from lightning_ooc.bench import sample as bench

    path = tmp_path / "sample.json"
    argv = [str(dataset.root), "--cache", "warm", "--batches", "3", "--reference-batches", "2", "--batch-size", "16",
            "--json", str(path)]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads(path.read_text())
    runs = {(r["impl"], tuple(r["fanouts"]), r["threads"]) for r in doc["results"]}
    assert runs == {(i, f, t) for i in ("native", "reference") for f in ((10, 10, 10), (15, 10, 5)) for t in (1, 2)}
    assert all(r["edges"] > 0 and r["batches"] == (3 if r["impl"] == "native" else 2) for r in doc["results"])
    assert doc["dataset"]["num_nodes"] == dataset.num_nodes and "TorchNeighborSampler" in doc["reference"]
    out = capsys.readouterr().out
    assert doc["table"] in out and "native/ref" in out
    from lightning_ooc.bench.report import render_file

    assert doc["kind"] == "sample" and "commit" in doc and render_file(path) == doc["table"]  # `bench report` renders the same table


def test_bench_table_ratios():
    from lightning_ooc.bench.sample import format_table

    def r(impl, threads, eps):
        return {"impl": impl, "fanouts": [2, 2], "threads": threads, "cache": "warm", "edges_per_s": eps,
                "batches_per_s": eps / 100, "first_batch_ms": 2e5 / eps}  # fmt: skip

    table = format_table([r("native", 1, 1000.0), r("native", 2, 1800.0), r("reference", 1, 250.0),
                          r("reference", 2, 300.0)])  # fmt: skip
    one, two = table.splitlines()[2:]
    assert [c.strip() for c in one.split("|")[1:-1]] == ["2,2", "warm", "1", "1,000", "10.00", "250", "2.50",
                                                         "4.0x", "1.00x", "1.00x", "200 / 800"]  # fmt: skip
    assert [c.strip() for c in two.split("|")[1:-1]][7:] == ["6.0x", "1.80x", "1.20x", "111 / 667"]


def _vm_flags(path) -> list[list[str]]:
    """The VmFlags of every mapping of ``path`` in this process."""
    out, current = [], None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if len(head) >= 6 and "-" in head[0] and not line.startswith("VmFlags"):
            current = head[5]
        elif line.startswith("VmFlags:") and current == str(path):
            out.append(line.split()[1:])
    return out


def test_link_batches_read_the_link_splits_through_maps_without_read_ahead(tmp_path):
    """A link batch reads a few edges at random positions of a split of millions: its map has
    MADV_RANDOM ('rr' in smaps' VmFlags). The topology keeps the kernel's read-ahead (a batch touches
    much of it) and so do the dataset's own maps (sequential readers)."""
    from lightning_ooc.data.prepare import prepare_from_arrays
    from lightning_ooc.loader.link_task import LinkBatchSampler, LinkDataConfig

    rng = np.random.default_rng(0)
    root = prepare_from_arrays(tmp_path / "g", rng.integers(0, 5000, (2, 40000)), rng.random((5000, 4), np.float32),
                               y=rng.integers(0, 3, 5000), split_edges=(0.8, 0.1, 0.1), progress=False)  # fmt: skip
    ds = lightning_ooc.open_dataset(root)
    link = (root / "link_train_index.npy").resolve()
    sampler = NeighborSampler(ds, [3, 2])
    assert np.shares_memory(sampler.indices, ds.indices)
    assert all("rr" not in f for f in _vm_flags((root / "indices.npy").resolve()))
    cached = ds.link_split("train").index
    assert _vm_flags(link) and all("rr" not in f for f in _vm_flags(link))
    links = LinkBatchSampler(LinkDataConfig(str(root), batch_size=8, num_neighbors=[2], progress=False), ds)
    assert sum("rr" in f for f in _vm_flags(link)) == 1
    assert torch.equal(links.splits["train"].src, cached[0]) and torch.equal(links.splits["train"].dst, cached[1])
    out = links.sample("train", torch.arange(8), seed=1, sampler=sampler)  # reads through that map
    assert out.edge_label_index.shape == (2, 8) and "y" not in out
