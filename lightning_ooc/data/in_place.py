"""Feature files used where they are: ``lightning-ooc prepare ... --features in-place``.

A dataset normally holds its own copy of the features (``features.bin``). A
user with terabytes of features in a ``.npy`` file (IGBH, MAG240M) cannot
afford a second copy, so an importer may instead record the user's file in
``meta.json``'s ``in_place`` section, keyed like ``files`` (``features``, or
``paper.features`` for a node type). The record holds the file's absolute path,
the offset of row 0 (after a ``.npy`` header: rarely a multiple of the disk
block), the rows, row size and dtype, the file's size and modification time,
a checksum of its first bytes (the header), a checksum of sampled blocks and a
checksum of the whole row range.

* :func:`check_in_place` runs whenever the dataset opens: the file must exist,
  be a regular file of the recorded size and modification time, and its header
  and sampled blocks must match. Anything else is a
  :class:`~lightning_ooc.errors.CorruptDatasetError` naming the file and the fix.
* :func:`verify_in_place` (``lightning-ooc verify``) checksums every byte.

This is the only place a dataset may point outside its directory, and only
where the user asked for it; every other file of a dataset is a plain name in it.

Example::

    >>> import os, tempfile, numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "x.npy")
    >>> np.save(path, np.arange(12, dtype=np.float32).reshape(4, 3))
    >>> src = npy_rows(path)
    >>> src.offset, src.shape, src.dtype_name
    (128, (4, 3), 'float32')
    >>> rec = describe(src, progress=False)
    >>> check_in_place(rec, "features") == src.path
    True
    >>> rec["offset"], rec["num_rows"], rec["dtype"], rec["sample_blocks"]
    (128, 4, 'float32', 1)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from lightning_ooc.data.files import check_file
from lightning_ooc.data.format import FEATURE_DTYPES, checksum_file, feature_dtype_name, new_hasher, read_npy_header
from lightning_ooc.errors import CorruptDatasetError, DatasetNotFoundError, InputError

#: meta.json's section of files used in place, keyed like ``files``
IN_PLACE = "in_place"
#: bytes at the start of the file whose checksum is recorded (the ``.npy`` header and the first rows)
HEADER_BYTES = 4096
#: blocks checksummed at open, spread evenly over the rows
SAMPLE_BLOCKS = 64
SAMPLE_BLOCK_BYTES = 4096
_REIMPORT = ("the dataset uses it in place (`--features in-place`), so it must stay as it was imported; put the "
             "original file back, or import again (`lightning-ooc prepare ... --overwrite`)")


@dataclass(frozen=True)
class RowFile:
    """Rows of a row-major file: ``shape[0]`` rows of ``shape[1]`` values of ``dtype_name`` from byte ``offset``.

    A raw file with a header of its own, say 10 bytes, before float16 rows:

    >>> import os, tempfile, numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "rows.bin")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(b"0123456789" + np.ones((5, 3), np.float16).tobytes())
    >>> src = RowFile(Path(path), 10, (5, 3), "float16")
    >>> src.row_bytes, src.data_bytes, float(src.memmap().sum())
    (6, 30, 15.0)
    """

    path: Path
    offset: int
    shape: tuple[int, int]
    dtype_name: str

    @property
    def row_bytes(self) -> int:
        return self.shape[1] * FEATURE_DTYPES[self.dtype_name][1].itemsize

    @property
    def data_bytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def memmap(self) -> np.ndarray:
        """The rows, memory-mapped read-only (bfloat16 as uint16)."""
        np_dtype = FEATURE_DTYPES[self.dtype_name][1]
        if not self.shape[0]:
            return np.empty(self.shape, np_dtype)
        return np.memmap(self.path, dtype=np_dtype, mode="r", offset=self.offset, shape=self.shape)

    @property
    def dtype(self) -> Any:
        """The rows' dtype: NumPy's, torch's for bfloat16 (which NumPy lacks)."""
        return torch.bfloat16 if self.dtype_name == "bfloat16" else FEATURE_DTYPES[self.dtype_name][1]

    def blocks(self, rows: int) -> Iterator[Any]:
        """The rows in blocks of ``rows``, each read when it is asked for (bfloat16 blocks as tensors)."""
        mm = self.memmap()
        for s in range(0, self.shape[0], rows):
            b = np.array(mm[s : s + rows])
            yield torch.from_numpy(b).view(torch.bfloat16) if self.dtype_name == "bfloat16" else b


