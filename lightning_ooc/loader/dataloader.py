"""What Lightning gets as a dataloader from every datamodule of the package, and where pass metrics go.

A pass is not a PyTorch ``DataLoader``: it is a run of a pipeline (or of a partition buffer) that the
datamodule starts. :class:`PassLoader` is the iterable Lightning asks for: ``len()`` is the number of
batches of a pass over its split, and each ``iter()`` closes the split's previous pass and starts a new one.
:func:`log_pass_metrics` writes what a pass cost to the Trainer's logger under ``ooc/{split}_{name}``.

Example::

    >>> from lightning_ooc.loader.dataloader import PassLoader
    >>> started = []
    >>> def start(split):  # a pass: an iterator of batches with close() (a generator here)
    ...     started.append(split)
    ...     return (b for b in [1, 2])
    >>> loader = PassLoader("train", start=start, count=lambda split: 2)
    >>> len(loader), list(loader), list(loader), started
    (2, [1, 2], [1, 2], ['train', 'train'])
"""
from __future__ import annotations

from typing import Any, Callable


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

    def __len__(self) -> int:
        return self._count(self.split)

    def __iter__(self) -> Any:
        self.close()
        self.run = self._start(self.split)
        return self.run

    def close(self) -> None:
        """Close the last pass (its threads stop; a closed pass may be closed again)."""
        if self.run is not None:
            self.run.close()


def log_pass_metrics(trainer: Any, split: str, metrics: dict[str, float]) -> None:
    """``metrics`` of a pass over ``split`` to the Trainer's logger as ``ooc/{split}_{name}``, at the current step
    (nothing without a Trainer or a logger, or during the sanity check)."""
    if trainer is None or trainer.logger is None or trainer.sanity_checking or not metrics:
        return
    trainer.logger.log_metrics({f"ooc/{split}_{k}": v for k, v in metrics.items()}, step=trainer.global_step)
