"""Seed batches per epoch and rank, and the bookkeeping that lets a run resume mid-epoch.

:class:`SeedBatches` cuts a split's seeds into this process's minibatches for
an epoch (shuffled per epoch for training; a disjoint share per rank with
several processes). :class:`EpochProgress` remembers which batches of the
current training epoch were trained, for checkpoints, and turns a checkpoint
back into the batches still to train.

Example::

    >>> import torch
    >>> from lightning_ooc.loader.batches import SeedBatches
    >>> batches = SeedBatches({"train": torch.arange(10), "val": torch.arange(10, 14)}.__getitem__,
    ...                       batch_size=4, eval_batch_size=3, shuffle=False)
    >>> [b.tolist() for b in batches.epoch("train", 0)], batches.count("val")
    ([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], 2)
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

log = logging.getLogger("lightning_ooc")


def _share_count(n: int, world: int, batch_size: int) -> int:
    """Batches of the largest of ``world`` shares of ``n`` seeds: every rank cuts that many."""
    return -(-(n // world + (n % world > 0)) // batch_size)


def _too_few(n: int, world: int, count: int) -> ValueError:
    return ValueError(f"{n} seeds cannot give {world} processes {count} non-empty batches each; "
                      f"use a larger batch_size or fewer processes")  # fmt: skip


def rank_batches(seeds: torch.Tensor, rank: int, world: int, batch_size: int, drop_last: bool = False) -> "BatchList":
    """This rank's minibatches: a disjoint share of ``seeds``, and the same number of batches on every rank.

    The shares are contiguous and differ in size by at most one seed; together they
    cover ``seeds`` (``drop_last``: all but fewer than ``world * batch_size`` of them).
    When shares would need different batch counts, every rank cuts its share into the
    larger count of near-equal batches, so collectives never wait for a missing batch.

    Example::

        >>> import torch
        >>> [[b.tolist() for b in rank_batches(torch.arange(7), r, 2, 3)] for r in range(2)]
        [[[0, 1], [2, 3]], [[4, 5], [6]]]
        >>> [[b.numel() for b in rank_batches(torch.arange(2001), r, 2, 1000)] for r in range(2)]
        [[501, 500], [500, 500]]
    """
    n = seeds.numel()
    if drop_last:
        per = n // world // batch_size * batch_size
        return BatchList.even(seeds[rank * per : (rank + 1) * per], batch_size)
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    part = seeds[lo : lo + base + (rank < extra)]
    count = _share_count(n, world, batch_size)
    if count == 0:
        return BatchList.even(part[:0], batch_size)
    if part.numel() < count:
        raise _too_few(n, world, count)
    if extra == 0 or -(-base // batch_size) == count:  # every share needs the same count: full batches
        return BatchList.even(part, batch_size)
    # near-equal batches, as torch.tensor_split cuts them: the first (numel % count) one seed larger
    small, larger = divmod(part.numel(), count)
    sizes = np.full(count, small, dtype=np.int64)
    sizes[:larger] += 1
    return BatchList(part, np.concatenate([[0], np.cumsum(sizes)]))


class BatchList(Sequence):
    """An epoch's minibatches as bounds into one tensor of seeds: ``batches[k]`` is a view made when
    asked. A list of views would cost a few hundred bytes per batch (170 MiB for the 300,000
    batches of a 78-million-edge link split); this costs 8 bytes per batch.

    >>> b = BatchList.even(torch.arange(7), 3)
    >>> len(b), [t.tolist() for t in b], b[-1].tolist(), [t.tolist() for t in b[:2]]
    (3, [[0, 1, 2], [3, 4, 5], [6]], [6], [[0, 1, 2], [3, 4, 5]])
    """

    def __init__(self, seeds: torch.Tensor, bounds: np.ndarray):
        self.seeds, self.bounds = seeds, np.asarray(bounds, dtype=np.int64)

    @classmethod
    def even(cls, seeds: torch.Tensor, batch_size: int) -> "BatchList":
        """``seeds`` cut into batches of ``batch_size`` (the last one smaller)."""
        n = seeds.numel()
        return cls(seeds, np.append(np.arange(0, n, batch_size, dtype=np.int64), n) if n else np.zeros(1, np.int64))

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        k = int(k)
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(f"batch {k} of {len(self)}")
        return self.seeds[int(self.bounds[k]) : int(self.bounds[k + 1])]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for k in range(len(self)):
            yield self[k]

    def cat(self) -> torch.Tensor:
        """Every seed of these batches, in order, as one tensor."""
        return self.seeds[int(self.bounds[0]) : int(self.bounds[-1])]





class SeedBatches:
    """The minibatches of seeds of each split, per epoch, for one rank of ``world``.

    Args:
        seeds: split name -> its seed node ids, or a count ``n`` for the positions ``0 .. n-1``
            (link splits: edge positions; held as int32 below 2**31, never materialised unshuffled
            beyond one epoch's order).
        batch_size, eval_batch_size: seeds per training / evaluation minibatch.
        shuffle: reshuffle the training seeds every epoch (from ``seed`` and the epoch).
        drop_last: drop the last incomplete training batch.
        rank, world: this process's share of every split.
    """

    def __init__(self, seeds: Callable[[str], torch.Tensor | int], *, batch_size: int, eval_batch_size: int,
                 shuffle: bool = True, drop_last: bool = False, seed: int = 0, rank: int = 0, world: int = 1):  # fmt: skip
        self._seeds = seeds
        self.batch_size, self.eval_batch_size = int(batch_size), int(eval_batch_size)
        self.shuffle, self.drop_last, self.seed = bool(shuffle), bool(drop_last), int(seed)
        self.rank, self.world = int(rank), int(world)

    def size(self, split: str) -> int:
        """How many seeds ``split`` has (all ranks together)."""
        seeds = self._seeds(split)
        return seeds.numel() if isinstance(seeds, torch.Tensor) else int(seeds)

    def take(self, split: str, index: torch.Tensor) -> torch.Tensor:
        """The seeds of ``split`` at ``index`` (positions in stored order), without materialising the others."""
        seeds = self._seeds(split)
        return seeds[index] if isinstance(seeds, torch.Tensor) else index.to(_position_dtype(int(seeds)))

    def seeds(self, split: str) -> torch.Tensor:
        """Every seed of ``split`` in stored order (a count of positions becomes ``arange``)."""
        seeds = self._seeds(split)
        if isinstance(seeds, torch.Tensor):
            return seeds
        return torch.arange(int(seeds), dtype=_position_dtype(int(seeds)))

    def epoch(self, split: str, epoch: int) -> BatchList:
        """This rank's batches of ``split`` in ``epoch`` (evaluation splits are the same every epoch)."""
        train = split == "train"
        bs = self.batch_size if train else self.eval_batch_size
        if train and self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            seeds = self._seeds(split)
            if isinstance(seeds, torch.Tensor):
                seeds = seeds[torch.randperm(seeds.numel(), generator=g)]
            else:  # positions: the permutation is the order itself
                seeds = torch.randperm(int(seeds), generator=g, dtype=_position_dtype(int(seeds)))
        else:
            seeds = self.seeds(split)
        drop = self.drop_last and train
        if self.world > 1:
            return rank_batches(seeds, self.rank, self.world, bs, drop_last=drop)
        n = seeds.numel()
        if drop:
            n = n // bs * bs
        return BatchList.even(seeds[:n], bs)

    def count(self, split: str) -> int:
        """Batches of ``split`` per epoch (the same every epoch), counted without cutting them."""
        train = split == "train"
        return batch_count(self.size(split), self.world, self.batch_size if train else self.eval_batch_size, self.drop_last and train)


def _position_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 2**31 else torch.int64


def batch_count(n: int, world: int, batch_size: int, drop_last: bool = False) -> int:
    """How many minibatches each rank gets of ``n`` seeds (what :func:`rank_batches` cuts).

    >>> [batch_count(n, w, 3, d) for n, w, d in ((7, 1, False), (7, 1, True), (7, 2, False), (2001, 2, True))]
    [3, 2, 2, 333]
    """
    if world == 1:
        return n // batch_size if drop_last else -(-n // batch_size)
    if drop_last:
        return n // world // batch_size
    count = _share_count(n, world, batch_size)
    if count and n // world < count:  # what rank_batches refuses on some rank, refused as early
        raise _too_few(n, world, count)
    return count


class EpochProgress:
    """Which batches of the current training epoch were trained, and what a checkpoint says to skip.

    Example::

        >>> from lightning_ooc.loader.batches import EpochProgress
        >>> p = EpochProgress(seed=0)
        >>> p.begin(epoch=0, num_batches=4)
        (0, frozenset())
        >>> p.trained(2); p.trained(0)
        >>> state = p.state_dict()
        >>> q = EpochProgress(seed=0); q.load_state_dict(state, rank=0, world=1)
        >>> q.begin(epoch=0, num_batches=4)
        (0, frozenset({0, 2}))
    """

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.epoch = -1  # the training epoch the trained set belongs to
        self.done: set[int] = set()
        self._resume: dict[str, Any] | None = None

    def begin(self, epoch: int, num_batches: int) -> tuple[int, frozenset[int]]:
        """Start training ``epoch``: returns the epoch really run and the batches to skip.

        A checkpoint loaded for this epoch is kept for the whole epoch (Lightning may start
        the loader more than once). A checkpoint that closed its epoch makes this the next
        one: Lightning still reports the old number for the first pass after a restart.
        """
        skip: frozenset[int] = frozenset()
        if self._resume is not None and self._resume.get("epoch") == epoch:
            done = frozenset(self._resume.get("trained", []))
            if len(done) >= num_batches:
                epoch += 1
            else:
                skip = done
                self.done = set(skip)
        else:
            self._resume = None
            self.done = set()
        self.epoch = epoch
        return epoch, skip

    def trained(self, k: int) -> None:
        self.done.add(int(k))

    def state_dict(self, gather: Callable[[Any], list[Any]] | None = None, world: int = 1) -> dict[str, Any]:
        """The epoch and its trained batches; ``gather`` (a collective) adds every rank's list."""
        trained = sorted(self.done)
        state: dict[str, Any] = {"epoch": self.epoch, "trained": trained, "seed": self.seed, "world_size": 1}
        if gather is not None and world > 1:
            state["trained_by_rank"] = gather(trained)
            state["world_size"] = world
        return state

    def load_state_dict(self, state: dict[str, Any], rank: int, world: int) -> None:
        if state.get("seed", self.seed) != self.seed:
            log.warning("resuming with seed %s but the checkpoint used %s: the epoch's batches differ",
                        self.seed, state.get("seed"))  # fmt: skip
        state = dict(state)
        if int(state.get("world_size", 1)) != world:
            log.warning("the checkpoint was taken with %s processes and this run has %s: its epoch %s restarts "
                        "from its first batch", state.get("world_size", 1), world, state.get("epoch"))  # fmt: skip
            state["trained"] = []
        elif "trained_by_rank" in state:
            state["trained"] = state["trained_by_rank"][rank]
        self._resume = state