def npy_rows(path: str | os.PathLike, what: str = "feature matrix") -> RowFile:
    """The rows of a 2-D, C-ordered ``.npy`` file, from its header (nothing else is read)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            shape, fortran, dtype = read_npy_header(f)
            offset = f.tell()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (the {what})") from None
    except (ValueError, OSError, EOFError, SyntaxError) as e:
        raise InputError(f"{path}: not a readable .npy file ({e}); the {what} must be a .npy array") from None
    if fortran:
        raise InputError(f"{path}: a Fortran-ordered array; rows must be contiguous: save it with "
                         "np.save(path, np.ascontiguousarray(x))")  # fmt: skip
    if len(shape) != 2:
        raise InputError(f"{path}: the {what} must be 2-D (nodes x dim), got shape {tuple(shape)}")
    try:
        name = feature_dtype_name(dtype)
    except ValueError:
        raise InputError(f"{path}: dtype {dtype} cannot be read in place; expected one of "
                         f"{', '.join(FEATURE_DTYPES)}") from None  # fmt: skip
    if dtype.byteorder == ">":
        raise InputError(f"{path}: big-endian {dtype}; rows are read as stored, so they must be little-endian")
    src = RowFile(path.absolute(), int(offset), (int(shape[0]), int(shape[1])), name)
    size = path.stat().st_size
    if size < src.offset + src.data_bytes:
        raise InputError(f"{path}: {size} bytes, but its header promises {shape[0]} x {shape[1]} {name} rows from "
                         f"offset {offset} ({src.offset + src.data_bytes} bytes): the file is truncated")  # fmt: skip
    return src


def _pread_exact(fd: int, length: int, offset: int) -> bytes:
    out = bytearray()
    while len(out) < length:
        chunk = os.pread(fd, length - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _sample_offsets(offset: int, data_bytes: int) -> list[int]:
    """Where the sampled blocks lie: spread evenly over the rows, the first and the last block among them."""
    if data_bytes <= SAMPLE_BLOCK_BYTES:
        return [offset] if data_bytes else []
    span = data_bytes - SAMPLE_BLOCK_BYTES
    count = min(SAMPLE_BLOCKS, data_bytes // SAMPLE_BLOCK_BYTES)
    return [offset + span * k // max(1, count - 1) for k in range(count)]


def _fingerprint(path: Path, offset: int, data_bytes: int) -> tuple[str, str]:
    """Checksums of the file's first :data:`HEADER_BYTES` and of its sampled blocks."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = new_hasher()
        header.update(_pread_exact(fd, HEADER_BYTES, 0))
        sample = new_hasher()
        for at in _sample_offsets(offset, data_bytes):
            sample.update(_pread_exact(fd, min(SAMPLE_BLOCK_BYTES, data_bytes), at))
        return header.hexdigest(), sample.hexdigest()
    finally:
        os.close(fd)


def _range_checksum(path: Path, offset: int, length: int, progress: Any = None) -> str:
    """Checksum of bytes ``[offset, offset + length)`` of ``path`` (a whole file's when it is all of it)."""
    if offset == 0 and path.stat().st_size == length:
        return checksum_file(path, progress)
    h = new_hasher()
    chunk = 16 << 20
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = length
        while left:
            data = f.read(min(chunk, left))
            if not data:
                raise CorruptDatasetError(f"{path}: ends {left} bytes before the recorded rows do", path)
            h.update(data)
            left -= len(data)
            if progress is not None:
                progress.update(len(data))
    return h.hexdigest()


