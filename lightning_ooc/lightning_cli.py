"""``lightning-ooc fit|validate|test|predict``: LightningCLI over our models and datamodules.

A config names the model class (any :class:`~lightning_ooc.models.NodeClassifier`
subclass, :class:`~lightning_ooc.models.LinkPredictor`, or your own LightningModule
taking ``in_channels`` and ``num_classes``, or PyG's names ``in_channels`` and ``out_channels``),
the dataset and budgets under ``data:`` (:class:`OutOfCoreNodeData`'s arguments, or another
datamodule named with ``class_path``, such as ``lightning_ooc.OutOfCoreLinkData``), and the
Trainer (``strategy: ooc``). ``in_channels`` and ``num_classes`` come from the dataset; they
need not be written (nor, for a heterogeneous dataset and the relational models, ``metadata`` and
``in_channels`` per node type: ``configs/rgat_igbh.yaml``). A model
classifying nodes that takes ``out_channels`` and no ``num_classes`` (PyG's models) gets the class
count there; for link prediction ``out_channels`` is the model's own (the embedding size).

    lightning-ooc fit --config configs/demo.yaml --trainer.accelerator cpu --trainer.devices 2
    lightning-ooc fit --config configs/sage_papers.yaml --data.root /ssd/papers100M
    lightning-ooc fit --print_config --config configs/demo.yaml   # the full config, defaults included
    lightning-ooc fit --config configs/link_demo.yaml             # link prediction (OutOfCoreLinkData)

``--test_after_fit true`` tests the trained model in the same run.

With a strategy that has ``mps_split``, the command makes this process a CUDA MPS
client (:func:`lightning_ooc.strategy.mps.prepare`) before it builds the Trainer;
the processes Lightning starts for further devices inherit that and join the same
daemon.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Sequence

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI

from lightning_ooc.datamodule import OutOfCoreNodeData
from lightning_ooc.errors import InputError, LightningOOCError
from lightning_ooc.models import checks
from lightning_ooc.utils.logs import StderrHandler, disk_full
from lightning_ooc.embed.table import read_table_meta
from lightning_ooc.strategy import mps
import importlib
import inspect
import os
import zipfile


def _get(obj: Any, key: str) -> Any:
    """``obj[key]`` of a dict or a jsonargparse Namespace, or None."""
    if obj is None or isinstance(obj, str):
        return None
    get = getattr(obj, "get", None)
    return get(key) if callable(get) else getattr(obj, key, None)


def mps_split_of(config: Any) -> int | None:
    """The ``mps_split`` of the trainer's strategy in a parsed config (one subcommand's), or None.

    ``trainer.strategy`` is a name (``"ooc"``: no split), a ``class_path``/``init_args`` mapping, or a
    strategy object. None too where the trainer's accelerator is named and is not a GPU.
    """
    trainer = _get(config, "trainer")
    strategy = _get(trainer, "strategy")
    if strategy is None or isinstance(strategy, str):
        return None
    split = _get(_get(strategy, "init_args"), "mps_split")
    if split is None and not hasattr(strategy, "get"):  # a strategy object
        split = getattr(strategy, "mps_split", None)
    accelerator = _get(trainer, "accelerator")
    if isinstance(accelerator, str) and accelerator not in ("auto", "gpu", "cuda"):
        return None
    return None if split is None else int(split)


def prepare_mps(config: Any) -> Any:
    """Make this process an MPS client when the config's strategy has ``mps_split`` (before the Trainer).

    Returns what :func:`lightning_ooc.strategy.mps.prepare` returns, or None without ``mps_split``.
    """
    split = mps_split_of(config)
    if split is None:
        return None

    return mps.prepare(split)


def _model_class(config: Any) -> type | None:
    """The model class named by a parsed config (one subcommand's), or None."""
    path = _get(_get(config, "model"), "class_path")
    if not isinstance(path, str):
        return None
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None  # jsonargparse reports it


def fill_num_relations(config: Any) -> None:
    """Give a model that takes ``num_relations`` (the knowledge-graph embedding models) the relation count of the
    embedding table named under ``data`` when the config leaves it out."""

    model, data = _get(config, "model"), _get(config, "data")
    args = _get(model, "init_args")
    cls = _model_class(config)
    if args is None or cls is None:
        return
    params = inspect.signature(cls.__init__).parameters
    table = _get(_get(data, "init_args"), "table") or _get(data, "table")
    if "num_relations" in params and _get(args, "num_relations") is None and table is not None:
        # an embedding table's relation count (a KGE model); a missing or wrong table is one line from here
        args["num_relations"] = int(read_table_meta(table).get("num_relations", 1))


class DatasetLinks:
    """The model's arguments that the dataset determines besides ``in_channels`` and ``num_classes`` (plain links):
    PyG's ``out_channels`` of a node classifier, and ``metadata`` (``[node_types, edge_types]``) of a
    heterogeneous dataset. It is made from the parsed config before the classes are built (what the config gives,
    the model's signature); the links call :meth:`out_channels` and :meth:`metadata` with the datamodule, and only
    for a model that takes the argument.

    Example::

        >>> class Net:
        ...     def __init__(self, in_channels: int, out_channels: int, metadata=None): ...
        >>> links = DatasetLinks(model=Net, given={})
        >>> class Nodes(OutOfCoreNodeData):  # stands in for the datamodule of a dataset with 3 classes
        ...     num_classes, metadata = 3, (["paper"], [("paper", "cites", "paper")])
        >>> dm = Nodes.__new__(Nodes)
        >>> links.out_channels(dm), links.metadata(dm)
        (3, [['paper'], [['paper', 'cites', 'paper']]])
        >>> DatasetLinks(model=Net, given={"out_channels": 5}).out_channels(dm)
        Traceback (most recent call last):
          ...
        lightning_ooc.errors.InputError: --model.out_channels 5: Net classifies the nodes of a dataset with 3 classes; leave out_channels out (it is read from the dataset)
    """

    def __init__(self, config: Any = None, *, model: type | None = None, given: Any = None):
        cls = model if model is not None else _model_class(config)
        self.name = cls.__name__ if cls is not None else "the model"
        self.params = dict(inspect.signature(cls.__init__).parameters) if cls is not None else {}
        self.given = given if given is not None else _get(_get(config, "model"), "init_args")

    def _value(self, key: str) -> Any:
        """The config's value of ``key`` (its default where it gives none), or None."""
        v = _get(self.given, key)
        if v is None or v is inspect.Parameter.empty:
            p = self.params.get(key)
            v = None if p is None or p.default is inspect.Parameter.empty else p.default
        return v

    def out_channels(self, datamodule: Any) -> Any:
        """The class count for a model that classifies the nodes of ``datamodule`` and takes no ``num_classes``
        (PyG's models); else the config's value (a link model's embedding size). One written that differs from
        the class count, or none where the dataset gives none, is an :class:`InputError`."""
        if "out_channels" not in self.params:  # the link is left out; LightningCLI calls it all the same
            return None
        value = self._value("out_channels")
        classifies = getattr(datamodule, "task", None) == "node"
        if classifies and "num_classes" not in self.params:
            classes = int(datamodule.num_classes)
            default = self.params["out_channels"].default if "out_channels" in self.params else None
            if value is not None and value != default and int(value) != classes:
                raise InputError(f"--model.out_channels {value}: {self.name} classifies the nodes of a dataset with "
                                 f"{classes} classes; leave out_channels out (it is read from the dataset)")  # fmt: skip
            return classes
        if value is None:
            raise InputError(f"{self.name} takes out_channels, which {type(datamodule).__name__} does not determine "
                             f"(it is the model's own output size): give --model.out_channels N")  # fmt: skip
        return value

    def in_channels(self, value: Any) -> Any:
        """The dataset's feature dimension as the model's ``in_channels``: one per node type (a heterogeneous
        dataset) only for a relational model (one that takes ``metadata``); else the error that names one."""
        if isinstance(value, dict) and "metadata" not in self.params:
            checks.in_channels(value)  # raises: a dimension per node type means a heterogeneous dataset
        return value

    def metadata(self, datamodule: Any) -> Any:
        """The config's ``metadata`` where it gives one, else the heterogeneous dataset's (lists, as YAML writes
        them), else the model's default."""
        if "metadata" not in self.params:
            return None
        given = _get(self.given, "metadata")
        if given is not None:
            return given
        meta = getattr(datamodule, "metadata", None)
        if meta is None:
            return self._value("metadata")
        node_types, edge_types = meta
        return [list(node_types), [list(et) for et in edge_types]]


def drop_unknown_links(config: Any, links: DatasetLinks) -> list[str]:
    """Remove ``out_channels`` and ``metadata`` from the model's ``dict_kwargs`` where the model takes no such
    argument; the names removed.

    The links to them are left out for such a model, but the saved config keeps their target with no value, and
    a checkpoint's hyperparameters carry it: ``--ckpt_path`` parses them back as keyword arguments the model
    does not take (a ``TypeError`` for ``GraphSAGE(out_channels=None)`` when a run resumed).

        >>> class Net:
        ...     def __init__(self, in_channels: int, num_classes: int): ...
        >>> config = {"model": {"class_path": "Net", "dict_kwargs": {"out_channels": None, "metadata": None}}}
        >>> drop_unknown_links(config, DatasetLinks(model=Net, given={})), config["model"]["dict_kwargs"]
        (['out_channels', 'metadata'], {})
    """
    extra = _get(_get(config, "model"), "dict_kwargs")
    if not extra or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in links.params.values()):
        return []
    dropped = [name for name in ("out_channels", "metadata") if name in extra and name not in links.params]
    for name in dropped:
        del extra[name]
    return dropped


