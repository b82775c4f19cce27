"""Settings groups: a frozen dataclass of settings given as an instance, a dict of its fields, or None.

The datamodules take their groups this way (``pipeline=``, ``predict=``, the embedding datamodule's
``buffer=`` and ``negatives=``), and keep them in hyperparameters as plain dicts.

>>> from dataclasses import dataclass
>>> @dataclass(frozen=True)
... class Queues:
...     size: int = 4
>>> settings_group(Queues, "queues", {"size": 2}), settings_group(Queues, "queues", None)
(Queues(size=2), Queues(size=4))
>>> plain(Queues(size=2))
{'size': 2}
>>> settings_group(Queues, "queues", {"length": 2})
Traceback (most recent call last):
  ...
lightning_ooc.errors.InputError: queues: unknown setting(s) length; it takes size
"""
from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from lightning_ooc.errors import InputError


def settings_group(cls: type, name: str, given: Any) -> Any:
    """The settings group ``name`` of class ``cls``: ``given`` as an instance, a dict of its fields, or None for
    the defaults; anything else, or a field it lacks, is an :class:`~lightning_ooc.errors.InputError`."""
    if given is None:
        return cls()
    if isinstance(given, cls):
        return given
    if isinstance(given, dict):
        unknown = sorted(set(given) - {f.name for f in fields(cls)})
        if unknown:
            raise InputError(f"{name}: unknown setting(s) {', '.join(map(str, unknown))}; it takes "
                             f"{', '.join(f.name for f in fields(cls))}")  # fmt: skip
        return cls(**given)
    raise InputError(f"{name} must be a {cls.__name__} or a dict of its fields, got {type(given).__name__}")


def plain(value: Any) -> dict[str, Any] | None:
    """A group (an instance, a dict of its fields or None) as a dict of plain values, or None (for
    hyperparameters, which checkpoints load with ``weights_only``)."""
    return None if value is None else dict(value) if isinstance(value, dict) else asdict(value)
