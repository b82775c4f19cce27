"""The ``"ooc"`` strategy: one process per device over node-local shared memory (see :mod:`.ooc`)."""
from lightning.pytorch.strategies import StrategyRegistry

from lightning_ooc.strategy.ooc import OutOfCoreStrategy

OutOfCoreStrategy.register_strategies(StrategyRegistry)

__all__ = ["OutOfCoreStrategy"]
