"""Layer-wise inference and prediction outputs: nothing the run reads or did not write is replaced, a resumed run
reuses only layers that give the same outputs, and the memory given is fitted under the process's limit."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch_geometric.nn import SAGEConv
from torch_geometric.nn import models as pyg_models

import lightning_ooc
from lightning_ooc import OutOfCoreNodeData, PredictSettings
from lightning_ooc.data.prepare import prepare_from_arrays
from lightning_ooc.data.synth import synthesize
from lightning_ooc.data.synth_hetero import synthesize_hetero
from lightning_ooc.errors import DatasetWriteError, InputError
from lightning_ooc.infer import layerwise, plan_layerwise
from lightning_ooc.store.planner import LAYERWISE_MIN_MEMORY as MIN_MEMORY
from lightning_ooc.store.planner import LAYERWISE_OVER_MEMORY as OVER_MEMORY
from lightning_ooc.store.planner import LAYERWISE_RESERVE as RESERVE
from lightning_ooc.infer.predict import PredictionWriter
from lightning_ooc.infer.run import work_dir_for
from lightning_ooc.models import GraphSAGE
from lightning_ooc.models.relational import RelationalGNN

N, F = 2000, 8


def _digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _digests(root: Path) -> dict[str, str]:
    return {p.name: _digest(p) for p in sorted(root.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def graph(tmp_path_factory) -> Path:
    """A small dataset the tests read (never write)."""
    return synthesize(tmp_path_factory.mktemp("outputs") / "g", num_nodes=N, avg_degree=5, num_features=F,
                      num_classes=3, progress=False)  # fmt: skip


def _sage(act: str = "relu") -> nn.Module:
    torch.manual_seed(0)
    model = pyg_models.GraphSAGE(F, 16, num_layers=2, out_channels=3, act=act)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model.eval()


def _features(out: Path) -> np.ndarray:
    return np.array(lightning_ooc.open_dataset(out).features_memmap())


def _trainer(*callbacks) -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=list(callbacks))  # fmt: skip


# -- npy= ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["meta.json", "labels.npy"])
def test_npy_inside_the_input_dataset_is_refused_before_any_work(graph, tmp_path, name):
    graph = Path(shutil.copytree(graph, tmp_path / "g"))
    before = _digests(graph)
    with pytest.raises(DatasetWriteError, match=f"{name}.*inside this command's input.*npy="):
        layerwise(_sage(), graph, tmp_path / "out", npy=graph / name, overwrite=True, progress=False)
    assert _digests(graph) == before
    assert lightning_ooc.open_dataset(graph).num_nodes == N
    assert not (tmp_path / "out").exists() and not work_dir_for(tmp_path / "out").exists()


def test_npy_naming_a_feature_file_used_in_place_is_refused(tmp_path):
    g = np.random.default_rng(0)
    x = g.standard_normal((N, F)).astype(np.float32)
    np.save(tmp_path / "user_x.npy", x)
    root = prepare_from_arrays(tmp_path / "g", g.integers(0, N, (2, 8000)), tmp_path / "user_x.npy",
                               g.integers(0, 3, N), features="in-place", progress=False)  # fmt: skip
    before = _digest(tmp_path / "user_x.npy")
    with pytest.raises(DatasetWriteError, match="user_x.npy.*is this command's input"):
        layerwise(_sage(), root, tmp_path / "out", npy=tmp_path / "user_x.npy", overwrite=True, progress=False)
    assert _digest(tmp_path / "user_x.npy") == before
    assert not (tmp_path / "out").exists()


def test_npy_inside_the_output_or_an_existing_file_is_refused_before_any_work(graph, tmp_path):
    with pytest.raises(DatasetWriteError, match="npy= lies in .*out"):
        layerwise(_sage(), graph, tmp_path / "out", npy=tmp_path / "out" / "x.npy", progress=False)
    (tmp_path / "mine.npy").write_bytes(b"mine")
    with pytest.raises(DatasetWriteError, match="mine.npy: already exists"):
        layerwise(_sage(), graph, tmp_path / "out", npy=tmp_path / "mine.npy", progress=False)
    assert (tmp_path / "mine.npy").read_bytes() == b"mine"
    assert not (tmp_path / "out").exists() and not work_dir_for(tmp_path / "out").exists()
    res = layerwise(_sage(), graph, tmp_path / "out", npy=tmp_path / "new" / "x.npy", progress=False)
    assert np.array_equal(np.load(res.npy), _features(tmp_path / "out"))


# -- the work directory --------------------------------------------------------------------------------------------
def test_a_work_directory_the_package_did_not_write_is_refused_and_kept(graph, tmp_path):
    work = work_dir_for(tmp_path / "out")
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    with pytest.raises(DatasetWriteError, match=r"\.out\.layerwise: holds files layer-wise inference did not write"):
        layerwise(_sage(), graph, tmp_path / "out", progress=False)
    (work / "state.json").write_text('{"hello": 1}')
    with pytest.raises(DatasetWriteError, match="state.json: is not the state of a layer-wise run"):
        layerwise(_sage(), graph, tmp_path / "out", progress=False)
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt", "state.json"]
    assert (work / "notes.txt").read_text() == "mine" and not (tmp_path / "out").exists()


def test_a_dataset_where_the_work_directory_goes_is_refused(graph, tmp_path):
    """The work directory of ``out`` is ``.out.layerwise`` beside it: the input dataset there is never cleared."""
    root = tmp_path / ".out.layerwise"
    shutil.copytree(graph, root)
    before = _digests(root)
    with pytest.raises(DatasetWriteError, match=r"\.out\.layerwise: the output is this command's input"):
        layerwise(_sage(), root, tmp_path / "out", progress=False)
    assert _digests(root) == before


def test_another_runs_layers_are_cleared_by_name_only(graph, tmp_path):
    opts = dict(memory=1 << 20, progress=False, keep_work=True, overwrite=True)
    layerwise(_sage(), graph, tmp_path / "out", **opts)
    work = work_dir_for(tmp_path / "out")
    (work / "notes.txt").write_text("mine")
    res = layerwise(_sage("tanh"), graph, tmp_path / "out", memory=1 << 20, progress=False, overwrite=True)
    assert res.resumed_from == 0
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]  # the run's own files removed, not this


# -- resuming ------------------------------------------------------------------------------------------------------
class Leaky(nn.Module):
    """Two SAGE layers; what comes between them reads a plain attribute."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.ModuleList([SAGEConv(F, 16), SAGEConv(16, 3)])
        self.slope = 0.0

    def inference_layers(self):
        return list(self.convs)

    def inference_between(self, index, h):
        return torch.nn.functional.leaky_relu(h, self.slope)


