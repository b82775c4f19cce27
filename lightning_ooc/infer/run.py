"""Layer-wise inference out of core: every layer for every node, blocked over partitions, one table per layer.

PyG's layer-wise inference (``model.inference(x_all, loader)``) computes
each layer for all nodes over their full neighbourhoods, but keeps every
layer's states in memory. Here each layer's output is a table on disk that
the next layer reads as its features:

1. The nodes are split into ID-range partitions small enough that ``capacity``
   of them (their input rows, their states as sources and their targets'
   accumulators) fit the memory given; the stored graph's edges are written
   once as partition-pair buckets (:mod:`lightning_ooc.embed.buckets`).
2. A layer in blocked form (:mod:`lightning_ooc.infer.layers`) visits the
   buckets in a partition-buffer order (:mod:`lightning_ooc.embed.order`,
   the one embedding training uses): bucket ``(i, j)`` runs while
   partitions ``i`` and ``j`` are resident and adds ``i``'s messages into
   ``j``'s accumulators. A partition whose last incoming bucket has run is
   finished and written to the layer's table; one evicted before that has its
   accumulators written to a scratch file and read back with it. Or (the
   targets schedule) a group of partitions' accumulators stays resident while
   every partition streams past as a source, group after group: its input rows,
   or a table of its messages written once per layer where that moves fewer
   bytes.
3. Any other message-passing layer reads each target's full in-neighbourhood
   row by row (direct I/O through the feature reader) and runs the layer on
   it; a layer that is not message passing (a linear head) runs row by row.
   :class:`LayerwisePlan` says which layer runs how, and the bytes each must
   move.
4. Each layer's table is written with direct I/O, checksummed per partition,
   and committed by rename with a ``state.json`` that records it; a run that
   stops is resumed at the first layer not committed (same dataset, weights,
   partitions, and the same outputs on a probe graph: see
   :mod:`lightning_ooc.infer.tables`). The last layer's table becomes the features of a
   new dataset at ``out`` (the input's topology, labels and splits, linked or
   copied), committed like every dataset, and optionally a ``.npy`` file.

``memory`` is fitted under what the process may still allocate (``memory_limit``: the memory cgroup's limit
and ``MemAvailable`` by default, as the sampled path plans): shrunk to what the limit leaves (the log says so),
or refused in one line where even the smallest partitions would not fit.

Example::

    >>> import tempfile, torch, lightning_ooc
    >>> from lightning_ooc.data.synth import synthesize
    >>> from torch_geometric.nn.models import GraphSAGE
    >>> from lightning_ooc.infer import layerwise
    >>> d = tempfile.mkdtemp()
    >>> root = synthesize(d + "/g", num_nodes=3000, avg_degree=5, num_features=8, num_classes=3,
    ...                       progress=False)
    >>> model = GraphSAGE(8, 16, num_layers=2, out_channels=3).eval()
    >>> result = layerwise(model, root, d + "/out", memory=1 << 20, progress=False)
    >>> [layer.kind for layer in result.plan.layers], result.plan.num_partitions > 1
    (['blocked', 'blocked'], True)
    >>> out = lightning_ooc.open_dataset(d + "/out")
    >>> out.num_features, out.num_nodes
    (3, 3000)
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch import Tensor

from lightning_ooc.data.dataset import open_dataset
from lightning_ooc.data.edge_sources import DatasetEdgeSource
from lightning_ooc.data.format import HOMOGENEOUS_VERSION, human_bytes, index_dtype
from lightning_ooc.data.writer import WriteTarget
from lightning_ooc.embed.buckets import EdgeBuckets, write_buckets
from lightning_ooc.embed.order import PartitionOrder, partition_order
from lightning_ooc.errors import InputError
from lightning_ooc.infer.layers import BlockedLayer, blocked_layer, neighbourhood_layer
from lightning_ooc.infer.model import LayerSteps, hetero_steps, layer_steps
from lightning_ooc.infer.tables import (
    LayerwiseResult,
    ReadAhead,
    TableChecksumError,
    _bounds,
    _check_npy,
    _edge_chunks,
    _export_npy,
    _graph_edges,
    _probe_digest,
    _probe_edges,
    _probe_rows,
    _link_or_copy,
    _RowRanges,
    _row_unit,
    _run_key,
    _run_layers,
    _TableWriter,
    _verify_table,
    _Work,
    work_dir_for,
)
from lightning_ooc.store.limits import release_freed_memory
from lightning_ooc.store.planner import LAYERWISE_OVER_MEMORY, check_layerwise_fits, fit_layerwise_memory
from lightning_ooc.io.bulk import BulkFile, aligned_empty, round_up
from lightning_ooc.utils.progress import progress_bar

if TYPE_CHECKING:
    from lightning_ooc.store.limits import MemoryLimit

log = logging.getLogger("lightning_ooc")

__all__ = ["layerwise", "plan_layerwise", "LayerwisePlan", "LayerPlan", "LayerwiseResult", "TableChecksumError",
           "work_dir_for"]

DEFAULT_CAPACITY = 3


@dataclass
class LayerPlan:
    """How one layer runs: ``kind`` is ``"blocked"``, ``"neighbourhood"`` or ``"node-wise"``; ``why`` says why.

    ``expected``: the bytes it must move (``input``, ``spill_write``, ``spill_read``, ``output``, ``edges``).

        >>> LayerPlan(0, "node-wise", "Linear", 4, 2).total_expected
        0
    """

    index: int
    kind: str
    why: str
    in_width: int
    out_width: int
    op: Any = None
    expected: dict[str, int] = field(default_factory=dict)
    #: partitions per group of targets (the targets schedule)
    group: int = 0
    #: the targets schedule streams a table of the sources' messages (written once from the input) past the
    #: groups instead of the input rows (each group recomputing them)
    messages: bool = False

    @property
    def total_expected(self) -> int:
        return int(sum(self.expected.values()))


SCHEDULES = ("auto", "targets", "messages", "buffer")


@dataclass
class LayerwisePlan:
    """Partitions, schedule and per-layer plan of one layer-wise run (:func:`plan_layerwise`).

    ``schedule``: ``"targets"`` (``group`` partitions' accumulators resident while every partition streams
    past as a source; a layer whose :attr:`LayerPlan.messages` is set streams a table of its sources' messages
    instead of its input rows) or ``"buffer"`` (``order``: a partition-buffer order, each resident partition a
    source and a target, accumulators spilled on eviction). ``alternatives``: the bytes each schedule considered
    would move over all layers (``"messages"``: the targets schedule with a message table for every layer).

        >>> import numpy as np
        >>> from lightning_ooc.embed.order import partition_order
        >>> p = LayerwisePlan(10, 20, np.array([0, 10]), "buffer", partition_order(1, 3), [], 1 << 20, 4096)
        >>> p.num_partitions
        1
    """

    num_nodes: int
    num_edges: int
    bounds: np.ndarray
    schedule: str
    order: PartitionOrder | None
    layers: list[LayerPlan]
    memory: int
    edge_chunk: int
    alternatives: dict[str, int] = field(default_factory=dict)
    #: bytes the largest partitions need resident (above ``memory`` where partitions cannot be smaller)
    need: int = 0

    @property
    def num_partitions(self) -> int:
        return len(self.bounds) - 1

    def disk_need(self, done: int = 0, buckets_written: bool = False, keep_work: bool = False) -> dict[str, int]:
        """Bytes the run will still write to its work directory's file system when ``done`` layers are
        committed (and the edge buckets are, where ``buckets_written``): the buckets; the layer tables at their
        peak (a layer's table is written while its input table is there, and tables no later layer reads are
        removed, so two at a time; every one with ``keep_work``; the last becomes the output dataset's features
        by a hard link); and the largest scratch file a layer writes and removes beside them (its message table,
        or its spilled accumulators; GCN's degree counts).

            >>> import numpy as np
            >>> layers = [LayerPlan(i, "node-wise", "Linear", 8, w) for i, w in enumerate((4, 16, 2))]
            >>> p = LayerwisePlan(1000, 5000, np.array([0, 500, 1000]), "targets", None, layers, 1 << 20, 4096)
            >>> p.disk_need()
            {'edge buckets': 40040, 'layer tables': 80000, 'scratch': 0}
            >>> p.disk_need(keep_work=True)["layer tables"], p.disk_need(done=2)["layer tables"]
            (88000, 8000)
        """
        n = self.num_nodes
        need = {"edge buckets": 0 if buckets_written else
                self.num_edges * 2 * index_dtype(n).itemsize + (self.num_partitions ** 2 + 1) * 8}  # fmt: skip
        sizes = [n * 4 * lp.out_width for lp in self.layers]
        if keep_work:
            need["layer tables"] = sum(sizes[done:])
        else:  # layer k's table beside its input's (already on disk where that layer is done)
            need["layer tables"] = max([sizes[k] + (sizes[k - 1] if k > done else 0)
                                        for k in range(done, len(sizes))] or [0])  # fmt: skip
        scratch = [0]
        for lp in self.layers[done:]:
            if lp.kind != "blocked":
                continue
            if lp.messages:
                scratch.append(n * 4 * lp.op.src_width)
            if lp.expected.get("spill_write"):
                scratch.append(n * 4 * lp.op.acc_width)
            if getattr(lp.op, "needs_degree", False):
                scratch.append(n * 4)
        need["scratch"] = max(scratch)
        return need

    def layout(self) -> str:
        """The layers and partitions, as the key of a resumable run takes them."""
        return repr([(lp.kind, lp.why, lp.in_width, lp.out_width) for lp in self.layers]) + self.bounds.tobytes().hex()

    def describe(self) -> str:
        """The plan in a few lines, as the run logs it."""
        if self.schedule == "targets":
            how = ("targets schedule: a group of partitions' accumulators resident while every partition streams past "
                   "as a source (its input rows, or the layer's table of messages)")  # fmt: skip
        else:
            how = (f"buffer schedule: {self.order.capacity} partitions resident ({self.order.name} order, "
                   f"{len(self.order.states)} states)")  # fmt: skip
        others = ", ".join(f"{k} {human_bytes(v)}" for k, v in self.alternatives.items())
        lines = [
            f"layer-wise inference: {self.num_nodes} nodes, {self.num_edges} edges, {self.num_partitions} partition(s) "
            f"of up to {int(np.diff(self.bounds).max())} nodes; {how}; memory {human_bytes(self.memory)}"
            + (f"; bytes to move by schedule: {others}" if others else "")
        ]
        for lp in self.layers:
            groups = (f", {math.ceil(self.num_partitions / lp.group)} group(s) of {lp.group}"
                      if self.schedule == "targets" and lp.kind == "blocked" else "")  # fmt: skip
            if self.schedule == "targets" and lp.messages:
                groups += f", streaming a table of messages ({lp.op.src_width} columns)"
            lines.append(f"  layer {lp.index + 1}: {lp.kind:13s} {lp.why}, {lp.in_width} -> {lp.out_width} columns"
                         f"{groups}, moves {human_bytes(lp.total_expected)}")  # fmt: skip
        disk = self.disk_need()
        lines.append(f"  disk: about {human_bytes(sum(disk.values()))} written beside the output ("
                     + ", ".join(f"{k} {human_bytes(v)}" for k, v in disk.items() if v) + ")")
        return "\n".join(lines)


# -- the rows of a file, read by range ---------------------------------------------------------------------------


# -- planning ----------------------------------------------------------------------------------------------------


def _layer_plans(steps: LayerSteps, in_width: int) -> list[LayerPlan]:
    from torch_geometric.nn.conv import MessagePassing  # lazy: PyG is heavy

    plans, width = [], in_width
    for i, m in enumerate(steps.layers):
        if isinstance(m, MessagePassing):
            op, why = blocked_layer(m)
            if op is not None:
                plans.append(LayerPlan(i, "blocked", why, width, op.out_width, op))
            else:
                ok, refusal = neighbourhood_layer(m)
                if not ok:
                    raise InputError(f"layer {i + 1} ({why}): {refusal}")
                out = _probe_width(m, width)
                plans.append(LayerPlan(i, "neighbourhood", why + ": full in-neighbourhoods read row by row", width,
                                       out, m))  # fmt: skip
        else:  # applied to each node's row on its own: a linear head, an MLP
            plans.append(LayerPlan(i, "node-wise", type(m).__name__, width, _probe_width(m, width), m))
        width = plans[-1].out_width
    return plans


def _probe_width(m: Any, width: int) -> int:
    """A layer's output width, by running it on two nodes."""
    from torch_geometric.nn.conv import MessagePassing  # lazy: PyG is heavy

    x = torch.zeros(2, width)
    with torch.no_grad():
        try:
            y = m(x, torch.tensor([[0], [1]])) if isinstance(m, MessagePassing) else m(x)
        except Exception as e:
            raise InputError(f"layer {type(m).__name__} does not take {width} input columns: {e}") from None
    return int(y.shape[-1])


def _order_traffic(order: PartitionOrder, sizes: np.ndarray, in_rb: int, acc_rb: int, out_rb: int,
                   edges_bytes: int) -> dict[str, int]:  # fmt: skip
    """The bytes a blocked layer must move under ``order``: each load reads its rows (and its accumulators if
    they were spilled), each eviction before a partition is finished writes its accumulators, each partition's
    output is written once, and every bucket's edges are read once."""
    finish = _finish_states(order)
    resident: set[int] = set()
    spilled: set[int] = set()
    t = dict(input=0, spill_write=0, spill_read=0, output=int(sizes.sum()) * out_rb, edges=edges_bytes)
    for k, st in enumerate(order.states):
        for p in st.partitions:
            if p not in resident:
                resident.add(p)
                t["input"] += int(sizes[p]) * in_rb
                if p in spilled:
                    t["spill_read"] += int(sizes[p]) * acc_rb
        if st.evict is not None:
            if finish[st.evict] > k:
                t["spill_write"] += int(sizes[st.evict]) * acc_rb
                spilled.add(st.evict)
            resident.discard(st.evict)
    return t


def _finish_states(order: PartitionOrder) -> dict[int, int]:
    """For each partition, the state in which its last incoming bucket runs."""
    finish: dict[int, int] = {}
    for k, st in enumerate(order.states):
        for _, j in st.buckets:
            finish[j] = k
    return finish


def plan_layerwise(model: Any, dataset: Any, *, memory: int = 1 << 30, capacity: int = DEFAULT_CAPACITY,
                   schedule: str = "auto", between: Callable | None = None,
                   memory_limit: int | str | None = "auto") -> LayerwisePlan:  # fmt: skip
    """How :func:`layerwise` would run ``model`` over ``dataset`` (a path or an open dataset) in ``memory`` bytes
    (fitted under ``memory_limit`` as :func:`layerwise` fits it; a plan whose smallest partitions do not fit that
    limit is refused in one line, as :func:`layerwise` refuses it).

    >>> import tempfile
    >>> from lightning_ooc.data.synth import synthesize
    >>> from torch_geometric.nn.models import GCN
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=3000, avg_degree=4, num_features=8,
    ...                       num_classes=2, progress=False)
    >>> plan = plan_layerwise(GCN(8, 4, num_layers=2, out_channels=2), root, memory=1 << 16)
    >>> [lp.why for lp in plan.layers]
    ['GCNConv (normalised sum)', 'GCNConv (normalised sum)']
    >>> plan.num_partitions > 1
    True
    """
    ds = _open_whole(dataset)
    if getattr(ds, "is_hetero", False):
        from lightning_ooc.infer.hetero_layerwise import plan_hetero  # lazy: builds on this module

        _targets_only(schedule)
        hsteps = _hetero_steps(model, between)
        memory, limit = fit_layerwise_memory(memory, memory_limit)
        plan = plan_hetero(hsteps, ds, memory)
    else:
        steps = layer_steps(model, between)
        over = _over_memory(steps)
        memory, limit = fit_layerwise_memory(memory, memory_limit, over)
        plan = _plan(steps, ds, memory, int(capacity), schedule)
        check_layerwise_fits(plan.need, plan.memory, limit, over)
        return plan
    check_layerwise_fits(plan.need, plan.memory, limit)
    return plan


def _over_memory(steps: LayerSteps) -> float:
    """The share of ``memory`` a run of ``steps`` may take at its peak: the largest of its layers' (a blocked
    layer's :attr:`~lightning_ooc.infer.layers.BlockedLayer.over_memory`, the planner's default for the others).

        >>> from torch_geometric.nn.models import GraphSAGE, GAT
        >>> _over_memory(layer_steps(GraphSAGE(8, 4, num_layers=2))), _over_memory(layer_steps(GAT(8, 4, 2, heads=2)))
        (1.2, 1.75)
    """
    from torch_geometric.nn.conv import MessagePassing  # lazy: PyG is heavy

    over = []
    for m in steps.layers:
        op = blocked_layer(m)[0] if isinstance(m, MessagePassing) else None
        over.append(op.over_memory if op is not None and op.over_memory else LAYERWISE_OVER_MEMORY)
    return max(over or [LAYERWISE_OVER_MEMORY])


def _targets_only(schedule: str) -> None:
    if schedule not in ("auto", "targets"):
        raise InputError(f"schedule={schedule!r}: over a heterogeneous dataset layer-wise inference runs the targets "
                         "schedule (pass schedule='auto' or 'targets')")  # fmt: skip


def _hetero_steps(model: Any, between: Callable | None) -> Any:
    steps = hetero_steps(model)
    if between is not None:
        steps.between = between
    return steps


def _open_whole(dataset: Any) -> Any:
    """``dataset`` (a path or an open dataset), refused where it is one part of a partitioned dataset."""
    ds = open_dataset(dataset) if isinstance(dataset, (str, os.PathLike)) else dataset
    if "partition" in ds.meta:
        raise InputError(f"{ds.root}: one part of a partitioned dataset holds only its own nodes' features; run "
                         "layer-wise inference over the dataset it was partitioned from")  # fmt: skip
    return ds


def _targets_traffic(bounds: np.ndarray, group: int, in_rb: int, out_rb: int, edges_bytes: int,
                     target_state: bool) -> dict[str, int]:  # fmt: skip
    """The bytes a blocked layer moves under the targets schedule: every group streams every partition's rows
    past as sources (and reads its own once more to start, where the layer needs target states during the
    aggregation), then reads its own rows again to finish; the output once, each bucket once."""
    n_nodes = int(bounds[-1])
    groups = math.ceil((len(bounds) - 1) / group)
    reads = groups * n_nodes * in_rb + n_nodes * in_rb + (n_nodes * in_rb if target_state else 0)
    return dict(input=reads, spill_write=0, spill_read=0, output=n_nodes * out_rb, edges=edges_bytes)


def _messages_traffic(bounds: np.ndarray, group: int, in_rb: int, src_rb: int, out_rb: int, edges_bytes: int,
                      target_state: bool) -> dict[str, int]:  # fmt: skip
    """The bytes of the targets schedule over a table of messages: the input read once to write the table (each
    node's message, ``src_rb`` bytes) and once more to finish (and once to start, where the layer reads target
    states), the table streamed past every group; the output once, each bucket once. Linear in the graph but
    for the table's streaming, whose rows are the messages' width rather than the input's."""
    n_nodes = int(bounds[-1])
    groups = math.ceil((len(bounds) - 1) / group)
    reads = 2 * n_nodes * in_rb + (n_nodes * in_rb if target_state else 0)
    return dict(input=reads, spill_write=0, spill_read=0, output=n_nodes * out_rb, edges=edges_bytes,
                messages_write=n_nodes * src_rb, messages_read=groups * n_nodes * src_rb)  # fmt: skip


def _plan(steps: LayerSteps, ds: Any, memory: int, capacity: int, schedule: str = "auto") -> LayerwisePlan:
    if memory < 1 << 16:
        raise InputError(f"memory={memory} bytes is too little for layer-wise inference; give at least 64 KiB")
    if capacity < 2:
        raise InputError(f"capacity={capacity}: at least 2 partitions must be resident (a source and a target)")
    if schedule not in SCHEDULES:
        raise InputError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    n_nodes, n_edges = int(ds.num_nodes), int(ds.num_edges)
    layers = _layer_plans(steps, int(ds.num_features))
    blocked = [lp for lp in layers if isinstance(lp.op, BlockedLayer)]
    # float32 columns per node. buffer: a resident partition holds input, states, accumulators and output;
    # targets: a streamed partition holds input, states and output, a group member its accumulators (and
    # target states)
    cols_buffer = max([4] + [lp.in_width + lp.out_width for lp in layers]
                      + [lp.in_width + lp.out_width + lp.op.src_width + lp.op.tgt_width + lp.op.acc_width + 2
                         for lp in blocked])  # fmt: skip
    cols_stream = max([4] + [lp.in_width + lp.out_width + lp.op.src_width + lp.op.tgt_width for lp in blocked])
    edge_width = max([1] + [lp.op.edge_width for lp in blocked])
    unit = _row_unit([lp.out_width for lp in layers] + [lp.op.acc_width for lp in blocked]
                     + [lp.op.src_width for lp in blocked])  # fmt: skip
    edge_chunk = max(4096, int(memory // 16 // (4 * (edge_width + 6))))
    edges_bytes = n_edges * 2 * index_dtype(n_nodes).itemsize

    def in_rb(lp: LayerPlan) -> int:
        return lp.in_width * (ds.feature_numpy_dtype.itemsize if lp.index == 0 else 4)

    # three quarters of the memory for partitions, a sixteenth for a chunk of edges and its messages
    b_bounds = _bounds(n_nodes, int(memory * 3 // 4 // (capacity * 4 * cols_buffer)), unit)
    order = partition_order(len(b_bounds) - 1, capacity)
    b_sizes = np.diff(b_bounds)
    # targets: two streamed partitions (one read ahead while the other is added) in an eighth of the memory,
    # 64 MiB of input rows each at most (reads that large run at the sequential rate already); the group's
    # accumulators in the rest but a sixteenth (the edge chunk's): every group more reads every source again
    t_bounds = _bounds(n_nodes, int(min(memory // 16, (64 << 20) * cols_stream // max(1, max(
        [lp.in_width for lp in blocked] or [1]))) // (4 * cols_stream)), unit)  # fmt: skip
    t_sizes = np.diff(t_bounds)
    for lp in blocked:
        per = 4 * (lp.op.acc_width + lp.op.tgt_width)
        lp.group = min(len(t_sizes), max(1, int(memory * 13 // 16 // per) // max(1, int(t_sizes.max()))))
    traffic = {
        "buffer": [_order_traffic(order, b_sizes, in_rb(lp), 4 * lp.op.acc_width, 4 * lp.out_width, edges_bytes)
                   for lp in blocked],
        "targets": [_targets_traffic(t_bounds, lp.group, in_rb(lp), 4 * lp.out_width, edges_bytes,
                                     lp.op.tgt_width > 0) for lp in blocked],
        "messages": [_messages_traffic(t_bounds, lp.group, in_rb(lp), 4 * lp.op.src_width, 4 * lp.out_width,
                                       edges_bytes, lp.op.tgt_width > 0) for lp in blocked],
    }  # fmt: skip
    totals = {k: int(sum(sum(t.values()) for t in v)) for k, v in traffic.items()}
    # the targets schedule takes, layer by layer, whichever of its two forms moves fewer bytes (a tie: the
    # table, which computes each message once instead of once per group)
    per_layer = [m if sum(m.values()) <= sum(t.values()) else t
                 for t, m in zip(traffic["targets"], traffic["messages"])]  # fmt: skip
    if schedule == "auto":
        best = int(sum(sum(t.values()) for t in per_layer))
        schedule = "buffer" if totals["buffer"] <= best else "targets"
        traffic["targets"] = per_layer
        if best not in (totals["targets"], totals["messages"]):  # a mix: what it moves, beside the pure forms
            totals["targets, each layer's best form"] = best
    elif schedule == "messages":
        schedule, traffic["targets"] = "targets", traffic["messages"]
    bounds = b_bounds if schedule == "buffer" else t_bounds
    largest = int(np.diff(bounds).max())
    need = largest * 4 * (capacity * cols_buffer if schedule == "buffer" else 2 * cols_stream)
    if need > memory:
        log.warning("layer-wise inference: partitions start on multiples of %d nodes (so that tables are written "
                    "with direct I/O in place), so a partition of %d nodes needs about %s, over memory=%s",
                    unit, largest, human_bytes(need), human_bytes(memory))  # fmt: skip
    for lp, t in zip(blocked, traffic[schedule]):
        lp.expected = t
        lp.messages = "messages_write" in t
    for lp in layers:
        if lp.kind == "node-wise":
            lp.expected = dict(input=n_nodes * in_rb(lp), output=n_nodes * 4 * lp.out_width)
        elif lp.kind == "neighbourhood":
            # every target's row and every edge's source row; a table of ours is checked whole first
            checked = n_nodes * in_rb(lp) if lp.index > 0 else 0
            lp.expected = dict(input=(n_nodes + n_edges) * in_rb(lp) + checked, output=n_nodes * 4 * lp.out_width,
                               edges=n_edges * ds.indices.dtype.itemsize)  # fmt: skip
    return LayerwisePlan(n_nodes, n_edges, bounds, schedule, order if schedule == "buffer" else None, layers,
                         memory, edge_chunk, totals if blocked else {}, need)  # fmt: skip


# -- the run -----------------------------------------------------------------------------------------------------


def _gcn_counts(ds: Any, work: Path, progress: bool) -> np.ndarray:
    """Per node its in-edges that are not self-loops, as float32, in a file of the work dir."""
    path = work / "gcn_degree.npy"
    if path.exists():
        return np.load(path, mmap_mode="r")
    part = path.with_name(path.name + ".partial")
    counts = np.lib.format.open_memmap(part, mode="w+", dtype=np.float32, shape=(int(ds.num_nodes),))
    counts[:] = np.diff(ds.indptr)
    with progress_bar(int(ds.num_edges), "degrees", "edge", progress) as bar:
        for src, dst in DatasetEdgeSource(ds).chunks():
            loops = dst[src == dst]
            if loops.size:
                np.subtract.at(counts, loops, 1)
            bar.update(src.size)
    counts.flush()
    del counts
    fd = os.open(part, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(part, path)
    return np.load(path, mmap_mode="r")


def layerwise(
    model: Any,
    dataset: str | os.PathLike,
    out: str | os.PathLike,
    *,
    memory: int = 1 << 30,
    capacity: int = DEFAULT_CAPACITY,
    schedule: str = "auto",
    npy: str | os.PathLike | None = None,
    overwrite: bool = False,
    between: Callable | None = None,
    keep_work: bool = False,
    progress: bool = True,
    memory_limit: int | str | None = "auto",
    resume: bool = True,
) -> LayerwiseResult:
    """Run ``model`` layer by layer over every node of ``dataset``; write its outputs as the dataset ``out``.

    Args:
        model: a :class:`~lightning_ooc.infer.LayerByLayer`, a PyG ``BasicGNN``, or a model with ``convs`` and
            ``between``; over a heterogeneous dataset a :class:`~lightning_ooc.infer.HeteroLayerByLayer` (the
            relational models); run in eval mode, on the CPU.
        dataset: the dataset directory, homogeneous or heterogeneous (:mod:`lightning_ooc.infer.hetero_layerwise`: a
            table per node type per layer, the targets schedule; ``capacity`` and ``schedule`` do not apply).
        out: the dataset to write: the input's graph, labels and splits with the model's outputs (logits or
            embeddings) as its features.
        memory: bytes for partitions and edge chunks; the partitions are sized from it. Shrunk to what
            ``memory_limit`` leaves (logged); refused where the smallest partitions do not fit it.
        capacity: partitions resident at a time in the buffer schedule (3: Legend's order; more: a greedy
            order).
        schedule: ``"targets"``, ``"messages"`` (the targets schedule streaming a table of each layer's
            messages, written once, instead of its input rows), ``"buffer"`` or ``"auto"`` (whichever moves fewer
            bytes, the targets schedule's form chosen layer by layer; see :class:`LayerwisePlan`).
        npy: also write the outputs to this ``.npy`` file (checked before any work: never a file the run reads,
            a dataset's or one it uses in place, never inside a dataset, ``out`` or the work directory).
        overwrite: replace ``out`` if it is a dataset already (and ``npy`` if it exists).
        between: what comes between layers, for a model with ``convs`` that says nothing of it.
        keep_work: keep the per-layer tables (``.OUT.layerwise`` beside ``out``) after the commit.
        progress: progress bars per layer.
        memory_limit: what ``memory`` must fit in: ``"auto"`` (the memory cgroup's limit and ``MemAvailable``),
            a size (this process's total), or None (no check).
        resume: reuse the layers a stopped run of the same key committed (see :mod:`lightning_ooc.infer.tables`
            for what the key covers); False starts over.

    A run that stops (killed, out of disk) keeps the layers it committed; the same call resumes at the next one.
    """
    out = Path(out)
    ds = _open_whole(dataset)
    if npy is not None:
        npy = _check_npy(npy, [Path(ds.root)], out, overwrite)
    hetero = bool(getattr(ds, "is_hetero", False))
    if hetero:
        _targets_only(schedule)
    steps = _hetero_steps(model, between) if hetero else layer_steps(model, between)
    over = LAYERWISE_OVER_MEMORY if hetero else _over_memory(steps)
    memory, limit = fit_layerwise_memory(memory, memory_limit, over)
    was_training = steps.module.training
    param = next(iter(steps.module.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    try:  # the model goes back to its device and mode whatever happens, a refused plan included
        if device.type != "cpu":  # the blocked layers run on the CPU, beside the rows they read
            log.info("layer-wise inference: running the model on the CPU (it was on %s; it goes back there after)",
                     device)  # fmt: skip
            steps.module.to("cpu")
        steps.module.eval()
        if hetero:
            from lightning_ooc.infer.hetero_layerwise import layerwise_hetero  # lazy: builds on this module

            return layerwise_hetero(steps, ds, out, memory=int(memory), limit=limit, npy=npy, overwrite=overwrite,
                                    keep_work=keep_work, progress=progress, resume=resume)  # fmt: skip
        return _layerwise_homogeneous(steps, ds, out, memory=int(memory), limit=limit, over=over,
                                      capacity=int(capacity), schedule=schedule, npy=npy, overwrite=overwrite,
                                      keep_work=keep_work, progress=progress, resume=resume)  # fmt: skip
    finally:
        steps.module.train(was_training)
        steps.module.to(device)


def _layerwise_homogeneous(steps: LayerSteps, ds: Any, out: Path, *, memory: int, limit: MemoryLimit,
                           over: float, capacity: int, schedule: str, npy: Path | None, overwrite: bool, keep_work: bool,
                           progress: bool, resume: bool) -> LayerwiseResult:  # fmt: skip
    """:func:`layerwise` over a homogeneous dataset (``steps`` in eval mode, on the CPU): the plan made in
    ``memory`` and checked against ``limit`` (:func:`~lightning_ooc.store.planner.check_layerwise_fits`), then
    run."""
    plan = _plan(steps, ds, memory, capacity, schedule)
    check_layerwise_fits(plan.need, plan.memory, limit, over)
    log.info("%s", plan.describe())

    def start(work: _Work) -> Callable:
        runner = _Runner(ds, plan, work, progress)
        return lambda lp, done: runner.run_layer(lp, steps, done)

    def export(work: _Work, last: dict) -> Path | None:
        if not npy:
            return None
        return _export_npy(work.root / last["file"], plan.num_nodes, plan.layers[-1].out_width, npy, overwrite,
                           [Path(ds.root)])  # fmt: skip

    key = _run_key(steps, ds, plan, _probe_outputs(steps, plan))
    return _run_layers(ds, plan, key, out, overwrite=overwrite, keep_work=keep_work, start=start,
                       commit=lambda work, last, target: _commit_dataset(ds, plan, work, last, target),
                       export=export, resume=resume)  # fmt: skip


def _probe_outputs(steps: LayerSteps, plan: LayerwisePlan) -> str:
    """The model's outputs on the probe graph (:func:`~lightning_ooc.infer.tables._probe_digest`): every layer
    as PyG runs it, and what comes between layers after each but the last."""
    from torch_geometric.nn.conv import MessagePassing  # lazy: PyG is heavy

    def run() -> list[Tensor]:
        x, edges, outs = _probe_rows(plan.layers[0].in_width, 0), _probe_edges(), []
        for i, m in enumerate(steps.layers):
            x = m(x, edges) if isinstance(m, MessagePassing) else m(x)
            if i < len(steps.layers) - 1:
                x = steps.between(i, x)
            outs.append(x)
        return outs

    return _probe_digest(steps.module, run)


class _Runner:
    def __init__(self, ds: Any, plan: LayerwisePlan, work: _Work, progress: bool):
        self.ds, self.plan, self.work, self.progress = ds, plan, work, progress
        self.sizes = np.diff(plan.bounds)
        self._buckets: EdgeBuckets | None = None
        self._gcn: np.ndarray | None = None

    # -- inputs
    def _input(self, lp: LayerPlan, done: list[dict]) -> _RowRanges:
        ds = self.ds
        if lp.index == 0:
            return _RowRanges(Path(ds.features_path), ds.features_offset, ds.num_features, ds.feature_numpy_dtype,
                              ds.feature_dtype, ds.num_nodes)  # fmt: skip
        prev = done[lp.index - 1]
        return _RowRanges(self.work.root / prev["file"], 0, prev["width"], np.dtype(np.float32), torch.float32,
                          ds.num_nodes, prev["checksums"])  # fmt: skip

    def buckets(self) -> EdgeBuckets:
        if self._buckets is None:
            self._buckets = self.work.edge_buckets("buckets", lambda d: write_buckets(
                d, "graph", _graph_edges(self.ds, self.plan.memory), self.plan.bounds, {}, self.progress))
        return self._buckets

    def degree(self, op: BlockedLayer, p: int) -> Tensor | None:
        """Partition ``p``'s inverse square-root degrees, for a layer that reads them (GCN)."""
        if not op.needs_degree:
            return None
        if self._gcn is None:
            self._gcn = _gcn_counts(self.ds, self.work.root, self.progress)
        a, b = int(self.plan.bounds[p]), int(self.plan.bounds[p + 1])
        # one loop of weight 1 per node: without edge weights, PyG's gcn_norm weighs every edge and loop 1
        # (``improved`` changes nothing then), so no degree is 0
        return (torch.from_numpy(np.array(self._gcn[a:b])) + 1).pow(-0.5)

    # -- one layer
    def run_layer(self, lp: LayerPlan, steps: LayerSteps, done: list[dict]) -> dict[str, Any]:
        last = lp.index == len(self.plan.layers) - 1
        name = f"layer-{lp.index + 1}.bin"
        src = self._input(lp, done)
        try:
            writer = _TableWriter(self.work.root / name, self.plan.num_nodes, lp.out_width, self.plan.bounds)
        except BaseException:
            src.close()
            raise
        t0 = time.perf_counter()
        counters = dict(edges=0, spill_read=0, spill_write=0)
        # I/O seconds of this thread; reads made in a read-ahead thread count only where they were waited for
        self.edge_seconds = self.spill_seconds = self.overlapped = self.waited = 0.0

        def emit(p: int, rows: Tensor) -> None:
            if not last:
                rows = steps.between(lp.index, rows)
            writer.write(p, rows)

        try:
            if lp.kind == "blocked" and self.plan.schedule == "targets":
                self._blocked_targets(lp, src, emit, counters)
            elif lp.kind == "blocked":
                self._blocked(lp, src, emit, counters)
            elif lp.kind == "node-wise":
                self._node_wise(lp, src, emit)
            else:
                self._neighbourhood(lp, src, emit, counters)
            checksums = writer.commit()
        except BaseException:
            writer.abort()
            raise
        finally:
            src.close()
        self.work.commit_layer(lp.index, file=name, width=lp.out_width, checksums=checksums)
        seconds = time.perf_counter() - t0
        moved = dict(input=src.bytes_read, output=writer.bytes_written, **counters)
        # the waits for the read-ahead thread count as I/O up to the seconds it spent reading (the rest of a
        # wait is its compute: making messages, checksums)
        io_seconds = (src.seconds + writer.seconds + self.edge_seconds + self.spill_seconds - self.overlapped
                      + min(self.waited, self.overlapped))  # fmt: skip
        log.info("layer %d of %d (%s): %.1f s, read %s, wrote %s", lp.index + 1, len(self.plan.layers), lp.kind,
                 seconds, human_bytes(moved["input"] + moved["edges"] + moved["spill_read"]
                                      + moved.get("messages_read", 0)),
                 human_bytes(moved["output"] + moved["spill_write"] + moved.get("messages_write", 0)))  # fmt: skip
        return dict(layer=lp.index + 1, kind=lp.kind, seconds=seconds, io_seconds=io_seconds, moved=moved,
                    expected=dict(lp.expected), input_table_bytes=self.plan.num_nodes * src.row_bytes,
                    messages=bool(lp.messages))  # fmt: skip

    def _node_wise(self, lp: LayerPlan, src: _RowRanges, emit: Callable) -> None:
        """A layer that is not message passing, applied to each partition's rows."""
        bounds = self.plan.bounds
        with progress_bar(self.plan.num_partitions, f"layer {lp.index + 1} (node-wise)", "part", self.progress) as bar:
            for p in range(self.plan.num_partitions):
                x = src.read(int(bounds[p]), int(bounds[p + 1]), p)
                emit(p, lp.op(x))
                bar.update(1)

    def _neighbourhood(self, lp: LayerPlan, src: _RowRanges, emit: Callable, counters: dict) -> None:
        from lightning_ooc.io.reader import FeatureReader  # lazy: the native reader

        ds, bounds = self.ds, self.plan.bounds
        if src.checksums is not None:  # rows are read by id below, where no partition checksum applies: check first
            for p in range(self.plan.num_partitions):
                src.read(int(bounds[p]), int(bounds[p + 1]), p)
        reader = FeatureReader(src.path, src.width, src.torch_dtype if src.torch_dtype != torch.bfloat16 else
                               "bfloat16", num_rows=ds.num_nodes, offset=src.offset)  # fmt: skip
        conv = lp.op
        budget_rows = max(64, self.plan.memory // (4 * max(src.width + lp.out_width, 1)) // 4)
        try:
            with progress_bar(self.plan.num_nodes, f"layer {lp.index + 1} (neighbourhoods)", "node",
                              self.progress) as bar:  # fmt: skip
                for p in range(self.plan.num_partitions):
                    a, b = int(bounds[p]), int(bounds[p + 1])
                    outs, lo = [], a
                    while lo < b:
                        # targets whose targets + neighbours fit the budget (at least one target)
                        hi = int(np.searchsorted(ds.indptr, ds.indptr[lo] + budget_rows, side="right")) - 1
                        hi = min(b, max(hi, lo + 1))
                        nbr = torch.from_numpy(np.asarray(ds.indices[ds.indptr[lo] : ds.indptr[hi]], dtype=np.int64))
                        counters["edges"] += int(nbr.numel()) * ds.indices.dtype.itemsize
                        dst = torch.repeat_interleave(torch.arange(hi - lo), torch.from_numpy(
                            np.diff(ds.indptr[lo : hi + 1]).astype(np.int64)))  # fmt: skip
                        # a neighbour among the chunk's targets is its target row (self-loops stay (i, i));
                        # the others follow, each once
                        inside = (nbr >= lo) & (nbr < hi)
                        others, inv = torch.unique(nbr[~inside], return_inverse=True)
                        local = torch.empty_like(nbr)
                        local[inside] = nbr[inside] - lo
                        local[~inside] = inv + (hi - lo)
                        x = torch.cat([src.read(lo, hi), reader.gather(others).float()])
                        src.bytes_read += int(others.numel()) * src.row_bytes
                        ei = torch.stack([local, dst])
                        outs.append(conv(x, ei)[: hi - lo])
                        bar.update(hi - lo)
                        lo = hi
                    emit(p, torch.cat(outs))
        finally:
            reader.close()

    def _accumulate(self, op: BlockedLayer, acc: Tensor, src: Tensor, tgt: Tensor | None, a: int, b: int,
                    s_base: int, d_base: int, counters: dict, bar: Any) -> None:  # fmt: skip
        """The stored edges ``[a, b)`` into ``acc`` (rows from ``d_base``), from ``src`` (rows from ``s_base``), read
        and added a chunk at a time; the stored self-loops dropped first where the layer replaces them."""
        for s, d in _edge_chunks(self, self.buckets(), a, b, self.plan.edge_chunk, counters, bar):
            if op.replaces_self_loops:
                keep = s != d
                s, d = s[keep], d[keep]
            op.accumulate(acc, src, tgt, s - s_base, d - d_base)

    def _blocked_targets(self, lp: LayerPlan, src: _RowRanges, emit: Callable, counters: dict) -> None:
        """The targets schedule: per group of partitions, accumulators resident, every partition streams past (its
        input rows made into messages, or the rows of the layer's table of messages); the next partition is read
        (and made into messages) in a thread while the current one is added."""
        op: BlockedLayer = lp.op
        plan, bounds, buckets = self.plan, self.plan.bounds, self.buckets()
        n, g = plan.num_partitions, lp.group
        self.degree(op, 0)  # the degrees (GCN) counted here, before a read-ahead thread needs them
        table = self._message_table(lp, src, counters) if lp.messages else None

        def messages(i: int) -> Tensor:  # in the read-ahead thread: its reads are not waited for
            a, b = int(bounds[i]), int(bounds[i + 1])
            t0 = time.perf_counter()
            rows = table.read(a, b, i) if table is not None else src.read(a, b, i)
            self.overlapped += time.perf_counter() - t0
            return rows if table is not None else op.prepare_source(rows, self.degree(op, i))

        try:
            with progress_bar(plan.num_edges, f"layer {lp.index + 1} (blocked)", "edge", self.progress) as bar:
                for g0 in range(0, n, g):
                    g1 = min(n, g0 + g)
                    base = int(bounds[g0])
                    acc = op.new_acc(int(bounds[g1]) - base)
                    tgt = None
                    if op.tgt_width:  # the layer reads its targets' states while aggregating (GAT's attention)
                        tgt = torch.empty(int(bounds[g1]) - base, op.tgt_width)  # filled in place: no list of parts
                        for j in range(g0, g1):
                            a, b = int(bounds[j]), int(bounds[j + 1])
                            tgt[a - base : b - base] = op.prepare_target(src.read(a, b, j), self.degree(op, j))
                    ahead = ReadAhead(messages, range(n))
                    for i, s_state in ahead:
                        a, b = buckets.span(i, g0, g1)
                        self._accumulate(op, acc, s_state, tgt, a, b, int(bounds[i]), base, counters, bar)
                        del s_state
                    self.waited += ahead.waited
                    for j in range(g0, g1):
                        a, b = int(bounds[j]), int(bounds[j + 1])
                        x = src.read(a, b, j)
                        degree = self.degree(op, j)
                        s_state, t_state = op.prepare(x, degree)
                        emit(j, op.finish(acc[a - base : b - base], x, s_state, t_state, degree))
                    del acc, tgt
                    release_freed_memory(collect=False)  # the arenas' freed pages, before the next group's
        finally:
            if table is not None:
                counters["messages_read"] = table.bytes_read
                self.spill_seconds += table.seconds
                table.close()
                table.path.unlink(missing_ok=True)

    def _message_table(self, lp: LayerPlan, src: _RowRanges, counters: dict) -> _RowRanges:
        """Every node's message of layer ``lp`` (:meth:`BlockedLayer.prepare_source`), computed once from the input
        and written as a scratch table (direct I/O, checksummed per partition) that the groups stream."""
        op: BlockedLayer = lp.op
        bounds = self.plan.bounds
        path = self.work.root / f"messages-{lp.index + 1}.bin"
        writer = _TableWriter(path, self.plan.num_nodes, op.src_width, bounds)
        try:
            def made(p: int) -> Tensor:  # in the read-ahead thread, while the last one is written
                t0 = time.perf_counter()
                x = src.read(int(bounds[p]), int(bounds[p + 1]), p)
                self.overlapped += time.perf_counter() - t0
                return op.prepare_source(x, self.degree(op, p))

            ahead = ReadAhead(made, range(self.plan.num_partitions))
            with progress_bar(self.plan.num_partitions, f"layer {lp.index + 1} (messages)", "part",
                              self.progress) as bar:  # fmt: skip
                for p, rows in ahead:
                    writer.write(p, rows)
                    del rows  # before the next is made: two partitions of messages alive at most
                    bar.update(1)
            self.waited += ahead.waited
            checksums = writer.commit()
        except BaseException:
            writer.abort()
            raise
        finally:
            counters["messages_write"] = writer.bytes_written
            self.spill_seconds += writer.seconds
        return _RowRanges(path, 0, op.src_width, np.dtype(np.float32), torch.float32, self.plan.num_nodes, checksums)

    def _blocked(self, lp: LayerPlan, src: _RowRanges, emit: Callable, counters: dict) -> None:
        op: BlockedLayer = lp.op
        plan, bounds, buckets = self.plan, self.plan.bounds, self.buckets()
        finish = _finish_states(plan.order)
        resident: dict[int, dict[str, Any]] = {}
        spill: BulkFile | None = None
        acc_rb = 4 * op.acc_width
        slots = np.zeros(plan.num_partitions + 1, dtype=np.int64)
        np.cumsum([round_up(int(s) * acc_rb) for s in self.sizes], out=slots[1:])
        spill_path = self.work.root / f"acc-{lp.index + 1}.bin"
        spilled: set[int] = set()
        try:
            with progress_bar(plan.num_edges, f"layer {lp.index + 1} (blocked)", "edge", self.progress) as bar:
                for k, st in enumerate(plan.order.states):
                    for p in st.partitions:
                        if p in resident:
                            continue
                        a, b = int(bounds[p]), int(bounds[p + 1])
                        x = src.read(a, b, p)
                        degree = self.degree(op, p)
                        s_state, t_state = op.prepare(x, degree)
                        if p in spilled:
                            buf = aligned_empty(slots[p + 1] - slots[p])
                            t0 = time.perf_counter()
                            counters["spill_read"] += spill.read_into(int(slots[p]), buf)
                            self.spill_seconds += time.perf_counter() - t0
                            acc = buf[: (b - a) * acc_rb].view(torch.float32).view(b - a, op.acc_width)
                        else:
                            acc = op.new_acc(b - a)
                        resident[p] = dict(x=x, src=s_state, tgt=t_state, acc=acc, degree=degree)
                    for i, j in st.buckets:
                        si, tj = resident[i], resident[j]
                        a, b = buckets.span(i, j, j + 1)
                        self._accumulate(op, tj["acc"], si["src"], tj["tgt"], a, b, int(bounds[i]), int(bounds[j]),
                                         counters, bar)  # fmt: skip
                    for p in st.partitions:
                        r = resident[p]
                        if finish[p] == k and r["acc"] is not None:
                            emit(p, op.finish(r["acc"], r["x"], r["src"], r["tgt"], r["degree"]))
                            r["acc"] = None
                    if st.evict is not None:
                        r = resident.pop(st.evict)
                        if r["acc"] is not None:  # not finished: its accumulators go to the scratch file
                            if spill is None:
                                spill = BulkFile(spill_path, "w", size=int(slots[-1]))
                            p = st.evict
                            n = int(self.sizes[p]) * acc_rb
                            buf = aligned_empty(slots[p + 1] - slots[p])
                            buf[:n].copy_(r["acc"].contiguous().view(-1).view(torch.uint8))
                            t0 = time.perf_counter()
                            counters["spill_write"] += spill.write_from(int(slots[p]), buf)
                            self.spill_seconds += time.perf_counter() - t0
                            spilled.add(p)
        finally:
            if spill is not None:
                spill.close()
            try:
                spill_path.unlink()
            except FileNotFoundError:
                pass


def _commit_dataset(ds: Any, plan: LayerwisePlan, work: _Work, last: dict, target: WriteTarget) -> Path:
    """The dataset at ``target``: the input's files (hard links where the file system allows, else copies) and
    the last layer's table as its features, committed atomically."""
    src_root = Path(ds.root)
    meta = json.loads(json.dumps(ds.meta))
    files = {}
    for key, entry in meta["files"].items():
        if key == "features":
            continue
        _link_or_copy(src_root / entry["name"], target.tmp / entry["name"])
        files[key] = entry
    table = work.root / last["file"]
    _verify_table(table, last, plan.bounds)  # a table changed since it was written is not committed
    _link_or_copy(table, target.tmp / "features.bin")
    width = int(last["width"])
    files = {"features": {"name": "features.bin", "bytes": plan.num_nodes * 4 * width}, **files}
    for k in ("in_place", "meta_checksum", "partition"):
        meta.pop(k, None)
    meta.update(version=HOMOGENEOUS_VERSION, num_features=width, feature_dtype="float32", row_bytes=4 * width,
                files=files, source={"layerwise": {"dataset": str(src_root), "dataset_identity": ds.identity,
                                                   "layers": len(plan.layers)}})  # fmt: skip
    return target.commit(meta)


