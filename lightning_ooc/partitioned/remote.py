"""Tiers of a partitioned dataset: other machines' rows (:class:`RemoteTier`) and this machine's (:class:`LocalRows`).

A minibatch of a partitioned run holds nodes of every machine. The store's
chain starts with :class:`RemoteTier`, which claims the ids other machines
own; the ids left are this machine's, served by its ordinary chain (host
cache, feature buffer, SSD) over the partition's own rows, each tier wrapped
in :class:`LocalRows`, which turns global ids into the partition's row
numbers before asking it.

:class:`RemoteTier` keeps a buffer of remote rows (MassiveGNN's prefetch
buffer, :mod:`lightning_ooc.store.policy`): a batch's remote rows found there
are copied out; the rest (the misses) are asked of their owners through the
:class:`~lightning_ooc.partitioned.exchange.RowExchange`, in the extractor, so the
exchange overlaps training like any other I/O. The policy sees every training
batch's remote ids (hits and misses); when an eviction round is due, the
replacement rows it picks travel in the same exchange as that batch's misses
and are installed in the evicted rows' slots. Evaluation passes use a
:meth:`~RemoteTier.frozen` view: it reads the buffer but never changes scores.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from lightning_ooc.partitioned.exchange import RowExchange
from lightning_ooc.store.tier import FeatureTier, Fence, Lease
from lightning_ooc.utils.cancel import NEVER, CancelToken

#: rows of the warm start asked for in one request
WARM_CHUNK_ROWS = 1 << 16


class _RemoteRows:
    """A lease's handle: the remote ids claimed and, once filled, their rows."""

    __slots__ = ("ids", "rows")

    def __init__(self, ids: torch.Tensor):
        self.ids = ids
        self.rows: torch.Tensor | None = None


