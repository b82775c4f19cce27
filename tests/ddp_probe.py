"""A callback the multi-process tests load into `lightning-ooc fit` runs: it records, per rank,
what the tests check (seeds trained per epoch, a checksum of the parameters after every optimizer
step, how the topology is mapped) into ``<out_dir>/rank<R>.json``."""
from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys
import time

import lightning as L


def mapping_of(address: int) -> dict:
    """The /proc/self/smaps entry holding ``address``: its path and Size/Rss/Pss in bytes."""
    entry: dict | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                if entry is not None:
                    break  # the next mapping starts: the one holding the address is complete
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                if lo <= address < hi:
                    entry = {"path": " ".join(head[5:]), "lo": lo, "hi": hi}
            elif entry is not None and head[0] in ("Size:", "Rss:", "Pss:", "Private_Clean:", "Private_Dirty:"):
                entry[head[0][:-1]] = int(head[1]) * 1024
    return entry or {}


# A test that finds a run hanging sends SIGUSR1 first: every thread's stack goes to the run's output.
faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


class Probe(L.Callback):
    def __init__(self, out_dir: str, stall_after_step: int = -1, stall_rank: int = -1):
        self.out_dir = out_dir
        self.stall_after_step = stall_after_step
        self.stall_rank = stall_rank
        self.seeds: dict[int, list[int]] = {}
        self.params: list[str] = []
        self.info: dict = {}

    def _dump(self, trainer) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "world": trainer.world_size, "seeds": self.seeds,
                       "params": self.params, **self.info}, f)
        os.replace(path + ".tmp", path)

    def on_train_start(self, trainer, pl_module) -> None:
        dm = trainer.datamodule
        indptr = dm.dataset.indptr
        self.info["indptr"] = {"bytes": int(indptr.nbytes), **mapping_of(indptr.ctypes.data)}
        if dm.store is not None:  # None when the store lives in a gather producer (mps_split)
            self.info["staging"] = mapping_of(dm.store.tier("ssd").staging.memory.data_ptr())
        self.info["node_rank"] = trainer.node_rank
        self.info["root"] = str(dm.dataset.root)
        self._dump(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        epoch = trainer.current_epoch
        self.seeds.setdefault(epoch, []).extend(batch.n_id[: batch.batch_size].tolist())
        h = hashlib.sha1()
        for p in pl_module.parameters():
            h.update(p.detach().cpu().numpy().tobytes())
        self.params.append(f"{trainer.global_step}:{h.hexdigest()}")
        self._dump(trainer)
        stall = self.stall_rank in (-1, trainer.global_rank)
        if stall and 0 <= self.stall_after_step <= trainer.global_step:
            self.info["stalled"] = True
            self._dump(trainer)
            while True:  # hold the run here so the test can kill or interrupt it mid-training
                time.sleep(0.5)

    def on_train_end(self, trainer, pl_module) -> None:
        self.info["done"] = True
        self._dump(trainer)