#: ``ckpt_path`` values that name no file: Lightning finds the checkpoint itself
_CKPT_KEYWORDS = ("best", "last", "hpc")


def check_ckpt_path(ckpt_path: Any) -> None:
    """Refuse a ``--ckpt_path`` that is missing, a directory, or not a checkpoint, before anything is built.

    A checkpoint (Lightning's ``ModelCheckpoint``, ``trainer.save_checkpoint``) is ``torch.save``'s zip archive
    holding a ``data.pkl``; a file of the old ``torch.save`` format starts as a pickle does. Lightning's
    keywords (``best``, ``last``, ``hpc``, ``registry...``) and remote paths (``s3://...``) are left to Lightning.
    """

    if ckpt_path is None or not isinstance(ckpt_path, (str, os.PathLike)):
        return
    text = os.fspath(ckpt_path)
    if text in _CKPT_KEYWORDS or text.startswith("registry") or "://" in text:
        return
    fix = ("give a checkpoint a run wrote (checkpoints/*.ckpt under its --trainer.default_root_dir), or leave "
           "--ckpt_path out to start from scratch")  # fmt: skip
    if not os.path.exists(text):
        raise InputError(f"--ckpt_path {text}: no such file; {fix}")
    if not os.path.isfile(text):
        raise InputError(f"--ckpt_path {text}: not a file; {fix}")
    try:
        with open(text, "rb") as f:
            legacy = f.read(1) == b"\x80"  # the old torch.save format: a pickle
        ours = False
        if zipfile.is_zipfile(text):
            with zipfile.ZipFile(text) as z:
                ours = any(n == "data.pkl" or n.endswith("/data.pkl") for n in z.namelist())
    except (OSError, zipfile.BadZipFile) as e:
        raise InputError(f"--ckpt_path {text}: cannot read it ({e}); {fix}") from None
    if not (ours or legacy):
        raise InputError(f"--ckpt_path {text}: not a checkpoint, or not a whole one (torch.save writes a zip archive "
                         f"holding data.pkl, whose index is at its end; this file is neither that nor a pickle); "
                         f"{fix}")  # fmt: skip


