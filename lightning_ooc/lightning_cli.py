"""``lightning-ooc fit|validate|test|predict``: LightningCLI over our models and :class:`OutOfCoreNodeData`.

A config names the model class (any :class:`~lightning_ooc.models.NodeClassifier`
subclass, or your own LightningModule taking ``in_channels`` and ``num_classes``),
the dataset and budgets under ``data:``, and the Trainer (``strategy: ooc``).
``in_channels`` and ``num_classes`` come from the dataset; they need not be written.

    lightning-ooc fit --config configs/demo.yaml --trainer.accelerator cpu --trainer.devices 2
    lightning-ooc fit --config configs/sage_papers.yaml --data.root /ssd/papers100M
    lightning-ooc fit --print_config --config configs/demo.yaml   # the full config, defaults included

``--test_after_fit true`` tests the trained model in the same run.
"""
from __future__ import annotations

import logging
import sys
from typing import Sequence

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI

from lightning_ooc.datamodule import OutOfCoreNodeData
from lightning_ooc.errors import LightningOOCError
from lightning_ooc.utils.logs import StderrHandler

class OutOfCoreCLI(LightningCLI):
    """LightningCLI whose model dimensions are read from the dataset."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.num_features", "model.init_args.in_channels", apply_on="instantiate")
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
        parser.add_argument("--test_after_fit", type=bool, default=False, help="run `test` after `fit` in the same run")

    def after_fit(self) -> None:
        if self.config[self.subcommand].get("test_after_fit"):
            self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)


def main(argv: Sequence[str]) -> int:
    from lightning_ooc.models import NodeClassifier

    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig, with a handler that follows sys.stderr
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    try:
        args = None if list(argv) == sys.argv[1:] else list(argv)  # None: LightningCLI reads sys.argv itself
        OutOfCoreCLI(NodeClassifier, OutOfCoreNodeData, subclass_mode_model=True, args=args,
                     save_config_kwargs={"overwrite": True})  # fmt: skip
    except (LightningOOCError, MisconfigurationException) as e:  # a setting to change: one line, no traceback
        print(f"lightning-ooc: error: {e}", file=sys.stderr)
        return 2
    return 0
