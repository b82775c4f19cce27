"""Feature files used where they are: ``lightning-ooc prepare ... --features in-place``.

A dataset normally holds its own copy of the features (``features.bin``). A
user with terabytes of features in a ``.npy`` file (IGBH, MAG240M) cannot
afford a second copy, so an importer may instead record the user's file in
``meta.json``'s ``in_place`` section, keyed like ``files`` (``features``, or
``paper.features`` for a node type). The record holds the file's absolute path,
the offset of row 0 (after a ``.npy`` header: rarely a multiple of the disk
block), the rows, row size and dtype, the file's size, modification time and
identity (device and inode), a checksum of its first bytes (the header), a
checksum of sampled blocks and a checksum of the whole row range.

* :func:`check_in_place` runs whenever the dataset opens. It opens the file
  once and checks that descriptor: a regular file of the recorded size, inode
  and modification time, whose header and sampled blocks match. Anything else
  is a :class:`~lightning_ooc.errors.CorruptDatasetError` naming the file and
  the fix. It returns a path to *that descriptor* (``/proc/PID/fd/N``, the
  descriptor held open for the life of the process), so every reader that
  opens the returned path (``O_DIRECT`` included) opens the checked file, even
  if another file is put at the recorded path later (see :func:`check_in_place`).
* :func:`verify_in_place` (``lightning-ooc verify --full``) checksums every byte.
* :func:`accept_in_place` (``lightning-ooc verify --full --accept``): a file
  whose time or identity changed (a copy without ``-p``, ``touch``, a restore)
  but whose every row byte matches the recorded checksum gets a record with
  its new time and identity.

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
    >>> os.path.samefile(check_in_place(rec, "features"), src.path)
    True
    >>> rec["offset"], rec["num_rows"], rec["dtype"], rec["sample_blocks"], rec["inode"] == os.stat(path).st_ino
    (128, 4, 'float32', 1, True)
"""
from __future__ import annotations

import datetime
import errno
import math
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from lightning_ooc.data.files import check_file, input_file
from lightning_ooc.data.format import FEATURE_DTYPES, feature_dtype_name, new_hasher, read_npy_header
from lightning_ooc.errors import CorruptDatasetError, DatasetError, DatasetNotFoundError, InputError

#: meta.json's section of files used in place, keyed like ``files``
IN_PLACE = "in_place"
#: bytes at the start of the file whose checksum is recorded (the ``.npy`` header and the first rows)
HEADER_BYTES = 4096
#: blocks checksummed at open, spread evenly over the rows
SAMPLE_BLOCKS = 64
SAMPLE_BLOCK_BYTES = 4096
#: the file's identity (``st_dev``, ``st_ino``); records written before it was recorded lack them and are checked
#: without them
IDENTITY_FIELDS = ("device", "inode")
#: bytes read at a time for a whole checksum
_CHUNK = 16 << 20
#: no link followed, no FIFO waited for (a regular file reads as without O_NONBLOCK)
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_REIMPORT = ("the dataset uses it in place (`--features in-place`), so it must stay as it was imported; put the "
             "original file back, or import again (`lightning-ooc prepare ... --overwrite`)")
_NOT_ACCEPTED = "not accepted: meta.json is unchanged"


def _accept_fix(root: Path | None) -> str:
    """The fixes for a file whose modification time or identity changed: accept it if its bytes did not, or the
    usual ones."""
    where = str(root) if root is not None else "DIR"
    return ("the dataset uses it in place (`--features in-place`), so it must stay as it was imported; if its bytes "
            f"are still those imported (a copy without -p, `touch`, a restore), `lightning-ooc verify --full --accept "
            f"{where}` checksums every row byte and accepts it when they match; else put the original file back, or "
            "import again (`lightning-ooc prepare ... --overwrite`)")  # fmt: skip


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

    A message names it by its file: ``str(src)`` is its path (``name``).

    >>> f"{src}" == path == src.name
    True
    """

    path: Path
    offset: int
    shape: tuple[int, int]
    dtype_name: str

    @property
    def name(self) -> str:
        """What a message calls these rows: the file's path."""
        return str(self.path)

    def __str__(self) -> str:
        return self.name

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
    path = input_file(path, f"the {what}", missing=f"{path}: no such file (the {what})")
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


