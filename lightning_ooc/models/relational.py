"""Relational GNNs for heterogeneous node classification: R-GAT and R-SAGE as LightningModules.

They follow the R-GAT of MLPerf Training's GNN benchmark (IGBH): per layer a
PyG ``HeteroConv`` with one ``GATConv`` (``heads`` heads concatenated, no
self-loops) or ``SAGEConv`` per relation, the relations into a node type
averaged, leaky ReLU and dropout between layers, and a linear classifier on
the target type's seeds. MLPerf's setting is hidden 512, 4 heads, 3 layers,
fanout 15,10,5, batch 1024, dropout 0.2, Adam at 1e-3.

Batches are PyG-shaped ``HeteroData`` (what ``NeighborLoader`` on a
``HeteroData`` and :class:`~lightning_ooc.sampling.HeteroNeighborSampler`
give): ``x`` per node type, ``edge_index`` per relation in local ids, and on
the target type ``y`` and ``batch_size``; the loss and accuracy are taken over
the target type's first ``batch_size`` nodes. A node type without features
(``in_channels`` 0, as MAG240M's authors and institutions) starts from one
learned vector of its type; its nodes tell apart after the first layer, from
their neighbours.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import GATConv, HeteroConv, SAGEConv
from torchmetrics.classification import MulticlassAccuracy

from lightning_ooc.errors import InputError
from lightning_ooc.models import checks

EdgeType = tuple[str, str, str]


def as_metadata(metadata: Any) -> tuple[list[str], list[EdgeType]]:
    """``(node_types, edge_types)`` from PyG's ``metadata()`` or its YAML form (lists of lists)."""
    node_types, edge_types = metadata
    return [str(t) for t in node_types], [tuple(str(p) for p in et) for et in edge_types]  # type: ignore[misc]


