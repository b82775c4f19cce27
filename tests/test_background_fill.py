"""The host cache ranked while training runs (`host_cache_fill="background"`): the first batches do not wait for
it, it keeps its rows from the reads the feature buffer makes (no read of its own) and serves each once it is in
place, a failure surfaces in the pipeline, closing stops it."""
import threading

import pytest
import torch

from lightning_ooc import OutOfCoreNodeData, Tiered
from lightning_ooc.store import background
from lightning_ooc.store.tiered import TieredFeatureStore
from lightning_ooc.testing import make_synthetic

TIERS = dict(gpu_cache="1MiB", host_cache="64KiB", staging="256KiB", presample_batches=16)
KW = dict(batch_size=50, num_neighbors=[4, 3], pipeline={"num_samplers": 2, "num_extractors": 2, "order": "in_order"},
          progress=False)


def tiered(**kw) -> Tiered:
    """The tiers of these tests, with ``kw`` changed."""
    return Tiered(**{**TIERS, **kw})


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("bg") / "g", num_nodes=4000, num_features=16, train_frac=0.2)


@pytest.fixture
def gate(monkeypatch):
    """Hold every background ranking until the event is set (closing the fill still stops it)."""
    event = threading.Event()
    init = background.DeferredHot.__init__

    def gated_init(self, rank, on_done, counter=None):
        def gated(check):
            while not event.wait(0.02):
                check()
            return rank(check)

        init(self, gated, on_done, counter)

    monkeypatch.setattr(background.DeferredHot, "__init__", gated_init)
    return event


def _fill(dm):
    return dm.source.store.tier("host_cache").background


def _epoch(dm, graph):
    stats = []
    for batch in dm.train_dataloader():
        assert torch.equal(batch.x, graph.read_features(batch.n_id)), "a row served wrong"
        stats.append(batch)
    return dm.train_dataloader().run.stats


def test_training_starts_before_the_ranking_and_the_cache_keeps_its_rows_from_the_buffers_reads(graph, gate):
    # a buffer far smaller than the graph: without the host cache, every epoch reads again what it read before
    kw = {**KW, "pipeline": {"num_samplers": 2, "num_extractors": 2, "order": "out_of_order"}}
    dm = OutOfCoreNodeData(graph.root, features=tiered(host_cache_fill="background", gpu_cache="96KiB"), **kw)
    dm.setup("fit")
    try:
        assert dm.plan.buffer_slots < graph.num_nodes // 2
        fill = _fill(dm)
        assert fill is not None and not fill.done and dm.plan.host_fill == "background"
        assert "ranked in the background" in dm.plan.format() and dm.plan.expected_host_hit is None
        first = _epoch(dm, graph)  # the whole epoch while the ranking is held: every row from SSD or the buffer
        assert first.io.host_hits == 0 and first.batches == len(dm._batches("train", 0))
        gate.set()
        assert fill.wait(timeout=60)
        host = fill.host
        assert host.num_rows == dm.plan.host_rows > 0 and fill.rows_filled == 0  # expected, none read yet
        assert host.fill_rows == 0 and bool((host.lookup(host.ids) == -1).all())
        assert dm.plan.expected_host_hit is not None and dm.plan.presample_batches == 16
        second = _epoch(dm, graph)  # every row still right; the cache keeps what the buffer read
        kept = fill.rows_filled
        assert kept > 0 and host.admitted_rows == kept and host.fill_rows == 0  # no read of its own
        held = host.lookup(host.ids) >= 0
        assert int(held.sum()) == kept and torch.equal(host.gather(host.lookup(host.ids[held])),
                                                       graph.read_features(host.ids[held]))  # fmt: skip
        # a kept row is read once: the epoch's misses are the first epoch's less what the cache now serves
        assert second.io.host_hits > 0 and second.io.misses < first.io.misses
        third = _epoch(dm, graph)  # the rows kept in the second epoch serve it from the start
        assert third.io.host_hits > second.io.host_hits and third.io.misses < second.io.misses
    finally:
        dm.teardown("fit")


