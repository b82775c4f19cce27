"""Feature backends: where a batch's ``x`` comes from, given to a datamodule as a value (``features=``).

Each backend is a small class that owns its settings and checks them once, at construction (sizes are parsed
to bytes there, once):

==================  ==========================================================================================
``Tiered(...)``     the default: SSD through the hierarchy (a feature buffer on the device, a host cache of hot
                    rows, a bounded staging buffer, direct-I/O reads)
``Packed(...)``     the tiered store, with each training batch's cold rows packed ahead of its epoch into one
                    sequential read (DiskGNN's offline sampling and packed minibatches)
``InMemory()``      every row in the training device's memory, through the same pipeline (the in-memory
                    reference)
``Mapped(...)``     rows read synchronously from a memory map of the feature file (or all of it in RAM) in the
                    training loop: what PyG with memory-mapped features amounts to (a baseline)
``Learnable(...)``  an embedding table's rows, trained with the model and written back (a graph without
                    features trains end to end)
``Partitioned(...)``  this machine's rows through the tiers, other machines' through the row exchange
==================  ==========================================================================================

A partitioned dataset and a PyG ``(FeatureStore, GraphStore)`` pair choose their backend from the data: that
choice is made in one place, :func:`~lightning_ooc.loader.registry.backend_for`. A short name stands for a
backend with its defaults (``features="packed"``); in a LightningCLI config a backend is a class with its
arguments::

    data:
      features:
        class_path: lightning_ooc.Tiered
        init_args: {gpu_cache: 4GiB, host_cache: 8GiB}

or on the command line ``--data.features Packed --data.features.pack_space 2``.

Example::

    >>> from lightning_ooc.loader.features import Tiered, Packed, as_backend
    >>> t = Tiered(gpu_cache="4GiB", host_cache="8GiB")
    >>> t.gpu_cache, t.host_cache >> 30
    (4294967296, 8)
    >>> t
    Tiered(gpu_cache='4GiB', host_cache='8GiB')
    >>> as_backend("packed") == Packed()
    True
    >>> as_backend({"class_path": "lightning_ooc.Packed", "init_args": {"pack_space": 2}}).pack_space
    2.0
    >>> Tiered(staging="lots")
    Traceback (most recent call last):
      ...
    lightning_ooc.errors.InputError: staging: cannot parse byte budget 'lots'; write e.g. '4GiB', '256MiB' or an integer
"""
from __future__ import annotations

import copy
import importlib
import inspect
import os
from typing import Any, ClassVar

from lightning_ooc.data.format import human_bytes, parse_bytes
from lightning_ooc.errors import InputError

__all__ = ["FeatureBackend", "Tiered", "Packed", "InMemory", "Mapped", "Learnable", "Partitioned", "StorePair",
           "as_backend", "NAMES"]

HOST_CACHE_POLICIES = ("presample", "degree", "scored")
#: when the host cache is ranked (and, at set-up, read)
HOST_CACHE_FILLS = ("auto", "setup", "background")
REMOTE_CACHE_POLICIES = ("scored", "static", "none")
IO_BACKENDS = ("auto", "uring", "pread", "buffered", "mmap")
FIRST_EPOCH = ("pack", "random")
MADVISE = ("random", "normal")
#: the least ``pack_memory`` (the packer's half holds its buffers and an epoch's cold ids)
PACK_MEMORY_LEAST = 8 << 20


