"""Link prediction as a LightningModule: a GraphSAGE encoder, a dot-product or MLP decoder, ranking metrics.

:class:`LinkPredictor` consumes minibatches shaped like PyG
``LinkNeighborLoader`` output, so it trains on ``OutOfCoreLinkData`` and on
PyG's own loader alike:

* binary batches: ``edge_label_index`` (``[2, P]`` local ids) and
  ``edge_label`` (``> 0``: a positive edge; PyG shifts given labels by one
  under binary negative sampling, so ``0`` is always a negative);
* triplet batches: ``src_index`` ``[B]``, ``dst_pos_index`` ``[B]`` and
  ``dst_neg_index`` ``[B]`` or ``[B, K]``.

Training minimises binary cross-entropy over the positive and negative
pairs. Evaluation ranks every positive against its own negatives (triplet
batches) on the raw scores, in their own dtype (float64 scores are compared
as float64): ``val_mrr`` / ``test_mrr`` is the mean reciprocal of the rank
that counts a tie half (:func:`~lightning_ooc.models.ranking.positive_ranks`;
ogbl-citation2's evaluator: the mean of the optimistic and the pessimistic
rank), and ``val_hits@K`` / ``test_hits@K`` follow ``hits_ties``
(:data:`~lightning_ooc.models.ranking.HITS_TIES`): ``"pessimistic"``
(the default) counts a positive as a hit when fewer than ``K`` of its
negatives score at least as high as it (ogbl-collab's, ddi's and ppa's
evaluator: ``pos > kth_neg``, a tie with the ``K``-th negative is a miss),
``"average"`` ranks it with ties counted half, as ogbl-citation2's evaluator
does for its Hits@K (:mod:`lightning_ooc.models.ranking`, which the KGE
models rank with too). The means over the positives are kept by torchmetrics
(``MeanMetric``, synchronised across processes). Every batch also logs
``val_auc`` over its positive and negative pairs (:class:`RankAUROC`: the
Mann-Whitney statistic of the raw scores, ties counted half, as
scikit-learn's ``roc_auc_score``; ``BinaryAUROC`` is not used: it squashes
logits through a float32 sigmoid, which is exactly 1.0 above about 17, so
large scores tie). ``torchmetrics.retrieval`` is not used either: it takes a
score <= 0 for "not retrieved" and breaks ties by position. A random scorer
has an expected MRR of ``H(K + 1) / (K + 1)`` with ``K`` negatives per
positive (:func:`~lightning_ooc.models.ranking.random_mrr`).

Example::

    >>> import torch
    >>> from torch_geometric.data import Data
    >>> from lightning_ooc.models import LinkPredictor
    >>> model = LinkPredictor(in_channels=8, hidden_channels=16, num_layers=2)
    >>> batch = Data(x=torch.randn(6, 8), edge_index=torch.tensor([[1, 2, 3, 4], [0, 0, 1, 5]]),
    ...              src_index=torch.tensor([0, 1]), dst_pos_index=torch.tensor([2, 3]),
    ...              dst_neg_index=torch.tensor([[4, 5], [5, 4]]), input_id=torch.tensor([10, 11]))
    >>> model.training_step(batch, 0).shape
    torch.Size([])
    >>> pos, neg = model.score_triplets(batch)
    >>> pos.shape, neg.shape
    (torch.Size([2]), torch.Size([2, 2]))
"""
from __future__ import annotations

from typing import Any, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import models as pyg_models
from torchmetrics import MeanMetric, Metric
from torchmetrics.utilities import dim_zero_cat

from lightning_ooc.errors import InputError
from lightning_ooc.infer.model import basic_gnn_between
from lightning_ooc.models import checks
from lightning_ooc.models.ranking import HITS_TIES, positive_ranks, random_mrr, rank_metrics

__all__ = ["LinkPredictor", "RankAUROC", "rank_auc", "DECODERS", "HITS_TIES", "positive_ranks", "random_mrr"]

#: how :class:`LinkPredictor` scores a pair of embeddings
DECODERS = ("dot", "mlp")


