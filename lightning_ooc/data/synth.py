"""Deterministic generator of large, learnable synthetic graphs.

The model is a degree-corrected planted partition:

* every node gets a class (uniform over ``num_classes``) and an out-weight
  ``w`` drawn from a Pareto law with the given exponent;
* every node ``v`` gets an in-degree drawn from a discrete power law with
  exponent ``degree_exponent`` and mean ``avg_degree``;
* each in-edge of ``v`` picks its source in ``v``'s class with probability
  ``homophily`` and among all nodes otherwise, in both cases with probability
  proportional to ``w`` (so out-degrees are heavy-tailed too); self-loops and
  repeated edges are dropped;
* features are the class centre plus Gaussian noise: strong enough that an MLP
  on the features alone is clearly worse than a GNN that also averages the
  neighbours (which, by homophily, are mostly of the same class);
* splits are drawn per node: ``train_frac`` (default 1 %, as in Papers100M),
  ``val_frac`` and ``test_frac``.

With ``temporal=True`` the graph has time (for temporal sampling, PyG's ``time_attr``): every node ``v`` gets
a time ``t_v`` (uniform over ``[0, time_span)``), and every in-edge a time of its own (uniform over the same
span), stored as ``edge_time`` with each node's in-edges in time order. An in-edge no later than its target's
time (the past) picks its source in the target's class with probability ``homophily``; a later one (the
future) with probability ``future_homophily`` (0.95). Each split's seeds are predicted at their node's time
(``{split}_time``). So a model that sees a seed's future neighbours (sampling without time) scores visibly
higher than one that sees only its past: the gap is the leak.

Everything is generated in fixed-size node chunks, each with its own random
stream derived from ``seed``, so the output is byte-identical for the same
arguments whatever the machine, and memory stays bounded: about 45 bytes per
node for the sampling tables plus one chunk (see ``docs/format.md``).
Edges come out grouped by target, so the CSC streams straight to disk.

Example::

    >>> import tempfile, lightning_ooc
    >>> from lightning_ooc.data.synth import synthesize
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=2000, avg_degree=8, num_features=16,
    ...                   num_classes=5, seed=1, progress=False)
    >>> ds = lightning_ooc.open_dataset(root)
    >>> ds.num_nodes, ds.num_classes, len(ds.split("train"))
    (2000, 5, 22)
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, TypeVar

import numpy as np

from lightning_ooc.data.format import FEATURE_DTYPES, feature_dtype_name, index_dtype
from lightning_ooc.data.writer import DatasetWriter
from lightning_ooc.errors import InputError
from lightning_ooc.utils.progress import progress_bar

log = logging.getLogger("lightning_ooc")

#: Nodes per generation chunk. Part of the output's definition: changing it changes the bytes.
CHUNK = 1 << 16
T = TypeVar("T")

# Random stream ids.
_CLASS, _WEIGHT, _EDGES, _FEATS, _SPLIT, _CENTRES, _TIME = range(7)


def _rng(seed: int | tuple[int, ...], stream: int, chunk: int = 0) -> np.random.Generator:
    """The random stream ``stream`` of node chunk ``chunk``; ``seed`` is the user's seed, or a tuple of it and a
    part's number (the node types and relations of a heterogeneous graph draw from streams of their own)."""
    base = list(seed) if isinstance(seed, tuple) else [seed]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([*base, stream, chunk])))


def _chunks(n: int) -> Iterator[tuple[int, int, int]]:
    for i, lo in enumerate(range(0, n, CHUNK)):
        yield i, lo, min(n, lo + CHUNK)


#: threads that draw chunks at once (each chunk has its own random stream: the files do not depend on it)
WORKERS = max(1, min(8, os.cpu_count() or 1))
#: bytes of drawn chunks waiting to be written, at most (about)
AHEAD_BYTES = 512 << 20


