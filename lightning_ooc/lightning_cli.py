"""``lightning-ooc fit|validate|test|predict``: LightningCLI over our models and datamodules.

A config names the model class (any :class:`~lightning_ooc.models.NodeClassifier`
subclass, :class:`~lightning_ooc.models.LinkPredictor`, or your own LightningModule
taking ``in_channels`` and ``num_classes``), the dataset and budgets under ``data:``
(:class:`OutOfCoreNodeData`'s arguments, or another datamodule named with
``class_path``, such as ``lightning_ooc.OutOfCoreLinkData``), and the Trainer
(``strategy: ooc``). ``in_channels`` and ``num_classes`` come from the dataset; they
need not be written (nor, for :class:`~lightning_ooc.OutOfCoreHeteroNodeData` and the relational
models, ``metadata`` and ``in_channels`` per node type: ``configs/rgat_igbh.yaml``).

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
from typing import Any, Sequence

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI

from lightning_ooc.datamodule import OutOfCoreNodeData
from lightning_ooc.errors import InputError, LightningOOCError
from lightning_ooc.utils.logs import StderrHandler, disk_full
from lightning_ooc.data.dataset import open_dataset
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


def fill_metadata(config: Any) -> None:
    """Give a model that takes ``metadata`` (the relational models) the ``(node_types, edge_types)`` of the
    dataset named under ``data`` when the config leaves it out, and one that takes ``num_relations`` (the
    knowledge-graph embedding models) the relation count of the embedding table named under ``data``. (Heterogeneous datamodules give their
    ``num_features`` per node type, which the ``in_channels`` link carries; ``metadata`` is set here rather than
    linked, because a link names the target for every model, and a homogeneous one has no such argument.)"""

    model, data = _get(config, "model"), _get(config, "data")
    args = _get(model, "init_args")
    path = _get(model, "class_path")
    if args is None or not isinstance(path, str) or _get(args, "metadata") is not None:
        return
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return  # jsonargparse reports it
    params = inspect.signature(cls.__init__).parameters
    table = _get(_get(data, "init_args"), "table") or _get(data, "table")
    if "num_relations" in params and _get(args, "num_relations") is None and table is not None:
        # an embedding table's relation count (a KGE model); a missing or wrong table is one line from here
        args["num_relations"] = int(read_table_meta(table).get("num_relations", 1))
    if "metadata" not in params:
        return
    root = _get(_get(data, "init_args"), "root") or _get(data, "root")
    if root is None:
        return

    ds = open_dataset(root)
    if getattr(ds, "is_hetero", False):
        node_types, edge_types = ds.metadata()
        args["metadata"] = [node_types, [list(et) for et in edge_types]]


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
        fill_metadata(config)

    def add_arguments_to_parser(self, parser) -> None:
        if self.subclass_mode_data:  # a config without data.class_path means OutOfCoreNodeData
            parser.set_defaults({"data": {"class_path": f"{OutOfCoreNodeData.__module__}.{OutOfCoreNodeData.__name__}"}})
        parser.link_arguments("data.num_features", "model.init_args.in_channels", apply_on="instantiate")
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
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
