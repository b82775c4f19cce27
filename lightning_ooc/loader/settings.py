"""The grouped settings of the sampled-GNN datamodules: budgets, pipeline shape, caching, I/O, remote, learnable.

Each group is a small dataclass that checks its own fields and holds each default once. A datamodule takes
them as ``budgets=Budgets(...)`` (or a dict of the same fields), and LightningCLI fills them from nested YAML::

    data:
      root: data/papers100M
      budgets: {gpu_cache: 4GiB, host_cache: 8GiB}
      pipeline: {num_samplers: 4, num_extractors: 4}

Every field keeps its flat keyword name as well (``gpu_cache="4GiB"``), mapped onto its group by
:data:`FLAT`, so configs written with flat names run unchanged. A flat name left at its default defers
to the group; a flat name and a group field that both differ from the default and from each other are an
error (:func:`merge`).

Example::

    >>> from lightning_ooc.loader.settings import Budgets, FLAT, merge
    >>> Budgets(gpu_cache="4GiB").host_cache
    '1GiB'
    >>> FLAT["num_samplers"]
    'pipeline'
    >>> merge("budgets", {"host_cache": "2GiB"}, {"gpu_cache": "4GiB"})
    Budgets(gpu_cache='4GiB', host_cache='2GiB', staging='256MiB', memory_limit='auto')
    >>> Budgets(staging="lots")
    Traceback (most recent call last):
      ...
    lightning_ooc.errors.InputError: staging: cannot parse byte budget 'lots'; write e.g. '4GiB', '256MiB' or an integer
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any

from lightning_ooc.data.format import parse_bytes
from lightning_ooc.errors import InputError

ORDERS = ("out_of_order", "in_order")
HOST_CACHE_POLICIES = ("presample", "degree", "scored")
#: when the host cache is ranked and read (:class:`CachingSettings`)
HOST_CACHE_FILLS = ("auto", "setup", "background")
REMOTE_CACHE_POLICIES = ("scored", "static", "none")
FEATURE_SOURCES = ("dataset", "learnable")


def positive(name: str, value: Any, why: str) -> int:
    """``value`` as an int, or an :class:`~lightning_ooc.errors.InputError` saying it must be >= 1 and why."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be an integer >= 1, got {value!r} ({why})")
    return int(value)


def _budget(name: str, value: Any) -> Any:
    try:
        if isinstance(value, bool):
            raise ValueError(f"cannot parse byte budget {value!r}; write e.g. '4GiB', '256MiB' or an integer")
        parse_bytes(value)
    except (ValueError, TypeError) as e:
        raise InputError(f"{name}: {e}") from None
    return value


@dataclass
class Budgets:
    """Memory of each tier, per process (sizes such as ``"4GiB"`` or integers of bytes).

    Args:
        gpu_cache: the feature buffer (device memory; host memory on CPU).
        host_cache: the host cache of hot rows (pinned; read zero-copy by the GPU).
        staging: the staging buffer that direct-I/O reads land in.
        memory_limit: host memory the plan must fit in: ``"auto"`` reads the memory cgroup's limit and
            ``MemAvailable``; a size is this process's total; ``None`` turns the check off.
    """

    gpu_cache: int | str = "1GiB"
    host_cache: int | str = "1GiB"
    staging: int | str = "256MiB"
    memory_limit: int | str | None = "auto"

    def __post_init__(self) -> None:
        for name in ("gpu_cache", "host_cache", "staging"):
            _budget(name, getattr(self, name))
        value = self.memory_limit
        if value is None or value == "auto":
            return
        try:
            if isinstance(value, bool) or parse_bytes(value) <= 0:
                raise ValueError
        except (ValueError, TypeError):
            raise InputError(f"memory_limit must be 'auto' (read the cgroup limit and MemAvailable), a size such "
                             f"as '8GiB', or None (no memory check), got {value!r}") from None  # fmt: skip


@dataclass
class PipelineShape:
    """The pipeline's threads and queues (GNNDrive's defaults) and the order batches are trained in.

    Args:
        order: ``"out_of_order"`` (train batches as they complete) or ``"in_order"`` (sampling order;
            reproducible for a given seed).
        num_samplers: sampler threads.
        num_extractors: extractor threads (each with its own reader).
        extract_queue_size: sampled minibatches waiting for an extractor.
        train_queue_size: extracted minibatches waiting for the trainer.
    """

    order: str = "out_of_order"
    num_samplers: int = 4
    num_extractors: int = 4
    extract_queue_size: int = 6
    train_queue_size: int = 4

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


