"""Deterministic heterogeneous graphs shaped like IGBH and MAG240M: ``synth --hetero igbh|mag``.

The model is :mod:`lightning_ooc.data.synth`'s planted partition across node
types: every node of every type has a latent class (uniform) and a Pareto
out-weight; each relation ``(src, rel, dst)`` gives every destination node a
power-law number of in-edges whose sources are drawn from the source type, in
the destination's class with probability ``homophily``, weighted by
out-weight. Features of a type are its class centre plus Gaussian noise (each
type has centres of its own dimension); labels are stored on the target type
only (``paper``). So a relational GNN learns from a paper's authors, topics
and citations, as on the real graphs.

The schemas follow the public datasets' node types, relations and feature
dimensions, with node and edge counts in their approximate proportions per
paper:

* ``igbh`` (IGBH, MLPerf Training's GNN benchmark): paper, author, institute,
  fos, journal, conference, every type with 1024-dim features; relations
  cites (stored in both directions), written_by, affiliated_to, topic,
  published, venue, each with its ``rev_`` reverse; 19 classes.
* ``mag`` (OGB-LSC MAG240M): paper (768-dim float16 features, 153 classes,
  labels only on the papers of the splits), author and institution (no
  features); relations writes, cites (both directions), affiliated_with, with
  ``rev_`` reverses.

``num_nodes`` counts papers; the other types scale with it (at least 2 nodes
each). ``num_features`` and ``feature_dtype`` override the schema's for every
type that has features; ``all_features=True`` (``--all-features``) gives the
bare types features too; ``temporal=True`` (``--temporal``) gives every type
node times and every relation edge times, as ``synth --temporal`` does for one
type. The output is byte-identical for the same arguments.

Example::

    >>> import tempfile, lightning_ooc
    >>> from lightning_ooc.data.synth_hetero import synthesize_hetero
    >>> root = synthesize_hetero(tempfile.mkdtemp() + "/h", "mag", num_nodes=3000, num_features=16,
    ...                          seed=0, progress=False)
    >>> ds = lightning_ooc.open_dataset(root)
    >>> ds.node_types, ds.target, ds.node("paper").num_features, ds.node("author").has_features
    (['paper', 'author', 'institution'], 'paper', 16, False)
    >>> ds.edge_types[:2]
    [('author', 'writes', 'paper'), ('paper', 'rev_writes', 'author')]
    >>> full = lightning_ooc.open_dataset(synthesize_hetero(tempfile.mkdtemp() + "/h", "mag", num_nodes=3000,
    ...                                   num_features=16, feature_dtype="float32", all_features=True, progress=False))
    >>> [full.node(t).num_features for t in full.node_types], full.node("author").feature_dtype
    ([16, 16, 16], torch.float32)
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from lightning_ooc.data.format import FEATURE_DTYPES, feature_dtype_name
from lightning_ooc.data.hetero_dataset import HeteroDatasetWriter, relation_key
from lightning_ooc.data.synth import (
    _classes_and_weights,
    _edge_segments,
    _feature_chunks,
    _label_chunks,
    _node_times,
    _source_tables,
    _split_ids,
    _timed_edge_segments,
    check_finite,
)
from lightning_ooc.errors import InputError
from lightning_ooc.data.edge_sources import DatasetEdgeSource

log = logging.getLogger("lightning_ooc")


@dataclass(frozen=True)
class NodeTypeSpec:
    name: str
    #: nodes of this type per paper
    per_paper: float
    #: feature dimension (0: no features)
    dim: int


@dataclass(frozen=True)
class RelationSpec:
    src: str
    rel: str
    dst: str
    #: edges per paper (before duplicates are dropped; a symmetric relation stores about twice as many)
    per_paper: float
    #: name of the reverse relation ``(dst, reverse, src)`` written beside it, or None
    reverse: str | None = None
    #: stored in both directions in the same relation (``src == dst``)
    symmetric: bool = False


@dataclass(frozen=True)
class HeteroSchema:
    node_types: tuple[NodeTypeSpec, ...]
    relations: tuple[RelationSpec, ...]
    num_classes: int
    feature_dtype: str
    #: labels on every paper (True), or only on the papers of the splits (MAG240M's arXiv subset)
    label_all: bool


SCHEMAS: dict[str, HeteroSchema] = {
    "igbh": HeteroSchema(
        node_types=(
            NodeTypeSpec("paper", 1.0, 1024),
            NodeTypeSpec("author", 1.03, 1024),
            NodeTypeSpec("institute", 1.0e-4, 1024),
            NodeTypeSpec("fos", 2.65e-3, 1024),
            NodeTypeSpec("journal", 1.8e-4, 1024),
            NodeTypeSpec("conference", 1.7e-5, 1024),
        ),
        relations=(
            RelationSpec("paper", "cites", "paper", 7.4, symmetric=True),
            RelationSpec("paper", "written_by", "author", 2.66, reverse="rev_written_by"),
            RelationSpec("author", "affiliated_to", "institute", 0.1, reverse="rev_affiliated_to"),
            RelationSpec("paper", "topic", "fos", 3.9, reverse="rev_topic"),
            RelationSpec("paper", "published", "journal", 0.06, reverse="rev_published"),
            RelationSpec("paper", "venue", "conference", 0.02, reverse="rev_venue"),
        ),
        num_classes=19,
        feature_dtype="float32",
        label_all=True,
    ),
    "mag": HeteroSchema(
        node_types=(
            NodeTypeSpec("paper", 1.0, 768),
            NodeTypeSpec("author", 1.005, 0),
            NodeTypeSpec("institution", 2.1e-4, 0),
        ),
        relations=(
            RelationSpec("author", "writes", "paper", 3.17, reverse="rev_writes"),
            RelationSpec("paper", "cites", "paper", 5.33, symmetric=True),
            RelationSpec("author", "affiliated_with", "institution", 0.366, reverse="rev_affiliated_with"),
        ),
        num_classes=153,
        feature_dtype="float16",
        label_all=False,
    ),
}
_TARGET = "paper"


class _GeneratedEdges:
    """A relation's generated edges as an edge source (generated again on each pass; deterministic)."""

    def __init__(self, segments, num_edges: int, name: str, timed: bool = False):
        self._segments = segments  # () -> iterator of (in-degrees, sorted sources[, times]) per chunk of destinations
        self.num_edges = num_edges  # an estimate: only progress bars use it
        self.name = name
        #: whether the segments and chunks carry each edge's time
        self.timed = timed

    def chunks(self) -> Iterator[tuple[np.ndarray, ...]]:
        lo = 0
        for counts, src, *when in self._segments():
            dst = np.repeat(np.arange(lo, lo + counts.size, dtype=np.int64), counts)
            lo += counts.size
            yield (np.asarray(src, dtype=np.int64), dst, *when)


