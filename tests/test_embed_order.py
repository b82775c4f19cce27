"""Partition loading orders for partition-buffer embedding training (lightning_ooc.embed.order)."""
import dataclasses
import doctest
import importlib

import pytest

order_mod = importlib.import_module("lightning_ooc.embed.order")
from lightning_ooc.embed.order import (  # noqa: E402
    BufferState,
    PartitionOrder,
    beta_order,
    greedy_order,
    legend_order,
    partition_order,
    prefetch_stats,
    swap_lower_bound,
)

NS = range(1, 41)
CASES = [("legend", 3)] + [(kind, c) for kind in ("beta", "greedy") for c in (3, 4, 5)]

# The Legend paper's Table 6, "I/O times" for a buffer of 3: the number of buffer states (initial fill + swaps).
PAPER_LEGEND_STATES = {6: 8, 8: 16, 10: 24, 12: 36, 14: 50, 16: 66}
PAPER_BETA_STATES = {6: 8, 8: 15, 10: 24, 12: 34, 14: 48, 16: 63}


def make(kind, n, c):
    return partition_order(n, c, kind) if n > c else partition_order(n, c, "auto")


def all_buckets(n):
    return {(i, j) for i in range(n) for j in range(n)}


@pytest.mark.parametrize("kind,c", CASES)
def test_every_bucket_once_one_swap_at_a_time(kind, c):
    for n in NS:
        order = make(kind, n, c)
        order.validate()
        buckets = order.buckets()
        assert len(buckets) == n * n and set(buckets) == all_buckets(n), (kind, n, c)
        assert order.capacity == c and order.num_partitions == n
        assert order.name == (kind if n > c else "single")
        for s in order.states:
            assert len(s.partitions) == min(c, n) and list(s.partitions) == sorted(set(s.partitions))
        for a, b in zip(order.states, order.states[1:]):
            assert set(a.partitions) ^ set(b.partitions) == {a.evict, a.load}
            assert a.evict in a.partitions and a.load in b.partitions
        last = order.states[-1]
        assert last.evict is None and last.load is None and last.during == ()
        assert order.num_swaps == len(order.states) - 1 == len(order.swaps())


@pytest.mark.parametrize("kind,c", CASES)
def test_first_resident_state_and_before_during_split(kind, c):
    for n in (5, 9, 17):
        order = make(kind, n, c)
        seen = set()
        for s in order.states:
            here = {(i, j) for i in s.partitions for j in s.partitions}
            assert set(s.buckets) == here - seen  # every bucket in the first state holding both partitions
            seen |= here
            assert list(s.before) == sorted(s.before) and list(s.during) == sorted(s.during)
            if s.evict is not None:
                assert all(s.evict in b for b in s.before)
                assert not any(s.evict in b or s.load in b for b in s.during)
        assert order.hidden_buckets() == sum(len(s.during) for s in order.states[:-1])


@pytest.mark.parametrize("kind,c", [("legend", 3), ("greedy", 2), ("greedy", 3), ("greedy", 4), ("greedy", 5)])
def test_property1_the_partition_just_loaded_is_not_evicted_next(kind, c):
    for n in range(1, 65 if kind == "legend" else 41):
        order = make(kind, n, c)
        for a, b in zip(order.states, order.states[1:-1]):
            assert b.evict != a.load, (kind, c, n, a, b)
        assert prefetch_stats(order)["property1"]


def test_legend_n6_is_the_papers_figure_6():
    order = legend_order(6)
    assert [s.partitions for s in order.states] == [
        (0, 1, 2), (0, 2, 3), (0, 3, 4), (0, 4, 5), (1, 4, 5), (1, 3, 5), (2, 3, 5), (2, 4, 5),
    ]
    # Table 6 gives 8 "I/O times" for 6 partitions, counting buffer states: the initial fill and 7 swaps.
    assert len(order.states) <= PAPER_LEGEND_STATES[6]
    assert order.num_swaps <= PAPER_LEGEND_STATES[6] - 1
    assert order.num_swaps <= 8  # also no worse if the paper's 8 were read as swaps
    first, second = order.states[:2]
    assert (first.evict, first.load) == (1, 3)
    assert set(first.before) == {(0, 1), (1, 0), (1, 1), (1, 2), (2, 1)}  # as in the paper's example
    assert set(first.during) == {(0, 0), (0, 2), (2, 0), (2, 2)}
    assert (second.evict, second.load) == (2, 4) and set(second.before) == {(2, 3), (3, 2)}
    st = prefetch_stats(order)
    assert st["unhidden_swaps"] == 0 and st["property1"]
    assert min(len(s.during) for s in order.states[:-1]) >= 2  # Theorem 3's "at least 2 buckets" per exchange


def test_swap_counts_against_the_paper():
    for n, states in PAPER_LEGEND_STATES.items():
        got = len(legend_order(n).states)
        assert got <= states + 2, (n, got, states)  # equal for n = 6, 8, 10, 14; 38 and 68 for 12 and 16
    for n, states in PAPER_BETA_STATES.items():
        assert len(beta_order(n, 3).states) == (35 if n == 12 else states)
    # "only 4 out of 36 I/O times fail to support prefetching for 12 partitions"
    assert prefetch_stats(legend_order(12))["unhidden_swaps"] == 4


