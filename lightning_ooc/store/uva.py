"""Zero-copy reads of pinned host memory by GPU threads ("unified tensor", as in PyTorch-Direct).

Host rows are pinned in place with ``cudaHostRegister``; with unified virtual
addressing their host address is valid on the device, so a kernel can gather
rows straight from host memory over PCIe without a CPU gather or a staging
copy. The Triton kernel below gives each program one output row and starts
its loads at the 128-byte line below the row's first byte (PyTorch-Direct's
circular shift), masking the bytes outside the row, so every warp reads whole
aligned lines even when rows are not multiples of 128 bytes.

On a machine without CUDA or Triton, :func:`gather_rows` falls back to
``index_select`` on the host followed by a copy, and says so once in the log.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("lightning_ooc")
_warned = False

try:  # pragma: no cover - needs CUDA and Triton
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_kernel(src, pos, out, n_cols, ALIGN_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        r = tl.load(pos + i).to(tl.int64)
        start = r * n_cols
        shift = start % ALIGN_ELEMS  # elements between the aligned line and the row start
        base = start - shift
        for k in range(0, n_cols + shift, BLOCK):
            offs = base + k + tl.arange(0, BLOCK)
            mask = (offs >= start) & (offs < start + n_cols)
            v = tl.load(src + offs, mask=mask)
            tl.store(out + i * n_cols + (offs - start), v, mask=mask)

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


def register(t: torch.Tensor) -> bool:
    """Pin ``t``'s memory in place for zero-copy device reads. Returns False where CUDA is absent."""
    if not torch.cuda.is_available() or t.is_cuda or t.numel() == 0:
        return False
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    return int(rc) == 0


def unregister(t: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def gather_rows(host_rows: torch.Tensor, pos: torch.Tensor, device: torch.device, zero_copy: bool) -> torch.Tensor:
    """Rows ``host_rows[pos]`` as a tensor on ``device``.

    With ``zero_copy`` (``host_rows`` registered, CUDA device, Triton present)
    GPU threads read the host rows directly; otherwise the rows are gathered on
    the host and copied.
    """
    global _warned
    device = torch.device(device)
    if device.type == "cuda" and zero_copy and HAVE_TRITON:  # pragma: no cover - needs a GPU
        pos = pos.to(device, non_blocking=True)
        n, f = pos.numel(), host_rows.shape[1]
        out = torch.empty((n, f), dtype=host_rows.dtype, device=device)
        if n:
            align = max(1, 128 // host_rows.element_size())
            block = max(align, min(1024, triton.next_power_of_2(f + align)))
            _gather_kernel[(n,)](_HostPointer(host_rows), pos, out, f, ALIGN_ELEMS=align, BLOCK=block)
        return out
    if device.type == "cuda" and not _warned:
        _warned = True
        log.warning("host cache: zero-copy gather unavailable (%s); gathering on the CPU and copying",
                    "Triton missing" if not HAVE_TRITON else "memory not registered")  # fmt: skip
    rows = host_rows.index_select(0, pos)
    return rows if device.type == "cpu" else rows.to(device, non_blocking=False)
