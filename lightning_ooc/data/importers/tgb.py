"""TGB's dynamic link property prediction datasets (``tgbl-wiki``, ``tgbl-review``, ``tgbl-coin``, ...).

The directory holds what TGB downloads for a dataset ``NAME``: the event list ``NAME_edgelist.csv`` (or
``NAME_edgelist_v2.csv``) and the fixed negatives of its evaluation, ``NAME_val_ns.pkl`` and
``NAME_test_ns.pkl`` (``_v2`` likewise):

* the CSV has a header line, then one event per line: its source, its destination and its timestamp
  (``tgbl-wiki``: ``user_id,item_id,timestamp,...``; ``tgbl-coin``/``review``: ``timestamp,src,dst,...``;
  the columns are found by the header's names, ``--tgb-columns`` names them otherwise), other columns
  (labels, weights, edge features) are not imported;
* node ids become TGB's: ``--tgb-ids bipartite`` adds the largest source id plus one to every destination
  (wiki, subreddit, lastfm: TGB's ``load_edgelist_wiki``, users and items in ranges of their own);
  ``first-seen`` numbers each id at its first appearance, line by line, source before destination (coin,
  review, comment, flight: TGB's ``csv_to_pd_data_*``); ``as-given`` keeps integer ids as they are. The
  default follows the dataset's name;
* a negatives file is a pickled dict ``(src, dst, timestamp) -> array of negative destinations``, keyed by
  TGB's ids: it is read with an unpickler that builds nothing but NumPy arrays and plain values, and every
  validation and test event must find its negatives there (else the ids were numbered otherwise: the error
  says which option to try).

What is written: every event is an edge of the stored graph, at its time (``edge_time``, each node's
in-edges in time order; with their reverses by default, as TGB's models look at both endpoints' histories),
and TGB's chronological split: ``val_time, test_time = quantile(timestamps, [0.70, 0.85])``, train the
events at or before ``val_time``, validation those after it up to ``test_time``, test the later ones, as
link splits of the events (``time``: the event's timestamp minus one, so an event's subgraph holds only what
happened strictly before it; validation and test with their TGB negatives as ``neg_dst``: a batch ranks
each event's destination against them, TGB's MRR). Timestamps must be whole numbers. TGB's link datasets
have no node features: every node gets one constant feature (train with learnable features,
``features=Learnable(...)``, or on the structure).
"""
from __future__ import annotations

import csv
import io
import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np

from lightning_ooc.data.edge_sources import ArrayEdgeSource
from lightning_ooc.data.importers.common import ImportOptions
from lightning_ooc.data.link_splits import chronological_masks
from lightning_ooc.errors import InputError
from lightning_ooc.utils.progress import progress_bar

log = logging.getLogger("lightning_ooc")

NAME = "tgb"
#: how ids are numbered (``--tgb-ids``)
ID_RULES = ("as-given", "first-seen", "bipartite")
#: TGB's split: the quantiles of the timestamps that end training and validation
VAL_RATIO = TEST_RATIO = 0.15
_EDGES = re.compile(r"^(?P<name>.+)_edgelist(?P<version>_v\d+)?\.csv$")


def _files(root: Path) -> tuple[Path, Path, Path] | None:
    """The event list and the two negatives files of the dataset in ``root`` (None: not this layout)."""
    for f in sorted(root.glob("*_edgelist*.csv")):
        m = _EDGES.match(f.name)
        if not m:
            continue
        stem = m["name"] + "_{}_ns" + (m["version"] or "") + ".pkl"
        val, test = root / stem.format("val"), root / stem.format("test")
        if val.is_file() and test.is_file():
            return f, val, test
    return None


def detect(root: Path) -> str | None:
    found = _files(root)
    return None if found is None else f"it holds {found[0].name} with {found[1].name} and {found[2].name}"


def default_ids(name: str) -> str:
    """TGB's numbering of a dataset's ids, by its name (``--tgb-ids``'s default)."""
    return "bipartite" if any(k in name for k in ("wiki", "subreddit", "lastfm", "uci", "enron")) else "first-seen"