class OutOfCoreCLI(LightningCLI):
    """LightningCLI whose model dimensions are read from the dataset.

    ``data`` is :class:`OutOfCoreNodeData` unless the config names another datamodule with
    ``class_path`` (``lightning_ooc.OutOfCoreLinkData`` for link prediction, see
    ``configs/link_demo.yaml``); its arguments may then be given under ``init_args`` or directly.
    """

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        # before LightningCLI reads the checkpoint's hyperparameters (a traceback from torch.load for a file that
        # is not one) or the Trainer looks for it (a traceback after the whole set-up for a missing one)
        subcommand = self.config.get("subcommand")
        if subcommand:
            check_ckpt_path(self.config[subcommand].get("ckpt_path"))

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        # before the Trainer exists: a process becomes an MPS client when it initialises CUDA, not later
        prepare_mps(config)
        fill_num_relations(config)
        self._links = DatasetLinks(config)
        drop_unknown_links(config, self._links)

    def _linked(self, name: str) -> Callable[[Any], Any]:
        """The link from the datamodule to the model's argument ``name`` (:class:`DatasetLinks`)."""
        return lambda datamodule: getattr(self._links, name)(datamodule)

    def add_arguments_to_parser(self, parser) -> None:
        if self.subclass_mode_data:  # a config without data.class_path means OutOfCoreNodeData
            parser.set_defaults({"data": {"class_path": f"{OutOfCoreNodeData.__module__}.{OutOfCoreNodeData.__name__}"}})
        parser.link_arguments("data.num_features", "model.init_args.in_channels", apply_on="instantiate",
                              compute_fn=lambda value: self._links.in_channels(value))  # fmt: skip
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
        # PyG's name of the class count, and a heterogeneous dataset's metadata: linked, so that a model that
        # requires them parses without them; a link to an argument the model does not take is left out
        for name in ("out_channels", "metadata"):
            parser.link_arguments("data", f"model.init_args.{name}", compute_fn=self._linked(name),
                                  apply_on="instantiate")  # fmt: skip
        parser.add_argument("--test_after_fit", type=bool, default=False, help="run `test` after `fit` in the same run")

    def after_instantiate_classes(self) -> None:
        # a model and a datamodule that cannot train together (node classification on link batches, say): one
        # line now, before the datamodule's set-up, rather than a traceback from the first training step
        check = getattr(self.model, "check_datamodule", None)
        if callable(check):
            check(self.datamodule)

    def after_fit(self) -> None:
        if self.config[self.subcommand].get("test_after_fit"):
            self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)


def main(argv: Sequence[str]) -> int:
    import lightning as L  # lazy: Lightning takes seconds to import

    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig, with a handler that follows sys.stderr
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    try:
        args = None if list(argv) == sys.argv[1:] else list(argv)  # None: LightningCLI reads sys.argv itself
        OutOfCoreCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                     args=args, save_config_kwargs={"overwrite": True})  # fmt: skip
    except (LightningOOCError, MisconfigurationException) as e:  # a setting to change: one line, no traceback
        print(f"lightning-ooc: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # jsonargparse wraps what a subclass-mode class (data:) raised while built
        ours = _cause(e, LightningOOCError)
        if ours is None:
            raise
        print(f"lightning-ooc: error: {ours}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk under a checkpoint, a log, config.yaml or learnable features' journal
        full = disk_full(e, "free space on that disk, or write elsewhere (checkpoints, logs and config.yaml: "
                            "--trainer.default_root_dir)")  # fmt: skip
        if full is None:
            raise
        print(f"lightning-ooc: error: {full}", file=sys.stderr)
        return 2
    return 0


def _cause(e: BaseException, kind: type) -> BaseException | None:
    """The first exception of type ``kind`` in the chain of causes and contexts of ``e``, or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None
