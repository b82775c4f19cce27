"""Reading feature rows from SSD: the direct-I/O reader layer.

:class:`FeatureReader` reads rows by id from a raw row-major feature file
through one of four backends (``uring``, ``pread``, ``buffered``, ``mmap``;
see :mod:`lightning_ooc.io.backends`), all returning the same bytes as
``numpy.memmap`` indexing. :class:`BulkFile` (:mod:`lightning_ooc.io.bulk`)
reads and writes whole files in large aligned ranges (backends uring, pread, buffered).

>>> from lightning_ooc.io import available_backends
>>> "uring" in available_backends()
True
"""
from __future__ import annotations

from lightning_ooc.io.backends import BACKENDS, available_backends
from lightning_ooc.io.bulk import BulkFile, aligned_empty, round_up
from lightning_ooc.io.io_errors import BackendUnavailableError, FeatureReadError, FeatureWriteError, ReaderClosedError
from lightning_ooc.io.reader import FeatureReader, GatherHandle
from lightning_ooc.io.stats import ReadStats

__all__ = [
    "BACKENDS",
    "BulkFile",
    "FeatureReader",
    "GatherHandle",
    "ReadStats",
    "FeatureReadError",
    "FeatureWriteError",
    "ReaderClosedError",
    "BackendUnavailableError",
    "aligned_empty",
    "available_backends",
    "round_up",
]
