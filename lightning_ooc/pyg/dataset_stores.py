"""PyG's ``FeatureStore`` and ``GraphStore`` over an on-disk dataset: PyG's own loaders read through our tiers.

:func:`open_pyg_stores` opens a dataset directory as the ``(feature_store, graph_store)`` pair that PyG's
``NeighborLoader``, ``LinkNeighborLoader`` and the rest of its remote-backend tooling take in place of a
``Data``:

* :class:`OutOfCoreFeatureStore` serves ``x`` (where the dataset has features), ``y`` (where it has
  labels) and ``time`` (where it stores node times: OGB's and MAG240M's years) per node type, PyG's
  ``TensorAttr`` group (``None`` for a homogeneous graph). Where the features fit half of the memory the
  process may use (``in_memory="auto"``), every row is read into memory when the store opens and ``x`` is
  served by index, as from PyG's in-memory ``Data``. Otherwise ``x`` is read through the tiers: an optional
  host cache of the highest in-degree rows, then direct I/O (io_uring where it works) of the rest; a
  ``multi_get_tensor`` of a batch's ids is one batched read per node type, sorted and merged, never a page
  fault per row. ``y`` is read into memory when the store opens (8 bytes per node); ``time`` is
  memory-mapped. The dataset stores no node weights. Without an index (``get_tensor(None, "x")``) a read
  is of every row.
* :class:`OutOfCoreGraphStore` serves every relation's in-edge CSC (``layout="csc"``: PyG's
  ``(row, colptr)``), and COO on request; PyG's samplers take int64 ids, so a relation's ids are converted
  once, cached, and the memory that costs is logged. Our own sampler
  (:class:`~lightning_ooc.sampling.PyGNeighborSampler`, PyG's ``neighbor_sampler=``) reads the on-disk
  CSC instead and costs nothing here.

:func:`open_pyg_stores` returns the pair as a :class:`PyGStores`: a tuple that also gives the dataset's
splits (OGB's ``get_idx_split()``), classes and metadata, and refuses a graph transform in one line.
:mod:`lightning_ooc.pyg.loaders` has PyG's ``NeighborLoader`` and ``LinkNeighborLoader`` with our sampler
built from their own arguments.

The stores are read-only, but for learnable input features: ``open_pyg_stores(root, embeddings=TABLE,
writable=True)`` serves ``x`` from an embedding table (``lightning-ooc init-embeddings``) and
``put_tensor`` writes rows back through the table's journal (a crash loses nothing written before it).

PyG's loader workers (``num_workers > 0``) fork this process: each worker opens its own readers on first
use (rings and threads do not survive a fork) and shares the host cache with its parent, copy on write.
A spawned worker gets the stores pickled as their dataset path and options, and reopens them.

Example::

    >>> import tempfile, torch
    >>> from torch_geometric.loader import NeighborLoader
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.pyg import open_pyg_stores
    >>> from lightning_ooc.sampling import PyGNeighborSampler
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=500, avg_degree=4, num_features=8,
    ...                   num_classes=3, progress=False)
    >>> fs, gs = open_pyg_stores(root)
    >>> from lightning_ooc.pyg import OutOfCoreFeatureStore, OutOfCoreGraphStore, PyGStoreOptions
    >>> isinstance(fs, OutOfCoreFeatureStore), isinstance(gs, OutOfCoreGraphStore), fs.options == PyGStoreOptions()
    (True, True, True)
    >>> fs.in_memory, open_pyg_stores(root, in_memory=False)[0].in_memory  # 16 KB of features fit
    (True, False)
    >>> fs.get_tensor_size(None, "x"), fs.get_tensor(None, "x", torch.tensor([3, 1])).shape
    ((500, 8), torch.Size([2, 8]))
    >>> row, colptr = gs.get_edge_index(None, "csc")
    >>> int(colptr[-1]) == row.numel()
    True
    >>> loader = NeighborLoader((fs, gs), num_neighbors=[4, 2], batch_size=50, input_nodes=torch.arange(100),
    ...                         neighbor_sampler=PyGNeighborSampler((fs, gs), [4, 2]))
    >>> batch = next(iter(loader))
    >>> batch.batch_size, batch.x.shape[0] == batch.n_id.numel() == batch.y.numel()
    (50, True)
    >>> fs.close()
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch_geometric.data import EdgeAttr, FeatureStore, GraphStore, TensorAttr
from torch_geometric.data.feature_store import _FieldStatus
from torch_geometric.data.graph_store import EdgeLayout

from lightning_ooc.data.dataset import all_features, open_dataset
from lightning_ooc.data.format import human_bytes, parse_bytes
from lightning_ooc.errors import InputError
from lightning_ooc.io import FeatureReader
from lightning_ooc.store.staging import StagingBuffer
from lightning_ooc.store.tiered import TieredFeatureStore

log = logging.getLogger("lightning_ooc")

#: readers a forked process inherited from its parent: kept referenced and never closed there (their threads
#: and rings are the parent's; closing them from the child would wait for threads that do not exist in it)
_INHERITED: list[Any] = []

#: staging of a store's reader chain (rows of one read wait here only where a buffer tier would use it)
STAGING_BYTES = 1 << 20


@dataclass
class PyGStoreOptions:
    """How :func:`open_pyg_stores` reads: what a spawned worker needs to open the same stores again."""

    host_cache: int = 0
    io_backend: str = "auto"
    queue_depth: int = 128
    workers: int = 1
    embeddings: str | None = None
    writable: bool = False
    progress: bool = False
    in_memory: Any = "auto"


class _NodeRows:
    """One node type's ``x``: the host cache (built once, shared with forked workers) and, per process, the
    chain of tiers over a reader of its own."""

    def __init__(self, owner: "OutOfCoreFeatureStore", src: Any, name: str, host_ids: torch.Tensor | None):
        self.owner, self.src, self.name = owner, src, name
        self.num_nodes = int(src.num_nodes)
        self._host = None  # the HostCache, filled when the chain is first built (the store fills it at opening)
        self._host_ids = host_ids
        self._pid = -1
        self._store: TieredFeatureStore | None = None
        self._reader: FeatureReader | None = None
        self._mu = threading.Lock()
        #: every row in memory (the features fit the memory given): read by index, no tiers
        self.memory: torch.Tensor | None = None

    @property
    def num_features(self) -> int:
        t = self.owner.table
        return int(t.dim) if t is not None else int(self.src.num_features)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.owner.table is not None else self.src.feature_dtype

    def _open_reader(self) -> FeatureReader:
        o, t = self.owner.options, self.owner.table
        if t is not None:
            return FeatureReader(t.partition_path(0), t.row_floats, torch.float32, backend=o.io_backend,
                                 queue_depth=o.queue_depth, num_rows=t.num_nodes, workers=o.workers)  # fmt: skip
        return FeatureReader(self.src.features_path, self.src.num_features, self.src.feature_dtype,
                             backend=o.io_backend, queue_depth=o.queue_depth, num_rows=self.num_nodes,
                             workers=o.workers, offset=self.src.features_offset)  # fmt: skip

    def chain(self) -> TieredFeatureStore:
        """This process's chain: ``host cache -> direct I/O`` (the reader opened here on first use)."""
        pid = os.getpid()
        if self._pid != pid and self._pid != -1:  # a forked child: the parent's lock may be held, its reader dead
            if self._reader is not None:
                _INHERITED.append(self._reader)
            self._mu, self._store, self._reader, self._pid = threading.Lock(), None, None, -1
        with self._mu:
            if self._store is None:
                self._store = self._build()
                self._pid = pid
            return self._store

    def _build(self) -> TieredFeatureStore:
        from lightning_ooc.store.host_cache import HostCache  # lazy: it imports Triton
        from lightning_ooc.store.learnable_rows import TableRowsTier  # lazy: it imports Triton
        from lightning_ooc.store.tiers import HostCacheTier, ReaderTier  # lazy: it imports Triton

        reader = self._open_reader()
        try:
            staging = StagingBuffer(STAGING_BYTES, reader.num_features, reader.dtype, pin=False)
            if self.owner.table is not None:
                last = TableRowsTier(reader, staging, self.owner.table.dim)
            else:
                last = ReaderTier(reader, staging)
            tiers = []
            if self._host_ids is not None and self._host_ids.numel():
                if self._host is None:
                    self._host = HostCache.load(reader, self._host_ids, self.num_nodes,
                                                progress=self.owner.options.progress)  # fmt: skip
                    log.info("PyG feature store: host cache of %s holds %s rows (%s)", self.name,
                             f"{self._host_ids.numel():,}", human_bytes(self._host.rows.numel() *
                                                                       self._host.rows.element_size()))  # fmt: skip
                tiers.append(HostCacheTier(self._host))
            tiers.append(last)
        except BaseException:
            reader.close()
            raise
        self._reader = reader
        # the host cache is not the chain's to close: forked workers share it
        return TieredFeatureStore(tiers, self.num_features, self.dtype, owned=[last])

    def load(self) -> None:
        """Every row into memory, read once in file order (forked loader workers share the pages)."""
        self.memory = all_features(self.src)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (checked): from memory where every row is there, else through the chain, one batched read
        of the rows no cache holds."""
        if self.memory is not None:
            return self.memory.index_select(0, ids)
        if ids.numel() == 0:
            return torch.empty((0, self.num_features), dtype=self.dtype)
        store = self.chain()
        ext = store.extract(ids)
        try:
            return store.gather(ext)
        finally:
            store.release(ext)

    def full_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole table rows (embedding and optimiser state) of ``ids``, for a write-back."""
        self.chain()
        return self._reader.gather(ids)

    def close(self) -> None:
        with self._mu:
            if self._store is not None and self._pid == os.getpid():
                self._store.close()
                self._reader.close()
            self._store = self._reader = None
            self._host = None


