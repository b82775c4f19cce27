"""``prepare --from tgb DIR``: a TGB dynamic link prediction dataset (events with times, fixed negatives),
on fixtures written in TGB's layout; then temporal link batches over it, evaluated as TGB does (MRR)."""
from __future__ import annotations

import pickle
import subprocess
import sys

import lightning as L
import numpy as np
import pytest
import torch

from lightning_ooc import InMemory, OutOfCoreLinkData, open_dataset
from lightning_ooc.data.importers import detect, import_dataset
from lightning_ooc.errors import InputError


def write_tgb(root, name="tgbl-wiki", events=600, users=40, items=30, k=7, hex_ids=False, seed=0):
    """A TGB event list and its negatives: wiki's columns (user, item, timestamp, label, features), items numbered
    after the users as TGB does (item + largest user id + 1), or coin's (timestamp, src, dst, weight) with names
    numbered at first sight."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    u = rng.integers(0, users, events)
    i = rng.integers(0, items, events)
    t = np.sort(rng.integers(0, 100_000, events)).astype(np.float64)
    lines = []
    if hex_ids:
        lines.append("timestamp,src,dst,weight")
        for a, b, ts in zip(u, i, t):
            lines.append(f"{int(ts)},0x{a:04x},0x{b:04x},{rng.random():.3f}")
        numbers: dict[str, int] = {}
        su, sd = [], []
        for a, b in zip(u, i):
            su.append(numbers.setdefault(f"0x{a:04x}", len(numbers)))
            sd.append(numbers.setdefault(f"0x{b:04x}", len(numbers)))
        tgb_u, tgb_i, n = np.array(su), np.array(sd), len(numbers)
    else:
        lines.append("user_id,item_id,timestamp,state_label,comma_separated_list_of_features")
        for a, b, ts in zip(u, i, t):
            lines.append(f"{a},{b},{ts},0,0.1,0.2")
        tgb_u, tgb_i = u, i + int(u.max()) + 1
        n = int(tgb_i.max()) + 1
    (root / f"{name}_edgelist_v2.csv").write_text("\n".join(lines) + "\n")
    val_time, test_time = np.quantile(t.astype(np.int64), [0.70, 0.85])
    for split, mask in (("val", (t > val_time) & (t <= test_time)), ("test", t > test_time)):
        table = {(int(a), int(b), int(ts)): rng.integers(0, n, k) for a, b, ts in
                 zip(tgb_u[mask], tgb_i[mask], t[mask])}  # fmt: skip
        with open(root / f"{name}_{split}_ns_v2.pkl", "wb") as f:
            pickle.dump(table, f)
    return root, (tgb_u, tgb_i, t.astype(np.int64), n)


def test_imports_events_with_times_and_tgb_splits(tmp_path):
    src, (u, i, t, n) = write_tgb(tmp_path / "tgbl-wiki")
    assert detect(src) == "tgb"
    root = import_dataset(tmp_path / "out", src, progress=False)
    ds = open_dataset(root)
    assert ds.num_nodes == n and ds.neighbor_order == "edge_time"
    assert ds.num_edges == 2 * t.size  # every event, with its reverse
    # the stored graph's edges at their times
    dst = np.repeat(np.arange(ds.num_nodes), np.diff(ds.indptr))
    stored = sorted(zip(np.asarray(ds.indices).tolist(), dst.tolist(), np.asarray(ds.edge_time).tolist()))
    given = sorted(list(zip(u.tolist(), i.tolist(), t.tolist())) + list(zip(i.tolist(), u.tolist(), t.tolist())))
    assert stored == given
    # TGB's chronological split, each event at its timestamp minus one, negatives in TGB's order
    val_time, test_time = np.quantile(t, [0.70, 0.85])
    masks = {"train": t <= val_time, "val": (t > val_time) & (t <= test_time), "test": t > test_time}
    negatives = {s: pickle.load(open(src / f"tgbl-wiki_{s}_ns_v2.pkl", "rb")) for s in ("val", "test")}
    for s, m in masks.items():
        ls = ds.link_split(s)
        assert ls.index.tolist() == [u[m].tolist(), i[m].tolist()]
        assert ls.time.tolist() == (t[m] - 1).tolist()
        if s != "train":
            want = [negatives[s][(a, b, c)].tolist() for a, b, c in zip(u[m], i[m], t[m])]
            assert ls.neg_dst.tolist() == want
    r = subprocess.run([sys.executable, "-m", "lightning_ooc", "verify", str(root)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_names_are_numbered_as_tgb_numbers_them(tmp_path):
    src, (u, i, t, n) = write_tgb(tmp_path / "tgbl-coin", name="tgbl-coin", hex_ids=True)
    ds = open_dataset(import_dataset(tmp_path / "out", src, "tgb", progress=False))
    assert ds.num_nodes == n
    val_time, test_time = np.quantile(t, [0.70, 0.85])
    m = t > test_time
    assert ds.link_split("test").index.tolist() == [u[m].tolist(), i[m].tolist()]
    with pytest.raises(InputError, match="'0x0.*' is not an integer.*--tgb-ids first-seen"):
        import_dataset(tmp_path / "out2", src, "tgb", progress=False, extra={"tgb_ids": "as-given"})
    # numbered otherwise, the negatives do not match: the error names the option to try
    wiki, _ = write_tgb(tmp_path / "tgbl-wiki")
    with pytest.raises(InputError, match="no negatives for val event 0.*try --tgb-ids"):
        import_dataset(tmp_path / "out3", wiki, "tgb", progress=False, extra={"tgb_ids": "as-given"})


def test_a_negatives_file_cannot_run_code(tmp_path):
    src, _ = write_tgb(tmp_path / "tgbl-wiki")

    class Evil:
        def __reduce__(self):
            return (print, ("this runs code",))

    with open(src / "tgbl-wiki_val_ns_v2.pkl", "wb") as f:
        pickle.dump({(0, 1, 2): Evil()}, f)
    with pytest.raises(InputError, match="not a TGB negatives file.*builtins.print"):
        import_dataset(tmp_path / "out", src, progress=False)


def test_fractional_timestamps_are_refused(tmp_path):
    src, _ = write_tgb(tmp_path / "tgbl-wiki")
    csv = src / "tgbl-wiki_edgelist_v2.csv"
    lines = csv.read_text().splitlines()
    lines[3] = lines[3].replace(lines[3].split(",")[2], "12.5")
    csv.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match="12.5.*not a whole number"):
        import_dataset(tmp_path / "out", src, progress=False)


def test_trains_on_the_past_and_ranks_tgb_negatives(tmp_path):
    """Temporal link batches over the import: every sampled edge precedes its supervision event; validation ranks
    each event against TGB's negatives (val_mrr, TGB's metric), in order."""
    from lightning_ooc.models import LinkPredictor

    src, _ = write_tgb(tmp_path / "tgbl-wiki", events=1500)
    root = import_dataset(tmp_path / "out", src, progress=False)
    ds = open_dataset(root)
    edge_time = torch.from_numpy(np.asarray(ds.edge_time))
    dm = OutOfCoreLinkData(root, batch_size=64, num_neighbors=[5, 5], neg_sampling="binary", features=InMemory(), return_e_id=True, progress=False, pipeline={"order": "in_order"}, time={"time_attr": "edge_time"})  # fmt: skip
    dm.setup()
    for batch in dm.val_dataloader():
        d = batch.edge_index[1]
        assert bool((edge_time[batch.e_id] <= batch.seed_time[batch.batch[d]]).all())
        assert batch.dst_neg_index.shape == (batch.batch_size, 7)
    torch.manual_seed(0)
    model = LinkPredictor(1, hidden_channels=16, num_layers=2)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, datamodule=dm)
    out = trainer.validate(model, datamodule=dm, verbose=False)[0]
    assert 0 < out["val_mrr"] <= 1
    dm.teardown()
