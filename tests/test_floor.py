"""The I/O floor of `bench epoch`: the fewest reads a batch sequence needs with a given memory, and the replay of an
epoch's batches it is computed over."""
import itertools
import random

import numpy as np
import torch

from lightning_ooc.bench.floor import (NEVER, best_static_reads, compulsory_reads, flatten_types, next_uses, optimal_reads,
                                      replay_epoch)
from lightning_ooc.testing import make_synthetic


def brute_force_reads(batches, capacity):
    """The fewest reads over every choice of rows to keep after every batch (all subsets of at most
    ``capacity`` of the rows kept or read), by dynamic programming over the kept sets."""
    best = {frozenset(): 0}
    for b in batches:
        need = frozenset(int(x) for x in b)
        nxt = {}
        for kept, cost in best.items():
            cost += len(need - kept)
            pool = sorted(kept | need)
            for size in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, size):
                    k = frozenset(keep)
                    if cost < nxt.get(k, 1 << 60):
                        nxt[k] = cost
        best = nxt
    return min(best.values())


def small_cases(count, most_rows):
    """``count`` seeded random ``(case, rows, batches)``: up to 6 batches of ids below ``rows`` (every fifth
    case with an id repeated in each batch, which counts once)."""
    for case in range(count):
        rng = random.Random(case)
        rows = rng.randint(1, most_rows)
        batches = [rng.sample(range(rows), rng.randint(0, rows)) for _ in range(rng.randint(1, 6))]
        if case % 5 == 0:
            batches = [b + b[:1] for b in batches]
        yield case, rows, batches


def test_optimal_reads_match_brute_force_on_small_cases():
    for case, rows, batches in small_cases(300, 6):
        for capacity in range(rows + 1):
            assert optimal_reads(batches, capacity) == brute_force_reads(batches, capacity), (case, batches, capacity)


def test_optimal_reads_bounds_and_per_batch():
    rng = np.random.default_rng(0)
    batches = [rng.choice(2000, size=300, replace=False) for _ in range(40)]
    total = sum(b.size for b in batches)
    distinct = compulsory_reads(batches)
    assert optimal_reads(batches, 0) == total
    assert optimal_reads(batches, 2000) == distinct  # everything fits: each row read once
    counts = [optimal_reads(batches, c) for c in (0, 100, 500, 1000, 1999, 2000)]
    assert counts == sorted(counts, reverse=True) and counts[-1] >= distinct
    per = optimal_reads(batches, 500, per_batch=True)
    assert per.shape == (40,) and int(per.sum()) == optimal_reads(batches, 500) and per[0] == 300  # cold start


def test_optimal_reads_beat_lru_and_a_static_cache():
    """The floor is below what a real policy with the same memory reads: LRU, or the most-used rows kept."""
    rng = np.random.default_rng(1)
    weights = 1.0 / np.arange(1, 5001) ** 0.8
    weights /= weights.sum()
    batches = [np.unique(rng.choice(5000, size=400, p=weights)) for _ in range(60)]
    cap = 600
    lru, lru_reads = {}, 0
    for t, b in enumerate(batches):
        for x in b.tolist():
            if x in lru:
                lru.pop(x)
            else:
                lru_reads += 1
            lru[x] = t
        while len(lru) > cap:
            lru.pop(next(iter(lru)))
    counts = np.bincount(np.concatenate(batches), minlength=5000)
    hot = set(np.argsort(-counts)[:cap].tolist())
    static_reads = len(hot) + sum(sum(1 for x in b.tolist() if x not in hot) for b in batches)
    opt = optimal_reads(batches, cap)
    assert opt < lru_reads and opt < static_reads


def test_best_static_reads_match_brute_force_and_lie_between_the_floor_and_no_cache():
    for case, rows, batches in small_cases(200, 7):
        used = sorted({x for b in batches for x in b})
        for capacity in range(rows + 1):
            # every set of rows kept all epoch: each kept row used at all is read once, every other use is a read
            brute = min(sum(1 for x in keep if any(x in b for b in batches))
                        + sum(len(set(b) - set(keep)) for b in batches)
                        for size in range(min(capacity, len(used)) + 1)
                        for keep in itertools.combinations(used, size))  # fmt: skip
            got = best_static_reads(batches, capacity)
            assert got == brute, (case, batches, capacity)
            assert optimal_reads(batches, capacity) <= got <= optimal_reads(batches, 0)


def test_next_uses_follow_each_row():
    nxt, starts = next_uses([[3, 1], [1, 1, 2], [], [3]])
    assert starts.tolist() == [0, 2, 4, 4, 5]
    assert nxt.tolist() == [1, 3, NEVER, NEVER, NEVER]  # batch 0: rows 1, 3 (sorted); batch 1: rows 1, 2
    assert flatten_types({"a": torch.tensor([0, 1]), "b": torch.tensor([0])}, {"a": 0, "b": 10}).tolist() == [0, 1, 10]


def test_replay_gives_the_node_ids_the_pipeline_gathers(tmp_path):
    from lightning_ooc import OutOfCoreNodeData

    ds = make_synthetic(tmp_path / "g", num_nodes=3000, num_features=8, train_frac=0.3)
    from lightning_ooc import Tiered

    kw = dict(batch_size=100, num_neighbors=[4, 3], seed=5, progress=False,
              features=Tiered(gpu_cache="256KiB", host_cache="16KiB", staging="64KiB"),
              pipeline=dict(num_samplers=2, num_extractors=2, order="out_of_order"))  # fmt: skip
    replayed = [b.clone() for b in replay_epoch(OutOfCoreNodeData, str(ds.root), **kw)]
    assert len(replayed) == 9
    dm = OutOfCoreNodeData(ds.root, **kw)
    dm.setup("fit")
    try:
        seen = {int(b.batch_index): b.n_id.clone() for b in dm.train_dataloader()}
    finally:
        dm.teardown("fit")
    assert sorted(seen) == list(range(9))
    for k, n_id in seen.items():
        assert torch.equal(n_id, replayed[k]), k
    assert len(list(replay_epoch(OutOfCoreNodeData, str(ds.root), max_batches=4, **kw))) == 4
