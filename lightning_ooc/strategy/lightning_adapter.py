"""The one place the strategy reaches past Lightning's public surface (written against Lightning 2.6).

Where Lightning has a public surface the strategy uses it directly: a launcher's ``kill(signum)`` forwards
SIGTERM (and SIGKILL after the grace period) to the ranks it started. Two needs have none, and this module
is all the code that depends on Lightning's private names for them:

* **Leaving SIGTERM to a** :class:`~lightning_ooc.strategy.signals.JobStop`. The trainer's signal connector
  (``Trainer._signal_connector``, a ``_SignalConnector``) registers its own SIGTERM handler at the start of
  every run, and that handler runs a collective inside the handler (which hangs with several processes).
  :func:`leave_sigterm` puts :class:`StrategySignalConnector` in its place: the same connector, except that
  it registers nothing while the strategy says it owns SIGTERM.
* **Waiting for the ranks a launcher started.** ``kill`` sends a signal but does not wait; the launched
  ranks are the launcher's ``procs`` list (``subprocess.Popen``), read by :func:`launched`.

:data:`WRITTEN_FOR` is the Lightning release these were written and tested against. On another release,
:func:`missing` lists what is gone; then :func:`leave_sigterm` logs one warning naming it and keeps
Lightning's connector. A job still stops on SIGTERM then (JobStop hears the signal through its wakeup pipe,
whatever Python-level handler is set), but Lightning's handler runs too.

Example::

    >>> from lightning_ooc.strategy import lightning_adapter
    >>> lightning_adapter.WRITTEN_FOR
    '2.6'
    >>> lightning_adapter.missing()
    []
"""
from __future__ import annotations

import inspect
import logging
import subprocess
from typing import Any

import lightning
from lightning.pytorch import Trainer

log = logging.getLogger("lightning_ooc")

#: the Lightning release (major.minor) the private names below were written and tested against
WRITTEN_FOR = "2.6"

try:
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
except ImportError:  # a Lightning release without it: missing() says so, leave_sigterm() does nothing
    _SignalConnector = object  # type: ignore[assignment,misc]


def missing() -> list[str]:
    """The private names this module uses that the installed Lightning lacks (empty: all there)."""
    init = inspect.unwrap(Trainer.__init__)  # under a decorator that reads defaults from the environment
    gone = []
    if _SignalConnector is object:
        gone.append("lightning.pytorch.trainer.connectors.signal_connector._SignalConnector")
    else:
        for name in ("register_signal_handlers", "teardown", "_original_handlers", "received_sigterm"):
            if not hasattr(_SignalConnector, name) and name not in _SignalConnector(None).__dict__:
                gone.append(f"_SignalConnector.{name}")
    if "_signal_connector" not in init.__code__.co_names:
        gone.append("Trainer._signal_connector")
    return gone


class StrategySignalConnector(_SignalConnector):  # type: ignore[valid-type,misc]
    """Lightning's signal connector, except that it leaves SIGTERM alone while the trainer's strategy says
    (``owns_sigterm``) that a :class:`~lightning_ooc.strategy.signals.JobStop` holds it; every other signal,
    and SIGTERM otherwise, as Lightning."""

    def register_signal_handlers(self) -> None:
        if not getattr(self.trainer.strategy, "owns_sigterm", False):
            super().register_signal_handlers()
            return
        # Lightning registers SIGTERM only (SIGUSR1 too under SLURM with auto-requeue, where no JobStop is
        # installed); with SIGTERM owned there is nothing to register, nor anything to restore at teardown
        self.received_sigterm = False
        self._original_handlers = {}


def leave_sigterm(trainer: Any) -> bool:
    """Give ``trainer`` a signal connector that leaves SIGTERM to the strategy's JobStop; ``False`` (one
    warning, nothing changed) where the installed Lightning lacks the names this relies on."""
    if isinstance(getattr(trainer, "_signal_connector", None), StrategySignalConnector):
        return True
    gone = missing()
    if gone or not isinstance(getattr(trainer, "_signal_connector", None), _SignalConnector):
        log.warning("Lightning %s lacks what the ooc strategy's SIGTERM handling was written for (Lightning %s: "
                    "%s); Lightning's SIGTERM handler stays installed beside the strategy's", lightning.__version__,
                    WRITTEN_FOR, ", ".join(gone) or "Trainer._signal_connector")  # fmt: skip
        return False
    trainer._signal_connector = StrategySignalConnector(trainer)
    return True


def launched(launcher: Any) -> list[subprocess.Popen]:
    """The rank processes ``launcher`` started (none unless this process launched the others)."""
    return [p for p in getattr(launcher, "procs", None) or () if isinstance(p, subprocess.Popen)]
