"""The grouped settings of the sampled-GNN datamodules besides the feature backend: the pipeline, and predict.

Each group is a small dataclass that checks its own fields and holds each default once. A datamodule takes
them as ``pipeline=Pipeline(...)`` (or a dict of the same fields), and LightningCLI fills them from nested
YAML::

    data:
      root: data/papers100M
      features: {class_path: lightning_ooc.Tiered, init_args: {gpu_cache: 4GiB, host_cache: 8GiB}}
      pipeline: {num_samplers: 4, num_extractors: 4}

Where ``x`` comes from, and that backend's own settings (budgets, caching, the reader), is the feature
backend's (:mod:`lightning_ooc.loader.features`).

Example::

    >>> from lightning_ooc.loader.settings import Pipeline, group
    >>> Pipeline(num_samplers=2).num_extractors == default_threads()
    True
    >>> group("pipeline", {"order": "in_order"}).order
    'in_order'
    >>> Pipeline(num_samplers=0)
    Traceback (most recent call last):
      ...
    lightning_ooc.errors.InputError: num_samplers must be an integer >= 1, got 0 (the pipeline needs at least one sampler thread)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from lightning_ooc.errors import InputError
from lightning_ooc.utils.groups import plain, settings_group
from lightning_ooc.loader.features import positive, size
from lightning_ooc.sampling.temporal import Temporal, check_temporal

__all__ = ["Pipeline", "PredictSettings", "GROUPS", "group", "plain", "ORDERS", "INFERENCE_MODES", "default_threads"]

ORDERS = ("out_of_order", "in_order")
#: the most sampler (and extractor) threads a pipeline starts by default
MAX_DEFAULT_THREADS = 4


def default_threads() -> int:
    """Sampler threads, and extractor threads, of a pipeline left at its defaults: one per CPU core this process
    may run on, at most :data:`MAX_DEFAULT_THREADS`. More threads than cores only contend: on two cores, two
    samplers and two extractors load a batch as fast as four of each, and hold fewer batches in memory.

        >>> 1 <= default_threads() <= MAX_DEFAULT_THREADS
        True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_THREADS, cores))


@dataclass
class Pipeline:
    """The pipeline's threads (one per core, up to 4) and queues (GNNDrive's), the order batches are trained in,
    and its timeline.

    Args:
        order: ``"out_of_order"`` (train batches as they complete) or ``"in_order"`` (sampling order;
            reproducible for a given seed).
        num_samplers: sampler threads (default: :func:`default_threads`, one per core up to 4).
        num_extractors: extractor threads, each with its own reader (default: :func:`default_threads`).
        extract_queue_size: sampled minibatches waiting for an extractor.
        train_queue_size: extracted minibatches waiting for the trainer.
        profile: a directory; every pass then writes its per-stage timeline there
            (``ooc-rank{R}-{split}-{N}.trace.json``, N counting that split's passes: sampling, claim, SSD reads
            and copies, waits, gather, training, release, per thread and batch), a Chrome trace that Perfetto
            (ui.perfetto.dev), ``chrome://tracing`` and TensorBoard's profiler open.

    >>> Pipeline(order="in_order", num_samplers=2).num_samplers, Pipeline().train_queue_size
    (2, 4)
    """

    order: str = "out_of_order"
    num_samplers: int = field(default_factory=default_threads)
    num_extractors: int = field(default_factory=default_threads)
    extract_queue_size: int = 6
    train_queue_size: int = 4
    profile: str | None = None

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise InputError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        self.num_samplers = positive("num_samplers", self.num_samplers, "the pipeline needs at least one sampler thread")
        self.num_extractors = positive("num_extractors", self.num_extractors,
                                       "the pipeline needs at least one extractor thread")  # fmt: skip
        self.extract_queue_size = positive("extract_queue_size", self.extract_queue_size,
                                           "sampled minibatches waiting for an extractor")  # fmt: skip
        self.train_queue_size = positive("train_queue_size", self.train_queue_size,
                                         "extracted minibatches waiting for the trainer")  # fmt: skip
        if self.profile is not None:
            if not isinstance(self.profile, (str, os.PathLike)) or not os.fspath(self.profile):
                raise InputError(f"profile must be a directory for the timeline files, got {self.profile!r}")
            self.profile = os.fspath(self.profile)


