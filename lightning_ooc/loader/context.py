"""``ProcessContext``: what a datamodule needs to know about the process it runs in.

Rank, world size, training device, and what the strategy offers beyond
plain DDP: node-local shared memory for the topology and the staging buffer,
and a way to run passes in another process (the gather producer). A strategy
provides one by implementing :class:`ContextProvider`; the datamodule asks
:meth:`ProcessContext.of` and never reads strategy attributes by name, and a
gather producer process builds its own from what its parent handed it.

Example::

    >>> from lightning_ooc.loader.context import ProcessContext
    >>> ctx = ProcessContext.of(None)  # no Trainer: one process on the CPU
    >>> ctx.rank, ctx.world, ctx.device.type, ctx.topology is None
    (0, 1, 'cpu', True)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from lightning_ooc.loader.config import NodeDataConfig


class Shared(Protocol):
    """Node-local shared memory (``NodeShared`` in a rank, ``AttachedShared`` in a helper process)."""

    local_rank: int
    local_world: int

    def buffer(self, key: str, nbytes: int, fill: Callable[[memoryview], None] | None = None) -> Any: ...

    def array(self, key: str, shape: tuple[int, ...], dtype: Any, fill: Any = None, writeable: bool = False) -> Any: ...


class PassRun(Protocol):
    """One pass over a split: an iterator of minibatches that can be closed early."""

    stats: Any

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...

    def close(self) -> None: ...


class PassSource(Protocol):
    """Something that runs passes: the local pipeline, a producer process, a synchronous baseline.

    Every member is declared; :class:`SourceDefaults` gives the optional ones their defaults, so the datamodule
    calls them without probing for them.
    """

    #: the dataset it opened (``None`` where passes run in another process)
    dataset: Any
    #: the sizes of its store's tiers (``None`` where there is no planned store)
    plan: Any
    #: the training sampler (``None`` where it lives in another process)
    sampler: Any
    #: what an error must close at once, in words for the log (``None``: closing can wait for teardown); a
    #: partitioned source leaves the row exchange, a learnable one writes its trained rows back
    close_after_error: str | None

    def run(self, split: str, epoch: int, skip: frozenset[int], on_end: Callable[[Any], None] | None = None,
            on_batch: Callable[[int], None] | None = None) -> PassRun: ...

    def flush(self) -> None: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


class SourceDefaults:
    """The optional members of :class:`PassSource`, for a source that has nothing to say for them.

    >>> src = SourceDefaults()
    >>> src.flush(), src.abort(), src.plan, src.close_after_error
    (None, None, None, None)
    """

    dataset: Any = None
    plan: Any = None
    sampler: Any = None
    close_after_error: str | None = None

    def flush(self) -> None:
        """Write back what the passes changed (learnable features); nothing by default."""

    def abort(self) -> None:
        """After an error, before :meth:`close`: stop what others wait on (the row exchange); nothing by default."""


@dataclass
class ProcessContext:
    """The process a datamodule runs in (see the module docstring).

    Attributes:
        rank, world: this process's global rank and the number of processes.
        device: the training device.
        topology: shared memory to keep ``indptr`` in once per machine (``None``: private memory).
        staging: shared memory to carve this process's staging buffer out of (``None``: private).
        remote: starts a :class:`PassSource` in another process for a config (``None``: run passes here).
    """

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    topology: Shared | None = None
    staging: Shared | None = None
    remote: Callable[["NodeDataConfig"], PassSource] | None = None

    @property
    def local_world(self) -> int:
        """Processes of this machine that plan at the same time (they share its memory limit)."""
        for shared in (self.topology, self.staging):
            if shared is not None:
                return int(shared.local_world)
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))

    @classmethod
    def of(cls, trainer: Any) -> "ProcessContext":
        """The context of a Trainer's process: its strategy's if it provides one, else plain DDP facts."""
        if trainer is None:
            return cls()
        strategy = trainer.strategy
        if isinstance(strategy, ContextProvider):
            return strategy.process_context()
        return cls(rank=int(trainer.global_rank), world=int(trainer.world_size), device=strategy.root_device)


@runtime_checkable
class ContextProvider(Protocol):
    """A strategy that tells datamodules about their process (the ``"ooc"`` strategy does)."""

    def process_context(self) -> ProcessContext: ...