@dataclass
class CachingSettings:
    """Which rows the host cache holds, and how the scored caches (host and remote) replace them.

    Args:
        host_cache_policy: ``"presample"`` (access frequency over ``presample_batches`` minibatches sampled
            at set-up), ``"degree"``, or ``"scored"`` (starts as ``"presample"``, then replaces rows as
            MassiveGNN's scored policy says every ``cache_interval`` training minibatches).
        presample_batches: minibatches sampled at set-up to rank rows (0: none).
        host_cache_fill: when the ``"presample"`` host cache is ranked and read: ``"setup"`` (before the first
            batch), ``"background"`` (in a thread while training runs: the first batches come from SSD and the
            buffer, the cache serves its rows as they arrive; :mod:`lightning_ooc.store.background`), or
            ``"auto"``: in the background for a host cache of 64 MiB or more, unless ranking beside training alone
            would shrink budgets that fit as asked, or nothing fits (its counts, 2 B a node, then overlap the
            store). The background fill starts once the first batch is trained. It applies to the ``"presample"``
            policy on one node type of a local dataset; the other policies, heterogeneous graphs,
            partitioned datasets and learnable features fill at set-up.
        cache_decay: the decay gamma of an unused row's eviction score per minibatch, in (0, 1].
        cache_interval: minibatches (Delta) between two eviction rounds.
    """

    host_cache_policy: str = "presample"
    presample_batches: int = 256
    host_cache_fill: str = "auto"
    cache_decay: float = 0.995
    cache_interval: int = 32

    def __post_init__(self) -> None:
        if self.host_cache_policy not in HOST_CACHE_POLICIES:
            raise InputError(f"host_cache_policy must be one of {', '.join(HOST_CACHE_POLICIES)}, "
                             f"got {self.host_cache_policy!r}")  # fmt: skip
        if self.host_cache_fill not in HOST_CACHE_FILLS:
            raise InputError(f"host_cache_fill must be one of {', '.join(HOST_CACHE_FILLS)}, "
                             f"got {self.host_cache_fill!r}")  # fmt: skip
        if isinstance(self.presample_batches, bool) or not isinstance(self.presample_batches, int) \
                or self.presample_batches < 0:  # fmt: skip
            raise InputError(f"presample_batches must be an integer >= 0, got {self.presample_batches!r}")
        if isinstance(self.cache_decay, bool) or not 0.0 < float(self.cache_decay) <= 1.0:
            raise InputError(f"cache_decay must lie in (0, 1] (gamma: the eviction score's decay per unused "
                             f"minibatch), got {self.cache_decay!r}")  # fmt: skip
        self.cache_decay = float(self.cache_decay)
        self.cache_interval = positive("cache_interval", self.cache_interval,
                                       "minibatches between two eviction rounds of a scored cache")  # fmt: skip


@dataclass
class IOSettings:
    """The feature reader (see :class:`~lightning_ooc.io.FeatureReader`).

    Args:
        io_backend: ``"auto"`` (the first of ``uring``, ``pread``, ``buffered`` that works on the file) or one
            of them, or ``"mmap"``.
        queue_depth: reads in flight per reader thread.
    """

    io_backend: str = "auto"
    queue_depth: int = 128

    def __post_init__(self) -> None:
        self.queue_depth = positive("queue_depth", self.queue_depth, "reads in flight per reader thread")


@dataclass
class RemoteSettings:
    """Other machines' rows, for a partitioned dataset (:mod:`lightning_ooc.loader.partitioned`).

    Args:
        remote_cache: bytes per process of the buffer of other machines' rows.
        remote_cache_policy: ``"scored"`` (MassiveGNN's prefetch with eviction, warm-started with the remote
            nodes most often a neighbour), ``"static"`` (those nodes, never replaced) or ``"none"``.
        exchange_timeout: seconds a row exchange may take before it is an error (a machine that died); also
            how long a machine done with its passes keeps serving the others.
    """

    remote_cache: int | str = "256MiB"
    remote_cache_policy: str = "scored"
    exchange_timeout: float = 120.0

    def __post_init__(self) -> None:
        _budget("remote_cache", self.remote_cache)
        if self.remote_cache_policy not in REMOTE_CACHE_POLICIES:
            raise InputError(f"remote_cache_policy must be one of {', '.join(REMOTE_CACHE_POLICIES)}, "
                             f"got {self.remote_cache_policy!r}")  # fmt: skip
        if isinstance(self.exchange_timeout, bool) or not float(self.exchange_timeout) > 0:
            raise InputError(f"exchange_timeout must be > 0 seconds, got {self.exchange_timeout!r}")
        self.exchange_timeout = float(self.exchange_timeout)


