"""SIGTERM to one rank of an ``"ooc"`` job stops the whole job, promptly, wherever the rank is.

Lightning's own SIGTERM handler (``_SignalConnector``) forwards the signal to the
ranks the launcher started, then runs a ``dist.broadcast`` *inside the handler*
and leaves the run to stop at the next batch. With several processes that
hangs until the collective timeout: the other ranks are in the gradient
all-reduce (or Lightning's per-step broadcast) and never match the handler's
broadcast, and a rank that is itself blocked in a collective never returns to
Python to run a handler at all.

:class:`JobStop` takes SIGTERM over instead. Its handler does no work: the
interpreter's C-level handler writes the signal number to a wakeup pipe
(``signal.set_wakeup_fd``), and a watcher thread, which runs even while the
main thread waits in a collective with the GIL released, stops the rank:

1. it writes ``rank R (pid P) received SIGTERM; stopping the job`` straight to stderr;
2. it kills this rank's helper processes (the gather producers) and unlinks the
   shared segments this rank created and has not unlinked yet;
3. it forwards SIGTERM to the ranks this process launched, if any, waits for
   them (``grace`` seconds, then SIGKILL) and runs the remaining clean-up;
4. it ends the process with ``os._exit(128 + SIGTERM)``: no collective, no
   teardown that could wait for a peer.

The rest of the job stops as it does when a rank dies: ranks that the launcher
started die with it (``PR_SET_PDEATHSIG``), gather producers die with their rank,
the launcher's child-process observer kills the job when a child rank exits with
an error, and peers blocked in gloo collectives fail once the dead rank's
connections close. A rank never signals its parent, so a signal forwarded by the
launcher cannot come back to it.

A peer's collective that fails because a rank is gone says so in one line
(:func:`peer_lost`, :func:`say_instead_of_traceback`): the launching rank names the
rank it launched that ended and how (``rank 1 (pid P) was terminated by SIGTERM``),
any other rank that the connection to another rank closed; the backend's traceback
is not printed after it, and the process exits with the status an uncaught error
gives (1).

While a :class:`JobStop` is installed, the strategy keeps Lightning from installing its SIGTERM handler
(:mod:`lightning_ooc.strategy.lightning_adapter`, the one place that uses Lightning's private names); every
other signal is Lightning's.
The strategy installs one only with several processes and *not* under SLURM with
auto-requeue: there SIGTERM announces a requeue, which Lightning's handler serves
(it lets the job save and requeue through ``SIGUSR1``), so it is left alone. With
one process Lightning's handler is left too, since nothing can wait for a peer.

Example (without a signal: installing and restoring the handlers)::

    >>> import signal
    >>> from lightning_ooc.strategy.signals import JobStop
    >>> before = signal.getsignal(signal.SIGTERM)
    >>> stop = JobStop(rank=lambda: 0)
    >>> stop.install(), signal.getsignal(signal.SIGTERM) is before
    (True, False)
    >>> stop.uninstall()
    >>> signal.getsignal(signal.SIGTERM) is before, stop.installed
    (True, False)
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable, Sequence

EXIT_CODE = 128 + signal.SIGTERM  # what a process killed by SIGTERM reports to a shell
_active: set[JobStop] = set()  # installed in this process


def _forget_in_forked_child() -> None:
    """A forked child (a DataLoader worker, say) keeps neither the handler nor the wakeup pipe: SIGTERM to it
    must not wake its parent's watcher, which would stop the whole job."""
    for stop in list(_active):
        stop._forget()


os.register_at_fork(after_in_child=_forget_in_forked_child)


