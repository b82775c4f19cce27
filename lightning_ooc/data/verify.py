"""``lightning-ooc verify``: every checksum and every index of a dataset."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lightning_ooc.data.commit import TargetLock, write_json_last
from lightning_ooc.data.dataset import OnDiskDataset, open_dataset, read_meta
from lightning_ooc.data.format import META_FILE, META_PENDING, SPLITS, checksum_file, meta_digest
from lightning_ooc.data.importers.sources import NpzMember, stored_npz_member_at
from lightning_ooc.data.in_place import IN_PLACE, accept_in_place, check_in_place, verify_in_place
from lightning_ooc.data.link_splits import LABEL_RULE, bad_id_text, bad_label_text, find_leaks
from lightning_ooc.errors import DatasetError, DatasetWriteError, InputError
from lightning_ooc.utils.progress import progress_bar
from lightning_ooc.data.hetero_dataset import relation_key

_CHUNK = 1 << 24


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    warning: bool = False


@dataclass
class VerifyReport:
    root: Path
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, detail: str = "", warning: bool = False) -> None:
        self.checks.append(Check(name, ok, detail, warning))

    def format(self) -> str:
        out = []
        for c in self.checks:
            tag = "ok  " if c.ok and not c.warning else ("warn" if c.ok else "FAIL")
            out.append(f"[{tag}] {c.name}" + (f": {c.detail}" if c.detail else ""))
        bad = sum(not c.ok for c in self.checks)
        out.append(f"{self.root}: " + ("all checks passed" if not bad else f"{bad} check(s) failed"))
        return "\n".join(out)


def verify(root: str | os.PathLike, progress: bool = True, full: bool = False, accept: bool = False) -> VerifyReport:
    """Check every file's size and checksum and every index; never raises on a bad dataset.

    A feature file used in place (outside the directory, maybe terabytes) gets the checks of every open (size,
    inode, modification time, header and sampled blocks) unless ``full``, which checksums every byte of it.

    ``accept`` (with ``full``): a file used in place whose size is the recorded one but whose modification time or
    inode changed (a copy without ``-p``, ``touch``, a restore) is accepted if its header and every row byte match
    the checksums recorded at import: meta.json (rewritten atomically, its own checksum updated) then records its
    time and identity now, so the dataset opens again. One whose bytes differ fails, and meta.json is left as it
    was (the records of the other files too).
    """
    if accept and not full:
        raise ValueError("accept needs full: a file is accepted only once every row byte is checksummed")
    root = Path(root)
    report = VerifyReport(root)
    try:
        meta = read_meta(root)
    except DatasetError as e:
        report.add("meta.json", False, str(e))
        return report
    if meta["version"] < 2:
        report.add("meta.json", True, f"{meta['format']} v{meta['version']}: no checksum of its own (format version "
                   "1), so an edit to it goes unseen; rebuild the dataset to protect it", warning=True)  # fmt: skip
    else:
        report.add("meta.json", True, f"{meta['format']} v{meta['version']}, its own checksum matches")

    files = meta["files"]
    total = sum(int(e["bytes"]) for e in files.values() if (root / e["name"]).is_file() and not (root / e["name"]).is_symlink())
    with progress_bar(total, "checksums", "B", progress) as bar:
        for key, entry in files.items():
            path = root / entry["name"]
            if path.is_symlink() or (path.exists() and not path.is_file()):
                report.add(entry["name"], False, "not a regular file of the dataset (a link, a directory or a device)")
                continue
            if not path.is_file():
                report.add(f"{entry['name']}", False, "missing")
                continue
            size = path.stat().st_size
            if size != int(entry["bytes"]):
                report.add(entry["name"], False, f"{size} bytes, meta.json records {entry['bytes']}")
                bar.update(size)
                continue
            digest = checksum_file(path, bar)
            if digest != entry.get("checksum"):
                report.add(entry["name"], False, f"checksum {digest} differs from recorded {entry.get('checksum')}")
            else:
                report.add(entry["name"], True, "size and checksum match")
    if accept:
        _accept_in_place(root, meta, report, progress)
    else:
        _verify_in_place(root, meta, report, progress, full)
    try:
        ds = open_dataset(root)
    except DatasetError as e:
        report.add("open", False, str(e))
        return report
    if ds.is_hetero:
        _verify_hetero(ds, report, progress)
        return report
    _verify_csc(report, "", ds.indptr, ds.indices, ds.num_nodes, ds.num_edges, bool(meta.get("sorted_neighbors")),
                progress)  # fmt: skip
    _verify_time_order(report, "", ds.indptr, ds.indices, ds.neighbor_order, ds.edge_time, ds.node_time, progress)
    _verify_nodes(report, "", ds)
    if ds.has_link_splits:
        _verify_links(ds, report)
    if ds.partition is not None:
        _verify_partition(ds, report)
    return report


def _verify_in_place(root: Path, meta: dict, report: VerifyReport, progress: bool, full: bool) -> None:
    """Feature files used in place: checksummed whole with ``full``, else as every open checks them."""
    records = meta.get(IN_PLACE, {})
    if not full:
        for key, rec in records.items():
            try:
                check_in_place(rec, key, root)
            except DatasetError as e:
                report.add(f"{key} (in place)", False, str(e))
                continue
            report.add(f"{key} (in place)", True, f"{rec['path']}: size, time, header and {rec['sample_blocks']} "
                       "sampled blocks match; `verify --full` checksums every byte")  # fmt: skip
        return
    members = _npz_members(records)
    total = sum(r["num_rows"] * r["row_bytes"] for r in records.values()) + \
        sum(m.data_bytes for m in members.values())  # fmt: skip
    with progress_bar(total, "checksums (in place)", "B", progress) as bar:
        for key, rec in records.items():
            ok, detail = verify_in_place(rec, key, bar, root)
            if ok and key in members:
                ok, detail = _member_crc(members[key], detail, bar)
            report.add(f"{key} (in place)", ok, detail)


def _npz_members(records: dict) -> dict[str, NpzMember]:
    """The stored ``.npz`` members among the files used in place, by key (their CRC-32 is checked too)."""
    found = {key: stored_npz_member_at(rec["path"], rec["offset"]) for key, rec in records.items()}
    return {key: m for key, m in found.items() if m is not None}


def _member_crc(member: NpzMember, detail: str, bar: Any) -> tuple[bool, str]:
    """``(ok, detail)`` of a stored ``.npz`` member used in place, read whole against the archive's CRC-32."""
    try:
        member.verify_crc(bar)
    except InputError as e:
        return False, str(e)
    return True, f"{detail}; the member {member.key!r} matches the archive's CRC-32"


