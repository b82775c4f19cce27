"""Layers split into pieces that run block by block: prepare a partition, accumulate a bucket, finish a node.

Blocked aggregation (:mod:`lightning_ooc.infer.run`) holds a few node
partitions at a time and visits the edges bucket by bucket. A layer whose
aggregation decomposes runs there as a :class:`BlockedLayer`:

- :meth:`~BlockedLayer.prepare`: from a resident partition's input rows, its
  states as a source (what its nodes send) and as a target;
- :meth:`~BlockedLayer.accumulate`: one chunk of a bucket's edges into the
  target partition's accumulator, one ``[rows, acc_width]`` float32 tensor so
  that it can be written to disk and read back whole;
- :meth:`~BlockedLayer.finish`: a target's output from its complete
  accumulator, its own input row and its own states (the self-loop term).

The layers here, with PyG 2.x's semantics reproduced exactly:

========== ===============================================================================
SAGEConv   mean (sum and count), sum or max; ``root_weight``, ``normalize``, ``project``;
           mean and sum accumulate ``x W`` when that is narrower than ``x``
GCNConv    ``normalize``: stored self-loops replaced by one loop per node, every edge and loop of
           weight 1 (PyG's ``gcn_norm`` without edge weights, where ``improved`` changes
           nothing), degrees counted once per graph; without ``normalize`` a plain sum
GATConv    softmax attention accumulated with a running maximum per target and head (one
           pass), self-loops removed and one added per node as GATConv does; ``concat`` or
           the mean of the heads, ``residual``; not ``edge_dim``
========== ===============================================================================

Anything else is not decomposed: :func:`blocked_layer` says why. The runner
reads each target's full in-neighbourhood instead for the layers of
:data:`ONE_HOP`, whose output for a node depends on its own row, its
in-neighbours' rows and nothing else; any other layer is refused
(:func:`neighbourhood_layer` says why), as its output may depend on the
sources' own degrees or on more than one hop.

Example (a bucket that is the whole graph gives PyG's output)::

    >>> import torch
    >>> from torch_geometric.nn import SAGEConv
    >>> conv = SAGEConv(4, 3).eval()
    >>> x = torch.randn(5, 4); ei = torch.tensor([[0, 1, 2, 4], [1, 1, 3, 0]])
    >>> blk, why = blocked_layer(conv)
    >>> src, tgt = blk.prepare(x, None)
    >>> acc = blk.new_acc(5)
    >>> blk.accumulate(acc, src, tgt, ei[0], ei[1])
    >>> torch.allclose(blk.finish(acc, x, src, tgt, None), conv(x, ei), atol=1e-6)
    True
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:  # the native aggregation (ext/kernels); torch's index_add_ where it is not built
    from lightning_ooc import _kernels
except ImportError:  # pragma: no cover - a source tree without `pip install -e .`
    _kernels = None

__all__ = ["BlockedLayer", "blocked_layer", "neighbourhood_layer", "ONE_HOP", "scatter_rows"]

log = logging.getLogger("lightning_ooc")
_said_fallback = False


def scatter_rows(acc: Tensor, src: Tensor, s: Tensor, d: Tensor, *, count_col: int = -1,
                 reduce: str = "sum") -> None:  # fmt: skip
    """For every edge ``e`` in order, ``acc[d[e], :W] += src[s[e]]`` (``reduce="sum"``) or the element-wise maximum
    (``"max"``), and ``acc[d[e], count_col] += 1`` where ``count_col >= 0``; ``W`` is ``src``'s width.

    The same result, bit for bit, as ``acc[:, :W].index_add_(0, d, src[s])`` (or ``scatter_reduce_`` with
    ``"amax"`` and ``include_self``), computed by the native kernel ``lightning_ooc._kernels`` without gathering
    every edge's message first, on ``torch.get_num_threads()`` threads when ``d`` is sorted. Tensors that need
    autograd, or a tree without the native module, take torch's path (the latter says so once in the log).

        >>> acc = torch.zeros(3, 3)
        >>> scatter_rows(acc, torch.tensor([[1., 2.], [3., 4.]]), torch.tensor([0, 1, 1]), torch.tensor([0, 0, 2]),
        ...              count_col=2)
        >>> acc
        tensor([[4., 6., 2.],
                [0., 0., 0.],
                [3., 4., 1.]])
    """
    global _said_fallback
    w = src.shape[1]
    native = (_kernels is not None and acc.device.type == src.device.type == s.device.type == "cpu"
              and acc.dtype == src.dtype == torch.float32 and acc.is_contiguous()
              and not (acc.requires_grad or src.requires_grad))  # fmt: skip
    if native:
        if s.dtype != d.dtype or s.dtype not in (torch.int32, torch.int64):
            s, d = s.long(), d.long()
        _kernels.scatter_rows(acc.numpy(), src.contiguous().numpy(), s.contiguous().numpy(), d.contiguous().numpy(),
                              count_col=count_col, reduce=reduce, threads=torch.get_num_threads())  # fmt: skip
        return
    if _kernels is None and not _said_fallback:
        _said_fallback = True
        log.warning("lightning_ooc._kernels is not built: layer-wise aggregation uses torch's index_add_ "
                    "(several times slower); run `pip install -e .` to build it")  # fmt: skip
    if reduce == "max":
        acc[:, :w].scatter_reduce_(0, d.view(-1, 1).expand(-1, w), src[s], "amax", include_self=True)
    else:
        acc[:, :w].index_add_(0, d, src[s])
    if count_col >= 0:
        acc[:, count_col].index_add_(0, d, torch.ones(d.numel(), dtype=acc.dtype))


class BlockedLayer:
    """One layer in blocked form (see the module docstring); subclasses fill in the pieces.

    ``needs_degree``: :meth:`prepare` and :meth:`finish` take each node's inverse square-root degree (GCN) as
    ``degree``; the other layers get ``None``.

        >>> from torch_geometric.nn import GCNConv
        >>> blk, _ = blocked_layer(GCNConv(4, 2))
        >>> blk.name, blk.needs_degree, blk.acc_width, blk.out_width
        ('gcn', True, 2, 2)
    """

    name = "blocked"
    #: the share of the plan's ``memory`` a run of this layer was measured to take at its peak (anonymous memory,
    #: the allocator's kept pages included; ``None``: the planner's default, ``LAYERWISE_OVER_MEMORY``)
    over_memory: float | None = None
    needs_degree = False
    #: the layer drops the graph's self-loops and adds one per node itself (in :meth:`finish`)
    replaces_self_loops = False
    #: float32 columns per node of each state, for the memory plan
    src_width = 0
    tgt_width = 0
    acc_width = 0
    out_width = 0
    #: float32 values per edge of a chunk's temporaries (messages), for the edge chunk size
    edge_width = 0

    def __init__(self, conv: nn.Module):
        self.conv = conv

    def prepare(self, x: Tensor, degree: Any) -> tuple[Tensor, Tensor | None]:
        """Rows ``x`` as sources and as targets (one node type: both from the same rows)."""
        return self.prepare_source(x, degree), self.prepare_target(x, degree)

    def prepare_source(self, x: Tensor, degree: Any) -> Tensor:
        """What the nodes of rows ``x`` send along their out-edges (``src_width`` columns)."""
        raise NotImplementedError

    def prepare_target(self, x: Tensor, degree: Any) -> Tensor | None:
        """What the aggregation reads of its targets (``tgt_width`` columns; ``None`` where it reads nothing).
        With two node types (a relation), ``x`` are the destination type's rows."""
        return None

    def new_acc(self, rows: int) -> Tensor:
        return torch.zeros(rows, self.acc_width)

    def accumulate(self, acc: Tensor, src: Tensor, tgt: Tensor | None, s: Tensor, d: Tensor) -> None:
        """Add edges ``s -> d`` (rows of ``src``, rows of ``acc`` / ``tgt``) into ``acc``; the runner has removed
        the stored self-loops already where :attr:`replaces_self_loops`."""
        raise NotImplementedError

    def finish(self, acc: Tensor, x: Tensor, src: Tensor, tgt: Tensor | None, degree: Any) -> Tensor:
        raise NotImplementedError


