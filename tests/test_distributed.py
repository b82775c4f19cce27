"""Several machines on one host: torchrun per "machine", over loopback, each with its own partition only.

Every seed is trained once per epoch across the machines, every batch's rows equal the unpartitioned
dataset's byte for byte, accuracy matches one machine's within noise, and a machine killed mid-epoch
surfaces as an error on the others within seconds (no hang).
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import lightning_ooc
from lightning_ooc.data.synth import synthesize
from lightning_ooc.partitioned.partition import partition_dataset

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    return synthesize(tmp / "g", num_nodes=4000, avg_degree=8, num_features=16, num_classes=4, train_frac=0.3,
                      val_frac=0.1, test_frac=0.2, progress=False)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machines(parts_out: Path, tmp: Path, parts: int) -> list[Path]:
    """One directory per machine holding its partition only (hard links: the other parts are not there)."""
    roots = []
    for k in range(parts):
        root = tmp / f"machine{k}" / "parts"
        shutil.copytree(parts_out / f"part-{k:05d}", root / f"part-{k:05d}", copy_function=os.link)
        roots.append(root)
    return roots


def _launch(roots: list[Path], out: Path, opts: list[str], timeout: float = 400) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for k, root in enumerate(roots):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(roots)), "--node-rank", str(k),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(TESTS / "partition_run.py"), str(root), str(out), *opts]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      start_new_session=True))  # fmt: skip
    results, deadline = [], time.monotonic() + timeout
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:  # the launcher and its worker
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    return results


def _metrics(out: Path, node: int) -> list[dict[str, str]]:
    files = sorted((out / f"log{node}").rglob("metrics.csv"))
    assert files, f"no metrics logged by machine {node}"
    with open(files[-1]) as f:
        return list(csv.DictReader(f))


def _one_machine_accuracy(graph: Path, tmp: Path) -> float:
    import lightning as L

    from lightning_ooc import OutOfCoreNodeData, Tiered
    from lightning_ooc.models import GraphSAGE

    L.seed_everything(0, workers=False)
    dm = OutOfCoreNodeData(graph, batch_size=100, num_neighbors=[5, 5], progress=False,
                           features=Tiered(gpu_cache="2MiB", host_cache="16KiB", staging="1MiB"),
                           pipeline=dict(num_samplers=1, num_extractors=2))  # fmt: skip
    model = GraphSAGE(dm.num_features, dm.num_classes, hidden_channels=32, num_layers=2, lr=0.01)
    trainer = L.Trainer(accelerator="cpu", max_epochs=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(model, datamodule=dm)
    return float(trainer.test(model, datamodule=dm, verbose=False)[0]["test_acc"])


@pytest.mark.parametrize("parts,policy", [(2, "scored"), pytest.param(4, "static", marks=pytest.mark.slow)])
def test_machines_train_every_seed_once_with_the_same_rows(graph, tmp_path, parts, policy):
    out = partition_dataset(graph, parts, tmp_path / "parts", progress=False)
    roots = _machines(out, tmp_path, parts)
    probe = tmp_path / "probe"
    results = _launch(roots, probe, [f"reference={graph}", f"policy={policy}", "epochs=3"])
    for k, r in enumerate(results):
        assert r.returncode == 0, f"machine {k} failed:\n{r.stdout[-6000:]}"
    ranks = [json.loads((probe / f"rank{k}.json").read_text()) for k in range(parts)]
    ds = lightning_ooc.open_dataset(graph)
    train = sorted(ds.split("train").tolist())
    owner = np.load(out / "owner.npy")
    for e in ("0", "1", "2"):
        seeds = [r["seeds"][e] for r in ranks]
        assert sorted(s for share in seeds for s in share) == train  # every seed once per epoch
        for k, share in enumerate(seeds):  # each machine trains the seeds it owns
            assert (owner[np.array(share)] == k).all()
    assert ranks[0]["seeds"]["0"] != ranks[0]["seeds"]["1"]  # reshuffled per epoch
    for r in ranks:
        assert r["checked"] > 0 and r["mismatch"] == 0  # rows byte-identical to the unpartitioned dataset
    rows = _metrics(probe, 0)
    remote = [float(row["ooc/train_remote_rows"]) for row in rows if row.get("ooc/train_remote_rows")]
    hit = [float(row["ooc/train_remote_hit_rate"]) for row in rows if row.get("ooc/train_remote_hit_rate")]
    sent = [float(row["ooc/train_exchange_bytes"]) for row in rows if row.get("ooc/train_exchange_bytes")]
    assert len(remote) == 3 and min(remote) > 0 and min(sent) > 0
    assert 0 < min(hit) <= max(hit) < 1  # the buffer served some remote rows, the owners the rest
    if policy == "scored":  # its eviction rounds replaced rows (and the rows above stayed exact)
        replaced = [float(row["ooc/train_remote_replaced_rows"]) for row in rows
                    if row.get("ooc/train_remote_replaced_rows")]  # fmt: skip
        assert len(replaced) == 3 and sum(replaced) > 0
    accs = [r["test"]["test_acc"] for r in ranks]
    assert max(accs) - min(accs) < 1e-6  # one model: every rank evaluates the same weights on its share
    single = _one_machine_accuracy(graph, tmp_path)
    assert abs(np.mean(accs) - single) < 0.08, (accs, single)


def test_a_killed_machine_is_an_error_on_the_others(graph, tmp_path):
    parts = 2
    out = partition_dataset(graph, parts, tmp_path / "parts", progress=False)
    roots = _machines(out, tmp_path, parts)
    probe = tmp_path / "probe"
    t0 = time.monotonic()
    results = _launch(roots, probe, ["kill_after=5", "epochs=50"], timeout=240)
    took = time.monotonic() - t0
    assert (probe / "killed").exists()
    for k, r in enumerate(results):
        assert r.returncode != 0, f"machine {k} exited 0 although machine {parts - 1} was killed"
    survivor = results[0].stdout
    assert "ExchangeError" in survivor or "Connection reset" in survivor or "Connection closed" in survivor, \
        survivor[-4000:]  # fmt: skip
    assert took < 200  # 50 epochs would take far longer: the survivor stopped on the error, it did not hang


def test_a_part_on_the_wrong_number_of_machines_or_a_missing_part_says_how_to_launch(graph, tmp_path):
    from lightning_ooc import OutOfCoreNodeData
    from lightning_ooc.errors import InputError

    out = partition_dataset(graph, 2, tmp_path / "parts", method="range", progress=False)
    dm = OutOfCoreNodeData(out / "part-00001", batch_size=100, num_neighbors=[3], progress=False)
    with pytest.raises(InputError, match=r"partition 1 of 2.*machine 0 of 1.*torchrun --nnodes 2"):
        dm.setup()
    lone = tmp_path / "machine0"
    shutil.copytree(out / "part-00001", lone / "part-00001", copy_function=os.link)
    dm = OutOfCoreNodeData(lone, batch_size=100, num_neighbors=[3], progress=False)
    assert dm.num_features == 16  # read from the part there, before any set-up
    with pytest.raises(InputError, match=r"machine 0 needs its partition part-00000 there \(found: part-00001\)"):
        dm.setup()


def test_every_process_cuts_its_seeds_into_the_agreed_number_of_batches():
    import torch

    from lightning_ooc.errors import InputError
    from lightning_ooc.loader.partitioned import cut, local_share

    seeds = torch.arange(23)
    shares = [local_share(seeds, r, 2) for r in range(2)]
    assert [s.numel() for s in shares] == [12, 11] and torch.equal(torch.cat(shares), seeds)
    b = cut(shares[1], 3, 5, drop_last=False)  # 11 seeds fill 3 batches of 5 as the others do
    assert [x.numel() for x in b] == [5, 5, 1] and torch.equal(b.cat(), shares[1])
    b = cut(torch.arange(8), 3, 5, drop_last=False)  # another process needs 3 batches: 8 seeds in 3 near-equal ones
    assert [x.numel() for x in b] == [3, 3, 2] and torch.equal(b.cat(), torch.arange(8))
    assert [x.numel() for x in cut(shares[0], 2, 5, drop_last=True)] == [5, 5]  # the fewest full batches any has
    with pytest.raises(InputError, match="too unbalanced in training seeds"):
        cut(torch.arange(2), 3, 5, drop_last=False)


def test_every_process_agrees_on_the_batches_of_an_epoch():
    from lightning_ooc.errors import InputError
    from lightning_ooc.loader.partitioned import agreed_batches

    assert agreed_batches([12, 11], 5, drop_last=False) == 3  # the most any process needs
    assert agreed_batches([12, 8], 5, drop_last=False) == 3  # 8 seeds: 3 near-equal batches
    assert agreed_batches([12, 11], 5, drop_last=True) == 2  # full batches, as many as the fewest seeds fill
    assert agreed_batches([0, 0], 5, drop_last=True) == 0
    with pytest.raises(InputError, match="too unbalanced"):
        agreed_batches([12, 2], 5, drop_last=False)
    with pytest.raises(InputError, match="fewer than one batch of 5: no process would train"):
        agreed_batches([12, 3], 5, drop_last=True)


@pytest.mark.slow
def test_a_machine_without_its_part_or_with_another_runs_part_stops_every_machine(graph, tmp_path):
    a = partition_dataset(graph, 2, tmp_path / "a", method="range", progress=False)
    b = partition_dataset(graph, 2, tmp_path / "b", method="random", progress=False)
    mixed = [_machines(a, tmp_path / "ma", 2)[0], _machines(b, tmp_path / "mb", 2)[1]]
    t0 = time.monotonic()
    results = _launch(mixed, tmp_path / "probe-mixed", ["epochs=1"], timeout=240)
    for k, r in enumerate(results):
        assert r.returncode != 0 and "parts of different `lightning-ooc partition` runs" in r.stdout, \
            f"machine {k}:\n{r.stdout[-4000:]}"  # fmt: skip
    both_0 = _machines(a, tmp_path / "mc", 2)[0]  # machine 1 was given machine 0's part
    results = _launch([both_0, both_0], tmp_path / "probe-missing", ["epochs=1"], timeout=240)
    assert results[1].returncode != 0 and "machine 1 needs its partition part-00001" in results[1].stdout
    assert results[0].returncode != 0 and "process 1 (machine 1) could not open its partition" in results[0].stdout, \
        results[0].stdout[-4000:]  # fmt: skip
    assert time.monotonic() - t0 < 200  # nobody waited for a collective's timeout (30 minutes)


def test_set_up_errors_reach_every_machine_with_shared_topology(graph, tmp_path):
    """Under the "ooc" strategy a machine keeps indptr in shared memory, whose creation is a collective: a machine
    given a whole dataset among partitioned ones, one without its part, or one whose part is damaged is the same
    one-line error on every machine (each process once took another's collective for its own: "too many values to
    unpack" on all, or a gloo traceback on the others)."""
    out = partition_dataset(graph, 2, tmp_path / "parts", method="range", progress=False)
    m0, m1 = _machines(out, tmp_path, 2)
    only_0 = _machines(out, tmp_path / "again", 2)[0]
    damaged = tmp_path / "damaged" / "parts"
    shutil.copytree(out / "part-00001", damaged / "part-00001")
    with open(damaged / "part-00001" / "features.bin", "r+b") as f:
        f.truncate(100)
    cases = {"mixed": f"{m0},{graph}", "missing": f"{m0},{only_0}", "damaged": f"{m0},{damaged}", "ok": f"{m0},{m1}"}
    probe = tmp_path / "probe"
    probe.mkdir()
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(TESTS / "layout_run.py"), str(probe),
                               *(f"{k}={v}" for k, v in cases.items())],
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                                   "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in range(2)]  # fmt: skip
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=180)
            assert p.returncode == 0, stdout[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    seen = [json.loads((probe / f"rank{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        kind, msg = seen[r]["mixed"]
        assert kind == "InputError" and "process 0 a partitioned one" in msg and "process 1 a whole one" in msg, msg
    assert seen[1]["missing"] == ["InputError", seen[1]["missing"][1]]
    assert "machine 1 needs its partition part-00001" in seen[1]["missing"][1]
    assert seen[0]["missing"][0] == "InputError"
    assert "process 1 (machine 1) could not open its partition" in seen[0]["missing"][1]
    assert seen[1]["damaged"][0] == "CorruptDatasetError" and "features.bin" in seen[1]["damaged"][1]
    assert seen[0]["damaged"][0] == "InputError" and "could not open its partition" in seen[0]["damaged"][1]
    assert seen[0]["ok"] is None and seen[1]["ok"] is None  # the shared indptr was made once every part opened