def positive(name: str, value: Any, why: str) -> int:
    """``value`` as an int, or an :class:`~lightning_ooc.errors.InputError` saying it must be >= 1 and why."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be an integer >= 1, got {value!r} ({why})")
    return int(value)


def size(name: str, value: Any) -> int:
    """A byte budget (``"4GiB"``, ``"256MiB"`` or an integer of bytes) as bytes, or an InputError naming it."""
    try:
        if isinstance(value, bool):
            raise ValueError(f"cannot parse byte budget {value!r}; write e.g. '4GiB', '256MiB' or an integer")
        return parse_bytes(value)
    except (ValueError, TypeError) as e:
        raise InputError(f"{name}: {e}") from None


def one_of(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise InputError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


class FeatureBackend:
    """A feature backend (see the module docstring): its settings, checked once; :attr:`name` is its key in the
    task x backend grid (:mod:`lightning_ooc.loader.registry`).

    >>> isinstance(Tiered(), FeatureBackend), Tiered().name, Tiered(gpu_cache="2GiB").plain()["init_args"]
    (True, 'tiered', {'gpu_cache': '2GiB'})
    """

    #: the backend's key in the grid
    name: ClassVar[str] = ""
    #: what it is, in words for messages
    words: ClassVar[str] = ""
    #: the settings :meth:`settings` reports, in the order the constructor takes them
    _given: dict[str, Any]

    def settings(self) -> dict[str, Any]:
        """The arguments it was made with, as plain values (sizes as given)."""
        return dict(getattr(self, "_given", {}))

    def plain(self) -> dict[str, Any]:
        """Itself as LightningCLI writes a class (``class_path``, ``init_args``): what a checkpoint keeps."""
        cls = type(self)
        ours = CLASSES.get(cls.__name__) is cls
        path = f"lightning_ooc.{cls.__name__}" if ours else f"{cls.__module__}.{cls.__qualname__}"
        return {"class_path": path, "init_args": self.settings()}

    def _keep(self, given: dict[str, Any]) -> None:
        """Record the arguments that differ from the constructor's defaults (for :meth:`settings`, ``repr``)."""
        defaults: dict[str, Any] = {}
        for cls in type(self).__mro__:  # a subclass's own arguments, and those it passes on to its base
            if "__init__" in vars(cls) and cls is not object:
                for p in inspect.signature(cls.__init__).parameters.values():
                    if p.default is not inspect.Parameter.empty:
                        defaults.setdefault(p.name, p.default)
        self._given = {k: (os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in given.items()
                       if k in defaults and not _same(v, defaults[k]) or k not in defaults}  # fmt: skip

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._resolved() == other._resolved()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(map(str, self._resolved().items())))))

    def _resolved(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args})"

    def describe(self) -> str:
        """One line: what it is and its sizes, for the datamodule's ``str``."""
        return self.words

    def source_options(self) -> dict[str, Any]:
        """What its pass source takes besides the settings (most read ``cfg.features`` itself: none)."""
        return {}

    def replaced(self, **changes: Any) -> "FeatureBackend":
        """A copy with some settings changed to values already in their final form (bytes for sizes): what the
        planner decided, for the passes (this one is left as it is).

        >>> t = Tiered(); t.replaced(host_cache=0).host_cache, t.host_cache >> 30
        (0, 1)
        """
        unknown = sorted(set(changes) - set(self._resolved()))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no setting(s) {', '.join(unknown)}")
        out = copy.copy(self)
        for k, v in changes.items():
            setattr(out, k, v)
        out._given = {**self._given, **changes}  # what it reports is what it holds
        return out


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