#: torch's unsigned integer dtypes wider than a byte (the torch release may lack some): their ids are checked as
#: NumPy's unsigned ints, before a cast to int64 could wrap the largest round
_WIDE_UNSIGNED = tuple(getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name))


def _out_of_range(bad: int, n: int, what: str) -> InputError:
    return InputError(f"{what}: node id {bad} is out of range; ids must lie in 0..{n - 1}")


def _not_ids(index: Any, what: str) -> InputError:
    return InputError(f"{what}: index must be None, a slice, an int, or a tensor or array of node ids, got "
                      f"{type(index).__name__}")  # fmt: skip


def _python_ints(values: list | tuple) -> list[int] | None:
    """The integers of a list or tuple (nested ones too) whose every entry is an integer (Python's or NumPy's, not
    a bool), in order; None where any entry is something else (a bool, a float, an array, an object)."""
    out: list[int] = []
    stack = [iter(values)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, (list, tuple)):
                stack.append(iter(v))
                break
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                return None
            out.append(int(v))
        else:
            stack.pop()
    return out


def _index_ids(index: Any, n: int, what: str) -> tuple[torch.Tensor, bool]:
    """``(ids, scalar)``: the node ids a ``TensorAttr.index`` names (None: all; a slice; an int; ids; a mask).

    An integer of any kind PyG may be given (Python's, NumPy's signed and unsigned, torch's) names the id it
    holds, however large: one past int64 is out of range, not wrapped round; floats, a single bool, and a mask
    of another length than the nodes are refused. Every refusal is an :class:`~lightning_ooc.errors.InputError`
    naming ``what``.

    >>> _index_ids(np.uint64(2), 5, "x")[0].tolist(), _index_ids(np.array([4, 0], np.uint16), 5, "x")[0].tolist()
    ([2], [4, 0])
    >>> _index_ids(np.uint64(2**63 + 5), 5, "x")
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.InputError: x: node id 9223372036854775813 is out of range; ids must lie in 0..4

    A list of integers is checked as the integers it holds, before NumPy would promote a mix of negative and
    unsigned 64-bit ones to floats:

    >>> _index_ids([-1, 2**63], 5, "x")
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.InputError: x: node id -1 is out of range; ids must lie in 0..4
    """
    if index is None:
        return torch.arange(n), False
    if isinstance(index, slice):
        return torch.arange(*index.indices(n)), False
    if isinstance(index, (bool, np.bool_)):
        raise InputError(f"{what}: index {bool(index)} is a single bool; a boolean index must have one entry per node "
                         f"({n})")  # fmt: skip
    if isinstance(index, (int, np.integer)):
        value = int(index)
        if not 0 <= value < n:
            raise _out_of_range(value, n, what)
        return torch.tensor([value]), True
    if isinstance(index, (list, tuple)):
        ints = _python_ints(index)
        if ints:  # their range first: NumPy holds [-1, 2**63] as float64, and 2**64 as an object
            low, high = min(ints), max(ints)
            if low < 0 or high >= n:
                raise _out_of_range(low if low < 0 else high, n, what)
        try:
            index = np.asarray(index, dtype=np.int64 if ints is not None else None)
        except (TypeError, ValueError):
            raise _not_ids(index, what) from None
        if index.dtype == object:  # integers beyond 64 bits, or entries that are not numbers
            flat = index.reshape(-1).tolist()
            if flat and all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
                raise _out_of_range(min(flat) if min(flat) < 0 else max(flat), n, what)
            raise InputError(f"{what}: node ids must be integers, got {sorted({type(v).__name__ for v in flat})}")
    if isinstance(index, torch.Tensor) and index.dtype in _WIDE_UNSIGNED:
        index = index.cpu().numpy()
    if isinstance(index, np.ndarray) and index.dtype.kind == "u":  # up to 2**64 - 1: compared before any cast
        if index.size and int(index.max()) >= n:
            raise _out_of_range(int(index.max()), n, what)
        index = index.astype(np.int64)
    try:
        ids = torch.as_tensor(index)
    except (TypeError, ValueError, RuntimeError):
        raise _not_ids(index, what) from None
    if ids.dtype == torch.bool:
        if ids.shape != (n,):
            raise InputError(f"{what}: a boolean index must have one entry per node ({n}), got {tuple(ids.shape)}")
        ids = ids.nonzero().view(-1)
    elif ids.dtype.is_floating_point or ids.is_complex():
        raise InputError(f"{what}: node ids must be integers, got {ids.dtype}")
    ids = ids.to(device="cpu", dtype=torch.int64).reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise _out_of_range(int(ids.min()) if int(ids.min()) < 0 else int(ids.max()), n, what)
    return ids, False


