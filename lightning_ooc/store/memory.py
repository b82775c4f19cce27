"""Host memory: the limit this process runs under, what the datamodule allocates, and whether a plan fits.

Three parts, used by :meth:`~lightning_ooc.store.plan.StorePlan.from_budgets`:

* :func:`memory_limit` reads what this process may still allocate: the
  tightest of its memory cgroups (v1 ``memory.limit_in_bytes`` minus
  ``memory.usage_in_bytes``, v2 ``memory.max``/``memory.high`` minus
  ``memory.current``, for its own cgroup and every ancestor it can read) and
  ``MemAvailable`` of ``/proc/meminfo``. File cache (``active_file`` and
  ``inactive_file``: clean pages of mapped or read files, such as the topology
  and the link splits read through the page cache) is given back under
  pressure before anything is killed, so it is not counted as in use; what is
  (anonymous memory, shared memory, the kernel's) cannot be. Counting active
  file pages as in use (the kubelet's "working set") refused link runs whose
  presample had touched a gigabyte of a link split's pages. One kind of file
  page is counted all the same: the code and read-only data of the process's
  executable and libraries (:func:`mapped_code`, ~200 MiB of torch and its
  kin), which the cgroup charges (its ``mapped_file``) and the process touches
  all the time. Taken back, they are read again at once: runs planned as if
  they were free stalled under a 600 MiB cap, threads waiting on page faults
  (D state). The usage already includes this process (Python, torch,
  Lightning, the open dataset, the reader, the presampled batches), so what
  is planned after it is compared with what is left.
* :func:`host_tally` counts the host memory the datamodule allocates from the
  plan on, phase by phase (choosing the host cache's rows, simulating the
  buffer, building the store, training), as a function of the dataset and
  the pipeline's shape (:class:`ProcessShape`): the byte budgets that live in
  host memory, and what comes with them that no budget covers, mostly arrays
  of one entry per node of the graph. The items held before the plan
  (``indptr``, the reader's I/O slots, the presample) are listed too, for
  the record; they are already in the usage.
* :func:`check_fits` compares the peak of the tally plus a reserve for the
  rest of training with the limit; it shrinks the host cache, then (on CPU)
  the feature buffer down to its reserve, then the batches in flight (queues,
  samplers, extractors, down to one of each; the buffer's reserve with them),
  and says what it chose in one line, or raises
  :class:`~lightning_ooc.errors.InputError` with one message naming the limit,
  what the plan needs and what to shrink. :func:`fit_parts` does the same for
  several plans of one process (a heterogeneous graph's node types, one
  pipeline): every part's smallest plan first, the pipeline lowered over their
  sum by the same :func:`fewer_in_flight`, then each part's room, into which
  :func:`check_fits` fits its sizes.

Where the numbers come from (``ext/`` and ``lightning_ooc/``; N nodes, s
buffer slots, k host rows, M nodes and E edges per batch):

==========================  ==========================================================  =================
phase                       allocation                                                  bytes
==========================  ==========================================================  =================
before the plan (held)      ``indptr`` (private, or in node-shared memory under "ooc")  8 N
                            the training split, loaded to presample                     8 x train
                            reader I/O slots: workers x queue_depth x 128 KiB           (registered)
                            presampled ``n_id`` and the main thread's sampler workspace
choosing hot rows           int16 access counts over the presampled batches             2 N
(``choose_hot``)            ``top_k``'s two passes: keys of a chunk of nodes at a       48 x 128k
                            time (the in-degree a slice of ``indptr`` at a time), the   + 40 k
                            k largest keys, their ids and order
simulating the buffer       counts (kept in the HotSet), a bool "in host" mask, the     2 N + N + 4 N
                            simulated buffer's node -> slot table and slot tables       + 55 s
building the store          node -> slot (int32), host cache node -> row map (int32)    4 N + 4 N
                            counts, still held by the caller until setup returns        2 N
                            per-slot tables: slot2node, stamp, refcount, valid,         54 s
                            failed, standby FIFO of 2 s + 16 (slot, stamp) pairs
                            host rows, staging, buffer rows (on CPU)                    the budgets
training                    an epoch's order of the training seeds: node ids            16 x train
                            (randperm + copy); link edge positions (int32 randperm)     4 x train
                            validation / test seeds (node ids; link edge positions)     8 x eval; 4 x eval
                            one workspace per sampler thread (node map, edge arrays)    ~ 24 E + 32 (M+E)
                            batches in flight (samplers + both queues + extractors +    (64 M + 16 E)
                            trainer and its prefetch): ids, labels, edges, leases       per batch
                            ``x`` of the trainer's two batches and a gather temporary   3 M x row bytes
                            link batches' K negatives (:class:`BatchNegatives`): their  8 K (binary 20 K)
                            indices into ``n_id`` in every batch in flight, and per     per batch
                            sampler thread the ids drawn, the seed set, ``unique``      + 56 x ids
==========================  ==========================================================  =================

The nodes a link batch's negatives bring in (and their features) are in M, presampled with them;
what the model allocates to score the negatives is in the reserve (:func:`training_reserve`), and
:func:`check_negatives` refuses negatives past the limit before the presample draws any.

The peak per node is while the store is built: 10 B per node (2 counts + 4
node -> slot + 4 host cache map), then 8 B per node (the two node maps) for as long as the store lives
(plus the 8 B of ``indptr`` held from the start). glibc keeps freed blocks of
up to 32 MiB in its heap (``M_MMAP_THRESHOLD`` grows to the largest block
freed), so while per-node arrays are below that size (N < 4M), freed
temporaries stay resident and are reused only by later allocations of the
same size class. How much stays varies from run to run (most runs: nothing; the
worst of six runs each: 21 B per node at 300k nodes, 48 at 1M, 69 at 3M, none at
6M): :data:`HEAP_SLACK_PER_NODE` counts the worst seen, below 4M nodes only.

Example::

    >>> from lightning_ooc.store.memory import MemoryFit, MemoryLimit, ProcessShape, check_fits, host_tally
    >>> shape = ProcessShape(num_nodes=3_000_000, row_bytes=64, max_nodes_per_batch=40_000,
    ...                      max_edges_per_batch=60_000, train_nodes=30_000)
    >>> tally = host_tally(shape, host_rows=0, buffer_slots=1 << 20, staging_bytes=8 << 20)
    >>> {group: size >> 20 for group, size in tally.groups("choosing hot rows").items()}  # MiB
    {'per-node': 5, 'heap slack': 205}
    >>> tally.peak_phase, {group: size >> 20 for group, size in tally.groups().items()}
    ('training', {'per-node': 23, 'per-slot': 54, 'host cache': 0, 'staging': 8, 'buffer': 64, 'batches': 108, 'heap slack': 205})
    >>> fit = check_fits(shape, host_rows=524_288, buffer_slots=1 << 20, min_slots=160_000,
    ...                  staging_bytes=8 << 20, limit=MemoryLimit(4 << 30, "a test"))
    >>> isinstance(fit, MemoryFit), fit.host_rows, fit.shrunk, fit.format()
    (True, 524288, [], '  host memory      499.80 MiB  planned at its peak (training) + 284.25 MiB reserve, of 4.00 GiB available (a test)')
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from lightning_ooc.data.format import human_bytes
from lightning_ooc.errors import InputError
from lightning_ooc.store.buffer import required_slots

log = logging.getLogger("lightning_ooc")
from lightning_ooc.store.limits import (  # re-exported: this module was the one place of all three parts
    UNLIMITED,
    MemoryLimit,
    keep_reserve,
    limit_for_plan,
    limit_from_setting,
    mapped_code,
    memory_limit,
    process_rss,
    release_freed_memory,
)
from lightning_ooc.store.tally import (
    HEAP_SLACK_PER_NODE,
    RESERVE_FIXED,
    RESERVE_PER_BATCH_NODE,
    RESERVE_PER_NEGATIVE,
    BatchNegatives,
    HostTally,
    MemoryItem,
    ProcessShape,
    edges_per_batch_bound,
    host_tally,
    sampler_workspace_bytes,
)

__all__ = [
    "MemoryLimit", "memory_limit", "limit_from_setting", "MemoryItem", "HostTally", "ProcessShape", "host_tally", "MemoryFit",
    "check_fits", "edges_per_batch_bound", "sampler_workspace_bytes", "training_reserve", "process_rss", "mapped_code",
    "release_freed_memory",
    "limit_for_plan",
    "RESERVE_FIXED", "RESERVE_PER_BATCH_NODE", "RESERVE_PER_NEGATIVE", "HEAP_SLACK_PER_NODE", "BatchNegatives",
    "check_negatives", "PlanPart", "JointFit", "fit_parts", "fewer_in_flight", "buffer_reserve",
]  # fmt: skip


# -------------------------------------------------------------------------------------------------
# the check
# -------------------------------------------------------------------------------------------------
def training_reserve(max_nodes_per_batch: int, negatives: BatchNegatives | None = None) -> int:
    """Bytes kept free for the rest of training: :data:`RESERVE_FIXED` + :data:`RESERVE_PER_BATCH_NODE` per
    node + :data:`RESERVE_PER_NEGATIVE` per negative of a link batch.

    What the plan cannot see is the model: its parameters and optimizer state are small,
    its activations are not. Measured on a 3M-node graph (batches of 1000 seeds, fanout
    [10, 5], up to 38.7k nodes planned, ~31k seen), ``Trainer.fit`` of a 2-layer GraphSAGE
    peaked above ``setup()`` by 103 / 185 / 437 MiB with hidden 16 / 64 / 256, of which
    the tally's training phase counts ~180 MiB (buffer rows filled, batches in flight,
    sampler workspaces); activations grow by ~44 B per hidden unit per batch node. 128 MiB
    + 4 KiB per planned batch node (279 MiB there) covers all three, i.e. 2-layer models up
    to hidden ~256 on such batches; pass ``memory_reserve`` for wider or deeper models.

    A link batch's negatives are scored apart from its nodes: ``LinkPredictor`` gathers an
    embedding per negative (``h[dst_neg_index]``, ``[B, K, hidden]``), multiplies it with its
    source's, and the backward pass allocates as much again: a training step peaked at 13 B per
    negative per hidden unit (triplet, dot decoder), 17 B per binary pair, 21-25 B with the MLP
    decoder (hidden 64); evaluation without gradients at 9 B. 4 KiB per triplet negative and 6 KiB
    per binary pair are the dot decoder up to hidden ~256, as for the nodes (fit peaks of a cgroup
    measured below the plan with it, 512 edges per batch, hidden 256: 775 of 803 MiB with 100
    triplet negatives each, 2.37 of 2.64 GiB with 1000, 1.46 of 1.53 GiB with 300 binary pairs;
    at hidden 64, 1000 triplet negatives peaked at 1.15 GiB). 512 x 1000 triplet negatives: 2 GiB.

    >>> training_reserve(40_000) >> 20
    284
    >>> training_reserve(20_000, BatchNegatives(512, 1000)) >> 20
    2206
    """
    return (RESERVE_FIXED + RESERVE_PER_BATCH_NODE * int(max_nodes_per_batch)
            + (negatives.reserve if negatives is not None else 0))  # fmt: skip


#: the pipeline's settings the plan may lower to fit, queues first (see :func:`smaller_pipelines`)
PIPELINE_QUEUES = ("extract_queue_size", "train_queue_size")
PIPELINE_THREADS = ("num_samplers", "num_extractors")


@dataclass
class MemoryFit:
    """The outcome of :func:`check_fits`: the sizes to use, and what was asked (:attr:`shrunk` compares them)."""

    host_rows: int
    buffer_slots: int
    tally: HostTally
    limit: MemoryLimit
    allowed: int  # bytes this process may plan (its share of what is available, less the reserve)
    reserve: int
    #: what the tally was computed from (the pipeline chosen), so that other sizes can be checked against the limit
    shape: ProcessShape | None = None
    staging_bytes: int = 0
    #: the sizes and pipeline asked for (None: those chosen)
    asked_host_rows: int | None = None
    asked_slots: int | None = None
    asked_shape: ProcessShape | None = None
    #: the feature buffer's reserve for the pipeline chosen (slots)
    min_slots: int = 0
    #: why the plan was changed: the limit and what the plan asked needs
    why: str = ""

    @property
    def need(self) -> int:
        return self.tally.peak

    @property
    def shrunk(self) -> list[str]:
        """What differs from what was asked, one entry per setting, from the sizes now (after :meth:`resize` too)."""
        rb = self.tally_row_bytes
        out = []
        asked_h = self.host_rows if self.asked_host_rows is None else self.asked_host_rows
        if self.host_rows != asked_h:
            how = "shrunk" if self.host_rows < asked_h else "grown"
            out.append(f"host_cache {how} from {human_bytes(asked_h * rb)} to {human_bytes(self.host_rows * rb)} "
                       f"({asked_h:,} -> {self.host_rows:,} rows)")  # fmt: skip
        asked_s = self.buffer_slots if self.asked_slots is None else self.asked_slots
        if self.buffer_slots != asked_s:
            out.append(f"gpu_cache shrunk from {human_bytes(asked_s * rb)} to {human_bytes(self.buffer_slots * rb)} "
                       f"({asked_s:,} -> {self.buffer_slots:,} slots of the feature buffer, in host memory on CPU; "
                       f"its reserve is {self.min_slots:,})")  # fmt: skip
        changed = self.pipeline
        if changed:
            old, new = self.asked_shape, self.shape
            assert old is not None and new is not None
            out.append(f"pipeline shrunk from {_pipeline(old)} to {_pipeline(new)}")
        return out

    @property
    def tally_row_bytes(self) -> int:
        return self.shape.row_bytes if self.shape is not None else 1

    @property
    def pipeline(self) -> dict[str, int]:
        """The pipeline's settings the plan lowered, with their new values (empty: as asked)."""
        return _lowered(self.asked_shape, self.shape)

    def settings(self) -> list[str]:
        """The settings that plan the sizes chosen directly, by where they are set (``features.host_cache=24MiB``,
        ``pipeline.num_samplers=1``, ...)."""
        rb = self.tally_row_bytes
        out = []
        if self.asked_host_rows is not None and self.host_rows != self.asked_host_rows:
            out.append(f"features.host_cache={budget_setting(self.host_rows * rb)}")
        if self.asked_slots is not None and self.buffer_slots != self.asked_slots:
            out.append(f"features.gpu_cache={budget_setting(self.buffer_slots * rb)}")
        out += [f"pipeline.{k}={v}" for k, v in self.pipeline.items()]
        return out

    def warning(self) -> str | None:
        """The one line that says what was changed to fit and how to ask for it directly (None: nothing was)."""
        shrunk = self.shrunk
        if not shrunk:
            return None
        settings = self.settings()
        ask = ", ".join(settings[:-1]) + " and " + settings[-1] if len(settings) > 1 else settings[0]
        return f"lightning_ooc: {'; '.join(shrunk)} to fit in memory: {self.why}; set {ask} to plan this without a warning"

    def fits(self, host_rows: int, buffer_slots: int) -> bool:
        """Whether these sizes fit under the same limit, with the same reserve (always, without a limit)."""
        if self.limit.unlimited:
            return True
        if self.shape is None:
            raise ValueError("this fit was built without its process shape")
        tally = host_tally(self.shape, host_rows=host_rows, buffer_slots=buffer_slots, staging_bytes=self.staging_bytes)
        return tally.peak <= self.allowed

    def resize(self, host_rows: int, buffer_slots: int) -> None:
        """Take other sizes (checked with :meth:`fits` by the caller) and the tally that goes with them."""
        if self.shape is None:
            raise ValueError("this fit was built without its process shape")
        self.host_rows, self.buffer_slots = int(host_rows), int(buffer_slots)
        self.tally = host_tally(self.shape, host_rows=self.host_rows, buffer_slots=self.buffer_slots,
                                staging_bytes=self.staging_bytes)  # fmt: skip

    def format(self) -> str:
        """The plan's memory line."""
        if self.limit.unlimited:
            return (f"  host memory     {human_bytes(self.need):>11}  planned at its peak ({self.tally.peak_phase}), "
                    f"{self.limit}")  # fmt: skip
        return (f"  host memory     {human_bytes(self.need):>11}  planned at its peak ({self.tally.peak_phase}) "
                f"+ {human_bytes(self.reserve)} reserve, of {self.limit}")  # fmt: skip


