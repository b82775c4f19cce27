"""`lightning-ooc bench distributed` on a tiny graph: 2 machines (one torchrun each, over loopback), 2 epochs."""
from __future__ import annotations

import json

import pytest

from lightning_ooc.bench import distributed

pytestmark = pytest.mark.slow


def test_tiny_run_writes_the_figures(tmp_path):
    out = tmp_path / "out"
    rc = distributed.main(["--nodes", "4000", "--features", "16", "--communities", "8", "--train-frac", "0.1",
                           "--machines", "2", "--policies", "none,scored", "--orders", "drift", "--epochs", "2",
                           "--links", "loopback,5",
                           "--batch-size", "100", "--interval", "4", "--gamma", "0.9", "--timeout", "150",
                           "--workdir", str(tmp_path / "work"), "--out", str(out)])  # fmt: skip
    assert rc == 0
    doc = json.loads((out / "distributed.json").read_text())
    assert doc["graph"]["nodes"] == 4000 and doc["tables"]
    runs = {r["policy"]: r for r in doc["runs"] if r["link"] == "loopback"}
    assert set(runs) == {"none", "scored"}
    modelled = {r["policy"]: r for r in doc["runs"] if r["link"] == "5"}
    assert set(modelled) == {"none", "scored"} and len(doc["tables"]) == 2
    for pol, r in modelled.items():
        assert "error" not in r, r.get("log_tail")
        s, loop = r["summary"], runs[pol]["summary"]
        # the modelled link took at least the larger direction's bytes over its rate; loopback models nothing
        assert loop["link_s"] == 0 and s["link_s"] >= 0.999 * (s["exchange_bytes"] / 2) / (5e6 / 8) > 0
        assert s["remote_rows"] == loop["remote_rows"]  # the same rows asked, in the same order
    for r in runs.values():
        assert "error" not in r, r.get("log_tail")
        assert r["machines"] == 2 and r["order"] == "drift" and len(r["per_epoch"]) == 2
        s = r["summary"]
        for k in ("seconds", "first_epoch_seconds", "remote_rows", "remote_fetched_rows", "remote_hit_rate",
                  "exchange_bytes", "trainer_wait_s", "eviction_rounds", "buffer_rows"):
            assert k in s, k
        assert s["remote_rows"] > 0 and s["exchange_bytes"] > 0
        assert sum(b for e in r["ranks"][0]["epochs"] for b in [e["batches"]]) > 0
    none, scored = runs["none"]["summary"], runs["scored"]["summary"]
    assert none["buffer_rows"] == 0 and none["remote_hit_rate"] == 0 and none["eviction_rounds"] == 0
    assert none["remote_fetched_rows"] == none["remote_rows"]  # every remote row asked from its owner
    assert scored["buffer_rows"] > 0 and scored["remote_hit_rate"] > 0
    assert scored["remote_fetched_rows"] < none["remote_fetched_rows"] + scored["remote_replaced_rows"] + 1


def test_drift_order_trains_every_seed_once_and_moves():
    import numpy as np
    import torch

    from lightning_ooc.loader.partitioned import PartitionSeedBatches

    DriftSeedBatches = distributed._subclasses()[0]
    seeds = torch.arange(0, 200, 2)
    base = PartitionSeedBatches({"train": seeds}.__getitem__, {}, {"train": 10}, local_rank=0, local_world=1,
                                rank=0, world=1, batch_size=10, eval_batch_size=10, shuffle=True)  # fmt: skip
    key = np.arange(200) % 5  # five "communities"
    b = DriftSeedBatches.of(base, key, 0.25)
    e0, e1 = b.epoch("train", 0), b.epoch("train", 1)
    for e in (e0, e1):
        assert sorted(e.cat().tolist()) == seeds.tolist()  # every seed once
    assert e0.cat().tolist() != e1.cat().tolist()  # the start moved
    first = e0[0].tolist()
    assert len({int(key[s]) for s in first}) == 1  # a batch stays in one community