def _columns(header: list[str], given: str | None) -> tuple[int, int, int]:
    """Positions of the source, destination and time columns: named (``--tgb-columns src,dst,time`` or
    ``time,src,dst``: their order among the first three), or found by the header's names."""
    if given:
        order = [c.strip() for c in given.split(",")]
        if sorted(order) != ["dst", "src", "time"]:
            raise InputError(f"--tgb-columns names the first three columns' roles, e.g. src,dst,time or time,src,dst; "
                             f"got {given!r}")  # fmt: skip
        return order.index("src"), order.index("dst"), order.index("time")
    names = [h.strip().lower() for h in header[:3]]
    timed = [i for i, h in enumerate(names) if "time" in h or h in ("ts", "t", "day", "date")]
    if len(timed) != 1:
        raise InputError(f"cannot tell the time column from the header {header[:3]}; name the first three columns' "
                         "roles with --tgb-columns src,dst,time (or time,src,dst)")  # fmt: skip
    rest = [i for i in range(3) if i != timed[0]]
    return rest[0], rest[1], timed[0]


def read_events(path: Path, ids: str, columns: str | None = None,
                progress: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:  # fmt: skip
    """``(src, dst, time, num_nodes)`` of the event list, ids numbered by rule ``ids``."""
    if ids not in ID_RULES:
        raise InputError(f"--tgb-ids must be one of {', '.join(ID_RULES)}, got {ids!r}")
    src: list[Any] = []
    dst: list[Any] = []
    time: list[str] = []
    with open(path, newline="") as f, progress_bar(None, f"read {path.name}", "event", progress) as bar:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise InputError(f"{path}: empty; a TGB event list has a header line and one event per line")
        si, di, ti = _columns(header, columns)
        need = max(si, di, ti)
        seen = 0
        for line, row in enumerate(reader, start=2):
            if len(row) <= need:
                if not row:
                    continue
                raise InputError(f"{path}:{line}: {len(row)} columns, but the source, destination and time are "
                                 f"columns {si + 1}, {di + 1} and {ti + 1}")  # fmt: skip
            src.append(row[si])
            dst.append(row[di])
            time.append(row[ti])
            seen += 1
            if seen % 65536 == 0:
                bar.update(65536)
    t = _whole_times(time, path)
    if ids == "first-seen":
        numbers: dict[str, int] = {}
        s = np.empty(len(src), np.int64)
        d = np.empty(len(dst), np.int64)
        for k, (a, b) in enumerate(zip(src, dst)):
            s[k] = numbers.setdefault(a.strip(), len(numbers))
            d[k] = numbers.setdefault(b.strip(), len(numbers))
        n = len(numbers)
    else:
        s, d = _integer_ids(src, path, "source"), _integer_ids(dst, path, "destination")
        if ids == "bipartite" and s.size:
            d = d + int(s.max()) + 1
        n = int(max(s.max(initial=-1), d.max(initial=-1))) + 1
    return s, d, t, n


def _integer_ids(values: list[str], path: Path, what: str) -> np.ndarray:
    try:
        a = np.array([int(float(v)) for v in values], dtype=np.int64)
    except ValueError:
        bad = next(v for v in values if not _is_number(v))
        raise InputError(f"{path}: {what} id {bad!r} is not an integer; with ids that are names use "
                         "--tgb-ids first-seen") from None  # fmt: skip
    if a.size and a.min() < 0:
        raise InputError(f"{path}: a {what} id is negative ({int(a.min())})")
    return a


def _is_number(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


def _whole_times(values: list[str], path: Path) -> np.ndarray:
    try:
        f = np.array(values, dtype=np.float64)
    except ValueError:
        bad = next(v for v in values if not _is_number(v))
        raise InputError(f"{path}: timestamp {bad!r} is not a number") from None
    if f.size and not np.all(f == np.floor(f)):
        k = int(np.flatnonzero(f != np.floor(f))[0])
        raise InputError(f"{path}: timestamp {values[k]!r} (event {k + 1}) is not a whole number; temporal sampling "
                         "compares int64 times: scale them to integers first")  # fmt: skip
    return f.astype(np.int64)


class _ArraysOnly(pickle.Unpickler):
    """Builds NumPy arrays, dtypes and plain values only: a negatives file names nothing else, and anything else
    would run code the file chooses."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("builtins", "dict"), ("builtins", "list"),
        ("builtins", "tuple"), ("builtins", "int"), ("builtins", "float"), ("_codecs", "encode"),
        ("collections", "OrderedDict"), ("collections", "defaultdict"),
    }  # fmt: skip

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a NumPy array or a plain value")


def load_negatives(path: Path) -> dict[tuple[int, int, int], np.ndarray]:
    """TGB's negatives file: ``(src, dst, timestamp) -> negative destinations``, keys as ints."""
    try:
        with open(path, "rb") as f:
            raw = _ArraysOnly(io.BufferedReader(f)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise InputError(f"{path}: not a TGB negatives file ({e})") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path}: expected a dict (src, dst, timestamp) -> negative destinations, got "
                         f"{type(raw).__name__}")  # fmt: skip
    out = {}
    for key, value in raw.items():
        if not isinstance(key, tuple) or len(key) != 3:
            raise InputError(f"{path}: a key is {key!r}; TGB's keys are (src, dst, timestamp)")
        out[(int(key[0]), int(key[1]), int(float(key[2])))] = np.asarray(value).reshape(-1).astype(np.int64)
    return out


def negatives_of(path: Path, src: np.ndarray, dst: np.ndarray, t: np.ndarray, num_nodes: int, ids: str,
                 split: str) -> np.ndarray:  # fmt: skip
    """The ``(M, K)`` negative destinations of a split's events, from TGB's file (``K``: the fewest any event has,
    where counts differ, with a warning)."""
    table = load_negatives(path)
    rows = []
    for k, key in enumerate(zip(src.tolist(), dst.tolist(), t.tolist())):
        neg = table.get(key)
        if neg is None:
            others = [r for r in ID_RULES if r != ids]
            raise InputError(f"{path}: no negatives for {split} event {k} ({key[0]} -> {key[1]} at {key[2]}), so its "
                             f"ids are not numbered as TGB numbered them here; try --tgb-ids "
                             f"{' or '.join(others)} (now {ids})")  # fmt: skip
        rows.append(neg)
    if not rows:
        return np.empty((0, 1), np.int64)
    counts = {r.size for r in rows}
    k = min(counts)
    if len(counts) > 1:
        log.warning("%s: events have %d to %d negatives; each keeps its first %d (the MRR is over %d)", path,
                    min(counts), max(counts), k, k)  # fmt: skip
    out = np.stack([r[:k] for r in rows])
    if out.size and (out.min() < 0 or out.max() >= num_nodes):
        raise InputError(f"{path}: a negative destination is outside the {num_nodes} nodes (ids numbered otherwise? "
                         "--tgb-ids)")  # fmt: skip
    return out


def write(out: str | os.PathLike, root: Path, opts: ImportOptions) -> Path:
    from lightning_ooc.data.prepare import _common_source, _prepare  # lazy: prepare imports the importers' users

    found = _files(root)
    if found is None:
        raise InputError(f"{root}: no TGB dataset: expected NAME_edgelist.csv (or _v2) with NAME_val_ns.pkl and "
                         "NAME_test_ns.pkl beside it")  # fmt: skip
    edges_csv, val_ns, test_ns = found
    name = _EDGES.match(edges_csv.name)["name"]
    ids = opts.extra.get("tgb_ids") or default_ids(name)
    src, dst, t, n = read_events(edges_csv, ids, opts.extra.get("tgb_columns"), opts.progress)
    if src.size == 0:
        raise InputError(f"{edges_csv}: holds no event")
    order = np.argsort(t, kind="stable")  # TGB's lists are in time order already; the split assumes it
    src, dst, t = src[order], dst[order], t[order]
    train, val, test = chronological_masks(t, (1 - VAL_RATIO - TEST_RATIO, VAL_RATIO, TEST_RATIO))
    links: dict[str, dict[str, Any]] = {}
    for split, mask, ns in (("train", train, None), ("val", val, val_ns), ("test", test, test_ns)):
        fields: dict[str, Any] = {"index": np.stack([src[mask], dst[mask]]), "time": t[mask] - 1}
        if ns is not None:
            fields["neg_dst"] = negatives_of(ns, src[mask], dst[mask], t[mask], n, ids, split)
        links[split] = fields
    add_reverse = True if opts.add_reverse is None else bool(opts.add_reverse)
    source = _common_source(input="tgb", root=str(root.absolute()), dataset=name, ids=ids,
                            split="chronological 0.70/0.15/0.15 (TGB)", add_reverse=add_reverse)  # fmt: skip
    ei = np.stack([src, dst])
    note = ("every event at its time (TGB's streaming history); a supervision event's time is its timestamp minus "
            "one, so temporal sampling (time_attr='edge_time') sees only earlier events")  # fmt: skip
    return _prepare(
        out, lambda w: ArrayEdgeSource(ei, name=str(edges_csv), times=t), np.ones((n, 1), np.float32), None, {},
        num_classes=None, feature_dtype=opts.feature_dtype, add_reverse=add_reverse, drop_self_loops=False,
        drop_duplicates=False, split=None, seed=opts.seed, overwrite=opts.overwrite, progress=opts.progress,
        source=source, link_splits=links, link_note=note, neighbor_order="edge_time",
    )  # fmt: skip
