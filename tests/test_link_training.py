"""Link prediction end to end: out of core equals all features in memory (in order), far above chance."""
import lightning as L
import numpy as np
import pytest
import torch

from lightning_ooc import InMemory, OutOfCoreLinkData, Tiered
from lightning_ooc.data.prepare import prepare_from_arrays
from lightning_ooc.models import LinkPredictor
from lightning_ooc.models.link_predictor import random_mrr

K = 20  # given negatives per val/test edge, the ranking's


@pytest.fixture(scope="module")
def communities(tmp_path_factory):
    """600 nodes in 30 communities; 90% of the links inside one; features a noisy community code.

    Val and test edges (10% each) are left out of the graph, each with K given negative destinations.
    """
    rng = np.random.default_rng(0)
    n, groups = 600, 30
    comm = np.arange(n) % groups
    x = (np.eye(32, dtype=np.float32)[comm] + 0.5 * rng.standard_normal((n, 32))).astype(np.float32)
    src = rng.integers(0, n, 4 * n)
    inside = rng.integers(0, n // groups, 4 * n) * groups + comm[src]
    dst = np.where(rng.random(4 * n) < 0.9, inside, rng.integers(0, n, 4 * n))
    pairs = np.unique(np.stack([src, dst], 1)[src != dst], axis=0)
    pairs = pairs[rng.permutation(len(pairs))]
    m = len(pairs) // 10
    val, test, train = pairs[:m], pairs[m : 2 * m], pairs[2 * m :]
    splits = {"train": train.T, "val": {"index": val.T, "neg_dst": rng.integers(0, n, (m, K))},
              "test": {"index": test.T, "neg_dst": rng.integers(0, n, (m, K))}}  # fmt: skip
    return prepare_from_arrays(tmp_path_factory.mktemp("links") / "g", train.T, x, link_splits=splits,
                               progress=False)  # fmt: skip


def _fit(root, features):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU's scatter-adds sum in thread order: one thread, one order
    try:
        L.seed_everything(0, workers=False)
        dm = OutOfCoreLinkData(root, batch_size=128, num_neighbors=[5, 5], neg_sampling="triplet", features=features,
                               pipeline=dict(order="in_order", num_samplers=2, num_extractors=2), seed=0,
                               progress=False)  # fmt: skip
        model = LinkPredictor(in_channels=32, hidden_channels=32, num_layers=2, lr=0.01, hits_at=(1, 10))
        misses = []

        class SsdReads(L.Callback):  # rows each validation pass read from the SSD tier (it reads past the buffer)
            def on_validation_epoch_end(self, trainer, pl_module):
                misses.append(dm.last_stats["val"].io.misses)

        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=4, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            callbacks=[SsdReads()])  # fmt: skip
        trainer.fit(model, datamodule=dm)
        return {k: float(v) for k, v in trainer.callback_metrics.items()}, misses
    finally:
        torch.set_num_threads(threads)


def test_out_of_core_link_training_equals_features_in_memory_and_beats_chance(communities):
    ours, misses = _fit(communities, Tiered(gpu_cache="1MiB", host_cache="16KiB", staging="256KiB"))
    ref, none = _fit(communities, InMemory())
    assert len(misses) == 4 and min(misses) > 0 and none == [0] * 4  # ours read rows from the SSD tier
    for key in ("val_mrr", "val_hits@1", "val_hits@10", "val_auc", "train_loss"):
        assert ours[key] == ref[key], (key, ours[key], ref[key])  # in order: the same numbers
    assert ours["val_mrr"] > 2.5 * random_mrr(K), (ours["val_mrr"], random_mrr(K))
