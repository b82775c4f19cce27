"""``OutOfCoreStrategy`` (``strategy="ooc"``): one process per device over shared host memory.

It is Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` (same
launchers, cluster environments, gradient all-reduce; NCCL on GPUs, gloo on
CPUs) plus what out-of-core training needs from the processes of a machine:

- :attr:`shared`, a :class:`~lightning_ooc.strategy.shared.NodeShared` through
  which :class:`~lightning_ooc.OutOfCoreNodeData` keeps one copy per machine of
  the topology (``indptr``) and of the staging buffer (each rank owns a
  portion); ``indices`` and the features are file mappings and direct reads,
  shared through the page cache or not cached at all;
- child processes die with their launcher, gather producers with their rank
  (``PR_SET_PDEATHSIG``), and a rank that dies takes the others down within
  seconds (Lightning's process observer for the ranks it launched, the closed
  gloo/NCCL connections for the rest); SIGTERM to any rank stops the whole job
  the same way instead of hanging in Lightning's handler (see
  :mod:`lightning_ooc.strategy.signals`); a rank whose collective fails because
  another rank is gone says which, and how it ended, in one line;
- ``mps_split``: the share of each GPU's SMs, in percent, given to the
  feature-gather kernels through CUDA MPS (see :mod:`lightning_ooc.strategy.mps`).

Several machines work as with DDP (``num_nodes`` under torchrun or SLURM);
every machine reads its own local copy of the dataset.

Example::

    >>> import lightning as L
    >>> import lightning_ooc.strategy  # registers "ooc" (importing OutOfCoreNodeData does too)
    >>> trainer = L.Trainer(strategy="ooc", accelerator="cpu", devices=2, logger=False)
    >>> type(trainer.strategy).__name__, trainer.strategy.num_processes
    ('OutOfCoreStrategy', 2)
"""
from __future__ import annotations

import logging
import os
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy

from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.strategy import mps as mps_mod
from lightning_ooc.strategy.mps import MPSControl, MPSError, mps_usable
from lightning_ooc.strategy.shared import NodeShared, _unlink_pending
from lightning_ooc.strategy import lightning_adapter
from lightning_ooc.strategy.signals import JobStop, peer_lost, say_instead_of_traceback
from lightning_ooc.utils.proc import die_with_parent

log = logging.getLogger("lightning_ooc")

LAUNCHER_PID = "LOOC_LAUNCHER_PID"  # set by the process that starts the ranks, inherited by them


