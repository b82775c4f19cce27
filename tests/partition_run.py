"""One "machine" of a partitioned run, for tests/test_distributed.py (launched by torchrun, one per machine).

Usage: partition_run.py PARTS_ROOT OUT_DIR [key=value ...]

PARTS_ROOT holds this machine's partition only. Every rank writes ``rank<R>.json``: the seeds it trained per
epoch, whether every batch's rows equalled the unpartitioned dataset's (``reference=ROOT``, read by this
probe only, never by the training), the logged ``ooc/`` metrics and its test accuracy.
"""
from __future__ import annotations

import json
import os
import signal
import sys

import lightning as L
import torch


class Probe(L.Callback):
    def __init__(self, out_dir: str, reference: str | None, kill_after: int | None):
        self.out_dir, self.seeds, self.mismatch, self.checked = out_dir, {}, 0, 0
        self.reference = None
        if reference:
            import lightning_ooc

            self.reference = lightning_ooc.open_dataset(reference)
        self.kill_after = kill_after
        self.steps = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seeds.setdefault(str(trainer.current_epoch), []).extend(batch.n_id[: batch.batch_size].tolist())
        if self.reference is not None:
            want = self.reference.read_features(batch.n_id.cpu())
            self.checked += 1
            self.mismatch += int(not torch.equal(batch.x.cpu(), want))
        self.steps += 1
        if self.kill_after is not None and self.steps >= self.kill_after:
            with open(os.path.join(self.out_dir, "killed"), "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    from lightning_ooc import OutOfCoreNodeData, Partitioned
    from lightning_ooc.models import GraphSAGE

    root, out_dir = sys.argv[1], sys.argv[2]
    opts = dict(a.split("=", 1) for a in sys.argv[3:])
    os.makedirs(out_dir, exist_ok=True)
    machines = int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))) // int(
        os.environ.get("LOCAL_WORLD_SIZE", "1"))  # fmt: skip
    node = int(os.environ.get("GROUP_RANK", "0"))
    L.seed_everything(0, workers=False)
    features = Partitioned(gpu_cache="2MiB", host_cache=opts.get("host_cache", "16KiB"), staging="1MiB",
                           remote_cache=opts.get("remote_cache", "64KiB"),
                           remote_cache_policy=opts.get("policy", "scored"), cache_interval=4,
                           cache_decay=0.9, exchange_timeout=60)  # fmt: skip
    dm = OutOfCoreNodeData(root, batch_size=int(opts.get("batch_size", 100)), num_neighbors=[5, 5],
                           features=features, pipeline=dict(num_samplers=1, num_extractors=2),
                           progress=False)  # fmt: skip
    model = GraphSAGE(dm.num_features, dm.num_classes, hidden_channels=32, num_layers=2, lr=0.01)
    kill = int(opts["kill_after"]) if "kill_after" in opts and node == machines - 1 else None
    probe = Probe(out_dir, opts.get("reference"), kill)
    logger = L.pytorch.loggers.CSVLogger(out_dir, name=f"log{node}")
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        num_nodes=machines, strategy="ddp", max_epochs=int(opts.get("epochs", 2)),
                        logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[probe])  # fmt: skip
    trainer.fit(model, datamodule=dm)
    test = trainer.test(model, datamodule=dm, verbose=False)
    metrics = {k: float(v) for k, v in trainer.logged_metrics.items()}
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "world": trainer.world_size, "seeds": probe.seeds,
                   "checked": probe.checked, "mismatch": probe.mismatch, "test": test[0] if test else {},
                   "metrics": metrics}, f)  # fmt: skip


if __name__ == "__main__":
    main()
