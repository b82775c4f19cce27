"""The partition loading order of partition-buffer embedding training (Legend's prefetch-friendly order).

Node embeddings (with their optimizer state) are split into ``n`` ID-range
partitions and the edges into ``n x n`` buckets: bucket ``(i, j)`` holds the
edges whose source lies in partition ``i`` and destination in partition ``j``.
A buffer on the training device holds ``c`` partitions; the set resident at a
time is a *buffer state*, and the next state differs by one *swap* (one
partition written back and evicted, another loaded). Bucket ``(i, j)`` can be
trained in any state that holds both ``i`` and ``j``; an epoch trains each
bucket exactly once.

A :class:`PartitionOrder` is the states of one epoch and, for each, the
buckets it trains. A bucket is trained in the *first* state that holds both
its partitions. Inside a state, the buckets that involve the partition to be
evicted next are trained first (``before``); then the swap starts in the
background while the rest (``during``) are trained, so those hide the swap's
I/O. A state whose ``during`` is empty cannot hide its swap. The last state
has no swap and puts all its buckets in ``before``.

Prefetching needs the partition just loaded never to be the one evicted next
(Legend, Theorem 1, property (1)). For ``c == 3`` Theorem 1 shows that this
together with property (2), two partitions are resident together only in
consecutive states, lets every swap be hidden. The orders:

- ``legend`` (``c == 3``): Legend's Algorithm 1 ("column separation covering";
  the Legend paper, section 4) with Algorithm 2's before/during split.
  Property (1) always holds; property (2) is not enforced (as in the paper),
  so a few column changes cannot hide their swap: the paper reports 4 of 36
  for 12 partitions, and this implementation has 4 there too.
- ``beta``: Marius's Buffer-aware Edge Traversal Algorithm (Mohoney et al.,
  OSDI'21, section 4), close to the fewest swaps but it evicts the partition
  it has just loaded, so almost no swap can be hidden.
- ``greedy`` (any ``c >= 2``): each swap covers the most new pairs without
  evicting the partition just loaded.

:func:`partition_order` picks one; :func:`prefetch_stats` summarizes one.

Counting: ``num_swaps`` excludes the initial fill of the buffer. The Legend
paper's "I/O times" (its Table 6) counts buffer states, i.e. ``num_swaps + 1``
(the initial fill counts as one): its 8 for ``n = 6`` is the 8 states (7
swaps) of its Figure 6, which :func:`legend_order` reproduces; Marius's BETA
gives 8, 15, 24, 35, 48, 63 states for n = 6, 8, ..., 16, the paper's
numbers except 34 for n = 12.

Example::

    >>> from lightning_ooc.embed.order import legend_order, prefetch_stats
    >>> order = legend_order(6)
    >>> [s.partitions for s in order.states]
    [(0, 1, 2), (0, 2, 3), (0, 3, 4), (0, 4, 5), (1, 4, 5), (1, 3, 5), (2, 3, 5), (2, 4, 5)]
    >>> order.num_swaps, len(order.buckets())
    (7, 36)
    >>> first = order.states[0]
    >>> first.evict, first.load
    (1, 3)
    >>> first.before
    ((0, 1), (1, 0), (1, 1), (1, 2), (2, 1))
    >>> first.during
    ((0, 0), (0, 2), (2, 0), (2, 2))
    >>> st = prefetch_stats(order)
    >>> st["unhidden_swaps"], st["property1"], st["hidden_buckets"]
    (0, True, 19)
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Iterable, Sequence

Bucket = tuple[int, int]

KINDS = ("auto", "legend", "beta", "greedy", "single")


@dataclass(frozen=True)
class BufferState:
    """One buffer state: the partitions resident, the swap after it, and the buckets it trains."""

    partitions: tuple[int, ...]  # sorted, len == min(capacity, num_partitions)
    evict: int | None  # swapped out after this state (None for the last state)
    load: int | None  # swapped in after this state (None for the last state)
    before: tuple[Bucket, ...]  # trained before the swap starts (all involve ``evict``; all buckets of the last state)
    during: tuple[Bucket, ...]  # trained while the swap runs (none involves ``evict`` or ``load``)

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets of this state in training order."""
        return self.before + self.during


