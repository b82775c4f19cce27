"""The native aggregation of layer-wise inference (``lightning_ooc._kernels.scatter_rows``) against torch's own."""
from __future__ import annotations

import logging

import pytest
import torch

from lightning_ooc.infer import layers
from lightning_ooc.infer.layers import scatter_rows

from lightning_ooc import _kernels  # built with the package: no skip


def _edges(num_src: int, num_dst: int, e: int, *, sort: bool, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, num_src, (e,), generator=g)
    d = torch.randint(0, num_dst, (e,), generator=g)
    if sort:
        d, order = torch.sort(d, stable=True)
        s = s[order]
    return s.to(dtype), d.to(dtype)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sum_and_count_equal_index_add_bit_for_bit(threads, sort, dtype):
    src = torch.randn(500, 7)
    s, d = _edges(500, 300, 50_000, sort=sort, dtype=dtype)
    want = torch.randn(300, 9)  # not zero: the kernel adds to what is there
    got = want.clone()
    want[:, :7].index_add_(0, d, src[s])
    want[:, 8].index_add_(0, d, torch.ones(d.numel()))
    _kernels.scatter_rows(got.numpy(), src.numpy(), s.numpy(), d.numpy(), count_col=8, threads=threads)
    assert torch.equal(got, want)  # each row's edges added in edge order, by one thread


@pytest.mark.parametrize("threads", [1, 2])
def test_max_equals_scatter_reduce_amax_nan_included(threads):
    src = torch.randn(400, 5)
    src[3, 1] = float("nan")
    s, d = _edges(400, 200, 30_000, sort=True, dtype=torch.int64, seed=1)
    s[:5] = 3  # the NaN row reaches some targets
    want = torch.full((200, 6), float("-inf"))
    want[7, :5] = float("nan")  # a NaN already there stays
    got = want.clone()
    want[:, :5].scatter_reduce_(0, d.view(-1, 1).expand(-1, 5), src[s], "amax", include_self=True)
    _kernels.scatter_rows(got.numpy(), src.numpy(), s.numpy(), d.numpy(), reduce="max", threads=threads)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got.isnan().any()


def test_bases_and_column_offset():
    src = torch.arange(12, dtype=torch.float32).view(4, 3)
    acc = torch.zeros(2, 5)
    s = torch.tensor([100, 103, 101])
    d = torch.tensor([50, 50, 51])
    _kernels.scatter_rows(acc.numpy(), src.numpy(), s.numpy(), d.numpy(), s_base=100, d_base=50, col=1, count_col=4)
    assert acc.tolist() == [[0, 9, 11, 13, 2], [0, 3, 4, 5, 1]]


def test_an_id_out_of_range_raises_and_leaves_the_accumulator_as_it_was():
    src = torch.randn(10, 4)
    acc = torch.randn(6, 4)
    before = acc.clone()
    s = torch.tensor([1, 2, 10, 3])
    d = torch.tensor([0, 1, 2, 3])
    with pytest.raises(IndexError, match="edge 2: source 10"):
        _kernels.scatter_rows(acc.numpy(), src.numpy(), s.numpy(), d.numpy(), threads=2)
    with pytest.raises(IndexError, match="edge 0"):
        _kernels.scatter_rows(acc.numpy(), src.numpy(), torch.tensor([0]).numpy(), torch.tensor([-1]).numpy())
    assert torch.equal(acc, before)


def test_bad_arguments_are_refused_by_name():
    acc, src = torch.zeros(4, 3), torch.zeros(4, 3)
    ids = torch.tensor([0, 1]).numpy()
    with pytest.raises(TypeError, match="acc: expected a C-contiguous 2-D float32"):
        _kernels.scatter_rows(acc.double().numpy(), src.numpy(), ids, ids)
    with pytest.raises(ValueError, match="do not fit"):
        _kernels.scatter_rows(acc.numpy(), src.numpy(), ids, ids, count_col=2)
    with pytest.raises(ValueError, match="same length"):
        _kernels.scatter_rows(acc.numpy(), src.numpy(), ids, ids[:1])
    with pytest.raises(ValueError, match="'sum' or 'max'"):
        _kernels.scatter_rows(acc.numpy(), src.numpy(), ids, ids, reduce="mean")


def test_scatter_rows_takes_torch_s_path_for_autograd_and_without_the_module(monkeypatch, caplog):
    src = torch.randn(20, 3, requires_grad=True)
    s, d = _edges(20, 5, 60, sort=True, dtype=torch.int64)
    acc = torch.zeros(5, 4)
    scatter_rows(acc, src, s, d, count_col=3)  # autograd: torch's path, gradients flow
    acc[:, :3].sum().backward()
    assert torch.equal(src.grad.sum(1), 3 * torch.bincount(s, minlength=20).float())
    monkeypatch.setattr(layers, "_kernels", None)
    monkeypatch.setattr(layers, "_said_fallback", False)
    plain = torch.zeros(5, 4)
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        scatter_rows(plain, src.detach(), s, d, count_col=3)
        scatter_rows(torch.zeros(5, 4), src.detach(), s, d, count_col=3)
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "_kernels is not built" in caplog.records[0].getMessage()
    assert torch.equal(plain, acc.detach())
