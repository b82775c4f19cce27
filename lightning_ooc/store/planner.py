"""The memory planner: the sizes of every tier of one node type or of several, fitted under one host memory limit.

One planner for every plan a run makes, of every stage (fit, then test, then predict), each against the limit
read when it is made (:func:`~lightning_ooc.store.limits.limit_for_plan`). A plan is made of *parts*
(:class:`PlanPart`), one per node type with features; a homogeneous graph's plan is the one part
:data:`~lightning_ooc.store.protocol.HOMOGENEOUS`. What memory there is comes from
:mod:`lightning_ooc.store.limits`, what each part needs from :mod:`lightning_ooc.store.tally`; here:

* **the fit** (:func:`fit_parts`): every part's smallest plan (staging, the feature buffer's reserve, per-node and
  per-slot tables, batches in flight) is placed first, the pipeline lowered for every part at once where they do
  not fit together (refused only below the smallest pipeline, with one message naming the limit, what the plan
  needs and what to shrink); what is left goes to the parts' budgets in proportion to what each asked beyond its
  smallest plan (a single part gets all of it), and each part's sizes are fitted into its room
  (:meth:`JointFit.fit`: the host cache shrinks first, then, on CPU, the feature buffer down to its reserve).
  :func:`check_fits` is the one-part case; :func:`check_negatives` refuses a link batch's negatives that cannot
  fit before anything is sampled;
* **the plan of one part's tiers** (:class:`StorePlan`): :meth:`StorePlan.from_budgets` turns the byte budgets
  into slot and row counts and fits them; :meth:`StorePlan.format` is the plan printed once at set-up;
* **planning from a dataset** (:func:`plan_store`): the nodes per batch bounded from the presampled batches
  (:func:`max_nodes_per_batch`), the sizes (:func:`size_store`), the host cache's rows chosen (at set-up, or
  ranked in the background while training runs), and a shrunk CPU plan's host memory shared between the host
  cache and the feature buffer by the hits simulated over the presample (:func:`split_host_memory`);
* **several node types** (:func:`plan_hetero_store`, :class:`HeteroPlan`): the feature buffer budget split
  across types (each its reserve first, the rest by its share of the bytes the presampled batches touched),
  staging split the same way, the host cache ranked across types by accesses per byte (:func:`rank_host_rows`),
  one :func:`fit_parts` for the process (the training reserve, sized for the batch's nodes of all types, counted
  once), then each type's tiers planned in its room.

The stores are built from the plans by :mod:`lightning_ooc.store.factory` (one node type) and
:mod:`lightning_ooc.store.typed_stores` (several).

Example::

    >>> from lightning_ooc.store.limits import MemoryLimit
    >>> from lightning_ooc.store.planner import MemoryFit, StorePlan, check_fits
    >>> plan = StorePlan.from_budgets(
    ...     num_nodes=3_000_000, row_bytes=64, gpu_cache="64MiB", host_cache="2GiB", staging="8MiB",
    ...     max_nodes_per_batch=10_000, num_extractors=4, train_queue_size=4, device="cpu",
    ...     batch_size=256, num_neighbors=[5, 5], num_edges=30_000_000, split_sizes={"train": 30_000},
    ...     memory=MemoryLimit(600 << 20, "a test"))
    >>> plan.host_rows
    778652
    >>> print(plan.format().splitlines()[-1])
      host memory      432.94 MiB  planned at its peak (training) + 167.06 MiB reserve, of 600.00 MiB available (a test); host_cache shrunk from 183.11 MiB to 47.53 MiB to fit
    >>> from lightning_ooc.store.tally import ProcessShape
    >>> shape = ProcessShape(num_nodes=3_000_000, row_bytes=64, max_nodes_per_batch=40_000,
    ...                      max_edges_per_batch=60_000, train_nodes=30_000)
    >>> fit = check_fits(shape, host_rows=524_288, buffer_slots=1 << 20, min_slots=160_000,
    ...                  staging_bytes=8 << 20, limit=MemoryLimit(4 << 30, "a test"))
    >>> isinstance(fit, MemoryFit), fit.host_rows, fit.shrunk
    (True, 524288, [])
    >>> print(fit.format())
      host memory      499.80 MiB  planned at its peak (training) + 284.25 MiB reserve, of 4.00 GiB available (a test)
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from lightning_ooc.data.degree import InDegree
from lightning_ooc.data.format import human_bytes, parse_bytes
from lightning_ooc.errors import InputError
from lightning_ooc.store.background import BACKGROUND_FILL_BYTES, BatchCounter, DeferredHot
from lightning_ooc.store.feature_buffer import FeatureBuffer, required_slots
from lightning_ooc.store.host_cache import HotSet, access_counts, choose_hot
from lightning_ooc.store.limits import UNLIMITED, MemoryLimit, keep_reserve, limit_for_plan, memory_limit
from lightning_ooc.store.protocol import HOMOGENEOUS
from lightning_ooc.store.tally import (BATCH_BYTES_PER_EDGE, BATCH_BYTES_PER_EDGE_WITH_ID, RESERVE_PER_NEGATIVE,
                                       BatchNegatives, HostTally, ProcessShape, buffer_reserve, edges_per_batch_bound,
                                       host_tally, training_reserve)

if TYPE_CHECKING:
    from lightning_ooc.store.typed_stores import TypeView

log = logging.getLogger("lightning_ooc")

__all__ = [
    "MemoryFit", "PlanPart", "JointFit", "fit_parts", "check_fits", "check_negatives", "smaller_pipelines",
    "fewer_in_flight", "largest_where", "budget_setting", "StorePlan", "max_nodes_per_batch", "size_store",
    "plan_store", "split_host_memory", "compact_ids", "local_positions", "host_hit_rate", "simulate_buffer",
    "HeteroPlan", "plan_hetero_store", "rank_host_rows", "hop_bound", "BATCH_MARGIN", "BATCH_SLACK",
]  # fmt: skip


# -------------------------------------------------------------------------------------------------
# what the fit reports, and the pipelines it may lower to
# -------------------------------------------------------------------------------------------------
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


# -------------------------------------------------------------------------------------------------
# the fit: one or several parts of one process (a homogeneous graph is the one part HOMOGENEOUS)
# -------------------------------------------------------------------------------------------------
def _with_pipeline(shape: ProcessShape, pipeline: ProcessShape) -> ProcessShape:
    """``shape`` with the queues, samplers and extractors of ``pipeline``."""
    return replace(shape, **{k: getattr(pipeline, k) for k in PIPELINE_QUEUES + PIPELINE_THREADS})


def _same_pipeline(a: ProcessShape, b: ProcessShape) -> bool:
    return all(getattr(a, k) == getattr(b, k) for k in PIPELINE_QUEUES + PIPELINE_THREADS)


@dataclass(frozen=True)
class PlanPart:
    """One part of a process's plan (a node type's tiers; a homogeneous graph's are the one part
    :data:`~lightning_ooc.store.protocol.HOMOGENEOUS`): its shape (its own nodes per batch; the batch's edges in one
    part only), the sizes asked, the feature buffer's reserve for the pipeline of ``shape`` and the staging buffer.

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

    def reserve_at(self, pipeline: ProcessShape, order: str | None) -> int:
        """The feature buffer's reserve (slots) with ``pipeline``: :attr:`min_slots` with its own pipeline (or where
        the pipeline may not be lowered), else :func:`~lightning_ooc.store.tally.buffer_reserve` of ``pipeline``."""
        if order is None or _same_pipeline(pipeline, self.shape):
            return self.min_slots
        return buffer_reserve(_with_pipeline(self.shape, pipeline), order, self.buffer_slots)

    def slots_at(self, pipeline: ProcessShape, order: str | None) -> int:
        """The fewest slots of the feature buffer with ``pipeline``: its reserve on CPU, as asked on a GPU (only
        its tables are in host memory)."""
        if not self.shape.buffer_on_host:
            return self.buffer_slots
        return min(self.reserve_at(pipeline, order), self.buffer_slots)

    def smallest(self, pipeline: ProcessShape, order: str | None) -> HostTally:
        """Its smallest plan with ``pipeline``: no host cache, the feature buffer at :meth:`slots_at`, its staging,
        per-node and per-slot tables and batches in flight."""
        return host_tally(_with_pipeline(self.shape, pipeline), host_rows=0,
                          buffer_slots=self.slots_at(pipeline, order), staging_bytes=self.staging_bytes)  # fmt: skip