class Tiered(FeatureBackend):
    """Features from SSD through the tiers (the default backend).

    Args:
        gpu_cache: the feature buffer (device memory; host memory when training on CPU), e.g. ``"4GiB"``.
        host_cache: the host cache of hot rows (pinned; read zero-copy by the GPU); ``0``: none.
        staging: the staging buffer that direct-I/O reads land in (32 MiB holds four chunks of 8,192 rows of
            512 B for each of two extractors; more rarely helps).
        host_cache_policy: ``"presample"`` (access frequency over ``presample_batches`` minibatches sampled at
            set-up, counted as they are sampled, not held), ``"degree"``, or ``"scored"`` (starts as
            ``"presample"``, then replaces rows as MassiveGNN's scored policy says, every ``cache_interval``
            training minibatches).
        presample_batches: minibatches counted to rank rows (0: none): presampled at set-up, or, for a host cache
            ranked in the background, the epoch's first batches and presampled ones, whichever come first.
        host_cache_fill: when the ``"presample"`` host cache is ranked: ``"setup"`` (ranked and read before the
            first batch), ``"background"`` (ranked in a thread while training runs; the host cache then keeps each
            of its rows from the read the feature buffer makes when a batch first needs it, so it costs no read
            of its own: :mod:`lightning_ooc.store.background`), or ``"auto"``: in the background for a host cache
            of 64 MiB or more, unless ranking beside training alone would shrink budgets that fit as asked. It
            applies to the ``"presample"`` policy on one node type of a local dataset; the others fill at set-up.
        cache_decay: the decay gamma of an unused row's eviction score per minibatch, in (0, 1] (scored caches).
        cache_interval: minibatches (Delta) between two eviction rounds of a scored cache.
        io_backend: the feature reader: ``"auto"`` (the first of ``uring``, ``pread``, ``buffered`` that works on
            the file), one of them, or ``"mmap"`` (see :class:`~lightning_ooc.io.FeatureReader`).
        queue_depth: reads in flight per reader thread.

    >>> Tiered(host_cache=0).host_cache, Tiered().describe()
    (0, 'features through the tiered store (gpu_cache 1.00 GiB, host_cache 1.00 GiB, staging 32.00 MiB)')
    """

    name = "tiered"
    words = "features through the tiered store"

    def __init__(self, gpu_cache: int | str = "1GiB", host_cache: int | str = "1GiB", staging: int | str = "32MiB",
                 host_cache_policy: str = "presample", presample_batches: int = 256, host_cache_fill: str = "auto",
                 cache_decay: float = 0.995, cache_interval: int = 32, io_backend: str = "auto",
                 queue_depth: int = 128):  # fmt: skip
        self._keep(dict(gpu_cache=gpu_cache, host_cache=host_cache, staging=staging,
                        host_cache_policy=host_cache_policy, presample_batches=presample_batches,
                        host_cache_fill=host_cache_fill, cache_decay=cache_decay, cache_interval=cache_interval,
                        io_backend=io_backend, queue_depth=queue_depth))
        self.gpu_cache = size("gpu_cache", gpu_cache)
        self.host_cache = size("host_cache", host_cache)
        self.staging = size("staging", staging)
        self.host_cache_policy = one_of("host_cache_policy", host_cache_policy, HOST_CACHE_POLICIES)
        if isinstance(presample_batches, bool) or not isinstance(presample_batches, int) or presample_batches < 0:
            raise InputError(f"presample_batches must be an integer >= 0, got {presample_batches!r}")
        self.presample_batches = int(presample_batches)
        self.host_cache_fill = one_of("host_cache_fill", host_cache_fill, HOST_CACHE_FILLS)
        if isinstance(cache_decay, bool) or not isinstance(cache_decay, (int, float)) or not 0.0 < cache_decay <= 1.0:
            raise InputError(f"cache_decay must lie in (0, 1] (gamma: the eviction score's decay per unused "
                             f"minibatch), got {cache_decay!r}")  # fmt: skip
        self.cache_decay = float(cache_decay)
        self.cache_interval = positive("cache_interval", cache_interval,
                                       "minibatches between two eviction rounds of a scored cache")  # fmt: skip
        self.io_backend = one_of("io_backend", io_backend, IO_BACKENDS)
        self.queue_depth = positive("queue_depth", queue_depth, "reads in flight per reader thread")

    def describe(self) -> str:
        return (f"{self.words} (gpu_cache {human_bytes(self.gpu_cache)}, host_cache {human_bytes(self.host_cache)}, "
                f"staging {human_bytes(self.staging)})")  # fmt: skip

    def tiered(self) -> dict[str, Any]:
        """Its :class:`Tiered` arguments as given (what a backend built on the tiers passes on)."""
        names = inspect.signature(Tiered.__init__).parameters
        return {k: v for k, v in self.settings().items() if k in names}


