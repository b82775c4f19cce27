"""Row-by-row write-back into an embedding table, safe against a crash: a redo journal.

Learnable input features (``OutOfCoreNodeData(features=Learnable(...))``) update
scattered rows, a few thousand per batch, so they cannot rewrite whole
partitions as the partition buffer does. :class:`TableRows` writes them in
place, behind a journal:

1. the rows (ids and bytes, with a checksum) are appended to ``journal.bin``
   and the journal is synced;
2. each row is written at its place in its partition file (buffered writes;
   direct-I/O readers of the same file see them, the kernel writing back dirty
   pages before a direct read of their range);
3. :meth:`TableRows.checkpoint` syncs the partition files, checksums the
   partitions written since the last checkpoint into ``state.json`` and
   empties the journal.

A process killed after step 1 has its rows replayed from the journal the next
time the table is opened for writing (:func:`replay_journal`); one killed
during step 1 leaves a record without its checksum at the journal's end,
which is dropped: its rows were never written in place. Either way every row
is a whole row some write-back wrote. Between the first in-place write and
the checkpoint a partition's checksum in ``state.json`` is empty ("changed
row by row since"), so ``verify`` says so instead of reporting damage.

Example::

    >>> import tempfile, torch
    >>> from lightning_ooc.embed.table import init_embeddings, EmbeddingTable
    >>> from lightning_ooc.embed.rows import TableRows
    >>> t = EmbeddingTable(init_embeddings(tempfile.mkdtemp() + "/e", num_nodes=10, dim=2, partitions=2,
    ...                                    progress=False))
    >>> rows = TableRows(t)
    >>> rows.write(torch.tensor([7, 1]), torch.full((2, 4), 5.0))
    >>> t.rows(torch.tensor([1, 7]))[:, 0].tolist()
    [5.0, 5.0]
    >>> rows.checkpoint(); t.verify(); rows.close(); t.close()
"""
from __future__ import annotations

import logging
import os
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from lightning_ooc.errors import InputError
from lightning_ooc.io.io_errors import FeatureWriteError
from lightning_ooc.data.format import checksum_file

log = logging.getLogger("lightning_ooc")

JOURNAL_FILE = "journal.bin"
_MAGIC = b"LOOCJRN1"
_HEAD = struct.Struct("<8sQII")  # magic, sequence number, rows, row bytes
_TAIL = struct.Struct("<Q")  # xxh64 of head + ids + rows
#: the most rows' bytes in one journal record, and the journal size at which it is emptied
RECORD_BYTES = 64 << 20
JOURNAL_LIMIT = 1 << 30


def _records(path: Path, row_bytes: int):
    """``(ids, rows)`` of every complete record of a journal, in order; stops at a torn end."""
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos + _HEAD.size <= len(data):
        magic, _seq, n, rb = _HEAD.unpack_from(data, pos)
        if magic != _MAGIC or rb != row_bytes:
            break
        end = pos + _HEAD.size + 8 * n + n * rb + _TAIL.size
        if end > len(data):
            break
        body = data[pos : end - _TAIL.size]
        (digest,) = _TAIL.unpack_from(data, end - _TAIL.size)
        if xxhash.xxh64_intdigest(body) != digest:
            break
        ids = np.frombuffer(body, dtype="<i8", count=n, offset=_HEAD.size)
        rows = np.frombuffer(body, dtype=np.uint8, count=n * rb, offset=_HEAD.size + 8 * n).reshape(n, rb)
        yield ids, rows
        pos = end
    if pos < len(data):
        log.info("%s: dropped an incomplete record at its end (its rows were never written in place)", path)


def replay_journal(table: Any) -> int:
    """Apply what a killed writer left in ``table``'s journal (at open, under the table's lock); the number
    of records applied."""
    path = table.root / JOURNAL_FILE
    if not path.exists() or path.stat().st_size == 0:
        return 0
    writer = TableRows(table, journal=False)
    n = 0
    try:
        for ids, rows in _records(path, table.row_bytes):
            writer._in_place(ids, rows)
            n += 1
        writer.checkpoint()
    finally:
        writer.close()
    if n:
        log.warning("%s: replayed %d journal record(s) of row write-backs an interrupted run left", table.root, n)
    return n


