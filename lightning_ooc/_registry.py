"""Registers ``strategy="ooc"`` with Lightning on ``import lightning_ooc``, without importing Lightning.

Lightning finds strategies by name in ``lightning.pytorch.strategies.StrategyRegistry``.
Importing Lightning costs seconds that ``lightning-ooc synth`` or ``info`` never
need, so the entry is added when Lightning's strategies module is imported (at
once if it already was): the registered factory imports
:class:`~lightning_ooc.strategy.OutOfCoreStrategy` only when a Trainer asks for it.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_TARGET = "lightning.pytorch.strategies"
_DESCRIPTION = "out-of-core GNN training: DDP over node-local shared topology and staging"


def _make_ooc(**kwargs: Any):
    from lightning_ooc.strategy.ooc import OutOfCoreStrategy  # lazy: it imports Lightning

    return OutOfCoreStrategy(**kwargs)


def _register(module: Any) -> None:
    registry = module.StrategyRegistry
    if "ooc" not in registry:
        registry.register("ooc", _make_ooc, description=_DESCRIPTION)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _register(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of Lightning's strategies module so that registration follows its import."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def register_strategy() -> None:
    """Make ``strategy="ooc"`` known to Lightning, now or when Lightning is imported."""
    module = sys.modules.get(_TARGET)
    if module is not None and hasattr(module, "StrategyRegistry"):
        _register(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