INFERENCE_MODES = ("sampled", "layerwise")


@dataclass
class PredictSettings:
    """How ``predict`` runs (``trainer.predict`` / ``lightning-ooc predict``).

    Args:
        inference: ``"sampled"`` (the test split's minibatches, sampled with ``eval_num_neighbors``) or
            ``"layerwise"``: every node, one layer at a time over full neighbourhoods, each layer's outputs a
            table on disk (:func:`lightning_ooc.infer.layerwise`); batches then carry the outputs (``out``) and
            the node ids (``n_id``) of a range of nodes.
        inference_out: with ``"layerwise"``, the dataset the outputs are written to (the input's graph, labels
            and splits with the outputs as features; replaced if it is one already); default: ``predictions``
            in the trainer's ``default_root_dir``.
        inference_memory: with ``"layerwise"``, bytes for the partitions resident at a time (a size such as
            ``"1GiB"``, parsed once: the field then holds bytes).
        inference_chunk: with ``"layerwise"``, nodes per predict batch.

    >>> PredictSettings(inference="layerwise", inference_memory="2GiB").inference_memory >> 30
    2
    """

    inference: str = "sampled"
    inference_out: str | None = None
    inference_memory: int | str = "1GiB"
    inference_chunk: int = 65536

    def __post_init__(self) -> None:
        if self.inference not in INFERENCE_MODES:
            raise InputError(f"inference must be one of {', '.join(INFERENCE_MODES)}, got {self.inference!r}")
        if self.inference_out is not None:
            self.inference_out = os.fspath(self.inference_out)
        self.inference_memory = size("inference_memory", self.inference_memory)
        positive("inference_chunk", self.inference_chunk, "nodes per predict batch")


#: where a seed's time comes from (``input_time``): its split's times where it has them, or its node time
INPUT_TIMES = ("split", "node")


@dataclass
class TimeSettings:
    """Temporal sampling, with the names PyG's ``NeighborLoader`` gives its arguments
    (:mod:`lightning_ooc.sampling.temporal`).

    Args:
        time_attr: ``"time"`` (each node's time, the dataset's ``node_time``) or ``"edge_time"`` (each edge's);
            None (the default): sampling without time. A seed's subgraph then holds only in-edges no later than
            the seed's time, and each seed has a subgraph of its own.
        temporal_strategy: ``"uniform"`` (the eligible in-edges uniformly) or ``"last"`` (the latest ``fanout``).
        time_window: only in-edges at most this much earlier than their seed (the dataset's time unit); None: no
            limit.
        input_time: each seed's time: ``"split"`` (the split's own, ``{split}_time``, where it has them, else the
            seed's node time) or ``"node"`` (the seed's node time). Link batches sample each supervision edge at
            its link split's ``time`` (PyG's ``edge_label_time``).

    >>> TimeSettings(time_attr="edge_time", temporal_strategy="last").temporal
    Temporal(time_attr='edge_time', strategy='last', window=None)
    """

    time_attr: str | None = None
    temporal_strategy: str = "uniform"
    time_window: int | None = None
    input_time: str = "split"

    def __post_init__(self) -> None:
        check_temporal(self.time_attr, self.temporal_strategy, self.time_window)
        if self.input_time not in INPUT_TIMES:
            raise InputError(f"input_time must be one of {list(INPUT_TIMES)} (where each seed's time comes from), got "
                             f"{self.input_time!r}")  # fmt: skip

    @property
    def temporal(self) -> Temporal | None:
        """The temporal sampling asked for (None: none)."""
        return check_temporal(self.time_attr, self.temporal_strategy, self.time_window)


#: the groups, by the keyword a datamodule takes them with
GROUPS: dict[str, type] = {"pipeline": Pipeline, "predict": PredictSettings, "time": TimeSettings}


def group(name: str, given: Any) -> Any:
    """The settings group ``name``: ``given`` as an instance, a dict of its fields, or None for the defaults."""
    return settings_group(GROUPS[name], name, given)
