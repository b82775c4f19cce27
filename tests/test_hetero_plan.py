"""The memory plan of a heterogeneous store: every node type's tiers fitted under one limit together.

Every type's smallest plan (staging, buffer reserve, tables, batches in flight) is placed before any type's
budgets get what is left, the sum stays within the limit, a tight limit lowers the pipeline with one warning
line (as a homogeneous plan does), and only a limit below the smallest pipeline is refused, with the figures.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from lightning_ooc import Tiered
from lightning_ooc.data.synth_hetero import synthesize_hetero
from lightning_ooc.errors import InputError
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.loader.hetero_task import HeteroLocalPasses
from lightning_ooc.store.feature_buffer import required_slots
from lightning_ooc.store.limits import MemoryLimit
from lightning_ooc.store.planner import smaller_pipelines
from lightning_ooc.store.tally import host_tally

PIPELINE = ("extract_queue_size", "train_queue_size", "num_samplers", "num_extractors")

MiB = 1 << 20


@pytest.fixture(scope="module")
def igbh(tmp_path_factory):
    # IGBH's six types with 1024-dim float32 rows: two large types, four of a handful of nodes
    return synthesize_hetero(tmp_path_factory.mktemp("hp") / "igbh", "igbh", num_nodes=3000, num_features=1024,
                             num_classes=4, train_frac=0.3, val_frac=0.05, test_frac=0.05, seed=0,
                             progress=False)  # fmt: skip


def _cfg(root, **kw):
    features = Tiered(gpu_cache="32MiB", host_cache="16MiB", staging="8MiB", presample_batches=8)
    kw = {**dict(batch_size=64, num_neighbors=[5, 3], features=features, progress=False, seed=0), **kw}
    return NodeDataConfig(root, **kw)


def _passes(cfg, limit: MemoryLimit) -> HeteroLocalPasses:
    class Capped(HeteroLocalPasses):
        def _plan_memory(self):
            return limit

    return Capped(cfg, ProcessContext())


def _smallest(fit, pipeline, order) -> int:
    """A type's smallest plan with ``pipeline``'s queues, samplers and extractors: no host cache, the feature
    buffer at its reserve (on CPU), its staging, tables and batches in flight."""
    shape = replace(fit.shape, **{k: getattr(pipeline, k) for k in PIPELINE})
    slots = min(required_slots(shape.max_nodes_per_batch, shape.num_extractors, shape.train_queue_size, order),
                shape.num_nodes, fit.buffer_slots)  # fmt: skip
    return host_tally(shape, host_rows=0, buffer_slots=slots, staging_bytes=fit.staging_bytes).peak


def _asked(cfg):
    """From the plan without a limit: what every type asks at its peak, the sum of the types' smallest plans with
    the pipeline asked and with the smallest pipeline, the training reserve, and each type's smallest plan."""
    passes = _passes(cfg, MemoryLimit.none("a test"))
    try:
        fits = {t: p.memory_fit for t, p in passes.plan.plans.items()}
    finally:
        passes.close()
    asked = next(iter(fits.values())).shape
    smallest = smaller_pipelines(asked)[0]
    fixed = {t: _smallest(f, asked, cfg.pipeline.order) for t, f in fits.items()}
    least = sum(_smallest(f, smallest, cfg.pipeline.order) for f in fits.values())
    reserve = max(f.reserve for f in fits.values())  # counted once, with one type's plan
    return sum(f.need for f in fits.values()), sum(fixed.values()), least, reserve, fixed


def _planned(plan, reserve: int) -> int:
    """Bytes every type's plan needs at its peak, and the training reserve (counted once)."""
    return sum(p.memory_fit.need for p in plan.plans.values()) + reserve


def test_every_type_is_placed_before_any_cache_grows(igbh):
    cfg = _cfg(igbh)
    need, fixed, _, reserve, each = _asked(cfg)
    # less than the plan asks, well above what every type needs at least: the budgets shrink, the pipeline not
    limit = MemoryLimit(reserve + fixed + (need - fixed) // 3, "a test")
    passes = _passes(cfg, limit)
    try:
        plan = passes.plan
        assert set(plan.plans) == {"paper", "author", "institute", "fos", "journal", "conference"}
        assert _planned(plan, reserve) <= limit.bytes  # the sum of what every type plans stays within the limit
        assert plan.pipeline == {} and passes.cfg.pipeline.num_samplers == cfg.pipeline.num_samplers
        for t, p in plan.plans.items():  # every type placed: its reserve of buffer slots, within its part
            assert p.buffer_slots >= p.buffer_reserve > 0, t
            assert p.memory_fit.need <= p.memory_fit.allowed, t
            assert p.memory_fit.need >= each[t], t
        shrunk = [s for p in plan.plans.values() for s in p.memory_fit.shrunk]
        assert any("shrunk" in s for s in shrunk)  # the limit was tight: budgets gave way
        assert "planned at the peaks of 6 node types" in plan.format()
        x = passes.store.extract({t: torch.arange(2) for t in plan.plans})  # every type's tiers were built
        assert all(passes.store.gather(x)[t].shape == (2, 1024) for t in plan.plans)
        passes.store.release(x)
    finally:
        passes.close()


def test_tight_limit_lowers_the_pipeline_and_warns_once(igbh, caplog):
    cfg = _cfg(igbh)
    need, fixed, least, reserve, _ = _asked(cfg)
    assert least < fixed < need
    # every type's smallest plan fits with fewer batches in flight only
    limit = MemoryLimit(reserve + (least + fixed) // 2, "a test")
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        passes = _passes(cfg, limit)
    try:
        plan = passes.plan
        assert plan.pipeline and set(plan.pipeline) <= {"extract_queue_size", "train_queue_size", "num_samplers",
                                                        "num_extractors"}  # fmt: skip
        for name, value in plan.pipeline.items():  # the passes run with the pipeline planned
            assert getattr(passes.cfg.pipeline, name) == value < getattr(cfg.pipeline, name)
        assert _planned(plan, reserve) <= limit.bytes
        for t, p in plan.plans.items():
            assert p.buffer_slots >= p.buffer_reserve > 0, t
            assert p.num_extractors == passes.cfg.pipeline.num_extractors, t
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(lines) == 1, lines
        (line,) = lines
        p = cfg.pipeline
        assert (f"pipeline shrunk from {p.num_samplers} sampler{'s' * (p.num_samplers > 1)}, queues 6/4, "
                f"{p.num_extractors} extractor{'s' * (p.num_extractors > 1)}: "
                f"{p.num_samplers + p.num_extractors + 12} batches in flight to ") in line
        assert "to fit in memory" in line and "to plan this without a warning" in line
        assert f"pipeline.num_extractors={passes.cfg.pipeline.num_extractors}" in line
    finally:
        passes.close()


def test_limit_below_the_smallest_pipeline_is_refused_with_the_figures(igbh):
    cfg = _cfg(igbh)
    _, _, least, reserve, _ = _asked(cfg)
    limit = MemoryLimit(reserve + least - MiB, "a test")
    with pytest.raises(InputError) as e:
        _passes(cfg, limit)
    msg = str(e.value)
    assert msg.startswith("the plan does not fit in memory: ")
    assert "the smallest pipeline (1 sampler, queues 1/1, 1 extractor: 6 batches in flight)" in msg
    assert "its 6 node types need" in msg and all(t in msg for t in ("paper ", "author ", "conference "))
    assert "1.00 MiB too much" in msg and "raise the memory limit by 1.00 MiB" in msg
    assert "lower batch_size / num_neighbors" in msg and "memory_limit=None" in msg