class TableRows:
    """In-place row writes into ``table`` (open for writing) behind a redo journal (see the module docstring).

    ``write`` may be called from one thread at a time per table (the learnable feature store has one
    write-back thread); ``checkpoint`` makes everything written durable and checksummed.
    """

    def __init__(self, table: Any, journal: bool = True):
        if not table.writable:
            raise InputError(f"{table.root}: row write-backs need the table open for writing")
        self.table = table
        self.row_bytes = int(table.row_bytes)
        self._fds: dict[int, int] = {}
        self._touched: set[int] = set()
        self._mu = threading.Lock()
        self._seq = 0
        #: journal bytes past which the written partitions are synced and the journal emptied
        self.journal_limit = JOURNAL_LIMIT
        self._journal = None
        if journal:
            self._journal = open(table.root / JOURNAL_FILE, "ab", buffering=0)
        self.closed = False

    def _fd(self, p: int) -> int:
        if p not in self._fds:
            self._fds[p] = os.open(self.table.partition_path(p), os.O_RDWR | os.O_CLOEXEC)
        return self._fds[p]

    def write(self, ids: Any, rows: Any) -> None:
        """Write ``rows`` (``[k, 2 * dim]`` float32: embedding and state) of nodes ``ids`` into the table."""
        ids = np.ascontiguousarray(torch.as_tensor(ids).cpu().numpy(), dtype=np.int64).reshape(-1)
        if ids.size == 0:
            return
        data = torch.as_tensor(rows).detach().to("cpu", torch.float32).contiguous().numpy()
        if data.size * 4 != ids.size * self.row_bytes:
            raise InputError(f"{ids.size} ids and rows of {data.size * 4} bytes for a table of {self.row_bytes}-byte "
                             "rows")  # fmt: skip
        data = data.view(np.uint8).reshape(ids.size, -1)
        if ids.min() < 0 or ids.max() >= self.table.num_nodes:
            raise InputError(f"node ids must lie in [0, {self.table.num_nodes}) for {self.table.root}")
        with self._mu:
            if self._journal is not None:
                step = max(1, RECORD_BYTES // self.row_bytes)
                path = self.table.root / JOURNAL_FILE
                try:
                    for s in range(0, ids.size, step):  # records of bounded size
                        self._append(ids[s : s + step], data[s : s + step])
                    os.fdatasync(self._journal.fileno())
                except FeatureWriteError:
                    raise
                except OSError as e:  # a full disk, most often: name the file, keep the errno
                    raise FeatureWriteError(e.errno or 0, f"cannot journal {ids.size} row write-back(s) "
                                            f"({e.strerror or e}); nothing of them was written in place", path) from e
            self._in_place(ids, data)
            if self._journal is not None and self._journal.tell() > self.journal_limit:
                self._sync(checksum=False)  # the rows are in place and synced: the journal can start again

    def _append(self, ids: np.ndarray, data: np.ndarray) -> None:
        """Append one record; a record not written whole is cut off again before anything is written in place."""
        self._seq += 1
        head = _HEAD.pack(_MAGIC, self._seq, ids.size, self.row_bytes)
        body = head + ids.tobytes() + data.tobytes()
        record = memoryview(body + _TAIL.pack(xxhash.xxh64_intdigest(body)))
        fd = self._journal.fileno()
        start = self._journal.tell()
        done = 0
        try:
            while done < len(record):
                done += os.write(fd, record[done:])
        except BaseException:
            os.ftruncate(fd, start)  # a later record must not follow a torn one
            os.lseek(fd, start, os.SEEK_SET)
            raise

    def _in_place(self, ids: np.ndarray, data: np.ndarray) -> None:
        order = np.argsort(ids, kind="stable")
        ids, data = ids[order], data[order]
        parts = self.table.partition_of(ids)
        new = sorted(set(np.unique(parts).tolist()) - self._touched)
        if new:  # from here until the checkpoint their checksums are not the files' any more
            for p in new:  # so a damaged partition is refused now, never checksummed again as good
                self.table.check_partition(p)
            with self.table._mu:
                for p in new:
                    self.table._sums[p] = ""
                self.table._commit_state()
            self._touched.update(new)
        # runs of consecutive ids in one partition are written at once
        brk = np.flatnonzero((np.diff(ids) != 1) | (np.diff(parts) != 0)) + 1
        starts = np.concatenate([[0], brk])
        ends = np.concatenate([brk, [ids.size]])
        rb = self.row_bytes
        for s, e in zip(starts.tolist(), ends.tolist()):
            p = int(parts[s])
            off = (int(ids[s]) - int(self.table.bounds[p])) * rb
            buf = memoryview(data[s:e]).cast("B")
            done = 0
            while done < len(buf):
                done += os.pwrite(self._fd(p), buf[done:], off + done)

    def checkpoint(self) -> None:
        """Sync the partitions written since the last checkpoint, checksum them into ``state.json``, and
        empty the journal."""
        with self._mu:
            self._sync(checksum=True)

    def _sync(self, checksum: bool) -> None:
        """Sync the written partitions and empty the journal; with ``checksum``, checksum them into
        ``state.json`` (without, their checksums stay empty until a checkpoint or the next open)."""

        for p in sorted(self._touched):
            os.fdatasync(self._fd(p))
        if self._touched and checksum:
            sums = {p: checksum_file(self.table.partition_path(p)) for p in sorted(self._touched)}
            with self.table._mu:
                for p, digest in sums.items():
                    self.table._sums[p] = digest
                self.table._commit_state()
            self._touched.clear()
        if self._journal is not None:
            self._journal.truncate(0)
            self._journal.seek(0)
            os.fsync(self._journal.fileno())
        else:
            path = self.table.root / JOURNAL_FILE
            if path.exists():
                with open(path, "r+b") as f:
                    f.truncate(0)
                    os.fsync(f.fileno())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._journal is not None:
            self._journal.close()


def check_journal(table: Any) -> str | None:
    """A problem in words if ``table`` has journal records not yet applied (a read-only open)."""
    path = Path(table.root) / JOURNAL_FILE
    if path.exists() and path.stat().st_size:
        return (f"{path}: holds row write-backs of an interrupted run, not yet applied; open the table for writing "
                "(EmbeddingTable(root)) to apply them")  # fmt: skip
    return None

