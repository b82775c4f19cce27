"""The tier protocol: what every level of the storage hierarchy answers.

A tier is asked three things about the node ids of one minibatch, in the
spirit of DGL GraphBolt's feature stores:

1. :meth:`FeatureTier.claim` -- *which of these ids do you hold?* The tier
   answers with a :class:`Lease` whose ``mask`` marks the ids it serves, and
   reserves what it needs to serve them (a feature-buffer slot, say). Claims
   are cheap and may wait for room (cancel-aware).
2. :meth:`FeatureTier.fill` then :meth:`FeatureTier.gather_into` -- *give me
   their rows*: ``fill`` does the slow part (direct reads into staging, copies
   into slots, waiting for rows another extractor is loading) in an extractor
   thread; ``gather_into`` writes them into the batch's ``x`` on the training
   device (``rows`` returns them as a tensor of their own). Index tensors are
   pinned by the extractor (:meth:`FeatureTier.pin`), so the trainer copies
   them without a host synchronisation.
3. :meth:`FeatureTier.release` -- *I am done with them*, with a completion
   :class:`Fence`: a tier that reuses memory (the feature buffer) waits for
   the fence before the memory can be handed to another batch, so a slot is
   reused only after its last reader has finished (a CUDA event recorded after
   the gather on the GPU; nothing on the CPU, where the gather is synchronous).

A :class:`~lightning_ooc.store.tiered.TieredFeatureStore` is a chain of
tiers: each id is served by the first tier that claims it, and the last tier
of a chain claims everything. A tier that caches (the feature buffer) fills
its misses from the tier it wraps, its ``source``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lightning_ooc.utils.cancel import NEVER, CancelToken


@dataclass
class ExtractStats:
    """What one extraction found in each tier of the local hierarchy and read from SSD, and, under ``tiers``,
    the statistics of tiers beyond it (a partitioned dataset's remote tier keeps its own: by tier name)."""

    host_hits: int = 0
    buffer_hits: int = 0
    in_flight_hits: int = 0
    misses: int = 0
    bytes_requested: int = 0
    bytes_read: int = 0
    ios: int = 0
    #: a tier's own statistics (an object with ``add``), by the tier's name
    tiers: dict[str, Any] = field(default_factory=dict)

    def add(self, o: "ExtractStats") -> None:
        for k in self.__dataclass_fields__:
            if k != "tiers":
                setattr(self, k, getattr(self, k) + getattr(o, k))
        for name, stats in o.tiers.items():
            self.add_tier(name, stats)

    def add_tier(self, name: str, stats: Any) -> None:
        """Add a lease's statistics: the local hierarchy's :class:`ExtractStats` to these, a tier's own kind
        to ``tiers[name]``."""
        if isinstance(stats, ExtractStats):
            self.add(stats)
        elif name in self.tiers:
            self.tiers[name].add(stats)
        else:
            self.tiers[name] = replace(stats)


class Fence:
    """Completion of the reads issued so far on a device (``wait()`` blocks until they finished).

    On a CUDA device it is an event recorded on the current stream; elsewhere the
    work is already complete when the fence is made, and :meth:`record` returns ``None``.
    """

    def __init__(self, event: Any):
        self._event = event

    @classmethod
    def record(cls, device: torch.device | str | None) -> "Fence | None":
        """A fence after the work queued so far on ``device``'s current stream (None off a GPU)."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type != "cuda":
            return None
        return cls.on_stream(torch.cuda.current_stream(device))  # pragma: no cover - needs a GPU

    @classmethod
    def on_stream(cls, stream: Any) -> "Fence | None":
        """A fence after the work queued so far on ``stream`` (a CUDA stream; None gives None)."""
        if stream is None:
            return None
        event = torch.cuda.Event(blocking=True)  # pragma: no cover - a waiting thread sleeps, not spins
        event.record(stream)  # pragma: no cover
        return cls(event)  # pragma: no cover

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()


def wait_fence(fence: "Fence | None") -> None:
    """Block until ``fence`` completed (``None``: nothing to wait for)."""
    if fence is not None:
        fence.wait()


@dataclass
class Lease:
    """What one tier holds of one minibatch: which ids it serves and the tier's own handle."""

    tier: "FeatureTier"
    mask: torch.Tensor  # bool over the ids the tier was asked about
    handle: Any = None
    #: what the tier found (its own kind of statistics where it keeps other ones: ``FeatureTier.stats_type``)
    stats: Any = field(default_factory=ExtractStats)
    positions: torch.Tensor | None = None  # set by the store: positions of the served ids in the batch
    released: bool = False


class FeatureTier(ABC):
    """One level of the storage hierarchy (see the module docstring)."""

    #: a short name, used in plans, metrics and :meth:`TieredFeatureStore.without`
    name: str = "tier"
    #: the tier this one fills its misses from, if it caches
    source: "FeatureTier | None" = None

    @abstractmethod
    def claim(self, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        """Which of ``ids`` this tier serves (``Lease.mask``), reserving what serving them needs."""

    def claim_for(self, batch: Any, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        """:meth:`claim` for the ids of the sampled minibatch ``batch`` (what the store calls when it has the
        batch). A tier whose rows are kept per batch (packed minibatches) overrides it; default: :meth:`claim`."""
        return self.claim(ids, cancel)

    def fill(self, lease: Lease, cancel: CancelToken = NEVER) -> None:
        """Make the claimed rows readable (I/O, copies, waiting for rows in flight). Default: nothing to do."""

    @abstractmethod
    def rows(self, lease: Lease, device: torch.device) -> torch.Tensor:
        """The claimed rows, in the order of the claimed ids, on ``device``."""

    def pin(self, lease: Lease) -> None:
        """Move the lease's index tensors to pinned memory (extractor side, CUDA only), so that
        :meth:`gather_into` copies them to the device without a host synchronisation. Default: none."""

    def gather_into(self, lease: Lease, x: torch.Tensor, positions: torch.Tensor) -> None:
        """``x[positions] = rows`` of the lease (``positions`` on ``x``'s device). Default: via :meth:`rows`."""
        x.index_copy_(0, positions, self.rows(lease, x.device))

    def release(self, lease: Lease, fence: Fence | None = None) -> None:
        """Done with the lease; memory it pinned is reused only after ``fence``. Default: nothing held."""
        lease.released = True

    def abandon(self, lease: Lease) -> None:
        """Give back a lease whose rows were never filled (the extraction failed)."""
        self.release(lease, None)

    def close(self) -> None:
        """Free the tier's memory (after every run that used it ended)."""
