"""Tasks x feature backends: the one table of which pass source runs a task over a feature backend.

A *task* says what a minibatch is: the dataset it opens (and the checks it needs), how each split's seeds
are cut into batches, and how a batch is sampled: node classification, link prediction, and node
classification on a heterogeneous graph (the multi-type case). A *feature backend* says where ``x`` comes
from:

========================  ===============================================================================
backend                   the rows of a batch come from
========================  ===============================================================================
``tiered``                SSD through the hierarchy: device buffer, host cache, staging, direct I/O
``device_table``          every row in the training device's memory (the in-memory reference)
``sync``                  RAM or a memory map, read synchronously in the caller (the baselines)
``learnable``             an embedding table's rows, trained with the model and written back
``partitioned``           this machine's part, and other machines' rows through the row exchange
``packed``                the tiered store, with each batch's cold rows packed ahead into one sequential
                          read (offline sampling and packed minibatches, DiskGNN)
``pyg_store``             a PyG ``(FeatureStore, GraphStore)`` pair of any backend: its ``multi_get_tensor``
                          on the extractor threads (a pair given as the datamodule's ``root``)
========================  ===============================================================================

A task is a class of :mod:`lightning_ooc.loader.tasks` (its batches: dataset, seeds, samplers, sample
function, the node types whose rows a batch carries); a backend is a pass-source class that takes a task's
batches from its ``task_type`` and builds the store per node type. A pass source of the grid is the
backend's class with the task as ``task_type`` (the named classes, ``LinkPasses`` and the like, are just
that). The datamodules, the gather producer and ``bench epoch`` all look the pair up here: :func:`source`
builds a pass source, :func:`backend_for` says which backend a configuration runs on (a partitioned dataset
and a PyG store pair choose theirs), and :data:`SOURCES` is the grid. Adding a backend is one module with
its value class and its pass-source class, and one :func:`register_backend` call; adding a task, one task
class, one :func:`register` call (which builds its pass sources with :func:`combine`) and, for users, a
datamodule: a subclass of :class:`~lightning_ooc.datamodule.GraphData` naming the task. The datamodules
ask :func:`task_for` which task of the grid runs their ``task`` over the dataset given (node classification
has a homogeneous and a heterogeneous case).

>>> from lightning_ooc.loader import registry
>>> sorted(registry.TASKS)
['hetero', 'link', 'node']
>>> registry.SOURCES["link", "device_table"].__name__
'DeviceTableLinkPasses'
>>> sorted(b for (t, b) in registry.SOURCES if t == "link")
['device_table', 'learnable', 'packed', 'sync', 'tiered']
>>> registry.SOURCES["link", "device_table"].task_type is registry.TASKS["link"].batches
True
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from lightning_ooc.errors import InputError
from lightning_ooc.loader.baseline import DeviceTablePasses, SyncPasses
from lightning_ooc.loader.batches import SeedBatches
from lightning_ooc.data.dataset import read_meta
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import PassSource, ProcessContext
from lightning_ooc.loader.features import (FeatureBackend, InMemory, Learnable, Mapped, Packed, Partitioned,
                                           StorePair, Tiered)  # fmt: skip
from lightning_ooc.loader.hetero_task import (HeteroDeviceTablePasses, HeteroLocalPasses, HeteroNodeTask,
                                              HeteroSyncPasses)  # fmt: skip
from lightning_ooc.loader.learnable_passes import LearnableLinkPasses, LearnablePasses
from lightning_ooc.loader.link_task import DeviceTableLinkPasses, LinkDataConfig, LinkPasses, LinkTask, SyncLinkPasses
from lightning_ooc.loader.packed_passes import PackedPasses
from lightning_ooc.loader.partitioned import PartitionedPasses, is_partitioned, partition_meta
from lightning_ooc.loader.store_pair import StorePairPasses
from lightning_ooc.loader.source import LocalPasses
from lightning_ooc.loader.tasks import NodeTask


@dataclass(frozen=True)
class Task:
    """A task by name: its settings' class and its batches (:mod:`lightning_ooc.loader.tasks`)."""

    name: str
    #: what it does, in words for messages
    words: str
    #: its settings (a :class:`~lightning_ooc.loader.config.NodeDataConfig` or a subclass)
    config: type
    #: what supplies its batches to a pass source: the dataset, seeds, samplers and sample function
    batches: type[NodeTask]
    #: the datamodule's task it is a case of (its ``task``: ``"node"``, ``"link"``); several tasks of the grid
    #: may be cases of one, told apart by the dataset
    datamodule: str = ""
    #: the case of a heterogeneous dataset (node types and relations), else of a homogeneous one
    typed: bool = False

    def __post_init__(self) -> None:
        if not self.datamodule:  # a task of its own datamodule
            object.__setattr__(self, "datamodule", self.name)

    def open(self, cfg: Any, ctx: ProcessContext) -> Any:
        """The dataset, opened and checked for this task (where passes run in another process: for batch counts)."""
        return self.batches.open(cfg, ctx)

    def seed_batches(self, cfg: Any, ds: Any, ctx: ProcessContext) -> SeedBatches:
        """Every split's seeds cut into batches, the same on every rank."""
        return self.batches.seed_batches_of(cfg, ds, ctx)


