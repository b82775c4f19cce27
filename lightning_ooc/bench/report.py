"""Tables from raw benchmark results: what ``bench epoch`` prints, and ``BENCHMARKS.md``'s tables rebuilt.

``lightning-ooc bench report`` finds every block of a Markdown file (``BENCHMARKS.md`` by default) between a line
``<!-- report PATH -->`` and a line ``<!-- /report -->``, where ``PATH`` is a result JSON (relative to the
Markdown file) written by a benchmark, and writes the tables rendered from that JSON between them. With
``--check`` it changes nothing and fails when a block differs from what its JSON renders: every figure in such
a block is one the raw results back.

A result of ``bench epoch`` renders as two tables: every variant's full epoch (median and range over the
repeats) and the floor and roofline per setting (:func:`summarize_epoch`, :func:`epoch_roofline`); one of
``bench sample`` or ``bench io`` as the table the benchmark printed; one of ``synth --json`` as a line of a
table. A block may name several results of one kind, separated by spaces: ``synth`` results make one table,
``bench epoch`` results of graphs of several sizes make the scaling table (:func:`format_scaling`: the cost
per training seed against the floor as the graph grows; ``--plot-scaling`` draws it).

Example::

    >>> doc = {"kind": "epoch", "results": [
    ...     {"setting": "light", "variant": "ours", "label": "ours", "repeat": r, "batches": 4,
    ...      "full_seconds": 10.0 + r, "setup_seconds": 2.0, "first_trained_seconds": 3.0, "epoch_seconds": 7.0,
    ...      "steady_seconds_per_batch": 1.5, "nodes_per_batch": 100.0, "data_wait_seconds": 1.0} for r in range(3)]}
    >>> [(x["label"], x["runs"], x["full_seconds"]["median"]) for x in summarize_epoch(doc)]
    [('ours', 3, 11.0)]
    >>> print(format_epoch(doc).splitlines()[2])
    | light | ours | 3 | 2.0 | 3.0 | **11.0** (10.0-12.0) | 1.500 | 100 | - | 9 % | 1 |
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from lightning_ooc.bench.system import save_plot
from lightning_ooc.data.format import human_bytes

#: the statistics of a variant's runs, per key of a run's result
_KEYS = ("full_seconds", "setup_seconds", "first_trained_seconds", "epoch_seconds", "steady_seconds_per_batch",
         "nodes_per_batch", "device_read_bytes", "wait_share", "ios", "cpu_seconds_per_batch",
         "steady_cpu_seconds_per_batch", "cores_busy", "reads_over_optimal")  # fmt: skip
#: settings without a model (``bench epoch --settings loader``, run only when named): the loader alone, with a
#: table of their own
LOADER_SETTINGS = ("loader",)


def floor_key(run: dict[str, Any]) -> str:
    """The key of a run's optimal reads in a result's floor: its repeat for ``ours`` (as results have always
    kept it), ``label/repeat`` for another variant compared with the floor (``defaults``).

        >>> floor_key({"label": "ours", "repeat": 2}), floor_key({"label": "defaults", "repeat": 0})
        ('2', 'defaults/0')
    """
    label = run.get("label", run.get("variant"))
    return str(run.get("repeat")) if label == "ours" else f"{label}/{run.get('repeat')}"


def _optimal(doc: dict[str, Any], run: dict[str, Any]) -> int | None:
    """The optimal reads of the replayed epoch for the memory and order of ``run`` (None: not computed)."""
    return ((doc.get("floor") or {}).get(run["setting"], {}).get("optimal") or {}).get(floor_key(run))


def _stat(values: list[float]) -> dict[str, float] | None:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def summarize_epoch(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per setting and variant label (``pyg-w1`` ...), in the order they first ran: the number of
    runs and, for each measured key, the median, minimum and maximum over the runs without an error."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in doc["results"]:
        if "error" not in r:
            groups.setdefault((r["setting"], r.get("label", r["variant"])), []).append(r)
    out = []
    for (setting, label), runs in groups.items():
        entry: dict[str, Any] = {"setting": setting, "label": label, "variant": runs[0]["variant"], "runs": len(runs),
                                 "batches": runs[0]["batches"]}  # fmt: skip
        if runs[0].get("mps"):  # an mps_split run: was the split in force in every run of it
            entry["mps_active"] = all((r.get("mps") or {}).get("active") for r in runs)
        for k in _KEYS:
            if k == "wait_share":
                vals = [r["data_wait_seconds"] / max(r.get("full_seconds") or r["epoch_seconds"], 1e-9) for r in runs]
            elif k == "cores_busy":  # CPU seconds over wall seconds: how many cores the run kept busy
                vals = [r["cpu_seconds"] / r["full_seconds"] if r.get("cpu_seconds") is not None else None
                        for r in runs]  # fmt: skip
            elif k == "reads_over_optimal":  # a tiered run's rows read from SSD over the optimal for its memory
                opts = [_optimal(doc, r) for r in runs]
                vals = [r["ios"] / o if r.get("ios") is not None and o else None for r, o in zip(runs, opts)]
            else:
                vals = [r.get(k) for r in runs]
            entry[k] = _stat(vals)
        out.append(entry)
    return out


def _iops(run: dict[str, Any]) -> float | None:
    vals = [v for v in run.get("fio_iops") or [] if v]
    return sum(vals) / len(vals) if vals else None


def epoch_roofline(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per setting with a run of ours: the floor (the optimal reads of the replayed epoch, in the order the run
    trained its batches, for the memory its plan kept, at fio's IOPS measured around the run), the compute-only
    time (the ``device`` variant's epoch after its set-up), the roofline (the larger), and ours' full epoch
    against it: our reads over the optimal ones (1 is the best any cache of that memory could do) and engine
    efficiency (our reads at fio's IOPS / our full epoch: 1 is the disk busy at fio's rate throughout); when
    I/O bounds the roofline, ours / roofline = reads over optimal / engine efficiency. Medians and ranges over
    ours' runs; PyG's best worker count, and ours' speed-up over it."""
    summary = summarize_epoch(doc)
    floor = doc.get("floor") or {}
    out: dict[str, dict[str, Any]] = {}
    for s in dict.fromkeys(r["setting"] for r in doc["results"]):
        ours = [r for r in doc["results"] if r["setting"] == s and r.get("label", r["variant"]) == "ours"
                and "error" not in r]  # fmt: skip
        if not ours:
            continue
        dev = next((x for x in summary if x["setting"] == s and x["label"] == "device"), None)
        compute = dev["epoch_seconds"]["median"] if dev and dev["epoch_seconds"] else None
        rep = floor.get(s) or {}
        per_run = []
        for r in ours:
            opt = (rep.get("optimal") or {}).get(floor_key(r))
            iops = _iops(r)
            line: dict[str, Any] = {"full": r["full_seconds"], "ios": r.get("ios"), "optimal": opt, "iops": iops,
                                    "best_static": (rep.get("best_static") or {}).get(floor_key(r))}  # fmt: skip
            if opt and iops:
                line["io_floor"] = opt / iops
                line["reads_over_optimal"] = r["ios"] / opt
                line["engine_efficiency"] = r["ios"] / iops / r["full_seconds"]
            top = max([v for v in (compute, line.get("io_floor")) if v], default=None)
            line["roofline"] = top
            line["ratio"] = r["full_seconds"] / top if top else None
            per_run.append(line)
        pyg = [x for x in summary if x["setting"] == s and x["variant"] == "pyg"]
        best = min(pyg, key=lambda x: x["full_seconds"]["median"]) if pyg else None
        ours_full = _stat([r["full_seconds"] for r in ours])
        out[s] = {
            "compute": compute, "batches": rep.get("batches"), "accesses": rep.get("accesses"),
            "compulsory": rep.get("compulsory"), "why": rep.get("why") or rep.get("error"),
            "capacity_rows": _stat([r.get("capacity_rows") for r in ours]),
            **{k: _stat([ln.get(k) for ln in per_run]) for k in
               ("optimal", "best_static", "ios", "iops", "io_floor", "reads_over_optimal", "engine_efficiency",
                "roofline", "ratio")},
            "full": ours_full, "pyg_best": best["label"] if best else None,
            "pyg_best_speedup": best["full_seconds"]["median"] / ours_full["median"] if best and ours_full else None,
        }  # fmt: skip
    return out


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _med(st: dict[str, float] | None, fmt: str = "{:.1f}") -> str:
    return "-" if st is None else fmt.format(st["median"])