def fingerprint(fd: int, offset: int, data_bytes: int) -> tuple[str, str]:
    """Checksums of the first :data:`HEADER_BYTES` of the file open as ``fd`` and of its sampled blocks."""
    header = new_hasher()
    header.update(_pread_exact(fd, HEADER_BYTES, 0))
    sample = new_hasher()
    for at in _sample_offsets(offset, data_bytes):
        sample.update(_pread_exact(fd, min(SAMPLE_BLOCK_BYTES, data_bytes), at))
    return header.hexdigest(), sample.hexdigest()


def _range_checksum(fd: int, offset: int, length: int, path: Path, progress: Any = None) -> str:
    """Checksum of bytes ``[offset, offset + length)`` of the file open as ``fd`` (``path``: its name, for errors);
    a whole file's, as :func:`~lightning_ooc.data.format.checksum_file` gives, when it is all of it."""
    h = new_hasher()
    at, end = offset, offset + length
    while at < end:
        data = os.pread(fd, min(_CHUNK, end - at), at)
        if not data:
            raise CorruptDatasetError(f"{path}: ends {end - at} bytes before the recorded rows do", path)
        h.update(data)
        at += len(data)
        if progress is not None:
            progress.update(len(data))
    return h.hexdigest()


def _stat(path: Path) -> os.stat_result | None:
    """``path``'s own status (a link not followed), or None where nothing is there."""
    try:
        return os.stat(path, follow_symlinks=False)
    except OSError:
        return None


def _unchanged(path: Path, before: os.stat_result, after: os.stat_result) -> bool:
    """Whether the file read through one descriptor kept its size and time from ``before`` to ``after``, and
    ``path`` still names it."""
    now = _stat(path)
    return (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns) and now is not None and \
        os.path.samestat(now, after)  # fmt: skip


def describe(src: RowFile, progress: bool = True) -> dict[str, Any]:
    """The ``in_place`` record of ``src``; reads the whole row range once for its checksum."""
    from lightning_ooc.utils.progress import progress_bar  # lazy: data.format must not pull the progress bars in

    path = Path(os.path.realpath(src.path))  # the file itself, not a link to it
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:  # one descriptor for every read: the record describes one file, whatever is put at the path meanwhile
        st = os.fstat(fd)
        header, sample = fingerprint(fd, src.offset, src.data_bytes)
        with progress_bar(src.data_bytes, f"checksum {path.name} (used in place)", "B", progress) as bar:
            full = _range_checksum(fd, src.offset, src.data_bytes, path, bar)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if not _unchanged(path, st, after):
        raise InputError(f"{path}: changed while it was being imported; import again once nothing writes to it")
    return {
        "path": str(path), "offset": src.offset, "num_rows": src.shape[0], "num_features": src.shape[1],
        "dtype": src.dtype_name, "row_bytes": src.row_bytes, "file_bytes": int(st.st_size),
        "mtime_ns": int(st.st_mtime_ns), "device": int(st.st_dev), "inode": int(st.st_ino),
        "header_checksum": header, "sample_checksum": sample,
        "sample_blocks": len(_sample_offsets(src.offset, src.data_bytes)), "checksum": full,
    }  # fmt: skip


_RECORD_INTS = ("offset", "num_rows", "num_features", "row_bytes", "file_bytes", "mtime_ns", "sample_blocks")


