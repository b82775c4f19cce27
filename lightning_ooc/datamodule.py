"""The datamodules of graph tasks: ``OutOfCoreNodeData`` and ``OutOfCoreLinkData``, minibatches from SSD.

One datamodule per task, as PyG's ``LightningNodeData`` and ``LightningLinkData`` are; the dataset says
whether a run is homogeneous or heterogeneous, and the feature backend (``features=``) is a value. A
datamodule wires things together and does none of their work:

* :class:`~lightning_ooc.loader.config.NodeDataConfig` checks the settings (the groups:
  :mod:`lightning_ooc.loader.settings`; the backends: :mod:`lightning_ooc.loader.features`);
* :class:`~lightning_ooc.loader.context.ProcessContext` says which process this is
  (rank, device, shared memory, whether passes run in a producer process);
* a pass source runs the passes: the task of the grid (:func:`~lightning_ooc.loader.registry.task_for`: the
  datamodule's ``task`` in the case its dataset is) over the feature backend, looked up in
  :mod:`lightning_ooc.loader.registry`, in this process or in the strategy's producer process;
* :mod:`lightning_ooc.loader.batches` cuts seeds into batches and keeps the mid-epoch resume bookkeeping.

Both share :class:`GraphData` (set-up, passes, resume, predict, teardown), which shares the loaders and the
logged metrics with the embedding datamodule (:class:`~lightning_ooc.loader.dataloader.PassData`).
"""
from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

from lightning_ooc.data.dataset import OnDiskDataset, open_dataset, read_meta
from lightning_ooc.errors import InputError
from lightning_ooc.loader import registry
from lightning_ooc.loader.batches import BatchList, EpochProgress, SeedBatches, rank_batches
from lightning_ooc.loader.config import DEFAULT_FANOUT, NodeDataConfig
from lightning_ooc.loader.features import FeatureBackend, Learnable, Mapped, Packed, Tiered, as_backend
from lightning_ooc.loader.context import PassRun, PassSource, ProcessContext
from lightning_ooc.loader.dataloader import PassData
from lightning_ooc.loader.link_task import LinkDataConfig, training_edges_or_fail
from lightning_ooc.loader.pipeline import EpochStats
from lightning_ooc.loader.settings import Pipeline, PredictSettings, TimeSettings, group, plain
from lightning_ooc.loader.partitioned import agree_on_layout, is_partitioned, partition_meta
from lightning_ooc.loader.store_pair import StorePairGraph, is_store_pair
from lightning_ooc.loader.source import LocalPasses
from lightning_ooc.store.limits import StageMemory, planning_stage, release_freed_memory
from lightning_ooc.utils.logs import log_secondary_failure
from lightning_ooc.embed.table import read_table_meta

log = logging.getLogger("lightning_ooc")

__all__ = ["OutOfCoreNodeData", "OutOfCoreLinkData", "GraphData", "OutOfCoreHeteroNodeData", "PackedNodeData",
           "datamodule_for", "rank_batches"]  # fmt: skip


