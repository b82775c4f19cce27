"""prepare -> open_dataset gives exactly the reference CSC, feature bytes, labels and splits."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_ooc
from lightning_ooc.data.format import FEATURE_DTYPES
from lightning_ooc.data.prepare import prepare_from_arrays, prepare_from_edge_list, prepare_from_pyg
from lightning_ooc.testing import reference_csc


def _expected_rows(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return x.astype(FEATURE_DTYPES[dtype][1])


@st.composite
def graphs(draw):
    n = draw(st.integers(1, 40))
    e = draw(st.integers(0, 120))
    ids = st.integers(0, n - 1)
    src = np.array(draw(st.lists(ids, min_size=e, max_size=e)), dtype=np.int64)
    # bias towards repeats and self-loops: reuse sources as targets sometimes
    dst = np.array(draw(st.lists(ids, min_size=e, max_size=e)), dtype=np.int64)
    if e and draw(st.booleans()):
        k = draw(st.integers(0, e - 1))
        dst[:k] = src[:k]  # self-loops
    if e > 1 and draw(st.booleans()):
        src = np.concatenate([src, src[: e // 2]])
        dst = np.concatenate([dst, dst[: e // 2]])  # duplicates
    f = draw(st.integers(1, 9))
    return n, src, dst, f


@settings(max_examples=60)
@given(
    g=graphs(),
    add_reverse=st.booleans(),
    drop_self_loops=st.booleans(),
    drop_duplicates=st.booleans(),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    bucket_edges=st.sampled_from([1, 3, 1 << 20]),
    seed=st.integers(0, 2**16),
)
def test_prepare_roundtrip(tmp_path_factory, g, add_reverse, drop_self_loops, drop_duplicates, dtype, bucket_edges, seed):
    n, src, dst, f = g
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, f)).astype(np.float32)
    num_classes = 3
    y = rng.integers(-1, num_classes, n)
    train = (rng.random(n) < 0.5) & (y >= 0)  # a split holds labelled nodes only
    test_ids = np.flatnonzero(~train & (y >= 0))[::2]
    out = tmp_path_factory.mktemp("rt") / "g"
    prepare_from_arrays(
        out, np.stack([src, dst]), x, y, train=train, test=test_ids, num_classes=num_classes, feature_dtype=dtype,
        add_reverse=add_reverse, drop_self_loops=drop_self_loops, drop_duplicates=drop_duplicates,
        progress=False, bucket_edges=bucket_edges,
    )  # fmt: skip
    ds = lightning_ooc.open_dataset(out)
    indptr, indices = reference_csc(
        src, dst, n, add_reverse=add_reverse, drop_self_loops=drop_self_loops, drop_duplicates=drop_duplicates
    )
    assert ds.num_nodes == n and ds.num_edges == len(indices)
    np.testing.assert_array_equal(ds.indptr, indptr)
    np.testing.assert_array_equal(np.asarray(ds.indices), indices)
    assert ds.indices.dtype == np.int32
    assert ds.features_path.read_bytes() == _expected_rows(x, dtype).tobytes()
    assert ds.feature_dtype == FEATURE_DTYPES[dtype][0]
    np.testing.assert_array_equal(np.asarray(ds.labels), y)
    np.testing.assert_array_equal(ds.split("train").numpy(), np.flatnonzero(train))
    np.testing.assert_array_equal(ds.split("test").numpy(), test_ids)
    assert ds.split("val").numel() == 0
    rows = ds.read_features(np.arange(n)[::-1].copy())
    assert rows.dtype == FEATURE_DTYPES[dtype][0]
    assert rows.flip(0).contiguous().view(torch.uint8).numpy().tobytes() == _expected_rows(x, dtype).tobytes()


def _graph(seed=0, n=50, e=300):
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = rng.integers(0, 4, n)
    return n, src, dst, x, y


def _check(ds, n, src, dst, x, y, **opts):
    indptr, indices = reference_csc(src, dst, n, **opts)
    np.testing.assert_array_equal(ds.indptr, indptr)
    np.testing.assert_array_equal(np.asarray(ds.indices), indices)
    assert ds.features_path.read_bytes() == x.astype(np.float32).tobytes()
    np.testing.assert_array_equal(np.asarray(ds.labels), y)


def test_prepare_from_pyg_file(tmp_path):
    from torch_geometric.data import Data

    n, src, dst, x, y = _graph()
    train = torch.zeros(n, dtype=torch.bool)
    train[:10] = True
    data = Data(x=torch.from_numpy(x).double(), edge_index=torch.from_numpy(np.stack([src, dst])),
                y=torch.from_numpy(y), train_mask=train)  # fmt: skip
    torch.save(data, tmp_path / "g.pt")
    prepare_from_pyg(tmp_path / "out", tmp_path / "g.pt", add_reverse=True, drop_duplicates=True, progress=False)
    ds = lightning_ooc.open_dataset(tmp_path / "out")
    _check(ds, n, src, dst, x, y, add_reverse=True, drop_duplicates=True)
    assert ds.split("train").tolist() == list(range(10))
    assert ds.feature_dtype == torch.float32  # float64 input is stored as float32 by default


def test_prepare_from_edge_list_csv_and_tsv(tmp_path):
    n, src, dst, x, y = _graph(1)
    np.save(tmp_path / "x.npy", x)
    lines = [f"{s},{d},{0.5}" for s, d in zip(src, dst)]
    (tmp_path / "e.csv").write_text("source,target,weight\n# a comment\n" + "\n".join(lines) + "\n")
    prepare_from_edge_list(tmp_path / "a", tmp_path / "e.csv", np.load(tmp_path / "x.npy", mmap_mode="r"), y,
                           drop_self_loops=True, progress=False)  # fmt: skip
    _check(lightning_ooc.open_dataset(tmp_path / "a"), n, src, dst, x, y, drop_self_loops=True)
    (tmp_path / "e.tsv").write_text("\n".join(f"{s}\t{d}" for s, d in zip(src, dst)))  # no final newline
    prepare_from_edge_list(tmp_path / "b", tmp_path / "e.tsv", x, y, progress=False)
    ds = lightning_ooc.open_dataset(tmp_path / "b")
    _check(ds, n, src, dst, x, y)
    # no split given: labelled nodes split 80/10/10, disjoint
    parts = [set(ds.split(s).tolist()) for s in ("train", "val", "test")]
    assert sum(map(len, parts)) == n and len(set().union(*parts)) == n
    assert not list((tmp_path / "b").glob("*.pairs"))


def test_prepare_float_labels_with_nan_and_npy_paths(tmp_path):
    n, src, dst, x, y = _graph(2)
    yf = y.astype(np.float32)
    yf[::3] = np.nan
    np.save(tmp_path / "ei.npy", np.stack([src, dst]))
    np.save(tmp_path / "x.npy", x)
    prepare_from_arrays(tmp_path / "g", tmp_path / "ei.npy", tmp_path / "x.npy", yf, progress=False)
    ds = lightning_ooc.open_dataset(tmp_path / "g")
    want = y.copy()
    want[::3] = -1
    _check(ds, n, src, dst, x, want)
    assert not set(ds.split("train").tolist()) & set(np.flatnonzero(want < 0).tolist())


def test_large_ids_use_int64_indices():
    from lightning_ooc.data.format import index_dtype

    assert index_dtype(2**31 - 1) == np.int32 and index_dtype(2**31) == np.int64


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(edge_index=np.array([[0, 5], [1, 1]])), "edge 1 is (5 -> 1)"),
        (dict(edge_index=np.array([[0, -1], [1, 1]])), "must lie in [0, 3)"),
        (dict(edge_index=np.array([[0.0, 1.0], [1.0, 2.0]])), "must be integers"),
        (dict(edge_index=np.array([0, 1, 2])), "shape (2, E)"),
        (dict(y=np.array([0, 1])), "labels must have shape (3,)"),
        (dict(y=np.array([0.5, 1, 2])), "fractional"),
        (dict(train=np.array([0, 0])), "duplicate"),
        (dict(train=np.array([7])), "train split"),
        (dict(x=np.zeros((3, 2), dtype=np.complex64)), "dtype complex64"),
        (dict(feature_dtype="int64"), "unsupported feature dtype"),
    ],
)
def test_prepare_rejects_bad_input(tmp_path, kwargs, message):
    args = dict(edge_index=np.array([[0, 1], [1, 2]]), x=np.zeros((3, 2), dtype=np.float32), y=None)
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(lightning_ooc.InputError) as ei:
        prepare_from_arrays(tmp_path / "g", args["edge_index"], args["x"], args["y"], progress=False, **kwargs)
    assert message in str(ei.value)
    assert not (tmp_path / "g").exists()
    assert not list(tmp_path.glob(".g.partial-*"))


def test_edge_list_errors_name_file_and_line(tmp_path):
    x = np.zeros((4, 2), dtype=np.float32)
    (tmp_path / "bad.csv").write_text("0,1\n1,2\n2,x\n")
    with pytest.raises(lightning_ooc.InputError, match=r"bad.csv:3: 'x' is not an integer"):
        prepare_from_edge_list(tmp_path / "g", tmp_path / "bad.csv", x, progress=False)
    (tmp_path / "ragged.tsv").write_text("0\t1\n1\t2\t3\n")
    with pytest.raises(lightning_ooc.InputError, match=r"ragged.tsv:2: expected 2 columns"):
        prepare_from_edge_list(tmp_path / "g", tmp_path / "ragged.tsv", x, progress=False)
    assert not (tmp_path / "g").exists()


def test_existing_target_needs_overwrite(tmp_path):
    n, src, dst, x, y = _graph(3)
    prepare_from_arrays(tmp_path / "g", np.stack([src, dst]), x, y, progress=False)
    with pytest.raises(lightning_ooc.DatasetWriteError, match="already exists; pass --overwrite"):
        prepare_from_arrays(tmp_path / "g", np.stack([src, dst]), x, y, progress=False)
    prepare_from_arrays(tmp_path / "g", np.stack([dst, src]), x, y, progress=False, overwrite=True)
    _check(lightning_ooc.open_dataset(tmp_path / "g"), n, dst, src, x, y)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]
