"""Log handlers of the command line."""
from __future__ import annotations

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
