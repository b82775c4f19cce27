"""PyG's own ``NeighborLoader`` and ``LinkNeighborLoader`` over memory-mapped features: the ``pyg`` baselines
of ``bench epoch`` (node settings, link setting, and ``NeighborLoader`` on a ``HeteroData`` for the
heterogeneous settings); and the same loaders over our ``(FeatureStore, GraphStore)`` pair with our
sampler, its ``pyg-store`` variant (``stores=``: :func:`lightning_ooc.pyg.open_pyg_stores`).

What a user tuning a PyG set-up for features larger than memory would run:
``x`` is the feature file memory-mapped with ``madvise(MADV_RANDOM)`` (no
read-ahead), the topology is the dataset's CSC held as a ``SparseTensor``
(torch-sparse) or an ``edge_index`` (pyg-lib), and ``NeighborLoader`` samples
the same seed batches, in the same order, with the same fanouts as ours. Its
minibatches carry ``edge_index``, ``y`` and ``batch_size`` like ours, so the
same model trains on them. ``num_workers`` loads in that many worker processes (PyG's
``DataLoader`` option, persistent workers); ``bench epoch`` tries 0, 1 and 2 and names the best.

PyG's sampler needs pyg-lib or torch-sparse. They are benchmark references,
never dependencies of this package: :func:`available` says whether one is
installed and, if not, how to get one.
"""
from __future__ import annotations

import importlib.util
import mmap
import warnings
from typing import Any, Callable

import numpy as np
import torch

from lightning_ooc.data.dataset import all_features, open_dataset, random_access_map
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext


def available() -> tuple[bool, str]:
    """Whether PyG's ``NeighborLoader`` can sample here, and what is missing if not."""
    if importlib.util.find_spec("torch_sparse") or importlib.util.find_spec("pyg_lib"):
        return True, ""
    return False, ("PyG's NeighborLoader needs pyg-lib or torch-sparse and neither is installed (a benchmark "
                   "reference only: pip install --no-build-isolation torch-scatter torch-sparse)")  # fmt: skip


def pyg_datamodule(root: str, batch_size: int, num_neighbors: list[int], seed: int = 0, num_workers: int = 0,
                   stores: dict[str, Any] | None = None, in_ram: bool = False, time: dict[str, Any] | None = None,
                   **_: Any) -> Any:  # fmt: skip
    """A LightningDataModule serving the training seed batches of epoch 0 of
    ``OutOfCoreNodeData(root, batch_size, num_neighbors, seed)`` through PyG's ``NeighborLoader`` with
    memory-mapped features (``MADV_RANDOM``; ``in_ram``: read into memory first, PyG's in-memory ``Data``),
    loading in ``num_workers`` worker processes (persistent; 0: in the trainer's process). With ``stores``
    (``open_pyg_stores`` options), over our store pair with our sampler instead. Lightning is imported here,
    not with this module. ``time={"time_attr": "edge_time"}`` samples by time, as ``OutOfCoreNodeData(time=...)``:
    the same seeds at the same times (``input_time``), PyG's temporal sampler (pyg-lib) over the edges' times,
    or ours over the pair."""
    time_attr = (time or {}).get("time_attr")

    def loader(ds: Any) -> Any:
        from torch_geometric.loader import NeighborLoader  # lazy: PyG only where it is used

        from lightning_ooc.loader.tasks import seed_batches, seed_time  # lazy: it imports PyG and Triton

        cfg = NodeDataConfig(root=str(root), batch_size=int(batch_size), num_neighbors=list(num_neighbors),
                             seed=seed, progress=False, time=time)  # fmt: skip
        seeds = seed_batches(cfg, ds, ProcessContext()).epoch("train", 0).cat()
        timed: dict[str, Any] = {}
        if time_attr is not None:  # the batches hold positions in the split: the seeds and their times
            pos = seeds.long()
            seeds = ds.split("train")[pos]
            timed = dict(time_attr=time_attr, input_time=seed_time(cfg, ds, "train", pos))
        data, opts = _source(ds, stores, num_neighbors, in_ram, time_attr)
        if stores is None:
            data.y = torch.from_numpy(ds.labels[:]).to(torch.int64)
        return NeighborLoader(data, num_neighbors=list(num_neighbors), input_nodes=seeds, batch_size=int(batch_size),
                              shuffle=False, transform=_with_edge_index, **timed, **opts,
                              **_workers(num_workers))  # fmt: skip

    return _loader_datamodule(root, loader, needs_sampler=stores is None)


