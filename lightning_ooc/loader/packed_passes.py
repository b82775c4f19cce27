"""``PackedPasses``: the packed backend (DiskGNN's offline sampling and packed minibatches).

The tiered backend (:class:`~lightning_ooc.loader.source.LocalPasses`) with one more tier and a sampler that
reads instead of sampling. The training batches of an epoch are sampled ahead, with the very seeds the
pipeline would use (batch ``k`` of epoch ``e``: :func:`~lightning_ooc.loader.pipeline.batch_seed`), and
written with each batch's cold rows (those the host cache does not hold) packed into a section of their own
(:mod:`lightning_ooc.store.pack_writing`: the feature file streamed once, sequential reads and large direct
writes). Training an epoch with a pack then reads each batch's record instead of sampling it, and its cold
rows with one sequential read per node type (:class:`~lightning_ooc.store.packed_batches.PackedChunkTier`, between
the host cache and the feature buffer); the host cache serves the rest as always. Nothing else changes:
batches, models and the pipeline are the tiered backend's, and evaluation passes read as there.

While epoch ``e`` trains, a thread (at a lower CPU priority) packs epoch ``e + 1``. The first epoch either
waits for its own pack (``first_epoch="pack"``, the default) or trains on direct reads while the next one
is packed (``"random"``). Packs live under ``pack_dir`` (default ``<dataset>.packed`` beside the dataset;
never inside it: :func:`~lightning_ooc.data.outputs.check_output`), one directory per rank and settings, and go
once trained; a run that stops cleanly removes its packs, one that is killed leaves only directories that a
later run either uses (a committed pack made for exactly its dataset, feature files, settings and host cache)
or removes: its own directory's partial packs, and the directories of its rank that were made for the same
dataset directory before its data changed (``synth --overwrite``, a feature file rewritten in place), as
each directory's ``owner.json`` records. Only files this package wrote are deleted.

``pack_memory`` is taken from the memory limit before the tiers are planned; where the tiers do not fit beside
it even at their smallest, it is lowered (halved, down to what packing an epoch needs) until they do, with a
warning, before the plan is refused.

Example::

    >>> import tempfile
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.loader.config import NodeDataConfig
    >>> from lightning_ooc.loader.context import ProcessContext
    >>> from lightning_ooc.loader.features import Packed
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=2000, avg_degree=5, num_features=8,
    ...                   num_classes=3, train_frac=0.2, progress=False)
    >>> # a toy graph: its sampled batches weigh more than its features, so the disk allowed is raised
    >>> cfg = NodeDataConfig(root, batch_size=100, num_neighbors=[4, 3], progress=False,
    ...                      features=Packed(pack_memory="16MiB", pack_space=100, gpu_cache="1MiB", host_cache="8KiB",
    ...                                      staging="256KiB"))
    >>> passes = PackedPasses(cfg, ProcessContext())
    >>> run = passes.run("train", epoch=0)
    >>> batches = list(run)
    >>> passes.last_pack["packed"] == len(batches), run.stats.extra["packed_sections"] > 0
    (True, True)
    >>> passes.close()
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import xxhash

from lightning_ooc._version import __version__
from lightning_ooc.data.commit import LockFile, marked_lock
from lightning_ooc.data.format import human_bytes
from lightning_ooc.data.in_place import recorded_path
from lightning_ooc.data.outputs import check_output
from lightning_ooc.errors import DatasetChangedError, InputError, LightningOOCError
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.loader.pipeline import EpochRun, EpochStats, batch_seed
from lightning_ooc.loader.features import PACK_MEMORY_LEAST, Packed
from lightning_ooc.loader.source import LocalPasses, sampling_seed
from lightning_ooc.store.limits import MemoryLimit, limit_for_plan
from lightning_ooc.store.planner import budget_setting
from lightning_ooc.store.typed_stores import HeteroFeatureStore
from lightning_ooc.io.bulk import BULK_BACKENDS
from lightning_ooc.store.packed_batches import (EpochPack, PackedChunkTier, SectionBuffers, epoch_dirname,
                                                file_fingerprint, ids_digest, remove_pack, remove_pack_files)  # fmt: skip
from lightning_ooc.store.pack_writing import EpochPackWriter, FeatureSource, PackReport
from lightning_ooc.store.protocol import HOMOGENEOUS, StoreProtocol
from lightning_ooc.utils.progress import progress_bar
from lightning_ooc.utils.shutdown import stop_at_exit

log = logging.getLogger("lightning_ooc")

#: the CPU priority (nice) of the thread that packs the next epoch beside training
PACKER_NICE = 10
_EPOCH_DIR = re.compile(r"^epoch-(\d{6})((?:\.removed)?\.partial)?$")
#: a rank's pack directory in ``pack_dir``: ``rank<R>-<key>``
_RANK_DIR = re.compile(r"^rank(\d+)-([0-9a-f]{16})$")
#: in each pack directory: the dataset directory its packs are for and the version of its data (a JSON object)
OWNER = "owner.json"
LOCK = "lock"


class PackingError(LightningOOCError, RuntimeError):
    """Packing an epoch's minibatches failed (the cause is chained); nothing of it is used."""


