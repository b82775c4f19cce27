"""``NodeDataConfig``: the settings of a node-classification datamodule, checked once at construction.

It is what the datamodule hands to whatever runs its passes (in the training
process, or in a gather producer process), so it holds plain, picklable values
only. Invalid shapes are errors here, not hangs later.

Example::

    >>> from lightning_ooc.loader.config import NodeDataConfig
    >>> NodeDataConfig(root="data/g", num_neighbors=[5, 5]).eval_fanout
    [5, 5]
    >>> NodeDataConfig(root="data/g", num_samplers=0)
    Traceback (most recent call last):
      ...
    lightning_ooc.errors.InputError: num_samplers must be an integer >= 1, got 0 (the pipeline needs at least one sampler thread)
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_ooc.data.format import parse_bytes
from lightning_ooc.errors import InputError
from lightning_ooc.data.hetero import as_edge_type, relation_key

ORDERS = ("out_of_order", "in_order")
HOST_CACHE_POLICIES = ("presample", "degree", "scored")
REMOTE_CACHE_POLICIES = ("scored", "static", "none")
FEATURE_SOURCES = ("dataset", "learnable")


def _positive(name: str, value: Any, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be an integer >= 1, got {value!r} ({why})")
    return int(value)


@dataclass
class NodeDataConfig:
    """The datamodule's arguments (see :class:`~lightning_ooc.OutOfCoreNodeData` for each)."""

    root: str
    batch_size: int = 1000
    num_neighbors: list[int] = field(default_factory=lambda: [10, 10, 10])
    replace: bool = False
    gpu_cache: int | str = "1GiB"
    host_cache: int | str = "1GiB"
    staging: int | str = "256MiB"
    order: str = "out_of_order"
    num_samplers: int = 4
    num_extractors: int = 4
    extract_queue_size: int = 6
    train_queue_size: int = 4
    host_cache_policy: str = "presample"
    presample_batches: int = 256
    io_backend: str = "auto"
    queue_depth: int = 128
    eval_batch_size: int | None = None
    eval_num_neighbors: list[int] | None = None
    shuffle: bool = True
    drop_last: bool = False
    seed: int = 0
    progress: bool = True
    memory_limit: int | str | None = "auto"
    #: a directory: every pass writes its per-stage timeline there as a Chrome trace (None: no timeline)
    profile: str | None = None
    #: "dataset" (the dataset's feature file) or "learnable" (the rows of the embedding table ``embeddings``,
    #: trained with the model: :mod:`lightning_ooc.loader.learnable`)
    features: str = "dataset"
    embeddings: str | None = None
    #: Adagrad learning rate of learnable features
    embedding_lr: float = 0.01
    #: a partitioned dataset (``lightning-ooc partition``): bytes of the buffer of other machines' rows,
    #: per process, and how it chooses them ("scored": MassiveGNN's prefetch and eviction, "static": the
    #: highest-degree remote rows, never replaced, "none": no buffer, every remote row fetched when needed)
    remote_cache: int | str = "256MiB"
    remote_cache_policy: str = "scored"
    #: the scored policies (remote buffer, ``host_cache_policy="scored"``): decay of the eviction score per
    #: minibatch a row goes unused (gamma) and minibatches between two eviction rounds (Delta)
    cache_decay: float = 0.995
    cache_interval: int = 32
    #: seconds a row exchange with other machines may take before it is an error (a machine that died)
    exchange_timeout: float = 120.0
    #: the identity (:attr:`~lightning_ooc.data.dataset.OnDiskDataset.identity`) every later open must find;
    #: set by the datamodule at its first set-up, so that a dataset replaced meanwhile is an error
    dataset_identity: str | None = None

    def __post_init__(self) -> None:
        self.root = str(self.root)
        if self.profile is not None:
            if not isinstance(self.profile, (str, os.PathLike)) or not str(self.profile):
                raise InputError(f"profile must be a directory for the timeline files, got {self.profile!r}")
            self.profile = str(self.profile)
        if self.order not in ORDERS:
            raise InputError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        self.batch_size = _positive("batch_size", self.batch_size, "seed nodes per minibatch")
        self.num_samplers = _positive("num_samplers", self.num_samplers,
                                      "the pipeline needs at least one sampler thread")  # fmt: skip
        self.num_extractors = _positive("num_extractors", self.num_extractors,
                                        "the pipeline needs at least one extractor thread")  # fmt: skip
        self.extract_queue_size = _positive("extract_queue_size", self.extract_queue_size,
                                            "sampled minibatches waiting for an extractor")  # fmt: skip
        self.train_queue_size = _positive("train_queue_size", self.train_queue_size,
                                          "extracted minibatches waiting for the trainer")  # fmt: skip
        self.queue_depth = _positive("queue_depth", self.queue_depth, "reads in flight per reader thread")
        if self.eval_batch_size is not None:
            self.eval_batch_size = _positive("eval_batch_size", self.eval_batch_size,
                                             "seed nodes per evaluation minibatch; leave it unset to use batch_size")  # fmt: skip
        if isinstance(self.presample_batches, bool) or not isinstance(self.presample_batches, int) \
                or self.presample_batches < 0:  # fmt: skip
            raise InputError(f"presample_batches must be an integer >= 0, got {self.presample_batches!r}")
        if self.host_cache_policy not in HOST_CACHE_POLICIES:
            raise InputError(f"host_cache_policy must be one of {', '.join(HOST_CACHE_POLICIES)}, "
                             f"got {self.host_cache_policy!r}")  # fmt: skip
        if self.remote_cache_policy not in REMOTE_CACHE_POLICIES:
            raise InputError(f"remote_cache_policy must be one of {', '.join(REMOTE_CACHE_POLICIES)}, "
                             f"got {self.remote_cache_policy!r}")  # fmt: skip
        if isinstance(self.cache_decay, bool) or not 0.0 < float(self.cache_decay) <= 1.0:
            raise InputError(f"cache_decay must lie in (0, 1] (gamma: the eviction score's decay per unused "
                             f"minibatch), got {self.cache_decay!r}")  # fmt: skip
        self.cache_decay = float(self.cache_decay)
        self.cache_interval = _positive("cache_interval", self.cache_interval,
                                        "minibatches between two eviction rounds of a scored cache")  # fmt: skip
        if isinstance(self.exchange_timeout, bool) or not float(self.exchange_timeout) > 0:
            raise InputError(f"exchange_timeout must be > 0 seconds, got {self.exchange_timeout!r}")
        self.exchange_timeout = float(self.exchange_timeout)
        for name in ("gpu_cache", "host_cache", "staging", "remote_cache"):
            self._check_budget(name)
        self._check_memory_limit()
        if self.features not in FEATURE_SOURCES:
            raise InputError(f"features must be one of {', '.join(FEATURE_SOURCES)}, got {self.features!r}")
        if self.features == "learnable":
            if self.embeddings is None:
                raise InputError("features='learnable' needs embeddings: an embedding table for the dataset's "
                                 "nodes (lightning-ooc init-embeddings ROOT --out TABLE --dim D)")  # fmt: skip
            self.embeddings = str(self.embeddings)
            if isinstance(self.embedding_lr, bool) or not float(self.embedding_lr) > 0:
                raise InputError(f"embedding_lr must be > 0, got {self.embedding_lr!r}")
            self.embedding_lr = float(self.embedding_lr)
        self.num_neighbors = self._fanout("num_neighbors", self.num_neighbors)
        if self.eval_num_neighbors is not None:
            self.eval_num_neighbors = self._fanout("eval_num_neighbors", self.eval_num_neighbors)

    @classmethod
    def _fanout(cls, name: str, value: Any) -> Any:
        return cls._fanout_list(name, value)

    def _check_budget(self, name: str) -> None:
        value = getattr(self, name)
        try:
            if isinstance(value, bool):
                raise ValueError(f"cannot parse byte budget {value!r}; write e.g. '4GiB', '256MiB' or an integer")
            parse_bytes(value)
        except (ValueError, TypeError) as e:
            raise InputError(f"{name}: {e}") from None

    def _check_memory_limit(self) -> None:
        value = self.memory_limit
        if value is None or value == "auto":
            return
        try:
            if isinstance(value, bool) or parse_bytes(value) <= 0:
                raise ValueError
        except ValueError:
            raise InputError(f"memory_limit must be 'auto' (read the cgroup limit and MemAvailable), a size such "
                             f"as '8GiB', or None (no memory check), got {value!r}") from None  # fmt: skip

    @staticmethod
    def _fanout_list(name: str, value: Any) -> list[int]:
        try:
            fan = list(value)
        except TypeError:
            raise InputError(f"{name} must be a list of fanouts per hop, e.g. [10, 10], got {value!r}") from None
        if not fan or any(isinstance(f, bool) or not isinstance(f, int) or f < -1 for f in fan):
            raise InputError(f"{name} must be a non-empty list of fanouts per hop (each >= 0, or -1 for all "
                             f"neighbours), got {value!r}")  # fmt: skip
        return [int(f) for f in fan]

    @property
    def eval_size(self) -> int:
        return int(self.eval_batch_size or self.batch_size)

    @property
    def eval_fanout(self) -> Any:
        fan = self.eval_num_neighbors or self.num_neighbors
        return dict(fan) if isinstance(fan, dict) else list(fan)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class HeteroNodeDataConfig(NodeDataConfig):
    """The settings of :class:`~lightning_ooc.OutOfCoreHeteroNodeData`: those of node classification, with
    ``num_neighbors`` one list for every relation or a dict ``"src__rel__dst"`` (or ``(src, rel, dst)``)
    -> list, as PyG's ``NeighborLoader`` on a ``HeteroData`` takes it, and the seeds' node type.

    >>> cfg = HeteroNodeDataConfig(root="data/h", num_neighbors={("author", "writes", "paper"): [5, 2]})
    >>> cfg.num_neighbors, cfg.hops
    ({'author__writes__paper': [5, 2]}, 2)
    """

    #: the node type of the seeds (default: the dataset's target type)
    input_type: str | None = None

    @classmethod
    def _fanout(cls, name: str, value: Any) -> Any:
        if not isinstance(value, dict):
            return cls._fanout_list(name, value)

        out = {relation_key(as_edge_type(k)): cls._fanout_list(f"{name}[{k!r}]", v) for k, v in value.items()}
        if not out:
            raise InputError(f"{name} is an empty dict; give a list of fanouts per relation, or one list for all")
        hops = {len(v) for v in out.values()}
        if len(hops) > 1:
            raise InputError(f"{name}: every relation needs the same number of hops, got {sorted(hops)}")
        return out

    @property
    def hops(self) -> int:
        fan = self.num_neighbors
        return len(next(iter(fan.values()))) if isinstance(fan, dict) else len(fan)