@dataclass
class RemoteStats:
    """What the remote tier did for one extraction (or a pass, summed): rows of other machines' nodes asked
    for, found in the remote buffer, fetched from their owners (misses, and replacements of an eviction
    round), the bytes fetched and the time waited for them."""

    remote_rows: int = 0
    remote_hits: int = 0
    remote_fetched: int = 0
    remote_replaced: int = 0
    remote_bytes: int = 0
    remote_wait_s: float = 0.0

    def add(self, o: "RemoteStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(o, f.name))


class RemoteTier(FeatureTier):
    """Claims the ids other machines own; fills them from the remote buffer, else from their owners.

    Args:
        exchange: the row exchange with the other machines.
        owner: the machine of every node (global ids), a tensor.
        me: this machine.
        policy: which remote rows the buffer keeps (:func:`~lightning_ooc.store.policy.make_policy`).
        buffer: the rows it keeps (:class:`~lightning_ooc.store.policy.RowBuffer`; ``None``: no buffer).
        observe: whether claims of this tier feed the policy (training; evaluation uses :meth:`frozen`).
    """

    name = "remote"

    def __init__(self, exchange: RowExchange, owner: torch.Tensor, me: int, policy: Any = None, buffer: Any = None,
                 observe: bool = True):  # fmt: skip
        self.exchange = exchange
        self.owner = owner
        self.me = int(me)
        self.policy = policy
        self.buffer = buffer
        self.observe = observe
        self.row_bytes = exchange.row_bytes
        self._policy_lock = threading.Lock() if observe else None
        self._installing = False  # an eviction round's replacements are on their way
        self._frozen: RemoteTier | None = None

    def frozen(self) -> "RemoteTier":
        """The same buffer and exchange, read without feeding the policy (evaluation passes)."""
        if self._frozen is None:
            self._frozen = RemoteTier(self.exchange, self.owner, self.me, self.policy, self.buffer, observe=False)
        return self._frozen

    def warm_start(self, cancel: CancelToken = NEVER) -> int:
        """Load the rows the policy starts with (the highest-degree remote nodes); returns how many."""
        if self.policy is None or self.buffer is None:
            return 0
        ids = np.asarray(self.policy.initial(), dtype=np.int64)
        for lo in range(0, ids.size, WARM_CHUNK_ROWS):  # in rounds of bounded size
            part = ids[lo : lo + WARM_CHUNK_ROWS]
            self.buffer.install(part, self.exchange.fetch(torch.from_numpy(part), cancel), None)
        return int(ids.size)

    def claim(self, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        mask = self.owner[ids] != self.me
        lease = Lease(self, mask, _RemoteRows(ids[mask]), stats=RemoteStats())
        lease.stats.remote_rows = int(lease.handle.ids.numel())
        return lease

    def fill(self, lease: Lease, cancel: CancelToken = NEVER) -> None:
        h: _RemoteRows = lease.handle
        ids = h.ids
        n = ids.numel()
        evicted = replace = None
        if self.buffer is not None:
            hit, rows_hit = self.buffer.lookup_rows(ids)
        else:
            hit, rows_hit = torch.zeros(n, dtype=torch.bool), None
        if self.observe and self.policy is not None:  # every training minibatch counts, with remote ids or not
            with self._policy_lock:
                self.policy.observe(ids.numpy(), hit.numpy())
                # one eviction round at a time: the next waits until this one's rows are installed
                if not self._installing and self.policy.due():
                    evicted, replace = self.policy.evict_and_replace()
                    if len(replace):
                        self._installing = True
                    else:  # nothing below the threshold (or nothing to take its place): no rows to fetch
                        evicted = replace = None
        if n == 0 and replace is None:
            h.rows = torch.empty((0, self.exchange.num_features), dtype=self.exchange.dtype)
            return
        misses = ids[~hit]
        ask, back = misses, None
        if replace is not None:  # the replacements travel with the misses; a row both are is asked once
            ask, back = torch.unique(torch.cat([misses, torch.from_numpy(np.asarray(replace, dtype=np.int64))]),
                                     return_inverse=True)  # fmt: skip
        t0 = time.perf_counter()
        try:
            fetched = self.exchange.fetch(ask, cancel) if ask.numel() else None
            if back is not None:
                fetched = fetched[back]  # the misses' rows, then the replacements'
            if replace is not None:
                self.buffer.install(np.asarray(replace, dtype=np.int64), fetched[misses.numel():], evicted)
        except BaseException:
            if replace is not None:  # the evicted rows stay, with the scores they had
                with self._policy_lock:
                    self.policy.revert()
            raise
        finally:
            if replace is not None:
                self._installing = False
        waited = time.perf_counter() - t0
        rows = torch.empty((n, self.exchange.num_features), dtype=self.exchange.dtype)
        if rows_hit is not None and rows_hit.shape[0]:
            rows[hit] = rows_hit
        if misses.numel():
            rows[~hit] = fetched[: misses.numel()]
        h.rows = rows
        s = lease.stats
        s.remote_hits = n - int(misses.numel())
        s.remote_fetched = int(misses.numel())
        s.remote_replaced = 0 if replace is None else int(len(replace))
        s.remote_bytes = int(ask.numel()) * self.row_bytes
        s.remote_wait_s = waited

    def rows(self, lease: Lease, device: torch.device) -> torch.Tensor:
        return lease.handle.rows.to(device, non_blocking=True)

    def pin(self, lease: Lease) -> None:
        if lease.handle.rows is not None:
            lease.handle.rows = lease.handle.rows.pin_memory()

    def release(self, lease: Lease, fence: Fence | None = None) -> None:
        lease.released = True  # the rows are the lease's own copy: nothing to wait for
        lease.handle.rows = None


class LocalRows(FeatureTier):
    """A tier of this machine's partition, asked with global ids (turned into the partition's row numbers).

    Leases are the wrapped tier's own (``lease.tier`` is it), so filling, gathering and releasing go
    straight to it; only :meth:`claim` passes through here. ``without`` on a store sees the wrapped
    tier's ``name`` and this wrapper's ``source`` (the wrapped tier's source, wrapped likewise).
    """

    def __init__(self, tier: FeatureTier, local: Any):
        self.tier = tier
        self.name = tier.name
        self._local = local  # global ids (numpy) -> local rows, -1 for ids not owned here
        self.source = LocalRows(tier.source, local) if tier.source is not None else None

    def claim(self, ids: torch.Tensor, cancel: CancelToken = NEVER) -> Lease:
        local = torch.from_numpy(np.asarray(self._local(ids.numpy()), dtype=np.int64))
        if local.numel() and int(local.min()) < 0:
            bad = int(ids[local < 0][0])
            raise RuntimeError(f"node {bad} reached the local tiers but is not owned by this machine")
        return self.tier.claim(local, cancel)

    def rows(self, lease: Lease, device: torch.device) -> torch.Tensor:  # leases are the wrapped tier's
        return self.tier.rows(lease, device)

    def close(self) -> None:
        self.tier.close()