class GraphData(PassData):
    """What the datamodules of graph tasks share: set-up through the grid (:mod:`lightning_ooc.loader.registry`),
    the passes and their mid-epoch resume, the dataset's facts a model is built from, predict and teardown.

    A datamodule of a task is a subclass that names its ``task`` (a datamodule task of
    :data:`~lightning_ooc.loader.registry.TASKS`) and its settings' class (``config_type``), and takes the
    parameters below plus its own (given to ``config_type``): see :class:`OutOfCoreNodeData` for each.

        >>> OutOfCoreNodeData.task, OutOfCoreLinkData.task, issubclass(OutOfCoreLinkData, OutOfCoreNodeData)
        ('node', 'link', False)
    """

    #: the task (a datamodule task of the registry's grid); the feature backend is a value, ``config.features``
    task: str = ""
    #: the settings' class: :class:`~lightning_ooc.loader.config.NodeDataConfig` or a subclass
    config_type: type[NodeDataConfig] = NodeDataConfig

    def __init__(
        self,
        root: str | os.PathLike,
        batch_size: int = NodeDataConfig.batch_size,
        num_neighbors: Sequence[int] | dict[Any, Sequence[int]] = DEFAULT_FANOUT,
        replace: bool = NodeDataConfig.replace,
        return_e_id: bool = NodeDataConfig.return_e_id,
        features: FeatureBackend | str = Tiered(),
        pipeline: Pipeline | dict[str, Any] | None = None,
        memory_limit: int | str | None = NodeDataConfig.memory_limit,
        eval_batch_size: int | None = None,
        eval_num_neighbors: Sequence[int] | dict[Any, Sequence[int]] | None = None,
        shuffle: bool = NodeDataConfig.shuffle,
        drop_last: bool = NodeDataConfig.drop_last,
        seed: int = NodeDataConfig.seed,
        progress: bool = NodeDataConfig.progress,
        predict: PredictSettings | dict[str, Any] | None = None,
        time: TimeSettings | dict[str, Any] | None = None,
        **task_settings: Any,
    ):
        stores = None
        if is_store_pair(root):  # a PyG (FeatureStore, GraphStore) pair: the pyg_store backend reads it
            stores, root = tuple(root), StorePairGraph.name_of(*root)
            if (self.task, "pyg_store") not in registry.SOURCES:
                raise InputError(f"{type(self).__name__}: {registry.TASKS[self.task].words} over "
                                 f"{registry.BACKENDS['pyg_store']} is not supported; node classification runs over "
                                 "one: OutOfCoreNodeData((feature_store, graph_store), ...)")  # fmt: skip
        super().__init__()
        self.config = self.config_type(
            root, batch_size=batch_size, num_neighbors=num_neighbors, replace=replace, return_e_id=return_e_id,
            features=features, pipeline=pipeline, memory_limit=memory_limit, eval_batch_size=eval_batch_size,
            eval_num_neighbors=eval_num_neighbors, shuffle=shuffle, drop_last=drop_last, seed=seed, progress=progress,
            predict=predict, time=time, **task_settings,
        )  # fmt: skip
        if stores is not None:  # the pair reads its own features: a backend given for it is refused now
            registry.backend_for(self.config, stores)
        # every __init__ frame of the hierarchy is read and the subclass's wins: its ``root`` may be a PyG store
        # pair, which is left out (never copied) and kept by its name
        self.save_hyperparameters(ignore=["root"])
        self.hparams["root"] = self.config.root
        plain_hparams(self.hparams)
        self.save_hyperparameters(dict(self.hparams))  # the loggers' copy (hparams.yaml) plain too
        self.root = root
        #: the PyG store pair given as ``root`` (None for a dataset directory)
        self.stores = stores
        self._pair_graph: StorePairGraph | None = None
        #: the order batches are trained in (a synchronous baseline, ``Mapped``, runs them as they are sampled)
        self.order = "in_order" if isinstance(self.config.features, Mapped) else self.config.pipeline.order
        self.dataset: OnDiskDataset | None = None
        self.batches: SeedBatches | None = None
        self.source: PassSource | None = None
        self.last_stats: dict[str, EpochStats] = {}
        self.progress = EpochProgress(self.config.seed)
        self._ctx: ProcessContext | None = None
        self._before_trainer = False  # set up with no Trainer attached (for one CPU process)
        self._source_closed = False  # the source was closed after an error, its batch counts kept
        self._plan = None
        #: what each stage's plan read of the memory limit: a later stage plans with what an earlier one gave back
        self._stage_memory = StageMemory()
        self._epoch = 0  # the next training epoch when no Trainer says which

    def __str__(self) -> str:
        """What this datamodule serves, from its settings alone: it opens nothing and starts no pass (Lightning's
        own ``__str__`` would call each ``*_dataloader()`` and iterate what is not a ``DataLoader``).

            >>> import tempfile
            >>> from lightning_ooc.data.synth import synthesize
            >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=500, avg_degree=4, num_features=8,
            ...                   num_classes=3, progress=False)
            >>> print(OutOfCoreNodeData(root, batch_size=64, num_neighbors=[5, 5]))  # doctest: +ELLIPSIS
            OutOfCoreNodeData(root=.../g, node classification over ..., batch_size=64, num_neighbors=[5, 5]; ...)
        """
        cfg = self.config
        task = registry.TASKS[self.task].words if self.task in registry.TASKS else self.task
        state = (f"set up: {self.dataset.num_nodes} nodes" if self.dataset is not None else "not set up")
        return (f"{type(self).__name__}(root={self.root}, {task} over {cfg.features.describe()}, "
                f"batch_size={cfg.batch_size}, num_neighbors={list(cfg.num_neighbors)}; predict: "
                f"{cfg.predict.inference}; {state})")  # fmt: skip

    __repr__ = __str__

    # -- set-up -----------------------------------------------------------------------------------
    @property
    def context(self) -> ProcessContext:
        """This process, as the Trainer's strategy describes it (one CPU process without a Trainer)."""
        if self._ctx is None:
            return ProcessContext.of(getattr(self, "trainer", None))
        return self._ctx

    # -- what a model is built from (read from the dataset, before set-up too) -----------------------------------
    @property
    def typed(self) -> bool:
        """Whether the dataset is heterogeneous (node types and relations): the dataset says, not the class (a
        dataset this datamodule's task cannot run, or settings of node types on a homogeneous one, are an error
        here)."""
        return registry.task_for(self.task, self.config, self.stores).typed

    def _typed_dataset(self) -> Any:
        """The heterogeneous dataset (opened for its facts when the datamodule is not set up yet)."""
        return self.dataset if self.dataset is not None else open_dataset(self.config.root)

    def _meta(self) -> dict[str, Any]:
        """``meta.json`` of a homogeneous dataset (of this machine's partition, for a partitioned one)."""
        if self.stores is not None:
            g = self._store_graph()
            return {"num_features": g.num_features, "num_classes": g.num_classes, "num_nodes": g.num_nodes}
        return partition_meta(self.root) if is_partitioned(self.root) else read_meta(self.root)

    @property
    def metadata(self) -> tuple[list[str], list[tuple[str, str, str]]] | None:
        """``(node_types, edge_types)`` of a heterogeneous dataset (a relational model's ``metadata``); ``None`` for
        a homogeneous one."""
        return self._typed_dataset().metadata() if self.typed else None

    @property
    def input_type(self) -> str | None:
        """The seeds' node type of a heterogeneous dataset (``input_type=``, else the dataset's target type);
        ``None`` for a homogeneous one."""
        if not self.typed:
            return None
        return self.config.input_type or self._typed_dataset().target

    @property
    def num_features(self) -> int | dict[str, int]:
        """Feature dimension (read from ``meta.json``; for ``in_channels`` of a model): per node type on a
        heterogeneous dataset (0: no features), as PyG's ``HeteroData.num_features``; with
        ``features=Learnable(...)``, the embedding table's ``dim``."""
        if isinstance(self.config.features, Learnable):
            return int(read_table_meta(self.config.features.table)["dim"])
        if self.typed:
            ds = self._typed_dataset()
            return {t: ds.node(t).num_features for t in ds.node_types}
        return self.dataset.num_features if self.dataset is not None else int(self._meta()["num_features"])

    @property
    def in_channels(self) -> int | dict[str, int]:
        """A model's ``in_channels``: :attr:`num_features` (per node type on a heterogeneous dataset)."""
        return self.num_features

    @property
    def num_classes(self) -> int:
        """Number of classes (of the seeds' node type on a heterogeneous dataset)."""
        if self.typed:
            ds = self._typed_dataset()  # opened once: the seeds' type and its classes
            return ds.node(self.config.input_type or ds.target).num_classes
        return self.dataset.num_classes if self.dataset is not None else int(self._meta()["num_classes"])

    @property
    def num_nodes(self) -> int | dict[str, int]:
        """Number of nodes (per node type on a heterogeneous dataset; this machine's part of a partitioned one)."""
        if self.typed:
            return dict(self._typed_dataset().num_nodes_dict)
        return self.dataset.num_nodes if self.dataset is not None else int(self._meta()["num_nodes"])

    def _store_graph(self) -> StorePairGraph:
        """The PyG store pair as the node task reads it (its topology, labels and splits, read once)."""
        if self._pair_graph is None:
            self._pair_graph = StorePairGraph(*self.stores)
        return self._pair_graph

    @property
    def local(self) -> LocalPasses | None:
        """The in-process pass source (``None`` when passes run elsewhere or before ``setup``)."""
        return self.source if isinstance(self.source, LocalPasses) else None

    @property
    def store(self):
        """The tiered feature store of this process (``None`` when a producer process owns it)."""
        return self.local.store if self.local is not None else None

    @property
    def plan(self):
        """The sizes of every tier of the last set-up (``None`` when a producer process owns the store)."""
        return self._plan

    @property
    def sampler(self):
        """The training sampler of the pass source in this process (``None`` when passes run elsewhere)."""
        return getattr(self.source, "sampler", None)

    def setup(self, stage: str | None = None) -> None:
        trainer = getattr(self, "trainer", None)
        if self._source_closed:  # closed after an error (on_exception): set up afresh
            self._source_closed = False
            self._close_source()
        if stage == "predict" and self.config.predict.inference == "layerwise":
            # layer-wise inference reads the dataset itself (lightning_ooc.infer): no sampled passes to set up
            if self.dataset is None and self.stores is None:
                self.dataset = open_dataset(self.config.root)
            return
        if self.source is not None:
            if not self._before_trainer or trainer is None:
                return
            # Set up before the Trainer existed (a script calling dm.setup() first): that was for one
            # CPU process. Set up again if the Trainer's process differs (a GPU, several processes).
            self._before_trainer = False
            ctx = ProcessContext.of(trainer)
            if self._serves(ctx):
                self._ctx = ctx
                return
            log.info("set up again for the Trainer's %s (rank %d of %d); the earlier set-up, made before the "
                     "Trainer, was for one process on %s", ctx.device, ctx.rank, ctx.world, self._ctx.device)  # fmt: skip
            self._close_source()
        self._before_trainer = trainer is None
        ctx = self._ctx = self.context
        # A set-up after an earlier one was closed (test after fit): that one's dataset (its indptr) goes
        # before this one opens its own; what the earlier stage freed goes back to the kernel before this
        # one's plan reads what is in use (store.limits.limit_for_plan), and what stayed in use of what the
        # earlier stage's reserve kept room for (the model, its optimizer state, the fit loop) is not kept
        # free again (store.limits.StageMemory).
        self.dataset = None
        agree_on_layout(self.config.root, ctx)  # before any other collective: the two kinds run different ones
        if ctx.remote is not None and is_partitioned(self.config.root):
            raise InputError(f"{self.config.root}: a partitioned dataset runs its passes in the training process; "
                             "mps_split (a gather process) is not supported with one yet: leave mps_split unset")  # fmt: skip
        if ctx.remote is not None and self.stores is not None:
            raise InputError(f"{type(self).__name__}: a PyG store pair runs its passes in the training process; "
                             "mps_split (a gather process) is not supported with one: leave mps_split "
                             "unset")  # fmt: skip
        if ctx.remote is not None and type(self.config.features) is not Tiered:
            raise InputError(f"{type(self).__name__}: a gather process (mps_split) runs the tiered store only; "
                             f"{self.config.features.words} run in the training process: leave mps_split "
                             "unset")  # fmt: skip
        if ctx.remote is not None:  # passes run in another process; this one needs batch counts only
            self.dataset = self._open(ctx)
            self.source = ctx.remote(self.config)
        else:
            with planning_stage(self._stage_memory, stage):
                self.source = self._local_source(ctx)
            self.dataset = self.source.dataset
            self._plan = self.source.plan
        if self.config.dataset_identity is None:  # pinned: a later set-up (test after fit) must find the same one
            self.config.dataset_identity = self.dataset.identity
        self.batches = self._seed_batches(ctx)

    def _open(self, ctx: ProcessContext) -> OnDiskDataset:
        """The dataset, opened here for batch counts when passes run in another process."""
        return registry.task_for(self.task, self.config).open(self.config, ctx)

    def _seed_batches(self, ctx: ProcessContext) -> SeedBatches:
        own = getattr(self.source, "batches", None) if ctx.remote is None else None
        if own is not None:  # the source's own (a partitioned one's agreed by every machine at its set-up)
            return own
        return registry.task_for(self.task, self.config).seed_batches(self.config, self.dataset, ctx)

    def _local_source(self, ctx: ProcessContext) -> PassSource:
        stores = self._store_graph() if self.stores is not None else None
        return registry.source(registry.task_for(self.task, self.config, stores), self.config, ctx, stores=stores)

    # -- epochs -------------------------------------------------------------------------------------
    def _batches(self, split: str, epoch: int) -> BatchList:
        if self.batches is None:
            self.setup()
        assert self.batches is not None
        return self.batches.epoch(split, epoch)

    def _num_batches(self, split: str) -> int:
        if self.batches is None:
            self.setup()
        assert self.batches is not None
        return self.batches.count(split)

    def _start(self, split: str) -> PassRun:
        if self.source is None:
            self.setup()
        assert self.source is not None
        trainer = getattr(self, "trainer", None)
        skip: frozenset[int] = frozenset()
        epoch = 0  # evaluation samples the same neighbourhoods every time
        if split == "train":
            epoch = trainer.current_epoch if trainer is not None else self._epoch
            epoch, skip = self.progress.begin(epoch, self._num_batches("train"))
            self._epoch = epoch + 1

        def on_batch(k: int) -> None:
            if split == "train" and trainer is None:
                self.progress.trained(k)

        return self.source.run(split, epoch, skip, on_end=lambda stats: self._epoch_end(split, stats),
                               on_batch=on_batch)  # fmt: skip

    def _epoch_end(self, split: str, stats: EpochStats) -> None:
        logged = getattr(self, "trainer", None) is not None and self.dataset is not None
        row_bytes = getattr(self.dataset, "row_bytes", 0)
        self._pass_ended(split, stats, self._mean_over_ranks(stats.as_metrics(row_bytes)) if logged else {})

    def _mean_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric averaged over the ranks (a collective; every rank ends its pass at the same batch count)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or trainer.world_size == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        # on the strategy's device: NCCL reduces only tensors on the rank's GPU
        t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=trainer.strategy.root_device)
        t = trainer.strategy.reduce(t, reduce_op="mean")
        return {k: float(v) for k, v in zip(keys, t.cpu().tolist())}

    def predict_dataloader(self) -> Any:
        if self.config.predict.inference == "layerwise":
            from lightning_ooc.infer.predict import LayerwisePredictLoader  # lazy: it imports PyG's layers

            return LayerwisePredictLoader(self)
        return self._loader("test")

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Called right before the training step that uses ``batch`` (after Lightning's prefetch),
        # so the batches recorded here are the ones a checkpoint taken after this step covers.
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training and hasattr(batch, "batch_index"):
            self.progress.trained(int(batch.batch_index))
        return batch

    # -- checkpointing ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The current training epoch and the batches of it already trained (for mid-epoch resume).

        With several processes every rank's own list is kept (out of order, ranks finish different
        batches first); Lightning builds checkpoints on every rank, so the lists are gathered here.
        """
        if self.source is not None:  # learnable features: the table holds what the checkpoint's model was trained with
            self.source.flush()
        world = self.context.world
        return self.progress.state_dict(gather=_all_gather_object if world > 1 else None, world=world)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ctx = self.context
        self.progress.load_state_dict(state, ctx.rank, ctx.world)

    def on_exception(self, exception: BaseException) -> None:
        # stop the pipeline threads now, so an interrupted or failing run exits promptly
        source = self.source
        if source is not None:  # a partitioned dataset: leave the row exchange now, the others fail, not wait
            source.abort()
        self.close_loaders()
        if source is not None and source.close_after_error is not None:
            # Lightning calls no teardown after an exception: what the source holds for others (the row exchange,
            # trained rows not yet written back) goes now. The batch counts stay (Lightning still asks for
            # them); a later set-up starts afresh.
            self._source_closed = True
            try:
                source.close()
            except Exception as e:  # noqa: BLE001 - the exception that stopped the run is the one to see
                # (a full disk fails this as it failed the run: one line, the run's own error follows it)
                log_secondary_failure(log, f"{source.close_after_error} after the error", e)

    def _serves(self, ctx: ProcessContext) -> bool:
        """Whether what was set up for ``self._ctx`` serves a process described by ``ctx`` as well."""
        old = self._ctx
        return (old is not None and ctx.device == old.device and (ctx.rank, ctx.world) == (old.rank, old.world)
                and ctx.remote is None and ctx.topology is None and ctx.staging is None)  # fmt: skip

    def _close_source(self) -> None:
        self.close_loaders()
        if self.source is not None:
            self.source.close()
        self.source = None
        self.batches = None
        self._ctx = None
        # what the pipeline's threads freed goes back now; cycles, if any, at the next set-up's collection
        release_freed_memory(collect=False)

    def teardown(self, stage: str | None = None) -> None:
        if stage in (None, "fit", "test", "predict", "validate") and self.source is not None:
            self._close_source()
        else:
            self.close_loaders()



class OutOfCoreNodeData(GraphData):
    """Node-classification minibatches for graphs whose features live on SSD, homogeneous or heterogeneous.

    The dataset says which, as PyG's datamodule takes a ``Data`` or a ``HeteroData``. On a homogeneous dataset
    minibatches are PyG-shaped ``Data`` (``x``, ``y``, ``edge_index``, ``n_id``, ``batch_size``, ...), as
    ``NeighborLoader`` gives them. On a heterogeneous one (``lightning-ooc synth --hetero igbh|mag``, ``prepare
    --pyg`` of a ``HeteroData``) they are ``HeteroData``: ``x``, ``n_id`` and ``num_sampled_nodes`` per node type,
    ``edge_index`` and ``num_sampled_edges`` per relation, ``y``, ``batch_size`` and ``input_id`` on the seed
    type, so ``to_hetero`` models and ``HeteroConv`` stacks (:class:`~lightning_ooc.models.RGAT`,
    :class:`~lightning_ooc.models.RSAGE`) train unchanged; every node type with features has its own tiers,
    planned as one. A model's arguments come from :attr:`metadata`, :attr:`in_channels` and
    :attr:`num_classes` (``lightning-ooc fit`` links them).

    Args:
        root: a dataset directory (``lightning-ooc synth`` / ``prepare``), as a string or path; or a PyG
            ``(FeatureStore, GraphStore)`` pair of any backend (:mod:`lightning_ooc.loader.store_pair`).
        batch_size: seed nodes per training minibatch.
        num_neighbors: fanout per hop (``-1``: all neighbours); on a heterogeneous dataset one list for every
            relation, or a dict ``{(src, rel, dst): [...]}`` (``"src__rel__dst"`` keys in YAML) with every relation.
        replace: sample neighbours with replacement.
        return_e_id: give every batch ``e_id`` (as PyG's loaders do): the id of each sampled edge, in
            ``edge_index``'s order, as the dataset stores it (the edge's position in the stored CSC: ``indices``,
            or a relation's on a heterogeneous graph, where ``e_id`` is per relation; for a PyG store pair, the
            graph store's edge id), so that a model can read edge features by it. Off by default (8 bytes a
            sampled edge).
        features: where ``x`` comes from, a feature backend with its own settings
            (:mod:`lightning_ooc.loader.features`): :class:`~lightning_ooc.Tiered` (the default: SSD through the
            tiers, ``Tiered(gpu_cache="4GiB", host_cache="8GiB", staging="256MiB", ...)``),
            :class:`~lightning_ooc.Packed` (packed minibatches), :class:`~lightning_ooc.InMemory` (every row in
            device memory), :class:`~lightning_ooc.Mapped` (the synchronous memory-map baseline),
            :class:`~lightning_ooc.Learnable` (an embedding table trained with the model); or a short name
            (``"tiered"``, ``"packed"``, ``"in_memory"``, ``"mapped"``). A partitioned dataset (``root`` is the
            output of ``lightning-ooc partition``, or this machine's part of it) runs
            :class:`~lightning_ooc.Partitioned` with the tiered settings given; a PyG store pair reads its own.
        pipeline: the pipeline's threads, queues, order and timeline (:class:`~lightning_ooc.Pipeline`, or a dict
            of its fields): ``order`` ``"out_of_order"`` (train batches as they complete) or ``"in_order"``
            (sampling order; reproducible for a given seed), ``num_samplers``, ``num_extractors``,
            ``extract_queue_size``, ``train_queue_size`` (defaults: one sampler and one extractor per core up to
            4, GNNDrive's queues 6 and 4), ``profile`` (a
            directory for every pass's per-stage timeline, a Chrome trace).
        memory_limit: host memory the plan must fit in: ``"auto"`` reads the memory cgroup's limit
            and ``MemAvailable``; a size (``"8GiB"``) is this process's total; ``None`` turns the
            check off. A plan that does not fit shrinks the host cache (then, on CPU, the feature
            buffer and the pipeline) with a warning, or is refused with an error that says what to shrink.
        eval_batch_size, eval_num_neighbors: for validation/test/predict (default: the training ones).
        shuffle, drop_last, seed: seed order per epoch, and the base seed of all sampling.
        progress: progress bars for setup steps.
        predict: how ``predict`` runs (:class:`~lightning_ooc.loader.settings.PredictSettings`, or a dict of its
            fields): ``inference`` ``"sampled"`` (the test split, sampled) or ``"layerwise"`` (every node, layer by
            layer over full neighbourhoods, out of core: :func:`lightning_ooc.infer.layerwise`; the outputs become
            the dataset ``inference_out``), ``inference_memory``, ``inference_chunk``.
        time: temporal sampling (:class:`~lightning_ooc.loader.settings.TimeSettings`, or a dict of its fields,
            PyG's names): ``time_attr`` ``"time"`` (each node's time, the dataset's ``node_time``) or
            ``"edge_time"`` (each edge's), ``temporal_strategy`` (``"uniform"`` or ``"last"``), ``time_window``
            and ``input_time`` (``"split"``: the split's own times, ``{split}_time``, where it has them, else
            the seed's node time; ``"node"``). A seed's subgraph then holds only in-edges no later than its
            time, and each seed has a subgraph of its own (``batch``, and the seeds' ``seed_time``, on every
            batch). The dataset must store each node's in-edges in that time's order (``synth --temporal``,
            ``prepare --from tgb``, ``prepare --neighbor-order``).
        input_type: the seeds' node type on a heterogeneous dataset (default: the dataset's target type).

    Invalid settings (a pipeline without samplers or extractors, an unknown order, a
    batch size below one, an empty fanout) raise :class:`~lightning_ooc.errors.InputError`
    here, at construction; settings the dataset must agree with (``input_type`` or a fanout
    per relation, which only a heterogeneous dataset takes) when the dataset is first read
    (``setup``, or a property such as :attr:`num_features`).

    Under the ``"ooc"`` strategy the datamodule learns its process from the strategy's
    :class:`~lightning_ooc.loader.context.ProcessContext` (shared topology and staging,
    passes run by a gather producer process); otherwise it runs every pass in this process.

    Example::

        >>> import tempfile, lightning as L
        >>> from lightning_ooc import OutOfCoreNodeData, Tiered
        >>> from lightning_ooc.data.synth import synthesize
        >>> from lightning_ooc.models import GraphSAGE
        >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=3000, avg_degree=6, num_features=16,
        ...                   num_classes=4, train_frac=0.2, progress=False)
        >>> dm = OutOfCoreNodeData(root, batch_size=100, num_neighbors=[5, 5], progress=False,
        ...                        features=Tiered(gpu_cache="8MiB", host_cache="64KiB", staging="1MiB"))
        >>> trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(GraphSAGE(16, 4, hidden_channels=32, num_layers=2), datamodule=dm)
        >>> dm.last_stats["train"].seeds == len(dm.dataset.split("train"))
        True

    The same class over a heterogeneous dataset, with a relational model::

        >>> from lightning_ooc.data.synth_hetero import synthesize_hetero
        >>> from lightning_ooc.models import RGAT
        >>> root = synthesize_hetero(tempfile.mkdtemp() + "/h", "igbh", num_nodes=2000, num_features=16,
        ...                          num_classes=4, train_frac=0.2, progress=False)
        >>> dm = OutOfCoreNodeData(root, batch_size=100, num_neighbors=[5, 5], progress=False,
        ...                        features=Tiered(gpu_cache="8MiB", host_cache="64KiB", staging="1MiB"))
        >>> dm.input_type, sorted(dm.metadata[0]) == sorted(dm.in_channels)
        ('paper', True)
        >>> model = RGAT(dm.metadata, dm.in_channels, dm.num_classes, hidden_channels=16, num_layers=2)
        >>> trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(model, datamodule=dm)
        >>> dm.last_stats["train"].seeds == len(dm.dataset.split("train"))
        True
    """

    task = "node"

    def __init__(
        self,
        root: str | os.PathLike,
        batch_size: int = NodeDataConfig.batch_size,
        num_neighbors: Sequence[int] | dict[Any, Sequence[int]] = DEFAULT_FANOUT,
        replace: bool = NodeDataConfig.replace,
        return_e_id: bool = NodeDataConfig.return_e_id,
        features: FeatureBackend | str = Tiered(),
        pipeline: Pipeline | dict[str, Any] | None = None,
        memory_limit: int | str | None = NodeDataConfig.memory_limit,
        eval_batch_size: int | None = None,
        eval_num_neighbors: Sequence[int] | dict[Any, Sequence[int]] | None = None,
        shuffle: bool = NodeDataConfig.shuffle,
        drop_last: bool = NodeDataConfig.drop_last,
        seed: int = NodeDataConfig.seed,
        progress: bool = NodeDataConfig.progress,
        predict: PredictSettings | dict[str, Any] | None = None,
        time: TimeSettings | dict[str, Any] | None = None,
        input_type: str | None = None,
    ):
        super().__init__(root, batch_size, num_neighbors, replace, return_e_id, features, pipeline, memory_limit,
                         eval_batch_size, eval_num_neighbors, shuffle, drop_last, seed, progress, predict, time,
                         input_type=input_type)  # fmt: skip



class OutOfCoreLinkData(GraphData):
    """Link-prediction minibatches for graphs whose features live on SSD, as PyG's ``LinkNeighborLoader`` gives them.

    The dataset must hold link splits (``lightning-ooc prepare ... --split-edges 0.85,0.05,0.10``,
    or given ones; see :mod:`lightning_ooc.data.link_splits`). Each minibatch holds ``batch_size``
    supervision edges of a split and, drawn in native code with the batch's seed, their
    negatives; the union of their endpoints is sampled as one subgraph and its features
    come from the tiers, through the same pipeline as :class:`OutOfCoreNodeData`'s
    (out of order by default, ``order="in_order"`` on request). A batch carries ``x``,
    ``n_id``, ``edge_index``, ``input_id`` (the edges' positions in the split),
    ``num_sampled_nodes``/``num_sampled_edges`` and, as PyG's ``LinkNeighborLoader``,
    ``edge_label_index``/``edge_label`` (binary or no negatives) or
    ``src_index``/``dst_pos_index``/``dst_neg_index`` (triplet), so a model written for
    that loader trains unchanged; ``batch_size`` is the number of positive edges.
    See :mod:`lightning_ooc.loader.link_task` for the details.

    Args:
        root, batch_size, num_neighbors, ...: as :class:`OutOfCoreNodeData` (``batch_size``:
            supervision edges per minibatch).
        neg_sampling: ``None``, ``"binary"``, ``"triplet"``, a dict such as
            ``{"mode": "binary", "amount": 2, "weight": "degree", "strict": True}``, a
            :class:`~lightning_ooc.sampling.negative.NegativeSampling` or PyG's
            ``NegativeSampling``. Training batches draw them; evaluation splits that store
            labels or negatives use those instead, the others draw as training does.
        exclude_seed_edges: remove every batch's positive edges (and their reverses) from its
            sampled ``edge_index``, so no supervision edge is passed as a message (off by
            default, as PyG's edge-exclusion options are).
        node_labels: also give each batch node's class as ``y`` when the dataset has labels (off
            by default: link models do not read it, and under a memory cap each label is a random
            read of the labels file).

    A dataset without link splits is an :class:`~lightning_ooc.errors.InputError` at ``setup``, and so is
    one without training edges (no link split ``train``, or an empty one) at ``setup("fit")``: the
    stored graph only passes messages. Such a dataset still validates, tests and predicts.

    Example::

        >>> import tempfile, numpy as np, lightning as L
        >>> from lightning_ooc import OutOfCoreLinkData, Tiered
        >>> from lightning_ooc.data.prepare import prepare_from_arrays
        >>> rng = np.random.default_rng(0)
        >>> root = prepare_from_arrays(tempfile.mkdtemp() + "/g", rng.integers(0, 400, (2, 2000)),
        ...                            rng.random((400, 8), dtype=np.float32), split_edges=(0.85, 0.05, 0.10),
        ...                            progress=False)
        >>> dm = OutOfCoreLinkData(root, batch_size=128, num_neighbors=[5, 5], neg_sampling="binary",
        ...                        features=Tiered(gpu_cache="1MiB", host_cache="16KiB", staging="256KiB"),
        ...                        progress=False)
        >>> dm.setup()
        >>> batch = next(iter(dm.train_dataloader()))
        >>> batch.edge_label_index.shape, int(batch.edge_label.sum()), batch.x.shape[0] == batch.n_id.numel()
        (torch.Size([2, 256]), 128, True)
        >>> bool((batch.x == dm.dataset.read_features(batch.n_id)).all())
        True
        >>> dm.teardown()
    """

    task = "link"
    config_type = LinkDataConfig

    def __init__(self, root: str | os.PathLike, batch_size: int = NodeDataConfig.batch_size,
                 num_neighbors: Sequence[int] = DEFAULT_FANOUT, neg_sampling: Any = None,
                 exclude_seed_edges: bool = False, node_labels: bool = False, **kwargs: Any):  # fmt: skip
        super().__init__(root, batch_size=batch_size, num_neighbors=num_neighbors, neg_sampling=neg_sampling,
                         exclude_seed_edges=exclude_seed_edges, node_labels=node_labels, **kwargs)  # fmt: skip

    def setup(self, stage: str | None = None) -> None:
        if stage == "fit":  # before anything is set up: fit needs training edges, evaluation does not
            meta = self.dataset.meta if self.dataset is not None else self._meta()
            training_edges_or_fail(self.root, meta.get("link_splits"))
        super().setup(stage)


_warned: set[str] = set()


def _warn_once(name: str, message: str) -> None:
    if name not in _warned:
        _warned.add(name)
        log.warning(message)


def OutOfCoreHeteroNodeData(root: str | os.PathLike, batch_size: int = 1024,
                            num_neighbors: Sequence[int] | dict[Any, Sequence[int]] = (15, 10, 5),
                            input_type: str | None = None,
                            eval_num_neighbors: Sequence[int] | dict[Any, Sequence[int]] | None = None,
                            **kwargs: Any) -> OutOfCoreNodeData:  # fmt: skip
    """``OutOfCoreNodeData(root, ...)`` under its earlier name, with its earlier positional order and defaults
    (warns once): one datamodule classifies the nodes of homogeneous and heterogeneous datasets alike, the dataset
    says which."""
    _warn_once("OutOfCoreHeteroNodeData", "OutOfCoreHeteroNodeData(root, ...) is spelled OutOfCoreNodeData(root, ...) "
               "now: the dataset says whether it is heterogeneous")  # fmt: skip
    return OutOfCoreNodeData(root, batch_size=batch_size, num_neighbors=num_neighbors, input_type=input_type,
                             eval_num_neighbors=eval_num_neighbors, **kwargs)  # fmt: skip


def PackedNodeData(root: str | os.PathLike, pack_dir: str | os.PathLike | None = None, pack_space: float = 3.0,
                   pack_memory: int | str = "256MiB", first_epoch: str = "pack", **kwargs: Any) -> OutOfCoreNodeData:
    """``OutOfCoreNodeData(root, features=Packed(pack_dir=..., ...), ...)`` under its earlier name (warns once); the
    tiers' settings it took (``host_cache=``, ...) go to the backend."""
    _warn_once("PackedNodeData", "PackedNodeData(root, pack_memory=...) is spelled OutOfCoreNodeData(root, "
               "features=Packed(pack_memory=...)) now")  # fmt: skip
    tiered = {k: kwargs.pop(k) for k in list(kwargs) if k in inspect.signature(Tiered).parameters}
    packed = Packed(pack_dir=pack_dir, pack_space=pack_space, pack_memory=pack_memory, first_epoch=first_epoch,
                    **tiered)  # fmt: skip
    return OutOfCoreNodeData(root, features=packed, **kwargs)


def datamodule_for(task: str) -> type[GraphData]:
    """The datamodule that runs a task of the grid (:data:`~lightning_ooc.loader.registry.TASKS`: both cases of
    node classification are :class:`OutOfCoreNodeData`'s).

    >>> datamodule_for("link").__name__, datamodule_for("hetero").__name__
    ('OutOfCoreLinkData', 'OutOfCoreNodeData')
    """
    name = registry.TASKS[task].datamodule if task in registry.TASKS else task
    for cls in _subclasses(GraphData):
        if cls.task == name:
            return cls
    raise InputError(f"no datamodule runs the task {task!r}; tasks: {', '.join(registry.TASKS)}")


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def plain_hparams(hparams: dict[str, Any]) -> None:
    """The datamodule's hyperparameters as plain values, in place: checkpoints load them with ``weights_only``,
    and a checkpoint's datamodule is built from them again (paths as strings, the settings groups as dicts,
    negative sampling as a dict, a heterogeneous fanout keyed by ``"src__rel__dst"``)."""
    for key, value in hparams.items():
        if isinstance(value, os.PathLike):
            hparams[key] = os.fspath(value)
        elif key in ("pipeline", "predict"):
            hparams[key] = None if value is None else plain(group(key, value))  # checked, paths as strings
        elif key == "features" and not isinstance(value, str):
            hparams[key] = as_backend(value).plain()
        elif key == "neg_sampling":
            hparams[key] = LinkDataConfig.plain_negatives(value)
        elif key in ("num_neighbors", "eval_num_neighbors") and isinstance(value, dict):
            hparams[key] = NodeDataConfig._fanout(key, value)


def _all_gather_object(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (a collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
