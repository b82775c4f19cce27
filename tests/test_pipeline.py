"""The asynchronous pipeline and OutOfCoreNodeData without a Trainer: exact rows, every seed once, failures."""
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from lightning_ooc import OutOfCoreNodeData, Tiered
from lightning_ooc.io import FeatureReadError
from lightning_ooc.testing import make_synthetic


def _ooc_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ooc-")]


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    # dim 100 float32: 400-byte rows straddle sectors
    return make_synthetic(tmp_path_factory.mktemp("p") / "g", num_nodes=20000, avg_degree=8, num_features=100,
                          num_classes=5, train_frac=0.1)  # fmt: skip


def _tiny_dm(root, tiered=None, pipeline=None, **kw):
    """A small datamodule: ``tiered`` and ``pipeline`` change the feature backend's and the pipeline's settings."""
    tiers = dict(gpu_cache=0, host_cache="40KiB", staging="64KiB", presample_batches=4)
    features = Tiered(**{**tiers, **(tiered or {})})
    pipeline = {**dict(num_extractors=3, num_samplers=2, train_queue_size=2), **(pipeline or {})}
    opts = dict(batch_size=64, num_neighbors=[4, 3], progress=False, features=features, pipeline=pipeline)
    return OutOfCoreNodeData(root, **{**opts, **kw})


def _with_gpu_cache(dm, gpu_cache):
    """The datamodule rebuilt from its hyperparameters with another ``gpu_cache``."""
    features = Tiered(**{**dm.config.features.settings(), "gpu_cache": gpu_cache})
    return OutOfCoreNodeData(**{**dm.hparams, "features": features})


def _smallest_buffer(dm):
    """Set gpu_cache to exactly the reserve the plan asks for (forces eviction and reuse)."""
    from lightning_ooc.store.planner import StorePlan

    try:
        dm.setup()
    except ValueError as e:
        assert "set features.gpu_cache to at least" in str(e)
    # read the reserve from a plan with a huge budget, then rebuild with just that
    probe = _with_gpu_cache(dm, "1GiB")
    probe.setup()
    reserve = probe.plan.buffer_reserve
    probe.teardown()
    dm = _with_gpu_cache(dm, reserve * probe.dataset.row_bytes)
    dm.setup()
    assert isinstance(dm.plan, StorePlan) and dm.plan.buffer_slots == reserve
    return dm


@pytest.mark.parametrize("order", ["out_of_order", "in_order"])
def test_epoch_rows_exact_and_every_seed_once(graph, order):
    dm = _smallest_buffer(_tiny_dm(graph.root, pipeline={"order": order}))
    ref = graph.features_memmap()
    for epoch in range(2):
        seen = []
        for batch in dm.train_dataloader():
            want = torch.from_numpy(np.ascontiguousarray(ref[batch.n_id.numpy()]))
            assert batch.x.dtype == graph.feature_dtype
            assert batch.x.numpy().tobytes() == want.numpy().tobytes()
            seen.append(batch.n_id[: batch.batch_size])
            assert torch.equal(batch.y, torch.from_numpy(np.asarray(graph.labels)[batch.n_id.numpy()]))
        seeds = torch.cat(seen)
        assert seeds.numel() == len(graph.split("train"))
        assert torch.equal(torch.sort(seeds).values, torch.sort(graph.split("train")).values)
        dm._epoch = epoch + 1
    buf = dm.store.tier("buffer").buffer
    assert buf.evictions > 0 and buf.hits > 0  # rows were evicted and reused
    buf.check_invariants()
    assert int(buf.refcount.sum()) == 0  # every slot released
    stats = dm.last_stats["train"]
    assert stats.io.host_hits > 0 and stats.io.misses > 0 and stats.io.bytes_read >= stats.io.bytes_requested
    dm.teardown()
    assert not _ooc_threads()


def test_in_order_is_reproducible(graph):
    runs = []
    for _ in range(2):
        dm = _tiny_dm(graph.root, {"gpu_cache": "4MiB"}, {"order": "in_order"}, seed=3)
        dm.setup()
        runs.append([(b.n_id.clone(), b.edge_index.clone(), b.x.clone()) for b in dm.train_dataloader()])
        dm.teardown()
    assert len(runs[0]) == len(runs[1])
    for (n1, e1, x1), (n2, e2, x2) in zip(*runs):
        assert torch.equal(n1, n2) and torch.equal(e1, e2) and torch.equal(x1, x2)


def test_out_of_order_delivers_in_completion_order(graph):
    """With a slow first batch, later batches are delivered before it."""
    dm = _tiny_dm(graph.root, {"gpu_cache": "4MiB"}, {"num_samplers": 2, "num_extractors": 3})
    dm.setup()
    original = dm.store.fill
    others_done = threading.Event()

    def slow_first(ext, *a, **k):
        filled = original(ext, *a, **k)
        # batch 0 is held after its rows are valid (a later batch sharing rows it claimed first must not wait on
        # it), until a later batch was handed to the trainer
        if ext.n_id[0] == first_seed:
            assert others_done.wait(60), "no later batch overtook the held first one"
        return filled

    first_seed = int(dm._batches("train", 0)[0][0])
    dm.store.fill = slow_first
    order = []
    for b in dm.train_dataloader():
        order.append(int(b.batch_index))
        others_done.set()
    assert sorted(order) == list(range(len(order))) and order[0] != 0
    dm.teardown()


def _expect_failure(dm, exc_type, match):
    t0 = time.monotonic()
    with pytest.raises(exc_type, match=match):
        for _ in dm.train_dataloader():
            pass
    assert time.monotonic() - t0 < 60  # a bound against hangs, not a speed check
    # the failed run closed itself: its threads are joined by the time the error reaches the caller
    assert not _ooc_threads(), _ooc_threads()


