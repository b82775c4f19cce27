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
  a ``control`` pipe; somebody else's, never stopped by us), or one a process
  of ours on this machine started (another rank, or a run that was killed),
  or starts one itself with ``-d``, pipe and log directories in a private
  temporary directory, and an environment without ``CUDA_VISIBLE_DEVICES``
  (:meth:`~MPSControl.daemon_env`: it serves the GPUs of every rank, and the
  clients' device numbers keep their meaning). A file lock makes the ranks of
  a machine agree on one; the advert of a started daemon lists the processes
  using it (pid and start time). Both live in a directory private to the user
  (``looc-mps-UID`` in the temporary directory, mode 0700, owner checked); an
  advert or a pipe another user owns is never followed.
- :meth:`~MPSControl.stop` leaves the daemon, and sends ``quit`` when no live
  process of ours uses it any more (a daemon left by a killed run is adopted
  and so stopped at the end), then removes its directories. It raises
  nothing: a failed ``quit`` is a warning. :meth:`~MPSControl.ensure` raises
  :class:`MPSError`; the strategy then trains without the split.

A process becomes an MPS client when it initialises CUDA (``cuInit``), with the
``CUDA_MPS_*`` variables its environment has then; later changes do nothing.
:func:`prepare` makes the training process one: a script calls it before
anything uses CUDA and before it builds its Trainer (``lightning-ooc fit``
does it itself). It ensures the daemon, sets this process's client settings
(``100 - mps_split`` percent of the SMs) and registers it as a user of the
daemon until it exits: the daemon is left (and quit by its last user) at
process exit, never while this process may still hold a CUDA context. Nothing
here initialises CUDA (:func:`mps_usable` looks at the build, the driver's
device node and the control program only).

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

import atexit
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time

import torch

from lightning_ooc.utils.proc import pid_alive

log = logging.getLogger("lightning_ooc")

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
NVIDIACTL = "/dev/nvidiactl"  # the NVIDIA driver's control device: there when the driver is loaded


class MPSError(RuntimeError):
    """Starting, reaching or stopping the MPS control daemon failed."""


def mps_usable(device: torch.device | str, control: str = CONTROL) -> tuple[bool, str]:
    """Whether CUDA MPS can split ``device`` here, and why not when it cannot.

    It must not initialise CUDA (``torch.cuda.is_available()`` may, through ``cudaGetDeviceCount``, and a
    process initialised before its MPS settings are in place never becomes a client), so it looks only at
    this PyTorch build, the NVIDIA driver's device node and the control program.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"the device is {device.type}, not a CUDA GPU"
    if not torch.backends.cuda.is_built():
        return False, "this PyTorch is built without CUDA"
    if not os.path.exists(NVIDIACTL):
        return False, f"no NVIDIA driver here ({NVIDIACTL} is missing)"
    if shutil.which(control) is None:
        return False, f"{control} is not on PATH (install the NVIDIA driver utilities)"
    return True, ""


def cuda_initialised() -> bool:
    """Whether this process has initialised CUDA already (too late to become an MPS client).

    PyTorch's own flag, or the CUDA driver library mapped into the process: ``cudaGetDeviceCount`` (behind
    ``torch.cuda.is_available()`` without NVML) loads it and calls ``cuInit`` without setting that flag.
    Neither looks at the GPU.
    """
    if torch.cuda.is_initialized():
        return True
    try:
        with open("/proc/self/maps", "rb") as f:
            return b"/libcuda.so" in f.read()
    except OSError:
        return False


def _is_pipe(path: str) -> bool:
    """Whether the daemon's ``control`` endpoint is at ``path``: a FIFO (older drivers) or a Unix socket (CUDA 13)."""
    try:
        mode = os.stat(path).st_mode
        return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
    except OSError:
        return False


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``), or None where unknown."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError, ValueError):
        return None


def _me() -> list:
    pid = os.getpid()
    return [pid, _start_time(pid)]


