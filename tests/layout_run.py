"""One "machine" of tests/test_distributed.py's set-up checks: ``layout_run.py OUT NAME=ROOT0,ROOT1 ...`` under
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, one process per machine.

The datamodule runs in a context like the "ooc" strategy's: the machine's shared memory for the topology,
whose creation is a collective. For each ``NAME=ROOTS`` in turn, this process sets up ``OutOfCoreNodeData``
on its root and records what it raised; ``OUT/rank<R>.json`` gets ``{NAME: [error type, message]}``.
"""
from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from lightning_ooc import OutOfCoreNodeData, Partitioned
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.strategy.shared import NodeShared


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def exchange(obj):
        got = [None] * world
        dist.all_gather_object(got, obj)
        return got

    shared = NodeShared(f"layout{os.environ['MASTER_PORT']}", local_rank=0, local_world=1, exchange=exchange,
                        node=rank)  # fmt: skip
    ctx = ProcessContext(rank=rank, world=world, topology=shared)

    class Data(OutOfCoreNodeData):
        context = property(lambda self: ctx)

    results = {}
    for arg in sys.argv[2:]:
        name, roots = arg.split("=", 1)
        dm = Data(roots.split(",")[rank], batch_size=100, num_neighbors=[3], progress=False,
                  features=Partitioned(gpu_cache="1MiB", host_cache="16KiB", staging="256KiB", exchange_timeout=30),
                  pipeline=dict(num_samplers=1, num_extractors=1))  # fmt: skip
        try:
            dm.setup("fit")
            results[name] = None
            dm.teardown("fit")
        except Exception as e:  # noqa: BLE001 - what each process saw is the result
            results[name] = [type(e).__name__, str(e)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    shared.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
