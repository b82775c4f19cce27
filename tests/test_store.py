"""Tiers of the feature store: host cache selection, staging, budgets, the tiered extract/gather."""
import tracemalloc

import numpy as np
import pytest
import torch

from lightning_ooc import Tiered
from lightning_ooc.data.degree import InDegree
from lightning_ooc.store.host_cache import access_counts, choose_hot, top_k
from lightning_ooc.store.planner import StorePlan
from lightning_ooc.store.staging import StagingBuffer
from lightning_ooc.store.tiered import TieredFeatureStore
from lightning_ooc.testing import make_synthetic


def test_choose_hot_by_presample_and_degree():
    batches = [torch.tensor([1, 2, 3]), torch.tensor([2, 3]), torch.tensor([3, 9])]
    assert access_counts(batches, 10).tolist() == [0, 1, 2, 3, 0, 0, 0, 0, 0, 1]
    deg = np.array([0, 5, 0, 0, 0, 0, 0, 0, 0, 1])
    hot = choose_hot(3, 10, policy="presample", in_degree=deg, presample=lambda: batches)
    assert hot.ids.tolist() == [3, 2, 1]  # 1 and 9 tie at one access; 1 has the higher in-degree
    assert hot.expected_hit_rate == pytest.approx(6 / 7)
    by_degree = choose_hot(2, 10, policy="degree", in_degree=deg)
    assert by_degree.ids.tolist() == [1, 9] and by_degree.expected_hit_rate is None
    with pytest.raises(ValueError, match="unknown host cache policy"):
        choose_hot(2, 10, policy="lfu", in_degree=deg)


def _ranked_by_sorting(counts: np.ndarray, deg: np.ndarray | None, k: int) -> list[int]:
    """The ranking the chunked one must give: count, then in-degree, descending; the lower id first."""
    keys = (np.arange(counts.size), -counts) if deg is None else (np.arange(counts.size), -deg, -counts)
    return np.lexsort(keys)[:k].tolist()


