"""The ``lightning-ooc`` command (also ``python -m lightning_ooc``).

Subcommands::

    lightning-ooc synth    --out DIR --nodes N --avg-degree D --dim F --classes C --seed S
    lightning-ooc synth    --hetero igbh|mag --out DIR --nodes PAPERS [--dim F]
    lightning-ooc prepare  --out DIR (--pyg FILE | --edge-index E.npy --x X.npy | --edges E.csv --x X.npy | --dataset DIR | --from [LAYOUT] DIR) [...]
                           [--link-train E --link-val E --link-test E | --split-edges 0.85,0.05,0.10]
    lightning-ooc init-embeddings ROOT [--out DIR] --dim D --partitions N [--init normal|uniform|zeros]
    lightning-ooc partition ROOT --parts P --out DIR [--method auto|metis|fennel|ldg|random|range] [--seed S]
    lightning-ooc info     ROOT            (a dataset, a partition output or an embedding table)
    lightning-ooc verify   ROOT [--full [--accept]]
    lightning-ooc bench    KIND ROOT ...

Every subcommand parses its own options; a training command (``fit``, ``validate``, ``test``, ``predict``) goes
to LightningCLI with the rest of the line:

>>> args = build_parser().parse_args(["verify", "data/demo"])
>>> args.command, str(args.root)
('verify', 'data/demo')
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import yaml

from lightning_ooc._version import __version__
from lightning_ooc.errors import InterruptedAfterCommit, LightningOOCError
from lightning_ooc.utils.logs import StderrHandler, disk_full
from lightning_ooc.data import importers
from lightning_ooc.data import prepare as prep
from lightning_ooc.data.prepare_hetero import REVERSE_MODES
from lightning_ooc.data.dataset import open_dataset
from lightning_ooc.data.dataset_summary import format_summary, summarize
from lightning_ooc.data.synth import synthesize
from lightning_ooc.data.synth_hetero import synthesize_hetero
from lightning_ooc.data.verify import verify
from lightning_ooc.embed.table import init_embeddings, table_info, verify_table
from lightning_ooc.partitioned.partition import METHODS, is_partition_output, partition_dataset
from lightning_ooc.partitioned.partition_summary import format_partition_output, summarize_partition_output

log = logging.getLogger("lightning_ooc")

#: ``bench`` kinds, each a module of lightning_ooc.bench with add_arguments(parser) and run(args).
BENCH_KINDS = ("io", "sample", "epoch", "embed", "gpu", "distributed", "import", "infer", "report")
#: a bench kind whose module has another name (``import`` is a keyword)
_BENCH_MODULES = {"import": "importing"}


def _setup_logging(verbose: bool) -> None:
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter("lightning_ooc: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False


def _backends(path: Path | None = None) -> dict[str, tuple[bool, str]] | None:
    try:
        from lightning_ooc.io import available_backends
    except ImportError:
        return None
    return available_backends(path)


# -- synth ---------------------------------------------------------------------------
SYNTH_KEYS = {
    "nodes": int, "avg_degree": float, "dim": int, "classes": int, "seed": int, "degree_exponent": float,
    "homophily": float, "class_separation": float, "feature_noise": float, "train_frac": float,
    "val_frac": float, "test_frac": float, "dtype": str, "hetero": str, "degree_scale": float,
    "all_features": bool, "temporal": bool, "future_homophily": float, "time_span": int,
}  # fmt: skip


def _add_synth(sub) -> None:
    p = sub.add_parser("synth", help="generate a deterministic synthetic graph",
                       description="Generate a learnable power-law graph with planted classes.")  # fmt: skip
    p.add_argument("--config", type=Path, help="YAML file whose keys set the options below (flags override it)")
    p.add_argument("--out", type=Path, help="output dataset directory")
    p.add_argument("--hetero", choices=["igbh", "mag"],
                   help="a heterogeneous graph of this schema (IGBH's or MAG240M's node types and relations); "
                        "--nodes then counts papers, --dim and --classes override the schema's, --dtype defaults "
                        "to its")  # fmt: skip
    p.add_argument("--degree-scale", type=float, help="with --hetero: multiply every relation's edges per paper")
    p.add_argument("--all-features", action="store_true",
                   help="with --hetero: give the node types the schema leaves bare (MAG240M's author and "
                        "institution) features too, of the papers' width, as a model that reads every type's x "
                        "(PyG's to_hetero) needs")  # fmt: skip
    p.add_argument("--nodes", type=int, help="number of nodes")
    p.add_argument("--avg-degree", type=float, help="mean in-degree")
    p.add_argument("--dim", type=int, help="feature dimension")
    p.add_argument("--classes", type=int, help="number of classes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--degree-exponent", type=float, default=2.5, help="power-law exponent of degrees (> 2)")
    p.add_argument("--homophily", type=float, default=0.7, help="fraction of edges inside a class")
    p.add_argument("--class-separation", type=float, default=2.0, help="norm of class centres")
    p.add_argument("--feature-noise", type=float, default=1.0, help="std of per-coordinate feature noise")
    p.add_argument("--train-frac", type=float, default=0.01)
    p.add_argument("--val-frac", type=float, default=0.005)
    p.add_argument("--test-frac", type=float, default=0.01)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="feature dtype (default float32)")
    p.add_argument("--temporal", action="store_true",
                   help="a graph with time: node and edge times, each node's in-edges in time order, splits "
                        "predicted at their node's time; edges later than their target are more homophilous "
                        "(--future-homophily), so sampling without time leaks visibly (train with "
                        "time_attr='edge_time'); with --hetero, every node type and relation has times")  # fmt: skip
    p.add_argument("--future-homophily", type=float, default=0.95,
                   help="with --temporal: fraction of in-edges inside a class among those later than their target "
                        "(--homophily is then the earlier ones')")  # fmt: skip
    p.add_argument("--time-span", type=int, default=1000, help="with --temporal: times lie in [0, SPAN)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --out")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="also write what the run took (wall time, peak memory, size on disk; with the command, "
                        "commit, machine and date) to this JSON, which `lightning-ooc bench report` renders")  # fmt: skip
    p.set_defaults(func=_cmd_synth, parser=p)


def _cmd_synth(args) -> int:
    if args.config is not None:
        try:
            cfg = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise LightningOOCError(f"{args.config}: cannot read the synth config ({e})") from None
        unknown = set(cfg) - set(SYNTH_KEYS) - {"out"}
        if unknown:
            raise LightningOOCError(f"{args.config}: unknown keys {sorted(unknown)}; known: {sorted(SYNTH_KEYS)}")
        defaults = args.parser.parse_args(["--out", "x"])
        for key, value in cfg.items():
            # flags given on the command line win over the file
            if getattr(args, key, None) is None or getattr(args, key) == getattr(defaults, key, None):
                setattr(args, key, Path(value) if key == "out" else SYNTH_KEYS[key](value))
    needed = ("out", "nodes") if args.hetero else ("out", "nodes", "avg_degree", "dim", "classes")
    missing = [f"--{k.replace('_', '-')}" for k in needed if getattr(args, k) is None]
    if missing:
        args.parser.error(f"missing {', '.join(missing)} (on the command line or in --config)")
    t0 = time.perf_counter()
    if args.hetero:
        if args.avg_degree is not None:
            args.parser.error("--avg-degree is for homogeneous graphs; with --hetero use --degree-scale (each "
                              "relation has its schema's edges per paper)")  # fmt: skip

        synthesize_hetero(
            args.out, args.hetero, num_nodes=args.nodes, num_features=args.dim, num_classes=args.classes,
            feature_dtype=args.dtype, degree_scale=1.0 if args.degree_scale is None else args.degree_scale,
            seed=args.seed, degree_exponent=args.degree_exponent, homophily=args.homophily,
            class_separation=args.class_separation, feature_noise=args.feature_noise, train_frac=args.train_frac,
            val_frac=args.val_frac, test_frac=args.test_frac, overwrite=args.overwrite, progress=not args.no_progress,
            all_features=args.all_features, temporal=args.temporal, future_homophily=args.future_homophily,
            time_span=args.time_span,
        )  # fmt: skip
        _synth_result(args, time.perf_counter() - t0)
        return 0
    if args.degree_scale is not None:
        args.parser.error("--degree-scale needs --hetero; a homogeneous graph takes --avg-degree")
    if args.all_features:
        args.parser.error("--all-features needs --hetero; every node of a homogeneous graph has features")

    synthesize(
        args.out, num_nodes=args.nodes, avg_degree=args.avg_degree, num_features=args.dim,
        num_classes=args.classes, seed=args.seed, degree_exponent=args.degree_exponent,
        homophily=args.homophily, class_separation=args.class_separation, feature_noise=args.feature_noise,
        train_frac=args.train_frac, val_frac=args.val_frac, test_frac=args.test_frac,
        feature_dtype=args.dtype or "float32", overwrite=args.overwrite, progress=not args.no_progress,
        temporal=args.temporal, future_homophily=args.future_homophily, time_span=args.time_span,
    )  # fmt: skip
    _synth_result(args, time.perf_counter() - t0)
    return 0


def _synth_result(args, seconds: float) -> None:
    """With ``--json``: the generated graph's facts and what generating it took."""
    if args.json is None:
        return
    from lightning_ooc.bench.system import code_version, machine_facts, write_results  # lazy: only with --json

    meta = json.loads((args.out / "meta.json").read_text())
    disk = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    doc = {"kind": "synth", **code_version(), "machine": machine_facts(), "dataset": args.out.name,
           "hetero": args.hetero, "num_nodes": meta.get("num_nodes"), "num_edges": meta.get("num_edges"),
           "num_features": meta.get("num_features"), "feature_dtype": meta.get("feature_dtype"),
           "disk_bytes": disk, "seconds": seconds, "peak_rss_bytes": peak}  # fmt: skip
    print(f"lightning_ooc: synth result -> {write_results(doc, args.json, 'synth', hide=[args.out.parent])}")


