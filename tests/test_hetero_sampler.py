"""The native heterogeneous neighbour sampler: exactness, invariants, statistics, determinism, PyG, input checks.

The graphs have three node types and five edge types: a self-relation
(paper cites paper), two pairs of relations sharing a destination type
(cites / writes into paper, rev_writes / coauthor into author), nodes without
in-edges of a type, and a type that only ever is a destination (field), so it
is unreachable from paper or author seeds.

Statistical tests use fixed seeds and a chi-square test at significance 0.001
(as tests/test_sampler.py does) plus a 5-sigma bound on every count, so their
outcome is reproducible; a biased sampler exceeds them by far.
"""
from __future__ import annotations

import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_geometric.data import HeteroData

from lightning_ooc.errors import InputError
from lightning_ooc.sampling import (
    CSCGraph,
    HeteroCSCGraph,
    HeteroNeighborSampler,
    NeighborSampler,
    release_thread_workspace,
)
from lightning_ooc.sampling.hetero_reference import HeteroReferenceSampler

NODE_TYPES = ["paper", "author", "field"]
EDGE_TYPES = [
    ("paper", "cites", "paper"),
    ("author", "writes", "paper"),
    ("paper", "rev_writes", "author"),
    ("author", "coauthor", "author"),
    ("paper", "has_topic", "field"),
]
CITES, WRITES, REV_WRITES, COAUTHOR, HAS_TOPIC = EDGE_TYPES

# ----------------------------------------------------------------------------- helpers


