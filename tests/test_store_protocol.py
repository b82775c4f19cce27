"""The feature-store protocol the pipeline drives, keyed by node type, with statistics kept per tier."""
from __future__ import annotations

import ast
import inspect
from dataclasses import fields

import pytest
import torch

import lightning_ooc
from lightning_ooc.data.synth import synthesize
from lightning_ooc.data.synth_hetero import synthesize_hetero
from lightning_ooc.loader import pipeline
from lightning_ooc.partitioned.remote import RemoteStats
from lightning_ooc.store.typed_stores import HeteroFeatureStore
from lightning_ooc.store.protocol import HOMOGENEOUS, StoreProtocol
from lightning_ooc.store.tier import ExtractStats
from lightning_ooc.store.tiered import TieredFeatureStore


def _members(cls: type) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))


def test_the_pipeline_uses_only_what_the_protocol_declares():
    tree = ast.parse(inspect.getsource(pipeline))
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "store" and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"}
    assert used >= {"claim_batch", "fill", "pin", "attach", "release", "abandon"}, used
    assert used <= _members(StoreProtocol), used - _members(StoreProtocol)
    assert inspect.signature(pipeline.EpochRun.__init__).parameters["store"].annotation == "StoreProtocol"


def test_both_stores_have_the_protocol_keyed_by_node_type(tmp_path):
    ds = lightning_ooc.open_dataset(synthesize(tmp_path / "g", num_nodes=300, avg_degree=4, num_features=8,
                                               num_classes=2, progress=False))  # fmt: skip
    homo = TieredFeatureStore.create(ds, buffer_slots=32, staging_bytes=8192)
    het_ds = lightning_ooc.open_dataset(synthesize_hetero(tmp_path / "h", "mag", num_nodes=400, num_features=8,
                                                          progress=False))  # fmt: skip
    paper = TieredFeatureStore.create(het_ds.node("paper"), buffer_slots=32, staging_bytes=8192)
    het = HeteroFeatureStore({"paper": paper})
    try:
        for store in (homo, het, homo.without("buffer"), het.without("buffer")):
            assert isinstance(store, StoreProtocol)
        assert homo.node_types == (HOMOGENEOUS,) and homo.of(None) is homo
        assert het.node_types == ("paper",) and het.of("paper") is paper
        assert het.without("buffer").of("paper").tiers[-1].name == "ssd"
        with pytest.raises(KeyError, match="no feature store for node type 'author'; the store has 'paper'"):
            het.of("author")
        with pytest.raises(KeyError, match="no feature store for node type 'paper'; the store has None"):
            homo.of("paper")
        # a heterogeneous extraction sums what every type's tiers found
        n_id = {"paper": torch.tensor([1, 2, 3, 1])}
        ext = het.extract(n_id)
        assert ext.stats.misses + ext.stats.buffer_hits + ext.stats.in_flight_hits == 4 and ext.stats.tiers == {}
        het.release(ext)
    finally:
        homo.close()
        het.close()


def test_statistics_are_kept_per_tier_and_the_remote_tier_keeps_its_own():
    assert not [f.name for f in fields(ExtractStats) if f.name.startswith("remote")]
    total = ExtractStats()
    mine = RemoteStats(remote_rows=3, remote_hits=1, remote_fetched=2, remote_bytes=64, remote_wait_s=0.5)
    total.add_tier("buffer", ExtractStats(misses=2, bytes_read=8192, ios=2))
    total.add_tier("remote", mine)
    total.add_tier("remote", RemoteStats(remote_rows=1, remote_fetched=1))
    assert (total.misses, total.bytes_read, total.ios) == (2, 8192, 2)
    assert total.tiers["remote"].remote_rows == 4 and total.tiers["remote"].remote_fetched == 3
    assert mine.remote_rows == 3  # the lease's own record is not changed by the sum
    epoch = ExtractStats()
    epoch.add(total)
    epoch.add(total)
    assert epoch.misses == 4 and epoch.tiers["remote"].remote_rows == 8 and total.tiers["remote"].remote_rows == 4
