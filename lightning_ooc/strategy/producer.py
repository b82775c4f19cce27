"""The gather producer: a process per rank that samples, extracts and gathers minibatches for the trainer.

With ``mps_split`` the strategy starts one per rank as a CUDA MPS client capped to
``mps_split`` percent of the SMs (the training process keeps the rest). It owns
the rank's feature store and pipeline (a :class:`~lightning_ooc.loader.source.LocalPasses`
built from the datamodule's config and a :class:`~lightning_ooc.loader.context.ProcessContext`
of its own); finished minibatches, ``x`` included, cross to the trainer through a
``torch.multiprocessing`` queue, which shares CUDA tensors by CUDA IPC (and CPU
tensors by shared memory), so rows are never copied between the processes. Its
entry point first sets its MPS client settings (given by the strategy, not
through the parent's environment) and selects the rank's GPU, in its main
thread and in every pass thread (the CUDA current device is per thread). It
maps the topology the rank already holds in node-local shared memory, or opens
the dataset itself when the strategy does not share it.

Every pass has its own identity end to end. The trainer starts a pass with a
new run id; the producer runs it in a thread of its own, so passes can be live
at the same time (a validation pass inside a paused training epoch), and tags
every message with the run id. Flow is by credit: the producer sends a run's
next batch only when the trainer has granted a credit for it, so a paused pass
never floods the shared queue, and the trainer files messages by run id. A
pass starts with as many credits as the train queue the producer's passes run
with (a tight memory cap may have lowered ``train_queue_size`` in their plan),
which the producer reports once it is ready.
Closing a pass cancels it in the producer, which answers with its end.

Errors cross too: an exception in a pass is re-raised in the trainer by that
pass alone (the producer and its store stay up for the next one); an exception
while the producer sets up, or the producer's death, is a
:class:`ProducerError` within a second, naming the pid and the exit code.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import pickle
import queue
import threading
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing as mp

from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader import registry
from lightning_ooc.loader.context import ProcessContext, SourceDefaults
from lightning_ooc.utils.cancel import Cancelled
from lightning_ooc.utils.device import use_device
from lightning_ooc.utils.proc import die_with_parent
from lightning_ooc.strategy.shared import AttachedShared

log = logging.getLogger("lightning_ooc")
_POLL = 0.5


class ProducerError(RuntimeError):
    """The gather producer process failed or exited."""


def _portable(e: BaseException) -> BaseException:
    """``e`` if it pickles (so the trainer re-raises the same type), else a ProducerError with its text."""
    note = "".join(traceback.format_exception(e))
    try:
        pickle.loads(pickle.dumps(e))
        e.add_note(f"in the gather producer process {os.getpid()}:\n{note}")
        return e
    except Exception:
        return ProducerError(f"in the gather producer process {os.getpid()}: {note}")


# -- the producer process ----------------------------------------------------------------------------
class _ProducedPass(threading.Thread):
    """One pass inside the producer: iterates its run and sends a batch per credit."""

    def __init__(self, passes: Any, run_id: int, split: str, epoch: int, skip: frozenset[int], out: Any,
                 device: torch.device | None = None):  # fmt: skip
        super().__init__(name=f"ooc-producer-run-{run_id}", daemon=True)
        self.run_id, self.out, self.device = run_id, out, device
        self.credits = threading.Semaphore(0)
        self.cancelled = threading.Event()
        self.pass_run = passes.run(split, epoch, skip, name=f"{split}-{run_id}")

    def _wait_credit(self) -> bool:
        while not self.credits.acquire(timeout=_POLL):
            if self.cancelled.is_set():
                return False
        return not self.cancelled.is_set()

    def run(self) -> None:  # noqa: D102 - Thread.run
        rid = self.run_id
        try:
            use_device(self.device)  # the CUDA current device is per thread: a new one starts on GPU 0
            self.out.put(("started", rid, len(self.pass_run)))
            for data in self.pass_run:
                if not self._wait_credit():
                    break
                self.out.put(("batch", rid, data))
            self.out.put(("end", rid, self.pass_run.stats))
        except Cancelled:
            self.out.put(("end", rid, self.pass_run.stats))
        except BaseException as e:  # noqa: BLE001 - re-raised in the trainer
            self.out.put(("error", rid, _portable(e)))
        finally:
            self.pass_run.close()

    def cancel(self) -> None:
        self.cancelled.set()
        self.pass_run.cancel.cancel("closed by the trainer")


def _context_in_child(spec: dict[str, Any]) -> ProcessContext:
    topology = AttachedShared(spec["handles"], *spec["local"]) if spec["handles"] else None
    return ProcessContext(rank=spec["rank"], world=spec["world"], device=torch.device(spec["device"]),
                          topology=topology)  # fmt: skip


def _main(cfg: NodeDataConfig, spec: dict[str, Any], commands: Any, out: Any) -> None:
    # first, before anything creates a CUDA context: the MPS client settings (read when the context is created;
    # given here, not through the parent's os.environ), then the rank's GPU
    os.environ.update(spec.get("env") or {})
    device = torch.device(spec["device"])
    use_device(device)
    if spec.get("parent"):  # a rank killed outright must not leave its producer waiting forever
        die_with_parent(spec["parent"])
    logging.basicConfig(level=logging.WARNING)
    ctx = _context_in_child(spec)
    try:
        passes = registry.source(registry.task_of(cfg), cfg, ctx)
    except BaseException as e:
        out.put(("error", None, _portable(e)))
        return
    # the passes run with the settings their plan settled on (a lowered train queue)
    credits = max(1, int(getattr(passes, "cfg", cfg).pipeline.train_queue_size))
    out.put(("ready", None, {"env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")},
                             "credits": credits}))  # fmt: skip
    live: dict[int, _ProducedPass] = {}
    try:
        while True:
            cmd = commands.get()
            if cmd is None:
                break
            kind, rid, *args = cmd
            for r in [r for r, p in live.items() if not p.is_alive()]:
                del live[r]
            if kind == "start":
                try:
                    p = live[rid] = _ProducedPass(passes, rid, *args, out=out, device=device)
                    p.start()
                except BaseException as e:  # noqa: BLE001
                    out.put(("error", rid, _portable(e)))
            elif kind == "credit" and rid in live:
                for _ in range(int(args[0])):
                    live[rid].credits.release()
            elif kind == "cancel" and rid in live:
                live[rid].cancel()
    finally:
        for p in live.values():
            p.cancel()
        for p in live.values():
            p.join()
        passes.close()
        if ctx.topology is not None:
            ctx.topology.close()


# -- the trainer's side ------------------------------------------------------------------------------
class GatherProducer(SourceDefaults):
    """One producer process for one rank (see the module docstring); a pass source for the datamodule.

    Args:
        cfg: the datamodule's settings.
        rank, world, device: the rank it produces for.
        handles: the rank's node-local shared segments to map (``{}``: the producer opens the dataset itself).
        local: ``(local_rank, local_world)`` of the rank.
        env: environment variables the process sets first thing, before CUDA starts (its MPS client
            settings); this process's ``os.environ`` is left alone.
        credits: batches of one pass that may wait in the trainer's queue (default: the train queue depth the
            producer's memory plan settled on: ``cfg.pipeline.train_queue_size`` unless a tight memory limit lowered
            it).
    """

    def __init__(self, cfg: NodeDataConfig, *, rank: int, world: int, device: torch.device | str,
                 handles: dict[str, tuple[str, int]], local: tuple[int, int] = (0, 1),
                 env: dict[str, str] | None = None, credits: int | None = None, ready_timeout: float = 3600.0):  # fmt: skip
        ctx = mp.get_context("spawn")
        self._commands = ctx.Queue()
        self._out = ctx.Queue()
        #: batches of one pass that may wait for the trainer (set again from the producer's plan once it is ready)
        self.credits = max(1, int(credits if credits is not None else cfg.pipeline.train_queue_size))
        self._ids = itertools.count(1)
        self._inbox: dict[int, collections.deque] = {}
        self._lock = threading.Lock()
        # the producer dies with this process, unless a thread other than the main one starts it (a parent-death
        # signal follows the thread that started the child: it would die when that thread ends)
        parent = os.getpid() if threading.current_thread() is threading.main_thread() else None
        spec = {"rank": rank, "world": world, "device": str(device), "handles": dict(handles), "local": tuple(local),
                "parent": parent, "env": dict(env or {})}  # fmt: skip
        self.proc = ctx.Process(target=_main, name=f"ooc-producer-{rank}", daemon=True,
                                args=(cfg, spec, self._commands, self._out))  # fmt: skip
        self._closed = False
        #: the ``CUDA_MPS_*`` variables the producer runs with, as it reported them once ready
        self.client_env: dict[str, str] = {}
        self.proc.start()
        kind, _, payload = self._get(ready_timeout)
        if kind == "error":
            self.close()
            raise payload
        self.client_env = dict((payload or {}).get("env", {}))
        if credits is None:  # the queue depth its memory plan settled on, not the one configured
            self.credits = max(1, int((payload or {}).get("credits", self.credits)))
        share = self.client_env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        mine = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        log.info("gather producer for rank %d runs in process %d%s", rank, self.proc.pid,
                 f" with {share}% of the GPU's SMs (the training process: {mine or 100}%)" if share else "")  # fmt: skip

    def _get(self, timeout: float | None = None) -> tuple[str, int | None, Any]:
        waited = 0.0
        while True:
            try:
                return self._out.get(timeout=_POLL)
            except (OSError, EOFError) as e:  # a batch whose memory went with a dead producer
                self.proc.join(timeout=5)
                why = "exited with code {}".format(self.proc.exitcode) if not self.proc.is_alive() else "is alive"
                raise ProducerError(f"receiving a minibatch from the gather producer process {self.proc.pid} failed "
                                    f"({e}); the process {why}") from e  # fmt: skip
            except queue.Empty:
                waited += _POLL
                if not self.proc.is_alive():
                    raise ProducerError(f"the gather producer process {self.proc.pid} exited with code "
                                        f"{self.proc.exitcode}") from None  # fmt: skip
                if timeout is not None and waited >= timeout:
                    raise ProducerError(f"no answer from the gather producer within {timeout:.0f} s") from None

    def _receive(self, run_id: int, timeout: float | None = None) -> tuple[str, Any]:
        """The next message of run ``run_id``; messages of other live runs are filed in their inboxes."""
        while True:
            with self._lock:
                box = self._inbox.get(run_id)
                if box:
                    return box.popleft()
            kind, rid, payload = self._get(timeout)
            with self._lock:
                if rid in self._inbox:
                    self._inbox[rid].append((kind, payload))
                # else: a message of a pass already closed (its late batches): dropped

    def _send(self, *cmd: Any) -> None:
        self._commands.put(cmd)

    def run(self, split: str, epoch: int, skip: frozenset[int] = frozenset(),
            on_end: Callable[[Any], None] | None = None, on_batch: Callable[[int], None] | None = None,
            **_: Any) -> "ProducedRun":  # fmt: skip
        """Start a pass in the producer; iterate the result."""
        rid = next(self._ids)
        with self._lock:
            self._inbox[rid] = collections.deque()
        self._send("start", rid, split, int(epoch), frozenset(skip))
        self._send("credit", rid, self.credits)
        return ProducedRun(self, rid, on_end, on_batch)

    def _forget(self, run_id: int) -> None:
        with self._lock:
            self._inbox.pop(run_id, None)

    def close(self) -> None:
        """Stop the process (its passes are cancelled) and close the queues; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.proc.is_alive():
            self._commands.put(None)
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
        for q in (self._commands, self._out):
            q.close()
            q.cancel_join_thread()