def test_sampler_exception_reaches_the_trainer(graph):
    dm = _tiny_dm(graph.root, {"gpu_cache": "4MiB"})
    dm.setup()
    real = dm.sampler.sample
    calls = []

    def boom(seeds, seed=None, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise ZeroDivisionError("sampler blew up")
        return real(seeds, seed=seed, **kw)

    dm.sampler.sample = boom
    _expect_failure(dm, ZeroDivisionError, "sampler blew up")


def test_extractor_exception_reaches_the_trainer(graph):
    dm = _tiny_dm(graph.root, {"gpu_cache": "4MiB"})
    dm.setup()
    real = dm.store.fill
    calls = []

    def boom(ext, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("extractor blew up")
        return real(ext, *a, **k)

    dm.store.fill = boom
    _expect_failure(dm, KeyError, "extractor blew up")


def test_reader_error_reaches_the_trainer(tmp_path):
    ds = make_synthetic(tmp_path / "g", num_nodes=4000, num_features=32, train_frac=0.5)
    dm = _tiny_dm(ds.root, {"gpu_cache": "4MiB", "host_cache": 0, "io_backend": "pread"})
    dm.setup()
    # the file shrinks under the open reader: reads past the new end come back short
    with open(ds.features_path, "r+b") as f:
        f.truncate(ds.row_bytes * 10)
    _expect_failure(dm, FeatureReadError, "features.bin")


def test_resume_mid_epoch_continues_the_epoch(graph):
    dm = _tiny_dm(graph.root, {"gpu_cache": "4MiB"}, {"order": "out_of_order"})
    dm.setup()
    it = iter(dm.train_dataloader())
    first = [next(it) for _ in range(5)]
    state = dm.state_dict()
    assert sorted(state["trained"]) == sorted(int(b.batch_index) for b in first)
    dm.teardown()
    dm2 = _tiny_dm(graph.root, {"gpu_cache": "4MiB"}, {"order": "out_of_order"})
    dm2.load_state_dict(state)
    dm2.setup()
    rest = list(dm2.train_dataloader())
    seeds = torch.cat([b.n_id[: b.batch_size] for b in first + rest])
    assert len(rest) == len(dm2._batches("train", 0)) - 5
    assert torch.equal(torch.sort(seeds).values, torch.sort(graph.split("train")).values)
    dm2.teardown()


def test_too_small_gpu_cache_is_a_clear_error(graph):
    dm = _tiny_dm(graph.root, {"gpu_cache": "16KiB"})
    with pytest.raises(ValueError, match=r"gpu_cache=16.00 KiB holds 40 rows .* set features.gpu_cache to at least"):
        dm.setup()


@pytest.mark.parametrize("drop_last", [False, True])
@given(n=st.integers(0, 3000), world=st.integers(1, 5), bs=st.integers(1, 700))
@settings(max_examples=300, deadline=None)
def test_rank_batches_are_disjoint_cover_the_seeds_and_have_equal_counts(drop_last, n, world, bs):
    from lightning_ooc.loader.batches import rank_batches

    seeds = torch.randperm(n)
    try:
        per_rank = [rank_batches(seeds, r, world, bs, drop_last=drop_last) for r in range(world)]
    except ValueError as e:  # only when there are fewer seeds than batches to fill
        assert "non-empty batches" in str(e) and (bs == 1 or n < world)
        return
    assert len({len(b) for b in per_rank}) == 1  # every rank runs the same number of batches
    flat = torch.cat([x for b in per_rank for x in b] + [torch.empty(0, dtype=torch.long)])
    assert flat.unique().numel() == flat.numel()  # disjoint
    assert all(0 < x.numel() <= bs for b in per_rank for x in b)
    if drop_last:
        assert n - flat.numel() < world * bs
    else:
        assert sorted(flat.tolist()) == sorted(seeds.tolist())  # cover the split

def test_batch_count_is_what_rank_batches_cuts_and_positions_batch_like_their_tensor():
    """Link splits hand SeedBatches a count of positions: counted without cutting, shuffled without an arange."""
    import itertools

    from lightning_ooc.loader.batches import SeedBatches, batch_count, rank_batches

    checked = 0
    for n, w, bs, d in itertools.product([0, 1, 5, 7, 100, 2001], [1, 2, 3], [1, 3, 7, 1000], [False, True]):
        try:
            counts = [len(rank_batches(torch.arange(n), r, w, bs, d)) for r in range(w)]
        except ValueError:  # too few seeds for the ranks: counting says so as early as cutting
            with pytest.raises(ValueError, match="non-empty batches"):
                batch_count(n, w, bs, d)
            continue
        assert batch_count(n, w, bs, d) == counts[0], (n, w, bs, d)
        by_count = SeedBatches(lambda s: n, batch_size=bs, eval_batch_size=bs, drop_last=d, world=w)
        assert by_count.count("train") == len(by_count.epoch("train", 2)) == counts[0]
        checked += 1
    assert checked > 100
    sb = SeedBatches(lambda s: 10, batch_size=4, eval_batch_size=3, seed=1)
    train = sb.epoch("train", 0)
    assert all(b.dtype == torch.int32 for b in train) and sorted(train.cat().tolist()) == list(range(10))
    assert [b.tolist() for b in sb.epoch("val", 0)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert train.cat().tolist() != list(range(10))  # shuffled
    assert torch.equal(sb.epoch("train", 0).cat(), train.cat())  # reproducibly
