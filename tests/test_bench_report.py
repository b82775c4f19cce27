"""`lightning-ooc bench report`: BENCHMARKS.md's tables are rendered from the committed raw results."""
import json
import re

import pytest

from jobs import REPO

from lightning_ooc.bench.report import epoch_roofline, format_epoch, rebuild
from lightning_ooc.cli import main


def _run(label, variant, repeat, full, **kw):
    return {"setting": "light", "variant": variant, "label": label, "repeat": repeat, "batches": 10,
            "full_seconds": full, "setup_seconds": 1.0, "first_trained_seconds": 2.0, "epoch_seconds": full - 1.0,
            "steady_seconds_per_batch": 0.1, "nodes_per_batch": 500.0, "data_wait_seconds": 0.5,
            "device_read_bytes": 2**30, **kw}


def _doc():
    runs = []
    for r in range(3):
        runs.append(_run("ours", "ours", r, 10.0 + r, ios=12_000, capacity_rows=500, fio_iops=[1000.0, 3000.0]))
        runs.append(_run("pyg-w0", "pyg", r, 60.0 + r))
        runs.append(_run("pyg-w2", "pyg", r, 40.0 + 2 * r))
        runs.append(_run("device", "device", r, 5.0))
    return {"kind": "epoch", "command": "lightning-ooc bench epoch g", "commit": "abc", "results": runs,
            "floor": {"light": {"batches": 10, "accesses": 20_000, "compulsory": 4_000,
                                  "optimal": {"0": 8_000, "1": 8_000, "2": 8_000}}}}


def test_the_roofline_arithmetic():
    line = epoch_roofline(_doc())["light"]
    assert line["compute"] == 4.0  # the device variant's epoch after its set-up
    assert line["optimal"]["median"] == 8_000 and line["iops"]["median"] == 2000.0
    assert line["io_floor"]["median"] == 4.0  # 8,000 optimal reads at 2,000 IOPS
    assert line["reads_over_optimal"]["median"] == 1.5  # 12,000 of ours / 8,000
    assert line["engine_efficiency"]["median"] == 12_000 / 2000.0 / 11.0  # the median run (11 s)
    assert line["ratio"]["min"] == 10.0 / 4.0 and line["ratio"]["max"] == 12.0 / 4.0
    assert line["pyg_best"] == "pyg-w2" and line["pyg_best_speedup"] == 42.0 / 11.0


def test_pyg_over_our_stores_against_pyg_over_the_memory_map():
    """Each at its best worker count; where every PyG run was stopped, its shortest stop is a lower bound."""
    doc = _doc()
    doc["results"] += [_run("pyg-store-w0", "pyg-store", r, 20.0 + r) for r in range(3)]
    doc["results"] += [_run("pyg-store-w1", "pyg-store", r, 15.0) for r in range(3)]
    text = format_epoch(doc)
    assert "| light | pyg-store-w1 | 15.0 | pyg-w2 | 42.0 (40.0-44.0) | 2.80x |" in text
    doc["results"] = [r for r in doc["results"] if r["variant"] != "pyg"] + [
        {"setting": "light", "variant": "pyg", "label": "pyg-w0", "repeat": 0, "error": "stopped", "timed_out": True,
         "lower_bound_seconds": 90.0},
        {"setting": "light", "variant": "pyg", "label": "pyg-w1", "repeat": 0, "error": "stopped", "timed_out": True,
         "lower_bound_seconds": 60.0}]  # fmt: skip
    assert "| light | pyg-store-w1 | 15.0 | pyg-w0, pyg-w1 (stopped) | > 60 | > 4.00x |" in format_epoch(doc)