def test_a_change_no_weight_shows_is_not_resumed(graph, tmp_path):
    """An activation, a value a ``between`` closure captured, an attribute read between layers: each changes the
    outputs, so the layers kept from before are not reused and the result is a fresh run's."""
    opts = dict(memory=1 << 20, progress=False, keep_work=True, overwrite=True)

    def fresh(model, **kw) -> np.ndarray:
        out = tmp_path / f"fresh-{len(list(tmp_path.iterdir()))}"
        layerwise(model, graph, out, memory=1 << 20, progress=False, **kw)
        return _features(out)

    relu, tanh = _sage("relu"), _sage("tanh")
    assert layerwise(relu, graph, tmp_path / "a", **opts).resumed_from == 0
    assert layerwise(tanh, graph, tmp_path / "a", **opts).resumed_from == 0
    np.testing.assert_array_equal(_features(tmp_path / "a"), fresh(tanh))

    scale = 1.0

    def between(i, h):
        return h * scale

    assert layerwise(relu, graph, tmp_path / "b", between=between, **opts).resumed_from == 0
    scale = 3.0
    assert layerwise(relu, graph, tmp_path / "b", between=between, **opts).resumed_from == 0
    np.testing.assert_array_equal(_features(tmp_path / "b"), fresh(relu, between=between))

    model = Leaky().eval()
    assert layerwise(model, graph, tmp_path / "c", **opts).resumed_from == 0
    model.slope = 0.5
    assert layerwise(model, graph, tmp_path / "c", **opts).resumed_from == 0
    np.testing.assert_array_equal(_features(tmp_path / "c"), fresh(model))
    # unchanged: resumed after every layer
    assert layerwise(model, graph, tmp_path / "c", **opts).resumed_from == 2