#: the tasks, by name
TASKS: dict[str, Task] = {
    "node": Task("node", "node classification", NodeDataConfig, NodeTask, "node"),
    "link": Task("link", "link prediction", LinkDataConfig, LinkTask, "link"),
    "hetero": Task("hetero", "node classification on a heterogeneous graph", NodeDataConfig, HeteroNodeTask, "node",
                   typed=True),
}

#: the feature backends (:mod:`lightning_ooc.loader.features`), by name, in words for messages
BACKENDS: dict[str, str] = {cls.name: cls.words for cls in (Tiered, InMemory, Mapped, Learnable, Partitioned, Packed,
                                                            StorePair)}  # fmt: skip

#: the grid: the pass source of each task over each backend (a pair not here is not supported); each is the
#: backend's class with the task's batches as its ``task_type``
SOURCES: dict[tuple[str, str], Callable[..., PassSource]] = {
    ("node", "tiered"): LocalPasses,
    ("node", "device_table"): DeviceTablePasses,
    ("node", "sync"): SyncPasses,
    ("node", "learnable"): LearnablePasses,
    ("node", "partitioned"): PartitionedPasses,
    ("node", "pyg_store"): StorePairPasses,
    ("link", "tiered"): LinkPasses,
    ("link", "device_table"): DeviceTableLinkPasses,
    ("link", "sync"): SyncLinkPasses,
    ("link", "learnable"): LearnableLinkPasses,
    ("hetero", "tiered"): HeteroLocalPasses,
    ("hetero", "device_table"): HeteroDeviceTablePasses,
    ("hetero", "sync"): HeteroSyncPasses,
}


#: each backend's pass-source class (over the node task); :func:`combine` puts another task under it
BACKEND_TYPES: dict[str, type] = {
    "tiered": LocalPasses,
    "device_table": DeviceTablePasses,
    "sync": SyncPasses,
    "learnable": LearnablePasses,
    "partitioned": PartitionedPasses,
    "packed": PackedPasses,
    "pyg_store": StorePairPasses,
}


def combine(backend: str, task: Task) -> type:
    """The pass-source class of ``task`` over ``backend``: the backend's class with the task's batches as its
    ``task_type`` (the backend's own class where that is its task already)."""
    base = BACKEND_TYPES[backend]
    if base.task_type is task.batches:
        return base
    return type(f"{base.__name__}Of{task.batches.__name__}", (base,), {"task_type": task.batches,
                                                                       "__module__": __name__})  # fmt: skip


for _task in ("node", "link", "hetero"):
    SOURCES[_task, "packed"] = combine("packed", TASKS[_task])


