"""The feature store of a heterogeneous graph: one tiered store per node type, planned as one.

Each node type with features has its own chain of tiers (host cache, feature
buffer over staging and the SSD reader of its feature file): rows of different
types differ in dimension and dtype. What is shared is the planning, so a type
gets memory in proportion to what the training batches ask of it:

* **the feature buffer budget** (``gpu_cache``) is split across types: each
  first gets its reserve (the slots its batches in flight need), the rest goes
  by each type's share of the bytes the presampled batches touched;
* **the host cache is ranked across types**: every node of every type is
  scored by its access count over the presample per byte of its row, and the
  highest-scoring rows fill ``host_cache`` whatever their type (a type whose
  rows are rarely touched gets none);
* **staging** is split as the buffer is, and the **memory check** sees one
  process (:func:`~lightning_ooc.store.memory.fit_parts`): every type's
  smallest plan (staging, the buffer's reserve, per-node and per-slot tables,
  batches in flight) is placed first, the pipeline lowered for all types at
  once where they do not fit together (as a homogeneous plan lowers its own,
  with one warning line; refused only below the smallest pipeline); what is
  left goes to the types' budgets in proportion to what each asked beyond its
  smallest plan, so no type's host cache grows into what another type needs,
  and the sum stays within the limit. The training reserve (sized for the
  batch's nodes of all types) is counted once;
* **reads of all types are in flight together**: :meth:`HeteroFeatureStore.fill`
  fills every type of a batch at once, one thread per type, each through its
  own reader's queue.

:class:`HeteroFeatureStore` has the store protocol the pipeline drives
(``claim_batch``, ``fill``, ``pin``, ``attach``, ``release``, ``abandon``,
``without``, ``close``, :mod:`lightning_ooc.store.protocol`), with ``n_id`` and ``x`` per node type.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import torch

from lightning_ooc.data.format import human_bytes
from lightning_ooc.errors import InputError
from lightning_ooc.store.buffer import required_slots
from lightning_ooc.store.factory import build_store, max_nodes_per_batch, plan_store, size_store
from lightning_ooc.store.host_cache import HotSet, access_counts
from lightning_ooc.store.memory import JointFit, MemoryLimit, PlanPart, fit_parts, limit_for_plan, training_reserve
from lightning_ooc.store.plan import StorePlan
from lightning_ooc.store.protocol import missing_type
from lightning_ooc.store.tier import ExtractStats, Fence
from lightning_ooc.store.tiered import Extracted, TieredFeatureStore
from lightning_ooc.utils.cancel import NEVER, CancelToken

log = logging.getLogger("lightning_ooc")


@dataclass
class HeteroExtracted:
    """One heterogeneous minibatch's claim: an :class:`Extracted` per node type with features."""

    parts: dict[str, Extracted]
    stats: ExtractStats = field(default_factory=ExtractStats)
    released: bool = False


