"""One pass over a split's edge buckets in a partition order: batches, swaps, statistics.

A :class:`PartitionPass` walks the buffer states of a
:class:`~lightning_ooc.embed.order.PartitionOrder`. In state ``k`` it first
yields the batches of the buckets that involve the partition to be evicted
(``before``), then starts the swap (write back the evicted partition, read the
next one) on the pass's own swap thread and yields the batches of the other
buckets (``during``) while it runs; before the first batch of state ``k + 1``
the swap must have finished. The time the trainer waits for swaps, and the
time the swaps took, are the pass's statistics (the hidden share is
``1 - wait / swap``).

Batches are made in two steps, because Lightning fetches the next batch
before it trains the current one: ``next()`` makes a batch of ids (global
node ids, relations, negatives: cheap, no buffer access), and
:meth:`PartitionPass.attach` turns them into buffer rows right before the
batch is trained (the datamodule calls it from ``on_after_batch_transfer``;
iterated without a Trainer, ``next()`` attaches itself). When a batch is
attached every earlier batch has been trained, so the swap that a ``during``
batch starts never writes back a partition an untrained batch still updates;
on a GPU the swap also waits for an event recorded on the trainer's stream
at that moment.

Everything a batch draws is a function of ``(seed, epoch, split, bucket,
batch)``: the order of the edges in a bucket, the negatives. The same
partition order therefore gives the same batches whatever the buffer
capacity, which is how the out-of-core run is compared with the whole table
in memory.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
import xxhash

from lightning_ooc.embed.batch import EmbeddingBatch
from lightning_ooc.embed.buckets import EdgeBuckets
from lightning_ooc.embed.partition_buffer import PartitionBuffer
from lightning_ooc.utils.cancel import CancelToken

log = logging.getLogger("lightning_ooc")

#: how long ``attach`` waits for a swap before it says what it waits for (it goes on waiting)
SWAP_WARN_SECONDS = 60.0


def stream_seed(*parts: Any) -> int:
    """A 63-bit seed for a random stream named by ``parts``."""
    return xxhash.xxh64_intdigest(":".join(str(p) for p in parts).encode()) & ((1 << 63) - 1)


@dataclass
class PassStats:
    split: str
    epoch: int
    batches: int = 0
    edges: int = 0
    swaps: int = 0
    overlapped: int = 0  # swaps started by a batch trained while they run (the others: at a state's end)
    swap_seconds: float = 0.0  # time the swaps of this pass took (on the swap thread)
    wait_seconds: float = 0.0  # time the trainer waited for partitions (swaps and the first load)
    first_load_seconds: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    done_batches: int = 0

    @property
    def hidden_fraction(self) -> float:
        """The share of swap time the trainer did not wait for."""
        if self.swap_seconds <= 0:
            return 1.0
        waited = max(0.0, self.wait_seconds - self.first_load_seconds)
        return max(0.0, 1.0 - waited / self.swap_seconds)

    def as_metrics(self) -> dict[str, float]:
        return {
            "batches": float(self.batches), "edges": float(self.edges), "swaps": float(self.swaps),
            "overlapped_swaps": float(self.overlapped),
            "swap_seconds": self.swap_seconds, "wait_seconds": self.wait_seconds,
            "hidden_fraction": self.hidden_fraction, "bytes_read": float(self.bytes_read),
            "bytes_written": float(self.bytes_written), "seconds": self.seconds,
            "edges_per_second": self.edges / self.seconds if self.seconds > 0 else 0.0,
        }  # fmt: skip


@dataclass
class _Swap:
    state: int
    evict: int
    load: int
    event: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    seconds: float = 0.0


class KnownEdges:
    """Every stored edge of a table (all splits), per bucket, for filtered ranking."""

    def __init__(self, buckets: dict[str, EdgeBuckets], num_nodes: int, num_relations: int):
        self.buckets = buckets
        self.n = int(num_nodes)
        self.r = int(num_relations)
        if self.n * self.n * self.r >= 1 << 62:
            raise ValueError(f"filtered ranking needs num_nodes^2 x num_relations < 2^62 ({self.n} nodes, {self.r} "
                             "relations); use sampled negatives without filter")  # fmt: skip
        self._cache: dict[tuple[int, int], np.ndarray] = {}
        self._all: np.ndarray | None = None

    def key(self, src: np.ndarray, rel: np.ndarray, dst: np.ndarray) -> np.ndarray:
        return (src * self.r + rel) * self.n + dst

    def of_bucket(self, i: int, j: int) -> np.ndarray:
        if (i, j) not in self._cache:
            keys = []
            for b in self.buckets.values():
                s, d, r = b.edges(i, j)
                keys.append(self.key(s.numpy(), r.numpy(), d.numpy()))
            self._cache = {(i, j): np.unique(np.concatenate(keys)) if keys else np.zeros(0, np.int64)}
        return self._cache[(i, j)]

    def everywhere(self) -> np.ndarray:
        """Every stored edge's key, sorted (ranking against every node: a small table)."""
        if self._all is None:
            keys = []
            for b in self.buckets.values():
                n = b.num_partitions
                for i in range(n):
                    for j in range(n):
                        s, d, r = b.edges(i, j)
                        keys.append(self.key(s.numpy(), r.numpy(), d.numpy()))
            self._all = np.unique(np.concatenate(keys)) if keys else np.zeros(0, np.int64)
        return self._all

    def contains(self, i: int | None, j: int | None, keys: np.ndarray) -> np.ndarray:
        """Whether each key is a stored edge; ``i, j`` name the bucket every key lies in (None: any bucket)."""
        known = self.everywhere() if i is None else self.of_bucket(i, j)
        if known.size == 0:
            return np.zeros(keys.shape, bool)
        pos = np.clip(np.searchsorted(known, keys), 0, known.size - 1)
        return known[pos] == keys


