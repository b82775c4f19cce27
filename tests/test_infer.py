"""Layer-wise inference out of core: exactness against PyG in memory, the plan's bytes, resume, full disk."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch_geometric.nn import GATConv, GATv2Conv, GCNConv, GINConv, GraphConv, SAGEConv
from torch_geometric.nn import models as pyg_models

import lightning_ooc
from lightning_ooc.data.prepare import prepare_from_arrays
from lightning_ooc.errors import DatasetWriteError, InputError
from lightning_ooc.infer import LayerByLayer, layerwise, plan_layerwise
from lightning_ooc.infer.run import work_dir_for
from lightning_ooc.io.io_errors import FeatureWriteError

N, F_IN = 5000, 12


def graph_arrays(seed: int = 0):
    """Random directed edges with self-loops, duplicates and nodes without in-edges."""
    g = np.random.default_rng(seed)
    src = g.integers(0, N, 40000)
    dst = g.integers(0, N - 300, 40000)  # the last 300 nodes have no in-edges (but some have self-loops below)
    loops = g.choice(N, 400, replace=False)
    dups = g.integers(0, 40000, 2000)
    src = np.concatenate([src, loops, src[dups]])
    dst = np.concatenate([dst, loops, dst[dups]])
    x = g.standard_normal((N, F_IN)).astype(np.float32)
    y = g.integers(0, 4, N)
    return np.stack([src, dst]), x, y


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    ei, x, y = graph_arrays()
    root = prepare_from_arrays(tmp_path_factory.mktemp("infer") / "g", ei, x, y, num_classes=4, progress=False)
    ds = lightning_ooc.open_dataset(root)
    # the graph as stored (the writer keeps self-loops and duplicates), in PyG's (source, target) form
    dst = np.repeat(np.arange(N), np.diff(ds.indptr))
    edge_index = torch.from_numpy(np.stack([np.asarray(ds.indices, dtype=np.int64), dst]))
    assert int((edge_index[0] == edge_index[1]).sum()) >= 400
    return root, torch.from_numpy(x), edge_index


class Stack(nn.Module):
    """Layers of any widths with ReLU between them (implements LayerByLayer)."""

    def __init__(self, *convs: nn.Module):
        super().__init__()
        self.convs = nn.ModuleList(convs)

    def inference_layers(self):
        return list(self.convs)

    def inference_between(self, index, h):
        return h.relu()

    def forward(self, x, edge_index):
        from torch_geometric.nn.conv import MessagePassing

        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index) if isinstance(conv, MessagePassing) else conv(x)
            if i < len(self.convs) - 1:
                x = x.relu()
        return x


def _randomise(model: nn.Module) -> nn.Module:
    """Non-zero biases and attention weights everywhere, so that every term is tested."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


MODELS = {
    "sage-mean": lambda: pyg_models.GraphSAGE(F_IN, 32, num_layers=3, out_channels=4),
    "sage-max-sum": lambda: Stack(SAGEConv(F_IN, 16, aggr="max"), SAGEConv(16, 4, aggr="sum", normalize=True)),
    "sage-project": lambda: Stack(SAGEConv(F_IN, 20, project=True), SAGEConv(20, 4, root_weight=False)),
    "gcn": lambda: pyg_models.GCN(F_IN, 24, num_layers=2, out_channels=4),
    "gcn-improved": lambda: Stack(GCNConv(F_IN, 8, improved=True), GCNConv(8, 4, normalize=False)),
    "gat": lambda: pyg_models.GAT(F_IN, 16, num_layers=2, out_channels=4, heads=4),
    "gat-mean-residual": lambda: Stack(GATConv(F_IN, 8, heads=3, concat=False, residual=True),
                                       GATConv(8, 4, heads=2, add_self_loops=False)),
    "gin-fallback": lambda: Stack(GINConv(nn.Sequential(nn.Linear(F_IN, 16), nn.ReLU(), nn.Linear(16, 16))),
                                  nn.Linear(16, 4)),
    # one-hop layers without a blocked form, over full neighbourhoods: GATv2 replaces the stored self-loops
    "gatv2-graphconv-fallback": lambda: Stack(GATv2Conv(F_IN, 8, heads=2), GraphConv(16, 4, aggr="max")),
    "mlp": lambda: pyg_models.MLP([F_IN, 16, 4], norm=None),
}
FALLBACK = ("gin-fallback", "gatv2-graphconv-fallback")


