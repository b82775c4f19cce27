"""Layer-wise inference through Lightning's predict loop, and a callback that writes predictions to disk.

With ``predict={"inference": "layerwise"}`` (``lightning-ooc predict --config ...
--data.predict.inference layerwise``), a node
datamodule's ``predict_dataloader`` is a :class:`LayerwisePredictLoader`: when the predict loop starts
iterating it, it runs :func:`~lightning_ooc.infer.layerwise` with the trainer's model (every node, one layer at
a time, out of core; resumed where a stopped run left off), then yields the outputs a range of nodes at a time
as :class:`LayerwiseBatch` (``out``, ``n_id``, ``batch_size``, ``y``). The package's node classifiers predict the
argmax of ``out``; :class:`PredictionWriter` writes what ``predict_step`` returns to one ``.npy`` file indexed by
node id, for sampled batches (their seeds) as for these. The layer-wise run's memory is fitted under the
datamodule's ``memory_limit``, as the sampled path's plan is.

Example::

    >>> import tempfile, numpy as np, lightning as L
    >>> from lightning_ooc import OutOfCoreNodeData
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.models import GraphSAGE
    >>> d = tempfile.mkdtemp()
    >>> root = synthesize(d + "/g", num_nodes=2000, avg_degree=5, num_features=8, num_classes=3, progress=False)
    >>> dm = OutOfCoreNodeData(root, predict={"inference": "layerwise", "inference_out": d + "/logits"}, progress=False)
    >>> trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
    ...                     callbacks=[PredictionWriter(d + "/pred.npy")])
    >>> _ = trainer.predict(GraphSAGE(8, 3, hidden_channels=16, num_layers=2), datamodule=dm, return_predictions=False)
    >>> pred = np.load(d + "/pred.npy")
    >>> pred.shape, bool((pred >= 0).all() and (pred < 3).all())
    ((2000,), True)
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch_geometric.data import Data

from lightning_ooc.data.commit import fsync_dir
from lightning_ooc.data.dataset import open_dataset
from lightning_ooc.data.outputs import check_output, partial_path, sweep_partials
from lightning_ooc.errors import DatasetWriteError, InputError
from lightning_ooc.infer.run import layerwise
from lightning_ooc.loader.features import Learnable
from lightning_ooc.loader.partitioned import is_partitioned

__all__ = ["LayerwiseBatch", "LayerwisePredictLoader", "PredictionWriter"]


class LayerwiseBatch(Data):
    """A range of nodes and the model's outputs for them, from layer-wise inference.

    ``out`` [n, C] (the last layer's outputs), ``n_id`` [n] (their node ids), ``batch_size`` n, ``y`` their labels.

        >>> import torch
        >>> b = LayerwiseBatch(out=torch.zeros(2, 3), n_id=torch.tensor([4, 5]), batch_size=2)
        >>> b.layerwise, b.out.shape
        (True, torch.Size([2, 3]))
    """

    layerwise = True


class LayerwisePredictLoader:
    """The predict batches of layer-wise inference (see the module docstring); built by the datamodule.

        >>> LayerwisePredictLoader.__name__
        'LayerwisePredictLoader'
    """

    def __init__(self, dm: Any):
        self.dm = dm
        cfg = dm.config
        if dm.task != "node" or dm.stores is not None or isinstance(cfg.features, Learnable):
            raise InputError(f"{type(dm).__name__}: predict.inference='layerwise' runs node classification over a "
                             "dataset directory with its own features; use predict.inference='sampled' here")  # fmt: skip
        #: the node type predicted (heterogeneous datasets): the datamodule's input type or the dataset's target
        self.node_type: str | None = None
        if is_partitioned(dm.root):
            raise InputError(f"{dm.root}: predict.inference='layerwise' runs over a whole dataset, not one "
                             "machine's partition; predict with predict.inference='sampled'")  # fmt: skip
        num_nodes = dm.num_nodes
        if isinstance(num_nodes, dict):  # a heterogeneous dataset: the seeds' type is predicted
            self.node_type = dm.input_type
            if self.node_type not in num_nodes:
                raise InputError(f"{dm.root}: name the node type to predict (input_type=...; node types: "
                                 f"{', '.join(num_nodes)})")  # fmt: skip
            num_nodes = num_nodes[self.node_type]
        self.num_nodes = int(num_nodes)
        self.chunk = int(cfg.predict.inference_chunk)
        self.result = None

    def __len__(self) -> int:
        return math.ceil(self.num_nodes / self.chunk)

    def out_dir(self, trainer: Any) -> Path:
        """Where layer-wise inference writes its outputs (``predict.inference_out``, else under the run's
        directory)."""
        given = self.dm.config.predict.inference_out
        if given is not None:
            return Path(given)
        return Path(trainer.default_root_dir) / "predictions"

    def __iter__(self) -> Iterator[LayerwiseBatch]:
        trainer = getattr(self.dm, "trainer", None)
        if trainer is None or trainer.lightning_module is None:
            raise InputError("layer-wise inference runs inside trainer.predict(model, datamodule=dm)")
        if trainer.world_size > 1:
            raise InputError(f"predict.inference='layerwise' runs in one process (this run has {trainer.world_size}); "
                             "predict with --trainer.devices 1")  # fmt: skip
        cfg = self.dm.config
        self.result = layerwise(trainer.lightning_module, self.dm.root, self.out_dir(trainer),
                                memory=cfg.predict.inference_memory, overwrite=True,
                                progress=cfg.progress, memory_limit=cfg.memory_limit)  # fmt: skip
        out = open_dataset(self.result.out)
        if self.node_type is not None:
            out = out.node(self.node_type)
            if not out.has_features:
                raise InputError(f"{trainer.lightning_module.__class__.__name__} gives no output for node type "
                                 f"{self.node_type!r}; predict the type its last layer classifies")  # fmt: skip
        rows = out.features_memmap()
        labels = out.labels
        for a in range(0, self.num_nodes, self.chunk):
            b = min(self.num_nodes, a + self.chunk)
            y = torch.from_numpy(np.array(labels[a:b], dtype=np.int64)) if labels is not None else None
            yield LayerwiseBatch(out=torch.from_numpy(np.array(rows[a:b])), n_id=torch.arange(a, b), batch_size=b - a,
                                 y=y)  # fmt: skip


class PredictionWriter(BasePredictionWriter):
    """Write each predict batch's predictions into one ``.npy`` file indexed by node id (``-1``: not predicted).

    Takes what ``predict_step`` returns for the first ``batch_size`` nodes of the batch (``n_id``), as the
    sampled batches and :class:`LayerwiseBatch` give them. The file is written beside its final name, under a
    name of this writer's own (:func:`~lightning_ooc.data.outputs.partial_path`; what killed writers left there
    is removed first, :func:`~lightning_ooc.data.outputs.sweep_partials`), and renamed into place when the loop
    ends.

    ``path`` is checked when predicting starts, before any batch
    (:func:`~lightning_ooc.data.outputs.check_output`): never the checkpoint or a file of the dataset read (one
    it uses in place included), never inside a dataset or the layer-wise run's output, and a file already there
    only with ``overwrite=True`` (``init_args: {path: ..., overwrite: true}``, or
    ``--trainer.callbacks.overwrite true``).

        >>> PredictionWriter("pred.npy").path.name
        'pred.npy'
    """

    def __init__(self, path: str | os.PathLike = "predictions.npy", overwrite: bool = False):
        super().__init__(write_interval="batch")
        self.path = Path(path)
        self.overwrite = bool(overwrite)
        self._map: np.memmap | None = None
        self._partial: Path | None = None

    def on_predict_start(self, trainer, pl_module) -> None:
        """Refuse ``path`` (one line, nothing predicted) where writing it would replace what the run reads or a
        file not to be replaced."""
        dm = getattr(trainer, "datamodule", None)
        option = "PredictionWriter(path=...)"
        self.path = check_output(self.path, inputs=[getattr(dm, "root", None), trainer.ckpt_path],
                                 overwrite=self.overwrite, option=option,
                                 overwrite_option="overwrite=True (--trainer.callbacks.overwrite true)")  # fmt: skip
        loader = trainer.predict_dataloaders
        if isinstance(loader, LayerwisePredictLoader):
            out = Path(os.path.abspath(loader.out_dir(trainer))).resolve()
            at = self.path.resolve()
            if at == out or at.is_relative_to(out):
                raise DatasetWriteError(f"{self.path}: lies in {out}, the dataset layer-wise inference writes, so "
                                        f"nothing was touched; choose {option} outside it")  # fmt: skip

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        pred = prediction.detach().cpu()
        n = int(batch.batch_size)
        ids = batch.n_id[:n].cpu().numpy()
        if self._map is None:
            dm = trainer.datamodule
            num_nodes = getattr(trainer.predict_dataloaders, "num_nodes", None)  # layer-wise: the type predicted
            if num_nodes is None:
                num_nodes = dm.num_nodes
                num_nodes = int(num_nodes[dm.input_type] if isinstance(num_nodes, dict) else num_nodes)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            sweep_partials(self.path)
            self._partial = partial_path(self.path)
            self._map = np.lib.format.open_memmap(self._partial, mode="w+", dtype=pred.numpy().dtype,
                                                  shape=(num_nodes, *pred.shape[1:]))  # fmt: skip
            self._map[:] = -1
        self._map[ids] = pred[:n].numpy()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """A failed or interrupted predict leaves no partial file (and no earlier file is replaced)."""
        if self._map is not None:
            del self._map
            self._map = None
            self._partial.unlink(missing_ok=True)

    def on_predict_end(self, trainer, pl_module) -> None:
        if self._map is None:
            return
        self._map.flush()
        del self._map
        self._map = None
        os.replace(self._partial, self.path)
        fsync_dir(self.path.parent)