def _non_negative_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_record(key: str, rec: Any, bad: Any) -> None:
    """An ``in_place`` record of meta.json has every field, of its type (``bad(text)`` makes the error); the
    identity (:data:`IDENTITY_FIELDS`) may be absent (a record written before it was recorded)."""
    if not isinstance(rec, dict):
        raise bad(f"in_place.{key} must be an object, got {rec!r}")
    if not isinstance(rec.get("path"), str) or not os.path.isabs(rec["path"]) or "\0" in rec["path"]:
        raise bad(f"in_place.{key}.path must be an absolute path, got {rec.get('path')!r}")
    for k in _RECORD_INTS:
        if not _non_negative_int(rec.get(k)):
            raise bad(f"in_place.{key}.{k} must be an integer >= 0, got {rec.get(k)!r}")
    for k in IDENTITY_FIELDS:
        if k in rec and not _non_negative_int(rec[k]):
            raise bad(f"in_place.{key}.{k} must be an integer >= 0 where present, got {rec[k]!r}")
    if rec.get("dtype") not in FEATURE_DTYPES:
        raise bad(f"in_place.{key}.dtype must be one of {', '.join(FEATURE_DTYPES)}, got {rec.get('dtype')!r}")
    if rec["row_bytes"] != rec["num_features"] * FEATURE_DTYPES[rec["dtype"]][1].itemsize:
        raise bad(f"in_place.{key}: row_bytes={rec['row_bytes']} is not {rec['num_features']} x {rec['dtype']}")
    if rec["offset"] + rec["num_rows"] * rec["row_bytes"] > rec["file_bytes"]:
        raise bad(f"in_place.{key}: its rows end past the recorded file size {rec['file_bytes']}")
    for k in ("header_checksum", "sample_checksum", "checksum"):
        if not isinstance(rec.get(k), str):
            raise bad(f"in_place.{key}.{k} must be a string, got {rec.get(k)!r}")


