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
batches), as OGB's link-prediction evaluator does (a tie counts half:
:func:`positive_ranks`): ``val_mrr`` / ``test_mrr`` and ``val_hits@K``, means
over the positives kept by torchmetrics (``MeanMetric``, synchronised across
processes); every batch also logs ``val_auc`` (``BinaryAUROC``) over its
positive and negative pairs. ``torchmetrics.retrieval`` is not used: it takes
a score <= 0 for "not retrieved" and breaks ties by position. A random scorer
has an expected MRR of ``H(K + 1) / (K + 1)`` with ``K`` negatives per
positive (:func:`random_mrr`).

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
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC

from lightning_ooc.errors import InputError
from lightning_ooc.infer.model import basic_gnn_between
from lightning_ooc.models import checks

#: how :class:`LinkPredictor` scores a pair of embeddings
DECODERS = ("dot", "mlp")


def random_mrr(num_negatives: int) -> float:
    """Expected MRR of a scorer that ranks a positive at random among ``num_negatives`` negatives."""
    n = int(num_negatives) + 1
    return sum(1.0 / r for r in range(1, n + 1)) / n


def positive_ranks(pos: Tensor, neg: Tensor) -> Tensor:
    """The rank (1 = best) of each positive among its negatives ``neg[i]``, a tie counting half (OGB's rule).

    >>> positive_ranks(torch.tensor([3.0, 1.0]), torch.tensor([[1.0, 3.0], [1.0, 1.0]])).tolist()
    [1.5, 2.0]
    """
    higher = (neg > pos[:, None]).sum(dim=1)
    ties = (neg == pos[:, None]).sum(dim=1)
    return 1.0 + higher + 0.5 * ties


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
        num_classes: int | None = None,
    ):
        super().__init__()
        decoder = checks.choice("decoder", decoder, DECODERS)
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
        for stage in ("val", "test"):
            ranking = {"mrr": MeanMetric()} | {f"hits@{k}": MeanMetric() for k in hits}
            setattr(self, f"{stage}_ranking", nn.ModuleDict(ranking))
            setattr(self, f"{stage}_auc", BinaryAUROC())

    def check_datamodule(self, datamodule: Any) -> None:
        """Refuse a datamodule of node-classification batches (``lightning-ooc fit`` asks before it runs; a
        Trainer at :meth:`setup`)."""
        from lightning_ooc.datamodule import OutOfCoreLinkData, OutOfCoreNodeData  # lazy: it imports Triton

        if isinstance(datamodule, OutOfCoreNodeData) and not isinstance(datamodule, OutOfCoreLinkData):
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
            ranks = positive_ranks(pos.detach().float(), neg.detach().float())
            b = int(ranks.numel())
            ranking = getattr(self, f"{stage}_ranking")
            ranking["mrr"].update(1.0 / ranks)
            for k in self.hits_at:
                ranking[f"hits@{k}"].update((ranks <= k).float())
            for name, metric in ranking.items():
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