# -- prepare -------------------------------------------------------------------------
def _add_prepare(sub) -> None:
    p = sub.add_parser(
        "prepare", help="convert a graph (PyG Data, .npy arrays, CSV/TSV edge list) to the on-disk format",
        description="Convert a graph to the on-disk format. Give one input: --pyg, --edge-index, --edges, or "
                    "--dataset (a dataset in this format, rewritten: e.g. with --split-edges to add link splits).",
    )  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="output dataset directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pyg", type=Path, help="a torch_geometric Data saved with torch.save (loaded with weights_only: "
                     "tensors and PyG data classes only)")  # fmt: skip
    src.add_argument("--edge-index", type=Path, help=".npy of shape (2, E): row 0 sources, row 1 targets")
    src.add_argument("--edges", type=Path, help="CSV/TSV/whitespace edge list, 'src dst' per line")
    src.add_argument("--from", dest="from_layout", nargs="+", metavar="LAYOUT DIR",
                     help="a dataset in a layout of its own, imported without loading it whole: `--from ogb DIR` (OGB's "
                          "download or DatasetSaver output), `--from mag240m DIR`, `--from igb DIR` (IGB/IGBH), "
                          "`--from graphbolt DIR` (metadata.yaml), `--from tgb DIR` (TGB link prediction: events with "
                          "times, fixed negatives); `--from DIR` detects the layout")  # fmt: skip
    src.add_argument("--dataset", type=Path, metavar="DIR",
                     help="a dataset in this package's format (e.g. from `lightning-ooc synth`): its features, labels, "
                          "node splits and graph, rewritten with the other options (e.g. --split-edges)")  # fmt: skip
    p.add_argument("--x", type=Path, help=".npy feature matrix (N, F); required with --edge-index/--edges")
    p.add_argument("--y", type=Path, help=".npy labels (N,), -1 or NaN for unknown")
    for s in ("train", "val", "test"):
        p.add_argument(f"--{s}", type=Path, help=f".npy boolean mask or node ids of the {s} split")
    p.add_argument("--split", metavar="TRAIN,VAL,TEST",
                   help="train,val,test fractions of the labelled nodes, split at random when no node split is given "
                        "(default 0.8,0.1,0.1); an error where no random split is drawn")
    p.add_argument("--seed", type=int, default=0, help="seed of the random splits (--split, --split-edges)")
    p.add_argument("--num-classes", type=int, help="number of classes (default: max label + 1)")
    p.add_argument("--target", help="a HeteroData's node type to predict (default: the only type with y)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="stored feature dtype")
    p.add_argument("--add-reverse", "--undirected", nargs="?", const="merge", choices=REVERSE_MODES,
                   metavar="merge|separate",
                   help="add the reverse of every edge; of a HeteroData (--pyg), a relation between two node types "
                        "gets a rev_ relation, and one within a type (cites) gets its reverses merged into it "
                        "(merge, the default: PyG's ToUndirected()) or in a rev_ relation of their own (separate: "
                        "ToUndirected(merge=False), as PyG's heterogeneous examples do)")  # fmt: skip
    p.add_argument("--drop-self-loops", action="store_true")
    p.add_argument("--drop-duplicates", action="store_true")
    p.add_argument("--node-time", type=Path, metavar="T.npy", help="an integer time of each node (PyG's time)")
    p.add_argument("--edge-time", type=Path, metavar="T.npy",
                   help="with --edge-index: an integer time of each edge (E,), stored as the edge times")
    p.add_argument("--neighbor-order", choices=["source_id", "node_time", "edge_time"],
                   help="how each node's in-edges are stored: by source id (the default), or in time order for "
                        "temporal sampling (time_attr='time': node_time; time_attr='edge_time': edge_time)")  # fmt: skip
    p.add_argument("--delimiter", help="edge list delimiter (default: ',' for .csv, tab for .tsv, else whitespace)")
    p.add_argument("--header", choices=["auto", "yes", "no"], default="auto", help="edge list has a header line")
    p.add_argument("--features", choices=["copy", "in-place"], default="copy",
                   help="copy the features into the dataset (default), or use the input's .npy file where it is "
                        "(--x X.npy, or an imported layout's): nothing is copied, and the dataset refuses to open "
                        "once that file changes")  # fmt: skip
    p.add_argument("--keep-directed", action="store_true",
                   help="with --from: store the edges as given, without the reverse edges the layout's own loader "
                        "adds (--add-reverse adds them where it does not)")  # fmt: skip
    g = p.add_argument_group("layouts (--from)")
    g.add_argument("--ogb-split", metavar="NAME", help="the OGB split directory (split/NAME) where there are several")
    g.add_argument("--igb-size", choices=["tiny", "experimental", "small", "medium", "large", "full"],
                   help="the IGB size, where DIR holds several")
    g.add_argument("--igb-classes", choices=["19", "2K"],
                   help="IGB's label set (default: 2K where MLPerf's train_idx.pt is there, as its splits are drawn "
                        "for it; else 19)")  # fmt: skip
    g.add_argument("--graphbolt-task", metavar="NAME", help="the GraphBolt task to import (default: the first)")
    g.add_argument("--graphbolt-feature", metavar="NAME", help="the GraphBolt node feature (default: feat)")
    g.add_argument("--tgb-ids", choices=["as-given", "first-seen", "bipartite"],
                   help="how TGB numbered the event list's ids (default by the dataset's name: bipartite for wiki, "
                        "subreddit and lastfm, first-seen for the others); the negatives files must match")  # fmt: skip
    g.add_argument("--tgb-columns", metavar="src,dst,time",
                   help="the roles of a TGB event list's first three columns (default: found by the header's names)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="with --pyg: unpickle any object (runs code the file names; only for files you trust)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    _add_link_options(p)
    p.set_defaults(func=_cmd_prepare, parser=p)


#: ``--link-SPLIT-OPTION`` -> the link split field it gives
LINK_OPTIONS = {"label": "label", "weight": "weight", "time": "time", "neg": "neg_dst"}


def _add_link_options(p) -> None:
    g = p.add_argument_group(
        "link prediction", "edge splits stored beside the graph: given (--link-*) or made (--split-edges: at random, or by time)"
    )
    for s in ("train", "val", "test"):
        g.add_argument(f"--link-{s}", type=Path, metavar="EDGES",
                       help=f"{s} supervision edges: .npy of shape (2, M) or (M, 2), or a CSV/TSV 'src dst' file")
    helps = {
        "label": ".npy (M,) label of each edge of --link-train (e.g. 1/0)",
        "weight": ".npy (M,) weight of each edge",
        "time": ".npy (M,) integer timestamp of each edge",
        "neg": ".npy (M, K) negative destinations per edge, paired with the edge's source",
    }  # fmt: skip
    for opt, text in helps.items():
        for s in ("train", "val", "test"):
            g.add_argument(f"--link-{s}-{opt}", type=Path, metavar="F.npy", help=argparse.SUPPRESS if s != "train" else
                           f"{text}; likewise --link-val-{opt}, --link-test-{opt}")  # fmt: skip
    g.add_argument("--split-edges", metavar="TRAIN,VAL,TEST",
                   help="split the input edges at random (--seed) into link train/val/test edges, e.g. 0.85,0.05,0.10, "
                        "and remove the val/test edges (with --add-reverse, their reverses too) from the stored graph; "
                        "edges with times (--edge-time, a dataset with edge times) are split by time instead: the "
                        "latest are val and test, each supervised at its time minus one, and every edge stays in the "
                        "graph at its time (TGB's split; sample with time_attr='edge_time')")


def _link_splits(args) -> dict[str, dict[str, Path]] | None:
    """The link splits given on the command line, ``{split: {"index": path, field: path}}``."""
    out: dict[str, dict[str, Path]] = {}
    for s in ("train", "val", "test"):
        given = {opt: getattr(args, f"link_{s}_{opt}") for opt in LINK_OPTIONS}
        fields = {LINK_OPTIONS[opt]: v for opt, v in given.items() if v is not None}
        index = getattr(args, f"link_{s}")
        if index is None and fields:
            opt = next(opt for opt, v in given.items() if v is not None)
            args.parser.error(f"--link-{s}-{opt} needs --link-{s} (the edges it belongs to)")
        if index is not None:
            out[s] = {"index": index, **fields}
    if out and args.split_edges is not None:
        args.parser.error("--split-edges makes the link splits; give it or --link-train/--link-val/--link-test, "
                          "not both")
    return out or None


def _cmd_prepare(args) -> int:
    fracs = None  # not given: the default split, where a random one is drawn
    if args.split is not None:
        try:
            fracs = [float(v) for v in args.split.split(",")]
        except ValueError:
            args.parser.error(f"--split must be three comma-separated fractions, got {args.split!r}")
    split_edges = None
    if args.split_edges is not None:
        try:
            split_edges = [float(v) for v in args.split_edges.split(",")]
        except ValueError:
            args.parser.error(f"--split-edges must be three comma-separated fractions, got {args.split_edges!r}")
    if args.add_reverse == "separate" and args.pyg is None:
        args.parser.error("--add-reverse separate keeps the reverses of a relation within one node type in a rev_ "
                          "relation of their own: it applies to a HeteroData given with --pyg; leave out 'separate' "
                          "(--add-reverse merges the reverse edges into the graph)")  # fmt: skip
    kw = dict(
        num_classes=args.num_classes, feature_dtype=args.dtype,
        add_reverse={None: False, "merge": True}.get(args.add_reverse, args.add_reverse),
        drop_self_loops=args.drop_self_loops, drop_duplicates=args.drop_duplicates, split=fracs,
        seed=args.seed, overwrite=args.overwrite, progress=not args.no_progress,
        link_splits=_link_splits(args), split_edges=split_edges,
    )  # fmt: skip
    if args.neighbor_order is not None:
        kw["neighbor_order"] = args.neighbor_order
    if args.node_time is not None:
        kw["node_time"] = prep.load_npy(args.node_time, "node times")
    if args.edge_time is not None:
        if args.edge_index is None:
            args.parser.error("--edge-time gives the time of each column of --edge-index")
        kw["edge_time"] = prep.load_npy(args.edge_time, "edge times")
    if (args.from_layout is not None or args.pyg is not None) and (args.neighbor_order or args.node_time is not None):
        args.parser.error("--neighbor-order and --node-time apply to --edge-index, --edges and --dataset inputs; a "
                          "layout (--from) or a HeteroData (--pyg) brings its own times")  # fmt: skip
    splits = {s: getattr(args, s) for s in ("train", "val", "test") if getattr(args, s) is not None}
    if args.from_layout is not None:
        return _cmd_import(args, fracs, splits)
    if args.features == "in-place" and (args.x is None or args.pyg is not None or args.dataset is not None):
        args.parser.error("--features in-place keeps a .npy file where it is: give it with --x and --edge-index or "
                          "--edges (or import a layout with --from)")  # fmt: skip
    if args.keep_directed:
        args.parser.error("--keep-directed applies to --from (the other inputs are stored as given)")
    if args.target is not None and args.pyg is None:
        args.parser.error("--target names a node type of a HeteroData given with --pyg")
    if args.allow_pickle and args.pyg is None:
        args.parser.error("--allow-pickle applies to --pyg only")
    if args.dataset is not None:
        given = [f"--{o.replace('_', '-')}" for o in ("x", "y", "num_classes") if getattr(args, o) is not None]
        if given:
            args.parser.error(f"--dataset brings its own features, labels and classes; leave out {', '.join(given)}")
        kw = {k: v for k, v in kw.items() if k != "num_classes" and not (k == "feature_dtype" and v is None)}
        if kw["link_splits"] is None:
            del kw["link_splits"]  # the dataset's own are carried over
        kw.update({s: prep.load_npy(v, f"{s} split") for s, v in splits.items()})
        out = prep.prepare_from_dataset(args.out, args.dataset, **kw)
    elif args.pyg is not None:
        kw.update({s: prep.load_npy(v, f"{s} split") for s, v in splits.items()})
        if args.target is not None:
            kw["target"] = args.target
        if args.y is not None:
            kw["y"] = prep.load_npy(args.y, "labels")
        out = prep.prepare_from_pyg(args.out, args.pyg, allow_pickle=args.allow_pickle, **kw)
    else:
        if args.x is None:
            args.parser.error("--x (the feature matrix) is required with --edge-index and --edges")
        kw.update({s: prep.load_npy(v, f"{s} split") for s, v in splits.items()})
        y = prep.load_npy(args.y, "labels") if args.y is not None else None
        x = args.x if args.features == "in-place" else prep.load_npy(args.x, "feature matrix")
        kw["features"] = args.features
        if args.edge_index is not None:
            out = prep.prepare_from_arrays(args.out, args.edge_index, x, y, **kw)
        else:
            out = prep.prepare_from_edge_list(args.out, args.edges, x, y, delimiter=args.delimiter,
                                              header=args.header, **kw)  # fmt: skip
    log.info("wrote %s", out)
    return 0


def _cmd_import(args, fracs, splits) -> int:
    """``prepare --from [LAYOUT] DIR``."""
    given = [f"--{o.replace('_', '-')}" for o in ("x", "y", "num_classes", "target", "split_edges", "delimiter")
             if getattr(args, o) is not None] + [f"--{s}" for s in splits]  # fmt: skip
    given += [f"--{o.replace('_', '-')}" for o in ("drop_self_loops", "drop_duplicates", "allow_pickle") if getattr(args, o)]
    given += ["--header"] if args.header != "auto" else []
    if given or _link_splits(args):
        args.parser.error(f"--from imports the layout's own features, labels, splits and edges as they are; leave "
                          f"out {', '.join(given) or 'the --link-* options'}")  # fmt: skip
    if len(args.from_layout) > 2:
        args.parser.error("--from takes the layout and the directory: --from ogb DIR (or --from DIR to detect it)")
    layout, root = (None, args.from_layout[0]) if len(args.from_layout) == 1 else args.from_layout
    if layout is not None and layout not in importers.LAYOUTS:
        args.parser.error(f"--from {layout}: unknown layout; this release imports {', '.join(importers.LAYOUTS)}")
    if args.add_reverse and args.keep_directed:
        args.parser.error("--add-reverse and --keep-directed contradict each other")
    extra = {k: getattr(args, k) for k in ("ogb_split", "igb_size", "igb_classes", "graphbolt_task",
                                           "graphbolt_feature", "tgb_ids", "tgb_columns")
             if getattr(args, k) is not None}  # fmt: skip
    out = importers.import_dataset(
        args.out, root, layout, features=args.features, feature_dtype=args.dtype,
        add_reverse=True if args.add_reverse else (False if args.keep_directed else None), split=fracs,
        seed=args.seed, overwrite=args.overwrite, progress=not args.no_progress, extra=extra,
    )  # fmt: skip
    log.info("wrote %s", out)
    return 0


# -- info / verify -------------------------------------------------------------------
def _add_info(sub) -> None:
    p = sub.add_parser("info", help="summarise a dataset (sizes, degrees, classes, splits, I/O backends)")
    p.add_argument("root", type=Path)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_cmd_info)


def _is_table(root: Path) -> bool:
    """Whether ``root`` holds an embedding table (``lightning-ooc init-embeddings``) rather than a dataset."""
    try:
        return json.loads((root / "meta.json").read_text()).get("format") == "lightning_ooc.embeddings"
    except (OSError, ValueError, AttributeError):
        return False


def _cmd_info(args) -> int:

    if is_partition_output(args.root):
        info = summarize_partition_output(args.root)
        print(json.dumps(info, indent=2) if args.json else format_partition_output(info))
        return 0
    if _is_table(args.root):
        info = table_info(args.root)
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            print("\n".join(f"{k}: {v}" for k, v in info.items() if k != "rows_per_partition"))
        return 0
    ds = open_dataset(args.root)
    info = summarize(ds)
    if ds.is_hetero:  # an O_DIRECT read of the first feature file there is
        first = [ds.node(t).features_path for t in ds.node_types if ds.node(t).has_features]
        backends = _backends(first[0] if first else ds.root)
    else:
        backends = _backends(ds.features_path)
    if args.json:
        if backends is not None:
            info["io_backends"] = {k: {"available": ok, "reason": why} for k, (ok, why) in backends.items()}
        print(json.dumps(info, indent=2))
    else:
        print(format_summary(info, backends))
    return 0


def _add_verify(sub) -> None:
    p = sub.add_parser("verify", help="check every checksum and every index of a dataset")
    p.add_argument("root", type=Path)
    p.add_argument("--full", action="store_true",
                   help="also checksum every byte of feature files used in place (prepare --features in-place); "
                        "without it they get the checks of every open: size, inode, time, header and sampled blocks")
    p.add_argument("--accept", action="store_true",
                   help="with --full: a feature file used in place whose modification time or inode changed (a copy "
                        "without -p, touch, a restore) but whose every row byte matches the checksum recorded at "
                        "import is accepted: meta.json records its new time and inode, so the dataset opens again; "
                        "one whose bytes differ fails (status 1) and meta.json is left as it was")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_verify, parser=p)