class PartitionPass:
    """A pass over ``buckets`` (one split) in ``order``, over ``buffer``; iterate it for batches.

    ``num_negatives`` shared negatives per chunk of ``chunk_size`` edges
    (``"all"``: every node, which needs the whole table resident). ``train``
    shuffles each bucket per epoch and marks the partitions it trains dirty.
    ``known`` enables filtered ranking (evaluation). ``attach_on_next``: attach
    each batch in ``next()`` (no Trainer) instead of waiting for :meth:`attach`.

    Example (what :class:`~lightning_ooc.embed.OutOfCoreEmbeddingData` starts for each pass)::

        >>> import tempfile, numpy as np, torch
        >>> from lightning_ooc.embed import EdgeBuckets, EmbeddingTable, PartitionBuffer, init_embeddings
        >>> from lightning_ooc.embed.order import partition_order
        >>> rng = np.random.default_rng(0)
        >>> root = init_embeddings(tempfile.mkdtemp() + "/e", num_nodes=40, dim=4, partitions=3,
        ...                        edges={"train": (rng.integers(0, 40, 200), rng.integers(0, 40, 200))},
        ...                        progress=False)
        >>> table = EmbeddingTable(root)
        >>> buffer = PartitionBuffer(table, 2, torch.device("cpu"))
        >>> buckets = EdgeBuckets(table.root, "train", table.meta["buckets"]["train"])
        >>> run = PartitionPass(buffer, buckets, partition_order(3, 2, "auto"), split="train", epoch=0, seed=0,
        ...                     batch_size=32, chunk_size=16, num_negatives=8, train=True)
        >>> sum(len(b) for b in run), run.stats.swaps > 0
        (200, True)
        >>> buffer.close(); table.close()
    """

    def __init__(
        self,
        buffer: PartitionBuffer,
        buckets: EdgeBuckets,
        order: Any,
        *,
        split: str,
        epoch: int,
        seed: int,
        batch_size: int,
        chunk_size: int,
        num_negatives: int | str,
        train: bool,
        known: KnownEdges | None = None,
        attach_on_next: bool = True,
        on_end: Callable[[PassStats], None] | None = None,
    ):
        self.buffer = buffer
        self.table = buffer.table
        self.buckets = buckets
        self.order = order
        self.split = split
        self.epoch = int(epoch)
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.chunk_size = int(chunk_size)
        self.num_negatives = num_negatives
        self.train = bool(train)
        self.known = known
        self.attach_on_next = attach_on_next
        self.on_end = on_end
        self.stats = PassStats(split, self.epoch)
        self.cancel = CancelToken(f"{split} embedding pass, epoch {epoch}")
        self._swaps: dict[int, _Swap] = {}
        self._jobs: queue.Queue[_Swap | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._state = -1  # the state whose partitions the last attached batch used
        self._gen = self._batches()
        #: batches in the pass (Lightning stops after this many without asking for the end)
        self.num_batches = sum(-(-buckets.count(i, j) // self.batch_size) for i, j in order.buckets())
        self._t0 = time.perf_counter()
        self._buf0 = buffer.stats.copy()
        self._ended = False
        self.closed = False
        if num_negatives == "all" and buffer.capacity < self.table.num_partitions:
            raise ValueError(f"num_negatives='all' ranks against every node, which needs the whole table in the "
                             f"buffer ({self.table.num_partitions} partitions, capacity {buffer.capacity}); use a "
                             "number of sampled negatives")  # fmt: skip

    # -- making batches of ids ------------------------------------------------------------
    def _batches(self) -> Iterator[EmbeddingBatch]:
        seq = 0
        for k, st in enumerate(self.order.states):
            for phase, bucket_list in (("before", st.before), ("during", st.during)):
                for i, j in bucket_list:
                    for b in self._bucket_batches(k, phase, i, j, seq):
                        seq += 1
                        yield b

    def _bucket_batches(self, k: int, phase: str, i: int, j: int, seq0: int) -> Iterator[EmbeddingBatch]:
        src, dst, rel = self.buckets.edges(i, j)
        m = int(src.numel())
        if m == 0:
            return
        if self.train:
            g = torch.Generator().manual_seed(stream_seed(self.seed, self.epoch, self.split, i, j))
            perm = torch.randperm(m, generator=g)
            src, dst, rel = src[perm], dst[perm], rel[perm]
        bounds = self.table.bounds
        for n, lo in enumerate(range(0, m, self.batch_size)):
            s, d, r = src[lo : lo + self.batch_size], dst[lo : lo + self.batch_size], rel[lo : lo + self.batch_size]
            if self.num_negatives == "all":
                every = torch.arange(self.table.num_nodes).unsqueeze(0)
                neg_src, neg_dst, chunk = every, every, max(1, int(s.numel()))
            else:
                chunk = self.chunk_size
                chunks = math.ceil(s.numel() / chunk)
                g = torch.Generator().manual_seed(stream_seed(self.seed, self.epoch, self.split, i, j, n, "neg"))
                kneg = int(self.num_negatives)
                neg_dst = torch.randint(int(bounds[j]), int(bounds[j + 1]), (chunks, kneg), generator=g)
                neg_src = torch.randint(int(bounds[i]), int(bounds[i + 1]), (chunks, kneg), generator=g)
            batch = EmbeddingBatch(
                src=s, dst=d, rel=r, src_rows=None, dst_rows=None, neg_src_rows=None, neg_dst_rows=None,
                chunk_size=chunk, weight=None, state=None, neg_src=neg_src, neg_dst=neg_dst, split=self.split,
                bucket=(i, j), epoch=self.epoch, index=seq0 + n, state_index=k, phase=phase,
            )  # fmt: skip
            if self.known is not None:
                batch.src_filter, batch.dst_filter = self._filters(batch)
            batch.on_done = self._on_done
            yield batch

    def _filters(self, b: EmbeddingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(edge, negative) pairs whose corrupted edge is a stored edge: ignored when ranking."""
        i, j = b.bucket
        s, d, r = b.src.numpy(), b.dst.numpy(), b.rel.numpy()
        chunk = np.arange(s.size) // b.chunk_size
        nd, ns = b.neg_dst.numpy()[chunk], b.neg_src.numpy()[chunk]  # [B, K]
        known = self.known
        if self.num_negatives == "all":  # candidates of every partition: look the keys up in every bucket
            i = j = None
        tail = known.contains(i, j, known.key(s[:, None], r[:, None], nd))
        head = known.contains(i, j, known.key(ns, r[:, None], d[:, None]))
        return (torch.from_numpy(np.stack(np.nonzero(head))).long(), torch.from_numpy(np.stack(np.nonzero(tail))).long())

    def _on_done(self, batch: EmbeddingBatch) -> None:
        self.stats.done_batches += 1

    def __iter__(self) -> "PartitionPass":
        return self

    def __next__(self) -> EmbeddingBatch:
        if self.closed:
            raise StopIteration
        try:
            batch = next(self._gen)
        except StopIteration:
            self._end()
            raise
        except BaseException:
            self.close()
            raise
        self.stats.batches += 1
        self.stats.edges += len(batch)
        if self.attach_on_next:
            self.attach(batch)
        return batch

    # -- attaching rows, swapping -----------------------------------------------------------
    def attach(self, batch: EmbeddingBatch) -> EmbeddingBatch:
        """Fill ``batch``'s buffer rows right before it is trained (waits for its state's partitions)."""
        self._raise_swap_error()
        k = int(batch.state_index)
        t0 = time.perf_counter()
        if k != self._state:
            self._enter_state(k)
        if batch.phase == "during" and k not in self._swaps:
            if self._start_swap(k):
                self.stats.overlapped += 1
        if any(self.buffer.slot_of(p) is None for p in batch.bucket):
            # another pass (evaluation in the middle of an epoch) used the buffer meanwhile: put back what
            # this state holds (the next state's partitions once its swap has started)
            self.quiesce()
            self._raise_swap_error()
            swapped = k in self._swaps and k + 1 < len(self.order.states)
            self.buffer.ensure(self.order.states[k + 1 if swapped else k].partitions)
        waited = time.perf_counter() - t0
        self.stats.wait_seconds += waited
        if self._state < 0:
            self.stats.first_load_seconds += waited
        self._state = k
        dev = batch.src.device
        rows = self.buffer.rows_of
        batch.src_rows, batch.dst_rows = rows(batch.src).to(dev), rows(batch.dst).to(dev)
        batch.neg_src_rows, batch.neg_dst_rows = rows(batch.neg_src).to(dev), rows(batch.neg_dst).to(dev)
        batch.weight, batch.state = self.buffer.weight, self.buffer.state
        if self.train:  # right before the step that updates them (a flush before it would not see them)
            self.buffer.mark_dirty(set(batch.bucket))
        if batch.index == self.num_batches - 1:  # the last batch: the pass's statistics are complete
            self._end()
        return batch

    def _enter_state(self, k: int) -> None:
        """Make state ``k``'s partitions resident: the swaps of earlier states finished (started if not yet)."""
        if self._state < 0:
            # the pass's first state: load what is missing now (not hidden); every partition when the
            # buffer holds the whole table (then the pass never swaps)
            whole = self.buffer.capacity >= self.table.num_partitions
            self.buffer.ensure(range(self.table.num_partitions) if whole else self.order.states[k].partitions)
            return
        for s in range(max(self._state, 0), k):
            if self.order.states[s].evict is not None and self.buffer.capacity < self.table.num_partitions:
                self._start_swap(s)
                self._wait_swap(s)

    def _start_swap(self, k: int) -> bool:
        """Start state ``k``'s swap on the swap thread; whether it was started now."""
        if k in self._swaps:
            return False
        st = self.order.states[k]
        if st.evict is None or self.buffer.capacity >= self.table.num_partitions:
            return False
        job = _Swap(k, int(st.evict), int(st.load))
        if self.buffer.device.type == "cuda":  # the swap's copies wait for the trainer's kernels so far
            job.event = torch.cuda.current_stream(self.buffer.device).record_event()
        self._swaps[k] = job
        if self._thread is None:
            self._thread = threading.Thread(target=self._swap_loop, name=f"looc-swap-{self.split}", daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return True

    def _swap_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                self.cancel.check()
                if job.event is not None:
                    job.event.synchronize()
                self.buffer.swap(job.evict, job.load)
            except BaseException as e:  # surfaced in the trainer by _wait_swap / attach
                job.error = e
            job.seconds = time.perf_counter() - t0
            job.done.set()

    def _wait_swap(self, k: int) -> None:
        job = self._swaps[k]
        warned = False
        t0 = time.perf_counter()
        while not job.done.wait(0.25):
            self.cancel.check()
            if not warned and time.perf_counter() - t0 > SWAP_WARN_SECONDS:
                log.warning("waiting %.0f s for the swap of partition %d for %d (%s pass)", SWAP_WARN_SECONDS,
                            job.evict, job.load, self.split)  # fmt: skip
                warned = True
        self.stats.swaps += 1
        self.stats.swap_seconds += job.seconds
        if job.error is not None:
            err = job.error
            self.close()
            raise err

    def _raise_swap_error(self) -> None:
        for job in self._swaps.values():
            if job.done.is_set() and job.error is not None:
                err = job.error
                self.close()
                raise err

    def quiesce(self) -> None:
        """Wait for a swap in flight (another pass is about to use the buffer)."""
        for k, job in list(self._swaps.items()):
            if not job.done.is_set():
                job.done.wait()

    # -- end --------------------------------------------------------------------------------
    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        for k in list(self._swaps):
            self._wait_swap(k) if not self._swaps[k].done.is_set() else None
        self.stats.seconds = time.perf_counter() - self._t0
        moved = self.buffer.stats.minus(self._buf0)
        self.stats.bytes_read, self.stats.bytes_written = moved.bytes_read, moved.bytes_written
        self._stop_thread()
        if self.on_end is not None:
            self.on_end(self.stats)

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop the pass: a swap in flight finishes (a partition is never left half-moved), nothing new starts."""
        if self.closed:
            return
        self.closed = True
        self.cancel.cancel("closed")
        self._stop_thread()
        self._gen.close()