def register(task: Task, backends: Iterable[str]) -> None:
    """Add a task, over each of ``backends``: one call, after its task class (see the module docstring).

    >>> from lightning_ooc.loader.link_task import LinkTask
    >>> class EdgeTask(LinkTask):  # a task of one's own: link batches, described differently
    ...     name = "edges"
    >>> register(Task("edges", "edge scoring", LinkDataConfig, EdgeTask), ["tiered", "sync"])
    >>> SOURCES["edges", "sync"].task_type is EdgeTask, issubclass(SOURCES["edges", "tiered"], LocalPasses)
    (True, True)
    >>> del TASKS["edges"], SOURCES["edges", "tiered"], SOURCES["edges", "sync"]
    """
    if task.name in TASKS:
        raise ValueError(f"a task {task.name!r} is registered already")
    unknown = sorted(set(backends) - set(BACKEND_TYPES))
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)}; one of {', '.join(BACKEND_TYPES)}")
    TASKS[task.name] = task
    for backend in backends:
        SOURCES[task.name, backend] = combine(backend, task)


def register_backend(backend: type[FeatureBackend], passes: type, tasks: Iterable[str]) -> None:
    """Add a feature backend: its value class (a :class:`~lightning_ooc.loader.features.FeatureBackend` with a
    ``name`` and ``words``), its pass-source class (over the node task; what :meth:`FeatureBackend.source_options`
    gives is passed to it), and the tasks it runs (each gets the class with the task's batches, :func:`combine`).
    One call; ``docs/architecture.md`` has a worked example.

    >>> from lightning_ooc.loader.features import Mapped
    >>> class Slow(Mapped):  # the memory-map baseline under a name of its own
    ...     name, words = "slow", "rows read slowly"
    >>> register_backend(Slow, SyncPasses, ["node", "link"])
    >>> SOURCES["link", "slow"].task_type is TASKS["link"].batches, BACKENDS["slow"]
    (True, 'rows read slowly')
    >>> unregister_backend("slow")
    """
    name = backend.name
    if not name or name in BACKEND_TYPES:
        raise ValueError(f"a backend needs a name of its own (got {name!r}; taken: {', '.join(BACKEND_TYPES)})")
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}; one of {', '.join(TASKS)}")
    BACKENDS[name] = backend.words
    BACKEND_TYPES[name] = passes
    for task in tasks:
        SOURCES[task, name] = combine(name, TASKS[task])


def unregister_backend(name: str) -> None:
    """Remove a backend :func:`register_backend` added (tests, notebooks)."""
    BACKENDS.pop(name, None)
    BACKEND_TYPES.pop(name, None)
    for key in [k for k in SOURCES if k[1] == name]:
        del SOURCES[key]


def is_typed(root: str, stores: Any = None) -> bool:
    """Whether the dataset at ``root`` (a dataset directory, a partition output or part) is heterogeneous: node
    types and relations. A PyG store pair is read as a homogeneous graph."""
    if stores is not None:
        return False
    meta = partition_meta(root) if is_partitioned(root) else read_meta(root)
    return "node_types" in meta


def task_for(datamodule: str, cfg: NodeDataConfig, stores: Any = None) -> Task:
    """The task of the grid a datamodule's task (``"node"``, ``"link"``) runs over the dataset of ``cfg``: its
    heterogeneous case where the dataset has node types, else its homogeneous one. Settings of node types on a
    homogeneous dataset, and a task without the case the dataset needs, are errors that say so.

    >>> import tempfile
    >>> from lightning_ooc.data.synth_hetero import synthesize_hetero
    >>> root = synthesize_hetero(tempfile.mkdtemp() + "/h", "mag", num_nodes=500, num_features=4, progress=False)
    >>> task_for("node", NodeDataConfig(root)).name
    'hetero'
    """
    typed = is_typed(cfg.root, stores)
    for task in TASKS.values():
        if task.datamodule == datamodule and task.typed == typed:
            break
    else:
        kind = "a heterogeneous" if typed else "a homogeneous"
        runs = [t.words for t in TASKS.values() if t.datamodule == datamodule]
        if not runs:
            names = sorted({t.datamodule for t in TASKS.values()})
            raise InputError(f"no task {datamodule!r}; tasks: {', '.join(names)}")
        raise InputError(f"{cfg.root}: {kind} dataset; {runs[0]} runs on "
                         f"{'homogeneous' if typed else 'heterogeneous'} datasets only")  # fmt: skip
    if not typed and getattr(cfg, "typed", False):
        raise InputError(f"{cfg.root}: a homogeneous dataset has no node types or relations; input_type and a fanout "
                         f"per relation are for heterogeneous ones (got num_neighbors={cfg.num_neighbors!r}, "
                         f"input_type={cfg.input_type!r})")  # fmt: skip
    return task


