"""The synthetic generator: deterministic, heavy-tailed, learnable."""
import numpy as np
import pytest
import torch

import lightning_ooc
from lightning_ooc.data.synth import synthesize
from lightning_ooc.testing import dataset_files_bytes, make_synthetic


def test_same_arguments_same_bytes(tmp_path, monkeypatch):
    """Chunks are drawn by several threads, each from its own random stream: the bytes do not depend on how
    many threads drew them, or in which order they finished."""
    from lightning_ooc.data import synth

    kw = dict(num_nodes=200_000, avg_degree=6, num_features=8, num_classes=5, seed=7, progress=False)
    monkeypatch.setattr(synth, "WORKERS", 1)
    a = synthesize(tmp_path / "a", **kw)  # more than one generation chunk
    monkeypatch.setattr(synth, "WORKERS", 4)
    b = synthesize(tmp_path / "b", **kw)
    fa, fb = dataset_files_bytes(a), dataset_files_bytes(b)
    assert sorted(fa) == ["features.bin", "indices.npy", "indptr.npy", "labels.npy", "meta.json",
                          "test.npy", "train.npy", "val.npy"]  # fmt: skip
    assert fa == fb
    c = synthesize(tmp_path / "c", **{**kw, "seed": 8})
    fc = dataset_files_bytes(c)
    assert fc["features.bin"] != fa["features.bin"] and fc["indices.npy"] != fa["indices.npy"]


def test_a_chunk_that_fails_raises_at_its_turn_and_leaves_no_thread(monkeypatch):
    import threading

    from lightning_ooc.data import synth

    monkeypatch.setattr(synth, "WORKERS", 3)

    def draw(i, lo, hi):
        if i == 2:
            raise OSError(28, "No space left on device")
        return i

    got = []
    with pytest.raises(OSError, match="No space left"):
        for i in synth._in_order(draw, synth.CHUNK * 6, 1):
            got.append(i)
    assert got == [0, 1]  # the chunks before it, in order
    assert not [t for t in threading.enumerate() if t.name.startswith("looc-synth")]


def test_structure(tmp_path):
    ds = make_synthetic(tmp_path / "g", num_nodes=20_000, avg_degree=12, num_classes=6, homophily=0.8)
    deg = ds.in_degree
    assert 9 < deg.mean() < 14  # target 12 before repeats are dropped
    assert deg.max() > 15 * deg.mean()  # heavy tail
    idx = np.asarray(ds.indices)
    dst = np.repeat(np.arange(ds.num_nodes), deg)
    assert not np.any(idx == dst)  # no self-loops
    keys = dst * ds.num_nodes + idx
    assert np.unique(keys).size == keys.size  # no repeated edge
    y = np.asarray(ds.labels)
    same = (y[idx] == y[dst]).mean()
    assert 0.75 < same < 0.9  # homophily 0.8 plus the chance of a random pick in the same class
    assert np.bincount(y).min() > 20_000 / 6 * 0.9
    assert abs(len(ds.split("train")) - 200) < 60 and len(ds.split("test")) > 100


def _accuracy(x, y, train, test, epochs=200):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 64), torch.nn.ReLU(), torch.nn.Linear(64, int(y.max()) + 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[train]), y[train]).backward()
        opt.step()
    return (model(x[test]).argmax(1) == y[test]).float().mean().item()


def test_graph_structure_is_needed_to_learn(tmp_path):
    """An MLP on features alone is clearly worse than one that also sees neighbour means (2 hops)."""
    ds = make_synthetic(tmp_path / "g", num_nodes=30_000, avg_degree=10, num_features=32, num_classes=8,
                        train_frac=0.03, test_frac=0.05)  # fmt: skip
    x = ds.read_features(np.arange(ds.num_nodes))
    deg = torch.from_numpy(ds.in_degree)
    dst = torch.repeat_interleave(torch.arange(ds.num_nodes), deg)
    src = torch.from_numpy(np.asarray(ds.indices).astype(np.int64))

    def mean_in(h):
        return torch.zeros_like(h).index_add_(0, dst, h[src]) / deg.clamp(min=1)[:, None]

    h1 = mean_in(x)
    x_gnn = torch.cat([x, h1, mean_in(h1)], 1)
    y = torch.from_numpy(np.array(ds.labels))
    train, test = ds.split("train"), ds.split("test")
    mlp, gnn = _accuracy(x, y, train, test), _accuracy(x_gnn, y, train, test)
    assert mlp > 1.5 / 8  # features carry signal...
    assert gnn > mlp + 0.25, (mlp, gnn)  # ...but the graph carries much more


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_features(tmp_path, dtype):
    ds32 = make_synthetic(tmp_path / "a", num_nodes=1000)
    ds16 = make_synthetic(tmp_path / "b", num_nodes=1000, feature_dtype=dtype)
    assert ds16.row_bytes == ds32.row_bytes // 2 and str(ds16.feature_dtype) == f"torch.{dtype}"
    ids = np.array([3, 999, 0, 3])
    torch.testing.assert_close(ds16.read_features(ids), ds32.read_features(ids).to(ds16.feature_dtype))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(degree_exponent=2.0), "degree_exponent must be > 2"),
        (dict(homophily=1.5), "homophily"),
        (dict(train_frac=0.9, val_frac=0.2), "split fractions"),
        (dict(num_nodes=0), "need nodes"),
        (dict(feature_dtype="int64"), "unsupported feature dtype"),
        (dict(avg_degree=float("nan")), "avg_degree must be a finite number, got nan"),
        (dict(avg_degree=float("inf")), "avg_degree must be a finite number, got inf"),
        (dict(degree_exponent=float("nan")), "degree_exponent must be a finite number, got nan"),
        (dict(train_frac=float("nan")), "train_frac must be a finite number, got nan"),
        (dict(feature_noise=-1.0), "feature_noise must be >= 0"),
    ],
)
def test_bad_arguments(tmp_path, kw, message):
    args = dict(num_nodes=100, avg_degree=3, num_features=4, num_classes=2, progress=False)
    args.update(kw)
    with pytest.raises(lightning_ooc.InputError, match=message):
        synthesize(tmp_path / "g", **args)
    assert not any(tmp_path.iterdir())
