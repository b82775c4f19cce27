"""Checks that need a CUDA GPU. `make gpu-check` runs them; `make test` deselects them (marker ``gpu``).

Each compares what the GPU path produces with the file, byte for byte, or asserts what the CPU
tests can only stand in for: no host synchronisation per batch, no CUDA error left behind by a
failed registration, the reduce of a one-GPU ``strategy="ooc"`` fit on the GPU, the real MPS daemon.
"""
import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by make gpu-check)"),
]

CUDA = torch.device("cuda", 0)
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    from lightning_ooc.testing import make_synthetic

    return make_synthetic(tmp_path_factory.mktemp("gpu") / "g", num_nodes=20_000, avg_degree=8, num_features=100,
                          num_classes=5, train_frac=0.2, val_frac=0.05)  # fmt: skip


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))  # fmt: skip


def test_every_tier_gives_the_files_rows_on_the_gpu(ds):
    from lightning_ooc.store.tier import Fence
    from lightning_ooc.store.tiered import TieredFeatureStore

    store = TieredFeatureStore.create(ds, buffer_slots=8192, staging_bytes=1 << 20, device=CUDA,
                                      host_ids=torch.arange(0, ds.num_nodes, 7))  # fmt: skip
    try:
        assert store.tier("host_cache").host.zero_copy, "the host cache was not registered for zero-copy reads"
        assert store.tier("buffer").buffer.rows.is_cuda
        cases = {
            "host cache only": torch.arange(0, ds.num_nodes, 7)[:1000],
            "feature buffer (staging + reader)": torch.arange(1, ds.num_nodes, 7)[:1000],
            "mixed, random": torch.randperm(ds.num_nodes, generator=torch.Generator().manual_seed(0))[:3000],
        }
        for store_, label in ((store, "train chain"), (store.without("buffer"), "eval chain (direct rows)")):
            for name, n_id in cases.items():
                for _ in range(2):  # the second time from the buffer's valid slots
                    ext = store_.extract(n_id)
                    store_.pin(ext)
                    x = store_.gather(ext, CUDA)
                    store_.release(ext, Fence.record(CUDA))
                    assert x.is_cuda and _same_bytes(x.cpu(), ds.read_features(n_id)), f"{label}: {name}"
    finally:
        store.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [1, 37, 100, 128, 256])
def test_the_zero_copy_kernel_on_the_gpu_matches_index_select(dtype, dim):
    from lightning_ooc.store import uva
    from lightning_ooc.store.pinning import host_register, host_unregister

    host = (torch.randn(5000, dim) * 100).to(dtype)
    assert host_register(host.data_ptr(), host.numel() * host.element_size(), "test rows")
    try:
        pos = torch.randint(0, 5000, (2049,))
        out_rows = torch.randperm(3000)[:2049]
        x = torch.zeros(3000, dim, dtype=dtype, device=CUDA)
        uva.gather_rows_into(x, out_rows, host, pos, zero_copy=True)
        ref = torch.zeros(3000, dim, dtype=dtype)
        ref[out_rows] = host[pos]
        assert _same_bytes(x.cpu(), ref)
    finally:
        torch.cuda.synchronize()
        host_unregister(host.data_ptr())


def test_a_failed_registration_leaves_no_cuda_error_for_the_next_kernel():
    from lightning_ooc.store.pinning import host_register, host_unregister

    t = torch.zeros(1 << 20)
    nbytes = t.numel() * t.element_size()
    assert host_register(t.data_ptr(), nbytes, "first")
    try:
        assert not host_register(t.data_ptr(), nbytes, "again")  # already registered: fails, and is cleared
        y = torch.ones(1000, device=CUDA) * 2  # a kernel launch checks cudaGetLastError
        torch.cuda.synchronize()
        assert float(y.sum()) == 2000.0
    finally:
        host_unregister(t.data_ptr())


