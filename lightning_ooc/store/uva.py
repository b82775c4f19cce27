"""Zero-copy reads of pinned host memory by GPU threads ("unified tensor", as in PyTorch-Direct).

Host rows are pinned in place with ``cudaHostRegister`` (:mod:`lightning_ooc.store.pinning`); with unified virtual
addressing their host address is valid on the device, so a Triton kernel can
gather rows straight from host memory over PCIe, with no CPU gather and no
staging copy, and write them straight into the batch's feature matrix:
:func:`gather_rows_into` does ``out[out_rows[i]] = host_rows[pos[i]]``.

The kernel (:func:`triton_gather_into`) gives each program a tile of ``ROWS``
rows by ``BLOCK`` columns. Each row's loads start at the 128-byte line at or
below the row's first byte (PyTorch-Direct's circular shift) and mask the
bytes outside the row, so a warp reads whole aligned lines even when rows are
not multiples of 128 bytes. Where a row is a multiple of 16 bytes (and the
source 16-byte aligned) the host picks the vectorised variant: the column
count is passed as a multiple of ``VEC = 16 // element_size`` and the offsets
carry ``tl.multiple_of`` / ``tl.max_contiguous`` hints, so the compiler can
issue 16-byte loads and stores; other rows take the element-wise masked
variant. Every offset (row index times row length, source and output) is
int64, so tables past 2**31 elements are addressed correctly.

Under ``TRITON_INTERPRET=1`` (set before ``triton`` is imported) the same
kernel runs on CPU tensors, which is how the tests check it. Without CUDA,
Triton or a registered table, :func:`gather_rows_into` falls back to
``index_select`` on the host and ``index_copy_`` into ``out``, and says so once
in the log when ``out`` is on a GPU:

>>> import torch
>>> host = torch.arange(12.).reshape(4, 3)
>>> x = torch.zeros(3, 3)
>>> gather_rows_into(x, torch.tensor([2, 0]), host, torch.tensor([1, 3]), zero_copy=False)
>>> x
tensor([[ 9., 10., 11.],
        [ 0.,  0.,  0.],
        [ 3.,  4.,  5.]])
>>> gather_rows(host, torch.tensor([3, 3]), torch.device("cpu"), zero_copy=False)
tensor([[ 9., 10., 11.],
        [ 9., 10., 11.]])
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("lightning_ooc")
_warned = False

#: PCIe reads are whole lines of this many bytes; each row's loads start on one.
LINE_BYTES = 128
#: Bytes per vector load or store in the aligned variant.
VEC_BYTES = 16
#: Bytes one program handles per row per loop step, and per tile.
_ROW_STEP_BYTES = 4096
_TILE_BYTES = 16384
_MAX_ROWS = 64
#: Gathers of at least this many rows read their source rows in ascending order (see triton_gather_into).
SORT_MIN = 2

try:  # the kernel runs on a GPU, or on CPU tensors under TRITON_INTERPRET=1
    import triton
    import triton.language as tl

    # n and the source's misalignment change from call to call: no specialisation (and recompilation) on them
    @triton.jit(do_not_specialize=["n", "src_mis"])
    def _gather_kernel(
        src,  # host rows: n_src x n_cols, contiguous
        pos,  # int64 [n]: source row of each output
        out,  # output rows: row-contiguous, n_cols columns
        out_rows,  # int64 [n]: output row of each output
        n,
        n_vecs,  # n_cols // VEC
        src_mis,  # (address of src % LINE_BYTES) // element size
        VEC: tl.constexpr,  # elements per 16-byte vector, or 1 (rows not 16-byte multiples)
        ALIGN: tl.constexpr,  # elements per 128-byte line
        MAX_SHIFT: tl.constexpr,  # largest circular shift of any row, in elements
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # n_cols written as n_vecs * VEC, so the compiler knows its factor VEC
        # (and that of every row start below).
        n_cols = n_vecs * VEC
        i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_ok = i < n
        r = tl.load(pos + i, mask=row_ok, other=0).to(tl.int64)
        o = tl.load(out_rows + i, mask=row_ok, other=0).to(tl.int64)
        start = r * n_cols  # int64: first element of the source row
        end = start + n_cols
        dst = o * n_cols  # int64: first element of the output row
        # Circular shift: begin at the 128-byte line holding the row's first byte.
        base = start - (start + src_mis) % ALIGN
        if VEC > 1:
            base = tl.multiple_of(base, VEC)
        cols = tl.arange(0, BLOCK)
        for k in range(0, n_cols + MAX_SHIFT, BLOCK):
            offs = base[:, None] + (k + cols)[None, :]
            d_offs = dst[:, None] + (offs - start[:, None])
            if VEC > 1:
                offs = tl.max_contiguous(tl.multiple_of(offs, [1, VEC]), [1, VEC])
                d_offs = tl.max_contiguous(tl.multiple_of(d_offs, [1, VEC]), [1, VEC])
            mask = row_ok[:, None] & (offs >= start[:, None]) & (offs < end[:, None])
            v = tl.load(src + offs, mask=mask)
            tl.store(out + d_offs, v, mask=mask)

    HAVE_TRITON = True
except Exception:  # ImportError, or a Triton without a usable backend
    HAVE_TRITON = False


class _HostPointer:
    """What Triton needs of a tensor argument: the address and the dtype."""

    def __init__(self, t: torch.Tensor):
        self._ptr = t.data_ptr()
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self._ptr


def _next_pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def kernel_plan(n_cols: int, element_size: int, src_ptr: int, n: int) -> dict:
    """Launch parameters of the gather kernel for ``n`` rows of ``n_cols`` elements at ``src_ptr``.

    ``VEC > 1`` (the vectorised variant) where a row is a multiple of 16 bytes
    and the source is 16-byte aligned; ``MAX_SHIFT`` is 0 where every row
    already starts on a 128-byte line.

    >>> kernel_plan(128, 4, 4096, 10)["VEC"], kernel_plan(37, 4, 4096, 10)["VEC"]
    (4, 1)
    """
    row_bytes = n_cols * element_size
    align = max(1, LINE_BYTES // element_size)
    vec = VEC_BYTES // element_size if row_bytes % VEC_BYTES == 0 and src_ptr % VEC_BYTES == 0 else 1
    vec = max(1, vec)
    max_shift = 0 if row_bytes % LINE_BYTES == 0 and src_ptr % LINE_BYTES == 0 else align - vec
    block = min(_next_pow2(n_cols + max_shift), max(align, _ROW_STEP_BYTES // element_size))
    # not dependent on n, so that batches of any size reuse one compiled kernel per row shape
    rows = max(1, min(_MAX_ROWS, _TILE_BYTES // (block * element_size)))
    rows = 1 << (rows.bit_length() - 1)  # a power of two
    return dict(VEC=vec, ALIGN=align, MAX_SHIFT=max_shift, ROWS=rows, BLOCK=block)


def _launch(out, out_rows: torch.Tensor, src, pos: torch.Tensor, n_cols: int, element_size: int) -> None:
    """Run the kernel: ``out`` and ``src`` are anything Triton takes as a pointer."""
    n = pos.numel()
    if n == 0:
        return
    src_ptr = src.data_ptr()
    p = kernel_plan(n_cols, element_size, src_ptr, n)
    grid = (triton.cdiv(n, p["ROWS"]),)
    _gather_kernel[grid](src, pos, out, out_rows, n, n_cols // p["VEC"], (src_ptr % LINE_BYTES) // element_size, **p)


def triton_gather_into(out: torch.Tensor, out_rows: torch.Tensor, src: torch.Tensor, pos: torch.Tensor) -> None:
    """``out[out_rows[i]] = src[pos[i]]`` by the Triton kernel, on the tensors given.

    ``out`` is on a GPU and ``src`` in registered host memory (or on the same
    GPU); or, under ``TRITON_INTERPRET=1``, all are CPU tensors. ``src`` must be
    contiguous and ``out`` row-contiguous with the same row length and dtype.
    Indices are not checked on the device: where ``pos`` or ``out_rows`` is a
    CPU tensor its range is checked here. The rows are read in ascending
    order of ``pos`` (sorted on the device, ``out_rows`` permuted with it):
    GPU reads of host memory at random addresses reach about a third of the
    link's bandwidth, in address order about nine tenths.
    """
    if not HAVE_TRITON:
        raise RuntimeError("triton_gather_into needs Triton")
    if src.dim() != 2 or out.dim() != 2 or src.shape[1] != out.shape[1]:
        raise ValueError(f"rows of different shapes: src {tuple(src.shape)}, out {tuple(out.shape)}")
    if src.dtype != out.dtype:
        raise ValueError(f"dtypes differ: src {src.dtype}, out {out.dtype}")
    n_cols = out.shape[1]
    if not src.is_contiguous() or (out.shape[0] > 1 and out.stride(0) != n_cols) or (n_cols > 1 and out.stride(1) != 1):
        raise ValueError("src must be contiguous and out row-contiguous")
    if pos.dim() != 1 or out_rows.shape != pos.shape:
        raise ValueError(f"pos {tuple(pos.shape)} and out_rows {tuple(out_rows.shape)} must be 1-D of one length")
    if pos.numel() == 0 or n_cols == 0:
        return
    for name, idx, bound in (("pos", pos, src.shape[0]), ("out_rows", out_rows, out.shape[0])):
        if not idx.is_cuda and (int(idx.min()) < 0 or int(idx.max()) >= bound):
            raise IndexError(f"{name} out of range [0, {bound})")
    dev = out.device
    pos = pos.to(dev, torch.int64, non_blocking=True).contiguous()
    out_rows = out_rows.to(dev, torch.int64, non_blocking=True).contiguous()
    if pos.numel() >= SORT_MIN:
        # in ascending source order: random rows read in address order run at about 0.9 of pinned cudaMemcpy
        # over PCIe, in random order at about 0.36 (H100); the sort is on the device, with no host sync
        pos, order = torch.sort(pos)
        out_rows = out_rows[order]
    if dev.type == "cuda":  # pragma: no cover - needs a GPU
        s = _HostPointer(src) if not src.is_cuda else src
        with torch.cuda.device(dev):
            _launch(out, out_rows, s, pos, n_cols, out.element_size())
    else:  # CPU tensors: only under TRITON_INTERPRET=1
        _launch(out, out_rows, src, pos, n_cols, out.element_size())


def _zero_copy_ok(out: torch.Tensor, host_rows: torch.Tensor, zero_copy: bool) -> bool:
    return (
        out.is_cuda
        and zero_copy
        and HAVE_TRITON
        and host_rows.dim() == 2
        and out.dim() == 2
        and host_rows.is_contiguous()
        and host_rows.dtype == out.dtype
        and host_rows.shape[1] == out.shape[1]
        and (out.shape[0] <= 1 or out.stride(0) == out.shape[1])
        and (out.shape[1] <= 1 or out.stride(1) == 1)
    )


def _warn_fallback() -> None:
    """One log line where Triton is missing (a failed registration was already logged where it failed)."""
    global _warned
    if not _warned and not HAVE_TRITON:
        _warned = True
        log.warning("host cache: zero-copy gather unavailable (Triton missing); gathering on the CPU and copying")


def gather_rows_into(
    out: torch.Tensor, out_rows: torch.Tensor, host_rows: torch.Tensor, pos: torch.Tensor, zero_copy: bool
) -> None:
    """``out[out_rows[i]] = host_rows[pos[i]]`` for every ``i``, in place.

    ``out`` is the batch's feature matrix (on its device), ``out_rows`` int64
    row positions in it, ``pos`` row positions in ``host_rows``. With
    ``zero_copy`` (``host_rows`` registered, ``out`` on a GPU, Triton present)
    GPU threads read the host rows directly and write them into ``out``;
    otherwise the rows are gathered on the host, copied and scattered with
    ``index_copy_``.
    """
    if _zero_copy_ok(out, host_rows, zero_copy):  # pragma: no cover - needs a GPU
        triton_gather_into(out, out_rows, host_rows, pos)
        return
    if out.is_cuda:
        _warn_fallback()
        # gathered on the host into pinned memory, then copied without holding the trainer up
        rows = host_rows.index_select(0, pos.to(host_rows.device)).pin_memory()
        out.index_copy_(0, out_rows.to(out.device, non_blocking=True), rows.to(out.device, non_blocking=True))
        return
    out.index_copy_(0, out_rows, host_rows.index_select(0, pos))  # all on the CPU


def gather_rows(host_rows: torch.Tensor, pos: torch.Tensor, device: torch.device, zero_copy: bool) -> torch.Tensor:
    """Rows ``host_rows[pos]`` as a new tensor on ``device``.

    With ``zero_copy`` on a GPU this is :func:`gather_rows_into` an empty
    tensor; otherwise the rows are gathered on the host and copied.
    """
    device = torch.device(device)
    if device.type == "cuda" and zero_copy and HAVE_TRITON and host_rows.dim() == 2:  # pragma: no cover - GPU
        n = pos.numel()
        out = torch.empty((n, host_rows.shape[1]), dtype=host_rows.dtype, device=device)
        gather_rows_into(out, torch.arange(n, device=device), host_rows, pos, zero_copy)
        return out
    if device.type == "cuda":
        _warn_fallback()
    rows = host_rows.index_select(0, pos)
    return rows if device.type == "cpu" else rows.to(device, non_blocking=False)
