"""The host cache kept by MassiveGNN's scores (``host_cache_policy="scored"``).

:class:`ScoredHostCacheTier` starts from the rows the presample ranked
hottest, like the static host cache, then follows
:class:`~lightning_ooc.store.policy.ScoredPolicy` over every node of the
dataset: each training minibatch's ids are observed once, at claim (hits keep
their eviction score, misses raise their access score), and every
``interval`` minibatches an eviction round replaces the rows whose eviction
score fell below ``gamma ** interval`` by the most missed rows. The round runs
in the extractor thread whose :meth:`~ScoredHostCacheTier.fill` finds it due
(the one that observed the Delta-th minibatch, or the next one if that batch
was abandoned): under the lock it picks the rows and takes the evicted ids out
of the map (a claim from then on misses them), it reads the replacements with
the SSD reader outside the lock, in chunks, and under the lock again copies
them into the evicted rows' slots and maps them.

Correctness: a slot referenced by a lease not yet released (a GPU trainer
gathers zero-copy from the host rows after ``fill``, until the fence of its
gather completed) is never evicted: claims count references per slot,
releases take them back after their fence, and a round skips referenced rows
(they stay until a later round). Replaced rows are overwritten in place in the
same (registered) host tensor, so zero-copy reads need no new registration.
A failed read of replacements puts the evicted rows back (their slots were
untouched) and reverts those pairs of the policy, then raises.

Evaluation must not change the scores: a store built with this tier is a
:class:`ScoredStore`, whose :meth:`~ScoredStore.without` (how evaluation
passes derive their chain) holds the tier's :meth:`~ScoredHostCacheTier.frozen`
view instead -- the same rows, map and reference counts, claims that never
observe, and no rounds.

Memory beyond the static host cache: the policy's arrays over every node
(access score float32, buffer index int32, in-degree int32: 12 bytes per
node; the all-nodes candidate set keeps no id array) and 16 bytes per cached
row, plus one int32 reference count per row.

Example::

    >>> import tempfile, numpy as np, torch, lightning_ooc
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.io import FeatureReader
    >>> from lightning_ooc.store.host_cache import HostCache
    >>> from lightning_ooc.store.scored_cache import ScoredHostCacheTier
    >>> ds = lightning_ooc.open_dataset(synthesize(tempfile.mkdtemp() + "/g", num_nodes=100, avg_degree=4,
    ...                                            num_features=8, num_classes=2, progress=False))
    >>> reader = FeatureReader.from_dataset(ds)
    >>> host = HostCache.load(reader, torch.arange(10), ds.num_nodes, progress=False)
    >>> tier = ScoredHostCacheTier(host, reader, ds.in_degree, gamma=0.5, interval=2)
    >>> for _ in range(4):  # a round after 2 and 4 minibatches; rows 1..9 unused, 50 missed
    ...     lease = tier.claim(torch.tensor([0, 50]))
    ...     tier.fill(lease); tier.release(lease)
    >>> tier.stats()["replaced"], int(tier.host.lookup(torch.tensor([50]))[0]) >= 0
    (1, True)
    >>> tier.close(); reader.close()
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from lightning_ooc.store.policy import ScoredPolicy
from lightning_ooc.store.host_cache import HostCache
from lightning_ooc.store.tiers import HostCacheTier
from lightning_ooc.store.tier import FeatureTier, Fence, Lease, wait_fence
from lightning_ooc.store.tiered import TieredFeatureStore
from lightning_ooc.utils import trace
from lightning_ooc.utils.cancel import NEVER, CancelToken

log = logging.getLogger("lightning_ooc")

#: bytes of replacement rows read (and installed) at a time in an eviction round
ROUND_CHUNK_BYTES = 16 << 20


class ScoredHostCacheTier(HostCacheTier):
    """The host cache, its rows replaced every ``interval`` training minibatches by MassiveGNN's scores.

    Args:
        host: the warm start (the presample's hottest rows), loaded; its rows, map and ids change in place.
        reader: the SSD :class:`~lightning_ooc.io.FeatureReader` the replacements are read with.
        degree: in-degree of every node (ties between replacements).
        gamma, interval: the policy's decay per unused minibatch and minibatches between rounds.
    """

    name = "host_cache"

    def __init__(self, host: HostCache, reader: Any, degree: np.ndarray, *, gamma: float = 0.995,
                 interval: int = 32):  # fmt: skip
        super().__init__(host)
        self.reader = reader
        num_nodes = int(host.map.numel())
        # warm start in slot order: the policy's buffer index i is the host cache's slot i
        self.policy = ScoredPolicy(num_nodes, degree, host.num_rows, gamma=gamma, interval=interval,
                                   warm=host.ids.numpy())  # fmt: skip
        self.refs = torch.zeros(host.num_rows, dtype=torch.int32)  # leases holding each slot
        self._lock = threading.Lock()
        self._round_running = False
        self._skipped = 0  # rows below the threshold kept because a lease referenced them
        self._failed_rounds = 0
        self._taken: dict[str, float] = {}
        self._frozen: FrozenHostCacheView | None = None

    # -- claims -------------------------------------------------------------------------------
    def claim(self, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        return self._claim(ids, self, observe=True)

    def _claim(self, ids: torch.Tensor, owner: FeatureTier, observe: bool) -> Lease:
        with self._lock:
            pos = self.host.lookup(ids)
            mask = pos >= 0
            slots = pos[mask]
            self.refs.index_add_(0, slots, torch.ones(slots.numel(), dtype=torch.int32))
            if observe:
                self.policy.observe(ids, mask)
        lease = Lease(owner, mask, slots)
        lease.stats.host_hits = int(slots.numel())
        return lease

    def fill(self, lease: Lease, cancel: CancelToken = NEVER) -> None:
        """Nothing to read for the lease; runs the eviction round when one is due."""
        if self.policy.due():
            self.run_round(cancel)

    # rows, pin, gather_into (zero-copy on a GPU) and close are the plain host cache's

    def release(self, lease: Lease, fence: Fence | None = None) -> None:
        if not lease.released:
            wait_fence(fence)  # the trainer's gather may still read the rows
            self._unref(lease)

    def abandon(self, lease: Lease) -> None:
        if not lease.released:
            self._unref(lease)

    def _unref(self, lease: Lease) -> None:
        lease.released = True
        slots = lease.handle.to("cpu") if lease.handle.is_cuda else lease.handle
        with self._lock:
            self.refs.index_add_(0, slots, torch.full((slots.numel(),), -1, dtype=torch.int32))

    # -- eviction rounds ------------------------------------------------------------------------
    def run_round(self, cancel: CancelToken = NEVER) -> int:
        """One eviction round if one is due and none is running; returns the rows replaced."""
        with self._lock:
            if self._round_running or not self.policy.due():
                return 0
            referenced = self.host.ids[self.refs > 0].numpy()
            below = self._below_threshold(referenced)
            evicted, repl = self.policy.evict_and_replace(keep=referenced)
            self._skipped += below
            if not evicted.size:
                return 0
            ev = torch.from_numpy(evicted)
            slots = self.host.map[ev].long()
            assert bool((slots >= 0).all()) and not bool(self.refs[slots].any()), "evicting a row in use"
            self.host.map[ev] = -1  # claims miss them from now on: their slots gain no reference
            self.host.ids[slots] = -1
            self._round_running = True
        try:
            with trace.span("host_cache.round", rows=int(repl.size)):
                self._read_and_install(torch.from_numpy(repl), ev, slots, cancel)
        finally:
            with self._lock:
                self._round_running = False
        log.debug("lightning_ooc: host cache round replaced %d rows", repl.size)
        return int(repl.size)

    def _below_threshold(self, referenced: np.ndarray) -> int:
        """How many referenced rows a round would have evicted (they stay: counted in ``stats``)."""
        if not referenced.size:
            return 0
        return int(self.policy.expired(referenced).sum())

    def _read_and_install(self, repl: torch.Tensor, ev: torch.Tensor, slots: torch.Tensor,
                          cancel: CancelToken) -> None:  # fmt: skip
        """Read the replacements chunk by chunk (sorted: extents merge) and install each chunk (replacement ``i``
        in the slot of evicted ``i``). When a read fails, the pairs not installed get their evicted rows back
        (their slots were not touched) and are reverted in the policy; the error propagates."""
        order = torch.argsort(repl)
        step = max(1, ROUND_CHUNK_BYTES // max(self.reader.row_bytes, 1))
        installed = torch.zeros(repl.numel(), dtype=torch.bool)
        try:
            for s in range(0, repl.numel(), step):
                cancel.check()
                part = order[s : s + step]
                rows = self.reader.gather(repl[part])
                with self._lock:
                    self.host.rows.index_copy_(0, slots[part], rows)  # in place: stays registered for zero-copy
                    self.host.map[repl[part]] = slots[part].to(torch.int32)
                    self.host.ids[slots[part]] = repl[part]
                installed[part] = True
        finally:
            if not bool(installed.all()):
                self._put_back(installed, ev, slots)

    def _put_back(self, installed: torch.Tensor, ev: torch.Tensor, slots: torch.Tensor) -> None:
        """After a failed read: the pairs not installed keep their evicted rows (slots untouched), reverted."""
        rest = torch.nonzero(~installed).flatten()
        with self._lock:
            self.host.map[ev[rest]] = slots[rest].to(torch.int32)
            self.host.ids[slots[rest]] = ev[rest]
            self.policy.revert(rest.numpy())
            self._failed_rounds += 1

    # -- views and statistics ---------------------------------------------------------------------
    def frozen(self) -> "FrozenHostCacheView":
        """The same rows for passes that must not change the scores (evaluation): claims never observe."""
        if self._frozen is None:
            self._frozen = FrozenHostCacheView(self)
        return self._frozen

    def stats(self) -> dict[str, float]:
        """Counters so far: eviction ``rounds``, rows ``evicted``/``replaced``, rows ``buffered``, training
        minibatches observed (``batches``), rows asked and served (``requests``, ``hits``, ``hit_rate``),
        rows kept past their threshold because a lease held them (``skipped_referenced``), failed rounds."""
        s = self.policy.stats()
        with self._lock:
            s["skipped_referenced"] = self._skipped
            s["failed_rounds"] = self._failed_rounds
        return s

    def take_stats(self) -> dict[str, float]:
        """The counters of :meth:`stats` accumulated since the previous call (per epoch), with their hit rate."""
        now = self.stats()
        keys = ("rounds", "evicted", "replaced", "batches", "requests", "hits", "skipped_referenced", "failed_rounds")
        out: dict[str, float] = {k: now[k] - self._taken.get(k, 0) for k in keys}
        out["buffered"] = now["buffered"]
        out["hit_rate"] = out["hits"] / out["requests"] if out["requests"] else 0.0
        self._taken = {k: now[k] for k in keys}
        return out


class FrozenHostCacheView(FeatureTier):
    """A :class:`ScoredHostCacheTier` read without feeding its policy: claims reference the rows (so no round
    replaces them under the lease) but are not observed, and :meth:`fill` runs no round."""

    name = "host_cache"

    def __init__(self, tier: ScoredHostCacheTier):
        self.tier = tier

    @property
    def host(self) -> HostCache:
        return self.tier.host

    def claim(self, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        return self.tier._claim(ids, self, observe=False)

    def rows(self, lease: Lease, device: torch.device) -> torch.Tensor:
        return self.tier.rows(lease, device)

    def pin(self, lease: Lease) -> None:
        self.tier.pin(lease)

    def gather_into(self, lease: Lease, x: torch.Tensor, positions: torch.Tensor) -> None:
        self.tier.gather_into(lease, x, positions)

    def release(self, lease: Lease, fence: Fence | None = None) -> None:
        self.tier.release(lease, fence)

    def abandon(self, lease: Lease) -> None:
        self.tier.abandon(lease)

    def frozen(self) -> "FrozenHostCacheView":
        return self

    def close(self) -> None:
        """Nothing: the training store closes the tier."""


class ScoredStore(TieredFeatureStore):
    """A store with a scored host cache: its chains derived by :meth:`without` (evaluation passes) read it through
    the tier's :meth:`~ScoredHostCacheTier.frozen` view (as every chain does for a tier that has one), so that only
    its own (training) claims feed the scores."""