def _in_order(fn: Callable[[int, int, int], T], n: int, chunk_bytes: int) -> Iterator[T]:
    """``fn(i, lo, hi)`` of every chunk of ``n`` rows, in chunk order, drawn by :data:`WORKERS` threads a few
    chunks ahead of the consumer (NumPy's generators, sorts and searches release the GIL); an error in a
    chunk is raised here, at its turn.

        >>> list(_in_order(lambda i, lo, hi: (i, hi - lo), CHUNK * 2 + 5, 1))
        [(0, 65536), (1, 65536), (2, 5)]
    """
    chunks = list(_chunks(n))
    ahead = max(1, min(2 * WORKERS, AHEAD_BYTES // max(chunk_bytes, 1)))
    if WORKERS == 1 or len(chunks) < 2:
        for c in chunks:
            yield fn(*c)
        return
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="looc-synth")
    try:
        pending: deque[Future[T]] = deque()
        it = iter(chunks)
        for c in it:
            pending.append(pool.submit(fn, *c))
            if len(pending) >= ahead:
                break
        while pending:
            out = pending.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(fn, *nxt))
            yield out
    finally:
        for fut in pending:
            fut.cancel()
        pool.shutdown(wait=True)


def synthesize(
    out: str | os.PathLike,
    *,
    num_nodes: int,
    avg_degree: float,
    num_features: int,
    num_classes: int,
    seed: int = 0,
    degree_exponent: float = 2.5,
    homophily: float = 0.7,
    class_separation: float = 2.0,
    feature_noise: float = 1.0,
    train_frac: float = 0.01,
    val_frac: float = 0.005,
    test_frac: float = 0.01,
    feature_dtype: str = "float32",
    overwrite: bool = False,
    progress: bool = True,
    temporal: bool = False,
    future_homophily: float = 0.95,
    time_span: int = 1000,
) -> Path:
    """Generate a synthetic graph into ``out`` and return its path.

    Args:
        num_nodes: number of nodes.
        avg_degree: target mean in-degree (before self-loops and repeats are dropped).
        num_features: feature dimension.
        num_classes: number of planted classes.
        seed: random seed; the same arguments and seed give byte-identical files.
        degree_exponent: exponent ``a > 2`` of the in-degree law ``P(d) ~ d^-a``; also
            used for the out-weights.
        homophily: probability that an edge joins two nodes of the same class.
        class_separation: norm of the class centres (features are centre + noise).
        feature_noise: standard deviation of the per-coordinate Gaussian noise.
        train_frac, val_frac, test_frac: fraction of nodes in each split.
        feature_dtype: ``float32``, ``float16`` or ``bfloat16``.
        overwrite: replace an existing dataset at ``out``.
        progress: show progress bars.
        temporal: give nodes and edges times (see the module docstring); ``homophily`` is then the past's.
        future_homophily: the homophily of in-edges later than their target's time (``temporal``).
        time_span: times lie in ``[0, time_span)`` (``temporal``).
    """
    check_finite(avg_degree=avg_degree, degree_exponent=degree_exponent, homophily=homophily,
                 class_separation=class_separation, feature_noise=feature_noise, train_frac=train_frac,
                 val_frac=val_frac, test_frac=test_frac, future_homophily=future_homophily)  # fmt: skip
    if temporal and (not 0 <= future_homophily <= 1 or isinstance(time_span, bool)
                     or not isinstance(time_span, (int, np.integer)) or time_span < 1):  # fmt: skip
        raise InputError(f"temporal graphs need future_homophily in [0, 1] and an integer time_span >= 1, got "
                         f"{future_homophily!r}, {time_span!r}")  # fmt: skip
    n, f, c = int(num_nodes), int(num_features), int(num_classes)
    dtype_name = _check_arguments(n, f, c, avg_degree, degree_exponent, homophily, train_frac, val_frac, test_frac,
                                  feature_dtype)  # fmt: skip
    t0 = time.perf_counter()
    params = dict(
        generator="lightning_ooc.synth", num_nodes=n, avg_degree=float(avg_degree), num_features=f,
        num_classes=c, seed=int(seed), degree_exponent=float(degree_exponent), homophily=float(homophily),
        class_separation=float(class_separation), feature_noise=float(feature_noise),
        train_frac=float(train_frac), val_frac=float(val_frac), test_frac=float(test_frac),
        feature_dtype=dtype_name,
    )  # fmt: skip
    if temporal:
        params.update(temporal=True, future_homophily=float(future_homophily), time_span=int(time_span))
    est = n * f * FEATURE_DTYPES[dtype_name][1].itemsize + int(n * avg_degree) * index_dtype(n).itemsize + 24 * n

    a = float(degree_exponent)
    labels, weights = _classes_and_weights(n, c, seed, a)
    tables = _source_tables(labels, weights, c)
    del weights
    splits = _split_ids(n, seed, train_frac, val_frac, test_frac)

    with DatasetWriter(
        out, num_nodes=n, num_features=f, num_classes=c, feature_dtype=dtype_name, overwrite=overwrite,
        source=params, progress=progress, estimated_bytes=est,
    ) as w:  # fmt: skip
        times = _node_times(n, seed, int(time_span)) if temporal else None
        if times is None:
            w.write_csc_segments(_edge_segments(labels, tables, seed, avg_degree, a, homophily, progress))
        else:
            w.write_csc_segments(_timed_edge_segments(labels, times, tables, seed, avg_degree, a, homophily,
                                                      float(future_homophily), int(time_span), progress),
                                 neighbor_order="edge_time")  # fmt: skip
            w.write_node_time(times[lo:hi] for _, lo, hi in _chunks(n))
        w.write_features(_feature_chunks(labels, f, c, seed, class_separation, feature_noise))
        w.write_labels(_label_chunks(labels))
        for name, ids in splits.items():
            w.write_split(name, ids, None if times is None else times[ids])
        path = w.commit()
    dt = time.perf_counter() - t0
    log.info(
        "synth: %d nodes, %d edges, dim %d in %.1f s (%.2f M edges/s) -> %s",
        n, w.num_edges, f, dt, (w.num_edges or 0) / max(dt, 1e-9) / 1e6, path,
    )  # fmt: skip
    return path