def test_resume_false_starts_over(graph, tmp_path):
    opts = dict(memory=1 << 20, progress=False, keep_work=True, overwrite=True)
    layerwise(_sage(), graph, tmp_path / "out", **opts)
    state = json.loads((work_dir_for(tmp_path / "out") / "state.json").read_text())
    assert [e["index"] for e in state["layers"]] == [0, 1]
    assert layerwise(_sage(), graph, tmp_path / "out", resume=False, **opts).resumed_from == 0
    assert layerwise(_sage(), graph, tmp_path / "out", **opts).resumed_from == 2


def test_a_model_the_probe_cannot_run_warns_that_resume_is_off(graph, tmp_path, caplog):
    """What comes between layers here needs more rows than the probe graph has: the run itself works, a warning
    of one line says resume is off for this model and why, and the same run again starts over."""

    def between(i: int, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] < 64:
            raise ValueError("needs at least 64 rows\nand a second line")
        return h.relu()

    opts = dict(memory=1 << 20, progress=False, keep_work=True, overwrite=True, between=between)
    with caplog.at_level(logging.WARNING, logger="lightning_ooc"):
        assert layerwise(_sage(), graph, tmp_path / "out", **opts).resumed_from == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "resume" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert "resume is off for this model" in warned[0] and "ValueError: needs at least 64 rows" in warned[0]
    assert layerwise(_sage(), graph, tmp_path / "out", **opts).resumed_from == 0


# -- PredictionWriter ----------------------------------------------------------------------------------------------
def test_prediction_writer_into_the_dataset_is_refused_before_predicting(graph, tmp_path):
    """Sampled predict (``lightning-ooc predict --config configs/demo.yaml``) with the writer at the dataset's
    labels: refused, the labels untouched."""
    graph = Path(shutil.copytree(graph, tmp_path / "g"))
    before = _digests(graph)
    dm = OutOfCoreNodeData(graph, batch_size=256, num_neighbors=[5, 5], progress=False)
    with pytest.raises(DatasetWriteError, match="labels.npy: the output lies inside this command's input"):
        _trainer(PredictionWriter(graph / "labels.npy")).predict(
            GraphSAGE(F, 3, hidden_channels=16, num_layers=2), datamodule=dm, return_predictions=False)
    assert _digests(graph) == before


def test_prediction_writer_refuses_the_checkpoint_and_an_existing_file(graph, tmp_path):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"weights")
    trainer = SimpleNamespace(datamodule=SimpleNamespace(root=graph), ckpt_path=str(ckpt), predict_dataloaders=None)
    with pytest.raises(DatasetWriteError, match="model.ckpt: the output is this command's input"):
        PredictionWriter(ckpt).on_predict_start(trainer, None)
    assert ckpt.read_bytes() == b"weights"
    (tmp_path / "pred.npy").write_bytes(b"mine")
    with pytest.raises(DatasetWriteError, match=r"pred.npy: already exists; pass overwrite=True"):
        PredictionWriter(tmp_path / "pred.npy").on_predict_start(trainer, None)
    PredictionWriter(tmp_path / "pred.npy", overwrite=True).on_predict_start(trainer, None)
    PredictionWriter(tmp_path / "new.npy").on_predict_start(trainer, None)


def test_layerwise_predict_refuses_an_existing_file_unless_overwrite(graph, tmp_path):
    def predict(writer: PredictionWriter) -> None:
        dm = OutOfCoreNodeData(graph, predict=dict(inference="layerwise", inference_out=tmp_path / "logits"),
                               progress=False)  # fmt: skip
        _trainer(writer).predict(GraphSAGE(F, 3, hidden_channels=16, num_layers=2), datamodule=dm,
                                 return_predictions=False)  # fmt: skip

    with pytest.raises(DatasetWriteError, match="lies in .*logits, the dataset layer-wise inference writes"):
        predict(PredictionWriter(tmp_path / "logits" / "pred.npy"))
    assert not (tmp_path / "logits").exists()  # refused before the layers ran
    (tmp_path / "pred.npy").write_bytes(b"mine")
    with pytest.raises(DatasetWriteError, match="pred.npy: already exists"):
        predict(PredictionWriter(tmp_path / "pred.npy"))
    assert (tmp_path / "pred.npy").read_bytes() == b"mine" and not (tmp_path / "logits").exists()
    predict(PredictionWriter(tmp_path / "pred.npy", overwrite=True))
    assert np.array_equal(np.load(tmp_path / "pred.npy"), _features(tmp_path / "logits").argmax(-1))


