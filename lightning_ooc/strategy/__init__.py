"""The ``"ooc"`` strategy: one process per device over node-local shared memory (see :mod:`.ooc`).

``strategy="ooc"`` is registered with Lightning in one place, :mod:`lightning_ooc._registry`, when
``lightning_ooc`` is imported.
"""
from lightning_ooc.strategy.ooc import OutOfCoreStrategy

__all__ = ["OutOfCoreStrategy"]