@dataclass
class _IndexAttr(TensorAttr):
    """PyG's ``TensorAttr`` with any index PyG allows: PyG's own tells whether a field is set with ``!=``, which a
    NumPy array of several ids answers element by element (a ``ValueError`` before the store is asked)."""

    def is_set(self, key: str) -> bool:
        if key not in self.__dataclass_fields__:
            raise KeyError(f"TensorAttr has no field {key!r}")
        return getattr(self, key) is not _FieldStatus.UNSET

    @classmethod
    def cast(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], TensorAttr) and not isinstance(args[0], cls):
            given = args[0]  # PyG's own (its loaders build them): the same fields, checked as ours
            return cls(**{k: getattr(given, k) for k in given.__dataclass_fields__})
        return super().cast(*args, **kwargs)


#: the share of what this process may still allocate that ``in_memory="auto"`` lets the features take (the rest is
#: the loader's, the model's and the training's)
IN_MEMORY_SHARE = 0.5


def _fits_in_memory(dataset: Any, srcs: list[Any], setting: Any) -> bool:
    """Whether the stores hold every feature row in memory: ``setting`` True or False, or ``"auto"``: where the
    rows take at most :data:`IN_MEMORY_SHARE` of what the process may allocate (the memory cgroup's limit and
    ``MemAvailable``). Logged either way."""
    if isinstance(setting, str) and setting != "auto" or not isinstance(setting, (bool, str)):
        raise InputError(f"in_memory must be True, False or 'auto', got {setting!r}")
    need = sum(int(s.num_nodes) * int(s.row_bytes) for s in srcs)
    if setting is not True and (setting is False or not need):
        return False
    if setting == "auto":
        # the limit as it stands, without the full garbage collection a plan pays for under a tight limit: a
        # half-of-it choice does not need the last megabytes
        from lightning_ooc.store.limits import memory_limit  # lazy: with the planner's dependencies

        limit = memory_limit()
        room = None if limit.unlimited else int(limit.bytes * IN_MEMORY_SHARE)
        if room is not None and need > room:
            log.info("PyG feature store: the features of %s (%s) are read through the tiers: more than %.0f%% of %s",
                     dataset.root, human_bytes(need), 100 * IN_MEMORY_SHARE, limit)  # fmt: skip
            return False
    log.info("PyG feature store: the features of %s (%s) are held in memory", dataset.root, human_bytes(need))
    return True


def _group_words(group: Any) -> str:
    if isinstance(group, (tuple, list)):
        return f"edge type {tuple(group)!r}"
    return "the graph" if group is None else f"node type {group!r}"