def _dead_pid() -> int:
    """The id of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("writer", ["PredictionWriter", "npy="])
def test_a_users_file_named_like_a_partial_output_survives(graph, tmp_path, writer):
    """A user's ``.pred.npy.partial`` beside the output and a live writer's partial file are kept; what a writer
    that died before its rename left there (``.pred.npy.partial-PID-TOKEN``) is removed."""
    mine = tmp_path / ".pred.npy.partial"
    mine.write_bytes(b"a user's file")
    live = tmp_path / f".pred.npy.partial-{os.getpid()}-0123abcd"
    live.write_bytes(b"a live writer's")
    dead = tmp_path / f".pred.npy.partial-{_dead_pid()}-89abcdef"
    dead.write_bytes(b"left by a killed writer")
    if writer == "npy=":
        res = layerwise(_sage(), graph, tmp_path / "out", npy=tmp_path / "pred.npy", memory=1 << 20, progress=False)
        assert np.array_equal(np.load(tmp_path / "pred.npy"), _features(res.out))
    else:
        dm = OutOfCoreNodeData(graph, batch_size=512, num_neighbors=[5, 5], progress=False)
        _trainer(PredictionWriter(tmp_path / "pred.npy")).predict(
            GraphSAGE(F, 3, hidden_channels=16, num_layers=2), datamodule=dm, return_predictions=False)
        assert np.load(tmp_path / "pred.npy").shape == (N,)
    assert mine.read_bytes() == b"a user's file" and live.read_bytes() == b"a live writer's"
    assert not dead.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if "partial" in p.name) == sorted([mine.name, live.name])


# -- memory --------------------------------------------------------------------------------------------------------
def _fake_limit(monkeypatch, tmp_path: Path, limit: int, usage: int) -> list[str]:
    """Every limit a plan reads is that of a fake v1 memory cgroup of ``limit`` bytes, ``usage`` in use; returns
    the list of the settings each read was made with."""
    from lightning_ooc.store import limits, planner

    fake = tmp_path / "fake-root"
    (fake / "proc/self").mkdir(parents=True, exist_ok=True)
    (fake / "proc/self/cgroup").write_text("4:memory:/job\n")
    (fake / "proc/meminfo").write_text("MemTotal: 8388608 kB\nMemAvailable: 4194304 kB\n")
    job = fake / "sys/fs/cgroup/memory/job"
    job.mkdir(parents=True, exist_ok=True)
    (job / "memory.limit_in_bytes").write_text(str(limit))
    (job / "memory.usage_in_bytes").write_text(str(usage))
    (job / "memory.stat").write_text("total_inactive_file 0\n")
    real = limits.limit_for_plan
    reads: list[str] = []

    def read(setting, root="/"):
        reads.append(setting)
        return real(setting, fake)

    monkeypatch.setattr(limits, "limit_for_plan", read)
    monkeypatch.setattr(planner, "limit_for_plan", read)  # the planner fits layer-wise memory with it
    return reads


def test_memory_is_shrunk_to_what_the_limit_leaves(graph, tmp_path, monkeypatch, caplog):
    _fake_limit(monkeypatch, tmp_path, 600 << 20, 300 << 20)
    with caplog.at_level(logging.INFO, logger="lightning_ooc"):
        res = layerwise(_sage(), graph, tmp_path / "out", memory=4 << 30, progress=False)
    assert 100 << 20 < res.plan.memory < 300 << 20
    assert any("memory=4.00 GiB does not fit 300.00 MiB available (cgroup v1" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    # the same through the predict loop (--data.predict.inference_memory 4GiB under the datamodule's memory_limit)
    dm = OutOfCoreNodeData(graph, predict=PredictSettings(inference="layerwise", inference_out=tmp_path / "logits",
                                                          inference_memory="4GiB"), progress=False)  # fmt: skip
    trainer = _trainer()
    trainer.predict(GraphSAGE(F, 3, hidden_channels=16, num_layers=2), datamodule=dm, return_predictions=False)
    assert trainer.predict_dataloaders.result.plan.memory == res.plan.memory


def test_a_limit_too_small_for_any_plan_is_refused_in_one_line(graph, tmp_path, monkeypatch):
    _fake_limit(monkeypatch, tmp_path, 600 << 20, 590 << 20)
    with pytest.raises(InputError, match=r"layer-wise inference needs at least .*10.00 MiB available \(cgroup v1"):
        layerwise(_sage(), graph, tmp_path / "out", memory=1 << 30, progress=False)
    assert not (tmp_path / "out").exists() and not work_dir_for(tmp_path / "out").exists()
    # no limit: planned as given
    assert layerwise(_sage(), graph, tmp_path / "out", memory=1 << 30, memory_limit=None,
                     progress=False).plan.memory == 1 << 30  # fmt: skip


#: what the fake cgroup leaves: above what :data:`MIN_MEMORY` needs (128 KiB to plan with), below what the
#: smallest partitions of the plans here need (a partition starts on a multiple of 1024 nodes: about 500 KiB for
#: ``_sage()``, 390 KiB for the relational SAGE)
ROOM = 128 << 10
SMALL_LIMIT = int(ROOM * OVER_MEMORY) + RESERVE + 4096


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])  # fmt: skip
def test_partitions_over_the_limit_are_refused_in_one_line_and_the_model_is_left_as_it_was(graph, tmp_path,
                                                                                          monkeypatch, device):
    """A limit that leaves more than the least memory a plan is made with, but less than the smallest partitions
    of this model's plan need: refused in one line naming the limit, read once, before any work; the model keeps
    its mode (training) and its device."""
    assert SMALL_LIMIT > int(MIN_MEMORY * OVER_MEMORY) + RESERVE
    reads = _fake_limit(monkeypatch, tmp_path, 600 << 20, (600 << 20) - SMALL_LIMIT)
    model = _sage().train().to(device)
    with pytest.raises(InputError, match=r"^layer-wise inference: its smallest partitions need about .* and this "
                                         r"process has .* available \(cgroup v1 .*memory_limit=") as err:  # fmt: skip
        layerwise(model, graph, tmp_path / "out", memory=1 << 30, progress=False)
    assert "\n" not in str(err.value)
    assert reads == ["auto"]  # the limit is read once, for fitting memory and for checking the plan
    assert model.training and all(m.training for m in model.modules())
    assert {p.device.type for p in model.parameters()} == {device}
    assert not (tmp_path / "out").exists() and not work_dir_for(tmp_path / "out").exists()
    with pytest.raises(InputError, match="its smallest partitions need about"):
        plan_layerwise(model, graph, memory=1 << 30)
    # the same plan under a limit with room for it
    _fake_limit(monkeypatch, tmp_path, 600 << 20, 300 << 20)
    assert plan_layerwise(_sage(), graph, memory=ROOM).need > ROOM


@pytest.fixture(scope="module")
def mag(tmp_path_factory) -> Path:
    """A small heterogeneous dataset: papers with features, authors and institutions without."""
    return synthesize_hetero(tmp_path_factory.mktemp("outputs-mag") / "mag", "mag", num_nodes=2500,
                             num_features=12, num_classes=4, seed=3, progress=False)  # fmt: skip


def test_heterogeneous_partitions_over_the_limit_are_refused_in_one_line(mag, tmp_path, monkeypatch):
    """A heterogeneous plan is checked against the limit as a homogeneous one: where its smallest partitions need
    more than the limit leaves, planning and the run are refused in one line, before any work."""
    ds = lightning_ooc.open_dataset(mag)
    torch.manual_seed(0)
    model = RelationalGNN(ds.metadata(), {"paper": 12}, 16, 4, "paper", num_layers=2, conv="sage").train()
    free = plan_layerwise(model, mag, memory=ROOM, memory_limit=None)
    assert free.need > ROOM  # what the limit below leaves is too little for this model's smallest partitions
    _fake_limit(monkeypatch, tmp_path, 600 << 20, (600 << 20) - SMALL_LIMIT)
    match = r"^layer-wise inference: its smallest partitions need about .* available \(cgroup v1"
    with pytest.raises(InputError, match=match):
        plan_layerwise(model, mag, memory=1 << 30)
    with pytest.raises(InputError, match=match):
        layerwise(model, mag, tmp_path / "out", memory=1 << 30, progress=False)
    assert model.training and all(m.training for m in model.modules())
    assert not (tmp_path / "out").exists() and not work_dir_for(tmp_path / "out").exists()
    # a limit with room for them: planned and run
    _fake_limit(monkeypatch, tmp_path, 600 << 20, 300 << 20)
    res = layerwise(model, mag, tmp_path / "out", memory=ROOM, progress=False)
    assert res.plan.need == free.need and lightning_ooc.open_dataset(res.out).node("paper").num_features == 4


CAPPED_CHILD = textwrap.dedent("""
    import sys, torch
    from torch_geometric.nn.models import GraphSAGE
    from lightning_ooc.infer import layerwise
    torch.manual_seed(0)
    model = GraphSAGE(256, 64, num_layers=2, out_channels=8).eval()
    res = layerwise(model, sys.argv[1], sys.argv[2], memory=1 << 30, progress=False)
    print("planned", res.plan.memory)
