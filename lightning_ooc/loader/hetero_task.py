"""``HeteroNodeTask``: node classification on a heterogeneous graph, the multi-type case of the node task.

Its batches come from the :class:`~lightning_ooc.sampling.HeteroNeighborSampler` (a fanout per relation),
seeded with the nodes of one type (``input_type``), and carry rows of every node type with features: the
backends build one reader and one chain of tiers per such type (the tiered one plans them as one,
:func:`~lightning_ooc.store.planner.plan_hetero_store`). Batches are PyG-shaped ``HeteroData``: ``n_id``, ``x``
(types with features) and ``num_sampled_nodes`` per type, ``edge_index`` and ``num_sampled_edges`` per relation,
``y``, ``batch_size`` and ``input_id`` on the seed type. ``HeteroLocalPasses``, ``HeteroDeviceTablePasses`` and
``HeteroSyncPasses`` are this task over the tiered, device-table and synchronous backends.

Example::

    >>> import tempfile
    >>> from lightning_ooc.data.synth_hetero import synthesize_hetero
    >>> from lightning_ooc.loader.config import NodeDataConfig
    >>> from lightning_ooc.loader.context import ProcessContext
    >>> from lightning_ooc.loader.features import Tiered
    >>> root = synthesize_hetero(tempfile.mkdtemp() + "/h", "mag", num_nodes=2000, num_features=8,
    ...                          train_frac=0.2, progress=False)
    >>> cfg = NodeDataConfig(root, batch_size=100, num_neighbors=[4, 3], progress=False,
    ...                      features=Tiered(gpu_cache="1MiB", host_cache="8KiB", staging="256KiB"))
    >>> passes = HeteroLocalPasses(cfg, ProcessContext())
    >>> batches = list(passes.run("train", epoch=0))
    >>> sum(b["paper"].batch_size for b in batches) == passes.dataset.split("train").numel()
    True
    >>> b = batches[0]
    >>> bool((b["paper"].x == passes.dataset.node("paper").read_features(b["paper"].n_id)).all())
    True
    >>> passes.close()
"""
from __future__ import annotations

import math
from typing import Any

import torch

from lightning_ooc.data.hetero_dataset import as_edge_type
from lightning_ooc.errors import DatasetChangedError, InputError
from lightning_ooc.loader.batches import SeedBatches
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.baseline import DeviceTablePasses, SyncPasses
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.loader.source import LocalPasses
from lightning_ooc.loader.tasks import NodeTask, check_labelled, check_seed_times
from lightning_ooc.store.planner import BATCH_MARGIN, BATCH_SLACK, hop_bound
from lightning_ooc.store.typed_stores import type_views
from lightning_ooc.data.dataset import open_dataset
from lightning_ooc.sampling import HeteroNeighborSampler


def homogeneous_dataset_error(root: Any) -> InputError:
    """The error of the heterogeneous node task given a homogeneous dataset."""
    return InputError(f"{root}: a homogeneous dataset; the heterogeneous node task reads heterogeneous ones (node "
                      "types and relations: `lightning-ooc synth --hetero`, `prepare --pyg` of a HeteroData)")


def open_hetero_for(cfg: NodeDataConfig, ctx: ProcessContext) -> Any:
    """The heterogeneous dataset of ``cfg`` (relations' ``indptr`` in the context's shared memory when it
    offers some), checked as :func:`~lightning_ooc.loader.source.open_for` checks a homogeneous one."""

    ds = open_dataset(cfg.root, share=ctx.topology)
    if not getattr(ds, "is_hetero", False):
        raise homogeneous_dataset_error(ds.root)
    if cfg.dataset_identity is not None and ds.identity != cfg.dataset_identity:
        raise DatasetChangedError(f"{ds.root}: replaced since this datamodule first opened it; create a new "
                                  "datamodule (a new run) for the new one", ds.root)  # fmt: skip
    check_labelled(ds.node(input_type(cfg, ds)))
    return ds


def input_type(cfg: NodeDataConfig, ds: Any) -> str:
    """The seeds' node type: ``cfg.input_type``, else the dataset's target type."""
    t = cfg.input_type or ds.target
    if t is None:
        raise InputError(f"{ds.root}: no target node type is recorded and several types have labels; "
                         f"set input_type to one of {[x for x in ds.node_types if ds.node(x).has_labels]}")  # fmt: skip
    if t not in ds.node_types:
        raise InputError(f"input_type {t!r} is not a node type of {ds.root} ({', '.join(ds.node_types)})")
    if not ds.node(t).has_labels:
        raise InputError(f"input_type {t!r} of {ds.root} has no labels to classify")
    return t


def hetero_fanout(fanout: Any, ds: Any) -> Any:
    """A config's fanout (a list, or ``"src__rel__dst"`` keys) as the sampler takes it (edge type tuples)."""
    if not isinstance(fanout, dict):
        return list(fanout)
    return {as_edge_type(k): list(v) for k, v in fanout.items()}