def test_a_training_batch_costs_the_trainer_no_host_synchronisation(ds, monkeypatch):
    from lightning_ooc.loader.config import NodeDataConfig
    from lightning_ooc.loader.context import ProcessContext
    from lightning_ooc.loader.features import Tiered
    from lightning_ooc.loader.source import LocalPasses

    cfg = NodeDataConfig(root=str(ds.root), batch_size=256, num_neighbors=[5, 5], progress=False,
                         features=Tiered(gpu_cache="64MiB", host_cache="2MiB", staging="8MiB"),
                         pipeline={"num_samplers": 2, "num_extractors": 2})  # fmt: skip
    passes = LocalPasses(cfg, ProcessContext(device=CUDA))
    try:
        run = passes.run("train", 0)
        batches = [next(run)]  # the first batch may set up CUDA state (streams, allocator pools)
        torch.cuda.synchronize()
        # A copy from pageable host memory waits for the stream, but the sync debug mode does not flag it:
        # record every host-to-device copy the trainer thread makes from memory that is not pinned.
        import threading

        pageable = []
        real_to = torch.Tensor.to

        def to(self, *args, **kwargs):
            out = real_to(self, *args, **kwargs)
            if (threading.current_thread() is threading.main_thread() and out.is_cuda and not self.is_cuda
                    and self.numel() and not self.is_pinned()):  # fmt: skip
                pageable.append(tuple(self.shape))
            return out

        monkeypatch.setattr(torch.Tensor, "to", to)
        torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call in __next__ raises
        try:
            for _ in range(3):
                batches.append(next(run))
        finally:
            torch.cuda.set_sync_debug_mode(0)
            monkeypatch.undo()
        assert not pageable, f"host-to-device copies from pageable memory in the trainer: {pageable}"
        for b in batches:
            assert b.x.is_cuda and b.edge_index.is_cuda and b.n_id.is_cuda
            assert _same_bytes(b.x.cpu(), ds.read_features(b.n_id.cpu()))
        run.close()
    finally:
        passes.close()


def _fit(ds, tmp_path, mps_split: int | None = None) -> subprocess.CompletedProcess:
    """A two-epoch ``lightning-ooc fit`` on one GPU with ``strategy="ooc"``, recording the seeds it trains."""
    import yaml

    strategy = "ooc" if mps_split is None else {"class_path": "lightning_ooc.OutOfCoreStrategy",
                                                 "init_args": {"mps_split": mps_split}}  # fmt: skip
    cfg = {
        "trainer": {"accelerator": "gpu", "devices": 1, "strategy": strategy, "max_epochs": 2, "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False,
                    "default_root_dir": str(tmp_path),
                    "callbacks": [{"class_path": "lightning_ooc.callbacks.RunReport"},
                                  {"class_path": "ddp_probe.Probe", "init_args": {"out_dir": str(tmp_path / "probe")}}]},
        "data": {"root": str(ds.root), "batch_size": 500, "num_neighbors": [5, 5],
                 "features": {"class_path": "lightning_ooc.Tiered",
                              "init_args": {"gpu_cache": "32MiB", "host_cache": "2MiB", "staging": "8MiB"}}},
    }  # fmt: skip
    (tmp_path / "gpu.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "lightning_ooc", "fit", "--config", str(REPO / "configs" / "demo.yaml"),
           "--config", str(tmp_path / "gpu.yaml")]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _seeds_trained_once_per_epoch(ds, tmp_path) -> None:
    import json

    seeds = json.loads((tmp_path / "probe" / "rank0.json").read_text())["seeds"]
    train = sorted(ds.split("train").tolist())
    assert sorted(seeds) == ["0", "1"]
    for epoch, trained in seeds.items():
        assert sorted(trained) == train, f"epoch {epoch}: not every training seed exactly once"


def _spawned() -> set[int]:
    """Processes started with multiprocessing's spawn method (the gather producers), anywhere."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"spawn_main" in (d / "cmdline").read_bytes():
                    out.add(int(d.name))
            except OSError:
                pass
    return out


def _mps_daemons() -> set[str]:
    r = subprocess.run(["pgrep", "-x", "nvidia-cuda-mps"], capture_output=True, text=True)
    return set(r.stdout.split())


def _our_shm() -> list[str]:
    return glob.glob("/dev/shm/looc-*")


def test_a_one_gpu_ooc_fit_runs_its_collectives_on_the_gpu(ds, tmp_path):
    before = set(_our_shm())
    r = _fit(ds, tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    assert "fit: 2 epoch(s)" in out
    _seeds_trained_once_per_epoch(ds, tmp_path)
    assert set(_our_shm()) <= before


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="no nvidia-cuda-mps-control on PATH")
def test_mps_split_with_the_real_daemon_trains_and_leaves_nothing(ds, tmp_path):
    shm, daemons, spawned = set(_our_shm()), _mps_daemons(), _spawned()
    r = _fit(ds, tmp_path, mps_split=20)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    assert "fit: 2 epoch(s)" in out and "CUDA MPS is not usable" not in out, out[-4000:]
    assert "with 20% of the GPU's SMs (the training process: 80%)" in out, out[-4000:]
    _seeds_trained_once_per_epoch(ds, tmp_path)
    assert set(_our_shm()) <= shm
    # the daemon quits when its last client has exited (an atexit hook of the run): allow it a moment
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (_mps_daemons() <= daemons and _spawned() <= spawned):
        time.sleep(0.5)
    assert _mps_daemons() <= daemons, "an MPS daemon started by the run is still running"
    assert _spawned() <= spawned, "gather producer processes are still running"