def check_finite(**values: float) -> None:
    """Raise :class:`InputError` naming the first argument that is not a finite number (NaN, infinity, a string).

    >>> check_finite(avg_degree=float("nan"))
    Traceback (most recent call last):
      ...
    lightning_ooc.errors.InputError: avg_degree must be a finite number, got nan
    """
    for name, v in values.items():
        try:
            ok = not isinstance(v, bool) and math.isfinite(float(v))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InputError(f"{name} must be a finite number, got {v!r}")
    if float(values.get("feature_noise", 0.0)) < 0:
        raise InputError(f"feature_noise must be >= 0 (a standard deviation), got {values['feature_noise']!r}")


def _check_arguments(
    n: int,
    f: int,
    c: int,
    avg_degree: float,
    degree_exponent: float,
    homophily: float,
    train_frac: float,
    val_frac: float,
    test_frac: float,
    feature_dtype: str,
) -> str:
    """Raise :class:`InputError` for arguments :func:`synthesize` cannot use; return the feature dtype's name."""
    if n < 1 or f < 1:
        raise InputError(f"need nodes and dim >= 1, got {n}, {f}")
    if c < 2:
        raise InputError(f"need classes >= 2 (node classification learns to tell classes apart), got {c}")
    if avg_degree < 0:
        raise InputError(f"avg_degree must be >= 0, got {avg_degree}")
    if degree_exponent <= 2:
        raise InputError(f"degree_exponent must be > 2 (the mean degree is infinite otherwise), got {degree_exponent}")
    if not 0 <= homophily <= 1:
        raise InputError(f"homophily must lie in [0, 1], got {homophily}")
    if min(train_frac, val_frac, test_frac) < 0 or train_frac + val_frac + test_frac > 1:
        raise InputError("split fractions must be >= 0 and add up to at most 1")
    try:
        return feature_dtype_name(feature_dtype)
    except ValueError as e:
        raise InputError(str(e)) from None


def _classes_and_weights(n: int, c: int, seed: int, a: float) -> tuple[np.ndarray, np.ndarray]:
    """The class of every node (uniform) and its out-weight (Pareto with exponent ``a``)."""
    labels = np.empty(n, dtype=np.int32 if c < 2**31 else np.int64)
    weights = np.empty(n, dtype=np.float64)
    for i, lo, hi in _chunks(n):
        labels[lo:hi] = _rng(seed, _CLASS, i).integers(0, c, hi - lo)
        weights[lo:hi] = (1.0 - _rng(seed, _WEIGHT, i).random(hi - lo)) ** (-1.0 / (a - 1.0))
    return labels, weights


class _SourceTables(NamedTuple):
    """Inverse-CDF tables that draw edge sources with probability proportional to their out-weight."""

    #: cumulative weight over all nodes
    cum_all: np.ndarray
    #: node ids sorted by class (stably), and the cumulative weight over them
    by_class: np.ndarray
    cum_class: np.ndarray
    #: class ``k`` holds ``by_class[class_start[k]:class_end[k]]``
    class_start: np.ndarray
    class_end: np.ndarray
    #: ``cum_class`` just before and at the end of each class's slice
    cum_lo: np.ndarray
    cum_hi: np.ndarray