class HeteroNodeTask(NodeTask):
    """Node classification on a heterogeneous graph (see the module docstring)."""

    name = "hetero"

    def __init__(self, cfg: NodeDataConfig, ctx: ProcessContext, dataset: Any = None):
        super().__init__(cfg, ctx, dataset)
        self.input_type = input_type(cfg, self.dataset)
        self._views: dict[str, Any] | None = None
        self._max_edges = 0  # the most edges of a presampled batch

    @classmethod
    def open(cls, cfg: Any, ctx: ProcessContext) -> Any:
        return open_hetero_for(cfg, ctx)

    @classmethod
    def seed_batches_of(cls, cfg: Any, ds: Any, ctx: ProcessContext) -> SeedBatches:
        return hetero_seed_batches(cfg, ds, ctx, input_type(cfg, ds))

    def samplers(self) -> tuple[Any, Any]:
        return hetero_samplers(self.cfg, self.dataset)

    def check_times(self) -> None:
        # the sampler checks each relation's times and order as it is built
        check_seed_times(self.cfg, self.dataset.node(input_type(self.cfg, self.dataset)), self.dataset.root)

    def seed_part(self) -> Any:
        return self.dataset.node(self.input_type)

    def sample(self, split: str, sampler: Any, seeds: torch.Tensor, seed: int) -> Any:
        ids, extra = self.seeds(split, seeds)
        return sampler.sample(ids, self.input_type, seed=seed, **extra)

    def presample_nodes(self, sampler: Any, seeds: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        ids, extra = self.seeds("train", seeds)
        extra.pop("input_id", None)
        sub = sampler.sample_subgraph(ids, self.input_type, seed=seed, **extra)
        self._max_edges = max(self._max_edges, sum(sum(v) for v in sub.num_sampled_edges.values()))
        return sub.n_id

    @property
    def node_types(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self.feature_views())

    def feature_views(self, ds: Any = None) -> dict[str, Any]:  # type: ignore[override]
        if ds is not None and ds is not self.dataset:
            return type_views(ds)
        if self._views is None:
            self._views = type_views(self.dataset)
        return self._views

    def plan_inputs(self) -> dict[str, Any]:
        """What the joint plan of the types' tiers needs to know of the batches (``plan_hetero_store``)."""
        cfg, ds = self.cfg, self.dataset
        fan = hetero_fanout(cfg.num_neighbors, ds)
        sizes = {s: int(ds.split(s, self.input_type).numel()) for s in ("train", "val", "test")}
        edges = math.ceil(self._max_edges * BATCH_MARGIN) + BATCH_SLACK if self._max_edges else None
        return {"fanout_bound": hop_bound(fan, ds.edge_types, cfg.hops), "input_type": self.input_type,
                "split_sizes": sizes, "edges_per_batch": edges}  # fmt: skip

    def per_epoch(self) -> str:
        return f"{self.input_type} seeds per epoch"


class HeteroLocalPasses(LocalPasses):
    """Heterogeneous node classification over the tiered store (see the module docstring)."""

    task_type = HeteroNodeTask

    @property
    def input_type(self) -> str:
        return self.task.input_type


def hetero_samplers(cfg: NodeDataConfig, ds: Any) -> tuple[Any, Any]:
    """The training and the evaluation heterogeneous sampler (one object when their fanouts agree)."""

    e_id = bool(getattr(cfg, "return_e_id", False))
    options = cfg.sampler_options()
    train = HeteroNeighborSampler(ds, hetero_fanout(cfg.num_neighbors, ds), replace=cfg.replace, return_e_id=e_id,
                                  **options)  # fmt: skip
    if cfg.eval_fanout == cfg.num_neighbors:
        return train, train
    return train, HeteroNeighborSampler(ds, hetero_fanout(cfg.eval_fanout, ds), replace=cfg.replace,
                                        return_e_id=e_id, **options)  # fmt: skip


def hetero_seed_batches(cfg: NodeDataConfig, ds: Any, ctx: ProcessContext, node_type: str) -> SeedBatches:
    """The seed batches of every split of ``node_type`` for the context's rank (positions in the split for
    temporal sampling, as :func:`~lightning_ooc.loader.tasks.seed_batches`)."""
    def seeds(split: str) -> torch.Tensor | int:
        ids = ds.split(split, node_type)
        return ids if cfg.time_attr is None else int(ids.numel())

    return SeedBatches(seeds, batch_size=cfg.batch_size,
                       eval_batch_size=cfg.eval_size, shuffle=cfg.shuffle, drop_last=cfg.drop_last, seed=cfg.seed,
                       rank=ctx.rank, world=ctx.world)  # fmt: skip


class HeteroSyncPasses(SyncPasses):
    """The batches of :class:`HeteroLocalPasses` (same sampler, seeds and per-batch sampling seeds) with every
    node type's features read synchronously from RAM or a memmap of its file: what PyG's ``NeighborLoader`` on a
    ``HeteroData`` with memory-mapped features amounts to. In order it gives the very same minibatches."""

    task_type = HeteroNodeTask


class HeteroDeviceTablePasses(DeviceTablePasses):
    """:class:`HeteroLocalPasses` whose store holds every row of every node type in the training device's
    memory (one :class:`~lightning_ooc.store.tiers.DeviceTableTier` per type): the same pipeline without the
    hierarchy, the in-memory reference of ``OutOfCoreNodeData`` on a heterogeneous dataset."""

    task_type = HeteroNodeTask