def rank_auc(scores: Tensor, labels: Tensor) -> Tensor:
    """The area under the ROC curve of raw ``scores`` against 0/1 ``labels``: the Mann-Whitney statistic of the
    scores' ranks, tied scores sharing their average rank (scikit-learn's ``roc_auc_score``), in float64.

    NaN where ``labels`` hold one class only (the area is not defined).

    >>> rank_auc(torch.tensor([30.0, 31.0, 29.0, 31.0]), torch.tensor([1, 1, 0, 0])).item()  # logits > 17
    0.625
    """
    scores, labels = scores.reshape(-1), labels.reshape(-1)
    if scores.device.type == "mps":  # no float64 there
        scores, labels = scores.cpu(), labels.cpu()
    scores = scores.detach().to(torch.float64)  # exact for every float dtype up to float64
    sorted_scores, order = torch.sort(scores)
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    ranks = (ends - (counts.to(torch.float64) - 1) / 2)[inverse]  # 1-based, ties averaged
    positive = labels[order] > 0
    n_pos = positive.sum().to(torch.float64)
    n_neg = float(labels.numel()) - n_pos
    if n_pos == 0 or n_neg == 0:
        return torch.tensor(float("nan"), dtype=torch.float64, device=scores.device)
    return (ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


class RankAUROC(Metric):
    """Binary AUROC of raw scores (:func:`rank_auc`): every score and label of the epoch kept as given
    (float64 stays float64) and ranked at :meth:`compute`, gathered across processes.

    >>> auc = RankAUROC()
    >>> auc.update(torch.tensor([30.0, 31.0]), torch.tensor([1, 1]))
    >>> auc.update(torch.tensor([29.0, 31.0]), torch.tensor([0, 0]))
    >>> auc.compute().item()
    0.625
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.add_state("scores", default=[], dist_reduce_fx="cat")
        self.add_state("labels", default=[], dist_reduce_fx="cat")

    def update(self, scores: Tensor, labels: Tensor) -> None:
        scores = scores.detach().reshape(-1)
        self.scores.append(scores if scores.is_floating_point() else scores.to(torch.float64))
        self.labels.append(labels.detach().reshape(-1).to(torch.int8))

    def compute(self) -> Tensor:
        if isinstance(self.scores, list) and not self.scores:  # nothing seen
            return torch.tensor(float("nan"), dtype=torch.float64)
        return rank_auc(dim_zero_cat(self.scores), dim_zero_cat(self.labels))


class LinkPredictor(L.LightningModule):
    """GraphSAGE node embeddings scored pairwise: ``dot`` (``<h_s, h_d>``) or ``mlp`` (an MLP on ``h_s * h_d``).

    Args:
        in_channels: feature dimension (``dataset.num_features``).
        hidden_channels: width of the hidden layers and of the embeddings.
        num_layers: message-passing layers (use as many as sampling hops).
        decoder: ``"dot"`` or ``"mlp"``.
        dropout: dropout between layers.
        lr, weight_decay: Adam settings.
        hits_at: the ``K`` of the Hits@K metrics.
        hits_ties: how Hits@K counts a positive tied with negatives (:data:`HITS_TIES`): ``"pessimistic"``
            (a tie with the ``K``-th negative is a miss: ogbl-collab's, ddi's and ppa's evaluator) or
            ``"average"`` (ties count half, as in the MRR: ogbl-citation2's evaluator).
        num_classes: not used (link prediction has no classes); ``lightning-ooc fit`` links every
            model's ``num_classes`` to the dataset's, so the model takes it and ignores it.
    
    The embeddings of a batch's nodes (``forward``); a training step scores the batch's
    ``edge_label_index`` pairs against ``edge_label``, or ranks triplets::

        >>> import torch
        >>> model = LinkPredictor(in_channels=8, hidden_channels=16, num_layers=2)
        >>> model(torch.randn(4, 8), torch.tensor([[1, 2, 3], [0, 0, 1]])).shape
        torch.Size([4, 16])
    """

    def __init__(
        self,
        in_channels: int,
        hidden_channels: int = 256,
        num_layers: int = 3,
        decoder: str = "dot",
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        hits_at: Sequence[int] = (1, 10),
        hits_ties: str = "pessimistic",
        num_classes: int | None = None,
    ):
        super().__init__()
        decoder = checks.choice("decoder", decoder, DECODERS)
        hits_ties = checks.choice("hits_ties", hits_ties, HITS_TIES)
        in_channels = checks.in_channels(in_channels)
        hidden_channels = checks.count("hidden_channels", hidden_channels, 1, "width of the layers and embeddings")
        num_layers = checks.count("num_layers", num_layers, 1, "message-passing layers, as many as sampling hops")
        dropout = checks.dropout(dropout)
        checks.rate("lr", lr)
        checks.rate("weight_decay", weight_decay, zero=True)
        try:
            hits = [checks.count("hits_at", k, 1, "the K of Hits@K") for k in hits_at]
        except TypeError:
            hits = []
        if not hits or len(set(hits)) != len(hits):
            raise InputError(f"hits_at must be a non-empty list of distinct counts >= 1 (the K of Hits@K), got "
                             f"{hits_at!r}")  # fmt: skip
        self.save_hyperparameters()
        self.encoder = pyg_models.GraphSAGE(in_channels=in_channels, hidden_channels=hidden_channels,
                                            num_layers=num_layers, dropout=dropout)  # fmt: skip
        self.mlp = (nn.Sequential(nn.Linear(hidden_channels, hidden_channels), nn.ReLU(),
                                  nn.Linear(hidden_channels, 1)) if decoder == "mlp" else None)  # fmt: skip
        self.hits_at = hits
        self.hits_ties = hits_ties
        for stage in ("val", "test"):
            ranking = {"mrr": MeanMetric()} | {f"hits@{k}": MeanMetric() for k in hits}
            setattr(self, f"{stage}_ranking", nn.ModuleDict(ranking))
            setattr(self, f"{stage}_auc", RankAUROC())

    def check_datamodule(self, datamodule: Any) -> None:
        """Refuse a datamodule of node-classification batches (``lightning-ooc fit`` asks before it runs; a
        Trainer at :meth:`setup`)."""
        if getattr(datamodule, "task", None) == "node":  # the datamodule's task
            raise InputError(
                f"LinkPredictor scores links, but {type(datamodule).__name__} gives node-classification batches "
                "(no edge_label_index); train it with lightning_ooc.OutOfCoreLinkData (data.class_path in "
                "configs/link_demo.yaml) on a dataset with link splits, or classify nodes with a NodeClassifier "
                "(lightning_ooc.models.GraphSAGE)"
            )  # fmt: skip

    def setup(self, stage: str) -> None:
        self.check_datamodule(getattr(self._trainer, "datamodule", None))

    # -- scores ---------------------------------------------------------------------------------
    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        """Embeddings of the batch's nodes."""
        if not x.is_floating_point() or (x.dtype in (torch.float16, torch.bfloat16)
                                         and not torch.is_autocast_enabled()):  # fmt: skip
            x = x.float()
        return self.encoder(x, edge_index)

    # -- layer-wise inference (lightning_ooc.infer.LayerByLayer): every node's embedding ---------------------
    def inference_layers(self) -> list:
        """The encoder's layers: :func:`lightning_ooc.infer.layerwise` on this model writes every node's
        embedding (what :meth:`forward` gives)."""
        return list(self.encoder.convs)

    def inference_between(self, index: int, h: Tensor) -> Tensor:
        """What follows the encoder's layer ``index`` in eval mode."""
        return basic_gnn_between(self.encoder, index, h)

    def decode(self, h_src: Tensor, h_dst: Tensor) -> Tensor:
        """Logits of the pairs ``(h_src[i], h_dst[i])`` (broadcasting over leading dimensions)."""
        if self.mlp is None:
            return (h_src * h_dst).sum(-1)
        return self.mlp(h_src * h_dst).squeeze(-1)

    def score_pairs(self, batch) -> tuple[Tensor, Tensor]:
        """Logits of a binary batch's ``edge_label_index`` and its 0/1 targets."""
        h = self(batch.x, batch.edge_index)
        src, dst = batch.edge_label_index
        label = getattr(batch, "edge_label", None)
        target = torch.ones(src.numel(), device=h.device) if label is None else (label > 0).float()
        return self.decode(h[src], h[dst]), target

    def score_triplets(self, batch) -> tuple[Tensor, Tensor]:
        """Logits of a triplet batch: positives ``[B]``, negatives ``[B, K]``."""
        h = self(batch.x, batch.edge_index)
        neg_index = batch.dst_neg_index.view(batch.src_index.numel(), -1)
        h_src = h[batch.src_index]
        return self.decode(h_src, h[batch.dst_pos_index]), self.decode(h_src[:, None, :], h[neg_index])

    @staticmethod
    def is_triplet(batch) -> bool:
        return getattr(batch, "dst_neg_index", None) is not None

    # -- steps ------------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx: int) -> Tensor:
        if self.is_triplet(batch):
            pos, neg = self.score_triplets(batch)
            logits = torch.cat([pos, neg.reshape(-1)])
            target = torch.cat([torch.ones_like(pos), torch.zeros(neg.numel(), device=pos.device)])
        else:
            logits, target = self.score_pairs(batch)
        loss = F.binary_cross_entropy_with_logits(logits, target)
        self.log("train_loss", loss, batch_size=int(target.numel()), prog_bar=True)
        return loss

    def _evaluate(self, batch, stage: str) -> None:
        if self.is_triplet(batch):
            pos, neg = self.score_triplets(batch)
            # compared as they are: float64 is not narrowed
            values = rank_metrics(pos.detach(), neg.detach(), self.hits_at, self.hits_ties)
            b = int(pos.numel())
            ranking = getattr(self, f"{stage}_ranking")
            for name, metric in ranking.items():
                metric.update(values[name])
                self.log(f"{stage}_{name}", metric, batch_size=b, prog_bar=stage == "val" and name == "mrr")
            logits = torch.cat([pos, neg.reshape(-1)])
            labels = torch.cat([torch.ones_like(pos), torch.zeros(neg.numel(), device=pos.device)]).long()
        else:
            logits, target = self.score_pairs(batch)
            labels = target.long()
        auc = getattr(self, f"{stage}_auc")
        auc.update(logits, labels)
        self.log(f"{stage}_auc", auc, batch_size=int(labels.numel()))

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch, batch_idx: int) -> Tensor:
        """Probabilities of the batch's pairs (binary) or of its positives (triplet)."""
        logits = self.score_triplets(batch)[0] if self.is_triplet(batch) else self.score_pairs(batch)[0]
        return torch.sigmoid(logits)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
