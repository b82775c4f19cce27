"""Process helpers shared by the writers and the strategy."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent(parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux only).

    ``parent`` is the pid the parent should have; if it is already gone (this process was
    re-parented before asking), ``sig`` is sent at once.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid() if parent is None else int(parent)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)
    return True
