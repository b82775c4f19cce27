"""MassiveGNN's scored cache policy, the row buffer, and the scored host cache (host_cache_policy="scored")."""
import threading

import numpy as np
import pytest
import torch

from lightning_ooc.store.policy import NoPolicy, RowBuffer, ScoredPolicy, StaticPolicy, make_policy
from lightning_ooc.testing import make_synthetic


# -- the policies -----------------------------------------------------------------------------------
def test_warm_start_is_top_degree_ties_by_lower_id():
    cand = np.array([50, 10, 40, 30, 20])  # unsorted: the degrees follow them
    deg = np.array([7, 3, 9, 7, 1])
    for name in ("static", "scored"):
        p = make_policy(name, cand, deg, capacity=3)
        assert p.initial().tolist() == [40, 30, 50]  # 9, then 7 twice: 30 before 50
        assert sorted(p.buffered().tolist()) == [30, 40, 50]
    assert make_policy("scored", 100, np.arange(100) % 7, capacity=2).initial().tolist() == [6, 13]
    warm = ScoredPolicy(100, np.zeros(100), 3, warm=np.array([5, 7, 5, 9, 11]))
    assert warm.initial().tolist() == [5, 7, 9]  # the given ranking, distinct, cut to the capacity


def test_none_holds_nothing_and_static_never_evicts():
    none = make_policy("none", np.arange(10), np.arange(10), capacity=5)
    assert isinstance(none, NoPolicy) and none.initial().size == 0 and none.buffered().size == 0
    static = make_policy("static", np.arange(10), np.arange(10), capacity=3, gamma=0.5, interval=1)
    assert isinstance(static, StaticPolicy)
    for p in (none, static):
        for _ in range(10):
            p.observe(np.array([0, 1, 2, 9]))
            assert not p.due()
        e, r = p.evict_and_replace()
        assert e.size == r.size == 0
    assert static.buffered().tolist() == [7, 8, 9]
    assert static.stats()["hit_rate"] == pytest.approx(0.25) and none.stats()["hits"] == 0
    with pytest.raises(ValueError, match="unknown cache policy"):
        make_policy("lru", np.arange(3), np.arange(3), 1)


def test_scored_evicts_a_row_unused_past_delta_for_the_most_missed():
    gamma, delta = 0.9, 4
    p = make_policy("scored", np.arange(10), np.arange(10), capacity=3, gamma=gamma, interval=delta)
    assert p.initial().tolist() == [9, 8, 7]
    batches = [[9, 8, 2, 3], [9, 8, 2], [9, 8, 2, 3], [9, 8, 2]]
    for b in batches:
        p.observe(np.array(b))
    assert p.due()
    # 7 went unused for exactly Delta minibatches: S_E == alpha, not below it: it stays
    e, r = p.evict_and_replace()
    assert e.size == r.size == 0 and not p.due()
    for b in batches:
        p.observe(np.array(b))
    ids, se = p.eviction_scores()
    assert dict(zip(ids.tolist(), se.tolist()))[7] == pytest.approx(gamma**8)
    e, r = p.evict_and_replace()
    assert e.tolist() == [7] and r.tolist() == [2]  # 2 missed 8 times, 3 only 4 times
    # the swap: 7's access score is its last eviction score, 2's eviction score its last access score
    assert p.access_scores([7, 2, 3]).tolist() == pytest.approx([gamma**8, -1.0, 4.0])
    assert dict(zip(*[a.tolist() for a in p.eviction_scores()]))[2] == pytest.approx(8.0)
    s = p.stats()
    assert (s["rounds"], s["evicted"], s["replaced"], s["buffered"]) == (2, 1, 1, 3)