class Packed(Tiered):
    """The tiered store with packed minibatches (DiskGNN): each epoch's training batches are sampled ahead and
    each batch's rows the host cache does not hold are packed contiguously, so an epoch reads them sequentially
    (:mod:`lightning_ooc.loader.packed_passes`). Batches are the same (in order, bit for bit); evaluation reads as the
    tiered store does.

    Args:
        pack_dir: where packs go (default ``<dataset>.packed`` beside the dataset; never inside it).
        pack_space: the most disk one epoch's pack may take, as a multiple of the feature files' size (two
            epochs are on disk while the next one is packed); batches past it read their rows directly.
        pack_memory: host memory for packing and for the sections being read (half each); the tiers are planned
            in what the memory limit leaves beside it (lowered, with a warning, where they cannot fit).
        first_epoch: ``"pack"`` (wait for the first epoch's pack) or ``"random"`` (train it on direct reads).
        **tiered: the :class:`Tiered` settings (``host_cache_policy="scored"`` is refused: the packer needs a
            host cache that does not change while it packs).

    >>> Packed(pack_memory="16MiB").pack_memory >> 20
    16
    """

    name = "packed"
    words = "packed minibatches (features packed per batch ahead of each epoch)"

    def __init__(self, pack_dir: str | os.PathLike | None = None, pack_space: float = 3.0,
                 pack_memory: int | str = "256MiB", first_epoch: str = "pack", **tiered: Any):  # fmt: skip
        super().__init__(**tiered)
        self._keep(dict(self._given, pack_dir=pack_dir, pack_space=pack_space, pack_memory=pack_memory,
                        first_epoch=first_epoch))  # fmt: skip
        if self.host_cache_policy == "scored":
            raise InputError("packed minibatches need a host cache that does not change while they are packed; "
                             "host_cache_policy='scored' replaces rows as training runs: use 'presample' or 'degree'")
        self.pack_dir = None if pack_dir is None else os.fspath(pack_dir)
        try:
            space = float(pack_space)
        except (TypeError, ValueError):
            space = -1.0
        if isinstance(pack_space, bool) or not space > 0:
            raise InputError(f"pack_space must be a multiple of the feature files' size > 0 (e.g. 3.0), got "
                             f"{pack_space!r}")  # fmt: skip
        self.pack_space = space
        self.pack_memory = size("pack_memory", pack_memory)
        if self.pack_memory < PACK_MEMORY_LEAST:
            raise InputError(f"pack_memory must be at least 8MiB, got {pack_memory!r}")
        self.first_epoch = one_of("first_epoch", first_epoch, FIRST_EPOCH)


class Learnable(Tiered):
    """An embedding table's rows as ``x``, trained with the model: a sparse Adagrad step with ``lr`` when the
    backward pass reaches ``x``, written back to the table (:mod:`lightning_ooc.store.learnable_rows`), so a graph
    without features trains end to end. One process; no host cache (its rows could not change).

    Args:
        table: the embedding table (``lightning-ooc init-embeddings ROOT --out TABLE --dim D --partitions 1``);
            the model's ``in_channels`` is its ``dim``.
        lr: Adagrad learning rate of the rows.
        gpu_cache, staging, io_backend, queue_depth: as :class:`Tiered` (the feature buffer over the table).

    >>> f = Learnable("data/g-emb", lr=0.1)
    >>> f.table, f.lr, f.host_cache, f.name
    ('data/g-emb', 0.1, 0, 'learnable')
    """

    name = "learnable"
    words = "learnable features (an embedding table)"

    def __init__(self, table: str | os.PathLike, lr: float = 0.01, gpu_cache: int | str = "1GiB",
                 staging: int | str = "32MiB", io_backend: str = "auto", queue_depth: int = 128):  # fmt: skip
        super().__init__(gpu_cache=gpu_cache, host_cache=0, staging=staging, io_backend=io_backend,
                         queue_depth=queue_depth)  # fmt: skip
        self._keep(dict(table=table, lr=lr, gpu_cache=gpu_cache, staging=staging, io_backend=io_backend,
                        queue_depth=queue_depth))  # fmt: skip
        if not isinstance(table, (str, os.PathLike)) or not os.fspath(table):
            raise InputError("Learnable needs table: an embedding table for the dataset's nodes "
                             "(lightning-ooc init-embeddings ROOT --out TABLE --dim D --partitions 1)")  # fmt: skip
        self.table = os.fspath(table)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise InputError(f"lr must be > 0 (the Adagrad learning rate of the learnable rows), got {lr!r}")
        self.lr = float(lr)

    def tiered(self) -> dict[str, Any]:
        return {"host_cache": 0, **{k: v for k, v in super().tiered().items() if k not in ("table", "lr")}}