def _cmd_verify(args) -> int:
    if args.accept and not args.full:
        args.parser.error("--accept needs --full: a file used in place is accepted only once every row byte of it "
                          "is checksummed")  # fmt: skip
    if _is_table(args.root):
        if args.accept:
            args.parser.error("--accept applies to datasets with feature files used in place, not to an embedding "
                              "table")  # fmt: skip
        problems = verify_table(args.root)
        for line in problems or [f"{args.root}: embedding table OK (every partition and bucket file matches its "
                                 "checksum)"]:  # fmt: skip
            print(line)
        return 1 if problems else 0
    report = verify(args.root, progress=not args.no_progress, full=args.full, accept=args.accept)
    print(report.format())
    return 0 if report.ok else 1


# -- init-embeddings -------------------------------------------------------------------
def _add_init_embeddings(sub) -> None:
    p = sub.add_parser(
        "init-embeddings", help="create a trainable embedding table on disk for a dataset's nodes",
        description="Create an embedding table (rows of embedding and Adagrad state, in N partitions) for the "
                    "nodes of ROOT, and group its training edges (the link split train, else the stored graph; "
                    "val/test link splits for evaluation) into N x N buckets.",
    )  # fmt: skip
    p.add_argument("root", type=Path, help="a dataset directory (synth / prepare)")
    p.add_argument("--out", type=Path, help="table directory (default ROOT/../NAME-embeddings)")
    p.add_argument("--dim", type=int, default=100, help="embedding dimension (default 100)")
    p.add_argument("--partitions", type=int, default=1, help="number of node partitions N (default 1)")
    p.add_argument("--init", choices=["normal", "uniform", "zeros"], default="normal")
    p.add_argument("--init-scale", type=float, default=1e-3, help="std (normal) or bound (uniform); default 1e-3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing table at --out")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_init_embeddings)


