"""What users hit, reproduced (the issue of exits that abort, metrics at the edges, caps that refuse)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
from jobs import _env

from lightning_ooc import OutOfCoreLinkData, OutOfCoreNodeData
from lightning_ooc.data.prepare import prepare_from_arrays
from lightning_ooc.data.synth import synthesize
from lightning_ooc.data.synth_hetero import synthesize_hetero


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


def test_a_script_that_takes_one_batch_and_exits_without_teardown_exits_cleanly(tmp_path):
    """``next(iter(dm.train_dataloader()))`` and exit (PyG's examples do it for their dummy forward pass) left the
    pass's sampler threads running into interpreter finalisation, which ended them inside native code:
    "terminate called without an active exception", status 134 (nearly every run with the link datamodule,
    most with the heterogeneous one). A run left going is now closed, and its threads joined, at exit."""
    node = synthesize(tmp_path / "g", num_nodes=2000, avg_degree=4, num_features=8, num_classes=3, progress=False)
    rng = np.random.default_rng(0)
    link = prepare_from_arrays(tmp_path / "l", rng.integers(0, 1000, (2, 20000)), rng.random((1000, 4), np.float32),
                               split_edges=(0.8, 0.1, 0.1), progress=False)  # fmt: skip
    hetero = synthesize_hetero(tmp_path / "h", "igbh", num_nodes=1000, num_features=8, num_classes=3,
                               train_frac=0.5, progress=False)  # fmt: skip
    # small batches and a deep sampled queue: the samplers are still busy in native code when the script ends
    script = textwrap.dedent(f"""
        from lightning_ooc import OutOfCoreHeteroNodeData, OutOfCoreLinkData, OutOfCoreNodeData
        small = dict(batch_size=4, progress=False, presample_batches=4, extract_queue_size=5000, train_queue_size=4)
        for cls, root in ((OutOfCoreNodeData, {str(node)!r}), (OutOfCoreHeteroNodeData, {str(hetero)!r}),
                          (OutOfCoreLinkData, {str(link)!r})):
            dm = cls(root, **small)
            dm.setup("fit")
            batch = next(iter(dm.train_dataloader()))
        print("took a batch of each")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert "terminate called" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == 0 and out.stdout.strip() == "took a batch of each", out.stderr[-3000:]