class JobStop:
    """Stop this rank, and the ranks it launched, when it receives SIGTERM (see the module docstring).

    Args:
        rank: the rank this process is, asked when the signal comes (for the message).
        children: the ranks this process launched (``subprocess.Popen``); they get SIGTERM forwarded, and
            are waited for.
        kill: sends a signal to those ranks: a Lightning launcher's public ``kill(signum)``; by default
            each of ``children`` gets it.
        helpers: helper processes to kill at once (``multiprocessing.Process``-like: ``pid``, ``kill()``,
            ``join(timeout)``), e.g. the gather producers.
        cleanup: callables run after the children are gone (unlink shared segments, stop an MPS daemon);
            a failure in one is reported and the others still run.
        grace: seconds the children get to stop before they are killed.
    """

    def __init__(self, rank: Callable[[], int], children: Callable[[], Sequence[subprocess.Popen]] = tuple,
                 helpers: Callable[[], Sequence[Any]] = tuple, cleanup: Sequence[Callable[[], Any]] = (),
                 grace: float = 10.0, kill: Callable[[int], Any] | None = None):  # fmt: skip
        self._rank, self._children, self._helpers = rank, children, helpers
        self._kill = kill
        self._cleanup = tuple(cleanup)
        self.grace = float(grace)
        self._pid: int | None = None
        self._previous: Any = None
        self._old_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Lock()
        self.received = False

    @property
    def installed(self) -> bool:
        return self._pid is not None

    # -- installing --------------------------------------------------------------------------------
    def install(self) -> bool:
        """Take SIGTERM over in this process; ``False`` (nothing changed) outside the main thread."""
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            return False
        self._pipe = (r, w)
        self._pid = os.getpid()
        self._watcher = threading.Thread(target=self._watch, args=(r,), name="ooc-sigterm", daemon=True)
        self._watcher.start()
        self._previous = signal.signal(signal.SIGTERM, self._handler)
        _active.add(self)
        return True

    def uninstall(self) -> None:
        """Give SIGTERM back to the handler it had before :meth:`install` (main thread only).

        While a stop is under way (the main thread got here because a peer it waited for is gone), this waits
        for the stop to end the process instead of racing it to an exit of its own.
        """
        if not self.installed or threading.current_thread() is not threading.main_thread():
            return
        if self._stopping.locked():
            self._stopping.acquire(timeout=self.grace + 30.0)  # never released: the stop ends with os._exit
            os._exit(EXIT_CODE)
        if signal.getsignal(signal.SIGTERM) == self._handler:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        assert self._pipe is not None
        r, w = self._pipe
        current = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(self._old_wakeup if current == w else current)  # someone else's since: keep theirs
        os.close(w)  # the watcher reads the end of the pipe and returns
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        os.close(r)
        self._pipe, self._watcher, self._pid, self._previous = None, None, None, None
        _active.discard(self)

    def _forget(self) -> None:
        """In a forked child: put back what :meth:`install` replaced, without the watcher (not forked along)."""
        try:
            signal.set_wakeup_fd(self._old_wakeup)
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        except (ValueError, OSError):
            pass
        for fd in self._pipe or ():
            try:
                os.close(fd)
            except OSError:
                pass
        self._pipe, self._watcher, self._pid, self._previous = None, None, None, None
        self._stopping = threading.Lock()
        _active.discard(self)

    # -- the signal ---------------------------------------------------------------------------------
    def _handler(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler: it only has to exist (so the wakeup pipe gets the signal) and stays cheap."""
        if os.getpid() != self._pid:  # a forked child inherited it without the watcher: act as if none were set
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.received = True
        watcher = self._watcher
        if watcher is None or not watcher.is_alive():  # no watcher to do it: stop from a thread of its own
            threading.Thread(target=self.stop, name="ooc-sigterm-stop", daemon=True).start()

    def _watch(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data:
                return
            if self._old_wakeup >= 0:  # whoever set a wakeup fd before still hears every signal
                try:
                    os.write(self._old_wakeup, data)
                except OSError:
                    pass
            if signal.SIGTERM in data and os.getpid() == self._pid:
                self.stop()

    def stop(self) -> None:
        """Stop this rank and the ranks it launched, then end the process (blocking; never in a signal handler).

        Returns only if another thread is already stopping the process.
        """
        if not self._stopping.acquire(blocking=False):
            return
        self.received = True
        try:
            rank = str(self._rank())
        except Exception:  # noqa: BLE001 - the message must not stop the stop
            rank = "?"
        _say(f"lightning-ooc: rank {rank} (pid {os.getpid()}) received SIGTERM; stopping the job")
        helpers = list(_safe(self._helpers))
        for h in helpers:
            try:
                h.kill()
            except (OSError, ValueError, AttributeError):
                pass
        children = [p for p in _safe(self._children) if p.poll() is None]
        self._signal(children, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for p in children:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _say(f"lightning-ooc: rank process {p.pid} did not stop within {self.grace:.0f} s of SIGTERM; "
                     "killing it")  # fmt: skip
                self._signal([p], signal.SIGKILL)
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        for h in helpers:
            try:
                h.join(timeout=5)
            except (OSError, ValueError, AttributeError, AssertionError):
                pass
        for fn in self._cleanup:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - report and go on: the process ends anyway
                _say(f"lightning-ooc: clean-up after SIGTERM failed: {e!r}")
        _flush(timeout=1.0)
        os._exit(EXIT_CODE)

    def _signal(self, children: Sequence[subprocess.Popen], signum: int) -> None:
        """``signum`` to the launched ranks (through the launcher's ``kill`` where one was given; those that
        already exited skip it), then to any of ``children`` still running without it."""
        if not children:
            return
        if self._kill is not None:
            try:
                self._kill(signum)
            except Exception as e:  # noqa: BLE001 - each child still gets the signal below
                _say(f"lightning-ooc: the launcher could not forward signal {signum}: {e!r}")
            if signum != signal.SIGKILL:
                return
        for p in children:
            try:
                p.send_signal(signum)
            except OSError:
                pass


def _safe(get: Callable[[], Sequence[Any]]) -> Sequence[Any]:
    try:
        return get()
    except Exception:  # noqa: BLE001 - stopping goes on with what is known
        return ()


def _say(message: str) -> None:
    """One line to stderr without Python's stream locks (another thread may hold them while it waits)."""
    try:
        os.write(2, (message + "\n").encode())
    except OSError:
        pass


def _flush(timeout: float) -> None:
    """Flush stdout and stderr, giving up after ``timeout`` seconds (a thread blocked mid-write holds their lock)."""

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass

    t = threading.Thread(target=flush, name="ooc-sigterm-flush", daemon=True)
    t.start()
    t.join(timeout)


# -- a peer that is gone ------------------------------------------------------------------------------------
#: what gloo and NCCL say when a collective fails because a peer's connection closed (the peer died or stopped)
#: ("Connection refused" is left out: a rank that cannot reach the store or a peer at start-up, say a wrong
#: MASTER_ADDR or port, gets it too)
_PEER_GONE = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|remote process exited|"
                        r"communicator was aborted|peer closed", re.IGNORECASE)
