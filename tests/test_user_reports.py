"""What users hit, reproduced (the issue of exits that abort, metrics at the edges, caps that refuse)."""
from __future__ import annotations

import threading

import numpy as np

from lightning_ooc import OutOfCoreLinkData, OutOfCoreNodeData
from lightning_ooc.data.prepare import prepare_from_arrays
from lightning_ooc.data.synth import synthesize


def test_str_of_a_datamodule_describes_it_and_starts_nothing(tmp_path):
    """``print(dm)`` (Lightning's ``__str__`` calls every ``*_dataloader()`` and iterates what is not a
    ``DataLoader``) raised AttributeError after starting a pass; it now describes the settings only."""
    root = synthesize(tmp_path / "g", num_nodes=2000, avg_degree=4, num_features=8, num_classes=3, progress=False)
    rng = np.random.default_rng(0)
    links = prepare_from_arrays(tmp_path / "l", rng.integers(0, 300, (2, 2000)), rng.random((300, 4), np.float32),
                                split_edges=(0.8, 0.1, 0.1), progress=False)  # fmt: skip
    threads = threading.active_count()
    for dm in (OutOfCoreNodeData(root, batch_size=64, progress=False),
               OutOfCoreLinkData(links, batch_size=64, progress=False)):  # fmt: skip
        text = str(dm)
        assert text.startswith(type(dm).__name__ + "(") and "batch_size=64" in text and "not set up" in text
        assert repr(dm) == text
        assert dm.source is None and not dm.last_stats and dm._passes == {}
    assert threading.active_count() == threads
    dm = OutOfCoreNodeData(root, batch_size=64, progress=False)
    dm.setup("fit")
    try:
        assert "set up: 2000 nodes" in str(dm) and not dm.last_stats
    finally:
        dm.teardown("fit")


def test_a_failed_bench_epoch_run_reports_its_error_in_one_line(tmp_path):
    """``bench epoch`` put the tail of a traceback in the table's notes cell; it gives the error's line now
    (the tail stays in the JSON)."""
    from lightning_ooc.bench.epoch import _run_variant

    res = _run_variant({"root": str(tmp_path), "setting": "no-such-setting", "label": "ours", "variant": "ours"}, None)
    assert res["error"] == "exit 1: KeyError: 'no-such-setting'"
    assert "File " in res["error_tail"]  # the traceback's tail is kept beside it
