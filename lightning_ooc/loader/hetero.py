"""``HeteroLocalPasses``: node-classification passes over a heterogeneous dataset, in this process.

The same :class:`~lightning_ooc.loader.source.LocalPasses` (seed batches of
one node type, presample, plan, one pipeline run per pass) with the
heterogeneous pieces behind its hooks: the
:class:`~lightning_ooc.sampling.HeteroNeighborSampler` (fanout per relation),
a feature reader per node type with features, and the
:class:`~lightning_ooc.store.hetero.HeteroFeatureStore` planned across types.
Batches are PyG-shaped ``HeteroData``: ``n_id``, ``x`` (types with features)
and ``num_sampled_nodes`` per type, ``edge_index`` and ``num_sampled_edges``
per relation, ``y``, ``batch_size`` and ``input_id`` on the seed type.

Example::

    >>> import tempfile
    >>> from lightning_ooc.data.synth_hetero import synthesize_hetero
    >>> from lightning_ooc.loader.config import HeteroNodeDataConfig
    >>> from lightning_ooc.loader.context import ProcessContext
    >>> root = synthesize_hetero(tempfile.mkdtemp() + "/h", "mag", num_nodes=2000, num_features=8,
    ...                          train_frac=0.2, progress=False)
    >>> cfg = HeteroNodeDataConfig(root, batch_size=100, num_neighbors=[4, 3], gpu_cache="1MiB",
    ...                            host_cache="8KiB", staging="256KiB", progress=False)
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
from typing import Any, Callable, Iterator

import torch

from lightning_ooc.data.hetero import as_edge_type
from lightning_ooc.errors import DatasetChangedError, InputError
from lightning_ooc.loader.batches import SeedBatches
from lightning_ooc.loader.config import HeteroNodeDataConfig
from lightning_ooc.loader.baseline import SyncPasses
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.loader.source import LocalPasses, check_labelled
from lightning_ooc.store.factory import BATCH_MARGIN, BATCH_SLACK
from lightning_ooc.store.hetero import HeteroFeatureStore, build_hetero_store, hop_bound, plan_hetero_store, type_views
from lightning_ooc.data.dataset import open_dataset
from lightning_ooc.io import FeatureReader
from lightning_ooc.sampling import HeteroNeighborSampler
from lightning_ooc.store.tiered import TieredFeatureStore
from lightning_ooc.store.tiers import DeviceTableTier


def homogeneous_dataset_error(root: Any) -> InputError:
    """The error of :class:`~lightning_ooc.OutOfCoreHeteroNodeData` given a homogeneous dataset."""
    return InputError(f"{root}: a homogeneous dataset; OutOfCoreHeteroNodeData reads heterogeneous ones (node types "
                      "and relations: `lightning-ooc synth --hetero`, `prepare --pyg` of a HeteroData); use "
                      "OutOfCoreNodeData and a homogeneous model (lightning_ooc.models.GraphSAGE) for this one")


def open_hetero_for(cfg: HeteroNodeDataConfig, ctx: ProcessContext) -> Any:
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


def input_type(cfg: HeteroNodeDataConfig, ds: Any) -> str:
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


class HeteroLocalPasses(LocalPasses):
    """Heterogeneous node-classification passes of one process (see the module docstring)."""

    def __init__(self, cfg: HeteroNodeDataConfig, ctx: ProcessContext, dataset: Any = None):
        ds = dataset if dataset is not None else open_hetero_for(cfg, ctx)
        self.input_type = input_type(cfg, ds)
        self._max_edges = 0  # the most edges of a presampled batch
        self._views: dict[str, Any] = {}
        super().__init__(cfg, ctx, dataset=ds)

    def _seed_batches(self, ds: Any) -> SeedBatches:
        return hetero_seed_batches(self.cfg, ds, self.ctx, self.input_type)

    def _samplers(self, ds: Any) -> tuple[Any, Any]:
        return hetero_samplers(self.cfg, ds)

    def _open_reader(self, ds: Any) -> dict[str, Any]:
        cfg = self.cfg
        readers: dict[str, Any] = {}
        self._views = type_views(ds)
        try:
            for t, view in self._views.items():
                readers[t] = FeatureReader.from_dataset(view, backend=cfg.io_backend, queue_depth=cfg.queue_depth,
                                                        workers=cfg.num_extractors)  # fmt: skip
        except BaseException:
            self._close_reader(readers)
            raise
        if not readers:
            raise InputError(f"{ds.root}: no node type has features; there is nothing to read from SSD")
        return readers

    def _close_reader(self, reader: dict[str, Any]) -> None:
        for r in reader.values():
            r.close()

    def _build_store(self, reader: dict[str, Any], presampled: list[dict[str, torch.Tensor]],
                     counted: Callable[[], Iterator[dict[str, torch.Tensor]]]) -> Any:  # fmt: skip
        cfg, ctx, ds = self.cfg, self.ctx, self.dataset
        views = self._views
        fan = hetero_fanout(cfg.num_neighbors, ds)
        sizes = {s: int(ds.split(s, self.input_type).numel()) for s in ("train", "val", "test")}
        edges = math.ceil(self._max_edges * BATCH_MARGIN) + BATCH_SLACK if self._max_edges else None
        self.plan, hots = plan_hetero_store(
            cfg, views, reader, self.device, presampled, counted=counted,
            fanout_bound=hop_bound(fan, ds.edge_types, cfg.hops), seeds_per_batch=self._seeds_per_batch(),
            input_type=self.input_type, split_sizes=sizes, edges_per_batch=edges, processes=ctx.local_world,
            topology_shared=ctx.topology is not None,
        )  # fmt: skip
        return build_hetero_store(self.plan, hots, views, reader, self.device,
                                  progress=cfg.progress and ctx.rank == 0)  # fmt: skip

    def _presample_nodes(self, seeds: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        sub = self.sampler.sample_subgraph(seeds, self.input_type, seed=seed)
        self._max_edges = max(self._max_edges, sum(sum(v) for v in sub.num_sampled_edges.values()))
        return sub.n_id

    def _sample_fn(self, split: str) -> Callable[[torch.Tensor, int, int], Any]:
        sampler = self.sampler if split == "train" else self.eval_sampler
        t = self.input_type

        def sample(seeds: torch.Tensor, seed: int, k: int) -> Any:
            return sampler.sample(seeds, t, seed=seed)

        return sample

    def describe(self, presampled: list[dict[str, torch.Tensor]]) -> str:
        cfg, world = self.cfg, self.ctx.world
        seen = max((sum(int(v.numel()) for v in b.values()) for b in presampled), default=0)
        extra = [
            f"  pipeline        {cfg.num_samplers} samplers, {cfg.num_extractors} extractors, queues "
            f"{cfg.extract_queue_size}/{cfg.train_queue_size}, {cfg.order}",
            f"  minibatches     {self.batches.count('train')} x {cfg.batch_size} {self.input_type} seeds per epoch"
            + (f" per process ({world} processes)" if world > 1 else "")
            + f", fanout {cfg.num_neighbors}, up to {seen:,} nodes of all types in the presample",
        ]
        return self.plan.format(extra=extra)


def hetero_samplers(cfg: HeteroNodeDataConfig, ds: Any) -> tuple[Any, Any]:
    """The training and the evaluation heterogeneous sampler (one object when their fanouts agree)."""

    train = HeteroNeighborSampler(ds, hetero_fanout(cfg.num_neighbors, ds), replace=cfg.replace)
    if cfg.eval_fanout == cfg.num_neighbors:
        return train, train
    return train, HeteroNeighborSampler(ds, hetero_fanout(cfg.eval_fanout, ds), replace=cfg.replace)


def hetero_seed_batches(cfg: HeteroNodeDataConfig, ds: Any, ctx: ProcessContext, node_type: str) -> SeedBatches:
    """The seed batches of every split of ``node_type`` for the context's rank."""
    return SeedBatches(lambda split: ds.split(split, node_type), batch_size=cfg.batch_size,
                       eval_batch_size=cfg.eval_size, shuffle=cfg.shuffle, drop_last=cfg.drop_last, seed=cfg.seed,
                       rank=ctx.rank, world=ctx.world)  # fmt: skip


