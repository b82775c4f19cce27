"""CUDA MPS for ``mps_split``: find or start the control daemon, and split each GPU's SMs.

Under MPS the kernels of several processes share a GPU at once, and each
process may be capped to a percentage of the SMs
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, read when the process creates its CUDA
context). PyTorch-Direct runs its gather kernels in a producer process capped
to about 10 % and the training process with the rest, so gathers for the next
minibatch never wait for a training kernel to free the GPU.

:class:`MPSControl` talks to ``nvidia-cuda-mps-control``, the only boundary
with the driver:

- :meth:`~MPSControl.ensure` uses a daemon that is already running (its pipe
  directory from ``CUDA_MPS_PIPE_DIRECTORY``, else ``/tmp/nvidia-mps``, holds
  a ``control`` pipe), or one another rank of this run on this machine started,
  or starts one itself with ``-d`` and pipe and log directories in a private
  temporary directory; a file lock makes the ranks of a machine agree on one.
  The lock and the advert of a started daemon live in a directory private to
  the user (``looc-mps-UID`` in the temporary directory, mode 0700, owner
  checked); an advert or a pipe another user owns is never followed.
- :meth:`~MPSControl.stop` sends ``quit`` only to a daemon this process
  started, and removes its directories.

Example (with a stand-in for the daemon's control program)::

    >>> import os, stat, tempfile
    >>> from lightning_ooc.strategy.mps import MPSControl
    >>> d = tempfile.mkdtemp()
    >>> fake = os.path.join(d, "mps-control")
    >>> _ = open(fake, "w").write('#!/bin/sh\\n[ "$1" = -d ] && mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"; '
    ...                           '[ "$1" = -d ] || { read cmd; rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"; }\\n')
    >>> os.chmod(fake, stat.S_IRWXU)
    >>> mps = MPSControl(control=fake, default_pipe_dir=os.path.join(d, "none"), lock_dir=d)
    >>> mps.ensure(); mps.started, os.path.exists(os.path.join(mps.pipe_dir, "control"))
    (True, True)
    >>> mps.env(10)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]
    '10'
    >>> mps.stop(); os.path.exists(mps.pipe_dir)
    False
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time

import torch

log = logging.getLogger("lightning_ooc")

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"


class MPSError(RuntimeError):
    """Starting, reaching or stopping the MPS control daemon failed."""


def mps_usable(device: torch.device | str, control: str = CONTROL) -> tuple[bool, str]:
    """Whether CUDA MPS can split ``device`` here, and why not when it cannot."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"the device is {device.type}, not a CUDA GPU"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if shutil.which(control) is None:
        return False, f"{control} is not on PATH (install the NVIDIA driver utilities)"
    return True, ""


