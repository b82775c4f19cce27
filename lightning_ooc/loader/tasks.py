"""Tasks: what a minibatch is, apart from where its features come from.

A datamodule is a *task* over a *feature backend* (:mod:`lightning_ooc.loader.registry`). The task supplies
everything about the batches: the dataset it opens and checks, the seeds of each split cut into batches,
the samplers and the sample function (a batch without ``x``), the node ids a training batch touches (for the
plan), what the plan must count for the seeds, and the node types whose rows the batches carry. The backend
(the pass source: :class:`~lightning_ooc.loader.source.LocalPasses` for the tiered store,
:class:`~lightning_ooc.loader.baseline.SyncPasses`, ...) builds the store from the task's node types and runs
the passes; it knows nothing else of the task.

============================================  ==================================================================
task                                          a batch is
============================================  ==================================================================
:class:`NodeTask`                             the sampled subgraph of a batch of nodes of a split, with ``y``
:class:`~lightning_ooc.loader.link_task.LinkTask`  the subgraph around a batch of edges and their negatives
:class:`~lightning_ooc.loader.hetero_task.HeteroNodeTask`  node classification on a heterogeneous graph: the
                                              multi-type case, ``x`` and ``n_id`` per node type
============================================  ==================================================================

Example::

    >>> import tempfile
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.loader.config import NodeDataConfig
    >>> from lightning_ooc.loader.context import ProcessContext
    >>> from lightning_ooc.loader.tasks import NodeTask
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=500, avg_degree=4, num_features=8,
    ...                   num_classes=3, train_frac=0.2, progress=False)
    >>> task = NodeTask(NodeDataConfig(root, batch_size=50, num_neighbors=[3]), ProcessContext())
    >>> sampler, _ = task.samplers()
    >>> batch = task.sample("train", sampler, task.dataset.split("train")[:50], seed=0)
    >>> batch.batch_size, list(task.feature_views()), task.node_types
    (50, [None], (None,))
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lightning_ooc.data.dataset import OnDiskDataset, open_dataset
from lightning_ooc.data.format import SPLITS
from lightning_ooc.errors import CorruptDatasetError, DatasetChangedError, InputError
from lightning_ooc.loader.batches import SeedBatches
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.sampling import NeighborSampler
from lightning_ooc.sampling.temporal import temporal_arrays
from lightning_ooc.store.protocol import HOMOGENEOUS


def seed_batches(cfg: NodeDataConfig, ds: OnDiskDataset, ctx: ProcessContext) -> SeedBatches:
    """The seed batches of every split for the context's rank: node ids, or, for temporal sampling, positions in
    the split (a seed is a node at a time, and a node may be a seed at several times)."""
    seeds = ds.split if cfg.time_attr is None else (lambda split: int(ds.split(split).numel()))
    return SeedBatches(seeds, batch_size=cfg.batch_size, eval_batch_size=cfg.eval_size, shuffle=cfg.shuffle,
                       drop_last=cfg.drop_last, seed=cfg.seed, rank=ctx.rank, world=ctx.world)  # fmt: skip


def seed_time(cfg: NodeDataConfig, part: Any, split: str, pos: torch.Tensor) -> torch.Tensor | None:
    """The time of the seeds at positions ``pos`` of ``split`` of ``part`` (a dataset, or the seeds' node type of
    a heterogeneous one): the split's own (``input_time="split"``, where it has them), else their node times."""
    times = part.split_time(split) if cfg.input_time == "split" and hasattr(part, "split_time") else None
    if times is not None:
        return times[pos]
    node_time = getattr(part, "node_time", None)
    return None if node_time is None else torch.from_numpy(np.asarray(node_time[part.split(split)[pos].numpy()]))


def check_seed_times(cfg: NodeDataConfig, part: Any, root: Any) -> None:
    """Every split with seeds has times for them, for temporal sampling; else an error naming the fix."""
    if cfg.time_attr is None or getattr(part, "node_time", None) is not None:
        return
    for split in SPLITS:
        has = cfg.input_time == "split" and hasattr(part, "split_time") and part.split_time(split) is not None
        if part.split(split).numel() and not has:
            raise InputError(f"{root}: time_attr={cfg.time_attr!r} needs the time of each seed, but the {split} "
                             "split has no times (split_time) and the nodes none (node_time); write them with "
                             "`prepare` or give input_time='split' with a timed split")  # fmt: skip


