"""`lightning-ooc bench embed`: the order table, out of core against in memory (each charged its load and its final
write-back, in an order rotated every repeat), Theorem 3's prediction."""
import argparse
import json

import numpy as np
import pytest

from lightning_ooc.bench import embed as bench
from lightning_ooc.bench.report import render_file
from lightning_ooc.cli import main
from lightning_ooc.embed.order import partition_order, prefetch_stats


def test_bench_embed_small(tmp_path, capsys):
    out = tmp_path / "res" / "embed"
    rc = main(["bench", "embed", "--nodes", "3000", "--avg-degree", "5", "--community", "50", "--dim", "8",
               "--partitions", "6", "--workdir", str(tmp_path / "work"), "--orders", "legend",
               "--max-partitions", "8", "--batch-size", "500", "--num-negatives", "8",
               "--chunk-size", "50", "--memory-cap", "none", "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.with_suffix(".json").read_text())
    for key in ("date", "command", "machine", "memory_cap", "cold", "capacity", "table", "synthetic", "orders",
                "results", "variants", "theorem3"):
        assert key in doc, key
    assert doc["memory_cap"] is None and doc["capacity"] == 3
    assert doc["kind"] == "embed" and "commit" in doc
    # `bench report` renders the tables the run printed from the JSON alone
    rendered = render_file(out.with_suffix(".json"))
    for part in rendered.split("\n\n"):
        assert part in text, part
    assert "Theorem 3 [legend]" in rendered and "partition orders, buffer of 3" in rendered
    assert doc["table"]["nodes"] == 3000 and doc["table"]["edges"] == 15000 and doc["table"]["partitions"] == 6
    assert not (tmp_path / "work" / "table-n3000-e15000-d8-p6-s0").exists()  # the synthetic table is removed

    # 1. the order table is order.py's, for every N up to --max-partitions and every kind
    rows = {(r["num_partitions"], r["name"]): r for r in doc["orders"]}
    assert set(rows) == {(n, k) for n in (4, 6, 8) for k in ("legend", "beta", "greedy")}
    for (n, kind), row in rows.items():
        want = prefetch_stats(partition_order(n, 3, kind))
        assert {k: row[k] for k in want} == want
    assert rows[6, "legend"]["swaps"] == 7 and rows[6, "legend"]["paper_swaps"] == 7  # the paper's Figure 6
    assert rows[8, "beta"]["paper_states"] == 15 and "paper_swaps" not in rows[4, "legend"]
    assert "partition orders, buffer of 3" in text and "paper swaps" in text

    # 2. the variants, two epochs each (the default), one repeat (the rotation over repeats: its own test below)
    assert doc["settings"]["epochs"] == 2 and doc["settings"]["repeats"] == 1
    runs = doc["results"]
    assert not any("error" in r for r in runs), runs
    assert [(r["repeat"], r["position"], f"{r['variant']}/{r['order']}") for r in runs] == [
        (0, 0, "ours/legend"), (0, 1, "memory/legend")]
    pbytes = sorted(doc["table"]["partition_bytes"])
    for r in runs:  # every edge each epoch; no swap in memory, the order's swaps out of core
        name = f"{r['variant']}/{r['order']}"
        assert len(r["epochs"]) == 2
        for e in r["epochs"]:
            assert e["edges"] == 15000 and e["seconds"] > 0
            if name.startswith("memory"):
                assert e["swaps"] == 0 and e["bytes_written"] == 0
            else:
                assert e["swaps"] == partition_order(6, 3, r["order"]).num_swaps == r["order_swaps"]
                assert e["bytes_read"] > 0 and e["bytes_written"] > 0
                assert 0.0 <= e["hidden_fraction"] <= 1.0
        s = r["summary"]
        assert s["edges_per_second"] > 0 and s["loss_first"] is not None
        # charged its final write-back: memory the whole table, ours the (at most 3) partitions it still held
        if name.startswith("memory"):
            assert s["swaps"] == 0
            assert r["epochs"][0]["bytes_read"] == doc["table"]["bytes"]  # the whole table, once
            assert r["epochs"][1]["bytes_read"] == 0
            assert r["final_writeback_bytes"] == doc["table"]["bytes"] and r["final_writebacks"] == 6
        else:
            assert 0 < r["final_writeback_bytes"] <= sum(pbytes[-3:])
        assert r["final_writeback_seconds"] > 0
        assert s["epoch_seconds"] == pytest.approx((sum(e["seconds"] for e in r["epochs"])
                                                    + r["final_writeback_seconds"]) / 2)  # fmt: skip
        assert s["bytes_written"] == pytest.approx((sum(e["bytes_written"] for e in r["epochs"])
                                                    + r["final_writeback_bytes"]) / 2)  # fmt: skip
    per = {f"{v['variant']}/{v['order']}": v for v in doc["variants"]}
    assert list(per) == ["ours/legend", "memory/legend"] and per["memory/legend"]["places"] == [2]
    assert per["ours/legend"]["summary"]["runs"] == 1 and per["ours/legend"]["summary"]["epochs"] == 2
    assert "ours/legend" in text and "vs memory" in text and "final wb s" in text

    # 3. Theorem 3: one prediction per ours variant, from the memory variant's seconds per edge
    t3 = {t["order"]: t for t in doc["theorem3"]}
    assert set(t3) == {"legend"}
    for kind, t in t3.items():
        assert t["seconds_per_edge_from"] == "memory"
        assert t["seconds_per_edge"] == per["memory/legend"]["summary"]["seconds_per_edge"]
        assert t["swaps"] == partition_order(6, 3, kind).num_swaps
        assert 0.0 <= t["predicted_hidden_fraction"] <= 1.0 and 0.0 <= t["predicted_hidden_fraction_own"] <= 1.0
        assert t["own_seconds_per_edge"] == per[f"ours/{kind}"]["summary"]["seconds_per_edge"]
        assert t["measured_hidden_fraction"] == per[f"ours/{kind}"]["summary"]["hidden_fraction"]
    assert "Theorem 3 [legend]" in text


def test_two_epochs_and_one_repeat_by_default():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args([])
    assert args.epochs == 2 and args.repeats == 1


def _epoch(seconds, load=0.0, written=0, edges=100):
    return {"seconds": seconds, "edges": edges, "batches": 1, "swaps": 0, "swap_seconds": 0.0, "wait_seconds": load,
            "first_load_seconds": load, "bytes_read": 0, "bytes_written": written, "read_seconds": 0.0,
            "write_seconds": 0.0, "buffer_bytes_read": 0, "buffer_bytes_written": 0, "loss_first": 1.0,
            "loss_last": 0.5}  # fmt: skip


def test_a_run_is_charged_its_load_and_its_final_writeback():
    # in memory: the whole table's 3 s load in the first epoch, 4 s to write it all back after the last
    mem = {"epochs": [_epoch(10.0, load=3.0), _epoch(6.0)], "final_writeback_seconds": 4.0,
           "final_writeback_bytes": 800}  # fmt: skip
    s = bench.summarize(mem)
    assert s["epoch_seconds"] == pytest.approx((10 + 6 + 4) / 2) and s["run_seconds"] == pytest.approx(20.0)
    assert s["edges_per_second"] == pytest.approx(200 / 20)
    assert s["load_seconds"] == pytest.approx(1.5) and s["final_writeback_seconds"] == pytest.approx(4.0)
    assert s["bytes_written"] == pytest.approx(400) and s["train_seconds"] == pytest.approx((16 - 3) / 2)
    # out of core: its swaps' write-backs in its epochs, and its own (smaller) final write-back
    ours = {"epochs": [_epoch(11.0, load=1.0, written=300), _epoch(10.0, load=0.5, written=300)],
            "final_writeback_seconds": 1.0, "final_writeback_bytes": 200}  # fmt: skip
    o = bench.summarize(ours)
    assert o["epoch_seconds"] == pytest.approx(11.0) and o["bytes_written"] == pytest.approx(400)
    assert o["epoch_seconds"] / s["epoch_seconds"] == pytest.approx(1.1)  # 'vs memory': both charged
    # over repeats: every run charged, the means per epoch and per run
    both = bench.summarize(mem, mem)
    assert both["runs"] == 2 and both["epochs"] == 4 and both["epoch_seconds"] == pytest.approx(10.0)
    assert both["final_writeback_seconds"] == pytest.approx(4.0) and both["run_seconds"] == pytest.approx(20.0)


def test_the_variants_run_in_an_order_rotated_every_repeat():
    plan = [("ours", "legend"), ("ours", "beta"), ("ours", "greedy"), ("memory", "legend")]
    runs = bench.rotated(plan, 4)
    assert [(r, k) for r, k, _, _ in runs] == [(r, k) for r in range(4) for k in range(4)]
    for r in range(4):
        assert [(v, o) for rr, _, v, o in runs if rr == r] == plan[r:] + plan[:r]
    for v in plan:  # as many repeats as variants: each once in every place
        assert sorted(k for _, k, *x in runs if tuple(x) == v) == [0, 1, 2, 3]
    assert bench.rotated(plan, 1) == [(0, k, *v) for k, v in enumerate(plan)]


def test_theorem3_arithmetic():
    """Per swap: min(training during it, write + read of a partition), summed, over the swaps' I/O time."""
    order = partition_order(6, 3, "legend")
    counts = [[10 * (i + 1) + j for j in range(6)] for i in range(6)]
    pbytes = [1000 + 100 * p for p in range(6)]
    facts = {"bucket_counts": counts, "partition_bytes": pbytes, "partitions": 6, "edges": sum(map(sum, counts)),
             "bytes": sum(pbytes)}  # fmt: skip
    t, w, r = 1e-3, 20000.0, 50000.0
    got = bench.theorem3(order, facts, t, w, r)
    d = [t * sum(counts[i][j] for i, j in st.during) for st in order.states[:-1]]
    io = [pbytes[st.evict] / w + pbytes[st.load] / r for st in order.states[:-1]]
    assert got["swaps"] == order.num_swaps == 7
    assert got["predicted_hidden_fraction"] == pytest.approx(sum(map(min, zip(d, io))) / sum(io))
    assert got["swaps_not_covered"] == sum(a < b for a, b in zip(d, io))
    pc = got["paper_condition"]
    assert pc["train_2_avg_buckets_seconds"] == pytest.approx(2 * t * facts["edges"] / 36)
    assert pc["exchange_seconds"] == pytest.approx(sum(pbytes) / 6 / w + sum(pbytes) / 6 / r)


def test_synthetic_edges_stay_in_communities():
    src, dst = bench.synthetic_edges(1050, 5000, 100, seed=3)
    again = bench.synthetic_edges(1050, 5000, 100, seed=3)
    assert np.array_equal(src, again[0]) and np.array_equal(dst, again[1])
    assert src.min() >= 0 and max(src.max(), dst.max()) < 1050 and not np.any(src == dst)
    # the communities: runs of 100 positions of one permutation; every edge joins two members of one
    perm = np.random.default_rng(3).permutation(1050)
    pos = np.empty(1050, np.int64)
    pos[perm] = np.arange(1050)
    assert np.array_equal(pos[src] // 100, pos[dst] // 100)