def _source(ds: Any, stores: dict[str, Any] | None, num_neighbors: list[int],
            in_ram: bool = False, time_attr: str | None = None) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """What PyG's loader loads from and its extra options: the memory-mapped graph (``stores`` None; its
    features read into memory with ``in_ram``; with ``time_attr``, its ``edge_index`` and edge times), or our
    store pair opened with ``stores`` and our sampler as its ``neighbor_sampler``."""
    if stores is None:
        data = _pyg_graph(ds, time_attr)
        if in_ram:  # every row read into memory in one sequential copy: PyG's in-memory Data
            data.x = all_features(ds)
        return data, {"is_sorted": True}  # the stored CSC's order: by target, and by time within (see _pyg_graph)
    from lightning_ooc.pyg import open_pyg_stores  # lazy: it imports PyG
    from lightning_ooc.sampling import PyGNeighborSampler  # lazy: it imports PyG and the native sampler

    pair = open_pyg_stores(ds, **stores)
    return pair, {"neighbor_sampler": PyGNeighborSampler(pair, list(num_neighbors), time_attr=time_attr)}


def _workers(num_workers: int) -> dict[str, Any]:
    """A PyG loader's worker options: ``num_workers`` processes kept across epochs (none for 0)."""
    n = int(num_workers)
    if n < 0:
        raise ValueError(f"num_workers must be 0 or more, got {n}")
    return {"num_workers": n, "persistent_workers": n > 0}


