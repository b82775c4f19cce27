"""Checks of a dataset's files that every reader shares: a file entry of ``meta.json``, a file against its
entry, a CSC ``indptr`` file, a class count against the node count.

>>> is_int(3), is_int(True)
(True, False)
>>> too_many_classes(10, 100) is None
True
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from lightning_ooc.data.format import META_FILE, NEIGHBOR_ORDERS, read_npy_header
from lightning_ooc.errors import CorruptDatasetError, DatasetNotFoundError, InputError

REBUILD = "rebuild it with `lightning-ooc prepare` / `lightning-ooc synth`, or restore it from a copy"
_REBUILD = REBUILD
_INDPTR_CHECK_CHUNK = 1 << 24


def not_a_file(path: str | os.PathLike) -> str | None:
    """What ``path`` is where it is not a regular file to read (links followed), without opening it: ``"missing"``
    where nothing is there, else what is there (a symbolic link loop, a FIFO, a device, a directory...); None for
    a regular file.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> os.symlink(os.path.join(d, "b"), os.path.join(d, "a"))
    >>> os.symlink(os.path.join(d, "a"), os.path.join(d, "b"))
    >>> not_a_file(d), not_a_file(os.path.join(d, "a")), not_a_file("/dev/null"), not_a_file(os.path.join(d, "c"))
    ('a directory', 'a symbolic link loop', 'a character device', 'missing')
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            return f"a symbolic link to {os.readlink(path)}, which does not exist"
        return "missing"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        if e.errno == errno.ENOTDIR:
            return "missing (a directory on its path is a file)"
        return f"not readable ({e.strerror})"
    if stat.S_ISREG(st.st_mode):
        return None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(st.st_mode)), "not a regular file")


def input_file(path: str | os.PathLike, what: str, missing: str | None = None) -> Path:
    """``path`` if it is a regular file (links followed), else an InputError naming it and ``what`` it should hold:
    ``missing`` (the whole message) where nothing is there, else what is there and what to give instead; nothing is
    opened, so a FIFO never blocks.

    >>> input_file("/dev/zero", "the features")
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.InputError: /dev/zero: a character device, not a regular file (the features); give a file
    """
    path = Path(path)
    why = not_a_file(path)
    if why is None:
        return path
    if why == "missing" and missing is not None:
        raise InputError(missing)
    if why == "a symbolic link loop":
        raise InputError(f"{path}: a symbolic link loop ({what}): its links lead back to themselves; give the file "
                         "itself")  # fmt: skip
    if why.startswith(("missing", "a symbolic link to", "not readable")):
        raise InputError(f"{path}: {why} ({what})")
    if why.startswith("a FIFO"):
        raise InputError(f"{path}: {why}, not a regular file ({what}); it is read at offsets and more than once: save "
                         "what the pipe carries to a file and give that")  # fmt: skip
    raise InputError(f"{path}: {why}, not a regular file ({what}); give a file")


def _npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype, int]:
    """Shape, dtype and data offset of a ``.npy`` file, or a CorruptDatasetError naming it."""
    try:
        with open(path, "rb") as f:
            shape, fortran, dtype = read_npy_header(f)
            offset = f.tell()
    except (ValueError, OSError, SyntaxError, EOFError) as e:
        raise CorruptDatasetError(f"{path}: not a readable .npy file ({e}); {_REBUILD}", path) from None
    if fortran:
        raise CorruptDatasetError(f"{path}: Fortran-ordered array; {_REBUILD}", path)
    return shape, dtype, offset


def check_file(
    root: Path,
    meta: dict[str, Any],
    key: str,
    want: tuple[tuple[np.dtype, ...], tuple[int, ...]] | None,
    raw: tuple[int, int] = (0, 0),
) -> None:
    """The file of ``key`` is a regular file of the recorded size, with the ``.npy`` header ``want``
    (``want=None``: a raw feature file of ``raw = (rows, row_bytes)``); else a DatasetError naming it."""
    if key not in meta["files"]:
        raise CorruptDatasetError(f"{root / META_FILE}: no entry for the {key!r} file; {_REBUILD}", root)
    entry = meta["files"][key]
    path = root / entry["name"]
    if path.is_symlink():
        raise CorruptDatasetError(f"{path}: a symbolic link (to {os.readlink(path)}); a dataset holds its own "
                                  f"regular files; {_REBUILD}", path)  # fmt: skip
    if path.exists() and not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file"
        raise CorruptDatasetError(f"{path}: {what}; {_REBUILD}", path)
    if not path.is_file():
        raise DatasetNotFoundError(f"{path}: missing from the dataset; {_REBUILD}", path)
    size = path.stat().st_size
    if size != int(entry["bytes"]):
        what = "truncated" if size < int(entry["bytes"]) else "longer than recorded"
        raise CorruptDatasetError(
            f"{path}: {size} bytes on disk but meta.json records {entry['bytes']} ({what}); {_REBUILD}", path
        )
    if want is None:  # a feature file
        rows, row_bytes = raw
        expect = rows * row_bytes
        if size != expect:
            raise CorruptDatasetError(
                f"{path}: {size} bytes but {rows} rows x {row_bytes} bytes = {expect}; {_REBUILD}", path
            )
        return
    shape, dtype, _ = _npy_header(path)
    want_dtypes, want_shape = want
    if dtype not in want_dtypes or tuple(shape) != want_shape:
        says = " or ".join(map(str, want_dtypes))
        raise CorruptDatasetError(
            f"{path}: holds {dtype}{list(shape)} but meta.json says {says}{list(want_shape)}; {_REBUILD}", path
        )


