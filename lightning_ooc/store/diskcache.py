"""The segmented disk cache of an epoch pack (DiskGNN, section 5.1): shared rows stored once, in MinHash order.

Packing copies each batch's cold rows into a section of its own, so a row that ``r`` batches need is
stored ``r`` times. When that would take more than ``pack_space``, the batches are cut into *segments* of
``S`` consecutive batches, and a row that at least ``t`` batches of a segment need goes to the segment's
*disk cache* instead: stored once, shared by the segment's batches. The other rows stay in the batches'
own sections (no read amplification). A batch then reads its section in one read, and its cached rows
as whole sectors of the cache (the reader merges rows of one sector, and neighbouring sectors, into one
read). To make those sectors few, the cache's rows are laid out by HashOrder: a row's *signature* is the
smallest of ``HASHES`` random permutations of the segment's batches that need it (MinHash); rows with
equal signatures (likely needed by the same batches) are put side by side.

:func:`plan_disk_cache` picks ``S`` and ``t``: the largest ``t`` (fewest shared rows, most rows read
without amplification), then the smallest ``S`` (caches that suit their batches best) whose bytes fit.
Counting the bytes of a configuration needs no layout, so the search is cheap.

>>> import numpy as np
>>> cold = {k: [np.array(ids)] for k, ids in enumerate([[1, 2, 3, 9], [2, 3, 4], [2, 5, 9], [6, 7]])}
>>> full = sum(round_up(len(v[0]) * 4096) for v in cold.values())  # 4096-byte rows: a row per sector
>>> plan = plan_disk_cache(cold, [4096], room=full - 4096)
>>> plan.segment, plan.threshold, [c[0].tolist() for c in plan.caches]
(4, 2, [[2, 3, 9]])
>>> plan.layouts[0][0].tolist()  # the cached rows in their on-disk order
[2, 3, 9]
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lightning_ooc.io.bulk import PAGE, round_up

#: the fewest batches that need a row, within a segment, for the row to be cached, tried in this order
THRESHOLDS = (8, 4, 2)
#: MinHash functions of a row's signature
HASHES = 4
#: random odd multipliers of :func:`row_sums`, one per 8-byte word of a row (up to 64 KiB rows; longer rows
#: reuse them cyclically)
_MIX = np.random.default_rng(0x10C5EED).integers(1, 2**63, size=8192, dtype=np.uint64) | np.uint64(1)


def region_align(row_bytes: int) -> int:
    """Where a cache region may start in ``chunks.bin``: a sector that is also a row boundary (so the region's
    rows are rows of the file seen as an array of ``row_bytes`` rows)."""
    return int(np.lcm(int(row_bytes), PAGE))


def window_rows(row_bytes: int, memory: int) -> int:
    """Rows of a cache reordered together in ``memory`` bytes (a whole number of sectors' worth of rows)."""
    per = PAGE // int(np.gcd(int(row_bytes), PAGE))  # rows whose bytes fill whole sectors
    return max(per, int(memory) // int(row_bytes) // per * per)


@dataclass
class CachePlan:
    """A disk-cache configuration: segments of ``segment`` batches (``segments[g]``: positions ``[lo, hi)`` in
    the sorted batch keys), rows needed by at least ``threshold`` of a segment's batches cached;
    ``caches[g][i]`` the cached ids of node type ``i`` (sorted), ``layouts[g][i]`` the same in their on-disk
    order; ``bytes`` what the pack's chunks take (an upper bound: each section padded to a whole sector)."""

    segment: int
    threshold: int
    segments: list[tuple[int, int]]
    caches: list[list[np.ndarray]] = field(default_factory=list)
    layouts: list[list[np.ndarray]] = field(default_factory=list)
    bytes: int = 0

    @property
    def cached_rows(self) -> int:
        return sum(len(c) for per in self.caches for c in per)


def locate(ids: np.ndarray, cache: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which of ``ids`` are in ``cache`` (sorted, unique), and where: a bool mask and, for the ids found, their
    index in ``cache`` (other entries are meaningless).

    >>> hit, at = locate(np.array([1, 4, 9]), np.array([2, 4, 9]))
    >>> hit.tolist(), at[hit].tolist()
    ([False, True, True], [1, 2])
    """
    if len(cache) == 0:
        return np.zeros(len(ids), dtype=bool), np.zeros(len(ids), dtype=np.int64)
    at = np.minimum(np.searchsorted(cache, ids), len(cache) - 1)
    return cache[at] == ids, at


def members(ids: np.ndarray, cache: np.ndarray) -> np.ndarray:
    """Which of ``ids`` are in ``cache`` (sorted, unique): a bool mask.

    >>> members(np.array([1, 4, 9]), np.array([2, 4, 9])).tolist()
    [False, True, True]
    """
    return locate(ids, cache)[0]


def _segments(n: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def _counts(lists: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    a = np.concatenate(lists) if lists else np.empty(0, dtype=np.int64)
    return np.unique(a, return_counts=True)


def plan_disk_cache(cold: dict[int, list[np.ndarray]], row_bytes: list[int], room: int,
                    thresholds: tuple[int, ...] = THRESHOLDS, windows: list[int] | None = None,
                    seed: int = 0) -> CachePlan | None:  # fmt: skip
    """The disk cache that lets the batches ``cold`` (key -> sorted cold ids per node type) fit in ``room``
    bytes. Where none does (not even one cache for the whole epoch of every row two batches share), the one
    cache of the whole epoch if, with it, more batches' own sections fit than whole sections do without it
    (the rest are left out of the pack), else ``None``.

    ``windows``: rows of each node type reordered together (:func:`window_rows`); ``None`` reorders each
    cache as a whole.
    """
    keys = sorted(cold)
    n = len(keys)
    if n == 0:
        return None
    sizes, s = [], 8
    while s < n:
        sizes.append(s)
        s *= 2
    sizes.append(n)
    aligns = [region_align(rb) for rb in row_bytes]
    pads = [PAGE - int(np.gcd(int(rb), PAGE)) for rb in row_bytes]  # the most a section's last sector pads
    # fits[(t, S)]: the bytes of each configuration that fits; each S's counts made once for every t
    best: tuple[int, int] | None = None
    fits: dict[tuple[int, int], int] = {}
    for size in sizes:
        est = {t: 0 for t in thresholds}
        for lo, hi in _segments(n, size):
            for i, rb in enumerate(row_bytes):
                u, c = _counts([cold[k][i] for k in keys[lo:hi]])
                for t in thresholds:
                    shared = c >= t
                    n_shared = int(shared.sum())
                    est[t] += (round_up(n_shared * rb) + (aligns[i] - PAGE if n_shared else 0)
                               + int(c[~shared].sum()) * rb + (hi - lo) * pads[i])  # fmt: skip
        for t in thresholds:
            if est[t] <= room:
                fits[(t, size)] = est[t]
    for t in thresholds:  # the largest threshold, then the smallest segments
        for size in sizes:
            if (t, size) in fits:
                best = (t, size)
                break
        if best is not None:
            break
    if best is None:  # no cache lets every batch in: one that lets more in than none does, if any
        best = _partial(cold, keys, row_bytes, room, min(thresholds), aligns, pads)
        if best is None:
            return None
        fits[best] = room
    t, size = best
    plan = CachePlan(size, t, _segments(n, size), bytes=fits[best])
    for g, (lo, hi) in enumerate(plan.segments):
        caches, layouts = [], []
        for i, rb in enumerate(row_bytes):
            lists = [np.asarray(cold[k][i]) for k in keys[lo:hi]]
            u, c = _counts(lists)
            cache = u[c >= t].astype(np.int64)
            caches.append(cache)
            layouts.append(minhash_order(cache, lists, seed=hash((seed, g, i)) & 0xFFFFFFFF,
                                         window=None if windows is None else windows[i]))  # fmt: skip
        plan.caches.append(caches)
        plan.layouts.append(layouts)
    return plan


def _partial(cold: dict[int, list[np.ndarray]], keys: list[int], row_bytes: list[int], room: int, t: int,
             aligns: list[int], pads: list[int]) -> tuple[int, int] | None:  # fmt: skip
    """``(t, len(keys))`` where one cache of the whole epoch's shared rows, then as many batches' own sections as
    fit, packs more batches than the batches' whole sections alone do; else ``None``."""
    whole = np.array([sum(round_up(len(cold[k][i]) * rb) for i, rb in enumerate(row_bytes)) for k in keys])
    without = int(np.searchsorted(np.cumsum(whole), room, side="right"))
    cache_bytes, own = 0, np.zeros(len(keys), dtype=np.int64)
    for i, rb in enumerate(row_bytes):
        u, c = _counts([cold[k][i] for k in keys])
        shared = u[c >= t]
        if len(shared):
            cache_bytes += round_up(len(shared) * rb) + aligns[i] - PAGE
        own += np.array([round_up(int((~members(cold[k][i], shared)).sum()) * rb) for k in keys], dtype=np.int64)
    if cache_bytes >= room:
        return None
    with_cache = int(np.searchsorted(np.cumsum(own), room - cache_bytes, side="right"))
    return (t, len(keys)) if with_cache > without else None


def minhash_order(cache: np.ndarray, lists: list[np.ndarray], seed: int = 0, hashes: int = HASHES,
                  window: int | None = None) -> np.ndarray:  # fmt: skip
    """The ids ``cache`` (sorted) in HashOrder: by the MinHash signature of the set of ``lists`` (a segment's
    batches) that hold each id, ties by id; with ``window``, only within consecutive blocks of that many ids
    (each block of the cache is then reordered in memory on its own).

    >>> minhash_order(np.array([1, 2, 3, 4]), [np.array([1, 3]), np.array([2, 4]), np.array([1, 3])]).tolist()
    [2, 4, 1, 3]
    """
    cache = np.asarray(cache, dtype=np.int64)
    m = len(cache)
    if m == 0:
        return cache
    node = np.concatenate([np.asarray(a, dtype=np.int64) for a in lists])
    bat = np.repeat(np.arange(len(lists), dtype=np.int64), [len(a) for a in lists])
    pos = np.searchsorted(cache, node)
    hit = pos < m
    hit[hit] = cache[pos[hit]] == node[hit]
    pos, bat = pos[hit], bat[hit]
    if np.bincount(pos, minlength=m).min() == 0:
        raise ValueError("every cached id must be in at least one of the lists")
    rng = np.random.default_rng(seed)
    keys = []
    for _ in range(hashes):
        perm = rng.permutation(len(lists)).astype(np.int32)
        mh = np.full(m, len(lists), dtype=np.int32)
        np.minimum.at(mh, pos, perm[bat])
        keys.append(mh)
    order_keys = [cache, *reversed(keys)]  # lexsort: the last key is the primary one
    if window is not None and m > window:
        order_keys.append(np.arange(m) // int(window))
    return cache[np.lexsort(order_keys)]


def row_sums(rows: np.ndarray) -> np.ndarray:
    """A checksum of each row of ``rows`` (``n x row_bytes`` uint8): its 8-, 4- or 2-byte words times fixed
    random odd constants, summed modulo 2**64 (vectorised; it catches a stale or torn sector, not an adversary).

    >>> r = np.arange(32, dtype=np.uint8).reshape(2, 16)
    >>> s = row_sums(r); t = r.copy(); t[1, 3] ^= 1
    >>> bool(s[0] == row_sums(t)[0]), bool(s[1] == row_sums(t)[1])
    (True, False)
    """
    rows = np.ascontiguousarray(rows)
    for dt in (np.int64, np.int32, np.int16, np.uint8):
        if rows.shape[1] % np.dtype(dt).itemsize == 0:
            w = rows.view(dt)
            break
    cols = w.shape[1]
    mix = np.resize(_MIX, cols) if cols > len(_MIX) else _MIX[:cols]
    w = w.view(np.uint64) if w.dtype == np.int64 else w.astype(np.uint64)  # 8-byte words: no copy
    return (w * mix).sum(axis=1, dtype=np.uint64)