# -- the checks ----------------------------------------------------------------------------------------------------
def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _open(path: Path, what: str) -> tuple[int, os.stat_result]:
    """``path`` opened read-only, and the status of that descriptor: a regular file, else a DatasetError."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise DatasetNotFoundError(f"{what}: no such file (moved or deleted?); {_REIMPORT}", path) from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
            raise CorruptDatasetError(f"{what}: now a symbolic link (to {_readlink(path)}); {_REIMPORT}", path) from None
        if e.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a socket
            raise CorruptDatasetError(f"{what}: not a regular file; {_REIMPORT}", path) from None
        raise DatasetError(f"{what}: cannot be opened ({e.strerror}); check its permissions", path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptDatasetError(f"{what}: not a regular file; {_REIMPORT}", path)
    return fd, st


def _check_stat(st: os.stat_result, rec: dict[str, Any], what: str, path: Path, root: Path | None,
                times: bool = True) -> None:  # fmt: skip
    """The size, and with ``times`` the inode and modification time, of the opened file against the record.

    The device number is recorded but not compared: network and virtual file systems (NFS, btrfs, ZFS, overlay)
    get a new one at every mount, while the inode, the size, the time and the sampled blocks stay.
    """
    if st.st_size != rec["file_bytes"]:
        how = "shorter (truncated?)" if st.st_size < rec["file_bytes"] else "longer"
        raise CorruptDatasetError(f"{what}: {st.st_size} bytes, {how} than the {rec['file_bytes']} recorded at "
                                  f"import; {_REIMPORT}", path)  # fmt: skip
    if not times:
        return
    inode = rec.get("inode")
    if inode is not None and st.st_ino != inode:
        raise CorruptDatasetError(f"{what}: another file than the one imported (inode {st.st_ino}, {inode} at "
                                  "import: a copy, a restore or a sync put a new file at its path, maybe with the "
                                  f"same size and time); {_accept_fix(root)}", path)  # fmt: skip
    if st.st_mtime_ns != rec["mtime_ns"]:
        raise CorruptDatasetError(f"{what}: modified after import (its modification time changed); "
                                  f"{_accept_fix(root)}", path)  # fmt: skip


def _check_content(fd: int, rec: dict[str, Any], what: str, path: Path) -> None:
    """The header and the sampled blocks of the opened file against the record."""
    header, sample = fingerprint(fd, rec["offset"], rec["num_rows"] * rec["row_bytes"])
    if header != rec["header_checksum"]:
        raise CorruptDatasetError(f"{what}: its first {HEADER_BYTES} bytes (the header) differ from those imported; "
                                  f"{_REIMPORT}", path)  # fmt: skip
    if sample != rec["sample_checksum"]:
        raise CorruptDatasetError(f"{what}: its rows differ from those imported (a sampled block changed); "
                                  f"{_REIMPORT}", path)  # fmt: skip


def _open_checked(rec: dict[str, Any], key: str, root: str | os.PathLike | None) -> tuple[Path, str, int, Any]:
    """``(path, what, fd, status)`` of the file of ``rec``, opened once and checked through that descriptor as
    every open checks it (size, inode, time, header, sampled blocks); the caller closes ``fd``."""
    path = Path(rec["path"])
    what = f"{path} (the {key} file)"
    fd, st = _open(path, what)
    try:
        _check_stat(st, rec, what, path, None if root is None else Path(root))
        _check_content(fd, rec, what, path)
    except BaseException:
        os.close(fd)
        raise
    return path, what, fd, st


# -- the checked file, held open -------------------------------------------------------------------------------
#: descriptors of the checked files, by (device, inode): held open for the life of the process (and inherited by
#: forked children), so the path :func:`check_in_place` returns for one always opens it. A file's descriptor is
#: opened once per process however often its datasets open; it keeps a replaced or removed file's blocks allocated
#: until the process exits.
_PINNED: dict[tuple[int, int], int] = {}
#: the recorded path of the file each path :func:`check_in_place` returned opens (what messages name it by)
_RECORDED: dict[str, Path] = {}
_PIN_LOCK = threading.Lock()


def _new_lock() -> None:  # a fork while another thread held the lock must not leave it held in the child
    global _PIN_LOCK
    _PIN_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock)


def _fd_path(fd: int) -> Path | None:
    """A path that opens the file open as ``fd``: ``/proc/PID/fd/N`` (Linux), or None where there is none.

    The process id rather than ``self``: the path opens the same file in a forked child and in a process started
    with spawn that is handed it, as long as this process runs.
    """
    via = Path(f"/proc/{os.getpid()}/fd/{fd}")
    try:
        return via if os.path.samestat(os.stat(via), os.fstat(fd)) else None
    except OSError:
        return None


def _pin(fd: int, st: os.stat_result, path: Path, what: str) -> Path:
    """A path that opens the file checked through ``fd`` (which this takes over)."""
    key = (st.st_dev, st.st_ino)
    with _PIN_LOCK:
        held = _PINNED.get(key)
        if held is not None:
            try:
                same = os.path.samestat(os.fstat(held), st)
            except OSError:
                same = False
            if same:  # the same file, held since an earlier check: one descriptor per file
                os.close(fd)
                fd = held
            else:  # closed behind our back (its number may name another file now: leave it alone)
                del _PINNED[key]
                held = None
        via = _fd_path(fd)
        if via is not None:
            _PINNED[key] = fd
            _RECORDED[str(via)] = path
            return via
    # no /proc: the path itself, if it still names the checked file (a file put there later is not seen)
    if fd != held:  # one held already stays held: paths to it may have been handed out
        os.close(fd)
    now = _stat(path)
    if now is None or not os.path.samestat(now, st):
        raise CorruptDatasetError(f"{what}: replaced while it was being checked; {_REIMPORT}", path)
    return path


def recorded_path(path: str | os.PathLike) -> Path:
    """The path a message names the file at ``path`` by: for a path :func:`check_in_place` returned (the held
    descriptor ``/proc/PID/fd/N``), the recorded path of the file it opens (the user's file); else ``path``.

    >>> import os, tempfile, numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "x.npy")
    >>> np.save(path, np.ones((4, 3), np.float32))
    >>> via = check_in_place(describe(npy_rows(path), progress=False), "features")
    >>> str(via).startswith("/proc/"), recorded_path(via) == Path(os.path.realpath(path))
    (True, True)
    >>> recorded_path("/data/features.bin")
    PosixPath('/data/features.bin')
    """
    return _RECORDED.get(os.fspath(path), Path(path))


def check_in_place(rec: dict[str, Any], key: str, root: str | os.PathLike | None = None) -> Path:
    """The file of an ``in_place`` record, checked as it is at open: a path the readers open it by.

    The file at the recorded path is opened once (read-only, links not followed) and that descriptor is checked:
    a regular file of the recorded size, inode (where recorded) and modification time, whose header and sampled
    blocks match. The path returned opens that same file: ``/proc/PID/fd/N``, the descriptor held open for the life
    of the process, so a reader that opens it (with ``O_DIRECT`` too) reads the checked file even if another file is
    put at the recorded path after the check. Where there is no ``/proc`` (not Linux) it is the recorded path,
    once a fresh look at it finds the checked file there.

    Raises a :class:`~lightning_ooc.errors.DatasetError` naming the file otherwise; a changed time or inode names
    ``lightning-ooc verify --full --accept ROOT`` (``root``: the dataset directory) among the fixes.
    """
    path, what, fd, st = _open_checked(rec, key, root)
    return _pin(fd, st, path, what)


def verify_in_place(rec: dict[str, Any], key: str, progress: Any = None,
                    root: str | os.PathLike | None = None) -> tuple[bool, str]:  # fmt: skip
    """Checksum every row byte of an ``in_place`` file (after the checks of every open, on the same descriptor):
    ``(ok, detail)``; never raises on a bad file."""
    try:
        path, what, fd, _ = _open_checked(rec, key, root)
    except (DatasetError, OSError) as e:
        return False, str(e)
    try:
        digest = _range_checksum(fd, rec["offset"], rec["num_rows"] * rec["row_bytes"], path, progress)
    except (DatasetError, OSError) as e:
        return False, str(e)
    finally:
        os.close(fd)
    if digest != rec["checksum"]:
        return False, f"{rec['path']}: checksum {digest} differs from the {rec['checksum']} recorded at import"
    return True, f"used in place: {rec['path']} (offset {rec['offset']}), size, time and checksum match"


def _when(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9).isoformat(sep=" ", timespec="microseconds")


def _changes(st: os.stat_result, rec: dict[str, Any]) -> list[str]:
    """What the record says of the file's time and identity that is no longer so (or not recorded)."""
    out = []
    if st.st_mtime_ns != rec["mtime_ns"]:
        out.append(f"modification time {_when(rec['mtime_ns'])} -> {_when(st.st_mtime_ns)}")
    if any(k not in rec for k in IDENTITY_FIELDS):
        out.append(f"identity (device {st.st_dev}, inode {st.st_ino}) recorded")
    else:
        if st.st_ino != rec["inode"]:
            out.append(f"inode {rec['inode']} -> {st.st_ino}")
        if st.st_dev != rec["device"]:
            out.append(f"device {rec['device']} -> {st.st_dev}")
    return out


