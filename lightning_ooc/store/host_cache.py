"""The host cache: the hottest feature rows, held in (pinned) host memory for the whole run.

Which rows are hot is decided once, either by access frequency over
a number of presampled minibatches (DiskGNN's offline sampling; the default)
or by in-degree (``host_cache_policy="scored"``: only the warm start, the rows
are then replaced by MassiveGNN's scores, :mod:`lightning_ooc.store.scored_cache`).
The rows are read once at set-up, with direct I/O (:meth:`HostCache.load`), or, for a cache ranked while
training runs, kept from the reads the feature buffer makes (:meth:`HostCache.expect`, :meth:`HostCache.admit`),
into host memory
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
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from lightning_ooc.data.degree import InDegree
from lightning_ooc.store import uva
from lightning_ooc.store.pinning import host_register, host_unregister
from lightning_ooc.utils.progress import progress_bar

log = logging.getLogger("lightning_ooc")

#: a host cache's map entry at or below this marks a row it expects and has not yet read (:meth:`HostCache.expect`)
ENTRY_PENDING = -2


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


#: nodes per pass of the ranking (:func:`top_k`): its temporaries are a few arrays of this many entries,
#: and a few of the host cache's size, never one of the graph's
RANK_CHUNK = 1 << 17


def access_counts(batches: Iterable[torch.Tensor], num_nodes: int) -> torch.Tensor:
    """How often each node appears in the ``n_id`` of the given minibatches: int16 (a node appears at most once
    per batch, so up to 32,767 batches fit; past that the counts widen to int32).

    >>> c = access_counts([torch.tensor([3, 1]), torch.tensor([1])], 4)
    >>> c.tolist(), c.dtype
    ([0, 2, 0, 1], torch.int16)
    """
    counts = torch.zeros(num_nodes, dtype=torch.int16)
    for i, n_id in enumerate(batches):
        if i == torch.iinfo(torch.int16).max and counts.dtype == torch.int16:
            counts = counts.to(torch.int32)
        n_id = n_id.to(torch.int64)
        counts.index_add_(0, n_id, torch.ones(n_id.numel(), dtype=counts.dtype))  # no per-batch array of N
    return counts


def _chunked_max(values: Callable[[int, int], np.ndarray], n: int, chunk: int) -> int:
    return max((int(values(lo, min(n, lo + chunk)).max(initial=0)) for lo in range(0, n, chunk)), default=0)


def top_k(key: Callable[[int, int], np.ndarray], n: int, k: int, *, chunk: int = RANK_CHUNK,
          ordered: bool = True) -> np.ndarray:  # fmt: skip
    """Ids of the ``k`` largest of the ``n`` int64 keys ``key(lo, hi)`` (the keys of ids ``lo..hi-1``), largest
    first, the lower id first among equal keys (``ordered=False``: the same ids in ascending order).

    Two passes over the ids, ``chunk`` at a time: the first finds the k-th largest key (a running
    ``np.partition`` of at most ``k + chunk`` keys), the second collects the ids above it and the first ones
    equal to it. Its temporaries are a few arrays of ``k`` and of ``chunk`` entries, never one of ``n``.

    >>> keys = np.array([5, 1, 7, 5, 0, 7])
    >>> top_k(lambda lo, hi: keys[lo:hi], 6, 4, chunk=2).tolist()
    [2, 5, 0, 3]
    >>> top_k(lambda lo, hi: keys[lo:hi], 6, 4, chunk=2, ordered=False).tolist()
    [0, 2, 3, 5]
    """
    k = max(0, min(int(k), int(n)))
    if k == 0:
        return np.empty(0, dtype=np.int64)
    top = np.empty(0, dtype=np.int64)
    for lo in range(0, n, chunk):
        c = np.asarray(key(lo, min(n, lo + chunk)), dtype=np.int64)
        if top.size == k:
            c = c[c > top[0]]  # an equal key does not move the k-th largest
        both = np.concatenate([top, c]) if top.size else c
        top = np.partition(both, both.size - k)[both.size - k :] if both.size > k else np.sort(both)
    threshold = int(top[0])
    equal_left = k - int(np.count_nonzero(top > threshold))
    del top, both, c
    ids, keys = [], []
    for lo in range(0, n, chunk):
        c = np.asarray(key(lo, min(n, lo + chunk)), dtype=np.int64)
        take = c > threshold
        if equal_left:
            eq = np.flatnonzero(c == threshold)[:equal_left]
            take[eq] = True
            equal_left -= eq.size
        at = np.flatnonzero(take)
        ids.append(at + lo)
        if ordered:
            keys.append(c[at])
    ids_a = np.concatenate(ids)
    if not ordered:
        return ids_a
    del ids
    keys_a = np.concatenate(keys)
    del keys
    order = np.argsort(-keys_a, kind="stable")  # collected in id order: stable keeps the lower id first
    return ids_a[order]


def choose_hot(
    capacity: int,
    num_nodes: int,
    *,
    policy: str = "presample",
    in_degree: np.ndarray | InDegree | None = None,
    presample: Callable[[], Iterable[torch.Tensor]] | None = None,
    counts: torch.Tensor | None = None,
    chunk: int = RANK_CHUNK,
    ordered: bool = True,
) -> HotSet:
    """Pick up to ``capacity`` nodes: most accessed in the presampled batches, or highest in-degree.

    Ties in access count are broken by in-degree when it is given (an array, or an :class:`InDegree` that
    computes it a slice at a time), then by the lower id. ``counts``: the access counts, already counted
    (then ``presample`` is not run); ``ordered=False`` gives the same ids in ascending order (fewer
    temporaries: a fill that reads them sorted). ``policy="scored"`` ranks like ``"presample"`` (the scored
    cache's warm start; the hot set says "presample"). Beside the counts (2 B per node) the ranking needs a
    few arrays of the host cache's size and of ``chunk`` entries (:func:`top_k`).

    >>> deg = np.array([0, 5, 1, 1, 9, 0])
    >>> batches = [torch.tensor([1, 2]), torch.tensor([2, 3]), torch.tensor([3, 4])]
    >>> hot = choose_hot(3, 6, in_degree=deg, presample=lambda: batches)
    >>> hot.ids.tolist(), hot.counts.tolist(), round(hot.expected_hit_rate, 3)
    ([2, 3, 4], [0, 1, 2, 2, 1, 0], 0.833)
    >>> choose_hot(2, 6, policy="degree", in_degree=deg).ids.tolist()
    [4, 1]
    """
    capacity = max(0, min(int(capacity), num_nodes))
    if policy == "degree":
        if in_degree is None:
            raise ValueError("policy='degree' needs in_degree")
        ids = top_k(lambda lo, hi: in_degree[lo:hi], num_nodes, capacity, chunk=chunk, ordered=ordered)
        return HotSet(torch.from_numpy(ids), "degree", None)
    if policy not in ("presample", "scored"):
        raise ValueError(f"unknown host cache policy {policy!r}; use 'presample', 'degree' or 'scored'")
    if counts is None:
        if presample is None:
            raise ValueError("policy='presample' needs a presample function or the access counts")
        counts = access_counts(presample(), num_nodes)
    c = counts.numpy()
    key: Callable[[int, int], np.ndarray]
    if in_degree is None:
        def key(lo: int, hi: int) -> np.ndarray:
            return c[lo:hi].astype(np.int64)
    else:  # count first, in-degree breaks ties: count * (max degree + 1) + degree, shifted to fit 63 bits
        deg = in_degree
        dmax = _chunked_max(lambda lo, hi: deg[lo:hi], num_nodes, chunk)
        cmax = _chunked_max(lambda lo, hi: c[lo:hi], num_nodes, chunk)
        shift = max(0, (dmax + 1).bit_length() + (cmax + 1).bit_length() - 62)
        scale = (dmax >> shift) + 1

        def key(lo: int, hi: int) -> np.ndarray:
            return c[lo:hi].astype(np.int64) * scale + (np.asarray(deg[lo:hi], dtype=np.int64) >> shift)
    ids = torch.from_numpy(top_k(key, num_nodes, capacity, chunk=chunk, ordered=ordered))
    total = int(counts.sum())
    hit = float(counts[ids].sum()) / total if total else 0.0
    return HotSet(ids, "presample", hit, counts)


class HostCache:
    """Rows of ``ids`` held in host memory, with a node -> position map."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor, num_nodes: int, register: bool = False):
        self.ids = ids.to(torch.int64)
        self.rows = rows
        #: the reads that filled it from SSD and the rows they read (:meth:`load`; 0 for rows handed over)
        self.fill_ios = self.fill_rows = 0
        #: rows kept from reads the feature buffer made anyway (:meth:`admit`): no read of their own
        self.admitted_rows = 0
        self._pending = 0  # rows expected and not yet kept
        self._admitting = threading.Lock()
        # one entry per node of the graph: its position, -1 where it is not cached, ENTRY_PENDING - p where it
        # will be kept at position p once a read brings it (:meth:`expect`)
        self.map = torch.full((num_nodes,), -1, dtype=torch.int32)
        self.map[self.ids] = torch.arange(self.ids.numel(), dtype=torch.int32)
        self.zero_copy = register and rows.numel() > 0 and not rows.is_cuda and host_register(
            rows.data_ptr(), self.nbytes, "host cache")  # fmt: skip

    @classmethod
    def load(cls, reader, ids: torch.Tensor, num_nodes: int, *, register: bool = False, progress: bool = True,
             chunk_rows: int = 1 << 16) -> "HostCache":  # fmt: skip
        """Read the rows of ``ids`` with ``reader`` (sorted, in chunks) into host memory."""
        ids = torch.sort(ids.to(torch.int64)).values
        rows = torch.empty((ids.numel(), reader.num_features), dtype=reader.dtype)
        cache = cls(ids, rows, num_nodes, register=register)
        with progress_bar(ids.numel() * reader.row_bytes, "fill host cache", "B", progress) as bar:
            for s in range(0, ids.numel(), chunk_rows):
                part = ids[s : s + chunk_rows]
                cache.read_rows(reader, s, part)
                bar.update(part.numel() * reader.row_bytes)
        return cache

    def read_rows(self, reader, start: int, ids: torch.Tensor) -> None:
        """Read the rows of ``ids`` (sorted) with ``reader`` into positions ``start...``; counted in
        :attr:`fill_ios` and :attr:`fill_rows`."""
        handle = reader.gather_async(ids, out=self.rows[start : start + ids.numel()])
        handle.wait()
        self.fill_ios += int(handle.stats.num_ios)
        self.fill_rows += int(ids.numel())

    @classmethod
    def empty(cls, capacity: int, num_features: int, dtype: torch.dtype, num_nodes: int, *,
              register: bool = False) -> "HostCache":  # fmt: skip
        """Room for ``capacity`` rows and none of them yet: :meth:`expect` says which rows will come,
        :meth:`admit` keeps each as a read brings it (ranked in the background,
        :mod:`lightning_ooc.store.background`)."""
        rows = torch.empty((int(capacity), int(num_features)), dtype=dtype)
        return cls(torch.empty(0, dtype=torch.int64), rows, num_nodes, register=register)

    @property
    def capacity(self) -> int:
        """The rows it has room for."""
        return int(self.rows.shape[0])

    def expect(self, ids: torch.Tensor) -> None:
        """The rows it will hold (unique), in position order: none is served yet; each is kept once a read of
        the feature buffer's brings it (:meth:`admit`), so filling the cache costs no read of its own."""
        if ids.numel() > self.capacity:
            raise ValueError(f"{ids.numel()} rows for a host cache with room for {self.capacity}")
        with self._admitting:
            self.ids = ids.to(torch.int64)
            self.map[self.ids] = ENTRY_PENDING - torch.arange(self.ids.numel(), dtype=torch.int32)
            self._pending = int(self.ids.numel())

    def admit(self, ids: torch.Tensor, rows: torch.Tensor) -> int:
        """Keep those of the rows just read from SSD (``rows[i]`` is row ``ids[i]``, host memory) that it expects
        (:meth:`expect`) and does not hold yet; each is served from the moment its bytes are in place.
        Returns how many it kept. Any thread may call it (the extractors, as their reads complete).

        >>> cache = HostCache.empty(2, 1, torch.float32, num_nodes=6)
        >>> cache.expect(torch.tensor([1, 4]))
        >>> cache.lookup(torch.tensor([1, 4])).tolist()  # expected, not yet read
        [-1, -1]
        >>> cache.admit(torch.tensor([0, 4]), torch.tensor([[0.], [4.]]))
        1
        >>> cache.lookup(torch.tensor([1, 4])).tolist(), cache.gather(torch.tensor([1])).tolist()
        ([-1, 1], [[4.0]])
        """
        if not self._pending:  # nothing expected (not ranked yet, or every row kept): no lock, no lookup
            return 0
        with self._admitting:
            code = self.map[ids]
            take = torch.nonzero(code <= ENTRY_PENDING).flatten()
            if take.numel() == 0:
                return 0
            pos = (ENTRY_PENDING - code[take]).to(torch.int64)
            self.rows.index_copy_(0, pos, rows.index_select(0, take).to(self.rows.dtype))
            self.map[ids[take]] = pos.to(torch.int32)  # served from here on: its bytes are in place
            self.admitted_rows += int(take.numel())
            self._pending -= int(take.numel())
            return int(take.numel())

    @property
    def num_rows(self) -> int:
        return int(self.ids.numel())

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def lookup(self, n_id: torch.Tensor) -> torch.Tensor:
        """Position of each node in the cache, ``-1`` where it is not cached (or expected and not yet read)."""
        return self.map[n_id].long().clamp_(min=-1)

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