@dataclass
class JointFit:
    """The outcome of :func:`fit_parts`: the pipeline every part runs with and each part's *room*, the bytes it may
    plan at its peak (its smallest plan, then its share of what is left); :meth:`fit` fits a part's sizes into
    its room.

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

    parts: dict[Any, PlanPart]
    limit: MemoryLimit
    allowed: int  # bytes the parts may plan together (this process's share of the limit, less the reserve)
    reserve: int
    #: bytes each part may plan at its peak
    rooms: dict[Any, int]
    #: each part's smallest plan with the pipeline chosen
    fixed: dict[Any, int]
    #: the pipeline chosen and the one asked (of the first part: every part has the same)
    shape: ProcessShape
    asked_shape: ProcessShape
    #: what the parts need as asked (the sum of their peaks)
    need: int = 0
    why: str = ""
    #: the pipeline's order (None: it was not to be lowered)
    order: str | None = None

    @property
    def pipeline(self) -> dict[str, int]:
        """The pipeline's settings lowered to fit, with their new values (empty: as asked)."""
        return _lowered(self.asked_shape, self.shape)

    def fit(self, name: Any) -> MemoryFit:
        """Part ``name``'s sizes in its room, with the pipeline chosen: as asked where they fit; else the largest
        host cache beside the feature buffer asked; with none, (CPU) the largest buffer down to its reserve."""
        part = self.parts[name]
        tally = part.tally()
        if self.limit.unlimited:
            return MemoryFit(part.host_rows, part.buffer_slots, tally, self.limit, UNLIMITED, self.reserve,
                             shape=part.shape, staging_bytes=part.staging_bytes, min_slots=part.min_slots)  # fmt: skip
        room = self.rooms[name]
        fit = MemoryFit(part.host_rows, part.buffer_slots, tally, self.limit, room, self.reserve, shape=part.shape,
                        staging_bytes=part.staging_bytes, asked_host_rows=part.host_rows,
                        asked_slots=part.buffer_slots, asked_shape=part.shape, min_slots=part.min_slots,
                        why=self.why)  # fmt: skip
        if tally.peak <= room and _same_pipeline(self.shape, part.shape):
            return fit
        shape = _with_pipeline(part.shape, self.shape)
        least = part.reserve_at(self.shape, self.order)
        got = _sizes(shape, part.host_rows, part.buffer_slots, least, part.staging_bytes, room)
        if got is None:  # not for a room of fit_parts: every part's smallest plan is in it
            raise ValueError(f"part {name!r} does not fit in its room of {human_bytes(room)}")
        fit.shape, fit.min_slots = shape, least
        fit.resize(*got)
        return fit

    def warning(self, fits: Mapping[Any, MemoryFit], label: str = "node type") -> str | None:
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

    def format(self, fits: Mapping[Any, MemoryFit]) -> str:
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


