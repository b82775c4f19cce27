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

import dataclasses
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from lightning_ooc.errors import InputError
from lightning_ooc.data.outputs import check_output
from lightning_ooc.data.hetero import as_edge_type, relation_key
from lightning_ooc.loader.settings import (
    FLAT,
    GROUPS,
    ORDERS,
    Budgets,
    CachingSettings,
    IOSettings,
    LearnableSettings,
    PipelineShape,
    PredictSettings,
    RemoteSettings,
    merge,
    positive,
)

__all__ = ["NodeDataConfig", "HeteroNodeDataConfig", "ORDERS", "DEFAULT_FANOUT"]

#: the fanout per hop when none is given (GNNDrive's and PyTorch-Direct's setting on ogbn-papers100M)
DEFAULT_FANOUT = (10, 10, 10)


@dataclass(init=False)
class NodeDataConfig:
    """The datamodule's arguments (see :class:`~lightning_ooc.OutOfCoreNodeData` for each): the sampling
    settings, and the groups of :mod:`lightning_ooc.loader.settings`.

    It takes the groups (``budgets=Budgets(...)`` or a dict) and every group field by its flat name as well
    (``gpu_cache="4GiB"``), and reads both ways: ``cfg.budgets.gpu_cache`` is ``cfg.gpu_cache``.
    """

    root: str
    batch_size: int = 1000
    num_neighbors: list[int] = field(default_factory=lambda: list(DEFAULT_FANOUT))
    replace: bool = False
    #: put ``e_id`` on every batch: the stored id (CSC position) of each sampled edge, per relation on a
    #: heterogeneous graph (PyG's loaders' ``e_id``), so that a model can index an edge-feature array
    return_e_id: bool = False
    eval_batch_size: int | None = None
    eval_num_neighbors: list[int] | None = None
    shuffle: bool = True
    drop_last: bool = False
    seed: int = 0
    progress: bool = True
    #: a directory: every pass writes its per-stage timeline there as a Chrome trace (None: no timeline)
    profile: str | None = None
    budgets: Budgets = field(default_factory=Budgets)
    pipeline: PipelineShape = field(default_factory=PipelineShape)
    caching: CachingSettings = field(default_factory=CachingSettings)
    io: IOSettings = field(default_factory=IOSettings)
    remote: RemoteSettings = field(default_factory=RemoteSettings)
    learnable: LearnableSettings = field(default_factory=LearnableSettings)
    predict: PredictSettings = field(default_factory=PredictSettings)
    #: the identity (:attr:`~lightning_ooc.data.dataset.OnDiskDataset.identity`) every later open must find;
    #: set by the datamodule at its first set-up, so that a dataset replaced meanwhile is an error
    dataset_identity: str | None = None

    def __init__(self, root: str | os.PathLike, **settings: Any):
        groups = {g: settings.pop(g, None) for g in GROUPS}
        flat: dict[str, dict[str, Any]] = {}
        for name in [n for n in settings if n in FLAT]:
            flat.setdefault(FLAT[name], {})[name] = settings.pop(name)
        own = {f.name: f for f in fields(self) if f.name != "root" and f.name not in GROUPS}
        unknown = sorted(set(settings) - set(own))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected setting(s): {', '.join(unknown)}")
        self.root = root  # type: ignore[assignment]
        for name, f in own.items():
            if name in settings:
                value = settings[name]
            elif f.default is not MISSING:
                value = f.default
            else:
                value = f.default_factory()  # type: ignore[misc]
            setattr(self, name, value)
        for group in GROUPS:
            setattr(self, group, merge(group, groups[group], flat.get(group, {}), strict=False))
        self.__post_init__()

    def __post_init__(self) -> None:
        self.root = str(self.root)
        if self.profile is not None:
            if not isinstance(self.profile, (str, os.PathLike)) or not str(self.profile):
                raise InputError(f"profile must be a directory for the timeline files, got {self.profile!r}")
            self.profile = str(self.profile)
            check_output(self.profile, inputs=[self.root], kind="workdir", option="profile")
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

    @classmethod
    def _fanout(cls, name: str, value: Any) -> Any:
        return cls._fanout_list(name, value)

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
        """Every setting as plain values, the groups as dicts (what the constructor takes back)."""
        return asdict(self)


def _flat(group: str, name: str) -> property:
    def get(self: NodeDataConfig) -> Any:
        return getattr(getattr(self, group), name)

    def put(self: NodeDataConfig, value: Any) -> None:  # a new group (checked), never one another config shares
        setattr(self, group, dataclasses.replace(getattr(self, group), **{name: value}))

    return property(get, put, doc=f"``{group}.{name}``")


for _name, _group in FLAT.items():  # cfg.gpu_cache reads (and sets) cfg.budgets.gpu_cache
    setattr(NodeDataConfig, _name, _flat(_group, _name))


@dataclass(init=False)
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