class OutOfCoreFeatureStore(FeatureStore):
    """A PyG ``FeatureStore`` over an on-disk dataset's rows (see :mod:`lightning_ooc.pyg.dataset_stores`).

    Open it with :func:`open_pyg_stores`. Groups are node types (``None`` for a homogeneous graph);
    attributes are ``x`` and ``y``, and ``time`` where the dataset stores node times (OGB's node years). Call :meth:`close` (or use it as a context manager) to let the readers go;
    with learnable features, :meth:`flush` makes every row written so far durable (``close`` does too).
    """

    def __init__(self, dataset: Any, options: PyGStoreOptions | None = None):
        super().__init__(tensor_attr_cls=_IndexAttr)
        o = options or PyGStoreOptions()
        self.dataset, self.options = dataset, o
        self.table: Any = None  # an EmbeddingTable, with learnable features
        self._writer: Any = None  # its journaled row writer, when writable
        self._label_cache: dict[Any, np.ndarray] = {}
        self._closed = False
        self._write_mu = threading.Lock()
        if getattr(dataset, "partition", None) is not None:
            raise InputError(f"{dataset.root} is a part of a partitioned dataset; open the whole dataset it was "
                             "partitioned from, or train on the parts with OutOfCoreNodeData")  # fmt: skip
        self.hetero = bool(getattr(dataset, "is_hetero", False))
        #: the node types: PyG's group names (``[None]`` for a homogeneous graph)
        self.node_types: list[Any] = list(dataset.node_types) if self.hetero else [None]
        self._srcs = {t: dataset.node(t) if self.hetero else dataset for t in self.node_types}
        if o.embeddings is not None:
            if self.hetero:
                raise InputError("learnable features (embeddings=) are for a homogeneous graph; this one is "
                                 f"heterogeneous ({dataset.root})")  # fmt: skip
            self._open_table(o)
        elif o.writable:
            raise InputError(f"{dataset.root}: writable=True needs learnable features (embeddings=TABLE, a table "
                             "from `lightning-ooc init-embeddings`); the dataset's own features are read-only")  # fmt: skip
        srcs = self._srcs
        with_x = [t for t in self.node_types if self.table is not None or getattr(srcs[t], "num_features", 0) > 0]
        #: every node type's rows held in memory (``in_memory``: they fit the memory this process may use)
        self.in_memory = self.table is None and _fits_in_memory(dataset, [srcs[t] for t in with_x], o.in_memory)
        hosts = self._host_ids(with_x) if o.host_cache > 0 and self.table is None and not self.in_memory else {}
        self._rows = {t: _NodeRows(self, srcs[t], _group_words(t), hosts.get(t)) for t in with_x}
        if self.in_memory:
            for rows in self._rows.values():
                rows.load()
        self._labelled = [t for t in self.node_types if getattr(srcs[t], "labels", None) is not None]
        self._timed = [t for t in self.node_types if getattr(srcs[t], "node_time", None) is not None]
        #: the time arrays by (group, attribute): node times as ``time``, edge times (in the graph store's edge id
        #: order, the CSC's) as ``edge_time`` of the edge type (None for a homogeneous graph), as PyG's temporal
        #: sampler reads a pair (the name ``time`` means node times, any other edge times)
        self._times: dict[tuple[Any, str], np.ndarray] = {(t, "time"): srcs[t].node_time for t in self._timed}
        if self.hetero:
            self._times.update(((et, "edge_time"), csc.edge_time) for et, csc in dataset.csc.items()
                               if getattr(csc, "edge_time", None) is not None)  # fmt: skip
        elif getattr(dataset, "edge_time", None) is not None:
            self._times[None, "edge_time"] = dataset.edge_time
        #: (group, attribute) of every tensor the store holds
        self._attrs = [(t, a) for t in self.node_types
                       for a, held in (("x", t in self._rows), ("y", t in self._labelled), ("time", t in self._timed))
                       if held] + [k for k in self._times if k[1] == "edge_time"]  # fmt: skip
        # the host cache and y are read now, so that loader workers forked later share them
        for rows in self._rows.values():
            if rows._host_ids is not None and rows._host_ids.numel():
                rows.chain()
        for t in self._labelled:
            self._labels(t)

    # -- opening ---------------------------------------------------------------------------------------
    def _open_table(self, o: PyGStoreOptions) -> None:
        from lightning_ooc.embed.rows import TableRows  # lazy: only for learnable features
        from lightning_ooc.loader.learnable_passes import open_feature_table  # lazy: only for learnable features

        table = open_feature_table(o.embeddings, self.dataset, backend=o.io_backend, writable=o.writable)
        try:
            writer = TableRows(table) if o.writable else None
        except BaseException:
            table.close()
            raise
        self.table, self._writer = table, writer

    def _host_ids(self, types: list[Any]) -> dict[Any, torch.Tensor]:
        """The host cache's rows per node type: the highest in-degree, its budget split by feature bytes."""
        ds, srcs = self.dataset, self._srcs
        total = sum(srcs[t].num_nodes * srcs[t].row_bytes for t in types) or 1
        out = {}
        for t in types:
            src = srcs[t]
            n = min(src.num_nodes, int(self.options.host_cache * src.num_nodes * src.row_bytes / total) //
                    max(src.row_bytes, 1))  # fmt: skip
            if n <= 0:
                continue
            if self.hetero:  # over every relation into the type
                from lightning_ooc.store.typed_stores import TypeView  # lazy: it imports Triton

                deg = TypeView(ds, t).in_degree
            else:
                deg = ds.in_degree
            top = np.arange(src.num_nodes) if n >= src.num_nodes else np.argpartition(-deg, n - 1)[:n]
            out[t] = torch.from_numpy(np.ascontiguousarray(top, dtype=np.int64))
        return out

    def __reduce__(self):
        """Pickled (a spawned loader worker) as the dataset's path and the options: reopened there."""
        return _reopen_features, (str(self.dataset.root), self.options)

    # -- what it holds ---------------------------------------------------------------------------------
    def get_all_tensor_attrs(self) -> list[TensorAttr]:
        """``x``, ``y`` and ``time`` of every node type that has them (group ``None`` for a homogeneous graph), and
        ``edge_time`` of every edge type that has edge times."""
        return [TensorAttr(group_name=t, attr_name=a) for t, a in self._attrs]

    def _check(self, attr: TensorAttr) -> tuple[Any, str]:
        self._check_open()
        t, a = attr.group_name, attr.attr_name
        if (t, a) in self._attrs:
            return t, a
        have = ", ".join(f"{a2} of {_group_words(t2)}" for t2, a2 in self._attrs) or "nothing"
        if t not in self.node_types:
            raise KeyError(f"{self.dataset.root}: no node type {t!r}; node types: "
                           f"{', '.join(map(repr, self.node_types))} (the store holds {have})")  # fmt: skip
        raise KeyError(f"{self.dataset.root}: {_group_words(t)} has no attribute {a!r}; the store holds {have}")

    def _num_nodes(self, t: Any, a: str = "x") -> int:
        """The rows of attribute ``a`` of group ``t``: its nodes (its edges for ``edge_time``)."""
        if a == "edge_time":
            return int(len(self._times[t, a]))
        return int(self._srcs[t].num_nodes)

    def _labels(self, t: Any) -> np.ndarray:
        y = self._label_cache.get(t)
        if y is None:  # in memory: 8 bytes per node, gathered on every batch
            y = self._label_cache[t] = np.array(self._srcs[t].labels)
        return y

    # -- reading ---------------------------------------------------------------------------------------
    def _whole(self, attr: TensorAttr) -> TensorAttr:
        """``attr`` with every row where it names none: ``get_tensor(None, "x")`` is all of ``x``, as
        ``index=None`` is (PyG's own refuses an attribute without an index as not fully specified)."""
        if not attr.is_set("index"):
            attr.index = None
        return attr

    def get_tensor(self, *args: Any, convert_type: bool = False, **kwargs: Any) -> torch.Tensor:
        """PyG's ``get_tensor``; without an index, every row (see :meth:`_whole`)."""
        attr = self._whole(self._tensor_attr_cls.cast(*args, **kwargs))
        return super().get_tensor(attr, convert_type=convert_type)

    def multi_get_tensor(self, attrs: list[TensorAttr], convert_type: bool = False) -> list[torch.Tensor]:
        """PyG's ``multi_get_tensor``; an attribute without an index gives every row."""
        attrs = [self._whole(self._tensor_attr_cls.cast(a)) for a in attrs]
        return super().multi_get_tensor(attrs, convert_type=convert_type)

    def _get_tensor(self, attr: TensorAttr) -> torch.Tensor:
        return self._multi_get_tensor([attr])[0]

    def _multi_get_tensor(self, attrs: list[TensorAttr]) -> list[torch.Tensor]:
        out = []
        for attr in attrs:
            t, a = self._check(attr)
            what = f"{a} of {_group_words(t)} ({self.dataset.root})"
            ids, scalar = _index_ids(attr.index, self._num_nodes(t, a), what)
            if a == "x":
                value = self._rows[t].read(ids)
            elif a in ("time", "edge_time"):  # node or edge times, memory-mapped: read where they are asked for
                value = torch.from_numpy(np.take(self._times[t, a], ids.numpy()))
            else:
                value = torch.from_numpy(np.take(self._labels(t), ids.numpy()))
            out.append(value[0] if scalar else value)
        return out

    def _get_tensor_size(self, attr: TensorAttr) -> tuple[int, ...]:
        t, a = self._check(attr)
        n = self._num_nodes(t, a)
        if attr.is_set("index") and attr.index is not None:
            ids, scalar = _index_ids(attr.index, n, f"{a} of {_group_words(t)}")
            n = None if scalar else ids.numel()
        tail = (self._rows[t].num_features,) if a == "x" else ()
        return tail if n is None else (n, *tail)

    # -- writing ---------------------------------------------------------------------------------------
    def _read_only(self, what: str) -> InputError:
        if self.table is not None:
            fix = "open it with writable=True to write rows of x back to the table"
        else:
            fix = ("x can be written where it is learnable: open_pyg_stores(root, embeddings=TABLE, writable=True) "
                   "with a table from `lightning-ooc init-embeddings`")  # fmt: skip
        return InputError(f"{self.dataset.root}: the feature store is read-only ({what}); {fix}")

    def _put_tensor(self, tensor: Any, attr: TensorAttr) -> bool:
        t, a = self._check(attr)
        if self._writer is None or a != "x":
            raise self._read_only(f"put_tensor of {a}")
        rows = self._rows[t]
        ids, scalar = _index_ids(attr.index, self._num_nodes(t), f"x of {self.table.root}")
        value = torch.as_tensor(tensor)
        if scalar:
            value = value.reshape(1, -1)
        if value.dtype.is_floating_point is False or value.shape != (ids.numel(), rows.num_features):
            raise InputError(f"{self.table.root}: put_tensor of x needs {ids.numel()} rows of {rows.num_features} "
                             f"floats, got {value.dtype}{list(value.shape)}")  # fmt: skip
        if ids.unique().numel() != ids.numel():
            raise InputError(f"{self.table.root}: put_tensor of x got a node id twice; give each row once")
        with self._write_mu:
            full = rows.full_rows(ids)  # the optimiser state stays as it is
            full[:, : rows.num_features] = value.detach().to("cpu", torch.float32)
            self._writer.write(ids, full)
        return True

    def _remove_tensor(self, attr: TensorAttr) -> bool:
        self._check(attr)
        raise self._read_only(f"remove_tensor of {attr.attr_name}")

    def flush(self) -> None:
        """Make every row written by :meth:`put_tensor` durable and checksummed (a table checkpoint)."""
        if self._writer is not None:
            with self._write_mu:
                self._writer.checkpoint()

    # -- lifetime --------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InputError(f"{self.dataset.root}: the feature store is closed; open it again with open_pyg_stores")

    def close(self) -> None:
        """Let the readers go (and, with learnable features, checkpoint and close the table). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._writer is not None:
                self._writer.checkpoint()
                self._writer.close()
        finally:
            for rows in self._rows.values():
                rows.close()
            if self.table is not None:
                self.table.close()

    def __enter__(self) -> "OutOfCoreFeatureStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        attrs = ", ".join(f"{a}" if t is None else f"{t}.{a}" for t, a in self._attrs)
        return f"OutOfCoreFeatureStore('{self.dataset.root}', {attrs})"


class OutOfCoreGraphStore(GraphStore):
    """A PyG ``GraphStore`` over an on-disk dataset's topology (see :mod:`lightning_ooc.pyg.dataset_stores`).

    Every relation (edge type ``None`` for a homogeneous graph) is stored as its in-edge CSC; ``layout="coo"``
    is built from it on request. Both are converted to int64 once per relation and cached (the memory this
    takes is logged). Edge ids are CSC positions. The topology is read-only.
    """

    def __init__(self, dataset: Any):
        super().__init__()
        self.dataset = dataset
        self._cache: dict[tuple[Any, str], torch.Tensor] = {}  # (edge type, "row" / "col") -> int64 ids
        self._mu = threading.Lock()
        self.hetero = bool(getattr(dataset, "is_hetero", False))
        if self.hetero:
            self._csc = {et: dataset.csc[et] for et in dataset.edge_types}
            self._sizes = {et: (dataset.num_nodes_dict[et[0]], dataset.num_nodes_dict[et[2]]) for et in self._csc}
        else:
            self._csc = {None: dataset}
            self._sizes = {None: (dataset.num_nodes, dataset.num_nodes)}

    def __reduce__(self):
        return _reopen_graph, (str(self.dataset.root),)

    @property
    def edge_types(self) -> list[Any]:
        return list(self._csc)

    @property
    def sampling_graph(self) -> Any:
        """The on-disk CSC as our samplers read it (the dataset): what
        :class:`~lightning_ooc.sampling.PyGNeighborSampler` samples, with no int64 copy."""
        return self.dataset

    def get_all_edge_attrs(self) -> list[EdgeAttr]:
        """One CSC per relation (edge type ``None`` for a homogeneous graph), with its size."""
        return [EdgeAttr(et, EdgeLayout.CSC, is_sorted=True, size=self._sizes[et]) for et in self._csc]

    def _edge_type(self, attr: EdgeAttr) -> Any:
        et = attr.edge_type
        if isinstance(et, list):
            et = tuple(et)
        if et in self._csc:
            return et
        if self.hetero and isinstance(et, tuple) and len(et) == 2:  # PyG's (src, dst) shorthand, where one matches
            hits = [k for k in self._csc if (k[0], k[2]) == et]
            if len(hits) == 1:
                return hits[0]
        have = "None (a homogeneous graph)" if not self.hetero else ", ".join(map(str, self._csc))
        raise KeyError(f"{self.dataset.root}: no edge type {et!r}; edge types: {have}")

    def _int64(self, et: Any, key: str, build: Any) -> torch.Tensor:
        with self._mu:
            t = self._cache.get((et, key))
            if t is None:
                t = self._cache[et, key] = build()
                log.info("PyG graph store: %s of %s built in memory as int64 (%s; kept for later calls)", key,
                         "the graph" if et is None else et, human_bytes(t.numel() * 8))  # fmt: skip
            return t

    def _get_edge_index(self, attr: EdgeAttr) -> tuple[torch.Tensor, torch.Tensor]:
        et = self._edge_type(attr)
        if attr.layout not in (EdgeLayout.CSC, EdgeLayout.COO):
            raise KeyError(f"{self.dataset.root}: edges are stored by destination (layout 'csc', or 'coo' built "
                           "from it); for 'csr' ask the store's csr(), which converts")  # fmt: skip
        csc = self._csc[et]
        colptr = _shared_tensor(csc.indptr)
        row = self._int64(et, "row", lambda: torch.from_numpy(np.asarray(csc.indices).astype(np.int64)))
        if attr.layout == EdgeLayout.CSC:
            return row, colptr
        n = self._sizes[et][1]
        col = self._int64(et, "col", lambda: torch.repeat_interleave(torch.arange(n), colptr.diff()))
        return row, col

    def coo(self, edge_types: list[Any] | None = None, store: bool = False) -> Any:
        """Every relation's edges as COO ``(row, col, perm)``, built from its CSC (``store`` is ignored: the
        topology is read-only): a tuple of tensors for a homogeneous graph asked for everything, else dicts by
        edge type, as PyG's ``GraphStore.coo`` gives them (``LinkNeighborLoader`` asks ``coo([edge_type])`` for
        its seed edges when ``edge_label_index`` names a relation but no edges). Built fresh on each call, not
        cached: PyG stacks the two into its own ``[2, E]`` tensor, the one int64 copy of the edges it keeps."""
        if edge_types is None:
            types = self.edge_types
        else:
            types = [self._edge_type(EdgeAttr(et, EdgeLayout.COO)) for et in edge_types]
        rows, cols = {}, {}
        for et in types:
            rows[et], cols[et] = self._coo(et)
        if edge_types is None and not self.hetero:
            return rows[None], cols[None], None
        return rows, cols, {et: None for et in types}

    def _coo(self, et: Any) -> tuple[torch.Tensor, torch.Tensor]:
        csc = self._csc[et]
        colptr = _shared_tensor(csc.indptr)
        row = torch.from_numpy(np.asarray(csc.indices).astype(np.int64))
        col = torch.repeat_interleave(torch.arange(self._sizes[et][1]), colptr.diff())
        return row, col

    def _read_only(self) -> InputError:
        return InputError(f"{self.dataset.root}: the graph store is read-only (the dataset's topology); build a new "
                          "dataset with `lightning-ooc prepare` to change its edges")  # fmt: skip

    def _put_edge_index(self, edge_index: Any, edge_attr: EdgeAttr) -> bool:
        raise self._read_only()

    def _remove_edge_index(self, edge_attr: EdgeAttr) -> bool:
        raise self._read_only()

    def __repr__(self) -> str:
        return f"OutOfCoreGraphStore('{self.dataset.root}', edge_types={self.edge_types})"


def _shared_tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` (int64, read-only: the dataset's ``indptr``, maybe shared between processes) as a tensor, no copy."""
    with warnings.catch_warnings():  # PyG's samplers only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(a, dtype=np.int64))