""")


@pytest.mark.slow
def test_layerwise_in_a_real_memory_cgroup_plans_under_its_limit(tmp_path):
    """410 MB of features, memory=1GiB, in a 600 MiB cgroup: planned under the limit and finished (not killed)."""
    from lightning_ooc.bench.system import MemoryCap, run_capped

    try:
        MemoryCap(600 << 20).close()
    except RuntimeError as e:
        pytest.skip(str(e))
    root = synthesize(tmp_path / "big", num_nodes=400_000, avg_degree=5, num_features=256, num_classes=8,
                      progress=False)  # fmt: skip
    script = tmp_path / "child.py"
    script.write_text(CAPPED_CHILD)
    res = run_capped([sys.executable, str(script), str(root), str(tmp_path / "out")], 600 << 20, tmp_path / "log",
                     timeout=300)  # fmt: skip
    assert res["code"] == 0, res["output"][-3000:]
    assert "memory=1.00 GiB does not fit" in res["output"]
    assert lightning_ooc.open_dataset(tmp_path / "out").num_nodes == 400_000


def test_memory_is_fitted_with_the_share_the_models_layers_were_measured_at(graph, tmp_path, monkeypatch):
    """The room a limit leaves is divided by the largest measured share of the model's layers (SAGE 1.2, GAT 1.75,
    a layer with none measured the planner's default), so a GAT model gets less of the same limit than SAGE."""
    limit, usage = 900 << 20, 100 << 20
    _fake_limit(monkeypatch, tmp_path, limit, usage)
    left = limit - usage
    torch.manual_seed(0)
    for model, over in ((_sage(), 1.2), (pyg_models.GAT(F, 16, num_layers=2, out_channels=3, heads=2), 1.75),
                        (pyg_models.GIN(F, 16, num_layers=2, out_channels=3), OVER_MEMORY)):  # fmt: skip
        plan = plan_layerwise(model, graph, memory=1 << 30)
        assert plan.memory == int((left - RESERVE) / over), type(model).__name__