class SAGEBlocked(BlockedLayer):
    """``SAGEConv``: ``lin_l(aggr_j x_j) + lin_r(x_i)``; mean and sum accumulate ``x_j W_l`` when narrower."""

    over_memory = 1.2  # measured 1.05x over three layers (1M nodes, 256 MiB) and 1.0x at 16M nodes

    def __init__(self, conv: nn.Module, aggr: str):
        super().__init__(conv)
        self.aggr = aggr
        self.name = f"sage-{aggr}"
        in_w = int(conv.lin_l.in_channels)  # the width of the messages (after the projection, with project=True)
        self.out_width = conv.out_channels
        # a linear map commutes with a sum: accumulate the narrower of x and x W
        self.transform_first = aggr in ("mean", "sum") and conv.out_channels < in_w
        self.msg = conv.out_channels if self.transform_first else in_w
        self.src_width = self.msg
        self.acc_width = self.msg + 1  # the count (mean), or whether any edge came (max)
        self.edge_width = self.msg

    def prepare_source(self, x: Tensor, degree: Any) -> Tensor:
        c = self.conv
        h = c.lin(x).relu() if c.project else x
        if self.transform_first:
            h = F.linear(h, c.lin_l.weight)
        return h

    def new_acc(self, rows: int) -> Tensor:
        acc = torch.zeros(rows, self.acc_width)
        if self.aggr == "max":
            acc[:, : self.msg] = float("-inf")
        return acc

    def accumulate(self, acc, src, tgt, s, d) -> None:
        scatter_rows(acc, src, s, d, count_col=self.msg, reduce="max" if self.aggr == "max" else "sum")

    def finish(self, acc, x, src, tgt, degree) -> Tensor:
        c, w = self.conv, self.msg
        count = acc[:, w : w + 1]
        if self.aggr == "max":
            agg = torch.where(count > 0, acc[:, :w], torch.zeros(()))
        elif self.aggr == "mean":
            agg = acc[:, :w] / count.clamp(min=1)
        else:
            agg = acc[:, :w]
        if self.transform_first:
            out = agg + c.lin_l.bias if c.lin_l.bias is not None else agg
        else:
            out = c.lin_l(agg)
        if c.root_weight:
            out = out + c.lin_r(x)
        if c.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
        return out