class Stopped(Exception):
    """Packing was stopped (the pass source closes)."""


@dataclass
class _Job:
    epoch: int
    thread: threading.Thread | None = None
    report: PackReport | None = None
    error: BaseException | None = None
    started: float | None = None  # time.perf_counter() at its start and end
    finished: float | None = None


def default_pack_dir(root: str | os.PathLike) -> Path:
    """``<dataset>.packed`` beside the dataset."""
    root = Path(root).absolute()
    return root.parent / f"{root.name}.packed"


def pack_memory_steps(asked: int, least: int) -> list[int]:
    """The ``pack_memory`` sizes a plan tries, in order: as asked, then halved (whole MiB) down to ``least``.

    >>> [m >> 20 for m in pack_memory_steps(256 << 20, 8 << 20)]
    [256, 128, 64, 32, 16, 8]
    >>> [m >> 20 for m in pack_memory_steps(100 << 20, 30 << 20)]
    [100, 50, 30]
    """
    least = min(int(least), int(asked))
    out, mem = [int(asked)], int(asked) // 2 >> 20 << 20
    while mem > least:
        out.append(mem)
        mem = mem // 2 >> 20 << 20
    if out[-1] != least:
        out.append(least)
    return out


def _read_owner(d: Path) -> dict[str, Any] | None:
    """The ``owner.json`` record of pack directory ``d`` (a regular file holding a JSON object), or None."""
    try:
        fd = os.open(d / OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        rec = json.loads(os.pread(fd, 1 << 16, 0))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
    return rec if isinstance(rec, dict) else None


class _Held(Exception):
    """Another process holds a pack directory's lock."""


class PackedPasses(LocalPasses):
    """The tiered backend with packed minibatches (see the module docstring).

    Its settings are the feature backend's (:class:`~lightning_ooc.loader.features.Packed`: ``pack_dir``,
    ``pack_space``, ``pack_memory``, ``first_epoch`` and the tiered ones); where the tiers cannot fit beside
    ``pack_memory`` even at their smallest it is lowered first (:attr:`pack_memory` is what the plan took).
    """

    def __init__(self, cfg: NodeDataConfig, ctx: ProcessContext, dataset: Any = None):
        if not isinstance(cfg.features, Packed):
            raise TypeError(f"PackedPasses runs features=Packed(...), got {cfg.features!r}")
        #: the packed backend's settings, checked (:class:`~lightning_ooc.loader.features.Packed`)
        self.options: Packed = cfg.features
        #: how pack files are read and written: direct I/O as the feature reads, which may be "mmap" (a
        #: baseline): pack files are always moved in large ranges
        self._backend = cfg.features.io_backend if cfg.features.io_backend in BULK_BACKENDS else "auto"
        # the packer splits hot from cold rows: the host cache is complete first
        cfg = cfg.with_settings(features={"host_cache_fill": "setup"})
        self._jobs: dict[int, _Job] = {}
        self._stop = threading.Event()
        self._lock: LockFile | None = None
        #: host memory packing and the sections take: ``pack_memory``, or less where the plan lowered it
        self.pack_memory = int(self.options.pack_memory)
        self._limit: MemoryLimit | None = None
        self._run_pack: EpochPack | None = None
        self._packs: dict[int, EpochPack] = {}
        #: what the last pack used by a training run held and cost (``packed``, ``batches``, ``bytes``, ...)
        self.last_pack: dict[str, Any] = {}
        super().__init__(cfg, ctx, dataset)
        self.eval_store = self.eval_store.without("packed")  # evaluation reads past the packs, and the buffer
        try:
            self._open_dir()
        except BaseException:
            super().close()
            raise

    # -- the store: the tiered chain with a packed tier after the host cache ---------------------------
    def _plan_memory(self) -> MemoryLimit | None:
        limit = self._limit if self._limit is not None else limit_for_plan(self.cfg.memory_limit)
        if limit.unlimited:
            return limit
        processes = max(1, self.ctx.local_world)
        mem = self.pack_memory * processes  # each process of this machine packs beside its own tiers
        lowered = (f" (lowered from {human_bytes(int(self.options.pack_memory))})"
                   if self.pack_memory < int(self.options.pack_memory) else "")  # fmt: skip
        each = f" for each of {processes} processes" if processes > 1 else ""
        if limit.bytes <= mem:
            raise InputError(f"features.pack_memory={human_bytes(self.pack_memory)}{lowered}{each} takes all of "
                             f"{limit}; lower features.pack_memory or raise the memory limit")  # fmt: skip
        return MemoryLimit(limit.bytes - mem, f"{limit.source}; less pack_memory={human_bytes(self.pack_memory)}"
                           f"{lowered}{each}", limit.limit, limit.used, limit.rss)  # fmt: skip

    def _least_pack_memory(self, presampled: list[Any]) -> int:
        """The least ``pack_memory`` the plan may lower it to: :data:`PACK_MEMORY_LEAST`, or what packing an epoch
        needs if more (its cold ids take at most a quarter of it: as many as the presampled batches' ids, at
        most, for every training batch)."""
        def ids(b: Any) -> int:
            return sum(int(v.numel()) for v in b.values()) if isinstance(b, dict) else int(b.numel())

        per_batch = sum(ids(b) for b in presampled) / max(len(presampled), 1)
        id_bytes = 4 if all(v.num_nodes < 2**31 for v in self.task.feature_views(self.dataset).values()) else 8
        need = 4 * int(per_batch * id_bytes * self.batches.count("train"))
        return max(PACK_MEMORY_LEAST, -(-need >> 20) << 20)

    def _build_store(self, reader, presampled, counted) -> StoreProtocol:  # type: ignore[override]
        self._limit = limit_for_plan(self.cfg.memory_limit)
        asked = int(self.options.pack_memory)
        steps = [asked] if self._limit.unlimited else pack_memory_steps(asked, self._least_pack_memory(presampled))
        refused = None
        for i, mem in enumerate(steps):
            self.pack_memory, self.plan = mem, None
            try:
                store = super()._build_store(reader, presampled, counted)
                break
            except InputError as e:
                # built, then failed; refused at the least; or refused alike with more room (not for memory)
                if self.plan is not None or i == len(steps) - 1 or str(e) == refused:
                    raise
                refused = str(e)
        if self.pack_memory < asked:
            log.warning("lightning_ooc: pack_memory lowered from %s to %s to fit in memory: %s; beside %s the tiers "
                        "do not fit even at their smallest; set features.pack_memory=%s to plan this without a warning",
                        human_bytes(asked), human_bytes(self.pack_memory), self._limit,
                        human_bytes(steps[i - 1]), budget_setting(self.pack_memory))  # fmt: skip
        views = self.task.feature_views(self.dataset)
        self._sources, self._tiers = [], {}
        # a section is held from its claim to the gather's fence: by extractors and the batches ready to train, of
        # the pipeline the plan chose (fewer where it lowered it to fit)
        lowered = getattr(self.plan, "pipeline", None) or {}
        inflight = (lowered.get("num_extractors", self.cfg.pipeline.num_extractors)
                    + lowered.get("train_queue_size", self.cfg.pipeline.train_queue_size) + 2)  # fmt: skip
        budget = self.pack_memory // 2 // len(store.node_types)  # half of pack_memory, per type
        for i, t in enumerate(store.node_types):
            view = views[t]
            self._sources.append(FeatureSource(t, Path(view.features_path), int(view.row_bytes), int(view.num_nodes),
                                               int(getattr(view, "features_offset", 0))))
            self._tiers[t] = PackedChunkTier(t, i, view.num_features, view.feature_dtype, view.row_bytes,
                                             SectionBuffers(inflight, pin=self.device.type == "cuda",
                                                            budget=budget))  # fmt: skip
        if isinstance(store, HeteroFeatureStore):
            return HeteroFeatureStore({t: s.inserted(self._tiers[t], after="host_cache") for t, s in store.stores.items()})
        return store.inserted(self._tiers[HOMOGENEOUS], after="host_cache")

    def packed_tiers(self) -> list[PackedChunkTier]:
        """The packed tier of every node type's chain."""
        return list(self._tiers.values())

    # -- where packs go ------------------------------------------------------------------------------------
    def _fingerprints(self) -> list[dict[str, Any]]:
        """Each node type's feature file as it is now (:func:`~lightning_ooc.store.packed_batches.file_fingerprint`)."""
        return [file_fingerprint(s.path, s.offset, s.row_bytes * s.num_rows) for s in self._sources]

    def identity(self) -> dict[str, Any]:
        """What a pack is for: the dataset and its feature files as they were when it opened (size, time, inode,
        sampled blocks: a file rewritten in place with ``meta.json`` unchanged makes another identity), the task
        and its sampling settings, the rank, the host cache."""
        cfg, ctx = self.cfg, self.ctx
        skip = {"features", "pipeline", "predict", "memory_limit", "root", "progress", "dataset_identity",
                "eval_batch_size", "eval_num_neighbors"}  # fmt: skip
        sampling = {k: v for k, v in cfg.as_dict().items() if k not in skip}
        hot = []
        for t in self.store.node_types:
            host = self.store.of(t).tier("host_cache")
            ids = host.host.ids if host is not None else torch.empty(0, dtype=torch.int64)
            hot.append(ids_digest(torch.sort(ids)[0]))
        raw = {"version": __version__, "dataset": self.dataset.identity, "files": self._files,
               "task": type(self.task).__name__, "sampling": sampling,
               "rank": ctx.rank, "world": ctx.world, "hot": hot,
               "types": [[s.node_type, s.row_bytes, s.num_rows] for s in self._sources]}  # fmt: skip
        return json.loads(json.dumps(raw, sort_keys=True, default=str))

    def _open_dir(self) -> None:
        root = Path(self.dataset.root).absolute()
        base = Path(self.options.pack_dir).absolute() if self.options.pack_dir else default_pack_dir(root)
        check_output(base, inputs=[root], kind="workdir", option="pack_dir")
        self._files = self._fingerprints()
        self._identity = self.identity()
        key = xxhash.xxh3_64_hexdigest(json.dumps(self._identity, sort_keys=True).encode())
        self.pack_dir = base / f"rank{self.ctx.rank}-{key}"
        check_output(self.pack_dir, inputs=[root], kind="workdir", option="pack_dir")  # resolved: a link put at its name
        try:
            self.pack_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"{self.pack_dir}: cannot create the pack directory ({e.strerror}); give pack_dir a "
                             "writable directory") from None  # fmt: skip
        self._lock = LockFile(self.pack_dir / LOCK).acquire(lambda holder: InputError(
            f"{self.pack_dir}: another process (pid {holder}) packs the same minibatches there; give each run its "
            "own pack_dir"))  # fmt: skip
        data = {"version": __version__, "dataset": self._identity["dataset"], "files": self._files}
        self._owner = {"dataset": str(root.resolve()), "rank": int(self.ctx.rank),
                       "data": xxhash.xxh3_64_hexdigest(json.dumps(data, sort_keys=True).encode())}  # fmt: skip
        self._write_owner()
        for p in self.pack_dir.iterdir():  # what a killed run left: partial packs never count
            m = _EPOCH_DIR.match(p.name)
            if m and m.group(2):
                remove_pack_files(p)
        self._remove_stale(base)
        self.feature_bytes = sum(s.row_bytes * s.num_rows for s in self._sources)
        self.space = int(self.options.pack_space * self.feature_bytes / 2)

    def _write_owner(self) -> None:
        """Record in the pack directory which dataset directory, and which version of its data, its packs are for."""
        tmp = self.pack_dir / (OWNER + ".tmp")
        try:
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISREG(os.lstat(tmp).st_mode):  # never written through a link or into a FIFO
                    raise InputError(f"{tmp}: is not a file this package wrote; move or remove it, or give pack_dir "
                                     "a directory of its own")  # fmt: skip
                os.unlink(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump(self._owner, f)
            os.replace(tmp, self.pack_dir / OWNER)
        except OSError as e:
            raise InputError(f"{self.pack_dir / OWNER}: cannot be written ({e.strerror}); give pack_dir a writable "
                             "directory") from None  # fmt: skip

    def _remove_stale(self, base: Path) -> None:
        """Remove this rank's pack directories in ``base`` made for this dataset directory before its data changed.

        Only a ``rank<R>-<key>`` directory of this rank that holds this package's lock file, not held by a running
        process, and an ``owner.json`` naming this dataset directory with data other than its own now; of it, only
        what a run writes (its packs, ``owner.json``, the lock). Directories of other datasets, of other
        settings of this one, and anything else in ``pack_dir`` are left as they are.
        """
        try:
            entries = list(os.scandir(base))
        except OSError:
            return
        for entry in entries:
            m = _RANK_DIR.match(entry.name)
            if m is None or int(m.group(1)) != self.ctx.rank or entry.name == self.pack_dir.name:
                continue
            d = Path(entry.path)
            try:
                if not entry.is_dir(follow_symlinks=False):
                    continue
            except OSError:
                continue
            owner = _read_owner(d)
            if (owner is None or owner.get("dataset") != self._owner["dataset"] or owner.get("rank") != self.ctx.rank
                    or owner.get("data") == self._owner["data"] or not marked_lock(d / LOCK)):  # fmt: skip
                continue
            try:
                lock = LockFile(d / LOCK).acquire(_Held)
            except (_Held, LightningOOCError):  # a running process uses it, or the lock is not ours after all
                continue
            try:
                kept = [p.name for p in d.iterdir() if _EPOCH_DIR.match(p.name) and not remove_pack_files(p)]
                for name in (OWNER, OWNER + ".tmp"):
                    with contextlib.suppress(FileNotFoundError):
                        if stat.S_ISREG(os.lstat(d / name).st_mode):
                            os.unlink(d / name)
            except OSError as e:
                log.warning("lightning_ooc: %s: the packs of an earlier version of %s could not all be removed (%s)",
                            d, self._owner["dataset"], e.strerror)  # fmt: skip
                continue
            finally:
                lock.release()
            try:
                d.rmdir()
            except OSError:
                log.warning("lightning_ooc: %s: the packs of an earlier version of %s were removed; the directory "
                            "holds files this package did not write%s, so it was left", d, self._owner["dataset"],
                            f" (in {', '.join(kept)})" if kept else "")  # fmt: skip
                continue
            log.info("lightning_ooc: removed %s: packs made for %s before its data changed", d,
                     self._owner["dataset"])  # fmt: skip

    def _pack_path(self, epoch: int) -> Path:
        return self.pack_dir / epoch_dirname(epoch)

    # -- packing ----------------------------------------------------------------------------------------------
    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise Stopped()

    def _cold(self, data: Any) -> list[np.ndarray]:
        out = []
        for t in self.store.node_types:
            ids = data.n_id if t is HOMOGENEOUS else (data[t].n_id if t in data.node_types else None)
            if ids is None:
                out.append(np.empty(0, dtype=np.int64))
                continue
            host = self.store.of(t).tier("host_cache")
            if host is not None:
                ids = ids[host.host.lookup(ids) < 0]
            out.append(np.sort(ids.numpy()))
        return out

    def pack_epoch(self, epoch: int, progress: bool = False) -> PackReport:
        """Sample epoch ``epoch``'s training batches and write their pack (in this thread); its report."""
        writer = EpochPackWriter(self.pack_dir, epoch, self._identity, self._sources,
                                 memory=self.pack_memory // 2, space=self.space,
                                 backend=self._backend, stop=self._check_stop)  # fmt: skip
        try:
            batches = self.batches.epoch("train", epoch)
            base = sampling_seed(self.cfg, self.ctx.rank)
            t0 = time.perf_counter()
            bar = progress_bar(len(batches), f"packing epoch {epoch}", "batch", enabled=progress, scale=False)
            try:
                for k in range(len(batches)):
                    self._check_stop()
                    data = self.task.sample("train", self.sampler, batches[k], batch_seed(base, epoch, k))
                    writer.add(k, data, self._cold(data))
                    bar.update(1)
            finally:
                bar.close()
            writer.report.sample_seconds = time.perf_counter() - t0
            writer.pack_features()
            if self._fingerprints() != self._files:  # its rows would be of another file than its identity names
                names = ", ".join(str(recorded_path(s.path)) for s in self._sources)
                raise DatasetChangedError(f"{names}: a feature file changed while epoch {epoch} was packed from it, "
                                          "so the pack was discarded; restart once nothing writes to it",
                                          self.dataset.root)  # fmt: skip
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        r = writer.report
        log.info("lightning_ooc: epoch %d packed: %d of %d batches, %s (%.2fx the features), sampled in %.1f s, "
                 "packed in %.1f s", epoch, r.packed, r.batches, human_bytes(r.bytes), r.bytes / self.feature_bytes,
                 r.sample_seconds, r.pack_seconds)  # fmt: skip
        return r

    def _background(self, epoch: int) -> None:
        if epoch in self._jobs or epoch in self._packs or self._stop.is_set():
            return
        if self._pack_path(epoch).exists():
            pack = EpochPack.open(self._pack_path(epoch), self._identity, self._backend)
            if pack is not None:  # a pack a killed run left, for this very identity
                self._packs[epoch] = pack
                return
            remove_pack(self._pack_path(epoch))
        job = self._jobs[epoch] = _Job(epoch)

        def work() -> None:
            job.started = time.perf_counter()
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PACKER_NICE)  # this thread only (Linux)
            except (OSError, AttributeError):
                pass
            try:
                job.report = self.pack_epoch(epoch)
            except Stopped:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to the run that needs the pack
                job.error = e
                log.error("lightning_ooc: packing epoch %d failed: %s", epoch, e)
            finally:
                job.finished = time.perf_counter()

        job.thread = threading.Thread(target=work, name=f"looc-pack-{epoch}", daemon=True)
        stop_at_exit(self)  # a packer left going when the script ends is stopped before the interpreter finalises
        job.thread.start()

    def finish_packing(self, epoch: int) -> dict[str, Any]:
        """Wait for the packing of ``epoch`` that runs beside training, if any; what it cost (``started`` and
        ``finished``: ``time.perf_counter()`` values; ``seconds``, ``sample_seconds``, ``pack_seconds``,
        ``bytes``, ``packed``, ``batches``; ``error``). The pack stays for the run of that epoch."""
        job = self._jobs.get(epoch)
        if job is None:
            return {"epoch": epoch, "ran": False}
        if job.thread is not None:
            job.thread.join()
        out: dict[str, Any] = {"epoch": epoch, "ran": True, "started": job.started, "finished": job.finished,
                               "seconds": (job.finished or 0.0) - (job.started or 0.0),
                               "error": None if job.error is None else str(job.error)}  # fmt: skip
        if job.report is not None:
            r = job.report
            out.update(sample_seconds=r.sample_seconds, pack_seconds=r.pack_seconds, bytes=r.bytes, packed=r.packed,
                       batches=r.batches, partitions=r.partitions, rows=r.rows, segments=r.segments,
                       segment_batches=r.segment_batches, threshold=r.threshold, cached_rows=r.cached_rows,
                       reorder_seconds=r.reorder_seconds)  # fmt: skip
        return out

    def _pack_for(self, epoch: int) -> tuple[EpochPack | None, float, PackReport | None]:
        """The pack of ``epoch`` (waiting for its packing, or packing it now with ``first_epoch="pack"``), the
        seconds waited, and the report of a pack made for this call."""
        t0 = time.perf_counter()
        report = None
        job = self._jobs.get(epoch)
        if job is not None:
            if job.thread is not None:
                job.thread.join()
            del self._jobs[epoch]
            if job.error is not None:
                raise PackingError(f"packing the minibatches of epoch {epoch} into {self.pack_dir} failed: "
                                   f"{job.error}") from job.error  # fmt: skip
            report = job.report
        pack = self._packs.get(epoch) or EpochPack.open(self._pack_path(epoch), self._identity, self._backend)
        if pack is None and self.options.first_epoch == "pack":
            for other in list(self._jobs):  # one packer at a time: its memory is planned once
                self.finish_packing(other)
            try:
                report = self.pack_epoch(epoch, progress=self.cfg.progress and self.ctx.rank == 0)
            except Stopped:
                raise
            except Exception as e:  # an interrupt stays an interrupt
                raise PackingError(f"packing the minibatches of epoch {epoch} into {self.pack_dir} failed: {e}") from e
            pack = EpochPack.open(self._pack_path(epoch), self._identity, self._backend)
        if pack is not None:
            self._packs[epoch] = pack
        return pack, time.perf_counter() - t0, report

    def _drop(self, keep: Callable[[int], bool]) -> None:
        for e in [e for e in self._packs if not keep(e)]:
            self._packs.pop(e).close()
        for p in self.pack_dir.iterdir():
            m = _EPOCH_DIR.match(p.name)
            if m and not m.group(2) and not keep(int(m.group(1))) and int(m.group(1)) not in self._jobs:
                remove_pack(p)

    # -- passes -----------------------------------------------------------------------------------------------
    def _batch_source(self, split: str) -> Callable[[torch.Tensor, int, int], Any]:
        sample = super()._batch_source(split)
        pack = self._run_pack if split == "train" else None
        if pack is None:
            return sample

        def read_or_sample(seeds: torch.Tensor, seed: int, k: int) -> Any:
            return pack.load_batch(k) if pack.has(k) else sample(seeds, seed, k)

        return read_or_sample

    def run(self, split: str, epoch: int, skip: frozenset[int] = frozenset(),
            on_end: Callable[[EpochStats], None] | None = None, on_batch: Callable[[int], None] | None = None,
            name: str | None = None) -> EpochRun:  # fmt: skip
        if split != "train":
            return super().run(split, epoch, skip, on_end, on_batch, name)
        pack, waited, report = self._pack_for(epoch)
        self._drop(lambda e: e >= epoch)  # trained epochs' packs go
        self._background(epoch + 1)
        for tier in self._tiers.values():
            tier.use(pack)
            tier.take_counts()
        r = pack.manifest["report"] if pack is not None else {"batches": self.batches.count("train"),
                                                               "packed": 0, "rows": 0, "bytes": 0}  # fmt: skip
        self.last_pack = {**r, "epoch": epoch, "waited_seconds": waited,
                          "pack_seconds": report.sample_seconds + report.pack_seconds if report else None,
                          "sample_seconds": report.sample_seconds if report else None,
                          "rows_seconds": report.pack_seconds if report else None}  # fmt: skip
        user_end = on_end

        def packed_end(stats: EpochStats) -> None:
            counts = {"sections": 0, "mismatched": 0}
            for tier in self._tiers.values():
                for key, v in tier.take_counts().items():
                    counts[key] += v
            stats.extra.update({"packed_sections": float(counts["sections"]),
                                "packed_mismatched": float(counts["mismatched"]),
                                "packed_batches": float(r["packed"]), "pack_wait_seconds": float(waited),
                                "pack_space_ratio": float(r["bytes"]) / max(self.feature_bytes, 1)})  # fmt: skip
            if user_end is not None:
                user_end(stats)

        self._run_pack = pack
        try:
            return super().run(split, epoch, skip, packed_end, on_batch, name)
        finally:
            self._run_pack = None

    def describe(self, presampled: list[Any]) -> str:
        o = self.options
        first = "packed before it trains" if o.first_epoch == "pack" else "trained on direct reads while packing"
        where = o.pack_dir or default_pack_dir(self.dataset.root)
        line = (f"  packed          epochs packed ahead into {where}: up to "
                f"{o.pack_space / 2:.2f}x the features each, {human_bytes(self.pack_memory)} of memory; first epoch "
                f"{first}")  # fmt: skip
        return super().describe(presampled) + "\n" + line

    def close(self) -> None:
        """Stop packing, close the runs and the store, and remove this run's packs."""
        self._stop.set()
        for job in list(self._jobs.values()):
            if job.thread is not None:
                job.thread.join()
        self._jobs.clear()
        try:
            super().close()
        finally:
            for pack in self._packs.values():
                pack.close()
            self._packs.clear()
            if self._lock is not None:  # the packs first, the lock last (held until it is gone)
                for p in self.pack_dir.iterdir():
                    if _EPOCH_DIR.match(p.name):
                        remove_pack(p)
                for name in (OWNER, OWNER + ".tmp"):
                    with contextlib.suppress(OSError):
                        if stat.S_ISREG(os.lstat(self.pack_dir / name).st_mode):
                            os.unlink(self.pack_dir / name)
                self._lock.release()
                self._lock = None
                with contextlib.suppress(OSError):
                    self.pack_dir.rmdir()
