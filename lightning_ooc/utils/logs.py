"""Log handlers and one-line messages of the command line."""
from __future__ import annotations

import errno
import logging
import sys


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record, so that a handler installed while stderr was
    redirected (the command line's ``main`` called from a test or a notebook) does not keep writing to a closed
    stream afterwards.

    >>> import io, contextlib
    >>> log = logging.getLogger("example")
    >>> log.addHandler(StderrHandler())
    >>> out = io.StringIO()
    >>> with contextlib.redirect_stderr(out):
    ...     log.warning("to the stderr of the moment")
    >>> out.getvalue().strip()
    'to the stderr of the moment'
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def log_secondary_failure(log: logging.Logger, what: str, error: BaseException) -> None:
    """Log, in one line, that ``what`` failed with ``error`` while another error was already stopping the run
    (that one is raised, and is the one to read); the traceback goes to the debug level (``lightning-ooc -v``,
    or a logger set to DEBUG).

    >>> import io, contextlib
    >>> log = logging.getLogger("secondary-example")
    >>> log.addHandler(StderrHandler())
    >>> log.propagate = False
    >>> out = io.StringIO()
    >>> with contextlib.redirect_stderr(out):
    ...     log_secondary_failure(log, "writing the rows back", OSError(28, "No space left on device", "j"))
    >>> out.getvalue().strip()
    "writing the rows back failed as well: OSError: [Errno 28] No space left on device: 'j'"
    """
    log.error("%s failed as well: %s: %s", what, type(error).__name__, error)
    log.debug("%s failed:", what, exc_info=error)


def disk_full(e: OSError, fix: str) -> str | None:
    """The one line for an ``OSError`` of a full disk (or an exhausted quota), keeping what it said; None for
    any other.

    >>> disk_full(OSError(28, "No space left on device", "/data/run/last.ckpt"), "free some space")
    "no space left on device writing /data/run/last.ckpt ([Errno 28] No space left on device: '/data/run/last.ckpt'); free some space"
    """
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    where = e.filename2 if e.filename2 is not None else e.filename
    return f"no space left on device{f' writing {where}' if where is not None else ''} ({e}); {fix}"