class RelationalGNN(nn.Module):
    """Stacked ``HeteroConv`` layers (GAT or SAGE per relation) and a classifier for one node type.

    Args:
        metadata: ``(node_types, edge_types)``, as ``HeteroData.metadata()``.
        in_channels: feature dimension per node type (0 or absent: no features).
        hidden_channels: width of every layer (with GAT: ``heads`` x ``hidden_channels // heads``).
        out_channels: number of classes.
        target: the node type classified.
        num_layers: message-passing layers (as many as sampling hops).
        conv: ``"gat"`` or ``"sage"``.
        heads: attention heads (GAT).
        dropout: dropout between layers.
        aggr: how ``HeteroConv`` combines the relations into one type (``"mean"``, ``"sum"``...).

    Example::

        >>> import torch
        >>> meta = (["paper", "author"], [("paper", "cites", "paper"), ("author", "writes", "paper"),
        ...                               ("paper", "rev_writes", "author")])
        >>> gnn = RelationalGNN(meta, {"paper": 8}, 16, 3, "paper", num_layers=2)
        >>> x = {"paper": torch.randn(4, 8)}
        >>> ei = {meta[1][0]: torch.tensor([[1, 2], [0, 0]]), meta[1][1]: torch.tensor([[0, 1], [0, 3]]),
        ...       meta[1][2]: torch.tensor([[0], [1]])}
        >>> gnn(x, ei, {"paper": 4, "author": 2}).shape
        torch.Size([4, 3])
    """

    def __init__(
        self,
        metadata: Any,
        in_channels: dict[str, int],
        hidden_channels: int,
        out_channels: int,
        target: str,
        num_layers: int = 3,
        conv: str = "gat",
        heads: int = 4,
        dropout: float = 0.2,
        aggr: str = "mean",
    ):
        super().__init__()
        node_types, edge_types = as_metadata(metadata)
        if target not in node_types:
            raise InputError(f"target {target!r} is not one of the node types {node_types}")
        conv = checks.choice("conv", conv, ("gat", "sage"))
        hidden_channels = checks.count("hidden_channels", hidden_channels, 1, "width of every layer")
        num_layers = checks.count("num_layers", num_layers, 1, "message-passing layers, as many as sampling hops")
        out_channels = checks.count("out_channels", out_channels, 1, "the number of classes")
        dropout = checks.dropout(dropout)
        if conv == "gat":
            heads = checks.count("heads", heads, 1, "attention heads per relation")
            if hidden_channels % heads:
                raise InputError(f"hidden_channels={hidden_channels} must be divisible by heads={heads}")
        unknown = set(in_channels) - set(node_types)
        if unknown:
            raise InputError(f"in_channels names node types {sorted(unknown)} not in the metadata {node_types}")
        for t, dim in in_channels.items():
            checks.count(f"in_channels[{t!r}]", dim, 0, "the feature dimension of the type, 0 for none")
        into = {et[2] for et in edge_types}
        if target not in into:
            raise InputError(f"no relation leads into the target type {target!r}; nothing reaches its seeds")
        self.target = target
        self.dropout = float(dropout)
        dims = {t: int(in_channels.get(t, 0)) or hidden_channels for t in node_types}
        # Only what reaches the target is built: the last layer's relations lead into the target type,
        # each earlier layer's into the types the next one reads (as source or destination). The rest
        # would compute outputs no loss depends on (and DDP refuses parameters without gradients).
        layers: list[list[EdgeType]] = []
        needed = {target}
        for i in reversed(range(num_layers)):
            rels = [et for et in edge_types if et[2] in needed]
            layers.insert(0, rels)
            needed = {et[0] for et in rels} | {et[2] for et in rels}
        for i in range(1, num_layers):
            fed = {et[2] for et in layers[i - 1]}
            missing = ({et[0] for et in layers[i]} | {et[2] for et in layers[i]}) - fed
            if missing:
                raise InputError(f"node types {sorted(missing)} have no relation leading into them, so they have no "
                                 f"representation after layer {i}; add reverse relations (prepare --add-reverse)")
        first_inputs = {et[0] for et in layers[0]} | {et[2] for et in layers[0]}
        #: the starting vector of each type without features (of the types the first layer reads)
        self.type_embedding = nn.ParameterDict({t: nn.Parameter(torch.randn(hidden_channels) * 0.1)
                                                for t in node_types if not in_channels.get(t, 0) and t in first_inputs})
        self.convs = nn.ModuleList()
        for i in range(num_layers):
            per_rel: dict[EdgeType, nn.Module] = {}
            for src, rel, dst in layers[i]:
                ins = (dims[src], dims[dst]) if i == 0 else (hidden_channels, hidden_channels)
                if conv == "gat":
                    per_rel[(src, rel, dst)] = GATConv(ins, hidden_channels // heads, heads=heads, add_self_loops=False)
                else:
                    per_rel[(src, rel, dst)] = SAGEConv(ins, hidden_channels)
            with warnings.catch_warnings():  # a pruned layer reads types it does not update: intended
                warnings.filterwarnings("ignore", message="There exist node types")
                self.convs.append(HeteroConv(per_rel, aggr=aggr))
        self.classifier = nn.Linear(hidden_channels, out_channels)

    def forward(self, x_dict: dict[str, Tensor], edge_index_dict: dict[EdgeType, Tensor],
                num_nodes_dict: dict[str, int] | None = None) -> Tensor:  # fmt: skip
        """Logits of every target node of the batch (``num_nodes_dict`` sizes the types without features)."""
        x_dict = dict(x_dict)
        for t, vec in self.type_embedding.items():
            if t not in x_dict:
                n = (num_nodes_dict or {}).get(t)
                if n is None:
                    raise ValueError(f"node type {t!r} has no features: give its node count in num_nodes_dict")
                x_dict[t] = vec.unsqueeze(0).expand(int(n), -1)
        for i, conv in enumerate(self.convs):
            x_dict = conv(x_dict, edge_index_dict)
            if i < len(self.convs) - 1:
                x_dict = {t: F.dropout(F.leaky_relu(x), p=self.dropout, training=self.training)
                          for t, x in x_dict.items()}  # fmt: skip
        return self.classifier(x_dict[self.target])

    # -- layer-wise inference (lightning_ooc.infer.HeteroLayerByLayer)
    def inference_layers(self) -> list[nn.Module]:
        """The ``HeteroConv`` layers, then the classifier on the target type."""
        return [*self.convs, nn.ModuleDict({self.target: self.classifier})]

    def inference_between(self, index: int, h: Tensor, node_type: str) -> Tensor:
        """Leaky ReLU between two ``HeteroConv`` layers (dropout is off in eval); nothing before the classifier."""
        return F.leaky_relu(h) if index < len(self.convs) - 1 else h

    def inference_inputs(self) -> dict[str, Tensor]:
        """The starting vector of each node type without features."""
        return dict(self.type_embedding.items())


class HeteroNodeClassifier(L.LightningModule):
    """A :class:`RelationalGNN` trained with cross-entropy on the target type's seeds.

    ``in_channels`` and ``metadata`` come from the dataset
    (``OutOfCoreNodeData.in_channels`` / ``.metadata`` of a heterogeneous dataset, or ``HeteroData.metadata()``).

    Example::

        >>> import torch
        >>> from torch_geometric.data import HeteroData
        >>> b = HeteroData()
        >>> b["paper"].x = torch.randn(4, 8); b["paper"].y = torch.tensor([0, 1, 2, 0]); b["paper"].batch_size = 2
        >>> b["author"].n_id = torch.arange(2)
        >>> b["author", "writes", "paper"].edge_index = torch.tensor([[0, 1], [0, 1]])
        >>> b["paper", "rev_writes", "author"].edge_index = torch.tensor([[2], [0]])
        >>> model = RGAT(b.metadata(), {"paper": 8}, num_classes=3, hidden_channels=16, num_layers=2)
        >>> model.training_step(b, 0).shape
        torch.Size([])
    """

    def __init__(
        self,
        metadata: Any = None,
        in_channels: dict[str, int] | None = None,
        num_classes: int = 0,
        target: str = "paper",
        hidden_channels: int = 512,
        num_layers: int = 3,
        conv: str = "gat",
        heads: int = 4,
        dropout: float = 0.2,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
    ):
        super().__init__()
        if metadata is None or in_channels is None or num_classes < 1:
            raise InputError("a relational model needs the graph's metadata=(node_types, edge_types), in_channels per "
                             "node type and num_classes: from the datamodule (dm.metadata, dm.in_channels, "
                             "dm.num_classes) or HeteroData.metadata(); `lightning-ooc fit` fills them in from a "
                             "heterogeneous dataset (a homogeneous one trains with lightning_ooc.models.GraphSAGE and "
                             "OutOfCoreNodeData)")  # fmt: skip
        if not isinstance(in_channels, dict):
            raise InputError(f"in_channels must map each node type to its feature dimension, got {in_channels!r}: "
                             "a homogeneous dataset trains with lightning_ooc.models.GraphSAGE and OutOfCoreNodeData")
        num_classes = checks.num_classes(num_classes)
        checks.rate("lr", lr)
        checks.rate("weight_decay", weight_decay, zero=True)
        node_types, edge_types = as_metadata(metadata)
        self.save_hyperparameters({"metadata": [node_types, [list(et) for et in edge_types]],
                                   "in_channels": dict(in_channels), "num_classes": num_classes, "target": target,
                                   "hidden_channels": hidden_channels, "num_layers": num_layers, "conv": conv,
                                   "heads": heads, "dropout": dropout, "lr": lr, "weight_decay": weight_decay})
        self.gnn = RelationalGNN((node_types, edge_types), in_channels, hidden_channels, num_classes, target,
                                 num_layers=num_layers, conv=conv, heads=heads, dropout=dropout)  # fmt: skip
        self.target = target
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, batch) -> Tensor:
        x_dict = {}
        for t in batch.node_types:
            x = getattr(batch[t], "x", None)
            if x is not None:
                x_dict[t] = x.float() if not x.is_floating_point() or (
                    x.dtype in (torch.float16, torch.bfloat16) and not torch.is_autocast_enabled()) else x
        sizes = {t: int(batch[t].num_nodes or 0) for t in batch.node_types}
        return self.gnn(x_dict, batch.edge_index_dict, sizes)

    def _seed_logits(self, batch) -> tuple[Tensor, Tensor, int]:
        n = int(batch[self.target].batch_size)
        return self(batch)[:n], batch[self.target].y[:n].long(), n

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
        return self._seed_logits(batch)[0].argmax(-1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class RGAT(HeteroNodeClassifier):
    """:class:`HeteroNodeClassifier` with GAT per relation: MLPerf's R-GAT.

    See :class:`HeteroNodeClassifier` for a training step; the logits of a batch's target nodes::

        >>> import torch
        >>> from torch_geometric.data import HeteroData
        >>> b = HeteroData()
        >>> b["paper"].x = torch.randn(4, 8)
        >>> b["author"].n_id = torch.arange(2)
        >>> b["author", "writes", "paper"].edge_index = torch.tensor([[0, 1], [0, 1]])
        >>> b["paper", "rev_writes", "author"].edge_index = torch.tensor([[2], [0]])
        >>> RGAT(b.metadata(), {"paper": 8}, num_classes=3, hidden_channels=16, num_layers=2, heads=2)(b).shape
        torch.Size([4, 3])
    """

    def __init__(self, metadata: Any = None, in_channels: dict[str, int] | None = None, num_classes: int = 0,
                 target: str = "paper", hidden_channels: int = 512, num_layers: int = 3, heads: int = 4,
                 dropout: float = 0.2, lr: float = 1e-3, weight_decay: float = 0.0):  # fmt: skip
        super().__init__(metadata, in_channels, num_classes, target, hidden_channels, num_layers, "gat", heads,
                         dropout, lr, weight_decay)  # fmt: skip


class RSAGE(HeteroNodeClassifier):
    """:class:`HeteroNodeClassifier` with GraphSAGE per relation: MLPerf's R-SAGE variant.

        >>> import torch
        >>> from torch_geometric.data import HeteroData
        >>> b = HeteroData()
        >>> b["paper"].x = torch.randn(4, 8)
        >>> b["author"].n_id = torch.arange(2)
        >>> b["author", "writes", "paper"].edge_index = torch.tensor([[0, 1], [0, 1]])
        >>> b["paper", "rev_writes", "author"].edge_index = torch.tensor([[2], [0]])
        >>> RSAGE(b.metadata(), {"paper": 8}, num_classes=3, hidden_channels=16, num_layers=2)(b).shape
        torch.Size([4, 3])
    """

    def __init__(self, metadata: Any = None, in_channels: dict[str, int] | None = None, num_classes: int = 0,
                 target: str = "paper", hidden_channels: int = 512, num_layers: int = 3, dropout: float = 0.2,
                 lr: float = 1e-3, weight_decay: float = 0.0):  # fmt: skip
        super().__init__(metadata, in_channels, num_classes, target, hidden_channels, num_layers, "sage", 1,
                         dropout, lr, weight_decay)  # fmt: skip


__all__: Sequence[str] = ["RelationalGNN", "HeteroNodeClassifier", "RGAT", "RSAGE", "as_metadata"]