def test_scored_keeps_the_buffer_full_and_respects_keep():
    p = ScoredPolicy(np.arange(20), np.arange(20), 4, gamma=0.5, interval=2)  # holds 19..16
    for _ in range(3):
        p.observe(np.array([0]))  # every buffered row unused (past Delta); only node 0 missed
    e, r = p.evict_and_replace()
    assert len(e) == len(r) == 1 and r.tolist() == [0]
    assert e.tolist() == [16]  # four rows below alpha, one replacement: the lowest degree goes
    assert len(p.buffered()) == 4
    for _ in range(2):
        p.observe(np.array([1, 2, 0]))
    e, r = p.evict_and_replace(keep=np.array([17, 18]))  # rows still read by a batch stay this round
    assert sorted(e.tolist()) == [19] and r.tolist() == [2]  # ties of S_A: the higher degree replaces
    assert 17 in p.buffered() and 18 in p.buffered()
    p.revert()  # the replacement could not be fetched: as if the round had not evicted it
    assert 19 in p.buffered() and 2 not in p.buffered()
    assert p.access_scores([19, 2]).tolist() == [-1.0, 2.0]


class _Literal:
    """MassiveGNN's Algorithm 2 as written: every unused buffered node decays on every minibatch."""

    def __init__(self, cand, deg, cap, gamma, delta):
        self.deg, self.gamma, self.delta = dict(zip(cand, deg)), gamma, delta
        warm = sorted(cand, key=lambda n: (-self.deg[n], n))[:cap]
        self.se = {n: 1.0 for n in warm}
        self.sa = {n: 0.0 for n in cand}
        for n in warm:
            self.sa[n] = -1.0
        self.steps = 0

    def observe(self, ids):
        ids = set(ids.tolist())
        for n in self.se:
            if n not in ids:
                self.se[n] *= self.gamma
        for n in ids:
            if n not in self.se:
                self.sa[n] += 1
        self.steps += 1

    def round(self, keep=()):
        self.steps = 0
        alpha = self.gamma**self.delta
        below = [n for n, v in self.se.items() if v < alpha * (1 - 1e-9) and n not in keep]
        pool = sorted((n for n, v in self.sa.items() if v >= 1 and n not in self.se),
                      key=lambda n: (-self.sa[n], -self.deg[n], n))[: len(below)]
        below = sorted(below, key=lambda n: (self.se[n], self.deg[n]))[: len(pool)]
        for ev, rep in zip(below, pool):
            self.sa[ev], self.se[rep] = self.se.pop(ev), self.sa[rep]
            self.sa[rep] = -1.0
        return below, pool