def _is_pipe(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


class MPSControl:
    """Find or start one MPS control daemon for the ranks of this machine; stop it only if we started it."""

    def __init__(self, control: str = CONTROL, default_pipe_dir: str | None = None, lock_dir: str | None = None,
                 timeout: float = 30.0):  # fmt: skip
        self.control = shutil.which(control) or control
        self.default_pipe_dir = default_pipe_dir or os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR)
        #: private to this user: the lock, the advert of a daemon a rank started, and its pipe and log directories
        self.lock_dir = lock_dir or os.path.join(tempfile.gettempdir(), f"looc-mps-{os.getuid()}")
        self.timeout = float(timeout)
        self.pipe_dir: str | None = None
        self.log_dir: str | None = None
        self.started = False
        self._private: str | None = None

    @property
    def _advert(self) -> str:
        return os.path.join(self.lock_dir, f"looc-mps-{os.getuid()}.json")

    def _private_lock_dir(self) -> None:
        """Create ``lock_dir`` (mode 0700) or check that this user owns it and nobody else can write into it."""
        uid = os.getuid()
        try:
            os.mkdir(self.lock_dir, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise MPSError(f"{self.lock_dir}: cannot create the directory for the MPS lock and advert: {e}") from None
        st = os.lstat(self.lock_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            what = "not a directory" if not stat.S_ISDIR(st.st_mode) else f"owned by uid {st.st_uid}, not {uid}"
            raise MPSError(f"{self.lock_dir}: {what}; it holds the MPS lock and advert of uid {uid}, so it must be "
                           "a directory of this user only: remove it, or pass another lock_dir")  # fmt: skip
        if st.st_mode & 0o077:
            os.chmod(self.lock_dir, 0o700)

    def _read_advert(self, check_pipe: bool = True) -> dict | None:
        """The advert of a daemon this user started, or None (missing, unreadable, or not this user's)."""
        uid = os.getuid()
        try:
            fd = os.open(self._advert, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                log.warning("CUDA MPS: ignoring %s: owned by uid %s, not %s", self._advert, st.st_uid, uid)
                return None
            try:
                adv = json.load(f)
                control = os.path.join(adv["pipe_dir"], "control")
            except (ValueError, KeyError, TypeError):
                return None
        if not check_pipe:
            return adv
        try:
            if os.lstat(control).st_uid != uid or os.lstat(adv["pipe_dir"]).st_uid != uid:
                log.warning("CUDA MPS: ignoring the advert's pipe %s: not owned by uid %s", control, uid)
                return None
        except OSError:
            return None
        return adv

    def _run(self, args: list[str], env: dict[str, str], stdin: str | None = None) -> None:
        try:
            p = subprocess.run([self.control, *args], env=env, input=stdin, capture_output=True, text=True,
                               timeout=self.timeout)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MPSError(f"{self.control} {' '.join(args)}: {e}") from None
        if p.returncode != 0:
            raise MPSError(f"{self.control} {' '.join(args)} exited with {p.returncode}: {p.stderr.strip()}")

    def ensure(self) -> None:
        """Use a running daemon, or start one (pipe and log directories private to this run)."""
        if _is_pipe(os.path.join(self.default_pipe_dir, "control")):
            self.pipe_dir, self.log_dir = self.default_pipe_dir, os.environ.get("CUDA_MPS_LOG_DIRECTORY")
            log.info("CUDA MPS: using the running control daemon at %s", self.pipe_dir)
            return
        self._private_lock_dir()
        lock_fd = os.open(os.path.join(self.lock_dir, f"looc-mps-{os.getuid()}.lock"),
                          os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # fmt: skip
        with os.fdopen(lock_fd, "r+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            adv = self._read_advert()
            if adv is not None and _is_pipe(os.path.join(adv["pipe_dir"], "control")):
                self.pipe_dir, self.log_dir = adv["pipe_dir"], adv.get("log_dir")
                log.info("CUDA MPS: using the control daemon started by process %s", adv.get("pid"))
                return
            self._private = tempfile.mkdtemp(prefix="looc-mps-", dir=self.lock_dir)
            self.pipe_dir = os.path.join(self._private, "pipe")
            self.log_dir = os.path.join(self._private, "log")
            os.makedirs(self.pipe_dir)
            os.makedirs(self.log_dir)
            try:
                self._run(["-d"], self.env())
                deadline = time.monotonic() + self.timeout
                while not _is_pipe(os.path.join(self.pipe_dir, "control")):
                    if time.monotonic() > deadline:
                        raise MPSError(f"the MPS control daemon did not create {self.pipe_dir}/control within "
                                       f"{self.timeout:.0f} s; see {self.log_dir}/control.log")  # fmt: skip
                    time.sleep(0.05)
            except BaseException:
                shutil.rmtree(self._private, ignore_errors=True)
                self._private = None
                raise
            self.started = True
            pending = f"{self._advert}.{os.getpid()}"
            with os.fdopen(os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as f:
                json.dump({"pipe_dir": self.pipe_dir, "log_dir": self.log_dir, "pid": os.getpid()}, f)
            os.replace(pending, self._advert)
            log.info("CUDA MPS: started a control daemon (pipes in %s)", self.pipe_dir)

    def env(self, thread_percentage: int | None = None) -> dict[str, str]:
        """The environment of a process that should be an MPS client (capped to ``thread_percentage``)."""
        env = dict(os.environ)
        if self.pipe_dir:
            env["CUDA_MPS_PIPE_DIRECTORY"] = self.pipe_dir
        if self.log_dir:
            env["CUDA_MPS_LOG_DIRECTORY"] = self.log_dir
        if thread_percentage is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(thread_percentage))
        return env

    def apply_to_environ(self, thread_percentage: int | None) -> None:
        """Make this process (and processes it starts later) clients capped to ``thread_percentage``."""
        os.environ.update({k: v for k, v in self.env(thread_percentage).items() if k.startswith("CUDA_MPS_")})

    def stop(self) -> None:
        """Quit the daemon if this process started it; leave anyone else's alone."""
        if not self.started:
            return
        try:
            self._run([], self.env(), stdin="quit\n")
        except MPSError as e:
            log.warning("CUDA MPS: stopping the control daemon failed: %s", e)
        finally:
            adv = self._read_advert(check_pipe=False)  # its pipe is gone once the daemon quit
            if adv is not None and adv.get("pipe_dir") == self.pipe_dir:
                try:
                    os.unlink(self._advert)
                except OSError:
                    pass
            if self._private:
                shutil.rmtree(self._private, ignore_errors=True)
            self.started = False
            log.info("CUDA MPS: stopped the control daemon this run started")
