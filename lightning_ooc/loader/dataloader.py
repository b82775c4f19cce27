"""What Lightning gets as a dataloader from every datamodule of the package, and where pass metrics go.

A pass is not a PyTorch ``DataLoader``: it is a run of a pipeline (or of a partition buffer) that the
datamodule starts. :class:`PassLoader` is the iterable Lightning asks for: ``len()`` is the number of
batches of a pass over its split, and each ``iter()`` closes the split's previous pass and returns a new one
that starts at its first ``next()``: Lightning calls ``iter()`` once only to check that the loader is
iterable, and a pass started there would read rows (and warm the caches) for nothing.
:func:`log_pass_metrics` writes what a pass cost to the Trainer's logger under ``ooc/{split}_{name}``.
:class:`PassData` is the base of every datamodule of the package (node classification, link prediction,
trainable embeddings): a loader per split over the passes it starts, each pass's stats kept and logged.

Example::

    >>> from lightning_ooc.loader.dataloader import PassLoader
    >>> started = []
    >>> def start(split):  # a pass: an iterator of batches with close() (a generator here)
    ...     started.append(split)
    ...     return (b for b in [1, 2])
    >>> loader = PassLoader("train", start=start, count=lambda split: 2)
    >>> len(loader), list(loader), list(loader), started
    (2, [1, 2], [1, 2], ['train', 'train'])
    >>> probe = iter(loader)  # nothing starts before the first next()
    >>> len(started)
    2
    >>> next(probe), len(started)
    (1, 3)
"""
from __future__ import annotations

from typing import Any, Callable

import lightning as L


class PassLoader:
    """The iterable Lightning gets as a dataloader (see the module docstring).

    Args:
        split: the split its passes go over.
        start: starts a pass over a split and returns it (an iterator of batches, with ``close()``).
        count: the number of batches of a pass over a split.
    """

    def __init__(self, split: str, start: Callable[[str], Any], count: Callable[[str], int]):
        self.split = split
        self._start, self._count = start, count
        #: the last pass started (kept after it is closed: its statistics stay readable)
        self.run: Any = None
        self._pending: PendingPass | None = None

    def __len__(self) -> int:
        return self._count(self.split)

    def __iter__(self) -> "PendingPass":
        self.close()
        self._pending = PendingPass(self)
        return self._pending

    def close(self) -> None:
        """Close the last pass (its threads stop; a closed pass may be closed again); one not started yet
        never starts."""
        if self._pending is not None:
            self._pending.closed = True
        if self.run is not None:
            self.run.close()

    def _begin(self) -> Any:
        self.run = self._start(self.split)
        return self.run


class PendingPass:
    """A pass that starts at its first ``next()`` (see the module docstring); afterwards it is the pass."""

    def __init__(self, loader: PassLoader):
        self._loader = loader
        self._run: Any = None
        self.closed = False

    def __iter__(self) -> "PendingPass":
        return self

    def __next__(self) -> Any:
        if self._run is None:
            if self.closed:
                raise StopIteration
            self.start()
        return next(self._run)

    def start(self) -> Any:
        """Start the pass now (if it has not started) and return it; a closed pass does not start."""
        if self._run is None:
            if self.closed:
                raise RuntimeError("this pass was closed before it started; iterate the loader again for a new one")
            self._run = self._loader._begin()
        return self._run

    def __len__(self) -> int:
        return len(self._loader)

    def close(self) -> None:
        self.closed = True
        if self._run is not None:
            self._run.close()

    def __getattr__(self, name: str) -> Any:  # the started pass's attributes (its stats)
        run = self.__dict__.get("_run")
        if run is None:
            raise AttributeError(f"{name!r}: the pass has not started (it starts at the first next())")
        return getattr(run, name)


def log_pass_metrics(trainer: Any, split: str, metrics: dict[str, float]) -> None:
    """``metrics`` of a pass over ``split`` to the Trainer's logger as ``ooc/{split}_{name}``, at the current step
    (nothing without a Trainer or a logger, or during the sanity check)."""
    if trainer is None or trainer.logger is None or trainer.sanity_checking or not metrics:
        return
    trainer.logger.log_metrics({f"ooc/{split}_{k}": v for k, v in metrics.items()}, step=trainer.global_step)


class PassData(L.LightningDataModule):
    """The base of the package's datamodules: one :class:`PassLoader` per split, over the passes a subclass
    starts (:meth:`_start`) and counts (:meth:`_num_batches`); the stats of the last pass of each split in
    :attr:`last_stats`, its metrics in the Trainer's logger (:meth:`_pass_ended`); every loader closed when a
    run fails (:meth:`close_loaders`).

        >>> class Counting(PassData):
        ...     def _start(self, split):
        ...         return iter(range(3))
        ...     def _num_batches(self, split):
        ...         return 3
        >>> dm = Counting()
        >>> len(dm.train_dataloader()), list(dm.val_dataloader()), dm.train_dataloader() is dm.train_dataloader()
        (3, [0, 1, 2], True)
    """

    def __init__(self) -> None:
        super().__init__()
        #: the stats of the last pass over each split
        self.last_stats: dict[str, Any] = {}
        self._passes: dict[str, PassLoader] = {}

    def _start(self, split: str) -> Any:
        """A new pass over ``split``: an iterator of batches with ``close()``."""
        raise NotImplementedError

    def _num_batches(self, split: str) -> int:
        """The batches of a pass over ``split``."""
        raise NotImplementedError

    def _loader(self, split: str) -> PassLoader:
        if split not in self._passes:
            self._passes[split] = PassLoader(split, self._start, self._num_batches)
        return self._passes[split]

    def train_dataloader(self) -> PassLoader:
        return self._loader("train")

    def val_dataloader(self) -> Any:
        return self._loader("val")

    def test_dataloader(self) -> PassLoader:
        return self._loader("test")

    def _pass_ended(self, split: str, stats: Any, metrics: dict[str, float]) -> None:
        """Keep the stats of a pass that ended, and log ``metrics`` (what it cost) under ``ooc/{split}_*``."""
        self.last_stats[split] = stats
        log_pass_metrics(getattr(self, "trainer", None), split, metrics)

    def current_pass(self, split: str) -> Any:
        """The last pass started over ``split`` (running or ended; its ``stats``), or None."""
        loader = self._passes.get(split)
        return loader.run if loader is not None else None

    def close_loaders(self) -> None:
        """Close every split's running pass (its threads stop now)."""
        for loader in self._passes.values():
            loader.close()
