"""The CUDA current device of a thread.

CUDA's current device is per thread, and every new thread starts on GPU 0.
A thread that touches CUDA for a rank on GPU 3 without selecting it first
creates a context on GPU 0 and allocates there whatever names no device
index. Every thread of ours that may touch CUDA calls :func:`use_device`
first.

Example::

    >>> import torch
    >>> from lightning_ooc.utils.device import use_device
    >>> use_device(torch.device("cpu"))  # nothing to select off a GPU
"""
from __future__ import annotations

import torch


def resolved(device: torch.device | str | None) -> torch.device | None:
    """``device`` with the calling thread's current GPU filled in where it names none (``"cuda"``)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def use_device(device: torch.device | str | None) -> None:
    """Make ``device`` the calling thread's current CUDA device (a no-op for other devices)."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
