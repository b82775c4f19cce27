"""Reading the files of other layouts without loading them whole: ``.npy`` (memory-mapped), ``.npz`` members
(memory-mapped when stored, streamed when deflated), numeric CSV (plain or gzip) in blocks of lines, and
``torch.save`` files of tensors and NumPy arrays (loaded with ``weights_only``).

Every reader names the file in its errors: a truncated file, a member that is missing, a line that does not parse.

Example::

    >>> import os, tempfile, numpy as np
    >>> tmp = tempfile.mkdtemp()
    >>> np.savez_compressed(os.path.join(tmp, "d.npz"), x=np.arange(12.0, dtype=np.float32).reshape(6, 2))
    >>> m = npz_member(os.path.join(tmp, "d.npz"), "x")
    >>> m.shape, m.dtype, m.stored
    ((6, 2), dtype('float32'), False)
    >>> [b[:, 0].tolist() for b in m.blocks(4)]
    [[0.0, 2.0, 4.0, 6.0], [8.0, 10.0]]
    >>> with open(os.path.join(tmp, "e.csv"), "w") as f:
    ...     _ = f.write("0,1\\n1,2\\n2,0\\n")
    >>> csv_array(os.path.join(tmp, "e.csv"), np.int64).tolist()
    [[0, 1], [1, 2], [2, 0]]
"""
from __future__ import annotations

import gzip
import io
import os
import struct
import warnings
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from lightning_ooc.data.files import input_file, not_a_file
from lightning_ooc.data.format import feature_dtype_name, load_npy_file, read_npy_header
from lightning_ooc.data.edge_lists import line_blocks
from lightning_ooc.data.in_place import RowFile, npy_rows
from lightning_ooc.errors import InputError

#: rows of a block of a streamed array: about this many bytes
BLOCK_BYTES = 64 << 20
_CSV_READ = 16 << 20


def need(path: Path, what: str) -> Path:
    """``path``, or an InputError saying which file of the layout is missing, or what is there instead of a regular
    file (a symbolic link loop, a FIFO, a device)."""
    return input_file(path, what, f"{path}: missing ({what}); check the directory, or name its layout with --from")


