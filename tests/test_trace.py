"""OutOfCoreNodeData(pipeline=Pipeline(profile=DIR)): every pass writes its per-stage timeline as a Chrome trace."""
import json

import lightning as L

from lightning_ooc import OutOfCoreNodeData, Pipeline, Tiered
from lightning_ooc.models import GraphSAGE
from lightning_ooc.testing import make_synthetic

STAGES = {"sample", "claim", "fill", "wait", "gather", "train", "release", "ssd.read", "ssd.copy"}


def test_a_fit_with_profile_writes_a_chrome_trace_per_pass(tmp_path):
    ds = make_synthetic(tmp_path / "g", num_nodes=4000, avg_degree=6, num_features=16, num_classes=3,
                        train_frac=0.25, val_frac=0.05)  # fmt: skip
    dm = OutOfCoreNodeData(str(ds.root), batch_size=100, num_neighbors=[4, 3], progress=False,
                           features=Tiered(gpu_cache="4MiB", host_cache="4KiB", staging="256KiB"),
                           pipeline=Pipeline(num_samplers=2, num_extractors=2, profile=tmp_path / "traces"))
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(GraphSAGE(16, 3, hidden_channels=16, num_layers=2), datamodule=dm)
    names = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert names == ["ooc-rank0-train-000.trace.json", "ooc-rank0-train-001.trace.json",
                     "ooc-rank0-val-000.trace.json", "ooc-rank0-val-001.trace.json"], names  # fmt: skip

    doc = json.loads((tmp_path / "traces" / "ooc-rank0-train-001.trace.json").read_text())
    events = doc["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    # the Trace Event Format: complete events with a name, pid, tid, ts and dur in microseconds
    assert spans and all({"name", "pid", "tid", "ts", "dur"} <= set(e) and e["dur"] >= 0 and e["ts"] >= 0
                         for e in spans)  # fmt: skip
    assert STAGES <= {e["name"] for e in spans}, {e["name"] for e in spans}
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"ooc-train-sampler-0", "ooc-train-sampler-1", "ooc-train-extractor-0", "ooc-train-extractor-1",
            "ooc-train-releaser"} <= threads, threads  # fmt: skip
    n = dm._num_batches("train")
    for stage in ("sample", "claim", "fill", "gather"):  # once per batch, each naming its batch
        assert sorted(e["args"]["batch"] for e in spans if e["name"] == stage) == list(range(n)), stage
    by_tid = {}
    for e in spans:
        by_tid.setdefault(e["name"], set()).add(e["tid"])
    assert len(by_tid["gather"]) == 1 and by_tid["gather"] == by_tid["train"] == by_tid["wait"]  # the trainer
    assert not by_tid["sample"] & by_tid["gather"] and not by_tid["fill"] & by_tid["sample"]
    assert sum(1 for e in spans if e["name"] == "train") == n - 1  # every step but the last (the pass ends first)
    # SSD reads happen inside fills, on the extractor threads
    assert by_tid["ssd.read"] <= by_tid["fill"]


def test_without_profile_nothing_is_written(tmp_path):
    ds = make_synthetic(tmp_path / "g", num_nodes=2000, avg_degree=4, num_features=8, num_classes=2, train_frac=0.2)
    dm = OutOfCoreNodeData(str(ds.root), batch_size=100, num_neighbors=[3], progress=False)
    dm.setup("fit")
    run = dm.local.run("train", 0)
    assert run.timeline is None and len(list(run)) == dm._num_batches("train")
    dm.teardown("fit")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]
