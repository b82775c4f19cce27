"""`lightning-ooc bench epoch` runs every variant in its own process and reports ratios."""
import json
import shutil
import sys

import numpy as np
import pytest

from jobs import REPO

from lightning_ooc.cli import main
from lightning_ooc.testing import make_synthetic


def test_bench_epoch_small(tmp_path, capsys):
    """Full epochs of every variant, twice, interleaved; the floor from the replayed batches."""
    from lightning_ooc.bench.report import format_epoch

    ds = make_synthetic(tmp_path / "g", num_nodes=12000, num_features=128, train_frac=0.25)
    batches = -(-ds.split("train").numel() // 1000)  # every batch of the epoch
    out = tmp_path / "res" / "epoch"
    rc = main(["bench", "epoch", str(ds.root), "--settings", "light", "--gpu-cache", "40MiB", "--host-cache", "1MiB",
               "--staging", "2MiB", "--samplers", "1", "--extractors", "2", "--order", "in_order", "--repeats", "2",
               "--variants", "ours,device", "--fio-seconds", "1", "--out", str(out),
               "--profile", str(tmp_path / "timelines")])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    raw = out.with_suffix(".json").read_text()
    doc = json.loads(raw)
    runs = doc["results"]
    assert not any("error" in r for r in runs), runs
    # a result may be committed: it names no directory of this host (the dataset is named as given)
    for where in (str(tmp_path), str(REPO), sys.prefix):
        assert where not in raw, where
    assert doc["dataset"] == "g" and doc["command"].startswith("lightning-ooc bench epoch g ")
    # interleaved repeats: the whole list once, then again
    assert [(r["repeat"], r["label"]) for r in runs] == [(k, v) for k in (0, 1) for v in ("ours", "device")]
    for r in runs:  # full epochs, set-up included in the clock
        ends = r["batch_ends"]
        assert r["batches"] == batches and len(ends) == batches and ends == sorted(ends)
        assert 0 < r["setup_seconds"] < r["first_trained_seconds"] <= r["full_seconds"] and ends[0] == pytest.approx(
            r["first_trained_seconds"], abs=1e-3)
        assert r["full_seconds"] >= r["epoch_seconds"] > 0
    ours = [r for r in runs if r["variant"] == "ours"]
    for r in ours:
        assert 0 <= r["host_cache_hit_rate"] <= 1 and "feature buffer" in r["plan"]
        assert r["ios"] == r["epoch_rows_read"] + r["fill_rows"] and r["fill_rows"] > 0 and r["capacity_rows"] > 0
    # in order, the same seed batches: the same nodes per batch whatever the loader
    assert len({r["nodes_per_batch"] for r in runs}) == 1
    # the floor: the replay's distinct rows <= the optimal reads <= every access; no design reads fewer rows
    floor = doc["floor"]["light"]
    assert floor["batches"] == batches and floor["compulsory"] <= floor["accesses"]
    for r in ours:  # in order: the trained order is the index order
        assert r["trained_order"] == list(range(batches))
        opt = floor["optimal"][str(r["repeat"])]
        assert floor["compulsory"] <= opt <= floor["accesses"] and r["ios"] >= opt
        assert opt == floor["optimal_index_order"][str(r["capacity_rows"])]
    line = doc["roofline"]["light"]
    dev = [r["epoch_seconds"] for r in runs if r["variant"] == "device"]
    assert line["compute"] == pytest.approx(sum(dev) / 2)  # the median of two runs
    if shutil.which("fio"):
        assert len(doc["fio"]["random"]) == 1 + len(runs) and doc["fio"]["jobs"] == 2  # one job per extractor
        assert all(len(r["fio_iops"]) == 2 for r in runs)
        iops = sum(ours[0]["fio_iops"]) / 2
        opt = floor["optimal"]["0"]
        assert line["io_floor"]["min"] <= opt / iops <= line["io_floor"]["max"]
        assert 0 < line["engine_efficiency"]["median"] and line["reads_over_optimal"]["median"] >= 1
    assert text.count("| light | ") >= 3 and "engine efficiency" in text and out.with_suffix(".png").exists()
    assert format_epoch(doc) in text  # what `bench report` renders from the JSON is what the run printed
    # runs stopped before the end (the JSON is written after every run) are finished with --finish
    partial = {k: v for k, v in doc.items() if k not in ("floor", "summary", "roofline")}
    (tmp_path / "partial.json").write_text(json.dumps({**partial, "partial": True}))
    assert main(["bench", "epoch", str(ds.root), "--finish", str(tmp_path / "partial.json"), "--no-fio",
                 "--out", str(tmp_path / "done")]) == 0  # fmt: skip
    done = json.loads((tmp_path / "done.json").read_text())
    assert "partial" not in done and done["command"] == doc["command"]
    for key in ("optimal", "compulsory", "accesses", "batches"):
        assert done["floor"]["light"][key] == floor[key], key
    # a run past --run-timeout is stopped (its process group) and recorded as a lower bound
    assert main(["bench", "epoch", str(ds.root), "--settings", "light", "--variants", "ours", "--no-fio",
                 "--run-timeout", "1", "--out", str(tmp_path / "cut")]) == 0  # fmt: skip
    (row,) = json.loads((tmp_path / "cut.json").read_text())["results"]
    assert row["timed_out"] and "stopped by --run-timeout" in row["error"] and row["lower_bound_seconds"] >= 0
    # --profile: a timeline of each pipeline variant's training pass (the first repeat's), with its spans
    for variant, spans in (("ours", {"sample", "fill", "ssd.read", "train"}), ("device", {"sample", "train"})):
        (path,) = (tmp_path / "timelines" / f"light-{variant}").glob("*.trace.json")
        events = json.loads(path.read_text())["traceEvents"]
        assert spans <= {e["name"] for e in events if e.get("ph") == "X"}, (variant, path)
    assert sorted(p.name for p in (tmp_path / "timelines").iterdir()) == ["light-device", "light-ours"]


def test_the_loader_alone_setting(tmp_path, capsys):
    """``--settings loader``: no model, every byte of x read; every variant reads the same rows (the same sum),
    the CPU per batch is counted, and the defaults variant is compared with its own optimal reads."""
    from lightning_ooc.bench.report import format_epoch

    ds = make_synthetic(tmp_path / "g", num_nodes=12000, num_features=128, train_frac=0.25)
    batches = -(-ds.split("train").numel() // 1000)
    out = tmp_path / "res" / "epoch"
    rc = main(["bench", "epoch", str(ds.root), "--settings", "loader", "--variants", "ours,defaults,mmap-random",
               "--gpu-cache", "40MiB", "--host-cache", "1MiB", "--staging", "2MiB", "--samplers", "1",
               "--extractors", "2", "--order", "in_order", "--no-fio", "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.with_suffix(".json").read_text())
    runs = {r["label"]: r for r in doc["results"]}
    assert set(runs) == {"ours", "defaults", "mmap-random"} and not any("error" in r for r in runs.values())
    # the features, summed as the steps read them: the same batches over every loader
    x = np.fromfile(ds.features_path, dtype=np.float32).reshape(ds.num_nodes, -1)
    assert all(r["batches"] == batches for r in runs.values())
    sums = [r["touched"] for r in runs.values()]
    assert sums[0] != 0 and sums == pytest.approx([sums[0]] * 3, rel=1e-5)
    assert abs(sums[0]) <= float(np.abs(x).sum()) * ds.num_nodes  # a sum of rows of x, not of anything else
    for r in runs.values():  # CPU seconds: the process and its children, from the clock's start
        assert 0 < r["cpu_first_seconds"] <= r["cpu_seconds"]
        assert r["cpu_seconds_per_batch"] == pytest.approx(r["cpu_seconds"] / batches)
        assert r["steady_cpu_seconds_per_batch"] >= 0
    # the defaults variant plans its own budgets and pipeline: not those of the flags
    assert "staging            2.00 MiB" in runs["ours"]["plan"] and "staging            2.00 MiB" not in runs["defaults"]["plan"]
    floor = doc["floor"]["loader"]
    assert set(floor["optimal"]) == {"0", "defaults/0"}
    for key, label in (("0", "ours"), ("defaults/0", "defaults")):
        assert floor["compulsory"] <= floor["optimal"][key] <= runs[label]["ios"]
    table = format_epoch(doc)
    assert table in text and "| loader | defaults | 1 |" in table and "CPU s/batch (steady)" in table
    row = [ln for ln in table.splitlines() if ln.startswith("| loader | defaults | 1 | ")][-1]  # the loader table
    ratio = runs["defaults"]["ios"] / floor["optimal"]["defaults/0"]
    assert f"| {ratio:.2f} |" in row  # reads over optimal, against its own plan's memory


def test_the_pyg_baseline_is_a_clear_row_where_pyg_cannot_sample(tmp_path, capsys, monkeypatch):
    from lightning_ooc.bench import pyg_reference

    ok, why = pyg_reference.available()
    if ok:  # a machine with pyg-lib or torch-sparse: the variant must run and sample the same seeds
        ds = make_synthetic(tmp_path / "g", num_nodes=6000, num_features=16, train_frac=0.4)
        out = tmp_path / "res" / "epoch"
        rc = main(["bench", "epoch", str(ds.root), "--settings", "light", "--max-batches", "2", "--pyg-workers", "0,1",
                   "--variants", "ours,pyg", "--order", "in_order", "--no-fio", "--out", str(out)])  # fmt: skip
        assert rc == 0
        doc = json.loads(out.with_suffix(".json").read_text())
        res = {r["label"]: r for r in doc["results"]}
        assert set(res) == {"ours", "pyg-w0", "pyg-w1"}
        assert all("error" not in res[k] and res[k]["batches"] == 2 for k in ("pyg-w0", "pyg-w1"))
        assert doc["roofline"]["light"]["pyg_best"] in ("pyg-w0", "pyg-w1")
        return
    ds = make_synthetic(tmp_path / "g", num_nodes=3000, num_features=8, train_frac=0.2)
    out = tmp_path / "res" / "epoch"
    rc = main(["bench", "epoch", str(ds.root), "--settings", "light", "--max-batches", "1", "--variants", "pyg",
               "--no-fio", "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [r["label"] for r in rows] == ["pyg-w0", "pyg-w1", "pyg-w2"]  # each worker count a run of its own
    assert all(r["variant"] == "pyg" and r["error"] == f"skipped: {why}" for r in rows)
    assert "pyg-lib or torch-sparse" in text


@pytest.mark.slow  # PyG's loaders over our stores run in make test (test_pyg_stores.py)
def test_pyg_loaders_over_our_stores_are_a_variant(tmp_path, capsys):
    """pyg-store: PyG's NeighborLoader over our store pair with our sampler, once per worker count; it needs no
    pyg-lib or torch-sparse, and trains the same seed batches."""
    ds = make_synthetic(tmp_path / "g", num_nodes=6000, num_features=16, train_frac=0.4)
    out = tmp_path / "res" / "epoch"
    rc = main(["bench", "epoch", str(ds.root), "--settings", "light", "--max-batches", "2", "--pyg-workers", "0,1",
               "--variants", "ours,pyg-store", "--host-cache", "64KiB", "--store-host-cache", "32KiB", "--order", "in_order", "--no-fio",
               "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    res = {r["label"]: r for r in json.loads(out.with_suffix(".json").read_text())["results"]}
    assert set(res) == {"ours", "pyg-store-w0", "pyg-store-w1"}
    assert all("error" not in r and r["batches"] == 2 for r in res.values()), res
    # the same seeds, about the same subgraphs (each loader draws its own sampling seeds)
    assert abs(res["pyg-store-w0"]["nodes_per_batch"] / res["ours"]["nodes_per_batch"] - 1) < 0.1
    assert "| light | pyg-store-w1 |" in text and "PyG's loader over our stores (best)" in text


@pytest.mark.slow
def test_bench_epoch_link_setting(tmp_path, capsys):
    """The link setting: OutOfCoreLinkData against the synchronous link baselines (and PyG's
    LinkNeighborLoader where it can sample), on the same edges; chosen by default when the dataset has link splits."""
    from lightning_ooc.bench import pyg_reference
    from lightning_ooc.data.prepare import prepare_from_dataset

    g = make_synthetic(tmp_path / "g", num_nodes=4000, num_features=16, train_frac=0.2)
    with pytest.raises(SystemExit, match="--split-edges"):
        main(["bench", "epoch", str(g.root), "--settings", "link", "--no-fio"])
    root = prepare_from_dataset(tmp_path / "links", g.root, split_edges=(0.9, 0.05, 0.05), progress=False)
    out = tmp_path / "res" / "epoch"
    pyg_ok = pyg_reference.available()[0]
    variants = "ours,mmap,mmap-random,ram,device,pyg-store" + (",pyg" if pyg_ok else "")
    rc = main(["bench", "epoch", str(root), "--settings", "link", "--max-batches", "3", "--gpu-cache", "4MiB", "--host-cache", "64KiB",
               "--staging", "1MiB", "--samplers", "1", "--extractors", "2", "--order", "in_order", "--variants",
               variants, "--pyg-workers", "0", "--fio-seconds", "1", "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.with_suffix(".json").read_text())
    res = {r["variant"]: r for r in doc["results"] if r["setting"] == "link"}
    assert set(res) == set(variants.split(",")) and not any("error" in r for r in res.values()), res
    assert all(r["batches"] == 3 for r in res.values())
    # in order the same link batches (edges, negatives, subgraphs) whatever the loader
    ours = {v: r for v, r in res.items() if v not in ("pyg", "pyg-store")}
    assert len({r["nodes_per_batch"] for r in ours.values()}) == 1
    assert res["ours"]["nodes_per_batch"] > 128 * 2  # the endpoints of 128 edges and 128 negatives, and more
    for v in ("pyg", "pyg-store") if pyg_ok else ("pyg-store",):  # PyG draws its own negatives: about as many nodes
        assert abs(res[v]["nodes_per_batch"] / res["ours"]["nodes_per_batch"] - 1) < 0.2
    assert doc["roofline"]["link"]["compute"] == res["device"]["epoch_seconds"]
    assert "| link | mmap-random |" in text
    floor = doc["floor"]["link"]
    assert floor["batches"] == 3 and floor["optimal"]["0"] <= res["ours"]["ios"]


def test_the_default_settings_are_those_the_dataset_can_run(tmp_path):
    import lightning_ooc
    from lightning_ooc.bench.epoch import choose_settings
    from lightning_ooc.data.prepare import prepare_from_arrays, prepare_from_dataset

    g = make_synthetic(tmp_path / "g", num_nodes=500, num_features=4, train_frac=0.2)
    assert choose_settings(g, "auto") == ["papers", "light"]
    both = lightning_ooc.open_dataset(prepare_from_dataset(tmp_path / "l", g.root, split_edges=(0.8, 0.1, 0.1),
                                                           progress=False))  # fmt: skip
    assert choose_settings(both, "auto") == ["papers", "light", "link"]
    assert choose_settings(both, "link, light") == ["link", "light"]
    assert choose_settings(g, "loader") == ["loader"]  # run only when named
    rng = np.random.default_rng(0)
    unlabelled = lightning_ooc.open_dataset(prepare_from_arrays(
        tmp_path / "u", rng.integers(0, 50, (2, 300)), rng.random((50, 4), dtype=np.float32),
        split_edges=(0.8, 0.1, 0.1), progress=False))  # fmt: skip
    assert choose_settings(unlabelled, "auto") == ["link"]
    with pytest.raises(SystemExit, match="no node labels"):
        choose_settings(unlabelled, "light")
    with pytest.raises(SystemExit, match="unknown setting"):
        choose_settings(both, "fast")


@pytest.mark.slow
def test_bench_epoch_heterogeneous_settings(tmp_path, capsys):
    """The heterogeneous settings: OutOfCoreNodeData against the synchronous baselines and the device
    tables, on the same seed batches with the same R-GAT; chosen by default on a heterogeneous dataset."""
    from lightning_ooc.bench.epoch import choose_settings
    from lightning_ooc.data.dataset import open_dataset
    from lightning_ooc.data.synth_hetero import synthesize_hetero

    root = synthesize_hetero(tmp_path / "igbh", "igbh", num_nodes=5000, num_features=16, num_classes=4,
                             train_frac=0.45, seed=0, progress=False)  # fmt: skip
    ds = open_dataset(root)
    assert choose_settings(ds, "auto") == ["rgat", "rgat-light"]
    with pytest.raises(SystemExit, match="needs a homogeneous dataset"):
        choose_settings(ds, "light")
    out = tmp_path / "res" / "epoch"
    rc = main(["bench", "epoch", str(root), "--settings", "rgat-light", "--max-batches", "2", "--gpu-cache", "16MiB",
               "--host-cache", "32KiB", "--staging", "4MiB", "--samplers", "1", "--extractors", "2", "--order",
               "in_order", "--variants", "ours,mmap-random,ram,device,pyg-store", "--pyg-workers", "0", "--fio-seconds",
               "1", "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.with_suffix(".json").read_text())
    res = {r["variant"]: r for r in doc["results"]}
    assert set(res) == {"ours", "mmap-random", "ram", "device", "pyg-store"}
    assert not any("error" in r for r in res.values()), res
    assert all(r["batches"] == 2 for r in res.values())
    # the same batches whatever the loader (PyG's loader over our stores draws its own sampling seeds)
    assert len({res[v]["nodes_per_batch"] for v in res if v != "pyg-store"}) == 1
    assert "node type paper" in res["ours"]["plan"] and "| rgat-light | ours |" in text
    assert res["ours"]["ios_per_batch"] > 0 and res["ours"]["capacity_rows"] is None
    assert "several node types" in doc["floor"]["rgat-light"]["why"]