def _cmd_init_embeddings(args) -> int:
    out = args.out or args.root.parent / f"{args.root.name}-embeddings"
    path = init_embeddings(out, dataset=args.root, dim=args.dim, partitions=args.partitions, init=args.init,
                           scale=args.init_scale, seed=args.seed, overwrite=args.overwrite,
                           progress=not args.no_progress)  # fmt: skip
    info = table_info(path)
    print(f"{path}: {info['num_nodes']} nodes x dim {info['dim']} in {info['partitions']} partitions "
          f"({info['bytes']} with Adagrad state); edge buckets: "
          + ", ".join(f"{k} {v}" for k, v in info["buckets"].items()))  # fmt: skip
    return 0


# -- partition -----------------------------------------------------------------------
def _add_partition(sub) -> None:
    p = sub.add_parser(
        "partition", help="split a dataset's feature rows into parts, one directory per machine",
        description="Assign every node of ROOT to one of P parts and write DIR/part-00000 ... each a dataset with "
                    "the whole topology and labels, the splits and feature rows of the nodes it owns, and "
                    "DIR/partition.json (method, edge cut, balance).",
    )  # fmt: skip
    p.add_argument("root", type=Path, help="a homogeneous dataset directory (synth / prepare)")
    p.add_argument("--parts", type=int, required=True, help="number of parts P (machines)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--method", choices=METHODS, default="auto",
                   help="auto (metis if pymetis is installed, else fennel), metis, fennel, ldg (streaming, edge-cut "
                        "reducing), random, range (contiguous ids); default auto")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the random and streaming partitioners and of METIS")
    p.add_argument("--overwrite", action="store_true", help="replace an existing partition output at --out")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_partition, parser=p)