def _pipeline(shape: ProcessShape) -> str:
    """A pipeline shape in a few words."""
    def n(count: int, what: str) -> str:
        return f"{count} {what}" + ("s" if count != 1 else "")

    return (f"{n(shape.num_samplers, 'sampler')}, queues {shape.extract_queue_size}/{shape.train_queue_size}, "
            f"{n(shape.num_extractors, 'extractor')}: {shape.batches_in_flight} batches in flight")


def smaller_pipelines(shape: ProcessShape) -> list[ProcessShape]:
    """Every pipeline the plan may lower ``shape``'s to, the smallest (one of each) first and one step below
    ``shape``'s last: a step takes one from the deeper queue while a queue holds more than one batch, then
    from the larger of the samplers and extractors. Each step holds fewer batches, so a plan that fits with
    one fits with every one before it.

    >>> shape = ProcessShape(num_nodes=10, row_bytes=4, max_nodes_per_batch=5, max_edges_per_batch=5,
    ...                      num_samplers=2, num_extractors=2, extract_queue_size=3, train_queue_size=2)
    >>> [s.batches_in_flight for s in smaller_pipelines(shape)], shape.batches_in_flight
    ([6, 7, 8, 9, 10], 11)
    """
    steps = []
    cur = shape
    for group in (PIPELINE_QUEUES, PIPELINE_THREADS):
        while True:
            name = max(group, key=lambda k: getattr(cur, k))
            if getattr(cur, name) <= 1:
                break
            cur = replace(cur, **{name: getattr(cur, name) - 1})
            steps.append(cur)
    return steps[::-1]


