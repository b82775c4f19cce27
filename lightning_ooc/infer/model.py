"""What a model tells layer-wise inference: its layers, and what happens between them.

Layer-wise inference runs a model one layer at a time over every node, so it
needs the model as a list of layers instead of one ``forward``. A model
implements :class:`LayerByLayer`:

- ``inference_layers()``: the layers in order. A PyG ``MessagePassing`` layer
  aggregates over each node's in-neighbours; any other module is applied to
  each node's row on its own (a linear head, an MLP).
- ``inference_between(index, h)``: what follows layer ``index`` when it is
  not the last (activation, normalisation in eval mode; dropout is off in
  eval mode). It must work row by row: a normalisation over the whole graph
  (PyG's ``GraphNorm``, ``LayerNorm(mode="graph")``) cannot run in blocks.

The package's node classifiers implement it; a PyG ``BasicGNN`` (GraphSAGE,
GCN, GAT, GIN...) works through :func:`layer_steps` as it is, and any other
model with a ``convs`` list through it too when told what comes between its
layers (``between=``). Anything else is refused with an error naming the
protocol.

Example::

    >>> import torch
    >>> from torch_geometric.nn.models import GraphSAGE
    >>> steps = layer_steps(GraphSAGE(8, 16, num_layers=2, out_channels=3))
    >>> [type(m).__name__ for m in steps.layers], steps.source
    (['SAGEConv', 'SAGEConv'], 'GraphSAGE (PyG BasicGNN)')
    >>> steps.between(0, torch.tensor([[-1.0, 2.0]])).tolist()  # ReLU
    [[0.0, 2.0]]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from torch import Tensor, nn

from lightning_ooc.errors import InputError

__all__ = ["LayerByLayer", "LayerSteps", "layer_steps", "basic_gnn_between", "HeteroLayerByLayer", "HeteroSteps",
           "hetero_steps"]

PROTOCOL_HINT = (
    "layer-wise inference runs a model layer by layer: implement lightning_ooc.infer.LayerByLayer on it "
    "(inference_layers() -> its layers in order; inference_between(index, h) -> what follows layer index), "
    "or give a model with a `convs` list and say what comes between its layers (between=torch.relu)"
)


@runtime_checkable
class LayerByLayer(Protocol):
    """A model that can be run one layer at a time over all nodes.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_geometric.nn import SAGEConv
        >>> class TwoLayers(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.convs = nn.ModuleList([SAGEConv(4, 8), SAGEConv(8, 2)])
        ...     def inference_layers(self):
        ...         return list(self.convs)
        ...     def inference_between(self, index, h):
        ...         return h.relu()
        >>> isinstance(TwoLayers(), LayerByLayer)
        True
    """

    def inference_layers(self) -> Sequence[nn.Module]: ...

    def inference_between(self, index: int, h: Tensor) -> Tensor: ...


@dataclass
class LayerSteps:
    """A model as layer-wise inference runs it: ``layers`` and ``between(index, h)`` after each but the last.

    ``module`` is what holds the parameters (its weights identify a run for resuming).

        >>> import torch
        >>> from torch_geometric.nn import SAGEConv
        >>> s = LayerSteps([SAGEConv(4, 2)], lambda i, h: h, "mine", SAGEConv(4, 2))
        >>> len(s.layers), s.source
        (1, 'mine')
    """

    layers: list[nn.Module]
    between: Callable[[int, Tensor], Tensor]
    source: str
    module: nn.Module


def basic_gnn_between(gnn: Any, index: int, h: Tensor) -> Tensor:
    """What a PyG ``BasicGNN`` applies after its layer ``index`` (not the last) in eval mode: activation and
    norm, in its order (dropout is off).

        >>> import torch
        >>> from torch_geometric.nn.models import GCN
        >>> basic_gnn_between(GCN(4, 8, num_layers=2), 0, torch.tensor([[-1.0, 1.0]])).tolist()
        [[0.0, 1.0]]
    """
    if gnn.act is not None and gnn.act_first:
        h = gnn.act(h)
    if gnn.norms is not None:
        h = gnn.norms[index](h)
    if gnn.act is not None and not gnn.act_first:
        h = gnn.act(h)
    return h


def _basic_gnn_steps(gnn: Any, name: str) -> LayerSteps:
    if getattr(gnn, "jk_mode", None) is not None:
        raise InputError(f"{name}: jumping knowledge (jk={gnn.jk_mode!r}) is not supported by layer-wise "
                         "inference, which keeps one layer's outputs at a time; build it with jk=None")  # fmt: skip
    if getattr(gnn, "supports_norm_batch", False):
        raise InputError(f"{name}: its normalisation ({type(gnn.norms[0]).__name__}) spans the whole graph, which "
                         "layer-wise inference cannot apply in blocks; use batch_norm (applied per node in eval "
                         "mode) or none")  # fmt: skip
    n = len(gnn.convs)

    def between(i: int, h: Tensor) -> Tensor:
        return basic_gnn_between(gnn, i, h)

    layers = list(gnn.convs)
    if hasattr(gnn, "lin") and gnn.lin is not None and n:  # (only with jk, refused above)
        layers.append(gnn.lin)
    return LayerSteps(layers, between, name, gnn)


def layer_steps(model: Any, between: Callable[[int, Tensor], Tensor] | None = None) -> LayerSteps:
    """The layers of ``model`` and what comes between them, or an :class:`InputError` naming the protocol.

    Takes, in this order: a :class:`LayerByLayer`; a PyG ``BasicGNN``; a PyG
    ``MLP`` (one node-wise layer); any module with a ``convs`` list when
    ``between`` is given.
    """
    from torch_geometric.nn import models as pyg_models  # lazy: PyG is heavy

    if hasattr(model, "inference_inputs"):
        raise InputError(f"{type(model).__name__} is a heterogeneous model (HeteroLayerByLayer): run it over a "
                         "heterogeneous dataset")  # fmt: skip
    if isinstance(model, LayerByLayer):
        layers = list(model.inference_layers())
        if not layers:
            raise InputError(f"{type(model).__name__}.inference_layers() returned no layers")
        return LayerSteps(layers, between or model.inference_between, type(model).__name__, model)
    if isinstance(model, pyg_models.basic_gnn.BasicGNN):
        steps = _basic_gnn_steps(model, f"{type(model).__name__} (PyG BasicGNN)")
        if between is not None:
            steps.between = between
        return steps
    if isinstance(model, pyg_models.MLP):
        return LayerSteps([model], lambda i, h: h, "MLP (PyG, node-wise)", model)
    convs = getattr(model, "convs", None)
    if isinstance(convs, (nn.ModuleList, list, tuple)) and len(convs):
        if between is None:
            raise InputError(f"{type(model).__name__} has a `convs` list but no way to tell what comes between its "
                             f"layers: pass between= (e.g. lambda i, h: h.relu()), or {PROTOCOL_HINT}")  # fmt: skip
        return LayerSteps(list(convs), between, f"{type(model).__name__} (convs)", model)
    raise InputError(f"{type(model).__name__} cannot be run layer by layer: {PROTOCOL_HINT}")


HETERO_PROTOCOL_HINT = (
    "layer-wise inference over a heterogeneous dataset runs a model layer by layer: implement "
    "lightning_ooc.infer.HeteroLayerByLayer on it (inference_layers() -> HeteroConv layers and node-wise "
    "ModuleDicts of node type -> module; inference_between(index, h, node_type); inference_inputs() -> the "
    "starting vector of each node type without features), as lightning_ooc.models.RelationalGNN does"
)


@runtime_checkable
class HeteroLayerByLayer(Protocol):
    """A heterogeneous model that can be run one layer at a time over all nodes of every type.

    - ``inference_layers()``: PyG ``HeteroConv`` layers (one message-passing layer per relation, the relations
      into a type combined by the ``HeteroConv``'s ``aggr``), or ``nn.ModuleDict`` objects of node type -> module
      applied to each node's row on its own (a classifier on the target type); a type a layer gives no output
      for is not carried further.
    - ``inference_between(index, h, node_type)``: what follows layer ``index`` (not the last) for the rows
      ``h`` of one type, row by row, in eval mode.
    - ``inference_inputs()``: node type -> the vector every node of a type without features starts from.

    :class:`~lightning_ooc.models.relational.RelationalGNN` (and the R-GAT / R-SAGE modules) implement it.

        >>> from lightning_ooc.models.relational import RelationalGNN
        >>> meta = (["paper", "author"], [("author", "writes", "paper"), ("paper", "rev_writes", "author")])
        >>> gnn = RelationalGNN(meta, {"paper": 8}, 16, 3, "paper", num_layers=2)
        >>> isinstance(gnn, HeteroLayerByLayer), sorted(gnn.inference_inputs())
        (True, ['author'])
    """

    def inference_layers(self) -> Sequence[nn.Module]: ...

    def inference_between(self, index: int, h: Tensor, node_type: str) -> Tensor: ...

    def inference_inputs(self) -> dict[str, Tensor]: ...


@dataclass
class HeteroSteps:
    """A heterogeneous model as layer-wise inference runs it (see :class:`HeteroLayerByLayer`).

        >>> from torch import nn
        >>> s = HeteroSteps([nn.ModuleDict({"paper": nn.Linear(4, 2)})], lambda i, h, t: h, {}, "mine", nn.Linear(1, 1))
        >>> len(s.layers), s.source
        (1, 'mine')
    """

    layers: list[nn.Module]
    between: Callable[[int, Tensor, str], Tensor]
    inputs: dict[str, Tensor]
    source: str
    module: nn.Module


def hetero_steps(model: Any) -> HeteroSteps:
    """The layers of a heterogeneous ``model``, or an :class:`InputError` naming the protocol.

    A LightningModule that holds its relational network as ``gnn`` (:class:`~lightning_ooc.models.RGAT`,
    :class:`~lightning_ooc.models.RSAGE`) is run through it.
    """
    inner = model if isinstance(model, HeteroLayerByLayer) else getattr(model, "gnn", None)
    if not isinstance(inner, HeteroLayerByLayer):
        raise InputError(f"{type(model).__name__} cannot be run layer by layer over a heterogeneous dataset: "
                         f"{HETERO_PROTOCOL_HINT}")  # fmt: skip
    layers = list(inner.inference_layers())
    if not layers:
        raise InputError(f"{type(inner).__name__}.inference_layers() returned no layers")
    inputs = {str(t): v.detach().reshape(-1) for t, v in inner.inference_inputs().items()}
    return HeteroSteps(layers, inner.inference_between, inputs, type(inner).__name__, model)
