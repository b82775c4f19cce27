"""A two-process heterogeneous run for tests/test_hetero_data.py: every rank records the seed papers it
trained on (``n_id`` of the seed type) and a checksum of the parameters after each step into ``rank<R>.json``,
and whether each relation's ``indptr`` lives in a shared segment."""
from __future__ import annotations

import hashlib
import json
import os
import sys

import lightning as L

from ddp_probe import mapping_of


class SeedProbe(L.Callback):
    def __init__(self, out_dir: str):
        self.out_dir, self.seeds, self.params, self.info = out_dir, {}, [], {}

    def on_train_start(self, trainer, pl_module) -> None:
        ds = trainer.datamodule.dataset
        self.info["indptr"] = {"__".join(et): mapping_of(csc.indptr.ctypes.data)["path"]
                               for et, csc in ds.csc.items() if csc.indptr.size > 512}  # fmt: skip

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        paper = batch["paper"]
        self.seeds.setdefault(trainer.current_epoch, []).extend(paper.n_id[: paper.batch_size].tolist())
        h = hashlib.sha1()
        for p in pl_module.parameters():
            h.update(p.detach().cpu().numpy().tobytes())
        self.params.append(h.hexdigest())

    def on_train_end(self, trainer, pl_module) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "world": trainer.world_size, "seeds": self.seeds, "params": self.params,
                       **self.info}, f)


def main() -> None:
    from lightning_ooc import OutOfCoreHeteroNodeData
    from lightning_ooc.models import RSAGE

    root, out_dir = sys.argv[1], sys.argv[2]
    L.seed_everything(0, workers=False)
    dm = OutOfCoreHeteroNodeData(root, batch_size=100, num_neighbors=[4, 3], gpu_cache="4MiB", host_cache="64KiB",
                                 staging="1MiB", num_samplers=1, num_extractors=1, progress=False)
    model = RSAGE(dm.metadata, dm.in_channels, dm.num_classes, hidden_channels=16, num_layers=2, lr=0.01)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ooc", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[SeedProbe(out_dir)])  # fmt: skip
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