#: seconds a launching rank waits for the rank whose connection closed to be seen exiting
PEER_EXIT_WAIT = 3.0


def ended(returncode: int) -> str:
    """How a process that exited with ``returncode`` (``Popen``'s: negative for a signal) ended, in words.

    >>> ended(-9), ended(143), ended(1)
    ('was killed by SIGKILL', 'was terminated by SIGTERM (exit status 143)', 'exited with status 1')
    """
    def name(signum: int) -> str | None:
        try:
            return signal.Signals(signum).name
        except ValueError:
            return None

    if returncode < 0 and name(-returncode):
        return f"was killed by {name(-returncode)}"
    if returncode == EXIT_CODE:  # a JobStop's exit, or a shell's report of SIGTERM
        return f"was terminated by SIGTERM (exit status {returncode})"
    if returncode > 128 and name(returncode - 128):
        return f"exited with status {returncode} (128 + {name(returncode - 128)})"
    return f"exited with status {returncode}"


def _backend_words(exception: BaseException) -> str:
    """The backend's reason in a few words: the first line of its message, without its source location."""
    first = (str(exception).strip().splitlines() or [""])[0]
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's "[/path/pair.cc:537] "
    return first.split(". ")[0].rstrip(".")


def _joined() -> bool:
    """Whether this process has joined its job: torch.distributed's default process group is initialised."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(dist.is_available() and dist.is_initialized())


def peer_lost(exception: BaseException, rank: int, launched: Sequence[subprocess.Popen] = (),
              first_launched_rank: int = 1, wait: float = PEER_EXIT_WAIT,
              joined: bool | None = None) -> str | None:  # fmt: skip
    """One line saying which rank is gone, when ``exception`` (raised on rank ``rank``) is a collective that
    failed because of it; None otherwise.

    A collective failed where the backend says a peer's connection closed, or raised one of torch's distributed
    errors (``DistError`` and its kinds); any other error (the run's own) is left as it is. ``launched``: the
    ranks this process launched (rank ``first_launched_rank`` first). One of them that exited with an error is
    named, with how it ended; once this rank has joined the job (``joined``; None: torch.distributed's default
    process group is initialised) and the backend said a connection closed, it is waited for up to ``wait``
    seconds, and if none ended the line says that the connection closed. Before this rank joined (an error at
    start-up: a wrong ``MASTER_ADDR`` or port, a store that cannot be reached), only a launched rank that has
    already ended is named; else None, and the error keeps its traceback.

    >>> e = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:55194: Connection reset "
    ...                  "by peer. This is typically caused by a remote worker hanging")
    >>> line = peer_lost(e, rank=1, joined=True)
    >>> line.split(" (")[0]
    'lightning-ooc: rank 1 stops: the connection to another rank of the job closed'
    >>> line.split("(")[1].split(")")[0]  # the backend's words, without its source location
    'Read error [127.0.0.1]:55194: Connection reset by peer'
    >>> peer_lost(e, rank=1, joined=False) is None  # not yet in the job: no rank of it can have gone
    True
    >>> peer_lost(ValueError("a bad batch"), rank=0, joined=True) is None
    True
    """
    if not isinstance(exception, RuntimeError):
        return None
    gone = bool(_PEER_GONE.search(str(exception)))
    if not gone and not any(c.__name__ == "DistError" for c in type(exception).__mro__):
        return None
    if joined is None:
        joined = _joined()
    deadline = time.monotonic() + (wait if gone and joined else 0.0)
    while True:
        for i, p in enumerate(launched):
            code = p.poll()
            if code:  # an error or a signal, not a clean exit
                return (f"lightning-ooc: rank {first_launched_rank + i} (pid {p.pid}) {ended(code)}; rank {rank} "
                        "stops the job")  # fmt: skip
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not (gone and joined):
        return None
    return (f"lightning-ooc: rank {rank} stops: the connection to another rank of the job closed "
            f"({_backend_words(exception)}); that rank died or was stopped, its own output says why")


def say_instead_of_traceback(exception: BaseException, line: str) -> None:
    """Write ``line`` to stderr now, and leave out ``exception``'s traceback should it end the process (the
    exit status stays an uncaught error's, 1). A caller that catches ``exception`` finds ``line`` in its notes."""
    _say(line)
    exception.add_note(line)
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if value is exception:  # said already, in one line
            _flush(timeout=1.0)
            return
        previous(kind, value, tb)

    sys.excepthook = hook
