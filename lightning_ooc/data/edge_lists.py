"""CSV/TSV edge lists parsed in blocks of whole lines: ``src dst`` pairs (further columns ignored, or refused where
a file must hold exactly two), a header line skipped when asked or detected, errors naming the file and line.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np

from lightning_ooc.data.files import input_file
from lightning_ooc.errors import InputError
from lightning_ooc.utils.progress import progress_bar


_CSV_CHUNK_BYTES = 32 << 20


def _parse_csv_block(block: bytes, delim: bytes | None, path: Path, first_line: int, ncols: int | None,
                     columns: int | None = None, fix: str = ""):  # fmt: skip
    """Parse whole lines of an edge list into an int64 (lines, ncols) array; ``columns``: the only number of
    columns allowed (else any number from 2, the columns past the second ignored), ``fix`` saying what to do."""
    if delim is not None and delim.strip():
        block = block.replace(delim, b" ")
    lines = block.split(b"\n")
    if b"#" in block or b"%" in block or b"\r" in block:
        lines = [ln.split(b"#")[0].split(b"%")[0].strip() for ln in lines]
    nonblank = len(lines) - lines.count(b"")
    tokens = block.split() if not (b"#" in block or b"%" in block) else b" ".join(lines).split()
    if ncols is None:
        first = next((ln for ln in lines if ln.strip()), None)
        ncols = len(first.split()) if first is not None else 2
        if ncols < 2:
            raise InputError(f"{path}:{first_line}: an edge list line needs two node ids, got {first!r}")
        if columns is not None and ncols != columns:
            at = first_line + next(i for i, ln in enumerate(lines) if ln.strip())
            raise InputError(f"{path}:{at}: {ncols} columns ({first.decode(errors='replace')!r}); {fix}")
    if len(tokens) != ncols * nonblank:
        for i, ln in enumerate(lines):
            if ln.strip() and len(ln.split()) != ncols:
                raise InputError(
                    f"{path}:{first_line + i}: expected {ncols} columns like the first line, got {ln.decode(errors='replace')!r}"
                )
    cols = np.array(tokens, dtype=np.bytes_).reshape(-1, ncols)[:, :2]
    try:
        arr = cols.astype(np.int64)
    except (ValueError, OverflowError):
        for i, ln in enumerate(lines):
            for t in ln.split()[:2]:
                try:
                    v = int(t)
                except ValueError:
                    raise InputError(
                        f"{path}:{first_line + i}: {t.decode(errors='replace')!r} is not an integer node id"
                    ) from None
                if not -(1 << 63) <= v < 1 << 63:
                    raise InputError(f"{path}:{first_line + i}: node id {v} does not fit in 64 bits") from None
        raise
    return arr, ncols


def line_blocks(f, size: int) -> Iterator[tuple[bytes, int]]:
    """Blocks of whole lines of the binary file ``f``, read ``size`` bytes at a time: ``(block, bytes read for
    it)``; the last block holds what follows the last newline, if anything.

    >>> import io
    >>> [b for b, _ in line_blocks(io.BytesIO(b"1 2\\n3 4\\n5 6"), 5)]
    [b'1 2\\n', b'3 4\\n', b'5 6']
    """
    rest = b""
    while True:
        data = f.read(size)
        block = rest + data
        if data:
            cut = block.rfind(b"\n")
            if cut < 0:
                rest = block
                continue
            block, rest = block[: cut + 1], block[cut + 1 :]
        else:
            rest = b""
        yield block, len(data)
        if not data:
            return


def _edge_list_blocks(path: Path, delimiter: str | None, header: str, progress: bool, columns: int | None = None,
                      fix: str = "") -> Iterator[np.ndarray]:  # fmt: skip
    """The edges of a CSV/TSV/whitespace edge list as int64 ``(lines, 2)`` blocks, read a chunk at a time."""
    input_file(path, "the edge list", f"{path}: edge list not found")
    if delimiter is None:
        delimiter = {".csv": ",", ".tsv": "\t"}.get(path.suffix.lower())
    return _parse_edge_list(path, delimiter.encode() if delimiter else None, header, progress, columns, fix)


def _parse_edge_list(path: Path, delim: bytes | None, header: str, progress: bool, columns: int | None = None,
                     fix: str = "") -> Iterator[np.ndarray]:  # fmt: skip
    ncols = None
    line_no = 1
    with open(path, "rb") as f, progress_bar(path.stat().st_size, f"read {path.name}", "B", progress) as bar:
        first = True
        for block, data in line_blocks(f, _CSV_CHUNK_BYTES):
            if first:
                first = False
                head, _, tail = block.partition(b"\n")
                probe = (head.replace(delim, b" ") if delim and delim.strip() else head).split()
                is_header = bool(probe) and not all(t.lstrip(b"-").isdigit() for t in probe) and not head.lstrip().startswith((b"#", b"%"))
                if header == "yes" or (header == "auto" and is_header):
                    block = tail
                    line_no += 1
            if block.strip():
                arr, ncols = _parse_csv_block(block, delim, path, line_no, ncols, columns, fix)
                yield np.ascontiguousarray(arr[:, :2])
            line_no += block.count(b"\n")
            bar.update(data)


def edge_list_to_pairs(path: str | os.PathLike, dest: Path, delimiter: str | None = None,
                       header: str = "auto", progress: bool = True) -> int:  # fmt: skip
    """Convert a CSV/TSV/whitespace edge list to raw int64 (src, dst) pairs in ``dest``; returns the edge count.

    Lines starting with ``#`` or ``%`` are comments; extra columns (weights)
    are ignored; a first line that is not numeric is taken as a header when
    ``header="auto"``.
    """
    blocks = _edge_list_blocks(Path(path), delimiter, header, progress)
    count = 0
    with open(dest, "wb") as out:
        for pairs in blocks:
            out.write(memoryview(pairs).cast("B"))
            count += pairs.shape[0]
    return count


def read_edge_list(path: str | os.PathLike, delimiter: str | None = None, header: str = "auto",
                   columns: int | None = None, fix: str = "") -> np.ndarray:  # fmt: skip
    """A (small) edge list in memory as an int64 ``(M, 2)`` array, parsed as :func:`edge_list_to_pairs` parses;
    with ``columns``, a file of another number of columns is an InputError naming its first line (and ``fix``)."""
    blocks = list(_edge_list_blocks(Path(path), delimiter, header, progress=False, columns=columns, fix=fix))
    return np.concatenate(blocks) if blocks else np.empty((0, 2), np.int64)
