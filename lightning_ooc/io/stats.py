"""Counters of one gather."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReadStats:
    """What one gather asked for and what it cost.

    ``bytes_requested`` counts the distinct rows (duplicates are read once);
    ``bytes_read`` counts what the reads returned, aligned extents and merge
    gaps included, so :attr:`read_amplification` is the I/O overhead of the
    layout. ``num_ios`` is the number of reads issued (resubmissions of short
    reads included). For the ``mmap`` backend, which reads through page
    faults, ``bytes_read`` and ``num_ios`` are the distinct pages the rows
    span: a lower bound on what a cold cache costs (the kernel reads ahead).

    >>> s = ReadStats("uring", rows=4, unique_rows=3, bytes_requested=1200, bytes_read=2048, num_ios=3, seconds=0.5)
    >>> round(s.read_amplification, 3), s.rows_per_second
    (1.707, 8.0)
    """

    backend: str
    rows: int
    unique_rows: int
    bytes_requested: int
    bytes_read: int
    num_ios: int
    seconds: float

    @property
    def read_amplification(self) -> float:
        """``bytes_read / bytes_requested`` (0.0 for an empty gather)."""
        return self.bytes_read / self.bytes_requested if self.bytes_requested else 0.0

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @classmethod
    def from_job_stats(cls, backend: str, d: dict) -> "ReadStats":
        return cls(
            backend=backend,
            rows=int(d["rows"]),
            unique_rows=int(d["unique_rows"]),
            bytes_requested=int(d["bytes_requested"]),
            bytes_read=int(d["bytes_read"]),
            num_ios=int(d["num_ios"]),
            seconds=float(d["seconds"]),
        )