def _source_tables(labels: np.ndarray, weights: np.ndarray, c: int) -> _SourceTables:
    """Global cumulative weight, and per-class cumulative weight over nodes sorted by class."""
    n = labels.size
    cum_all = np.cumsum(weights)
    by_class = np.argsort(labels, kind="stable").astype(index_dtype(n))
    cum_class = np.cumsum(weights[by_class])
    class_end = np.searchsorted(labels[by_class], np.arange(c), side="right")
    class_start = np.concatenate([[0], class_end[:-1]])
    cum_lo = np.where(class_start > 0, cum_class[np.maximum(class_start - 1, 0)], 0.0)
    cum_hi = np.where(class_end > 0, cum_class[np.maximum(class_end - 1, 0)], 0.0)
    return _SourceTables(cum_all, by_class, cum_class, class_start, class_end, cum_lo, cum_hi)


def _edge_segments(
    labels: np.ndarray,
    tables: _SourceTables,
    seed: int | tuple[int, ...],
    avg_degree: float,
    a: float,
    homophily: float,
    progress: bool,
    same_nodes: bool = True,
    what: str = "synth edges",
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The in-edges of each node chunk, as ``(in-degrees, sorted sources)`` for ``write_csc_segments``.

    ``labels`` are the targets' classes; the sources are drawn from ``tables``: the targets' own nodes
    (``same_nodes``: self-loops are dropped) or another node type's.
    """
    n_src = tables.cum_all.size
    # Discrete power-law in-degree with mean ~avg_degree: floor(xmin * U^(-1/(a-1))).
    xmin = (avg_degree + 0.5) * (a - 2.0) / (a - 1.0)
    def chunk(i: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        rng = _rng(seed, _EDGES, i)
        m = hi - lo
        deg = _in_degrees(rng, m, n_src if same_nodes else n_src + 1, avg_degree, xmin, a)
        local = np.repeat(np.arange(m, dtype=np.int64), deg)
        src = _draw_sources(rng, labels[lo:hi][local], tables, homophily)
        local_k, src_k = _drop_loops_and_repeats(local, src, lo if same_nodes else None, n_src)
        return np.bincount(local_k, minlength=m), src_k

    with progress_bar(labels.size, what, "node", progress) as bar:
        for deg, src in _in_order(chunk, labels.size, int(CHUNK * max(avg_degree, 1.0) * 48)):
            bar.update(deg.size)
            yield deg, src


def _node_times(n: int, seed: int | tuple[int, ...], span: int) -> np.ndarray:
    """The time of every node, uniform over ``[0, span)``."""
    times = np.empty(n, dtype=np.int64)
    for i, lo, hi in _chunks(n):
        times[lo:hi] = _rng(seed, _TIME, i).integers(0, span, hi - lo)
    return times


def _timed_edge_segments(labels: np.ndarray, times: np.ndarray, tables: _SourceTables, seed: int | tuple[int, ...],
                         avg_degree: float, a: float, homophily: float, future_homophily: float, span: int,
                         progress: bool, same_nodes: bool = True,
                         what: str = "synth edges") -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:  # fmt: skip
    """The in-edges of each node chunk with their times, ``(in-degrees, sources, times)`` in time order per
    node: an edge at or before its target's time has the past's homophily, a later one the future's.
    ``labels`` and ``times`` are the targets'; the sources are drawn from ``tables``: the targets' own nodes
    (``same_nodes``: self-loops are dropped) or another node type's. A repeated pair is kept (two edges at
    different times)."""
    n_src = tables.cum_all.size
    xmin = (avg_degree + 0.5) * (a - 2.0) / (a - 1.0)

    def chunk(i: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = _rng(seed, _EDGES, i)
        m = hi - lo
        deg = _in_degrees(rng, m, n_src if same_nodes else n_src + 1, avg_degree, xmin, a)
        local = np.repeat(np.arange(m, dtype=np.int64), deg)
        when = rng.integers(0, span, local.size)
        past = when <= times[lo:hi][local]
        src = _draw_sources(rng, labels[lo:hi][local], tables, np.where(past, homophily, future_homophily))
        if same_nodes:
            keep = src != local + lo
            local, src, when = local[keep], src[keep], when[keep]
        order = np.lexsort((src, when, local))
        return np.bincount(local, minlength=m), src[order], when[order]

    with progress_bar(labels.size, what, "node", progress) as bar:
        for deg, src, when in _in_order(chunk, labels.size, int(CHUNK * max(avg_degree, 1.0) * 64)):
            bar.update(deg.size)
            yield deg, src, when


def _in_degrees(rng: np.random.Generator, m: int, n: int, avg_degree: float, xmin: float, a: float) -> np.ndarray:
    """In-degrees of ``m`` nodes from the discrete power law (at most ``n - 1``)."""
    if avg_degree > 0:
        deg = np.floor(xmin * (1.0 - rng.random(m)) ** (-1.0 / (a - 1.0)))
        return np.minimum(deg, n - 1).astype(np.int64)
    return np.zeros(m, dtype=np.int64)


def _draw_sources(rng: np.random.Generator, cls: np.ndarray, tables: _SourceTables,
                  homophily: float | np.ndarray) -> np.ndarray:  # fmt: skip
    """One source per in-edge whose target has class ``cls``: in that class with probability ``homophily`` (one
    for all, or one per edge)."""
    total = cls.size
    n = tables.cum_all.size
    same = rng.random(total) < homophily
    u = rng.random(total)
    src = np.empty(total, dtype=np.int64)
    # Same class: inverse CDF over the class's slice of cum_class. Any class: over cum_all.
    # The targets are searched in sorted order (several times faster than random
    # order on large tables) and scattered back.
    t = np.where(same, tables.cum_lo[cls] + u * (tables.cum_hi[cls] - tables.cum_lo[cls]), u * tables.cum_all[-1])
    idx_same, idx_any = np.flatnonzero(same), np.flatnonzero(~same)
    for ids, table in ((idx_same, tables.cum_class), (idx_any, tables.cum_all)):
        order = ids[np.argsort(t[ids])]
        src[order] = np.searchsorted(table, t[order], side="right")
    c_same = cls[idx_same]
    src[idx_same] = tables.by_class[np.clip(src[idx_same], tables.class_start[c_same], tables.class_end[c_same] - 1)]
    src[idx_any] = np.minimum(src[idx_any], n - 1)
    return src


def _drop_loops_and_repeats(
    local: np.ndarray, src: np.ndarray, lo: int | None, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Edges ``src -> lo + local`` without self-loops and repeats, sorted by target then source (``lo=None``:
    sources of another node type, so no edge is a loop); ``n`` is the number of possible sources."""
    key = local * n + src
    key = np.sort(key if lo is None else key[src != local + lo])
    key = key[np.concatenate([[True], key[1:] != key[:-1]])] if key.size else key  # drop repeats
    return np.divmod(key, n)


