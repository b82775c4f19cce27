"""Layer-wise inference over heterogeneous datasets: per-type tables, exact against the relational model in memory."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
from torch import nn
from torch_geometric.data import HeteroData

import lightning_ooc
from lightning_ooc.data.prepare_hetero import prepare_from_hetero
from lightning_ooc.data.synth_hetero import synthesize_hetero
from lightning_ooc.errors import InputError
from lightning_ooc.infer import layerwise, plan_layerwise
from lightning_ooc.infer import hetero_layerwise as infer_hetero
from lightning_ooc.infer.run import work_dir_for
from lightning_ooc.io.io_errors import FeatureWriteError
from lightning_ooc.models import RGAT
from lightning_ooc.models.relational import RelationalGNN


@pytest.fixture(scope="module")
def mag(tmp_path_factory):
    """Papers with features, authors and institutions without (their starting vectors come from the model)."""
    root = synthesize_hetero(tmp_path_factory.mktemp("ih") / "mag", "mag", num_nodes=2500, num_features=12,
                             num_classes=4, seed=3, train_frac=0.2, test_frac=0.2, progress=False)  # fmt: skip
    ds = lightning_ooc.open_dataset(root)
    x = {t: torch.from_numpy(np.array(ds.node(t).features_memmap())).float()
         for t in ds.node_types if ds.node(t).has_features}  # fmt: skip
    edges = {}
    for et, c in ds.csc.items():
        dst = np.repeat(np.arange(c.num_nodes), np.diff(c.indptr))
        edges[et] = torch.from_numpy(np.stack([np.asarray(c.indices, dtype=np.int64), dst]))
    return root, ds, x, edges


def gnn(ds, conv: str, aggr: str = "mean", layers: int = 2, seed: int = 0) -> RelationalGNN:
    torch.manual_seed(seed)
    model = RelationalGNN(ds.metadata(), {"paper": 12}, 16, 4, "paper", num_layers=layers, conv=conv, heads=2,
                          aggr=aggr)  # fmt: skip
    for p in model.type_embedding.values():  # starting vectors as large as features, so that errors would show
        nn.init.normal_(p)
    return model.eval()


def read(root, node_type: str) -> torch.Tensor:
    return torch.from_numpy(np.array(lightning_ooc.open_dataset(root).node(node_type).features_memmap()))


@pytest.mark.parametrize("conv, aggr, layers", [("sage", "mean", 2), ("gat", "mean", 2), ("sage", "sum", 3),
                                                ("gat", "max", 3)])  # fmt: skip
def test_out_of_core_equals_the_relational_model_in_memory(mag, tmp_path, conv, aggr, layers):
    root, ds, x, edges = mag
    model = gnn(ds, conv, aggr, layers)
    result = layerwise(model, root, tmp_path / "out", memory=1 << 18, progress=False)
    plan = result.plan
    # small memory: several partitions per type, and groups of the target type smaller than the type
    assert plan.num_partitions["paper"] > 1 and plan.num_partitions["author"] > 1
    assert any(n < plan.num_partitions[t] for lp in plan.layers for t, n in lp.groups.items())
    with torch.no_grad():
        expected = model(x, edges, ds.num_nodes_dict)
    got = read(result.out, "paper")
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    out = lightning_ooc.open_dataset(result.out)
    # the input's labels and splits are kept; types without an output carry no features
    assert torch.equal(out.split("test"), ds.split("test"))
    assert np.array_equal(np.asarray(out.labels["paper"]), np.asarray(ds.labels["paper"]))
    assert not out.node("author").has_features and not out.node("institution").has_features
    assert not work_dir_for(result.out).exists()


def test_bytes_moved_are_what_the_plan_says(mag, tmp_path):
    root, ds, _, _ = mag
    result = layerwise(gnn(ds, "gat"), root, tmp_path / "out", memory=1 << 18, progress=False)
    for layer in result.layers:
        moved, expected = layer["moved"], layer["expected"]
        assert moved["input"] == expected["input"]
        assert moved["edges"] == expected["edges"]
        # tables are written in whole pages
        assert expected["output"] <= moved["output"] <= expected["output"] + 4096 * sum(
            result.plan.num_partitions.values())
    relations = result.layers[0]
    assert relations["kind"] == "relations" and relations["moved"]["edges"] > 0
    # the types without features are never read: layer 1 reads the papers' rows only
    paper = ds.node("paper")
    assert relations["moved"]["input"] % paper.row_bytes == 0


def test_lightning_module_and_npy_export(mag, tmp_path):
    root, ds, x, edges = mag
    torch.manual_seed(1)
    module = RGAT(ds.metadata(), {"paper": 12}, num_classes=4, hidden_channels=8, num_layers=2, heads=2)
    module.train()
    layerwise(module, root, tmp_path / "out", npy=tmp_path / "logits.npy", memory=1 << 20, progress=False)
    assert module.training  # given back as it came
    with torch.no_grad():
        module.eval()
        expected = module.gnn(x, edges, ds.num_nodes_dict)
    torch.testing.assert_close(torch.from_numpy(np.load(tmp_path / "logits.npy")), expected, atol=1e-4, rtol=1e-4)


def test_stopped_run_resumes_at_the_first_layer_not_committed(mag, tmp_path, monkeypatch):
    root, ds, _, _ = mag
    model = gnn(ds, "sage", layers=3)
    calls = []
    run_layer = infer_hetero._HeteroRunner.run_layer

    def stop_at_layer_two(self, lp, done):
        calls.append(lp.index)
        if lp.index == 1:
            raise KeyboardInterrupt
        return run_layer(self, lp, done)

    monkeypatch.setattr(infer_hetero._HeteroRunner, "run_layer", stop_at_layer_two)
    with pytest.raises(KeyboardInterrupt):
        layerwise(model, root, tmp_path / "out", memory=1 << 18, progress=False)
    assert not (tmp_path / "out").exists()
    work = work_dir_for(tmp_path / "out")
    kept = {p.name for p in work.glob("layer-*.bin")}
    assert {"layer-1.author.bin", "layer-1.paper.bin"} <= kept and not any(k.startswith("layer-2") for k in kept)
    monkeypatch.setattr(infer_hetero._HeteroRunner, "run_layer", run_layer)
    result = layerwise(model, root, tmp_path / "out", memory=1 << 18, progress=False)
    assert result.resumed_from == 1 and [s["layer"] for s in result.layers] == [2, 3, 4]
    fresh = layerwise(model, root, tmp_path / "fresh", memory=1 << 18, progress=False)
    assert fresh.resumed_from == 0
    assert torch.equal(read(result.out, "paper"), read(fresh.out, "paper"))
    # other weights: the kept layers are not reused
    with torch.no_grad():
        next(iter(model.parameters())).add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        monkeypatch.setattr(infer_hetero._HeteroRunner, "run_layer", stop_at_layer_two)
        layerwise(model, root, tmp_path / "again", memory=1 << 18, progress=False)
    monkeypatch.setattr(infer_hetero._HeteroRunner, "run_layer", run_layer)
    assert layerwise(model, root, tmp_path / "again", memory=1 << 18, progress=False).resumed_from == 1
    assert layerwise(model, root, tmp_path / "again2", memory=1 << 18, progress=False).resumed_from == 0


def test_a_changed_table_is_not_committed(mag, tmp_path, monkeypatch):
    root, ds, _, _ = mag
    commit = infer_hetero._commit_hetero

    def corrupt_then_commit(ds_, plan, work, last, target):
        path = work.root / last["tables"]["paper"]["file"]
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(b"\x7f\x7f\x7f\x7f")
        return commit(ds_, plan, work, last, target)

    monkeypatch.setattr(infer_hetero, "_commit_hetero", corrupt_then_commit)
    with pytest.raises(lightning_ooc.infer.run.TableChecksumError, match="partition 0"):
        layerwise(gnn(ds, "sage"), root, tmp_path / "out", memory=1 << 18, progress=False)
    assert not (tmp_path / "out").exists()


def test_plan_describes_per_type_partitions_and_relations(mag):
    root, ds, _, _ = mag
    plan = plan_layerwise(gnn(ds, "gat"), root, memory=1 << 18)
    text = plan.describe()
    assert "heterogeneous" in text and "GATConv" in text and "combined by mean" in text
    assert [lp.kind for lp in plan.layers] == ["relations", "relations", "node-wise"]
    assert list(plan.layers[-1].out_widths) == ["paper"] and plan.layers[-1].out_widths["paper"] == 4


def test_models_and_layers_that_cannot_run_are_refused(mag, tmp_path):
    root, ds, _, _ = mag
    from torch_geometric.nn.models import GraphSAGE

    with pytest.raises(InputError, match="HeteroLayerByLayer"):
        layerwise(GraphSAGE(12, 8, num_layers=2), root, tmp_path / "o1", progress=False)
    with pytest.raises(InputError, match="runs the targets schedule"):
        layerwise(gnn(ds, "sage"), root, tmp_path / "o4", schedule="buffer", progress=False)
    with pytest.raises(InputError, match="combines relations by"):
        layerwise(gnn(ds, "sage", aggr="cat"), root, tmp_path / "o2", progress=False)
    with pytest.raises(InputError, match="npy= exports one table"):
        model = gnn(ds, "sage")
        model.inference_layers = lambda: list(model.convs)[:1]  # outputs for papers and authors
        layerwise(model, root, tmp_path / "o3", npy=tmp_path / "x.npy", progress=False)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_a_heterogeneous_model_over_a_homogeneous_dataset_is_refused(tmp_path):
    from lightning_ooc.data.synth import synthesize

    root = synthesize(tmp_path / "g", num_nodes=500, avg_degree=3, num_features=12, num_classes=4, progress=False)
    ds = lightning_ooc.open_dataset(synthesize_hetero(tmp_path / "h", "mag", num_nodes=200, progress=False))
    with pytest.raises(InputError, match="heterogeneous model"):
        layerwise(RelationalGNN(ds.metadata(), {"paper": 12}, 8, 4, "paper"), root, tmp_path / "o", progress=False)


def test_predict_loop_runs_layerwise_over_a_heterogeneous_dataset(mag, tmp_path):
    import lightning as L

    from lightning_ooc import OutOfCoreNodeData
    from lightning_ooc.infer.predict import PredictionWriter
    from lightning_ooc.models import RSAGE

    root, ds, x, edges = mag
    torch.manual_seed(2)
    module = RSAGE(ds.metadata(), {"paper": 12}, num_classes=4, hidden_channels=8, num_layers=2)
    dm = OutOfCoreNodeData(root, predict=dict(inference="layerwise", inference_out=tmp_path / "logits",
                                                    inference_memory="1MiB"), progress=False)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[PredictionWriter(tmp_path / "pred.npy")])  # fmt: skip
    trainer.predict(module, datamodule=dm, return_predictions=False)
    pred = np.load(tmp_path / "pred.npy")
    with torch.no_grad():
        module.eval()
        expected = module.gnn(x, edges, ds.num_nodes_dict).argmax(-1).numpy()
    assert pred.shape == (ds.num_nodes_dict["paper"],)
    assert (pred == expected).mean() > 0.999  # argmax of outputs equal within float tolerance


def test_full_disk_is_a_clear_error_and_keeps_earlier_layers(mag, small_disk):
    root, ds, x, edges = mag
    # buckets and layer 1's tables (about 1.6 MB) fit in 2 MiB; layer 2's do not
    model = RelationalGNN(ds.metadata(), {"paper": 12}, 64, 4, "paper", num_layers=3, conv="sage").eval()
    with pytest.raises(FeatureWriteError, match="disk is full") as ei:
        layerwise(model, root, small_disk / "out", memory=1 << 18, progress=False)
    assert "layer-2." in str(ei.value)
    work = work_dir_for(small_disk / "out")
    state = json.loads((work / "state.json").read_text())
    assert [e["index"] for e in state["layers"]] == [0]
    assert (work / "layer-1.paper.bin").exists() and not list(work.glob("*.partial"))
    assert not (small_disk / "out").exists()
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    res = layerwise(model, root, small_disk / "out", memory=1 << 18, progress=False)
    assert res.resumed_from == 1
    with torch.no_grad():
        want = model(x, edges, ds.num_nodes_dict)
    torch.testing.assert_close(read(small_disk / "out", "paper"), want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def cites_both_ways(tmp_path_factory):
    """Papers citing papers as two relations (cites and its separate reverse) and authors writing them: the paper
    type is the source of two relations into papers."""
    g = torch.Generator().manual_seed(5)
    data = HeteroData()
    data["paper"].x = torch.randn(1500, 12, generator=g)
    data["paper"].y = torch.randint(0, 4, (1500,), generator=g)
    data["author"].x = torch.randn(1200, 6, generator=g)
    data["paper", "cites", "paper"].edge_index = torch.randint(0, 1500, (2, 6000), generator=g)
    data["author", "writes", "paper"].edge_index = torch.stack(
        [torch.randint(0, 1200, (3000,), generator=g), torch.randint(0, 1500, (3000,), generator=g)])
    root = prepare_from_hetero(tmp_path_factory.mktemp("ih") / "both", data, add_reverse="separate",
                               drop_duplicates=True, progress=False)  # fmt: skip
    ds = lightning_ooc.open_dataset(root)
    x = {t: torch.from_numpy(np.array(ds.node(t).features_memmap())).float() for t in ds.node_types}
    edges = {}
    for et, c in ds.csc.items():
        dst = np.repeat(np.arange(c.num_nodes), np.diff(c.indptr))
        edges[et] = torch.from_numpy(np.stack([np.asarray(c.indices, dtype=np.int64), dst]))
    return root, ds, x, edges


def _one_relation_at_a_time(plan, lp, ds) -> int:
    """The bytes layer ``lp`` read when each relation streamed its source type and read its destination rows on
    its own, its group holding one relation's accumulators and target states, its output and the combination."""
    total = 0
    for t, out_w in lp.out_widths.items():
        rels = [(et, op) for et, op in lp.ops.items() if et[2] == t]
        sizes = np.diff(plan.bounds[t])
        per = 4 * (max(op.acc_width + op.tgt_width for _, op in rels) + 2 * out_w)
        g = min(len(sizes), max(1, int(plan.memory * 3 // 4 // per) // int(sizes.max())))
        groups = -(-len(sizes) // g)
        for et, op in rels:
            total += groups * plan.num_nodes[et[0]] * ds.node(et[0]).row_bytes
            total += plan.num_nodes[t] * ds.node(t).row_bytes * (2 if op.tgt_width else 1)
    return total


@pytest.mark.parametrize("conv, aggr", [("sage", "mean"), ("gat", "sum"), ("sage", "max")])
def test_a_source_type_streams_once_for_all_its_relations_into_a_type(cites_both_ways, tmp_path, conv, aggr):
    root, ds, x, edges = cites_both_ways
    assert {("paper", "cites", "paper"), ("paper", "rev_cites", "paper")} <= set(ds.edge_types)
    torch.manual_seed(0)
    model = RelationalGNN(ds.metadata(), {"paper": 12, "author": 6}, 16, 4, "paper", num_layers=2, conv=conv,
                          heads=2, aggr=aggr).eval()  # fmt: skip
    result = layerwise(model, root, tmp_path / "out", memory=1 << 18, progress=False)
    plan = result.plan
    first = plan.layers[0]
    # fewer bytes than one relation at a time, from the plan's own partitions and widths
    assert first.expected["input"] < _one_relation_at_a_time(plan, first, ds)
    # the three relations into papers (two from papers) aggregate together, in groups smaller than the type
    assert first.orders["paper"] == "shared" and len(first.bundles["paper"]) == 1
    assert len(first.bundles["paper"][0]) == 3 and first.groups["paper"] < plan.num_partitions["paper"]
    assert "paper shared" in plan.describe()
    for layer in result.layers:
        assert layer["moved"]["input"] == layer["expected"]["input"]
        assert layer["moved"]["edges"] == layer["expected"]["edges"]
    with torch.no_grad():
        expected = model(x, edges, ds.num_nodes_dict)
    torch.testing.assert_close(read(result.out, "paper"), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("orders, bundles", [(("per relation",), [1, 1, 1]), (("per source type",), [2, 1])])
def test_each_order_of_the_relations_gives_the_same_outputs(cites_both_ways, tmp_path, monkeypatch, orders,
                                                            bundles):  # fmt: skip
    root, ds, x, edges = cites_both_ways
    monkeypatch.setattr(infer_hetero, "ORDERS", orders)
    torch.manual_seed(1)
    model = RelationalGNN(ds.metadata(), {"paper": 12, "author": 6}, 16, 4, "paper", num_layers=2, conv="gat",
                          heads=2, aggr="mean").eval()  # fmt: skip
    result = layerwise(model, root, tmp_path / "out", memory=1 << 18, progress=False)
    first = result.plan.layers[0]
    assert [len(b) for b in first.bundles["paper"]] == bundles
    assert first.orders["paper"].startswith(orders[0])
    if orders == ("per relation",):  # one relation at a time, as before: the same bytes as then
        assert first.expected["input"] <= _one_relation_at_a_time(result.plan, first, ds)
    for layer in result.layers:
        assert layer["moved"]["input"] == layer["expected"]["input"]
    with torch.no_grad():
        expected = model(x, edges, ds.num_nodes_dict)
    torch.testing.assert_close(read(result.out, "paper"), expected, atol=1e-4, rtol=1e-4)
