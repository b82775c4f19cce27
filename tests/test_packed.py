"""Packed minibatches (DiskGNN): rows served from packed sections equal the feature file's for every batch
(across partitions, float16/float32, odd row sizes), batches and in-order training equal the in-memory run
(node, heterogeneous and link tasks), and packing fails and restarts cleanly: a damaged or foreign pack is
never read, a killed packing leaves nothing a later run uses, a full disk is a clear error that touches
no dataset."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from jobs import _env
from torch_geometric.data import Data, HeteroData

from lightning_ooc.data.synth import synthesize
from lightning_ooc.data.synth_hetero import synthesize_hetero
import lightning_ooc.datamodule as datamodule
from lightning_ooc import Mapped, Packed, Tiered
from lightning_ooc.datamodule import OutOfCoreLinkData, OutOfCoreNodeData, PackedNodeData
from lightning_ooc.errors import CorruptDatasetError, DatasetWriteError, InputError
from lightning_ooc.io.bulk import BulkFile
from lightning_ooc.loader.packed_passes import PackedPasses, PackingError
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.models import GraphSAGE
from lightning_ooc.store.packed_batches import (CHUNKS, GRAPHS, MANIFEST, EpochPack, PackedChunkTier, SectionBuffers,
                                        decode_batch, encode_batch, epoch_dirname)  # fmt: skip
from lightning_ooc.store.diskcache import window_rows
from lightning_ooc.store.pack_writing import EpochPackWriter, FeatureSource

TESTS = Path(__file__).parent
REPO = TESTS.parent


# -- the batch records -------------------------------------------------------------------------------------------
def _roundtrip(data):
    raw = encode_batch(data)
    return decode_batch(torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()))


def test_batch_records_round_trip_every_field():
    d = Data(n_id=torch.tensor([5, 2, 9]), edge_index=torch.tensor([[1, 2], [0, 0]]), y=torch.tensor([1, 0, 1]),
             edge_label=torch.tensor([0.5, 1.0], dtype=torch.float16), mask=torch.tensor([True, False, True]),
             empty=torch.empty((0, 3), dtype=torch.int32), batch_size=1, num_sampled_nodes=[1, 2], name="b")  # fmt: skip
    d.batch_index = 7  # the run's, never stored
    d.x = torch.ones(3, 2)  # features come from the sections, never stored with the record
    out = _roundtrip(d)
    assert "batch_index" not in out and "x" not in out
    for key in ("n_id", "edge_index", "y", "edge_label", "mask", "empty"):
        assert out[key].dtype == d[key].dtype and torch.equal(out[key], d[key]), key
    assert out.batch_size == 1 and out.num_sampled_nodes == [1, 2] and out.name == "b"

    h = HeteroData()
    h["paper"].n_id = torch.tensor([3, 1])
    h["paper"].batch_size = 1
    h["author"].n_id = torch.tensor([0])
    h["author", "writes", "paper"].edge_index = torch.tensor([[0], [1]])
    h["author", "writes", "paper"].num_sampled_edges = [1, 0]
    out = _roundtrip(h)
    assert isinstance(out, HeteroData) and set(out.node_types) == {"paper", "author"}
    assert torch.equal(out["paper"].n_id, h["paper"].n_id) and out["paper"].batch_size == 1
    assert torch.equal(out["author", "writes", "paper"].edge_index, h["author", "writes", "paper"].edge_index)
    assert out["author", "writes", "paper"].num_sampled_edges == [1, 0]
    with pytest.raises(TypeError, match="cannot hold 'bad'"):
        encode_batch(Data(bad=object()))


# -- writer and tier, without a datamodule -----------------------------------------------------------------------
def _features(tmp_path, name, rows, dim, dtype, seed):
    g = np.random.default_rng(seed)
    a = g.standard_normal((rows, dim)).astype(dtype)
    path = tmp_path / f"{name}.bin"
    a.tofile(path)
    return path, a


def _pack(tmp_path, sources, batches, memory, space=None, identity=None):
    w = EpochPackWriter(tmp_path / "packs", 3, identity or {"test": 1}, sources, memory=memory, space=space)
    try:
        for k, cold in batches.items():
            w.add(k, Data(n_id=torch.as_tensor(cold[0]), batch_size=len(cold[0])), cold)
        w.pack_features()
        return w.commit(), w.report
    except BaseException:
        w.abort()
        raise


@pytest.mark.parametrize("dim,dtype,memory", [(128, np.float32, 1 << 20), (25, np.float32, 1 << 20),
                                              (7, np.float16, 640 << 10), (3, np.float16, 320 << 10),
                                              (2, np.float16, 200 << 10)])  # fmt: skip
def test_sections_are_the_feature_rows_across_partitions(tmp_path, dim, dtype, memory):
    rows = 20_011  # the file ends inside a sector, so its last partition is read partly without direct I/O
    path, feats = _features(tmp_path, "f", rows, dim, dtype, seed=dim)
    rb = feats.itemsize * dim
    g = np.random.default_rng(1)
    batches = {k: [np.sort(g.choice(rows, size=int(g.integers(0, 3000)), replace=False))] for k in range(12)}
    batches[5] = [np.empty(0, dtype=np.int64)]  # a batch without cold rows
    batches[6] = [np.array([0, rows - 1])]  # the first and the very last row
    final, report = _pack(tmp_path, [FeatureSource(None, path, rb, rows)], batches, memory)  # small partitions
    assert report.partitions >= 3 and report.packed == 12
    assert final.name == epoch_dirname(3) and (final / MANIFEST).exists()
    pack = EpochPack.open(final, {"test": 1})
    tier = PackedChunkTier(None, 0, dim, torch.from_numpy(feats[:1]).dtype, rb, SectionBuffers(2))
    tier.use(pack)
    for k, (cold,) in batches.items():
        ids = torch.from_numpy(np.random.default_rng(k).permutation(cold)).to(torch.int64)  # any order
        lease = tier.claim_for(SimpleNamespace(batch_index=k), ids)
        assert bool(lease.mask.all())
        tier.fill(lease)
        got = tier.rows(lease, torch.device("cpu"))
        assert torch.equal(got, torch.from_numpy(feats[ids.numpy()])), k  # bit for bit, in the ids' order
        x = torch.zeros((ids.numel() + 2, dim), dtype=got.dtype)
        tier.gather_into(lease, x, torch.arange(2, ids.numel() + 2))
        assert torch.equal(x[2:], got)
        assert lease.stats.bytes_read == -(-ids.numel() * rb // 4096) * 4096  # no read beyond the last sector
        tier.release(lease)
        assert torch.equal(pack.load_batch(k).n_id, torch.as_tensor(cold))
    # other ids than the section's: nothing claimed (the chain reads them elsewhere)
    lease = tier.claim_for(SimpleNamespace(batch_index=0), torch.as_tensor(batches[0][0][:-1]))
    assert not bool(lease.mask.any()) and tier.take_counts()["mismatched"] == 1
    tier.close()
    pack.close()


def test_two_node_types_and_the_space_limit(tmp_path):
    pa, fa = _features(tmp_path, "a", 5000, 16, np.float32, 0)
    pb, fb = _features(tmp_path, "b", 3001, 5, np.float16, 1)
    srcs = [FeatureSource("a", pa, 64, 5000), FeatureSource("b", pb, 10, 3001)]
    g = np.random.default_rng(2)
    batches = {k: [np.sort(g.choice(5000, 800, replace=False)), np.sort(g.choice(3001, 300, replace=False))]
               for k in range(6)}  # fmt: skip
    per_batch = 800 * 64 // 4096 * 4096 + 4096 + 4096
    records = 44 << 10  # about 40 KiB for the 6 records
    # 16 KiB short of every batch's own sections: a disk cache of the rows they share lets all 6 in
    space = 6 * per_batch - (16 << 10) + records
    final, report = _pack(tmp_path, srcs, batches, 1 << 20, space=space)
    assert report.packed == report.batches == 6 and report.segments >= 1 and report.cached_rows > 0
    assert report.bytes <= space
    pack = EpochPack.open(final, {"test": 1})
    assert pack.has_caches and pack.batches == [0, 1, 2, 3, 4, 5]
    for i, (feats, dim, dtype) in enumerate([(fa, 16, torch.float32), (fb, 5, torch.float16)]):
        tier = PackedChunkTier("ab"[i], i, dim, dtype, feats.itemsize * dim, SectionBuffers(1))
        tier.use(pack)
        for k in range(6):
            ids = torch.from_numpy(batches[k][i])
            lease = tier.claim_for(SimpleNamespace(batch_index=k), ids)
            assert bool(lease.mask.all())
            tier.fill(lease)
            assert torch.equal(tier.rows(lease, torch.device("cpu")), torch.from_numpy(feats[batches[k][i]]))
            tier.release(lease)
        tier.close()
    pack.close()
    # no room even for one copy of each row two batches share: the batches past the space read directly
    final, report = _pack(tmp_path, srcs, batches, 1 << 20, space=per_batch + records)
    assert 0 < report.packed < 6 and report.segments == 0
    pack = EpochPack.open(final, {"test": 1})
    assert pack.batches == [0, 1, 2, 3, 4, 5]  # every record is kept: training reads it instead of sampling
    assert [pack.section(k, 0) is not None for k in range(6)] == [True] * report.packed + [False] * (6 - report.packed)
    tier = PackedChunkTier("a", 0, 16, torch.float32, 64, SectionBuffers(1))
    tier.use(pack)
    lease = tier.claim_for(SimpleNamespace(batch_index=5), torch.from_numpy(batches[5][0]))
    assert not bool(lease.mask.any())  # left out of the pack: direct reads serve it
    tier.close()
    pack.close()


@pytest.mark.parametrize("dim,dtype,memory,frac", [(128, np.float32, 1 << 20, 0.75), (25, np.float32, 1 << 20, 0.55),
                                                   (63, np.float16, 2 << 20, 0.75)])  # fmt: skip
def test_a_disk_cache_serves_every_batch_its_rows_bit_for_bit(tmp_path, dim, dtype, memory, frac):
    rows = 20_011
    path, feats = _features(tmp_path, "f", rows, dim, dtype, seed=dim)
    rb = feats.itemsize * dim
    g = np.random.default_rng(4)
    hot = g.choice(rows, 3000, replace=False)  # rows many batches share
    batches = {k: [np.unique(np.concatenate([g.choice(hot, 600), g.choice(rows, 300)]))] for k in range(40)}
    batches[7] = [np.empty(0, dtype=np.int64)]
    batches[8] = [np.unique(g.choice(hot, 900))]  # every row of it cached, perhaps: an empty own section
    own = sum(-(-len(b[0]) * rb // 4096) * 4096 for b in batches.values())
    space = int(own * frac)  # the batches' records take some of it too
    final, report = _pack(tmp_path, [FeatureSource(None, path, rb, rows)], batches, memory, space=space)
    assert report.packed == 40 and report.segments >= 1 and report.cached_rows > 0 and report.bytes <= space
    if dim != 63:  # the cache is reordered in several windows of a quarter of the packer's memory
        assert report.cached_rows > window_rows(rb, memory // 4) * report.segments
    pack = EpochPack.open(final, {"test": 1})
    tier = PackedChunkTier(None, 0, dim, torch.from_numpy(feats[:1]).dtype, rb, SectionBuffers(2))
    tier.use(pack)
    cached = requested = 0
    for k, (cold,) in batches.items():
        ids = torch.from_numpy(np.random.default_rng(k).permutation(cold)).to(torch.int64)
        lease = tier.claim_for(SimpleNamespace(batch_index=k), ids)
        assert bool(lease.mask.all()), k
        tier.fill(lease)
        got = tier.rows(lease, torch.device("cpu"))
        assert torch.equal(got, torch.from_numpy(feats[ids.numpy()])), k
        x = torch.zeros((ids.numel() + 1, dim), dtype=got.dtype)
        tier.gather_into(lease, x, torch.arange(1, ids.numel() + 1))
        assert torch.equal(x[1:], got)
        cached += pack.section(k, 0).cached
        requested += lease.stats.bytes_requested
        assert lease.stats.bytes_requested == ids.numel() * rb and lease.stats.misses == ids.numel()
        tier.release(lease)
    assert cached > 0 and tier.take_counts() == {"sections": 40, "mismatched": 0}
    tier.close()
    pack.close()


def test_disk_caches_of_several_segments_and_node_types_with_odd_rows(tmp_path):
    # batches in groups of 8 that share their group's rows: a cache per segment, for two node types whose
    # rows do not divide a sector (100 and 126 bytes: caches start where a sector and a row begin together),
    # a type some batches lack
    g = np.random.default_rng(1)
    specs = [("a", 40_000, 25, np.float32), ("b", 30_011, 63, np.float16)]
    srcs, feats = [], []
    for name, rows, dim, dt in specs:
        path, a = _features(tmp_path, name, rows, dim, dt, seed=rows)
        srcs.append(FeatureSource(name, path, a.itemsize * dim, rows))
        feats.append(a)
    batches = {}
    for k in range(48):
        grp = k // 8
        a = np.unique(np.concatenate([g.choice(np.arange(grp * 6000, grp * 6000 + 6000), 2500),
                                      g.choice(40_000, 100)]))  # fmt: skip
        b = (np.unique(np.concatenate([g.choice(np.arange(grp * 2500, grp * 2500 + 2500), 1200), g.choice(30_011, 50)]))
             if k % 5 else np.empty(0, np.int64))  # fmt: skip
        batches[k] = [a, b]
    own = sum(-(-len(b[i]) * s.row_bytes // 4096) * 4096 for b in batches.values() for i, s in enumerate(srcs))
    w = EpochPackWriter(tmp_path / "packs", 1, {"t": 1}, srcs, memory=3 << 20, space=int(own * 0.6))
    for k, cold in batches.items():
        w.add(k, Data(n_id=torch.as_tensor(cold[0]), batch_size=1), cold)
    w.pack_features()
    final = w.commit()
    r = w.report
    assert r.packed == 48 and r.segments >= 2 and r.bytes <= int(own * 0.6)
    pack = EpochPack.open(final, {"t": 1})
    for g_ in range(r.segments):
        for i, s in enumerate(srcs):
            seg = pack.cache(g_, i)
            assert seg.row_start * s.row_bytes % 4096 == 0 or len(seg.sorted_ids) == 0
    for i, (s, (_, _, dim, _)) in enumerate(zip(srcs, specs)):
        tier = PackedChunkTier(s.node_type, i, dim, torch.from_numpy(feats[i][:1]).dtype, s.row_bytes, SectionBuffers(2))
        tier.use(pack)
        for k, cold in batches.items():
            ids = torch.from_numpy(np.random.default_rng(k).permutation(cold[i])).to(torch.int64)
            lease = tier.claim_for(SimpleNamespace(batch_index=k), ids)
            assert bool(lease.mask.all()), (k, i)
            tier.fill(lease)
            assert torch.equal(tier.rows(lease, torch.device("cpu")), torch.from_numpy(feats[i][ids.numpy()])), (k, i)
            tier.release(lease)
        assert tier.take_counts() == {"sections": 48, "mismatched": 0}
        tier.close()
    pack.close()


def test_the_disk_cache_puts_rows_the_same_batches_need_side_by_side():
    from lightning_ooc.store.diskcache import minhash_order, plan_disk_cache

    # 8 groups of 64 rows, each group needed by its own 3 of 24 batches; ids interleave the groups
    group = np.arange(512) % 8
    lists = [np.flatnonzero(np.isin(group, [b % 8])) for b in range(24)]
    cache = np.arange(512)
    laid = minhash_order(cache, lists)
    assert sorted(laid.tolist()) == cache.tolist()
    runs = 1 + int((np.diff(group[laid]) != 0).sum())
    assert runs == 8  # each group contiguous: a batch reads one run, not 64 scattered rows
    with_windows = minhash_order(cache, lists, window=128)  # reordered only within blocks of 128 ids
    assert all(set(with_windows[i : i + 128].tolist()) == set(range(i, i + 128)) for i in range(0, 512, 128))
    # the plan: the largest threshold, then the smallest segments, that fit
    cold = {k: [a] for k, a in enumerate(lists)}
    plan = plan_disk_cache(cold, [4096], room=24 * 64 * 4096)  # everything fits apart: (8, 8) is the first try
    assert (plan.threshold, plan.segment) == (8, 8) and plan.cached_rows == 0
    plan = plan_disk_cache(cold, [4096], room=512 * 4096)  # one copy of each row: one segment, t = 2
    assert (plan.threshold, plan.segment, len(plan.segments)) == (2, 24, 1) and plan.cached_rows == 512
    assert plan_disk_cache(cold, [4096], room=511 * 4096) is None


def test_where_no_cache_fits_every_batch_one_that_lets_more_in_is_used(tmp_path):
    path, feats = _features(tmp_path, "f", 1000, 1024, np.float32, 0)  # a row per sector
    hot = np.arange(100)  # every batch needs these; and 50 rows of its own
    batches = {k: [np.concatenate([hot, np.arange(100 + 50 * k, 150 + 50 * k)])] for k in range(10)}
    records = 40 << 10
    # whole sections: 150 sectors each, 2 fit in 400; with the 100 shared rows stored once, 6 do
    final, report = _pack(tmp_path, [FeatureSource(None, path, 4096, 1000)], batches, 4 << 20,
                          space=400 * 4096 + records)  # fmt: skip
    assert report.segments == 1 and report.cached_rows == 100 and report.packed == 6
    pack = EpochPack.open(final, {"test": 1})
    tier = PackedChunkTier(None, 0, 1024, torch.float32, 4096, SectionBuffers(1))
    tier.use(pack)
    for k, (cold,) in batches.items():
        lease = tier.claim_for(SimpleNamespace(batch_index=k), torch.from_numpy(cold))
        if k >= 6:
            assert not bool(lease.mask.any())  # left to direct reads
            continue
        tier.fill(lease)
        assert torch.equal(tier.rows(lease, torch.device("cpu")), torch.from_numpy(feats[cold]))
        tier.release(lease)
    tier.close()
    pack.close()


def test_a_damaged_disk_cache_row_is_an_error_not_wrong_rows(tmp_path):
    path, feats = _features(tmp_path, "f", 4000, 32, np.float32, 0)
    g = np.random.default_rng(5)
    batches = {k: [np.unique(g.choice(2000, 600))] for k in range(6)}
    own = sum(-(-len(b[0]) * 128 // 4096) * 4096 for b in batches.values())
    final, report = _pack(tmp_path, [FeatureSource(None, path, 128, 4000)], batches, 1 << 20, space=own * 3 // 4)
    assert report.cached_rows > 0
    pack = EpochPack.open(final, {"test": 1})
    seg = pack.cache(0, 0)
    with open(final / CHUNKS, "r+b") as f:  # one flipped byte in the first row of the cache
        f.seek(seg.row_start * 128 + 5)
        b = f.read(1)
        f.seek(seg.row_start * 128 + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    first = int(seg.sorted_ids[np.argsort(seg.sorted_pos)[0]])  # the id in that row
    k = next(k for k, (c,) in batches.items() if first in c)
    tier = PackedChunkTier(None, 0, 32, torch.float32, 128, SectionBuffers(1))
    tier.use(pack)
    lease = tier.claim_for(SimpleNamespace(batch_index=k), torch.from_numpy(batches[k][0]))
    with pytest.raises(CorruptDatasetError, match="disk cache do not match their checksums"):
        tier.fill(lease)
    tier.abandon(lease)
    tier.close()
    pack.close()
    (final / "caches.npz").write_bytes(b"damaged")
    pack = EpochPack.open(final, {"test": 1})
    with pytest.raises(CorruptDatasetError, match="caches.npz: does not match its checksum"):
        pack.cache(0, 0)
    pack.close()
    (final / "caches.npz").unlink()
    assert EpochPack.open(final, {"test": 1}) is None  # a pack without its cache index is not a pack


def test_a_damaged_or_foreign_pack_is_never_read(tmp_path):
    path, feats = _features(tmp_path, "f", 4000, 32, np.float32, 0)
    batches = {k: [np.arange(k, 4000, 7)] for k in range(3)}
    final, _ = _pack(tmp_path, [FeatureSource(None, path, 128, 4000)], batches, 1 << 20, identity={"dataset": "x"})
    assert EpochPack.open(final, {"dataset": "y"}) is None  # another dataset, settings or host cache
    manifest = json.loads((final / MANIFEST).read_text())
    (final / MANIFEST).write_text(json.dumps({**manifest, "format": 99}))
    assert EpochPack.open(final, {"dataset": "x"}) is None
    (final / MANIFEST).write_text(json.dumps(manifest))
    with open(final / CHUNKS, "r+b") as f:  # one flipped byte in a section
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    pack = EpochPack.open(final, {"dataset": "x"})
    tier = PackedChunkTier(None, 0, 32, torch.float32, 128, SectionBuffers(1))
    tier.use(pack)
    lease = tier.claim_for(SimpleNamespace(batch_index=0), torch.from_numpy(batches[0][0]))
    with pytest.raises(CorruptDatasetError, match="does not match its checksum"):
        tier.fill(lease)
    tier.abandon(lease)
    with open(final / GRAPHS, "r+b") as f:
        f.seek(20)
        f.write(b"\xff\xff")
    with pytest.raises(CorruptDatasetError, match="record of batch 0"):
        pack.load_batch(0)
    tier.close()
    pack.close()
    os.truncate(final / CHUNKS, 4096)  # a removal cut short: the manifest is there, the rows are not
    assert EpochPack.open(final, {"dataset": "x"}) is None


def test_a_full_disk_fails_before_writing_and_leaves_nothing(tmp_path, monkeypatch):
    path, _ = _features(tmp_path, "f", 4000, 32, np.float32, 0)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setattr(BulkFile, "_free_bytes", lambda self: 4096)
    with pytest.raises(OSError, match="disk is full"):
        _pack(tmp_path, [FeatureSource(None, path, 128, 4000)], {0: [np.arange(0, 4000, 3)]}, 1 << 20)
    assert list((tmp_path / "packs").iterdir()) == []
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


# -- through the datamodules ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("pk") / "g", num_nodes=6000, avg_degree=6, num_features=24,
                      num_classes=4, train_frac=0.3, val_frac=0.1, test_frac=0.1, seed=3, progress=False)  # fmt: skip


#: the tiered settings of every run here (the packed backend's too)
TIERS = dict(gpu_cache="2MiB", host_cache="96KiB", staging="512KiB", presample_batches=8)


def _kw(tiers=None, order="out_of_order", **kw):
    """A datamodule's arguments: the tiered backend with ``tiers`` changed (or ``features``), the pipeline in
    ``order``, and ``kw``."""
    return {**dict(batch_size=150, num_neighbors=[5, 3], progress=False, seed=1,
                   features=Tiered(**{**TIERS, **(tiers or {})}),
                   pipeline=dict(num_samplers=2, num_extractors=2, order=order)), **kw}  # fmt: skip


def _packed(root, tmp_path, cls=OutOfCoreNodeData, pack_space=10.0, first_epoch="pack", tiers=None, **kw):
    # toy graphs: records weigh, so the disk allowed is raised
    packed = Packed(pack_dir=tmp_path / "packs", pack_memory="8MiB", pack_space=pack_space, first_epoch=first_epoch,
                    **{**TIERS, **(tiers or {})})  # fmt: skip
    return cls(root, **_kw(features=packed, **kw))


def _same(a, b, hetero=False):
    if hetero:
        for t in a.node_types:
            assert torch.equal(a[t].n_id, b[t].n_id) and torch.equal(a[t].x, b[t].x), t
        for et in a.edge_types:
            assert torch.equal(a[et].edge_index, b[et].edge_index), et
        return
    for key in ("n_id", "edge_index", "x", "y"):
        if key in b:
            assert torch.equal(a[key], b[key]), key


def test_packed_batches_equal_the_tiered_ones_and_packs_go_once_trained(graph, tmp_path):
    ref = OutOfCoreNodeData(graph, **_kw(order="in_order"))
    dm = _packed(graph, tmp_path, order="in_order")
    ref.setup()
    dm.setup()
    src = dm.source
    for epoch in range(3):
        batches = list(src.run("train", epoch))
        expect = list(ref.source.run("train", epoch))
        assert len(batches) == len(expect) > 3
        for a, b in zip(batches, expect):
            _same(a, b)
        assert src.last_pack["packed"] == len(batches)
        # while epoch e trains, e + 1 is packed beside it; e - 1 is gone
        names = sorted(p.name for p in src.pack_dir.iterdir() if p.name.startswith("epoch-"))
        assert epoch_dirname(epoch - 1) not in names and epoch_dirname(epoch) in names
    stats = src.run("train", 3)
    list(stats)
    assert stats.stats.extra["packed_sections"] == stats.stats.batches and stats.stats.extra["packed_mismatched"] == 0
    assert stats.stats.io.bytes_read >= stats.stats.io.bytes_requested > 0
    assert stats.stats.io.bytes_read <= stats.stats.io.bytes_requested + stats.stats.batches * 4096
    # evaluation reads past the packs
    assert sum(int(b.batch_size) for b in src.run("val", 0)) == dm.dataset.split("val").numel()
    where = src.pack_dir
    dm.teardown()
    ref.teardown()
    assert not where.exists()  # a run that ends cleanly removes its packs


def test_a_pack_space_that_needs_disk_caches_gives_the_same_batches(graph, tmp_path):
    ref = OutOfCoreNodeData(graph, **_kw(order="in_order"))
    dm = _packed(graph, tmp_path, order="in_order", pack_space=4.0)  # each batch apart: 4.1x (2 epochs)
    ref.setup()
    dm.setup()
    src = dm.source
    for epoch in range(2):
        run = src.run("train", epoch)
        for a, b in zip(run, ref.source.run("train", epoch)):
            _same(a, b)
        assert src.last_pack["segments"] >= 1 and src.last_pack["cached_rows"] > 0
        assert src.last_pack["packed"] == run.stats.batches == run.stats.extra["packed_sections"]
        assert run.stats.extra["packed_mismatched"] == 0 and run.stats.extra["pack_space_ratio"] <= 2.0
    dm.teardown()
    ref.teardown()


def _fit(dm, epochs=2):
    L.seed_everything(0, workers=False)
    dm.setup()
    model = GraphSAGE(dm.num_features, dm.num_classes, hidden_channels=16, num_layers=2, lr=0.01)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        deterministic=True)  # fmt: skip
    trainer.fit(model, datamodule=dm)
    acc = trainer.test(model, datamodule=dm, verbose=False)[0]["test_acc"]
    dm.teardown()
    return model, acc


@pytest.mark.parametrize("first_epoch,pack_space", [("pack", 10.0), ("random", 10.0), ("pack", 4.0)])
def test_in_order_training_equals_training_from_memory(graph, tmp_path, first_epoch, pack_space):
    # pack_space=4.0: with disk caches
    packed, acc = _fit(_packed(graph, tmp_path, order="in_order", first_epoch=first_epoch, pack_space=pack_space))
    ram, acc_ram = _fit(OutOfCoreNodeData(graph, **_kw(order="in_order", features=Mapped(in_ram=True))))
    for (k, a), (_, b) in zip(packed.state_dict().items(), ram.state_dict().items()):
        assert torch.equal(a, b), k  # bit-identical: the same batches, the same rows
    assert acc == acc_ram and acc > 0.4


@pytest.mark.parametrize("pack_space", [10.0, 6.0])
def test_heterogeneous_batches_equal_the_tiered_ones(tmp_path, pack_space):  # 6.0: with disk caches
    root = synthesize_hetero(tmp_path / "igbh", "igbh", num_nodes=3000, num_features=16, num_classes=4,
                             train_frac=0.3, val_frac=0.1, test_frac=0.2, seed=0, progress=False)  # fmt: skip
    tiers = dict(gpu_cache="4MiB", host_cache="64KiB", staging="1MiB")
    kw = dict(batch_size=128, num_neighbors=[4, 3])
    ref = OutOfCoreNodeData(root, **_kw(tiers, order="in_order", **kw))
    dm = _packed(root, tmp_path, OutOfCoreNodeData, order="in_order", pack_space=pack_space, tiers=tiers, **kw)
    ref.setup()
    dm.setup()
    for epoch in range(2):
        run = dm.source.run("train", epoch)
        for a, b in zip(run, ref.source.run("train", epoch)):
            _same(a, b, hetero=True)
        assert run.stats.extra["packed_sections"] > run.stats.batches  # several node types a batch
        assert run.stats.extra["packed_mismatched"] == 0 and dm.source.last_pack["packed"] == run.stats.batches
        assert (dm.source.last_pack["cached_rows"] > 0) == (pack_space == 6.0)
    ref.teardown()
    dm.teardown()


def test_link_batches_equal_the_tiered_ones(graph, tmp_path):
    root = tmp_path / "links"
    subprocess.run([sys.executable, "-m", "lightning_ooc", "prepare", "--dataset", str(graph), "--out", str(root),
                    "--split-edges", "0.8,0.1,0.1", "--seed", "0"], check=True, env=_env(), capture_output=True)  # fmt: skip
    kw = dict(batch_size=256, num_neighbors=[4, 2])
    ref = OutOfCoreLinkData(root, **_kw(order="in_order", **kw))
    dm = _packed(root, tmp_path, OutOfCoreLinkData, order="in_order", pack_space=100, **kw)
    ref.setup()
    dm.setup()
    n = 0
    for a, b in zip(dm.source.run("train", 0), ref.source.run("train", 0)):
        _same(a, b)
        assert torch.equal(a.edge_label_index, b.edge_label_index)
        n += 1
    assert n == len(dm.train_dataloader()) and dm.source.last_pack["packed"] == n
    ref.teardown()
    dm.teardown()


def test_pack_files_use_direct_io_whatever_the_feature_reads_use(graph, tmp_path):
    ref = OutOfCoreNodeData(graph, **_kw(order="in_order"))
    dm = _packed(graph, tmp_path, order="in_order", tiers={"io_backend": "mmap"})  # the baseline reader
    ref.setup()
    dm.setup()
    for a, b in zip(dm.source.run("train", 0), ref.source.run("train", 0)):
        _same(a, b)
    assert dm.source.last_pack["packed"] > 0
    ref.teardown()
    dm.teardown()


def test_errors_name_the_setting(graph, tmp_path):
    with pytest.raises(InputError, match="pack_space"):
        Packed(pack_space=0)
    with pytest.raises(InputError, match="pack_memory"):
        Packed(pack_memory="1MiB")
    with pytest.raises(InputError, match="first_epoch"):
        Packed(first_epoch="later")
    with pytest.raises(InputError, match="pack_space"):  # as a YAML config gives it to the datamodule
        OutOfCoreNodeData(graph, features={"class_path": "lightning_ooc.Packed", "init_args": {"pack_space": 0}})
    with pytest.raises(DatasetWriteError, match="lies inside this command's input .*choose pack_dir outside it"):
        OutOfCoreNodeData(graph, **_kw(features=Packed(pack_dir=Path(graph) / "packs", **TIERS))).setup()
    with pytest.raises(InputError, match="host_cache_policy='scored'"):
        Packed(host_cache_policy="scored", **TIERS)
    cfg = NodeDataConfig(graph, **_kw(features=Packed(pack_dir=str(tmp_path / "p"), pack_memory="8MiB", **TIERS)))
    one = PackedPasses(cfg, ProcessContext())
    try:
        with pytest.raises(InputError, match="another process"):
            PackedPasses(cfg, ProcessContext())
    finally:
        one.close()
    with pytest.raises(TypeError, match=r"features=Packed"):  # the packed passes run the packed backend only
        PackedPasses(NodeDataConfig(graph, **_kw()), ProcessContext())


def test_packed_node_data_is_the_packed_backend_under_its_earlier_name(graph, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(datamodule, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        dms = [PackedNodeData(graph, pack_dir=tmp_path / "packs", pack_memory="8MiB", pack_space=10.0,
                              first_epoch="random", batch_size=150) for _ in range(2)]  # fmt: skip
    assert [type(dm) for dm in dms] == [OutOfCoreNodeData] * 2 and dms[0].config.batch_size == 150
    assert dms[0].config.features == Packed(pack_dir=tmp_path / "packs", pack_memory="8MiB", pack_space=10.0,
                                            first_epoch="random")  # fmt: skip
    said = [r.getMessage() for r in caplog.records if "PackedNodeData" in r.getMessage()]
    assert len(said) == 1 and "features=Packed(pack_memory=...)" in said[0]  # once, naming the new spelling


def test_a_full_disk_while_packing_is_a_clear_error(graph, tmp_path, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in Path(graph).iterdir()}
    dm = _packed(graph, tmp_path)
    dm.setup()
    monkeypatch.setattr(BulkFile, "_free_bytes", lambda self: 4096)
    with pytest.raises(PackingError, match="disk is full") as e:
        dm.source.run("train", 0)
    assert "packing the minibatches of epoch 0" in str(e.value)
    assert [p.name for p in dm.source.pack_dir.iterdir() if p.name.startswith("epoch-")] == []
    monkeypatch.undo()
    assert sum(1 for _ in dm.source.run("train", 0)) > 0  # the same store trains once there is room
    dm.teardown()
    assert {p.name: p.stat().st_mtime_ns for p in Path(graph).iterdir()} == before  # the dataset untouched


_KILL = textwrap.dedent("""
    import json, os, signal, sys
    from lightning_ooc import OutOfCoreNodeData, Packed
    from lightning_ooc.store import pack_writing as packing
    after = sys.argv[3]
    if after == "sampling":  # killed between sampling and packing the rows
        packing.EpochPackWriter.pack_features = lambda self: os.kill(os.getpid(), signal.SIGKILL)
    kw = dict(batch_size=150, num_neighbors=[5, 3], progress=False, seed=1,
              pipeline=dict(num_samplers=2, num_extractors=2, order="in_order"))
    packed = Packed(pack_dir=sys.argv[2], pack_memory="8MiB", **json.loads(sys.argv[4]))
    dm = OutOfCoreNodeData(sys.argv[1], features=packed, **kw)
    dm.setup()
    dm.source.run("train", 0)  # packs epoch 0 up front
    os.kill(os.getpid(), signal.SIGKILL)  # killed after a pack was committed
