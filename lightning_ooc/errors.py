"""Exception classes of lightning_ooc.

Every error raised on bad input is one of these. Messages name the file
involved and say what to do about it.
"""
from __future__ import annotations
import signal


class LightningOOCError(Exception):
    """Base class of every error this package raises on purpose.

    >>> import lightning_ooc
    >>> try:
    ...     lightning_ooc.open_dataset("/nonexistent/g")
    ... except LightningOOCError as e:  # any of ours: one message naming the file and the fix
    ...     print(type(e).__name__)
    DatasetNotFoundError
    """


class DatasetError(LightningOOCError):
    """A dataset directory cannot be opened or used; ``path`` is the file or directory at fault.

    >>> import lightning_ooc
    >>> try:
    ...     lightning_ooc.open_dataset("/nonexistent/g")
    ... except DatasetError as e:
    ...     print(e.path)
    /nonexistent/g
    """

    def __init__(self, message: str, path: object | None = None):
        super().__init__(message)
        self.path = path


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """The dataset directory, or a file it must contain, does not exist (also a ``FileNotFoundError``).

    >>> import lightning_ooc
    >>> lightning_ooc.open_dataset("/nonexistent/g")
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.DatasetNotFoundError: /nonexistent/g: no such dataset directory; create one with ...
    """


class CorruptDatasetError(DatasetError):
    """A dataset file disagrees with the metadata (size, dtype, shape, checksum, indices).

    >>> import os, tempfile, lightning_ooc
    >>> from lightning_ooc.data.synth import synthesize
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=200, avg_degree=4, num_features=4, num_classes=2,
    ...                   progress=False)
    >>> os.truncate(root / "labels.npy", 100)
    >>> lightning_ooc.open_dataset(root)
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.CorruptDatasetError: .../labels.npy: 100 bytes on disk but meta.json records ... (truncated); ...
    """


class FormatVersionError(DatasetError):
    """The metadata names a format or version this release cannot read.

    >>> import json, tempfile, lightning_ooc
    >>> from lightning_ooc.data.synth import synthesize
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=200, avg_degree=4, num_features=4, num_classes=2,
    ...                   progress=False)
    >>> meta = json.loads((root / "meta.json").read_text())
    >>> _ = (root / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    >>> lightning_ooc.open_dataset(root)
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.FormatVersionError: .../meta.json: format version 99 is not supported by this release ...
    """


class DatasetChangedError(DatasetError):
    """The dataset directory was replaced while a datamodule that opened it was still in use: what it had
    read would no longer match what it reads next, so it stops instead.

    >>> issubclass(DatasetChangedError, DatasetError)
    True
    """


class DatasetWriteError(LightningOOCError):
    """Writing a dataset failed (full disk, target exists, interrupted input); what was there is kept.

    >>> import tempfile
    >>> from lightning_ooc.data.synth import synthesize
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=200, avg_degree=4, num_features=4, num_classes=2,
    ...                   progress=False)
    >>> synthesize(root, num_nodes=200, avg_degree=4, num_features=4, num_classes=2, progress=False)
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.DatasetWriteError: .../g: already exists; pass --overwrite (overwrite=True) to replace it, ...
    """


class InterruptedAfterCommit(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while a dataset was being put in place; the commit was finished first.

    ``path`` holds the complete new dataset; ``signum`` is the signal that was held. It is a
    ``KeyboardInterrupt``, so a script stops as it would on Ctrl-C, but the dataset is written.

    >>> e = InterruptedAfterCommit("data/g", signal.SIGTERM)
    >>> isinstance(e, KeyboardInterrupt), e.signum == signal.SIGTERM
    (True, True)
    >>> str(e)
    'SIGTERM arrived while data/g was being committed; the commit was finished first, so data/g holds the complete new dataset'
    """

    def __init__(self, path: object, signum: int):
        self.path = path
        self.signum = int(signum)
        name = signal.Signals(self.signum).name
        super().__init__(f"{name} arrived while {path} was being committed; the commit was finished first, so {path} "
                         "holds the complete new dataset")  # fmt: skip


class InputError(LightningOOCError, ValueError):
    """Input given to ``prepare`` or an API call is malformed (dtype, shape, range); also a ``ValueError``.

    >>> from lightning_ooc import OutOfCoreNodeData
    >>> OutOfCoreNodeData("data/g", batch_size=0)
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.InputError: batch_size must be an integer >= 1, got 0 (seed nodes per minibatch)
    """


class BatchKindError(InputError, AttributeError):
    """A model asked a batch for a field that batches of this kind do not carry (``x`` of an embedding batch).

    Also an ``AttributeError``, so ``hasattr(batch, "x")`` stays False where code probes for the field.

    >>> issubclass(BatchKindError, AttributeError) and issubclass(BatchKindError, InputError)
    True
    """