class OutOfCoreStrategy(DDPStrategy):
    """DDP with node-local shared memory for topology and staging, and optional CUDA MPS splits.

    Args:
        mps_split: percent of each GPU's SMs for the feature gather (e.g. ``10``); the trainer gets the
            rest. ``None`` (default) gathers in the training process on a side stream. The training process
            is capped only if it was made an MPS client before CUDA started: a script calls
            ``lightning_ooc.strategy.mps.prepare(mps_split)`` before building its Trainer
            (``lightning-ooc fit`` does).
        share_topology: keep ``indptr`` once per machine in shared memory (default) instead of per rank.
        share_staging: carve every rank's staging buffer out of one shared segment per machine.
        gather_process: run each rank's sampling, extraction and gather in a producer process that
            hands finished minibatches to the trainer (default: exactly when ``mps_split`` is active).
        start_method, timeout, process_group_backend, and other keyword arguments: as for
            :class:`~lightning.pytorch.strategies.DDPStrategy`.

    ``strategy="ooc"`` names it (registered on ``import lightning_ooc``); an instance takes its options::

        >>> import lightning as L, lightning_ooc
        >>> trainer = L.Trainer(strategy="ooc", accelerator="cpu", devices=2, logger=False)
        >>> type(trainer.strategy).__name__, trainer.num_devices
        ('OutOfCoreStrategy', 2)
        >>> strategy = OutOfCoreStrategy(share_topology=False)  # indptr per rank, not once per machine
        >>> L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False).strategy.share_topology
        False
    """

    strategy_name = "ooc"

    def __init__(
        self,
        *args: Any,
        mps_split: int | None = None,
        share_topology: bool = True,
        share_staging: bool = True,
        gather_process: bool | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, timeout=timeout, **kwargs)
        if mps_split is not None and not 0 < int(mps_split) < 100:
            raise ValueError(f"mps_split is a percentage of the SMs strictly between 0 and 100, got {mps_split}")
        self.mps_split = None if mps_split is None else int(mps_split)
        self.share_topology = bool(share_topology)
        self.share_staging = bool(share_staging)
        self.shared: NodeShared | None = None
        self.mps: MPSControl | None = None
        self._mps_active = False
        self.gather_process = gather_process
        self._producers: list[Any] = []  # this rank's gather producers (GatherProducer), until teardown
        self._job_stop: JobStop | None = None

    # -- processes --------------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if "LOCAL_RANK" not in os.environ:  # this process launches the others: they learn its pid
            os.environ[LAUNCHER_PID] = str(os.getpid())

    def setup_environment(self) -> None:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: die with its agent
            die_with_parent()
        elif self.local_rank > 0 and self._start_method == "popen" and os.environ.get(LAUNCHER_PID):
            die_with_parent(int(os.environ[LAUNCHER_PID]))
        if self.mps_split is not None:
            self._start_mps()
        super().setup_environment()
        self._take_over_sigterm()
        token = uuid.uuid4().hex[:12] if self.global_rank == 0 else None
        token = self.broadcast(token) if self.world_size > 1 else token
        self.shared = NodeShared(token, self.local_rank, self.num_processes, exchange=self.all_gather_object,
                                 node=self.node_rank)  # fmt: skip

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        # Lightning registers its SIGTERM handler after this; it must leave a JobStop's in place
        lightning_adapter.leave_sigterm(trainer)

    # -- signals ---------------------------------------------------------------------------------
    @property
    def sigterm_requeues(self) -> bool:
        """Whether SIGTERM announces a requeue (SLURM with auto-requeue), which Lightning's own handler serves."""
        env = self.cluster_environment
        return isinstance(env, SLURMEnvironment) and bool(env.auto_requeue)

    @property
    def owns_sigterm(self) -> bool:
        """Whether SIGTERM stops the whole job through this strategy's :class:`~.signals.JobStop` right now."""
        return self._job_stop is not None and self._job_stop.installed

    def _take_over_sigterm(self) -> None:
        """With several processes, SIGTERM to this rank stops the job (:mod:`lightning_ooc.strategy.signals`).

        Not under SLURM with auto-requeue, where Lightning's handler requeues the job, and not with one
        process, where Lightning's handler stops the run at the next batch and no peer can make it wait.
        The handler it replaces (Lightning's, or one set before the run) is back after :meth:`teardown`.
        """
        if self.owns_sigterm or self.sigterm_requeues or self.world_size <= 1:
            return
        launcher = self._launcher

        def children() -> list[Any]:  # the ranks this process launched (none unless it is the launcher)
            return lightning_adapter.launched(launcher)

        def kill(signum: int) -> None:  # Lightning's public way to signal them
            if launcher is not None:
                launcher.kill(signum)

        def stop_mps() -> None:  # the job ends with os._exit: no atexit hook leaves the daemon
            mps_mod.release()

        self._job_stop = JobStop(rank=lambda: self.global_rank, children=children, kill=kill,
                                 helpers=lambda: [p.proc for p in list(self._producers)],
                                 cleanup=(_unlink_pending, stop_mps))  # fmt: skip
        if not self._job_stop.install():
            log.warning("SIGTERM keeps Lightning's handler: the strategy was set up outside the main thread")
            self._job_stop = None

    def on_exception(self, exception: BaseException) -> None:
        """A collective that failed because another rank is gone: one line naming that rank (the launching rank
        knows the ranks it started and how they ended), in place of the backend's traceback."""
        super().on_exception(exception)
        if self.world_size <= 1:
            return
        launched = lightning_adapter.launched(self._launcher)
        first = self.node_rank * self.num_processes + 1  # the launcher starts local ranks 1, 2, ... in order
        line = peer_lost(exception, self.global_rank, launched, first_launched_rank=first)
        if line is not None:
            say_instead_of_traceback(exception, line)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (a collective: every rank must call it)."""
        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    # -- MPS -------------------------------------------------------------------------------------
    def _start_mps(self) -> None:
        """Use the MPS daemon this process was prepared for (:func:`.mps.prepare`), or prepare it now.

        Prepared now, the training process still becomes a client if nothing has initialised CUDA yet; if
        something has, one warning says it is not one (the producer, a fresh process, is capped all the
        same) and names the fix. The daemon is left at process exit, not at teardown.
        """
        ok, why = mps_usable(self.root_device)
        if ok:
            try:
                self.mps = mps_mod.client_of(self.mps_split)
            except (MPSError, OSError) as e:  # e.g. the daemon does not start: train without the split
                ok, why = False, " ".join(str(e).split())
        if not ok:
            instead = ("running the gather producer without a split" if self.gather_process
                       else "gathering on a side stream in the training process instead")  # fmt: skip
            log.warning("mps_split=%s: CUDA MPS is not usable here (%s); %s", self.mps_split, why, instead)
            return
        self._mps_active = True

    @property
    def gather_in_producer(self) -> bool:
        """Whether the feature gather runs in a producer process (under MPS when active), else in the trainer."""
        return self._mps_active if self.gather_process is None else bool(self.gather_process)

    def producer_env(self) -> dict[str, str]:
        """Environment variables a producer process starts with (its MPS client settings and SM cap)."""
        if self._mps_active and self.mps is not None:
            env = self.mps.env(self.mps_split)
            return {k: v for k, v in env.items() if k.startswith("CUDA_MPS_")}
        return {}

    # -- what the datamodule learns about this process ----------------------------------------------
    def process_context(self) -> ProcessContext:
        """This rank as a :class:`~lightning_ooc.loader.context.ProcessContext` (see ``ContextProvider``)."""
        shared = self.shared
        remote = None
        if self.gather_in_producer:
            local = (shared.local_rank, shared.local_world) if shared is not None else (0, 1)

            def remote(cfg: Any) -> Any:
                from lightning_ooc.strategy.producer import GatherProducer  # lazy: it imports PyG and Triton

                # the segments the rank holds by now (its topology, opened just before)
                handles = shared.handles() if shared is not None and self.share_topology else {}
                producer = GatherProducer(cfg, rank=self.global_rank, world=self.world_size, device=self.root_device,
                                          handles=handles, local=local, env=self.producer_env())  # fmt: skip
                self._producers.append(producer)  # killed at once if SIGTERM stops the job
                return producer

        return ProcessContext(
            rank=self.global_rank, world=self.world_size, device=self.root_device,
            topology=shared if self.share_topology else None, staging=shared if self.share_staging else None,
            remote=remote,
        )  # fmt: skip

    # -- teardown --------------------------------------------------------------------------------
    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if self._job_stop is not None:
                self._job_stop.uninstall()
                if not self._job_stop.installed:
                    self._job_stop = None
            # The producers go first: each is an MPS client and maps the shared segments. Lightning tears the
            # strategy down before the datamodule on success (after it on failure); the datamodule's own
            # close of a producer closed here does nothing.
            producers, self._producers = self._producers, []
            for producer in producers:
                try:
                    producer.close()
                except Exception as e:  # noqa: BLE001 - teardown goes on
                    log.warning("closing the gather producer failed: %s", e)
            if self.shared is not None:
                self.shared.close()
                self.shared = None
            # The daemon stays: this process may be its client, holding a CUDA context until it exits (a daemon
            # that quits takes its clients' MPS server with it). The atexit hook of mps.prepare() leaves it,
            # and the last process using it quits it; a later fit in this process (test_after_fit) uses it.
            self.mps = None
            self._mps_active = False
