"""Opening an on-disk dataset: :func:`open_dataset` and :class:`OnDiskDataset`.

Opening validates cheaply (files present, sizes and ``.npy`` headers agree
with ``meta.json``, ``indptr`` monotone and ending at the edge count); the
full checksum and index checks live in :func:`lightning_ooc.data.verify.verify`.
"""
from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_ooc.data.format import (
    FEATURE_DTYPES,
    FILES,
    FORMAT_NAME,
    FORMAT_VERSION,
    IN_PLACE_VERSION,
    META_FILE,
    META_PENDING,
    OPTIONAL_FILES,
    SPLITS,
    index_dtype,
    meta_digest,
)
from lightning_ooc.data.link_splits import (
    LABEL_RULE,
    LINK_META,
    LinkSplit,
    bad_label_text,
    check_link_meta,
    expected_shape,
    link_file_keys,
    link_key,
)
from lightning_ooc.data.files import (
    REBUILD as _REBUILD,
    check_entry,
    check_file,
    check_neighbor_order,
    is_int,
    load_indptr,
    too_many_classes,
)
from lightning_ooc.data.degree import InDegree
from lightning_ooc.data.in_place import IN_PLACE, check_record, feature_file
from lightning_ooc.data.hetero_dataset import HeteroOnDiskDataset, check_hetero_schema
from lightning_ooc.errors import CorruptDatasetError, DatasetNotFoundError, FormatVersionError, InputError
from lightning_ooc.data.commit import backups
from lightning_ooc.utils.proc import pid_alive

#: meta.json's key of a part directory of a partitioned dataset (``lightning-ooc partition``)
PARTITION_META = "partition"
_REPARTITION = ("partition the source again with `lightning-ooc partition ROOT --parts P --out DIR --overwrite`, or "
                "restore the part directory from a copy")
