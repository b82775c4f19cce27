"""Node classification LightningModules: GraphSAGE, GCN, GAT and an MLP baseline.

They consume minibatches shaped like PyG ``NeighborLoader`` output (``x``,
``edge_index`` in local ids, ``y``, ``batch_size``): the loss and accuracy are
taken over the first ``batch_size`` nodes, the seeds.
"""
from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.nn import models as pyg_models
from torchmetrics.classification import MulticlassAccuracy

from lightning_ooc.errors import BatchKindError, InputError
from lightning_ooc.infer.model import basic_gnn_between
from lightning_ooc.models import checks

#: the message-passing layers a :class:`NodeClassifier` builds
CONVS = ("sage", "gcn", "gat", "mlp")


class NodeClassifier(L.LightningModule):
    """A PyG ``BasicGNN`` (GraphSAGE, GCN or GAT) trained with cross-entropy on the seed nodes.

    Args:
        in_channels: feature dimension (``dataset.num_features``).
        num_classes: number of classes (``dataset.num_classes``).
        hidden_channels: width of the hidden layers.
        num_layers: message-passing layers (use as many as sampling hops).
        conv: ``"sage"``, ``"gcn"``, ``"gat"`` or ``"mlp"`` (ignores the edges).
        dropout: dropout between layers.
        lr, weight_decay: Adam settings.
        heads: attention heads (GAT only).

    Example::

        >>> import torch
        >>> from torch_geometric.data import Data
        >>> model = NodeClassifier(in_channels=8, num_classes=3, hidden_channels=16, num_layers=2)
        >>> batch = Data(x=torch.randn(5, 8), edge_index=torch.tensor([[1, 2, 3], [0, 0, 1]]),
        ...              y=torch.tensor([0, 2, 1, 1, 0]), batch_size=2)
        >>> model.training_step(batch, 0).shape
        torch.Size([])
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        hidden_channels: int = 256,
        num_layers: int = 3,
        conv: str = "sage",
        dropout: float = 0.5,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        heads: int = 4,
    ):
        super().__init__()
        conv = checks.choice("conv", conv, CONVS)
        in_channels = checks.in_channels(in_channels)
        num_classes = checks.num_classes(num_classes, allow_none=True)
        hidden_channels = checks.count("hidden_channels", hidden_channels, 1, "width of the hidden layers")
        num_layers = checks.count("num_layers", num_layers, 1, "message-passing layers, as many as sampling hops")
        dropout = checks.dropout(dropout)
        checks.rate("lr", lr)
        checks.rate("weight_decay", weight_decay, zero=True)
        if conv == "gat":
            heads = checks.count("heads", heads, 1, "attention heads")
            if hidden_channels % heads:
                raise InputError(f"hidden_channels={hidden_channels} must be divisible by heads={heads}")
        self.save_hyperparameters()
        kw: dict[str, Any] = dict(
            in_channels=in_channels, hidden_channels=hidden_channels, num_layers=num_layers,
            out_channels=num_classes, dropout=dropout,
        )  # fmt: skip
        if conv == "sage":
            self.gnn = pyg_models.GraphSAGE(**kw)
        elif conv == "gcn":
            self.gnn = pyg_models.GCN(**kw)
        elif conv == "gat":
            self.gnn = pyg_models.GAT(**kw, heads=heads)
        else:
            self.gnn = pyg_models.MLP(
                in_channels=in_channels, hidden_channels=hidden_channels, out_channels=num_classes,
                num_layers=num_layers, dropout=dropout, norm=None,
            )  # fmt: skip
        self.conv = conv
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def check_datamodule(self, datamodule: Any) -> None:
        """Refuse a datamodule whose batches this model cannot train on (``lightning-ooc fit`` asks before it
        runs; a Trainer at :meth:`setup`)."""
        task = getattr(datamodule, "task", None)  # the datamodule's task: "node", "link", ...
        if task is not None and task != "node":
            raise InputError(
                f"{type(self).__name__} classifies nodes, but {type(datamodule).__name__} gives link-prediction "
                "batches (edge_label_index, no labels y); train them with lightning_ooc.models.LinkPredictor "
                "(configs/link_demo.yaml), or classify the nodes with lightning_ooc.OutOfCoreNodeData"
            )  # fmt: skip
        if self.hparams.num_classes is None and task == "node":
            raise InputError(f"{type(self).__name__} was built with num_classes=None; give it the dataset's class "
                             "count (dm.num_classes)")  # fmt: skip

    def setup(self, stage: str) -> None:
        self.check_datamodule(getattr(self._trainer, "datamodule", None))

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        if self.conv == "mlp":
            return self.gnn(x)
        return self.gnn(x, edge_index)

    # -- layer-wise inference (lightning_ooc.infer.LayerByLayer) -------------------------------------------------
    def inference_layers(self) -> list:
        """The layers :func:`lightning_ooc.infer.layerwise` runs one at a time over all nodes (the MLP: one
        node-wise layer)."""
        if self.conv == "mlp":
            return [self.gnn]
        return list(self.gnn.convs)

    def inference_between(self, index: int, h: Tensor) -> Tensor:
        """What follows layer ``index`` in :meth:`forward` in eval mode: the activation (dropout is off)."""
        return basic_gnn_between(self.gnn, index, h)

    def _seed_logits(self, batch, labels: bool = True) -> tuple[Tensor, Tensor | None, int]:
        # (a batch of another kind that knows what it lacks, such as an embedding batch, raises its own error here)
        if (labels and batch.y is None) or getattr(batch, "batch_size", None) is None:
            raise BatchKindError(
                f"{type(self).__name__} classifies nodes and reads batch.y and batch.batch_size (the seeds' labels, "
                f"as PyG's NeighborLoader gives them), which this {type(batch).__name__} batch does not carry; a "
                "link-prediction batch trains with lightning_ooc.models.LinkPredictor"
            )  # fmt: skip
        n = int(batch.batch_size)
        x = batch.x if batch.x.is_floating_point() else batch.x.float()
        if x.dtype in (torch.float16, torch.bfloat16) and not torch.is_autocast_enabled():
            x = x.float()
        out = self(x, batch.edge_index)[:n]
        return out, (batch.y[:n].long() if labels else None), n

    def training_step(self, batch, batch_idx: int) -> Tensor:
        out, y, n = self._seed_logits(batch)
        loss = F.cross_entropy(out, y)
        self.train_acc(out, y)
        self.log("train_loss", loss, batch_size=n, prog_bar=True)
        self.log("train_acc", self.train_acc, batch_size=n, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        out, y, n = self._seed_logits(batch)
        self.val_acc(out, y)
        self.log("val_loss", F.cross_entropy(out, y), batch_size=n, sync_dist=True)
        self.log("val_acc", self.val_acc, batch_size=n, prog_bar=True)

    def test_step(self, batch, batch_idx: int) -> None:
        out, y, n = self._seed_logits(batch)
        self.test_acc(out, y)
        self.log("test_acc", self.test_acc, batch_size=n, prog_bar=True)

    def predict_step(self, batch, batch_idx: int) -> Tensor:
        if getattr(batch, "layerwise", False):  # layer-wise inference's outputs (lightning_ooc.infer.predict)
            return batch.out.argmax(-1)
        out, _, _ = self._seed_logits(batch, labels=False)
        return out.argmax(-1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class GraphSAGE(NodeClassifier):
    """:class:`NodeClassifier` with GraphSAGE layers (mean aggregation).

    Logits for every node of a batch (its seeds are the first ``batch_size``)::

        >>> import torch
        >>> model = GraphSAGE(in_channels=8, num_classes=3, hidden_channels=16, num_layers=2)
        >>> model(torch.randn(4, 8), torch.tensor([[1, 2, 3], [0, 0, 1]])).shape
        torch.Size([4, 3])
    """

    def __init__(self, in_channels: int, num_classes: int, hidden_channels: int = 256, num_layers: int = 3,
                 dropout: float = 0.5, lr: float = 1e-3, weight_decay: float = 0.0):  # fmt: skip
        super().__init__(in_channels, num_classes, hidden_channels, num_layers, "sage", dropout, lr, weight_decay)


class GCN(NodeClassifier):
    """:class:`NodeClassifier` with GCN layers.

        >>> import torch
        >>> model = GCN(in_channels=8, num_classes=3, hidden_channels=16, num_layers=2)
        >>> model(torch.randn(4, 8), torch.tensor([[1, 2, 3], [0, 0, 1]])).shape
        torch.Size([4, 3])
    """

    def __init__(self, in_channels: int, num_classes: int, hidden_channels: int = 256, num_layers: int = 3,
                 dropout: float = 0.5, lr: float = 1e-3, weight_decay: float = 0.0):  # fmt: skip
        super().__init__(in_channels, num_classes, hidden_channels, num_layers, "gcn", dropout, lr, weight_decay)


class GAT(NodeClassifier):
    """:class:`NodeClassifier` with GAT layers (``heads`` attention heads, concatenated).

        >>> import torch
        >>> model = GAT(in_channels=8, num_classes=3, hidden_channels=16, num_layers=2, heads=2)
        >>> model(torch.randn(4, 8), torch.tensor([[1, 2, 3], [0, 0, 1]])).shape
        torch.Size([4, 3])
    """

    def __init__(self, in_channels: int, num_classes: int, hidden_channels: int = 256, num_layers: int = 3,
                 dropout: float = 0.5, lr: float = 1e-3, weight_decay: float = 0.0, heads: int = 4):  # fmt: skip
        super().__init__(in_channels, num_classes, hidden_channels, num_layers, "gat", dropout, lr, weight_decay, heads)


class MLP(NodeClassifier):
    """The features-only baseline: same training loop, no message passing.

    The edges change nothing::

        >>> import torch
        >>> model = MLP(in_channels=8, num_classes=3, hidden_channels=16, num_layers=2).eval()
        >>> x = torch.randn(4, 8)
        >>> bool((model(x, torch.tensor([[1, 2, 3], [0, 0, 1]])) == model(x, torch.empty(2, 0, dtype=torch.long))).all())
        True
    """

    def __init__(self, in_channels: int, num_classes: int, hidden_channels: int = 256, num_layers: int = 3,
                 dropout: float = 0.5, lr: float = 1e-3, weight_decay: float = 0.0):  # fmt: skip
        super().__init__(in_channels, num_classes, hidden_channels, num_layers, "mlp", dropout, lr, weight_decay)