class GCNBlocked(BlockedLayer):
    """``GCNConv``: ``d_i^-1/2 (sum_j d_j^-1/2 x_j W + d_i^-1/2 x_i W) + b``, ``d`` counting one loop of weight 1 per
    node (``degree`` is ``d^-1/2``)."""

    name = "gcn"
    over_memory = 1.4  # measured 1.28x over three layers (1M nodes, 256 MiB)

    def __init__(self, conv: nn.Module):
        super().__init__(conv)
        self.out_width = conv.out_channels
        self.src_width = self.acc_width = self.edge_width = conv.out_channels
        self.needs_degree = self.replaces_self_loops = bool(conv.normalize)

    def prepare_source(self, x, degree):
        h = self.conv.lin(x)
        if self.needs_degree:
            h = h * degree.view(-1, 1)
        return h

    def accumulate(self, acc, src, tgt, s, d) -> None:
        scatter_rows(acc, src, s, d)

    def finish(self, acc, x, src, tgt, degree) -> Tensor:
        out = acc
        if self.needs_degree:
            out = (acc + src) * degree.view(-1, 1)
        if self.conv.bias is not None:
            out = out + self.conv.bias
        return out


class GATBlocked(BlockedLayer):
    """``GATConv``: per target and head a running maximum ``m``, ``sum exp(e - m)`` and ``sum exp(e - m) x_j W``."""

    name = "gat"
    over_memory = 1.75  # measured 1.50x over three layers (1M nodes, 256 MiB, 4 heads)

    def __init__(self, conv: nn.Module):
        super().__init__(conv)
        self.H, self.C = conv.heads, conv.out_channels
        hc = self.H * self.C
        self.out_width = hc if conv.concat else self.C
        self.src_width = hc + self.H
        self.tgt_width = self.H
        self.acc_width = hc + 2 * self.H  # [sum of weighted messages | running max | sum of weights]
        self.edge_width = hc + 4 * self.H
        self.replaces_self_loops = bool(conv.add_self_loops)

    def _lin(self, x: Tensor, which: str) -> Tensor:
        c = self.conv
        lin = c.lin if c.lin is not None else getattr(c, f"lin_{which}")
        return lin(x)

    def prepare_source(self, x, degree):
        H, C = self.H, self.C
        xs = self._lin(x, "src").view(-1, H, C)
        return torch.cat([xs.reshape(-1, H * C), (xs * self.conv.att_src).sum(-1)], 1)

    def prepare_target(self, x, degree):
        xd = self._lin(x, "dst").view(-1, self.H, self.C)
        return (xd * self.conv.att_dst).sum(-1)

    def prepare(self, x, degree):
        if self.conv.lin is None:  # separate source and target maps
            return super().prepare(x, degree)
        src = self.prepare_source(x, degree)  # one map: the target's attention reads the same projection
        xs = src[:, : self.H * self.C].view(-1, self.H, self.C)
        return src, (xs * self.conv.att_dst).sum(-1)

    def new_acc(self, rows: int) -> Tensor:
        acc = torch.zeros(rows, self.acc_width)
        hc = self.H * self.C
        acc[:, hc : hc + self.H] = float("-inf")
        return acc

    def _fold(self, acc: Tensor, d: Tensor, e: Tensor, msg: Tensor) -> None:
        """Fold edges (targets ``d``, logits ``e`` [E, H], messages ``msg`` [E, H, C]) into ``acc``."""
        H, hc = self.H, self.H * self.C
        num, m, den = acc[:, :hc].view(-1, H, self.C), acc[:, hc : hc + H], acc[:, hc + H :]
        rows, inv = torch.unique(d, return_inverse=True)  # only the rows this chunk touches change
        old = m[rows]
        new = old.clone().scatter_reduce_(0, inv.view(-1, 1).expand(-1, H), e, "amax", include_self=True)
        scale = torch.where(torch.isneginf(old), torch.zeros(()), torch.exp(old - new))
        num[rows] *= scale.unsqueeze(-1)
        den[rows] *= scale
        m[rows] = new
        w = torch.exp(e - new[inv])
        den.index_add_(0, d, w)
        num.index_add_(0, d, w.unsqueeze(-1) * msg)

    def accumulate(self, acc, src, tgt, s, d) -> None:
        c, H, hc = self.conv, self.H, self.H * self.C
        if not d.numel():
            return
        xs = src[s]
        e = F.leaky_relu(xs[:, hc:] + tgt[d], c.negative_slope)
        self._fold(acc, d, e, xs[:, :hc].view(-1, H, self.C))

    def finish(self, acc, x, src, tgt, degree) -> Tensor:
        c, H, hc = self.conv, self.H, self.H * self.C
        if c.add_self_loops:
            ids = torch.arange(x.shape[0])
            e = F.leaky_relu(src[:, hc:] + tgt, c.negative_slope)
            self._fold(acc, ids, e, src[:, :hc].view(-1, H, self.C))
        num, den = acc[:, :hc].view(-1, H, self.C), acc[:, hc + H :]
        out = torch.where(den.unsqueeze(-1) > 0, num / (den.unsqueeze(-1) + 1e-16), torch.zeros(()))
        out = out.reshape(-1, hc) if c.concat else out.mean(dim=1)
        if getattr(c, "res", None) is not None:
            out = out + c.res(x)
        if c.bias is not None:
            out = out + c.bias
        return out