def test_lazy_decay_equals_literal_per_step_decay():
    rng = np.random.default_rng(7)
    n, cap, gamma, delta = 300, 40, 0.9, 5
    cand = np.sort(rng.choice(10_000, n, replace=False))
    deg = rng.integers(0, 6, n)  # many ties
    lazy = ScoredPolicy(cand, deg, cap, gamma=gamma, interval=delta)
    lit = _Literal(cand.tolist(), deg.tolist(), cap, gamma, delta)
    evicted = 0
    for step in range(400):
        hot = cand[(step // 40) * 20 % n: (step // 40) * 20 % n + 60]  # a drifting working set
        ids = np.unique(np.concatenate([rng.choice(hot, 25), rng.choice(cand, 5)]))
        lazy.observe(ids)
        lit.observe(ids)
        if lazy.due():
            keep = rng.choice(cand, 3) if step % 3 == 0 else None
            e, r = lazy.evict_and_replace(keep=keep)
            le, lr = lit.round(() if keep is None else set(keep.tolist()))
            assert sorted(e.tolist()) == sorted(le) and r.tolist() == lr
            evicted += len(e)
            ids_, se = lazy.eviction_scores()
            assert ids_.tolist() == sorted(lit.se)
            np.testing.assert_allclose(se, [lit.se[i] for i in ids_.tolist()], rtol=1e-6)  # S_A is float32
            np.testing.assert_allclose(lazy.access_scores(cand), [lit.sa[i] for i in cand.tolist()], rtol=1e-6)
    assert evicted > 20  # the trace exercised eviction


def _drift_hit_rate(name, seed=0):
    """Hit rate over a working set that drifts across "epochs" (degree only loosely tracks it)."""
    rng = np.random.default_rng(seed)
    n, cap, window, batch = 4000, 400, 400, 120
    deg = rng.integers(0, 50, n)
    p = make_policy(name, n, deg, capacity=cap, gamma=0.95, interval=16)
    for epoch in range(12):
        lo = epoch * 100  # the working set moves gradually: a quarter of it per epoch
        for _ in range(60):
            ids = np.unique(np.concatenate([rng.integers(lo, lo + window, batch), rng.integers(0, n, 10)]))
            p.observe(ids)
            if p.due():
                p.evict_and_replace()
    return p.stats()["hit_rate"]


def test_scored_follows_a_drifting_working_set_better_than_static():
    # seeds 0-4 gave static 0.08-0.11, scored 0.67 (gamma 0.95, Delta 16). Section 3.5's trade-off shows too:
    # with low decay (gamma 0.99) over this fast drift, rows once missed often stay long after the working set
    # moved on, and scored fell to 0.08-0.28
    rates = {name: _drift_hit_rate(name) for name in ("none", "static", "scored")}
    print(rates)
    assert rates["none"] == 0.0
    assert rates["scored"] > rates["static"] + 0.3, rates


# -- the row buffer ------------------------------------------------------------------------------
@pytest.mark.parametrize("candidates", [1000, None])
def test_row_buffer_never_serves_a_row_of_another_id(candidates):
    cap, n = 48, 1000
    buf = RowBuffer(cap, 4, torch.float32, candidates=candidates)
    start = np.arange(cap, dtype=np.int64)
    buf.install(start, torch.from_numpy(start).float()[:, None].expand(-1, 4).contiguous())
    assert len(buf) == cap
    stop = threading.Event()
    errors, served = [], [0]

    def installer():
        rng = np.random.default_rng(1)
        held = set(start.tolist())
        while not stop.is_set():
            out = rng.choice(sorted(held), 8, replace=False)
            new = rng.choice(sorted(set(range(n)) - held), 8, replace=False)
            buf.install(new, torch.from_numpy(new).float()[:, None].expand(-1, 4).contiguous(), out)
            held = (held - set(out.tolist())) | set(new.tolist())

    def reader(seed):
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                ids = torch.from_numpy(rng.choice(n, 200, replace=False))
                hit, rows = buf.lookup_rows(ids)
                assert torch.equal(rows, ids[hit].float()[:, None].expand(-1, 4))
                with buf.lock:
                    hit2, slots = buf.lookup(ids)
                    rows2 = buf.copy_rows(slots)
                assert torch.equal(rows2, ids[hit2].float()[:, None].expand(-1, 4))
                served[0] += int(hit.sum())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=installer)] + [threading.Thread(target=reader, args=(s,)) for s in (2, 3)]
    for t in threads:
        t.start()
    stop.wait(0.8)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert served[0] > 0 and len(buf) == cap
    with buf.lock:
        hit, _ = buf.lookup(torch.arange(n))
    absent = int(np.flatnonzero(~np.asarray(hit))[-1])  # an id the buffer does not hold now, within the candidates
    with pytest.raises(ValueError, match="not buffered"):
        buf.install(np.array([n + 5 if candidates is None else absent]), torch.zeros(1, 4), np.array([-3]))


# -- the scored host cache ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("scored") / "g", num_nodes=1500, avg_degree=6, num_features=12)