class OnDiskDataset:
    """A graph stored in the lightning_ooc on-disk format.

    Use :func:`open_dataset` to get one. Topology is the in-edge CSC: for node
    ``v``, ``indices[indptr[v]:indptr[v + 1]]`` are the sources of the edges
    into ``v``, sorted ascending. ``indptr`` is held in memory, ``indices``
    and ``labels`` are memory-mapped, features stay on disk in
    :attr:`features_path` and are read by the feature readers.

    Example::

        >>> import tempfile, lightning_ooc
        >>> from lightning_ooc.data.synth import synthesize
        >>> root = tempfile.mkdtemp() + "/g"
        >>> _ = synthesize(root, num_nodes=1000, avg_degree=5, num_features=8, num_classes=4, seed=0, progress=False)
        >>> ds = lightning_ooc.open_dataset(root)
        >>> ds.num_nodes, ds.num_features, ds.feature_dtype, ds.row_bytes
        (1000, 8, torch.float32, 32)
        >>> int(ds.indptr[-1]) == ds.num_edges
        True
    """

    is_hetero = False

    def __init__(self, root: Path, meta: dict[str, Any], share: Any = None):
        self.root = root
        self.meta = meta
        self.num_nodes: int = int(meta["num_nodes"])
        self.num_edges: int = int(meta["num_edges"])
        self.num_features: int = int(meta["num_features"])
        self.num_classes: int = int(meta["num_classes"])
        self.feature_dtype_name: str = meta["feature_dtype"]
        self.feature_dtype: torch.dtype = FEATURE_DTYPES[self.feature_dtype_name][0]
        #: NumPy dtype holding the raw feature bytes (uint16 for bfloat16).
        self.feature_numpy_dtype: np.dtype = FEATURE_DTYPES[self.feature_dtype_name][1]
        self.row_bytes: int = int(meta["row_bytes"])
        #: the feature file: the dataset's own ``features.bin``, or a file used in place (``in_place`` of meta.json)
        self.features_path: Path = root / meta["files"]["features"]["name"] if "features" in meta["files"] else \
            Path(meta[IN_PLACE]["features"]["path"])  # fmt: skip
        #: file offset of row 0 of :attr:`features_path` (a header before it: a ``.npy`` used in place)
        self.features_offset: int = 0
        #: the dataset's identity: the checksum of its meta.json, which records every file's checksum
        #: (a rebuild with other content has another; a byte-identical rebuild the same)
        self.identity: str = meta.get("meta_checksum") or meta_digest(meta)  # read_meta checked the recorded one
        #: meta.json's ``link_splits`` (each link split's edges and fields, what the stored graph holds), or None
        self.link_splits: dict[str, Any] | None = meta.get(LINK_META)
        #: meta.json's ``partition`` (a part directory of a partitioned dataset), or None
        self._partition_meta: dict[str, Any] | None = meta.get(PARTITION_META)
        #: rows held in ``features.bin``: ``num_nodes``, or a part's own rows
        self.num_rows: int = int(self._partition_meta["num_rows"]) if self._partition_meta else self.num_nodes
        self._check_files()
        #: which rows a part directory of a partitioned dataset holds (:class:`PartitionInfo`); None otherwise
        self.partition: PartitionInfo | None = (
            PartitionInfo(self.root, self.meta, self._path("nodes"), self._path("owner"))
            if self._partition_meta else None
        )  # fmt: skip
        self._rows: PartitionRows | None = None
        if share is None:
            self.indptr: np.ndarray = self._load_indptr()
        else:  # one copy per machine: the first rank there loads and checks it, the others map it
            self.indptr = share.array("indptr", (self.num_nodes + 1,), np.int64, fill=self._load_indptr)
        self.indices: np.ndarray = self._mmap("indices")
        self.labels: np.ndarray = self._mmap("labels")
        #: an int64 time of each node (e.g. OGB's node years; PyG's ``time`` attribute), memory-mapped; or None
        self.node_time: np.ndarray | None = self._mmap("node_time") if "node_time" in meta["files"] else None
        #: an int64 time of each edge, in CSC order (memory-mapped), or None
        self.edge_time: np.ndarray | None = self._mmap("edge_time") if "edge_time" in meta["files"] else None
        #: how each node's in-edges are ordered: "source_id", or "node_time" / "edge_time" (temporal sampling)
        self.neighbor_order: str = meta.get("neighbor_order") or "source_id"
        self._splits: dict[str, torch.Tensor] = {}
        self._links: dict[str, LinkSplit] = {}
        self._labels_checked: set[str] = set()

    # -- opening -----------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root / self.meta["files"][key]["name"]

    def _expected_files(self) -> dict[str, tuple[tuple[np.dtype, ...], tuple[int, ...]] | None]:
        """Each file's allowed dtypes and shape (None for ``features.bin``, a raw file)."""
        i8 = (np.dtype("<i8"),)
        out: dict[str, Any] = {
            "indptr": (i8, (self.num_nodes + 1,)),
            "indices": ((index_dtype(self.num_nodes),), (self.num_edges,)),
            "features": None,
            "labels": (i8, (self.num_nodes,)),
            **({"node_time": (i8, (self.num_nodes,))} if "node_time" in self.meta["files"] else {}),
            **({"edge_time": (i8, (self.num_edges,))} if "edge_time" in self.meta["files"] else {}),
        }
        out.update({f"{s}_time": (i8, (int(self.meta["files"].get(s, {}).get("length", -1)),))
                    for s in SPLITS if f"{s}_time" in self.meta["files"]})  # fmt: skip
        out.update({s: (i8, (int(self.meta["files"].get(s, {}).get("length", -1)),)) for s in SPLITS})
        if self.link_splits is not None:
            out.update({k: expected_shape(self.link_splits, s, f) for k, s, f in link_file_keys(self.link_splits)})
        if self._partition_meta is not None:
            parts = int(self._partition_meta["parts"])
            out["nodes"] = (i8, (self.num_rows,))
            out["owner"] = ((partition_owner_dtype(parts),), (self.num_nodes,))
        return out

    def _check_files(self) -> None:
        for key, want in self._expected_files().items():
            self._check_file(key, want)

    def _check_file(self, key: str, want: tuple[tuple[np.dtype, ...], tuple[int, ...]] | None) -> None:
        if key == "features":
            self.features_path, self.features_offset = feature_file(self.root, self.meta, key, self.num_rows,
                                                                    self.row_bytes, self.feature_dtype_name)
            return
        check_file(self.root, self.meta, key, want)

    def _mmap(self, key: str) -> np.ndarray:
        return np.load(self._path(key), mmap_mode="r")

    def _load_indptr(self, out: np.ndarray | None = None) -> np.ndarray:
        """Load ``indptr`` (into ``out`` when given) and check it, one chunk at a time."""
        return load_indptr(self._path("indptr"), self.num_edges, out)

    # -- public API ----------------------------------------------------------------
    def split(self, name: str) -> torch.Tensor:
        """Node ids of a split (``"train"``, ``"val"`` or ``"test"``) as an int64 tensor."""
        if name not in SPLITS:
            raise KeyError(f"unknown split {name!r}; splits are {', '.join(SPLITS)}")
        if name not in self._splits:
            self._splits[name] = torch.from_numpy(np.load(self._path(name)))
        return self._splits[name]

    def split_time(self, name: str) -> torch.Tensor | None:
        """The time of each seed of split ``name`` (int64, aligned with :meth:`split`), or None where it has none."""
        if name not in SPLITS:
            raise KeyError(f"unknown split {name!r}; splits are {', '.join(SPLITS)}")
        key = f"{name}_time"
        if key not in self.meta["files"]:
            return None
        if key not in self._splits:
            self._splits[key] = torch.from_numpy(np.load(self._path(key)))
        return self._splits[key]

    @property
    def has_link_splits(self) -> bool:
        """Whether the dataset holds link-prediction edge splits (:meth:`link_split`)."""
        return self.link_splits is not None

    def link_split(self, name: str, random_access: bool = False, check_labels: bool = True) -> LinkSplit:
        """The supervision edges of link split ``name`` and their fields, as tensors.

        The files are memory-mapped copy-on-write: pages are read when used, and
        writing to a tensor changes this process's copy only. ``index`` is a
        ``[2, M]`` view of the ``(M, 2)`` file. ``random_access=True`` gives a
        new copy whose maps have read-ahead off (:func:`random_access_map`), for
        readers of a few edges at random positions (the link batch sampler).

        The split's labels are read once, at the first call, and must be 0 or 1
        (a dataset written before they were checked may hold others): else a
        :class:`~lightning_ooc.errors.CorruptDatasetError` names the file and the
        first bad label. ``check_labels=False`` skips that (``verify`` reports it).
        """
        splits = (self.link_splits or {}).get("splits", {})
        if name not in splits:
            have = ", ".join(splits) or "none"
            raise KeyError(f"no link split {name!r} in {self.root} (link splits: {have}); prepare one with "
                           "`lightning-ooc prepare --split-edges` or --link-train/--link-val/--link-test")  # fmt: skip
        fields = ("index", *splits[name]["fields"])
        if name not in self._links:
            t = {f: torch.from_numpy(np.load(self._path(link_key(name, f)), mmap_mode="c")) for f in fields}
            self._links[name] = LinkSplit(t.pop("index").t(), **t)
        if check_labels and name not in self._labels_checked:
            self._check_link_labels(name, self._links[name])
        if random_access:
            t = {f: torch.from_numpy(random_access_map(np.load(self._path(link_key(name, f)), mmap_mode="c")))
                 for f in fields}  # fmt: skip
            return LinkSplit(t.pop("index").t(), **t)
        return self._links[name]

    def _check_link_labels(self, name: str, ls: LinkSplit) -> None:
        """Every label of link split ``name`` is 0 or 1, else a CorruptDatasetError naming its file."""
        if ls.label is not None:
            bad = bad_label_text(ls.label.numpy())
            if bad is not None:
                path = self._path(link_key(name, "label"))
                raise CorruptDatasetError(
                    f"{path}: {bad}, but {LABEL_RULE}; write the {name} link split again with 0/1 labels "
                    f"(`lightning-ooc prepare --dataset {self.root} --out NEW --link-{name} EDGES "
                    f"--link-{name}-label LABELS.npy`, beside the other link splits)", path)  # fmt: skip
        self._labels_checked.add(name)

    def unlabelled(self, name: str) -> np.ndarray:
        """Sorted node ids of split ``name`` whose label is not a class in ``[0, num_classes)``."""
        ids = np.sort(self.split(name).numpy())
        y = np.asarray(self.labels[ids])
        return ids[(y < 0) | (y >= self.num_classes)]

    @property
    def in_degree(self) -> np.ndarray:
        """In-degree of every node (``np.diff(indptr)``; computed on each access, not kept)."""
        return np.diff(self.indptr)

    def features_memmap(self) -> np.memmap:
        """The feature file as a read-only ``(N, F)`` memmap of :attr:`feature_numpy_dtype`
        (``(num_rows, F)`` for a part of a partitioned dataset: its own rows, by local row).

        This reads through the page cache; it is the reference the readers are
        tested against and the baseline that benchmarks compare with, not the
        training path.
        """
        return np.memmap(self.features_path, dtype=self.feature_numpy_dtype, mode="r", offset=self.features_offset,
                         shape=(self.num_rows, self.num_features))  # fmt: skip

    def read_features(self, ids: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as a tensor of :attr:`feature_dtype`, through the page cache (memmap).

        On a part of a partitioned dataset ``ids`` are global node ids, each of which
        this part must own (else an InputError names the first that is not, and its part).
        """
        ids = np.asarray(ids, dtype=np.int64)
        if self.partition is not None:
            ids = self.partition.checked_local(ids)
        rows = torch.from_numpy(np.ascontiguousarray(self.features_memmap()[ids]))
        return rows.view(self.feature_dtype) if self.feature_dtype == torch.bfloat16 else rows

    @property
    def rows(self) -> "PartitionRows":
        """The rows this directory holds, shaped as a homogeneous dataset's node side indexed by local row.

        For a part of a partitioned dataset: ``num_nodes`` is its ``num_rows``, ``read_features``
        takes local rows, ``in_degree`` is that of its own nodes; feature readers and tiers
        (``FeatureReader.from_dataset``, ``TieredFeatureStore.create``, ``plan_store``/``build_store``)
        take it as a dataset. For any other dataset it is the dataset's own rows (local = global).
        """
        if self._rows is None:
            self._rows = PartitionRows(self)
        return self._rows

    def partition_rows(self) -> "PartitionRows":
        """:attr:`rows`."""
        return self.rows

    def file_sizes(self) -> dict[str, int]:
        return {k: int(v["bytes"]) for k, v in self.meta["files"].items()}

    def __repr__(self) -> str:
        part = f", partition={self.partition.index}/{self.partition.parts}" if self.partition is not None else ""
        return (
            f"OnDiskDataset(root='{self.root}', num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
            f"num_features={self.num_features}, feature_dtype={self.feature_dtype_name}, num_classes={self.num_classes}"
            f"{part})"
        )


def partition_owner_dtype(parts: int) -> np.dtype:
    """Dtype of ``owner.npy`` in a part directory: int16 below 32768 parts, else int32."""
    return np.dtype("<i2") if parts < 32768 else np.dtype("<i4")


class PartitionInfo:
    """Which rows a part directory of a partitioned dataset holds (``OnDiskDataset.partition``).

    ``nodes`` (int64, ascending, memory-mapped) is the global id of each row of
    ``features.bin``; ``owner`` (loaded) the part of every node of the graph.

    >>> import numpy as np
    >>> info = PartitionInfo.__new__(PartitionInfo)
    >>> info.nodes = np.array([2, 5, 7]); info.num_rows = 3
    >>> info.local([7, 2, 3, 9]).tolist()
    [2, 0, -1, -1]
    """

    def __init__(self, root: Path, meta: dict[str, Any], nodes_path: Path, owner_path: Path):
        p = meta[PARTITION_META]
        self.root = root
        self.index: int = int(p["index"])
        self.parts: int = int(p["parts"])
        self.num_rows: int = int(p["num_rows"])
        self.method: str = str(p.get("method", ""))
        self.source_identity: str | None = p.get("source_identity")
        self.nodes: np.ndarray = np.load(nodes_path, mmap_mode="r")
        self.owner: np.ndarray = np.load(owner_path)

    def local(self, ids: Any) -> np.ndarray:
        """The local row of each global id (int64), -1 where this part does not own it."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.num_rows == 0:
            return np.full(ids.shape, -1, dtype=np.int64)
        pos = np.searchsorted(self.nodes, ids)
        clipped = np.minimum(pos, self.num_rows - 1)
        return np.where(np.asarray(self.nodes[clipped]) == ids, clipped, -1).astype(np.int64)

    def checked_local(self, ids: Any) -> np.ndarray:
        """:meth:`local` of ids that must all be owned here; else an InputError naming the first that is not."""
        loc = self.local(ids)
        bad = np.flatnonzero(loc < 0)
        if bad.size:
            flat = np.asarray(ids, dtype=np.int64).reshape(-1)
            v = int(flat[bad[0]])
            n = self.owner.size
            where = (f"node {v} is owned by part {int(self.owner[v])}" if 0 <= v < n
                     else f"node {v} is outside [0, {n})")  # fmt: skip
            raise InputError(f"{self.root}: part {self.index} of {self.parts} holds the feature rows of its own "
                             f"{self.num_rows} nodes only; {where} ({bad.size} of the {flat.size} ids asked for are "
                             "not owned here); read them from that part")  # fmt: skip
        return loc

    def __repr__(self) -> str:
        return f"PartitionInfo(index={self.index}, parts={self.parts}, num_rows={self.num_rows}, method={self.method!r})"


class PartitionRows:
    """The feature rows of a dataset directory by local row, shaped as a homogeneous dataset's node side
    (as :class:`~lightning_ooc.data.hetero_dataset.NodeTypeData` is for a node type), so that feature readers,
    tiers and the store factory take it as a dataset: ``num_nodes`` is the number of rows, ids are
    local rows (``ds.partition.local(global_ids)``), ``in_degree`` is the global in-degree of each row's node.
    """

    is_hetero = False
    has_link_splits = False
    link_splits = None

    def __init__(self, ds: OnDiskDataset):
        self.dataset = ds
        self.root = ds.root
        self.meta = ds.meta
        self.num_nodes: int = ds.num_rows
        self.num_edges: int = ds.num_edges  # of the (replicated) topology a sampler walks
        self.num_features = ds.num_features
        self.num_classes = ds.num_classes
        self.feature_dtype_name = ds.feature_dtype_name
        self.feature_dtype = ds.feature_dtype
        self.feature_numpy_dtype = ds.feature_numpy_dtype
        self.row_bytes = ds.row_bytes
        self.features_path = ds.features_path
        self.features_offset = ds.features_offset
        #: rows of one directory: the dataset's identity with ``:rows``
        self.identity = f"{ds.identity}:rows"

    @property
    def nodes(self) -> np.ndarray:
        """Global id of each row."""
        p = self.dataset.partition
        return np.asarray(p.nodes) if p is not None else np.arange(self.num_nodes, dtype=np.int64)

    @property
    def in_degree(self) -> np.ndarray:
        """In-degree in the whole graph of each row's node (a fresh array on each access, like the dataset's)."""
        ip = self.dataset.indptr
        if self.dataset.partition is None:
            return np.diff(ip)
        nodes = np.asarray(self.dataset.partition.nodes)
        return ip[nodes + 1] - ip[nodes]

    @property
    def degree_view(self) -> InDegree:
        """:attr:`in_degree` a slice at a time (no array of one entry per row)."""
        p = self.dataset.partition
        return InDegree(self.dataset.indptr, None if p is None else np.asarray(p.nodes))

    def features_memmap(self) -> np.memmap:
        """The rows as a read-only ``(num_rows, F)`` memmap."""
        return self.dataset.features_memmap()

    def read_features(self, rows: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Local rows ``rows`` as a tensor of :attr:`feature_dtype`, through the page cache."""
        rows = np.asarray(rows, dtype=np.int64)
        out = torch.from_numpy(np.ascontiguousarray(self.features_memmap()[rows]))
        return out.view(self.feature_dtype) if self.feature_dtype == torch.bfloat16 else out

    def file_sizes(self) -> dict[str, int]:
        return self.dataset.file_sizes()

    def __repr__(self) -> str:
        return f"PartitionRows(root='{self.root}', num_rows={self.num_nodes}, num_features={self.num_features})"


def all_features(src: Any) -> torch.Tensor:
    """Every row of ``src``'s feature file (a dataset, or a node type's view) in memory, as a tensor of its
    feature dtype: one sequential copy through the page cache (the kernel's read-ahead on), not a gather.

        >>> import tempfile
        >>> from lightning_ooc.data.synth import synthesize
        >>> ds = open_dataset(synthesize(tempfile.mkdtemp() + "/g", num_nodes=50, avg_degree=2, num_features=3,
        ...                              num_classes=2, progress=False))
        >>> x = all_features(ds)
        >>> x.shape, torch.equal(x[7], ds.read_features([7])[0])
        (torch.Size([50, 3]), True)
    """
    rows = torch.from_numpy(np.array(src.features_memmap()))
    return rows.view(src.feature_dtype) if src.feature_dtype == torch.bfloat16 else rows


def random_access_map(a: np.ndarray) -> np.ndarray:
    """A map of the same file bytes as the memory-mapped array ``a``, with the kernel's read-ahead off
    (``madvise(MADV_RANDOM)``); anything else is returned as it is.

    The link batch sampler reads a few hundred edges at random positions of a split of millions:
    with the default read-ahead every page fault reads about 128 KiB around its page, nearly all of
    it never used, and under a memory cap those reads evict each other (the same finding as for
    memory-mapped features). The topology keeps read-ahead (a batch touches much of it), and so do
    sequential readers (``verify``, ``prepare --dataset``), through the dataset's own maps.

    >>> import tempfile, numpy as np
    >>> path = tempfile.mkdtemp() + "/a.npy"
    >>> np.save(path, np.arange(10))
    >>> a = np.load(path, mmap_mode="r")
    >>> b = random_access_map(a)
    >>> b is not a and np.array_equal(a, b), random_access_map(np.arange(3)).tolist()
    (True, [0, 1, 2])
    """
    # only a map of a whole array of its file (np.load's): a slice keeps its parent's offset
    if (not isinstance(a, np.memmap) or getattr(a, "filename", None) is None or a.size == 0
            or not isinstance(a.base, mmap.mmap)):  # fmt: skip
        return a
    mode = "c" if a.mode in ("c", "w+", "r+") else "r"
    m = np.memmap(a.filename, dtype=a.dtype, mode=mode, offset=a.offset, shape=a.shape,
                  order="F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C")  # fmt: skip
    read_ahead_off(m)
    return m


def read_ahead_off(a: np.ndarray) -> bool:
    """Turn the kernel's read-ahead off on the pages of the memory-mapped array ``a`` (``madvise(MADV_RANDOM)``
    on its map, for every view of it in this process); ``False`` where ``a`` is not such a map.

    A page fault on a map with read-ahead reads far around the page (as much as the device's ``read_ahead_kb``,
    megabytes on some disks). That fills the page cache quickly where the file stays cached, and where it does
    not (a topology larger than the memory given) every fault evicts what the last ones read.

    >>> import tempfile, numpy as np
    >>> path = tempfile.mkdtemp() + "/a.npy"
    >>> np.save(path, np.arange(10))
    >>> read_ahead_off(np.load(path, mmap_mode="r")), read_ahead_off(np.arange(3))
    (True, False)
    """
    raw = getattr(a, "_mmap", None)
    if not isinstance(raw, mmap.mmap) or not hasattr(mmap, "MADV_RANDOM"):
        return False
    raw.madvise(mmap.MADV_RANDOM)
    return True


def topology_read_ahead_off(ds: Any, time_attr: str | None, budget: int) -> int:
    """Turn the kernel's read-ahead off on the topology's maps of ``ds`` (its ``indices``, and the times the
    sampler searches for ``time_attr``: ``"edge_time"`` or ``"time"``, the node times) where together they take
    more than ``budget`` bytes; returns those bytes (0: the maps are left as they are).

    Where the topology cannot stay cached beside what the process holds, every fault that reads far around its
    page evicts what the last ones read (an 8M-node graph with edge times under a 0.95 GiB cap read 450 GB in
    six minutes); where it fits, read-ahead caches the files in a few large reads, and stays. A heterogeneous
    dataset's relations keep their maps as they are.

    >>> import tempfile, numpy as np
    >>> from lightning_ooc.data.synth import synthesize
    >>> ds = open_dataset(synthesize(tempfile.mkdtemp() + "/g", num_nodes=200, avg_degree=4, num_features=2,
    ...                              num_classes=2, progress=False))
    >>> topology_read_ahead_off(ds, None, budget=1 << 30), topology_read_ahead_off(ds, None, budget=0) > 0
    (0, True)
    """
    indices = getattr(ds, "indices", None)
    if not isinstance(indices, np.ndarray):
        return 0
    times = {"edge_time": getattr(ds, "edge_time", None), "time": getattr(ds, "node_time", None)}.get(time_attr or "")
    maps = [a for a in (indices, times) if isinstance(a, np.ndarray)]
    total = sum(a.nbytes for a in maps)
    if total > budget and all([read_ahead_off(a) for a in maps]):
        return total
    return 0


def read_meta(root: str | os.PathLike) -> dict[str, Any]:
    """Read and check ``meta.json`` of a dataset directory."""
    root = Path(root)
    if not root.exists():
        moved = backups(root)
        if moved:
            path, pid = moved[-1]
            if pid is not None and pid != os.getpid() and pid_alive(pid):
                raise DatasetNotFoundError(
                    f"{root}: being replaced right now (pid {pid} moved the old dataset to {path.name} and is putting "
                    "the new one in place); open it again in a moment",
                    root,
                )
            raise DatasetNotFoundError(
                f"{root}: no such dataset directory, but {path} holds the dataset that an interrupted --overwrite "
                f"moved aside; rename it back to {root.name}, or run the writer again (it puts it back first)",
                root,
            )
        raise DatasetNotFoundError(
            f"{root}: no such dataset directory; create one with `lightning-ooc synth` or `lightning-ooc prepare`", root
        )
    if not root.is_dir():
        raise DatasetNotFoundError(f"{root}: not a directory; pass the dataset directory, not a file in it", root)
    meta_path = root / META_FILE
    if not meta_path.is_file():
        if (root / META_PENDING).exists():
            raise CorruptDatasetError(
                f"{meta_path}: missing; the directory holds {META_PENDING}, so the run that wrote it was "
                f"interrupted while putting it in place; {_REBUILD}",
                meta_path,
            )
        if (root / "partition.json").is_file():
            raise DatasetNotFoundError(
                f"{meta_path}: missing: {root} is the output of `lightning-ooc partition` (it holds partition.json); "
                "open one of its part-NNNNN directories, each a dataset",
                meta_path,
            )
        raise DatasetNotFoundError(
            f"{meta_path}: missing, so {root} is not a lightning_ooc dataset (or an interrupted write); {_REBUILD}",
            meta_path,
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptDatasetError(f"{meta_path}: unreadable ({e}); {_REBUILD}", meta_path) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise FormatVersionError(
            f"{meta_path}: format is {got!r}, not {FORMAT_NAME!r}; this is not a lightning_ooc dataset. "
            "Convert the graph with `lightning-ooc prepare`",
            meta_path,
        )
    version = meta.get("version")
    if not isinstance(version, int) or version < 1 or version > FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        fix = "upgrade lightning_ooc" if newer else f"rebuild it with this release (format version {FORMAT_VERSION})"
        raise FormatVersionError(
            f"{meta_path}: format version {version!r} is not supported by this release "
            f"(reads versions 1..{FORMAT_VERSION}); {fix}",
            meta_path,
        )
    if version >= 2:
        recorded, digest = meta.get("meta_checksum"), meta_digest(meta)
        if recorded != digest:
            raise CorruptDatasetError(
                f"{meta_path}: changed after it was written (its checksum {digest} differs from the recorded "
                f"{recorded!r}); the counts and dtypes in it say how to read the data files, so an edited value "
                f"reads them wrongly; {_REBUILD}",
                meta_path,
            )
    if "node_types" in meta:
        check_hetero_schema(meta, meta_path)
    else:
        _check_schema(meta, meta_path)
        _check_agreement(meta, meta_path)
    return meta


_COUNTS = {"num_nodes": 0, "num_edges": 0, "num_features": 1, "num_classes": 0, "row_bytes": 1}
def _check_schema(meta: dict[str, Any], meta_path: Path) -> None:
    """Every key of ``meta.json`` this reader uses has the type and range it needs; file names are plain names."""

    def bad(what: str) -> CorruptDatasetError:
        return CorruptDatasetError(f"{meta_path}: {what}; {_REBUILD}", meta_path)

    required = ("num_nodes", "num_edges", "num_features", "num_classes", "feature_dtype", "row_bytes", "files")
    missing = [k for k in required if k not in meta]
    if missing:
        raise bad(f"missing keys {missing}")
    for key, low in _COUNTS.items():
        if not is_int(meta[key]) or meta[key] < low:
            raise bad(f"{key} must be an integer >= {low}, got {meta[key]!r}")
    if too_many_classes(meta["num_classes"], meta["num_nodes"]):
        raise bad(too_many_classes(meta["num_classes"], meta["num_nodes"]))
    if meta["feature_dtype"] not in FEATURE_DTYPES:
        raise bad(f"unknown feature dtype {meta['feature_dtype']!r} (known: {', '.join(FEATURE_DTYPES)})")
    itemsize = FEATURE_DTYPES[meta["feature_dtype"]][1].itemsize
    if meta["row_bytes"] != meta["num_features"] * itemsize:
        raise bad(f"row_bytes={meta['row_bytes']} but {meta['num_features']} x {meta['feature_dtype']} "
                  f"= {meta['num_features'] * itemsize}")  # fmt: skip
    files = meta["files"]
    if not isinstance(files, dict):
        raise bad(f"'files' must map each file's key to its entry, got {type(files).__name__}")
    in_place = meta.get(IN_PLACE, {})
    if not isinstance(in_place, dict) or set(in_place) - {"features"}:
        raise bad(f"'{IN_PLACE}' may hold the features file only, got {in_place!r}")
    for key, rec in in_place.items():
        check_record(key, rec, bad)
        if key in files:
            raise bad(f"the {key!r} file has both a files entry and an in_place record")
    if in_place and meta["version"] < IN_PLACE_VERSION:
        raise bad(f"features used in place in a format version {meta['version']} dataset (they came with version "
                  f"{IN_PLACE_VERSION})")  # fmt: skip
    for key in FILES:
        if key not in in_place:
            check_entry(key, files.get(key), bad, need_length=key in SPLITS)
    for key in OPTIONAL_FILES:
        if key in files:
            check_entry(key, files[key], bad, need_length=False)
    check_neighbor_order(meta.get("neighbor_order"), files, "", bad)
    if LINK_META in meta:
        _check_link_schema(meta[LINK_META], files, bad)
    if PARTITION_META in meta:
        _check_partition_schema(meta, files, bad)
    sizes = meta.get("split_sizes", {})
    if not isinstance(sizes, dict) or not all(is_int(v) and v >= 0 for v in sizes.values()):
        raise bad(f"split_sizes must map split names to counts, got {sizes!r}")
    if not isinstance(meta.get("source", {}), dict):
        raise bad(f"'source' must be an object (how the dataset was made), got {meta['source']!r}")


#: keys of meta.json that no version 1 writer wrote: the checksum (version 2), link splits and partitions
#: (both came after it)
_NEWER_THAN_V1 = {"meta_checksum": "its own checksum", LINK_META: "link splits", PARTITION_META: "a partition"}
#: fields that ``source`` (what the writer recorded: synth's parameters, prepare's input) may repeat
_SOURCE_FIELDS = ("num_nodes", "num_features", "num_classes", "feature_dtype")


def _check_agreement(meta: dict[str, Any], meta_path: Path) -> None:
    """The fields of a homogeneous ``meta.json`` agree with each other and with its ``source``.

    Version 2 and later are covered by their checksum; version 1 has none, and some edits keep every
    size check true (``float16 x 128`` reads the bytes of ``float32 x 64``), so what it records twice
    must agree: ``source``'s ``num_nodes``, ``num_features``, ``num_classes`` and ``feature_dtype`` (where
    the writer recorded them) with the top-level fields, ``index_dtype`` with the node count, each
    ``split_sizes`` entry with its file's length; and it holds nothing a version 1 writer never wrote.
    """
    found = []
    source = meta.get("source", {})
    for key in _SOURCE_FIELDS:
        if key in source and source[key] != meta[key]:
            found.append(f"{key}={meta[key]!r} but source.{key}={source[key]!r}")
    if "index_dtype" in meta and meta["index_dtype"] != index_dtype(meta["num_nodes"]).name:
        found.append(f"index_dtype={meta['index_dtype']!r} but num_nodes={meta['num_nodes']} gives "
                     f"{index_dtype(meta['num_nodes']).name!r}")  # fmt: skip
    for s, n in meta.get("split_sizes", {}).items():
        length = meta["files"].get(s, {}).get("length") if s in SPLITS else None
        if length is not None and n != length:
            found.append(f"split_sizes.{s}={n} but files.{s}.length={length}")
    if meta["version"] < 2:
        found += [f"version 1 but it holds {what} ({key!r}), which only later versions write"
                  for key, what in _NEWER_THAN_V1.items() if key in meta]  # fmt: skip
    if not found:
        return
    why = ("format version 1 has no checksum of its own, so meta.json was edited (or copied from another "
           "dataset): the counts and dtypes in it say how to read the data files" if meta["version"] < 2 else
           "the writer recorded both; the counts and dtypes in it say how to read the data files")  # fmt: skip
    raise CorruptDatasetError(f"{meta_path}: contradicts itself: {'; '.join(found)}; {why}, so it cannot be "
                              f"trusted; {_REBUILD}", meta_path)  # fmt: skip


def _check_link_schema(link_meta: Any, files: dict[str, Any], bad: Any) -> None:
    """``link_splits`` of meta.json, and a ``files`` entry of each link file it names, of the split's length."""
    check_link_meta(link_meta, bad)
    for key, split, _ in link_file_keys(link_meta):
        check_entry(key, files.get(key), bad, need_length=True)
        edges = link_meta["splits"][split]["edges"]
        if files[key]["length"] != edges:
            raise bad(f"the {key!r} file's length {files[key]['length']} differs from the {edges} edges of link "
                      f"split {split}")  # fmt: skip