@pytest.mark.parametrize("presample_batches", [17, 24])
def test_the_ranking_counts_the_epochs_own_batches_and_presamples_only_the_rest(graph, gate, presample_batches):
    from lightning_ooc.data.degree import InDegree
    from lightning_ooc.store.host_cache import access_counts, choose_hot

    # the ranking is held for a whole epoch of 17 batches: the host cache tier counts them meanwhile
    dm = OutOfCoreNodeData(graph.root, features=tiered(host_cache_fill="background", presample_batches=presample_batches),
                           **KW)  # fmt: skip
    dm.setup("fit")
    try:
        n_ids = [batch.n_id.clone() for batch in dm.train_dataloader()]
        assert len(n_ids) == 17
        fill = _fill(dm)
        gate.set()
        assert fill.wait(timeout=60)
        counter = fill.counter
        assert (counter.observed, counter.presampled) == (17, presample_batches - 17)
        assert dm.plan.presample_batches == presample_batches and counter.full
        if presample_batches == 17:  # the epoch's batches alone: the rows ranked are exactly theirs
            want = choose_hot(dm.plan.host_rows, graph.num_nodes, in_degree=InDegree(dm.dataset.indptr),
                              counts=access_counts(n_ids, graph.num_nodes), ordered=False).ids  # fmt: skip
            assert torch.equal(fill.host.ids, want)
        assert fill.ranked_after_batches == 17
        _epoch(dm, graph)  # counting ended: the next epoch's batches are not counted
        assert (counter.observed, counter.presampled) == (17, presample_batches - 17)
    finally:
        dm.teardown("fit")


def test_evaluation_batches_do_not_count_towards_the_ranking(graph, gate):
    dm = OutOfCoreNodeData(graph.root, features=tiered(host_cache_fill="background"), **KW)
    dm.setup("fit")
    try:
        fill = _fill(dm)
        val = sum(1 for _ in dm.val_dataloader())  # through the evaluation chain: the tier's frozen view
        assert val > 0 and fill.counter.observed == 0 and fill.batches_done == 0
        assert sum(1 for _ in dm.train_dataloader()) == 17 and fill.counter.observed == 16  # full at 16
        assert fill.batches_done == 17
    finally:
        dm.teardown("fit")


def test_the_batch_counter_counts_its_batches_once_from_many_threads():
    counter = background.BatchCounter(num_nodes=1000, batches=50)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randperm(1000, generator=gen)[:100] for _ in range(120)]
    taken = [0] * 4

    def add(i):
        for b in batches[i::4]:
            taken[i] += counter.add(b, observed=i % 2 == 0)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sum(taken) == 50 == counter.observed + counter.presampled and counter.full
    counts = counter.take()
    assert counts.dtype == torch.int16 and int(counts.sum()) == 50 * 100  # no count lost, none past 50 batches
    assert not counter.add(batches[0]) and counter.take().sum() == 0  # taken: counting ended
    assert background.BatchCounter(10, 40_000).add(torch.tensor([1]))  # past int16's batches: wider counts


def test_a_failed_ranking_fails_the_pass_with_its_cause(graph, gate, monkeypatch):
    def broken(self, ids):
        raise MemoryError("the ranking's temporaries do not fit")

    monkeypatch.setattr(background.HostCache, "expect", broken)
    monkeypatch.setattr(background, "FILL_WAIT_SECONDS", 0.0)  # no batch is trained before it is waited for
    dm = OutOfCoreNodeData(graph.root, features=tiered(host_cache_fill="background"), **KW)
    dm.setup("fit")
    try:
        gate.set()
        with pytest.raises(background.HostCacheFillError, match="temporaries do not fit"):
            _fill(dm).wait(timeout=60)
        with pytest.raises(Exception) as err:
            list(dm.train_dataloader())
        chain, e = [], err.value
        while e is not None:
            chain.append(e)
            e = e.__cause__ or e.__context__
        assert any(isinstance(x, background.HostCacheFillError) for x in chain), chain
    finally:
        dm.teardown("fit")