def _scored_store(ds, warm, gamma=0.8, interval=3, buffer_slots=400):
    from lightning_ooc.io import FeatureReader
    from lightning_ooc.store.feature_buffer import FeatureBuffer
    from lightning_ooc.store.host_cache import HostCache
    from lightning_ooc.store.scored_cache import ScoredHostCacheTier, ScoredStore
    from lightning_ooc.store.staging import StagingBuffer
    from lightning_ooc.store.tiers import BufferTier, ReaderTier

    reader = FeatureReader.from_dataset(ds)
    host = HostCache.load(reader, warm, ds.num_nodes, progress=False)
    tier = ScoredHostCacheTier(host, reader, ds.in_degree, gamma=gamma, interval=interval)
    disk = ReaderTier(reader, StagingBuffer(64 * ds.row_bytes * 4, ds.num_features, ds.feature_dtype, chunk_rows=64))
    buffer = BufferTier(FeatureBuffer(buffer_slots, ds.num_nodes, ds.num_features, ds.feature_dtype), disk)
    return ScoredStore([tier, buffer], ds.num_features, ds.feature_dtype), tier


def _host_rows_match(tier, ds):
    host = tier.host
    slots = torch.nonzero(host.ids >= 0).flatten()
    ids = host.ids[slots]
    assert torch.equal(host.map[ids].long(), slots)
    assert torch.equal(host.rows[slots], ds.read_features(ids))


def test_scored_host_cache_serves_exact_rows_across_rounds(small):
    ds = small
    store, tier = _scored_store(ds, torch.arange(100))
    rng = np.random.default_rng(0)
    errors = []

    def worker(seed, batches):
        g = np.random.default_rng(seed)
        try:
            for k in range(batches):
                lo = (k // 10) * 60 % (ds.num_nodes - 300)  # drifting
                n_id = torch.from_numpy(np.unique(g.integers(lo, lo + 300, 80)))
                ext = store.extract(n_id)
                x = store.gather(ext)
                assert torch.equal(x, ds.read_features(n_id))
                store.release(ext)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s, 120)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    s = tier.stats()
    assert s["rounds"] >= 50 and s["replaced"] > 50 and s["evicted"] == s["replaced"] and s["buffered"] == 100
    assert int(tier.refs.sum()) == 0
    _host_rows_match(tier, ds)
    # evaluation reads the same rows without touching the scores
    ev = store.without("buffer")
    assert [t.name for t in ev.tiers] == ["host_cache", "ssd"] and ev.tiers[0] is tier.frozen()
    before = tier.stats()
    for _ in range(10):
        n_id = torch.from_numpy(np.unique(rng.integers(0, ds.num_nodes, 200)))
        ext = ev.extract(n_id)
        assert torch.equal(ev.gather(ext), ds.read_features(n_id))
        assert ext.stats.host_hits > 0
        ev.release(ext)
    after = tier.stats()
    assert after == before
    epoch = tier.take_stats()
    assert epoch["replaced"] == s["replaced"] and 0 < epoch["hit_rate"] < 1
    assert tier.take_stats()["rounds"] == 0
    store.close()


def test_a_referenced_row_is_never_replaced(small):
    ds = small
    store, tier = _scored_store(ds, torch.arange(50), gamma=0.5, interval=2)
    held = store.extract(torch.arange(0, 10))  # rows 0..9 from the host cache, not released
    assert held.leases[0].stats.host_hits == 10
    for k in range(20):  # rows 0..49 unused: all fall below the threshold; misses pile up
        n_id = torch.arange(500 + 20 * k, 540 + 20 * k)
        ext = store.extract(n_id)
        store.release(ext)
    assert tier.stats()["replaced"] >= 40
    assert torch.equal(tier.host.map[:10].long() >= 0, torch.ones(10, dtype=torch.bool))  # still cached
    assert torch.equal(store.gather(held), ds.read_features(torch.arange(10)))
    assert tier.stats()["skipped_referenced"] > 0
    store.release(held)
    for k in range(4):
        store.release(store.extract(torch.arange(900 + 20 * k, 940 + 20 * k)))
    assert int((tier.host.map[:10] >= 0).sum()) == 0  # released: evicted at the next rounds
    _host_rows_match(tier, ds)
    store.close()