def load_indptr(path: Path, num_edges: int, out: np.ndarray | None = None) -> np.ndarray:
    """Load a CSC ``indptr`` file (into ``out`` when given), checked to run from 0 to ``num_edges`` without
    decreasing, one chunk at a time; read-only unless ``out`` was given."""
    src = np.load(path, mmap_mode="r")
    indptr = np.empty(src.shape, np.int64) if out is None else out
    if src[0] != 0 or src[-1] != num_edges:
        raise CorruptDatasetError(
            f"{path}: starts at {src[0]} and ends at {src[-1]}; expected 0 and num_edges={num_edges}; {_REBUILD}",
            path,
        )
    for start in range(0, len(src) - 1, _INDPTR_CHECK_CHUNK):
        part = indptr[start : start + _INDPTR_CHECK_CHUNK + 1]
        part[:] = src[start : start + _INDPTR_CHECK_CHUNK + 1]
        bad = np.flatnonzero(part[1:] < part[:-1])
        if bad.size:
            v = start + int(bad[0])
            raise CorruptDatasetError(
                f"{path}: not monotone (indptr[{v + 1}]={part[bad[0] + 1]} < indptr[{v}]={part[bad[0]]}); {_REBUILD}",
                path,
            )
    if len(src) == 1:
        indptr[:] = src
    if out is None:
        indptr.flags.writeable = False
    return indptr


#: num_classes may exceed the node count up to this (a small graph whose labels are a big one's classes)
_CLASSES_FLOOR = 1 << 16


def too_many_classes(num_classes: int, num_nodes: int) -> str | None:
    """Why ``num_classes`` is absurd for ``num_nodes`` nodes (the class histogram of ``info`` and a model's
    output layer are that wide), or None."""
    if num_classes <= max(num_nodes, _CLASSES_FLOOR):
        return None
    return (f"num_classes={num_classes} is absurd for {num_nodes} nodes: it may be at most the node count or "
            f"{_CLASSES_FLOOR} (the class histogram and a model's output layer are as wide as it)")  # fmt: skip


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_entry(key: str, entry: Any, bad: Any, need_length: bool) -> None:
    """A ``files`` entry of meta.json: a plain file name, its size, its length where the file has one."""
    if entry is None:
        raise bad(f"no entry for the {key!r} file")
    if not isinstance(entry, dict):
        raise bad(f"the {key!r} file's entry must be an object with 'name' and 'bytes', got {entry!r}")
    name = entry.get("name")
    if not isinstance(name, str) or name in ("", ".", "..") or name != os.path.basename(name) \
            or "\\" in name or "\0" in name:  # fmt: skip
        raise bad(f"the {key!r} file's name must be a plain file name inside the dataset directory, "
                  f"got {name!r}")  # fmt: skip
    if not is_int(entry.get("bytes")) or entry["bytes"] < 0:
        raise bad(f"the {key!r} file's 'bytes' must be an integer >= 0, got {entry.get('bytes')!r}")
    if need_length and not (is_int(entry.get("length")) and entry["length"] >= 0):
        raise bad(f"the {key!r} file's 'length' must be an integer >= 0, got {entry.get('length')!r}")
    if "checksum" in entry and not isinstance(entry["checksum"], str):
        raise bad(f"the {key!r} file's checksum must be a string, got {entry['checksum']!r}")


def check_neighbor_order(order: Any, files: dict[str, Any], prefix: str, bad: Any, node_prefix: str | None = None) -> None:
    """A ``neighbor_order`` entry: one of :data:`NEIGHBOR_ORDERS`, with the time file it sorts by present.

    ``prefix`` is the file prefix of the CSC (a relation's), ``node_prefix`` that of its source node type.
    """
    if order is None:
        return
    if order not in NEIGHBOR_ORDERS:
        raise bad(f"neighbor_order must be one of {list(NEIGHBOR_ORDERS)}, got {order!r}")
    need = {"edge_time": prefix + "edge_time", "node_time": (prefix if node_prefix is None else node_prefix)
            + "node_time"}.get(order)  # fmt: skip
    if need is not None and need not in files:
        raise bad(f"neighbor_order is {order!r} but there is no {need} file to order by")
