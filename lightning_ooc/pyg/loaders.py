"""PyG's ``NeighborLoader`` and ``LinkNeighborLoader``, sampling natively: the same arguments, written once.

PyG's loaders take a sampler as ``neighbor_sampler=``, and then ignore their own ``num_neighbors``,
``replace``, ``disjoint`` and ``subgraph_type``. These two subclasses build our sampler
(:class:`~lightning_ooc.sampling.PyGNeighborSampler`) from the loader's own arguments, so a script changes its
import line and its data source and nothing else:

* ``num_neighbors``, ``replace`` and ``disjoint`` reach the sampler (``disjoint=True`` gives ``batch.batch``),
  and so do ``time_attr`` and ``temporal_strategy`` (temporal sampling, seeds at ``input_time`` /
  ``edge_label_time`` or their node times; over our store pair ``"time"`` is the node times and another name
  the edge times, as PyG reads a pair; the dataset's in-edges must be in that time's order);
* a ``neighbor_sampler=`` given as well must agree with them (a disagreement is refused in one line);
* a heterogeneous pair with node types without ``x``, or with ``x`` in half precision, is named in one
  warning line (a ``to_hetero`` model fails on them deep inside PyG otherwise);
* what the native sampler does not do is refused in one line: ``subgraph_type`` other than
  ``"directional"``, ``weight_attr``;
* over a homogeneous store pair, ``NeighborLoader`` without ``input_nodes`` seeds on every node and
  ``LinkNeighborLoader`` without ``edge_label_index`` on every edge, as they do over a ``Data`` (PyG's own
  assert there: over a pair they need ``input_nodes``, and ``edge_label_index=(None, None)`` or an edge
  type).

Everything else (batching, negative sampling, ``transform=``, workers) is PyG's, unchanged.

Example (PyG's unsupervised GraphSAGE example's loader, over our stores)::

    >>> import tempfile, torch
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.pyg import LinkNeighborLoader, NeighborLoader, open_pyg_stores
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=400, avg_degree=4, num_features=8,
    ...                   num_classes=3, progress=False)
    >>> data = open_pyg_stores(root)
    >>> loader = LinkNeighborLoader(data, batch_size=64, shuffle=True, neg_sampling_ratio=1.0,
    ...                             num_neighbors=[10, 10])
    >>> batch = next(iter(loader))
    >>> batch.edge_label_index.shape, int(batch.edge_label.sum())
    (torch.Size([2, 128]), 64)
    >>> nodes = NeighborLoader(data, num_neighbors=[5, 5], batch_size=32, disjoint=True,
    ...                        input_nodes=data.split("train"))
    >>> b = next(iter(nodes))
    >>> b.batch.shape == b.n_id.shape, int(b.batch.max()) == b.batch_size - 1
    (True, True)
    >>> data.close()
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch_geometric.loader import LinkNeighborLoader as _PyGLinkNeighborLoader
from torch_geometric.loader import NeighborLoader as _PyGNeighborLoader

from lightning_ooc.errors import InputError
from lightning_ooc.sampling.pyg import PyGNeighborSampler

__all__ = ["NeighborLoader", "LinkNeighborLoader"]

log = logging.getLogger("lightning_ooc")


def _same_fanout(a: Any, b: Any) -> bool:
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and {k: list(v) for k, v in a.items()} == \
            {k: list(v) for k, v in b.items()}
    return list(a) == list(b)


def _sampler(loader: str, data: Any, num_neighbors: Any, *, replace: bool, disjoint: bool, subgraph_type: Any,
             time_attr: Any, temporal_strategy: str, weight_attr: Any, directed: bool, given: Any) -> Any:  # fmt: skip
    """Our sampler for ``loader``'s arguments (or ``given``, checked against them)."""
    kind = str(getattr(subgraph_type, "value", subgraph_type))
    if kind != "directional" or not directed:
        raise InputError(f"{loader}: subgraph_type={kind!r} is not supported by the native sampler (it samples "
                         "'directional' subgraphs); use PyG's own NeighborSampler (pyg-lib) for it")  # fmt: skip
    if weight_attr is not None:
        raise InputError(f"{loader}: weight_attr={weight_attr!r}: the native sampler samples uniformly; weighted "
                         "sampling needs PyG's own NeighborSampler (pyg-lib)")  # fmt: skip
    if given is None:
        return PyGNeighborSampler(data, num_neighbors, replace=replace, disjoint=disjoint, time_attr=time_attr,
                                  temporal_strategy=temporal_strategy)  # fmt: skip
    if isinstance(given, PyGNeighborSampler):
        temporal = given.temporal is not None
        mine = {"num_neighbors": given.num_neighbors, "replace": given.replace, "disjoint": given.disjoint,
                "time_attr": temporal, "temporal_strategy": given.temporal.strategy if temporal else "uniform"}
        asked = {"num_neighbors": num_neighbors, "replace": replace, "disjoint": disjoint or time_attr is not None,
                 "time_attr": time_attr is not None, "temporal_strategy": temporal_strategy}  # fmt: skip
        differ = [k for k in mine if not (_same_fanout(mine[k], asked[k]) if k == "num_neighbors"
                                          else mine[k] == asked[k] if k == "temporal_strategy"
                                          else bool(mine[k]) == bool(asked[k]))]  # fmt: skip
        if differ:
            said = ", ".join(f"{k}={asked[k]!r} but the sampler's {mine[k]!r}" for k in differ)
            raise InputError(f"{loader}: neighbor_sampler= disagrees with the loader's own arguments ({said}); "
                             "give them once: drop neighbor_sampler= and the loader builds it")  # fmt: skip
    return given


