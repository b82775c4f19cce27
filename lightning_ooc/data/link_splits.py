"""Link-prediction edge splits stored beside the graph (see ``docs/format.md``).

A dataset may hold, per split ``train``/``val``/``test``, the edges a link
predictor is supervised and evaluated on::

    link_{split}_index.npy     int64[M, 2]         (src, dst) of each supervision edge
    link_{split}_label.npy     float32|int64[M]    optional: its label, 1 (positive) or 0 (negative), as PyG's edge_label
    link_{split}_weight.npy    float32[M]          optional: its weight
    link_{split}_time.npy      int64[M]            optional: its timestamp
    link_{split}_neg_dst.npy   int64[M, K]         optional: K given negative destinations per edge,
                                                   each paired with the edge's source (as OGB's citation2)

and ``meta.json`` then has a ``link_splits`` key saying how many edges each
split holds, which fields it has, and which edges the stored graph
(``indptr``/``indices``, the message-passing graph) holds relative to them.
A dataset without link splits has none of these files and no such key.

This module holds the names, the :class:`LinkSplit` a dataset returns, the
checks of given splits, the search of supervision edges in the stored graph
:class:`EdgeSplit`, the seeded random split of an edge list, and :class:`TimedEdgeSplit`, the
chronological split of edges with times.

Example::

    >>> import numpy as np
    >>> s = check_link_split("val", 4, index=np.array([[0, 1], [2, 3]]), label=np.array([1, 0]))
    >>> s["index"].tolist(), s["label"].dtype
    ([[0, 2], [1, 3]], dtype('int64'))
    >>> indptr, indices = np.array([0, 0, 1, 1, 2]), np.array([0, 1])  # edges 0 -> 1 and 1 -> 3
    >>> in_graph(indptr, indices, np.array([0, 0, 1]), np.array([1, 2, 3])).tolist()
    [True, False, True]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from lightning_ooc.data.format import SPLITS
from lightning_ooc.errors import InputError

#: Optional per-edge fields of a link split, in file order.
LINK_FIELDS = ("label", "weight", "time", "neg_dst")
#: The meta.json key of the link splits.
LINK_META = "link_splits"
_FIELD_DTYPES = {
    "index": (np.dtype("<i8"),),
    "label": (np.dtype("<f4"), np.dtype("<i8")),
    "weight": (np.dtype("<f4"),),
    "time": (np.dtype("<i8"),),
    "neg_dst": (np.dtype("<i8"),),
}
_CHUNK = 1 << 20
#: Edge keys ``src * N + dst`` must fit in int64.
MAX_KEYED_NODES = 3_037_000_499


def link_key(split: str, field: str) -> str:
    """The ``files`` key of a link file (``"index"`` or one of :data:`LINK_FIELDS`).

    >>> link_key("val", "neg_dst"), link_file("val", "neg_dst")
    ('link_val_neg_dst', 'link_val_neg_dst.npy')
    """
    return f"link_{split}_{field}"


def link_file(split: str, field: str) -> str:
    return link_key(split, field) + ".npy"


#: Every name a link file may have (a dataset directory of ours may hold these).
LINK_FILE_NAMES = frozenset(link_file(s, f) for s in SPLITS for f in ("index",) + LINK_FIELDS)


@dataclass
class LinkSplit:
    """The supervision edges of one split, as tensors.

    ``index`` is ``[2, M]`` (row 0 sources, row 1 destinations, as PyG's
    ``edge_label_index``; a view of the ``(M, 2)`` file); the optional fields
    have ``M`` rows; ``neg_dst`` is ``[M, K]``: negative destinations paired
    with each edge's source.
    """

    index: torch.Tensor
    label: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    time: torch.Tensor | None = None
    neg_dst: torch.Tensor | None = None

    @property
    def num_edges(self) -> int:
        return int(self.index.shape[1])


# -- checks of given splits -------------------------------------------------------------
def _numpy(a: Any) -> np.ndarray:
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def first_bad_id(a: np.ndarray, n: int) -> tuple[tuple[int, ...], int] | None:
    """Position and value of the first id of ``a`` outside ``[0, n)`` (read in chunks), or None."""
    flat = a.reshape(-1)
    for s in range(0, flat.size, _CHUNK):
        part = np.asarray(flat[s : s + _CHUNK])
        bad = np.flatnonzero((part < 0) | (part >= n))
        if bad.size:
            return tuple(int(i) for i in np.unravel_index(s + int(bad[0]), a.shape)), int(part[bad[0]])
    return None


def bad_id_text(a: np.ndarray, n: int, field: str) -> str | None:
    """The first id outside ``[0, n)`` in words (``edge i is (s -> d)`` for an ``(M, 2)`` index), or None.

    >>> bad_id_text(np.array([[0, 1], [2, 7]]), 4, "index"), bad_id_text(np.array([[0, -2]]), 4, "neg_dst")
    ('edge 1 is (2 -> 7)', 'neg_dst[0, 1] is -2')
    """
    found = first_bad_id(a, n)
    if found is None:
        return None
    (i, *rest), v = found
    if field == "index":
        return f"edge {i} is ({int(a[i, 0])} -> {int(a[i, 1])})"
    return f"{field}[{', '.join(map(str, (i, *rest)))}] is {v}"


def check_ids(a: np.ndarray, n: int, what: str, field: str = "index") -> None:
    """Raise unless every id of ``a`` lies in ``[0, n)``, naming the first that does not."""
    bad = bad_id_text(a, n, field)
    if bad is not None:
        raise InputError(f"{what}: {bad}, but node ids must lie in [0, {n}) (the number of feature rows)")


def as_edge_pairs(a: Any, what: str) -> np.ndarray:
    """Edges given as ``(2, M)`` (PyG's layout) or ``(M, 2)`` as an int64 ``(M, 2)`` array; ``(2, 2)`` is ``(2, M)``."""
    a = _numpy(a)
    if a.ndim != 2 or 2 not in a.shape:
        raise InputError(f"{what}: edges must have shape (2, M) or (M, 2), got {tuple(a.shape)}")
    if a.size and a.dtype.kind not in "iu":
        raise InputError(f"{what}: node ids must be integers, got dtype {a.dtype}")
    pairs = a.T if a.shape[0] == 2 else a
    return np.ascontiguousarray(pairs, dtype=np.int64)


#: What a link label may be. Every reader of the labels takes each as a positive or a negative edge (the
#: link predictor's targets, ``label > 0``; the leakage check and the embedding buckets, ``label != 0``), so
#: anything else (NaN, 2, -1, 0.5) is read differently by each and silently wrong for all.
LABEL_RULE = "link labels must be 0 (a negative edge) or 1 (a positive one)"


def bad_label_text(label: Any) -> str | None:
    """The first link label that is not 0 or 1, and how many there are, in words (read in chunks); or None.

    >>> bad_label_text(np.array([1, 0, 2, 2])), bad_label_text(np.array([0.0, np.nan, 1.0]))
    ('label[2] is 2 (2 of the 4 labels are not 0 or 1)', 'label[1] is nan (1 of the 3 labels is not 0 or 1)')
    >>> bad_label_text(np.array([1.0, 0.0])) is None
    True
    """
    flat = _numpy(label).reshape(-1)
    count, first = 0, None
    for s in range(0, flat.size, _CHUNK):
        part = np.asarray(flat[s : s + _CHUNK])
        bad = (part != 0) & (part != 1)  # NaN compares unequal to both
        k = int(np.count_nonzero(bad))
        if k and first is None:
            i = int(np.flatnonzero(bad)[0])
            first = (s + i, part[i].item())
        count += k
    if first is None:
        return None
    verb = "is" if count == 1 else "are"
    return f"label[{first[0]}] is {first[1]} ({count:,} of the {flat.size:,} labels {verb} not 0 or 1)"


def _field(name: str, field: str, value: Any, m: int, file: str | None = None) -> np.ndarray:
    """One optional field checked against the split's ``m`` edges and cast to its stored dtype."""
    a = _numpy(value)
    what = f"link split {name}: {field}" + (f" ({file})" if file else "")
    if field == "neg_dst":
        if a.ndim != 2 or a.shape[0] != m or a.shape[1] < 1:
            raise InputError(f"{what} must have shape ({m}, K), K >= 1 negatives per edge, got {tuple(a.shape)}")
    elif a.ndim != 1 or a.shape[0] != m:
        raise InputError(f"{what} must have shape ({m},), one per edge of the split, got {tuple(a.shape)}")
    kind = a.dtype.kind
    if field == "label" and kind in "fiub":
        bad = bad_label_text(a)  # the values given, before the cast to the stored dtype
        if bad is not None:
            raise InputError(f"{what}: {bad}; {LABEL_RULE}")
        return np.ascontiguousarray(a, dtype=np.float32 if kind == "f" else np.int64)
    if field == "weight" and kind in "fiu":
        return np.ascontiguousarray(a, dtype=np.float32)
    if field in ("time", "neg_dst") and (kind in "iu" or not a.size):
        return np.ascontiguousarray(a, dtype=np.int64)
    want = {"label": "numbers", "weight": "numbers", "time": "integers", "neg_dst": "integer node ids"}[field]
    raise InputError(f"{what} must hold {want}, got dtype {a.dtype}")


def check_link_split(name: str, num_nodes: int, index: Any, *, files: dict[str, str] | None = None,
                     **fields: Any) -> dict[str, np.ndarray]:  # fmt: skip
    """Check one given split and return its arrays as stored (``index`` as ``(M, 2)`` int64).

    Raises :class:`~lightning_ooc.errors.InputError` naming the split and the field (and the file a
    field came from, where ``files`` names it). Labels must be 0 or 1 (:data:`LABEL_RULE`).
    """
    if name not in SPLITS:
        raise InputError(f"unknown link split {name!r}; splits are {', '.join(SPLITS)}")
    unknown = set(fields) - set(LINK_FIELDS)
    if unknown:
        raise InputError(f"link split {name}: unknown fields {sorted(unknown)}; known: index, {', '.join(LINK_FIELDS)}")
    if index is None:
        raise InputError(f"link split {name}: no index (the (src, dst) of its edges)")
    pairs = as_edge_pairs(index, f"link split {name}: index")
    check_ids(pairs, num_nodes, f"link split {name}")
    out = {"index": pairs}
    for field in LINK_FIELDS:
        if fields.get(field) is not None:
            out[field] = _field(name, field, fields[field], pairs.shape[0], (files or {}).get(field))
    if "neg_dst" in out:
        check_ids(out["neg_dst"], num_nodes, f"link split {name}", "neg_dst")
    return out


# -- meta.json ------------------------------------------------------------------------
def link_file_keys(link_meta: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(files key, split, field)`` of every link file that ``link_splits`` of meta.json names."""
    return [
        (link_key(s, f), s, f)
        for s, entry in link_meta["splits"].items()
        for f in ("index",) + tuple(entry["fields"])
    ]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_link_meta(link_meta: Any, bad: Callable[[str], Exception]) -> None:
    """Raise ``bad(what)`` unless ``link_splits`` of meta.json has the layout this reader uses."""
    if not isinstance(link_meta, dict):
        raise bad(f"{LINK_META} must be an object, got {type(link_meta).__name__}")
    if not isinstance(link_meta.get("message_passing"), str) or not isinstance(link_meta.get("leakage_free"), bool):
        raise bad(f"{LINK_META} needs 'message_passing' (a string) and 'leakage_free' (true or false), got "
                  f"{link_meta.get('message_passing')!r} and {link_meta.get('leakage_free')!r}")  # fmt: skip
    splits = link_meta.get("splits")
    if not isinstance(splits, dict) or not set(splits) <= set(SPLITS):
        raise bad(f"{LINK_META}.splits must map split names ({', '.join(SPLITS)}) to their entries, got {splits!r}")
    for s, e in splits.items():
        fields = e.get("fields") if isinstance(e, dict) else None
        if not isinstance(fields, list) or not set(fields) <= set(LINK_FIELDS) or len(set(fields)) != len(fields):
            raise bad(f"{LINK_META}.splits.{s}.fields must list fields among {', '.join(LINK_FIELDS)}, got {fields!r}")
        edges = e.get("edges")
        if not (_is_int(edges) and edges >= 0):
            raise bad(f"{LINK_META}.splits.{s}.edges must be an integer >= 0, got {edges!r}")
        k = e.get("neg_per_edge")
        if ("neg_dst" in fields) != (k is not None) or (k is not None and not (_is_int(k) and k >= 1)):
            raise bad(f"{LINK_META}.splits.{s}.neg_per_edge must be an integer >= 1 exactly when the split has "
                      f"neg_dst, got {k!r}")  # fmt: skip


def expected_shape(link_meta: dict[str, Any], split: str, field: str) -> tuple[tuple[np.dtype, ...], tuple[int, ...]]:
    """The dtypes allowed for a link file and its shape, from ``link_splits`` of meta.json."""
    entry = link_meta["splits"][split]
    m = int(entry["edges"])
    shape = {"index": (m, 2), "neg_dst": (m, int(entry.get("neg_per_edge") or 0))}.get(field, (m,))
    return _FIELD_DTYPES[field], shape


# -- supervision edges in the stored graph ---------------------------------------------------
def in_graph(indptr: np.ndarray, indices: np.ndarray, src: np.ndarray, dst: np.ndarray,
             sorted_neighbors: bool = True) -> np.ndarray:  # fmt: skip
    """Whether each edge ``src -> dst`` is in the in-edge CSC (ids in ``[0, N)``), vectorised.

    A binary search of ``src`` in the sorted sources of each ``dst``: about
    ``log2(max in-degree)`` gathers from ``indices`` per edge. Where the sources are not sorted by id (a
    CSC in time order), every in-edge of each ``dst`` is compared instead.
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    lo = np.asarray(indptr[dst], dtype=np.int64)
    end = np.asarray(indptr[dst + 1], dtype=np.int64)
    out = np.zeros(src.size, dtype=bool)
    if not len(indices):
        return out
    if not sorted_neighbors:
        deg = end - lo
        owner = np.repeat(np.arange(src.size), deg)
        pos = np.repeat(lo - np.concatenate([[0], np.cumsum(deg)[:-1]]), deg) + np.arange(int(deg.sum()))
        hit = np.asarray(indices[pos]) == src[owner]
        out[owner[hit]] = True
        return out
    hi = end.copy()
    last = len(indices) - 1
    active = lo < hi
    while active.any():
        mid = (lo + hi) // 2
        less = np.asarray(indices[np.minimum(mid, last)]) < src
        lo = np.where(active & less, mid + 1, lo)
        hi = np.where(active & ~less, mid, hi)
        active = lo < hi
    hit = np.flatnonzero(lo < end)
    out[hit] = np.asarray(indices[lo[hit]]) == src[hit]
    return out


def find_leaks(
    indptr: np.ndarray, indices: np.ndarray, pairs: np.ndarray, label: np.ndarray | None = None,
    sorted_neighbors: bool = True,
) -> tuple[int, int | None]:
    """How many positive edges of ``pairs`` (``(M, 2)``; label != 0 where labels exist) the graph holds, and the first.

    >>> find_leaks(np.array([0, 0, 1]), np.array([0]), np.array([[0, 1], [1, 0], [0, 1]]), np.array([0, 1, 1]))
    (1, 2)
    """
    count, first = 0, None
    for s in range(0, len(pairs), _CHUNK):
        p = np.asarray(pairs[s : s + _CHUNK])
        found = in_graph(indptr, indices, p[:, 0], p[:, 1], sorted_neighbors)
        if label is not None:
            found &= np.asarray(label[s : s + _CHUNK]) != 0
        hits = np.flatnonzero(found)
        count += hits.size
        if first is None and hits.size:
            first = s + int(hits[0])
    return count, first


# -- a random split of an edge list ------------------------------------------------------------
def split_fractions(fracs: Sequence[float]) -> tuple[float, float, float]:
    """Three fractions >= 0 adding up to 1 (train, val, test)."""
    fracs = tuple(float(f) for f in fracs)
    if len(fracs) != 3 or min(fracs) < 0 or abs(sum(fracs) - 1) > 1e-6:
        raise InputError(f"--split-edges takes three fractions >= 0 adding up to 1 (train,val,test), got {list(fracs)}")
    return fracs  # type: ignore[return-value]


def _keys(src: np.ndarray, dst: np.ndarray, n: int) -> np.ndarray:
    return src.astype(np.int64) * n + dst


def _held_out_positions(num_edges: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A uniform random ``k``-subset of ``[0, num_edges)``, sorted, in ``O(k)`` memory."""
    pos = np.unique(rng.integers(0, num_edges, k)) if k else np.empty(0, np.int64)
    while pos.size < k:
        more = rng.integers(0, num_edges, (k - pos.size) * 5 // 4 + 16)
        pos = np.unique(np.concatenate([pos, more]))
    if pos.size > k:  # a uniform subset of a uniform subset
        pos = np.sort(rng.choice(pos, k, replace=False))
    return pos


def _check_edge_ids(name: str, src: np.ndarray, dst: np.ndarray, start: int, n: int) -> None:
    for arr in (src, dst):
        if arr.size and arr.dtype.kind not in "iu":
            raise InputError(f"{name}: edge ids must be integers, got dtype {arr.dtype}")
    bad = np.flatnonzero((src < 0) | (src >= n) | (dst < 0) | (dst >= n))
    if bad.size:
        i = int(bad[0])
        raise InputError(f"{name}: edge {start + i} is ({int(src[i])} -> {int(dst[i])}) but node ids must "
                         f"lie in [0, {n}); check the node count (it comes from the feature matrix's rows)")


def chronological_masks(t: np.ndarray, fractions: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masks of the train, val and test parts of events at times ``t``, split at their time quantiles.

    Train holds the events at or before the ``fractions[0]`` quantile of ``t``, val those after it up to the
    ``fractions[0] + fractions[1]`` quantile, test the later ones (TGB's split, whose fractions are 0.70, 0.15,
    0.15). Events at one time fall in one part, so the parts' sizes may differ a little from the fractions.

    >>> [m.tolist() for m in chronological_masks(np.array([5, 1, 2, 3, 4, 6, 7, 8, 9, 10]), (0.7, 0.2, 0.1))]
    ... # doctest: +NORMALIZE_WHITESPACE
    [[True, True, True, True, True, True, True, False, False, False],
     [False, False, False, False, False, False, False, True, True, False],
     [False, False, False, False, False, False, False, False, False, True]]
    """
    fr = split_fractions(fractions)
    if t.size == 0:
        return (np.zeros(0, bool),) * 3  # type: ignore[return-value]
    val_time, test_time = np.quantile(t, [fr[0], min(1.0, fr[0] + fr[1])])
    return t <= val_time, (t > val_time) & (t <= test_time), t > test_time


class TimedEdgeSplit:
    """The chronological split of edges with times, itself an edge source: every edge, each at its time.

    The link splits are the edges themselves, cut at the time quantiles of
    ``fractions`` (:func:`chronological_masks`): train the earliest, val the
    next, test the latest, each supervised at its time minus one (``time``), so
    that temporal sampling (``time_attr="edge_time"``) shows an edge's subgraph
    only what happened strictly before it. The stored graph keeps every edge at
    its time, val and test ones too: sampled by time, a validation edge's
    subgraph holds the history up to it, the earlier validation edges included
    (TGB's streaming evaluation), and never the edge itself or anything later.
    Sampled without time, those edges leak (the note says so). The constructor
    reads the edges once and holds them (24 bytes an edge).

    Example::

        >>> from lightning_ooc.data.writer import ArrayEdgeSource
        >>> e = ArrayEdgeSource(np.array([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]]), times=np.array([50, 10, 20, 30, 40]))
        >>> sp = TimedEdgeSplit(e, (0.6, 0.2, 0.2), num_nodes=5)
        >>> {s: (v["index"].tolist(), v["time"].tolist()) for s, v in sp.links().items()}
        {'train': ([[1, 2], [2, 3], [3, 4]], [9, 19, 29]), 'val': ([[4, 0]], [39]), 'test': ([[0, 1]], [49])}
    """

    timed = True

    def __init__(self, edges: Any, fractions: Sequence[float], *, num_nodes: int, chunk_edges: int = 1 << 22):
        self.name = edges.name
        self.fractions = split_fractions(fractions)
        self.num_nodes = int(num_nodes)
        self.chunk_edges = int(chunk_edges)
        parts: list[tuple[np.ndarray, ...]] = []
        start = 0
        for src, dst, t in edges.chunks():
            src, dst = np.asarray(src), np.asarray(dst)
            _check_edge_ids(self.name, src, dst, start, self.num_nodes)
            parts.append((src.astype(np.int64, copy=False), dst.astype(np.int64, copy=False),
                          np.asarray(t, dtype=np.int64)))  # fmt: skip
            start += src.size
        src, dst, t = (np.concatenate([p[k] for p in parts]) if parts else np.empty(0, np.int64) for k in range(3))
        del parts
        if t.size and np.any(t[1:] < t[:-1]):  # the link splits in time order, as events are
            order = np.argsort(t, kind="stable")
            src, dst, t = src[order], dst[order], t[order]
        self._src, self._dst, self._time = src, dst, t
        self.num_edges = int(self._src.size)
        self._masks = dict(zip(SPLITS, chronological_masks(self._time, self.fractions)))

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Every edge with its time: the stored graph."""
        for s in range(0, self.num_edges, self.chunk_edges):
            e = slice(s, s + self.chunk_edges)
            yield self._src[e], self._dst[e], self._time[e]

    def links(self) -> dict[str, dict[str, np.ndarray]]:
        """``{split: {"index": (M, 2), "time": (M,)}}``: each part's edges and their supervision times."""
        return {s: {"index": np.stack([self._src[m], self._dst[m]], axis=1), "time": self._time[m] - 1}
                for s, m in self._masks.items()}  # fmt: skip

    def note(self) -> str:
        """What the stored graph holds, in words (the ``message_passing`` of meta.json)."""
        fr = ",".join(f"{f:g}" for f in self.fractions)
        return (f"every edge at its time, val/test edges too (prepare --split-edges {fr} on edges with times: a "
                "chronological split, each link edge supervised at its time minus one); sample with "
                "time_attr='edge_time', which shows a link edge's subgraph only earlier edges: without time, "
                "val/test edges leak")  # fmt: skip


class EdgeSplit:
    """The train part of a seeded random split of an edge list, itself an edge source.

    ``fractions`` (train, val, test) add up to 1; val gets ``round(val * E)``
    edges, test ``round(test * E)``, drawn uniformly without replacement. The
    constructor reads ``edges`` once and keeps the val and test edges
    (:meth:`held_out`); :meth:`chunks` then streams the other edges, as often
    as asked, minus every copy of a held-out edge (and, with ``reverse``,
    every edge whose reverse is held out, since the writer adds reverses), so
    a graph built from it holds no val/test edge. Those are the train edges.

    Example::

        >>> from lightning_ooc.data.writer import ArrayEdgeSource
        >>> e = ArrayEdgeSource(np.array([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]]))
        >>> sp = EdgeSplit(e, (0.6, 0.2, 0.2), seed=0, num_nodes=10)
        >>> [len(sp.held_out(s)) for s in ("val", "test")], sum(len(s) for s, _ in sp.chunks())
        ([2, 2], 6)
    """

    def __init__(self, edges: Any, fractions: Sequence[float], *, seed: int, num_nodes: int, reverse: bool = False):
        self.edges = edges
        self.name = edges.name
        self.fractions = split_fractions(fractions)
        self.seed = int(seed)
        self.reverse = bool(reverse)
        self.num_nodes = int(num_nodes)
        if self.num_nodes > MAX_KEYED_NODES:
            raise InputError(f"--split-edges handles graphs of up to {MAX_KEYED_NODES:,} nodes, got {self.num_nodes:,}")
        e = int(edges.num_edges)
        k_val, k_test = round(self.fractions[1] * e), round(self.fractions[2] * e)
        k_test = min(k_test, e - k_val)
        #: an upper bound of what :meth:`chunks` yields (the copies of held-out edges are dropped)
        self.num_edges = e - k_val - k_test
        #: train edges dropped by the last pass of :meth:`chunks` as copies (or reverses) of held-out edges
        self.dropped = 0
        self._held = self._collect(e, k_val, k_test)
        keys = [_keys(p[:, 0], p[:, 1], self.num_nodes) for p in self._held.values()]
        if self.reverse:
            keys += [_keys(p[:, 1], p[:, 0], self.num_nodes) for p in self._held.values()]
        self._keys = np.unique(np.concatenate(keys))

    def _collect(self, e: int, k_val: int, k_test: int) -> dict[str, np.ndarray]:
        """Read the edges once; return the val and test edges as ``(M, 2)`` int64 arrays, in input order."""
        rng = np.random.default_rng(self.seed)
        pos = _held_out_positions(e, k_val + k_test, rng)
        part = np.repeat(np.array([1, 2], dtype=np.int8), [k_val, k_test])
        rng.shuffle(part)
        out: dict[str, list[np.ndarray]] = {"val": [], "test": []}
        start = 0
        for src, dst in self.edges.chunks():
            src, dst = np.asarray(src), np.asarray(dst)
            self._check_ids(src, dst, start)
            a, b = np.searchsorted(pos, [start, start + src.size])
            local, which = pos[a:b] - start, part[a:b]
            for code, s in ((1, "val"), (2, "test")):
                sel = local[which == code]
                out[s].append(np.stack([src[sel], dst[sel]], axis=1).astype(np.int64))
            start += src.size
        if start != e:
            raise InputError(f"{self.name}: read {start:,} edges but it announced {e:,}")
        return {s: np.concatenate(v) if v else np.empty((0, 2), np.int64) for s, v in out.items()}

    def _check_ids(self, src: np.ndarray, dst: np.ndarray, start: int) -> None:
        _check_edge_ids(self.name, src, dst, start, self.num_nodes)

    def held_out(self, split: str) -> np.ndarray:
        """The ``(M, 2)`` edges of ``"val"`` or ``"test"``."""
        return self._held[split]

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The train edges, chunk by chunk: the input's, minus copies (and reverses) of held-out edges."""
        dropped = 0
        keys = self._keys
        for src, dst in self.edges.chunks():
            src = np.asarray(src).astype(np.int64, copy=False)
            dst = np.asarray(dst).astype(np.int64, copy=False)
            key = _keys(src, dst, self.num_nodes)
            if keys.size:
                i = np.minimum(np.searchsorted(keys, key), keys.size - 1)
                keep = keys[i] != key
                src, dst = src[keep], dst[keep]
                dropped += int(keep.size - keep.sum())
            yield src, dst
        held = sum(len(p) for p in self._held.values())
        self.dropped = dropped - held

    def note(self) -> str:
        """What the stored graph holds, in words (the ``message_passing`` of meta.json)."""
        fr = ",".join(f"{f:g}" for f in self.fractions)
        rev = " with their reverses" if self.reverse else ""
        how = "copies or reverses" if self.reverse else "copies"
        extra = f"; {self.dropped:,} more input edges dropped as {how} of them" if self.dropped else ""
        return f"train edges only: val/test edges removed{rev} (prepare --split-edges {fr}, seed {self.seed}){extra}"