# -- arrays --------------------------------------------------------------------------------------------------------
def rows_per_block(row_bytes: int) -> int:
    return max(1, BLOCK_BYTES // max(1, row_bytes))


class ArrayRows:
    """A 2-D array read block by block, forward only: ``shape``, ``dtype`` and :meth:`blocks`.

    Features that cannot be memory-mapped (a deflated ``.npz`` member, CSV) reach the writer this way.

    >>> rows = ArrayRows((5, 2), "float32", lambda r: row_blocks(np.ones((5, 2), np.float32), r), "ones")
    >>> [len(b) for b in rows.blocks(2)]
    [2, 2, 1]
    """

    def __init__(self, shape: tuple[int, int], dtype: Any, blocks: Any, name: str):
        self.shape = tuple(int(v) for v in shape)
        self.dtype = np.dtype(dtype)
        self._blocks = blocks
        self.name = name

    def blocks(self, rows: int) -> Iterator[np.ndarray]:
        """Consecutive blocks of about ``rows`` rows each; the rows add up to ``shape[0]`` (else an InputError)."""
        got = 0
        for b in self._blocks(rows):
            got += len(b)
            yield b
        if got != self.shape[0]:
            raise InputError(f"{self.name}: {got} rows, expected {self.shape[0]} (truncated?)")


def row_blocks(a: Any, rows: int) -> Iterator[np.ndarray]:
    """Blocks of ``rows`` rows of an array-like (a memmap: each block read when it is asked for)."""
    for s in range(0, len(a), rows):
        yield np.asarray(a[s : s + rows])


@dataclass
class NpzMember:
    """One array of an ``.npz`` file: ``shape``, ``dtype``; ``stored`` (not compressed) members have a file
    ``offset`` (of the array's data) and can be memory-mapped or used in place.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "s.npz")
    >>> np.savez(path, x=np.ones((3, 2), np.float16))
    >>> m = npz_member(path, "x")
    >>> m.stored, m.rows().offset == m.offset, float(m.array().sum())
    (True, True, 6.0)
    """

    path: Path
    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    stored: bool
    offset: int | None
    fortran: bool
    #: a stored member's bytes in the file (its ``.npy`` header, then its data): ``(start, size, CRC-32)``, as the
    #: archive records them
    span: tuple[int, int, int] | None = None
    _crc_ok: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def name(self) -> str:
        return f"{self.path}[{self.key}]"

    @property
    def data_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def check_crc(self, data_crc: int) -> None:
        """A stored member whose data (the array's bytes, in file order) have CRC-32 ``data_crc``, checked against
        the archive's CRC-32 of the whole member; an InputError naming it where they differ (``np.load`` refuses
        such a member too)."""
        start, size, want = self.span
        head = self._crc_range(start, int(self.offset))
        tail_at = int(self.offset) + self.data_bytes
        got = crc32_combine(crc32_combine(head, data_crc, self.data_bytes), self._crc_range(tail_at, start + size),
                            start + size - tail_at)  # fmt: skip
        if got != want:
            raise InputError(f"{self.name}: its bytes do not match the archive's CRC-32 (crc {got:08x}, recorded "
                             f"{want:08x}): the file is damaged (np.load refuses it too); download or write it "
                             "again")  # fmt: skip
        self._crc_ok = True

    def verify_crc(self, progress: Any = None) -> None:
        """Read a stored member whole and check it against the archive's CRC-32 (once: a member found whole stays
        so); ``progress.update(bytes)`` as it goes."""
        if self._crc_ok:
            return
        crc = self._crc_range(int(self.offset), int(self.offset) + self.data_bytes, progress)
        self.check_crc(crc)

    def _crc_range(self, begin: int, end: int, progress: Any = None) -> int:
        crc = 0
        if end <= begin:
            return crc
        try:
            with open(self.path, "rb") as f:
                f.seek(begin)
                while begin < end:
                    data = f.read(min(BLOCK_BYTES, end - begin))
                    if not data:
                        raise InputError(f"{self.name}: ends past the end of the file (truncated?)")
                    crc = zlib.crc32(data, crc)
                    begin += len(data)
                    if progress is not None:
                        progress.update(len(data))
        except OSError as e:
            raise InputError(f"{self.name}: unreadable ({e}); the file is damaged or truncated") from None
        return crc

    def open(self) -> Any:
        """The archive and this member's ``.npy``, opened and read past its header (the caller closes both)."""
        z = zipfile.ZipFile(self.path)
        f = z.open(self.key + ".npy")
        _read_npy_header(f, self.name)
        return z, f

    def blocks(self, rows: int) -> Iterator[np.ndarray]:
        """The array in blocks of ``rows`` rows (along axis 0), read sequentially."""
        if self.fortran:
            raise InputError(f"{self.name}: a Fortran-ordered array; save it C-ordered")
        row_items = int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1
        z, f = self.open()
        try:
            left = self.shape[0] if self.shape else 1
            while left:
                take = min(rows, left)
                want = take * row_items * self.dtype.itemsize
                data = f.read(want)
                if len(data) != want:
                    raise InputError(f"{self.name}: ends inside its data (truncated?)")
                yield np.frombuffer(data, self.dtype).reshape((take, *self.shape[1:]))
                left -= take
        except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
            raise InputError(f"{self.name}: unreadable ({e}); the file is damaged or truncated") from None
        finally:
            f.close()
            z.close()

    def array(self) -> np.ndarray:
        """The whole array in memory (for the small members: counts, labels, splits), a stored one checked against
        its CRC-32."""
        if self.stored:
            a = np.array(self.memmap())
            self.check_crc(zlib.crc32(a.ravel(order="K")))  # the bytes in file order, either order
            return a
        parts = list(self.blocks(rows_per_block(self.dtype.itemsize * max(1, int(np.prod(self.shape[1:]))))))
        return np.concatenate(parts) if parts else np.empty(self.shape, self.dtype)

    def memmap(self) -> np.ndarray:
        if not self.stored:
            raise InputError(f"{self.name}: compressed, so it cannot be mapped")
        if not int(np.prod(self.shape)):
            return np.empty(self.shape, self.dtype)
        return np.memmap(self.path, self.dtype, "r", offset=self.offset, shape=self.shape,
                         order="F" if self.fortran else "C")  # fmt: skip

    def rows(self) -> Any:
        """Features as rows: a :class:`~lightning_ooc.data.in_place.RowFile` when stored (usable in place), else
        an :class:`ArrayRows` streamed out of the archive."""
        if len(self.shape) != 2:
            raise InputError(f"{self.name}: features must be 2-D (nodes x dim), got shape {self.shape}")
        try:
            name = feature_dtype_name(self.dtype)
        except ValueError:
            raise InputError(f"{self.name}: features of dtype {self.dtype}; expected a float (or uint8/int8) "
                             "matrix") from None  # fmt: skip
        if self.stored and not self.fortran and self.dtype.byteorder != ">":
            return NpzRowFile(self.path.absolute(), int(self.offset), self.shape, name, self)
        return ArrayRows(self.shape, self.dtype, self.blocks, self.name)


@dataclass(frozen=True)
class NpzRowFile(RowFile):
    """The rows of a stored ``.npz`` member: a :class:`~lightning_ooc.data.in_place.RowFile` (usable in place)
    whose blocks are checked against the archive's CRC-32 as they stream (before the last one is handed out).

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "s.npz")
    >>> np.savez(path, x=np.arange(12, dtype=np.float32).reshape(6, 2))
    >>> rows = npz_member(path, "x").rows()
    >>> [len(b) for b in rows.blocks(4)], rows.name
    ([4, 2], '...s.npz[x]')
    """

    member: Any = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.member.name

    def blocks(self, rows: int) -> Iterator[Any]:
        crc, left = 0, self.shape[0]
        if not left:
            self.member.check_crc(crc)
        for b in super().blocks(rows):
            crc = zlib.crc32(b, crc)
            left -= len(b)
            if not left:
                self.member.check_crc(crc)
            yield b

    def check_whole(self, progress: Any = None) -> None:
        """Read the member whole and check it against its CRC-32 (a member used in place is not streamed)."""
        self.member.verify_crc(progress)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` (of ``A``), ``crc2`` (of ``B``) and ``len2`` (``B``'s length), as
    zlib's ``crc32_combine`` makes it.

    >>> a, b = b"graphs larger", b" than memory"
    >>> crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    True
    """
    if len2 <= 0:
        return crc1

    def times(mat: list[int], vec: int) -> int:
        out, i = 0, 0
        while vec:
            if vec & 1:
                out ^= mat[i]
            vec >>= 1
            i += 1
        return out

    def square(mat: list[int]) -> list[int]:
        return [times(mat, mat[n]) for n in range(32)]

    op = [0xEDB88320] + [1 << n for n in range(31)]  # what one zero bit does to a CRC register
    for _ in range(3):
        op = square(op)  # 2, 4, then 8 zero bits: one zero byte
    while len2:  # run crc1 through len2 zero bytes, one power of two at a time
        if len2 & 1:
            crc1 = times(op, crc1)
        len2 >>= 1
        if len2:
            op = square(op)
    return crc1 ^ crc2


def _read_npy_header(f: Any, name: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    try:
        return read_npy_header(f)
    except (ValueError, OSError, EOFError, SyntaxError, zipfile.BadZipFile) as e:
        raise InputError(f"{name}: not a readable .npy array ({e})") from None


def npz_member(path: str | os.PathLike, key: str) -> NpzMember:
    """The array ``key`` of ``path`` (an ``.npz``), from its headers only."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            try:
                info = z.getinfo(key + ".npy")
            except KeyError:
                have = [n[:-4] for n in z.namelist() if n.endswith(".npy")]
                raise InputError(f"{path}: holds no array {key!r} (it holds {', '.join(have) or 'none'})") from None
            with z.open(info) as f:
                shape, fortran, dtype = _read_npy_header(f, f"{path}[{key}]")
                header_len = f.tell() if info.compress_type == zipfile.ZIP_STORED else None
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise InputError(f"{path}: not a readable .npz archive ({e}); the file is damaged or truncated") from None
    offset = None
    if header_len is not None:  # the local header's own name and extra lengths may differ from the directory's
        with open(path, "rb") as f:
            f.seek(info.header_offset)
            local = f.read(30)
            if len(local) != 30 or local[:4] != b"PK\x03\x04":
                raise InputError(f"{path}: damaged .npz archive (no local header for {key!r})")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        offset = start + header_len
        end = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end > path.stat().st_size:
            raise InputError(f"{path}[{key}]: ends past the end of the file (truncated?)")
        if end > start + info.compress_size:
            raise InputError(f"{path}[{key}]: the archive records {info.compress_size} bytes for it, fewer than its "
                             f".npy header says it holds ({end - start}); the file is damaged")  # fmt: skip
        span = (start, int(info.compress_size), int(info.CRC))
    return NpzMember(path, key, shape, dtype, header_len is not None, offset, fortran,
                     span if header_len is not None else None)  # fmt: skip


def stored_npz_member_at(path: str | os.PathLike, offset: int) -> NpzMember | None:
    """The stored ``.npz`` member of ``path`` whose data start at byte ``offset`` (a member used in place), or None
    where ``path`` is no such archive; never raises.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "s.npz")
    >>> np.savez(path, a=np.ones(3), x=np.ones((4, 2), np.float32))
    >>> m = npz_member(path, "x")
    >>> stored_npz_member_at(path, m.offset).key, stored_npz_member_at(path, m.offset + 1)
    ('x', None)
    """
    try:
        if not_a_file(path) is not None or not zipfile.is_zipfile(path):  # nothing opened that is not a file
            return None
        for key in npz_keys(path):
            m = npz_member(path, key)
            if m.stored and m.offset == offset:
                return m
    except (InputError, OSError, zipfile.BadZipFile):
        return None
    return None


def npz_keys(path: str | os.PathLike) -> list[str]:
    try:
        with zipfile.ZipFile(path) as z:
            return [n[:-4] for n in z.namelist() if n.endswith(".npy")]
    except (zipfile.BadZipFile, OSError) as e:
        raise InputError(f"{path}: not a readable .npz archive ({e})") from None


def npy_array(path: str | os.PathLike, what: str, mmap: bool = True) -> np.ndarray:
    """A ``.npy`` file, memory-mapped (or loaded); errors name the file and what it should hold."""
    path = need(Path(path), what)
    try:
        return load_npy_file(path, "r" if mmap else None)
    except (ValueError, OSError, EOFError) as e:
        raise InputError(f"{path}: not a readable .npy array ({e}); expected {what} (truncated?)") from None


def npy_features(path: str | os.PathLike, what: str = "node features") -> RowFile:
    """A 2-D ``.npy`` of features as a :class:`~lightning_ooc.data.in_place.RowFile` (header only read)."""
    return npy_rows(need(Path(path), what), what.removeprefix("the "))  # npy_rows says "the {what}"


# -- CSV -----------------------------------------------------------------------------------------------------------
def _open_bytes(path: Path) -> Any:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def csv_blocks(path: str | os.PathLike, dtype: Any, what: str = "", header: bool = False) -> Iterator[np.ndarray]:
    """A numeric CSV (``.csv`` or ``.csv.gz``, comma-separated, ``nan`` allowed in floats) as 2-D blocks of
    whole lines, read a few MiB at a time."""
    path = need(Path(path), what or "a CSV file")
    line = 1
    skip = header
    try:
        with _open_bytes(path) as f:
            for block, _ in line_blocks(f, _CSV_READ):
                if skip:
                    _, _, block = block.partition(b"\n")
                    line += 1
                    skip = False
                if block.strip():
                    yield _parse_csv(block, dtype, path, line)
                line += block.count(b"\n")
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise InputError(f"{path}: unreadable ({e}); the file is damaged or truncated") from None


def _parse_csv(block: bytes, dtype: Any, path: Path, line: int) -> np.ndarray:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return np.loadtxt(io.BytesIO(block), delimiter=",", dtype=dtype, ndmin=2)
    except ValueError as e:
        raise InputError(f"{path}: a line from line {line} on does not parse as {np.dtype(dtype)} ({e})") from None


def csv_array(path: str | os.PathLike, dtype: Any, what: str = "", header: bool = False) -> np.ndarray:
    """A (small) numeric CSV in memory, 2-D."""
    blocks = list(csv_blocks(path, dtype, what, header))
    return np.concatenate(blocks) if blocks else np.empty((0, 0), dtype)


def csv_rows(path: str | os.PathLike, num_rows: int, dtype: Any, what: str) -> ArrayRows:
    """A CSV of features (one node per line) as rows; the width is that of its first line."""
    path = need(Path(path), what)
    with _open_bytes(path) as f:
        first = f.readline()
    width = len(first.split(b",")) if first.strip() else 0

    def blocks(rows: int) -> Iterator[np.ndarray]:
        buf, held = [], 0
        for b in csv_blocks(path, dtype, what):
            if b.shape[1] != width:
                raise InputError(f"{path}: rows of {b.shape[1]} values after a first row of {width}")
            buf.append(b)
            held += len(b)
            while held >= rows:
                cat = np.concatenate(buf)
                yield cat[:rows]
                buf, held = [cat[rows:]], held - rows
        if held:
            yield np.concatenate(buf)

    return ArrayRows((num_rows, width), dtype, blocks, str(path))


# -- torch.save files ----------------------------------------------------------------------------------------------
def _numpy_globals() -> list[Any]:
    core = getattr(np, "_core", None) or np.core
    out: list[Any] = [np.ndarray, np.dtype, core.multiarray._reconstruct]
    for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                 "float32", "float64"):  # fmt: skip
        out.append(type(np.dtype(name)))
    scalar = getattr(core.multiarray, "scalar", None)
    return out + ([scalar] if scalar is not None else [])


def load_pt(path: str | os.PathLike, what: str) -> Any:
    """A ``torch.save`` file of tensors, NumPy arrays, numbers, strings, lists and dicts, loaded with
    ``weights_only=True`` (nothing it names is run); anything else is an InputError naming it."""
    path = need(Path(path), what)
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling raises many kinds; all mean "not a file we read"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{path}: cannot be loaded safely as {what} ({first}); it must hold tensors, NumPy "
                         "arrays, numbers and dicts only") from None  # fmt: skip


def as_numpy(v: Any) -> np.ndarray:
    return v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)




class NpzEdgeSource:
    """The edges of a ``(2, E)`` integer ``.npz`` member (OGB's ``edge_index``) as an edge source: a stored
    member memory-mapped, a deflated one streamed through two readers of the archive (sources, targets).

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "g.npz")
    >>> np.savez_compressed(path, edge_index=np.array([[0, 1, 2], [1, 2, 0]]))
    >>> [(s.tolist(), d.tolist()) for s, d in NpzEdgeSource(npz_member(path, "edge_index"), chunk_edges=2).chunks()]
    [([0, 1], [1, 2]), ([2], [0])]
    """

    def __init__(self, member: NpzMember, chunk_edges: int = 1 << 22):
        if len(member.shape) != 2 or member.shape[0] != 2 or member.dtype.kind not in "iu":
            raise InputError(f"{member.name}: edges must be an integer (2, E) array, got {member.dtype}{list(member.shape)}")
        self.member = member
        self.name = member.name
        self.num_edges = int(member.shape[1])
        self.chunk_edges = int(chunk_edges)

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        m = self.member
        if m.stored:  # checked against the archive's CRC-32 as the edges stream, before the last chunk goes out
            yield from self._stored_chunks()
            return
        item = m.dtype.itemsize
        if m.fortran:  # a Fortran-ordered (2, E): stored as (src, dst) pairs, one after the other
            z, f = m.open()
            try:
                for s in range(0, self.num_edges, self.chunk_edges):
                    want = min(self.chunk_edges, self.num_edges - s) * 2 * item
                    data = f.read(want)
                    if len(data) != want:
                        raise InputError(f"{self.name}: ends inside its data (truncated?)")
                    pairs = np.frombuffer(data, m.dtype).reshape(-1, 2)
                    yield np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])
            except (zipfile.BadZipFile, EOFError, OSError) as e:
                raise InputError(f"{self.name}: unreadable ({e}); the file is damaged or truncated") from None
            finally:
                f.close()
                z.close()
            return
        opened = [m.open(), m.open()]
        try:
            src, dst = opened[0][1], opened[1][1]
            dst.seek(dst.tell() + self.num_edges * item)
            for s in range(0, self.num_edges, self.chunk_edges):
                want = min(self.chunk_edges, self.num_edges - s) * item
                a, b = src.read(want), dst.read(want)
                if len(a) != want or len(b) != want:
                    raise InputError(f"{self.name}: ends inside its data (truncated?)")
                yield np.frombuffer(a, m.dtype), np.frombuffer(b, m.dtype)
        except (zipfile.BadZipFile, EOFError, OSError) as e:
            raise InputError(f"{self.name}: unreadable ({e}); the file is damaged or truncated") from None
        finally:
            for z, f in opened:
                f.close()
                z.close()

    def _stored_chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """A stored member's edges, memory-mapped; its CRC-32 summed over both rows of a C-ordered ``(2, E)`` (the
        sources' bytes, then the targets') or over the ``(src, dst)`` pairs of a Fortran-ordered one."""
        m, n, step = self.member, self.num_edges, self.chunk_edges
        if not n:
            m.check_crc(0)
            return
        if m.fortran:
            pairs = np.memmap(m.path, m.dtype, "r", offset=m.offset, shape=(n, 2))
            crc = 0
            for s in range(0, n, step):
                block = np.array(pairs[s : s + step])
                crc = zlib.crc32(block, crc)
                if s + step >= n:
                    m.check_crc(crc)
                yield np.ascontiguousarray(block[:, 0]), np.ascontiguousarray(block[:, 1])
            return
        mm = m.memmap()
        src_crc = dst_crc = 0
        for s in range(0, n, step):
            src, dst = np.array(mm[0, s : s + step]), np.array(mm[1, s : s + step])
            src_crc, dst_crc = zlib.crc32(src, src_crc), zlib.crc32(dst, dst_crc)
            if s + step >= n:
                m.check_crc(crc32_combine(src_crc, dst_crc, n * m.dtype.itemsize))
            yield src, dst


class CsvEdgeSource:
    """``src,dst`` lines of a CSV (plain or gzip) as an edge source (OGB's ``edge.csv.gz``).

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "e.csv.gz")
    >>> with gzip.open(path, "wt") as f:
    ...     _ = f.write("0,1\\n2,0\\n")
    >>> [(s.tolist(), d.tolist()) for s, d in CsvEdgeSource(path).chunks()]
    [([0, 2], [1, 0])]
    """

    def __init__(self, path: Path, num_edges: int | None = None):
        self.path = need(Path(path), "the edge list")
        self.name = str(path)
        self.num_edges = num_edges

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for b in csv_blocks(self.path, np.int64, "the edge list"):
            if b.shape[1] < 2:
                raise InputError(f"{self.path}: edge lines need two node ids, got {b.shape[1]} column(s)")
            yield np.ascontiguousarray(b[:, 0]), np.ascontiguousarray(b[:, 1])


class PairsEdgeSource:
    """Edges of an ``(E, 2)`` or ``(2, E)`` array (a memory-mapped ``.npy``: IGB's, MAG240M's, GraphBolt's).

    >>> [(s.tolist(), d.tolist()) for s, d in PairsEdgeSource(np.array([[0, 1], [1, 2], [2, 0]]), "pairs").chunks()]
    [([0, 1, 2], [1, 2, 0])]
    """

    def __init__(self, a: np.ndarray, name: str, chunk_edges: int = 1 << 22, rows: bool | None = None):
        if a.ndim != 2 or 2 not in a.shape or a.dtype.kind not in "iu":
            raise InputError(f"{name}: edges must be an integer (E, 2) or (2, E) array, got {a.dtype}{list(a.shape)}")
        if rows is not None and a.shape[0 if rows else 1] != 2:
            want = "(2, E)" if rows else "(E, 2)"
            raise InputError(f"{name}: edges must be a {want} array here, got {a.dtype}{list(a.shape)}")
        # rows=True: (2, E), a row of sources and one of targets; by default guessed, a (2, 2) array read as (E, 2)
        self.rows = (a.shape[0] == 2 and a.shape[1] != 2) if rows is None else rows
        self.a = a
        self.name = name
        self.num_edges = int(a.shape[1] if self.rows else a.shape[0])
        self.chunk_edges = int(chunk_edges)

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for s in range(0, self.num_edges, self.chunk_edges):
            if self.rows:
                block = np.array(self.a[:, s : s + self.chunk_edges])
                yield block[0], block[1]
            else:
                block = np.array(self.a[s : s + self.chunk_edges])
                yield np.ascontiguousarray(block[:, 0]), np.ascontiguousarray(block[:, 1])


__all__ = ["ArrayRows", "NpzMember", "NpzRowFile", "npz_member", "npz_keys", "stored_npz_member_at", "crc32_combine",
           "npy_array", "npy_features", "csv_blocks", "csv_array", "csv_rows", "load_pt", "row_blocks", "need",
           "NpzEdgeSource", "CsvEdgeSource", "PairsEdgeSource"]