@pytest.mark.parametrize("schedule", ["targets", "messages", "buffer"])
@pytest.mark.parametrize("name", list(MODELS))
def test_out_of_core_equals_pyg_in_memory(dataset, tmp_path, name, schedule):
    """Blocked over many partitions the outputs equal PyG's own forward over the whole graph in memory, which is
    its layer-wise inference with full neighbourhoods: with the targets schedule (several groups, every
    partition streamed past each) and the buffer schedule (Legend's order, accumulators spilled and read back)."""
    root, x, edge_index = dataset
    model = _randomise(MODELS[name]())
    with torch.no_grad():
        want = model(x) if name == "mlp" else model(x, edge_index)
    res = layerwise(model, root, tmp_path / "out", memory=256 << 10, npy=tmp_path / "out.npy", schedule=schedule,
                    progress=False)  # fmt: skip
    plan = res.plan
    assert plan.num_partitions >= (5 if name not in (*FALLBACK, "mlp") else 2)
    assert plan.schedule == ("targets" if schedule == "messages" else schedule)
    if schedule == "messages":  # every blocked layer streams its table of messages
        assert all(lp.messages for lp in plan.layers if lp.kind == "blocked")
    if schedule == "buffer":
        assert plan.order.name == "legend"
    out = lightning_ooc.open_dataset(tmp_path / "out")
    got = torch.from_numpy(np.asarray(out.features_memmap())).float()
    assert got.shape == want.shape
    # float32 sums in another order: the tolerance stated in the README
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert np.array_equal(np.load(tmp_path / "out.npy"), got.numpy())
    # the rest of the dataset is the input's
    src = lightning_ooc.open_dataset(root)
    assert np.array_equal(out.indptr, src.indptr) and np.array_equal(out.labels, src.labels)
    assert torch.equal(out.split("train"), src.split("train"))
    kinds = [lp.kind for lp in plan.layers]
    if name == "gin-fallback":
        assert kinds == ["neighbourhood", "node-wise"]
    elif name in FALLBACK:
        assert kinds == ["neighbourhood", "neighbourhood"]
    elif name == "mlp":
        assert kinds == ["node-wise"]
    else:
        assert set(kinds) == {"blocked"}
    # the work directory is gone after the commit
    assert not work_dir_for(tmp_path / "out").exists()