def _reopen_features(root: str, options: PyGStoreOptions) -> OutOfCoreFeatureStore:
    return OutOfCoreFeatureStore(open_dataset(root), options)


def _reopen_graph(root: str) -> OutOfCoreGraphStore:
    return OutOfCoreGraphStore(open_dataset(root))


#: the ``prepare`` options that give the graph a PyG transform would make, for the refusal of a transform
_TRANSFORM_FIXES = ("ToUndirected: `--add-reverse merge`; RemoveSelfLoops: `--drop-self-loops`; "
                    "RemoveDuplicatedEdges: `--drop-duplicates`; AddSelfLoops: none, GCNConv and GATConv add their own")


class StoreTransformError(InputError, AttributeError):
    """What a :class:`PyGStores` pair says when asked for an attribute a ``Data`` has and a pair has not (a graph
    transform reads them): an :class:`AttributeError` too, so ``hasattr`` stays False.

        >>> issubclass(StoreTransformError, InputError), issubclass(StoreTransformError, AttributeError)
        (True, True)
    """


class PyGStores(tuple):
    """The ``(feature_store, graph_store)`` pair of :func:`open_pyg_stores`, with what PyG's and OGB's datasets
    give beside the graph: the splits, the number of classes, the metadata.

    It is a tuple, so PyG's loaders take it where they take a pair, and ``fs, gs = stores`` unpacks it.

    * :meth:`get_idx_split`: OGB's ``{"train", "valid", "test"}`` node ids (per node type, as OGB's
      heterogeneous datasets give them: ``{"train": {"paper": ids}}``); :meth:`split` takes ``"val"`` or
      ``"valid"``; ``train_mask``, ``val_mask`` and ``test_mask`` as ``Data`` has them (of :attr:`target`'s
      nodes on a heterogeneous graph);
    * :attr:`num_classes`, :attr:`num_features` (per node type on a heterogeneous graph), :attr:`num_nodes`;
    * :meth:`metadata`: ``(node_types, edge_types)``, what ``to_hetero`` takes (heterogeneous graphs).

    A graph transform (``T.ToUndirected()(stores)``) is refused in one line: the graph is on disk and
    read-only, and ``lightning-ooc prepare`` makes the changed graph once. Feature transforms apply to the
    batches, as the loaders' ``transform=``.

        >>> import tempfile
        >>> from lightning_ooc.data.synth import synthesize
        >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=300, avg_degree=4, num_features=8,
        ...                   num_classes=3, progress=False)
        >>> stores = open_pyg_stores(root)
        >>> fs, gs = stores
        >>> stores.num_classes, stores.num_features, stores.num_nodes
        (3, 8, 300)
        >>> split = stores.get_idx_split()
        >>> sorted(split), int(stores.train_mask.sum()) == split["train"].numel()
        (['test', 'train', 'valid'], True)
        >>> import torch_geometric.transforms as T
        >>> T.ToUndirected()(stores)
        Traceback (most recent call last):
        ...
        lightning_ooc.pyg.dataset_stores.StoreTransformError: ...: a graph transform does not apply to a (FeatureStore, GraphStore) pair ...
        >>> stores.close()
    """

    def __new__(cls, feature_store: OutOfCoreFeatureStore, graph_store: OutOfCoreGraphStore) -> "PyGStores":
        return super().__new__(cls, (feature_store, graph_store))

    def __init__(self, feature_store: OutOfCoreFeatureStore, graph_store: OutOfCoreGraphStore):
        super().__init__()
        self.__dict__["dataset"] = feature_store.dataset

    def __reduce__(self):
        return PyGStores, (self[0], self[1])

    @property
    def feature_store(self) -> OutOfCoreFeatureStore:
        return self[0]

    @property
    def graph_store(self) -> OutOfCoreGraphStore:
        return self[1]

    @property
    def hetero(self) -> bool:
        return bool(getattr(self.dataset, "is_hetero", False))

    @property
    def target(self) -> str | None:
        """The node type the splits and labels are of (``None`` on a homogeneous graph)."""
        return self.dataset.target if self.hetero else None

    @property
    def num_classes(self) -> int:
        """Classes of the labels (of :attr:`target` on a heterogeneous graph)."""
        ds = self.dataset
        if self.hetero:
            if self.target is None:
                raise InputError(f"{ds.root}: no single labelled node type; ask stores.dataset.node(TYPE).num_classes")
            return int(ds.node(self.target).num_classes)
        return int(ds.num_classes)

    @property
    def num_features(self) -> Any:
        """Feature columns: an int, or per node type a dict (0 for a type without features)."""
        if self.hetero:
            return {t: int(getattr(self.dataset.node(t), "num_features", 0) or 0) for t in self.dataset.node_types}
        return int(self.dataset.num_features)

    @property
    def num_nodes(self) -> Any:
        """Nodes: an int, or per node type a dict."""
        return dict(self.dataset.num_nodes_dict) if self.hetero else int(self.dataset.num_nodes)

    def metadata(self) -> tuple[list[str], list[tuple[str, str, str]]]:
        """``(node_types, edge_types)``, as ``HeteroData.metadata()`` gives them (``to_hetero`` takes them)."""
        if not self.hetero:
            raise InputError(f"{self.dataset.root}: metadata() describes a heterogeneous graph's types, and this "
                             "graph is homogeneous (one node type, one relation)")  # fmt: skip
        return self.dataset.metadata()

    def split(self, name: str) -> Any:
        """Node ids (int64) of split ``name``: ``"train"``, ``"val"`` (or OGB's ``"valid"``), ``"test"``; of
        :attr:`target`'s nodes on a heterogeneous graph."""
        key = {"valid": "val"}.get(name, name)
        if key not in ("train", "val", "test"):
            raise InputError(f"{self.dataset.root}: no split {name!r}; splits: train, val (or valid), test")
        try:
            return self.dataset.split(key)
        except (KeyError, FileNotFoundError) as e:
            raise InputError(f"{self.dataset.root}: split {name!r} cannot be read ({e})") from None

    def get_idx_split(self) -> dict[str, Any]:
        """The splits as OGB's ``dataset.get_idx_split()`` names them: ``train``, ``valid``, ``test`` (each a
        dict ``{target: ids}`` on a heterogeneous graph, as OGB's MAG gives it)."""
        out = {}
        for name in ("train", "valid", "test"):
            ids = self.split(name)
            out[name] = {self.target: ids} if self.hetero else ids
        return out

    def _mask(self, name: str) -> torch.Tensor:
        n = self.dataset.node(self.target).num_nodes if self.hetero else self.dataset.num_nodes
        mask = torch.zeros(int(n), dtype=torch.bool)
        mask[self.split(name)] = True
        return mask

    @property
    def train_mask(self) -> torch.Tensor:
        return self._mask("train")

    @property
    def val_mask(self) -> torch.Tensor:
        return self._mask("val")

    @property
    def test_mask(self) -> torch.Tensor:
        return self._mask("test")

    def close(self) -> None:
        """Let the feature store's readers go (:meth:`OutOfCoreFeatureStore.close`)."""
        self[0].close()

    def __enter__(self) -> "PyGStores":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __setattr__(self, name: str, value: Any) -> None:
        raise StoreTransformError(f"{self.dataset.root}: a (FeatureStore, GraphStore) pair cannot take attribute "
                                  f"{name!r}: its graph and features are on disk and read-only")  # fmt: skip

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        raise StoreTransformError(
            f"{self.dataset.root}: a graph transform does not apply to a (FeatureStore, GraphStore) pair (it asked "
            f"for {name!r}, which a Data has): the graph is on disk and read-only. Make the changed graph once with "
            f"`lightning-ooc prepare --dataset DIR --out NEW ...` ({_TRANSFORM_FIXES}); feature transforms apply to "
            "the batches, as the loader's transform="
        )  # fmt: skip