def hetero_node_counts(schema: HeteroSchema, num_papers: int) -> dict[str, int]:
    """Nodes per type for ``num_papers`` papers (each type at least 2).

    >>> hetero_node_counts(SCHEMAS["mag"], 100000)
    {'paper': 100000, 'author': 100500, 'institution': 21}
    """
    return {t.name: max(2, int(round(t.per_paper * num_papers))) for t in schema.node_types}


def synthesize_hetero(
    out: str | os.PathLike,
    schema: str,
    *,
    num_nodes: int,
    num_features: int | None = None,
    num_classes: int | None = None,
    feature_dtype: str | None = None,
    degree_scale: float = 1.0,
    seed: int = 0,
    degree_exponent: float = 2.5,
    homophily: float = 0.7,
    class_separation: float = 2.0,
    feature_noise: float = 1.0,
    train_frac: float = 0.01,
    val_frac: float = 0.005,
    test_frac: float = 0.01,
    overwrite: bool = False,
    progress: bool = True,
    all_features: bool = False,
    temporal: bool = False,
    future_homophily: float = 0.95,
    time_span: int = 1000,
) -> Path:
    """Generate a heterogeneous graph of ``schema`` (``"igbh"`` or ``"mag"``) into ``out``; return its path.

    Args:
        num_nodes: number of papers (the target type); the other types scale with it.
        num_features: feature dimension of every type with features (default: the schema's, 1024 / 768).
        num_classes: classes of the papers (default: the schema's, 19 / 153).
        feature_dtype: default the schema's (float32 / float16).
        degree_scale: multiplies every relation's edges per paper.
        seed, degree_exponent, homophily, class_separation, feature_noise, train_frac, val_frac,
        test_frac: as for :func:`~lightning_ooc.data.synth.synthesize` (the splits are of papers).
        all_features: give the types the schema leaves without features (MAG240M's author and institution)
            features too, of the papers' width, from their own latent classes: what a model that reads ``x``
            of every node type (PyG's ``to_hetero``) needs.
        temporal, future_homophily, time_span: a graph with time, as
            :func:`~lightning_ooc.data.synth.synthesize` makes one: every node a time (``node_time`` of its
            type), every edge of every relation a time, each target's in-edges stored in time order
            (``neighbor_order="edge_time"`` per relation; a reverse relation carries its edges' times, a
            symmetric one keeps a pair seen at two times twice), edges later than their target more homophilous
            (``future_homophily``), and the papers' splits predicted at their node's time. Train with
            ``time={"time_attr": "edge_time"}``; sampling without time leaks the future.
    """
    if schema not in SCHEMAS:
        raise InputError(f"unknown heterogeneous schema {schema!r}; choose one of {', '.join(SCHEMAS)}")
    spec = SCHEMAS[schema]
    check_finite(degree_scale=degree_scale, degree_exponent=degree_exponent, homophily=homophily,
                 class_separation=class_separation, feature_noise=feature_noise, train_frac=train_frac,
                 val_frac=val_frac, test_frac=test_frac)  # fmt: skip
    n_papers = int(num_nodes)
    c = int(spec.num_classes if num_classes is None else num_classes)
    try:
        dtype = feature_dtype_name(spec.feature_dtype if feature_dtype is None else feature_dtype)
    except ValueError as e:
        raise InputError(str(e)) from None
    if n_papers < 2 or c < 2 or (num_features is not None and num_features < 1) or degree_scale < 0:
        raise InputError(f"need nodes >= 2, classes >= 2, dim >= 1 and degree_scale >= 0; got {n_papers}, {c}, "
                         f"{num_features}, {degree_scale}")  # fmt: skip
    if degree_exponent <= 2 or not 0 <= homophily <= 1:
        raise InputError("degree_exponent must be > 2 and homophily in [0, 1]")
    if min(train_frac, val_frac, test_frac) < 0 or train_frac + val_frac + test_frac > 1:
        raise InputError("split fractions must be >= 0 and add up to at most 1")
    if temporal and (not 0 <= future_homophily <= 1 or isinstance(time_span, bool)
                     or not isinstance(time_span, (int, np.integer)) or time_span < 1):  # fmt: skip
        raise InputError(f"temporal graphs need future_homophily in [0, 1] and an integer time_span >= 1, got "
                         f"{future_homophily!r}, {time_span!r}")  # fmt: skip
    t0 = time.perf_counter()
    counts = hetero_node_counts(spec, n_papers)
    paper_dim = int(num_features) if num_features is not None else next(t.dim for t in spec.node_types
                                                                        if t.name == _TARGET)  # fmt: skip
    dims = {t.name: (int(num_features) if num_features is not None and t.dim else t.dim) for t in spec.node_types}
    if all_features:  # the types the schema leaves bare get the papers' width, from their own latent classes
        dims = {name: dim or paper_dim for name, dim in dims.items()}
    params: dict[str, Any] = dict(
        generator="lightning_ooc.synth_hetero", schema=schema, num_nodes=n_papers, num_features=num_features,
        num_classes=c, feature_dtype=dtype, degree_scale=float(degree_scale), seed=int(seed),
        degree_exponent=float(degree_exponent), homophily=float(homophily),
        class_separation=float(class_separation), feature_noise=float(feature_noise), train_frac=float(train_frac),
        val_frac=float(val_frac), test_frac=float(test_frac), all_features=bool(all_features),
    )  # fmt: skip
    if temporal:
        params.update(temporal=True, future_homophily=float(future_homophily), time_span=int(time_span))
    node_types = {t: {"num_nodes": counts[t], "num_features": dims[t], "feature_dtype": dtype,
                      "num_classes": c if t == _TARGET else 0} for t in counts}  # fmt: skip
    edge_types = []
    for r in spec.relations:
        edge_types.append((r.src, r.rel, r.dst))
        if r.reverse:
            edge_types.append((r.dst, r.reverse, r.src))
    est_edges = sum(r.per_paper * (2 if r.reverse or r.symmetric else 1) for r in spec.relations) * n_papers
    est = int(sum(counts[t] * dims[t] * FEATURE_DTYPES[dtype][1].itemsize for t in counts)
              + est_edges * degree_scale * 12 + 40 * sum(counts.values()))  # fmt: skip
    a = float(degree_exponent)

    # Every type's latent classes and out-weights, each type from its own random streams.
    part_seed = {t.name: (int(seed), 1 + i) for i, t in enumerate(spec.node_types)}
    classes: dict[str, np.ndarray] = {}
    tables = {}
    for t in counts:
        classes[t], weights = _classes_and_weights(counts[t], c, part_seed[t], a)
        tables[t] = _source_tables(classes[t], weights, c)
        del weights
    splits = _split_ids(n_papers, part_seed[_TARGET], train_frac, val_frac, test_frac)
    times = {t: _node_times(counts[t], part_seed[t], int(time_span)) for t in counts} if temporal else None
    order = "edge_time" if temporal else "source_id"

    with HeteroDatasetWriter(out, node_types=node_types, edge_types=edge_types, target=_TARGET,
                             overwrite=overwrite, source=params, progress=progress, estimated_bytes=est) as w:
        for i, r in enumerate(spec.relations):
            rel_seed = (int(seed), 1 + len(spec.node_types) + i)
            avg_in = r.per_paper * degree_scale * n_papers / counts[r.dst]

            def segments(r=r, rel_seed=rel_seed, avg_in=avg_in):
                kw = dict(same_nodes=r.src == r.dst, what=f"synth {r.rel}")
                if times is None:
                    return _edge_segments(classes[r.dst], tables[r.src], rel_seed, avg_in, a, homophily, progress,
                                          **kw)  # fmt: skip
                return _timed_edge_segments(classes[r.dst], times[r.dst], tables[r.src], rel_seed, avg_in, a,
                                            homophily, float(future_homophily), int(time_span), progress, **kw)

            part = w.relation((r.src, r.rel, r.dst))
            if r.symmetric:  # with times a pair seen twice is two events: kept
                edges = _GeneratedEdges(segments, int(avg_in * counts[r.dst]), relation_key((r.src, r.rel, r.dst)),
                                        timed=temporal)  # fmt: skip
                part.write_edges(edges, add_reverse=True, drop_duplicates=not temporal, neighbor_order=order)
            else:
                part.write_csc_segments(segments(), neighbor_order=order)
            if r.reverse:
                indptr, indices = part.topology()
                csc = _Csc(indptr, indices, counts[r.dst], part.edge_time() if temporal else None)
                w.relation((r.dst, r.reverse, r.src)).write_edges(
                    DatasetEdgeSource(csc, reverse=True, name=f"{relation_key((r.src, r.rel, r.dst))} reversed"),
                    neighbor_order=order,
                )  # fmt: skip
        for t in counts:
            node = w.node(t)
            if times is not None:
                node.write_node_time([times[t]])
            if dims[t]:
                node.write_features(_feature_chunks(classes[t], dims[t], c, part_seed[t], class_separation,
                                                    feature_noise))  # fmt: skip
        paper = w.node(_TARGET)
        labels = classes[_TARGET].astype(np.int64)
        if not spec.label_all:  # labels only where a split needs them
            known = np.zeros(n_papers, dtype=bool)
            for ids in splits.values():
                known[ids] = True
            labels[~known] = -1
        paper.write_labels(_label_chunks(labels))
        for name, ids in splits.items():
            paper.write_split(name, ids, None if times is None else times[_TARGET][ids])
        path = w.commit()
    log.info("synth --hetero %s: %s nodes, %d relations in %.1f s -> %s", schema,
             sum(counts.values()), len(edge_types), time.perf_counter() - t0, path)  # fmt: skip
    return path


@dataclass
class _Csc:
    """A just-written relation's CSC, as :class:`~lightning_ooc.data.prepare.DatasetEdgeSource` reads one."""

    indptr: np.ndarray
    indices: np.ndarray
    num_nodes: int
    #: each edge's time, in the CSC's order (None: edges without times)
    edge_time: np.ndarray | None = None

    @property
    def num_edges(self) -> int:
        return int(self.indptr[-1])