def _accept_in_place(root: Path, meta: dict, report: VerifyReport, progress: bool) -> None:
    """``verify --full --accept``: every file used in place checksummed whole; where every one matches, the records
    of those whose time or identity changed are updated in meta.json (written to a pending file, renamed over it),
    under the writers' lock, if meta.json is still the one read. Where one does not, nothing is written."""
    records = meta.get(IN_PLACE, {})
    accepted: dict[str, dict] = {}
    failed = []
    members = _npz_members(records)
    total = sum(r["num_rows"] * r["row_bytes"] for r in records.values()) + \
        sum(m.data_bytes for m in members.values())  # fmt: skip
    with progress_bar(total, "checksums (in place)", "B", progress) as bar:
        for key, rec in records.items():
            ok, detail, new = accept_in_place(rec, key, bar, root)
            if ok and key in members:
                ok, detail = _member_crc(members[key], detail, bar)
            report.add(f"{key} (in place)", ok, detail)
            if not ok:
                failed.append(key)
            elif new is not None:
                accepted[key] = new
    if not accepted:
        return
    check = "meta.json (accept)"
    if failed:  # all or nothing: the dataset does not open until every file is fixed anyway
        report.add(check, False, f"nothing accepted, meta.json is unchanged: {', '.join(accepted)} matched, but "
                   f"{', '.join(failed)} did not")  # fmt: skip
        return
    try:
        with TargetLock(root):  # no writer replaces the dataset meanwhile
            now = read_meta(root)
            if meta_digest(now) != meta_digest(meta):
                report.add(check, False, "meta.json changed while the files were checksummed (the dataset was "
                           "written again?); nothing accepted: run `verify --full --accept` again")  # fmt: skip
                return
            for key, new in accepted.items():
                now[IN_PLACE][key] = new
            if "meta_checksum" in now:
                now["meta_checksum"] = meta_digest(now)
            write_json_last(root, META_FILE, now, META_PENDING)
    except (DatasetError, DatasetWriteError, OSError) as e:
        report.add(check, False, f"cannot update meta.json ({e}); nothing accepted")
        return
    meta.clear()
    meta.update(now)
    report.add(check, True, f"records of {', '.join(accepted)} updated (new time and identity; the dataset's "
               "identity, its meta.json checksum, changes with them)")  # fmt: skip


