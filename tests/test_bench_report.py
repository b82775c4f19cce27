"""`lightning-ooc bench report`: BENCHMARKS.md's tables are rendered from the committed raw results."""
import json
import re

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
    paths = re.findall(r"<!-- report (\S+) -->", md.read_text())
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
    assert doc["kind"] == "io" and [r["backend"] for r in doc["results"]] == ["pread", "mmap"]
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