def random_hetero_data(seed: int, scale: int = 1, *, labels: bool = True) -> HeteroData:
    """A random heterogeneous multigraph (repeated edges and self-loops kept) over NODE_TYPES / EDGE_TYPES.

    About a quarter of the nodes of each destination type get no in-edges of a given edge type, and there
    are fewer fields than papers (so paper ids in has_topic exceed the field count).
    """
    rng = np.random.default_rng(seed)
    counts = {"paper": int(rng.integers(15, 40)) * scale, "author": int(rng.integers(10, 30)) * scale,
              "field": int(rng.integers(2, 6))}  # fmt: skip
    data = HeteroData()
    for t, n in counts.items():
        data[t].num_nodes = n
    for et in EDGE_TYPES:
        src, _, dst = et
        m = int(rng.integers(0, 4 * counts[dst] + 1))
        with_in_edges = rng.permutation(counts[dst])[: max(1, 3 * counts[dst] // 4)]
        edge_index = np.stack([rng.integers(0, counts[src], m), rng.choice(with_in_edges, m)])
        data[et].edge_index = torch.from_numpy(edge_index)
    if labels:
        data["paper"].y = torch.from_numpy(rng.integers(0, 5, counts["paper"]))
        data["author"].y = torch.from_numpy(rng.integers(0, 3, counts["author"]))
    return data


def global_edges(out, et) -> Counter:
    """The multiset of (source id, target id) of the sampled edges of ``et``, in per-type global ids."""
    src, _, dst = et
    ei = out.edge_index[et]
    return Counter(zip(out.n_id[src][ei[0]].tolist(), out.n_id[dst][ei[1]].tolist()))


def assert_same_output(a, b, *, e_id: bool = True) -> None:
    assert a.n_id.keys() == b.n_id.keys() and a.edge_index.keys() == b.edge_index.keys()
    for t in a.n_id:
        assert torch.equal(a.n_id[t], b.n_id[t]), t
        assert a.num_sampled_nodes[t] == b.num_sampled_nodes[t], t
    for et in a.edge_index:
        assert torch.equal(a.edge_index[et], b.edge_index[et]), et
        assert a.num_sampled_edges[et] == b.num_sampled_edges[et], et
        if e_id:
            assert torch.equal(a.e_id[et], b.e_id[et]), et


def check_invariants(graph, out, num_neighbors: dict, replace: bool, seeds, input_type: str) -> None:
    """Properties every sample must have, whatever the random draws."""
    hops = len(next(iter(num_neighbors.values())))
    seeds = list(seeds)
    b = len(seeds)
    assert out.batch_size == b and out.n_id[input_type][:b].tolist() == seeds
    node_start, edge_start = {}, {}
    for t in graph.node_types:
        n_id, counts = out.n_id[t].numpy(), out.num_sampled_nodes[t]
        assert out.n_id[t].dtype == torch.int64
        assert len(counts) == hops + 1 and sum(counts) == n_id.size
        assert counts[0] == (b if t == input_type else 0)
        rest = n_id[counts[0]:]
        assert np.unique(rest).size == rest.size  # no node twice
        assert not set(rest.tolist()) & set(n_id[: counts[0]].tolist())  # a seed is never added again
        assert np.all((n_id >= 0) & (n_id < graph.num_nodes_dict[t]))
        node_start[t] = np.cumsum([0] + counts)
    for et in graph.edge_types:
        counts = out.num_sampled_edges[et]
        assert len(counts) == hops and sum(counts) == out.edge_index[et].size(1) == out.e_id[et].numel()
        assert out.edge_index[et].dtype == torch.int64
        edge_start[et] = np.cumsum([0] + counts)
    for h in range(hops):
        rows_by_src: dict[str, list[np.ndarray]] = {t: [] for t in graph.node_types}
        for et in graph.edge_types:  # in sampling order
            src, _, dst = et
            indptr, indices = np.asarray(graph.csc[et].indptr), np.asarray(graph.csc[et].indices)
            sl = slice(edge_start[et][h], edge_start[et][h + 1])
            row, col, e = out.edge_index[et][0, sl].numpy(), out.edge_index[et][1, sl].numpy(), out.e_id[et][sl].numpy()
            # the targets of this hop are the nodes dst gained in the previous hop (the seeds at hop 0), in order
            lo, hi = node_start[dst][h], node_start[dst][h + 1]
            assert np.all((col >= lo) & (col < hi)) and np.all(np.diff(col) >= 0)
            # every edge exists: its source sits at its CSC position among the target's in-edges
            tv = out.n_id[dst].numpy()[col]
            assert np.all((e >= indptr[tv]) & (e < indptr[tv + 1]))
            assert np.array_equal(indices[e], out.n_id[src].numpy()[row])
            # each target gets min(fanout, degree) in-edges (fanout if it has any, with replacement)
            k = num_neighbors[et][h]
            targets = out.n_id[dst].numpy()[lo:hi]
            deg = indptr[targets + 1] - indptr[targets]
            if k < 0:
                want = deg
            elif replace:
                want = np.where(deg > 0, k, 0)
            else:
                want = np.minimum(deg, k)
            assert np.array_equal(np.bincount(col - lo, minlength=hi - lo), want)
            if not replace:  # no in-edge twice for a target
                pairs = col.astype(np.int64) * (indices.size + 1) + e
                assert np.unique(pairs).size == pairs.size
            rows_by_src[src].append(row)
        # the nodes a type gains in this hop are numbered in order of first appearance over the edge types
        for t, rows in rows_by_src.items():
            rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
            old = node_start[t][h + 1]
            new = rows[rows >= old]
            first = new[np.sort(np.unique(new, return_index=True)[1])]
            assert np.array_equal(first, np.arange(old, old + first.size))
            assert old + first.size == node_start[t][h + 2]


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Upper quantile of the chi-square law (Wilson-Hilferty); z = 3.0902 is the normal 0.999 quantile."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.fixture(scope="module")
def data():
    return random_hetero_data(7)


@pytest.fixture(scope="module")
def graph(data):
    return HeteroCSCGraph.from_hetero_data(data)


# ----------------------------------------------------------------------------- fanout -1: exact


@settings(max_examples=60)
@given(
    graph_seed=st.integers(0, 2**16),
    hops=st.integers(0, 3),
    input_type=st.sampled_from(NODE_TYPES),
    num_seeds=st.integers(0, 6),
    repeat=st.booleans(),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_all_neighbours_equal_reference(graph_seed, hops, input_type, num_seeds, repeat, dtype):
    g = HeteroCSCGraph.from_hetero_data(random_hetero_data(graph_seed), dtype=dtype)
    rng = np.random.default_rng(graph_seed)
    n = g.num_nodes_dict[input_type]
    seeds = rng.choice(n, min(num_seeds, n), replace=repeat).tolist()
    out = HeteroNeighborSampler(g, [-1] * hops, return_e_id=True).sample_subgraph(seeds, input_type, seed=graph_seed)
    ref = HeteroReferenceSampler(g, [-1] * hops).sample_subgraph(seeds, input_type, seed=0)
    assert_same_output(out, ref)  # node for node, edge for edge, in order
    check_invariants(g, out, {et: [-1] * hops for et in EDGE_TYPES}, False, seeds, input_type)


def test_all_neighbours_by_hand(graph):
    """Fanout -1 from one paper, checked against a breadth-first search written out here."""
    sampler = HeteroNeighborSampler(graph, [-1, -1, -1], return_e_id=True)
    out = sampler.sample_subgraph([3], "paper", seed=0)
    in_nbrs = {et: {} for et in EDGE_TYPES}
    for et in EDGE_TYPES:
        g = graph.csc[et]
        for v in range(g.num_nodes):
            in_nbrs[et][v] = g.indices[g.indptr[v] : g.indptr[v + 1]].tolist()
    level = {"paper": [3], "author": [], "field": []}  # nodes first reached at the previous hop
    seen = {"paper": {3}, "author": set(), "field": set()}
    want = {et: Counter() for et in EDGE_TYPES}
    for _ in range(3):
        nxt = {t: [] for t in NODE_TYPES}
        for et in EDGE_TYPES:
            src, _, dst = et
            for v in level[dst]:
                for u in in_nbrs[et][v]:
                    want[et][(u, v)] += 1
                    if u not in seen[src]:
                        seen[src].add(u)
                        nxt[src].append(u)
        level = nxt
    for t in NODE_TYPES:
        assert set(out.n_id[t].tolist()) == seen[t]
    for et in EDGE_TYPES:
        assert global_edges(out, et) == want[et]
    assert out.n_id["field"].numel() == 0 and out.edge_index[HAS_TOPIC].shape == (2, 0)  # unreachable


def test_one_type_equals_the_homogeneous_sampler():
    """With one node type and one edge type the hetero sampler makes the same random draws as NeighborSampler."""
    rng = np.random.default_rng(3)
    n = 300
    ei = torch.from_numpy(rng.integers(0, n, (2, 3000)))
    homo = CSCGraph.from_edge_index(ei, num_nodes=n)
    hetero = HeteroCSCGraph({"n": n}, {("n", "to", "n"): homo})
    seeds = rng.choice(n, 20, replace=False)
    for fanouts in ([5, 3], [40, 2], [-1], [0, 4]):
        for replace in (False, True):
            a = NeighborSampler(homo, fanouts, replace, return_e_id=True).sample_subgraph(seeds, seed=11)
            b = HeteroNeighborSampler(hetero, fanouts, replace, return_e_id=True).sample_subgraph(seeds, "n", seed=11)
            et = ("n", "to", "n")
            assert torch.equal(a.n_id, b.n_id["n"]) and torch.equal(a.edge_index, b.edge_index[et])
            assert torch.equal(a.e_id, b.e_id[et])
            assert a.num_sampled_nodes == b.num_sampled_nodes["n"] and a.num_sampled_edges == b.num_sampled_edges[et]


# ----------------------------------------------------------------------------- finite fanouts: invariants


FANOUTS = {
    "list": [3, 2],
    "dict": {CITES: [2, 1], WRITES: [3, 0], REV_WRITES: [-1, 2], COAUTHOR: [1, 1], HAS_TOPIC: [4, 4]},
    "three hops": {CITES: [1, 1, 1], WRITES: [2, 2, 2], REV_WRITES: [1, 2, 1], COAUTHOR: [0, 0, 3],
                   HAS_TOPIC: [2, 2, 2]},  # fmt: skip
}


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("fanouts", list(FANOUTS), ids=list(FANOUTS))
@pytest.mark.parametrize("input_type", ["paper", "field"])
def test_invariants(fanouts, replace, input_type):
    for graph_seed in range(8):
        g = HeteroCSCGraph.from_hetero_data(random_hetero_data(graph_seed, scale=3))
        sampler = HeteroNeighborSampler(g, FANOUTS[fanouts], replace, return_e_id=True)
        ref = HeteroReferenceSampler(g, FANOUTS[fanouts], replace)
        n = g.num_nodes_dict[input_type]
        seeds = np.random.default_rng(graph_seed).choice(n, min(n, 6), replace=False).tolist()
        for seed in range(4):
            for s in (sampler, ref):  # the reference has to satisfy them too
                out = s.sample_subgraph(seeds, input_type, seed=seed)
                check_invariants(g, out, sampler.num_neighbors, replace, seeds, input_type)


def test_edges_map_back_to_the_original_edge_index(data, graph):
    """Sampled edges, in global ids, are edges of the HeteroData; perm maps e_id to its columns."""
    sampler = HeteroNeighborSampler(graph, [4, 3], return_e_id=True)
    for seed in range(10):
        out = sampler.sample_subgraph(torch.arange(10), "paper", seed=seed)
        for et in EDGE_TYPES:
            src, _, dst = et
            cols = graph.perm[et][out.e_id[et]]
            ei = out.edge_index[et]
            assert torch.equal(data[et].edge_index[0, cols], out.n_id[src][ei[0]])
            assert torch.equal(data[et].edge_index[1, cols], out.n_id[dst][ei[1]])


def test_repeated_seeds_keep_their_places(graph):
    out = HeteroNeighborSampler(graph, [-1], return_e_id=True).sample_subgraph([3, 5, 3], "paper", seed=0)
    assert out.n_id["paper"][:3].tolist() == [3, 5, 3] and out.batch_size == 3
    ref = HeteroReferenceSampler(graph, [-1]).sample_subgraph([3, 5, 3], "paper")
    assert_same_output(out, ref)
    # each seed position is a target of its own: both copies of paper 3 get its in-edges
    for et in (CITES, WRITES):
        deg = int(graph.csc[et].indptr[4] - graph.csc[et].indptr[3])
        got = Counter(out.edge_index[et][1].tolist())
        assert got[0] == got[2] == deg


def test_empty_batch(graph):
    out = HeteroNeighborSampler(graph, [3, 3], return_e_id=True).sample_subgraph([], "author", seed=0)
    assert all(out.n_id[t].shape == (0,) and out.num_sampled_nodes[t] == [0, 0, 0] for t in NODE_TYPES)
    assert all(out.edge_index[et].shape == (2, 0) and out.num_sampled_edges[et] == [0, 0] for et in EDGE_TYPES)
    assert out.batch_size == 0


# ----------------------------------------------------------------------------- uniformity


@pytest.mark.parametrize("replace", [False, True])
def test_neighbours_uniform(replace):
    """Paper 0 has 50 authors (writes, fanout 5) and 20 citing papers (cites, fanout 3), both sampled in one hop.

    4000 draws: each author is expected 400 times, each citing paper 600 times. Chi-square at 0.001 over
    each relation's neighbours (inclusion-count statistic without replacement, Pearson's with), and every
    count within 5 standard deviations of its expectation.
    """
    n_auth, n_cite, k_auth, k_cite, trials = 50, 20, 5, 3, 4000
    data = HeteroData()
    data["paper"].num_nodes, data["author"].num_nodes = 1 + n_cite + 5, n_auth + 5
    data[WRITES].edge_index = torch.stack([torch.arange(5, 5 + n_auth), torch.zeros(n_auth, dtype=torch.long)])
    data[CITES].edge_index = torch.stack([torch.arange(1, 1 + n_cite), torch.zeros(n_cite, dtype=torch.long)])
    graph = HeteroCSCGraph.from_hetero_data(data)
    sampler = HeteroNeighborSampler(graph, {WRITES: [k_auth], CITES: [k_cite]}, replace, return_e_id=True)
    counts = {WRITES: np.zeros(n_auth, np.int64), CITES: np.zeros(n_cite, np.int64)}
    for seed in range(trials):
        out = sampler.sample_subgraph([0], "paper", seed=seed)
        for et in counts:
            counts[et] += np.bincount(out.e_id[et].numpy(), minlength=counts[et].size)
    for et, k in ((WRITES, k_auth), (CITES, k_cite)):
        c, d = counts[et], counts[et].size
        assert c.sum() == k * trials
        p = k / d
        if replace:  # multinomial: k * trials draws, each neighbour with probability 1 / d
            expected, var = k * trials / d, k * trials * (1 / d) * (1 - 1 / d)
            stat = float(((c - expected) ** 2 / expected).sum())
        else:  # each neighbour in a uniform k-subset with probability p (see tests/test_sampler.py)
            expected, var = trials * p, trials * p * (1 - p)
            stat = float(((c - expected) ** 2).sum() / var * (d - 1) / d)
        assert np.all(np.abs(c - expected) < 5 * math.sqrt(var)), (et, c)
        assert stat < chi2_critical(d - 1), (et, stat)


# ----------------------------------------------------------------------------- determinism, threads


def test_same_seed_same_sample_on_any_thread():
    g = HeteroCSCGraph.from_hetero_data(random_hetero_data(5, scale=40))
    sampler = HeteroNeighborSampler(g, [6, 4, 2], return_e_id=True)
    rng = np.random.default_rng(5)
    jobs = [(rng.choice(g.num_nodes_dict["paper"], 50, replace=False), s) for s in range(16)]
    serial = [sampler.sample_subgraph(b, "paper", seed=s) for b, s in jobs]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda job: sampler.sample_subgraph(job[0], "paper", seed=job[1]), jobs * 3))
    for i, out in enumerate(threaded):
        assert_same_output(out, serial[i % len(jobs)])
    # different seeds give different samples
    a, b = sampler.sample_subgraph(jobs[0][0], "paper", seed=1), sampler.sample_subgraph(jobs[0][0], "paper", seed=2)
    assert any(not torch.equal(a.e_id[et], b.e_id[et]) for et in EDGE_TYPES)
    # a thread's workspace is only scratch: freeing it, or sampling another graph in between, changes nothing
    release_thread_workspace()
    assert_same_output(sampler.sample_subgraph(jobs[0][0], "paper", seed=jobs[0][1]), serial[0])
    HeteroNeighborSampler(HeteroCSCGraph.from_hetero_data(random_hetero_data(1)), [-1] * 5).sample([0], "author")
    assert_same_output(sampler.sample_subgraph(jobs[0][0], "paper", seed=jobs[0][1]), serial[0])


def test_seed_none_follows_torch_manual_seed(graph):
    sampler = HeteroNeighborSampler(graph, [2, 2], return_e_id=True)
    torch.manual_seed(3)
    a = sampler.sample_subgraph(torch.arange(8), "paper")
    torch.manual_seed(3)
    b = sampler.sample_subgraph(torch.arange(8), "paper")
    c = sampler.sample_subgraph(torch.arange(8), "paper")
    assert_same_output(a, b)
    assert any(not torch.equal(b.e_id[et], c.e_id[et]) for et in EDGE_TYPES)


def test_num_neighbors_forms_agree(graph):
    """A list, the same dict keyed by tuples, by 'src__rel__dst' strings, and PyG's NumNeighbors sample alike."""
    from torch_geometric.sampler.base import NumNeighbors

    forms = [
        [3, 2],
        {et: [3, 2] for et in EDGE_TYPES},
        {"__".join(et): [3, 2] for et in EDGE_TYPES},
        NumNeighbors({CITES: [3, 2]}, default=[3, 2]),
        NumNeighbors([3, 2]),
    ]
    outs = [HeteroNeighborSampler(graph, f, return_e_id=True).sample_subgraph([1, 2], "paper", seed=4) for f in forms]
    for out in outs[1:]:
        assert_same_output(out, outs[0])


def test_memory_mapped_indices(tmp_path, graph):
    """Read-only memory-mapped indices are read in place and sample as the in-memory ones do."""
    csc = {}
    for i, et in enumerate(EDGE_TYPES):
        np.save(tmp_path / f"indices{i}.npy", graph.csc[et].indices)
        indices = np.load(tmp_path / f"indices{i}.npy", mmap_mode="r")
        csc[et] = SimpleNamespace(indptr=graph.csc[et].indptr, indices=indices)
    on_disk = SimpleNamespace(node_types=NODE_TYPES, edge_types=EDGE_TYPES, num_nodes_dict=graph.num_nodes_dict,
                              csc=csc)  # fmt: skip
    a = HeteroNeighborSampler(on_disk, [4, 4], return_e_id=True)
    assert all(np.shares_memory(a.indices[et], csc[et].indices) for et in EDGE_TYPES)
    b = HeteroNeighborSampler(graph, [4, 4], return_e_id=True)
    for seed in range(3):
        assert_same_output(a.sample_subgraph([0, 1, 2], "paper", seed=seed),
                           b.sample_subgraph([0, 1, 2], "paper", seed=seed))  # fmt: skip


# ----------------------------------------------------------------------------- the HeteroData minibatch


def test_minibatch_fields_like_neighbor_loader(data, graph):
    sampler = HeteroNeighborSampler(graph, [3, 2])
    seeds = torch.tensor([4, 1, 7])
    batch = sampler.sample(seeds, "paper", seed=0, input_id=torch.tensor([10, 11, 12]))
    out = sampler.sample_subgraph(seeds, "paper", seed=0, labels=True)
    assert isinstance(batch, HeteroData)
    assert set(batch.node_types) == set(NODE_TYPES) and set(batch.edge_types) == set(EDGE_TYPES)
    assert set(batch["paper"].keys()) == {"n_id", "y", "num_sampled_nodes", "input_id", "batch_size"}
    assert set(batch["author"].keys()) == {"n_id", "y", "num_sampled_nodes"}
    assert set(batch["field"].keys()) == {"n_id", "num_sampled_nodes"}  # no labels
    assert all(set(batch[et].keys()) == {"edge_index", "num_sampled_edges"} for et in EDGE_TYPES)
    assert batch["paper"].batch_size == 3 and batch["paper"].input_id.tolist() == [10, 11, 12]
    assert torch.equal(batch["paper"].n_id[:3], seeds)
    for t in NODE_TYPES:
        assert torch.equal(batch[t].n_id, out.n_id[t]) and batch[t].num_nodes == out.n_id[t].numel()
        if t != "field":
            assert torch.equal(batch[t].y, data[t].y[batch[t].n_id])
    for et in EDGE_TYPES:
        assert torch.equal(batch[et].edge_index, out.edge_index[et])
    assert batch.num_sampled_nodes_dict == out.num_sampled_nodes
    assert batch.num_sampled_edges_dict == out.num_sampled_edges
    assert isinstance(batch["paper"].num_sampled_nodes[0], int)
    assert batch["field"].num_nodes == 0 and batch[HAS_TOPIC].edge_index.shape == (2, 0)  # unreachable
    assert batch.validate(raise_on_error=True)  # edge_index within the node counts of its types
    default = sampler.sample(seeds, "paper", seed=0)
    assert default["paper"].input_id.tolist() == [0, 1, 2]
    with_e_id = HeteroNeighborSampler(graph, [3, 2], return_e_id=True).sample(seeds, "paper", seed=0)
    assert all(torch.equal(with_e_id[et].e_id, sampler.sample_subgraph(seeds, "paper", seed=0, e_id=True).e_id[et])
               for et in EDGE_TYPES)  # fmt: skip
    assert sampler(seeds, "paper", seed=0)["paper"].n_id.tolist() == batch["paper"].n_id.tolist()


@pytest.mark.parametrize("input_type", ["paper", "field"])
def test_to_hetero_graphsage_matches_the_full_graph(input_type):
    """With fanout -1 and as many hops as layers, a to_hetero(GraphSAGE) gives the seeds the full-graph outputs."""
    from torch_geometric.nn import GraphSAGE, to_hetero

    torch.manual_seed(0)
    data = random_hetero_data(11, scale=2)
    x = {t: torch.randn(data[t].num_nodes, 8) for t in NODE_TYPES}
    model = to_hetero(GraphSAGE((-1, -1), 16, num_layers=2, out_channels=4), (NODE_TYPES, EDGE_TYPES), aggr="sum")
    model.eval()
    with torch.no_grad():
        full = model(x, {et: data[et].edge_index for et in EDGE_TYPES})
        sampler = HeteroNeighborSampler(HeteroCSCGraph.from_hetero_data(data), [-1, -1])
        seeds = torch.arange(0, data[input_type].num_nodes, 2)
        batch = sampler.sample(seeds, input_type, seed=0)
        for t in NODE_TYPES:
            batch[t].x = x[t][batch[t].n_id]
        out = model(batch.x_dict, batch.edge_index_dict)
    b = batch[input_type].batch_size
    assert out[input_type].shape == (batch[input_type].num_nodes, 4)
    torch.testing.assert_close(out[input_type][:b], full[input_type][seeds], rtol=1e-5, atol=1e-5)
    # one hop too few leaves the second layer without the in-edges of the seeds' neighbours
    short = HeteroNeighborSampler(HeteroCSCGraph.from_hetero_data(data), [-1]).sample(seeds, input_type, seed=0)
    for t in NODE_TYPES:
        short[t].x = x[t][short[t].n_id]
    with torch.no_grad():
        out_short = model(short.x_dict, short.edge_index_dict)
    assert not torch.allclose(out_short[input_type][:b], full[input_type][seeds], atol=1e-5)


def test_hetero_conv_runs_on_a_sampled_batch(graph):
    from torch_geometric.nn import HeteroConv, SAGEConv

    x = {t: torch.randn(graph.num_nodes_dict[t], 5) for t in NODE_TYPES}
    conv = HeteroConv({et: SAGEConv((-1, -1), 7) for et in EDGE_TYPES}, aggr="mean")
    batch = HeteroNeighborSampler(graph, [4]).sample(torch.arange(6), "paper", seed=1)
    for t in NODE_TYPES:
        batch[t].x = x[t][batch[t].n_id]
    out = conv(batch.x_dict, batch.edge_index_dict)
    assert out["paper"].shape == (batch["paper"].num_nodes, 7)
    assert out["author"].shape == (batch["author"].num_nodes, 7)


# ----------------------------------------------------------------------------- PyG's own NeighborLoader


def _pyg_can_sample_hetero() -> bool:
    import torch_geometric.typing as t

    return bool(t.WITH_PYG_LIB or t.WITH_TORCH_SPARSE)


@pytest.mark.skipif(not _pyg_can_sample_hetero(), reason="PyG samples HeteroData only with pyg-lib or torch-sparse")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("graph_seed", range(6))
@pytest.mark.parametrize("input_type", NODE_TYPES)
def test_matches_pyg_neighbor_loader(graph_seed, input_type):
    """Fanout -1: the same nodes per type and the same edges (global ids, original edge ids) per edge type."""
    import torch_geometric.typing
    from torch_geometric.loader import NeighborLoader

    data = random_hetero_data(graph_seed)
    for t in NODE_TYPES:
        data[t].x = torch.randn(data[t].num_nodes, 2)
    seeds = torch.from_numpy(np.random.default_rng(graph_seed).permutation(data[input_type].num_nodes)[:4])
    loader = NeighborLoader(data, num_neighbors=[-1, -1, -1], input_nodes=(input_type, seeds), batch_size=seeds.numel())
    theirs = next(iter(loader))
    graph = HeteroCSCGraph.from_hetero_data(data)
    ours = HeteroNeighborSampler(graph, [-1, -1, -1], return_e_id=True).sample(seeds, input_type, seed=0)
    assert theirs[input_type].batch_size == ours[input_type].batch_size
    for t in NODE_TYPES:
        assert torch.equal(theirs[t].n_id[: seeds.numel() if t == input_type else 0],
                           ours[t].n_id[: seeds.numel() if t == input_type else 0])  # fmt: skip
        assert sorted(theirs[t].n_id.tolist()) == sorted(ours[t].n_id.tolist()), t
    for et in EDGE_TYPES:
        src, _, dst = et

        def edges(batch, e_id):
            ei = batch[et].edge_index
            return Counter(zip(batch[src].n_id[ei[0]].tolist(), batch[dst].n_id[ei[1]].tolist(), e_id.tolist()))

        ours_e_id = graph.perm[et][ours[et].e_id]  # CSC positions -> columns of the original edge_index
        assert edges(theirs, theirs[et].e_id) == edges(ours, ours_e_id), et
        if "num_sampled_edges" in theirs[et]:  # pyg-lib reports the counts per hop too
            assert theirs[et].num_sampled_edges == ours[et].num_sampled_edges
    if not torch_geometric.typing.WITH_PYG_LIB:
        # Over the very CSC torch-sparse sampled from (its sort leaves the sources of a target in no particular
        # order), and visiting the edge types in its order (it walks its dict of fanouts, which comes out sorted
        # by 'src__rel__dst'; pyg-lib walks the graph's order), we number nodes and edges exactly as it does.
        pyg = loader.node_sampler
        order = sorted(EDGE_TYPES, key="__".join)
        assert order != EDGE_TYPES  # so the order matters here
        same = HeteroCSCGraph(graph.num_nodes_dict, {et: CSCGraph(pyg.colptr_dict["__".join(et)],
                                                                  pyg.row_dict["__".join(et)], perm=pyg.perm[et])
                                                     for et in order})  # fmt: skip
        ours = HeteroNeighborSampler(same, [-1, -1, -1], return_e_id=True).sample(seeds, input_type, seed=0)
        for t in NODE_TYPES:
            assert torch.equal(theirs[t].n_id, ours[t].n_id), t
        for et in EDGE_TYPES:
            assert torch.equal(theirs[et].edge_index, ours[et].edge_index), et
            assert torch.equal(theirs[et].e_id, same.perm[et][ours[et].e_id]), et


# ----------------------------------------------------------------------------- HeteroCSCGraph


def test_from_hetero_data(data):
    g = HeteroCSCGraph.from_hetero_data(data)
    assert g.node_types == NODE_TYPES and g.edge_types == EDGE_TYPES
    assert g.num_nodes_dict == {t: data[t].num_nodes for t in NODE_TYPES}
    assert sorted(g.labels) == ["author", "paper"] and g.labels["paper"].dtype == np.int64
    topic = data[HAS_TOPIC].edge_index
    assert int(topic[0].max()) >= data["field"].num_nodes  # paper ids beyond the number of fields
    for et in EDGE_TYPES:
        csc, ei = g.csc[et], data[et].edge_index
        assert csc.num_nodes == data[et[2]].num_nodes and csc.indices.dtype == np.int32
        assert torch.equal(ei[0, csc.perm], torch.from_numpy(csc.indices.astype(np.int64)))
        dst = ei[1, csc.perm]
        assert torch.equal(torch.from_numpy(np.diff(csc.indptr)), torch.bincount(dst, minlength=csc.num_nodes))
    assert not HeteroCSCGraph.from_hetero_data(data, labels=False).labels
    assert HeteroCSCGraph.from_hetero_data(data, dtype=torch.int64).csc[CITES].indices.dtype == np.int64


def test_from_edge_index_with_separate_source_count():
    g = CSCGraph.from_edge_index(torch.tensor([[7, 2, 5], [0, 1, 0]]), num_nodes=2, num_src_nodes=8)
    assert g.indptr.tolist() == [0, 2, 3] and g.indices.tolist() == [5, 7, 2]
    with pytest.raises(InputError, match=r"edge_index\[0\] holds node ids 2..7, outside \[0, num_src_nodes=6\)"):
        CSCGraph.from_edge_index(torch.tensor([[7, 2], [0, 1]]), num_nodes=2, num_src_nodes=6)
    with pytest.raises(InputError, match=r"edge_index\[1\] holds node ids 0..2, outside \[0, num_nodes=2\)"):
        CSCGraph.from_edge_index(torch.tensor([[1, 1], [0, 2]]), num_nodes=2, num_src_nodes=6)
    with pytest.raises(InputError, match="outside \\[0, num_nodes=2\\)"):  # one count: both rows against it
        CSCGraph.from_edge_index(torch.tensor([[7, 1], [0, 1]]), num_nodes=2)


def test_hetero_csc_graph_checks():
    data = HeteroData()
    data["paper"].num_nodes = 3
    data["paper", "cites", "paper"].edge_index = torch.tensor([[0], [5]])
    with pytest.raises(InputError, match=r"edge type \('paper', 'cites', 'paper'\): edge_index\[1\]"):
        HeteroCSCGraph.from_hetero_data(data)
    data["paper", "cites", "paper"].edge_index = torch.tensor([[0], [1]])
    data["paper"].y = torch.rand(3)
    with pytest.raises(InputError, match="labels of node type 'paper' must be 3 integers"):
        HeteroCSCGraph.from_hetero_data(data)
    assert not HeteroCSCGraph.from_hetero_data(data, labels=False).labels
    no_count = HeteroData()
    no_count["paper", "cites", "paper"].edge_index = torch.tensor([[0], [1]])
    no_count["paper"].y = torch.tensor([1, 2])  # y alone does not say how many papers there are
    with pytest.raises(InputError, match="node type 'paper' has no num_nodes"):
        HeteroCSCGraph.from_hetero_data(no_count)
    with pytest.raises(InputError, match="names node type 'venue'"):
        HeteroCSCGraph({"paper": 3}, {("venue", "hosts", "paper"): CSCGraph.from_edge_index(torch.tensor([[0], [1]]))})
    with pytest.raises(InputError, match="has 2 targets, but node type 'paper' has 3 nodes"):
        HeteroCSCGraph({"paper": 3}, {("paper", "cites", "paper"): CSCGraph.from_edge_index(torch.tensor([[0], [1]]))})


# ----------------------------------------------------------------------------- input checks


def test_num_neighbors_checks(graph):
    with pytest.raises(InputError, match=r"does not have: \[\('paper', 'reviews', 'paper'\)\]"):
        HeteroNeighborSampler(graph, {**{et: [2] for et in EDGE_TYPES}, ("paper", "reviews", "paper"): [2]})
    with pytest.raises(InputError, match=r"no fanouts for edge types \[\('paper', 'has_topic', 'field'\)\]"):
        HeteroNeighborSampler(graph, {et: [2] for et in EDGE_TYPES[:4]})
    with pytest.raises(InputError, match="same number of hops"):
        HeteroNeighborSampler(graph, {**{et: [2, 2] for et in EDGE_TYPES}, CITES: [2]})
    with pytest.raises(InputError, match=r"edge type \('author', 'writes', 'paper'\): num_neighbors\[1\] = -2"):
        HeteroNeighborSampler(graph, {**{et: [2, 2] for et in EDGE_TYPES}, WRITES: [2, -2]})
    with pytest.raises(InputError, match="num_neighbors"):
        HeteroNeighborSampler(graph, 3)
    with pytest.raises(InputError, match="is not an edge type"):
        HeteroNeighborSampler(graph, {("a", "b", "c", "d"): [1]})
    with pytest.raises(InputError, match="twice"):
        HeteroNeighborSampler(graph, {**{et: [1] for et in EDGE_TYPES}, "paper__cites__paper": [1]})
    with pytest.raises(InputError, match=r"pass HeteroCSCGraph.from_hetero_data\(data\)"):
        HeteroNeighborSampler(random_hetero_data(0), [1])


def test_seed_and_input_type_checks(graph):
    sampler = HeteroNeighborSampler(graph, [2])
    n = graph.num_nodes_dict["author"]
    with pytest.raises(InputError, match=rf"seed {n} \(position 1\) is not an id of node type 'author'; it has {n} "):
        sampler.sample([0, n], "author")
    with pytest.raises(InputError, match="seed -1"):
        sampler.sample([-1], "paper")
    with pytest.raises(InputError, match=r"input type 'venue' is not a node type of the graph"):
        sampler.sample([0], "venue")
    with pytest.raises(InputError, match="integer node ids"):
        sampler.sample(torch.tensor([0.5]), "paper")
    with pytest.raises(InputError, match="input_id has 2 entries for 1 seeds"):
        sampler.sample([0], "paper", input_id=torch.tensor([0, 1]))
    with pytest.raises(InputError, match=r"input type \('paper',\) is not a node type"):
        sampler.sample([0], ("paper",))
    with pytest.raises(InputError, match="labels=True but the graph has no labels"):
        unlabelled = HeteroCSCGraph(graph.num_nodes_dict, graph.csc)
        HeteroNeighborSampler(unlabelled, [2]).sample_subgraph([0], "paper", labels=True)


def _graph_with(et_bad, indptr, indices, num_nodes=None):
    """The test graph's CSCs with one edge type's arrays replaced."""
    g = HeteroCSCGraph.from_hetero_data(random_hetero_data(7))
    csc = {et: SimpleNamespace(indptr=c.indptr, indices=c.indices) for et, c in g.csc.items()}
    csc[et_bad] = SimpleNamespace(indptr=np.asarray(indptr, dtype=np.int64),
                                  indices=np.asarray(indices, dtype=np.int32))  # fmt: skip
    return SimpleNamespace(node_types=NODE_TYPES, edge_types=EDGE_TYPES, num_nodes_dict=num_nodes or g.num_nodes_dict,
                           csc=csc)  # fmt: skip


def test_corrupt_relation_raises_naming_it():
    g = HeteroCSCGraph.from_hetero_data(random_hetero_data(7))
    n_paper = g.num_nodes_dict["paper"]
    # paper 0's range of writes in-edges runs past the end of indices
    bad = _graph_with(WRITES, [0, 9] + [2] * (n_paper - 1), [0, 1])
    with pytest.raises(ValueError, match=r"corrupt graph: relation \('author', 'writes', 'paper'\): indptr of node 0 "
                                         r"gives a range outside the 2 indices"):  # fmt: skip
        HeteroNeighborSampler(bad, [-1, -1]).sample([0], "paper", seed=0)
    # an author id beyond the number of authors
    n_author = g.num_nodes_dict["author"]
    bad = _graph_with(WRITES, [0, 2] + [2] * (n_paper - 1), [0, n_author + 3])
    with pytest.raises(ValueError, match=rf"corrupt graph: relation \('author', 'writes', 'paper'\): indices\[1\] = "
                                         rf"{n_author + 3} is not a node id of its source type, "
                                         rf"in \[0, {n_author}\)"):  # fmt: skip
        HeteroNeighborSampler(bad, [-1, -1]).sample([0], "paper", seed=0)
    # a relation that is never reached is never read
    bad = _graph_with(HAS_TOPIC, [0, 99] + [1] * (g.num_nodes_dict["field"] - 1), [0])
    HeteroNeighborSampler(bad, [-1, -1]).sample([0], "paper", seed=0)
    # an indptr of the wrong length is refused up front
    with pytest.raises(InputError, match=r"indptr of edge type \('author', 'writes', 'paper'\) must be int64 with"):
        HeteroNeighborSampler(_graph_with(WRITES, [0, 0], []), [2])


def test_native_argument_checks():
    from lightning_ooc import _sampler

    indptr, indices, seeds = np.array([0, 1, 1], dtype=np.int64), np.array([0], dtype=np.int32), np.array([0])
    rel = (indptr, indices, 0, 0, [2], "r")
    with pytest.raises(ValueError, match="relation r: 2 fanouts for 1 hops"):
        _sampler.sample_hetero([2], [(indptr, indices, 0, 0, [2, 2], "r")], seeds, 0, 1, False, 0, False)
    with pytest.raises(ValueError, match="relation r: node types 0 -> 3"):
        _sampler.sample_hetero([2], [(indptr, indices, 0, 3, [2], "r")], seeds, 0, 1, False, 0, False)
    with pytest.raises(ValueError, match="relation r: indptr holds 3 entries; its target type has 5 nodes"):
        _sampler.sample_hetero([5], [rel], seeds, 0, 1, False, 0, False)
    with pytest.raises(ValueError, match="input_type 1 is not one of the 1 node types"):
        _sampler.sample_hetero([2], [rel], seeds, 1, 1, False, 0, False)
    with pytest.raises(IndexError, match="seed 7 \\(position 1\\) is not a node id of the input type"):
        _sampler.sample_hetero([2], [rel], np.array([0, 7]), 0, 1, False, 0, False)
    with pytest.raises(TypeError, match="relations\\[0\\]: expected a tuple"):
        _sampler.sample_hetero([2], [list(rel)], seeds, 0, 1, False, 0, False)
    with pytest.raises(TypeError, match="seeds: expected a contiguous 1-D int64 array"):
        _sampler.sample_hetero([2], [rel], np.array([0], dtype=np.int32), 0, 1, False, 0, False)
    with pytest.raises(ValueError, match="fanouts: entry 0 is -2"):
        _sampler.sample_hetero([2], [(indptr, indices, 0, 0, [-2], "r")], seeds, 0, 1, False, 0, False)
    # many relations (more arrays than the inline borrowing holds) are fine
    many = [rel] * 20
    n_id, edge_index, e_id, hop_nodes, hop_edges, _ = _sampler.sample_hetero([2], many, seeds, 0, 1, False, 0, True)
    assert hop_edges == [[1]] * 20  # every relation samples the seed's one in-edge (a self-loop: no new node)
    assert hop_nodes == [[1, 0]] and len(e_id) == len(edge_index) == 20 and len(n_id) == 1


@pytest.mark.parametrize("name", ["hetero_sampler", "hetero_reference", "csc"])
def test_docstring_examples(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"lightning_ooc.sampling.{name}"), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
