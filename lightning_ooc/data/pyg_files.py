"""Loading a PyG ``Data``/``HeteroData`` saved with ``torch.save``: weights-only by default (PyG's storage classes
allowed), a full unpickle only when asked for, the first graph of a dataset object.
"""
from __future__ import annotations

import collections
import os
import pickle
import re
import types
import zipfile
from pathlib import Path
from typing import Any

import torch

from lightning_ooc.data.files import input_file
from lightning_ooc.errors import InputError
from torch import _weights_only_unpickler as wo


def _pyg_safe_globals() -> list[Any]:
    """PyG's data classes: what ``torch.load(weights_only=True)`` may build from a saved ``Data``."""
    try:
        from torch_geometric.data import Data, HeteroData  # lazy: PyG only where it is used
        from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr  # lazy: PyG only where it is used
        # lazy: PyG only where it is used
        from torch_geometric.data.storage import AttrType, BaseStorage, EdgeStorage, GlobalStorage, NodeStorage
    except ImportError:
        return []
    # AttrType: an enum a storage caches once asked which keys are edge attributes (RandomLinkSplit's Data are)
    return [Data, HeteroData, DataEdgeAttr, DataTensorAttr, BaseStorage, EdgeStorage, GlobalStorage, NodeStorage,
            AttrType]  # fmt: skip


def _defaultdict_pickle() -> types.ModuleType:
    """torch's weights-only unpickler that also fills a ``collections.defaultdict``, as a pickle module.

    A PyG storage that was asked which of its keys are edge attributes (every
    ``Data`` that ``RandomLinkSplit`` returns) caches the answer in a
    ``defaultdict``, and torch's weights-only unpickler fills plain dicts only
    (SETITEM/SETITEMS). This subclass lets those two opcodes fill a
    ``defaultdict`` too; everything else is torch's weights-only unpickler as
    it is: its allowed globals, its checks of every opcode (BUILD, NEWOBJ, ...)
    and of persistent ids.
    """

    class Unpickler(wo.Unpickler):
        def _check_set_item_target(self, opcode: str) -> None:
            if type(self.stack[-1]) is not collections.defaultdict:
                super()._check_set_item_target(opcode)

    mod = types.ModuleType("lightning_ooc_weights_only_defaultdict")
    mod.Unpickler = Unpickler  # type: ignore[attr-defined]
    mod.load = lambda f, **kw: Unpickler(f, **kw).load()  # type: ignore[attr-defined]
    mod.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]
    return mod


def _torch_load(path: Path, allow_pickle: bool) -> Any:
    """The object of a ``torch.save`` file, loaded as :func:`load_pyg_data` says."""
    input_file(path, "a PyG Data saved with torch.save", f"{path}: no such file (expected a PyG Data saved with "
               "torch.save)")  # fmt: skip
    try:
        if allow_pickle:
            return torch.load(path, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(_pyg_safe_globals()):
            try:
                return torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                if "defaultdict" not in str(e) or not zipfile.is_zipfile(path):  # not PyG's cache of edge attributes
                    raise
        # the same weights-only unpickler, which also fills a defaultdict (see _defaultdict_pickle); zip files only
        with torch.serialization.safe_globals([*_pyg_safe_globals(), collections.defaultdict]):
            return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_defaultdict_pickle())
    except pickle.UnpicklingError as e:
        found = None if allow_pickle else re.search(r"\bGLOBAL (\S+)", str(e))
        if found is None:
            raise InputError(f"{path}: cannot load it with torch.load (not a file saved by torch.save, or torn); "
                             "save the graph with torch.save(data, path) where data is a torch_geometric.data.Data"
                             ) from None  # fmt: skip
        what = f"it names {found.group(1)}, which"
        raise InputError(
            f"{path}: not loaded: {what} is not a tensor, a plain container or a PyG data class, and unpickling "
            "it would run code from the file; convert it to a torch_geometric.data.Data, or pass --allow-pickle "
            "(allow_pickle=True) if you trust the file"
        ) from None
    except Exception as e:  # a torn or foreign file can raise almost anything
        raise InputError(
            f"{path}: cannot load it with torch.load ({type(e).__name__}: {e}); save the graph with "
            "torch.save(data, path) where data is a torch_geometric.data.Data"
        ) from None


def _first_graph(obj: Any, name: object) -> Any:
    """The ``Data`` of a loaded object: itself, the first of a tuple, or the first graph of a dataset."""
    if isinstance(obj, tuple) and obj and hasattr(obj[0], "edge_index"):
        obj = obj[0]
    if not hasattr(obj, "edge_index") and hasattr(obj, "__getitem__") and hasattr(obj, "__len__"):
        try:
            obj = obj[0]
        except Exception:
            pass
    if getattr(obj, "edge_index", None) is None or getattr(obj, "x", None) is None:
        raise InputError(f"{name}: holds a {type(obj).__name__} without edge_index and x; expected a PyG Data")
    return obj


def load_pyg_data(path: str | os.PathLike, *, allow_pickle: bool = False) -> Any:
    """Load a ``torch.save``'d PyG ``Data`` (or a dataset whose first graph is used).

    The file is read with ``torch.load(weights_only=True)``: tensors, plain
    containers and PyG's data classes only, so a crafted file cannot run code.
    ``allow_pickle=True`` unpickles anything (other classes of your own), which
    runs whatever code the file names: only for files you trust.
    """
    path = Path(path)
    return _first_graph(_torch_load(path, allow_pickle), path)
