"""Train GraphSAGE with one process per device: `strategy="ooc"` and a plain lightning.Trainer.

    python examples/train_ddp.py data/demo --devices 2                 # two CPU processes
    python examples/train_ddp.py data/papers --accelerator gpu --devices 4 --mps-split 10

Lightning starts this script again once per further device; every process
builds its own datamodule, trains a disjoint share of the seeds each epoch and
maps the machine's single copy of the topology. Rank 0 prints the result.

The `if __name__ == "__main__":` guard at the end is required: the processes
Lightning starts for the other devices, and the gather producers of
`mps_split` (started with the `spawn` method), import this file again, and
without the guard each of them would start training too.
"""
import argparse

import lightning as L

from lightning_ooc import OutOfCoreNodeData, OutOfCoreStrategy, Tiered
from lightning_ooc.callbacks import RunReport
from lightning_ooc.models import GraphSAGE

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--mps-split", type=int, default=None, help="percent of SMs for the gather (GPUs with CUDA MPS)")
    args = p.parse_args()

    L.seed_everything(0)
    dm = OutOfCoreNodeData(args.root, batch_size=256, num_neighbors=[10, 10],
                           features=Tiered(gpu_cache="64MiB", host_cache="4MiB", staging="8MiB"),
                           pipeline={"num_samplers": 2, "num_extractors": 2})
    model = GraphSAGE(dm.num_features, dm.num_classes, hidden_channels=128, num_layers=2, lr=0.005)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=OutOfCoreStrategy(mps_split=args.mps_split),
                        max_epochs=args.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        callbacks=[RunReport()])
    trainer.fit(model, datamodule=dm)
    trainer.test(model, datamodule=dm, verbose=False)


if __name__ == "__main__":  # required: each further process imports this file again (spawn)
    main()