def hetero_dataset_error(root: Any, node_types: Any) -> InputError:
    """The error of a homogeneous task given a heterogeneous dataset."""
    return InputError(f"{root}: a heterogeneous dataset (node types {', '.join(node_types)}); this task reads "
                      "homogeneous ones; OutOfCoreNodeData classifies the nodes of either kind, with a relational "
                      "model (lightning_ooc.models.RGAT or RSAGE) here: configs/rgat_demo.yaml")  # fmt: skip


def open_for(cfg: NodeDataConfig, ctx: ProcessContext, labelled: bool = True) -> OnDiskDataset:
    """The dataset of ``cfg``, with ``indptr`` in the context's shared memory when it offers some.

    It must be the dataset ``cfg.dataset_identity`` names (when set) and, when ``labelled``
    (node classification), have labels of at least two classes on every node of its splits.
    """
    ds = open_dataset(cfg.root, share=ctx.topology)
    if ds.is_hetero:
        raise hetero_dataset_error(ds.root, ds.node_types)
    if cfg.dataset_identity is not None and ds.identity != cfg.dataset_identity:
        raise DatasetChangedError(
            f"{ds.root}: replaced since this datamodule first opened it (identity {cfg.dataset_identity[:12]}, now "
            f"{ds.identity[:12]}); what was trained or planned belongs to the old dataset; create a new datamodule "
            "(a new run) for the new one",
            ds.root,
        )  # fmt: skip
    if labelled:
        check_labelled(ds)
    return ds


def neighbor_samplers(cfg: NodeDataConfig, ds: Any) -> tuple[Any, Any]:
    """The training and the evaluation neighbour sampler of ``cfg`` (one object when their fanouts agree)."""

    e_id = bool(getattr(cfg, "return_e_id", False))
    options = cfg.sampler_options()
    sampler = NeighborSampler(ds, cfg.num_neighbors, replace=cfg.replace, return_e_id=e_id, **options)
    return sampler, (sampler if cfg.eval_fanout == cfg.num_neighbors
                     else NeighborSampler(ds, cfg.eval_fanout, replace=cfg.replace, return_e_id=e_id,
                                          **options))  # fmt: skip


def stored_edge_ids(ds: Any, e_id: torch.Tensor) -> torch.Tensor:
    """The sampler's edge ids (positions in the CSC it reads) as the ids of the edges as ``ds`` stores them: the
    same for a dataset directory; through the graph store's permutation for a PyG store pair (as PyG's loaders)."""
    perm = getattr(ds, "edge_perm", None)
    return e_id if perm is None else perm[e_id]


def check_labelled(ds: OnDiskDataset) -> None:
    """Node classification needs labels of two classes or more, on every node of every split."""
    if ds.num_classes < 2:
        raise InputError(
            f"{ds.root}: the dataset has {ds.num_classes} class(es); node classification needs labels of at least "
            "two classes (`lightning-ooc prepare --y LABELS.npy`, `lightning-ooc synth --classes 2` or more)"
        )  # fmt: skip
    for split in SPLITS:
        ids = ds.split(split).numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= ds.num_nodes):
            raise CorruptDatasetError(f"{ds.root}: the {split} split holds node ids outside [0, {ds.num_nodes}); "
                                      f"run `lightning-ooc verify {ds.root}`", ds.root)  # fmt: skip
        bad = ds.unlabelled(split)
        if bad.size:
            raise InputError(
                f"{ds.root}: the {split} split holds {bad.size:,} node(s) without a label in [0, {ds.num_classes}), "
                f"e.g. node {int(bad[0])} (label {int(ds.labels[bad[0]])}); label them or leave them out of the split, "
                "and prepare the dataset again"
            )  # fmt: skip


