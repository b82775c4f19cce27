"""``NodeDataConfig``: the settings of a node-classification datamodule, checked once at construction.

It is what the datamodule hands to whatever runs its passes (in the training
process, or in a gather producer process), so it holds plain, picklable values
only: the sampling settings, the feature backend (:mod:`lightning_ooc.loader.features`)
and the groups of :mod:`lightning_ooc.loader.settings`. Each setting has one place:
``cfg.features.gpu_cache``, ``cfg.pipeline.num_samplers``. Invalid shapes are errors
here, not hangs later.

Example::

    >>> from lightning_ooc.loader.config import NodeDataConfig
    >>> from lightning_ooc.loader.features import Tiered
    >>> cfg = NodeDataConfig(root="data/g", num_neighbors=[5, 5], features=Tiered(gpu_cache="4GiB"),
    ...                      pipeline={"num_samplers": 3})
    >>> cfg.eval_fanout, cfg.features.gpu_cache >> 30, cfg.pipeline.num_samplers
    ([5, 5], 4, 3)
    >>> NodeDataConfig(root="data/g", pipeline={"num_samplers": 0})
    Traceback (most recent call last):
      ...
    lightning_ooc.errors.InputError: num_samplers must be an integer >= 1, got 0 (the pipeline needs at least one sampler thread)
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lightning_ooc.data.format import parse_bytes
from lightning_ooc.data.hetero_dataset import as_edge_type, relation_key
from lightning_ooc.data.outputs import check_output
from lightning_ooc.errors import InputError
from lightning_ooc.loader.features import FeatureBackend, Tiered, as_backend, positive
from lightning_ooc.loader.settings import INPUT_TIMES, ORDERS, Pipeline, PredictSettings, TimeSettings, group
from lightning_ooc.sampling.temporal import Temporal

__all__ = ["NodeDataConfig", "ORDERS", "DEFAULT_FANOUT", "INPUT_TIMES", "check_memory_limit"]

#: the fanout per hop when none is given (GNNDrive's and PyTorch-Direct's setting on ogbn-papers100M)
DEFAULT_FANOUT = (10, 10, 10)


def check_memory_limit(value: Any) -> Any:
    """``memory_limit`` as given, checked: ``"auto"``, a size, or None.

    >>> check_memory_limit("8GiB"), check_memory_limit(None)
    ('8GiB', None)
    """
    if value is None or value == "auto":
        return value
    try:
        if isinstance(value, bool) or parse_bytes(value) <= 0:
            raise ValueError
    except (ValueError, TypeError):
        raise InputError(f"memory_limit must be 'auto' (read the cgroup limit and MemAvailable), a size such "
                         f"as '8GiB', or None (no memory check), got {value!r}") from None  # fmt: skip
    return value


@dataclass
class NodeDataConfig:
    """The datamodule's arguments (see :class:`~lightning_ooc.OutOfCoreNodeData` for each): the sampling
    settings, the feature backend, the pipeline and predict groups.

    On a heterogeneous dataset ``num_neighbors`` is one list for every relation or a dict ``"src__rel__dst"``
    (or ``(src, rel, dst)``) -> list, as PyG's ``NeighborLoader`` on a ``HeteroData`` takes it, and
    ``input_type`` names the seeds' node type (default: the dataset's target type); the dataset says which
    case a run is (:func:`~lightning_ooc.loader.registry.task_for`).

    >>> cfg = NodeDataConfig(root="data/h", num_neighbors={("author", "writes", "paper"): [5, 2]})
    >>> cfg.num_neighbors, cfg.hops
    ({'author__writes__paper': [5, 2]}, 2)
    """

    root: str
    batch_size: int = 1000
    #: fanout per hop: a list, or (heterogeneous datasets) a dict relation -> list
    num_neighbors: list[int] | dict[str, list[int]] = field(default_factory=lambda: list(DEFAULT_FANOUT))
    replace: bool = False
    #: put ``e_id`` on every batch: the stored id (CSC position) of each sampled edge, per relation on a
    #: heterogeneous graph (PyG's loaders' ``e_id``), so that a model can index an edge-feature array
    return_e_id: bool = False
    #: where ``x`` comes from (:mod:`lightning_ooc.loader.features`), with that backend's own settings
    features: FeatureBackend = field(default_factory=Tiered)
    pipeline: Pipeline = field(default_factory=Pipeline)
    #: host memory the plan must fit in: ``"auto"``, a size (this process's total), or None (no check)
    memory_limit: int | str | None = "auto"
    eval_batch_size: int | None = None
    eval_num_neighbors: list[int] | dict[str, list[int]] | None = None
    shuffle: bool = True
    drop_last: bool = False
    seed: int = 0
    progress: bool = True
    predict: PredictSettings = field(default_factory=PredictSettings)
    #: the node type of the seeds on a heterogeneous dataset (default: the dataset's target type)
    input_type: str | None = None
    #: temporal sampling (:class:`~lightning_ooc.loader.settings.TimeSettings`: PyG's ``time_attr``,
    #: ``temporal_strategy``, ``input_time``, and ``time_window``); by default none
    time: TimeSettings = field(default_factory=TimeSettings)
    #: the identity (:attr:`~lightning_ooc.data.dataset.OnDiskDataset.identity`) every later open must find;
    #: set by the datamodule at its first set-up, so that a dataset replaced meanwhile is an error
    dataset_identity: str | None = None

    def __post_init__(self) -> None:
        self.root = str(self.root)
        self.features = as_backend(self.features)
        self.pipeline = group("pipeline", self.pipeline)
        self.predict = group("predict", self.predict)
        self.time = group("time", self.time)
        self.memory_limit = check_memory_limit(self.memory_limit)
        if self.pipeline.profile is not None:
            check_output(self.pipeline.profile, inputs=[self.root], kind="workdir", option="profile")
        self.batch_size = positive("batch_size", self.batch_size, "seed nodes per minibatch")
        if not isinstance(self.return_e_id, bool):
            raise InputError(f"return_e_id must be true or false (put e_id, the stored ids of the sampled edges, "
                             f"on every batch), got {self.return_e_id!r}")  # fmt: skip
        if self.eval_batch_size is not None:
            self.eval_batch_size = positive("eval_batch_size", self.eval_batch_size,
                                            "seed nodes per evaluation minibatch; leave it unset to use batch_size")  # fmt: skip
        self.num_neighbors = self._fanout("num_neighbors", self.num_neighbors)
        if self.eval_num_neighbors is not None:
            self.eval_num_neighbors = self._fanout("eval_num_neighbors", self.eval_num_neighbors)
        if self.input_type is not None and (not isinstance(self.input_type, str) or not self.input_type):
            raise InputError(f"input_type must be the name of a node type, got {self.input_type!r}")

    @property
    def time_attr(self) -> str | None:
        """The time temporal sampling samples by (``time.time_attr``; None: sampling without time)."""
        return self.time.time_attr

    @property
    def input_time(self) -> str:
        return self.time.input_time

    @property
    def temporal(self) -> Temporal | None:
        """The temporal sampling asked for (None: none)."""
        return self.time.temporal

    def sampler_options(self) -> dict[str, Any]:
        """The temporal options every neighbour sampler of this config takes."""
        t = self.time
        if t.time_attr is None:
            return {}
        return {"time_attr": t.time_attr, "temporal_strategy": t.temporal_strategy, "time_window": t.time_window}

    @property
    def typed(self) -> bool:
        """Whether a setting names node types or relations (``input_type``, a fanout per relation): settings
        only a heterogeneous dataset takes."""
        return self.input_type is not None or isinstance(self.num_neighbors, dict) or isinstance(
            self.eval_num_neighbors, dict)

    @property
    def hops(self) -> int:
        fan = self.num_neighbors
        return len(next(iter(fan.values()))) if isinstance(fan, dict) else len(fan)

    @classmethod
    def _fanout(cls, name: str, value: Any) -> Any:
        """A fanout as given: a list per hop, or a dict relation -> list (keys ``"src__rel__dst"``)."""
        if not isinstance(value, dict):
            return cls._fanout_list(name, value)
        out = {relation_key(as_edge_type(k)): cls._fanout_list(f"{name}[{k!r}]", v) for k, v in value.items()}
        if not out:
            raise InputError(f"{name} is an empty dict; give a list of fanouts per relation, or one list for all")
        hops = {len(v) for v in out.values()}
        if len(hops) > 1:
            raise InputError(f"{name}: every relation needs the same number of hops, got {sorted(hops)}")
        return out

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

    def with_settings(self, *, features: dict[str, Any] | None = None, pipeline: dict[str, Any] | None = None,
                      **own: Any) -> "NodeDataConfig":  # fmt: skip
        """A copy with some settings changed: the feature backend's (values in their final form, bytes for sizes),
        the pipeline's, and its own; this one is left as it is (what the planner decided, for the passes).

        >>> cfg = NodeDataConfig("data/g", pipeline={"num_samplers": 3})
        >>> lowered = cfg.with_settings(features={"host_cache": 0}, pipeline={"num_samplers": 1})
        >>> lowered.features.host_cache, lowered.pipeline.num_samplers, cfg.pipeline.num_samplers
        (0, 1, 3)
        """
        out = copy.copy(self)
        if features:
            out.features = self.features.replaced(**features)
        if pipeline:
            out.pipeline = replace(self.pipeline, **pipeline)
        for name, value in own.items():
            if name not in {f.name for f in fields(self)}:
                raise TypeError(f"{type(self).__name__} has no setting {name}")
            setattr(out, name, value)
        return out

    def as_dict(self) -> dict[str, Any]:
        """Every setting by name, the groups and the feature backend as they are (what the constructor takes
        back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

