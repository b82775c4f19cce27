"""One pass, one run: a pass's failure or close touches nothing outside it, and no shape of pipeline hangs.

Each test here failed on the code before runs owned their cancel token, channels and leases
(a failed pass closed the feature buffer every pass shares; the producer mixed the batches of
live passes; in order a large batch could deadlock; close() gave up on blocked threads).
"""
import threading

import lightning as L
import numpy as np
import pytest
import torch

from lightning_ooc import Mapped, OutOfCoreNodeData, Tiered
from lightning_ooc.errors import InputError
from lightning_ooc.models import GraphSAGE
from lightning_ooc.store.tiers import ReaderTier
from lightning_ooc.strategy import OutOfCoreStrategy
from lightning_ooc.testing import make_synthetic

HANG_BOUND = 120  # seconds: a bound against hangs, never a speed check


def _ooc_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ooc-")]


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("runs") / "g", num_nodes=6000, avg_degree=8, num_features=24,
                          num_classes=4, train_frac=0.3, val_frac=0.1)  # fmt: skip


def _dm(root, tiered=None, pipeline=None, **kw):
    """A small datamodule: ``tiered`` and ``pipeline`` change the feature backend's and the pipeline's settings."""
    tiers = dict(gpu_cache="2MiB", host_cache="8KiB", staging="64KiB", presample_batches=4)
    features = Tiered(**{**tiers, **(tiered or {})})
    pipeline = {**dict(num_extractors=2, num_samplers=2, train_queue_size=2), **(pipeline or {})}
    opts = dict(batch_size=64, num_neighbors=[4, 3], progress=False, features=features, pipeline=pipeline)
    return OutOfCoreNodeData(str(root), **{**opts, **kw})


def _check_epoch(graph, batches):
    """Every training seed exactly once, and every row byte-equal to the file."""
    ref = graph.features_memmap()
    seeds = torch.cat([b.n_id[: b.batch_size] for b in batches])
    assert torch.equal(torch.sort(seeds).values, torch.sort(graph.split("train")).values)
    for b in batches:
        assert b.x.numpy().tobytes() == np.ascontiguousarray(ref[b.n_id.numpy()]).tobytes()


