"""The GPU path's logic, tested on the CPU: what reaches CUDA, on which device, and what is cleaned up."""
import doctest
import logging
import types

import pytest
import torch

from lightning_ooc.store import pinning


class _RecordingStrategy:
    """Stands in for a Lightning strategy: records the device of every tensor given to ``reduce``."""

    def __init__(self, root_device):
        self.root_device = torch.device(root_device)
        self.devices = []

    def reduce(self, t, reduce_op="mean"):
        self.devices.append(t.device)
        return torch.zeros(t.shape, dtype=t.dtype)  # what a reduce hands back, on the CPU for the test


def _trainer(strategy):
    return types.SimpleNamespace(world_size=2, strategy=strategy, logger=None, sanity_checking=False, global_step=0)


# -- 1. collectives get tensors on the strategy's device (NCCL reduces GPU tensors only) ---------------------------
def test_epoch_metrics_are_reduced_on_the_strategys_device():
    from lightning_ooc import OutOfCoreNodeData

    dm = OutOfCoreNodeData("unused")
    strategy = _RecordingStrategy("meta")  # any device but the CPU shows where the tensor was made
    dm.trainer = _trainer(strategy)
    out = dm._mean_over_ranks({"ooc/train_a": 1.0, "ooc/train_b": 2.0})
    assert strategy.devices == [torch.device("meta")] and out == {"ooc/train_a": 0.0, "ooc/train_b": 0.0}


def test_run_report_reduces_on_the_strategys_device():
    from lightning_ooc.callbacks import RunReport

    strategy = _RecordingStrategy("meta")
    report = RunReport()
    report.on_train_epoch_start(_trainer(strategy), None)
    report.on_train_epoch_end(_trainer(strategy), None)
    assert strategy.devices == [torch.device("meta")]


# -- 5. a failed cudaHostRegister is cleared and falls back with one log line ---------------------------------------
class _FakeCudart:
    def __init__(self, rc):
        self.rc = rc
        self.calls = []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append("register")
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.calls.append("unregister")
        return 0

    def cudaGetErrorString(self, rc):
        return "part or all of the requested memory range is already mapped"


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(rc):
        cudart = _FakeCudart(rc)
        cleared = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
        monkeypatch.setattr(pinning, "clear_last_error", lambda: cleared.append(True) or True)
        return cudart, cleared

    return install


def test_a_failed_host_register_clears_the_cuda_error_and_falls_back(fake_cuda, caplog):
    from lightning_ooc.store.host_cache import HostCache
    from lightning_ooc.store.staging import StagingBuffer

    cudart, cleared = fake_cuda(712)  # cudaErrorHostMemoryAlreadyRegistered
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        cache = HostCache(torch.tensor([1, 0]), torch.ones(2, 4), num_nodes=3, register=True)
        staging = StagingBuffer(1 << 16, 4, torch.float32)
    assert not cache.zero_copy and not staging.pinned
    assert len(cleared) == 2  # cudaGetLastError after each failure, so no later kernel launch reports it
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("cudaHostRegister" in m and "already mapped" in m for m in lines), lines
    assert "host cache" in lines[0] and "staging buffer" in lines[1]
    cache.close()
    staging.close()
    assert cudart.calls == ["register", "register"]  # nothing registered, so nothing unregistered


def test_a_registered_buffer_is_unregistered_once(fake_cuda):
    from lightning_ooc.store.staging import StagingBuffer

    cudart, cleared = fake_cuda(0)
    st = StagingBuffer(1 << 16, 4, torch.float32)
    assert st.pinned
    st.close()
    st.close()
    assert cudart.calls == ["register", "unregister"] and not cleared


def test_clear_last_error_without_a_cuda_runtime_says_so():
    assert pinning.clear_last_error() is False  # no libcudart in a CPU-only process