def _check_partition_schema(meta: dict[str, Any], files: dict[str, Any], bad: Any) -> None:
    """``partition`` of a part directory's meta.json, and the entries of ``nodes.npy`` and ``owner.npy``."""
    p = meta[PARTITION_META]
    if not isinstance(p, dict):
        raise bad(f"'partition' must be an object, got {p!r}")
    for key in ("index", "parts", "num_rows"):
        if not is_int(p.get(key)):
            raise bad(f"partition.{key} must be an integer, got {p.get(key)!r}")
    if p["parts"] < 1 or not 0 <= p["index"] < p["parts"]:
        raise bad(f"partition index {p['index']} is not in [0, parts={p['parts']})")
    if not 0 <= p["num_rows"] <= meta["num_nodes"]:
        raise bad(f"partition.num_rows={p['num_rows']} is not in [0, num_nodes={meta['num_nodes']}]")
    for key in ("nodes", "owner"):
        check_entry(key, files.get(key), bad, need_length=False)


def open_dataset(root: str | os.PathLike, share: Any = None) -> Any:
    """Open a dataset directory written by ``lightning-ooc synth`` or ``prepare``.

    ``share`` (a :class:`~lightning_ooc.strategy.shared.NodeShared`, as the
    ``"ooc"`` strategy provides) keeps ``indptr`` once per machine in shared
    memory instead of once per process; every rank of the run must then open
    the dataset together.

    A heterogeneous dataset (node and edge types) opens as a
    :class:`~lightning_ooc.data.hetero_dataset.HeteroOnDiskDataset`.

    Raises :class:`~lightning_ooc.errors.DatasetError` subclasses, whose
    messages name the offending file and the fix, when the directory is
    missing, incomplete, truncated, inconsistent or of an unknown version.
    """
    root = Path(root)
    meta = read_meta(root)
    if "node_types" in meta:
        return HeteroOnDiskDataset(root, meta, share=share)
    return OnDiskDataset(root, meta, share=share)