class NodeTask:
    """Node classification (see the module docstring); the other tasks are subclasses that override what differs.

    Args:
        cfg, ctx: the settings and the process.
        dataset: the dataset, already opened and checked (default: :meth:`open` it).
    """

    #: the task's name in the registry
    name = "node"

    def __init__(self, cfg: NodeDataConfig, ctx: ProcessContext, dataset: Any = None):
        self.cfg, self.ctx = cfg, ctx
        self.dataset = dataset if dataset is not None else self.open(cfg, ctx)
        if cfg.time_attr is not None:
            self.check_times()

    # -- what a process needs without a task object (batch counts where passes run elsewhere) ---------------
    @classmethod
    def open(cls, cfg: Any, ctx: ProcessContext) -> Any:
        """The dataset, opened and checked for this task."""
        return open_for(cfg, ctx)

    @classmethod
    def seed_batches_of(cls, cfg: Any, ds: Any, ctx: ProcessContext) -> SeedBatches:
        """Every split's seeds cut into batches, the same on every rank."""
        return seed_batches(cfg, ds, ctx)

    # -- what a pass source asks ---------------------------------------------------------------------
    def seed_batches(self, ds: Any) -> SeedBatches:
        return self.seed_batches_of(self.cfg, ds, self.ctx)

    def samplers(self) -> tuple[Any, Any]:
        """The training and the evaluation sampler (one object when their fanouts agree)."""
        return neighbor_samplers(self.cfg, self.dataset)

    def check_times(self) -> None:
        """For temporal sampling: the dataset has the times ``time_attr`` asks for, in order, and the seeds have
        times; else an error naming the fix."""
        temporal_arrays(self.dataset, self.cfg.temporal, what=str(self.dataset.root))
        check_seed_times(self.cfg, self.dataset, self.dataset.root)

    def seed_part(self) -> Any:
        """Where the seeds' splits and times are: the dataset (a node type of it for several types)."""
        return self.dataset

    def seeds(self, split: str, seeds: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """A batch's seed node ids and the sampler's arguments for them. With temporal sampling a batch holds
        positions in the split (a node may be a seed at several times): they become ``input_id``, and the seeds'
        times come from there (``input_time``)."""
        if self.cfg.time_attr is None:
            return seeds, {}
        part, pos = self.seed_part(), seeds.long()
        return part.split(split)[pos], {"input_id": pos, "seed_time": seed_time(self.cfg, part, split, pos)}

    def sample(self, split: str, sampler: Any, seeds: torch.Tensor, seed: int) -> Any:
        """The minibatch of ``seeds`` of ``split`` (no ``x``), drawn by ``sampler`` with ``seed``."""
        ids, extra = self.seeds(split, seeds)
        data = sampler.sample(ids, seed=seed, **extra)
        if getattr(data, "e_id", None) is not None:
            data.e_id = stored_edge_ids(self.dataset, data.e_id)
        return data

    def presample_nodes(self, sampler: Any, seeds: torch.Tensor, seed: int) -> Any:
        """The node ids a training minibatch of ``seeds`` touches (per node type for several types)."""
        ids, extra = self.seeds("train", seeds)
        extra.pop("input_id", None)
        return sampler.sample_subgraph(ids, seed=seed, **extra).n_id

    def seeds_per_batch(self) -> int:
        """The most seed nodes a training minibatch starts from: what the plan bounds a batch's size by."""
        return self.cfg.batch_size

    def seed_memory(self) -> dict[str, Any]:
        """What the plan counts for the seeds of every split (node ids here: ``meta.json``'s split sizes)
        and for what a batch carries besides its nodes (a link batch's negatives)."""
        return {}

    #: the node types whose rows batches carry (``(None,)``: one, a homogeneous graph)
    node_types: tuple[str | None, ...] = (HOMOGENEOUS,)

    def feature_views(self, ds: Any = None) -> dict[str | None, Any]:
        """Each node type's rows as a dataset-like view (the reader and the store are built per view)."""
        return {HOMOGENEOUS: self.dataset if ds is None else ds}

    def per_epoch(self) -> str:
        """What a training batch's seeds are, in the plan's summary ("N x B seeds per epoch")."""
        return "seeds per epoch"