def test_a_run_the_disk_cannot_hold_is_refused_before_any_work(graph, tmp_path, monkeypatch):
    """The plan's disk need (buckets, every layer's table, the largest scratch file) against the free space of the
    work directory's file system: refused in one line naming the parts, nothing written at out; with room, the
    same call runs, and what it wrote stayed within the plan's count."""
    import shutil as sh

    from lightning_ooc.infer import tables

    plan = plan_layerwise(_sage(), graph, memory=1 << 20)
    need = plan.disk_need()
    assert need["layer tables"] == N * 4 * (16 + 3) and need["edge buckets"] > 0
    assert "disk: about" in plan.describe()
    real = sh.disk_usage
    monkeypatch.setattr(tables.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=sum(need.values()) - 1))  # fmt: skip
    with pytest.raises(DatasetWriteError, match=r"needs about .* of disk at .*\(edge buckets .*, layer tables .*\), "
                                                r"and its file system has .* free") as err:  # fmt: skip
        layerwise(_sage(), graph, tmp_path / "out", memory=1 << 20, progress=False, keep_work=True)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
    assert not any(p.name != "state.json" for p in work_dir_for(tmp_path / "out").iterdir())
    monkeypatch.setattr(tables.shutil, "disk_usage", lambda p: real(p)._replace(free=sum(need.values())))
    layerwise(_sage(), graph, tmp_path / "out", memory=1 << 20, progress=False, keep_work=True)
    written = sum(p.stat().st_size for p in work_dir_for(tmp_path / "out").rglob("*") if p.is_file())
    assert written <= sum(need.values()) + (64 << 10)  # state.json and the buckets' headers beside the count