def describe(src: RowFile, progress: bool = True) -> dict[str, Any]:
    """The ``in_place`` record of ``src``; reads the whole row range once for its checksum."""
    from lightning_ooc.utils.progress import progress_bar  # lazy: data.format must not pull the progress bars in

    path = Path(os.path.realpath(src.path))  # the file itself, not a link to it
    st = path.stat()
    header, sample = _fingerprint(path, src.offset, src.data_bytes)
    with progress_bar(src.data_bytes, f"checksum {path.name} (used in place)", "B", progress) as bar:
        full = _range_checksum(path, src.offset, src.data_bytes, bar)
    st_after = path.stat()
    if (st_after.st_size, st_after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
        raise InputError(f"{path}: changed while it was being imported; import again once nothing writes to it")
    return {
        "path": str(path), "offset": src.offset, "num_rows": src.shape[0], "num_features": src.shape[1],
        "dtype": src.dtype_name, "row_bytes": src.row_bytes, "file_bytes": int(st.st_size),
        "mtime_ns": int(st.st_mtime_ns), "header_checksum": header, "sample_checksum": sample,
        "sample_blocks": len(_sample_offsets(src.offset, src.data_bytes)), "checksum": full,
    }  # fmt: skip


_RECORD_INTS = ("offset", "num_rows", "num_features", "row_bytes", "file_bytes", "mtime_ns", "sample_blocks")


def check_record(key: str, rec: Any, bad: Any) -> None:
    """An ``in_place`` record of meta.json has every field, of its type (``bad(text)`` makes the error)."""
    if not isinstance(rec, dict):
        raise bad(f"in_place.{key} must be an object, got {rec!r}")
    if not isinstance(rec.get("path"), str) or not os.path.isabs(rec["path"]) or "\0" in rec["path"]:
        raise bad(f"in_place.{key}.path must be an absolute path, got {rec.get('path')!r}")
    for k in _RECORD_INTS:
        v = rec.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise bad(f"in_place.{key}.{k} must be an integer >= 0, got {v!r}")
    if rec.get("dtype") not in FEATURE_DTYPES:
        raise bad(f"in_place.{key}.dtype must be one of {', '.join(FEATURE_DTYPES)}, got {rec.get('dtype')!r}")
    if rec["row_bytes"] != rec["num_features"] * FEATURE_DTYPES[rec["dtype"]][1].itemsize:
        raise bad(f"in_place.{key}: row_bytes={rec['row_bytes']} is not {rec['num_features']} x {rec['dtype']}")
    if rec["offset"] + rec["num_rows"] * rec["row_bytes"] > rec["file_bytes"]:
        raise bad(f"in_place.{key}: its rows end past the recorded file size {rec['file_bytes']}")
    for k in ("header_checksum", "sample_checksum", "checksum"):
        if not isinstance(rec.get(k), str):
            raise bad(f"in_place.{key}.{k} must be a string, got {rec.get(k)!r}")


def check_in_place(rec: dict[str, Any], key: str) -> Path:
    """The file of an ``in_place`` record, checked as it is at open (size, time, header, sampled blocks).

    Returns its path; raises a :class:`~lightning_ooc.errors.DatasetError` naming it otherwise.
    """
    path = Path(rec["path"])
    what = f"{path} (the {key} file)"
    if path.is_symlink():
        raise CorruptDatasetError(f"{what}: now a symbolic link (to {os.readlink(path)}); {_REIMPORT}", path)
    if not path.exists():
        raise DatasetNotFoundError(f"{what}: no such file (moved or deleted?); {_REIMPORT}", path)
    if not path.is_file():
        raise CorruptDatasetError(f"{what}: not a regular file; {_REIMPORT}", path)
    st = path.stat()
    if st.st_size != rec["file_bytes"]:
        how = "shorter (truncated?)" if st.st_size < rec["file_bytes"] else "longer"
        raise CorruptDatasetError(f"{what}: {st.st_size} bytes, {how} than the {rec['file_bytes']} recorded at "
                                  f"import; {_REIMPORT}", path)  # fmt: skip
    if st.st_mtime_ns != rec["mtime_ns"]:
        raise CorruptDatasetError(f"{what}: modified after import (its modification time changed); {_REIMPORT}",
                                  path)  # fmt: skip
    header, sample = _fingerprint(path, rec["offset"], rec["num_rows"] * rec["row_bytes"])
    if header != rec["header_checksum"]:
        raise CorruptDatasetError(f"{what}: its first {HEADER_BYTES} bytes (the header) differ from those imported; "
                                  f"{_REIMPORT}", path)  # fmt: skip
    if sample != rec["sample_checksum"]:
        raise CorruptDatasetError(f"{what}: its rows differ from those imported (a sampled block changed); "
                                  f"{_REIMPORT}", path)  # fmt: skip
    return path


def verify_in_place(rec: dict[str, Any], key: str, progress: Any = None) -> tuple[bool, str]:
    """Checksum every row byte of an ``in_place`` file: ``(ok, detail)``; never raises on a bad file."""
    try:
        path = check_in_place(rec, key)
        digest = _range_checksum(path, rec["offset"], rec["num_rows"] * rec["row_bytes"], progress)
    except (CorruptDatasetError, DatasetNotFoundError, OSError) as e:
        return False, str(e)
    if digest != rec["checksum"]:
        return False, f"{rec['path']}: checksum {digest} differs from the {rec['checksum']} recorded at import"
    return True, f"used in place: {rec['path']} (offset {rec['offset']}), size, time and checksum match"


def read_amplification(offset: int, row_bytes: int, block: int) -> float:
    """Bytes a direct read of one row costs per row byte, averaged over rows: the aligned extent around each row.

    Rows at an offset that is not a multiple of ``block`` straddle one more block more often.

    >>> read_amplification(0, 4096, 4096), read_amplification(128, 4096, 4096)
    (1.0, 2.0)
    """
    if row_bytes <= 0 or block <= 1:
        return 1.0
    period = block // math.gcd(row_bytes, block)  # row starts repeat modulo block after this many rows
    total = 0
    for i in range(period):
        start = offset + i * row_bytes
        end = start + row_bytes
        total += -(-end // block) * block - start // block * block
    return total / (period * row_bytes)




def feature_file(root: Path, meta: dict[str, Any], key: str, num_rows: int, row_bytes: int,
                 dtype_name: str) -> tuple[Path, int]:  # fmt: skip
    """``(path, offset of row 0)`` of the feature file of ``files`` key ``key``, checked: the dataset's own
    ``features.bin`` (its size), or a file used in place (as :func:`check_in_place` says, and its rows,
    row size and dtype those of the dataset)."""
    rec = meta.get(IN_PLACE, {}).get(key)
    if rec is None:
        check_file(root, meta, key, None, (num_rows, row_bytes))
        return root / meta["files"][key]["name"], 0
    got = (rec["num_rows"], rec["row_bytes"], rec["dtype"])
    if got != (num_rows, row_bytes, dtype_name):
        raise CorruptDatasetError(f"{root / 'meta.json'}: in_place.{key} records {got[0]} rows of {got[1]} bytes "
                                  f"({got[2]}), the dataset {num_rows} rows of {row_bytes} bytes ({dtype_name}); "
                                  "import it again", root)  # fmt: skip
    return check_in_place(rec, key), int(rec["offset"])


__all__ = ["IN_PLACE", "RowFile", "npy_rows", "describe", "check_record", "check_in_place", "verify_in_place",
           "read_amplification", "feature_file"]