def _live(users: list) -> list:
    """The entries ``[pid, start]`` of processes still running (the same process: its start time matches)."""
    out = []
    for u in users:
        try:
            pid, start = int(u[0]), u[1]
        except (TypeError, ValueError, IndexError):
            continue
        if pid_alive(pid) and (start is None or _start_time(pid) in (None, start)):
            out.append([pid, start])
    return out


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
        #: whether this process started the daemon (it may be stopped by another process of ours, see stop())
        self.started = False
        #: whether the daemon was running before and is somebody else's (never stopped)
        self.external = False
        self._registered = False  # listed as a user in the advert
        self._private: str | None = None
        self._stop_lock = threading.Lock()

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

    def _read_advert(self) -> dict | None:
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
                os.path.join(adv["pipe_dir"], "control")
            except (ValueError, KeyError, TypeError):
                return None
        if not isinstance(adv.get("users"), list):  # an advert of an older version: its starter is its user
            adv["users"] = [[adv.get("pid"), adv.get("start")]]
        return adv

    def _daemon_state(self, adv: dict) -> str:
        """``"live"`` (its control pipe is there, this user's), ``"gone"`` (no pipe), or ``"foreign"``."""
        uid = os.getuid()
        control = os.path.join(adv["pipe_dir"], "control")
        try:
            if os.lstat(control).st_uid != uid or os.lstat(adv["pipe_dir"]).st_uid != uid:
                log.warning("CUDA MPS: ignoring the advert's pipe %s: not owned by uid %s", control, uid)
                return "foreign"
        except OSError:
            return "gone"
        return "live" if _is_pipe(control) else "gone"

    def _write_advert(self, adv: dict) -> None:
        pending = f"{self._advert}.{os.getpid()}"
        with os.fdopen(os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as f:
            json.dump(adv, f)
        os.replace(pending, self._advert)

    def _owned_private(self, path: str | None) -> str | None:
        """``path`` if it is a private directory of ours (``lock_dir/looc-mps-*``, this user's), else None."""
        if not path or os.path.dirname(os.path.abspath(path)) != os.path.abspath(self.lock_dir):
            return None
        if not os.path.basename(path).startswith("looc-mps-"):
            return None
        try:
            st = os.lstat(path)
        except OSError:
            return None
        return path if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() else None

    @contextlib.contextmanager
    def _locked(self):
        self._private_lock_dir()
        lock_fd = os.open(os.path.join(self.lock_dir, f"looc-mps-{os.getuid()}.lock"),
                          os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # fmt: skip
        with os.fdopen(lock_fd, "r+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _run(self, args: list[str], env: dict[str, str], stdin: str | None = None) -> None:
        try:
            p = subprocess.run([self.control, *args], env=env, input=stdin, capture_output=True, text=True,
                               timeout=self.timeout)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MPSError(f"{self.control} {' '.join(args)}: {e}") from None
        if p.returncode != 0:
            raise MPSError(f"{self.control} {' '.join(args)} exited with {p.returncode}: {p.stderr.strip()}")

    def ensure(self) -> None:
        """Use a running daemon, or start one (pipe and log directories private to this run).

        Raises :class:`MPSError` when no daemon can be used or started (the caller falls back to no split).
        """
        if self._registered or self.external:
            return
        # CUDA_MPS_PIPE_DIRECTORY may name a daemon of ours (inherited from the process that prepared it, e.g.
        # by the ranks Lightning starts): that one is found through its advert, and this process becomes a user
        ours = self._owned_private(os.path.dirname(os.path.abspath(self.default_pipe_dir))) is not None
        if not ours and _is_pipe(os.path.join(self.default_pipe_dir, "control")):
            self.pipe_dir, self.log_dir = self.default_pipe_dir, os.environ.get("CUDA_MPS_LOG_DIRECTORY")
            self.external = True  # somebody else's: never stopped by us
            log.info("CUDA MPS: using the running control daemon at %s", self.pipe_dir)
            return
        me = _me()
        with self._locked():
            adv = self._read_advert()
            if adv is not None:
                users = _live(adv["users"])
                state = self._daemon_state(adv)
                if state == "live":
                    if not users:
                        log.info("CUDA MPS: adopting the control daemon at %s left by process %s, which is gone; it "
                                 "is stopped when the last process using it ends", adv["pipe_dir"], adv.get("pid"))
                    else:
                        log.info("CUDA MPS: using the control daemon started by process %s", adv.get("pid"))
                    adv["users"] = users + [me]
                    self._write_advert(adv)
                    self.pipe_dir, self.log_dir = adv["pipe_dir"], adv.get("log_dir")
                    self._private = self._owned_private(adv.get("private") or os.path.dirname(adv["pipe_dir"]))
                    self._registered = True
                    return
                if state == "gone" and not users:  # a daemon that quit or died with its run: sweep its directories
                    stale = self._owned_private(adv.get("private") or os.path.dirname(adv["pipe_dir"]))
                    if stale:
                        shutil.rmtree(stale, ignore_errors=True)
            self._private = tempfile.mkdtemp(prefix="looc-mps-", dir=self.lock_dir)
            self.pipe_dir = os.path.join(self._private, "pipe")
            self.log_dir = os.path.join(self._private, "log")
            os.makedirs(self.pipe_dir)
            os.makedirs(self.log_dir)
            try:
                self._run(["-d"], self.daemon_env())
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
            self.started = self._registered = True
            self._write_advert({"pipe_dir": self.pipe_dir, "log_dir": self.log_dir, "private": self._private,
                                "pid": me[0], "start": me[1], "users": [me]})  # fmt: skip
            log.info("CUDA MPS: started a control daemon (pipes in %s)", self.pipe_dir)

    def daemon_env(self) -> dict[str, str]:
        """The environment the control daemon starts with: this process's, without ``CUDA_VISIBLE_DEVICES``.

        (Nor ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, which would cap every client of the daemon; each client
        sets its own.)

        MPS renumbers the GPUs of its clients: a client's ``CUDA_VISIBLE_DEVICES`` picks among the devices the
        daemon sees. A daemon started with this rank's list would serve no GPU of another rank, and an index
        would name another GPU in a client than without MPS. Without it the daemon sees every GPU this machine
        lets the job see (a scheduler's device cgroup still applies), and each client's own list (the
        training process's and its producer's, which stay as they are) means what it means without MPS.
        """
        env = self.env()
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
        return env

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
        """Make this process a client capped to ``thread_percentage`` (before it creates its CUDA context).

        The driver reads these from the process environment, so they go into ``os.environ``; the strategy
        does it once, while setting up, before it starts any thread. Child processes get theirs from
        :meth:`env` instead (see :class:`~lightning_ooc.strategy.producer.GatherProducer`).
        """
        os.environ.update({k: v for k, v in self.env(thread_percentage).items() if k.startswith("CUDA_MPS_")})

    def stop(self) -> None:
        """Leave the daemon; quit it if this was the last live process of ours using it.

        A daemon that was running before (the default pipe directory) is never stopped. One that a
        process of ours started is stopped by the last of our processes that use it, whichever started
        it, and also when its starter was killed (its advert names processes that are all gone).
        """
        with self._stop_lock:
            if not self._registered:
                return
            self._registered = False
            try:
                self._leave()
            except (MPSError, OSError) as e:
                log.warning("CUDA MPS: leaving the control daemon at %s failed: %s", self.pipe_dir, e)

    def _leave(self) -> None:
        """Take this process off the advert; the last live user quits the daemon and removes its directories."""
        me = _me()
        with self._locked():
            adv = self._read_advert()
            ours = adv is not None and adv.get("pipe_dir") == self.pipe_dir
            if ours:
                users = _live(adv["users"])
                if me in users:
                    users.remove(me)
                if users:
                    adv["users"] = users
                    self._write_advert(adv)
                    log.info("CUDA MPS: leaving the control daemon to processes %s", [u[0] for u in users])
                    return
            elif not self.started:  # no longer advertised (it died and another took its place): not ours
                return
            try:
                self._run([], self.env(), stdin="quit\n")
            except MPSError as e:
                log.warning("CUDA MPS: stopping the control daemon failed: %s", e)
            finally:
                if ours:
                    try:
                        os.unlink(self._advert)
                    except OSError:
                        pass
                if self._private:
                    shutil.rmtree(self._private, ignore_errors=True)
                self.started = False
                log.info("CUDA MPS: stopped the control daemon at %s", self.pipe_dir)


# -- this process as an MPS client ---------------------------------------------------------------------
@dataclasses.dataclass
class _Prepared:
    control: MPSControl
    split: int  # the producer's percentage; this process has 100 - split
    client: bool  # the settings were in place before this process initialised CUDA
    pid: int


_state: _Prepared | None = None  # what prepare() did in this process
_state_lock = threading.Lock()
_atexit_register = atexit.register
_hooked: set[int] = set()  # the pids whose atexit hook is registered (a forked child inherits the list)


def _split(mps_split: int) -> int:
    if not 0 < int(mps_split) < 100:
        raise ValueError(f"mps_split is a percentage of the SMs strictly between 0 and 100, got {mps_split}")
    return int(mps_split)


def _not_a_client(split: int) -> str:
    return (f"mps_split={split}: CUDA was initialised in this process before it could become a CUDA MPS client, "
            f"so the training process is not one: its {100 - split}% share of the SMs is not enforced and its "
            f"kernels time-slice with those of the gather producer (still capped to {split}%); call "
            f"lightning_ooc.strategy.mps.prepare({split}) before anything uses CUDA and before building the "
            "Trainer, or train with `lightning-ooc fit`, which does")  # fmt: skip


def prepared() -> MPSControl | None:
    """The daemon this process was prepared for by :func:`prepare` (and is a user of), or None."""
    p = _state
    if p is None or p.pid != os.getpid() or not (p.control._registered or p.control.external):
        return None
    return p.control


def client_of(mps_split: int, control: str = CONTROL, lock_dir: str | None = None) -> MPSControl:
    """The daemon for ``mps_split`` in this process: the one :func:`prepare` set up, else prepared now.

    What the strategy calls while it sets up. Prepared now, this process is still a client if nothing has
    initialised CUDA yet; otherwise one warning says it is not, and how to fix that. The daemon is left
    at process exit either way. Raises :class:`MPSError` when no daemon can be used or started.
    """
    global _state
    split = _split(mps_split)
    with _state_lock:
        mps = prepared()
        if mps is not None:
            if split != _state.split:
                log.warning("mps_split=%s, but this process was prepared for mps_split=%s: the gather producer "
                            "gets %s%% of the SMs, the training process keeps %s%%", split, _state.split, split,
                            100 - _state.split)  # fmt: skip
            return mps
        client = not cuda_initialised()
        mps = MPSControl(control=control, lock_dir=lock_dir)
        mps.ensure()
        if not client:
            log.warning("%s", _not_a_client(split))
        # the settings go into os.environ: this process (if not initialised yet) and the processes it starts
        # (Lightning's further ranks) become clients; a producer gets its own cap from MPSControl.env()
        mps.apply_to_environ(100 - split)
        _state = _Prepared(mps, split, client, os.getpid())
        if os.getpid() not in _hooked:
            _hooked.add(os.getpid())
            _atexit_register(release)
        log.info("CUDA MPS: this process is %s of the daemon at %s (%s%% of the SMs)",
                 "a client" if client else "a user (not a client)", mps.pipe_dir, 100 - split)  # fmt: skip
        return mps


def prepare(mps_split: int, control: str = CONTROL, lock_dir: str | None = None) -> MPSControl | None:
    """Make this process a CUDA MPS client with ``100 - mps_split`` percent of the SMs, before CUDA starts.

    Call it at the top of a training script that uses ``OutOfCoreStrategy(mps_split=...)``, before anything
    uses CUDA and before building the Trainer (``lightning-ooc fit|validate|test|predict`` calls it when the
    config's strategy has ``mps_split``). A process connects to the MPS daemon when it initialises CUDA,
    with the environment it has then, so the strategy alone comes too late for the training process.

    It uses or starts the control daemon (as :meth:`MPSControl.ensure`), sets ``CUDA_MPS_PIPE_DIRECTORY``,
    ``CUDA_MPS_LOG_DIRECTORY`` and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` in ``os.environ`` (before any
    thread exists; the processes this one starts inherit them), and registers this process as a user of
    the daemon until it exits: an ``atexit`` hook (:func:`release`) leaves it, and the last user quits it.
    Calling it again (or in a process started with these settings, such as Lightning's further ranks)
    adopts the same daemon. If CUDA is already initialised here, one warning says this process cannot
    become a client, and how to fix that.

    ``control`` and ``lock_dir`` are as for :class:`MPSControl`. Returns the :class:`MPSControl`, or None
    where MPS is not usable or the daemon does not start (the strategy then warns when it sets up, with the
    reason, and trains without the split).

    Example (with a stand-in for the control program, as in the module's example)::

        >>> import os, stat, tempfile
        >>> from lightning_ooc.strategy import mps
        >>> d = tempfile.mkdtemp()
        >>> fake = os.path.join(d, "nvidia-cuda-mps-control")
        >>> _ = open(fake, "w").write('#!/bin/sh\\n[ "$1" = -d ] && mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"; '
        ...                           '[ "$1" = -d ] || { read cmd; rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"; }\\n')
        >>> os.chmod(fake, stat.S_IRWXU)
        >>> keys = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        >>> saved, usable = {k: os.environ.pop(k, None) for k in keys}, mps.mps_usable
        >>> os.environ["CUDA_MPS_PIPE_DIRECTORY"] = os.path.join(d, "none")  # no daemon running here
        >>> mps.mps_usable = lambda device, control: (True, "")  # this example runs without a GPU
        >>> daemon = mps.prepare(10, control=fake, lock_dir=d)  # before the Trainer: starts a daemon
        >>> os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], os.environ["CUDA_MPS_PIPE_DIRECTORY"] == daemon.pipe_dir
        ('90', True)
        >>> mps.prepare(10, control=fake, lock_dir=d) is daemon  # again: the same one
        True
        >>> mps.release()  # what the atexit hook does: the last user quits the daemon
        >>> os.path.exists(daemon.pipe_dir)
        False
        >>> mps.mps_usable = usable
        >>> for k, v in saved.items():
        ...     _ = os.environ.pop(k, None) if v is None else os.environ.update({k: v})
    """
    split = _split(mps_split)
    ok, why = mps_usable("cuda", control)
    # debug only: the strategy warns with the reason when it sets up (and tries the daemon again)
    if not ok:
        log.debug("CUDA MPS: not preparing mps_split=%s: %s", split, why)
        return None
    try:
        return client_of(split, control, lock_dir)
    except (MPSError, OSError) as e:
        log.debug("CUDA MPS: not preparing mps_split=%s: %s", split, " ".join(str(e).split()))
        return None


def release() -> None:
    """Leave the daemon :func:`prepare` set up in this process; quit it if this was its last user.

    The ``atexit`` hook :func:`prepare` registers (also run when SIGTERM stops the job). Call it yourself only
    once this process is done with CUDA: a client whose daemon quits loses its MPS server. Raises nothing.
    """
    global _state
    p = _state  # no lock: this may run in a signal handler that interrupted a thread holding it
    if p is None or p.pid != os.getpid():
        return
    _state = None
    p.control.stop()
