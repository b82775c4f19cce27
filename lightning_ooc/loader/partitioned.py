"""``PartitionedPasses``: the passes of one machine of a partitioned dataset (``lightning-ooc partition``).

Every machine holds one partition directory: the whole topology, and the
feature rows of the nodes it owns. Its processes train on the training seeds
it owns; a minibatch's rows come from three places:

* its own rows, through its ordinary chain (host cache, feature buffer, SSD)
  over the partition's rows (:class:`~lightning_ooc.partitioned.remote.LocalRows`);
* other machines' rows kept in the remote buffer (MassiveGNN's prefetch
  buffer, ``remote_cache_policy``), and
* the rest from their owners, over the row exchange
  (:class:`~lightning_ooc.partitioned.exchange.RowExchange`), a gloo process group of
  its own between the processes of the same local rank on every machine.
  Owners serve requests through their chain without the feature buffer (host
  cache, then SSD), which holds no slot a training batch waits for.

Training batches per epoch are the same number on every process (the largest
any needs; the others cut their seeds into that many smaller batches), so no
collective waits for a batch that never comes. Evaluation splits are gathered
from every machine and shared out evenly, whoever owns the seeds.

Launch one process per GPU on every machine, each machine with its partition
(see the README, "Several machines"):
``torchrun --nnodes P --node-rank K --nproc-per-node G ... lightning-ooc fit --trainer.num_nodes P ...``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from lightning_ooc.data.format import SPLITS
from lightning_ooc.errors import InputError
from lightning_ooc.loader.batches import BatchList, SeedBatches, rank_batches
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.loader.pipeline import EpochRun, EpochStats
from lightning_ooc.loader.source import LocalPasses
from lightning_ooc.loader.tasks import open_for
from lightning_ooc.store.protocol import HOMOGENEOUS
from lightning_ooc.store.factory import build_store
from lightning_ooc.store.planner import max_nodes_per_batch, plan_store
from lightning_ooc.store.tally import training_reserve
from lightning_ooc.store.tiered import TieredFeatureStore
from lightning_ooc.partitioned.exchange import RowExchange, destroy_group, exchange_group
from lightning_ooc.partitioned.remote import LocalRows, RemoteStats, RemoteTier
from lightning_ooc.store.policy import RowBuffer, make_policy
from lightning_ooc.utils.device import use_device

log = logging.getLogger("lightning_ooc")

PARTITION_FILE = "partition.json"


def part_dir_name(k: int) -> str:
    return f"part-{k:05d}"


def is_partitioned(root: str | Path) -> bool:
    """Whether ``root`` is a partitioned dataset: the output of ``lightning-ooc partition`` or one of its parts."""
    root = Path(root)
    if (root / PARTITION_FILE).is_file():
        return True
    if not (root / "meta.json").is_file():  # a machine's directory holding its part (and maybe no other)
        return any((p / "meta.json").is_file() for p in root.glob("part-[0-9]*"))
    try:
        return "partition" in json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):
        return False


def part_root(root: str | Path, machine: int) -> Path:
    """The partition directory of ``machine`` under ``root`` (``root`` itself when it is a part directory)."""
    root = Path(root)
    if (root / "meta.json").is_file():
        return root
    part = root / part_dir_name(machine)
    if not (part / "meta.json").is_file():
        present = sorted(p.name for p in root.glob("part-*") if (p / "meta.json").is_file())
        raise InputError(
            f"{root}: machine {machine} needs its partition {part.name} there (found: {', '.join(present) or 'none'}); "
            f"copy {part.name} of the `lightning-ooc partition` output to this machine, or launch machine {machine} "
            "where it is"
        )  # fmt: skip
    return part


def partition_meta(root: str | Path) -> dict[str, Any]:
    """``meta.json`` of a partition found under ``root`` (every part has the same node and feature counts)."""
    root = Path(root)
    if (root / "meta.json").is_file():
        return json.loads((root / "meta.json").read_text())
    for p in sorted(root.glob("part-*")):
        if (p / "meta.json").is_file():
            return json.loads((p / "meta.json").read_text())
    raise InputError(f"{root}: no partition directory (part-NNNNN) here; see `lightning-ooc partition`")


class PartitionSeedBatches(SeedBatches):
    """Training seeds of this machine shared by its processes; evaluation seeds of every machine shared by all.

    ``counts``: batches per epoch of each split, the same on every process of the run.
    """

    def __init__(self, seeds: Callable[[str], torch.Tensor], eval_seeds: dict[str, torch.Tensor],
                 counts: dict[str, int], *, local_rank: int, local_world: int, rank: int, world: int,
                 **kwargs: Any):  # fmt: skip
        super().__init__(seeds, rank=rank, world=world, **kwargs)
        self.local_rank, self.local_world = int(local_rank), int(local_world)
        self._eval = eval_seeds
        self._counts = dict(counts)

    def size(self, split: str) -> int:
        return super().size(split) if split == "train" else int(self._eval[split].numel())

    def seeds(self, split: str) -> torch.Tensor:
        return super().seeds(split) if split == "train" else self._eval[split]

    def count(self, split: str) -> int:
        return self._counts[split]

    def epoch(self, split: str, epoch: int) -> BatchList:
        if split != "train":
            return rank_batches(self._eval[split], self.rank, self.world, self.eval_batch_size)
        seeds = self._seeds("train")
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            seeds = seeds[torch.randperm(seeds.numel(), generator=g)]
        share = local_share(seeds, self.local_rank, self.local_world)
        return cut(share, self._counts["train"], self.batch_size, self.drop_last)


def local_share(seeds: torch.Tensor, local_rank: int, local_world: int) -> torch.Tensor:
    """This process's contiguous share of its machine's seeds (shares differ by at most one)."""
    base, extra = divmod(seeds.numel(), local_world)
    lo = local_rank * base + min(local_rank, extra)
    return seeds[lo : lo + base + (local_rank < extra)]


def share_batches(n: int, batch_size: int, drop_last: bool) -> int:
    return n // batch_size if drop_last else -(-n // batch_size)


def cut(seeds: torch.Tensor, count: int, batch_size: int, drop_last: bool) -> BatchList:
    """``seeds`` in exactly ``count`` batches: full ones when they fill them, else near-equal ones."""
    n = seeds.numel()
    if count == 0:
        return BatchList.even(seeds[:0], batch_size)
    if drop_last:
        return BatchList.even(seeds[: count * batch_size], batch_size)
    if n < count:
        raise InputError(
            f"this process has {n} training seeds for the {count} batches every process trains per epoch; the "
            "partitions are too unbalanced in training seeds for this batch size: partition again (the default "
            "methods balance training seeds) or use a larger batch_size"
        )  # fmt: skip
    if share_batches(n, batch_size, False) == count:
        return BatchList.even(seeds, batch_size)
    small, larger = divmod(n, count)
    sizes = np.full(count, small, dtype=np.int64)
    sizes[:larger] += 1
    return BatchList(seeds, np.concatenate([[0], np.cumsum(sizes)]))


def agreed_batches(shares: list[int], batch_size: int, drop_last: bool) -> int:
    """Training batches per epoch, the same on every process, from every process's count of seeds: as many as the
    process with the most seeds needs (the others cut theirs into smaller batches), or with ``drop_last`` as many
    full batches as the process with the fewest has. Where that trains nothing, or some process cannot fill them,
    an :class:`InputError` on every process (they all decide on the same figures).

    >>> agreed_batches([120, 95], 50, drop_last=False), agreed_batches([120, 95], 50, drop_last=True)
    (3, 1)
    """
    per = [share_batches(k, batch_size, drop_last) for k in shares]
    count = min(per) if drop_last else max(per)
    if not drop_last and min(shares) < count:
        cut(torch.arange(min(shares)), count, batch_size, False)  # the error
    if drop_last and count == 0 and max(shares) > 0:
        raise InputError(f"drop_last=True and a process has {min(shares)} training seeds, fewer than one batch of "
                         f"{batch_size}: no process would train; use a smaller batch_size or drop_last=False")  # fmt: skip
    return count


def neighbour_counts(indices: np.ndarray, num_nodes: int, chunk: int = 1 << 24) -> np.ndarray:
    """How often each node is an in-neighbour in the CSC (its out-degree): how often sampling can reach it,
    the warm-start ranking of the remote buffer. In-degree is not it on a directed graph. One pass over
    ``indices`` (memory-mapped), a chunk at a time."""
    counts = np.zeros(num_nodes, dtype=np.int64)
    for lo in range(0, len(indices), chunk):
        counts += np.bincount(np.asarray(indices[lo : lo + chunk]), minlength=num_nodes)
    return counts


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class _TopologyLater:
    """Stands in for a machine's shared memory while a part is opened to be checked: the part's ``indptr`` is
    an empty array here (no collective, no read); the part is opened again with the real shared memory once
    every process could open its own (:class:`PartitionedPasses`)."""

    def __init__(self, shared: Any):
        self.local_rank, self.local_world = shared.local_rank, shared.local_world

    def array(self, key: str, shape: tuple[int, ...], dtype: Any, fill: Any = None, writeable: bool = False) -> Any:
        return np.empty(0, dtype=dtype)

    def buffer(self, key: str, nbytes: int, fill: Any = None) -> Any:  # pragma: no cover - not used by an open
        raise RuntimeError("a part being checked has no shared buffers")


def agree_on_layout(root: str | Path, ctx: ProcessContext) -> None:
    """Raise the same :class:`~lightning_ooc.errors.InputError` on every process of a run over several if some
    were given a partitioned dataset and others a whole one (a collective; every process calls it first).

    The two set up differently: a partitioned one through :class:`PartitionedPasses` and its collectives, a
    whole one without them. Mixed, each process would take the other's first collective for its own.
    """
    if ctx.world <= 1 or not (dist.is_available() and dist.is_initialized()):
        return
    everyone = _gather((is_partitioned(root), str(root)))
    parted = [(r, p) for r, (yes, p) in enumerate(everyone) if yes]
    whole = [(r, p) for r, (yes, p) in enumerate(everyone) if not yes]
    if parted and whole:
        (a, pa), (b, pb) = parted[0], whole[0]
        raise InputError(
            f"the processes of this run were given different kinds of dataset: process {a} a partitioned one ({pa}: "
            f"`lightning-ooc partition` parts), process {b} a whole one ({pb}); give every machine its part of the "
            "same partition output, or every machine a copy of the whole dataset"
        )  # fmt: skip


class PartitionedPasses(LocalPasses):
    """The passes of one process of one machine of a partitioned dataset (see the module docstring)."""

    #: the row exchange's class (``None``: :class:`~lightning_ooc.partitioned.exchange.RowExchange`); ``bench
    #: distributed --links`` puts a subclass here that models a slower network
    exchange_type: Any = None
    #: the chain of this machine's own rows (``store`` wraps it with the remote tier once the exchange runs)
    local_store: TieredFeatureStore | None = None

    def __init__(self, cfg: NodeDataConfig, ctx: ProcessContext):
        if not (dist.is_available() and dist.is_initialized()) and ctx.world > 1:
            raise InputError("a partitioned dataset needs torch.distributed initialised (a Trainer with several "
                             "processes does it)")  # fmt: skip
        local_world = ctx.local_world if ctx.world > 1 else 1
        if ctx.world % local_world:
            raise InputError(f"{ctx.world} processes are not a whole number of machines of {local_world} each")
        self.machine, self.machines = ctx.rank // local_world, ctx.world // local_world
        self.local_rank, self.local_world_size = ctx.rank % local_world, local_world
        self.exchange = None
        self.remote = None
        self._groups: list[Any] = []
        # Every process opens its partition, then all of them learn whether every other could: a machine that
        # cannot is an error on all of them now, not a wait for the default group's timeout at the next barrier.
        # The opening that may fail is one without collectives: with the machine's shared memory (the "ooc"
        # strategy), putting indptr there is one, which a process that failed before it would never join (the
        # others' would then pair with its gather below); so the part is opened with its indptr left out first,
        # and with the shared one once every process could.
        ds = error = None
        later = _TopologyLater(ctx.topology) if ctx.topology is not None else None
        try:
            ds, cfg = self._open_part(cfg, ctx if later is None else dataclasses.replace(ctx, topology=later))
        except Exception as e:  # noqa: BLE001 - raised below, after the others heard of it
            error = e
        self._agree_on_parts(ds, error, multi=ctx.world > 1)
        if later is not None:  # every process opened its part: each takes part in the shared indptr's creation
            ds = open_for(cfg, ctx)
        part = self.part = ds.partition
        self.owner = torch.from_numpy(np.asarray(part.owner).astype(np.int32, copy=False))
        try:
            # The exchange groups now, while every process arrives together (connecting a gloo group waits at
            # most the group's timeout; the set-up below may take one machine minutes longer than another).
            self._groups = self._exchange_groups(cfg.features.exchange_timeout)
            super().__init__(cfg, ctx, dataset=ds)
        except BaseException:
            self._drop_groups()
            raise
        try:
            self._start_exchange()
        except BaseException:
            self.abort()  # the others' next exchange fails now, instead of waiting for us
            self.close()
            raise

    def _open_part(self, cfg: NodeDataConfig, ctx: ProcessContext) -> tuple[Any, NodeDataConfig]:
        """This machine's partition, opened and checked against the run's shape."""
        root = part_root(cfg.root, self.machine)
        cfg = dataclasses.replace(cfg, root=str(root))
        ds = open_for(cfg, ctx)
        part = getattr(ds, "partition", None)
        if part is None:
            raise InputError(f"{root}: not a partition of a dataset (no `partition` in its meta.json)")
        if part.parts != self.machines or part.index != self.machine:
            raise InputError(
                f"{root} is partition {part.index} of {part.parts}, but this process is on machine {self.machine} "
                f"of {self.machines} ({ctx.world} processes, {self.local_world_size} per machine): launch "
                f"{part.parts} machines (torchrun --nnodes {part.parts}, Trainer(num_nodes={part.parts})), each "
                "with its own partition"
            )  # fmt: skip
        return ds, cfg

    def _agree_on_parts(self, ds: Any, error: BaseException | None, multi: bool) -> None:
        """Raise on every process if one could not open its part, or if the parts come from different
        ``partition`` runs (their owner maps differ: rows would be asked of the wrong machine)."""
        if not multi:
            if error is not None:
                raise error
            return
        mine = None
        if error is None:  # a digest of the owner map: one pass at set-up
            owner = np.ascontiguousarray(ds.partition.owner)
            mine = (xxhash.xxh3_64_hexdigest(owner.view(np.uint8)), str(ds.partition.root))
        everyone = _gather(("error", f"{type(error).__name__}: {error}") if error is not None else ("ok", mine))
        if error is not None:
            raise error
        failed = [(r, m) for r, (kind, m) in enumerate(everyone) if kind == "error"]
        if failed:
            r, msg = failed[0]
            raise InputError(f"process {r} (machine {r // self.local_world_size}) could not open its partition: "
                             f"{msg}")  # fmt: skip
        other = next(((r, m) for r, (_, m) in enumerate(everyone) if m[0] != mine[0]), None)
        if other is not None:
            raise InputError(
                f"{mine[1]} and {other[1][1]} (process {other[0]}) are parts of different `lightning-ooc partition` "
                "runs (their owner maps differ); give every machine its part of the same output"
            )  # fmt: skip

    def _drop_groups(self) -> None:
        """Let the exchange groups go (set-up failed before an exchange took them over)."""

        groups, self._groups = self._groups, []
        for g in groups:
            destroy_group(g)

    def _exchange_groups(self, timeout: float) -> list[Any]:
        """A gloo group per local rank, holding that local rank of every machine (none on one machine)."""

        if self.machines == 1:
            return []
        _gather(None)  # every process here before any connects
        lw = self.local_world_size
        return [exchange_group([j + m * lw for m in range(self.machines)], timeout) for j in range(lw)]

    # -- seeds ----------------------------------------------------------------------------------
    def _seed_batches(self, ds: Any) -> SeedBatches:
        cfg, ctx = self.cfg, self.ctx
        multi = ctx.world > 1 and dist.is_initialized()
        evals = {s: ds.split(s) for s in SPLITS if s != "train"}
        if multi:  # every machine's evaluation seeds, shared out evenly (whoever owns them)
            gathered = _gather({s: t.numpy() for s, t in evals.items()} if self.local_rank == 0 else None)
            evals = {s: torch.from_numpy(np.sort(np.concatenate([g[s] for g in gathered if g is not None])))
                     for s in evals}  # fmt: skip
        train = ds.split("train")
        n = local_share(train, self.local_rank, self.local_world_size).numel()
        shares = _gather(n) if multi else [n]  # every process decides on the same figures
        counts = {"train": agreed_batches(shares, cfg.batch_size, cfg.drop_last)}
        if cfg.drop_last and n - counts["train"] * cfg.batch_size >= cfg.batch_size:
            log.warning("drop_last=True: this process trains %d of its %d training seeds per epoch (%d batches of %d, "
                        "as many as the process with the fewest seeds, %d); drop_last=False trains every seed in "
                        "batches a little smaller", counts["train"] * cfg.batch_size, n, counts["train"],
                        cfg.batch_size, min(shares))  # fmt: skip
        for s, t in evals.items():
            counts[s] = SeedBatches({s: t}.__getitem__, batch_size=cfg.eval_size, eval_batch_size=cfg.eval_size,
                                    shuffle=False, rank=ctx.rank, world=ctx.world).count(s)  # fmt: skip
        return PartitionSeedBatches(ds.split, evals, counts, local_rank=self.local_rank,
                                    local_world=self.local_world_size, rank=ctx.rank, world=ctx.world,
                                    batch_size=cfg.batch_size, eval_batch_size=cfg.eval_size, shuffle=cfg.shuffle,
                                    drop_last=cfg.drop_last, seed=cfg.seed)  # fmt: skip

    # -- this machine's rows ---------------------------------------------------------------------
    def _open_reader(self, ds: Any) -> Any:
        return super()._open_reader(ds.rows)

    def _local_ids(self, n_id: torch.Tensor) -> torch.Tensor:
        local = torch.from_numpy(np.asarray(self.part.local(n_id.numpy()), dtype=np.int64))
        return local[local >= 0]

    def _build_store(self, reader: Any, presampled: list[torch.Tensor],
                     counted: Callable[[], Iterator[torch.Tensor]]) -> TieredFeatureStore:  # fmt: skip
        """Plan and build this machine's chain over its rows; the remote tier is added in front of it."""
        cfg, ctx, rows = self.cfg, self.ctx, self.dataset.rows
        reader = reader[HOMOGENEOUS]  # the one reader of this machine's rows (_open_reader)
        local = [self._local_ids(b) for b in presampled]

        def counted_local() -> Iterator[torch.Tensor]:
            for b in counted():
                yield self._local_ids(b)

        # what the plan cannot see (remote_memory): the remote buffer, its tables, its policy's scores and pool,
        # and the owner map; kept free beside the usual training reserve
        remote = self.remote_memory()
        max_nodes = max_nodes_per_batch(self.dataset.num_nodes, self._seeds_per_batch(), cfg.num_neighbors, presampled)
        self.plan, hot = plan_store(cfg, rows, reader, self.device, local, processes=ctx.local_world,
                                    topology_shared=ctx.topology is not None, counted=counted_local,
                                    seeds_per_batch=self._seeds_per_batch(), num_edges=self.dataset.num_edges,
                                    in_degree=rows.degree_view,
                                    memory_reserve=training_reserve(max_nodes) + remote)  # fmt: skip
        self.local_store = build_store(self.plan, hot, rows, reader, self.device,
                                       staging_memory=self._staging_memory(self.plan),
                                       progress=cfg.progress and ctx.rank == 0)  # fmt: skip
        return self.local_store  # wrapped by _start_exchange once the exchange runs

    def remote_memory(self) -> int:
        """Host bytes of what serves other machines' rows: the remote buffer, its tables and scores."""
        if self.machines == 1:
            return 0
        remote_nodes = self.dataset.num_nodes - self.part.num_rows
        rows = 0 if self.cfg.features.remote_cache_policy == "none" else min(
            self.cfg.features.remote_cache // max(1, self.dataset.row_bytes), remote_nodes)  # fmt: skip
        # candidate ids, the buffer's slot table, the policy's scores, its pool of replacements (and the misses
        # waiting to join it), the owner map
        per_node = 8 + 4 + 12 + 16 + 4
        return rows * (self.dataset.row_bytes + 8) + remote_nodes * per_node

    # -- other machines' rows ----------------------------------------------------------------------
    def _serve(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of nodes this machine owns, asked by another machine: through the chain without the buffer."""
        store = self._serve_store
        ext = store.extract(torch.from_numpy(self.part.checked_local(ids.numpy())))
        try:
            return store.gather(ext, "cpu")
        finally:
            store.release(ext)

    def _start_exchange(self) -> None:
        cfg, ctx, ds = self.cfg, self.ctx, self.dataset
        self._serve_store = self.local_store.without("buffer")
        if not self._groups:  # one machine: every row is here
            self.remote_warm_rows, self.remote_warm_seconds = 0, 0.0
            self.store = TieredFeatureStore([LocalRows(t, self.part.local) for t in self.local_store.tiers],
                                            ds.num_features, ds.feature_dtype, owned=[])  # fmt: skip
            self.eval_store = TieredFeatureStore([LocalRows(t, self.part.local) for t in self._serve_store.tiers],
                                                 ds.num_features, ds.feature_dtype, owned=[])  # fmt: skip
            return
        device = self.device
        # every process here before the exchange's first round: a machine whose set-up took longer than
        # exchange_timeout (a cold cache, a slower disk) is waited for under the default group's timeout
        _gather(None)
        exchange_type = self.exchange_type or RowExchange
        self.exchange = exchange_type(self._groups[self.local_rank], self.owner, self.machine, self._serve,
                                      ds.num_features, ds.feature_dtype, name=f"rank{ctx.rank}",
                                      thread_init=lambda: use_device(device))  # fmt: skip
        # the remote buffer: its policy chooses among every node of the other machines
        capacity = cfg.features.remote_cache // max(1, ds.row_bytes)
        candidates = np.flatnonzero(np.asarray(self.part.owner) != self.machine).astype(np.int64)
        capacity = int(min(capacity, candidates.size)) if cfg.features.remote_cache_policy != "none" else 0
        policy = buffer = None
        if capacity:
            degree = neighbour_counts(ds.indices, ds.num_nodes)[candidates]
            f = cfg.features
            policy = make_policy(f.remote_cache_policy, candidates, degree, capacity, gamma=f.cache_decay,
                                 interval=f.cache_interval)  # fmt: skip
            buffer = RowBuffer(capacity, ds.num_features, ds.feature_dtype, candidates=candidates)
        self.remote = RemoteTier(self.exchange, self.owner, self.machine, policy, buffer)
        t0 = time.perf_counter()
        self.remote_warm_rows = self.remote.warm_start()
        self.remote_warm_seconds = time.perf_counter() - t0
        local = self.local_store
        wrapped = [LocalRows(t, self.part.local) for t in local.tiers]
        self.store = TieredFeatureStore([self.remote, *wrapped], ds.num_features, ds.feature_dtype,
                                        owned=[])  # fmt: skip
        self.eval_store = TieredFeatureStore([self.remote.frozen(), *[LocalRows(t, self.part.local)
                                              for t in self._serve_store.tiers]],
                                             ds.num_features, ds.feature_dtype, owned=[])  # fmt: skip
        if ctx.rank == 0:
            log.info("%s", self.describe_remote(capacity))

    def describe_remote(self, capacity: int) -> str:
        cfg, part = self.cfg, self.part
        return (f"  partition       {part.index} of {part.parts} ({part.method}): {part.num_rows:,} of "
                f"{self.dataset.num_nodes:,} rows here; remote buffer {capacity:,} rows "
                f"({cfg.features.remote_cache_policy}, gamma {cfg.features.cache_decay}, interval "
                f"{cfg.features.cache_interval}), "
                f"{self.remote_warm_rows:,} fetched at start in {self.remote_warm_seconds:.2f} s")  # fmt: skip

    def describe(self, presampled: list[torch.Tensor]) -> str:
        return super().describe(presampled)

    # -- passes -------------------------------------------------------------------------------------
    def run(self, split: str, epoch: int, skip: frozenset[int] = frozenset(),
            on_end: Callable[[EpochStats], None] | None = None, on_batch: Callable[[int], None] | None = None,
            name: str | None = None) -> EpochRun:  # fmt: skip
        if self.exchange is None:  # one machine
            return super().run(split, epoch, skip, on_end=on_end, on_batch=on_batch, name=name)
        before = self.exchange.counters()
        policy = self.remote.policy
        rounds = policy.stats().get("rounds", 0) if policy is not None else 0

        def ended(stats: EpochStats) -> None:
            now = self.exchange.counters()
            io = stats.io.tiers.get(RemoteTier.name) or RemoteStats()
            stats.extra.update({
                "remote_rows": float(io.remote_rows),
                "remote_hit_rate": io.remote_hits / io.remote_rows if io.remote_rows else 0.0,
                "remote_fetched_rows": float(io.remote_fetched),
                "remote_replaced_rows": float(io.remote_replaced),
                "remote_wait_s": float(io.remote_wait_s),
                "exchange_bytes": float(now["bytes_sent"] + now["bytes_received"]
                                        - before["bytes_sent"] - before["bytes_received"]),
                "exchange_rounds": float(now["rounds"] - before["rounds"]),
                "eviction_rounds": float((policy.stats().get("rounds", 0) if policy is not None else 0) - rounds),
            })  # fmt: skip
            if on_end is not None:
                on_end(stats)

        return super().run(split, epoch, skip, on_end=ended, on_batch=on_batch, name=name)

    def close(self) -> None:
        """Close the runs, then leave the exchange once every machine is done with it, then the store."""
        try:
            for run in list(self._runs):
                try:
                    run.close()
                except Exception:  # noqa: BLE001
                    log.exception("closing a pass's run")
            if self.exchange is not None:
                self.exchange.close(self.cfg.features.exchange_timeout)
        finally:
            store = self.local_store
            if self.exchange is not None and not self.exchange.stopped:
                # still inside a collective with a machine that stopped answering: it may yet read the store
                log.warning("the row exchange thread is still waiting for another machine; its feature store is "
                            "left open")  # fmt: skip
            elif store is not None:
                store.close()

    def own_store(self) -> TieredFeatureStore:
        return self.local_store if self.local_store is not None else self.store

    #: an exchange left after an error cannot serve again: the source closes at once, a later set-up starts afresh
    close_after_error = "closing the partitioned pass source"

    def abort(self) -> None:
        """After an error: leave the exchange at once (the other machines' next exchange fails, not waits)."""
        if self.exchange is not None:
            self.exchange.abort()