def task_of(cfg: NodeDataConfig) -> Task:
    """The task of the grid that runs settings ``cfg``: the datamodule task its settings' class is (the most
    derived class wins), in the case its dataset is (:func:`task_for`)."""
    for task in sorted(TASKS.values(), key=lambda t: -len(t.config.__mro__)):
        if isinstance(cfg, task.config):
            return task_for(task.datamodule, cfg)
    raise TypeError(f"no task takes settings of type {type(cfg).__name__}")


def backend_for(cfg: NodeDataConfig, stores: Any = None) -> FeatureBackend:
    """The backend a configuration runs on, the one place the data chooses it: a PyG store pair (``stores``) reads
    its own feature store; a partitioned dataset (``root`` is a partition output or a part) runs
    :class:`~lightning_ooc.loader.features.Partitioned` with the tiered settings given; otherwise ``cfg.features``.

    >>> backend_for(NodeDataConfig("data/g", features="in_memory"))
    InMemory()
    """
    given = cfg.features
    if stores is not None:
        if given != Tiered():
            raise InputError(f"a PyG store pair is read through its own feature store; leave features unset (got "
                             f"features={given!r})")  # fmt: skip
        return StorePair()
    partitioned = is_partitioned(cfg.root)
    if partitioned and isinstance(given, Learnable):
        raise InputError(f"{cfg.root}: learnable features of a partitioned dataset are not supported; "
                         "train them on one machine (the unpartitioned dataset)")  # fmt: skip
    if partitioned and not isinstance(given, Partitioned):
        if type(given) is not Tiered:
            raise InputError(f"{cfg.root}: a partitioned dataset reads other machines' rows through the row exchange "
                             f"(features=Partitioned(...)); {given.words} cannot be combined with it")  # fmt: skip
        return Partitioned(**given.tiered())
    if isinstance(given, Partitioned) and not partitioned:
        raise InputError(f"{cfg.root}: features=Partitioned(...) needs a partitioned dataset (the output of "
                         "`lightning-ooc partition`, or this machine's part of it)")  # fmt: skip
    return given


def source(task: Task | str, cfg: NodeDataConfig, ctx: ProcessContext, *, stores: Any = None) -> PassSource:
    """The pass source of ``task`` over the backend ``cfg`` runs on (:func:`backend_for`) in the process ``ctx``
    (``stores``: the PyG store pair given as ``root``, read through its own feature store)."""
    task = TASKS[task] if isinstance(task, str) else task
    backend = backend_for(cfg, stores)
    factory = SOURCES.get((task.name, backend.name))
    if factory is None:
        runs = sorted(b for (t, b) in SOURCES if t == task.name)
        raise InputError(f"{cfg.root}: {task.words} over {BACKENDS[backend.name]} is not supported; it runs over "
                         f"{', '.join(BACKENDS[b] for b in runs)}; node classification runs over all of them")  # fmt: skip
    if backend is not cfg.features:
        cfg = copy.copy(cfg)
        cfg.features = backend
    options = dict(backend.source_options())
    if stores is not None:
        options["stores"] = stores
    return factory(cfg, ctx, **options)