@dataclass(frozen=True)
class PartitionOrder:
    """The buffer states of one epoch, in order, each with the buckets it trains."""

    num_partitions: int
    capacity: int
    states: tuple[BufferState, ...]
    name: str  # "legend", "beta", "greedy", "single"

    @property
    def num_swaps(self) -> int:
        """Swaps (evict one partition, load another) after the initial fill: ``len(states) - 1``."""
        return len(self.states) - 1

    def swaps(self) -> list[tuple[int, int]]:
        """``(evict, load)`` of every swap, in order."""
        return [(s.evict, s.load) for s in self.states[:-1]]

    def buckets(self) -> list[Bucket]:
        """Every bucket in training order (``before`` then ``during``, state by state)."""
        return [b for s in self.states for b in s.buckets]

    def hidden_buckets(self) -> int:
        """Buckets trained while a swap is in flight (``during`` of every state followed by a swap)."""
        return sum(len(s.during) for s in self.states[:-1])

    def validate(self) -> None:
        """Raise :class:`ValueError` unless this is a well-formed order covering every bucket exactly once."""
        n, c = self.num_partitions, self.capacity
        if n < 1 or c < 1:
            raise ValueError(f"an order needs num_partitions >= 1 and capacity >= 1, got {n} and {c}")
        if not self.states:
            raise ValueError("an order needs at least one buffer state")
        size = min(c, n)
        seen: set[Bucket] = set()
        last = len(self.states) - 1
        for k, s in enumerate(self.states):
            p = s.partitions
            if len(p) != size:
                raise ValueError(f"state {k} holds {len(p)} partitions, expected {size}: {p}")
            if list(p) != sorted(set(p)):
                raise ValueError(f"state {k}'s partitions are not sorted and distinct: {p}")
            if p[0] < 0 or p[-1] >= n:
                raise ValueError(f"state {k} holds a partition outside [0, {n}): {p}")
            resident = set(p)
            for b in s.buckets:
                if len(b) != 2 or b[0] not in resident or b[1] not in resident:
                    raise ValueError(f"state {k} {p} trains bucket {b} whose partitions are not both resident")
                if b in seen:
                    raise ValueError(f"bucket {b} is trained twice (again in state {k})")
                seen.add(b)
            if k == last:
                if s.evict is not None or s.load is not None:
                    raise ValueError(f"the last state {k} has a swap ({s.evict} -> {s.load})")
                if s.during:
                    raise ValueError(f"the last state {k} has buckets in 'during' but no swap to hide")
            else:
                nxt = set(self.states[k + 1].partitions)
                if s.evict is None or s.load is None:
                    raise ValueError(f"state {k} is not the last but has no swap")
                if s.evict not in resident or s.load in resident:
                    raise ValueError(f"state {k} {p} cannot evict {s.evict} and load {s.load}")
                if nxt != (resident - {s.evict}) | {s.load}:
                    raise ValueError(f"state {k + 1} {tuple(sorted(nxt))} is not state {k} {p} "
                                     f"with {s.evict} swapped for {s.load} (one partition per swap)")
                if any(s.evict not in b for b in s.before):
                    raise ValueError(f"state {k} trains a bucket not involving {s.evict} before evicting it")
                if any(s.evict in b or s.load in b for b in s.during):
                    raise ValueError(f"state {k} trains a bucket involving the swapped partitions during the swap")
        if len(seen) != n * n:
            missing = sorted({(i, j) for i in range(n) for j in range(n)} - seen)
            raise ValueError(f"{len(missing)} of {n * n} buckets are never trained, e.g. {missing[:5]}")


def _check_n_c(n, c) -> tuple[int, int]:
    try:
        n, c = operator.index(n), operator.index(c)
    except TypeError:
        raise ValueError(f"num_partitions and capacity must be integers, got {n!r} and {c!r}") from None
    if n < 1:
        raise ValueError(f"num_partitions must be >= 1, got {n}")
    if c < 2:
        raise ValueError(f"the buffer capacity must be >= 2 partitions, got {c}")
    return n, c


def _assemble(n: int, c: int, seq: Sequence[Iterable[int]], name: str) -> PartitionOrder:
    """Turn a sequence of partition sets into an order: each bucket goes to the first state holding both ends."""
    sets = [frozenset(s) for s in seq]
    done = [[False] * n for _ in range(n)]
    states = []
    for k, cur in enumerate(sets):
        part = tuple(sorted(cur))
        new = []
        for i in part:
            row = done[i]
            for j in part:
                if not row[j]:
                    row[j] = True
                    new.append((i, j))
        if k + 1 < len(sets):
            nxt = sets[k + 1]
            out, inn = cur - nxt, nxt - cur
            if len(out) != 1 or len(inn) != 1:
                raise AssertionError(f"states {k} and {k + 1} differ by more than one swap: {part} -> {sorted(nxt)}")
            evict, load = next(iter(out)), next(iter(inn))
            before = tuple(b for b in new if evict in b)
            during = tuple(b for b in new if evict not in b)
        else:
            evict = load = None
            before, during = tuple(new), ()
        states.append(BufferState(part, evict, load, before, during))
    order = PartitionOrder(n, c, tuple(states), name)
    order.validate()
    return order


def _single(n: int, c: int, name: str) -> PartitionOrder:
    return _assemble(n, c, [range(min(n, c))], name)


