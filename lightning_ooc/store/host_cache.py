"""The host cache: the hottest feature rows, held in (pinned) host memory for the whole run.

Which rows are hot is decided once at setup, either by access frequency over
a number of presampled minibatches (DiskGNN's offline sampling; the default)
or by in-degree (``host_cache_policy="scored"``: only the warm start, the rows
are then replaced by MassiveGNN's scores, :mod:`lightning_ooc.store.scored_cache`).
The rows are read once, with direct I/O, into host memory
that is pinned with ``cudaHostRegister`` when a GPU is used so that GPU threads
gather from it zero-copy (:mod:`lightning_ooc.store.uva`); on CPU it is an
ordinary tensor indexed by the trainer.

Example::

    >>> import torch
    >>> from lightning_ooc.store.host_cache import HostCache
    >>> cache = HostCache(torch.tensor([4, 1]), torch.tensor([[4., 4.], [1., 1.]]), num_nodes=6)
    >>> cache.lookup(torch.tensor([1, 2, 4])).tolist()
    [1, -1, 0]
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from lightning_ooc.store import uva
from lightning_ooc.store.pinning import host_register, host_unregister
from lightning_ooc.utils.progress import progress_bar

log = logging.getLogger("lightning_ooc")


@dataclass
class HotSet:
    """Nodes chosen for the host cache, hottest first, and how they were chosen."""

    ids: torch.Tensor
    policy: str
    #: fraction of the presampled node accesses that these rows would serve (None for "degree")
    expected_hit_rate: float | None
    #: per-node access counts over the presample (None for "degree")
    counts: torch.Tensor | None = None
    #: ``host_cache_policy="scored"``: these rows are only the warm start, kept afterwards by MassiveGNN's
    #: scores with this (decay gamma, interval Delta) (:mod:`lightning_ooc.store.scored_cache`); None: fixed
    scored: tuple[float, int] | None = None


def access_counts(batches: Iterable[torch.Tensor], num_nodes: int) -> torch.Tensor:
    """How often each node appears in the ``n_id`` of the given minibatches."""
    counts = torch.zeros(num_nodes, dtype=torch.int64)
    for n_id in batches:
        n_id = n_id.to(torch.int64)
        counts.index_add_(0, n_id, torch.ones_like(n_id))  # no temporary of num_nodes entries per batch
    return counts


def choose_hot(
    capacity: int,
    num_nodes: int,
    *,
    policy: str = "presample",
    in_degree: np.ndarray | None = None,
    presample: Callable[[], Iterable[torch.Tensor]] | None = None,
    counts: torch.Tensor | None = None,
) -> HotSet:
    """Pick up to ``capacity`` nodes: most accessed in the presampled batches, or highest in-degree.

    Ties in access count are broken by in-degree when it is given. ``counts``: the access
    counts, already counted (then ``presample`` is not run). ``policy="scored"`` ranks like
    ``"presample"`` (the scored cache's warm start; the hot set says "presample").
    """
    capacity = max(0, min(int(capacity), num_nodes))
    deg = torch.from_numpy(np.asarray(in_degree, dtype=np.int64)) if in_degree is not None else None
    if policy == "degree":
        if deg is None:
            raise ValueError("policy='degree' needs in_degree")
        ids = torch.topk(deg, capacity, sorted=True).indices if capacity else deg[:0]
        return HotSet(ids, "degree", None)
    if policy not in ("presample", "scored"):
        raise ValueError(f"unknown host cache policy {policy!r}; use 'presample', 'degree' or 'scored'")
    if counts is None:
        if presample is None:
            raise ValueError("policy='presample' needs a presample function or the access counts")
        counts = access_counts(presample(), num_nodes)
    total = int(counts.sum())
    score = counts.to(torch.float64)
    if deg is not None:
        score += deg.to(torch.float64) / (float(deg.max()) + 1.0)  # < 1: only breaks ties
    ids = torch.topk(score, capacity, sorted=True).indices if capacity else counts[:0]
    hit = float(counts[ids].sum()) / total if total else 0.0
    return HotSet(ids, "presample", hit, counts)


class HostCache:
    """Rows of ``ids`` held in host memory, with a node -> position map."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor, num_nodes: int, register: bool = False):
        self.ids = ids.to(torch.int64)
        self.rows = rows
        #: the reads that filled it from SSD and the rows they read (:meth:`load`; 0 for rows handed over)
        self.fill_ios = self.fill_rows = 0
        self.map = torch.full((num_nodes,), -1, dtype=torch.int32)  # one entry per node of the graph
        self.map[self.ids] = torch.arange(self.ids.numel(), dtype=torch.int32)
        self.zero_copy = register and rows.numel() > 0 and not rows.is_cuda and host_register(
            rows.data_ptr(), self.nbytes, "host cache")  # fmt: skip

    @classmethod
    def load(cls, reader, ids: torch.Tensor, num_nodes: int, *, register: bool = False, progress: bool = True,
             chunk_rows: int = 1 << 16) -> "HostCache":  # fmt: skip
        """Read the rows of ``ids`` with ``reader`` (sorted, in chunks) into host memory."""
        ids = torch.sort(ids.to(torch.int64)).values
        rows = torch.empty((ids.numel(), reader.num_features), dtype=reader.dtype)
        ios = 0
        with progress_bar(ids.numel() * reader.row_bytes, "fill host cache", "B", progress) as bar:
            for s in range(0, ids.numel(), chunk_rows):
                part = ids[s : s + chunk_rows]
                handle = reader.gather_async(part, out=rows[s : s + part.numel()])
                handle.wait()
                ios += int(handle.stats.num_ios)
                bar.update(part.numel() * reader.row_bytes)
        cache = cls(ids, rows, num_nodes, register=register)
        cache.fill_ios, cache.fill_rows = ios, int(ids.numel())
        return cache

    @classmethod
    def empty(cls, capacity: int, num_features: int, dtype: torch.dtype, num_nodes: int, *,
              register: bool = False) -> "HostCache":  # fmt: skip
        """Room for ``capacity`` rows and none of them yet: :meth:`set_ids` says which rows will come,
        :meth:`publish` serves each part once its rows are in place (a fill in the background,
        :mod:`lightning_ooc.store.background`)."""
        rows = torch.empty((int(capacity), int(num_features)), dtype=dtype)
        return cls(torch.empty(0, dtype=torch.int64), rows, num_nodes, register=register)

    @property
    def capacity(self) -> int:
        """The rows it has room for."""
        return int(self.rows.shape[0])

    def set_ids(self, ids: torch.Tensor) -> None:
        """The rows it will hold, in position order (none is served before :meth:`publish`)."""
        if ids.numel() > self.capacity:
            raise ValueError(f"{ids.numel()} rows for a host cache with room for {self.capacity}")
        self.ids = ids.to(torch.int64)

    def publish(self, start: int, ids: torch.Tensor) -> None:
        """Serve rows ``ids`` from positions ``start...``: their bytes must be in place (a lookup that sees a
        position reads the row at once)."""
        self.map[ids] = torch.arange(start, start + ids.numel(), dtype=torch.int32)

    @property
    def num_rows(self) -> int:
        return int(self.ids.numel())

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def lookup(self, n_id: torch.Tensor) -> torch.Tensor:
        """Position of each node in the cache, ``-1`` where it is not cached."""
        return self.map[n_id].long()

    def gather(self, pos: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows at positions ``pos`` on ``device`` (zero-copy from a GPU where possible)."""
        return uva.gather_rows(self.rows, pos, torch.device(device), self.zero_copy)

    def gather_into(self, out: torch.Tensor, out_rows: torch.Tensor, pos: torch.Tensor) -> None:
        """``out[out_rows] = rows at positions pos`` (GPU threads read the pinned rows straight into ``out``)."""
        uva.gather_rows_into(out, out_rows, self.rows, pos, self.zero_copy)

    def close(self) -> None:
        if self.zero_copy:
            host_unregister(self.rows.data_ptr())
            self.zero_copy = False