class HeteroSyncPasses(SyncPasses):
    """The batches of :class:`HeteroLocalPasses` (same sampler, seeds and per-batch sampling seeds) with every
    node type's features read synchronously from RAM or a memmap of its file: what PyG's ``NeighborLoader`` on a
    ``HeteroData`` with memory-mapped features amounts to. In order it gives the very same minibatches."""

    def __init__(self, cfg: HeteroNodeDataConfig, ctx: ProcessContext, features: str = "ram",
                 madvise_random: bool = False):  # fmt: skip
        self.cfg, self.ctx = cfg, ctx
        self.features = self.check_features(features)
        ds = self.dataset = open_hetero_for(cfg, ctx)
        self.input_type = input_type(cfg, ds)
        self.batches = hetero_seed_batches(cfg, ds, ctx, self.input_type)
        self.sampler, self.eval_sampler = hetero_samplers(cfg, ds)
        self._tables = {t: self.load_rows(v, self.features, madvise_random) for t, v in type_views(ds).items()}
        self._x = None  # type: ignore[assignment]

    def sample(self, split: str, seeds: torch.Tensor, seed: int) -> Any:
        sampler = self.sampler if split == "train" else self.eval_sampler
        return sampler.sample(seeds, self.input_type, seed=seed)

    def attach(self, data: Any) -> None:
        for t, table in self._tables.items():
            data[t].x = self.take_rows(table, data[t].n_id, self.dataset.node(t).feature_dtype)

    def close(self) -> None:
        self._tables = {}


class HeteroDeviceTablePasses(HeteroLocalPasses):
    """:class:`HeteroLocalPasses` whose store holds every row of every node type in the training device's
    memory (one :class:`~lightning_ooc.store.tiers.DeviceTableTier` per type): the same pipeline without the
    hierarchy, the in-memory reference of ``OutOfCoreHeteroNodeData``."""

    def _build_store(self, reader: dict[str, Any], presampled: Any, counted: Any = None) -> Any:
        self._close_reader(reader)  # no SSD tier
        self.plan = None
        stores = {}
        for t, v in type_views(self.dataset).items():
            stores[t] = TieredFeatureStore([DeviceTableTier.load(v, self.device)], v.num_features, v.feature_dtype)
        return HeteroFeatureStore(stores)

    def describe(self, presampled: Any) -> str:
        views = type_views(self.dataset)
        rows = ", ".join(f"{t} {v.num_nodes:,} x {v.row_bytes} B" for t, v in views.items())
        return (f"lightning_ooc reference: every feature row ({rows}) in {self.device} memory; "
                f"{self.cfg.num_samplers} samplers, {self.cfg.num_extractors} extractors, {self.cfg.order}")