def _edge_label_index(data: Any, edge_label_index: Any) -> Any:
    """PyG's seeds of a link loader over ``data``: over one of our homogeneous store pairs without any, every
    edge of the graph (``(None, None)``, as PyG seeds on ``data.edge_index`` over a ``Data``)."""
    if edge_label_index is not None or not isinstance(data, (tuple, list)) or len(data) != 2:
        return edge_label_index
    gs = data[1]
    if getattr(gs, "sampling_graph", None) is not None and not getattr(gs, "hetero", True):
        return (None, None)
    return edge_label_index


def _say_what_batches_lack(loader: str, data: Any) -> None:
    """One warning line, once per store, where a heterogeneous pair of ours has node types without ``x`` or with
    ``x`` in half precision: a model that reads every type's ``x`` (PyG's ``to_hetero``) fails on them deep
    inside PyG otherwise."""
    fs = data[0] if isinstance(data, (tuple, list)) and len(data) == 2 else None
    if not getattr(fs, "hetero", False) or getattr(fs, "_said_types", False) or not hasattr(fs, "_rows"):
        return
    fs._said_types = True
    bare = [t for t in fs.node_types if t not in fs._rows]
    half = [t for t, rows in fs._rows.items() if rows.dtype in (torch.float16, torch.bfloat16)]
    said = []
    if bare:
        said.append(f"node types {', '.join(bare)} have no features (x), so their batches carry none: a model that "
                    "reads every type's x (to_hetero) fails on them; give them features (synth --hetero ... "
                    "--all-features, or prepare with their features) or leave them out of the model's metadata")  # fmt: skip
    if half:
        said.append(f"x of {', '.join(half)} is {fs._rows[half[0]].dtype} as stored: a float32 model needs "
                    "batch[t].x.float() (or a dataset written with --dtype float32)")  # fmt: skip
    if said:
        log.warning("%s over %s: %s", loader, fs.dataset.root, "; ".join(said))


def _input_nodes(data: Any, input_nodes: Any) -> Any:
    """PyG's seeds of a node loader over ``data``: over one of our homogeneous store pairs without any, every
    node (as PyG takes every node of a ``Data``; over a pair it asserts)."""
    if input_nodes is not None or not isinstance(data, (tuple, list)) or len(data) != 2:
        return input_nodes
    gs = data[1]
    graph = getattr(gs, "sampling_graph", None)
    if graph is not None and not getattr(gs, "hetero", True):
        return torch.arange(int(graph.num_nodes))
    return input_nodes