class Partitioned(Tiered):
    """A partitioned dataset's rows (``lightning-ooc partition``: one machine per part): this machine's through
    the tiers, other machines' through the row exchange and a buffer of them (:mod:`lightning_ooc.loader.partitioned`).
    A partitioned ``root`` runs on it when ``features`` is :class:`Tiered` (those settings carried over; other
    backends are refused there); give it to set the remote settings.

    Args:
        remote_cache: bytes per process of the buffer of other machines' rows.
        remote_cache_policy: ``"scored"`` (MassiveGNN's prefetch with eviction, warm-started with the remote nodes
            most often a neighbour), ``"static"`` (those nodes, never replaced) or ``"none"``; ``cache_decay`` and
            ``cache_interval`` are the scored policy's.
        exchange_timeout: seconds a row exchange may take before it is an error (a machine that died); also how
            long a machine done with its passes keeps serving the others.
        **tiered: the :class:`Tiered` settings of this machine's rows.

    >>> f = Partitioned(remote_cache="1GiB", host_cache="2GiB")
    >>> f.remote_cache >> 30, f.host_cache >> 30, f.remote_cache_policy
    (1, 2, 'scored')
    """

    name = "partitioned"
    words = "a partitioned dataset"

    def __init__(self, remote_cache: int | str = "256MiB", remote_cache_policy: str = "scored",
                 exchange_timeout: float = 120.0, **tiered: Any):  # fmt: skip
        super().__init__(**tiered)
        self._keep(dict(self._given, remote_cache=remote_cache, remote_cache_policy=remote_cache_policy,
                        exchange_timeout=exchange_timeout))  # fmt: skip
        self.remote_cache = size("remote_cache", remote_cache)
        self.remote_cache_policy = one_of("remote_cache_policy", remote_cache_policy, REMOTE_CACHE_POLICIES)
        if isinstance(exchange_timeout, bool) or not isinstance(exchange_timeout, (int, float)) \
                or not exchange_timeout > 0:  # fmt: skip
            raise InputError(f"exchange_timeout must be > 0 seconds, got {exchange_timeout!r}")
        self.exchange_timeout = float(exchange_timeout)


class InMemory(FeatureBackend):
    """Every feature row in the training device's memory, read by the same pipeline (samplers, extractors, out
    of order) from one tier instead of the hierarchy: the in-memory reference (on a GPU, "all features in GPU
    memory").

    >>> InMemory().describe()
    'every feature row in device memory'
    """

    name = "device_table"
    words = "every feature row in device memory"

    def __init__(self) -> None:
        self._keep({})


class Mapped(FeatureBackend):
    """Rows read synchronously, in the training loop, from a memory map of the feature file: what PyG with
    memory-mapped features amounts to (a baseline; no thread, no cache of ours), in sampling order.

    Args:
        madvise: ``"random"`` turns the kernel's read-ahead off (``MADV_RANDOM``: the strongest honest setting for
            random rows) or ``"normal"`` keeps it.
        in_ram: read the whole feature file into RAM first instead (the upper bound of a synchronous loader).

    >>> Mapped().source_options(), Mapped(in_ram=True).source_options()["features"]
    ({'features': 'mmap', 'madvise_random': True}, 'ram')
    """

    name = "sync"
    words = "features read synchronously from RAM or a memory map"

    def __init__(self, madvise: str = "random", in_ram: bool = False):
        self._keep(dict(madvise=madvise, in_ram=in_ram))
        self.madvise = one_of("madvise", madvise, MADVISE)
        if not isinstance(in_ram, bool):
            raise InputError(f"in_ram must be true or false, got {in_ram!r}")
        self.in_ram = in_ram

    def source_options(self) -> dict[str, Any]:
        """Where the synchronous pass source reads rows from."""
        return {"features": "ram" if self.in_ram else "mmap", "madvise_random": self.madvise == "random"}

    def describe(self) -> str:
        return ("features read synchronously from RAM" if self.in_ram
                else f"features read synchronously from a memory map (madvise {self.madvise})")  # fmt: skip


