"""Pinning host memory in place (``cudaHostRegister``) without leaving a CUDA error behind.

A failed ``cudaHostRegister`` (memory already registered, a limit on locked
memory, a mapping the driver refuses) returns an error code *and* leaves it as
the CUDA runtime's "last error". PyTorch checks ``cudaGetLastError`` after
every kernel launch, so the next, unrelated kernel would fail with this old
error. :func:`host_register` clears it (``cudaGetLastError`` of the runtime
PyTorch loaded), logs one line, and returns False so the caller falls back to
pageable memory.

Example (without CUDA nothing is registered)::

    >>> import torch
    >>> from lightning_ooc.store.pinning import host_register
    >>> t = torch.zeros(4)
    >>> host_register(t.data_ptr(), t.numel() * t.element_size(), "example") == torch.cuda.is_available()
    True
    >>> from lightning_ooc.store.pinning import host_unregister
    >>> host_unregister(t.data_ptr())
"""
from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger("lightning_ooc")

_cudart_lib: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (PyTorch's), or None."""
    global _cudart_lib
    if _cudart_lib is False:
        _cudart_lib = None
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "libcudart" in line}
            # the runtime PyTorch links first (its own lib, then the nvidia-cuda-runtime wheel), then any other
            def rank(path: str) -> tuple[int, str]:
                return (0 if "/torch/" in path else 1 if "cuda_runtime" in path else 2, path)

            for path in sorted(paths, key=rank):
                try:
                    lib = ctypes.CDLL(path)
                    lib.cudaGetLastError  # noqa: B018 - the symbol must be there
                    _cudart_lib = lib
                    break
                except (OSError, AttributeError):
                    continue
            if _cudart_lib is None:  # linked into the process itself (a static build)
                lib = ctypes.CDLL(None)
                if hasattr(lib, "cudaGetLastError"):
                    _cudart_lib = lib
        except OSError:
            pass
    return _cudart_lib or None


def clear_last_error() -> bool:
    """Reset the CUDA runtime's last error (``cudaGetLastError``). Returns whether it could."""
    lib = _loaded_cudart()
    if lib is None:
        return False
    lib.cudaGetLastError()
    return True


def host_register(ptr: int, nbytes: int, what: str) -> bool:
    """Pin ``nbytes`` at ``ptr`` for DMA and zero-copy device reads; False (and one log line) if it fails.

    ``what`` names the memory in the log line. Without CUDA nothing is done and False is returned.
    """
    if not torch.cuda.is_available() or nbytes <= 0:
        return False
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(int(ptr), int(nbytes), 0))
    if rc == 0:
        return True
    cleared = clear_last_error()
    try:
        reason = cudart.cudaGetErrorString(rc)
    except Exception:  # noqa: BLE001 - only for the message
        reason = f"error {rc}"
    log.warning("%s: cudaHostRegister of %d bytes failed (%s); using pageable memory instead (copies are staged%s)",
                what, nbytes, reason, "" if cleared else "; the CUDA error could not be cleared")  # fmt: skip
    return False


def host_unregister(ptr: int) -> None:
    """Undo :func:`host_register` (a no-op without CUDA); a failure is cleared, never left for a later call."""
    if not torch.cuda.is_available():
        return
    if int(torch.cuda.cudart().cudaHostUnregister(int(ptr))) != 0:
        clear_last_error()