class NeighborLoader(_PyGNeighborLoader):
    """PyG's ``NeighborLoader``, its sampler ours and built from its own arguments (see the module docstring).

    Takes PyG's arguments; over a ``Data``, a ``HeteroData`` or a store pair (:func:`open_pyg_stores`).
    """

    def __init__(self, data: Any, num_neighbors: Any, input_nodes: Any = None, input_time: Any = None,
                 replace: bool = False, subgraph_type: Any = "directional", disjoint: bool = False,
                 temporal_strategy: str = "uniform", time_attr: str | None = None, weight_attr: str | None = None,
                 transform: Any = None, transform_sampler_output: Any = None, is_sorted: bool = False,
                 filter_per_worker: bool | None = None, neighbor_sampler: Any = None, directed: bool = True,
                 **kwargs: Any):  # fmt: skip
        _say_what_batches_lack("NeighborLoader", data)
        sampler = _sampler("NeighborLoader", data, num_neighbors, replace=replace, disjoint=disjoint,
                           subgraph_type=subgraph_type, time_attr=time_attr, temporal_strategy=temporal_strategy,
                           weight_attr=weight_attr, directed=directed, given=neighbor_sampler)  # fmt: skip
        super().__init__(data, num_neighbors, input_nodes=_input_nodes(data, input_nodes), input_time=input_time, replace=replace,
                         subgraph_type=subgraph_type, disjoint=disjoint, temporal_strategy=temporal_strategy,
                         time_attr=time_attr, weight_attr=weight_attr, transform=transform,
                         transform_sampler_output=transform_sampler_output, is_sorted=is_sorted,
                         filter_per_worker=filter_per_worker, neighbor_sampler=sampler, directed=directed,
                         **kwargs)  # fmt: skip


class LinkNeighborLoader(_PyGLinkNeighborLoader):
    """PyG's ``LinkNeighborLoader``, its sampler ours and built from its own arguments (see the module
    docstring); homogeneous graphs (the native link sampling runs PyG's ``edge_sample``)."""

    def __init__(self, data: Any, num_neighbors: Any, edge_label_index: Any = None, edge_label: Any = None,
                 edge_label_time: Any = None, replace: bool = False, subgraph_type: Any = "directional",
                 disjoint: bool = False, temporal_strategy: str = "uniform", neg_sampling: Any = None,
                 neg_sampling_ratio: Any = None, time_attr: str | None = None, weight_attr: str | None = None,
                 transform: Any = None, transform_sampler_output: Any = None, is_sorted: bool = False,
                 filter_per_worker: bool | None = None, neighbor_sampler: Any = None, directed: bool = True,
                 **kwargs: Any):  # fmt: skip
        _say_what_batches_lack("LinkNeighborLoader", data)
        sampler = _sampler("LinkNeighborLoader", data, num_neighbors, replace=replace, disjoint=disjoint,
                           subgraph_type=subgraph_type, time_attr=time_attr, temporal_strategy=temporal_strategy,
                           weight_attr=weight_attr, directed=directed, given=neighbor_sampler)  # fmt: skip
        super().__init__(data, num_neighbors, edge_label_index=_edge_label_index(data, edge_label_index),
                         edge_label=edge_label, edge_label_time=edge_label_time, replace=replace,
                         subgraph_type=subgraph_type, disjoint=disjoint, temporal_strategy=temporal_strategy,
                         neg_sampling=neg_sampling, neg_sampling_ratio=neg_sampling_ratio, time_attr=time_attr,
                         weight_attr=weight_attr, transform=transform,
                         transform_sampler_output=transform_sampler_output, is_sorted=is_sorted,
                         filter_per_worker=filter_per_worker, neighbor_sampler=sampler, directed=directed,
                         **kwargs)  # fmt: skip
