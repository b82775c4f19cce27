"""An I/O floor that no design can move: the fewest SSD reads an epoch's batches need with a given memory.

The batches of an epoch are deterministic (the seed order and each batch's sampling seed follow from the
configuration), so their node lists can be replayed offline, without reading a feature row
(:func:`replay_epoch`). Over them:

* :func:`compulsory_reads`: the distinct rows of the epoch, read at least once by any design;
* :func:`optimal_reads`: the fewest reads with ``capacity`` rows of memory kept between batches, cold at
  the start (Belady's rule with the option not to keep a row: after each batch, keep the ``capacity`` rows
  whose next use comes soonest, among those kept and those the batch read; a row used by no later batch is
  never kept). A design that fills a cache before training pays those reads too: they count.
* :func:`best_static_reads`: the fewest reads of a cache that keeps the same ``capacity`` rows all epoch,
  chosen knowing the epoch: the best a static host cache of that memory alone can do.

``bench epoch`` divides the optimal reads by fio's IOPS to get its floor, and compares its own reads with them.

Example::

    >>> import numpy as np
    >>> batches = [np.array([0, 1, 2]), np.array([2, 3]), np.array([0, 3])]
    >>> compulsory_reads(batches), optimal_reads(batches, capacity=0), optimal_reads(batches, capacity=1)
    (4, 7, 5)
    >>> optimal_reads(batches, capacity=2)  # keeps 2 (used next) and 0 (used last), then 3 beside 0
    4
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

#: the next use of a row that no later batch touches
NEVER = np.iinfo(np.int64).max


def _unique_batches(batches: Iterable[Any]) -> list[np.ndarray]:
    out = []
    for b in batches:
        a = b.numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
        if a.ndim != 1:
            raise ValueError(f"a batch is a 1-D list of row ids, got shape {a.shape}")
        out.append(np.unique(a.astype(np.int64, copy=False)))
    return out


def next_uses(batches: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Each batch's distinct rows, concatenated, and for each the index of the next batch that uses the row
    again (:data:`NEVER` for none). Returns ``(next_use, starts)``: batch ``t``'s rows are
    ``next_use[starts[t]:starts[t + 1]]``.

    >>> nxt, starts = next_uses([[5, 6], [6], [5, 5]])
    >>> [int(x) if x != NEVER else None for x in nxt], starts.tolist()
    ([2, 1, None, None], [0, 2, 3, 4])
    """
    ub = _unique_batches(batches)
    sizes = np.array([b.size for b in ub], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if not ub or starts[-1] == 0:
        return np.empty(0, dtype=np.int64), starts
    rows = np.concatenate(ub)
    when = np.repeat(np.arange(len(ub), dtype=np.int64), sizes)
    order = np.lexsort((when, rows))  # by row, then by batch
    r, w = rows[order], when[order]
    nxt_sorted = np.full(r.size, NEVER, dtype=np.int64)
    same = r[1:] == r[:-1]
    nxt_sorted[:-1][same] = w[1:][same]
    nxt = np.empty_like(nxt_sorted)
    nxt[order] = nxt_sorted
    return nxt, starts


def compulsory_reads(batches: Sequence[Any]) -> int:
    """The distinct rows of all ``batches``: every design reads each at least once."""
    ub = _unique_batches(batches)
    return int(np.unique(np.concatenate(ub)).size) if ub else 0


def best_static_reads(batches: Sequence[Any], capacity: int) -> int:
    """The fewest row reads of a cache that holds the same ``capacity`` rows for the whole epoch, chosen knowing
    every batch (the most used rows; each read once, on its first use): the best a static host cache of that
    memory alone can do, between :func:`optimal_reads` (which may change the rows it keeps after every batch)
    and no cache at all.

    >>> best_static_reads([[0, 1, 2], [2, 3], [0, 3], [3]], capacity=1)  # keeps 3 (read once); 5 other uses
    6
    >>> optimal_reads([[0, 1, 2], [2, 3], [0, 3], [3]], capacity=1)  # keeps 2, then 3
    5
    """
    ub = _unique_batches(batches)
    if not ub:
        return 0
    _, uses = np.unique(np.concatenate(ub), return_counts=True)
    k = max(0, min(int(capacity), uses.size))
    kept = np.partition(uses, uses.size - k)[uses.size - k :] if k else uses[:0]
    return int(uses.sum() - kept.sum() + kept.size)


def optimal_reads(batches: Sequence[Any], capacity: int, *, per_batch: bool = False) -> Any:
    """The fewest row reads that serve ``batches`` in order with ``capacity`` rows kept between batches.

    The model: a batch needs all of its distinct rows; a row is a hit if it was kept from before, else it is
    read (one read per row); after the batch, any ``capacity`` of the rows kept or just read may be kept
    (starting empty). Keeping those whose next use is soonest is optimal (Belady's rule; a row whose next use
    is farther than every kept one is simply not kept). With ``per_batch``, returns the reads of each batch
    (a NumPy array) instead of their sum.
    """
    nxt, starts = next_uses(batches)
    reads = np.zeros(len(starts) - 1, dtype=np.int64)
    capacity = max(0, int(capacity))
    kept = np.empty(0, dtype=np.int64)  # the next use of each kept row (the row itself does not matter)
    for t in range(len(reads)):
        need = nxt[starts[t] : starts[t + 1]]
        due = kept == t  # kept rows this batch uses: exactly its hits
        reads[t] = need.size - int(due.sum())
        if capacity == 0:
            continue
        cand = np.concatenate([kept[~due], need[need != NEVER]])
        if cand.size > capacity:
            cand = np.partition(cand, capacity - 1)[:capacity]
        kept = cand
    return reads if per_batch else int(reads.sum())


def replay_epoch(datamodule_cls: Any, root: str, max_batches: int = 0, **kwargs: Any) -> Iterator[Any]:
    """The node ids of each training batch of epoch 0 of ``datamodule_cls(root, **kwargs)``, in the epoch's
    order, sampled as its pipeline samples them (same seeds) without reading a feature row: a dict per node
    type for a heterogeneous task. ``max_batches`` (0: all) cuts the epoch short like the Trainer's
    ``limit_train_batches``."""
    from lightning_ooc.loader import registry  # lazy: it imports PyG
    from lightning_ooc.loader.context import ProcessContext  # lazy: the loader package imports PyG
    from lightning_ooc.loader.pipeline import batch_seed  # lazy: the loader package imports PyG
    from lightning_ooc.loader.source import sampling_seed  # lazy: it imports PyG

    dm = datamodule_cls(root, **kwargs)
    cfg = dm.config
    task = registry.task_for(dm.task, cfg).batches(cfg, ProcessContext())
    batches = task.seed_batches(task.dataset).epoch("train", 0)
    sampler, _ = task.samplers()
    seed = sampling_seed(cfg, 0)
    n = len(batches) if not max_batches else min(max_batches, len(batches))
    for k in range(n):
        yield task.presample_nodes(sampler, batches[k], batch_seed(seed, 0, k))


def flatten_types(batch: Any, offsets: dict[Any, int]) -> np.ndarray:
    """One batch's node ids of every type as ids of one space (type ``t``'s ids shifted by ``offsets[t]``);
    a homogeneous batch (a tensor) as it is."""
    if not isinstance(batch, dict):
        return batch.numpy() if isinstance(batch, torch.Tensor) else np.asarray(batch)
    parts = [np.asarray(v.numpy() if isinstance(v, torch.Tensor) else v, dtype=np.int64) + offsets[t]
             for t, v in batch.items() if t in offsets]  # fmt: skip
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