def accept_in_place(rec: dict[str, Any], key: str, progress: Any = None,
                    root: str | os.PathLike | None = None) -> tuple[bool, str, dict[str, Any] | None]:  # fmt: skip
    """``lightning-ooc verify --full --accept``'s check of an ``in_place`` file: ``(ok, detail, new record)``;
    never raises on a bad file.

    The file must have the recorded size, header and checksum of every row byte, read through one descriptor.
    Where its modification time or identity is not the recorded one (a copy without ``-p``, ``touch``, a
    restore), or the record has no identity yet, the new record (the third item) holds them as they are now; else
    it is None. A file that does not match gives ``(False, why, None)``: nothing is to be changed.

    >>> import os, tempfile, numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "x.npy")
    >>> np.save(path, np.ones((4, 3), np.float32))
    >>> rec = describe(npy_rows(path), progress=False)
    >>> os.utime(path, ns=(0, rec["mtime_ns"] + 10**9))  # `touch`: the same bytes, a new time
    >>> ok, detail, new = accept_in_place(rec, "features")
    >>> ok, new["mtime_ns"] - rec["mtime_ns"], "every row byte matches the checksum recorded at import" in detail
    (True, 1000000000, True)
    >>> accept_in_place(new, "features")[::2]
    (True, None)
    """
    path = Path(rec["path"])
    what = f"{path} (the {key} file)"
    try:
        fd, st = _open(path, what)
    except DatasetError as e:
        return False, f"{e} ({_NOT_ACCEPTED})", None
    try:
        _check_stat(st, rec, what, path, None if root is None else Path(root), times=False)
        header, sample = fingerprint(fd, rec["offset"], rec["num_rows"] * rec["row_bytes"])
        if header != rec["header_checksum"]:
            return False, (f"{what}: its first {HEADER_BYTES} bytes (the header) differ from those imported; "
                           f"{_NOT_ACCEPTED}; {_REIMPORT}"), None  # fmt: skip
        digest = None
        if sample == rec["sample_checksum"]:  # else the checksum cannot match: no need to read it all
            digest = _range_checksum(fd, rec["offset"], rec["num_rows"] * rec["row_bytes"], path, progress)
        after = os.fstat(fd)
    except (DatasetError, OSError) as e:
        return False, f"{e} ({_NOT_ACCEPTED})", None
    finally:
        os.close(fd)
    if digest != rec["checksum"]:
        got = "a sampled block differs" if digest is None else f"checksum {digest}, {rec['checksum']} at import"
        return False, f"{what}: its rows differ from those imported ({got}); {_NOT_ACCEPTED}; {_REIMPORT}", None
    if not _unchanged(path, st, after):
        return False, (f"{what}: changed while it was being checksummed (or another file was put at its path); "
                       f"{_NOT_ACCEPTED}; run it again once nothing writes to it"), None  # fmt: skip
    changes = _changes(after, rec)
    if not changes:
        return True, f"used in place: {rec['path']} (offset {rec['offset']}), size, time and checksum match", None
    new = {**rec, "mtime_ns": int(after.st_mtime_ns), "device": int(after.st_dev), "inode": int(after.st_ino)}
    return True, (f"accepted: {rec['path']} (offset {rec['offset']}): every row byte matches the checksum recorded "
                  f"at import; {', '.join(changes)}"), new  # fmt: skip


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
    row size and dtype those of the dataset), whose path is then the one :func:`check_in_place` returns: it opens
    the checked file whatever is put at the recorded path later."""
    rec = meta.get(IN_PLACE, {}).get(key)
    if rec is None:
        check_file(root, meta, key, None, (num_rows, row_bytes))
        return root / meta["files"][key]["name"], 0
    got = (rec["num_rows"], rec["row_bytes"], rec["dtype"])
    if got != (num_rows, row_bytes, dtype_name):
        raise CorruptDatasetError(f"{root / 'meta.json'}: in_place.{key} records {got[0]} rows of {got[1]} bytes "
                                  f"({got[2]}), the dataset {num_rows} rows of {row_bytes} bytes ({dtype_name}); "
                                  "import it again", root)  # fmt: skip
    return check_in_place(rec, key, root), int(rec["offset"])


__all__ = ["IN_PLACE", "IDENTITY_FIELDS", "RowFile", "npy_rows", "describe", "check_record", "check_in_place",
           "recorded_path", "verify_in_place", "accept_in_place", "read_amplification", "feature_file"]