class ProducedRun(Iterator[Any]):
    """The trainer's iterator over one pass run by a :class:`GatherProducer`."""

    def __init__(self, producer: GatherProducer, run_id: int, on_end: Callable[[Any], None] | None,
                 on_batch: Callable[[int], None] | None):  # fmt: skip
        self._p, self.run_id = producer, run_id
        self._on_end, self._on_batch = on_end, on_batch
        self._left: int | None = None
        self._done = False
        self.stats = None

    def __iter__(self) -> "ProducedRun":
        return self

    def __len__(self) -> int:
        self._started()
        return int(self._left or 0)

    def _started(self) -> None:
        if self._left is None:
            kind, payload = self._p._receive(self.run_id)
            if kind != "started":
                self._end(kind, payload)
            self._left = int(payload)

    def _end(self, kind: str, payload: Any) -> None:
        self._done = True
        self._p._forget(self.run_id)
        if kind == "error":
            raise payload
        if kind != "end":
            raise ProducerError(f"the gather producer sent {kind!r} where the end of pass {self.run_id} was due")
        self.stats = payload
        if self._on_end is not None:
            self._on_end(payload)

    def __next__(self):
        if self._done:
            raise StopIteration
        self._started()
        if self._left == 0:
            self._end(*self._p._receive(self.run_id))
            raise StopIteration
        kind, payload = self._p._receive(self.run_id)
        if kind != "batch":
            self._end(kind, payload)
            raise StopIteration
        self._left -= 1
        self._p._send("credit", self.run_id, 1)
        if self._on_batch is not None and hasattr(payload, "batch_index"):
            self._on_batch(int(payload.batch_index))
        if self._left == 0:  # loaders that know their length never ask again: take the end marker now
            self._end(*self._p._receive(self.run_id))
        return payload

    def close(self) -> None:
        """Stop the pass early: the producer cancels it and answers with its end."""
        if self._done:
            return
        self._done = True
        try:
            if self._p.proc.is_alive():
                self._p._send("cancel", self.run_id)
                while True:
                    kind, _ = self._p._receive(self.run_id, timeout=60)
                    if kind in ("end", "error"):
                        break
        finally:
            self._p._forget(self.run_id)
