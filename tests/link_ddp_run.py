"""A two-process link-prediction run for tests/test_link_strategy.py: every rank records the training
edges it was given (``input_id``) and a checksum of the parameters after each step into ``rank<R>.json``."""
from __future__ import annotations

import hashlib
import json
import os
import sys

import lightning as L


class EdgeProbe(L.Callback):
    def __init__(self, out_dir: str):
        self.out_dir, self.edges, self.params = out_dir, {}, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.edges.setdefault(trainer.current_epoch, []).extend(batch.input_id.tolist())
        h = hashlib.sha1()
        for p in pl_module.parameters():
            h.update(p.detach().cpu().numpy().tobytes())
        self.params.append(h.hexdigest())

    def on_train_end(self, trainer, pl_module) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "world": trainer.world_size, "edges": self.edges, "params": self.params}, f)


def main() -> None:
    from lightning_ooc import OutOfCoreLinkData
    from lightning_ooc.models import LinkPredictor

    root, out_dir = sys.argv[1], sys.argv[2]
    L.seed_everything(0, workers=False)
    dm = OutOfCoreLinkData(root, batch_size=200, num_neighbors=[5, 5], neg_sampling="binary", gpu_cache="4MiB",
                           host_cache="64KiB", staging="1MiB", num_samplers=1, num_extractors=1, progress=False)
    model = LinkPredictor(in_channels=dm.num_features, hidden_channels=16, num_layers=2, lr=0.01)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ooc", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[EdgeProbe(out_dir)])  # fmt: skip
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