def fit_parts(parts: Mapping[Any, PlanPart], *, limit: MemoryLimit, reserve: int | None = None, processes: int = 1,
              order: str | None = None) -> JointFit:  # fmt: skip
    """Fit the parts of one process's plan (a node type's tiers each, one pipeline for all) into ``limit`` together.

    The one planner of every plan: a homogeneous graph's is the one part
    :data:`~lightning_ooc.store.protocol.HOMOGENEOUS` (:func:`check_fits`), a heterogeneous graph's has a part per
    node type with features. The peaks of every part's :func:`~lightning_ooc.store.tally.host_tally` plus
    ``reserve`` (default :func:`~lightning_ooc.store.tally.training_reserve` of the parts' batch nodes, counted
    once for the process) must fit into this process's share of what is available (``limit.bytes / processes``:
    ranks of one machine plan at the same time, under the same limit). Every part's smallest plan
    (:meth:`PlanPart.smallest`: what the part needs whatever its budgets) is placed first; where their sum does not
    fit, the pipeline holds fewer batches (:func:`fewer_in_flight` over the sum; ``order``: the pipeline's order,
    None: it may not be lowered). Only what is left then goes to the parts' budgets (host cache, a CPU feature
    buffer above its reserve), in proportion to what each asked beyond its smallest plan, so no part's cache grows
    into what another part needs; a single part's room is all that is allowed. The rooms add up to at most the
    limit (less the reserve). Where even the smallest plans with the smallest pipeline do not fit,
    :class:`~lightning_ooc.errors.InputError` gives the figures (per part) and what to shrink.
    """
    names = list(parts)
    if not names:
        raise ValueError("fit_parts needs at least one plan")
    one = names == [HOMOGENEOUS]  # a homogeneous plan: its messages speak of one plan, not of node types
    asked = parts[names[0]].shape
    default_reserve = reserve is None
    if reserve is None:
        reserve = training_reserve(sum(p.shape.max_nodes_per_batch for p in parts.values()), asked.negatives)
    reserve = int(reserve)
    keep_reserve(reserve)
    processes = max(1, int(processes))
    tallies = {t: p.tally() for t, p in parts.items()}
    need = {t: tally.peak for t, tally in tallies.items()}
    if limit.unlimited:
        return JointFit(dict(parts), limit, UNLIMITED, reserve, {t: UNLIMITED for t in names}, need, asked, asked,
                        sum(need.values()), order=order)  # fmt: skip
    allowed = limit.bytes // processes - reserve
    share = f", a 1/{processes} share for each of {processes} processes" if processes > 1 else ""
    if one:
        tally = tallies[HOMOGENEOUS]
        why = (f"{limit}{share}; as asked, the plan needs {human_bytes(tally.peak)} at its peak ({tally.peak_phase}) "
               f"+ {human_bytes(reserve)} kept for training")  # fmt: skip
    else:
        why = (f"{limit}{share}; as asked, the plan needs {human_bytes(sum(need.values()))} at the peaks of its "
               f"{len(names)} node types + {human_bytes(reserve)} kept for training")  # fmt: skip

    def fixed_at(pipeline: ProcessShape) -> dict[Any, int]:
        return {t: p.smallest(pipeline, order).peak for t, p in parts.items()}

    chosen = asked
    if sum(need.values()) > allowed and sum(fixed_at(asked).values()) > allowed:
        lowered = smallest = None
        if order is not None:
            lowered, smallest = fewer_in_flight(asked, lambda s: sum(fixed_at(s).values()), allowed)
        if lowered is None:
            tried = smallest or asked
            if one:
                part = parts[HOMOGENEOUS]
                raise InputError(_refusal(_with_pipeline(part.shape, tried), limit, reserve, processes,
                                          part.host_rows, part.buffer_slots, part.reserve_at(tried, order),
                                          part.staging_bytes, allowed, default_reserve,
                                          lowered=smallest is not None))  # fmt: skip
            raise InputError(_parts_refusal(parts, tried, order, limit, reserve, processes, allowed,
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
    return JointFit(dict(parts), limit, allowed, reserve, rooms, fixed, chosen, asked, sum(need.values()), why,
                    order=order)  # fmt: skip


def check_fits(shape: ProcessShape, *, host_rows: int, buffer_slots: int, min_slots: int, staging_bytes: int,
               limit: MemoryLimit, reserve: int | None = None, processes: int = 1, order: str | None = None,
               warn: bool = True) -> MemoryFit:  # fmt: skip
    """Fit one plan into ``limit``, shrinking the host cache, then (CPU) the feature buffer, then the pipeline, or
    refuse: :func:`fit_parts` of the one part :data:`~lightning_ooc.store.protocol.HOMOGENEOUS`.

    The peak of :func:`~lightning_ooc.store.tally.host_tally` plus ``reserve`` (default
    :func:`~lightning_ooc.store.tally.training_reserve`) must fit into this process's share of what is available
    (``limit.bytes / processes``). If it does not, the host cache gets the rows that fit; if none fit, the feature
    buffer on CPU shrinks towards ``min_slots``. If even that does not fit and ``order`` is given (the pipeline's
    order: its batches in flight may be lowered), the pipeline holds fewer batches: the least lowered of
    :func:`smaller_pipelines` whose smallest plan fits (the feature buffer's reserve shrinks with the extractors),
    and the host cache and buffer then get what fits beside it. One warning line says what was chosen and the
    settings that ask for it directly (``warn=False``: the caller logs :meth:`MemoryFit.warning` itself, once the
    sizes are final). Only where the smallest plan of the smallest pipeline does not fit,
    :class:`~lightning_ooc.errors.InputError` says what the plan needs and what to shrink.

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
    part = PlanPart(shape, host_rows, buffer_slots, min_slots, staging_bytes)
    joint = fit_parts({HOMOGENEOUS: part}, limit=limit, reserve=reserve, processes=processes, order=order)
    fit = joint.fit(HOMOGENEOUS)
    line = fit.warning() if warn else None
    if line:
        log.warning("%s", line)
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


# -------------------------------------------------------------------------------------------------
# the plan of one part's tiers
# -------------------------------------------------------------------------------------------------
@dataclass
class StorePlan:
    """Sizes of every tier for one process, derived from the budgets."""

    row_bytes: int
    num_nodes: int
    buffer_slots: int
    buffer_reserve: int
    max_nodes_per_batch: int
    host_rows: int
    staging_bytes: int
    staging_chunk_rows: int
    device: str
    expected_host_hit: float | None = None
    expected_buffer_hit: float | None = None
    host_policy: str = "presample"
    presample_batches: int = 0
    backend: str = ""
    backend_reason: str = ""
    #: the memory check: the host memory planned, the limit, and what was shrunk to fit (None: not checked)
    memory_fit: MemoryFit | None = field(default=None, repr=False)
    #: how a shrunk CPU plan shared host memory between the host cache and the buffer (None: not done)
    split_note: str | None = None
    #: when the host cache's rows are ranked: ``"setup"`` (ranked and read before training) or ``"background"``
    #: (ranked while training runs, kept from the buffer's reads: :mod:`lightning_ooc.store.background`)
    host_fill: str = "setup"
    #: extractor threads of the pipeline it was sized for (a background fill starts after their first batch)
    num_extractors: int = 1
    #: the pipeline's settings the plan lowered to fit (``{"extract_queue_size": 1, ...}``); the passes run with
    #: them (empty: as asked)
    pipeline: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_budgets(
        cls,
        *,
        num_nodes: int,
        row_bytes: int,
        gpu_cache: int | str,
        host_cache: int | str,
        staging: int | str,
        max_nodes_per_batch: int,
        num_extractors: int,
        train_queue_size: int,
        device: str,
        order: str = "out_of_order",
        staging_chunk_rows: int = 8192,
        num_samplers: int = 4,
        extract_queue_size: int = 6,
        batch_size: int | None = None,
        num_neighbors: Sequence[int] | None = None,
        num_edges: int | None = None,
        replace: bool = False,
        host_cache_policy: str = "presample",
        background_fill: bool = False,
        topology_shared: bool = False,
        split_sizes: Mapping[str, int] | None = None,
        seed_bytes: tuple[int, int, int] = (16, 8, 8),
        negatives: BatchNegatives | None = None,
        edge_bytes: int = BATCH_BYTES_PER_EDGE,
        processes: int = 1,
        memory_reserve: int | str | None = None,
        memory: MemoryLimit | None = None,
        shrink_pipeline: bool = True,
        warn: bool = True,
    ) -> "StorePlan":
        """Size every tier from the budgets, and fit what lives in host memory under the memory limit.

        The budgets become slot and row counts (a feature buffer below its reserve is
        refused). Then the host memory the plan allocates from here on (host cache,
        staging, the feature buffer on CPU, per-node and per-slot tables, batches in
        flight; see :func:`~lightning_ooc.store.tally.host_tally`) plus ``memory_reserve``
        (default :func:`~lightning_ooc.store.tally.training_reserve`) is compared with
        ``memory`` (default: :func:`~lightning_ooc.store.limits.memory_limit`, read now;
        ``MemoryLimit.none()`` turns the check off) divided by ``processes`` (ranks of this
        machine planning under the same limit). Call it after the dataset is open and the
        presample drawn: what is held then is in the usage the limit subtracts.

        The other arguments describe the pipeline (defaults: the datamodule's):
        ``num_samplers``, ``extract_queue_size``; the batches (``batch_size``,
        ``num_neighbors``, ``num_edges``, ``replace`` bound the edges of a batch);
        ``host_cache_policy``; ``background_fill`` (the host cache is ranked while training runs:
        its temporaries count in the training phase); ``topology_shared`` (``indptr`` in node-shared memory);
        ``split_sizes`` (``{"train": ..., "val": ..., "test": ...}``, as in ``meta.json``;
        default: every node a training seed; link prediction: the link splits' edges) and
        ``seed_bytes`` (bytes per training seed of an epoch's order, per training seed held,
        per evaluation seed: see :class:`~lightning_ooc.store.tally.ProcessShape`) and ``negatives``
        (of the largest link batch, :class:`~lightning_ooc.store.tally.BatchNegatives`) and ``edge_bytes``
        (bytes per edge of a batch in flight: 16 for ``edge_index``, 24 with ``e_id``).

        Where nothing else fits, the pipeline holds fewer batches (``shrink_pipeline``; see
        :func:`check_fits`): :attr:`pipeline` names the settings lowered, which the
        passes must run with. ``warn=False``: what was shrunk is not logged here (the caller logs
        :meth:`MemoryFit.warning` once the sizes are final).
        """
        gpu_b, host_b, stage_b = parse_bytes(gpu_cache), parse_bytes(host_cache), parse_bytes(staging)
        # a node holds at most one slot, so no more than num_nodes slots are ever needed at once
        reserve = min(required_slots(max_nodes_per_batch, num_extractors, train_queue_size, order), num_nodes)
        slots = min(gpu_b // row_bytes, num_nodes)
        if slots < reserve:
            need = reserve * row_bytes
            held = (f"{num_extractors} extractors" if order == "out_of_order"
                    else f"{num_extractors} extractors + train queue {train_queue_size} + 2, in order")  # fmt: skip
            raise InputError(
                f"features.gpu_cache={human_bytes(gpu_b)} holds {slots:,} rows of {row_bytes} B but the pipeline "
                f"needs at least {reserve:,} ({held}, batches of up to {max_nodes_per_batch:,} nodes) so that "
                f"extraction cannot deadlock; set features.gpu_cache to at least {human_bytes(need)}, or lower "
                "batch_size, num_neighbors or pipeline.num_extractors"
            )
        if stage_b < row_bytes:
            raise InputError(f"features.staging={human_bytes(stage_b)} cannot hold one row of {row_bytes} B; give it "
                             "at least 1MiB")  # fmt: skip
        host_rows = min(host_b // row_bytes, num_nodes)
        stage_b = min(stage_b, max(num_nodes * row_bytes, row_bytes * max(2, num_extractors)))
        chunk_rows = max(1, min(staging_chunk_rows, stage_b // row_bytes // max(2, num_extractors)))
        splits = dict(split_sizes or {})
        shape = ProcessShape(
            num_nodes=int(num_nodes), row_bytes=int(row_bytes), max_nodes_per_batch=int(max_nodes_per_batch),
            max_edges_per_batch=edges_per_batch_bound(batch_size, num_neighbors, int(max_nodes_per_batch), num_edges,
                                                      replace),
            buffer_on_host=not str(device).startswith("cuda"), num_samplers=int(num_samplers),
            num_extractors=int(num_extractors), extract_queue_size=int(extract_queue_size),
            train_queue_size=int(train_queue_size), host_cache_policy=host_cache_policy,
            background_fill=bool(background_fill), topology_shared=bool(topology_shared), train_nodes=splits.get("train"),
            eval_nodes=int(splits.get("val", 0)) + int(splits.get("test", 0)),
            seed_order_bytes=int(seed_bytes[0]), seeds_held_bytes=int(seed_bytes[1]),
            eval_seed_bytes=int(seed_bytes[2]), negatives=negatives, edge_bytes=int(edge_bytes),
        )  # fmt: skip
        fit = check_fits(
            shape, host_rows=int(host_rows), buffer_slots=int(slots), min_slots=int(reserve), staging_bytes=int(stage_b),
            limit=memory_limit() if memory is None else memory,
            reserve=None if memory_reserve is None else parse_bytes(memory_reserve), processes=processes,
            order=order if shrink_pipeline else None, warn=False,
        )  # fmt: skip
        if warn and fit.warning():
            log.warning("%s", fit.warning())
        chosen = fit.shape if fit.shape is not None else shape
        return cls(
            row_bytes=row_bytes, num_nodes=num_nodes, buffer_slots=int(fit.buffer_slots),
            buffer_reserve=int(fit.min_slots or reserve), max_nodes_per_batch=int(max_nodes_per_batch),
            host_rows=int(fit.host_rows), staging_bytes=int(stage_b), staging_chunk_rows=int(chunk_rows), device=device,
            memory_fit=fit, num_extractors=int(chosen.num_extractors), pipeline=fit.pipeline,
        )  # fmt: skip

    def format(self, *, extra: list[str] | None = None) -> str:
        rb = self.row_bytes
        host_hit = f", expected hit rate {self.expected_host_hit:.1%}" if self.expected_host_hit is not None else ""
        buf_hit = f", expected hit rate {self.expected_buffer_hit:.1%}" if self.expected_buffer_hit is not None else ""
        chosen = (f"chosen by access frequency over {self.presample_batches} presampled batches"
                  if self.host_policy == "presample" else "chosen by in-degree")  # fmt: skip
        if self.host_fill == "background" and self.host_rows:
            chosen = (f"chosen by access frequency over {self.presample_batches} batches (the epoch's first and "
                      "presampled ones), ranked in the background while training runs and kept from the buffer's "
                      "reads")  # fmt: skip
        lines = [
            f"  feature buffer  {human_bytes(self.buffer_slots * rb):>11}  {self.buffer_slots:,} slots on {self.device} "
            f"(reserve {self.buffer_reserve:,} = batches in flight x {self.max_nodes_per_batch:,} nodes){buf_hit}",
            f"  host cache      {human_bytes(self.host_rows * rb):>11}  {self.host_rows:,} rows "
            f"({self.host_rows / max(self.num_nodes, 1):.1%} of nodes), {chosen}{host_hit}",
            f"  staging         {human_bytes(self.staging_bytes):>11}  chunks of {self.staging_chunk_rows:,} rows",
            f"  SSD             {human_bytes(self.num_nodes * rb):>11}  {self.num_nodes:,} rows of {rb} B, "
            f"reader backend {self.backend} ({self.backend_reason})",
        ]
        if self.memory_fit is not None:  # what was asked and what is planned, from the sizes as they are now
            shrunk = "; ".join(s.split(" (")[0] if s.startswith(("host_cache", "gpu_cache")) else s
                               for s in self.memory_fit.shrunk)  # fmt: skip
            shrunk = f"; {shrunk} to fit" if shrunk else ""
            lines.append(self.memory_fit.format() + shrunk)
        if self.split_note:
            lines.append(f"  split           {self.split_note}")
        return "\n".join(["lightning_ooc plan:"] + lines + (extra or []))


# -------------------------------------------------------------------------------------------------
# planning from a dataset and its presampled batches
# -------------------------------------------------------------------------------------------------
#: margin over the largest presampled batch when sizing the buffer's reserve
BATCH_MARGIN, BATCH_SLACK = 1.25, 64


def max_nodes_per_batch(num_nodes: int, batch_size: int, fanout: list[int], presampled: list[torch.Tensor]) -> int:
    """The node count the plan reserves per batch: the presampled maximum with a margin, within the hard bound.

    A batch may still exceed it (the run then waits for slots in order, never deadlocks);
    it only sizes the reserve of the feature buffer.
    """
    seen = max((int(b.numel()) for b in presampled), default=1)
    bound = reach = batch_size
    for f in fanout:
        reach = reach * (f if f >= 0 else num_nodes)
        bound += reach
    return int(min(num_nodes, bound, math.ceil(seen * BATCH_MARGIN) + BATCH_SLACK))


def size_store(cfg: Any, ds: Any, device: torch.device, presampled: list[torch.Tensor], *,
               seeds_per_batch: int | None = None, processes: int = 1, topology_shared: bool = False,
               background_fill: bool = False, memory: Any = None, num_edges: int | None = None,
               **plan_kwargs: Any) -> StorePlan:  # fmt: skip
    """The sizes of the tiers from the budgets of ``cfg``, fitted under ``memory`` (default: its ``memory_limit``,
    read now), without choosing the host cache's rows: :meth:`StorePlan.from_budgets` with what ``cfg``, the
    dataset and the presampled batches say (what :func:`plan_store` plans with; nothing is logged)."""
    seeds = int(seeds_per_batch or cfg.batch_size)
    scored = cfg.features.host_cache_policy == "scored"  # warm-started like "presample" (and planned like it)
    if memory is None:
        memory = limit_for_plan(getattr(cfg, "memory_limit", "auto"))  # what is live, not what was freed
    max_nodes = max_nodes_per_batch(ds.num_nodes, seeds, cfg.num_neighbors, presampled)
    return StorePlan.from_budgets(
        num_nodes=ds.num_nodes, row_bytes=ds.row_bytes, gpu_cache=cfg.features.gpu_cache,
        host_cache=cfg.features.host_cache, staging=cfg.features.staging, max_nodes_per_batch=max_nodes,
        num_extractors=cfg.pipeline.num_extractors, train_queue_size=cfg.pipeline.train_queue_size, device=str(device),
        order=cfg.pipeline.order, num_samplers=cfg.pipeline.num_samplers,
        extract_queue_size=cfg.pipeline.extract_queue_size, batch_size=seeds,
        num_neighbors=cfg.num_neighbors, num_edges=ds.num_edges if num_edges is None else num_edges,
        replace=cfg.replace, host_cache_policy="presample" if scored else cfg.features.host_cache_policy,
        background_fill=background_fill, topology_shared=topology_shared, processes=processes, memory=memory,
        warn=False,
        edge_bytes=BATCH_BYTES_PER_EDGE_WITH_ID if getattr(cfg, "return_e_id", False) else BATCH_BYTES_PER_EDGE,
        **{"split_sizes": ds.meta.get("split_sizes"), **plan_kwargs},
    )  # fmt: skip


def plan_store(cfg: Any, ds: Any, reader: Any, device: torch.device, presampled: list[torch.Tensor], *,
               processes: int = 1, topology_shared: bool = False,
               counted: Callable[[], Iterable[torch.Tensor]] | None = None, seeds_per_batch: int | None = None,
               counts: torch.Tensor | None = None, in_degree: Any = None, host_cache_fill: str = "setup",
               warn: bool = True, **plan_kwargs: Any) -> tuple[StorePlan, HotSet | DeferredHot]:  # fmt: skip
    """Size every tier from the budgets of ``cfg``, fit them under its ``memory_limit``, choose the host cache's rows.

    ``presampled`` batches size the feature buffer's reserve and give the plan's expected
    hit rates; the host cache's rows are the most accessed over ``counted()`` (batches
    sampled independently of ``presampled``, so the estimates are not measured on the
    batches that chose the rows; default: ``presampled`` themselves).
    ``seeds_per_batch`` is the most seed nodes a batch starts from (default ``cfg.batch_size``;
    a link batch starts from the endpoints of its edges and negatives).
    ``counts``: the host cache's access counts, counted already (instead of over ``counted()``);
    ``in_degree``: the nodes' in-degree (default ``ds.in_degree``).
    ``host_cache_fill``: ``"setup"`` ranks the host cache's rows here; ``"background"`` (and ``"auto"`` for a
    host cache of :data:`~lightning_ooc.store.background.BACKGROUND_FILL_BYTES` or more, with the
    ``"presample"`` policy) returns a :class:`~lightning_ooc.store.background.DeferredHot` instead, whose
    ranking over ``counted()`` runs in the store's fill thread (the split of a shrunk CPU plan is then
    judged with a ranking over half of ``presampled``, on the other half).
    ``processes`` is the number of processes of this machine that plan under the same
    limit at once, ``topology_shared`` whether ``indptr`` lives in node-shared memory;
    ``plan_kwargs`` go to :meth:`StorePlan.from_budgets` (through :func:`size_store`).
    ``warn=False``: what was shrunk to fit is not logged (the caller logs it, e.g. once for the plans of every
    node type).
    """
    scored = cfg.features.host_cache_policy == "scored"  # warm-started like "presample" (and planned like it)
    # ranked while training runs (then the plan counts its temporaries in the training phase)
    background = (cfg.features.host_cache_policy == "presample" and counts is None
                  and (host_cache_fill == "background"
                       or (host_cache_fill == "auto"
                           and cfg.features.host_cache >= BACKGROUND_FILL_BYTES)))  # fmt: skip
    memory = plan_kwargs.pop("memory", None)
    if memory is None:
        memory = limit_for_plan(getattr(cfg, "memory_limit", "auto"))  # what is live, not what was freed
    num_edges = plan_kwargs.pop("num_edges", ds.num_edges)

    def sized(background_fill: bool) -> StorePlan:
        return size_store(cfg, ds, device, presampled, seeds_per_batch=seeds_per_batch, processes=processes,
                          topology_shared=topology_shared, background_fill=background_fill, memory=memory,
                          num_edges=num_edges, **plan_kwargs)  # fmt: skip

    if background and host_cache_fill == "auto":
        # ranking beside training costs memory the set-up's ranking does not (it runs before the store exists):
        # the ranking and fill stay at set-up where that would not fit, or would shrink budgets that fit as asked
        quiet, log.disabled = log.disabled, True  # trials: what they would shrink is not what will run
        try:
            at_setup = sized(False)
            try:
                beside = sized(True)
                background = not (beside.memory_fit is not None and beside.memory_fit.shrunk
                                  and not (at_setup.memory_fit is not None and at_setup.memory_fit.shrunk))  # fmt: skip
            except InputError:
                background = False
        finally:
            log.disabled = quiet
        plan = sized(background)  # again, to log what it shrinks
    else:
        plan = sized(background)
    fit = plan.memory_fit
    # On CPU both tiers hold rows in host memory: when they had to shrink to fit, the presample
    # decides how that memory is shared between them (the budgets asked for could not be kept anyway).
    split = (fit is not None and bool(fit.shrunk) and fit.shape is not None and fit.shape.buffer_on_host
             and cfg.features.host_cache_policy in ("presample", "scored") and plan.buffer_slots > plan.buffer_reserve
             and cfg.features.host_cache > 0)  # host_cache=0 asks for no host cache at all  # fmt: skip
    most = plan.host_rows
    if split:
        most = largest_where(plan.host_rows, ds.num_nodes, lambda h: fit.fits(h, plan.buffer_reserve)) or most
    plan.backend, plan.backend_reason = reader.backend, reader.backend_reason
    # the ranking's tie-break, a slice at a time (not an array of one entry per node)
    deg = in_degree if in_degree is not None else InDegree(ds.indptr) if hasattr(ds, "indptr") else ds.in_degree
    if background and most > 0:
        plan, deferred = _plan_deferred(plan, cfg, ds, presampled, counted, deg, most, split)
        if warn:
            _warn_shrunk(plan, cfg)
        return plan, deferred
    batches_counted = 0

    def counting() -> Iterator[torch.Tensor]:
        nonlocal batches_counted
        for n_id in (counted() if counted is not None else presampled):
            batches_counted += 1
            yield n_id

    hot = choose_hot(most, ds.num_nodes, policy=cfg.features.host_cache_policy, in_degree=deg, presample=counting,
                     counts=counts)  # fmt: skip
    if split:
        hot = split_host_memory(plan, hot, presampled, ds.num_nodes)
    if warn:
        _warn_shrunk(plan, cfg)  # once the sizes are final: the same account as the plan's memory line
    if scored:
        hot.scored = (cfg.features.cache_decay, cfg.features.cache_interval)
    plan.host_policy, plan.presample_batches = hot.policy, batches_counted or len(presampled)
    if hot.counts is not None:
        plan.expected_host_hit = host_hit_rate(hot.ids, presampled, ds.num_nodes)
    touched, local = compact_ids(presampled)
    cached = local_positions(touched, hot.ids)
    plan.expected_buffer_hit = simulate_buffer(plan.buffer_slots, touched.numel(), local, cached[cached >= 0])
    return plan, hot


def _warn_shrunk(plan: StorePlan, cfg: Any) -> None:
    """Log what the plan changed to fit in memory, from its final sizes (after a split of host memory): a warning
    where a budget asked for was shrunk, an info line where only the defaults were (a user who set no budget
    asked for none: fitting the defaults to the memory there is is the plan's job)."""
    line = plan.memory_fit.warning() if plan.memory_fit is not None else None
    if not line:
        return
    if not {"gpu_cache", "host_cache", "staging"} & set(cfg.features.settings()):
        log.info("%s", line)
    else:
        log.warning("%s", line)


def _plan_deferred(plan: StorePlan, cfg: Any, ds: Any, presampled: list[torch.Tensor],
                   counted: Callable[[], Iterable[torch.Tensor]] | None, deg: Any, most: int,
                   split: bool) -> tuple[StorePlan, DeferredHot]:  # fmt: skip
    """:func:`plan_store`'s sizes for a host cache ranked in the background: the split of a shrunk CPU
    plan judged with a ranking over half of the presampled batches, on the other half; the ranking over
    ``counted()`` deferred to the fill thread."""
    if split:  # judged on batches its ranking did not count
        half = len(presampled) // 2
        rank_on, judge_on = (presampled[:half], presampled[half:]) if half else (presampled, presampled)
        hot = choose_hot(most, ds.num_nodes, policy="presample", in_degree=deg, presample=lambda: iter(rank_on))
        split_host_memory(plan, hot, judge_on, ds.num_nodes, candidates=3)  # on the critical path: fewer tried
        del hot
    plan.host_policy, plan.host_fill = "presample", "background"
    plan.presample_batches = int(cfg.features.presample_batches) or len(presampled)
    size = plan.host_rows
    # the epoch's own batches (the host cache tier adds them) and the thread's presample fill the same count
    counter = BatchCounter(ds.num_nodes, plan.presample_batches)

    def rank(check: Callable[[], None]) -> HotSet:
        source = iter(counted() if counted is not None else presampled)
        while not counter.full:  # a presampled batch at a time, until the two sources together fill the count
            check()
            n_id = next(source, None)
            if n_id is None:
                break
            counter.add(n_id)
        counts = counter.take()
        plan.presample_batches = counter.observed + counter.presampled or plan.presample_batches
        ranked = choose_hot(size, ds.num_nodes, policy="presample", in_degree=deg, counts=counts,
                            ordered=False)  # expected in id order  # fmt: skip
        return HotSet(ranked.ids, ranked.policy, ranked.expected_hit_rate)  # the counts go before the estimates

    def done(ranked: HotSet, fill: Any) -> None:  # the estimate too is off the critical path
        # the host cache's hit rate only: simulating the buffer beside the running one would cost its tables twice
        plan.expected_host_hit = host_hit_rate(ranked.ids, presampled, ds.num_nodes)
        rows = min(int(ranked.ids.numel()), size)
        log.info("lightning_ooc: host cache ranked in the background: %s rows (%s) over %d batches (%d of the "
                 "epoch's own, %d presampled) in %.1f s, after %d batches trained, kept as the feature buffer reads "
                 "them (%s so far); expected host cache hit rate %.1f%%",
                 f"{rows:,}", human_bytes(rows * ds.row_bytes), plan.presample_batches, counter.observed,
                 counter.presampled, fill.rank_seconds, fill.ranked_after_batches or 0, f"{fill.rows_filled:,}",
                 100 * (plan.expected_host_hit or 0.0))  # fmt: skip

    return plan, DeferredHot(rank, done, counter)


def split_host_memory(plan: StorePlan, ranked: HotSet, presampled: list[torch.Tensor], num_nodes: int,
                      candidates: int = 5) -> HotSet:  # fmt: skip
    """Share the host memory of a shrunk CPU plan between the host cache and the feature buffer.

    ``ranked`` holds the hot rows, hottest first, for the largest host cache that fits
    beside a buffer at its reserve. Buffer sizes from ``plan.buffer_slots`` down to the
    reserve are tried (``candidates`` of them, evenly spaced), each with the largest host
    cache that fits beside it; the pair that serves the most rows of the ``presampled``
    batches from memory (host hits, then LRU buffer hits over the rest) is taken, the
    plan's first pair on a tie. ``plan`` and its memory fit are resized in place, and
    ``plan.split_note`` says what was chosen; returns the hot set (a prefix of ``ranked``).

    A static cache of the most accessed rows usually serves more per byte than the buffer,
    which keeps only what recent batches touched, so this mostly moves memory from the
    buffer to the host cache; on access patterns without hot rows it keeps the buffer.
    """
    fit = plan.memory_fit
    assert fit is not None
    lo, hi = plan.buffer_reserve, plan.buffer_slots
    sizes = sorted({hi - (hi - lo) * i // (candidates - 1) for i in range(candidates)}, reverse=True)
    best = None
    # the simulations run over the nodes the presample touched, renumbered (the same order, so the same hits)
    touched, local = compact_ids(presampled)
    pos = local_positions(touched, ranked.ids)  # each ranked row's new number, -1 where no batch touched it
    for slots in sizes:
        h = plan.host_rows if slots == hi else largest_where(0, ranked.ids.numel(), lambda x: fit.fits(x, slots))
        if h is None:
            continue
        cached = pos[:h][pos[:h] >= 0]
        host_hit = host_hit_rate(cached, local, touched.numel())
        buf_hit = simulate_buffer(slots, touched.numel(), local, cached) or 0.0
        served = host_hit + (1.0 - host_hit) * buf_hit
        if best is None or served > best[0] + 1e-9:
            best = (served, slots, h)
    assert best is not None  # the plan's own pair always fits
    served, slots, h = best
    first = sizes[0]
    if slots != hi:
        fit.resize(h, slots)
        plan.host_rows, plan.buffer_slots = h, slots
    rb = plan.row_bytes
    note = (f"host memory shared by expected hits over the presample: host_cache {human_bytes(h * rb)}, gpu_cache "
            f"{human_bytes(slots * rb)} serve {served:.1%} of the rows (of {len(sizes)} splits tried"
            f"{'' if slots != first else ', the first kept'})")  # fmt: skip
    log.info("lightning_ooc: %s; set features.host_cache=%s and features.gpu_cache=%s to plan this directly", note,
             budget_setting(h * rb), budget_setting(slots * rb))  # fmt: skip
    counts = ranked.counts
    hit = float(counts[ranked.ids[:h]].sum()) / max(int(counts.sum()), 1) if counts is not None else None
    plan.split_note = note
    return HotSet(ranked.ids[:h], ranked.policy, hit, counts)


def compact_ids(batches: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The distinct node ids of ``batches`` (ascending) and the batches renumbered into them: simulations over
    a presample then need tables of the nodes it touched, not of the graph's.

    >>> touched, local = compact_ids([torch.tensor([90, 7]), torch.tensor([7, 30])])
    >>> touched.tolist(), [b.tolist() for b in local]
    ([7, 30, 90], [[2, 0], [0, 1]])
    """
    if not batches:
        return torch.empty(0, dtype=torch.int64), []
    touched, inverse = torch.unique(torch.cat([b.to(torch.int64) for b in batches]), return_inverse=True)
    return touched, list(inverse.split([int(b.numel()) for b in batches]))


def local_positions(touched: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each of ``ids``' position in the sorted ``touched``, ``-1`` where it is not there.

    >>> local_positions(torch.tensor([7, 30, 90]), torch.tensor([30, 8, 90, 100])).tolist()
    [1, -1, 2, -1]
    """
    ids = ids.to(torch.int64)
    if touched.numel() == 0:
        return torch.full_like(ids, -1)
    at = torch.searchsorted(touched, ids).clamp_(max=touched.numel() - 1)
    return torch.where(touched[at] == ids, at, torch.full_like(at, -1))


def host_hit_rate(ids: torch.Tensor, batches: list[torch.Tensor], num_nodes: int) -> float | None:
    """Share of the node accesses of ``batches`` that a host cache of ``ids`` serves (None without batches)."""
    total = sum(int(b.numel()) for b in batches)
    if not total:
        return None
    cached = torch.zeros(num_nodes, dtype=torch.bool)
    cached[ids] = True
    return sum(int(cached[b].sum()) for b in batches) / total


def simulate_buffer(slots: int, num_nodes: int, batches: list[torch.Tensor], host_ids: torch.Tensor) -> float | None:
    """Hit rate an LRU buffer of ``slots`` rows would have over the presampled batches (host rows excluded)."""
    if not batches:
        return None
    in_host = torch.zeros(num_nodes, dtype=torch.bool)
    in_host[host_ids] = True
    sim = FeatureBuffer(slots, num_nodes, 1, torch.uint8, "cpu")
    hits = total = 0
    for n_id in batches:
        rest = n_id[~in_host[n_id]]
        if rest.numel() > slots:
            return None
        a = sim.acquire(rest)
        hits += int(a.hit.sum())
        total += rest.numel()
        sim.mark_valid(a.slots)
        sim.release(a.slots)
    return hits / total if total else 0.0


# -------------------------------------------------------------------------------------------------
# several node types: the budgets shared, the host cache ranked across types, one fit
# -------------------------------------------------------------------------------------------------
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
        >>> from lightning_ooc.loader.config import NodeDataConfig
        >>> from lightning_ooc.loader.context import ProcessContext
        >>> from lightning_ooc.loader.features import Tiered
        >>> from lightning_ooc.loader.hetero_task import HeteroLocalPasses
        >>> root = synthesize_hetero(tempfile.mkdtemp() + "/h", "mag", num_nodes=1000, num_features=8,
        ...                          train_frac=0.2, progress=False)
        >>> cfg = NodeDataConfig(root, batch_size=50, num_neighbors=[3, 2], progress=False,
        ...                      features=Tiered(gpu_cache="1MiB", host_cache="8KiB", staging="256KiB"))
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
        """Each type's memory check (:class:`MemoryFit`), where it was made."""
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
    fitted under the memory limit together (:func:`fit_parts`: each type's plan gets
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


# -- layer-wise inference: the memory its partitions are sized from, fitted under the same limit ----------------
#: kept free beside ``memory`` under a memory limit: what a layer allocates that its plan does not count
#: (a read's aligned buffer and its float copy, the operations' temporaries), with :data:`LAYERWISE_OVER_MEMORY`
LAYERWISE_RESERVE = 64 << 20
#: ... and the share of ``memory`` a run may use above it (partitions are whole multiples of a row unit, a
#: layer holds its inputs and outputs at once, the allocator keeps some freed pages): what a model whose layers
#: say nothing lower or higher is planned with (a ``BlockedLayer``'s ``over_memory`` says what it was measured at)
LAYERWISE_OVER_MEMORY = 1.4
#: the least ``memory`` a plan is made with (:func:`fit_layerwise_memory` refuses a limit that leaves less)
LAYERWISE_MIN_MEMORY = 1 << 16


def fit_layerwise_memory(memory: int, memory_limit: int | str | None,
                         over: float = LAYERWISE_OVER_MEMORY) -> tuple[int, MemoryLimit]:  # fmt: skip
    """``memory`` (bytes for partitions and edge chunks) fitted under what this process may still allocate, and
    that limit, read once here for the run (:func:`~lightning_ooc.store.limits.limit_for_plan` of
    ``memory_limit``: ``"auto"``, the cgroup's limit and ``MemAvailable``; a size; None: no limit).

    ``memory`` is shrunk (logged) to what the limit leaves, less :data:`LAYERWISE_RESERVE`, over ``over`` (the
    share of ``memory`` the model's layers were measured to use; :data:`LAYERWISE_OVER_MEMORY` by default); an
    :class:`InputError` where that is less than :data:`LAYERWISE_MIN_MEMORY`. Whether the plan made in it fits the limit
    (its smallest partitions may need more than ``memory``) is :func:`check_layerwise_fits`'s check, given the limit returned.

        >>> memory, limit = fit_layerwise_memory(1 << 30, None)
        >>> memory == 1 << 30, limit.unlimited
        (True, True)
    """
    memory = int(memory)
    limit = limit_for_plan(memory_limit)
    if limit.unlimited:
        return memory, limit
    room = int((limit.bytes - LAYERWISE_RESERVE) / over)
    if room < LAYERWISE_MIN_MEMORY:
        raise InputError(f"layer-wise inference needs at least {human_bytes(int(LAYERWISE_MIN_MEMORY * over) + LAYERWISE_RESERVE)} "
                         f"of memory, and this process has {limit}: free memory or run it under a higher limit "
                         "(memory_limit=, --data.memory_limit)")  # fmt: skip
    if memory > room:
        log.warning("layer-wise inference: memory=%s does not fit %s; planning with %s", human_bytes(memory), limit,
                    human_bytes(room))  # fmt: skip
        return room, limit
    return memory, limit


def check_layerwise_fits(need: int, memory: int, limit: MemoryLimit, over: float = LAYERWISE_OVER_MEMORY) -> None:
    """Raise an :class:`InputError` (one line, naming ``limit``) where a plan's smallest partitions need more
    than the ``memory`` it was made in (``need`` bytes: partitions are whole multiples of a row unit) and, with
    ``over`` and :data:`LAYERWISE_RESERVE`, more than ``limit`` (what :func:`fit_layerwise_memory` read) leaves.

        >>> check_layerwise_fits(100 << 20, 1 << 20, MemoryLimit.none("memory_limit=None")) is None
        True
        >>> check_layerwise_fits(100 << 20, 1 << 20, MemoryLimit(150 << 20, "a test"))
        Traceback (most recent call last):
        ...
        lightning_ooc.errors.InputError: layer-wise inference: its smallest partitions need about 100.00 MiB, ...
    """
    if need <= memory or limit.unlimited or int(need * over) + LAYERWISE_RESERVE <= limit.bytes:
        return
    raise InputError(f"layer-wise inference: its smallest partitions need about {human_bytes(need)}, and this "
                     f"process has {limit}: free memory or run it under a higher limit (memory_limit=, "
                     "--data.memory_limit)")  # fmt: skip