# -- 9. the staging example holds where CUDA is present --------------------------------------------------------
def test_the_staging_doctest_passes_with_cuda_present(fake_cuda):
    import lightning_ooc.store.staging as staging

    fake_cuda(0)
    result = doctest.testmod(staging, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# -- 2. every thread that may touch CUDA selects the rank's GPU first ---------------------------------------------
def test_every_pipeline_thread_selects_the_device_before_its_work(tmp_path, monkeypatch):
    import threading

    from lightning_ooc import OutOfCoreNodeData, Pipeline, Tiered
    from lightning_ooc.loader import pipeline
    from lightning_ooc.testing import make_synthetic

    ds = make_synthetic(tmp_path / "g", num_nodes=2000, avg_degree=5, num_features=8, num_classes=3, train_frac=0.3)
    dm = OutOfCoreNodeData(str(ds.root), batch_size=64, num_neighbors=[3, 2], progress=False,
                           features=Tiered(gpu_cache="1MiB", host_cache="4KiB", staging="64KiB"),
                           pipeline=Pipeline(num_samplers=2, num_extractors=2))  # fmt: skip
    dm.setup("fit")
    events: list[tuple[str, str, object]] = []  # (what, thread, device) in the order they happened
    lock = threading.Lock()

    def use_device(device):
        with lock:
            events.append(("select", threading.current_thread().name, device))

    real_extract = pipeline.EpochRun._extractor_loop

    def extractor_loop(self):
        with lock:
            events.append(("work", threading.current_thread().name, None))
        return real_extract(self)

    monkeypatch.setattr(pipeline, "use_device", use_device)
    monkeypatch.setattr(pipeline.EpochRun, "_extractor_loop", extractor_loop)
    try:
        batches = list(iter(dm.train_dataloader()))
    finally:
        dm.teardown("fit")
    assert batches
    selected = {name: dev for what, name, dev in events if what == "select"}
    assert sum("-sampler-" in n for n in selected) == 2 and sum("-extractor-" in n for n in selected) == 2, selected
    assert any(n.endswith("-releaser") for n in selected) and set(selected.values()) == {torch.device("cpu")}
    for k, (what, name, _) in enumerate(events):  # each extractor selected the device before it worked
        if what == "work":
            assert ("select", name, torch.device("cpu")) in events[:k], name


# -- 4. a staging chunk is reused only after the fence of its last copies -----------------------------------------
class _FakeFence:
    """A fence the test completes by hand; ``wait`` completes it (as waiting on an event does)."""

    def __init__(self, log, name):
        self.log, self.name, self.complete = log, name, False

    def done(self):
        return self.complete

    def wait(self):
        self.log.append(("wait", self.name))
        self.complete = True


def test_a_fenced_staging_chunk_is_handed_out_only_after_its_fence():
    from lightning_ooc.store.staging import StagingBuffer

    log = []
    st = StagingBuffer(2 * 4096, 1024, torch.float32, chunk_rows=1, pin=False)  # two chunks of one 4 KiB row
    assert st.num_chunks == 2
    a, b = st.acquire(), st.acquire()
    fa, fb = _FakeFence(log, "a"), _FakeFence(log, "b")
    st.release(a, fa)
    st.release(b, fb)
    fb.complete = True  # b's copies finished: b is free again without waiting
    c = st.acquire()
    assert c.index == b.index and log == []
    d = st.acquire()  # only a is left, still copying: the caller waits on its fence, then gets it
    assert d.index == a.index and log == [("wait", "a")]
    st.release(c, _FakeFence(log, "c"))
    st.close()  # a chunk whose copies may still run is waited for before the memory goes
    assert log[-1] == ("wait", "c")


def test_load_into_releases_each_chunk_with_a_fence_after_its_copies(tmp_path, monkeypatch):
    from lightning_ooc.io import FeatureReader
    from lightning_ooc.store.staging import StagingBuffer
    from lightning_ooc.store.tier import ExtractStats, Fence
    from lightning_ooc.store.tiers import ReaderTier
    from lightning_ooc.testing import make_synthetic

    ds = make_synthetic(tmp_path / "g", num_nodes=500, avg_degree=3, num_features=8, num_classes=2)
    log = []
    staging = StagingBuffer(4096 * 2, 8, ds.feature_dtype, chunk_rows=100, pin=False)
    tier = ReaderTier(FeatureReader.from_dataset(ds), staging, copy_chunk_rows=50)
    stream = object()  # stands in for the thread's CUDA side stream
    monkeypatch.setattr(tier, "_stream", lambda device: stream)

    def copy_rows(dest, slots, rows, s):
        assert s is stream
        log.append(("copy", int(slots.numel())))
        dest.index_copy_(0, slots, rows)

    fences = []

    def on_stream(s):
        assert s is stream
        fences.append(_FakeFence(log, f"f{len(fences)}"))
        log.append(("record", fences[-1].name))
        return fences[-1]

    real_release = staging.release
    monkeypatch.setattr(tier, "_copy_rows", copy_rows)
    monkeypatch.setattr(Fence, "on_stream", staticmethod(on_stream))
    monkeypatch.setattr(staging, "release", lambda chunk, fence=None: (log.append(("release", fence.name)),
                                                                       real_release(chunk, fence)))  # fmt: skip
    ids = torch.randperm(500)[:250]
    dest = torch.zeros(250, 8, dtype=ds.feature_dtype)
    tier.load_into(ids, dest, torch.arange(250), ExtractStats())
    assert torch.equal(dest, ds.read_features(ids))
    # three chunks of up to 100 rows: each one's copies, then a fence on the stream, then the chunk goes back
    # with that fence; before returning (the caller then publishes the rows) the last fence is waited on
    kinds = [e[0] for e in log]
    assert kinds.count("record") == 3 and kinds.count("release") == 3 and log[-1] == ("wait", "f2")
    for k, e in enumerate(log):
        if e[0] == "release":
            assert log[k - 1] == ("record", e[1]) and log[k - 2][0] == "copy"
    # a failed read still releases its chunk with a fence after whatever copies were queued, and waits for it
    # before the failure goes up (the lease's slots are then given back: no queued copy may land in them later)
    log.clear()

    def failing_copy(dest, slots, rows, s):
        raise OSError("read failed")

    monkeypatch.setattr(tier, "_copy_rows", failing_copy)
    with pytest.raises(OSError, match="read failed"):
        tier.load_into(ids, dest, torch.arange(250), ExtractStats())
    assert log == [("record", "f3"), ("release", "f3"), ("wait", "f3")]
    tier.close()


# -- a datamodule set up before the Trainer is set up again for the Trainer's process ----------------------------
def test_setup_before_the_trainer_is_redone_for_the_trainers_process(tmp_path):
    from lightning_ooc import OutOfCoreNodeData, Tiered
    from lightning_ooc.loader.context import ProcessContext
    from lightning_ooc.testing import make_synthetic

    ds = make_synthetic(tmp_path / "g", num_nodes=2000, avg_degree=5, num_features=8, num_classes=3, train_frac=0.3)
    dm = OutOfCoreNodeData(str(ds.root), batch_size=50, num_neighbors=[3], progress=False,
                           features=Tiered(gpu_cache="1MiB", host_cache="4KiB", staging="64KiB"))
    dm.setup("fit")  # as a script does before building its Trainer: one CPU process
    first = dm.source
    n = len(ds.split("train"))
    assert dm._num_batches("train") == -(-n // 50)

    class Strategy:  # the Trainer's process: rank 1 of 2 (on a GPU, its device would differ the same way)
        root_device = torch.device("cpu")

        def process_context(self):
            return ProcessContext(rank=1, world=2, device=torch.device("cpu"))

    dm.trainer = types.SimpleNamespace(strategy=Strategy(), global_rank=1, world_size=2)
    dm.setup("fit")
    assert dm.source is not first and dm.context.world == 2 and dm._num_batches("train") == -(-(-(-n // 2)) // 50)
    dm.setup("fit")  # and only once
    second = dm.source
    dm.setup("test")
    assert dm.source is second
    dm.teardown("fit")


def test_setup_before_a_trainer_of_the_same_process_is_kept(tmp_path):
    from lightning_ooc import OutOfCoreNodeData
    from lightning_ooc.testing import make_synthetic

    ds = make_synthetic(tmp_path / "g", num_nodes=2000, avg_degree=5, num_features=8, num_classes=3)
    dm = OutOfCoreNodeData(str(ds.root), batch_size=50, num_neighbors=[3], progress=False)
    dm.setup("fit")
    first = dm.source
    dm.trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cpu")),
                                       global_rank=0, world_size=1)  # fmt: skip
    dm.setup("fit")
    assert dm.source is first
    dm.teardown("fit")


# -- make gpu-check on a machine without CUDA: one line, status 0 ------------------------------------------------
def test_gpu_check_without_cuda_is_one_line_and_success():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run(["make", "-s", "gpu-check", f"GPU_PY={sys.executable}"], cwd=repo, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines() == [
        "gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False); nothing to check"
    ]
    assert not (repo / "gpu-check.json").exists()


# -- 8. on a GPU the trainer copies only pinned index tensors, without waiting ------------------------------------
def test_the_trainer_side_copies_only_what_the_extractor_pinned(tmp_path, monkeypatch):
    from lightning_ooc.store.tiered import TieredFeatureStore
    from lightning_ooc.testing import make_synthetic

    ds = make_synthetic(tmp_path / "g", num_nodes=3000, avg_degree=4, num_features=8, num_classes=2)
    store = TieredFeatureStore.create(ds, buffer_slots=1024, staging_bytes=1 << 16, host_ids=torch.arange(0, 3000, 5))
    pinned: set[int] = set()  # data pointers of tensors "pinned" (stood in for: CPU-only torch cannot pin)
    copies: list[tuple[bool, bool]] = []  # (source pinned, non_blocking) of every copy the trainer side makes

    def pin_memory(self, *a, **k):
        out = self.clone()
        pinned.add(out.data_ptr())
        return out

    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        copies.append((self.data_ptr() in pinned, bool(kwargs.get("non_blocking"))))
        return real_to(self, *args, **kwargs)

    n_id = torch.randperm(3000)[:700]
    ext = store.extract(n_id)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    store.pin(ext)  # the extractor's side
    monkeypatch.setattr(torch.Tensor, "to", to)
    x = store.gather(ext, "cpu")  # the trainer's side
    monkeypatch.undo()
    assert torch.equal(x, ds.read_features(n_id))
    assert {t.name for t in (lease.tier for lease in ext.leases)} == {"host_cache", "buffer"}
    # every index tensor the trainer moves (positions in x, host-cache positions, buffer slots) was pinned by
    # the extractor and is copied non-blocking: on a GPU none of these copies waits for the stream
    assert len(copies) >= 3 and all(src_pinned and nb for src_pinned, nb in copies), copies
    store.release(ext)
    store.close()


# -- make gpu-check's epoch step, its logic on the CPU ---------------------------------------------------------------
def _epoch_run(setting, label, per_batch, **kw):
    return {"setting": setting, "variant": label.split("-")[0] if label.startswith("pyg") else label.split("-mps")[0],
            "label": label, "steady_seconds_per_batch": per_batch, "batches": 40, "epoch_seconds": 40 * per_batch,
            **kw}  # fmt: skip


def test_gpu_check_epoch_table_reads_every_reference_from_the_same_run():
    from lightning_ooc.bench.gpu import _epoch_lines

    results = [_epoch_run("papers", "ours", 0.05, gpu_peak_allocated_bytes=3 * 2**30, plan_gpu_bytes=2 * 2**30),
               _epoch_run("papers", "mmap-random", 1.0), _epoch_run("papers", "pyg-w0", 2.0),
               _epoch_run("papers", "pyg-w4", 0.8), _epoch_run("papers", "device", 0.048),
               {"setting": "light", "variant": "ours", "label": "ours", "error": "exit 1: InputError: refused"},
               {"setting": "light", "variant": "mmap-random", "label": "mmap-random", "error": "stopped",
                "timed_out": True}]  # fmt: skip
    mps = [_epoch_run("papers", "ours", 0.05), _epoch_run("papers", "ours-mps10", 0.045, mps={"active": True}),
           _epoch_run("papers", "ours-mps20", 0.06, mps={"active": False})]  # fmt: skip
    text = "\n".join(_epoch_lines({"features_bytes": 12 * 2**30, "memory_cap": 3 * 2**30, "results": results,
                                   "mps": {"results": mps, "returncode": 0}}))  # fmt: skip
    papers = next(ln for ln in text.splitlines() if ln.strip().startswith("papers"))
    # mmap-random 20x, PyG at its best worker count (4) 16x, 1.04x of all rows in GPU memory, GPU peak / plan
    assert papers.split() == ["papers", "0.0500", "20.00", "16.00", "(pyg-w4)", "1.04", "3.00", "/", "2.00"]
    assert "light    exit 1: InputError: refused" in text
    assert "lower bounds): light/mmap-random" in text
    assert "mps10: 0.90; mps20: 1.20 (MPS not in force)" in text


def test_gpu_check_writes_its_graph_beside_the_tests_and_names_a_failure(tmp_path):
    import argparse

    from lightning_ooc.bench.gpu import _Graph
    from lightning_ooc.data.dataset import open_dataset

    args = argparse.Namespace(epoch_root=None, epoch_dir=tmp_path, epoch_features="2MiB")
    g = _Graph(args)
    assert g.proc is not None  # started, not waited for
    assert g.ready() > 0 and open_dataset(g.root).num_nodes == 10_000 and open_dataset(g.root).num_features == 128
    assert _Graph(args).proc is None  # there already: written once
    (tmp_path / "file").write_text("not a directory")
    bad = _Graph(argparse.Namespace(epoch_root=None, epoch_dir=tmp_path / "file" / "x", epoch_features="2MiB"))
    with pytest.raises(RuntimeError, match="failed"):
        bad.ready()


def test_gpu_check_epoch_step_runs_the_references_then_the_mps_splits(tmp_path, monkeypatch):
    import argparse
    from pathlib import Path

    from lightning_ooc.bench import gpu

    calls = []

    def fake(args, root, out, extra, accelerator="gpu"):
        calls.append((Path(out).name, extra))
        return {"returncode": 0, "features_bytes": 1, "results": []}

    monkeypatch.setattr(gpu, "_bench_epoch", fake)
    graph = argparse.Namespace(root=tmp_path)
    doc = gpu._epoch_figures(argparse.Namespace(mps_split="10,20,30"), graph, tmp_path / "e")
    assert calls == [("e", ["--variants", "ours,mmap-random,pyg,device", "--settings", "papers,light"]),
                     ("e-mps", ["--variants", "ours", "--settings", "papers", "--mps-split", "10,20,30"])]  # fmt: skip
    assert doc["mps"]["returncode"] == 0 and "error" not in doc
    calls.clear()
    assert "mps" not in gpu._epoch_figures(argparse.Namespace(mps_split=""), graph, tmp_path / "e")
    assert len(calls) == 1