def test_report_blocks_are_rebuilt_from_their_json_and_checked(tmp_path, capsys):
    res = tmp_path / "results" / "epoch.json"
    res.parent.mkdir()
    res.write_text(json.dumps(_doc()))
    md = tmp_path / "B.md"
    md.write_text("# B\n\ntext before\n<!-- report results/epoch.json -->\nstale table\n<!-- /report -->\nafter\n")
    assert main(["bench", "report", str(md), "--check"]) == 1
    assert "1 of 1 report block(s) differ" in capsys.readouterr().err
    assert main(["bench", "report", str(md)]) == 0
    text = md.read_text()
    assert format_epoch(_doc()) in text and "stale table" not in text and text.startswith("# B\n\ntext before\n")
    assert text.endswith("<!-- /report -->\nafter\n")
    assert main(["bench", "report", str(md), "--check"]) == 0
    assert "| light | pyg-w2 | 3 |" in text and "3.82x faster than pyg-w2" in text
    # a changed result is a stale table
    doc = _doc()
    doc["results"][0]["full_seconds"] = 9.0
    res.write_text(json.dumps(doc))
    assert main(["bench", "report", str(md), "--check"]) == 1
    new, changed = rebuild(md.read_text(), tmp_path)
    assert changed == ["results/epoch.json"] and new != md.read_text()


def test_benchmarks_md_tables_match_the_committed_results(capsys):
    md = REPO / "BENCHMARKS.md"
    paths = [p for block in re.findall(r"<!-- report (\S+(?: \S+)*?) -->", md.read_text()) for p in block.split()]
    assert paths, "BENCHMARKS.md has no table rendered from raw results"
    for p in paths:
        doc = json.loads((REPO / p).read_text())
        assert p.startswith("benchmarks/results/") and doc.get("command") and doc.get("commit") and doc.get("date")
        assert doc.get("machine"), p
    assert main(["bench", "report", str(md), "--check"]) == 0, capsys.readouterr().err


def test_bench_io_result_renders_its_table(tmp_path, capsys):
    """A `bench io` result is a report block's source too: its JSON renders the table the run printed."""
    from lightning_ooc.bench import io as bench_io
    from lightning_ooc.bench.report import render_file
    from lightning_ooc.testing import make_synthetic

    ds = make_synthetic(tmp_path / "g", num_nodes=3000, num_features=128)
    path = tmp_path / "io.json"
    assert bench_io.main([str(ds.root), "--backends", "pread,mmap", "--queue-depths", "4", "--patterns", "uniform",
                          "--orders", "unsorted", "--batch-size", "64", "--seconds", "0.2", "--max-batches", "8",
                          "--no-fio", "--warm", "--json", str(path)]) == 0  # fmt: skip
    doc = json.loads(path.read_text())
    assert doc["kind"] == "io" and [r["backend"] for r in doc["results"]] == ["pread", "mmap"] and "commit" in doc
    table = render_file(path)
    assert table == doc["table"] and table in capsys.readouterr().out and "| uniform | unsorted | pread" in table