@pytest.mark.parametrize("schedule", ["targets", "messages", "buffer"])
def test_bytes_moved_are_what_the_schedule_must_move(dataset, tmp_path, schedule):
    root, _, _ = dataset
    model = _randomise(pyg_models.GAT(F_IN, 64, num_layers=2, out_channels=4, heads=2))
    res = layerwise(model, root, tmp_path / "out", memory=256 << 10, schedule=schedule, progress=False)
    states = len(res.plan.order.states) if schedule == "buffer" else res.plan.num_partitions ** 2
    for layer in res.layers:
        moved, want = layer["moved"], layer["expected"]
        if schedule == "buffer":
            assert want["spill_write"] > 0 and want["spill_read"] == want["spill_write"]
        else:  # several groups, each streaming every partition past
            assert want["spill_write"] == 0 and 0 < res.plan.layers[layer["layer"] - 1].group < res.plan.num_partitions
        if schedule == "targets":  # the input rows, past every group
            assert want["input"] > 3 * res.plan.num_nodes * F_IN * 4 and "messages_read" not in moved
        if schedule == "messages":  # the input read three times (table, target states, finish); the table streamed
            lp = res.plan.layers[layer["layer"] - 1]
            groups = -(-res.plan.num_partitions // lp.group)
            assert moved["messages_write"] >= res.plan.num_nodes * lp.op.src_width * 4 and groups >= 2
            assert moved["messages_read"] >= groups * res.plan.num_nodes * lp.op.src_width * 4
            assert want["input"] == 3 * res.plan.num_nodes * lp.in_width * 4
        assert moved["edges"] == want["edges"]
        for key in want.keys() - {"edges"}:
            # equal but for page alignment: a partition's rows start on a page, its end is rounded up to one
            assert want[key] <= moved[key] <= want[key] + 2 * 4096 * states, key
        assert sum(moved.values()) <= 1.5 * sum(want.values())


def test_one_partition_when_memory_allows(dataset, tmp_path):
    root, x, edge_index = dataset
    model = _randomise(pyg_models.GCN(F_IN, 8, num_layers=2, out_channels=4))
    res = layerwise(model, root, tmp_path / "out", memory=1 << 30, progress=False)
    # one partition: the buffer schedule reads each row once, the targets schedule would read them twice
    assert res.plan.num_partitions == 1 and res.plan.schedule == "buffer" and res.plan.order.name == "single"
    for layer in res.layers:
        assert layer["moved"]["spill_write"] == 0
    with torch.no_grad():
        want = model(x, edge_index)
    got = torch.from_numpy(np.asarray(lightning_ooc.open_dataset(tmp_path / "out").features_memmap()))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_models_that_cannot_run_layer_by_layer_are_refused(dataset, tmp_path):
    root, _, _ = dataset
    with pytest.raises(InputError, match="LayerByLayer"):
        layerwise(nn.Linear(F_IN, 4), root, tmp_path / "a", progress=False)

    class Convs(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList([SAGEConv(F_IN, 4)])

    with pytest.raises(InputError, match="between="):
        layerwise(Convs(), root, tmp_path / "b", progress=False)
    with pytest.raises(InputError, match="jumping knowledge"):
        layerwise(pyg_models.GraphSAGE(F_IN, 8, num_layers=2, jk="cat", out_channels=4), root, tmp_path / "c",
                  progress=False)
    assert isinstance(Stack(SAGEConv(F_IN, 4)), LayerByLayer)
    # nothing was left behind by the refusals
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_existing_output_is_refused_before_any_work(dataset, tmp_path):
    root, _, _ = dataset
    model = _randomise(pyg_models.GraphSAGE(F_IN, 8, num_layers=2, out_channels=4))
    layerwise(model, root, tmp_path / "out", progress=False)
    with pytest.raises(Exception, match="already exists"):
        layerwise(model, root, tmp_path / "out", progress=False)
    assert not work_dir_for(tmp_path / "out").exists()
    res = layerwise(model, root, tmp_path / "out", overwrite=True, progress=False)
    assert res.out == (tmp_path / "out").absolute()


def test_a_changed_table_is_detected(dataset, tmp_path, monkeypatch):
    """A layer's table is checksummed per partition: bytes changed between layers are refused when read."""
    from lightning_ooc.infer import run as run_mod

    root, _, _ = dataset
    model = _randomise(pyg_models.GraphSAGE(F_IN, 16, num_layers=2, out_channels=4))
    original = run_mod._Runner.run_layer

    def corrupting(self, lp, steps, done):
        if lp.index == 1:
            table = self.work.root / done[0]["file"]
            with open(table, "r+b") as f:
                f.seek(100)
                f.write(b"\x7f\x7f\x7f\x7f")
        return original(self, lp, steps, done)

    monkeypatch.setattr(run_mod._Runner, "run_layer", corrupting)
    with pytest.raises(run_mod.TableChecksumError, match="partition 0"):
        layerwise(model, root, tmp_path / "out", memory=256 << 10, progress=False)
    assert not (tmp_path / "out").exists()


CHILD = textwrap.dedent("""
    import sys, time, torch
    from torch_geometric.nn import models as pyg_models
    from lightning_ooc.infer import layerwise
    from lightning_ooc.infer import run as run_mod

    root, out, ready = sys.argv[1:4]
    torch.manual_seed(1)
    model = pyg_models.GraphSAGE({f_in}, 16, num_layers=3, out_channels=4).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    original = run_mod._Runner.run_layer

    def slow(self, lp, steps, done):
        if lp.index == 2:  # two layers are committed: say so, and wait to be killed in the middle of the third
            open(ready, "w").close()
            time.sleep(600)
        return original(self, lp, steps, done)

    run_mod._Runner.run_layer = slow
    layerwise(model, root, out, memory=256 << 10, progress=False)
""")


def test_killed_run_resumes_at_the_first_layer_not_committed(dataset, tmp_path):
    root, x, edge_index = dataset
    ready = tmp_path / "ready"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(f_in=F_IN))
    child = subprocess.Popen([sys.executable, str(script), str(root), str(tmp_path / "out"), str(ready)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None, f"the child ended with {child.returncode}"
            assert time.monotonic() < deadline, "the child never reached its third layer"
            time.sleep(0.1)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    work = work_dir_for(tmp_path / "out")
    state = json.loads((work / "state.json").read_text())
    assert [e["index"] for e in state["layers"]] == [0, 1]
    assert not (tmp_path / "out").exists()
    # the same model, weights and dataset: resumed at layer 3; the result is the uninterrupted one
    torch.manual_seed(1)
    model = pyg_models.GraphSAGE(F_IN, 16, num_layers=3, out_channels=4).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    res = layerwise(model, root, tmp_path / "out", memory=256 << 10, progress=False)
    assert res.resumed_from == 2 and [s["layer"] for s in res.layers] == [3]
    with torch.no_grad():
        want = model(x, edge_index)
    got = torch.from_numpy(np.asarray(lightning_ooc.open_dataset(tmp_path / "out").features_memmap()))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_work_is_kept_for_the_same_run_only(dataset, tmp_path):
    """The work directory is keyed by the dataset, the layers, their weights and what comes between them: the
    same run resumes (here: every layer is done), another one starts over instead of mixing layers."""
    root, _, _ = dataset
    model = _randomise(pyg_models.GraphSAGE(F_IN, 16, num_layers=2, out_channels=4))
    opts = dict(memory=256 << 10, progress=False, keep_work=True, overwrite=True)
    assert layerwise(model, root, tmp_path / "out", **opts).resumed_from == 0
    assert layerwise(model, root, tmp_path / "out", **opts).resumed_from == 2
    assert layerwise(model, root, tmp_path / "out", between=lambda i, h: h.tanh(), **opts).resumed_from == 0
    assert layerwise(model, root, tmp_path / "out", between=lambda i, h: h.tanh(), **opts).resumed_from == 2
    with torch.no_grad():
        model.convs[0].lin_l.weight.add_(1.0)
    assert layerwise(model, root, tmp_path / "out", **opts).resumed_from == 0
    # a message table a killed layer left (and its partial) is the run's own: removed when the run comes back
    layerwise(model, root, tmp_path / "out", schedule="messages", **opts)
    work = work_dir_for(tmp_path / "out")
    for name in ("messages-1.bin", "messages-2.bin.partial"):
        (work / name).write_bytes(b"left by a killed run")
    assert layerwise(model, root, tmp_path / "out", schedule="messages", **opts).resumed_from == 2
    assert not list(work.glob("messages-*"))


def test_the_read_ahead_keeps_the_callers_grad_mode_and_order():
    from lightning_ooc.infer.tables import ReadAhead

    w = torch.ones(3, requires_grad=True)
    with torch.no_grad():  # as inference runs: the worker thread must not record graphs either
        got = list(ReadAhead(lambda i: w * i, range(4)))
    assert [i for i, _ in got] == [0, 1, 2, 3] and not any(v.requires_grad for _, v in got)
    assert all(v.requires_grad for _, v in ReadAhead(lambda i: w * i, range(2)))

    def fails(i):
        if i == 2:
            raise OSError("a read failed")
        return i

    with pytest.raises(OSError, match="a read failed"):
        list(ReadAhead(fails, range(5)))


def test_killed_while_bucketing_resumes(dataset, tmp_path, monkeypatch):
    """A run stopped while it writes the edge buckets leaves a partial directory that the next run clears."""
    from lightning_ooc.infer import run as run_mod

    root, x, edge_index = dataset
    model = _randomise(pyg_models.GCN(F_IN, 8, num_layers=2, out_channels=4))
    real = run_mod.write_buckets

    def dies(out_dir, *a, **kw):
        (out_dir / "buckets_graph.npy").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "write_buckets", dies)
    with pytest.raises(KeyboardInterrupt):
        layerwise(model, root, tmp_path / "out", memory=256 << 10, progress=False)
    assert (work_dir_for(tmp_path / "out") / "buckets.partial").is_dir()
    monkeypatch.setattr(run_mod, "write_buckets", real)
    layerwise(model, root, tmp_path / "out", memory=256 << 10, progress=False)
    with torch.no_grad():
        want = model(x, edge_index)
    got = torch.from_numpy(np.array(lightning_ooc.open_dataset(tmp_path / "out").features_memmap()))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("conv, why", [
    (GCNConv(F_IN, 4, add_self_loops=False), "sources' own degrees"),
    (GATConv(F_IN, 4, edge_dim=3), "not one of the layers"),
    (GINConv(nn.Linear(F_IN, 4), flow="target_to_source"), "flow='target_to_source'"),
])  # fmt: skip
def test_layers_neighbourhoods_would_get_wrong_are_refused(dataset, tmp_path, conv, why):
    root, _, _ = dataset
    with pytest.raises(InputError, match=why):
        layerwise(Stack(conv), root, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_full_disk_is_a_clear_error_and_keeps_earlier_layers(dataset, small_disk, monkeypatch):
    """A disk that fills while the run goes (another writer took the room its check saw) fails the layer that
    meets it with a clear error and keeps the layers before; a run that cannot fit from the start is refused
    before any work (``tests/test_infer_outputs.py``)."""
    from lightning_ooc.infer import tables

    root, x, edge_index = dataset
    # layer 1's table (5000 x 16 floats, 320 KB) fits; layer 2's (5000 x 256 floats, 5 MB) does not
    model = _randomise(Stack(SAGEConv(F_IN, 16), SAGEConv(16, 256), SAGEConv(256, 4)))
    with pytest.raises(DatasetWriteError, match=r"needs about .* of disk .* file system has .* free"):
        layerwise(model, root, small_disk / "out", memory=256 << 10, progress=False)  # the check sees it first
    assert not (work_dir_for(small_disk / "out") / "layer-1.bin").exists()
    monkeypatch.setattr(tables, "check_disk", lambda root, need: None)  # the room was there when it started
    with pytest.raises(FeatureWriteError, match="disk is full") as ei:
        layerwise(model, root, small_disk / "out", memory=256 << 10, progress=False)
    assert "layer-2.bin" in str(ei.value)
    work = work_dir_for(small_disk / "out")
    state = json.loads((work / "state.json").read_text())
    assert [e["index"] for e in state["layers"]] == [0]
    assert (work / "layer-1.bin").exists() and not list(work.glob("*.partial"))
    assert not (small_disk / "out").exists()
    # more room: the run goes on from layer 2
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    res = layerwise(model, root, small_disk / "out", memory=256 << 10, progress=False)
    assert res.resumed_from == 1
    with torch.no_grad():
        want = model(x, edge_index)
    got = torch.from_numpy(np.array(lightning_ooc.open_dataset(small_disk / "out").features_memmap()))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_plan_says_how_each_layer_runs(dataset):
    root, _, _ = dataset
    model = Stack(GINConv(nn.Linear(F_IN, 8)), GATConv(8, 4, heads=2), nn.Linear(8, 2))
    plan = plan_layerwise(model, root, memory=256 << 10)
    text = plan.describe()
    assert "neighbourhood" in text and "GINConv has no blocked form" in text
    assert "softmax with a running maximum" in text and "node-wise" in text
    assert [lp.out_width for lp in plan.layers] == [8, 8, 2]


def test_accuracy_from_layerwise_outputs_matches_sampled_evaluation(tmp_path):
    """A trained classifier's test accuracy from the layer-wise outputs equals sampled evaluation's with full
    fanouts exactly, and with a small fanout within noise."""
    import lightning as L

    from lightning_ooc import OutOfCoreNodeData, Tiered
    from lightning_ooc.data.synth import synthesize
    from lightning_ooc.models import GraphSAGE

    root = synthesize(tmp_path / "g", num_nodes=4000, avg_degree=8, num_features=16, num_classes=4, train_frac=0.5,
                      val_frac=0.1, test_frac=0.3, progress=False)
    L.seed_everything(0)
    model = GraphSAGE(16, 4, hidden_channels=32, num_layers=2, lr=0.01)
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    common = dict(batch_size=256, features=Tiered(gpu_cache="4MiB", host_cache="64KiB", staging="1MiB"), progress=False)
    trainer.fit(model, datamodule=OutOfCoreNodeData(root, num_neighbors=[10, 10], **common))
    accs = {}
    for fanout in ([-1, -1], [5, 5]):
        dm = OutOfCoreNodeData(root, num_neighbors=[10, 10], eval_num_neighbors=fanout, shuffle=False, **common)
        accs[fanout[0]] = trainer.test(model, datamodule=dm, verbose=False)[0]["test_acc"]
    res = layerwise(model, root, tmp_path / "logits", memory=1 << 20, progress=False)
    assert res.plan.num_partitions > 1
    out = lightning_ooc.open_dataset(tmp_path / "logits")
    test = out.split("test").numpy()
    pred = np.asarray(out.features_memmap())[test].argmax(-1)
    acc = float((pred == np.asarray(out.labels)[test]).mean())
    assert acc > 0.5  # it learned something, so the comparison means something
    assert acc == pytest.approx(accs[-1], abs=1e-6)
    assert abs(acc - accs[5]) < 0.05


def test_predict_from_yaml_runs_layerwise(tmp_path, capsys):
    """`lightning-ooc predict --config configs/demo.yaml --config configs/predict_layerwise.yaml`: Lightning's
    predict loop over layer-wise inference; the writer callback saves one class per node."""
    import yaml

    from lightning_ooc.cli import main
    from lightning_ooc.data.synth import synthesize

    root = synthesize(tmp_path / "g", num_nodes=3000, avg_degree=6, num_features=8, num_classes=3, progress=False)
    configs = Path(lightning_ooc.__file__).resolve().parents[1] / "configs"
    extra = yaml.safe_load((configs / "predict_layerwise.yaml").read_text())
    assert extra["data"]["predict"]["inference"] == "layerwise"
    rc = main(["predict", "--config", str(configs / "demo.yaml"), "--config", str(configs / "predict_layerwise.yaml"),
               "--data.root", str(root), "--data.predict.inference_out", str(tmp_path / "logits"),
               "--trainer.callbacks.path", str(tmp_path / "pred.npy"), "--trainer.accelerator", "cpu",
               "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--data.progress", "false",
               f"--trainer.default_root_dir={tmp_path / 'run'}"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err[-3000:]
    pred = np.load(tmp_path / "pred.npy")
    logits = np.asarray(lightning_ooc.open_dataset(tmp_path / "logits").features_memmap())
    assert pred.shape == (3000,) and np.array_equal(pred, logits.argmax(-1))


def test_link_predictor_embeddings_for_every_node(dataset, tmp_path):
    """A LinkPredictor runs layer by layer too: its encoder's embedding of every node, for export."""
    from lightning_ooc.models import LinkPredictor

    root, x, edge_index = dataset
    model = _randomise(LinkPredictor(F_IN, hidden_channels=16, num_layers=2))
    res = layerwise(model, root, tmp_path / "emb", memory=256 << 10, npy=tmp_path / "emb.npy", progress=False)
    with torch.no_grad():
        want = model(x, edge_index)
    assert res.plan.num_partitions > 1
    torch.testing.assert_close(torch.from_numpy(np.load(tmp_path / "emb.npy")), want, rtol=1e-4, atol=1e-4)


class _StopsOnce(nn.Module):
    """A node-wise layer that fails on its first real partition (more rows than the 16-node probe), then doubles."""

    stopped = False

    def forward(self, h):
        if not _StopsOnce.stopped and h.shape[0] > 100:
            _StopsOnce.stopped = True
            raise RuntimeError("stopped")
        return 2 * h


def test_tables_no_later_layer_reads_are_dropped_and_a_stopped_run_still_resumes(dataset, tmp_path):
    """Layer 1's table goes once layer 2's is committed (two tables on disk at most); a run stopped in layer 3
    resumes from layer 2's table and gives the whole model's outputs."""
    root, x, edge_index = dataset
    model = _randomise(Stack(SAGEConv(F_IN, 8), SAGEConv(8, 8), _StopsOnce()))
    with pytest.raises(RuntimeError, match="stopped"):
        layerwise(model, root, tmp_path / "out", memory=256 << 10, progress=False)
    work = work_dir_for(tmp_path / "out")
    state = json.loads((work / "state.json").read_text())
    assert [(e["index"], bool(e.get("dropped"))) for e in state["layers"]] == [(0, True), (1, False)]
    assert not (work / "layer-1.bin").exists() and (work / "layer-2.bin").exists()
    res = layerwise(model, root, tmp_path / "out", memory=256 << 10, progress=False)
    assert res.resumed_from == 2
    with torch.no_grad():
        want = model(x, edge_index)
    got = torch.from_numpy(np.array(lightning_ooc.open_dataset(tmp_path / "out").features_memmap()))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    kept = layerwise(model, root, tmp_path / "kept", memory=256 << 10, progress=False, keep_work=True)
    assert kept.resumed_from == 0
    assert all((work_dir_for(tmp_path / "kept") / f"layer-{i}.bin").exists() for i in (1, 2, 3))  # keep_work keeps all
