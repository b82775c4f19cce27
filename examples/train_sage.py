"""Train GraphSAGE on an on-disk dataset with OutOfCoreNodeData and a plain lightning.Trainer.

    python examples/train_sage.py data/demo --epochs 3

Prints the feature-store plan, then test accuracy and training throughput,
beside an MLP trained on the features alone.
"""
import argparse
import logging
import time

import lightning as L

from lightning_ooc import Mapped, OutOfCoreNodeData, Tiered
from lightning_ooc.models import MLP, GraphSAGE

def run(model_cls, dm, args, fanout):
    L.seed_everything(0, workers=False)
    dm.setup("fit")
    ds = dm.dataset
    model = model_cls(ds.num_features, ds.num_classes, hidden_channels=128, num_layers=len(fanout), lr=0.005)
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    seconds = time.perf_counter() - t0
    acc = trainer.test(model, datamodule=dm, verbose=False)[0]["test_acc"]
    seeds = len(ds.split("train")) * args.epochs
    return acc, seeds / seconds, dm.last_stats.get("train")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--fanout", default="10,10")
    p.add_argument("--order", default="out_of_order", choices=["out_of_order", "in_order"])
    p.add_argument("--gpu-cache", default="64MiB", help="feature buffer (host memory when training on CPU)")
    p.add_argument("--host-cache", default="4MiB")
    p.add_argument("--staging", default="8MiB")
    p.add_argument("--accelerator", default="auto")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("lightning", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.WARNING)
    fanout = [int(f) for f in args.fanout.split(",")]
    common = dict(batch_size=args.batch_size, num_neighbors=fanout, progress=True)
    tiers = Tiered(gpu_cache=args.gpu_cache, host_cache=args.host_cache, staging=args.staging)
    sage_acc, sage_rate, stats = run(GraphSAGE, OutOfCoreNodeData(
        args.root, features=tiers, pipeline={"order": args.order}, **common), args, fanout)
    # the MLP reads every row from RAM in the training loop: it needs no cache
    mlp_acc, _, _ = run(MLP, OutOfCoreNodeData(args.root, features=Mapped(in_ram=True), **common), args, fanout)
    print()
    print(f"GraphSAGE (OutOfCoreNodeData, {args.order}): test accuracy {sage_acc:.3f}, "
          f"{sage_rate:,.0f} training seeds/s over {args.epochs} epochs")
    if stats is not None:
        m = stats.as_metrics(0)
        print(f"  last epoch: {m['batches_per_s']:.1f} batches/s, rows from host cache {m['host_cache_hit_rate']:.0%}, "
              f"feature buffer {m['buffer_hit_rate']:.0%}, SSD {m['ssd_row_rate']:.0%} (read amplification "
              f"{m['read_amplification']:.2f}), trainer waited {m['trainer_wait_frac']:.0%} of the time")
    print(f"MLP on features alone: test accuracy {mlp_acc:.3f}")


if __name__ == "__main__":  # required where processes are spawned: they import this file again
    main()