class StorePair(FeatureBackend):
    """A PyG ``(FeatureStore, GraphStore)`` pair given as ``root``: its ``multi_get_tensor`` on the extractor
    threads (:mod:`lightning_ooc.loader.store_pair`); chosen from the data, never given.

    >>> StorePair().name, StorePair() == StorePair()
    ('pyg_store', True)
    """

    name = "pyg_store"
    words = "a PyG (FeatureStore, GraphStore) pair"

    def __init__(self) -> None:
        self._keep({})


#: the backends a short name stands for (with their defaults)
NAMES: dict[str, type[FeatureBackend]] = {
    "tiered": Tiered,
    "packed": Packed,
    "in_memory": InMemory,
    "mapped": Mapped,
    "partitioned": Partitioned,
}

#: the backends a ``class_path`` may name, by class name
CLASSES: dict[str, type[FeatureBackend]] = {c.__name__: c for c in (Tiered, Packed, InMemory, Mapped, Learnable,
                                                                    Partitioned)}  # fmt: skip


def _backend_class(path: str) -> type[FeatureBackend]:
    """The backend class ``path`` names: ours by ``lightning_ooc.NAME`` (or their module's path), another by its
    import path (a subclass of one of ours)."""
    module, _, name = path.rpartition(".")
    if name in CLASSES and module in ("", "lightning_ooc", __name__):
        return CLASSES[name]
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError, ValueError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, FeatureBackend)):
        raise InputError(f"features: unknown backend {path!r}; one of {', '.join(CLASSES)} (lightning_ooc.NAME), or "
                         "the import path of a subclass of one")  # fmt: skip
    return cls


def as_backend(value: Any) -> FeatureBackend:
    """``features=`` as a backend: a :class:`FeatureBackend`, a short name (:data:`NAMES`), or what
    :meth:`FeatureBackend.plain` gives back (a checkpoint's hyperparameters, a YAML mapping), else an InputError.

    >>> as_backend(None) == Tiered(), as_backend("in_memory")
    (True, InMemory())
    >>> as_backend("learnable")
    Traceback (most recent call last):
      ...
    lightning_ooc.errors.InputError: features='learnable' needs its table: features=Learnable(table=TABLE) ...
    """
    if value is None:
        return Tiered()
    if isinstance(value, FeatureBackend):
        return value
    if isinstance(value, str):
        if value == "learnable":
            raise InputError("features='learnable' needs its table: features=Learnable(table=TABLE) (in YAML, "
                             "class_path: lightning_ooc.Learnable with init_args: {table: TABLE})")  # fmt: skip
        if value not in NAMES:
            raise InputError(f"features must be a feature backend or one of {', '.join(NAMES)}, got {value!r}")
        return NAMES[value]()
    if isinstance(value, dict) and "class_path" in value:
        cls = _backend_class(str(value["class_path"]))
        args = value.get("init_args") or {}
        try:
            return cls(**args)
        except TypeError as e:
            raise InputError(f"features: {cls.__name__}: {e}") from None
    raise InputError(f"features must be a feature backend (Tiered(...), Packed(...), InMemory(), Mapped(...), "
                     f"Learnable(...)) or one of {', '.join(NAMES)}, got {type(value).__name__}")  # fmt: skip