def test_a_result_written_into_the_results_folder_does_not_make_the_code_dirty(tmp_path):
    import subprocess

    from lightning_ooc.bench.system import code_version

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    clean = code_version(tmp_path)
    assert len(clean["commit"]) == 40 and clean["dirty"] is False
    (tmp_path / "benchmarks" / "results" / "r.json").write_text('{"runs": 1}')  # the run writes its result
    assert code_version(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert code_version(tmp_path)["dirty"] is True


def test_synth_json_records_the_graph_and_renders_as_a_table_line(tmp_path):
    """`synth --json` writes what the run made and took; a block naming two such results is one table."""
    from lightning_ooc.bench.report import render_files

    paths = []
    for n in (3000, 5000):
        out, res = tmp_path / f"g{n}", tmp_path / "results" / f"synth-{n}.json"
        assert main(["synth", "--out", str(out), "--nodes", str(n), "--avg-degree", "4", "--dim", "8", "--classes",
                     "3", "--no-progress", "--json", str(res)]) == 0  # fmt: skip
        doc = json.loads(res.read_text())
        meta = json.loads((out / "meta.json").read_text())
        assert doc["kind"] == "synth" and doc["dataset"] == out.name and doc["command"] and doc["machine"]
        assert doc["num_nodes"] == n and doc["num_edges"] == meta["num_edges"] and doc["num_features"] == 8
        assert doc["disk_bytes"] == sum(f.stat().st_size for f in out.iterdir()) and doc["peak_rss_bytes"] > 2**20
        assert 0 < doc["seconds"] < 600
        paths.append(res)
    table = render_files(paths).splitlines()
    assert len(table) == 4 and table[2].startswith("| `g3000` | 3,000 | ") and table[3].startswith("| `g5000` | 5,000 |")


def _sized(nodes, seeds, scale):
    doc = _doc()
    for r in doc["results"]:
        r["full_seconds"] *= scale
        if r["variant"] == "ours":
            r["ios"] *= scale
    doc["floor"]["light"]["optimal"] = {k: v * scale for k, v in doc["floor"]["light"]["optimal"].items()}
    doc["dataset"] = f"/data/g{nodes}"
    doc["dataset_facts"] = {"nodes": nodes, "edges": 5 * nodes, "feature_bytes": 512 * nodes, "seeds": seeds}
    doc["memory_cap"] = 128 * nodes
    return doc


def test_results_of_several_graph_sizes_render_the_cost_per_seed(tmp_path):
    from lightning_ooc.bench.report import format_scaling, plot_scaling, render_files, scaling_points

    small, large = _sized(1000, 10_000, 1), _sized(4000, 40_000, 3)
    points = scaling_points([large, small])
    assert [(p["nodes"], p["seeds"], p["full_seconds"]) for p in points] == [(4000, 40_000, 33.0), (1000, 10_000, 11.0)]
    assert points[0]["io_floor"] == 12.0 and points[0]["ios"] == 36_000  # 24,000 optimal reads at 2,000 IOPS
    lines = format_scaling([large, small]).splitlines()
    # ordered by size; 11 s over 10,000 seeds = 1.10 ms; floor 4 s = 0.40 ms; 12,000 reads = 1.2 a seed
    assert lines[2] == "| light | `g1000` | 1,000 | 4.0x | 10,000 | 11.0 | 1.10 | 0.40 | 2.75 | 1.2 | 0.8 | 0.4 |"
    assert lines[3] == "| light | `g4000` | 4,000 | 4.0x | 40,000 | 33.0 | 0.82 | 0.30 | 2.75 | 0.9 | 0.6 | 0.1 |"
    # a report block naming both results renders that table; results of two kinds in one block are refused
    for name, doc in (("a", small), ("b", large)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    md = tmp_path / "B.md"
    md.write_text("<!-- report a.json b.json -->\n<!-- /report -->\n")
    assert main(["bench", "report", str(md)]) == 0 and "\n".join(lines) in md.read_text()
    (tmp_path / "c.json").write_text(json.dumps({"kind": "synth"}))
    with pytest.raises(SystemExit, match="all are of one kind"):
        render_files([tmp_path / "a.json", tmp_path / "c.json"])
    png = tmp_path / "scaling.png"
    assert plot_scaling([small, large], png) == f"plot: {png}" and png.read_bytes()[:4] == b"\x89PNG"
def test_a_graph_where_ours_could_not_run_is_a_line_with_its_reason():
    from lightning_ooc.bench.report import format_scaling

    tiny = _sized(250, 2_500, 1)
    for r in tiny["results"]:
        if r["variant"] == "ours":
            r.clear()
            r.update(setting="light", variant="ours", label="ours", repeat=0,
                     error="exit 1: Traceback\n  File x\nlightning_ooc.errors.InputError: the plan does not fit | here")
    lines = format_scaling([tiny, _sized(1000, 10_000, 1)]).splitlines()
    assert lines[2] == "| light | `g250` | 250 | 4.0x | - | did not run: the plan does not fit / here | | | | | | |"
    assert lines[3].startswith("| light | `g1000` | 1,000 | 4.0x | 10,000 | 11.0 |")


def test_a_result_does_not_name_this_process_cgroup(monkeypatch):
    from lightning_ooc.bench import system

    own = "/sys/fs/cgroup/memory/jobs/abc123"
    monkeypatch.setattr(system, "_memory_controller", lambda: ("memory.limit_in_bytes", system.Path(own)))
    assert own + "/" in system.private_prefixes()
    assert system.scrub({"error": f"cgroup v1 {own}/child: memory.limit_in_bytes"}, system.private_prefixes()) == {
        "error": "cgroup v1 child: memory.limit_in_bytes"}


def test_bench_import_small(tmp_path, capsys):
    """``bench import`` writes an IGB layout, reads it once, imports it in a child process and reports both; the
    imported dataset is the layout's graph."""
    import numpy as np

    import lightning_ooc
    from lightning_ooc.bench.report import render_file

    out = tmp_path / "import.json"
    rc = main(["bench", "import", "--nodes", "5000", "--edges", "40000", "--dim", "8", "--memory-cap", "none",
               "--workdir", str(tmp_path / "w"), "--keep", "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.read_text())
    assert doc["kind"] == "import" and doc["import"]["returncode"] == 0 and doc["read_once_seconds"] > 0
    assert doc["ratio_to_read_once"] == pytest.approx(doc["import"]["seconds"] / doc["read_once_seconds"])
    ds = lightning_ooc.open_dataset(tmp_path / "w" / "imported")
    edges = np.load(tmp_path / "w" / "igb-5000-40000-8" / "processed" / "paper__cites__paper" / "edge_index.npy")
    assert ds.num_edges == 40000 and np.array_equal(np.bincount(edges[:, 1], minlength=5000), np.diff(ds.indptr))
    assert ds.features_offset == 128  # used in place
    table = render_file(out)
    assert "5,000 nodes, 40,000 edges" in table and f"{doc['import']['seconds']:.1f} s" in table


def test_bench_infer_small(tmp_path, capsys):
    """``bench infer`` runs layer-wise and PyG-in-memory inference in child processes; the report gives each
    layer's bytes moved against what its schedule must move, and the bound."""
    from lightning_ooc.bench.report import render_file
    from lightning_ooc.data.synth import synthesize

    root = synthesize(tmp_path / "g", num_nodes=8000, avg_degree=5, num_features=16, num_classes=4,
                      progress=False)  # fmt: skip
    out = tmp_path / "infer.json"
    rc = main(["bench", "infer", str(root), "--workdir", str(tmp_path / "w"), "--memory", "1MiB",
               "--variants", "layerwise,pyg", "--seq-gib", "0.001", "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.read_text())
    lw = doc["results"]["layerwise"]
    assert doc["kind"] == "infer" and lw["ok"] and doc["results"]["pyg"]["ok"]
    assert lw["partitions"] > 1 and [layer["layer"] for layer in lw["layers"]] == [1, 2, 3]
    for layer in lw["layers"]:
        assert sum(layer["moved"].values()) >= sum(layer["expected"].values()) > 0
        assert layer["bound_seconds"] > 0 and 0 <= layer["io_seconds"] <= layer["seconds"]
        # the goal's bytes: three times the layer's input table and every edge's message at the hidden width
        assert layer["goal_bytes"] == 3 * layer["input_table_bytes"] + doc["num_edges"] * 64 * 4
        assert layer["moved_over_goal"] == sum(layer["moved"].values()) / layer["goal_bytes"]
    assert lw["layers"][0]["input_table_bytes"] == 8000 * 16 * 4
    table = render_file(out)
    assert "layer-wise, out of core (ours)" in table and f"{lw['seconds']:.1f}" in table
    assert f"{lw['layers'][0]['moved_over_goal']:.2f} |" in table
    assert not (tmp_path / "w" / "layerwise-out").exists()


def test_infer_results_of_several_graphs_make_one_growth_table(tmp_path):
    from lightning_ooc.bench.report import render_files

    def doc(name, nodes, edges, ours, pyg, moved):
        layers = [{"layer": 1, "moved": {"input": moved}, "input_table_bytes": nodes * 64, "moved_over_goal": 0.5}]
        d = {"kind": "infer", "dataset": name, "num_nodes": nodes, "num_edges": edges, "feature_bytes": nodes * 64,
             "memory": nodes * 16, "results": {"layerwise": {"ok": True, "seconds": ours, "layers": layers},
                                               "pyg": {"ok": pyg is not None, "seconds": pyg}}}  # fmt: skip
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(d))
        return path

    table = render_files([doc("big", 4_000_000, 20_000_000, 80.0, None, 4_000_000 * 64 * 6),
                          doc("small", 1_000_000, 5_000_000, 10.0, 5.0, 1_000_000 * 64 * 3)])  # fmt: skip
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert rows[0].startswith("| `small` | 1,000,000 |") and rows[1].startswith("| `big` | 4,000,000 |")
    assert "| 4.0x | 10.0 | 5.0 | 2.00 | 3.0 | 0.50 | 2.00 |" in rows[0]  # 10 s over 5M edges: 2 us per edge
    assert "| 80.0 | - | - | 6.0 |" in rows[1]  # PyG did not run there
    png = tmp_path / "growth.png"
    assert main(["bench", "report", "--plot-scaling", str(png), "--results", str(tmp_path / "small.json"),
                 str(tmp_path / "big.json")]) == 0  # fmt: skip
    assert png.stat().st_size > 0


def test_bench_infer_heterogeneous_small(tmp_path, capsys):
    """Over a heterogeneous dataset ``bench infer`` runs the relational model layer-wise and in memory; the report
    names the model and each type's partitions."""
    from lightning_ooc.bench.report import render_file
    from lightning_ooc.data.synth_hetero import synthesize_hetero

    root = synthesize_hetero(tmp_path / "mag", "mag", num_nodes=3000, num_features=16, num_classes=4, progress=False)
    out = tmp_path / "infer.json"
    rc = main(["bench", "infer", str(root), "--workdir", str(tmp_path / "w"), "--memory", "1MiB", "--hidden", "16",
               "--variants", "layerwise,pyg", "--seq-gib", "0.001", "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.read_text())
    lw = doc["results"]["layerwise"]
    assert lw["ok"] and doc["results"]["pyg"]["ok"] and doc["num_nodes"] == 3000
    assert lw["partitions"]["paper"] > 1 and [layer["kind"] for layer in lw["layers"]][-1] == "node-wise"
    for layer in lw["layers"]:
        assert sum(layer["moved"].values()) >= sum(layer["expected"].values()) > 0
    table = render_file(out)
    assert "R-SAGE on 'paper'" in table and "paper " in table


def test_mps_split_runs_are_rows_of_their_own_and_say_when_the_split_was_not_in_force():
    """``--mps-split`` runs are ours under a split: each its own row beside ours, never one of ours' runs in the
    roofline; a run that fell back to no split says so in its row."""
    doc = _doc()
    doc["results"] += [_run("ours-mps10", "ours", r, 9.0, ios=99_999, capacity_rows=500, fio_iops=[1000.0],
                            mps={"split": 10, "active": True, "gather_in_producer": True}) for r in range(3)]  # fmt: skip
    doc["results"] += [_run("ours-mps20", "ours", r, 12.0, mps={"split": 20, "active": False,
                                                                 "gather_in_producer": False}) for r in range(3)]  # fmt: skip
    line = epoch_roofline(doc)["light"]
    assert line["ios"]["median"] == 12_000  # ours' runs only: the split runs' reads are not mixed in
    text = format_epoch(doc)
    assert "| light | ours-mps10 | 3 |" in text and "| 0.82x |" in text  # 9 s against ours' 11 s
    assert "| light | ours-mps20 (MPS not in force: no split) | 3 |" in text


def test_bench_epoch_runs_ours_once_more_per_mps_split(tmp_path, capsys):
    """On a machine without MPS the split runs still run, under OutOfCoreStrategy, and record that the split
    was not in force (so their figures are never read as a split's)."""
    from lightning_ooc.data.synth import synthesize

    root = synthesize(tmp_path / "g", num_nodes=3000, avg_degree=5, num_features=8, num_classes=3, progress=False)
    out = tmp_path / "e"
    assert main(["bench", "epoch", str(root), "--settings", "light", "--variants", "ours", "--mps-split", "10",
                 "--max-batches", "2", "--no-fio", "--no-floor", "--out", str(out)]) == 0  # fmt: skip
    res = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [r["label"] for r in res] == ["ours", "ours-mps10"]
    assert "error" not in res[1] and res[1]["batches"] == res[0]["batches"] > 0
    assert res[1]["mps"] == {"split": 10, "active": False, "gather_in_producer": False}
    assert "mps" not in res[0]
    assert "ours-mps10 (MPS not in force: no split)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="percentages between 1 and 99"):
        main(["bench", "epoch", str(root), "--variants", "ours", "--mps-split", "100", "--out", str(out)])
