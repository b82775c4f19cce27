"""Which rows a buffer of node features keeps: MassiveGNN's scored prefetch and eviction, and the rows themselves.

A buffer holds the feature rows of some of its ``candidates`` (the remote,
"halo" nodes of a partition, or every node of a dataset for the host cache).
A :class:`CachePolicy` decides which:

* ``"none"`` (:class:`NoPolicy`) keeps nothing;
* ``"static"`` (:class:`StaticPolicy`) keeps the ``capacity`` highest-degree
  candidates (ties: lower id), loaded once, never replaced;
* ``"scored"`` (:class:`ScoredPolicy`) warm-starts the same way and then follows
  Algorithm 2 of MassiveGNN (Sarkar et al., *MassiveGNN: efficient training via
  prefetching for massively connected distributed graphs*, 2024) with its two
  scoreboards. The eviction score S_E starts at 1 for buffered nodes and is
  multiplied by ``gamma`` on every minibatch that does not use the node; the
  access score S_A is -1 for buffered nodes, 0 for the others, and grows by one
  on every minibatch that asks for the node while it is not buffered (a miss).
  Every ``interval`` (Delta) minibatches an eviction round evicts the buffered
  nodes whose S_E dropped below ``alpha = gamma ** Delta`` (Eq. 1 with the
  initial S_E of 1: a warm-started node unused on more than Delta minibatches)
  and replaces them, one for one, by the non-buffered candidates with the highest
  S_A (ties: higher degree, then lower id). Only candidates missed since they
  last left the buffer may replace (S_A >= 1: an evicted node's S_A is its last
  S_E, below alpha <= 1, and brought back with it as S_E it would leave at the
  next round); with fewer such candidates than nodes below the threshold, only
  as many nodes are evicted (lowest S_E first) and the buffer stays full. After
  the swap the evicted nodes' S_A is their last S_E and the replacements' S_E
  their last S_A (the paper's swap); the replacements' S_A becomes -1.

Section 3.5 of the paper discusses the four quadrants of (gamma, Delta): low
decay (gamma near 1) over a long interval evicts gradually and keeps the hit
rate growing at little cost; short intervals add rounds (and their overhead),
high decay evicts aggressively and makes the hit rate swing.

The policy only decides: :meth:`CachePolicy.evict_and_replace` returns which ids
to evict and which to fetch in their place; the caller fetches the replacement
rows (with the same exchange as that minibatch's misses) and installs them in a
:class:`RowBuffer`, row ``i`` of the replacements in the slot of evicted id ``i``.

Cost: arrays over the candidates' positions (S_A float32, the buffered index
int32, the degree int32: 12 bytes per candidate), the pool of candidates that
may replace (int64 positions of those missed since they last left the buffer:
up to 8 bytes per candidate; the misses of the latest minibatches are folded
into it as they come, so it stays within twice that whatever Delta is) and
arrays over the buffer (S_E and the step it was last brought up to date: 16
bytes per buffered node). S_E is compared with ``alpha`` in logarithms, so a
strong decay over a long interval (``0.5 ** 1100`` is 0 in floating point)
still evicts. The decay
of the unused buffered nodes is lazy: each keeps the step it was last used at
and its S_E then, and S_E is brought up to date (times ``gamma`` per unused
step) when the node is used again or at an eviction round -- the same value as
multiplying every unused node on every minibatch, for O(minibatch) work per
minibatch. Candidates: sorted ids (positions by ``np.searchsorted``) or an int
``n``, meaning every id in ``[0, n)`` (positions are the ids; no array held).

Example::

    >>> import numpy as np
    >>> from lightning_ooc.store.policy import make_policy
    >>> p = make_policy("scored", np.arange(10, 20), np.arange(10), capacity=2, gamma=0.5, interval=2)
    >>> p.initial().tolist()  # the highest degrees
    [19, 18]
    >>> for _ in range(3):
    ...     p.observe(np.array([18, 12]), np.array([True, False]))  # 19 unused, 12 missed
    >>> p.due()
    True
    >>> [a.tolist() for a in p.evict_and_replace()]
    [[19], [12]]
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

POLICIES = ("scored", "static", "none")

#: relative margin under ``alpha``: a node unused on exactly Delta minibatches (S_E == alpha) stays
_ALPHA_MARGIN = 1e-9
#: missed positions held before they are folded into the pool of replacement candidates
_POOL_FOLD_MIN = 1 << 20


def _as_ids(ids: Any) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    return np.asarray(ids, dtype=np.int64).reshape(-1)


class CachePolicy:
    """Which candidate rows a buffer keeps (the base class keeps nothing: ``"none"``).

    Args:
        candidates: the ids the buffer may ever hold (int64; sorted here if they are not), or an
            int ``n``: every id in ``[0, n)``.
        degree: one value per candidate (in the order given): ranks the warm start and breaks ties
            between replacements.
        capacity: rows the buffer holds.
        gamma: decay of the eviction score per minibatch a buffered node is not used (0 < gamma <= 1).
        interval: minibatches between two eviction rounds (Delta).
        warm: the ids to warm-start with instead of the ``capacity`` highest-degree candidates
            (the host cache starts from the presample's ranking); at most ``capacity`` are kept.
    """

    name = "none"

    def __init__(self, candidates: np.ndarray | int, degree: np.ndarray, capacity: int, *, gamma: float = 0.995,
                 interval: int = 32, warm: np.ndarray | None = None):  # fmt: skip
        if not 0.0 < float(gamma) <= 1.0:
            raise ValueError(f"gamma must lie in (0, 1], got {gamma!r}")
        if int(interval) < 1:
            raise ValueError(f"interval must be >= 1, got {interval!r}")
        self.gamma, self.interval = float(gamma), int(interval)
        degree = np.asarray(degree).reshape(-1)
        if isinstance(candidates, (int, np.integer)):
            self._cand: np.ndarray | None = None
            self.num_candidates = int(candidates)
        else:
            cand = np.asarray(candidates, dtype=np.int64).reshape(-1)
            if cand.size > 1 and not bool((cand[1:] > cand[:-1]).all()):
                order = np.argsort(cand, kind="stable")
                cand = cand[order]
                if degree.size == order.size:
                    degree = degree[order]
                if cand.size > 1 and not bool((cand[1:] > cand[:-1]).all()):
                    raise ValueError("candidates must be distinct ids")
            self._cand = cand
            self.num_candidates = int(cand.size)
        if degree.size != self.num_candidates:
            raise ValueError(f"degree has {degree.size} entries for {self.num_candidates} candidates")
        # int32 (4 B per candidate) where the degrees fit, as they do for any graph of < 2**31 edges per node
        big = degree.size and (degree.max() > np.iinfo(np.int32).max or degree.min() < np.iinfo(np.int32).min)
        self._degree = degree.astype(np.int64 if big else np.int32, copy=False)
        self.capacity = max(0, min(int(capacity), self.num_candidates)) if self.name != "none" else 0
        self._lock = threading.RLock()
        self._batches = self._requests = self._hits = 0
        self._rounds = self._evicted = self._replaced = 0
        self._warm = self._choose_warm(warm)
        # candidate position -> index in the buffer (-1: not buffered)
        self._member = np.full(self.num_candidates if self.capacity else 0, -1, dtype=np.int32)
        if self._warm.size:
            self._member[self._warm] = np.arange(self._warm.size, dtype=np.int32)

    # -- ids and positions ----------------------------------------------------------------
    def positions(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """Candidate position of each id and whether it is a candidate at all (positions of others: 0)."""
        ids = _as_ids(ids)
        if self._cand is None:
            ok = (ids >= 0) & (ids < self.num_candidates)
            return np.where(ok, ids, 0), ok
        pos = np.searchsorted(self._cand, ids)
        pos = np.minimum(pos, max(self.num_candidates - 1, 0))
        ok = self._cand[pos] == ids if self.num_candidates else np.zeros(ids.size, dtype=bool)
        return np.where(ok, pos, 0), ok

    def ids_at(self, pos: np.ndarray) -> np.ndarray:
        """The ids at candidate positions ``pos``."""
        pos = np.asarray(pos, dtype=np.int64)
        return pos.copy() if self._cand is None else self._cand[pos]

    def _choose_warm(self, warm: np.ndarray | None) -> np.ndarray:
        if self.capacity == 0:
            return np.empty(0, dtype=np.int64)
        if warm is not None:
            pos, ok = self.positions(warm)
            if not bool(ok.all()):
                raise ValueError("the warm start holds ids that are not candidates")
            pos = pos[np.sort(np.unique(pos, return_index=True)[1])]  # distinct, first occurrence kept
            return pos[: self.capacity].astype(np.int64)
        n, k = self.num_candidates, self.capacity
        deg = self._degree.astype(np.int64)
        if k < n:  # the k-th highest degree, then every candidate at or above it ranked exactly
            kth = np.partition(deg, n - k)[n - k]
            top = np.flatnonzero(deg >= kth)
        else:
            top = np.arange(n)
        order = np.lexsort((self.ids_at(top), -deg[top]))  # higher degree first, then lower id
        return top[order[:k]].astype(np.int64)

    # -- the protocol ---------------------------------------------------------------------
    def initial(self) -> np.ndarray:
        """Ids to load at the warm start (the buffer's index ``i`` holds ``initial()[i]``)."""
        return self.ids_at(self._warm)

    def buffered(self) -> np.ndarray:
        """Ids the policy currently counts as buffered (sorted)."""
        with self._lock:
            if not self._member.size:
                return np.empty(0, dtype=np.int64)
            return self.ids_at(np.flatnonzero(self._member >= 0))

    def observe(self, ids: Any, hit: Any = None) -> None:
        """One minibatch: the distinct candidate ids it asked for, and which the buffer served (``hit``).

        Scores follow the policy's own idea of what is buffered (a replacement not yet installed
        counts as buffered); ``hit`` only feeds the hit rate of :meth:`stats` (default: the
        policy's membership). Ids that are not candidates are ignored.
        """
        ids = _as_ids(ids)
        pos, ok = self.positions(ids)
        with self._lock:
            pos = pos[ok]
            idx = self._member[pos] if self._member.size else np.full(pos.size, -1, dtype=np.int32)
            self._batches += 1
            self._requests += int(pos.size)
            self._hits += int((idx >= 0).sum()) if hit is None else int(_as_bool(hit)[ok].sum())
            self._update(pos, idx)

    def _update(self, pos: np.ndarray, idx: np.ndarray) -> None:
        """Score bookkeeping of one observed minibatch (under the lock)."""

    def due(self) -> bool:
        """Whether an eviction round is due (never for ``"none"`` and ``"static"``)."""
        return False

    def evict_and_replace(self, keep: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """One eviction round: ``(evicted ids, replacement ids)`` of equal length, replacement ``i`` taking the
        place of evicted ``i``; resets the round counter. ``keep``: ids that may not be evicted this round
        (rows still being read: they stay until a later round)."""
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)

    def revert(self, which: np.ndarray | None = None) -> None:
        """Undo pairs ``which`` (indices into the last round's result; all when ``None``): the caller could not
        fetch their replacements, so the evicted nodes stay with the scores they had."""

    def stats(self) -> dict[str, float]:
        """Counters so far: eviction rounds, rows evicted and replaced, rows buffered, minibatches observed,
        rows asked for and served (``hit_rate``)."""
        with self._lock:
            buffered = int((self._member >= 0).sum()) if self._member.size else 0
            return {"rounds": self._rounds, "evicted": self._evicted, "replaced": self._replaced,
                    "buffered": buffered, "batches": self._batches, "requests": self._requests, "hits": self._hits,
                    "hit_rate": self._hits / self._requests if self._requests else 0.0}  # fmt: skip


def _as_bool(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=bool).reshape(-1)


class NoPolicy(CachePolicy):
    """``"none"``: no buffer; every row is fetched when a minibatch needs it."""

    name = "none"


class StaticPolicy(CachePolicy):
    """``"static"``: the ``capacity`` highest-degree candidates (ties: lower id), loaded once, never replaced."""

    name = "static"


class ScoredPolicy(CachePolicy):
    """``"scored"``: MassiveGNN's access and eviction scoreboards, an eviction round every ``interval``
    minibatches (see the module docstring)."""

    name = "scored"

    def __init__(self, candidates: np.ndarray | int, degree: np.ndarray, capacity: int, *, gamma: float = 0.995,
                 interval: int = 32, warm: np.ndarray | None = None):  # fmt: skip
        super().__init__(candidates, degree, capacity, gamma=gamma, interval=interval, warm=warm)
        cap = self.capacity
        self.alpha = self.gamma**self.interval  # Eq. (1) with the initial S_E of 1 (reported; may underflow to 0)
        # thresholds compare logarithms: gamma ** Delta underflows to 0 for a long interval and a strong decay
        # (0.5 ** 1100), and a threshold of 0 would never evict
        self._log_gamma = float(np.log(self.gamma))
        self._log_alpha = self.interval * self._log_gamma + float(np.log1p(-_ALPHA_MARGIN))
        self._sa = np.zeros(self.num_candidates if cap else 0, dtype=np.float32)  # access score S_A
        self._bpos = np.full(cap, -1, dtype=np.int64)  # buffer index -> candidate position
        self._base = np.ones(cap, dtype=np.float64)  # S_E as of step _mark
        self._mark = np.zeros(cap, dtype=np.int64)  # the step S_E was last brought up to date
        self._step = 0  # minibatches observed
        self._since = 0  # minibatches since the last round
        self._pending: list[np.ndarray] = []  # positions missed since the pool was last brought up to date
        self._pending_size = 0
        self._pool = np.empty(0, dtype=np.int64)  # positions that may replace (S_A >= 1 when last folded in)
        self._last: dict[str, np.ndarray] | None = None  # the last round, to revert pairs of it
        if self._warm.size:
            self._bpos[: self._warm.size] = self._warm
            self._sa[self._warm] = -1.0

    def _update(self, pos: np.ndarray, idx: np.ndarray) -> None:
        self._step += 1
        self._since += 1
        t = self._step
        if not self.capacity:
            return
        used = idx[idx >= 0].astype(np.int64)
        if used.size:  # bring S_E up to date: the steps since the last one were all unused
            self._base[used] *= self.gamma ** (t - 1 - self._mark[used]).astype(np.float64)
            self._mark[used] = t
        miss = pos[idx < 0]
        if miss.size:
            self._sa[miss] += 1.0  # a minibatch's ids are distinct: one count per minibatch
            self._pending.append(miss.astype(np.int64))
            self._pending_size += miss.size
            if self._pending_size > max(_POOL_FOLD_MIN, self._pool.size):  # bounded however long the interval
                self._refresh_pool()

    def due(self) -> bool:
        with self._lock:
            return self.capacity > 0 and self._since >= self.interval

    def eviction_scores(self, ids: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, S_E)`` as of the last observed minibatch: of the buffered nodes (sorted by id), or of ``ids``
        (``nan`` where one is not buffered)."""
        with self._lock:
            if ids is not None:
                ids = _as_ids(ids)
                pos, ok = self.positions(ids)
                idx = np.where(ok, self._member[pos] if self._member.size else -1, -1).astype(np.int64)
                se = np.full(ids.size, np.nan)
                b = idx >= 0
                se[b] = self._base[idx[b]] * self.gamma ** (self._step - self._mark[idx[b]]).astype(np.float64)
                return ids, se
            occ = np.flatnonzero(self._bpos >= 0)
            se = self._base[occ] * self.gamma ** (self._step - self._mark[occ]).astype(np.float64)
            ids = self.ids_at(self._bpos[occ])
            order = np.argsort(ids)
            return ids[order], se[order]

    def _log_se(self, idx: np.ndarray, t: int) -> np.ndarray:
        """log S_E of buffer indices ``idx`` at step ``t`` (-inf where S_E underflowed to 0)."""
        with np.errstate(divide="ignore"):
            return np.log(self._base[idx]) + (t - self._mark[idx]).astype(np.float64) * self._log_gamma

    def expired(self, ids: Any) -> np.ndarray:
        """Whether each of ``ids`` is buffered with S_E below ``alpha``: what the next round may evict."""
        ids = _as_ids(ids)
        with self._lock:
            pos, ok = self.positions(ids)
            idx = np.where(ok, self._member[pos] if self._member.size else -1, -1).astype(np.int64)
            out = np.zeros(ids.size, dtype=bool)
            b = idx >= 0
            out[b] = self._log_se(idx[b], self._step) < self._log_alpha
            return out

    def access_scores(self, ids: Any) -> np.ndarray:
        """S_A of ``ids`` (all candidates)."""
        pos, ok = self.positions(ids)
        if not bool(ok.all()):
            raise ValueError("access_scores: ids that are not candidates")
        with self._lock:
            return self._sa[pos].copy()

    def _refresh_pool(self) -> np.ndarray:
        """Positions of the candidates that may replace: missed since they last left the buffer (S_A >= 1)."""
        if self._pending:
            self._pool = np.unique(np.concatenate([self._pool, *self._pending]))
            self._pending, self._pending_size = [], 0
        self._pool = self._pool[self._sa[self._pool] >= 1.0]
        return self._pool

    def _top(self, pool: np.ndarray, k: int) -> np.ndarray:
        """The ``k`` positions of ``pool`` with the highest S_A (ties: higher degree, then lower id), best first."""
        sa = self._sa[pool]
        if pool.size > k:
            kth = np.partition(sa, pool.size - k)[pool.size - k]
            sel = sa >= kth
            pool, sa = pool[sel], sa[sel]
        order = np.lexsort((self.ids_at(pool), -self._degree[pool].astype(np.int64), -sa.astype(np.float64)))
        return pool[order[:k]]

    def evict_and_replace(self, keep: Any = None) -> tuple[np.ndarray, np.ndarray]:
        empty = np.empty(0, dtype=np.int64)
        with self._lock:
            # a round that came late (another was still installing) lets the next one come as much earlier
            self._since = max(0, self._since - self.interval)
            if not self.capacity:
                return empty, empty
            self._rounds += 1
            self._last = None
            t = self._step
            occ = np.flatnonzero(self._bpos >= 0)
            log_se = self._log_se(occ, t)
            below = log_se < self._log_alpha
            if keep is not None:
                kpos, kok = self.positions(keep)
                kidx = self._member[kpos[kok]]
                kept = np.zeros(self.capacity, dtype=bool)
                kept[kidx[kidx >= 0]] = True
                below &= ~kept[occ]
            ev_idx, ev_log = occ[below], log_se[below]
            if not ev_idx.size:
                return empty, empty
            repl = self._top(self._refresh_pool(), ev_idx.size)
            if repl.size < ev_idx.size:  # keep the buffer full: evict only the lowest S_E (ties: lower degree)
                order = np.lexsort((self._degree[self._bpos[ev_idx]].astype(np.int64), ev_log))[: repl.size]
                ev_idx, ev_log = ev_idx[order], ev_log[order]
            ev_se = np.exp(ev_log)
            if not repl.size:
                return empty, empty
            ev_pos = self._bpos[ev_idx]
            self._last = {"idx": ev_idx, "ev_pos": ev_pos, "base": self._base[ev_idx].copy(),
                          "mark": self._mark[ev_idx].copy(), "repl": repl,
                          "repl_sa": self._sa[repl].copy()}  # fmt: skip
            # the paper's swap: the evicted keep their last S_E as S_A, the replacements their last S_A as S_E
            self._sa[ev_pos] = ev_se.astype(np.float32)
            self._member[ev_pos] = -1
            self._base[ev_idx] = self._sa[repl].astype(np.float64)
            self._mark[ev_idx] = t
            self._bpos[ev_idx] = repl
            self._member[repl] = ev_idx.astype(np.int32)
            self._sa[repl] = -1.0
            self._evicted += int(ev_idx.size)
            self._replaced += int(repl.size)
            return self.ids_at(ev_pos), self.ids_at(repl)

    def revert(self, which: np.ndarray | None = None) -> None:
        with self._lock:
            last = self._last
            if last is None:
                return
            sel = np.arange(last["idx"].size) if which is None else np.asarray(which, dtype=np.int64).reshape(-1)
            if not sel.size:
                return
            idx, ev_pos, repl = last["idx"][sel], last["ev_pos"][sel], last["repl"][sel]
            self._member[repl] = -1
            self._sa[repl] = last["repl_sa"][sel]
            self._pending.append(repl)  # candidates again
            self._pending_size += repl.size
            self._bpos[idx] = ev_pos
            self._member[ev_pos] = idx.astype(np.int32)
            self._base[idx] = last["base"][sel]
            self._mark[idx] = last["mark"][sel]
            self._sa[ev_pos] = -1.0
            self._evicted -= int(sel.size)
            self._replaced -= int(sel.size)
            keep = np.ones(last["idx"].size, dtype=bool)
            keep[sel] = False
            self._last = {k: v[keep] for k, v in last.items()}


_CLASSES = {"none": NoPolicy, "static": StaticPolicy, "scored": ScoredPolicy}


def make_policy(name: str, candidates: np.ndarray | int, degree: np.ndarray, capacity: int, gamma: float = 0.995,
                interval: int = 32, *, warm: np.ndarray | None = None) -> CachePolicy:  # fmt: skip
    """The policy called ``name`` (``"scored"``, ``"static"`` or ``"none"``)."""
    if name not in _CLASSES:
        raise ValueError(f"unknown cache policy {name!r}; use one of {', '.join(POLICIES)}")
    return _CLASSES[name](candidates, degree, capacity, gamma=gamma, interval=interval, warm=warm)


class RowBuffer:
    """The rows of a buffer's ids: ``capacity`` slots of ``num_features`` values, and an id -> slot map.

    Thread-safe under one lock (:attr:`lock`, re-entrant): extractor threads look rows up and copy
    them out while another thread installs replacements. :meth:`lookup_rows` does both at once;
    :meth:`lookup` then :meth:`copy_rows` are consistent only inside ``with buffer.lock:`` (an install
    in between may give the slot to another id).

    The map is a table over the candidates' positions when ``candidates`` are given (sorted ids, or an
    int ``n`` for the ids ``[0, n)``; int32, 4 bytes per candidate), else a sorted array of the
    buffered ids, rebuilt at each install (no memory beyond the buffer).
    """

    def __init__(self, capacity: int, num_features: int, dtype: torch.dtype, *,
                 candidates: np.ndarray | int | None = None, device: torch.device | str = "cpu"):  # fmt: skip
        self.capacity = int(capacity)
        self.rows = torch.zeros((self.capacity, int(num_features)), dtype=dtype, device=device)
        self.ids = torch.full((self.capacity,), -1, dtype=torch.int64)  # slot -> id (-1: free)
        self.lock = threading.RLock()
        self._n: int | None = None
        self._cand: torch.Tensor | None = None
        self._table: torch.Tensor | None = None
        if isinstance(candidates, (int, np.integer)):
            self._n = int(candidates)
            self._table = torch.full((self._n,), -1, dtype=torch.int32)
        elif candidates is not None:
            self._cand = torch.from_numpy(np.sort(np.asarray(candidates, dtype=np.int64)))
            self._table = torch.full((self._cand.numel(),), -1, dtype=torch.int32)
        self._sorted_ids = torch.empty(0, dtype=torch.int64)
        self._sorted_slots = torch.empty(0, dtype=torch.int64)

    def __len__(self) -> int:
        with self.lock:
            return int((self.ids >= 0).sum())

    def _pos(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cand is None:
            assert self._n is not None
            ok = (ids >= 0) & (ids < self._n)
            return torch.where(ok, ids, 0), ok
        n = self._cand.numel()
        if n == 0:
            return torch.zeros_like(ids), torch.zeros(ids.shape, dtype=torch.bool)
        pos = torch.searchsorted(self._cand, ids).clamp_(max=n - 1)
        return pos, self._cand[pos] == ids

    def _slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id, -1 where it is not buffered (under the lock)."""
        if self._table is not None:
            pos, ok = self._pos(ids)
            return torch.where(ok, self._table[pos].long(), -1)
        n = self._sorted_ids.numel()
        if n == 0:
            return torch.full(ids.shape, -1, dtype=torch.int64)
        at = torch.searchsorted(self._sorted_ids, ids).clamp_(max=n - 1)
        return torch.where(self._sorted_ids[at] == ids, self._sorted_slots[at], -1)

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hit mask over ids, slot of each hit)``."""
        ids = torch.as_tensor(ids, dtype=torch.int64)
        with self.lock:
            slots = self._slots(ids)
        hit = slots >= 0
        return hit, slots[hit]

    def copy_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the rows in ``slots`` (taken under the lock)."""
        with self.lock:
            return self.rows.index_select(0, torch.as_tensor(slots, dtype=torch.int64).to(self.rows.device))

    def lookup_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hit mask over ids, a copy of the hits' rows)``, looked up and copied atomically."""
        ids = torch.as_tensor(ids, dtype=torch.int64)
        with self.lock:
            slots = self._slots(ids)
            hit = slots >= 0
            return hit, self.rows.index_select(0, slots[hit].to(self.rows.device))

    def install(self, ids: np.ndarray, rows: torch.Tensor, evicted: np.ndarray | None = None) -> torch.Tensor:
        """Put ``rows`` (row ``i`` of id ``ids[i]``) into the slots of ``evicted[i]`` (which leave the buffer), or
        into free slots (``evicted=None``: the warm start). Returns the slots used."""
        ids_t = torch.as_tensor(_as_ids(ids))
        if rows.shape[0] != ids_t.numel():
            raise ValueError(f"install: {rows.shape[0]} rows for {ids_t.numel()} ids")
        with self.lock:
            if ids_t.numel() and bool((self._slots(ids_t) >= 0).any()):
                raise ValueError("install: an id is buffered already")
            if evicted is None:
                slots = torch.nonzero(self.ids < 0).flatten()[: ids_t.numel()]
                if slots.numel() < ids_t.numel():
                    raise ValueError(f"install: {ids_t.numel()} rows for {slots.numel()} free slots")
            else:
                ev = torch.as_tensor(_as_ids(evicted))
                if ev.numel() != ids_t.numel():
                    raise ValueError(f"install: {ids_t.numel()} replacements for {ev.numel()} evicted ids")
                slots = self._slots(ev)
                if ev.numel() and int(slots.min()) < 0:
                    raise ValueError(f"install: evicted id {int(ev[slots < 0][0])} is not buffered")
                self._map(ev, None)
            self.rows.index_copy_(0, slots.to(self.rows.device), rows.to(self.rows.device, self.rows.dtype))
            self.ids[slots] = ids_t
            self._map(ids_t, slots)
            return slots

    def _map(self, ids: torch.Tensor, slots: torch.Tensor | None) -> None:
        """Map ``ids`` to ``slots`` (``None``: unmap them and free their slots), under the lock."""
        if self._table is not None:
            pos, ok = self._pos(ids)
            if not bool(ok.all()):
                raise ValueError("install: ids that are not candidates")
            if slots is None:
                self.ids[self._table[pos].long()] = -1
                self._table[pos] = -1
            else:
                self._table[pos] = slots.to(torch.int32)
            return
        if slots is None:
            self.ids[self._slots(ids)] = -1
        occ = torch.nonzero(self.ids >= 0).flatten()
        keys, order = torch.sort(self.ids[occ])
        self._sorted_ids, self._sorted_slots = keys, occ[order]