def test_a_failed_replacement_read_keeps_the_evicted_rows(small):
    ds = small
    store, tier = _scored_store(ds, torch.arange(30), gamma=0.5, interval=2)

    class Boom(RuntimeError):
        pass

    real = tier.reader

    class Failing:
        row_bytes = real.row_bytes

        def gather(self, ids, out=None):
            raise Boom("disk gone")

    tier.reader = Failing()
    n_id = torch.arange(700, 740)
    for _ in range(3):  # a round after 2 minibatches: rows unused exactly Delta times stay
        store.release(store.extract(n_id))
    with pytest.raises(Boom):
        store.extract(n_id)  # the fourth minibatch's fill runs the round that evicts
    assert tier.stats()["replaced"] == 0 and tier.stats()["failed_rounds"] == 1
    assert int((tier.host.map[:30] >= 0).sum()) == 30 and int(tier.refs.sum()) == 0
    assert set(tier.policy.buffered().tolist()) == set(range(30))
    tier.reader = real
    for _ in range(2):
        store.release(store.extract(n_id))
    assert tier.stats()["replaced"] == 30
    _host_rows_match(tier, ds)
    store.close()


def test_build_store_makes_a_scored_host_cache(small):
    from lightning_ooc import Tiered
    from lightning_ooc.io import FeatureReader
    from lightning_ooc.loader.config import NodeDataConfig
    from lightning_ooc.store.factory import build_store
    from lightning_ooc.store.planner import plan_store
    from lightning_ooc.store.scored_cache import ScoredHostCacheTier, ScoredStore

    tiers = Tiered(gpu_cache="256KiB", host_cache="4KiB", staging="64KiB", host_cache_policy="scored",
                   cache_decay=0.9, cache_interval=7)  # fmt: skip
    cfg = NodeDataConfig(str(small.root), batch_size=20, num_neighbors=[3], features=tiers, progress=False)
    reader = FeatureReader.from_dataset(small)
    presampled = [torch.arange(40), torch.arange(30, 80)]
    plan, hot = plan_store(cfg, small, reader, torch.device("cpu"), presampled)
    assert hot.scored == (0.9, 7) and plan.host_policy == "presample"
    store = build_store(plan, hot, small, reader, torch.device("cpu"), progress=False)
    tier = store.tiers[0]
    assert isinstance(store, ScoredStore) and isinstance(tier, ScoredHostCacheTier)
    assert tier.policy.gamma == 0.9 and tier.policy.interval == 7
    assert sorted(tier.host.ids.tolist()) == sorted(hot.ids.tolist())
    store.close()