def _cmd_partition(args) -> int:
    if args.parts < 1:
        args.parser.error(f"--parts must be >= 1, got {args.parts}")
    out = partition_dataset(args.root, args.parts, args.out, method=args.method, seed=args.seed,
                            overwrite=args.overwrite, progress=not args.no_progress)  # fmt: skip
    info = summarize_partition_output(out)
    print(json.dumps(info, indent=2) if args.json else format_partition_output(info))
    return 0


# -- bench ---------------------------------------------------------------------------
def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure I/O, sampling, epoch or GPU gather speed against a reference")
    kinds = p.add_subparsers(dest="kind", metavar="KIND")
    for kind in BENCH_KINDS:
        try:
            mod = importlib.import_module(f"lightning_ooc.bench.{_BENCH_MODULES.get(kind, kind)}")
        except ImportError:
            continue
        kp = kinds.add_parser(kind, help=(mod.__doc__ or "").strip().splitlines()[0] if mod.__doc__ else None)
        mod.add_arguments(kp)
        kp.set_defaults(func=mod.run)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


TRAIN_COMMANDS = ("fit", "validate", "test", "predict")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-ooc",
        description="Out-of-core GNN training for PyTorch Lightning: dataset tools and benchmarks.",
    )
    parser.add_argument("--version", action="version", version=f"lightning_ooc {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in TRAIN_COMMANDS:  # handled by LightningCLI (see lightning_ooc.lightning_cli); listed for --help
        sub.add_parser(name, help=f"{name} a model from a YAML config (LightningCLI; `{name} --help`)", add_help=False)
    for add in (_add_synth, _add_prepare, _add_init_embeddings, _add_partition, _add_info, _add_verify, _add_bench):
        add(sub)
    return parser


class _Terminated(SystemExit):
    """SIGTERM, raised in the main thread so finally-blocks remove partial output."""


def _sigterm(signum, frame):
    raise _Terminated(128 + signum)


_sigterm.interrupts_writers = True  # a writer that holds SIGTERM through its commit reports it as done


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TRAIN_COMMANDS:
        from lightning_ooc.lightning_cli import main as train_main  # lazy: it imports Lightning and PyG and Triton

        return train_main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = ["lightning-ooc", *argv]  # what a benchmark's results record as their command
    _setup_logging(args.verbose)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    signal.signal(signal.SIGTERM, _sigterm)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args) or 0)
    except LightningOOCError as e:
        print(f"lightning-ooc: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk under a writer that does not say so itself (a bench's output, say)
        full = disk_full(e, "free space on that disk, or write to another one")
        if full is None:
            raise
        print(f"lightning-ooc: error: {full}", file=sys.stderr)
        return 2
    except InterruptedAfterCommit as e:  # the dataset was written: say so, and report success
        print(f"lightning-ooc: {e}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        print("lightning-ooc: interrupted", file=sys.stderr)
        return 130
    except _Terminated as e:
        print("lightning-ooc: terminated (SIGTERM)", file=sys.stderr)
        return int(e.code)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