@dataclass
class LearnableSettings:
    """Where ``x`` comes from: the dataset's feature file, or an embedding table trained with the model.

    Args:
        features: ``"dataset"`` or ``"learnable"`` (the rows of ``embeddings`` are ``x``, trained with a
            sparse Adagrad step and written back: :mod:`lightning_ooc.loader.learnable`).
        embeddings: the embedding table (``lightning-ooc init-embeddings ROOT --out TABLE --dim D``).
        embedding_lr: Adagrad learning rate of the learnable rows.
    """

    features: str = "dataset"
    embeddings: str | None = None
    embedding_lr: float = 0.01

    def __post_init__(self) -> None:
        if self.features not in FEATURE_SOURCES:
            raise InputError(f"features must be one of {', '.join(FEATURE_SOURCES)}, got {self.features!r}")
        if self.embeddings is not None:
            self.embeddings = str(self.embeddings)
        if self.features != "learnable":
            return
        if self.embeddings is None:
            raise InputError("features='learnable' needs embeddings: an embedding table for the dataset's "
                             "nodes (lightning-ooc init-embeddings ROOT --out TABLE --dim D)")  # fmt: skip
        if isinstance(self.embedding_lr, bool) or not float(self.embedding_lr) > 0:
            raise InputError(f"embedding_lr must be > 0, got {self.embedding_lr!r}")
        self.embedding_lr = float(self.embedding_lr)


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
        inference_memory: with ``"layerwise"``, bytes for the partitions resident at a time.
        inference_chunk: with ``"layerwise"``, nodes per predict batch.
    """

    inference: str = "sampled"
    inference_out: str | None = None
    inference_memory: int | str = "1GiB"
    inference_chunk: int = 65536

    def __post_init__(self) -> None:
        if self.inference not in INFERENCE_MODES:
            raise InputError(f"inference must be one of {', '.join(INFERENCE_MODES)}, got {self.inference!r}")
        if self.inference_out is not None:
            self.inference_out = str(self.inference_out)
        _budget("inference_memory", self.inference_memory)
        positive("inference_chunk", self.inference_chunk, "nodes per predict batch")


#: the groups, by the keyword a datamodule takes them with
GROUPS: dict[str, type] = {
    "budgets": Budgets,
    "pipeline": PipelineShape,
    "caching": CachingSettings,
    "io": IOSettings,
    "remote": RemoteSettings,
    "learnable": LearnableSettings,
    "predict": PredictSettings,
}

#: each flat keyword name -> the group it belongs to
FLAT: dict[str, str] = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}


#: each flat name's default, as its group holds it (every group field has a plain default)
_DEFAULTS: dict[str, Any] = {f.name: f.default for cls in GROUPS.values() for f in fields(cls)}
assert MISSING not in _DEFAULTS.values()


def default(name: str) -> Any:
    """The default of the flat setting ``name`` (written once, in its group)."""
    return _DEFAULTS[name]


def merge(group: str, given: Any, flat: dict[str, Any], strict: bool = True) -> Any:
    """The settings of ``group``: ``given`` (an instance, a dict of its fields, or None for the defaults) with the
    flat keywords ``flat`` of its fields laid over it.

    A flat value wins over the group's default; where the group sets the field to something else as well,
    the two are an :class:`~lightning_ooc.errors.InputError` that names both (with ``strict``; otherwise the
    flat value wins, as in :func:`dataclasses.replace` of a configuration).
    """
    cls = GROUPS[group]
    if given is None:
        base = cls()
    elif isinstance(given, cls):
        base = given
    elif isinstance(given, dict):
        unknown = sorted(set(given) - {f.name for f in fields(cls)})
        if unknown:
            raise InputError(f"{group}: unknown setting(s) {', '.join(unknown)}; it takes "
                             f"{', '.join(f.name for f in fields(cls))}")  # fmt: skip
        base = cls(**given)
    else:
        raise InputError(f"{group} must be a {cls.__name__} or a dict of its fields, got {type(given).__name__}")
    if not flat:
        return base
    if strict:
        for name, value in flat.items():
            set_in_group = getattr(base, name)
            if set_in_group != default(name) and set_in_group != value:
                raise InputError(f"{name} is given twice: {name}={value!r} and {group}.{name}={set_in_group!r}; "
                                 f"give it once (the flat name or the {group} group)")  # fmt: skip
    return replace(base, **flat)


def from_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """A datamodule's keyword arguments as a configuration's: each group merged with those of its flat names
    that differ from their default (:func:`merge`, strict), everything else as given."""
    out = {k: v for k, v in arguments.items() if k not in FLAT and k not in GROUPS}
    for group in GROUPS:
        flat = {k: v for k, v in arguments.items() if FLAT.get(k) == group and not _same(v, default(k))}
        out[group] = merge(group, arguments.get(group), flat)
    return out


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def plain(group: Any) -> dict[str, Any] | None:
    """A group (an instance, a dict of its fields or None) as a dict of plain values, or None (for
    hyperparameters, which checkpoints load with ``weights_only``)."""
    return None if group is None else asdict(group) if not isinstance(group, dict) else dict(group)