def _in_thread(fn):
    """Run ``fn`` in a thread; its result, or the exception it raised. Fails (not hangs) past HANG_BOUND."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(HANG_BOUND)
    assert not t.is_alive(), f"hung for {HANG_BOUND} s"
    return out


# -- 2. a failed pass ends only its own run -------------------------------------------------------------
def test_a_failed_pass_leaves_the_store_usable_for_the_next(graph):
    dm = _dm(graph.root)
    dm.setup()
    real = dm.sampler.sample
    calls = []

    def flaky(seeds, seed=None, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise ZeroDivisionError("sampler blew up once")
        return real(seeds, seed=seed, **kw)

    dm.sampler.sample = flaky
    with pytest.raises(ZeroDivisionError, match="blew up once"):
        list(dm.train_dataloader())
    assert not _ooc_threads()
    buffer = dm.store.tier("buffer").buffer
    buffer.check_invariants()
    assert int(buffer.refcount.sum()) == 0  # the failed run gave back every slot it held
    # the retry, once the cause is gone: a whole epoch, exact rows
    _check_epoch(graph, list(dm.train_dataloader()))
    # evaluation passes too
    assert sum(int(b.batch_size) for b in dm.val_dataloader()) == graph.split("val").numel()
    dm.teardown()


def test_a_read_error_in_one_pass_does_not_break_the_next(graph, monkeypatch):
    dm = _dm(graph.root, {"host_cache": 0})
    dm.setup()
    real = ReaderTier.load_into
    failed = []

    def failing_once(self, *a, **k):
        if not failed:
            failed.append(1)
            raise OSError(5, "Input/output error (injected)")
        return real(self, *a, **k)

    monkeypatch.setattr(ReaderTier, "load_into", failing_once)
    with pytest.raises(OSError, match="injected"):
        list(dm.train_dataloader())
    buffer = dm.store.tier("buffer").buffer
    buffer.check_invariants()
    assert int(buffer.refcount.sum()) == 0 and not bool(buffer.failed.any())
    _check_epoch(graph, list(dm.train_dataloader()))
    dm.teardown()
    assert not _ooc_threads()


def test_a_row_whose_loader_failed_is_an_error_for_its_waiters_not_a_hang():
    from lightning_ooc.store.feature_buffer import FeatureBuffer, RowLoadFailedError

    buf = FeatureBuffer(8, 20, 2)
    loader = buf.acquire(torch.tensor([3, 4]))
    waiter = buf.acquire(torch.tensor([4, 5]))  # row 4 is in flight, loaded by `loader`
    assert waiter.in_flight.tolist() == [True, False]
    buf.abandon(loader)  # the loader's extraction failed
    with pytest.raises(RowLoadFailedError):
        buf.wait_valid(waiter.slots[waiter.in_flight], timeout=30)
    again = buf.acquire(torch.tensor([4]))  # a later batch loads row 4 afresh
    assert again.miss.tolist() == [True]
    buf.abandon(waiter)
    buf.release(again.slots)
    buf.check_invariants()
    assert int(buf.refcount.sum()) == 0


# -- 4. in order, a batch larger than the reserve waits its turn; it never deadlocks ----------------
def test_in_order_batches_larger_than_the_reserve_do_not_hang(graph, monkeypatch):
    import lightning_ooc.store.planner as planner

    ref_dm = _dm(graph.root, pipeline={"order": "in_order"})
    ref_dm.setup()
    real_max = ref_dm.plan.max_nodes_per_batch
    ref_dm.teardown()
    # The plan believes batches have a quarter of their real size; the buffer holds 2.5 real batches,
    # far less than the in-order window of extractors + train queue + 2 batches.
    monkeypatch.setattr(planner, "max_nodes_per_batch", lambda *a, **k: max(1, real_max // 4))
    gate = threading.Event()
    dm = _dm(graph.root, {"gpu_cache": int(real_max * 2.5) * graph.row_bytes},
             {"order": "in_order", "num_extractors": 3, "train_queue_size": 3})  # fmt: skip
    dm.setup()
    assert dm.plan.buffer_slots < real_max * (3 + 3 + 2)
    real = dm.sampler.sample
    first = int(dm._batches("train", 0)[0][0])

    def head_last(seeds, seed=None, **kw):  # the head batch is sampled after the batches behind it
        if int(seeds[0]) == first:
            gate.wait(5)
        return real(seeds, seed=seed, **kw)

    dm.sampler.sample = head_last
    threading.Timer(1.0, gate.set).start()
    out = _in_thread(lambda: [(int(b.batch_index), b) for b in dm.train_dataloader()])
    assert "error" not in out, out.get("error")
    order = [k for k, _ in out["value"]]
    assert order == sorted(order)  # in order
    _check_epoch(graph, [b for _, b in out["value"]])
    dm.teardown()


def test_a_batch_larger_than_the_whole_buffer_is_a_clear_error(graph, monkeypatch):
    import lightning_ooc.store.planner as planner

    monkeypatch.setattr(planner, "max_nodes_per_batch", lambda *a, **k: 2)
    dm = _dm(graph.root, {"gpu_cache": 40 * graph.row_bytes},
             {"order": "in_order", "num_extractors": 1, "train_queue_size": 1})
    dm.setup()
    out = _in_thread(lambda: list(dm.train_dataloader()))
    assert isinstance(out.get("error"), ValueError) and "feature buffer has 40 slots" in str(out["error"])
    dm.teardown()
    assert not _ooc_threads()


# -- 5. close() stops every thread through the run's cancel token ---------------------------------------
@pytest.mark.parametrize("blocked_on", ["staging", "buffer"])
def test_close_stops_threads_blocked_in_any_wait(graph, blocked_on):
    dm = _dm(graph.root, {"host_cache": 0}, {"num_extractors": 2})
    dm.setup()
    disk = dm.store.tier("ssd")
    buffer = dm.store.tier("buffer").buffer
    waiting = threading.Event()
    if blocked_on == "staging":  # every staging chunk is taken: extractors wait for one
        held = [disk.staging.acquire() for _ in range(disk.staging.num_chunks)]
        real = disk.staging.acquire

        def acquire(*a, **k):
            waiting.set()
            return real(*a, **k)

        disk.staging.acquire = acquire
    else:  # every buffer slot is referenced elsewhere: extractors wait for free slots
        held = buffer.acquire(torch.arange(buffer.num_slots))
        real = buffer.acquire

        def acquire(ids, *a, **k):
            waiting.set()
            return real(ids, *a, **k)

        buffer.acquire = acquire
    run = iter(dm.train_dataloader()).start()
    assert waiting.wait(HANG_BOUND)
    run.close()
    assert not [t.name for t in run._threads + [run._releaser] if t.is_alive()]
    assert not _ooc_threads()
    # the run gave back what it held; what others hold is untouched, and the store still works
    if blocked_on == "staging":
        for c in held:
            disk.staging.release(c)
        del disk.staging.acquire
    else:
        assert int(buffer.refcount.sum()) == buffer.num_slots
        buffer.release(held.slots)
        del buffer.acquire
    _check_epoch(graph, list(dm.train_dataloader()))
    dm.teardown()


# -- 6. invalid pipeline shapes are errors at construction ---------------------------------------------
@pytest.mark.parametrize("where,kw", [("pipeline", dict(num_samplers=0)), ("pipeline", dict(num_samplers=-1)),
                                      ("pipeline", dict(num_extractors=0)), ("pipeline", dict(extract_queue_size=0)),
                                      ("pipeline", dict(train_queue_size=-2)), ("own", dict(batch_size=0)),
                                      ("pipeline", dict(order="bogus")), ("own", dict(num_neighbors=[])),
                                      ("own", dict(eval_batch_size=-1)), ("tiered", dict(host_cache_policy="bogus")),
                                      ("pipeline", dict(num_samplers=1.5)),
                                      ("pipeline", dict(num_sampler=2))])  # fmt: skip (num_sampler: an unknown setting)
def test_invalid_pipeline_shapes_are_clear_errors_at_construction(graph, where, kw):
    name = next(iter(kw))
    with pytest.raises(InputError, match=name):
        _dm(graph.root, **(kw if where == "own" else {where: kw}))


def test_cli_with_no_samplers_exits_with_one_line_not_a_hang(graph):
    import subprocess
    import sys

    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    p = subprocess.run(
        [sys.executable, "-m", "lightning_ooc", "fit", "--config", str(config), "--data.root", str(graph.root),
         "--data.pipeline.num_samplers", "0", "--trainer.logger", "false", "--trainer.max_epochs", "1"],
        capture_output=True, text=True, timeout=HANG_BOUND,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert "num_samplers must be an integer >= 1, got 0" in p.stderr and "Traceback" not in p.stderr


# -- 1 and 3. the gather producer: passes have their own identity; unshared topology works --------------
class _Record(L.Callback):
    def __init__(self):
        self.train: dict[int, list[int]] = {}
        self.val: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.setdefault(trainer.current_epoch, []).extend(batch.n_id[: batch.batch_size].tolist())

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val.extend(batch.n_id[: batch.batch_size].tolist())


def _fit_with_producer(graph, strategy, **trainer_kw):
    rec = _Record()
    opts = dict(accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, callbacks=[rec])  # fmt: skip
    opts.update(trainer_kw)
    trainer = L.Trainer(**opts)
    dm = _dm(graph.root, pipeline={"num_samplers": 1, "num_extractors": 1})
    out = _in_thread(lambda: trainer.fit(GraphSAGE(graph.num_features, graph.num_classes, hidden_channels=16,
                                                   num_layers=2), datamodule=dm))  # fmt: skip
    assert "error" not in out, repr(out.get("error"))
    return rec


def test_validation_inside_an_epoch_with_the_producer_keeps_passes_apart(graph):
    rec = _fit_with_producer(graph, OutOfCoreStrategy(gather_process=True), val_check_interval=0.3)
    train, val = sorted(graph.split("train").tolist()), set(graph.split("val").tolist())
    for epoch in range(2):
        assert sorted(rec.train[epoch]) == train  # every training seed once, no validation seed among them
    n_val_passes = len(rec.val) // len(val)
    assert n_val_passes >= 4 and len(rec.val) == n_val_passes * len(val) and set(rec.val) == val


def test_the_producer_opens_its_own_topology_when_it_is_not_shared(graph):
    rec = _fit_with_producer(graph, OutOfCoreStrategy(gather_process=True, share_topology=False), max_epochs=1,
                             limit_val_batches=0)  # fmt: skip
    assert sorted(rec.train[0]) == sorted(graph.split("train").tolist())


def test_producer_passes_closed_early_or_live_at_once_do_not_mix(graph):
    from lightning_ooc.strategy.producer import GatherProducer

    dm = _dm(graph.root, pipeline={"num_samplers": 1, "num_extractors": 1})
    producer = GatherProducer(dm.config, rank=0, world=1, device="cpu", handles={})
    val_seeds = sorted(graph.split("val").tolist())
    try:
        run = producer.run("train", epoch=0)
        next(run)
        run.close()  # a pass closed early; its late batches must not reach the next passes
        val = list(producer.run("val", epoch=0))
        assert sorted(torch.cat([b.n_id[: b.batch_size] for b in val]).tolist()) == val_seeds
        _check_epoch(graph, list(producer.run("train", epoch=0)))
        # a training pass paused mid-epoch while a validation pass runs, then resumed
        a = producer.run("train", epoch=1)
        got_a = [next(a), next(a)]
        got_b = list(producer.run("val", epoch=0))
        got_a += list(a)
        assert sorted(torch.cat([b.n_id[: b.batch_size] for b in got_b]).tolist()) == val_seeds
        _check_epoch(graph, got_a)
    finally:
        producer.close()
    assert not producer.proc.is_alive()


# -- in order, every batch equals the synchronous baseline's, byte for byte -------------------------------
@pytest.mark.parametrize("features", [Mapped(in_ram=True), Mapped(madvise="normal"), Mapped()],
                         ids=["ram", "mmap", "mmap-random"])
def test_in_order_batches_equal_the_baselines_byte_for_byte(graph, features):
    kw = dict(batch_size=64, num_neighbors=[4, 3], seed=5, progress=False)
    ours = _dm(graph.root, pipeline={"order": "in_order"}, **kw)
    base = OutOfCoreNodeData(str(graph.root), features=features, pipeline={"order": "in_order"}, **kw)
    for dm in (ours, base):
        dm.setup()
    for epoch in range(2):
        a, b = list(ours.train_dataloader()), list(base.train_dataloader())
        assert len(a) == len(b) == ours._num_batches("train")
        for x, y in zip(a, b):
            for field in ("n_id", "edge_index", "y", "x"):
                assert getattr(x, field).numpy().tobytes() == getattr(y, field).numpy().tobytes(), (epoch, field)
    ours.teardown()
    base.teardown()


def test_closing_the_passes_closes_a_run_left_going_first(tmp_path):
    """A run whose threads still extract when its passes close is stopped before the store goes
    (closing the store under it would free the reader and staging memory its threads use)."""
    from lightning_ooc.loader.config import NodeDataConfig
    from lightning_ooc.loader.context import ProcessContext
    from lightning_ooc.loader.source import LocalPasses
    from lightning_ooc.testing import make_synthetic

    ds = make_synthetic(tmp_path / "g", num_nodes=6000, num_features=16, train_frac=0.5)
    cfg = NodeDataConfig(str(ds.root), batch_size=50, num_neighbors=[5, 5], progress=False,
                         features=Tiered(gpu_cache="2MiB", host_cache="8KiB", staging="256KiB"),
                         pipeline={"num_samplers": 2, "num_extractors": 2})  # fmt: skip
    passes = LocalPasses(cfg, ProcessContext())
    run = passes.run("train", epoch=0)
    next(iter(run))  # one batch taken; the other threads go on extracting
    alive = [t for t in run._threads if t.is_alive()]
    passes.close()
    assert alive and not any(t.is_alive() for t in run._threads + [run._releaser])
    assert run._closed