def _feature_chunks(
    labels: np.ndarray, f: int, c: int, seed: int, class_separation: float, feature_noise: float
) -> Iterator[np.ndarray]:
    """Feature rows chunk by chunk: the node's class centre plus Gaussian noise."""
    centres = _rng(seed, _CENTRES).standard_normal((c, f)).astype(np.float32)
    centres *= class_separation / np.sqrt(f)

    def chunk(i: int, lo: int, hi: int) -> np.ndarray:
        noise = _rng(seed, _FEATS, i).standard_normal((hi - lo, f), dtype=np.float32)
        noise *= feature_noise
        noise += centres[labels[lo:hi]]
        return noise

    yield from _in_order(chunk, labels.size, CHUNK * f * 4)


def _label_chunks(labels: np.ndarray) -> Iterator[np.ndarray]:
    for _, lo, hi in _chunks(labels.size):
        yield labels[lo:hi]


def _split_ids(n: int, seed: int, train_frac: float, val_frac: float, test_frac: float) -> dict[str, np.ndarray]:
    """The node ids of each split, drawn per node."""
    splits: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
    for i, lo, hi in _chunks(n):
        u = _rng(seed, _SPLIT, i).random(hi - lo)
        ids = np.arange(lo, hi, dtype=np.int64)
        splits["train"].append(ids[u < train_frac])
        splits["val"].append(ids[(u >= train_frac) & (u < train_frac + val_frac)])
        splits["test"].append(ids[(u >= train_frac + val_frac) & (u < train_frac + val_frac + test_frac)])
    return {name: np.concatenate(parts) for name, parts in splits.items()}