def _loader_datamodule(root: str, loader: Callable[[Any], Any], needs_sampler: bool = True) -> Any:
    """A LightningDataModule whose training loader is ``loader(dataset at root)``, made at ``setup`` (where
    PyG's sampler can run: :func:`available`, unless the loader brings ours: ``needs_sampler=False``)."""
    import lightning as L  # lazy: Lightning takes seconds to import


    class PygLoaderData(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.dataset = None
            self._loader = None

        def setup(self, stage: str | None = None) -> None:
            if self._loader is not None:
                return
            ok, why = available()
            if needs_sampler and not ok:
                raise RuntimeError(why)
            self.dataset = open_dataset(root)
            self._loader = loader(self.dataset)

        def train_dataloader(self):
            if self._loader is None:
                self.setup("fit")
            return self._loader

    return PygLoaderData()


def _pyg_graph(ds: Any, time_attr: str | None = None) -> Any:
    """The dataset as PyG's samplers take it: ``x`` the feature file memory-mapped with ``MADV_RANDOM``
    (no copy: rows are read through the page cache as PyG indexes them), the topology as an ``adj_t``
    ``SparseTensor`` (torch-sparse), else an ``edge_index`` in CSC order (sorted by target: PyG's
    ``is_sorted=True`` skips its sort). With ``time_attr`` (PyG samples by time only with pyg-lib), the edge
    times as the edge attribute ``time_attr`` or the node times as ``time``: the stored CSC keeps each node's
    in-edges in time order, as pyg-lib needs, so PyG holds the topology once and sorts nothing (its smallest
    form: 8 bytes an edge for the sources in memory, the times mapped from their file)."""
    from torch_geometric.data import Data  # lazy: PyG only where it is used

    if time_attr is not None and not importlib.util.find_spec("pyg_lib"):
        raise RuntimeError("PyG samples by time only with pyg-lib, which is not installed (a benchmark "
                           "reference only)")  # fmt: skip
    x = _mapped_rows(ds)
    indptr = torch.from_numpy(ds.indptr).to(torch.int64)
    indices = torch.from_numpy(ds.indices[:]).to(torch.int64)
    data = Data(x=x, num_nodes=ds.num_nodes)
    if importlib.util.find_spec("torch_sparse"):
        from torch_sparse import SparseTensor  # lazy: optional, torch-sparse (a benchmark reference)

        # row = target, col = source: PyG's adj_t, whose row v lists the sources of v's in-edges
        data.adj_t = SparseTensor(rowptr=indptr, col=indices, sparse_sizes=(ds.num_nodes, ds.num_nodes),
                                  is_sorted=True, trust_data=True)  # fmt: skip
    else:
        dst = torch.repeat_interleave(torch.arange(ds.num_nodes), indptr[1:] - indptr[:-1])
        data.edge_index = torch.stack([indices, dst])
    if time_attr == "time":
        data.time = _mapped_times(ds.node_time)
    elif time_attr is not None:  # in the CSC's order, as adj_t and edge_index hold the edges
        data[time_attr] = _mapped_times(ds.edge_time)
    return data


def _mapped_times(a: np.ndarray) -> torch.Tensor:
    """Stored int64 times as a tensor over their file, mapped with ``MADV_RANDOM`` as the features are (no copy:
    under a memory cap their pages can be evicted, where a copy would hold 8 bytes an edge for good)."""
    with warnings.catch_warnings():  # a read-only map: PyG's sampler only reads it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(random_access_map(a))


def pyg_link_datamodule(root: str, batch_size: int, num_neighbors: list[int], neg_sampling: Any = "binary",
                        seed: int = 0, max_batches: int | None = None, num_workers: int = 0,
                        stores: dict[str, Any] | None = None, time: dict[str, Any] | None = None,
                        **_: Any) -> Any:  # fmt: skip
    """A LightningDataModule serving the training edges of epoch 0 of
    ``OutOfCoreLinkData(root, batch_size, num_neighbors, neg_sampling, seed)``, in the same batches and
    order, through PyG's ``LinkNeighborLoader`` with memory-mapped features (``MADV_RANDOM``); PyG draws
    its own negatives (the same mode and amount, uniform). The ``pyg`` variant of ``bench epoch``'s link
    setting. With ``max_batches``, PyG is given only the edges of the first ``max_batches`` batches
    (``LinkNeighborLoader`` holds its ``edge_label_index`` in memory: the whole split would only cost it
    memory the measured batches do not use). With ``stores``, over our store pair with our sampler. With
    ``time`` (``{"time_attr": ...}``), each edge's subgraph at its time (``edge_label_time``: the split's times)."""
    time_attr = (time or {}).get("time_attr")

    def loader(ds: Any) -> Any:
        from torch_geometric.loader import LinkNeighborLoader  # lazy: PyG only where it is used
        from torch_geometric.sampler import NegativeSampling as PygNegativeSampling  # lazy: PyG only where it is used

        # lazy: it imports PyG and Triton
        from lightning_ooc.loader.link_task import LinkDataConfig, has_link_splits_or_fail, link_batches

        has_link_splits_or_fail(ds)
        cfg = LinkDataConfig(root=str(root), batch_size=int(batch_size), num_neighbors=list(num_neighbors),
                             neg_sampling=neg_sampling, seed=seed, progress=False)  # fmt: skip
        ns = cfg.negatives
        batches = link_batches(cfg, ds, ProcessContext()).epoch("train", 0)
        # every batch but the last is full: the first max_batches are a prefix of the order
        positions = batches.cat()[: max_batches * int(batch_size) if max_batches else None].to(torch.int64)
        index = ds.link_split("train").index[:, positions]
        neg = None if ns is None else PygNegativeSampling(ns.mode, amount=ns.amount)
        data, opts = _source(ds, stores, num_neighbors, time_attr=time_attr)
        if time_attr is not None:
            opts = dict(opts, time_attr=time_attr, edge_label_time=ds.link_split("train").time[positions])
        if stores is not None:  # over a store pair PyG takes the edges with their edge type (None: homogeneous)
            index = (None, index)
        return LinkNeighborLoader(data, num_neighbors=list(num_neighbors), edge_label_index=index,
                                  neg_sampling=neg, batch_size=int(batch_size), shuffle=False,
                                  transform=_with_edge_index, **opts, **_workers(num_workers))  # fmt: skip

    return _loader_datamodule(root, loader, needs_sampler=stores is None)


def _with_edge_index(batch: Any) -> Any:
    """PyG's batch from a ``SparseTensor`` carries ``adj_t``; the models read ``edge_index`` (per relation
    of a ``HeteroData``)."""
    from torch_geometric.data import HeteroData  # lazy: PyG only where it is used

    for store in batch.edge_stores if isinstance(batch, HeteroData) else [batch]:
        adj_t = store["adj_t"] if "adj_t" in store else None
        if adj_t is not None and "edge_index" not in store:
            row, col, _ = adj_t.coo()  # row: target, col: source
            store.edge_index = torch.stack([col, row])
            del store.adj_t
    return batch


def pyg_hetero_datamodule(root: str, batch_size: int, num_neighbors: list[int], seed: int = 0,
                          input_type: str | None = None, num_workers: int = 0, stores: dict[str, Any] | None = None,
                          **_: Any) -> Any:  # fmt: skip
    """A LightningDataModule serving the training seed batches of epoch 0 of
    ``OutOfCoreNodeData(root, batch_size, num_neighbors, seed)`` (a heterogeneous ``root``) through PyG's
    ``NeighborLoader`` on a ``HeteroData``: every node type's features memory-mapped (``MADV_RANDOM``), every relation's CSC as a
    ``SparseTensor`` (torch-sparse) or an ``edge_index`` (pyg-lib). The ``pyg`` variant of ``bench epoch``'s
    heterogeneous settings. With ``stores``, over our store pair with our sampler."""

    def loader(ds: Any) -> Any:
        from torch_geometric.data import HeteroData  # lazy: PyG only where it is used
        from torch_geometric.loader import NeighborLoader  # lazy: PyG only where it is used

        from lightning_ooc.loader.hetero_task import hetero_seed_batches  # lazy: it imports PyG and Triton
        from lightning_ooc.loader.hetero_task import input_type as seed_type  # lazy: it imports PyG and Triton

        cfg = NodeDataConfig(root=str(root), batch_size=int(batch_size), num_neighbors=list(num_neighbors),
                             seed=seed, input_type=input_type, progress=False)  # fmt: skip
        t = seed_type(cfg, ds)
        seeds = hetero_seed_batches(cfg, ds, ProcessContext(), t).epoch("train", 0).cat()
        if stores is not None:
            pair, opts = _source(ds, stores, num_neighbors)
            return NeighborLoader(pair, num_neighbors=list(num_neighbors), input_nodes=(t, seeds),
                                  batch_size=int(batch_size), shuffle=False, **opts, **_workers(num_workers))  # fmt: skip
        data = HeteroData()
        for nt in ds.node_types:
            node = ds.node(nt)
            data[nt].num_nodes = node.num_nodes
            if node.has_features:
                data[nt].x = _mapped_rows(node)
        data[t].y = torch.from_numpy(ds.node(t).labels[:]).to(torch.int64)
        sparse = importlib.util.find_spec("torch_sparse") is not None
        for et, csc in ds.csc.items():
            indptr = torch.from_numpy(csc.indptr).to(torch.int64)
            indices = torch.from_numpy(csc.indices[:]).to(torch.int64)
            if sparse:
                from torch_sparse import SparseTensor  # lazy: optional, torch-sparse (a benchmark reference)

                data[et].adj_t = SparseTensor(rowptr=indptr, col=indices, sparse_sizes=(csc.num_nodes, csc.num_src_nodes),
                                              is_sorted=True, trust_data=True)  # fmt: skip
            else:
                dst = torch.repeat_interleave(torch.arange(csc.num_nodes), indptr[1:] - indptr[:-1])
                data[et].edge_index = torch.stack([indices, dst])
        return NeighborLoader(data, num_neighbors=list(num_neighbors), input_nodes=(t, seeds),
                              batch_size=int(batch_size), shuffle=False, transform=_with_edge_index,
                              **_workers(num_workers))  # fmt: skip

    return _loader_datamodule(root, loader, needs_sampler=stores is None)


def _mapped_rows(ds: Any) -> torch.Tensor:
    """A feature file memory-mapped with ``MADV_RANDOM``, as a tensor (no copy; PyG only reads it)."""
    mm = ds.features_memmap()
    if getattr(mm, "_mmap", None) is not None:
        mm._mmap.madvise(mmap.MADV_RANDOM)
    with warnings.catch_warnings():  # a read-only map
        warnings.simplefilter("ignore", UserWarning)
        x = torch.from_numpy(mm)
    return x.view(torch.bfloat16) if ds.feature_dtype == torch.bfloat16 else x