def largest_where(lo: int, hi: int, fits) -> int | None:
    """The largest x in [lo, hi] with fits(x) (fits is monotone: true up to some x), or None."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def buffer_reserve(shape: ProcessShape, order: str, buffer_slots: int | None = None) -> int:
    """The feature buffer's reserve (slots) for ``shape``'s pipeline: what its batches in flight hold at once,
    at most one slot per node (and at most ``buffer_slots``)."""
    most = min(required_slots(shape.max_nodes_per_batch, shape.num_extractors, shape.train_queue_size, order),
               shape.num_nodes)  # fmt: skip
    return most if buffer_slots is None else min(most, int(buffer_slots))


def fewer_in_flight(shape: ProcessShape, smallest_need: Callable[[ProcessShape], int],
                    allowed: int) -> tuple[ProcessShape | None, ProcessShape | None]:  # fmt: skip
    """The pipeline a plan that does not fit lowers ``shape``'s to: the least lowered of
    :func:`smaller_pipelines` whose smallest plan (``smallest_need``: its bytes at the peak) fits in
    ``allowed``, and the smallest pipeline (for the refusal); ``(None, smallest)`` where none fits,
    ``(None, None)`` where ``shape`` holds one batch of each already. One path for every plan: a
    homogeneous plan's smallest is its own, a heterogeneous one's the sum over its node types.

    >>> shape = ProcessShape(num_nodes=10, row_bytes=4, max_nodes_per_batch=5, max_edges_per_batch=5,
    ...                      num_samplers=2, num_extractors=2, extract_queue_size=3, train_queue_size=2)
    >>> lowered, smallest = fewer_in_flight(shape, lambda s: 100 * s.batches_in_flight, 800)
    >>> lowered.batches_in_flight, smallest.batches_in_flight
    (8, 6)
    """
    pipelines = smaller_pipelines(shape)
    if not pipelines:
        return None, None
    i = largest_where(0, len(pipelines) - 1, lambda j: smallest_need(pipelines[j]) <= allowed)
    return (pipelines[i] if i is not None else None), pipelines[0]


def check_fits(shape: ProcessShape, *, host_rows: int, buffer_slots: int, min_slots: int, staging_bytes: int,
               limit: MemoryLimit, reserve: int | None = None, processes: int = 1, order: str | None = None,
               warn: bool = True) -> MemoryFit:  # fmt: skip
    """Fit the plan into ``limit``, shrinking the host cache, then (CPU) the feature buffer, then the pipeline, or refuse.

    The peak of :func:`host_tally` plus ``reserve`` (default :func:`training_reserve`)
    must fit into this process's share of what is available (``limit.bytes /
    processes``: ranks of one machine plan at the same time, under the same limit).
    If it does not, the host cache gets the rows that fit; if none fit, the feature
    buffer on CPU shrinks towards ``min_slots``. If even that does not fit and ``order``
    is given (the pipeline's order: its batches in flight may be lowered), the pipeline
    holds fewer batches: the least lowered of :func:`smaller_pipelines` whose smallest
    plan fits (the feature buffer's reserve shrinks with the extractors), and the host
    cache and buffer then get what fits beside it. One warning line says what was chosen
    and the settings that ask for it directly (``warn=False``: the caller logs
    :meth:`MemoryFit.warning` itself, once the sizes are final). Only where the smallest
    plan of the smallest pipeline does not fit, :class:`~lightning_ooc.errors.InputError`
    says what the plan needs and what to shrink.

    >>> shape = ProcessShape(num_nodes=100_000, row_bytes=4096, max_nodes_per_batch=5_000,
    ...                      max_edges_per_batch=20_000, train_nodes=1_000)
    >>> fit = check_fits(shape, host_rows=100_000, buffer_slots=50_000, min_slots=20_000,
    ...                  staging_bytes=8 << 20, limit=MemoryLimit(600 << 20, "a test"))
    >>> fit.host_rows < 100_000, fit.buffer_slots, fit.shrunk[0].split(" (")[0]
    (True, 50000, 'host_cache shrunk from 390.62 MiB to 157.82 MiB')
    >>> check_fits(shape, host_rows=0, buffer_slots=50_000, min_slots=20_000, staging_bytes=8 << 20,
    ...            limit=MemoryLimit(100 << 20, "a test"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.InputError: the plan does not fit in memory: ...
    >>> fit = check_fits(shape, host_rows=0, buffer_slots=50_000, min_slots=20_000, staging_bytes=8 << 20,
    ...                  limit=MemoryLimit(300 << 20, "a test"), order="out_of_order", warn=False)
    >>> fit.pipeline, fit.min_slots, fit.shrunk[-1]
    ({'extract_queue_size': 1, 'train_queue_size': 1, 'num_samplers': 3, 'num_extractors': 3}, 15000, 'pipeline shrunk from 4 samplers, queues 6/4, 4 extractors: 20 batches in flight to 3 samplers, queues 1/1, 3 extractors: 10 batches in flight')
    """
    default_reserve = reserve is None
    reserve = training_reserve(shape.max_nodes_per_batch, shape.negatives) if reserve is None else int(reserve)
    keep_reserve(reserve)
    processes = max(1, int(processes))

    tally = host_tally(shape, host_rows=host_rows, buffer_slots=buffer_slots, staging_bytes=staging_bytes)
    if limit.unlimited:
        return MemoryFit(host_rows, buffer_slots, tally, limit, UNLIMITED, reserve, shape=shape,
                         staging_bytes=staging_bytes, min_slots=min_slots)  # fmt: skip
    allowed = limit.bytes // processes - reserve
    share = f", a 1/{processes} share for each of {processes} processes" if processes > 1 else ""
    why = (f"{limit}{share}; as asked, the plan needs {human_bytes(tally.peak)} at its peak ({tally.peak_phase}) "
           f"+ {human_bytes(reserve)} kept for training")  # fmt: skip
    fit = MemoryFit(host_rows, buffer_slots, tally, limit, allowed, reserve, shape=shape, staging_bytes=staging_bytes,
                    asked_host_rows=host_rows, asked_slots=buffer_slots, asked_shape=shape, min_slots=min_slots,
                    why=why)  # fmt: skip
    if tally.peak <= allowed:
        return fit
    chosen, least = shape, min_slots
    got = _sizes(shape, host_rows, buffer_slots, min_slots, staging_bytes, allowed)
    smallest = None
    if got is None and order is not None:
        def reserve_of(s: ProcessShape) -> int:
            return buffer_reserve(s, order, buffer_slots)

        def smallest_need(s: ProcessShape) -> int:
            slots = reserve_of(s) if s.buffer_on_host else buffer_slots
            return host_tally(s, host_rows=0, buffer_slots=slots, staging_bytes=staging_bytes).peak

        lowered, smallest = fewer_in_flight(shape, smallest_need, allowed)
        if lowered is not None:
            chosen = lowered
            least = reserve_of(chosen)
            got = _sizes(chosen, host_rows, buffer_slots, least, staging_bytes, allowed)
    if got is None:
        s = smallest if smallest is not None else shape
        least = min_slots if s is shape else buffer_reserve(s, order or "out_of_order", buffer_slots)
        raise InputError(_refusal(s, limit, reserve, processes, host_rows, buffer_slots, least, staging_bytes,
                                  allowed, default_reserve, lowered=s is not shape))  # fmt: skip
    fit.shape, fit.min_slots = chosen, least
    fit.resize(*got)
    if warn:
        log.warning("%s", fit.warning())
    return fit


def _sizes(shape: ProcessShape, host_rows: int, buffer_slots: int, min_slots: int, staging_bytes: int,
           allowed: int) -> tuple[int, int] | None:
    """The largest host cache that fits beside the buffer asked; with none, (CPU) the largest buffer down to
    ``min_slots`` with no host cache; None where neither fits."""

    def need(h: int, sl: int) -> int:
        return host_tally(shape, host_rows=h, buffer_slots=sl, staging_bytes=staging_bytes).peak

    h = largest_where(0, host_rows, lambda x: need(x, buffer_slots) <= allowed)
    if h is not None:
        return h, buffer_slots
    if shape.buffer_on_host and min_slots < buffer_slots:
        slots = largest_where(min_slots, buffer_slots, lambda x: need(0, x) <= allowed)
        if slots is not None:
            return 0, slots
    return None


# -------------------------------------------------------------------------------------------------
# several plans in one process: a heterogeneous graph's chain of tiers per node type, one pipeline
# -------------------------------------------------------------------------------------------------
def _with_pipeline(shape: ProcessShape, pipeline: ProcessShape) -> ProcessShape:
    """``shape`` with the queues, samplers and extractors of ``pipeline``."""
    return replace(shape, **{k: getattr(pipeline, k) for k in PIPELINE_QUEUES + PIPELINE_THREADS})


@dataclass(frozen=True)
class PlanPart:
    """One of several plans that share a process and its pipeline (a node type's tiers), as :func:`check_fits`
    takes one plan: its shape (its own nodes per batch; the batch's edges in one part only), the sizes asked, the
    feature buffer's reserve for the pipeline of ``shape`` and the staging buffer.

    >>> part = PlanPart(ProcessShape(num_nodes=1000, row_bytes=64, max_nodes_per_batch=100, max_edges_per_batch=0),
    ...                 host_rows=500, buffer_slots=800, min_slots=400, staging_bytes=1 << 20)
    >>> part.smallest(part.shape, "out_of_order").peak < part.tally().peak
    True
    """

    shape: ProcessShape
    host_rows: int
    buffer_slots: int
    min_slots: int
    staging_bytes: int

    def tally(self, pipeline: ProcessShape | None = None) -> HostTally:
        """The sizes asked, with ``pipeline``'s queues, samplers and extractors (default: its own)."""
        shape = self.shape if pipeline is None else _with_pipeline(self.shape, pipeline)
        return host_tally(shape, host_rows=self.host_rows, buffer_slots=self.buffer_slots,
                          staging_bytes=self.staging_bytes)  # fmt: skip

    def slots_at(self, pipeline: ProcessShape, order: str | None) -> int:
        """The fewest slots of the feature buffer with ``pipeline``: its reserve on CPU, as asked on a GPU (only
        its tables are in host memory)."""
        if not self.shape.buffer_on_host:
            return self.buffer_slots
        if order is None or all(getattr(pipeline, k) == getattr(self.shape, k)
                                for k in PIPELINE_QUEUES + PIPELINE_THREADS):  # fmt: skip
            return self.min_slots
        return buffer_reserve(_with_pipeline(self.shape, pipeline), order, self.buffer_slots)

    def smallest(self, pipeline: ProcessShape, order: str | None) -> HostTally:
        """Its smallest plan with ``pipeline``: no host cache, the feature buffer at :meth:`slots_at`, its staging,
        per-node and per-slot tables and batches in flight."""
        return host_tally(_with_pipeline(self.shape, pipeline), host_rows=0,
                          buffer_slots=self.slots_at(pipeline, order), staging_bytes=self.staging_bytes)  # fmt: skip


@dataclass
class JointFit:
    """The outcome of :func:`fit_parts`: the pipeline every part runs with and each part's *room*, the bytes it may
    plan at its peak (its smallest plan, then its share of what is left); each part's sizes are then fitted
    into its room by :func:`check_fits`.

    >>> shape = ProcessShape(num_nodes=20_000, row_bytes=4096, max_nodes_per_batch=2_000, max_edges_per_batch=0)
    >>> big = PlanPart(shape, host_rows=10_000, buffer_slots=40_000, min_slots=20_000, staging_bytes=8 << 20)
    >>> small = PlanPart(replace(shape, num_nodes=50, max_nodes_per_batch=50), host_rows=50, buffer_slots=50,
    ...                  min_slots=50, staging_bytes=64 << 10)
    >>> joint = fit_parts({"paper": big, "fos": small}, limit=MemoryLimit(100 << 20, "a test"), reserve=0,
    ...                   order="out_of_order")  # as asked 234 MiB; the smallest plans alone 116 MiB
    >>> all(joint.rooms[t] >= joint.fixed[t] for t in joint.rooms), sum(joint.rooms.values()) <= joint.allowed
    (True, True)
    >>> joint.pipeline, joint.fixed["paper"] >> 20
    ({'extract_queue_size': 5}, 67)
    >>> fit_parts({"paper": big, "fos": small}, limit=MemoryLimit(30 << 20, "a test"), reserve=0,
    ...           order="out_of_order")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.InputError: the plan does not fit in memory: ... the smallest pipeline (1 sampler, queues 1/1, 1 extractor: 6 batches in flight) its 2 node types need 42.95 MiB at their peaks (paper ...
    """

    parts: dict[str, PlanPart]
    limit: MemoryLimit
    allowed: int  # bytes the parts may plan together (this process's share of the limit, less the reserve)
    reserve: int
    #: bytes each part may plan at its peak
    rooms: dict[str, int]
    #: each part's smallest plan with the pipeline chosen
    fixed: dict[str, int]
    #: the pipeline chosen and the one asked (of the first part: every part has the same)
    shape: ProcessShape
    asked_shape: ProcessShape
    #: what the parts need as asked (the sum of their peaks)
    need: int = 0
    why: str = ""

    @property
    def pipeline(self) -> dict[str, int]:
        """The pipeline's settings lowered to fit, with their new values (empty: as asked)."""
        return _lowered(self.asked_shape, self.shape)

    def warning(self, fits: Mapping[str, MemoryFit], label: str = "node type") -> str | None:
        """The one line that says what was changed to fit (``fits``: each part's final sizes) and the settings
        that ask for it directly (None: nothing was). Budgets are named by their totals over the parts."""
        shrunk = []
        if self.pipeline:
            shrunk.append(f"pipeline shrunk from {_pipeline(self.asked_shape)} to {_pipeline(self.shape)}")
        host = {"asked": 0, "now": 0}
        gpu = {"asked": 0, "now": 0}
        for name, fit in fits.items():
            rb = fit.tally_row_bytes
            host["asked"] += (fit.host_rows if fit.asked_host_rows is None else fit.asked_host_rows) * rb
            host["now"] += fit.host_rows * rb
            gpu["asked"] += (fit.buffer_slots if fit.asked_slots is None else fit.asked_slots) * rb
            gpu["now"] += fit.buffer_slots * rb
            mine = [line.split(" (")[0] for line in fit.shrunk if not line.startswith("pipeline")]
            if mine:
                shrunk.append(f"{label} {name}: {', '.join(mine)}")
        if not shrunk:
            return None
        settings = [f"features.{k}={budget_setting(v['now'])}" for k, v in (("host_cache", host), ("gpu_cache", gpu))
                    if v["now"] != v["asked"]] + [f"pipeline.{k}={v}" for k, v in self.pipeline.items()]  # fmt: skip
        ask = ", ".join(settings[:-1]) + " and " + settings[-1] if len(settings) > 1 else settings[0]
        return f"lightning_ooc: {'; '.join(shrunk)} to fit in memory: {self.why}; set {ask} to plan this without a warning"

    def format(self, fits: Mapping[str, MemoryFit]) -> str:
        """The plan's memory line: what the parts plan together at their peaks, of the limit."""
        planned = sum(f.need for f in fits.values())
        what = f"planned at the peaks of {len(fits)} node types"
        if self.limit.unlimited:
            return f"  host memory     {human_bytes(planned):>11}  {what}, {self.limit}"
        return (f"  host memory     {human_bytes(planned):>11}  {what} + {human_bytes(self.reserve)} reserve, "
                f"of {self.limit}")  # fmt: skip


def _lowered(old: ProcessShape | None, new: ProcessShape | None) -> dict[str, int]:
    if old is None or new is None:
        return {}
    return {k: getattr(new, k) for k in PIPELINE_QUEUES + PIPELINE_THREADS if getattr(new, k) != getattr(old, k)}


def fit_parts(parts: Mapping[str, PlanPart], *, limit: MemoryLimit, reserve: int, processes: int = 1,
              order: str | None = None) -> JointFit:  # fmt: skip
    """Fit several plans of one process (a node type's tiers each, one pipeline for all) into ``limit`` together.

    Every part's smallest plan (:meth:`PlanPart.smallest`: what the part needs whatever its budgets) is placed
    first; where their sum does not fit, the pipeline is lowered as :func:`check_fits` lowers a single plan's
    (:func:`fewer_in_flight` over the sum; ``order``: the pipeline's order, None: it may not be lowered). Only
    what is left then goes to the parts' budgets (host cache, a CPU feature buffer above its reserve), in
    proportion to what each asked beyond its smallest plan, so no part's cache grows into what another part
    needs. The rooms add up to at most the limit (less ``reserve``, counted once for the process). Where even
    the smallest plans with the smallest pipeline do not fit, :class:`~lightning_ooc.errors.InputError` gives
    the figures per part and what to shrink.
    """
    names = list(parts)
    if not names:
        raise ValueError("fit_parts needs at least one plan")
    asked = parts[names[0]].shape
    keep_reserve(int(reserve))
    processes = max(1, int(processes))
    need = {t: p.tally().peak for t, p in parts.items()}
    if limit.unlimited:
        return JointFit(dict(parts), limit, UNLIMITED, reserve, {t: UNLIMITED for t in names}, need, asked, asked,
                        sum(need.values()))  # fmt: skip
    allowed = limit.bytes // processes - int(reserve)
    share = f", a 1/{processes} share for each of {processes} processes" if processes > 1 else ""
    why = (f"{limit}{share}; as asked, the plan needs {human_bytes(sum(need.values()))} at the peaks of its "
           f"{len(names)} node types + {human_bytes(reserve)} kept for training")  # fmt: skip

    def fixed_at(pipeline: ProcessShape) -> dict[str, int]:
        return {t: p.smallest(pipeline, order).peak for t, p in parts.items()}

    chosen = asked
    if sum(need.values()) > allowed and sum(fixed_at(asked).values()) > allowed:
        lowered = smallest = None
        if order is not None:
            lowered, smallest = fewer_in_flight(asked, lambda s: sum(fixed_at(s).values()), allowed)
        if lowered is None:
            raise InputError(_parts_refusal(parts, smallest or asked, order, limit, int(reserve), processes, allowed,
                                            lowered=smallest is not None))  # fmt: skip
        chosen = lowered
    fixed = fixed_at(chosen)
    want = {t: max(p.tally(chosen).peak, fixed[t]) for t, p in parts.items()}
    left = allowed - sum(fixed.values())
    extra = {t: want[t] - fixed[t] for t in names}
    total = sum(extra.values())
    if total <= left:  # everything asked fits: what is left over is shared the same way
        more = left - total
        rooms = {t: want[t] + (more * extra[t] // total if total else more // len(names)) for t in names}
    else:
        rooms = {t: fixed[t] + left * extra[t] // total for t in names}
    return JointFit(dict(parts), limit, allowed, int(reserve), rooms, fixed, chosen, asked, sum(need.values()), why)


def _pipeline_fixes(groups: Mapping[str, int], shape: Any, lowered: bool, batch: str, *, staging_over: int,
                    staging_where: str, slots: str) -> list[str]:  # fmt: skip
    """What a refusal suggests about the staging, the batches, the pipeline and the feature buffer's tables:
    ``groups`` are the planned bytes by group, ``shape`` the pipeline (``batches_in_flight``,
    ``buffer_on_host``), ``lowered`` whether it was lowered already, ``batch`` what the batches hold."""
    fixes = []
    if groups.get("staging", 0) > staging_over:
        fixes.append(f"lower features.staging ({human_bytes(groups['staging'])} {staging_where}; 1MiB is enough)")
    fixes.append(f"lower batch_size / num_neighbors ({batch})")
    if not lowered and shape.batches_in_flight > ProcessShape.smallest_in_flight():
        fixes.append(f"lower pipeline.num_samplers / extract_queue_size / train_queue_size / num_extractors "
                     f"({shape.batches_in_flight} batches in flight)")  # fmt: skip
    if not shape.buffer_on_host and groups.get("per-slot", 0) > (16 << 20):
        fixes.append(f"lower features.gpu_cache ({slots} keep {human_bytes(groups['per-slot'])} of tables in host memory)")
    return fixes


def _parts_refusal(parts: Mapping[str, PlanPart], pipeline: ProcessShape, order: str | None, limit: MemoryLimit,
                   reserve: int, processes: int, allowed: int, lowered: bool) -> str:  # fmt: skip
    """:func:`_refusal` for several parts: the smallest plans' sum and each part's, and what to shrink."""
    groups: dict[str, int] = {}
    each, total, nodes = [], 0, 0
    for name, part in parts.items():
        small = part.smallest(pipeline, order)
        total += small.peak
        nodes += part.shape.max_nodes_per_batch
        each.append(f"{name} {human_bytes(small.peak)}")
        for group, size in small.groups().items():
            groups[group] = groups.get(group, 0) + size
    over = total - allowed
    what = ", ".join(f"{g} {human_bytes(groups[g])}" for g in ("per-node", "heap slack", "per-slot", "buffer",
                                                                 "staging", "batches", "negatives") if groups.get(g))
    reserves = sum(part.slots_at(pipeline, order) * part.shape.row_bytes for part in parts.values())
    batch = f"batches of up to {nodes:,} nodes of all types: {human_bytes(groups.get('batches', 0))} in flight"
    if pipeline.buffer_on_host:
        batch += f", feature buffer reserves of {human_bytes(reserves)}"
    fixes = _pipeline_fixes(groups, pipeline, lowered, batch, staging_over=len(parts) * (1 << 20),
                            staging_where="over the node types now", slots="its slots")  # fmt: skip
    fixes.append(f"raise the memory limit by {human_bytes(over * processes)}")
    fixes.append("set memory_limit=None to skip this check (the kernel may then kill the run)")
    held = (f"; this process already holds {human_bytes(limit.rss)} (anonymous and shared memory, mapped code and "
            "libraries)" if limit.rss else "")  # fmt: skip
    share = f" (1/{processes} of it per process: {processes} processes plan at once)" if processes > 1 else ""
    tried = "no host cache" + (", the smallest feature buffers" if pipeline.buffer_on_host else "") + (
        f" and the smallest pipeline ({_pipeline(pipeline)})" if lowered else "")
    return (f"the plan does not fit in memory: {limit}{share}{held}; even with {tried} its {len(parts)} node types "
            f"need {human_bytes(total)} at their peaks ({', '.join(each)}; {what}) + {human_bytes(reserve)} kept "
            f"for training, {human_bytes(over)} too much; to fit, " + ", or ".join(fixes))


def _negatives_cost(shape: ProcessShape, slots: int, staging_bytes: int, reserve: int | None) -> int:
    """The peak of the smallest plan with these negatives, plus the reserve (default: with its share for them)."""
    tally = host_tally(shape, host_rows=0, buffer_slots=slots, staging_bytes=staging_bytes)
    return tally.peak + (training_reserve(shape.max_nodes_per_batch, shape.negatives) if reserve is None
                         else reserve)  # fmt: skip


def _fewer_negatives(shape: ProcessShape, slots: int, staging_bytes: int, room: int, reserve: int | None) -> str | None:
    """How far to lower a link batch's negatives for the smallest plan to fit in ``room`` (reserve included),
    or None (no negatives, or none too many: nothing else would fit even without them)."""
    neg = shape.negatives
    if neg is None or not neg.count:
        return None

    def fits(n: BatchNegatives) -> bool:
        return _negatives_cost(replace(shape, negatives=n), slots, staging_bytes, reserve) <= room

    if not fits(replace(neg, per_edge=0)):
        return None
    none = replace(shape, negatives=None)
    cost = (_negatives_cost(shape, slots, staging_bytes, reserve)
            - _negatives_cost(none, slots, staging_bytes, None if reserve is None else reserve))  # fmt: skip
    scale = 100 if neg.mode == "binary" else 1  # a ratio to two decimals; whole negatives per edge
    amount = largest_where(0, int(neg.per_edge * scale), lambda a: fits(replace(neg, per_edge=a / scale)))
    edges = largest_where(1, neg.edges, lambda b: fits(replace(neg, edges=b)))
    ways = []
    if amount and neg.per_edge_option == "neg_sampling amount":
        ways.append(f"{neg.per_edge_option}={amount / scale:g} with {neg.edges_option}={neg.edges:,}")
    if edges:
        ways.append(f"{neg.edges_option}={edges:,} with {neg.per_edge_option}={neg.per_edge:g}")
    what = f"lower {neg.per_edge_option} or {neg.edges_option}" if neg.per_edge_option == "neg_sampling amount" \
        else f"lower {neg.edges_option}"
    fit = f"; at most {', or '.join(ways)}, fits" if ways else ""
    scores = (f", and {human_bytes(RESERVE_PER_NEGATIVE[neg.mode])} each kept for the model's scores" if reserve is None
              else "")  # fmt: skip
    return (f"{what} ({neg.describe()}, {human_bytes(cost)} with what they take: indices in every batch in flight, "
            f"the samplers drawing them{scores}{fit})")  # fmt: skip


def check_negatives(shape: ProcessShape, limit: MemoryLimit, processes: int = 1) -> None:
    """Refuse a link batch's negatives that cannot fit, before anything is sampled to plan with.

    The presample draws hundreds of batches with their negatives (minutes, and a batch of 5M
    negatives is ~300 MiB to draw), so the plan cannot wait for it to see them. ``shape`` is a
    lower bound of the plan's (no host cache, buffer or staging; nodes and edges per batch as
    known before the presample, e.g. 0): when it fits without the negatives and not with them,
    :class:`~lightning_ooc.errors.InputError` says so, with the numbers and how far to lower
    ``neg_sampling`` amount or ``batch_size``. Otherwise the plan decides later.

    >>> shape = ProcessShape(num_nodes=20_000, row_bytes=128, max_nodes_per_batch=0, max_edges_per_batch=0,
    ...                      negatives=BatchNegatives(512, 1000))
    >>> check_negatives(shape, MemoryLimit(600 << 20, "a test"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.InputError: the plan does not fit in memory: ... at most neg_sampling amount=214 with batch_size=512, or batch_size=110 with ...
    """
    if limit.unlimited or shape.negatives is None or not shape.negative_count:
        return
    processes = max(1, int(processes))
    room = limit.bytes // processes
    need = _negatives_cost(shape, 0, 0, None)
    if need <= room or _negatives_cost(replace(shape, negatives=None), 0, 0, None) > room:
        return
    fix = _fewer_negatives(shape, 0, 0, room, None)
    share = f" (1/{processes} of it per process: {processes} processes plan at once)" if processes > 1 else ""
    held = (f"; this process already holds {human_bytes(limit.rss)} (anonymous and shared memory, mapped code and "
            "libraries)" if limit.rss else "")  # fmt: skip
    raise InputError(
        f"the plan does not fit in memory: {limit}{share}{held}; a link batch's negatives alone take it past that: "
        f"{human_bytes(need)} at least with them, {human_bytes(need - room)} too much; to fit, {fix}, or raise the "
        f"memory limit by {human_bytes((need - room) * processes)}, or set memory_limit=None to skip this check "
        "(the kernel may then kill the run)"
    )


def budget_setting(nbytes: int) -> str:
    """A byte count as a budget setting, rounded down (``"167MiB"``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0 or nbytes >= 10 << shift:
            return f"{nbytes >> shift}{unit}"
    return str(int(nbytes))


def _refusal(shape: ProcessShape, limit: MemoryLimit, reserve: int, processes: int, host_rows: int,
             buffer_slots: int, min_slots: int, staging_bytes: int, allowed: int,
             default_reserve: bool = False, lowered: bool = False) -> str:  # fmt: skip
    """One line: the limit and its source, the smallest plan broken down, and what to shrink by how much.
    ``lowered``: ``shape`` is the smallest pipeline, tried already."""
    rb = shape.row_bytes
    slots = min_slots if shape.buffer_on_host else buffer_slots
    small = host_tally(shape, host_rows=0, buffer_slots=slots, staging_bytes=staging_bytes)
    phase = small.peak_phase
    g = small.groups(phase)
    over = small.peak - allowed
    parts = [f"per-node structures for {shape.num_nodes:,} nodes {human_bytes(g.get('per-node', 0))}"]
    for name in ("heap slack", "per-slot", "buffer", "host cache", "staging", "batches", "negatives"):
        if g.get(name):
            parts.append(f"{name} {human_bytes(g[name])}")
    fixes = []
    fewer = _fewer_negatives(shape, slots, staging_bytes, allowed + reserve, None if default_reserve else reserve)
    if fewer:
        fixes.append(fewer)
    if phase != "choosing hot rows":  # counts of one per node: no budget makes them smaller
        batch = f"batches of up to {shape.max_nodes_per_batch:,} nodes: {human_bytes(g.get('batches', 0))} in flight"
        if shape.buffer_on_host:
            batch += f", a feature buffer reserve of {human_bytes(min_slots * rb)}"
        fixes += _pipeline_fixes(g, shape, lowered, batch, staging_over=1 << 20, staging_where="now",
                                 slots=f"its {buffer_slots:,} slots")  # fmt: skip
    fixes.append(f"raise the memory limit by {human_bytes(over * processes)}")
    fixes.append("set memory_limit=None to skip this check (the kernel may then kill the run)")
    held = (f"; this process already holds {human_bytes(limit.rss)} (anonymous and shared memory, mapped code and "
            "libraries)" if limit.rss else "")  # fmt: skip
    share = f" (1/{processes} of it per process: {processes} processes plan at once)" if processes > 1 else ""
    asked = f"host_cache {human_bytes(host_rows * rb)}, gpu_cache {human_bytes(buffer_slots * rb)}"
    tried = ["no host cache"] + ([f"the smallest feature buffer ({min_slots:,} slots)"] if shape.buffer_on_host
                                 else []) + ([f"the smallest pipeline ({_pipeline(shape)})"] if lowered else [])
    smallest = " and ".join([", ".join(tried[:-1]), tried[-1]]) if len(tried) > 1 else tried[0]
    return (
        f"the plan does not fit in memory: {limit}{share}{held}; even with {smallest}"
        + f" it needs {human_bytes(small.peak)} while {phase} ({', '.join(parts)}) + {human_bytes(reserve)} "
        f"kept for training, {human_bytes(over)} too much (asked: {asked}); to fit, "
        + ", or ".join(fixes)
    )