def test_closing_stops_a_fill_that_has_not_finished(graph, gate):
    dm = OutOfCoreNodeData(graph.root, features=tiered(host_cache_fill="background"), **KW)
    dm.setup("fit")
    fill = _fill(dm)
    assert not fill.done
    dm.teardown("fit")
    assert fill.done and fill.error is None and fill.rows_filled == 0
    assert not [t for t in threading.enumerate() if t.name == "ooc-host-cache-fill"]


def test_auto_fills_small_caches_at_setup_and_ranks_large_ones_in_the_background(graph, monkeypatch):
    dm = OutOfCoreNodeData(graph.root, features=tiered(), **KW)  # host_cache_fill="auto", a 64 KiB cache
    dm.setup("fit")
    try:
        assert dm.plan.host_fill == "setup" and _fill(dm) is None and dm.plan.expected_host_hit is not None
    finally:
        dm.teardown("fit")
    monkeypatch.setattr("lightning_ooc.store.planner.BACKGROUND_FILL_BYTES", 32 << 10)
    monkeypatch.setattr(background, "FILL_WAIT_SECONDS", 0.0)  # no batch is trained before it is waited for
    dm = OutOfCoreNodeData(graph.root, features=tiered(), **KW)
    dm.setup("fit")
    try:
        assert dm.plan.host_fill == "background" and _fill(dm).wait(timeout=60)
        assert _epoch(dm, graph).io.host_hits > 0
    finally:
        dm.teardown("fit")
    with pytest.raises(Exception, match="host_cache_fill must be one of auto, setup, background"):
        OutOfCoreNodeData(graph.root, features=Tiered(host_cache_fill="later"))


def test_auto_ranks_in_the_background_unless_that_alone_would_shrink_the_budgets(graph, monkeypatch):
    from lightning_ooc.io import FeatureReader
    from lightning_ooc.loader.config import NodeDataConfig
    from lightning_ooc.store.limits import MemoryLimit
    from lightning_ooc.store.planner import plan_store

    monkeypatch.setattr("lightning_ooc.store.planner.BACKGROUND_FILL_BYTES", 32 << 10)
    monkeypatch.setattr("lightning_ooc.store.tally.RANK_CHUNK", 64)  # the ranking's chunks as small as this graph
    cfg = NodeDataConfig(str(graph.root), features=tiered(), **KW)
    reader = FeatureReader.from_dataset(graph)
    presampled = [torch.arange(i * 300, i * 300 + 600) for i in range(4)]
    try:
        def plan(fill, limit):
            return plan_store(cfg, graph, reader, torch.device("cpu"), presampled, host_cache_fill=fill,
                              memory=limit, memory_reserve=0)[0]  # fmt: skip

        unlimited = MemoryLimit.none()
        setup, beside = plan("setup", unlimited).memory_fit, plan("background", unlimited).memory_fit
        assert beside.need > setup.need  # the ranking's temporaries overlap training
        assert plan("auto", unlimited).host_fill == "background"
        # room for the budgets with the ranking at set-up only: ranking beside training would shrink them
        between = MemoryLimit(setup.need + 256, "a test")
        assert plan("setup", between).memory_fit.shrunk == [] and plan("background", between).memory_fit.shrunk
        assert plan("auto", between).host_fill == "setup"
        # a limit that shrinks them either way: the first batches need not wait for the ranking as well
        tight = MemoryLimit(setup.need - 100 * graph.row_bytes, "a test")
        assert plan("setup", tight).memory_fit.shrunk
        auto = plan("auto", tight)
        assert auto.host_fill == "background" and auto.memory_fit.shrunk
    finally:
        reader.close()


