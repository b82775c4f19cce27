"""Checking and converting what callers pass to a reader: ids, dtypes, destinations."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_ooc.data.format import FEATURE_DTYPES, feature_dtype_name
from lightning_ooc.errors import InputError

_INT64_MAX = np.iinfo(np.int64).max


def resolve_dtype(dtype: Any) -> tuple[str, torch.dtype, np.dtype]:
    """``(name, torch dtype, NumPy dtype holding the bytes)`` of a feature dtype given any way."""
    try:
        name = feature_dtype_name(dtype)
    except ValueError as e:
        raise InputError(str(e)) from None
    t, n = FEATURE_DTYPES[name]
    return name, t, n


def as_ids(ids: Any, *, copy: bool = False) -> np.ndarray:
    """Ids as a 1-D C-contiguous int64 array (shares memory with ``ids`` where it can, unless ``copy``)."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InputError(f"ids must be integers, got a {ids.dtype} tensor; convert them with .long()")
        if ids.dim() != 1:
            raise InputError(f"ids must be 1-D, got a tensor of shape {tuple(ids.shape)}; flatten it first")
        arr = ids.detach().to("cpu", torch.int64).contiguous().numpy()
    else:
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise InputError(f"ids must be 1-D, got shape {arr.shape}; pass a list, array or tensor of node ids")
        if arr.size == 0:
            return np.empty(0, dtype=np.int64)
        if arr.dtype.kind not in "iu":
            raise InputError(f"ids must be integers, got dtype {arr.dtype}; convert them with .astype(np.int64)")
        if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _INT64_MAX:
            raise InputError(f"id {int(arr.max())} does not fit in int64")
        arr = np.ascontiguousarray(arr, dtype=np.int64)
    return arr.copy() if copy else arr


@dataclass
class Destination:
    """Where a gather writes: the tensor handed back, the object to keep alive, its address and size."""

    tensor: torch.Tensor
    keep: Any
    address: int
    nbytes: int

    def numpy(self) -> np.ndarray:
        """The destination rows as a writable NumPy array of the stored byte dtype."""
        t = self.tensor
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()


def destination(
    out: Any, n: int, num_features: int, dtype: torch.dtype, numpy_dtype: np.dtype, path: Path, *,
    pin_memory: bool = False,
) -> Destination:
    """Check ``out`` (None, a CPU tensor or a NumPy array) and describe its first ``n`` rows."""
    row_bytes = num_features * numpy_dtype.itemsize
    if out is None:
        t = torch.empty((n, num_features), dtype=dtype, pin_memory=pin_memory)
        return Destination(t, t, t.data_ptr(), n * row_bytes)
    where = f"{path}: destination"
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu":
            raise InputError(
                f"{where} is on {out.device}; pass a CPU tensor (pinned or not) and copy it to the device, "
                "e.g. chunk by chunk with gather_async(...).chunks()"
            )
        if out.dtype != dtype:
            raise InputError(f"{where} has dtype {out.dtype} but the rows are {dtype}; allocate it with dtype={dtype}")
        if out.dim() != 2 or out.shape[1] != num_features:
            raise InputError(f"{where} has shape {tuple(out.shape)}; it must be (rows >= {n}, {num_features})")
        if out.shape[0] < n:
            raise InputError(f"{where} is too small: it has {out.shape[0]} rows and the gather needs {n}")
        view = out[:n]
        if not view.is_contiguous():
            raise InputError(f"{where} is not contiguous; pass a contiguous tensor (e.g. out.contiguous())")
        return Destination(view, out, view.data_ptr(), n * row_bytes)
    if isinstance(out, np.ndarray):
        if out.dtype != numpy_dtype:
            hint = " (bfloat16 rows are held as uint16 in NumPy)" if dtype == torch.bfloat16 else ""
            raise InputError(f"{where} has dtype {out.dtype} but the rows are {numpy_dtype}{hint}")
        if out.ndim != 2 or out.shape[1] != num_features:
            raise InputError(f"{where} has shape {out.shape}; it must be (rows >= {n}, {num_features})")
        if out.shape[0] < n:
            raise InputError(f"{where} is too small: it has {out.shape[0]} rows and the gather needs {n}")
        if not out.flags.writeable:
            raise InputError(f"{where} is read-only; pass a writable array")
        view = out[:n]
        if not view.flags.c_contiguous:
            raise InputError(f"{where} is not C-contiguous; pass np.ascontiguousarray(...) or a fresh np.empty")
        t = torch.from_numpy(view)
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return Destination(t, out, int(view.ctypes.data), n * row_bytes)
    raise InputError(f"{where} must be a torch.Tensor or a numpy.ndarray, not {type(out).__name__}")