def open_pyg_stores(root: str | os.PathLike | Any, *, host_cache: int | str = 0, embeddings: str | None = None,
                    writable: bool = False, io_backend: str = "auto", queue_depth: int = 128, workers: int = 1,
                    progress: bool = False, in_memory: bool | str = "auto") -> PyGStores:  # fmt: skip
    """The ``(feature_store, graph_store)`` pair of a dataset, for PyG's loaders (see the module docstring), as a
    :class:`PyGStores`: a tuple with the dataset's splits, classes and metadata.

    Args:
        root: a dataset directory (``lightning-ooc synth`` / ``prepare``), or an opened dataset.
        host_cache: bytes of host memory for the rows of the highest in-degree nodes (``"512MiB"``; 0: none).
            Filled when the store opens; loader workers forked later share it.
        embeddings: an embedding table (``lightning-ooc init-embeddings``, one partition) whose rows are ``x``.
        writable: with ``embeddings``, let ``put_tensor`` write rows of ``x`` back (journaled).
        io_backend, queue_depth, workers: how the readers read (:class:`~lightning_ooc.io.FeatureReader`).
        progress: show a progress bar while the host cache fills.
        in_memory: hold every feature row in memory, read once when the store opens, and serve ``x`` by
            index as PyG's in-memory ``Data`` does: ``"auto"`` where the rows take at most half of what this
            process may allocate (the memory cgroup's limit, ``MemAvailable``), True always, False never (the
            tiers: host cache, direct reads). Not with ``embeddings`` (their rows are the table's).
    """
    ds = open_dataset(root) if isinstance(root, (str, os.PathLike, Path)) else root
    o = PyGStoreOptions(host_cache=parse_bytes(host_cache), io_backend=io_backend, queue_depth=int(queue_depth),
                        workers=int(workers), embeddings=None if embeddings is None else str(embeddings),
                        writable=bool(writable), progress=bool(progress), in_memory=in_memory)  # fmt: skip
    return PyGStores(OutOfCoreFeatureStore(ds, o), OutOfCoreGraphStore(ds))
