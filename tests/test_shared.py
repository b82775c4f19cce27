"""Node-local shared segments (lightning_ooc.strategy.shared) with ranks played by threads."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from lightning_ooc.strategy.shared import PREFIX, NodeShared, SharedMemoryError


class _AllGather:
    """An all-gather among ``world`` threads (what the strategy does over torch.distributed)."""

    def __init__(self, world: int):
        self.world = world
        self.slots: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def fn(self, rank: int):
        def exchange(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return exchange


def _run_ranks(world: int, body, shm_dir: str) -> list:
    """Run ``body(shared)`` on ``world`` local ranks (threads); returns each rank's result or exception."""
    gather = _AllGather(world)
    results: list = [None] * world

    def rank(r: int) -> None:
        shared = NodeShared("t", r, world, exchange=gather.fn(r), shm_dir=shm_dir)
        try:
            results[r] = body(shared)
        except Exception as e:
            results[r] = e
        finally:
            shared.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return results


def test_a_fill_that_fails_while_viewing_the_segment_fails_every_rank_cleanly(tmp_path):
    """A corrupt ``indptr`` found while filling (the check raises with the array still in its frame): the creating
    rank raises that error, not ``BufferError``, the other rank a ``SharedMemoryError``, and nothing is left."""

    class Corrupt(ValueError):
        pass

    def fill(out: np.ndarray) -> None:
        out[:] = 7
        view = out[1:]  # noqa: F841 (held by the traceback, as the dataset's indptr check holds its chunk)
        raise Corrupt("indptr.npy: not monotone")

    results = _run_ranks(2, lambda sh: sh.array("indptr", (1000,), np.int64, fill=fill), str(tmp_path))
    assert isinstance(results[0], Corrupt), results[0]
    assert isinstance(results[1], SharedMemoryError) and "indptr.npy: not monotone" in str(results[1])
    assert not [n for n in os.listdir(tmp_path) if n.startswith(PREFIX)]


def test_every_rank_maps_the_same_filled_segment(tmp_path):
    def body(sh):
        arr = sh.array("a", (4,), np.int64, fill=lambda out: out.__setitem__(slice(None), [1, 2, 3, 4]))
        return arr.tolist()

    assert _run_ranks(3, body, str(tmp_path)) == [[1, 2, 3, 4]] * 3
    assert not [n for n in os.listdir(tmp_path) if n.startswith(PREFIX)]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