def _verify_partition(ds: OnDiskDataset, report: VerifyReport) -> None:
    """A part of a partitioned dataset: its rows' ids (``nodes.npy``) ascending, unique, in range and owned by
    this part in ``owner.npy``, which gives it exactly that many nodes; its splits hold only nodes it owns."""
    p = ds.partition
    n = ds.num_nodes
    nodes = np.asarray(p.nodes)
    problems = []
    in_range = not nodes.size or (int(nodes.min()) >= 0 and int(nodes.max()) < n)
    if not in_range:
        problems.append(f"ids outside [0, {n})")
    if nodes.size > 1 and not bool(np.all(nodes[1:] > nodes[:-1])):
        problems.append("not strictly ascending (unsorted or repeated ids)")
    report.add("partition nodes", not problems,
               "; ".join(problems) or f"{nodes.size:,} rows, ascending, unique, in [0, {n})")  # fmt: skip
    owner = p.owner
    bad_owner = int(((owner < 0) | (owner >= p.parts)).sum())
    owned = int((owner == p.index).sum())
    problems = []
    if bad_owner:
        problems.append(f"{bad_owner:,} parts outside [0, {p.parts})")
    if owned != p.num_rows:
        problems.append(f"gives part {p.index} {owned:,} nodes but it holds {p.num_rows:,} rows")
    if in_range and nodes.size:
        mismatch = int((owner[nodes] != p.index).sum())
        if mismatch:
            problems.append(f"{mismatch:,} of this part's rows belong to other parts")
    report.add("partition owner", not problems,
               "; ".join(problems) or f"part {p.index} of {p.parts} owns exactly its {p.num_rows:,} rows")  # fmt: skip
    for s in SPLITS:
        ids = ds.split(s).numpy()
        ids = ids[(ids >= 0) & (ids < n)]
        foreign = int((owner[ids] != p.index).sum()) if ids.size else 0
        report.add(f"partition split {s}", foreign == 0,
                   f"{foreign:,} nodes owned by other parts" if foreign else "only nodes this part owns")  # fmt: skip


def _verify_csc(report: VerifyReport, name: str, ip: np.ndarray, idx: np.ndarray, n: int, num_edges: int,
                sorted_neighbors: bool, progress: bool) -> None:  # fmt: skip
    """A CSC's sources: every id in ``[0, n)`` (``n``: the source nodes), sorted per target where promised."""
    what = f"{name} " if name else ""
    report.add(f"{what}indptr", True, f"monotone, 0..{num_edges}")
    targets = ip.size - 1
    bad_range = 0
    unsorted = 0
    with progress_bar(num_edges, f"check {what}indices", "edge", progress) as bar:
        for s in range(0, num_edges, _CHUNK):
            part = np.asarray(idx[s : s + _CHUNK + 1]).astype(np.int64)
            body = part[: min(_CHUNK, part.size)]
            bad_range += int(((body < 0) | (body >= n)).sum())
            if sorted_neighbors and part.size > 1:
                pos = np.flatnonzero(part[1:] < part[:-1]) + s + 1  # global position of the smaller element
                if pos.size:
                    k = np.searchsorted(ip, pos, side="left")
                    unsorted += int((ip[np.minimum(k, targets)] != pos).sum())
            bar.update(body.size)
    report.add(f"{what}indices", bad_range == 0,
               f"{bad_range:,} ids outside [0, {n})" if bad_range else f"all in [0, {n})")  # fmt: skip
    if sorted_neighbors:
        report.add(f"{what}neighbour order", unsorted == 0,
                   f"{unsorted:,} out-of-order entries" if unsorted else "sorted per node")  # fmt: skip


def _verify_time_order(report: VerifyReport, name: str, ip: np.ndarray, idx: np.ndarray, order: str,
                       edge_time: np.ndarray | None, node_time: np.ndarray | None, progress: bool) -> None:  # fmt: skip
    """Each node's in-edges in time order, where the dataset says so (what temporal sampling's binary search
    needs)."""
    if order == "source_id":
        return
    what = f"{name} " if name else ""
    times = edge_time if order == "edge_time" else node_time
    if times is None:
        report.add(f"{what}time order", False, f"neighbor_order is {order} but there are no such times")
        return
    n_edges = int(ip[-1])
    targets = ip.size - 1
    late = 0
    with progress_bar(n_edges, f"check {what}time order", "edge", progress) as bar:
        for s in range(0, n_edges, _CHUNK):
            e = min(n_edges, s + _CHUNK + 1)
            if order == "edge_time":
                t = np.asarray(edge_time[s:e], dtype=np.int64)
            else:
                src = np.asarray(idx[s:e]).astype(np.int64)
                t = np.asarray(node_time[np.clip(src, 0, len(node_time) - 1)], dtype=np.int64)
            pos = np.flatnonzero(t[1:] < t[:-1]) + s + 1  # a drop in time not at a node's first in-edge
            if pos.size:
                k = np.searchsorted(ip, pos, side="left")
                late += int((ip[np.minimum(k, targets)] != pos).sum())
            bar.update(e - s)
    report.add(f"{what}time order", late == 0,
               f"{late:,} in-edges earlier than the one before them" if late else f"each node's in-edges by "
               f"{order.replace('_', ' ')}")  # fmt: skip