class HeteroFeatureStore:
    """A :class:`~lightning_ooc.store.tiered.TieredFeatureStore` per node type, driven as one store.

    Example::

        >>> import tempfile, torch, lightning_ooc
        >>> from lightning_ooc.data.synth_hetero import synthesize_hetero
        >>> ds = lightning_ooc.open_dataset(synthesize_hetero(tempfile.mkdtemp() + "/h", "mag", num_nodes=500,
        ...                                                   num_features=8, progress=False))
        >>> paper = ds.node("paper")
        >>> store = HeteroFeatureStore({"paper": TieredFeatureStore.create(paper, buffer_slots=64, staging_bytes=4096)})
        >>> n_id = {"paper": torch.tensor([3, 250, 7]), "author": torch.tensor([0, 1])}
        >>> ext = store.extract(n_id)  # a HeteroExtracted: a claim per type with a store
        >>> isinstance(ext, HeteroExtracted), sorted(ext.parts)
        (True, ['paper'])
        >>> x = store.gather(ext)
        >>> sorted(x), bool((x["paper"] == paper.read_features(n_id["paper"])).all())
        (['paper'], True)
        >>> store.release(ext); store.close()
    """

    def __init__(self, stores: dict[str, TieredFeatureStore], parent: "HeteroFeatureStore | None" = None):
        if not stores:
            raise ValueError("a heterogeneous feature store needs a store for at least one node type")
        self.stores = dict(stores)
        #: the node types with features, each with its chain (the store protocol: :mod:`lightning_ooc.store.protocol`)
        self.node_types: tuple[str | None, ...] = tuple(self.stores)
        #: the store this one is a view of (:meth:`without`): it owns the tiers and the fill threads
        self._parent = parent
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False

    # -- the protocol the pipeline drives ------------------------------------------------------------
    def of(self, node_type: str | None) -> TieredFeatureStore:
        """The chain of tiers of ``node_type``."""
        if node_type not in self.stores:
            raise missing_type(node_type, self.node_types)
        return self.stores[node_type]

    def claim_batch(self, data: Any, cancel: CancelToken = NEVER) -> HeteroExtracted:
        """Claim the rows of a ``HeteroData`` batch (its ``n_id`` per node type)."""
        return self.claim({t: data[t].n_id for t in self.stores if t in data.node_types}, cancel, batch=data)

    def attach(self, data: Any, ext: HeteroExtracted, device: torch.device | str | None = None) -> None:
        """Set ``x`` of every node type with features from the claimed rows, on ``device``."""
        for t, x in self.gather(ext, device).items():
            data[t].x = x

    def claim(self, n_id: dict[str, torch.Tensor], cancel: CancelToken = NEVER, batch: Any = None) -> HeteroExtracted:
        """Claim each type's rows in its store (types without a store, i.e. without features, are skipped);
        ``batch``: the sampled minibatch, for tiers that keep rows per batch."""
        ext = HeteroExtracted({})
        try:
            for t, store in self.stores.items():
                ids = n_id.get(t)
                if ids is not None:
                    ext.parts[t] = store.claim(ids, cancel, batch=batch)
        except BaseException:
            self.abandon(ext)
            raise
        return ext

    def fill(self, ext: HeteroExtracted, cancel: CancelToken = NEVER) -> None:
        """Fill every type's rows at once (one thread per type); on any failure every lease is given back."""
        parts = list(ext.parts.items())
        try:
            if len(parts) <= 1:
                for t, part in parts:
                    self.stores[t].fill(part, cancel)
            else:
                pool = self._executor()
                futures = [pool.submit(self.stores[t].fill, part, cancel) for t, part in parts]
                errors = [f.exception() for f in futures]  # waits for all: none is left reading
                first = next((e for e in errors if e is not None), None)
                if first is not None:
                    raise first
        except BaseException:
            self.abandon(ext)
            raise
        for _, part in parts:
            ext.stats.add(part.stats)

    def extract(self, n_id: dict[str, torch.Tensor], cancel: CancelToken = NEVER) -> HeteroExtracted:
        ext = self.claim(n_id, cancel)
        self.fill(ext, cancel)
        return ext

    def pin(self, ext: HeteroExtracted) -> None:
        for t, part in ext.parts.items():
            self.stores[t].pin(part)

    def gather(self, ext: HeteroExtracted, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """``x`` of every type of the batch with features, on ``device`` (default: the CPU)."""
        return {t: self.stores[t].gather(part, device) for t, part in ext.parts.items()}

    def release(self, ext: HeteroExtracted, fence: Fence | None = None) -> None:
        if not ext.released:
            ext.released = True
            for t, part in ext.parts.items():
                self.stores[t].release(part, fence)

    def abandon(self, ext: HeteroExtracted) -> None:
        if not ext.released:
            ext.released = True
            for t, part in ext.parts.items():
                self.stores[t].abandon(part)

    def without(self, name: str) -> "HeteroFeatureStore":
        """Every type's chain with tier ``name`` replaced by its source (evaluation reads past the buffer)."""
        return HeteroFeatureStore({t: s.without(name) for t, s in self.stores.items()}, parent=self._parent or self)

    def tier(self, name: str) -> dict[str, Any]:
        """Tier ``name`` of each type's chain."""
        return {t: s.tier(name) for t, s in self.stores.items()}

    def _executor(self) -> ThreadPoolExecutor:
        if self._parent is not None:
            return self._parent._executor()
        with self._pool_lock:
            if self._closed:
                raise RuntimeError("the feature store is closed")
            if self._pool is None:
                # every extractor may fill a batch at once: a thread per type for each
                self._pool = ThreadPoolExecutor(max_workers=4 * len(self.stores), thread_name_prefix="ooc-fill")
            return self._pool

    def close(self) -> None:
        if self._closed:
            return
        with self._pool_lock:
            self._closed = True
        if self._parent is not None:
            return  # a view: the parent closes the tiers and the threads
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for s in self.stores.values():
            s.close()


# ---------------------------------------------------------------------------------------------- planning


class TypeView:
    """One node type as the planner and the tiers see a dataset: its rows (the attributes of its
    :class:`~lightning_ooc.data.hetero.NodeTypeData`), and the edges of every relation into it."""

    def __init__(self, ds: Any, node_type: str):
        self.node = ds.node(node_type)
        self._into = [csc for et, csc in ds.csc.items() if et[2] == node_type]
        self.num_edges = sum(csc.num_edges for csc in self._into)

    @property
    def in_degree(self) -> np.ndarray:
        """In-degree over every relation into the type (computed on each access, not kept)."""
        deg = np.zeros(self.node.num_nodes, dtype=np.int64)
        for csc in self._into:
            deg += np.diff(csc.indptr)
        return deg

    def __getattr__(self, name: str) -> Any:
        return getattr(self.node, name)


def type_views(ds: Any) -> dict[str, TypeView]:
    """A :class:`TypeView` of every node type with features."""
    return {t: TypeView(ds, t) for t in ds.node_types if ds.node(t).has_features}


def rank_host_rows(counts: dict[str, torch.Tensor], row_bytes: dict[str, int], budget: int) -> dict[str, int]:
    """Rows of each type in a host cache of ``budget`` bytes ranked across types: the rows that serve the
    most accesses per byte first.

    >>> c = {"a": torch.tensor([5, 0, 1]), "b": torch.tensor([9, 8, 2, 0])}
    >>> rank_host_rows(c, {"a": 4, "b": 8}, budget=16)  # a0 scores 1.25, b0 1.125, b1 1.0, ...
    {'a': 1, 'b': 1}
    """
    scores, kinds, sizes = [], [], []
    for i, (t, c) in enumerate(counts.items()):
        hit = c[c > 0].to(torch.float64)
        scores.append(hit / row_bytes[t])
        kinds.append(torch.full((hit.numel(),), i, dtype=torch.int64))
        sizes.append(torch.full((hit.numel(),), row_bytes[t], dtype=torch.int64))
    out = {t: 0 for t in counts}
    if not scores:
        return out
    score, kind, size = torch.cat(scores), torch.cat(kinds), torch.cat(sizes)
    order = torch.argsort(score, descending=True, stable=True)
    fits = torch.cumsum(size[order], 0) <= budget
    chosen = torch.bincount(kind[order][fits], minlength=len(counts))
    return {t: int(chosen[i]) for i, t in enumerate(counts)}


@dataclass
class HeteroPlan:
    """The plan of every node type's tiers, and how the budgets were shared (by each type's share of the bytes
    the presampled batches touched).

    Example (the plan of heterogeneous passes; in MAG only papers have features)::

        >>> import tempfile
        >>> from lightning_ooc.data.synth_hetero import synthesize_hetero
        >>> from lightning_ooc.loader.config import HeteroNodeDataConfig
        >>> from lightning_ooc.loader.context import ProcessContext
        >>> from lightning_ooc.loader.features import Tiered
        >>> from lightning_ooc.loader.hetero import HeteroLocalPasses
        >>> root = synthesize_hetero(tempfile.mkdtemp() + "/h", "mag", num_nodes=1000, num_features=8,
        ...                          train_frac=0.2, progress=False)
        >>> cfg = HeteroNodeDataConfig(root, batch_size=50, num_neighbors=[3, 2], progress=False,
        ...                            features=Tiered(gpu_cache="1MiB", host_cache="8KiB", staging="256KiB"))
        >>> passes = HeteroLocalPasses(cfg, ProcessContext())
        >>> plan = passes.plan
        >>> isinstance(plan, HeteroPlan), list(plan.plans) == list(passes.store.node_types), plan.shares
        (True, True, {'paper': 1.0})
        >>> passes.close()
    """

    plans: dict[str, StorePlan]
    #: each type's share of the bytes the presampled batches touched
    shares: dict[str, float]
    presample_batches: int
    #: the pipeline's settings lowered to fit every type's plan in memory (empty: as asked); the passes run with them
    pipeline: dict[str, int] = field(default_factory=dict)
    #: the memory check of every type's plan together (None: not made)
    memory: JointFit | None = field(default=None, repr=False)

    @property
    def fits(self) -> dict[str, Any]:
        """Each type's memory check (:class:`~lightning_ooc.store.memory.MemoryFit`), where it was made."""
        return {t: p.memory_fit for t, p in self.plans.items() if p.memory_fit is not None}

    def format(self, extra: list[str] | None = None) -> str:
        lines = ["lightning_ooc plan (heterogeneous: a tier chain per node type, budgets shared by access)"]
        for t, plan in self.plans.items():
            lines.append(f"  node type {t}: {self.shares[t]:.1%} of the presampled bytes")
            lines += ["  " + line for line in plan.format().splitlines()[1:]]
        fits = self.fits
        if self.memory is not None and fits:
            shrunk = f"; pipeline {', '.join(f'{k}={v}' for k, v in self.pipeline.items())} to fit" if self.pipeline else ""
            lines.append(self.memory.format(fits) + shrunk)
        return "\n".join(lines + list(extra or []))

    @property
    def buffer_bytes(self) -> int:
        return sum(p.buffer_slots * p.row_bytes for p in self.plans.values())

    @property
    def host_bytes(self) -> int:
        return sum(p.host_rows * p.row_bytes for p in self.plans.values())


def plan_hetero_store(cfg: Any, views: dict[str, TypeView], readers: dict[str, Any], device: torch.device,
                      presampled: list[dict[str, torch.Tensor]], *,
                      counted: Callable[[], Iterable[dict[str, torch.Tensor]]] | None = None,
                      fanout_bound: list[int], seeds_per_batch: int, input_type: str, split_sizes: dict[str, int],
                      edges_per_batch: int | None = None, processes: int = 1,
                      topology_shared: bool = False,
                      memory: MemoryLimit | None = None) -> tuple[HeteroPlan, dict[str, HotSet]]:  # fmt: skip
    """Share the budgets of ``cfg`` across node types (see the module docstring) and plan each type's tiers,
    fitted under the memory limit together (:func:`~lightning_ooc.store.memory.fit_parts`: each type's plan gets
    its room; the pipeline lowered for every type where needed, :attr:`HeteroPlan.pipeline`; one warning line).

    ``presampled`` batches (``n_id`` per type) size each type's reserve and give its share;
    the host cache is ranked over ``counted()`` (default: ``presampled``). ``fanout_bound``
    bounds the nodes a frontier node adds per hop (for the batch size bound). What a batch holds
    besides its rows (ids, edges, the sampler's workspace) is counted in one type's plan only,
    with ``edges_per_batch`` edges (the presample's largest with a margin); each type's plan
    counts its own nodes.
    """
    types = list(views)
    touched = {t: sum(int(b[t].numel()) for b in presampled if t in b) * views[t].row_bytes for t in types}
    total = sum(touched.values())
    shares = {t: (touched[t] / total if total else 1.0 / len(types)) for t in types}
    per_batch = {t: max_nodes_per_batch(views[t].num_nodes, seeds_per_batch, fanout_bound,
                                        [b[t] for b in presampled if t in b]) for t in types}  # fmt: skip
    # the feature buffer: every type's reserve first, the rest by share
    gpu_b = cfg.features.gpu_cache
    p = cfg.pipeline
    reserve = {t: min(required_slots(per_batch[t], p.num_extractors, p.train_queue_size, p.order),
                      views[t].num_nodes) * views[t].row_bytes for t in types}  # fmt: skip
    if sum(reserve.values()) > gpu_b:
        need = ", ".join(f"{t} {human_bytes(b)}" for t, b in reserve.items())
        raise InputError(f"features.gpu_cache={human_bytes(gpu_b)} is below what the batches in flight need across "
                         f"node types ({need}; {human_bytes(sum(reserve.values()))} in all); raise features.gpu_cache, "
                         "or lower batch_size, num_neighbors or pipeline.num_extractors")  # fmt: skip
    spare = gpu_b - sum(reserve.values())
    gpu = {t: reserve[t] + int(spare * shares[t]) for t in types}
    stage_b = cfg.features.staging
    staging = {t: max(int(stage_b * shares[t]), 2 * max(2, p.num_extractors) * views[t].row_bytes) for t in types}
    # the host cache, ranked across types over an independent presample
    host_b = cfg.features.host_cache
    counts: dict[str, torch.Tensor] | None = None
    batches_counted = len(presampled)
    if cfg.features.host_cache_policy == "presample":
        counts = {t: torch.zeros(views[t].num_nodes, dtype=torch.int64) for t in types}
        batches_counted = 0
        for b in (counted() if counted is not None else presampled):
            batches_counted += 1
            for t in types:
                if t in b:
                    counts[t] += access_counts([b[t]], views[t].num_nodes)
        rows = rank_host_rows(counts, {t: views[t].row_bytes for t in types}, host_b)
    else:  # by in-degree per byte, across types
        rows = rank_host_rows({t: torch.from_numpy(views[t].in_degree) for t in types},
                              {t: views[t].row_bytes for t in types}, host_b)  # fmt: skip
    host = {t: rows[t] * views[t].row_bytes for t in types}
    # one memory check for the process: every type's smallest plan first (the pipeline lowered where they do not fit
    # together), then what is left to the types' budgets; the training reserve counted once, with the first type
    limit = memory if memory is not None else limit_for_plan(getattr(cfg, "memory_limit", "auto"))  # what is live
    batch_reserve = training_reserve(sum(per_batch.values()))
    first = max(types, key=lambda t: shares[t])

    def cfg_of(t: str, pipeline: dict[str, int] | None = None) -> Any:
        return cfg.with_settings(features={"gpu_cache": gpu[t], "host_cache": host[t], "staging": staging[t]},
                                 pipeline=pipeline, num_neighbors=fanout_bound)  # fmt: skip

    def inputs(t: str) -> dict[str, Any]:  # what a type's plan is sized with besides its budgets
        # the edges of a batch, once (the edge bound takes the smallest of its bounds: num_edges among them)
        edges = (edges_per_batch if edges_per_batch is not None else views[t].num_edges) if t == first else 0
        return dict(topology_shared=topology_shared, seeds_per_batch=seeds_per_batch, num_edges=edges,
                    split_sizes=split_sizes if t == input_type else {"train": 0, "val": 0, "test": 0})  # fmt: skip

    ids = {t: [b[t] for b in presampled if t in b] for t in types}
    asked = {t: size_store(cfg_of(t), views[t], device, ids[t], memory=MemoryLimit.none("sizes as asked"),
                           **inputs(t)) for t in types}  # fmt: skip
    parts = {t: PlanPart(p.memory_fit.shape, p.host_rows, p.buffer_slots, p.buffer_reserve, p.staging_bytes)
             for t, p in asked.items()}  # fmt: skip
    joint = fit_parts(parts, limit=limit, reserve=batch_reserve, processes=processes, order=cfg.pipeline.order)
    plans: dict[str, StorePlan] = {}
    hots: dict[str, HotSet] = {}
    for t in types:
        if limit.unlimited:
            mem = limit
        else:
            mem = MemoryLimit(joint.rooms[t] + (batch_reserve if t == first else 0),
                              f"the part of {limit} planned for node type {t}"
                              + (", with the training reserve" if t == first else ""))  # fmt: skip
        plan, hot = plan_store(
            cfg_of(t, joint.pipeline), views[t], readers[t], device, ids[t], processes=1,
            counts=None if counts is None else counts[t], memory=mem,
            memory_reserve=batch_reserve if t == first else 0, shrink_pipeline=False, warn=False, **inputs(t),
        )  # fmt: skip
        plan.presample_batches = batches_counted
        plans[t], hots[t] = plan, hot
    out = HeteroPlan(plans, shares, batches_counted, pipeline=joint.pipeline, memory=joint)
    line = joint.warning(out.fits)
    if line:
        log.warning("%s", line)
    return out, hots


def build_hetero_store(plan: HeteroPlan, hots: dict[str, HotSet], views: dict[str, TypeView],
                       readers: dict[str, Any], device: torch.device, *, progress: bool = True) -> HeteroFeatureStore:  # fmt: skip
    """Allocate every type's tiers of ``plan`` (a failure closes what was built)."""
    stores: dict[str, TieredFeatureStore] = {}
    try:
        for t, p in plan.plans.items():
            stores[t] = build_store(p, hots[t], views[t], readers[t], device, progress=progress)
    except BaseException:
        for s in stores.values():
            s.close()
        raise
    return HeteroFeatureStore(stores)


def hop_bound(num_neighbors: Any, edge_types: list[tuple[str, str, str]], hops: int) -> list[int]:
    """Per hop, the most nodes one frontier node can add over every relation (fanouts summed over the
    relations leaving a type; -1 stays -1): what bounds a batch's size per type.

    >>> hop_bound({("a", "r", "b"): [2, 1], ("c", "s", "b"): [3, -1]}, [("a", "r", "b"), ("c", "s", "b")], 2)
    [5, -1]
    """
    out = []
    for h in range(hops):
        per_dst: dict[str, int] = {}
        for et in edge_types:
            k = num_neighbors[et][h] if isinstance(num_neighbors, dict) else num_neighbors[h]
            if k < 0:
                per_dst[et[2]] = -1
            elif per_dst.get(et[2], 0) >= 0:
                per_dst[et[2]] = per_dst.get(et[2], 0) + k
        vals = list(per_dst.values()) or [0]
        out.append(-1 if -1 in vals else max(vals))
    return out


__all__ = ["HeteroFeatureStore", "HeteroExtracted", "HeteroPlan", "plan_hetero_store", "build_hetero_store",
           "rank_host_rows", "type_views", "hop_bound"]