@pytest.mark.parametrize("seed", range(16))
def test_top_k_and_choose_hot_match_a_full_sort_in_every_chunking(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    counts = rng.integers(0, 4, n).astype(np.int32)  # few distinct values: many ties
    indptr = np.concatenate([[0], np.cumsum(rng.integers(0, 3, n))])
    deg = np.diff(indptr)
    k, chunk = int(rng.integers(0, n + 3)), int(rng.integers(1, n + 2))
    assert top_k(lambda lo, hi: counts[lo:hi], n, k, chunk=chunk).tolist() == _ranked_by_sorting(counts, None, k)
    want = _ranked_by_sorting(counts, deg, k)
    for d in (deg, InDegree(indptr)):
        hot = choose_hot(k, n, counts=torch.from_numpy(counts), in_degree=d, chunk=chunk)
        assert hot.ids.tolist() == want
        unordered = choose_hot(k, n, counts=torch.from_numpy(counts), in_degree=d, chunk=chunk, ordered=False)
        assert unordered.ids.tolist() == sorted(want) and unordered.expected_hit_rate == hot.expected_hit_rate
    assert choose_hot(k, n, counts=torch.from_numpy(counts), chunk=chunk).ids.tolist() == _ranked_by_sorting(
        counts, None, k)  # fmt: skip
    assert choose_hot(k, n, policy="degree", in_degree=deg, chunk=chunk).ids.tolist() == _ranked_by_sorting(
        deg, None, k)  # fmt: skip


def test_access_counts_widen_past_what_int16_holds():
    counts = access_counts((torch.tensor([0, 2]) for _ in range(40_000)), 3)
    assert counts.dtype == torch.int32 and counts.tolist() == [40_000, 0, 40_000]


def test_ranking_keys_that_would_overflow_keep_the_count_first():
    counts = np.array([1, 2, 2, 1], dtype=np.int32) * (1 << 29)
    deg = np.array([1 << 40, 1, 1 << 40, 0])  # count x (max degree + 1) would need 71 bits
    hot = choose_hot(4, 4, counts=torch.from_numpy(counts), in_degree=deg)
    assert hot.ids.tolist() == [2, 1, 0, 3]


def test_ranking_needs_no_array_of_the_graphs_size_beside_the_counts():
    n, k, chunk = 4_000_000, 1000, 1 << 16
    rng = np.random.default_rng(0)
    counts = torch.from_numpy(rng.integers(0, 50, n).astype(np.int32))
    indptr = np.concatenate([[0], np.cumsum(rng.integers(0, 9, n))])
    tracemalloc.start()  # numpy's allocations are traced; the counts and indptr were made before
    try:
        hot = choose_hot(k, n, counts=counts, in_degree=InDegree(indptr), chunk=chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * (chunk + k) * 8  # arrays of a chunk and of k entries (8.5 MB); an int32 array of n: 16 MB
    c, d = counts.numpy(), np.diff(indptr)
    assert hot.ids.tolist() == _ranked_by_sorting(c, d, k)


def test_staging_chunks_are_page_aligned_and_bounded():
    st = StagingBuffer(3 * 4096 * 8 + 100, num_features=2, dtype=torch.float32, chunk_rows=4096)
    assert (st.num_chunks, st.chunk_rows, st.nbytes) == (3, 4096, 3 * 4096 * 8)  # the 100 spare bytes are unused
    st.close()
    st = StagingBuffer(8 * 1024, num_features=4, dtype=torch.float16, chunk_rows=256)
    chunks = [st.acquire() for _ in range(st.num_chunks)]
    assert all(c.rows.data_ptr() % 4096 == 0 for c in chunks)
    with pytest.raises(TimeoutError):
        st.acquire(timeout=0.05)  # bounded: all chunks are taken
    st.release(chunks[0])
    assert st.acquire(timeout=1).index == chunks[0].index
    with pytest.raises(ValueError, match="cannot hold one row"):
        StagingBuffer(10, num_features=4, dtype=torch.float32)


def test_plan_from_budgets():
    plan = StorePlan.from_budgets(num_nodes=10**6, row_bytes=512, gpu_cache="256MiB", host_cache="64MiB",
                                  staging="32MiB", max_nodes_per_batch=20000, num_extractors=4, train_queue_size=4,
                                  device="cpu")  # fmt: skip
    assert plan.buffer_slots == 256 * 2**20 // 512 and plan.buffer_reserve == 20000 * 4
    in_order = StorePlan.from_budgets(num_nodes=10**6, row_bytes=512, gpu_cache="256MiB", host_cache=0,
                                      staging="1MiB", max_nodes_per_batch=20000, num_extractors=4,
                                      train_queue_size=4, device="cpu", order="in_order")  # fmt: skip
    assert in_order.buffer_reserve == 20000 * 10
    assert plan.host_rows == 64 * 2**20 // 512
    assert "feature buffer" in plan.format() and "host cache" in plan.format()
    with pytest.raises(ValueError, match=r"set features\.gpu_cache to at least 39\.06 MiB, .* "
                                         r"pipeline\.num_extractors"):  # fmt: skip
        StorePlan.from_budgets(num_nodes=10**6, row_bytes=512, gpu_cache="32MiB", host_cache=0, staging="1MiB",
                               max_nodes_per_batch=20000, num_extractors=4, train_queue_size=4,
                               device="cpu")  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiered_extract_gather_release(tmp_path, dtype):
    ds = make_synthetic(tmp_path / "g", num_nodes=3000, num_features=37, feature_dtype=dtype)
    store = TieredFeatureStore.create(ds, buffer_slots=600, staging_bytes=37 * 4 * 100,
                                      host_ids=torch.arange(0, 3000, 7))  # fmt: skip
    ref = ds.read_features(np.arange(ds.num_nodes))
    g = torch.Generator().manual_seed(0)
    held = []
    for i in range(30):
        n_id = torch.randperm(3000, generator=g)[:150]
        ext = store.extract(n_id)
        x = store.gather(ext)
        assert x.dtype == ds.feature_dtype and torch.equal(x.view(torch.uint8), ref[n_id].view(torch.uint8))
        assert ext.stats.host_hits == int((n_id % 7 == 0).sum())
        held.append(ext)
        if len(held) > 2:
            store.release(held.pop(0))
    for ext in held:
        store.release(ext)
    store.tier("buffer").buffer.check_invariants()
    assert store.tier("buffer").buffer.evictions > 0 and int(store.tier("buffer").buffer.refcount.sum()) == 0
    direct_store = store.without("buffer")  # evaluation passes: read past the buffer, hold no slot
    free = store.tier("buffer").buffer.free_slots
    direct = direct_store.extract(torch.tensor([5, 7, 2999]))
    assert torch.equal(direct_store.gather(direct).view(torch.uint8), ref[[5, 7, 2999]].view(torch.uint8))
    assert [lease.tier.name for lease in direct.leases] == ["host_cache", "ssd"]
    assert store.tier("buffer").buffer.free_slots == free
    direct_store.release(direct)
    store.close()



def _shrunk_cpu_plan(num_nodes: int, batch: int, room_rows: int, asked_slots: int):
    """A CPU plan under a limit that leaves ``room_rows`` rows beside a buffer at its reserve (one batch)."""
    from lightning_ooc.store.limits import MemoryLimit
    from lightning_ooc.store.tally import host_tally

    common = dict(num_nodes=num_nodes, row_bytes=512, gpu_cache=asked_slots * 512, host_cache=asked_slots * 512,
                  staging="64KiB", max_nodes_per_batch=batch, num_extractors=1, train_queue_size=1, device="cpu",
                  memory_reserve=0)  # fmt: skip
    shape = StorePlan.from_budgets(**common, memory=MemoryLimit.none()).memory_fit.shape
    at_reserve = host_tally(shape, host_rows=0, buffer_slots=batch, staging_bytes=64 << 10).peak
    plan = StorePlan.from_budgets(**common, memory=MemoryLimit(at_reserve + room_rows * 512, "a test"))
    assert plan.memory_fit.shrunk and plan.buffer_reserve == batch
    return plan


def test_a_shrunk_cpu_plan_gives_the_buffer_memory_to_hot_rows_it_would_lose():
    from lightning_ooc.store.planner import host_hit_rate, simulate_buffer, split_host_memory

    n, batch = 70_000, 3000
    plan = _shrunk_cpu_plan(n, batch, room_rows=3000, asked_slots=8000)
    slots = plan.buffer_slots
    assert plan.host_rows == 0 and batch < slots < 8000
    # 1000 hot nodes in every third batch, nodes never seen again around them: more churn between two
    # uses of a hot row than the buffer holds, so LRU keeps none of them; a static cache keeps them all
    hot, cold = torch.arange(1000), iter(torch.arange(1000, n).split(1000))

    def batches():
        return [torch.cat([hot] + [next(cold) for _ in range(2)]) if i % 3 == 0
                else torch.cat([next(cold) for _ in range(3)]) for i in range(12)]  # fmt: skip

    counted, presampled = batches(), batches()  # ranked on some batches, estimated on others
    assert simulate_buffer(slots, n, presampled, torch.arange(0)) == 0.0  # the plan as fitted serves nothing
    ranked = choose_hot(n, n, presample=lambda: counted)
    chosen = split_host_memory(plan, ranked, presampled, n)
    assert plan.buffer_slots < slots and plan.host_rows >= 1000 and chosen.ids.numel() == plan.host_rows
    assert set(hot.tolist()) <= set(chosen.ids.tolist())
    assert host_hit_rate(chosen.ids, presampled, n) == pytest.approx(4000 / 36000)
    fit = plan.memory_fit
    assert fit.fits(plan.host_rows, plan.buffer_slots)
    assert (fit.host_rows, fit.buffer_slots) == (plan.host_rows, plan.buffer_slots)
    assert not fit.fits(plan.host_rows + 1, plan.buffer_slots)  # the room freed went to the host cache
    assert "11.1% of the rows" in plan.split_note and plan.split_note in plan.format()


def test_a_shared_cpu_plan_gives_one_account_of_the_host_cache():
    """The plan printed "host_cache shrunk from 3.91 MiB to 0 B" and then a host cache of the size the split of
    host memory chose: the memory line and the warning now compare what was asked with what is planned."""
    from lightning_ooc.data.format import human_bytes
    from lightning_ooc.store.planner import split_host_memory

    n, batch = 70_000, 3000
    plan = _shrunk_cpu_plan(n, batch, room_rows=3000, asked_slots=8000)
    hot, cold = torch.arange(1000), iter(torch.arange(1000, n).split(1000))
    batches = [torch.cat([hot] + [next(cold) for _ in range(2)]) if i % 3 == 0
               else torch.cat([next(cold) for _ in range(3)]) for i in range(12)]  # fmt: skip
    split_host_memory(plan, choose_hot(n, n, presample=lambda: batches), batches, n)
    host, buffer = human_bytes(plan.host_rows * 512), human_bytes(plan.buffer_slots * 512)
    assert plan.host_rows > 0 and f"host_cache {host}, gpu_cache {buffer}" in plan.split_note
    memory_line = plan.format().splitlines()[-2]
    assert memory_line.startswith("  host memory ") and "to 0 B" not in memory_line
    assert (f"host_cache shrunk from 3.91 MiB to {host}; gpu_cache shrunk from 3.91 MiB to {buffer} to fit"
            in memory_line)  # fmt: skip
    warning = plan.memory_fit.warning()
    assert f"to {host} (8,000 -> {plan.host_rows:,} rows)" in warning and "to 0 B" not in warning


def test_a_shrunk_cpu_plan_keeps_the_buffer_where_recent_batches_are_what_repeats():
    from lightning_ooc.store.planner import simulate_buffer, split_host_memory

    n, batch = 60_000, 3000
    plan = _shrunk_cpu_plan(n, batch, room_rows=6000, asked_slots=8000)
    slots = plan.buffer_slots
    # batch i repeats the fresh half of batch i - 2: an LRU buffer larger than two batches serves it,
    # a buffer at its reserve (one batch) never does, and no node is seen more than twice
    fresh = torch.arange(n).split(1500)
    batches = [torch.cat([fresh[i - 2] if i >= 2 else fresh[30 + i], fresh[i]]) for i in range(12)]
    before = simulate_buffer(slots, n, batches, torch.arange(plan.host_rows))
    assert before == pytest.approx(10 * 1500 / 36000, abs=0.01)
    assert simulate_buffer(batch, n, batches, torch.arange(0)) == 0.0
    ranked = choose_hot(n, n, presample=lambda: batches)
    chosen = split_host_memory(plan, ranked, batches, n)
    assert plan.buffer_slots > plan.buffer_reserve  # memory is not taken from a buffer that serves more
    assert chosen.ids.numel() == plan.host_rows


def test_the_passes_run_with_the_pipeline_the_plan_lowered(tmp_path, monkeypatch):
    """A plan that fitted the memory limit with fewer batches in flight names the settings it lowered; the
    passes run with them (the datamodule's own settings stay as given)."""
    from lightning_ooc.loader import source
    from lightning_ooc.loader.config import NodeDataConfig
    from lightning_ooc.loader.context import ProcessContext
    from lightning_ooc.loader.source import LocalPasses

    plan_store = source.plan_store

    def lowered(*args, **kwargs):  # as a plan under a tight cap chooses (test_memory.py plans one)
        plan, hot = plan_store(*args, **kwargs)
        plan.pipeline = {"extract_queue_size": 1, "num_samplers": 1, "num_extractors": 1}
        return plan, hot

    monkeypatch.setattr(source, "plan_store", lowered)
    ds = make_synthetic(tmp_path / "g", num_nodes=3000, num_features=8, train_frac=0.1)
    cfg = NodeDataConfig(str(ds.root), batch_size=100, num_neighbors=[2], progress=False,
                         features=Tiered(gpu_cache="1MiB", host_cache="8KiB", staging="256KiB", presample_batches=2),
                         pipeline={"num_samplers": 3, "num_extractors": 2})  # fmt: skip
    passes = LocalPasses(cfg, ProcessContext())
    try:
        ran = passes.cfg.pipeline
        assert (ran.num_samplers, ran.num_extractors, ran.extract_queue_size) == (1, 1, 1)
        asked = cfg.pipeline
        assert (asked.num_samplers, asked.num_extractors, asked.extract_queue_size) == (3, 2, 6)
        run = passes.run("train", 0)
        assert len(run._threads) == 2 and len(list(run)) == len(passes.batches.epoch("train", 0))
        assert "1 samplers, 1 extractors, queues 1/4" in passes.describe([])
    finally:
        passes.close()


def test_presampled_batches_are_not_the_first_batches_of_an_epoch(tmp_path):
    from lightning_ooc.loader.config import NodeDataConfig
    from lightning_ooc.loader.context import ProcessContext
    from lightning_ooc.loader.source import LocalPasses

    ds = make_synthetic(tmp_path / "g", num_nodes=3000, num_features=8, train_frac=0.1)  # 300 seeds: 3 batches
    cfg = NodeDataConfig(str(ds.root), batch_size=100, num_neighbors=[2], progress=False,
                         features=Tiered(gpu_cache="1MiB", host_cache="8KiB", staging="256KiB", presample_batches=7),
                         pipeline={"num_samplers": 1, "num_extractors": 1})  # fmt: skip
    passes = LocalPasses(cfg, ProcessContext())
    try:
        assert passes.plan.presample_batches == 7  # counted: more batches than an epoch has, seeds drawn again
        epoch = passes.batches.epoch("train", 0)
        a, b = list(passes.presample(7, stream=0)), list(passes.presample(7, stream=1))
        assert len(a) == len(b) == 7 and all(x.numel() > 0 for x in a)
        assert [x.tolist() for x in a] == [x.tolist() for x in passes.presample(7, stream=0)]  # deterministic
        assert any(x.tolist() != y.tolist() for x, y in zip(a, b))  # independent streams
        train, fewest = set(epoch.cat().tolist()), min(s.numel() for s in epoch)
        for x in a:  # a batch's seeds come first in its n_id: training seeds, but not one of an epoch's batches
            assert set(x[:fewest].tolist()) <= train
            assert all(set(x[: s.numel()].tolist()) != set(s.tolist()) for s in epoch)
    finally:
        passes.close()


@pytest.mark.parametrize("seed", range(5))
def test_simulations_over_the_touched_nodes_renumbered_equal_those_over_the_graph(seed):
    from lightning_ooc.store.planner import compact_ids, host_hit_rate, local_positions, simulate_buffer

    rng = np.random.default_rng(seed)
    n = 50_000
    batches = [torch.from_numpy(rng.choice(n, size=int(rng.integers(50, 400)), replace=False)) for _ in range(12)]
    host = torch.from_numpy(rng.choice(n, size=300, replace=False))
    touched, local = compact_ids(batches)
    pos = local_positions(touched, host)
    cached = pos[pos >= 0]
    assert touched.numel() < n and torch.equal(touched[cached], host[pos >= 0])
    for slots in (400, 900, 3000):
        assert simulate_buffer(slots, touched.numel(), local, cached) == simulate_buffer(slots, n, batches, host)
    assert host_hit_rate(cached, local, touched.numel()) == host_hit_rate(host, batches, n)
