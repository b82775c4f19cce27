"""``OutOfCoreNodeData``: the LightningDataModule that feeds minibatches from SSD.

It owns, per process: the dataset (topology memory-mapped), the native
neighbour sampler, the tiered feature store (feature buffer, host cache,
staging buffer, direct-I/O reader) and one asynchronous pipeline per pass
(:mod:`lightning_ooc.loader.pipeline`).
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Sequence

import lightning as L
import torch

import lightning_ooc.strategy  # noqa: F401  (registers strategy="ooc")
from lightning_ooc.data.dataset import OnDiskDataset, open_dataset, read_meta
from lightning_ooc.loader.pipeline import ORDERS, EpochRun, EpochStats
from lightning_ooc.store.buffer import FeatureBuffer
from lightning_ooc.store.host_cache import HostCache, choose_hot
from lightning_ooc.store.plan import StorePlan
from lightning_ooc.store.staging import StagingBuffer
from lightning_ooc.store.tiered import TieredFeatureStore

log = logging.getLogger("lightning_ooc")


class _Pass:
    """The iterable Lightning gets as a dataloader: each ``iter()`` starts a new pipeline run."""

    def __init__(self, dm: "OutOfCoreNodeData", split: str):
        self.dm = dm
        self.split = split
        self.run: EpochRun | None = None

    def __len__(self) -> int:
        return self.dm._num_batches(self.split)

    def __iter__(self) -> EpochRun:
        if self.run is not None:
            self.run.close()
        self.run = self.dm._start(self.split)
        return self.run

    def close(self) -> None:
        if self.run is not None:
            self.run.close()  # kept: its stats stay readable


class OutOfCoreNodeData(L.LightningDataModule):
    """Node-classification minibatches for graphs whose features live on SSD.

    Args:
        root: a dataset directory (``lightning-ooc synth`` / ``prepare``), as a string or path.
        batch_size: seed nodes per training minibatch.
        num_neighbors: fanout per hop (``-1``: all neighbours).
        replace: sample neighbours with replacement.
        gpu_cache: budget of the feature buffer (device memory; host memory on CPU), e.g. ``"4GiB"``.
        host_cache: budget of the host cache of hot rows (pinned; zero-copy on GPU).
        staging: budget of the staging buffer that direct-I/O reads land in.
        order: ``"out_of_order"`` (train batches as they complete) or ``"in_order"``
            (sampling order; reproducible for a given seed).
        num_samplers, num_extractors, extract_queue_size, train_queue_size: pipeline shape
            (GNNDrive's defaults: 4, 4, 6, 4).
        host_cache_policy: ``"presample"`` (access frequency over ``presample_batches``
            sampled minibatches) or ``"degree"``.
        io_backend, queue_depth: feature reader settings (see :class:`~lightning_ooc.io.FeatureReader`).
        eval_batch_size, eval_num_neighbors: for validation/test/predict (default: the training ones).
        shuffle, drop_last, seed: seed order per epoch, and the base seed of all sampling.
        progress: progress bars for setup steps.

    Example::

        >>> import tempfile, lightning as L
        >>> from lightning_ooc import OutOfCoreNodeData
        >>> from lightning_ooc.data.synth import synthesize
        >>> from lightning_ooc.models import GraphSAGE
        >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=3000, avg_degree=6, num_features=16,
        ...                   num_classes=4, train_frac=0.2, progress=False)
        >>> dm = OutOfCoreNodeData(root, batch_size=100, num_neighbors=[5, 5], gpu_cache="8MiB",
        ...                        host_cache="64KiB", staging="1MiB", progress=False)
        >>> trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(GraphSAGE(16, 4, hidden_channels=32, num_layers=2), datamodule=dm)
        >>> dm.last_stats["train"].seeds == len(dm.dataset.split("train"))
        True
    """

    def __init__(
        self,
        root: str | os.PathLike,
        batch_size: int = 1000,
        num_neighbors: Sequence[int] = (10, 10, 10),
        replace: bool = False,
        gpu_cache: int | str = "1GiB",
        host_cache: int | str = "1GiB",
        staging: int | str = "256MiB",
        order: str = "out_of_order",
        num_samplers: int = 4,
        num_extractors: int = 4,
        extract_queue_size: int = 6,
        train_queue_size: int = 4,
        host_cache_policy: str = "presample",
        presample_batches: int = 32,
        io_backend: str = "auto",
        queue_depth: int = 128,
        eval_batch_size: int | None = None,
        eval_num_neighbors: Sequence[int] | None = None,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        progress: bool = True,
    ):
        super().__init__()
        root = str(root)  # hyperparameters go into checkpoints: plain types only
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.save_hyperparameters()
        self.root = root
        self.batch_size = int(batch_size)
        self.num_neighbors = list(num_neighbors)
        self.eval_batch_size = int(eval_batch_size or batch_size)
        self.eval_num_neighbors = list(eval_num_neighbors or num_neighbors)
        self.order = order
        self.dataset: OnDiskDataset | None = None
        self.store: TieredFeatureStore | None = None
        self.plan: StorePlan | None = None
        self.last_stats: dict[str, EpochStats] = {}
        self._passes: dict[str, _Pass] = {}
        self._trained: set[int] = set()
        self._trained_epoch = -1
        self._resume: dict[str, Any] | None = None
        self._epoch = 0
        self._context: tuple | None = None  # (rank, world, device, shared) inside a gather producer process
        self._producer = None

    # -- set-up -----------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        if self._context is not None:
            return self._context[2]
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.strategy.root_device
        return torch.device("cpu")

    def _rank(self) -> tuple[int, int]:
        if self._context is not None:
            return self._context[0], self._context[1]
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        return 0, 1

    def _shared(self, what: str):
        """The strategy's node-local shared memory, when it has one and sharing ``what`` is on."""
        if self._context is not None:  # a gather producer maps its rank's topology; its staging is its own
            return self._context[3] if what == "topology" else None
        trainer = getattr(self, "trainer", None)
        strategy = getattr(trainer, "strategy", None)
        if getattr(strategy, "shared", None) is None or not getattr(strategy, f"share_{what}", False):
            return None
        return strategy.shared

    def _sampling_seed(self) -> int:
        """The base seed of this rank's neighbour sampling (ranks draw independent streams)."""
        return self.hparams.seed + 1_000_033 * self._rank()[0]

    @property
    def num_features(self) -> int:
        """Feature dimension of the dataset (read from ``meta.json``; for ``in_channels`` of a model)."""
        return self.dataset.num_features if self.dataset is not None else int(read_meta(self.root)["num_features"])

    @property
    def num_classes(self) -> int:
        """Number of classes of the dataset (read from ``meta.json``)."""
        return self.dataset.num_classes if self.dataset is not None else int(read_meta(self.root)["num_classes"])

    def setup(self, stage: str | None = None) -> None:
        if self.store is not None or self._producer is not None:
            return
        strategy = getattr(getattr(self, "trainer", None), "strategy", None)
        if self._context is None and getattr(strategy, "gather_in_producer", False):
            self._start_producer(strategy)
            return
        from lightning_ooc.io import FeatureReader
        from lightning_ooc.sampling import NeighborSampler

        ds = self.dataset = open_dataset(self.root, share=self._shared("topology"))
        hp = self.hparams
        self.sampler = NeighborSampler(ds, self.num_neighbors, replace=hp.replace)
        self.eval_sampler = (
            self.sampler if self.eval_num_neighbors == self.num_neighbors
            else NeighborSampler(ds, self.eval_num_neighbors, replace=hp.replace)
        )  # fmt: skip
        device = self._device()
        reader = FeatureReader.from_dataset(ds, backend=hp.io_backend, queue_depth=hp.queue_depth,
                                            workers=max(1, hp.num_extractors))  # fmt: skip
        try:
            self._build_store(ds, reader, device)
        except BaseException:
            reader.close()
            raise

    def _start_producer(self, strategy) -> None:
        """Open the dataset here (for batch counts) and run the store and pipeline in a producer process."""
        from lightning_ooc.strategy.producer import GatherProducer

        self.dataset = open_dataset(self.root, share=self._shared("topology"))
        shared = strategy.shared
        rank, world = self._rank()
        self._producer = GatherProducer(
            dict(self.hparams), rank=rank, world=world, device=self._device(), env=strategy.producer_env(),
            handles=shared.handles() if shared is not None and strategy.share_topology else {},
            local=(shared.local_rank, shared.local_world) if shared is not None else (0, 1),
            queue_size=self.hparams.train_queue_size,
        )  # fmt: skip

    def _presample(self, n: int) -> list[torch.Tensor]:
        """``n`` training minibatches' node ids, from the epoch-0 seed order of this process."""
        batches = self._batches("train", epoch=0)
        out = []
        for k in range(min(n, len(batches))):
            out.append(self.sampler.sample_subgraph(batches[k], seed=self._sampling_seed() * 7919 + k).n_id)
        return out

    def _build_store(self, ds: OnDiskDataset, reader, device: torch.device) -> None:
        hp = self.hparams
        presampled = self._presample(max(1, hp.presample_batches))
        seen = max((int(b.numel()) for b in presampled), default=1)
        bound = self.batch_size
        reach = self.batch_size
        for f in self.num_neighbors:
            reach = reach * (f if f >= 0 else ds.num_nodes)
            bound += reach
        max_nodes = int(min(ds.num_nodes, bound, math.ceil(seen * 1.25) + 64))
        plan = StorePlan.from_budgets(
            num_nodes=ds.num_nodes, row_bytes=ds.row_bytes, gpu_cache=hp.gpu_cache, host_cache=hp.host_cache,
            staging=hp.staging, max_nodes_per_batch=max_nodes, num_extractors=hp.num_extractors,
            train_queue_size=hp.train_queue_size, device=str(device), order=self.order,
        )  # fmt: skip
        hot = choose_hot(plan.host_rows, ds.num_nodes, policy=hp.host_cache_policy, in_degree=ds.in_degree,
                         presample=lambda: presampled)  # fmt: skip
        plan.host_policy, plan.presample_batches = hot.policy, len(presampled)
        plan.backend, plan.backend_reason = reader.backend, reader.backend_reason
        if hot.counts is not None:
            plan.expected_host_hit = hot.expected_hit_rate
        buffer = FeatureBuffer(plan.buffer_slots, ds.num_nodes, ds.num_features, ds.feature_dtype, device,
                               reserve=plan.buffer_reserve)  # fmt: skip
        plan.expected_buffer_hit = _simulate_buffer(plan.buffer_slots, ds.num_nodes, presampled, hot.ids)
        staging = StagingBuffer(plan.staging_bytes, ds.num_features, ds.feature_dtype, chunk_rows=plan.staging_chunk_rows,
                                pin=device.type == "cuda", memory=self._staging_memory(plan, ds))  # fmt: skip
        host = None
        if plan.host_rows:
            host = HostCache.load(reader, hot.ids, ds.num_nodes, register=device.type == "cuda",
                                  progress=hp.progress and self._rank()[0] == 0)  # fmt: skip
        self.store = TieredFeatureStore(reader, buffer, staging, host)
        self.plan = plan
        rank, world = self._rank()
        if rank == 0:
            extra = [
                f"  pipeline        {hp.num_samplers} samplers, {hp.num_extractors} extractors, queues "
                f"{hp.extract_queue_size}/{hp.train_queue_size}, {self.order}",
                f"  minibatches     {self._num_batches('train')} x {self.batch_size} seeds per epoch"
                + (f" per process ({world} processes)" if world > 1 else "")
                + f", fanout {self.num_neighbors}, up to ~{max_nodes:,} nodes each (presample max {seen:,})",
            ]
            msg = plan.format(extra=extra)
            log.info("%s", msg)

    def _staging_memory(self, plan: StorePlan, ds: OnDiskDataset):
        """This rank's portion of the machine's shared staging segment (``None``: private memory)."""
        shared = self._shared("staging")
        if shared is None:
            return None
        size = StagingBuffer.layout(plan.staging_bytes, ds.num_features, ds.feature_dtype, plan.staging_chunk_rows)[3]
        mm = shared.buffer("staging", size * shared.local_world)
        lo = shared.local_rank * size
        return memoryview(mm)[lo : lo + size]

    # -- epochs -------------------------------------------------------------------------------------
    def _seeds(self, split: str) -> torch.Tensor:
        assert self.dataset is not None
        return self.dataset.split("train" if split == "train" else split)

    def _batches(self, split: str, epoch: int) -> list[torch.Tensor]:
        seeds = self._seeds(split)
        hp = self.hparams
        bs = self.batch_size if split == "train" else self.eval_batch_size
        if split == "train" and hp.shuffle:
            g = torch.Generator().manual_seed(hp.seed * 1_000_003 + epoch)
            seeds = seeds[torch.randperm(seeds.numel(), generator=g)]
        rank, world = self._rank()
        if world > 1:
            return rank_batches(seeds, rank, world, bs, drop_last=hp.drop_last and split == "train")
        n = seeds.numel()
        if split == "train" and hp.drop_last:
            n = n // bs * bs
        return [seeds[s : min(s + bs, n)] for s in range(0, n, bs)]

    def _num_batches(self, split: str) -> int:
        return len(self._batches(split, 0))

    def _start(self, split: str):
        if self.store is None and self._producer is None:
            self.setup()
        trainer = getattr(self, "trainer", None)
        if split == "train":
            epoch = trainer.current_epoch if trainer is not None else self._epoch
        else:
            epoch = 0  # evaluation samples the same neighbourhoods every time
        skip: frozenset[int] = frozenset()
        if split == "train":
            # Kept for the whole resumed epoch: Lightning may start the loader more than once.
            if self._resume is not None and self._resume.get("epoch") == epoch:
                done = frozenset(self._resume.get("trained", []))
                if len(done) >= self._num_batches("train"):
                    # The checkpoint closed that epoch; Lightning still reports its number for the
                    # first pass after the restart, which is really the next epoch.
                    epoch += 1
                else:
                    skip = done
                    self._trained = set(skip)
            else:
                self._resume = None
                self._trained = set()
            self._trained_epoch = epoch
            self._epoch = epoch + 1
        if self._producer is not None:
            n = self._num_batches(split) - len(skip)
            return self._producer.run(split, epoch, skip, n, on_end=lambda stats: self._epoch_end(split, stats))
        return self._make_run(split, epoch, skip)

    def _make_run(self, split: str, epoch: int, skip: frozenset[int]) -> EpochRun:
        hp = self.hparams
        trainer = getattr(self, "trainer", None)
        sampler = self.sampler if split == "train" else self.eval_sampler
        use_buffer = split == "train"

        def sample(seeds: torch.Tensor, seed: int, k: int):
            return sampler.sample(seeds, seed=seed)

        store = self.store
        assert store is not None
        if not use_buffer:
            store = _DirectStore(store)

        def on_batch(k: int) -> None:
            if split == "train" and trainer is None:
                self._trained.add(k)

        run = EpochRun(
            self._batches(split, epoch), sample, store, epoch=epoch, seed=self._sampling_seed(),
            num_samplers=hp.num_samplers, num_extractors=hp.num_extractors,
            extract_queue_size=hp.extract_queue_size, train_queue_size=hp.train_queue_size,
            order=self.order if split == "train" else "out_of_order", device=self._device(), skip=skip,
            on_batch=on_batch, on_end=lambda stats: self._epoch_end(split, stats), name=split,
        )  # fmt: skip
        return run

    def _epoch_end(self, split: str, stats: EpochStats) -> None:
        self.last_stats[split] = stats
        trainer = getattr(self, "trainer", None)
        if trainer is None or self.dataset is None:
            return
        metrics = {f"ooc/{split}_{k}": v for k, v in stats.as_metrics(self.dataset.row_bytes).items()}
        metrics = self._mean_over_ranks(metrics)
        if trainer.logger is not None and not trainer.sanity_checking:
            trainer.logger.log_metrics(metrics, step=trainer.global_step)

    def _mean_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric averaged over the ranks (a collective; every rank ends its pass at the same batch count)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or trainer.world_size == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        t = trainer.strategy.reduce(t, reduce_op="mean")
        return {k: float(v) for k, v in zip(keys, t.tolist())}

    def _loader(self, split: str) -> _Pass:
        if split not in self._passes:
            self._passes[split] = _Pass(self, split)
        return self._passes[split]

    def train_dataloader(self) -> _Pass:
        return self._loader("train")

    def val_dataloader(self) -> _Pass:
        return self._loader("val")

    def test_dataloader(self) -> _Pass:
        return self._loader("test")

    def predict_dataloader(self) -> _Pass:
        return self._loader("test")

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Called right before the training step that uses ``batch`` (after Lightning's prefetch),
        # so the batches recorded here are the ones a checkpoint taken after this step covers.
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training and hasattr(batch, "batch_index"):
            self._trained.add(int(batch.batch_index))
        return batch

    # -- checkpointing ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The current training epoch and the batches of it already trained (for mid-epoch resume).

        With several processes every rank's own list is kept (out of order, ranks finish different
        batches first); Lightning builds checkpoints on every rank, so the lists are gathered here.
        """
        trained = sorted(self._trained)
        state = {"epoch": self._trained_epoch, "trained": trained, "seed": self.hparams.seed, "world_size": 1}
        world = self._rank()[1]
        gather = getattr(self.trainer.strategy, "all_gather_object", None) if world > 1 else None
        if gather is not None:
            state["trained_by_rank"] = gather(trained)
            state["world_size"] = world
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.hparams.seed) != self.hparams.seed:
            log.warning("resuming with seed %s but the checkpoint used %s: the epoch's batches differ",
                        self.hparams.seed, state.get("seed"))  # fmt: skip
        state = dict(state)
        rank, world = self._rank()
        if int(state.get("world_size", 1)) != world:
            log.warning("the checkpoint was taken with %s processes and this run has %s: its epoch %s restarts "
                        "from its first batch", state.get("world_size", 1), world, state.get("epoch"))  # fmt: skip
            state["trained"] = []
        elif "trained_by_rank" in state:
            state["trained"] = state["trained_by_rank"][rank]
        self._resume = state

    def on_exception(self, exception: BaseException) -> None:
        # stop the pipeline threads now, so an interrupted or failing run exits promptly
        for p in self._passes.values():
            p.close()

    def teardown(self, stage: str | None = None) -> None:
        for p in self._passes.values():
            p.close()
        if self._producer is not None and stage in (None, "fit", "test", "predict", "validate"):
            self._producer.close()
            self._producer = None
        if stage in (None, "fit", "test", "predict", "validate") and self.store is not None:
            self.store.close()
            self.store = None


class _DirectStore:
    """The store seen by evaluation passes: reads past the feature buffer (holds no slot)."""

    def __init__(self, store: TieredFeatureStore):
        self._store = store
        self.buffer = store.buffer

    def extract(self, n_id, timeout=None):
        return self._store.extract(n_id, timeout=timeout, use_buffer=False)

    def gather(self, ext, device=None):
        return self._store.gather(ext, device)

    def release(self, ext) -> None:
        self._store.release(ext)


def rank_batches(seeds: torch.Tensor, rank: int, world: int, batch_size: int, drop_last: bool = False) -> list[torch.Tensor]:
    """This rank's minibatches: a disjoint share of ``seeds``, and the same number of batches on every rank.

    The shares are contiguous and differ in size by at most one seed; together they
    cover ``seeds`` (``drop_last``: all but fewer than ``world * batch_size`` of them).
    When shares would need different batch counts, every rank cuts its share into the
    larger count of near-equal batches, so collectives never wait for a missing batch.

    Example::

        >>> import torch
        >>> [[b.tolist() for b in rank_batches(torch.arange(7), r, 2, 3)] for r in range(2)]
        [[[0, 1], [2, 3]], [[4, 5], [6]]]
        >>> [[b.numel() for b in rank_batches(torch.arange(2001), r, 2, 1000)] for r in range(2)]
        [[501, 500], [500, 500]]
    """
    n = seeds.numel()
    if drop_last:
        per = n // world // batch_size * batch_size
        part = seeds[rank * per : (rank + 1) * per]
        return [part[s : s + batch_size] for s in range(0, per, batch_size)]
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    part = seeds[lo : lo + base + (rank < extra)]
    count = -(-(base + (extra > 0)) // batch_size)  # batches of the largest share
    if count == 0:
        return []
    if part.numel() < count:
        raise ValueError(f"{n} seeds cannot give {world} processes {count} non-empty batches each; "
                         f"use a larger batch_size or fewer processes")  # fmt: skip
    if extra == 0 or -(-base // batch_size) == count:  # every share needs the same count: full batches
        return [part[s : s + batch_size] for s in range(0, part.numel(), batch_size)]
    return list(torch.tensor_split(part, count))


def _simulate_buffer(slots: int, num_nodes: int, batches: list[torch.Tensor], host_ids: torch.Tensor) -> float | None:
    """Hit rate an LRU buffer of ``slots`` rows would have over the presampled batches (host rows excluded)."""
    if not batches:
        return None
    in_host = torch.zeros(num_nodes, dtype=torch.bool)
    in_host[host_ids] = True
    sim = FeatureBuffer(slots, num_nodes, 1, torch.uint8, "cpu")
    hits = total = 0
    for n_id in batches:
        rest = n_id[~in_host[n_id]]
        if rest.numel() > slots:
            return None
        a = sim.acquire(rest)
        hits += int(a.hit.sum())
        total += rest.numel()
        sim.mark_valid(a.slots)
        sim.release(a.slots)
    return hits / total if total else 0.0