def _aggr_name(conv: nn.Module) -> str | None:
    aggr = getattr(conv, "aggr", None)
    if isinstance(aggr, str):
        return aggr
    mod = getattr(conv, "aggr_module", None)
    names = {"MeanAggregation": "mean", "SumAggregation": "sum", "MaxAggregation": "max"}
    return names.get(type(mod).__name__) if mod is not None else None


def blocked_layer(conv: nn.Module) -> tuple[BlockedLayer | None, str]:
    """``conv`` in blocked form, or ``None`` and why it is not (it then runs over full neighbourhoods)."""
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv  # lazy: PyG is heavy

    kind = type(conv).__name__
    if type(conv) is SAGEConv:
        aggr = _aggr_name(conv)
        if aggr not in ("mean", "sum", "max"):
            return None, f"SAGEConv with aggr={aggr!r} (blocked: mean, sum, max)"
        if getattr(conv, "flow", "source_to_target") != "source_to_target":
            return None, f"{kind} with flow={conv.flow!r}"
        return SAGEBlocked(conv, aggr), f"{kind} ({aggr})"
    if type(conv) is GCNConv:
        if conv.flow != "source_to_target" or (conv.normalize and not conv.add_self_loops):
            return None, f"{kind} with flow={conv.flow!r}, add_self_loops={conv.add_self_loops}"
        return GCNBlocked(conv), f"{kind} (normalised sum)" if conv.normalize else f"{kind} (sum)"
    if type(conv) is GATConv:
        if getattr(conv, "edge_dim", None) is not None:
            return None, f"{kind} with edge_dim (edge features are not read)"
        if conv.flow != "source_to_target":
            return None, f"{kind} with flow={conv.flow!r}"
        return GATBlocked(conv), f"{kind} (softmax with a running maximum)"
    return None, f"{kind} has no blocked form here"


