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
