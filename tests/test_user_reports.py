"""What users hit, reproduced (the issue of exits that abort, metrics at the edges, caps that refuse)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
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
        assert "over features through the tiered store (gpu_cache 1.00 GiB" in text  # the backend, described
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
        from lightning_ooc import OutOfCoreLinkData, OutOfCoreNodeData, Tiered
        small = dict(batch_size=4, progress=False, features=Tiered(presample_batches=4),
                     pipeline=dict(extract_queue_size=5000, train_queue_size=4))
        for cls, root in ((OutOfCoreNodeData, {str(node)!r}), (OutOfCoreNodeData, {str(hetero)!r}),
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


_BY_HAND = {
    # learnable input features through the node datamodule: one epoch by hand, x's gradient updates the rows
    "learnable": """
        import torch
        from lightning_ooc import Learnable, OutOfCoreNodeData
        dm = OutOfCoreNodeData({graph!r}, batch_size=64, num_neighbors=[4], progress=False,
                               features=Learnable({table!r}, lr=0.05, gpu_cache="1MiB", staging="256KiB"),
                               pipeline=dict(order="in_order", num_samplers=1, num_extractors=1))
        dm.setup("fit")
        for i, batch in enumerate(dm.train_dataloader()):
            (batch.x * (i + 1.0)).sum().backward()
        """,
    # node embeddings through the partition buffer: one epoch by hand, the rows of each batch changed in place
    "embeddings": """
        import torch
        from lightning_ooc.embed import OutOfCoreEmbeddingData
        dm = OutOfCoreEmbeddingData({table!r}, batch_size=128, negatives=dict(num=8, chunk_size=32))
        dm.setup("fit")
        for b in dm.train_dataloader():
            with torch.no_grad():
                b.weight[b.src_rows] += 1.0
            b.done()
        """,
}


@pytest.mark.parametrize("kind", sorted(_BY_HAND))
def test_training_by_hand_and_exiting_without_teardown_writes_the_trained_rows_back(tmp_path, kind):
    """A script that trains in a plain loop and ends without ``teardown()`` lost what it had trained since
    the last write-back: learnable rows still in the feature buffer, partitions still in the partition buffer
    (one of five stayed as it was, silently). At exit they are now written back: the table equals the one
    the same script leaves when it calls ``teardown()`` itself, bit for bit, and differs from the one it
    started from."""
    import torch

    from lightning_ooc.embed import init_embeddings
    from lightning_ooc.embed.table import EmbeddingTable

    graph = synthesize(tmp_path / "g", num_nodes=3000, avg_degree=6, num_features=4, num_classes=3, progress=False)
    rng = np.random.default_rng(0)
    edges = {"train": (rng.integers(0, 400, 3000), rng.integers(0, 400, 3000))}
    tables = {}
    for how in ("teardown", "exit"):
        if kind == "learnable":
            table = init_embeddings(tmp_path / how, dataset=graph, dim=8, init="normal", scale=0.1, seed=0,
                                    progress=False)  # fmt: skip
        else:
            table = init_embeddings(tmp_path / how, num_nodes=400, dim=8, partitions=5, edges=edges, init="normal",
                                    scale=0.1, seed=0, progress=False)  # fmt: skip
        script = textwrap.dedent(_BY_HAND[kind].format(graph=str(graph), table=str(table)))
        if how == "teardown":
            script += 'dm.teardown("fit")\n'
        script += 'print("trained")\n'
        out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(), capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0 and out.stdout.strip() == "trained", out.stderr[-3000:]
        with EmbeddingTable(table) as t:  # opened for writing: a journal left to replay would be replayed here
            t.verify()
            tables[how] = t.rows(torch.arange(t.num_nodes))
    start = init_embeddings(tmp_path / "start", num_nodes=tables["exit"].shape[0], dim=8, init="normal", scale=0.1,
                            seed=0, progress=False, **({"edges": edges, "partitions": 5} if kind == "embeddings"
                                                       else {}))  # fmt: skip
    with EmbeddingTable(start, writable=False) as t:
        before = t.rows(torch.arange(t.num_nodes))
        bounds = [int(b) for b in t.bounds]
    assert torch.equal(tables["exit"], tables["teardown"])
    changed = (tables["exit"] != before).any(1)
    assert int(changed.sum()) > 0
    if kind == "embeddings":  # every partition was trained
        assert len(bounds) == 6 and all(changed[bounds[p] : bounds[p + 1]].any() for p in range(5))


def test_the_exit_registry_closes_the_last_registered_first_with_the_named_method():
    """A pass registered after the store it reads is closed before it (its threads stop before the store
    writes back); an object registered twice keeps its first place; one forgotten or collected is skipped."""
    import gc

    from lightning_ooc.utils import shutdown

    calls = []

    class Owner:
        def __init__(self, name):
            self.name = name

        def close(self):
            calls.append(("close", self.name))

        def teardown(self):
            calls.append(("teardown", self.name))

    saved = dict(shutdown._LIVE), dict(shutdown._BY_ID)
    shutdown._LIVE.clear()
    shutdown._BY_ID.clear()
    try:
        store, run, done, gone = Owner("store"), Owner("run"), Owner("done"), Owner("gone")
        shutdown.stop_at_exit(store, "teardown")
        shutdown.stop_at_exit(done)
        shutdown.stop_at_exit(run)
        shutdown.stop_at_exit(gone)
        shutdown.stop_at_exit(store, "teardown")  # again: keeps its first place
        shutdown.forget(done)
        del gone
        gc.collect()
        assert shutdown.registered() == [run, store]
        assert shutdown.stop_all() == 2
        assert calls == [("close", "run"), ("teardown", "store")]
        assert shutdown.registered() == []
        with pytest.raises(TypeError, match="no method flush"):
            shutdown.stop_at_exit(store, "flush")
    finally:
        shutdown._LIVE.update(saved[0])
        shutdown._BY_ID.update(saved[1])
