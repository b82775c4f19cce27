"""The on-disk dataset format (see ``docs/format.md``).

A dataset is a directory::

    meta.json      format name and version, counts, dtypes, each file's size and checksum
    indptr.npy     int64[N + 1]        in-edge CSC offsets
    indices.npy    int32|int64[E]      sources of the edges into each node, sorted per node
    features.bin   raw row-major rows, N x row_bytes, no header, no padding
    labels.npy     int64[N]            class of each node, -1 where unknown
    train.npy      int64[*]            node ids of each split
    val.npy
    test.npy

This module holds the constants, the dtype table and the small helpers that
both the writers and the reader use.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tokenize
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import torch
import xxhash

FORMAT_NAME = "lightning_ooc.graph"
#: 2 added ``meta_checksum`` (of meta.json itself, which names every file's checksum); 3 added heterogeneous
#: datasets (node and edge types); 4 added feature files used in place (``in_place``, outside the directory).
#: Versions 1 to 3 are still read.
FORMAT_VERSION = 4
#: Datasets whose features are used in place are written as version 4: older releases refuse them (they
#: would find no feature file) instead of failing on a missing ``features.bin``.
IN_PLACE_VERSION = 4
#: Homogeneous datasets are still written as version 2, so that releases before heterogeneous graphs open them.
HOMOGENEOUS_VERSION = 2
META_FILE = "meta.json"
#: meta.json is written under this name and renamed once complete (older releases renamed it after the commit).
META_PENDING = "meta.json.pending"
SPLITS = ("train", "val", "test")
#: The files of an embedding table directory besides meta.json (lightning_ooc.embed.table): partitions by
#: generation, the state and its lock, the edge buckets.
#: an embedding table's ``meta.json`` format and the versions this release reads (lightning_ooc.embed.table)
TABLE_FORMAT_NAME = "lightning_ooc.embeddings"
TABLE_FORMAT_VERSION = 1
#: the lock a process holding a table open for writing takes (flock)
TABLE_LOCK_FILE = "state.lock"
TABLE_ENTRY_RE = re.compile(
    r"^(state\.json|state\.json\.pending|state\.lock|journal\.bin|part-\d{5}\.g\d{8}\.bin|buckets_(train|val|test)(_offsets|_rel)?\.npy)$"
)

FILES = {
    "indptr": "indptr.npy",
    "indices": "indices.npy",
    "features": "features.bin",
    "labels": "labels.npy",
    "train": "train.npy",
    "val": "val.npy",
    "test": "test.npy",
}

#: Files a dataset (or a node type) may have: ``node_time`` holds an int64 time of each node (OGB's node years),
#: as PyG's ``time`` node attribute; ``edge_time`` an int64 time of each edge, in the CSC's order; ``{split}_time``
#: the time of each seed of a node split (its prediction time: a seed may then appear once per time).
#: Readers that predate a file ignore it, so it needs no new version.
OPTIONAL_FILES = {"node_time": "node_time.npy", "edge_time": "edge_time.npy", "train_time": "train_time.npy",
                  "val_time": "val_time.npy", "test_time": "test_time.npy"}  # fmt: skip

#: ``neighbor_order`` of meta.json (of a relation, in a heterogeneous dataset): how each node's in-edges are
#: ordered. ``source_id`` (the default, also written as ``sorted_neighbors``), or by time for temporal sampling:
#: ``node_time`` (the sources' node times) or ``edge_time`` (the edges' own); ties by source id.
NEIGHBOR_ORDERS = ("source_id", "node_time", "edge_time")

#: Feature dtypes: name -> (torch dtype, NumPy dtype used to hold the raw bytes).
#: bfloat16 has no NumPy type; its rows are held as uint16 and viewed by torch.
FEATURE_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),
    "float64": (torch.float64, np.dtype("<f8")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "int8": (torch.int8, np.dtype("i1")),
}

CHECKSUM_ALGO = "xxh3_128"
_HASH_CHUNK = 16 << 20


def feature_dtype_name(dtype: object) -> str:
    """Normalise a dtype given as a string, NumPy dtype or torch dtype to its format name.

    >>> feature_dtype_name("float16"), feature_dtype_name(torch.bfloat16)
    ('float16', 'bfloat16')
    """
    if isinstance(dtype, torch.dtype):
        for name, (t, _) in FEATURE_DTYPES.items():
            if t == dtype:
                return name
    else:
        name = str(dtype)
        if name in FEATURE_DTYPES:
            return name
        try:
            npd = np.dtype(dtype)  # type: ignore[arg-type]
        except TypeError:
            npd = None
        if npd is not None and npd.name in FEATURE_DTYPES and npd.name != "uint16":
            return npd.name
    raise ValueError(f"unsupported feature dtype {dtype!r}; use one of {', '.join(FEATURE_DTYPES)}")


def index_dtype(num_nodes: int) -> np.dtype:
    """Dtype of ``indices``: int32 when every node id fits, else int64."""
    return np.dtype("<i4") if num_nodes < 2**31 else np.dtype("<i8")


def to_feature_bytes(rows: np.ndarray | torch.Tensor, dtype_name: str) -> np.ndarray:
    """Cast a 2-D block of rows to the stored dtype and return it as a C-contiguous NumPy array.

    bfloat16 is converted through torch (round to nearest even) and returned as uint16.
    """
    t_dtype, np_dtype = FEATURE_DTYPES[dtype_name]
    if dtype_name == "bfloat16":
        t = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.array(rows, copy=True))
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    if isinstance(rows, torch.Tensor):
        if rows.dtype == torch.bfloat16:
            rows = rows.float()
        rows = rows.numpy()
    return np.ascontiguousarray(rows, dtype=np_dtype)


def meta_digest(meta: dict) -> str:
    """Checksum of ``meta.json``'s content, itself excluded: every other key, in a canonical JSON form.

    >>> meta_digest({"b": 1, "a": [2]}) == meta_digest({"a": [2], "b": 1, "meta_checksum": "x"})
    True
    """
    body = {k: v for k, v in meta.items() if k != "meta_checksum"}
    return xxhash.xxh3_128(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def new_hasher():
    return xxhash.xxh3_128()


def checksum_file(path: str | os.PathLike, progress=None) -> str:
    """Checksum of a whole file, as written in ``meta.json``."""
    h = new_hasher()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_HASH_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            if progress is not None:
                progress.update(n)
    return h.hexdigest()


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The bytes of a version 1.0 ``.npy`` header for a C-ordered array."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    )
    return buf.getvalue()


#: what NumPy's parser of a ``.npy`` header raises besides ValueError where the header is not a Python literal (a
#: byte that is not ASCII, a bracket left open): its tokenizer's and evaluator's own errors
_HEADER_ERRORS = (SyntaxError, tokenize.TokenError, TypeError, OverflowError, RecursionError)


def _header_text(e: BaseException) -> str:
    """One line saying why a ``.npy`` header does not parse."""
    why = e.args[0] if isinstance(e, tokenize.TokenError) and e.args else str(e).splitlines()[0] if str(e) else ""
    return f"its header does not parse ({type(e).__name__}: {why}): a damaged header or a byte that is not ASCII"


@contextlib.contextmanager
def _npy_header_errors() -> Iterator[None]:
    """Turn what NumPy raises for a ``.npy`` header inside the block into a one-line ValueError: its parser's own
    errors (:data:`_HEADER_ERRORS`) say that the header does not parse, and a ValueError's text (which quotes the
    whole header, padding included) is put on one line, spaces squeezed.

    >>> with _npy_header_errors():
    ...     raise ValueError("Header does not contain the correct keys:   {'descr': '<f4',     }")
    Traceback (most recent call last):
    ...
    ValueError: Header does not contain the correct keys: {'descr': '<f4', }
    >>> with _npy_header_errors():
    ...     raise SyntaxError("invalid syntax")
    Traceback (most recent call last):
    ...
    ValueError: its header does not parse (SyntaxError: invalid syntax): a damaged header or a byte that is not ASCII
    """
    try:
        yield
    except _HEADER_ERRORS as e:
        raise ValueError(_header_text(e)) from None
    except ValueError as e:
        raise ValueError(" ".join(str(e).split())) from None


def read_npy_header(f: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` header at ``f``'s position, leaving ``f`` at the data;
    a ValueError (or the read's own error) where it is not one.

    >>> buf = io.BytesIO(npy_header(np.dtype("<f4"), (3, 2)))
    >>> read_npy_header(buf), buf.tell()
    (((3, 2), False, dtype('float32')), 128)
    """
    version = np.lib.format.read_magic(f)
    read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in read:
        raise ValueError(f".npy version {version} is not supported")
    with _npy_header_errors():
        shape, fortran, dtype = read[version](f)
    return tuple(int(v) for v in shape), bool(fortran), dtype