def test_the_fill_waits_for_the_first_batch_or_its_time_limit_and_closes_while_waiting(graph):
    from lightning_ooc.store.host_cache import HostCache, HotSet

    ranked = threading.Event()

    def rank(check):
        ranked.set()
        return HotSet(torch.tensor([5, 9]), "presample", None)

    def fill(**kw):
        host = HostCache.empty(2, graph.num_features, graph.feature_dtype, graph.num_nodes)
        return background.BackgroundFill(host, rank, **kw).start()

    f = fill(wait_batches=3, wait_seconds=60)
    f.batch_done(), f.batch_done()
    assert not ranked.wait(0.3) and not f.done  # two batches of three trained: still waiting
    f.batch_done()
    assert f.wait(timeout=30) and ranked.is_set() and f.host.num_rows == 2 and f.waited < 30
    ranked.clear()
    f = fill(wait_batches=3, wait_seconds=0.2)  # no batch comes: it ranks once its time is up
    assert f.wait(timeout=30) and ranked.is_set() and f.waited >= 0.2
    ranked.clear()
    f = fill(wait_batches=3, wait_seconds=60)
    f.close()  # while it waits: stops at once, ranks nothing
    assert f.done and not ranked.is_set() and f.error is None


def test_the_ssd_tier_offers_every_row_it_reads_and_the_host_cache_keeps_only_those_it_expects(graph):
    from lightning_ooc.store.host_cache import HostCache
    from lightning_ooc.store.tiers import HostCacheTier

    store = TieredFeatureStore.create(graph, buffer_slots=256, staging_bytes=64 * graph.row_bytes)
    host = HostCache.empty(6, graph.num_features, graph.feature_dtype, graph.num_nodes)
    expected = torch.tensor([3, 40, 41, 900, 2000, 3999])
    host.expect(expected)
    store.tier("ssd").admit = host.admit
    store = store.inserted(HostCacheTier(host))  # the host cache first, as the factory chains it
    try:
        n_id = torch.tensor([41, 7, 3999, 40, 12])  # three expected rows, two others
        ext = store.extract(n_id)
        assert torch.equal(store.gather(ext), graph.read_features(n_id))
        store.release(ext)
        assert host.admitted_rows == 3 and host.fill_rows == 0
        assert host.lookup(expected).tolist() == [-1, 1, 2, -1, -1, 5]  # kept at their expected positions
        assert torch.equal(host.gather(torch.tensor([1, 2, 5])), graph.read_features(torch.tensor([40, 41, 3999])))
        ext = store.extract(torch.tensor([40, 3, 41]))  # two from the host cache; 3 read, and kept
        assert ext.stats.host_hits == 2 and host.admitted_rows == 4
        assert torch.equal(store.gather(ext), graph.read_features(torch.tensor([40, 3, 41])))
        store.release(ext)
        # an evaluation chain (no buffer) reads through the same SSD tier: its reads are offered too
        ev = store.without("buffer")
        ext = ev.extract(torch.tensor([900, 5, 3]))
        assert torch.equal(ev.gather(ext), graph.read_features(torch.tensor([900, 5, 3])))
        ev.release(ext)
        assert host.admitted_rows == 5 and host.lookup(torch.tensor([900])).tolist() == [3]
    finally:
        store.close()


def test_admitting_from_many_threads_keeps_each_row_once_and_right(graph):
    from lightning_ooc.store.host_cache import HostCache

    host = HostCache.empty(500, graph.num_features, graph.feature_dtype, graph.num_nodes)
    expected = torch.arange(0, 4000, 8)
    host.expect(expected)
    rows = graph.read_features(torch.arange(4000))
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randperm(4000, generator=gen)[:700] for _ in range(8)]  # overlapping reads of many threads
    kept = [0] * len(parts)

    def admit(i):
        for s in range(0, 700, 50):
            ids = parts[i][s : s + 50]
            kept[i] += host.admit(ids, rows[ids])

    threads = [threading.Thread(target=admit, args=(i,)) for i in range(len(parts))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    seen = torch.unique(torch.cat(parts))
    want = expected[torch.isin(expected, seen)]
    assert sum(kept) == host.admitted_rows == want.numel()  # each expected row kept once
    pos = host.lookup(want)
    assert bool((pos >= 0).all()) and torch.equal(host.gather(pos), rows[want])
    assert bool((host.lookup(expected[~torch.isin(expected, seen)]) == -1).all())
