"""Negative sampling for link prediction: the distribution drawn, the strict option, PyG's layout, errors."""
import math
import threading

import pytest
import torch

from lightning_ooc.errors import InputError
from lightning_ooc.sampling import CSCGraph, NegativeSampler, NegativeSampling


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts.double() - expected) ** 2 / expected).sum())


def _critical(df: int, z: float = 4.75) -> float:
    """The chi-square quantile at about 1 - 1e-6 (Wilson-Hilferty): above it, the draw is not from the law."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _skewed_graph(n: int = 60) -> tuple[CSCGraph, torch.Tensor, torch.Tensor]:
    """Node v points to the next (v % 7) + 1 nodes; in-degrees vary too; node n-1 has no out-edge."""
    src, dst = [], []
    for v in range(n - 1):
        for k in range(1, v % 7 + 2):
            src.append(v)
            dst.append((v + 3 * k) % n)
    ei = torch.tensor([src, dst])
    return CSCGraph.from_edge_index(ei, num_nodes=n), torch.bincount(ei[0], minlength=n), torch.bincount(ei[1], minlength=n)


def test_binary_uniform_negatives_are_uniform_and_the_test_would_see_a_bias():
    g, out_deg, in_deg = _skewed_graph()
    n, draws = 60, 120_000
    pos = torch.tensor([0, 1, 2])
    neg = NegativeSampler(g, NegativeSampling("binary", amount=draws / 3)).sample(pos, pos + 1, seed=7)
    assert neg.src.shape == neg.dst.shape == (draws,) and neg.unresolved == 0
    uniform = torch.full((n,), draws / n, dtype=torch.float64)
    for ends in (neg.src, neg.dst):
        assert _chi2(torch.bincount(ends, minlength=n), uniform) < _critical(n - 1)
    # the same statistic rejects degree-weighted draws: the test has the power to fail
    biased = NegativeSampler(g, NegativeSampling("binary", amount=draws / 3, weight="degree")).sample(pos, pos + 1, 7)
    assert _chi2(torch.bincount(biased.src, minlength=n), uniform) > 10 * _critical(n - 1)


def test_degree_weighted_negatives_follow_out_and_in_degree():
    g, out_deg, in_deg = _skewed_graph()
    n, draws = 60, 200_000
    pos = torch.tensor([5])
    neg = NegativeSampler(g, NegativeSampling("binary", amount=draws, weight="degree")).sample(pos, pos, seed=3)
    for ends, deg in ((neg.src, out_deg), (neg.dst, in_deg)):
        counts = torch.bincount(ends, minlength=n)
        assert int(counts[deg == 0].sum()) == 0  # a node without such edges is never drawn
        live = deg > 0
        expected = draws * deg[live].double() / float(deg.sum())
        assert _chi2(counts[live], expected) < _critical(int(live.sum()) - 1)


def test_triplet_negatives_are_laid_out_per_positive_and_strict():
    g, _, _ = _skewed_graph()
    src, dst = torch.tensor([0, 4, 9, 13, 20]), torch.tensor([3, 7, 12, 16, 23])
    out = NegativeSampler(g, NegativeSampling("triplet", amount=6, strict=True)).sample(src, dst, seed=1)
    assert out.src is None and out.dst.shape == (30,) and out.unresolved == 0
    per = out.dst.view(5, 6)  # PyG's dst_neg_index layout: negative j of positive i at i * amount + j
    assert bool((per != dst[:, None]).all())
    edges = set(zip(*_edges(g)))
    assert not any((int(s), int(d)) in edges for s, row in zip(src, per) for d in row)
    assert NegativeSampling("triplet", amount=6).count(5) == 30 and NegativeSampling("binary", amount=1.5).count(5) == 8


def _edges(g: CSCGraph) -> list[list[int]]:
    indptr, indices = torch.as_tensor(g.indptr), torch.as_tensor(g.indices)
    dst = torch.repeat_interleave(torch.arange(indptr.numel() - 1), indptr[1:] - indptr[:-1])
    return [indices.tolist(), dst.tolist()]


def test_strict_binary_negatives_avoid_edges_and_positives_and_count_what_cannot():
    g, _, _ = _skewed_graph()
    edges = set(zip(*_edges(g)))
    src, dst = torch.tensor([1, 2, 3]), torch.tensor([40, 41, 42])  # positives that are not graph edges
    loose = NegativeSampler(g, NegativeSampling("binary", amount=2000)).sample(src, dst, seed=5)
    assert any((int(s), int(d)) in edges for s, d in zip(loose.src, loose.dst))  # without strict, some are edges
    out = NegativeSampler(g, NegativeSampling("binary", amount=2000, strict=True)).sample(src, dst, seed=5)
    pairs = set(zip(out.src.tolist(), out.dst.tolist()))
    assert out.unresolved == 0 and not pairs & edges and not pairs & {(1, 40), (2, 41), (3, 42)}
    # a complete graph leaves no strict negative: every pair is kept and counted
    full = torch.cartesian_prod(torch.arange(4), torch.arange(4)).t()
    k4 = CSCGraph.from_edge_index(full, num_nodes=4)
    out = NegativeSampler(k4, NegativeSampling("binary", amount=3, strict=True, max_tries=5)).sample(
        torch.tensor([0]), torch.tensor([1]), seed=0)  # fmt: skip
    assert out.unresolved == 3 and out.src.shape == (3,)


def test_negatives_are_deterministic_per_seed_on_any_thread():
    g, _, _ = _skewed_graph()
    sampler = NegativeSampler(g, NegativeSampling("binary", amount=50, weight="degree", strict=True))
    pos = torch.arange(10)
    ref = {s: sampler.sample(pos, pos + 1, seed=s) for s in range(4)}
    assert not torch.equal(ref[0].dst, ref[1].dst)
    got = {}

    def work(s):
        got[s] = sampler.sample(pos, pos + 1, seed=s)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(got[s].src, ref[s].src) and torch.equal(got[s].dst, ref[s].dst) for s in range(4))


def test_configuration_and_input_errors_are_clear():
    g, _, _ = _skewed_graph()
    with pytest.raises(InputError, match="integer amount"):
        NegativeSampling("triplet", amount=1.5)
    with pytest.raises(InputError, match="mode must be one of binary, triplet"):
        NegativeSampling("pairwise")
    with pytest.raises(InputError, match="amount must be a number > 0"):
        NegativeSampling("binary", amount=0)
    with pytest.raises(InputError, match="weight must be one of"):
        NegativeSampling("binary", weight="pagerank")
    with pytest.raises(InputError, match=r"positive edge 1 holds node 60, not a node id in \[0, 60\)"):
        NegativeSampler(g, "binary").sample(torch.tensor([0, 60]), torch.tensor([1, 2]), seed=0)
    with pytest.raises(InputError, match="needs a graph with edges"):
        NegativeSampler(CSCGraph.from_edge_index(torch.zeros(2, 0, dtype=torch.long), num_nodes=3),
                        NegativeSampling(weight="degree"))  # fmt: skip
    from torch_geometric.sampler import NegativeSampling as PyGNegativeSampling

    cfg = NegativeSampling.cast(PyGNegativeSampling("triplet", amount=3))
    assert (cfg.mode, cfg.amount) == ("triplet", 3) and NegativeSampling.cast("binary").mode == "binary"
    assert NegativeSampling.cast({"mode": "binary", "amount": 2}).amount == 2 and NegativeSampling.cast(None) is None


def test_a_corrupt_graph_is_an_error_not_a_wild_read():
    from lightning_ooc.errors import CorruptDatasetError

    class Raw:  # a CSC as given, unchecked
        def __init__(self, indptr, indices):
            self.indptr, self.indices = torch.tensor(indptr), torch.tensor(indices)

    one = (torch.tensor([0]), torch.tensor([1]))
    cases = {
        "indptr not starting at 0": (Raw([1, 1, 2], [0, 1]), "binary", "runs from 1 to 2"),
        "indptr decreasing": (Raw([0, 2, 1, 2], [0, 1]), "binary", "indptr decreases"),
        "a source outside the graph": (Raw([0, 1, 2], [-5, 99]), "binary", "indices hold -5|indices hold 99"),
        "a range past indices": (Raw([0, 3, 2], [0, 1]), "triplet", "indptr decreases"),
    }
    for what, (graph, mode, message) in cases.items():
        with pytest.raises(CorruptDatasetError, match=message):
            NegativeSampler(graph, NegativeSampling(mode, amount=4, weight="degree", strict=True)).sample(*one, seed=0)