def load_npy_file(path: str | os.PathLike, mmap_mode: str | None = "r") -> np.ndarray:
    """``np.load`` of a ``.npy`` file (no pickled objects), memory-mapped by default; a header that does not parse
    is a ValueError (as :func:`read_npy_header` gives), as is a file that is not a ``.npy`` array.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "a.npy")
    >>> np.save(path, np.arange(3))
    >>> load_npy_file(path).tolist()
    [0, 1, 2]
    >>> with open(path, "r+b") as f:  # a byte that is not ASCII in place of the header's opening brace
    ...     _ = f.seek(10)
    ...     _ = f.write(bytes([0xE9]))
    >>> try:
    ...     load_npy_file(path)
    ... except ValueError as e:
    ...     print(str(e)[:62])
    its header does not parse (TokenError: EOF in multi-line state
    """
    with _npy_header_errors():
        return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)


class NpyStreamWriter:
    """Write a ``.npy`` file chunk by chunk without holding the array.

    The array has shape ``(length,) + row_shape``; each chunk holds whole rows
    (items, for the default 1-D array). If the length is not known up front
    (``length=None``) a header is reserved and rewritten with the real length
    on :meth:`close`.
    """

    def __init__(
        self, path: str | os.PathLike, dtype: np.dtype | str, length: int | None, row_shape: tuple[int, ...] = ()
    ):
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.expected = length
        self.row_shape = tuple(int(d) for d in row_shape)
        self.count = 0
        self._f: BinaryIO = open(self.path, "wb")
        header = npy_header(self.dtype, (length if length is not None else 10**15,) + self.row_shape)
        self._header_len = len(header)
        self._f.write(header)

    def write(self, chunk: np.ndarray) -> None:
        arr = np.ascontiguousarray(chunk, dtype=self.dtype).reshape((-1,) + self.row_shape)
        rows = arr.shape[0]
        if self.expected is not None and self.count + rows > self.expected:
            raise ValueError(f"{self.path.name}: more than the declared {self.expected} items")
        self._f.write(memoryview(arr.reshape(-1)).cast("B"))
        self.count += rows

    def close(self) -> int:
        """Finish the file (fsync'd) and return its size in bytes."""
        if self.expected is not None and self.count != self.expected:
            raise ValueError(f"{self.path.name}: wrote {self.count} items, declared {self.expected}")
        if self.expected is None:
            header = npy_header(self.dtype, (self.count,) + self.row_shape)
            if len(header) != self._header_len:  # pragma: no cover - header sizes are padded alike
                raise RuntimeError("npy header length changed")
            self._f.seek(0)
            self._f.write(header)
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return os.path.getsize(self.path)

    def abort(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass


def human_bytes(n: float) -> str:
    """Format a byte count with a binary unit.

    >>> human_bytes(3 * 2**30)
    '3.00 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def parse_bytes(value: int | str) -> int:
    """Parse a byte budget such as ``"4GiB"``, ``"256MiB"``, ``"1.5GB"`` or an int.

    >>> parse_bytes("4GiB"), parse_bytes("256MiB"), parse_bytes(1000), parse_bytes("1kB")
    (4294967296, 268435456, 1000, 1000)
    """
    if isinstance(value, (int, np.integer)):
        if value < 0:
            raise ValueError(f"byte budget must be >= 0, got {value}")
        return int(value)
    s = str(value).strip().replace(" ", "").replace("_", "")
    units = {
        "": 1, "b": 1,
        "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
        "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    }
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = s[len(num):].lower()
    if unit not in units or not num:
        raise ValueError(f"cannot parse byte budget {value!r}; write e.g. '4GiB', '256MiB' or an integer")
    out = float(num) * units[unit]
    if out < 0:
        raise ValueError(f"byte budget must be >= 0, got {value!r}")
    return int(out)