def test_training_with_a_scored_host_cache(tmp_path):
    import csv

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_ooc import OutOfCoreNodeData, Tiered
    from lightning_ooc.models import GraphSAGE
    from lightning_ooc.store.scored_cache import ScoredHostCacheTier

    ds = make_synthetic(tmp_path / "g", num_nodes=2000, avg_degree=6, num_features=8, train_frac=0.3, val_frac=0.05)
    tiers = Tiered(gpu_cache="2MiB", host_cache="8KiB", staging="1MiB", host_cache_policy="scored",
                   presample_batches=4, cache_interval=4)  # fmt: skip
    dm = OutOfCoreNodeData(str(ds.root), batch_size=32, num_neighbors=[4, 3], features=tiers,
                           pipeline={"num_samplers": 1, "num_extractors": 2}, progress=False)  # fmt: skip
    assert dm.config.features.cache_interval == 4 and dm.config.features.host_cache_policy == "scored"

    L.seed_everything(0, workers=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=CSVLogger(tmp_path),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=3)  # fmt: skip
    model = GraphSAGE(ds.num_features, ds.num_classes, hidden_channels=8, num_layers=2)
    tier = None

    class Keep(L.Callback):
        def on_train_end(self, trainer, pl_module):
            nonlocal tier
            tier = trainer.datamodule.store.tiers[0]

    trainer.callbacks.append(Keep())
    trainer.fit(model, datamodule=dm)
    assert isinstance(tier, ScoredHostCacheTier)
    # every training batch observed once, evaluation never; a round every 4. The first epoch also saw the
    # batch or two extracted by the run Lightning starts (and drops) to check that the loader iterates
    n = trainer.num_training_batches
    total = tier.stats()
    assert n >= 16 and 2 * n <= total["batches"] <= 2 * n + 4, total
    rows = list(csv.DictReader(open(trainer.logger.experiment.metrics_file_path)))
    rounds = [float(r["ooc/train_host_cache_eviction_rounds"]) for r in rows
              if r.get("ooc/train_host_cache_eviction_rounds")]  # fmt: skip
    replaced = [float(r["ooc/train_host_cache_replaced_rows"]) for r in rows
                if r.get("ooc/train_host_cache_replaced_rows")]  # fmt: skip
    assert len(rounds) == 2 and min(rounds) >= 4 and sum(replaced) > 0  # logged per epoch
    assert sum(rounds) == total["rounds"]
    hit = [float(r["ooc/train_host_cache_hit_rate"]) for r in rows if r.get("ooc/train_host_cache_hit_rate")]
    assert len(hit) == 2 and all(0 < h < 1 for h in hit)


# -- thresholds, late rounds and the pool of replacements ------------------------------------------------
def test_a_long_interval_and_a_strong_decay_still_evict():
    p = ScoredPolicy(np.arange(10), np.arange(10), 2, gamma=0.5, interval=1100)  # holds 9 and 8
    assert p.alpha == 0.0  # 0.5 ** 1100 underflows: the threshold is compared in logarithms
    for _ in range(1100):
        p.observe(np.array([9, 0]))
    assert p.due()
    e, r = p.evict_and_replace()
    assert e.size == 0 and r.size == 0  # 8 went unused on exactly Delta minibatches: it stays
    for _ in range(1100):
        p.observe(np.array([9, 0]))
    e, r = p.evict_and_replace()
    assert e.tolist() == [8] and r.tolist() == [0]


def test_a_round_that_ran_late_lets_the_next_come_on_time():
    p = ScoredPolicy(np.arange(10), np.arange(10), 2, gamma=0.9, interval=4)
    for _ in range(6):  # due after 4; run after 6 (another round was still installing its rows)
        p.observe(np.array([0]))
    p.evict_and_replace()
    p.observe(np.array([0]))
    assert not p.due()
    p.observe(np.array([0]))
    assert p.due()  # 8 minibatches, 2 rounds, as if neither had been late


def test_the_missed_ids_are_folded_into_the_pool_as_they_come(monkeypatch):
    import lightning_ooc.store.policy as policy

    monkeypatch.setattr(policy, "_POOL_FOLD_MIN", 50)
    rng = np.random.default_rng(3)
    batches = [rng.choice(np.arange(1000), 40, replace=False) for _ in range(300)]
    folded = ScoredPolicy(1000, np.arange(1000) % 13, 50, gamma=0.99, interval=1000)
    held = []
    for b in batches:
        folded.observe(b)
        held.append(sum(a.size for a in folded._pending) - max(50, folded._pool.size))
    # never more than the pool (or the minimum) and one minibatch: folded as they come, however long the interval
    assert max(held) <= 40 and folded._pool.size > 50
    monkeypatch.setattr(policy, "_POOL_FOLD_MIN", 1 << 30)
    reference = ScoredPolicy(1000, np.arange(1000) % 13, 50, gamma=0.99, interval=1000)
    for b in batches:
        reference.observe(b)
    for _ in range(1000 - len(batches)):
        folded.observe(np.array([1]))
        reference.observe(np.array([1]))
    assert folded.due() and reference.due()
    assert [a.tolist() for a in folded.evict_and_replace()] == [a.tolist() for a in reference.evict_and_replace()]


