"""What each part of a plan needs in host memory: what the datamodule allocates from the plan on, phase by phase, as
a function of the dataset and the pipeline's shape (:class:`ProcessShape`, :func:`host_tally`), with the sizes of
what no budget covers, the feature buffer's reserve (:func:`buffer_reserve`) and the reserve kept free for the rest
of training (:func:`training_reserve`). The planner (:mod:`lightning_ooc.store.planner`) fits these under the limit
(:mod:`lightning_ooc.store.limits`).

:func:`host_tally` counts the byte budgets that live in host memory, and what comes with them that no budget covers,
mostly arrays of one entry per node of the graph, phase by phase (choosing the host cache's rows, simulating the
buffer, building the store, training). The items held before the plan (``indptr``, the reader's I/O slots, the
presample) are listed too, for the record; they are already in the usage the limit subtracts.

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
:func:`~lightning_ooc.store.planner.check_negatives` refuses negatives past the limit before the presample draws any.

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

    >>> shape = ProcessShape(num_nodes=1000, row_bytes=64, max_nodes_per_batch=100, max_edges_per_batch=300,
    ...                      train_nodes=100)
    >>> tally = host_tally(shape, host_rows=0, buffer_slots=256, staging_bytes=1 << 20)
    >>> isinstance(tally, HostTally), tally.peak_phase
    (True, 'training')
    >>> item = tally.phases["training"][0]  # one allocation of the phase
    >>> isinstance(item, MemoryItem), item.bytes > 0
    (True, True)
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

from lightning_ooc.data.format import human_bytes
from lightning_ooc.store.feature_buffer import required_slots
from lightning_ooc.store.host_cache import RANK_CHUNK

log = logging.getLogger("lightning_ooc")


#: kept free for what no plan can see (see :func:`training_reserve`): Lightning's fit loop, the model,
#: its optimizer state, imports made when training starts, allocator fragmentation
RESERVE_FIXED = 128 << 20
#: ... and the activations of the batch being trained, per node of the largest planned batch
RESERVE_PER_BATCH_NODE = 4096
#: ... and the model's scores of a link batch's negatives, per negative: a triplet's destination, a binary
#: pair (two embeddings gathered); see :func:`training_reserve`
RESERVE_PER_NEGATIVE = {"triplet": 4096, "binary": 6144}
#: glibc's heap retention of freed per-node temporaries (the ``bincount`` of every presampled batch,
#: the float64 scores) while they are below its 32 MiB mmap threshold: the worst seen, 69 B at 3M nodes
HEAP_SLACK_PER_NODE = 72
#: glibc's largest dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
_MMAP_THRESHOLD_MAX = 32 << 20
#: bytes per node of a batch in flight: n_id, y (8 + 8) and the store's leases (positions, slots, masks)
BATCH_BYTES_PER_NODE = 64
#: bytes per edge of a batch in flight: edge_index (2 x int64)
BATCH_BYTES_PER_EDGE = 16
#: bytes per edge of a batch in flight that carries ``e_id`` as well (``return_e_id``: one int64 more)
BATCH_BYTES_PER_EDGE_WITH_ID = BATCH_BYTES_PER_EDGE + 8
#: the reader's largest merged read (a slot of its I/O buffers); see ``ext/io/reader.c``
READER_SLOT_BYTES = 128 << 10
#: bytes per negative of a link batch in flight: its int64 index into ``n_id`` (triplet:
#: ``dst_neg_index``; binary: the pair's two in ``edge_label_index`` and its float32 label)
NEGATIVE_HELD_BYTES = {"triplet": 8, "binary": 20}
#: bytes per negative id a sampler thread allocates while it draws a batch's negatives: the ids, the seed
#: set they join (``torch.cat``), ``unique``'s sort (values and order) and its inverse (51 B measured)
NEGATIVE_SAMPLING_BYTES_PER_ID = 56


@dataclass(frozen=True)
class MemoryItem:
    """One allocation: ``group`` is "per-node", "per-slot", "buffer", "host cache", "staging",
    "batches", "negatives" or "heap slack"."""

    group: str
    what: str
    bytes: int


@dataclass
class HostTally:
    """Host memory of one process from the plan on, phase by phase, and what was held before it."""

    num_nodes: int
    phases: dict[str, list[MemoryItem]]
    held: list[MemoryItem] = field(default_factory=list)

    def total(self, phase: str) -> int:
        return sum(i.bytes for i in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        """The phase that needs the most (the first of equals)."""
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        """Bytes the plan still allocates at its peak (compare with :attr:`MemoryLimit.bytes`)."""
        return self.total(self.peak_phase)

    @property
    def held_bytes(self) -> int:
        return sum(i.bytes for i in self.held)

    @property
    def per_node_bytes(self) -> int:
        """Bytes of per-node structures (and the heap slack they leave) at the peak phase."""
        return sum(i.bytes for i in self.phases[self.peak_phase] if i.group in ("per-node", "heap slack"))

    def groups(self, phase: str | None = None) -> dict[str, int]:
        """Bytes per group in ``phase`` (default: the peak)."""
        out: dict[str, int] = {}
        for i in self.phases[phase or self.peak_phase]:
            out[i.group] = out.get(i.group, 0) + i.bytes
        return out

    def format(self) -> str:
        """Every phase with its items, and what was held before the plan (for logs and reports)."""
        lines = []
        for name, items in [("held before the plan", self.held)] + list(self.phases.items()):
            mark = " (peak)" if name == self.peak_phase else ""
            lines.append(f"{name}: {human_bytes(sum(i.bytes for i in items))}{mark}")
            lines += [f"  {i.group:10s} {human_bytes(i.bytes):>11}  {i.what}" for i in items if i.bytes]
        return "\n".join(lines)


@dataclass(frozen=True)
class BatchNegatives:
    """The negatives of the largest link minibatch: ``edges`` positive edges, ``per_edge`` negatives each.

    ``mode`` is ``"triplet"`` (a destination per negative, ``per_edge`` whole) or ``"binary"`` (a
    source-destination pair and a label per negative, ``per_edge`` a ratio); ``edges_option`` and
    ``per_edge_option`` say how they are set (``"batch_size"``, ``"neg_sampling amount"``; given
    negatives: the split's own, which only a smaller batch makes fewer).

    >>> neg = BatchNegatives(512, 1000)
    >>> neg.count, neg.ids, neg.describe()
    (512000, 512000, 'batch_size=512 x neg_sampling amount=1000 (triplet): 512,000 negatives per batch')
    """

    edges: int
    per_edge: float
    mode: str = "triplet"
    edges_option: str = "batch_size"
    per_edge_option: str = "neg_sampling amount"

    @property
    def count(self) -> int:
        """Negatives of the batch (as :meth:`~lightning_ooc.sampling.negative.NegativeSampling.count`)."""
        if self.mode == "binary":
            return math.ceil(self.edges * self.per_edge)
        return int(self.edges) * int(self.per_edge)

    @property
    def ids(self) -> int:
        """Node ids the negatives draw (a binary pair has two)."""
        return 2 * self.count if self.mode == "binary" else self.count

    @property
    def reserve(self) -> int:
        """What the model's scores of them take (:data:`RESERVE_PER_NEGATIVE` each)."""
        return RESERVE_PER_NEGATIVE[self.mode] * self.count

    def describe(self) -> str:
        return (f"{self.edges_option}={self.edges:,} x {self.per_edge_option}={self.per_edge:g} ({self.mode}): "
                f"{self.count:,} negatives per batch")  # fmt: skip


@dataclass(frozen=True)
class ProcessShape:
    """What, besides the byte budgets, decides the host memory of one process.

    Attributes:
        num_nodes, row_bytes: of the dataset.
        max_nodes_per_batch, max_edges_per_batch: of the largest planned minibatch
            (see :func:`edges_per_batch_bound`).
        buffer_on_host: the feature buffer's rows live in host memory (training on CPU).
        num_samplers, num_extractors, extract_queue_size, train_queue_size: the pipeline.
        host_cache_policy: "presample" or "degree" (their temporaries differ).
        background_fill: the host cache is ranked and estimated while training runs, and keeps its rows from the
            buffer's reads (:mod:`lightning_ooc.store.background`): the larger phase counts in training too.
        topology_shared: ``indptr`` lives in node-shared memory (the "ooc" strategy).
        train_nodes, eval_nodes: seeds of the training split and of validation + test
            (``None``: every node is a training seed, the most it can be); link prediction:
            edges of its link splits.
        seed_order_bytes, seeds_held_bytes, eval_seed_bytes: bytes per training seed of an
            epoch's order (node ids: ``randperm`` int64 and the shuffled copy, 16; link edge
            positions: the int32 permutation itself, 4), per training seed held all along (node
            ids 8; positions 0: they are a count) and per evaluation seed of a pass (node ids 8;
            positions 4, an int32 ``arange``).
        reader_workers, reader_queue_depth, presampled_nodes: for the record of what was held
            before the plan.
        negatives: of the largest link minibatch (:class:`BatchNegatives`; ``None``: no link batches).
        edge_bytes: bytes per edge of a batch in flight (``edge_index``; with ``e_id``, 8 more).
    """

    num_nodes: int
    row_bytes: int
    max_nodes_per_batch: int
    max_edges_per_batch: int
    buffer_on_host: bool = True
    num_samplers: int = 4
    num_extractors: int = 4
    extract_queue_size: int = 6
    train_queue_size: int = 4
    host_cache_policy: str = "presample"
    background_fill: bool = False
    topology_shared: bool = False
    train_nodes: int | None = None
    eval_nodes: int = 0
    reader_workers: int = 0
    reader_queue_depth: int = 0
    presampled_nodes: int = 0
    seed_order_bytes: int = 16
    seeds_held_bytes: int = 8
    eval_seed_bytes: int = 8
    negatives: BatchNegatives | None = None
    edge_bytes: int = BATCH_BYTES_PER_EDGE

    @property
    def negative_count(self) -> int:
        return self.negatives.count if self.negatives is not None else 0

    @property
    def batches_in_flight(self) -> int:
        """Sampled batches alive at once: being sampled, queued, extracted, trained (with Lightning's prefetch)."""
        return self.num_samplers + self.extract_queue_size + self.num_extractors + self.train_queue_size + 2

    @staticmethod
    def smallest_in_flight() -> int:
        """Batches in flight with one sampler, one extractor and queues of one: the fewest a pipeline holds."""
        return 1 + 1 + 1 + 1 + 2


def edges_per_batch_bound(batch_size: int | None, num_neighbors: Sequence[int] | None, max_nodes: int,
                          num_edges: int | None = None, replace: bool = False) -> int:  # fmt: skip
    """An upper bound of the edges of one sampled batch.

    Each node is in one hop's frontier at most and adds at most that hop's fanout of edges,
    so ``E <= max_nodes * max(fanout)`` and ``E <= batch_size * sum_h prod_{i<=h} fanout_i``;
    without replacement an edge is drawn once at most (``E <= num_edges``). Without a fanout,
    10 edges per node (GNNDrive's fanout) is assumed.

    >>> edges_per_batch_bound(1000, [10, 5], max_nodes=40_000)
    60000
    >>> edges_per_batch_bound(1000, [-1], max_nodes=40_000, num_edges=30_000)
    30000
    """
    bound = math.inf
    if num_neighbors is not None and len(num_neighbors):
        fan = [int(f) for f in num_neighbors]
        if all(f >= 0 for f in fan):
            bound = min(bound, max_nodes * max(fan))
            if batch_size is not None:
                reach, tree = int(batch_size), 0
                for f in fan:
                    reach *= f
                    tree += reach
                bound = min(bound, tree)
    else:
        bound = max_nodes * 10
    if num_edges is not None and not replace:
        bound = min(bound, int(num_edges))
    if bound == math.inf:  # all neighbours with replacement and no edge count: as many as nodes x 10
        bound = max_nodes * 10
    return int(bound)


def _vec_cap(n: int) -> int:
    """Capacity the sampler's growable arrays reach for ``n`` items (1024 doubled)."""
    c = 1024
    while c < n:
        c *= 2
    return c


def sampler_workspace_bytes(max_nodes: int, max_edges: int, num_nodes: int) -> int:
    """One sampling thread's workspace at its largest (``ext/sampler/sampler.cpp``).

    Edge positions, targets and sources (3 x int64 per edge), the node list, and the
    open-addressing node map (16 B per entry, at most half full, power of two; 1.5 x while
    it grows). Each thread keeps it for its next call.

    >>> sampler_workspace_bytes(40_000, 60_000, 3_000_000) >> 20
    8
    """
    m, e = int(max_nodes), int(max_edges)
    entries = min(m + e, num_nodes)
    need = 2 * max(entries, 1)
    slots = 16
    while slots < need:
        slots *= 2
    return 8 * (3 * _vec_cap(e) + _vec_cap(m + e)) + 16 * slots * 3 // 2


def rank_bytes(num_nodes: int, k: int, ordered: bool = True) -> int:
    """Temporaries of :func:`~lightning_ooc.store.host_cache.top_k` ranking ``k`` of ``num_nodes`` nodes: about six
    int64 arrays of a chunk (keys, counts and degrees as int64, masks, positions) and three of ``k`` (the running
    partition and its copy; the ids kept), two more to order them hottest first."""
    return 48 * min(int(num_nodes), RANK_CHUNK) + (40 if ordered else 24) * int(k)


def host_tally(shape: ProcessShape, *, host_rows: int, buffer_slots: int, staging_bytes: int) -> HostTally:
    """Host memory the datamodule allocates from the plan on, phase by phase (see the module docstring).

    >>> shape = ProcessShape(num_nodes=1_000_000, row_bytes=128, max_nodes_per_batch=20_000,
    ...                      max_edges_per_batch=50_000, train_nodes=10_000)
    >>> t = host_tally(shape, host_rows=100_000, buffer_slots=200_000, staging_bytes=8 << 20)
    >>> list(t.phases)
    ['choosing hot rows', 'simulating the buffer', 'building the store', 'training']
    >>> t.groups("building the store")["per-node"] // 1_000_000, t.groups("training")["per-node"] // 1_000_000
    (10, 8)
    """
    n, rb, k, s = int(shape.num_nodes), int(shape.row_bytes), int(host_rows), int(buffer_slots)
    m, e = int(shape.max_nodes_per_batch), int(shape.max_edges_per_batch)
    idx = 4 if s < 2**31 else 8  # FeatureBuffer.node2slot: int32 while slot numbers fit
    presample = shape.host_cache_policy == "presample"
    train = n if shape.train_nodes is None else int(shape.train_nodes)
    slot_tables = 8 + 8 + 4 + 1 + 1 + 2 * 2 * 8  # slot2node, stamp, refcount, valid, failed, FIFO (2 s + 16 pairs)
    node = "per-node"

    # glibc: freed blocks below its mmap threshold (which grows to the largest freed block, up to
    # 32 MiB) stay in the heap; per-node arrays of 8 B cross it at N = 4M
    slack = HEAP_SLACK_PER_NODE * n if 8 * n < _MMAP_THRESHOLD_MAX else 0
    heap = [MemoryItem("heap slack", "freed per-node temporaries glibc keeps in its heap (arrays < 32 MiB)", slack)]

    # choose_hot: int16 access counts, then top_k's two chunked passes (the in-degree a slice at a time)
    hot: list[MemoryItem] = []
    if presample:
        hot.append(MemoryItem(node, "access counts over the presampled batches (int16)", 2 * n))
    if k:
        hot.append(MemoryItem("host cache", f"ranking: keys of {min(n, RANK_CHUNK):,} nodes at a time, the "
                              f"{k:,} largest and their ids", rank_bytes(n, k)))  # fmt: skip
    hot += heap

    counts = [MemoryItem(node, "access counts (held until setup ends)", 2 * n)] if presample else []
    sim = counts + [
        MemoryItem("host cache", f"ids of the {k:,} hot rows", 8 * k),
        MemoryItem(node, "buffer simulation: in-host mask, node -> slot", (1 + idx) * n),
        MemoryItem("per-slot", f"buffer simulation: tables of {s:,} slots", (slot_tables + 1) * s + 256),
    ] + heap

    store = [
        MemoryItem(node, f"feature buffer node -> slot (int{8 * idx}) of {n:,} nodes", idx * n),
        MemoryItem(node, f"host cache node -> row map (int32) of {n:,} nodes", 4 * n),
        MemoryItem("per-slot", f"feature buffer tables of {s:,} slots", slot_tables * s + 256),
        MemoryItem("host cache", f"{k:,} rows of {rb} B", k * rb),
        MemoryItem("host cache", "ids of the hot rows", 8 * k),
        MemoryItem("staging", "staging buffer", int(staging_bytes)),
    ]
    if shape.buffer_on_host:
        store.append(MemoryItem("buffer", f"feature buffer: {s:,} rows of {rb} B (host memory on CPU)", s * rb))
    load = [MemoryItem("host cache", "filling it: sorted ids, sort order, positions, reader plans",
                       20 * k + 64 * min(k, 1 << 16))]  # fmt: skip
    build = counts + store + load + heap

    batch = BATCH_BYTES_PER_NODE * m + int(shape.edge_bytes) * e
    training = store + [
        MemoryItem(node, f"epoch order of {train:,} training seeds", shape.seed_order_bytes * train),
        MemoryItem(node, f"validation and test seeds ({shape.eval_nodes:,})",
                   shape.eval_seed_bytes * int(shape.eval_nodes)),
        MemoryItem("batches", f"{shape.num_samplers} sampler workspaces (batches of {m:,} nodes, {e:,} edges)",
                   shape.num_samplers * sampler_workspace_bytes(m, e, n)),
        MemoryItem("batches", f"{shape.batches_in_flight} batches in flight (ids, labels, edges, leases)",
                   shape.batches_in_flight * batch),
        MemoryItem("batches", "x of the trainer's batches and a gather temporary", 3 * m * rb),
    ] + _negative_items(shape) + heap
    if shape.background_fill and k:  # ranking, then the expectation, then the estimates: one at a time, beside
        # training (the cache reads nothing: it keeps rows from the buffer's reads; the estimate beside training is
        # the host cache's hit rate only, a mask of N bools)
        ranking = (2 * n if presample else 0) + rank_bytes(n, k, ordered=False)  # expect() sorts the ids itself
        during = max(ranking, 12 * k, n + 8 * k)  # expect: sorted ids and their positions
        training.append(MemoryItem(node, "the host cache's ranking, expectation or estimates, in the background",
                                   during))  # fmt: skip

    held = [
        MemoryItem(node, "indptr" + (" (node-shared memory)" if shape.topology_shared else ""),
                   0 if shape.topology_shared else 8 * (n + 1)),
        MemoryItem(node, f"training seeds ({train:,})", shape.seeds_held_bytes * train),
        MemoryItem("reader", f"reader I/O slots: {shape.reader_workers} workers x {shape.reader_queue_depth} x "
                   f"{READER_SLOT_BYTES >> 10} KiB", shape.reader_workers * shape.reader_queue_depth * READER_SLOT_BYTES),
        MemoryItem("batches", f"presampled node ids ({shape.presampled_nodes:,})", 8 * int(shape.presampled_nodes)),
        MemoryItem("batches", "the main thread's sampler workspace", sampler_workspace_bytes(m, e, n)),
    ]  # fmt: skip
    phases = {"choosing hot rows": hot, "simulating the buffer": sim, "building the store": build,
              "training": training}  # fmt: skip
    return HostTally(n, phases, held)


def _negative_items(shape: ProcessShape) -> list[MemoryItem]:
    """What a link batch's negatives cost while training: their indices in every batch in flight, and the
    sampler threads drawing them (the nodes they bring, and those nodes' features, are in the batch's
    node count, presampled with them; what the model allocates to score them is in the reserve)."""
    neg = shape.negatives
    if neg is None or not neg.count:
        return []
    labels = ", labels" if neg.mode == "binary" else ""
    return [
        MemoryItem("negatives", f"{shape.batches_in_flight} batches in flight with {neg.count:,} negatives each "
                   f"(indices into n_id{labels})", shape.batches_in_flight * neg.count * NEGATIVE_HELD_BYTES[neg.mode]),
        MemoryItem("negatives", f"{shape.num_samplers} sampler threads drawing {neg.ids:,} negative ids each (the ids, "
                   "the seed set, unique's sort and inverse)", shape.num_samplers * neg.ids * NEGATIVE_SAMPLING_BYTES_PER_ID),
    ]  # fmt: skip


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


def buffer_reserve(shape: ProcessShape, order: str, buffer_slots: int | None = None) -> int:
    """The feature buffer's reserve (slots) for ``shape``'s pipeline: what its batches in flight hold at once,
    at most one slot per node (and at most ``buffer_slots``).

    >>> buffer_reserve(ProcessShape(num_nodes=10_000, row_bytes=4, max_nodes_per_batch=500, max_edges_per_batch=0,
    ...                             num_extractors=2), "out_of_order")
    1000
    """
    most = min(required_slots(shape.max_nodes_per_batch, shape.num_extractors, shape.train_queue_size, order),
               shape.num_nodes)  # fmt: skip
    return most if buffer_slots is None else min(most, int(buffer_slots))