def test_lower_bound():
    assert swap_lower_bound(6, 3) == 6 and swap_lower_bound(3, 3) == 0 and swap_lower_bound(1, 5) == 0
    assert swap_lower_bound(8, 4) == 8 and swap_lower_bound(16, 3) == 59
    for kind, c in CASES + [("greedy", 2), ("beta", 2)]:
        for n in NS:
            assert make(kind, n, c).num_swaps >= swap_lower_bound(n, c), (kind, n, c)
    assert beta_order(10, 2).num_swaps == swap_lower_bound(10, 2)  # with c = 2 every pair costs one swap


def test_legend_hides_more_than_beta():
    for n in range(6, 41):
        legend, beta = prefetch_stats(legend_order(n)), prefetch_stats(beta_order(n, 3))
        assert legend["hidden_buckets"] >= beta["hidden_buckets"], n
        assert legend["unhidden_swaps"] <= beta["unhidden_swaps"], n
        assert legend["unhidden_swaps"] <= 0.3 * legend["swaps"], n
        assert not beta["property1"] and beta["property1_violations"] > 0, n
        if n >= 8:
            assert legend["hidden_fraction"] > 0.45 and legend["hidden_fraction"] > 1.5 * beta["hidden_fraction"]
    for n in range(1, 7):
        assert prefetch_stats(legend_order(n))["unhidden_swaps"] == 0


def test_greedy_hides_its_swaps_with_larger_buffers():
    for c in (4, 5):
        for n in range(c + 1, 41):
            st = prefetch_stats(greedy_order(n, c))
            assert st["property1"] and st["unhidden_swaps"] <= 0.1 * st["swaps"] + 1, (n, c, st)


def test_deterministic():
    for kind, c in CASES:
        for n in (7, 13, 24):
            a, b = make(kind, n, c), make(kind, n, c)
            assert a == b and a.buckets() == b.buckets()
    assert legend_order(10) == partition_order(10) == partition_order(10, 3, "legend")


def test_partition_order_kinds_and_errors():
    assert partition_order(3).name == "single" and partition_order(3).num_swaps == 0
    assert partition_order(4, 8).states[0].partitions == (0, 1, 2, 3)
    assert partition_order(9).name == "legend"
    assert partition_order(9, 4).name == "greedy" and partition_order(9, 2).name == "greedy"
    assert partition_order(9, 4, "beta").name == "beta"
    assert partition_order(1, 3, "single").states == (BufferState((0,), None, None, ((0, 0),), ()),)
    for bad in [dict(n=0), dict(n=-3), dict(n=5, c=1), dict(n=5, c=0), dict(n=5, kind="hilbert"),
                dict(n=5, c=4, kind="legend"), dict(n=5, c=3, kind="single"), dict(n=2.5)]:
        with pytest.raises(ValueError):
            partition_order(**{"c": 3, **bad})
    for f in (lambda: legend_order(0), lambda: beta_order(4, 1), lambda: greedy_order(0, 3), lambda: swap_lower_bound(4, 1)):
        with pytest.raises(ValueError):
            f()


def test_validate_rejects_broken_orders():
    order = legend_order(6)
    s = list(order.states)

    def broken(states, **kw):
        return dataclasses.replace(order, states=tuple(states), **kw)

    cases = [
        broken(s[:-1]),  # buckets of the last state never trained
        broken(s[:1] + s[2:]),  # a swap that changes two partitions
        broken([dataclasses.replace(s[0], during=s[0].during + ((1, 1),), before=s[0].before[:2] + s[0].before[3:])] + s[1:]),
        broken([dataclasses.replace(s[0], before=s[0].before + ((0, 0),), during=s[0].during[1:])] + s[1:]),
        broken([dataclasses.replace(s[0], partitions=(0, 1))] + s[1:]),
        broken([dataclasses.replace(s[0], partitions=(0, 2, 1))] + s[1:]),
        broken([dataclasses.replace(s[0], before=s[0].before + ((0, 3),))] + s[1:]),  # 3 is not resident
        broken(s[:-1] + [dataclasses.replace(s[-1], evict=2, load=0)]),
        broken(s[:-1] + [dataclasses.replace(s[-1], before=(), during=s[-1].before)]),
        broken([dataclasses.replace(s[0], evict=None)] + s[1:]),
        broken(s[:1] + [dataclasses.replace(s[1], during=s[1].during + ((0, 0),))] + s[2:]),  # trained twice
        broken(s, num_partitions=7),
        broken(s, capacity=4),
        broken([]),
    ]
    for bad in cases:
        with pytest.raises(ValueError):
            bad.validate()
    order.validate()


def test_prefetch_stats_fields():
    st = prefetch_stats(beta_order(8, 3))
    assert st["name"] == "beta" and st["states"] == 15 and st["swaps"] == 14 and st["buckets"] == 64
    assert st["lower_bound"] == 13 and 0 < st["hidden_fraction"] < 1
    assert st["hidden_buckets"] == beta_order(8, 3).hidden_buckets()
    single = prefetch_stats(partition_order(2))
    assert single["swaps"] == 0 and single["hidden_buckets"] == 0 and single["unhidden_swaps"] == 0


def test_module_docstring_example():
    result = doctest.testmod(order_mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
    assert isinstance(legend_order(4), PartitionOrder)
