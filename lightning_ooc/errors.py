"""Exception classes of lightning_ooc.

Every error raised on bad input is one of these. Messages name the file
involved and say what to do about it.
"""
from __future__ import annotations
import signal


class LightningOOCError(Exception):
    """Base class of every error this package raises on purpose."""


class DatasetError(LightningOOCError):
    """A dataset directory cannot be opened or used."""

    def __init__(self, message: str, path: object | None = None):
        super().__init__(message)
        self.path = path


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """The dataset directory, or a file it must contain, does not exist."""


class CorruptDatasetError(DatasetError):
    """A dataset file disagrees with the metadata (size, dtype, shape, checksum, indices)."""


class FormatVersionError(DatasetError):
    """The metadata names a format or version this release cannot read."""


class DatasetChangedError(DatasetError):
    """The dataset directory was replaced while a datamodule that opened it was still in use."""


class DatasetWriteError(LightningOOCError):
    """Writing a dataset failed (full disk, target exists, interrupted input)."""


class InterruptedAfterCommit(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while a dataset was being put in place; the commit was finished first.

    ``path`` holds the complete new dataset; ``signum`` is the signal that was held. It is a
    ``KeyboardInterrupt``, so a script stops as it would on Ctrl-C, but the dataset is written.
    """

    def __init__(self, path: object, signum: int):
        self.path = path
        self.signum = int(signum)
        name = signal.Signals(self.signum).name
        super().__init__(f"{name} arrived while {path} was being committed; the commit was finished first, so {path} "
                         "holds the complete new dataset")  # fmt: skip


class InputError(LightningOOCError, ValueError):
    """Input given to ``prepare`` or an API call is malformed (dtype, shape, range)."""


class BatchKindError(InputError, AttributeError):
    """A model asked a batch for a field that batches of this kind do not carry (``x`` of an embedding batch).

    Also an ``AttributeError``, so ``hasattr(batch, "x")`` stays False where code probes for the field.
    """
