"""Checks of a model's arguments, shared by the LightningModules of this package.

A model is built before anything trains (``lightning-ooc fit`` builds it from
the config), so a width of 0 or a negative learning rate is an
:class:`~lightning_ooc.errors.InputError` naming the argument there, not a
traceback from the first forward pass or from the optimizer (or, for
``num_layers=0``, a model that trains nothing and says nothing).

    >>> from lightning_ooc.models.checks import count
    >>> count("num_layers", 2, 1, "message-passing layers")
    2
    >>> count("num_layers", 0, 1, "message-passing layers")
    Traceback (most recent call last):
      ...
    lightning_ooc.errors.InputError: num_layers must be an integer >= 1, got 0 (message-passing layers)
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

from lightning_ooc.errors import InputError


def count(name: str, value: Any, low: int, what: str) -> int:
    """``value`` as an int ``>= low`` (an integral float such as ``2.0`` is taken; a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value != int(value) or value < low:  # fmt: skip
        raise InputError(f"{name} must be an integer >= {low}, got {value!r} ({what})")
    return int(value)


def rate(name: str, value: Any, *, zero: bool = False) -> float:
    """A finite number ``> 0`` (``>= 0`` with ``zero``): a learning rate or a weight decay."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if isinstance(value, bool) or not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        raise InputError(f"{name} must be a finite number {'>= 0' if zero else '> 0'}, got {value!r}")
    return v


def dropout(value: Any) -> float:
    """A dropout probability in ``[0, 1)``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if isinstance(value, bool) or not 0.0 <= v < 1.0:
        raise InputError(f"dropout must be a probability in [0, 1), got {value!r}")
    return v


def choice(name: str, value: Any, options: Sequence[str]) -> str:
    """One of ``options``."""
    if value not in options:
        raise InputError(f"unknown {name} {value!r}; use {' or '.join(repr(o) for o in options)}")
    return value


def num_classes(value: Any, allow_none: bool = False) -> int | None:
    """The class count of a node classifier: 2 or more (a dataset without labels has 0). ``allow_none``: None
    passes, as a datamodule without classes (embedding training) gives it; the model's first batch says what to
    use instead."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 2:
        raise InputError(
            f"num_classes must be an integer >= 2 (node classification tells classes apart), got {value!r}; a "
            "dataset without node labels (num_classes 0, such as a link-prediction dataset) trains with "
            "lightning_ooc.models.LinkPredictor and lightning_ooc.OutOfCoreLinkData (configs/link_demo.yaml)"
        )  # fmt: skip
    return int(value)


def in_channels(value: Any) -> int:
    """The feature dimension of a homogeneous model (a dict per node type means a heterogeneous dataset)."""
    if isinstance(value, dict):
        raise InputError(
            f"in_channels is a feature dimension per node type ({value}): the dataset is heterogeneous; train it "
            "with a relational model (lightning_ooc.models.RGAT or RSAGE, configs/rgat_demo.yaml)"
        )  # fmt: skip
    return count("in_channels", value, 1, "the feature dimension: dm.num_features")