# -- the remote tier: a round's replacements with the misses ----------------------------------------------
class _Exchange:
    """Rows whose every value is their id; records each fetch, fails on demand."""

    num_features, dtype, row_bytes = 4, torch.float32, 16

    def __init__(self):
        self.calls: list[list[int]] = []
        self.fail = False

    def fetch(self, ids, cancel=None):
        self.calls.append(ids.tolist())
        if self.fail:
            raise RuntimeError("the owner is gone")
        return ids.to(torch.float32)[:, None].expand(-1, 4).contiguous()


def _remote_tier(capacity: int, interval: int = 2):
    """Machine 0 owns nodes 0-9, machine 1 nodes 10-19 (degree: the id's order); a warm-started buffer."""
    from lightning_ooc.partitioned.remote import RemoteTier

    cand = np.arange(10, 20)
    policy = make_policy("scored", cand, np.arange(10), capacity, gamma=0.5, interval=interval)
    ex = _Exchange()
    tier = RemoteTier(ex, torch.tensor([0] * 10 + [1] * 10, dtype=torch.int32), 0, policy,
                      RowBuffer(capacity, 4, torch.float32, candidates=cand))  # fmt: skip
    tier.warm_start()
    ex.calls.clear()
    return tier, ex


def _fill(tier, ids):
    lease = tier.claim(torch.tensor(ids))
    tier.fill(lease)
    remote = [i for i in ids if i >= 10]
    assert lease.handle.rows[:, 0].tolist() == [float(i) for i in remote]  # every row its own
    return lease


def test_a_round_with_nothing_to_evict_and_no_miss_fetches_nothing():
    tier, ex = _remote_tier(capacity=10)  # every remote row is buffered
    for _ in range(5):
        lease = _fill(tier, [1, 19, 18])
        assert lease.stats.remote_hits == 2 and lease.stats.remote_fetched == 0
    _fill(tier, [1, 2])  # no remote id at all: the minibatch still counts
    assert ex.calls == []
    s = tier.policy.stats()
    assert s["batches"] == 6 and s["rounds"] == 3 and s["evicted"] == 0


def test_replacements_travel_in_the_same_fetch_as_the_misses():
    tier, ex = _remote_tier(capacity=3)  # holds 19, 18, 17
    _fill(tier, [19, 12, 13])
    _fill(tier, [19, 12, 13])  # round: 18 and 17 unused on exactly Delta minibatches stay
    _fill(tier, [19, 12, 14])
    lease = _fill(tier, [19, 12, 14])  # round: 18 and 17 leave for 12 (missed 4 times) and 14 (higher degree)
    assert ex.calls[-1] == [12, 14] and len(ex.calls) == 4  # the misses and the replacements: one fetch
    assert lease.stats.remote_replaced == 2 and lease.stats.remote_fetched == 2
    assert sorted(tier.policy.buffered().tolist()) == [12, 14, 19]
    lease = _fill(tier, [14, 12, 19])
    assert len(ex.calls) == 4 and lease.stats.remote_hits == 3  # installed in the evicted rows' slots


def test_a_failed_fetch_of_a_round_keeps_the_evicted_rows():
    tier, ex = _remote_tier(capacity=3)
    for ids in ([19, 12, 13], [19, 12, 13], [19, 12, 14]):
        _fill(tier, ids)
    ex.fail = True
    with pytest.raises(RuntimeError, match="owner is gone"):
        _fill(tier, [19, 12, 14])
    assert sorted(tier.policy.buffered().tolist()) == [17, 18, 19]
    ex.fail = False
    lease = _fill(tier, [17, 18, 19, 11])  # the evicted rows are still there, and served
    assert lease.stats.remote_hits == 3 and ex.calls[-1] == [11]