def _verify_nodes(report: VerifyReport, name: str, ds) -> None:
    """Labels in ``[-1, C)``; each split's ids in range, unique and labelled; overlaps as warnings."""
    what = f"{name} " if name else ""
    n = ds.num_nodes
    bad_labels = 0
    for s in range(0, n, _CHUNK):
        part = np.asarray(ds.labels[s : s + _CHUNK])
        bad_labels += int(((part < -1) | (part >= ds.num_classes)).sum())
    report.add(f"{what}labels", bad_labels == 0,
               f"{bad_labels:,} outside [-1, {ds.num_classes})" if bad_labels else "in range")  # fmt: skip

    seen: dict[str, np.ndarray] = {}
    for s in SPLITS:
        ids = ds.split(s).numpy()
        problems = []
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            problems.append(f"ids outside [0, {n})")
        times = ds.split_time(s) if hasattr(ds, "split_time") else None
        if times is None and np.unique(ids).size != ids.size:
            problems.append("duplicate ids")
        if times is not None and ids.size and np.unique(np.stack([ids, times.numpy()], 1), axis=0).shape[0] < ids.size:
            problems.append("duplicate ids at the same time")
        if ds.num_classes and ids.size and not problems:
            unlabelled = ds.unlabelled(s).size
            if unlabelled:
                problems.append(f"{unlabelled:,} nodes without a label in [0, {ds.num_classes})")
        report.add(f"{what}split {s}", not problems, "; ".join(problems) or f"{ids.size:,} nodes")
        seen[s] = ids
    for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
        both = np.intersect1d(seen[a], seen[b]).size
        if both:
            report.add(f"{what}splits {a}/{b}", True, f"{both:,} nodes in both", warning=True)


def _verify_hetero(ds, report: VerifyReport, progress: bool) -> None:
    """Every relation's CSC against its source and destination types; every labelled type's labels and splits."""

    for et, csc in ds.csc.items():  # sorted by source id unless in time order
        _verify_csc(report, relation_key(et), csc.indptr, csc.indices, csc.num_src_nodes, csc.num_edges,
                    csc.neighbor_order == "source_id", progress)  # fmt: skip
        _verify_time_order(report, relation_key(et), csc.indptr, csc.indices, csc.neighbor_order, csc.edge_time,
                           ds.node(et[0]).node_time, progress)  # fmt: skip
    for t in ds.node_types:
        node = ds.node(t)
        if node.has_labels:
            _verify_nodes(report, t, node)


def _verify_links(ds: OnDiskDataset, report: VerifyReport) -> None:
    """Link splits: node ids in range; labels 0 or 1; val/test positives absent from the stored graph where
    meta.json says so."""
    meta = ds.link_splits
    n = ds.num_nodes
    for name, entry in meta["splits"].items():
        ls = ds.link_split(name, check_labels=False)  # reported here, not raised
        if ls.label is not None:
            bad_label = bad_label_text(ls.label.numpy())
            report.add(f"link split {name} labels", bad_label is None,
                       f"{bad_label}, but {LABEL_RULE}" if bad_label else "0 or 1")  # fmt: skip
        pairs = ls.index.t().numpy()  # (M, 2), as stored; open_dataset checked every file's shape
        bad = bad_id_text(pairs, n, "index")
        if bad is None and ls.neg_dst is not None:
            bad = bad_id_text(ls.neg_dst.numpy(), n, "neg_dst")
        fields = ", ".join(entry["fields"]) or "no fields"
        report.add(f"link split {name}", bad is None, f"{bad}: a node id outside [0, {n})" if bad
                   else f"{len(pairs):,} edges ({fields}), ids in [0, {n})")  # fmt: skip
        if name == "train" or bad:
            continue
        label = None if ls.label is None else ls.label.numpy()
        count, first = find_leaks(ds.indptr, ds.indices, pairs, label, ds.neighbor_order == "source_id")
        check = f"link split {name} leakage"
        if count:
            s, d = (int(v) for v in pairs[first])
            what = f"{count:,} positive edge(s) are edges of the message-passing graph, e.g. {s} -> {d} (row {first})"
            if meta["leakage_free"]:
                report.add(check, False, what + ", but meta.json says leakage_free")
            else:
                report.add(check, True, what + " (meta.json does not say leakage_free)", warning=True)
        elif meta["leakage_free"]:
            report.add(check, True, "no positive edge is in the message-passing graph")
