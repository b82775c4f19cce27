"""Turning byte budgets into tier sizes, and the plan printed once at setup.

The plan also checks that what it allocates in host memory fits under the
limit this process runs under (:mod:`lightning_ooc.store.memory`): it shrinks
the host cache (then, on CPU, the feature buffer, then the batches in flight)
and warns, or refuses with an :class:`~lightning_ooc.errors.InputError` that
says what to shrink. The plan's memory line and the warning compare what was
asked with the sizes finally planned (after host memory is shared between the
host cache and the buffer too).

Example::

    >>> from lightning_ooc.store.memory import MemoryLimit
    >>> from lightning_ooc.store.plan import StorePlan
    >>> plan = StorePlan.from_budgets(
    ...     num_nodes=3_000_000, row_bytes=64, gpu_cache="64MiB", host_cache="2GiB", staging="8MiB",
    ...     max_nodes_per_batch=10_000, num_extractors=4, train_queue_size=4, device="cpu",
    ...     batch_size=256, num_neighbors=[5, 5], num_edges=30_000_000, split_sizes={"train": 30_000},
    ...     memory=MemoryLimit(600 << 20, "a test"))
    >>> plan.host_rows
    778652
    >>> print(plan.format().splitlines()[-1])
      host memory      432.94 MiB  planned at its peak (training) + 167.06 MiB reserve, of 600.00 MiB available (a test); host_cache shrunk from 183.11 MiB to 47.53 MiB to fit
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from lightning_ooc.errors import InputError
from lightning_ooc.data.format import human_bytes, parse_bytes
from lightning_ooc.store.buffer import required_slots
from lightning_ooc.store.memory import (BatchNegatives, MemoryFit, MemoryLimit, ProcessShape, check_fits,
                                        edges_per_batch_bound, memory_limit)
from lightning_ooc.store.tally import BATCH_BYTES_PER_EDGE

log = logging.getLogger("lightning_ooc")


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
    #: when the host cache's rows are ranked and read: ``"setup"`` (before training) or ``"background"``
    #: (while training runs, :mod:`lightning_ooc.store.background`)
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
        flight; see :func:`~lightning_ooc.store.memory.host_tally`) plus ``memory_reserve``
        (default :func:`~lightning_ooc.store.memory.training_reserve`) is compared with
        ``memory`` (default: :func:`~lightning_ooc.store.memory.memory_limit`, read now;
        ``MemoryLimit.none()`` turns the check off) divided by ``processes`` (ranks of this
        machine planning under the same limit). Call it after the dataset is open and the
        presample drawn: what is held then is in the usage the limit subtracts.

        The other arguments describe the pipeline (defaults: the datamodule's):
        ``num_samplers``, ``extract_queue_size``; the batches (``batch_size``,
        ``num_neighbors``, ``num_edges``, ``replace`` bound the edges of a batch);
        ``host_cache_policy``; ``background_fill`` (the host cache is ranked and read while training runs:
        its temporaries count in the training phase); ``topology_shared`` (``indptr`` in node-shared memory);
        ``split_sizes`` (``{"train": ..., "val": ..., "test": ...}``, as in ``meta.json``;
        default: every node a training seed; link prediction: the link splits' edges) and
        ``seed_bytes`` (bytes per training seed of an epoch's order, per training seed held,
        per evaluation seed: see :class:`~lightning_ooc.store.memory.ProcessShape`) and ``negatives``
        (of the largest link batch, :class:`~lightning_ooc.store.memory.BatchNegatives`) and ``edge_bytes``
        (bytes per edge of a batch in flight: 16 for ``edge_index``, 24 with ``e_id``).

        Where nothing else fits, the pipeline holds fewer batches (``shrink_pipeline``; see
        :func:`~lightning_ooc.store.memory.check_fits`): :attr:`pipeline` names the settings lowered, which the
        passes must run with. ``warn=False``: what was shrunk is not logged here (the caller logs
        :meth:`~lightning_ooc.store.memory.MemoryFit.warning` once the sizes are final).
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
            chosen += ", ranked and read in the background while training runs"
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