def legend_order(n: int) -> PartitionOrder:
    """Legend's prefetch-friendly order for a buffer of 3 partitions (Algorithms 1 and 2 of the paper).

    First the partitions are swept through with partition 0 resident
    (``{0,1,2}``, then ``i - 2`` swapped out for ``i``), covering column 0.
    Then column by column: when every pair of the current column ``col`` has
    been resident, ``col`` is swapped out for the next column that still has
    an uncovered pair (a column change), and one of the other two residents is
    evicted next: the larger if the new column still has an uncovered pair
    with a partition above it, else the smaller. Inside a column the resident that
    was not just loaded is evicted. Each load is the partition that covers the
    most uncovered buckets with the two partitions that stay, scanning the ids
    cyclically from the staying non-column partition + 1 (first maximum wins).

    The OCR'd pseudocode leaves some details open; this reading reproduces the
    paper's worked example for ``n = 6`` exactly (8 states, 7 swaps) and its
    4 unhideable swaps for ``n = 12``. Two cases the pseudocode does not
    handle: if the next column is already resident, the column change and the
    following load are one swap; columns whose pairs are all covered are
    skipped. ``n <= 3`` gives a single state.
    """
    n, _ = _check_n_c(n, 3)
    if n <= 3:
        return _single(n, 3, "legend")
    cov = [[False] * n for _ in range(n)]
    left = [n] * n  # uncovered buckets in each row; the matrix is covered symmetrically, so rows == columns
    total = [n * n]
    seq: list[frozenset[int]] = []

    def enter(buf: set[int]) -> None:
        seq.append(frozenset(buf))
        for a in buf:
            for b in buf:
                if not cov[a][b]:
                    cov[a][b] = True
                    left[a] -= 1
                    total[0] -= 1

    buf = {0, 1, 2}
    enter(buf)
    for i in range(3, n):
        buf = (buf - {i - 2}) | {i}
        enter(buf)
    col = 0
    while total[0]:
        if left[col] == 0:  # the column is covered: change columns
            nxt = col + 1
            while left[nxt] == 0:  # some column after ``col`` is uncovered while buckets are left
                nxt += 1
            if nxt in buf:
                evict, col = col, nxt
            else:
                buf = (buf - {col}) | {nxt}
                enter(buf)
                if not total[0]:
                    break
                others = sorted(buf - {nxt})
                top = others[-1]
                evict = top if any(not cov[nxt][y] for y in range(top + 1, n)) else others[0]
                col = nxt
        else:  # the resident of the last two states that is not the column (never the one just loaded)
            (evict,) = (seq[-1] & seq[-2]) - {col}
        (stay,) = buf - {evict, col}
        best, gain = -1, -1
        for k in range(1, n + 1):
            x = (stay + k) % n
            if x in buf:
                continue
            g = (not cov[x][col]) + (not cov[col][x]) + (not cov[x][stay]) + (not cov[stay][x])
            if g > gain:
                best, gain = x, g
        buf = (buf - {evict}) | {best}
        enter(buf)
    return _assemble(n, 3, seq, "legend")


def beta_order(n: int, c: int) -> PartitionOrder:
    """Marius's BETA order (Buffer-aware Edge Traversal Algorithm), without its random shuffles.

    The buffer starts with partitions ``0 .. c-1`` and the others wait on disk
    in id order. A pass keeps the first ``c - 1`` buffer slots fixed and
    swaps every waiting partition through the last slot, one by one (the
    partition leaving the last slot takes the arriving one's place in the
    waiting list). Then the fixed partitions, which have now met every
    partition, are retired: the first ``c - 1`` waiting partitions replace
    them one swap at a time, and the next pass starts; it ends when no
    partition waits. Marius draws the slot and waiting orders at random; the
    number of states does not depend on them. Buckets go to states by the
    module's first-resident rule. The partition swapped into the last slot
    is evicted by the very next swap, so BETA breaks property (1) and almost
    none of its swaps can be hidden.
    """
    n, c = _check_n_c(n, c)
    if n <= c:
        return _single(n, c, "beta")
    buf = list(range(c))
    disk = list(range(c, n))
    seq = [frozenset(buf)]
    while disk:
        for i, admit in enumerate(disk):
            disk[i], buf[-1] = buf[-1], admit
            seq.append(frozenset(buf))
        replaced = min(c - 1, len(disk))
        for i in range(replaced):
            buf[i] = disk[i]
            seq.append(frozenset(buf))
        disk = disk[replaced:]
    return _assemble(n, c, seq, "beta")


