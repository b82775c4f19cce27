"""Layer-wise inference over a heterogeneous dataset: per layer a table per node type, relations blocked.

The relational models (:class:`~lightning_ooc.models.relational.RelationalGNN`: a PyG
``HeteroConv`` per layer with one GAT or SAGE layer per relation, the
relations into a type combined by ``aggr``) run here the way
:mod:`lightning_ooc.infer.run` runs a homogeneous model, with these
differences:

- Every node type has its own ID-range partitions (:attr:`HeteroLayerwisePlan.bounds`)
  and its own table per layer (``layer-K.TYPE.bin``), checksummed per
  partition and committed together with the layer.
- Each relation ``(src, rel, dst)`` is written once as buckets of source-type
  partition by destination-type partition (:func:`~lightning_ooc.embed.buckets.write_buckets`
  with ``dst_bounds``).
- A layer runs the targets schedule per destination type: for a group of that
  type's partitions, the relations into it aggregate in bundles
  (:attr:`HeteroLayerPlan.bundles`). A bundle's accumulators (and target
  states, GAT's attention) are resident together; each of its source types
  streams past once, every partition read once for all the bundle's
  relations from that type; then each partition of the group is read once to
  finish all the bundle's relations (SAGE's root weight, GAT's residual), and
  their outputs are combined (``sum``, ``mean``, ``max`` or ``min``, as
  ``HeteroConv`` does, bundle after bundle) before what comes between
  layers. A relation's output needs its complete accumulator (SAGE's mean
  divides by its own relation's count), so every relation of a bundle keeps
  its own accumulator until the group's edges are done.
- The planner sizes the groups per destination type and order
  (:data:`ORDERS`): all the relations in one bundle (``shared``: each source
  type streamed once per group, the group's rows read once; its group holds
  every relation's accumulators), one bundle per source type, or one relation
  at a time. With several bundles the group also holds its combination;
  with one, each partition is combined on its own once the group's edges are
  done. Of the orders whose group holds a partition in three quarters
  of ``memory``, it takes the one that moves the fewest bytes; one relation
  at a time always runs, and :meth:`HeteroLayerwisePlan.describe` says which
  order each type took and why.
- A node type without features starts from the model's vector for it
  (``inference_inputs()``), which is never read from disk.
- A node-wise layer (the classifier on the target type) is applied to the rows
  of the types it names; a type a layer gives no output for is not carried on.

The output is a heterogeneous dataset with the input's topology, labels and
splits, each type's last table as its features (types without an output have
none).

Example::

    >>> import tempfile, lightning_ooc
    >>> from lightning_ooc.data.synth_hetero import synthesize_hetero
    >>> from lightning_ooc.models.relational import RelationalGNN
    >>> from lightning_ooc.infer import layerwise
    >>> d = tempfile.mkdtemp()
    >>> root = synthesize_hetero(d + "/h", "mag", num_nodes=400, num_features=8, num_classes=3, progress=False)
    >>> ds = lightning_ooc.open_dataset(root)
    >>> gnn = RelationalGNN(ds.metadata(), {"paper": 8}, 16, 3, "paper", num_layers=2, conv="sage").eval()
    >>> result = layerwise(gnn, root, d + "/out", memory=1 << 20, progress=False)
    >>> out = lightning_ooc.open_dataset(d + "/out")
    >>> out.node("paper").num_features, out.node("author").has_features
    (3, False)
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from lightning_ooc.data.format import human_bytes, index_dtype
from lightning_ooc.data.hetero_dataset import HETERO_VERSION, NODE_TYPES, node_prefix, relation_key
from lightning_ooc.data.writer import WriteTarget
from lightning_ooc.embed.buckets import EdgeBuckets, write_buckets
from lightning_ooc.errors import InputError
from lightning_ooc.infer.layers import BlockedLayer, blocked_layer
from lightning_ooc.infer.model import HeteroSteps
from lightning_ooc.infer.tables import (
    PROBE_NODES,
    LayerwiseResult,
    _bounds,
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
)
from lightning_ooc.store.planner import check_layerwise_fits
from lightning_ooc.utils.progress import progress_bar

if TYPE_CHECKING:
    from lightning_ooc.store.limits import MemoryLimit

log = logging.getLogger("lightning_ooc")

__all__ = ["HeteroLayerPlan", "HeteroLayerwisePlan", "plan_hetero"]

EdgeType = tuple[str, str, str]
#: how ``HeteroConv`` combines the relations into one type, as running element-wise folds (in place)
COMBINE: dict[str, Callable[[Tensor, Tensor], Any]] = {
    "sum": torch.Tensor.add_, "mean": torch.Tensor.add_,
    "max": lambda acc, x: torch.maximum(acc, x, out=acc), "min": lambda acc, x: torch.minimum(acc, x, out=acc),
}


@dataclass
class HeteroLayerPlan:
    """How one layer runs over a heterogeneous dataset.

    ``kind``: ``"relations"`` (a ``HeteroConv``: ``ops`` per relation, ``aggr`` over the relations into a type,
    ``groups`` partitions per group of each destination type, ``bundles`` the relations into each destination
    type whose accumulators are resident together, ``orders`` which order each destination type runs in and
    why) or ``"node-wise"`` (``modules`` per type). ``in_widths`` / ``out_widths``: float32 columns per type read
    and written; ``expected``: bytes it must move.

        >>> HeteroLayerPlan(0, "node-wise", {"paper": 4}, {"paper": 2}).total_expected
        0
    """

    index: int
    kind: str
    in_widths: dict[str, int]
    out_widths: dict[str, int]
    ops: dict[EdgeType, BlockedLayer] = field(default_factory=dict)
    whys: dict[EdgeType, str] = field(default_factory=dict)
    aggr: str = "sum"
    modules: dict[str, nn.Module] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)
    bundles: dict[str, list[list[EdgeType]]] = field(default_factory=dict)
    orders: dict[str, str] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)

    @property
    def total_expected(self) -> int:
        return int(sum(self.expected.values()))


@dataclass
class HeteroLayerwisePlan:
    """Partitions per node type and the per-layer plan of a heterogeneous layer-wise run (:func:`plan_hetero`).

    It always runs the targets schedule (a group of a destination type's partitions resident while every
    partition of each source type streams past, once per bundle of relations: :attr:`HeteroLayerPlan.bundles`).
    ``need``: the bytes its largest partitions need resident at least (above ``memory`` where partitions cannot
    be smaller).

        >>> import numpy as np
        >>> p = HeteroLayerwisePlan({"paper": 10}, {}, {"paper": np.array([0, 10])}, [], 1 << 20, 4096)
        >>> p.num_partitions, p.schedule
        ({'paper': 1}, 'targets')
    """

    num_nodes: dict[str, int]
    num_edges: dict[EdgeType, int]
    bounds: dict[str, np.ndarray]
    layers: list[HeteroLayerPlan]
    memory: int
    edge_chunk: int
    schedule: str = "targets"
    need: int = 0

    @property
    def num_partitions(self) -> dict[str, int]:
        return {t: len(b) - 1 for t, b in self.bounds.items()}

    @property
    def out_types(self) -> list[str]:
        """The node types the last layer gives an output for."""
        return list(self.layers[-1].out_widths) if self.layers else []

    def layout(self) -> str:
        """The layers and partitions, as the key of a resumable run takes them."""
        layers = [(lp.kind, lp.aggr, sorted(lp.whys.items()), sorted(lp.in_widths.items()),
                   sorted(lp.out_widths.items())) for lp in self.layers]  # fmt: skip
        return repr(layers) + "".join(f"{t}:{b.tobytes().hex()}" for t, b in sorted(self.bounds.items()))

    def describe(self) -> str:
        """The plan in a few lines, as the run logs it."""
        parts = ", ".join(f"{t} {len(b) - 1}" for t, b in self.bounds.items())
        lines = [f"layer-wise inference (heterogeneous): {sum(self.num_nodes.values())} nodes of "
                 f"{len(self.num_nodes)} types, {sum(self.num_edges.values())} edges; partitions per type: {parts}; "
                 f"targets schedule; memory {human_bytes(self.memory)}"]  # fmt: skip
        for lp in self.layers:
            outs = ", ".join(f"{t} {lp.in_widths.get(t, 0)} -> {w}" for t, w in lp.out_widths.items())
            if lp.kind == "relations":
                whys = sorted(set(lp.whys.values()))
                how = f"{len(lp.ops)} relation(s) ({'; '.join(whys)}), combined by {lp.aggr}"
                how += "; into " + ", ".join(
                    f"{t} {lp.orders[t]}, {math.ceil((len(self.bounds[t]) - 1) / lp.groups[t])} group(s)"
                    for t in lp.out_widths if t in lp.orders)  # fmt: skip
            else:
                how = ", ".join(f"{t}: {type(m).__name__}" for t, m in lp.modules.items())
            lines.append(f"  layer {lp.index + 1}: {lp.kind:10s} {how}; columns {outs}; "
                         f"moves {human_bytes(lp.total_expected)}")  # fmt: skip
        return "\n".join(lines)


# -- planning ----------------------------------------------------------------------------------------------------
def _relations_of(conv: nn.Module) -> list[tuple[EdgeType, nn.Module]]:
    return [(tuple(str(p) for p in et), m) for et, m in conv.convs.items()]  # type: ignore[misc]


def _probe(m: nn.Module, widths: tuple[int, ...], what: str) -> int:
    """A module's output width, run on two rows (a relation's layer: two sources, two targets, one edge)."""
    with torch.no_grad():
        try:
            if len(widths) == 2:
                y = m((torch.zeros(2, widths[0]), torch.zeros(2, widths[1])), torch.tensor([[0], [1]]))
            else:
                y = m(torch.zeros(2, widths[0]))
        except Exception as e:
            raise InputError(f"{what} does not take {' and '.join(map(str, widths))} input columns: {e}") from None
    return int(y.shape[-1])


def _layer_plans(steps: HeteroSteps, ds: Any) -> list[HeteroLayerPlan]:
    from torch_geometric.nn import HeteroConv  # lazy: PyG is heavy

    widths: dict[str, int] = {}
    for t in ds.node_types:
        node = ds.node(t)
        if node.has_features:
            widths[t] = node.num_features
        elif t in steps.inputs:
            widths[t] = int(steps.inputs[t].numel())
    plans: list[HeteroLayerPlan] = []
    for i, layer in enumerate(steps.layers):
        if isinstance(layer, HeteroConv):
            aggr = str(layer.aggr)
            if aggr not in COMBINE:
                raise InputError(f"layer {i + 1}: HeteroConv with aggr={aggr!r}; layer-wise inference combines "
                                 f"relations by {', '.join(COMBINE)}")  # fmt: skip
            lp = HeteroLayerPlan(i, "relations", {}, {}, aggr=aggr)
            for et, conv in _relations_of(layer):
                if et not in ds.csc:
                    raise InputError(f"layer {i + 1}: relation {et} is not in {ds.root} (relations: {ds.edge_types})")
                for t in (et[0], et[2]):
                    if t not in widths:
                        raise InputError(f"layer {i + 1}: relation {et} reads node type {t!r}, which has no "
                                         + ("features and no starting vector (inference_inputs())" if i == 0 else
                                            "output from the layer before"))  # fmt: skip
                op, why = blocked_layer(conv)
                if op is None or op.needs_degree or op.replaces_self_loops:
                    reason = why if op is None else f"{why} adds self-loops or reads degrees"
                    raise InputError(f"layer {i + 1}, relation {et}: {reason}; over a heterogeneous dataset "
                                     "layer-wise inference runs SAGEConv (mean, sum, max) and GATConv without "
                                     "self-loops per relation, as the relational models build them")  # fmt: skip
                out = _probe(conv, (widths[et[0]], widths[et[2]]), f"layer {i + 1}, relation {et}")
                if lp.out_widths.setdefault(et[2], out) != out:
                    raise InputError(f"layer {i + 1}: the relations into {et[2]!r} give {lp.out_widths[et[2]]} and "
                                     f"{out} columns, which {aggr} cannot combine")  # fmt: skip
                lp.ops[et], lp.whys[et] = op, why
                lp.in_widths[et[0]], lp.in_widths[et[2]] = widths[et[0]], widths[et[2]]
            if not lp.ops:
                raise InputError(f"layer {i + 1}: a HeteroConv without relations")
        elif isinstance(layer, nn.ModuleDict):
            lp = HeteroLayerPlan(i, "node-wise", {}, {})
            for t, m in layer.items():
                if t not in widths:
                    raise InputError(f"layer {i + 1} applies {type(m).__name__} to node type {t!r}, which has no "
                                     "rows at this layer")  # fmt: skip
                lp.modules[t] = m
                lp.in_widths[t] = widths[t]
                lp.out_widths[t] = _probe(m, (widths[t],), f"layer {i + 1} ({t!r}: {type(m).__name__})")
        else:
            raise InputError(f"layer {i + 1} is a {type(layer).__name__}; over a heterogeneous dataset a layer is a "
                             "HeteroConv or an nn.ModuleDict of node type -> node-wise module")  # fmt: skip
        plans.append(lp)
        widths = dict(lp.out_widths)
    return plans


def plan_hetero(steps: HeteroSteps, ds: Any, memory: int) -> HeteroLayerwisePlan:
    """How a heterogeneous run of ``steps`` over ``ds`` goes in ``memory`` bytes (what
    :func:`~lightning_ooc.infer.plan_layerwise` returns for a heterogeneous dataset)."""
    if memory < 1 << 16:
        raise InputError(f"memory={memory} bytes is too little for layer-wise inference; give at least 64 KiB")
    layers = _layer_plans(steps, ds)
    ops = [op for lp in layers for op in lp.ops.values()]
    # float32 columns a streamed partition holds at most: its input rows, its states, an output
    in_cols = max([4] + [w for lp in layers for w in lp.in_widths.values()])
    out_cols = max([0] + [w for lp in layers for w in lp.out_widths.values()])
    cols = 2 * in_cols + max([0] + [op.src_width + op.tgt_width for op in ops]) + out_cols
    widest_in = max([1] + [w for lp in layers for w in lp.in_widths.values()])
    part_nodes = int(min(memory // 8, (64 << 20) * cols // widest_in) // (4 * cols))
    bounds = {}
    for t in ds.node_types:
        tables = [lp.out_widths[t] for lp in layers if t in lp.out_widths]
        tables += [op.acc_width for lp in layers for et, op in lp.ops.items() if et[2] == t]
        bounds[t] = _bounds(int(ds.num_nodes_dict[t]), part_nodes, _row_unit(tables or [1]))
    edge_width = max([1] + [op.edge_width for op in ops])
    edge_chunk = max(4096, int(memory // 8 // (4 * (edge_width + 6))))
    plan = HeteroLayerwisePlan(dict(ds.num_nodes_dict), dict(ds.num_edges_dict), bounds, layers, int(memory),
                               edge_chunk)  # fmt: skip
    for lp in layers:
        _expect(plan, lp, ds)
    plan.need = _need(plan, cols)
    if plan.need > memory:
        log.warning("layer-wise inference: partitions start on multiples of a row unit (so that tables are written "
                    "with direct I/O in place), so the largest partitions need about %s, over memory=%s",
                    human_bytes(plan.need), human_bytes(memory))  # fmt: skip
    return plan


def _need(plan: HeteroLayerwisePlan, cols: int) -> int:
    """Bytes the plan's largest partitions need resident at least: a streamed partition (``cols`` float32
    columns per row) and one destination partition's accumulators and target states of one relation, the least
    any order holds (:func:`_expect`: a group holds at least one partition)."""
    largest = {t: int(np.diff(b).max()) if len(b) > 1 else 0 for t, b in plan.bounds.items()}
    group = 0
    for lp in plan.layers:
        for t, out_w in lp.out_widths.items():
            rels = [et for et in lp.ops if et[2] == t]
            if rels:
                group = max(group, largest[t] * _resident_per_row(lp, _bundles(rels, "per relation"), out_w))
    return max([0, *largest.values()]) * 4 * cols + group


def _in_rb(ds: Any, lp: HeteroLayerPlan, t: str) -> int:
    """Bytes of one input row of type ``t`` at layer ``lp`` (0: a starting vector, never read)."""
    if lp.index > 0:
        return 4 * lp.in_widths[t]
    node = ds.node(t)
    return node.row_bytes if node.has_features else 0


#: the orders a destination type's relations may run in, as bundles of relations resident together: all of
#: them, those of one source type, one at a time (always considered); the planner takes the cheapest that fits
ORDERS = ("shared", "per source type", "per relation")


def _bundles(rels: list[EdgeType], order: str) -> list[list[EdgeType]]:
    """The relations ``rels`` into one type as the bundles ``order`` aggregates together (in ``rels``' order)."""
    if order == "shared":
        return [list(rels)]
    if order == "per relation":
        return [[et] for et in rels]
    by_source: dict[str, list[EdgeType]] = {}
    for et in rels:
        by_source.setdefault(et[0], []).append(et)
    return list(by_source.values())


def _sources(bundle: list[EdgeType]) -> list[str]:
    """The source types a bundle streams, each once, in the order of its relations."""
    return list(dict.fromkeys(et[0] for et in bundle))


def _resident_per_row(lp: HeteroLayerPlan, bundles: list[list[EdgeType]], out_w: int) -> int:
    """Bytes a group holds per destination row: the largest bundle's accumulators and target states, all of its
    relations at once, and the group's combination where there are several bundles to fold (with one bundle
    each partition is finished and combined on its own, after the group's edges)."""
    widest = max(sum(lp.ops[et].acc_width + lp.ops[et].tgt_width for et in b) for b in bundles)
    return 4 * (widest + (out_w if len(bundles) > 1 else 0))


def _expect(plan: HeteroLayerwisePlan, lp: HeteroLayerPlan, ds: Any) -> None:
    """The order, groups and bytes of a layer. Per destination type, its relations run in bundles (:data:`ORDERS`:
    all of them together, those of one source type together, or one at a time); per group and bundle every
    partition of each of the bundle's source types streams past once, for all the bundle's relations from it,
    and the group's own rows are read once to finish them (and once more to start where one of them reads
    target states). Of the orders whose group holds at least one partition in three quarters of ``memory``
    (one at a time always runs), the one that moves the fewest bytes runs (the least memory on a tie). Every
    output is written once, every relation's edges read once."""
    t_ = dict(input=0, output=0, edges=0)
    if lp.kind == "node-wise":
        for t in lp.modules:
            t_["input"] += plan.num_nodes[t] * _in_rb(ds, lp, t)
            t_["output"] += plan.num_nodes[t] * 4 * lp.out_widths[t]
        lp.expected = t_
        return
    for t, out_w in lp.out_widths.items():
        rels = [et for et in lp.ops if et[2] == t]
        sizes = np.diff(plan.bounds[t])
        n_t, largest = plan.num_nodes[t], max(1, int(sizes.max()))
        options = []
        for order in dict.fromkeys((*ORDERS, "per relation")):  # one at a time always runs, whatever ORDERS holds
            bundles = _bundles(rels, order)
            if order == "per source type" and len(bundles) in (1, len(rels)):
                continue  # the same bundles as sharing (one source type) or as one at a time (no source twice)
            per = _resident_per_row(lp, bundles, out_w)
            fit = int(plan.memory * 3 // 4 // per) // largest
            if fit < 1 and order != "per relation":
                continue
            g = min(len(sizes), max(1, fit))
            groups = math.ceil(len(sizes) / g)
            moved = 0
            for b in bundles:
                moved += groups * sum(plan.num_nodes[s] * _in_rb(ds, lp, s) for s in _sources(b))
                moved += n_t * _in_rb(ds, lp, t) * (2 if any(lp.ops[et].tgt_width for et in b) else 1)
            options.append((moved, per, order, bundles, g))
        moved, _, order, bundles, g = min(options, key=lambda o: o[:2])
        lp.groups[t], lp.bundles[t] = g, bundles
        if len(rels) == 1:
            lp.orders[t] = "one relation"
        elif order == "per relation" and all(o[2] == "per relation" for o in options):
            lp.orders[t] = "per relation (the shared streams do not fit in memory)"
        elif order == "per relation":
            lp.orders[t] = "per relation (fewer bytes than sharing)"
        else:
            lp.orders[t] = order
        t_["input"] += moved
        for et in rels:
            idt = index_dtype(max(plan.num_nodes[et[0]], n_t)).itemsize
            t_["edges"] += plan.num_edges[et] * 2 * idt
        t_["output"] += n_t * 4 * out_w
    lp.expected = t_


# -- the rows of a type at a layer -------------------------------------------------------------------------------
class _StartRows:
    """The rows of a type without features: its starting vector, repeated (nothing is read)."""

    checksums = None
    bytes_read = 0
    seconds = 0.0

    def __init__(self, vector: Tensor):
        self.vector = vector.float().reshape(1, -1)

    def read(self, a: int, b: int, part: int | None = None) -> Tensor:
        return self.vector.expand(b - a, -1)

    def close(self) -> None:
        pass


# -- the run -----------------------------------------------------------------------------------------------------
def layerwise_hetero(steps: HeteroSteps, ds: Any, out: Path, *, memory: int, limit: MemoryLimit,
                     npy: Path | None, overwrite: bool, keep_work: bool, progress: bool,
                     resume: bool = True) -> LayerwiseResult:  # fmt: skip
    """:func:`~lightning_ooc.infer.layerwise` over a heterogeneous dataset (``steps`` in eval mode, on the CPU): the
    plan made in ``memory`` and checked against ``limit``
    (:func:`~lightning_ooc.store.planner.check_layerwise_fits`), then run."""
    plan = plan_hetero(steps, ds, memory)
    check_layerwise_fits(plan.need, plan.memory, limit)
    log.info("%s", plan.describe())
    if npy is not None and len(plan.out_types) != 1:
        raise InputError(f"npy= exports one table; this model gives outputs for the node types {plan.out_types}: "
                         "read them from the output dataset instead")  # fmt: skip

    def export(work: _Work, last: dict) -> Path | None:
        if npy is None:
            return None
        (t, entry), = last["tables"].items()
        return _export_npy(work.root / entry["file"], plan.num_nodes[t], entry["width"], npy, overwrite,
                           [Path(ds.root)])  # fmt: skip

    return _run_layers(ds, plan, _run_key(steps, ds, plan, _probe_outputs(steps, ds, plan)), out, overwrite=overwrite,
                       keep_work=keep_work, start=lambda work: _HeteroRunner(ds, plan, work, steps, progress).run_layer,
                       commit=lambda work, last, target: _commit_hetero(ds, plan, work, last, target),
                       export=export, resume=resume)  # fmt: skip


def _probe_outputs(steps: HeteroSteps, ds: Any, plan: HeteroLayerwisePlan) -> str:
    """The model's outputs on the probe graph (:func:`~lightning_ooc.infer.tables._probe_digest`): seeded rows for
    every type the first layer reads (a type without features: its starting vector), the probe's edges for every
    relation, each layer as PyG runs it (``HeteroConv`` over the relations it has, a ``ModuleDict`` per type) and
    what comes between layers after each but the last."""
    from torch_geometric.nn import HeteroConv  # lazy: PyG is heavy

    def run() -> list[Tensor]:
        x: dict[str, Tensor] = {}
        for k, t in enumerate(sorted(plan.layers[0].in_widths)):
            node = ds.node(t)
            x[t] = (_probe_rows(plan.layers[0].in_widths[t], k) if node.has_features else
                    steps.inputs[t].reshape(1, -1).expand(PROBE_NODES, -1).float())  # fmt: skip
        edges, outs = _probe_edges(), []
        for i, layer in enumerate(steps.layers):
            if isinstance(layer, HeteroConv):
                ets = [et for et, _ in _relations_of(layer) if et[0] in x and et[2] in x]
                y = layer(x, {et: edges for et in ets})
            else:
                y = {t: m(x[t]) for t, m in layer.items() if t in x}
            if i < len(steps.layers) - 1:
                y = {t: steps.between(i, h, t) for t, h in y.items()}
            outs.extend(y[t] for t in sorted(y))
            x = y
        return outs

    return _probe_digest(steps.module, run)


def _finish(lp: HeteroLayerPlan, bundle: list[EdgeType], accs: dict[EdgeType, Tensor], tgts: dict[EdgeType, Tensor],
            x: Tensor, a: int, b: int, fold: Callable, part: Tensor | None) -> Tensor:  # fmt: skip
    """Rows ``[a, b)`` of the group finished for every relation of ``bundle`` (``x``: those rows' inputs) and
    combined, folded in place into ``part`` where given (one relation's output of one partition at a time)."""
    for et in bundle:
        tgt = tgts.get(et)
        out = lp.ops[et].finish(accs[et][a:b], x, None, None if tgt is None else tgt[a:b], None)
        if part is None:
            part = out
        else:
            fold(part, out)
    return part


class _HeteroRunner:
    def __init__(self, ds: Any, plan: HeteroLayerwisePlan, work: _Work, steps: HeteroSteps, progress: bool):
        self.ds, self.plan, self.work, self.steps, self.progress = ds, plan, work, steps, progress
        self._buckets: dict[EdgeType, EdgeBuckets] = {}
        self.edge_seconds = 0.0

    def buckets(self, et: EdgeType) -> EdgeBuckets:
        """Relation ``et``'s edges as buckets of source-type by destination-type partitions, written once."""
        if et not in self._buckets:
            source = _graph_edges(self.ds.csc[et], self.plan.memory, name=f"{self.ds.root} (relation {et})")
            self._buckets[et] = self.work.edge_buckets(f"buckets-{relation_key(et)}", lambda d: write_buckets(
                d, "graph", source, self.plan.bounds[et[0]], {}, self.progress, dst_bounds=self.plan.bounds[et[2]]))
        return self._buckets[et]

    def _input(self, lp: HeteroLayerPlan, t: str, done: list[dict]) -> Any:
        ds = self.ds
        if lp.index == 0:
            node = ds.node(t)
            if not node.has_features:
                return _StartRows(self.steps.inputs[t])
            return _RowRanges(Path(node.features_path), node.features_offset, node.num_features,
                              node.feature_numpy_dtype, node.feature_dtype, node.num_nodes)  # fmt: skip
        prev = done[lp.index - 1]["tables"][t]
        return _RowRanges(self.work.root / prev["file"], 0, prev["width"], np.dtype(np.float32), torch.float32,
                          self.plan.num_nodes[t], prev["checksums"])  # fmt: skip

    def run_layer(self, lp: HeteroLayerPlan, done: list[dict]) -> dict[str, Any]:
        last = lp.index == len(self.plan.layers) - 1
        inputs: dict[str, Any] = {}
        writers: dict[str, _TableWriter] = {}
        t0 = time.perf_counter()
        counters = dict(edges=0)
        self.edge_seconds = 0.0
        try:
            for t in lp.in_widths:
                inputs[t] = self._input(lp, t, done)
            for t, w in lp.out_widths.items():
                writers[t] = _TableWriter(self.work.root / f"layer-{lp.index + 1}.{t}.bin", self.plan.num_nodes[t], w,
                                          self.plan.bounds[t])  # fmt: skip

            def emit(t: str, p: int, rows: Tensor) -> None:
                if not last:
                    rows = self.steps.between(lp.index, rows, t)
                writers[t].write(p, rows)

            if lp.kind == "relations":
                self._relations(lp, inputs, emit, counters)
            else:
                for t, m in lp.modules.items():
                    b = self.plan.bounds[t]
                    for p in range(len(b) - 1):
                        emit(t, p, m(inputs[t].read(int(b[p]), int(b[p + 1]), p)))
            tables = {t: {"file": w.path.name, "width": w.width, "checksums": w.commit()} for t, w in writers.items()}
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        finally:
            for r in inputs.values():
                r.close()
        self.work.commit_layer(lp.index, tables=tables)
        seconds = time.perf_counter() - t0
        moved = dict(input=sum(r.bytes_read for r in inputs.values()),
                     output=sum(w.bytes_written for w in writers.values()), **counters)  # fmt: skip
        io_seconds = sum(r.seconds for r in inputs.values()) + sum(w.seconds for w in writers.values())
        log.info("layer %d of %d (%s): %.1f s, read %s, wrote %s", lp.index + 1, len(self.plan.layers), lp.kind,
                 seconds, human_bytes(moved["input"] + moved["edges"]), human_bytes(moved["output"]))  # fmt: skip
        return dict(layer=lp.index + 1, kind=lp.kind, seconds=seconds, io_seconds=io_seconds + self.edge_seconds,
                    moved=moved, expected=dict(lp.expected))  # fmt: skip

    def _relations(self, lp: HeteroLayerPlan, inputs: dict[str, Any], emit: Callable, counters: dict) -> None:
        """Per destination type, per group of its partitions, per bundle of its relations
        (:attr:`HeteroLayerPlan.bundles`): the bundle's accumulators resident while each of its source types
        streams past once, then every partition of the group read once to finish the bundle's relations, their
        outputs folded bundle after bundle (into the group's combination where there are several bundles)."""
        plan, fold = self.plan, COMBINE[lp.aggr]
        total = sum(plan.num_edges[et] for et in lp.ops)
        with progress_bar(total, f"layer {lp.index + 1} (relations)", "edge", self.progress) as bar:
            for t in lp.out_widths:
                tb = plan.bounds[t]
                bundles = lp.bundles[t]
                n, g = len(tb) - 1, lp.groups[t]
                n_rels = sum(len(b) for b in bundles)
                for g0 in range(0, n, g):
                    g1 = min(n, g0 + g)
                    base = int(tb[g0])
                    comb: Tensor | None = None  # the group's combination, where several bundles fold into it
                    for bundle in bundles:
                        accs, tgts = self._aggregate(lp, bundle, inputs, g0, g1, counters, bar)
                        if len(bundles) > 1 and comb is None:
                            comb = torch.empty(int(tb[g1]) - base, lp.out_widths[t])
                        first = bundle is bundles[0]
                        for j in range(g0, g1):
                            a, b = int(tb[j]) - base, int(tb[j + 1]) - base
                            x = inputs[t].read(int(tb[j]), int(tb[j + 1]), j)
                            part = _finish(lp, bundle, accs, tgts, x, a, b, fold,
                                           None if comb is None or first else comb[a:b])  # fmt: skip
                            del x
                            if comb is None:  # one bundle: the partition is done
                                if lp.aggr == "mean":
                                    part.div_(n_rels)
                                emit(t, j, part)
                            elif first:
                                comb[a:b] = part
                        del accs, tgts
                    if comb is not None:
                        if lp.aggr == "mean":
                            comb.div_(n_rels)
                        for j in range(g0, g1):
                            emit(t, j, comb[int(tb[j]) - base : int(tb[j + 1]) - base])

    def _aggregate(self, lp: HeteroLayerPlan, bundle: list[EdgeType], inputs: dict[str, Any], g0: int, g1: int,
                   counters: dict, bar: Any) -> tuple[dict[EdgeType, Tensor], dict[EdgeType, Tensor]]:  # fmt: skip
        """The accumulators (and target states) of the relations of ``bundle`` for destination partitions
        ``[g0, g1)``: each source type's partitions read once, each relation from it aggregated in turn while the
        partition is resident."""
        d_t = bundle[0][2]
        tb = self.plan.bounds[d_t]
        base = int(tb[g0])
        accs = {et: lp.ops[et].new_acc(int(tb[g1]) - base) for et in bundle}
        tgts: dict[EdgeType, Tensor] = {}
        reads = [et for et in bundle if lp.ops[et].tgt_width]  # the aggregation reads its targets (GAT's attention)
        if reads:  # filled in place: a list of parts between the reads keeps the allocator's freed pages
            tgts = {et: torch.empty(int(tb[g1]) - base, lp.ops[et].tgt_width) for et in reads}
            for j in range(g0, g1):
                a, b = int(tb[j]) - base, int(tb[j + 1]) - base
                x = inputs[d_t].read(int(tb[j]), int(tb[j + 1]), j)
                for et in reads:
                    tgts[et][a:b] = lp.ops[et].prepare_target(x, None)
        for s_t in _sources(bundle):
            sb = self.plan.bounds[s_t]
            from_s = [et for et in bundle if et[0] == s_t]
            for i in range(len(sb) - 1):
                x = inputs[s_t].read(int(sb[i]), int(sb[i + 1]), i)
                for et in from_s:  # one relation's source states at a time
                    op, buckets = lp.ops[et], self.buckets(et)
                    src = op.prepare_source(x, None)
                    a, b = buckets.span(i, g0, g1)
                    for s, d in _edge_chunks(self, buckets, a, b, self.plan.edge_chunk, counters, bar):
                        op.accumulate(accs[et], src, tgts.get(et), s - int(sb[i]), d - base)
                    del src
        return accs, tgts


def _commit_hetero(ds: Any, plan: HeteroLayerwisePlan, work: _Work, last: dict, target: WriteTarget) -> Path:
    """The heterogeneous dataset at ``target``: the input's files linked (or copied) but its features; each type's
    last table as its features, the other types without; committed atomically."""
    src_root = Path(ds.root)
    meta = json.loads(json.dumps(ds.meta))
    feature_keys = {node_prefix(t) + "features" for t in ds.node_types}
    files = {}
    for key, entry in meta["files"].items():
        if key in feature_keys:
            continue
        _link_or_copy(src_root / entry["name"], target.tmp / entry["name"])
        files[key] = entry
    tables = last["tables"]
    for t, entry in meta[NODE_TYPES].items():
        if t in tables:
            tab = tables[t]
            path = work.root / tab["file"]
            _verify_table(path, tab, plan.bounds[t])  # a table changed since it was written is not committed
            name = f"{node_prefix(t)}features.bin"
            _link_or_copy(path, target.tmp / name)
            files[node_prefix(t) + "features"] = {"name": name, "bytes": plan.num_nodes[t] * 4 * int(tab["width"])}
            entry.update(num_features=int(tab["width"]), feature_dtype="float32", row_bytes=4 * int(tab["width"]))
        else:
            entry.update(num_features=0, row_bytes=0)
    for k in ("in_place", "meta_checksum"):
        meta.pop(k, None)
    meta.update(version=HETERO_VERSION, files=files,
                source={"layerwise": {"dataset": str(src_root), "dataset_identity": ds.identity,
                                      "layers": len(plan.layers)}})  # fmt: skip
    return target.commit(meta)