def _span(st: dict[str, float] | None, fmt: str = "{:.1f}") -> str:
    if st is None:
        return "-"
    if st["min"] == st["max"]:
        return fmt.format(st["median"])
    return f"{fmt.format(st['median'])} ({fmt.format(st['min'])}-{fmt.format(st['max'])})"


def format_epoch(doc: dict[str, Any]) -> str:
    """The tables of a ``bench epoch`` result (Markdown; see the module docstring)."""
    summary = summarize_epoch(doc)
    ours = {x["setting"]: x for x in summary if x["label"] == "ours"}
    lines = ["| setting | variant | runs | set-up s | 1st trained s | full epoch s | s/batch (steady) | nodes/batch | "
             "disk read | trainer waited | full epoch / ours' |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for x in summary:
        o = ours.get(x["setting"])
        ratio = ("1" if x is o else _num(x["full_seconds"]["median"] / o["full_seconds"]["median"], "{:.2f}x")
                 if o else "-")  # fmt: skip
        full = _span(x["full_seconds"])
        if x is o:
            full = f"**{full.split(' ')[0]}**" + (full[len(full.split(' ')[0]):] if " " in full else "")
        read = "-" if x["device_read_bytes"] is None else f"{x['device_read_bytes']['median'] / 2**30:.2f} GiB"
        label = x["label"] + (" (MPS not in force: no split)" if x.get("mps_active") is False else "")
        lines.append(
            f"| {x['setting']} | {label} | {x['runs']} | {_med(x['setup_seconds'])} | "
            f"{_med(x['first_trained_seconds'])} | {full} | {_med(x['steady_seconds_per_batch'], '{:.3f}')} | "
            f"{_med(x['nodes_per_batch'], '{:,.0f}')} | "
            f"{read} | {_med(x['wait_share'], '{:.0%}').replace('%', ' %')} | "
            f"{ratio} |"
        )  # fmt: skip
    errors = [r for r in doc["results"] if "error" in r]
    for r in errors:
        why = " ".join(r["error"].replace("|", "/").split())[:160]
        lines.append(f"| {r['setting']} | {r.get('label', r['variant'])} | - | | | {why} | | | | | |")
    lines.append("")
    lines.append("Median over the runs, range in parentheses. *full epoch*: from the start of the datamodule's set-up to "
                 "the end of the last training step, every batch; *1st trained*: from the same start to the end of "
                 "the first step; *s/batch*: end of the first step to the end of the last, per step; *disk read*: "
                 "bytes the block device read during the run (set-up included); *trainer waited*: share of the "
                 "full epoch the trainer waited for a batch.")  # fmt: skip
    roof = doc.get("roofline") if doc.get("roofline") is not None else epoch_roofline(doc)
    lines += _loader_table(summary, roof)
    lines += _packed_table(doc, summary)
    lines += _stores_table(doc, summary)
    lines += _stores_in_memory_table(summary)
    if roof:
        lines += ["", "| setting | distinct rows | rows in memory | optimal reads | best static reads | our reads | "
                  "reads / optimal | fio IOPS | I/O floor s | compute-only s | roofline s | ours s | engine "
                  "efficiency | ours / roofline | ours vs PyG's best |",
                  "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
        for s, ln in roof.items():
            best = (f"{ln['pyg_best_speedup']:.2f}x faster than {ln['pyg_best']}" if ln.get("pyg_best_speedup")
                    else "-")  # fmt: skip
            lines.append(
                f"| {s} | {_num(ln['compulsory'], '{:,}')} | {_med(ln['capacity_rows'], '{:,.0f}')} | "
                f"{_med(ln['optimal'], '{:,.0f}')} | {_med(ln.get('best_static'), '{:,.0f}')} | "
                f"{_med(ln['ios'], '{:,.0f}')} | "
                f"{_span(ln['reads_over_optimal'], '{:.2f}')} | {_med(ln['iops'], '{:,.0f}')} | "
                f"{_med(ln['io_floor'])} | {_num(ln['compute'])} | {_med(ln['roofline'])} | {_span(ln['full'])} | "
                f"{_span(ln['engine_efficiency'], '{:.2f}')} | {_span(ln['ratio'], '{:.2f}')} | {best} |"
            )  # fmt: skip
        lines.append("")
        lines.append("*distinct rows*: the epoch's compulsory reads; *rows in memory*: host cache plus feature buffer "
                     "as ours' plan sized them; *optimal reads*: the fewest reads of the replayed batches, in the "
                     "order ours trained them, with that many rows kept between batches (Belady, cold, a cache's "
                     "fill counted); *best static reads*: the fewest reads of a cache of that many rows that keeps "
                     "the same rows all epoch, chosen knowing every batch (a reference for a static host cache); *our "
                     "reads*: rows ours read from SSD, its host cache's fill included; "
                     "*I/O floor*: optimal reads at fio's IOPS (same block size, one job per extractor, measured "
                     "around each run); *compute-only*: the device variant's epoch after its set-up; *engine "
                     "efficiency*: our reads at fio's IOPS / ours' full epoch; when I/O bounds the roofline, ours / "
                     "roofline = (reads / optimal) / engine efficiency.")  # fmt: skip
    return "\n".join(lines)


def _loader_table(summary: list[dict[str, Any]], roof: dict[str, dict[str, Any]]) -> list[str]:
    """The loader alone (settings of :data:`LOADER_SETTINGS`), a line per variant: its full epoch and steady
    state, what the disk read, its reads over the optimal for its plan's memory (tiered variants), the epoch
    against the I/O floor of ours' memory, the CPU seconds per batch (the process and its children, every
    thread) and the cores it kept busy, and how much faster than PyG's best loader it ran."""
    rows = [x for x in summary if x["setting"] in LOADER_SETTINGS]
    if not rows:
        return []
    lines = ["", "| setting | variant | runs | full epoch s | s/batch (steady) | disk read | reads / optimal | "
             "I/O floor s | full / floor | CPU s/batch | CPU s/batch (steady) | cores busy | vs PyG's best |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for x in rows:
        s = x["setting"]
        floor = (roof.get(s) or {}).get("io_floor")
        full = x["full_seconds"]["median"]
        pyg = [y for y in summary if y["setting"] == s and y["variant"] == "pyg"]
        best = min(pyg, key=lambda y: y["full_seconds"]["median"]) if pyg else None
        vs = ("-" if best is None else "1" if best is x
              else f"{best['full_seconds']['median'] / full:.2f}x faster" if best["full_seconds"]["median"] >= full
              else f"{full / best['full_seconds']['median']:.2f}x slower")  # fmt: skip
        read = "-" if x["device_read_bytes"] is None else f"{x['device_read_bytes']['median'] / 2**30:.2f} GiB"
        lines.append(
            f"| {s} | {x['label']} | {x['runs']} | {_span(x['full_seconds'])} | "
            f"{_med(x['steady_seconds_per_batch'], '{:.3f}')} | {read} | {_span(x['reads_over_optimal'], '{:.2f}')} | "
            f"{_med(floor)} | {_num(full / floor['median'], '{:.2f}') if floor else '-'} | "
            f"{_med(x['cpu_seconds_per_batch'], '{:.3f}')} | {_med(x['steady_cpu_seconds_per_batch'], '{:.3f}')} | "
            f"{_med(x['cores_busy'], '{:.2f}')} | {vs} |"
        )  # fmt: skip
    lines += ["", "The loader alone: each step reads every byte of the batch's x and trains nothing. "
              "*reads / optimal*: rows a tiered run read from SSD (its host cache's fill included) over the fewest reads of the same "
              "batches, in the order it trained them, with the rows its plan kept in memory; *I/O floor*: the "
              "optimal reads for ours' memory at fio's IOPS; *full / floor*: the variant's full epoch over it; "
              "*CPU s/batch*: user + system seconds of the run's process and its children (every thread), set-up "
              "included, per batch; *steady*: from the end of the first step to the end of the last, per batch; "
              "*cores busy*: CPU seconds over the full epoch's seconds."]  # fmt: skip
    return lines


def _disk_cache(packing: dict[str, Any]) -> str:
    """The disk cache of a ``packed`` run's next pack (else its first), in words."""
    r = packing.get("next") if packing.get("next", {}).get("segments") is not None else packing.get("first", {})
    if not r or not r.get("segments"):
        return "none"
    share = r["cached_rows"] / max(r["rows"], 1)
    return f"{r['segments']} x {r['segment_batches']} batches, t={r['threshold']}, {r['cached_rows']:,} rows ({share:.0%})"


def _best_runs(summary: list[dict[str, Any]], setting: str, variants: tuple[str, ...]) -> list[dict | None]:
    """Per variant, its summary row of ``setting`` with the shortest median full epoch (its best worker count);
    None where it did not run.

        >>> rows = [dict(setting="s", variant="a", full_seconds={"median": m}, label=f"a{m}") for m in (3, 2)]
        >>> [r and r["label"] for r in _best_runs(rows, "s", ("a", "b"))]
        ['a2', None]
    """
    best = []
    for v in variants:
        runs = [x for x in summary if x["setting"] == setting and x["variant"] == v]
        best.append(min(runs, key=lambda x: x["full_seconds"]["median"]) if runs else None)
    return best


def _stores_table(doc: dict[str, Any], summary: list[dict[str, Any]]) -> list[str]:
    """PyG's loaders over our store pair (``pyg-store``) against PyG's loaders over the memory map (``pyg``):
    the best worker count of each, per setting. A PyG run stopped by ``--run-timeout`` counts as its lower
    bound, where no run of that variant finished."""
    lines = []
    for s in dict.fromkeys(x["setting"] for x in summary):
        st, mm = _best_runs(summary, s, ("pyg-store", "pyg"))
        if st is None:
            continue
        ours = st["full_seconds"]["median"]
        if mm is not None:
            ref, ref_time, ratio = mm["label"], _span(mm["full_seconds"]), f"{mm['full_seconds']['median'] / ours:.2f}x"
        else:
            stopped = [r for r in doc["results"] if r["setting"] == s and r["variant"] == "pyg" and r.get("timed_out")]
            if stopped:
                low = min(stopped, key=lambda r: r["lower_bound_seconds"])  # the best is no faster than this
                ref = ", ".join(r["label"] for r in stopped) + " (stopped)"
                ref_time, ratio = f"> {low['lower_bound_seconds']:.0f}", f"> {low['lower_bound_seconds'] / ours:.2f}x"
            else:
                ref, ref_time, ratio = "-", "-", "-"
        lines.append(f"| {s} | {st['label']} | {_span(st['full_seconds'])} | {ref} | {ref_time} | {ratio} |")
    if not lines:
        return []
    return ["", "| setting | PyG's loader over our stores (best) | full epoch s | PyG's loader over the memory map "
            "(best) | full epoch s | speed-up |", "|---|---|--:|---|--:|--:|", *lines, "",
            "The same PyG loader, given our `(FeatureStore, GraphStore)` pair and our sampler instead of a `Data` "
            "over the `MADV_RANDOM` memory map; each at its best `num_workers`."]  # fmt: skip


def _stores_in_memory_table(summary: list[dict[str, Any]]) -> list[str]:
    """PyG's loader over our store pair (``pyg-store``) against PyG's loader over an in-memory ``Data``
    (``pyg-ram``), where features fit: the best worker count of each, per setting; the goal is at most 1.5x."""
    lines = []
    for s in dict.fromkeys(x["setting"] for x in summary):
        st, ram = _best_runs(summary, s, ("pyg-store", "pyg-ram"))
        if st is None or ram is None:
            continue
        ratio = st["full_seconds"]["median"] / ram["full_seconds"]["median"]
        lines.append(f"| {s} | {st['label']} | {_span(st['full_seconds'])} | {ram['label']} | "
                     f"{_span(ram['full_seconds'])} | {ratio:.2f}x |")  # fmt: skip
    if not lines:
        return []
    return ["", "| setting | PyG's loader over our stores (best) | full epoch s | PyG's loader over an in-memory `Data` "
            "(best) | full epoch s | stores / in memory (goal <= 1.5x) |", "|---|---|--:|---|--:|--:|", *lines, "",
            "The same PyG loader over our pair (our sampler; features held in memory where they fit, "
            "`open_pyg_stores(in_memory=\"auto\")`) and over a `Data` whose features were read into memory (PyG's "
            "sampler); each at its best `num_workers`."]  # fmt: skip


def _packed_table(doc: dict[str, Any], summary: list[dict[str, Any]]) -> list[str]:
    """The ``packed`` variant's costs: packing, disk, reads, and its packed epoch against the compute-only time."""
    runs = [r for r in doc["results"] if r.get("variant") == "packed" and "packing" in r and "error" not in r]
    if not runs:
        return []
    lines = ["", "| setting | runs | 1st epoch packed up front s (sampled + rows) | next epoch packed beside training s "
             "| ran past the last step s | pack on disk / features | disk cache | read / batch | reads / batch | "
             "read amplification | packed epoch s | compute-only s | packed epoch / compute-only |",
             "|---|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for s in dict.fromkeys(r["setting"] for r in runs):
        rs = [r for r in runs if r["setting"] == s]
        pk = [r["packing"] for r in rs]
        dev = next((x for x in summary if x["setting"] == s and x["label"] == "device"), None)
        compute = dev["epoch_seconds"]["median"] if dev and dev["epoch_seconds"] else None
        first = _stat([p["first"].get("pack_seconds") for p in pk])
        parts = (f" ({_med(_stat([p['first'].get('sample_seconds') for p in pk]))} + "
                 f"{_med(_stat([p['first'].get('rows_seconds') for p in pk]))})" if first else "")  # fmt: skip
        epoch = _stat([p.get("packed_epoch_seconds") for p in pk])
        ratio = _stat([p["packed_epoch_seconds"] / compute for p in pk if p.get("packed_epoch_seconds") and compute])
        read = _stat([r.get("bytes_read_per_batch") for r in rs])
        lines.append(
            f"| {s} | {len(rs)} | {_med(first)}{parts} | {_med(_stat([p['next'].get('seconds') for p in pk]))} | "
            f"{_med(_stat([p.get('next_overhang_seconds') for p in pk]))} | "
            f"{_med(_stat([p.get('space_ratio') for p in pk]), '{:.2f}x')} | {_disk_cache(pk[0])} | "
            f"{'-' if read is None else human_bytes(read['median'])} | "
            f"{_med(_stat([r.get('ios_per_batch') for r in rs]), '{:,.0f}')} | "
            f"{_med(_stat([r.get('read_amplification') for r in rs]), '{:.3f}')} | {_span(epoch)} | "
            f"{_num(compute)} | {_span(ratio, '{:.2f}')} |"
        )  # fmt: skip
    lines += ["", "*packed*: ours with packed minibatches. *1st epoch packed up front*: sampling its batches and "
              "packing their cold rows before it trained (included in its full epoch above); *next epoch packed "
              "beside training*: the same for the next epoch, while this one trained; *ran past the last step*: how "
              "long that went on after this epoch's last step; *disk cache*: where the pack would take more than "
              "`pack_space`, the segments of consecutive batches, the fewest of a segment's batches that share a row "
              "it caches, and the rows cached once instead (share of the rows the pack holds); *read / batch*, *reads / "
              "batch*: bytes and reads from SSD per batch (packed sections, disk-cache rows with neighbours merged, "
              "and direct reads of what no pack holds); *read amplification*: bytes read over "
              "the bytes of the rows asked for; *packed epoch*: an epoch whose pack is ready, the next one's "
              "packing included: the training time less the wait for its own pack, plus the time the next pack "
              "ran past the last step."]  # fmt: skip
    return lines


def format_sample(doc: dict[str, Any]) -> str:
    """``bench sample``'s table (native sampler against the reference, per fanout, cache and threads)."""
    from lightning_ooc.bench.sample import format_table  # lazy: the bench imports torch and the sampler

    return format_table(doc["results"])


def format_io(doc: dict[str, Any]) -> str:
    """``bench io``'s table (one line per ids, order, backend and queue depth, against fio)."""
    from lightning_ooc.bench.io import format_table  # lazy: the bench imports the reader's native extension

    return format_table(doc["results"])


def format_synth(docs: list[dict[str, Any]]) -> str:
    """``synth --json`` results as one table, a line per generated graph."""
    lines = ["| graph | nodes | edges | features | on disk | wall time | generation rate | peak RSS |",
             "|---|--:|--:|---|--:|--:|--:|--:|"]
    def whole(v: Any, how: Callable = sum) -> Any:  # a heterogeneous graph counts per type
        return how(v.values()) if isinstance(v, dict) else v

    for d in docs:
        nodes, edges, feats = whole(d["num_nodes"]), whole(d["num_edges"]), whole(d["num_features"], max)
        minutes, seconds = divmod(d["seconds"], 60)
        wall = f"{int(minutes)} min {seconds:04.1f} s" if minutes else f"{seconds:.1f} s"
        lines.append(f"| `{d['dataset']}` | {nodes:,} | {edges:,} | {feats} {d['feature_dtype']} | "
                     f"{d['disk_bytes'] / 2**30:.2f} GiB | {wall} | {edges / d['seconds'] / 1e6:.2f} M edges/s | "
                     f"{d['peak_rss_bytes'] / 2**30:.2f} GiB |")  # fmt: skip
    return "\n".join(lines)


def scaling_points(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting and graph (``bench epoch`` results of one design on graphs of several sizes): ours' full
    epoch and its reads per training seed, against the optimal reads and the I/O floor of the same epoch."""
    points = []
    for d in docs:
        facts = d.get("dataset_facts") or {}
        roof = d.get("roofline") if d.get("roofline") is not None else epoch_roofline(d)
        for x in summarize_epoch(d):
            if x["label"] != "ours":
                continue
            line = roof.get(x["setting"]) or {}
            med = {k: (line.get(k) or {}).get("median") for k in ("ios", "optimal", "io_floor")}
            points.append({
                "setting": x["setting"], "dataset": Path(d["dataset"]).name, "nodes": facts.get("nodes"),
                "feature_bytes": facts.get("feature_bytes"), "memory_cap": d.get("memory_cap"),
                "seeds": facts.get("seeds") or None, "full_seconds": x["full_seconds"]["median"],
                "compulsory": line.get("compulsory"), **med,
            })  # fmt: skip
        ran = {p["setting"] for p in points if p["dataset"] == Path(d["dataset"]).name}
        for r in d["results"]:  # a setting whose every run of ours failed (a refused plan): its reason
            if r.get("label", r["variant"]) == "ours" and "error" in r and r["setting"] not in ran:
                ran.add(r["setting"])
                points.append({"setting": r["setting"], "dataset": Path(d["dataset"]).name,
                               "nodes": facts.get("nodes"), "feature_bytes": facts.get("feature_bytes"),
                               "memory_cap": d.get("memory_cap"), "error": r["error"]})  # fmt: skip
    return points


def _reason(error: str) -> str:
    """The last line of a failed run's error, without its exception's name and its parenthesised details,
    shortened for a table cell.

    >>> _reason("Traceback\\nx.InputError: does not fit: 9 MiB free (cgroup c (1 MiB mapped)); holds 5 MiB (all)")
    'does not fit: 9 MiB free; holds 5 MiB'
    """
    last = error.strip().splitlines()[-1] if error.strip() else error
    last = re.sub(r"^[\w.]+(Error|Exception): ", "", last).replace("|", "/")
    while True:  # innermost parentheses first
        shorter = re.sub(r"\s*\([^()]*\)", "", last)
        if shorter == last:
            break
        last = shorter
    return last if len(last) <= 200 else last[:197] + "..."


def format_scaling(docs: list[dict[str, Any]]) -> str:
    """``bench epoch`` results on graphs of several sizes as one table: how the cost per training seed grows."""
    lines = ["| setting | graph | nodes | features / cap | seeds | ours: full epoch s | ms per seed | I/O floor ms "
             "per seed | ours / floor | our reads per seed | optimal reads per seed | distinct rows per seed |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for p in sorted(scaling_points(docs), key=lambda p: (p["setting"], p["nodes"] or 0)):
        ratio = p["feature_bytes"] / p["memory_cap"] if p["feature_bytes"] and p["memory_cap"] else None
        if "error" in p:
            lines.append(f"| {p['setting']} | `{p['dataset']}` | {_num(p['nodes'], '{:,}')} | "
                         f"{_num(ratio, '{:.1f}x')} | - | did not run: {_reason(p['error'])} | | | | | | |")  # fmt: skip
            continue
        seeds = p["seeds"]

        def per(v: float | None, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
            return "-" if v is None or not seeds else fmt.format(v * scale / seeds)

        lines.append(
            f"| {p['setting']} | `{p['dataset']}` | {_num(p['nodes'], '{:,}')} | {_num(ratio, '{:.1f}x')} | "
            f"{_num(seeds, '{:,}')} | {p['full_seconds']:.1f} | {per(p['full_seconds'], 1e3)} | "
            f"{per(p['io_floor'], 1e3)} | "
            f"{_num(p['full_seconds'] / p['io_floor'] if p['io_floor'] else None, '{:.2f}')} | "
            f"{per(p['ios'], fmt='{:.1f}')} | {per(p['optimal'], fmt='{:.1f}')} | {per(p['compulsory'], fmt='{:.1f}')} |"
        )  # fmt: skip
    lines.append("")
    lines.append("One `bench epoch` result per graph (ours, full epochs with set-up, cold, each graph's features 4x "
                 "its memory cap), medians over the runs. *I/O floor*: the optimal reads of the same epoch for the "
                 "memory ours' plan kept, at fio's IOPS measured around the run; *seeds*: the training nodes of an "
                 "epoch (one batch per 1,000).")  # fmt: skip
    return "\n".join(lines)


def plot_scaling(docs: list[dict[str, Any]], path: Path) -> str:
    """One figure of :func:`scaling_points`: milliseconds and reads per seed against the graph's nodes, ours and
    the floor, a line per setting."""
    try:
        import matplotlib  # lazy: matplotlib only for the plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    points = [p for p in scaling_points(docs) if p.get("seeds") and p["nodes"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for j, setting in enumerate(dict.fromkeys(p["setting"] for p in points)):
        pts = sorted((p for p in points if p["setting"] == setting), key=lambda p: p["nodes"])
        for ax, key, scale, style, what in ((left, "full_seconds", 1e3, "o-", "ours"),
                                            (left, "io_floor", 1e3, "s--", "I/O floor"),
                                            (right, "ios", 1.0, "o-", "ours"),
                                            (right, "optimal", 1.0, "s--", "optimal")):  # fmt: skip
            xy = [(p["nodes"], p[key] * scale / p["seeds"]) for p in pts if p[key]]
            if xy:
                ax.plot(*zip(*xy), style, color=f"C{j}", label=f"{setting}: {what}")
    return _growth_figure(fig, ((left, "ms per training seed"), (right, "SSD reads per training seed")),
                          sorted({p["nodes"] for p in points}), "nodes (features 4x the memory cap)",
                          "lightning-ooc bench epoch: full epochs as the graph grows", path)  # fmt: skip


def _growth_figure(fig: Any, axes: tuple[tuple[Any, str], ...], sizes: list[int], xlabel: str, title: str,
                   path: Path) -> str:  # fmt: skip
    """Finish a figure of costs against the graph's nodes (log axis, a tick per size) and save it."""
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot (imported by the caller already)

    for ax, what in axes:
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{n / 1e6:g}M" for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    save_plot(fig, path)
    plt.close(fig)
    return f"plot: {path}"


def format_embed(doc: dict[str, Any]) -> str:
    """``bench embed``'s tables: the partition orders, every variant's epochs, and Theorem 3 per order."""
    from lightning_ooc.bench.embed import format_order_table, format_results, format_theorem3  # lazy: torch

    parts = [format_order_table(doc["orders"], doc["capacity"]), format_results(doc["results"], doc["variants"])]
    parts += [format_theorem3(t3, t3.get("measured_hidden_fraction")) for t3 in doc.get("theorem3") or []]
    return "\n\n".join(parts)


def format_distributed(doc: dict[str, Any]) -> str:
    """``bench distributed``'s tables, one per machine count, seed order and link, as the run printed them."""
    return "\n\n".join(doc["tables"])


def format_import(docs: list[dict[str, Any]]) -> str:
    """``bench import`` results, one row each: the import's time against reading its input once, peak memory."""
    gib = 2**30
    lines = ["| graph (IGB layout) | features | memory cap | input | read once | import | import / read once | "
             "peak anonymous | peak RSS | cgroup peak | written |", "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for d in docs:
        imp = d["import"]
        ok = imp["returncode"] == 0 and d.get("ratio_to_read_once") is not None
        lines.append(
            f"| {d['nodes']:,} nodes, {d['edges']:,} edges | {d['dim']} x float32, {d['features']} | "
            f"{_num(d['memory_cap'] and d['memory_cap'] / gib, '{:.2f} GiB')} | {d['input_bytes'] / gib:.2f} GiB | "
            f"{d['read_once_seconds']:.1f} s | "
            + (f"{imp['seconds']:.1f} s | {d['ratio_to_read_once']:.2f}x | " if ok else
               f"failed (exit {imp['returncode']}) | - | ")
            + (f"{imp['peak_anon_bytes'] / gib:.2f} GiB | " if imp.get("peak_anon_bytes") else "- | ")
            + f"{imp['peak_rss_bytes'] / gib:.2f} GiB | {(imp['cgroup_peak_bytes'] or 0) / gib:.2f} GiB | "
            f"{d['output_bytes'] / gib:.2f} GiB |"
        )  # fmt: skip
    return "\n".join(lines)


def format_infer(d: dict[str, Any]) -> str:
    """``bench infer``: every node's outputs three ways, then layer-wise inference's layers against its goal."""
    gib = 2**30
    res = d["results"]
    cap = d.get("memory_cap")
    hetero = d.get("model", "GraphSAGE") != "GraphSAGE"
    nodes = (f"{d['all_nodes']:,} nodes ({d['num_nodes']:,} of the predicted type)" if hetero
             else f"{d['num_nodes']:,} nodes")  # fmt: skip
    lines = [f"Graph `{d['dataset']}`: {nodes}, {d['num_edges']:,} edges, features "
             f"{d['feature_bytes'] / gib:.2f} GiB" + (f" ({d['feature_bytes'] / cap:.1f}x the {cap / gib:.2f} GiB cap)"
                                                       if cap else "")
             + f"; {d.get('model', 'GraphSAGE')}, {d['layers']} layers, hidden {d['hidden']}; sequential read "
             + (f"{d['sequential_bytes_per_s'] / 1e6:.0f} MB/s" if d.get("sequential_bytes_per_s") else "-") + ".",
             "",
             "| inference | memory | every node, s | notes |", "|---|---|--:|---|"]  # fmt: skip
    names = {"layerwise": "layer-wise, out of core (ours)", "sampled": "sampled, our datamodule's predict",
             "pyg": "PyG in memory, whole graph per layer"}  # fmt: skip
    for v, r in res.items():
        where = ("uncapped" if v == "pyg" or not cap else f"{cap / gib:.2f} GiB cap")
        if not r.get("ok"):
            lines.append(f"| {names.get(v, v)} | {where} | - | did not run: {r.get('error', '')} |")
            continue
        if v == "layerwise":
            parts = r["partitions"]
            parts = ", ".join(f"{t} {n}" for t, n in parts.items()) if isinstance(parts, dict) else parts
            note = (f"{r['schedule']} schedule, {parts} partitions; peak anonymous "
                    f"{(r.get('peak_anon_bytes') or 0) / gib:.2f} GiB")  # fmt: skip
            secs = f"{r['seconds']:.1f}"
        elif v == "sampled":
            note = (f"{r['seeds']:,} test seeds in {r['seconds']:.1f} s, fanout {d['fanout']}, batch "
                    f"{d.get('batch_size', 1000)}, {d.get('workers', 2)} sampler(s), extrapolated to every "
                    "node at the same seconds per seed")  # fmt: skip
            secs = f"{r.get('all_nodes_seconds', 0):.0f}"
        else:
            note = (f"features read in and adjacency built {r['load_seconds']:.1f} s; layers "
                    + ", ".join(f"{t:.1f}" for t in r["layer_seconds"]) + " s")  # fmt: skip
            secs = f"{r['seconds']:.1f}"
        lines.append(f"| {names.get(v, v)} | {where} | {secs} | {note} |")
    if d.get("speedup_over_sampled"):
        lines += ["", f"Layer-wise over sampled inference of every node: **{d['speedup_over_sampled']:.1f}x** (goal >= 5x)."]
    lw = res.get("layerwise")
    if lw and lw.get("ok"):
        goal = any(layer.get("moved_over_goal") is not None for layer in lw["layers"])  # older results have none
        lines += ["", "| layer | kind | seconds | I/O s | compute s | moved | schedule must move | moved / must | "
                  "bound: moved at sequential rate + compute, s | seconds / bound |"
                  + (" moved / (3 x input + edges x hidden x 4 B) |" if goal else ""),
                  "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|" + ("--:|" if goal else "")]  # fmt: skip
        for layer in lw["layers"]:
            moved, must = sum(layer["moved"].values()), sum(layer["expected"].values())
            bound = layer.get("bound_seconds")
            kind = layer["kind"] + (", message table" if layer.get("messages") else "")
            lines.append(f"| {layer['layer']} | {kind} | {layer['seconds']:.1f} | {layer['io_seconds']:.1f} | "
                         f"{layer.get('compute_seconds', 0):.1f} | {moved / gib:.2f} GiB | {must / gib:.2f} GiB | "
                         f"{moved / max(1, must):.2f} | {_num(bound, '{:.1f}')} | "
                         f"{_num(bound and layer['seconds'] / bound, '{:.2f}')} |"
                         + (f" {_num(layer.get('moved_over_goal'), '{:.2f}')} |" if goal else ""))  # fmt: skip
    return "\n".join(lines)


def infer_growth_points(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per ``bench infer`` result, smallest graph first: ours' and PyG's seconds (``None`` where the
    variant did not run), each per edge and layer, ours' bytes moved over the layers' input tables and the
    worst layer's bytes over the goal's budget."""
    points = []
    for d in sorted(docs, key=lambda d: d["num_nodes"]):
        lw, pyg = d["results"].get("layerwise") or {}, d["results"].get("pyg") or {}
        layers = lw.get("layers") or []
        edge_layers = d["num_edges"] * max(1, len(layers) or d.get("layers", 1))
        moved = sum(sum(layer["moved"].values()) for layer in layers)
        tables = sum(layer.get("input_table_bytes") or 0 for layer in layers)
        goals = [layer["moved_over_goal"] for layer in layers if layer.get("moved_over_goal") is not None]
        p = {"doc": d, "ours": lw.get("seconds") if lw.get("ok") else None,
             "pyg": pyg.get("seconds") if pyg.get("ok") else None,
             "moved_over_tables": moved / tables if tables else None, "worst_goal": max(goals) if goals else None}  # fmt: skip
        for k in ("ours", "pyg"):
            p[f"{k}_us_per_edge"] = p[k] * 1e6 / edge_layers if p[k] else None
        points.append(p)
    return points


def format_infer_growth(docs: list[dict[str, Any]]) -> str:
    """``bench infer`` results on graphs of several sizes as one table: how layer-wise inference's seconds and
    bytes grow with the graph against the memory it was given, beside PyG in memory where it ran."""
    lines = ["| graph | nodes | edges | features / partition memory | ours s | PyG in memory s | ours / PyG | "
             "moved / input tables | moved / (3 x input + edges x hidden x 4 B), worst layer | us per edge |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for p in infer_growth_points(docs):
        d, ours, theirs = p["doc"], p["ours"], p["pyg"]
        lines.append(f"| `{d['dataset']}` | {d['num_nodes']:,} | {d['num_edges']:,} | "
                     f"{_num(d['feature_bytes'] / d['memory'] if d.get('memory') else None, '{:.1f}x')} | "
                     f"{_num(ours)} | {_num(theirs)} | {_num(ours / theirs if ours and theirs else None, '{:.2f}')} | "
                     f"{_num(p['moved_over_tables'], '{:.1f}')} | {_num(p['worst_goal'], '{:.2f}')} | "
                     f"{_num(p['ours_us_per_edge'], '{:.2f}')} |")  # fmt: skip
    lines += ["", "One `bench infer` result per graph, one run each. *features / partition memory*: the feature file over "
              "the bytes layer-wise inference planned its partitions in; *moved / input tables*: bytes read and "
              "written over all layers, over the sum of the layers' input tables; *us per edge*: ours' seconds per "
              "edge and layer."]  # fmt: skip
    return "\n".join(lines)


def plot_infer_growth(docs: list[dict[str, Any]], path: Path) -> str:
    """One figure of :func:`format_infer_growth`'s results: seconds per edge and layer (ours, PyG in memory) and
    bytes moved over the input tables, against the graph's nodes."""
    try:
        import matplotlib  # lazy: matplotlib only for the plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    points = infer_growth_points(docs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, style, what in ((left, "ours_us_per_edge", "o-", "ours, out of core"),
                                 (left, "pyg_us_per_edge", "s--", "PyG in memory"),
                                 (right, "moved_over_tables", "o-", "ours")):  # fmt: skip
        xy = [(p["doc"]["num_nodes"], p[key]) for p in points if p[key] is not None]
        if xy:
            ax.plot(*zip(*xy), style, label=what)
    return _growth_figure(fig, ((left, "us per edge and layer"), (right, "bytes moved / input tables")),
                          [p["doc"]["num_nodes"] for p in points], "nodes",
                          "lightning-ooc bench infer: every node's outputs as the graph grows", path)  # fmt: skip


#: how each kind of result renders: one result, or (``MULTI``) the results of one block's several paths
RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {"epoch": format_epoch, "sample": format_sample,
                                                          "io": format_io, "synth": lambda d: format_synth([d]),
                                                          "embed": format_embed, "import": lambda d: format_import([d]),
                                                          "distributed": format_distributed,
                                                          "infer": format_infer}  # fmt: skip
MULTI: dict[str, Callable[[list[dict[str, Any]]], str]] = {"epoch": format_scaling, "synth": format_synth,
                                                           "import": format_import, "infer": format_infer_growth}

_BLOCK = re.compile(r"(<!-- report (?P<path>\S+(?: \S+)*?) -->\n)(?P<body>.*?)(<!-- /report -->)", re.S)


def load_result(path: Path) -> dict[str, Any]:
    """One result JSON, with a clear error when it is missing or not a result."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: no such result; run the benchmark that writes it, or fix the path") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}: not a JSON result ({e})") from None
    if not isinstance(doc, dict) or doc.get("kind") not in RENDERERS:
        kind = doc.get("kind") if isinstance(doc, dict) else None
        raise SystemExit(f"{path}: a result of kind {kind!r}; `bench report` renders {', '.join(RENDERERS)}")
    return doc


def render_file(path: Path) -> str:
    """The tables of one result JSON."""
    doc = load_result(path)
    return RENDERERS[doc["kind"]](doc)


def render_files(paths: list[Path]) -> str:
    """The tables of one report block: one result as :func:`render_file`; several of one kind as one table
    (``synth``: a line per graph; ``epoch``: the cost per seed as the graph grows)."""
    if len(paths) == 1:
        return render_file(paths[0])
    docs = [load_result(p) for p in paths]
    kinds = {d["kind"] for d in docs}
    if len(kinds) > 1 or next(iter(kinds)) not in MULTI:
        raise SystemExit(f"{', '.join(map(str, paths))}: one report block renders several results only when all "
                         f"are of one kind of {', '.join(MULTI)}; these are {', '.join(sorted(kinds))}")  # fmt: skip
    return MULTI[docs[0]["kind"]](docs)


def rebuild(markdown: str, base: Path) -> tuple[str, list[str]]:
    """``markdown`` with every report block rebuilt from its JSON (paths relative to ``base``), and the paths of
    the blocks that changed."""
    changed: list[str] = []

    def sub(m: re.Match) -> str:
        body = render_files([base / p for p in m["path"].split()]) + "\n"
        if body != m["body"]:
            changed.append(m["path"])
        return m.group(1) + body + m.group(4)

    return _BLOCK.sub(sub, markdown), changed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("markdown", nargs="?", type=Path, default=Path("BENCHMARKS.md"),
                   help="the Markdown file whose report blocks to rebuild (default: BENCHMARKS.md)")  # fmt: skip
    p.add_argument("--check", action="store_true", help="change nothing; fail if a block differs from its JSON")
    p.add_argument("--plot-scaling", type=Path, metavar="PNG",
                   help="instead: plot how the cost of the --results grows with the graph (bench epoch: per seed; "
                        "bench infer: per edge and bytes moved) to this PNG and print their table")  # fmt: skip
    p.add_argument("--results", type=Path, nargs="+", metavar="JSON", help="the results --plot-scaling reads")


def run(args: argparse.Namespace) -> int:
    if args.plot_scaling is not None:
        if not args.results:
            raise SystemExit("--plot-scaling needs --results: the bench epoch JSON of each graph size")
        docs = [load_result(p) for p in args.results]
        kinds = {d["kind"] for d in docs}
        if kinds == {"infer"}:
            print(format_infer_growth(docs))
            print(plot_infer_growth(docs, args.plot_scaling))
            return 0
        if kinds != {"epoch"}:
            raise SystemExit("--plot-scaling reads results of one kind: bench epoch, or bench infer")
        print(format_scaling(docs))
        print(plot_scaling(docs, args.plot_scaling))
        return 0
    path: Path = args.markdown
    if not path.exists():
        raise SystemExit(f"{path}: no such file")
    text = path.read_text()
    new, changed = rebuild(text, path.parent)
    blocks = len(_BLOCK.findall(text))
    if args.check:
        if changed:
            print(f"{path}: {len(changed)} of {blocks} report block(s) differ from their results: "
                  f"{', '.join(changed)}; run `lightning-ooc bench report {path}`", file=sys.stderr)  # fmt: skip
            return 1
        print(f"{path}: {blocks} report block(s), each as its results render it")
        return 0
    if changed:
        path.write_text(new)
    print(f"{path}: {blocks} report block(s), {len(changed)} rebuilt")
    return 0
