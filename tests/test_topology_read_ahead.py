"""Sampling a topology larger than the memory given: the mapped indices are read with the kernel's read-ahead off
(a fault reading megabytes around its page would evict what the last faults read); where it fits, read-ahead
stays."""
from types import SimpleNamespace

import numpy as np

from lightning_ooc import open_dataset
from lightning_ooc.data.dataset import read_ahead_off
from lightning_ooc.loader.source import LocalPasses
from lightning_ooc.store.limits import MemoryLimit
from lightning_ooc.testing import make_synthetic


def _random_read(a: np.ndarray) -> bool:
    """Whether the kernel reads the map of ``a`` at random (``rr`` among its VmFlags in /proc/self/smaps)."""
    start = a.ctypes.data
    vma = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                vma = lo <= start < hi
            elif vma and line.startswith("VmFlags:"):
                return "rr" in line.split()[1:]
    raise AssertionError("the array's map is not in /proc/self/smaps")


def _decide(ds, limit: MemoryLimit, time_attr: str | None = None) -> None:
    LocalPasses._topology_read_ahead(SimpleNamespace(cfg=SimpleNamespace(time_attr=time_attr)), ds, limit)


def test_read_ahead_goes_off_only_where_the_indices_exceed_half_the_memory_left(tmp_path):
    root = make_synthetic(tmp_path / "g", num_nodes=3000, num_features=4).root
    size = open_dataset(root).indices.nbytes
    for limit, off in ((MemoryLimit.none(), False), (MemoryLimit(4 * size, "a test"), False),
                       (MemoryLimit(size, "a test"), True)):  # fmt: skip
        ds = open_dataset(root)  # a map of its own each time
        assert not _random_read(ds.indices)
        _decide(ds, limit)
        assert _random_read(ds.indices) is off, limit
        assert np.array_equal(ds.indices, open_dataset(root).indices)  # the same bytes either way


def test_read_ahead_off_refuses_what_is_not_a_map():
    assert read_ahead_off(np.arange(5)) is False


def test_the_times_temporal_sampling_searches_count_with_the_indices(tmp_path):
    """Edge times (8 bytes an edge) are searched at random as the indices are: together they decide, and both maps
    go to random reads (an 8M-node graph with edge times under a 0.95 GiB cap read 450 GB in six minutes with
    read-ahead on)."""
    from lightning_ooc.data.synth import synthesize

    root = synthesize(tmp_path / "t", num_nodes=3000, avg_degree=8, num_features=4, num_classes=3, temporal=True,
                      progress=False)  # fmt: skip
    ds = open_dataset(root)
    both = ds.indices.nbytes + ds.edge_time.nbytes
    limit = MemoryLimit(int(1.5 * both), "a test")  # the indices alone fit half of it; with the times they do not
    assert ds.indices.nbytes <= limit.bytes // 2 < both
    _decide(ds, limit)  # without time: the indices alone decide
    assert not _random_read(ds.indices) and not _random_read(ds.edge_time)
    ds = open_dataset(root)
    _decide(ds, limit, "edge_time")
    assert _random_read(ds.indices) and _random_read(ds.edge_time)


def test_the_random_map_baseline_reads_the_topology_at_random_too(tmp_path):
    """``Mapped(madvise="random")``, the strongest setting of the memory-map baseline, reads the topology's maps
    (indices, the searched times) without read-ahead as it reads the features; ``"normal"`` keeps it."""
    from lightning_ooc import Mapped, OutOfCoreNodeData
    from lightning_ooc.data.synth import synthesize

    root = synthesize(tmp_path / "t", num_nodes=3000, avg_degree=8, num_features=4, num_classes=3, temporal=True,
                      train_frac=0.2, progress=False)  # fmt: skip
    for madvise, off in (("random", True), ("normal", False)):
        dm = OutOfCoreNodeData(root, features=Mapped(madvise=madvise), progress=False,
                               batch_size=100, num_neighbors=[3], time={"time_attr": "edge_time"})  # fmt: skip
        dm.setup()
        ds = dm.source.dataset
        assert _random_read(ds.indices) is off and _random_read(ds.edge_time) is off, madvise
        dm.teardown()


def test_our_sampler_over_the_store_pair_turns_read_ahead_off_as_the_datamodule_does(tmp_path, monkeypatch):
    """``PyGNeighborSampler`` over our FeatureStore/GraphStore pair reads the dataset's maps: with less memory
    left than twice its indices and times, they go to random reads; with plenty, read-ahead stays."""
    import lightning_ooc.store.limits as limits
    from lightning_ooc.data.synth import synthesize
    from lightning_ooc.pyg import open_pyg_stores
    from lightning_ooc.sampling import PyGNeighborSampler

    root = synthesize(tmp_path / "t", num_nodes=3000, avg_degree=8, num_features=4, num_classes=3, temporal=True,
                      progress=False)  # fmt: skip
    both = open_dataset(root).indices.nbytes + open_dataset(root).edge_time.nbytes
    for left, off in ((100 * both, False), (both, True)):
        monkeypatch.setattr(limits, "memory_limit", lambda *a, **k: MemoryLimit(left, "a test"))
        pair = open_pyg_stores(root, in_memory=False)
        try:
            sampler = PyGNeighborSampler(pair, [3], time_attr="edge_time")
            graph = sampler.sampler.graph
            assert _random_read(graph.indices) is off and _random_read(graph.edge_time) is off, left
        finally:
            pair.feature_store.close()
