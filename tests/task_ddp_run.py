"""A two-process run of one task under strategy="ooc", for tests/test_multiprocess.py: every rank records the
seeds it trained on per epoch (seed nodes; a link batch's training edges, ``input_id``; the seed papers of a
heterogeneous batch), a checksum of the parameters after each step, and the mapping of every ``indptr`` it
reads, into ``rank<R>.json``.

    python tests/task_ddp_run.py node|link|hetero ROOT OUT_DIR
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

import lightning as L

from ddp_probe import mapping_of


def _seeds(task: str, batch) -> list[int]:
    if task == "link":
        return batch.input_id.tolist()
    if task == "hetero":
        paper = batch["paper"]
        return paper.n_id[: paper.batch_size].tolist()
    return batch.n_id[: batch.batch_size].tolist()


def _indptrs(task: str, ds) -> dict[str, str]:
    if task == "hetero":
        return {"__".join(et): mapping_of(csc.indptr.ctypes.data)["path"]
                for et, csc in ds.csc.items() if csc.indptr.size > 512}  # fmt: skip
    return {"graph": mapping_of(ds.indptr.ctypes.data)["path"]}


class TaskProbe(L.Callback):
    def __init__(self, task: str, out_dir: str):
        self.task, self.out_dir, self.seeds, self.params, self.info = task, out_dir, {}, [], {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.info["indptr"] = _indptrs(self.task, trainer.datamodule.dataset)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seeds.setdefault(trainer.current_epoch, []).extend(_seeds(self.task, batch))
        h = hashlib.sha1()
        for p in pl_module.parameters():
            h.update(p.detach().cpu().numpy().tobytes())
        self.params.append(h.hexdigest())

    def on_train_end(self, trainer, pl_module) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "world": trainer.world_size, "seeds": self.seeds, "params": self.params,
                       **self.info}, f)


def _data_and_model(task: str, root: str):
    from lightning_ooc import OutOfCoreLinkData, OutOfCoreNodeData, Tiered
    from lightning_ooc.models import RSAGE, GraphSAGE, LinkPredictor

    small = dict(features=Tiered(gpu_cache="4MiB", host_cache="64KiB", staging="1MiB"),
                 pipeline=dict(num_samplers=1, num_extractors=1), progress=False)  # fmt: skip
    if task == "link":
        dm = OutOfCoreLinkData(root, batch_size=200, num_neighbors=[5, 5], neg_sampling="binary", **small)
        return dm, LinkPredictor(in_channels=dm.num_features, hidden_channels=16, num_layers=2, lr=0.01)
    if task == "hetero":
        dm = OutOfCoreNodeData(root, batch_size=100, num_neighbors=[4, 3], **small)
        return dm, RSAGE(dm.metadata, dm.in_channels, dm.num_classes, hidden_channels=16, num_layers=2, lr=0.01)
    dm = OutOfCoreNodeData(root, batch_size=100, num_neighbors=[4, 3], **small)
    return dm, GraphSAGE(dm.num_features, dm.num_classes, hidden_channels=16, num_layers=2, lr=0.01)


def main() -> None:
    task, root, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    L.seed_everything(0, workers=False)
    dm, model = _data_and_model(task, root)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ooc", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[TaskProbe(task, out_dir)])  # fmt: skip
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
