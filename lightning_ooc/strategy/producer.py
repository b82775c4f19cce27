"""The gather producer: a process per rank that samples, extracts and gathers minibatches for the trainer.

With ``mps_split`` the strategy starts one per rank as a CUDA MPS client capped to
``mps_split`` percent of the SMs (the training process keeps the rest). It owns
the rank's feature store (feature buffer, host cache, staging, reader) and its
pipeline; finished minibatches, ``x`` included, cross to the trainer through a
``torch.multiprocessing`` queue, which shares CUDA tensors by CUDA IPC (and CPU
tensors by shared memory), so rows are never copied between the processes. It
maps the topology the rank already holds in node-local shared memory.

The trainer's side (:meth:`GatherProducer.run`) is an iterator over one pass.
Errors cross too: an exception in the producer is re-raised in the trainer, and
a producer that dies is reported within a second, by its pid and exit code.
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing as mp

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


def _main(dm_kwargs: dict, rank: int, world: int, device: str, handles: dict, local: tuple[int, int],
          commands: Any, out: Any, stop: Any) -> None:  # fmt: skip
    from lightning_ooc.datamodule import OutOfCoreNodeData
    from lightning_ooc.strategy.shared import AttachedShared

    logging.basicConfig(level=logging.WARNING)
    shared = AttachedShared(handles, *local)
    dm = OutOfCoreNodeData(**dm_kwargs)
    dm._context = (rank, world, torch.device(device), shared)
    try:
        dm.setup()
    except BaseException as e:
        out.put(("error", _portable(e)))
        return
    out.put(("ready", None))
    try:
        while True:
            cmd = commands.get()
            if cmd is None:
                break
            split, epoch, skip = cmd
            stop.clear()
            run = dm._make_run(split, epoch, frozenset(skip))
            try:
                for data in run:
                    while not stop.is_set():
                        try:
                            out.put(("batch", data), timeout=_POLL)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        break
                out.put(("end", run.stats))
            except BaseException as e:
                out.put(("error", _portable(e)))
            finally:
                run.close()
    finally:
        dm.teardown()
        shared.close()


class GatherProducer:
    """One producer process for one rank (see the module docstring)."""

    def __init__(self, dm_kwargs: dict, *, rank: int, world: int, device: torch.device | str,
                 handles: dict[str, tuple[str, int]], local: tuple[int, int] = (0, 1),
                 env: dict[str, str] | None = None, queue_size: int = 4, ready_timeout: float = 3600.0):  # fmt: skip
        ctx = mp.get_context("spawn")
        self._commands = ctx.Queue()
        self._out = ctx.Queue(maxsize=max(1, int(queue_size)))
        self._stop = ctx.Event()
        self.proc = ctx.Process(target=_main, name=f"ooc-producer-{rank}", daemon=True, args=(
            dm_kwargs, rank, world, str(device), handles, local, self._commands, self._out, self._stop))  # fmt: skip
        saved = dict(os.environ)
        try:  # the child reads its MPS settings from the environment it starts with
            os.environ.update(env or {})
            self.proc.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        kind, payload = self._get(ready_timeout)
        if kind == "error":
            self.close()
            raise payload
        log.info("gather producer for rank %d runs in process %d", rank, self.proc.pid)

    def _get(self, timeout: float | None = None):
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

    def run(self, split: str, epoch: int, skip: frozenset[int], num_batches: int,
            on_end: Callable[[Any], None] | None = None) -> "ProducedRun":  # fmt: skip
        """Start a pass of ``num_batches`` minibatches (after ``skip``) in the producer; iterate the result."""
        self._commands.put((split, int(epoch), sorted(skip)))
        return ProducedRun(self, num_batches, on_end)

    def close(self) -> None:
        if self.proc.is_alive():
            self._stop.set()
            self._commands.put(None)
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
        for q in (self._commands, self._out):
            q.close()
            q.cancel_join_thread()


class ProducedRun(Iterator[Any]):
    """The trainer's iterator over one pass run by a :class:`GatherProducer`."""

    def __init__(self, producer: GatherProducer, num_batches: int, on_end: Callable[[Any], None] | None):
        self._p, self._on_end = producer, on_end
        self._left = int(num_batches)
        self._done = False
        self.stats = None

    def _end(self, kind: str, payload: Any) -> None:
        self._done = True
        if kind == "error":
            raise payload
        if kind != "end":
            raise ProducerError(f"the gather producer sent {kind!r} where the end of the pass was due")
        self.stats = payload
        if self._on_end is not None:
            self._on_end(payload)

    def __next__(self):
        if self._done:
            raise StopIteration
        kind, payload = self._p._get()
        if kind != "batch":
            self._end(kind, payload)
            raise StopIteration
        self._left -= 1
        if self._left == 0:  # loaders that know their length never ask again: take the end marker now
            self._end(*self._p._get())
        return payload

    def close(self) -> None:
        """Stop the pass early (the producer finishes its current batch and ends it)."""
        if self._done:
            return
        self._p._stop.set()
        while True:
            kind, payload = self._p._get(timeout=60)
            if kind in ("end", "error"):
                break
        self._done = True
