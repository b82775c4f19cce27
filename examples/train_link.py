"""Train a link predictor on an on-disk dataset with OutOfCoreLinkData and a plain lightning.Trainer.

    python examples/train_link.py data/links --make 20000   # first make a graph with planted communities
    python examples/train_link.py data/links --epochs 3

The dataset needs link splits (``lightning-ooc prepare ... --split-edges 0.85,0.05,0.10`` for your
own graph; ``--make N`` writes one of N nodes in communities, whose links mostly stay inside one, with
val/test edges left out of the graph and 20 given negatives per val/test edge). Prints the
feature-store plan, then test MRR and Hits@K of a GraphSAGE encoder with a dot-product decoder,
beside what a random scorer gets.
"""
import argparse
import logging
import time

import lightning as L
import numpy as np

from lightning_ooc import OutOfCoreLinkData, Tiered
from lightning_ooc.data.prepare import prepare_from_arrays
from lightning_ooc.models import LinkPredictor
from lightning_ooc.models.link_predictor import random_mrr

NEGATIVES = 20


def make_graph(root: str, n: int, dim: int = 32, seed: int = 0) -> None:
    """N nodes in communities of 20; 90 % of the links inside one; features a noisy community code."""
    rng = np.random.default_rng(seed)
    groups = max(1, n // 20)
    comm = np.arange(n) % groups
    code = rng.standard_normal((groups, dim)).astype(np.float32)
    x = (code[comm] + 0.5 * rng.standard_normal((n, dim))).astype(np.float32)
    m = 4 * n
    src = rng.integers(0, n, m)
    dst = np.where(rng.random(m) < 0.9, rng.integers(0, n // groups, m) * groups + comm[src], rng.integers(0, n, m))
    pairs = np.unique(np.stack([src, dst], 1)[src != dst], axis=0)
    pairs = pairs[rng.permutation(len(pairs))]
    k = len(pairs) // 10
    val, test, train = pairs[:k], pairs[k : 2 * k], pairs[2 * k :]
    splits = {"train": train.T, "val": {"index": val.T, "neg_dst": rng.integers(0, n, (k, NEGATIVES))},
              "test": {"index": test.T, "neg_dst": rng.integers(0, n, (k, NEGATIVES))}}  # fmt: skip
    prepare_from_arrays(root, train.T, x, link_splits=splits, overwrite=True, progress=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--make", type=int, metavar="N", help="write a planted-community graph of N nodes to ROOT and exit")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=512, help="supervision edges per minibatch")
    p.add_argument("--fanout", default="10,5")
    p.add_argument("--neg-sampling", default="triplet", choices=["binary", "triplet"])
    p.add_argument("--order", default="out_of_order", choices=["out_of_order", "in_order"])
    p.add_argument("--gpu-cache", default="64MiB", help="feature buffer (host memory when training on CPU)")
    p.add_argument("--host-cache", default="4MiB")
    p.add_argument("--staging", default="8MiB")
    p.add_argument("--accelerator", default="auto")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("lightning", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.make:
        make_graph(args.root, args.make)
        return
    fanout = [int(f) for f in args.fanout.split(",")]
    L.seed_everything(0, workers=False)
    dm = OutOfCoreLinkData(args.root, batch_size=args.batch_size, num_neighbors=fanout, neg_sampling=args.neg_sampling,
                           features=Tiered(gpu_cache=args.gpu_cache, host_cache=args.host_cache, staging=args.staging),
                           pipeline={"order": args.order})  # fmt: skip
    dm.setup("fit")
    model = LinkPredictor(dm.dataset.num_features, hidden_channels=64, num_layers=len(fanout), lr=0.01)
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    seconds = time.perf_counter() - t0
    test = trainer.test(model, datamodule=dm, verbose=False)[0]
    edges = dm.dataset.link_splits["splits"]["train"]["edges"] * args.epochs
    print()
    if "test_mrr" in test:
        k = dm.dataset.link_split("test").neg_dst
        k = k.shape[1] if k is not None else int(dm.config.negatives.amount)
        print(f"LinkPredictor (OutOfCoreLinkData, {args.order}): test MRR {test['test_mrr']:.3f} (random scorer "
              f"{random_mrr(k):.3f} with {k} negatives), Hits@1 {test['test_hits@1']:.3f}, Hits@10 "
              f"{test['test_hits@10']:.3f}, AUC {test['test_auc']:.3f}")  # fmt: skip
    else:
        print(f"LinkPredictor (OutOfCoreLinkData, {args.order}): test AUC {test['test_auc']:.3f}")
    print(f"  {edges / seconds:,.0f} training edges/s over {args.epochs} epochs")


if __name__ == "__main__":
    main()