""")


@pytest.mark.parametrize("after", ["sampling", "commit"])
def test_a_run_killed_while_packing_restarts_cleanly(graph, tmp_path, after):
    packs = tmp_path / "packs"
    r = subprocess.run([sys.executable, "-c", _KILL, str(graph), str(packs), after, json.dumps(TIERS)], env=_env(),
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == -9, r.stderr[-2000:]
    (left,) = [p for p in packs.iterdir()]
    names = {p.name for p in left.iterdir()}
    assert (epoch_dirname(0) + ".partial" in names) == (after == "sampling")
    assert (epoch_dirname(0) in names) == (after == "commit")
    ref = OutOfCoreNodeData(graph, **_kw(order="in_order"))
    packed = Packed(pack_dir=packs, pack_memory="8MiB", **TIERS)  # pack_space as the killed run's (the default)
    dm = OutOfCoreNodeData(graph, **_kw(order="in_order", features=packed))
    ref.setup()
    dm.setup()
    assert dm.source.pack_dir == left
    assert not any(n.endswith(".partial") for n in os.listdir(left))  # what the killed run left half-done
    for a, b in zip(dm.source.run("train", 0), ref.source.run("train", 0)):
        _same(a, b)
    # a committed pack of the same dataset, settings and host cache is used as it is
    assert (dm.source.last_pack["pack_seconds"] is None) == (after == "commit")
    ref.teardown()
    dm.teardown()


def test_a_gather_process_is_refused(graph, tmp_path, monkeypatch):
    dm = _packed(graph, tmp_path)
    monkeypatch.setattr(ProcessContext, "of", staticmethod(lambda trainer: ProcessContext(remote=lambda cfg: None)))
    with pytest.raises(InputError, match="mps_split"):
        dm.setup()