def greedy_order(n: int, c: int) -> PartitionOrder:
    """A greedy order for any capacity: each swap covers the most new pairs and keeps property (1).

    Starting from ``0 .. c-1``, each swap ``(evict e, load x)`` with ``e``
    not the partition just loaded and ``x`` not resident is chosen by, in
    turn: the most new pairs (``x`` with the ``c - 1`` partitions that stay);
    a swap the current state can hide (some bucket first trained in this state
    does not involve ``e``); the evicted partition with the fewest uncovered
    pairs left; where no swap brings a new pair, the loaded partition with the
    most uncovered pairs left (so the next swap brings one); then the lowest
    ids (``x``, then ``e``). It always terminates: a load without new pairs is
    followed by one with some.
    """
    n, c = _check_n_c(n, c)
    if n <= c:
        return _single(n, c, "greedy")
    cov = [[False] * n for _ in range(n)]  # pairs (symmetric; the diagonal is covered on first load)
    left = [n - 1] * n  # uncovered pairs per partition
    remaining = [n * (n - 1) // 2]
    seq: list[frozenset[int]] = []
    fresh: list[Bucket] = []  # buckets first resident in the current state

    def enter(buf: set[int]) -> None:
        seq.append(frozenset(buf))
        fresh.clear()
        for a in buf:
            if not cov[a][a]:
                cov[a][a] = True
                fresh.append((a, a))
            for b in buf:
                if a < b and not cov[a][b]:
                    cov[a][b] = cov[b][a] = True
                    left[a] -= 1
                    left[b] -= 1
                    remaining[0] -= 1
                    fresh.append((a, b))

    buf = set(range(c))
    enter(buf)
    just_loaded = None
    while remaining[0]:
        best, best_key = None, None
        outside = [x for x in range(n) if x not in buf]
        for e in sorted(buf):
            if e == just_loaded:
                continue
            stay = [y for y in buf if y != e]
            hides = any(e not in b for b in fresh)
            for x in outside:
                gain = sum(1 for y in stay if not cov[x][y])
                key = (gain, hides, -left[e], left[x] if gain == 0 else 0, -x, -e)
                if best_key is None or key > best_key:
                    best, best_key = (e, x), key
        e, x = best
        buf = (buf - {e}) | {x}
        enter(buf)
        just_loaded = x
    return _assemble(n, c, seq, "greedy")


def partition_order(n: int, c: int = 3, kind: str = "auto") -> PartitionOrder:
    """The order for ``n`` partitions and a buffer of ``c``.

    ``kind``: ``"legend"`` (``c == 3`` only), ``"beta"``, ``"greedy"``,
    ``"single"`` (``n <= c``: one state holding everything), or ``"auto"``:
    ``single`` when everything fits, else ``legend`` for ``c == 3`` and
    ``greedy`` otherwise.
    """
    n, c = _check_n_c(n, c)
    if kind not in KINDS:
        raise ValueError(f"unknown partition order kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind == "auto":
        kind = "single" if n <= c else ("legend" if c == 3 else "greedy")
    if kind == "single":
        if n > c:
            raise ValueError(f"a single buffer state cannot hold {n} partitions with capacity {c}")
        return _single(n, c, "single")
    if kind == "legend":
        if c != 3:
            raise ValueError(f"the legend order is defined for a buffer of 3 partitions, got {c}; use 'greedy'")
        return legend_order(n)
    if kind == "beta":
        return beta_order(n, c)
    return greedy_order(n, c)


def swap_lower_bound(n: int, c: int) -> int:
    """No order needs fewer swaps: the initial state covers C(c,2) pairs and each swap at most ``c - 1`` more."""
    n, c = _check_n_c(n, c)
    if n <= c:
        return 0
    return math.ceil((math.comb(n, 2) - math.comb(c, 2)) / (c - 1))


def prefetch_stats(order: PartitionOrder) -> dict:
    """How well ``order``'s swaps can be hidden behind training.

    Keys: ``name``, ``num_partitions``, ``capacity``, ``states``, ``swaps``,
    ``lower_bound`` (:func:`swap_lower_bound`), ``buckets`` (all, ``n * n``),
    ``hidden_buckets`` (trained while a swap runs), ``hidden_fraction``,
    ``unhidden_swaps`` (swaps whose state has an empty ``during``: training
    waits for them), ``property1_violations`` (swaps evicting the partition
    the previous swap loaded) and ``property1`` (no violation).
    """
    states = order.states
    violations = sum(1 for a, b in zip(states, states[1:-1]) if b.evict == a.load)
    total = sum(len(s.before) + len(s.during) for s in states)
    hidden = order.hidden_buckets()
    return {
        "name": order.name,
        "num_partitions": order.num_partitions,
        "capacity": order.capacity,
        "states": len(states),
        "swaps": order.num_swaps,
        "lower_bound": swap_lower_bound(order.num_partitions, order.capacity),
        "buckets": total,
        "hidden_buckets": hidden,
        "hidden_fraction": hidden / total if total else 0.0,
        "unhidden_swaps": sum(1 for s in states[:-1] if not s.during),
        "property1_violations": violations,
        "property1": violations == 0,
    }
