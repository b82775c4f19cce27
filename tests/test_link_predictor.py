"""LinkPredictor: its ranking metrics against a direct computation, and that it learns planted links."""
import warnings

import pytest
import torch
from torch_geometric.data import Data

from torchmetrics.classification import BinaryAUROC

from lightning_ooc.models import LinkPredictor
from lightning_ooc.models.link_predictor import positive_ranks, random_mrr


def test_ranks_and_the_random_scorer():
    assert positive_ranks(torch.tensor([3.0, 1.0]), torch.tensor([[1.0, 2.0], [1.0, 5.0]])).tolist() == [1, 2.5]
    assert positive_ranks(torch.zeros(1), torch.zeros(1, 20)).tolist() == [11.0]  # all tied: the middle (OGB)
    assert random_mrr(1) == pytest.approx(0.75) and random_mrr(0) == 1.0
    g = torch.Generator().manual_seed(0)
    pos, neg = torch.rand(20000, generator=g), torch.rand(20000, 9, generator=g)  # scores of a random scorer
    assert (1.0 / positive_ranks(pos, neg)).mean().item() == pytest.approx(random_mrr(9), abs=0.01)


def test_ranking_metrics_equal_a_direct_computation(monkeypatch):
    model = LinkPredictor(in_channels=4, hidden_channels=8, num_layers=1, hits_at=(1, 3))
    g = torch.Generator().manual_seed(1)
    pos, neg = torch.randn(12, generator=g).round(), torch.randn(12, 5, generator=g).round()  # with ties
    batches = [Data(dst_neg_index=torch.zeros(7, 5)), Data(dst_neg_index=torch.zeros(5, 5))]
    parts = iter([(pos[:7], neg[:7]), (pos[7:], neg[7:])])
    monkeypatch.setattr(model, "score_triplets", lambda batch: next(parts))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        for i, b in enumerate(batches):
            model.validation_step(b, i)
    got = {k: v.compute().item() for k, v in model.val_ranking.items()}
    # by hand: OGB's rank, a tie counting half
    ranks = torch.tensor([1 + sum(float(n > p) + 0.5 * float(n == p) for n in row) for p, row in zip(pos, neg)])
    assert got["mrr"] == pytest.approx((1 / ranks).mean().item())
    assert got["hits@1"] == pytest.approx((ranks <= 1).double().mean().item())
    assert got["hits@3"] == pytest.approx((ranks <= 3).double().mean().item())
    assert model.val_auc.compute().item() == pytest.approx(
        BinaryAUROC()(torch.cat([pos, neg.reshape(-1)]), torch.cat([torch.ones(12), torch.zeros(60)]).long()).item())


def _planted(n=400, groups=20, dim=24, seed=0):
    """Nodes in communities; edges mostly inside one; features a noisy community code."""
    g = torch.Generator().manual_seed(seed)
    comm = torch.arange(n) % groups
    x = torch.nn.functional.one_hot(comm, dim).float() + 0.5 * torch.randn(n, dim, generator=g)
    src = torch.randint(n, (4 * n,), generator=g)
    same = torch.rand(4 * n, generator=g) < 0.9
    other = torch.randint(n, (4 * n,), generator=g)
    pick = torch.randint(n // groups, (4 * n,), generator=g) * groups + comm[src]  # a node of src's community
    dst = torch.where(same, pick, other)
    keep = src != dst
    return x, torch.stack([src[keep], dst[keep]]), comm


def _triplets(edge_index, n, k, seed, ids):
    g = torch.Generator().manual_seed(seed)
    b = edge_index.shape[1]
    return dict(src_index=edge_index[0], dst_pos_index=edge_index[1], dst_neg_index=torch.randint(n, (b, k), generator=g),
                input_id=ids)  # fmt: skip


@pytest.mark.parametrize("decoder", ["dot", "mlp"])
def test_it_learns_planted_links_far_above_a_random_scorer(decoder):
    torch.manual_seed(0)
    x, edges, _ = _planted()
    n = x.shape[0]
    train, held = edges[:, :1200], edges[:, 1200:1400]
    model = LinkPredictor(in_channels=x.shape[1], hidden_channels=32, num_layers=2, decoder=decoder, lr=0.01)
    opt = model.configure_optimizers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(60):  # full-batch steps, alternating the two batch kinds
            if step % 2:
                batch = Data(x=x, edge_index=train, **_triplets(train, n, 1, step, torch.arange(train.shape[1])))
            else:
                neg = torch.randint(n, (2, train.shape[1]))
                batch = Data(x=x, edge_index=train, edge_label_index=torch.cat([train, neg], 1),
                             edge_label=torch.cat([torch.ones(train.shape[1]), torch.zeros(train.shape[1])]))  # fmt: skip
            opt.zero_grad()
            loss = model.training_step(batch, step)
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            model.validation_step(Data(x=x, edge_index=train, **_triplets(held, n, 20, 99, torch.arange(200))), 0)
    mrr = model.val_ranking["mrr"].compute().item()
    assert mrr > 2.5 * random_mrr(20), (mrr, random_mrr(20))
    assert model.val_auc.compute().item() > 0.8
