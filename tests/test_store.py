"""Tiers of the feature store: host cache selection, staging, budgets, the tiered extract/gather."""
import numpy as np
import pytest
import torch

from lightning_ooc.store.host_cache import access_counts, choose_hot
from lightning_ooc.store.plan import StorePlan
from lightning_ooc.store.staging import StagingBuffer
from lightning_ooc.store.tiered import TieredFeatureStore
from lightning_ooc.testing import make_synthetic


def test_choose_hot_by_presample_and_degree():
    batches = [torch.tensor([1, 2, 3]), torch.tensor([2, 3]), torch.tensor([3, 9])]
    assert access_counts(batches, 10).tolist() == [0, 1, 2, 3, 0, 0, 0, 0, 0, 1]
    deg = np.array([0, 5, 0, 0, 0, 0, 0, 0, 0, 1])
    hot = choose_hot(3, 10, policy="presample", in_degree=deg, presample=lambda: batches)
    assert hot.ids.tolist() == [3, 2, 1]  # 1 and 9 tie at one access; 1 has the higher in-degree
    assert hot.expected_hit_rate == pytest.approx(6 / 7)
    by_degree = choose_hot(2, 10, policy="degree", in_degree=deg)
    assert by_degree.ids.tolist() == [1, 9] and by_degree.expected_hit_rate is None
    with pytest.raises(ValueError, match="unknown host cache policy"):
        choose_hot(2, 10, policy="lfu", in_degree=deg)


def test_staging_chunks_are_page_aligned_and_bounded():
    st = StagingBuffer(3 * 4096 * 8 + 100, num_features=2, dtype=torch.float32, chunk_rows=4096)
    assert (st.num_chunks, st.chunk_rows, st.nbytes) == (3, 4096, 3 * 4096 * 8)  # the 100 spare bytes are unused
    st.close()
    st = StagingBuffer(8 * 1024, num_features=4, dtype=torch.float16, chunk_rows=256)
    chunks = [st.acquire() for _ in range(st.num_chunks)]
    assert all(c.rows.data_ptr() % 4096 == 0 for c in chunks)
    with pytest.raises(TimeoutError):
        st.acquire(timeout=0.05)  # bounded: all chunks are taken
    st.release(chunks[0])
    assert st.acquire(timeout=1).index == chunks[0].index
    with pytest.raises(ValueError, match="cannot hold one row"):
        StagingBuffer(10, num_features=4, dtype=torch.float32)


def test_plan_from_budgets():
    plan = StorePlan.from_budgets(num_nodes=10**6, row_bytes=512, gpu_cache="256MiB", host_cache="64MiB",
                                  staging="32MiB", max_nodes_per_batch=20000, num_extractors=4, train_queue_size=4,
                                  device="cpu")  # fmt: skip
    assert plan.buffer_slots == 256 * 2**20 // 512 and plan.buffer_reserve == 20000 * 4
    in_order = StorePlan.from_budgets(num_nodes=10**6, row_bytes=512, gpu_cache="256MiB", host_cache=0,
                                      staging="1MiB", max_nodes_per_batch=20000, num_extractors=4,
                                      train_queue_size=4, device="cpu", order="in_order")  # fmt: skip
    assert in_order.buffer_reserve == 20000 * 10
    assert plan.host_rows == 64 * 2**20 // 512
    assert "feature buffer" in plan.format() and "host cache" in plan.format()
    with pytest.raises(ValueError, match=r"set gpu_cache to at least 39.06 MiB"):
        StorePlan.from_budgets(num_nodes=10**6, row_bytes=512, gpu_cache="32MiB", host_cache=0, staging="1MiB",
                               max_nodes_per_batch=20000, num_extractors=4, train_queue_size=4, device="cpu")  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiered_extract_gather_release(tmp_path, dtype):
    ds = make_synthetic(tmp_path / "g", num_nodes=3000, num_features=37, feature_dtype=dtype)
    store = TieredFeatureStore.create(ds, buffer_slots=600, staging_bytes=37 * 4 * 100,
                                      host_ids=torch.arange(0, 3000, 7))  # fmt: skip
    ref = ds.read_features(np.arange(ds.num_nodes))
    g = torch.Generator().manual_seed(0)
    held = []
    for i in range(30):
        n_id = torch.randperm(3000, generator=g)[:150]
        ext = store.extract(n_id)
        x = store.gather(ext)
        assert x.dtype == ds.feature_dtype and torch.equal(x.view(torch.uint8), ref[n_id].view(torch.uint8))
        assert ext.stats.host_hits == int((n_id % 7 == 0).sum())
        held.append(ext)
        if len(held) > 2:
            store.release(held.pop(0))
    for ext in held:
        store.release(ext)
    store.tier("buffer").buffer.check_invariants()
    assert store.tier("buffer").buffer.evictions > 0 and int(store.tier("buffer").buffer.refcount.sum()) == 0
    direct_store = store.without("buffer")  # evaluation passes: read past the buffer, hold no slot
    free = store.tier("buffer").buffer.free_slots
    direct = direct_store.extract(torch.tensor([5, 7, 2999]))
    assert torch.equal(direct_store.gather(direct).view(torch.uint8), ref[[5, 7, 2999]].view(torch.uint8))
    assert [lease.tier.name for lease in direct.leases] == ["host_cache", "ssd"]
    assert store.tier("buffer").buffer.free_slots == free
    direct_store.release(direct)
    store.close()
