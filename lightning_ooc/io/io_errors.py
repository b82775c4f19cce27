"""Errors of the feature readers and of bulk files.

Bad ids or a bad destination raise :class:`~lightning_ooc.errors.InputError`;
a feature file shorter than its metadata says raises
:class:`~lightning_ooc.errors.CorruptDatasetError` when the reader is opened.
The classes here cover what can go wrong afterwards.

Example::

    >>> import errno, os, tempfile, numpy as np
    >>> from lightning_ooc.io import FeatureReader
    >>> from lightning_ooc.io.io_errors import (BackendUnavailableError, FeatureReadError, FeatureWriteError,
    ...                                      ReaderClosedError)
    >>> path = os.path.join(tempfile.mkdtemp(), "features.bin")
    >>> np.arange(64, dtype=np.float32).tofile(path)  # 16 rows of 4
    >>> reader = FeatureReader(path, 4, "float32")
    >>> reader.gather([3]).tolist()
    [[12.0, 13.0, 14.0, 15.0]]
    >>> reader.close()
    >>> reader.gather([3])
    Traceback (most recent call last):
      ...
    lightning_ooc.io.io_errors.ReaderClosedError: ...: the reader is closed; open a new FeatureReader

    A failed read or write is an ``OSError`` that says where (``filename``, ``offset``, ``length``) and what
    (``errno``), and one of the package's errors, so ``except LightningOOCError`` catches it too:

    >>> from lightning_ooc.errors import LightningOOCError
    >>> e = FeatureWriteError(errno.ENOSPC, "No space left on device", path, offset=4096, length=8192)
    >>> isinstance(e, OSError), isinstance(e, LightningOOCError), e.errno == errno.ENOSPC, e.offset, e.length
    (True, True, True, 4096, 8192)
    >>> issubclass(FeatureReadError, OSError), issubclass(BackendUnavailableError, RuntimeError)
    (True, True)
"""
from __future__ import annotations

import os

from lightning_ooc.errors import LightningOOCError


class _FileRangeError(LightningOOCError, OSError):
    """An I/O error over a range of a file: ``filename``, ``offset`` and ``length`` say where, ``errno`` what."""

    def __init__(
        self, errno_: int, message: str, filename: str | os.PathLike, *, offset: int | None = None,
        length: int | None = None,
    ):
        OSError.__init__(self, errno_, message, os.fspath(filename))
        self.offset = offset
        self.length = length

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


class FeatureReadError(_FileRangeError):
    """A read of the feature file failed: an I/O error from the device, or a
    read that returned fewer bytes than the rows it covers (the file shrank
    while open). ``filename``, ``offset`` (first byte that could not be read)
    and ``length`` say where; ``errno`` says what. No rows of the failed call
    are returned; the reader stays usable.
    """


class FeatureWriteError(_FileRangeError):
    """A write of a file failed, or could not start: the disk is full
    (``errno.ENOSPC``, also when space reserved up front is not there), a
    device error, a file that is not open for writing, a file that must be
    new but exists. ``filename``, ``offset`` (first byte that was not
    written) and ``length`` say where; ``errno`` says what. Bytes before
    ``offset`` may have been written.
    """


class ReaderClosedError(LightningOOCError, ValueError):
    """The reader was used after :meth:`~lightning_ooc.io.FeatureReader.close`."""


class BackendUnavailableError(LightningOOCError, RuntimeError):
    """The backend asked for cannot work on this machine or file system."""