#: layers whose output for a node reads only its own row and its in-neighbours' rows: where they have no blocked
#: form they run over full in-neighbourhoods (without edge features, flow source to target)
ONE_HOP = ("SAGEConv", "GINConv", "GraphConv", "GATv2Conv", "TransformerConv", "ResGatedGraphConv", "EdgeConv",
           "GeneralConv", "LEConv")


def neighbourhood_layer(conv: nn.Module) -> tuple[bool, str]:
    """Whether ``conv`` may run over each target's full in-neighbourhood, and if not, why.

        >>> from torch_geometric.nn import GCNConv, GINConv
        >>> import torch
        >>> neighbourhood_layer(GINConv(torch.nn.Linear(4, 4)))
        (True, '')
        >>> neighbourhood_layer(GCNConv(4, 4, add_self_loops=False))[1][:40]
        'GCNConv with these settings is not one o'
    """
    name = type(conv).__name__
    if name not in ONE_HOP:
        return False, (f"{name} with these settings is not one of the layers known to read only a node's "
                       f"in-neighbourhood ({', '.join(ONE_HOP)}), and has no blocked form; its output may depend on "
                       "its sources' own degrees or on several hops, which reading neighbourhoods would get wrong")
    if getattr(conv, "flow", "source_to_target") != "source_to_target":
        return False, f"{name} with flow={conv.flow!r}: layer-wise inference aggregates over in-edges"
    for attr in ("edge_dim", "in_edge_channels"):
        if getattr(conv, attr, None) is not None:
            return False, f"{name} reads edge features ({attr}={getattr(conv, attr)}), which are not stored"
    return True, ""
