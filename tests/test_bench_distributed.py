"""`lightning-ooc bench distributed`: the modelled link's costs (rows, the owners' serve time, gradients) and, slow,
a tiny graph on 2 machines (one torchrun each, over loopback and over a modelled link), 2 epochs."""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_ooc.bench import distributed
from lightning_ooc.bench.distributed import ModelledLink, link_latency_s
from lightning_ooc.bench.report import render_file
from lightning_ooc.loader.partitioned import PartitionSeedBatches


@pytest.fixture
def group():
    """A gloo group of this process alone (a default group of one where the process has none yet)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.new_group([dist.get_rank()], backend="gloo")
    if created:
        dist.destroy_process_group()


def test_the_latency_scales_with_the_rate_unless_given():
    # the reference network's 0.05 ms per message at 10 Gbit/s, slowed down as much as the rate
    assert link_latency_s(10_000) == pytest.approx(5e-5)
    assert link_latency_s(20) == pytest.approx(0.025) and link_latency_s(5) == pytest.approx(0.1)
    assert ModelledLink(100).latency == pytest.approx(0.005)
    assert ModelledLink(100, latency_ms=0.05).latency == pytest.approx(5e-5)  # given: as it is
    p = argparse.ArgumentParser()
    distributed.add_arguments(p)
    assert p.parse_args([]).link_latency_ms is None  # derived by default
    assert "25 ms" in distributed._link_name("20") and distributed._link_name("loopback") == "loopback"


def test_a_round_lasts_its_messages_then_the_owners_serve_then_the_transfer():
    link = ModelledLink(8, latency_ms=2.0)  # 1e6 bytes/s
    cost, done = link.round(50.0, sent=4000, received=9000, serve_s=0.25, busy=True)
    assert cost == pytest.approx(3 * 0.002 + 0.25 + 9000 / 1e6)  # the serve time added, not overlapped
    assert done == pytest.approx(50.0 + cost)
    cost, done = link.round(60.0, sent=0, received=0, serve_s=0.0, busy=False)  # headers only
    assert cost == pytest.approx(0.002) and done == pytest.approx(60.002)
    assert link.rows_s == pytest.approx(0.265 + 0.002)


def test_rows_and_gradients_queue_on_one_link():
    link = ModelledLink(8, latency_ms=1.0)
    _, rows_done = link.round(10.0, sent=100_000, received=0, serve_s=0.0, busy=True)  # 0.1 s of transfer
    assert rows_done == pytest.approx(10.103)
    cost, done = link.allreduce(10.0, nbytes=30_000, world=4)  # begun while the rows are on the link
    # ring: 2 (n - 1) messages, 2 (n - 1) / n x the bytes each way
    assert cost == pytest.approx(6 * 0.001 + 1.5 * 30_000 / 1e6)
    assert done == pytest.approx(rows_done + 1.5 * 30_000 / 1e6)  # its transfer waited for the rows'
    assert link.grad_bytes == 45_000 and link.grads_s == pytest.approx(cost)
    assert link.allreduce(20.0, nbytes=30_000, world=1) == (0.0, 20.0)  # alone: nothing to send


def test_the_gradient_hook_charges_the_ring_allreduce_of_each_bucket(group):
    link = ModelledLink(8, latency_ms=1.0)
    slept = []
    link.sleep = slept.append  # the amounts, not the time
    torch.manual_seed(0)
    net = torch.nn.Linear(10, 5)  # 55 parameters: one bucket of 220 bytes
    ref = torch.nn.Linear(10, 5)
    ref.load_state_dict(net.state_dict())
    ddp = DistributedDataParallel(net, process_group=group)
    ddp.register_comm_hook(group, link.grad_hook(world=2))  # as if over 2 machines
    x = torch.randn(4, 10)
    ddp(x).sum().backward()
    ref(x).sum().backward()
    cost = 2 * 0.001 + 220 / 1e6  # 2 messages, 2 (2 - 1) / 2 x 220 bytes each way
    assert link.grad_bytes == 220 and link.grads_s == pytest.approx(cost)
    # what loopback left of it: nothing when loopback itself took longer (a loaded machine)
    assert len(slept) <= 1 and all(0 < t <= cost for t in slept)
    assert torch.equal(net.weight.grad, ref.weight.grad)  # the mean over a group of one: the gradient itself


def test_the_link_exchange_adds_the_owners_serve_time(group):
    LinkExchange = distributed._subclasses()[3]
    link = ModelledLink(8, latency_ms=0.0)  # no latency: only the busy round costs
    table = torch.arange(20, dtype=torch.float32).reshape(10, 2)

    def serve(ids):
        time.sleep(0.02)  # a slow owner
        return table[ids]

    ex = type("Link", (LinkExchange,), {"link": link})(group, torch.zeros(10, dtype=torch.int32), 0, serve, 2,
                                                       torch.float32)  # fmt: skip
    try:
        assert ex.request(torch.tensor([7, 3, 5])).result().tolist() == [[14.0, 15.0], [6.0, 7.0], [10.0, 11.0]]
    finally:
        ex.close(10.0)
    assert ex.rounds == 1 and ex.serve_seconds > 0
    # the owner's serve time came back with its rows and was added to the transfer of the larger direction
    transfer = max(ex.bytes_sent, ex.bytes_received) / link.rate
    assert ex.bytes_sent == 3 * 8 + 3 * 8  # ids out, rows out (the serve-time stamp is not traffic)
    assert ex.link_s == pytest.approx(ex.serve_seconds + transfer, rel=1e-9)
    assert link.rows_s == pytest.approx(ex.link_s, rel=1e-9)


@pytest.mark.slow
def test_tiny_run_writes_the_figures(tmp_path):
    out = tmp_path / "out"
    rc = distributed.main(["--nodes", "4000", "--features", "16", "--communities", "8", "--train-frac", "0.1",
                           "--machines", "2", "--policies", "none,scored", "--orders", "drift", "--epochs", "2",
                           "--links", "loopback,5",
                           "--batch-size", "100", "--interval", "4", "--gamma", "0.9", "--timeout", "150",
                           "--workdir", str(tmp_path / "work"), "--out", str(out)])  # fmt: skip
    assert rc == 0
    doc = json.loads((out / "distributed.json").read_text())
    assert doc["graph"]["nodes"] == 4000 and doc["tables"] and doc["kind"] == "distributed" and "commit" in doc
    assert render_file(out / "distributed.json") == "\n\n".join(doc["tables"])
    runs = {r["policy"]: r for r in doc["runs"] if r["link"] == "loopback"}
    assert set(runs) == {"none", "scored"}
    modelled = {r["policy"]: r for r in doc["runs"] if r["link"] == "5"}
    assert set(modelled) == {"none", "scored"} and len(doc["tables"]) == 2
    for pol, r in modelled.items():
        assert "error" not in r, r.get("log_tail")
        s, loop = r["summary"], runs[pol]["summary"]
        # the modelled link took at least the larger direction's bytes over its rate; loopback models nothing
        assert loop["link_s"] == 0 and s["link_s"] >= 0.999 * (s["exchange_bytes"] / 2) / (5e6 / 8) > 0
        # the gradients went over it too: per step at least the ring's 2 messages of 100 ms (derived at 5 Mbit/s)
        steps = np.mean([e["batches"] for rk in r["ranks"] for e in rk["epochs"][1:]])
        assert loop["grad_link_s"] == 0 and loop["grad_bytes"] == 0 and s["grad_bytes"] > 0
        assert s["grad_link_s"] >= steps * 2 * 0.1 + s["grad_bytes"] / (5e6 / 8) * 0.999
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
