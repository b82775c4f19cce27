"""R-GAT and R-SAGE: they learn from relations, and take featureless node types."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_geometric.data import HeteroData

import lightning_ooc
from lightning_ooc.data.synth_hetero import synthesize_hetero
from lightning_ooc.models import RGAT, RSAGE


def full_graph(ds, zero_target_features: bool = False) -> HeteroData:
    """The whole dataset as one HeteroData batch whose seeds are all the papers."""
    data = HeteroData()
    for t in ds.node_types:
        node = ds.node(t)
        data[t].n_id = torch.arange(node.num_nodes)
        if node.has_features:
            x = node.read_features(np.arange(node.num_nodes)).float()
            data[t].x = torch.zeros_like(x) if zero_target_features and t == ds.target else x
    for et, csc in ds.csc.items():
        dst = torch.from_numpy(np.repeat(np.arange(csc.num_nodes), np.diff(csc.indptr)))
        data[et].edge_index = torch.stack([torch.from_numpy(np.asarray(csc.indices, dtype=np.int64)), dst])
    data[ds.target].y = torch.from_numpy(np.array(ds.node(ds.target).labels))
    data[ds.target].batch_size = ds.num_nodes_dict[ds.target]
    return data


def fit_accuracy(model, batch, steps: int) -> float:
    torch.manual_seed(0)
    opt = model.configure_optimizers()
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        out, y, _ = model._seed_logits(batch)
        torch.nn.functional.cross_entropy(out, y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out, y, _ = model._seed_logits(batch)
    return float((out.argmax(-1) == y).float().mean())


@pytest.fixture(scope="module")
def igbh(tmp_path_factory):
    root = synthesize_hetero(tmp_path_factory.mktemp("m") / "igbh", "igbh", num_nodes=1500, num_features=16,
                             num_classes=5, seed=0, progress=False)  # fmt: skip
    return lightning_ooc.open_dataset(root)


@pytest.mark.parametrize("cls", [RGAT, RSAGE])
def test_learns_from_relations_alone(igbh, cls):
    """With the papers' own features zeroed, only the authors, topics and citations tell the class."""
    torch.manual_seed(0)
    in_channels = {t: igbh.node(t).num_features for t in igbh.node_types}
    model = cls(igbh.metadata(), in_channels, num_classes=5, hidden_channels=32, num_layers=2, dropout=0.0,
                lr=0.01)  # fmt: skip
    acc = fit_accuracy(model, full_graph(igbh, zero_target_features=True), steps=60)
    assert acc > 0.5, acc  # 5 classes: chance is 0.2


def test_featureless_types_and_shapes(tmp_path):
    root = synthesize_hetero(tmp_path / "mag", "mag", num_nodes=1500, num_features=16, num_classes=4, seed=0,
                             progress=False)  # fmt: skip
    ds = lightning_ooc.open_dataset(root)
    in_channels = {t: ds.node(t).num_features for t in ds.node_types}
    assert in_channels == {"paper": 16, "author": 0, "institution": 0}
    model = RGAT(ds.metadata(), in_channels, num_classes=4, hidden_channels=16, num_layers=2, heads=2)
    assert set(model.gnn.type_embedding) == {"author", "institution"}
    batch = full_graph(ds)
    y = batch["paper"].y
    batch["paper"].y = torch.where(y < 0, torch.zeros_like(y), y)  # MAG's papers outside the splits: no label
    out, _, n = model._seed_logits(batch)
    assert out.shape == (n, 4) and n == 1500
    loss = model.training_step(batch, 0)
    loss.backward()
    assert model.gnn.type_embedding["author"].grad is not None  # the featureless type's vector learns


def test_yaml_metadata_and_bad_arguments(igbh):
    node_types, edge_types = igbh.metadata()
    as_yaml = [node_types, [list(et) for et in edge_types]]  # what LightningCLI hands over
    in_channels = {t: 16 for t in node_types}
    model = RSAGE(as_yaml, in_channels, num_classes=5, hidden_channels=8, num_layers=1)
    assert model.hparams.metadata == as_yaml
    with pytest.raises(ValueError, match="not one of the node types"):
        RGAT(as_yaml, in_channels, num_classes=5, target="venue")
    with pytest.raises(ValueError, match="divisible by heads"):
        RGAT(as_yaml, in_channels, num_classes=5, hidden_channels=30, heads=4)
    with pytest.raises(ValueError, match="not in the metadata"):
        RGAT(as_yaml, {"papers": 16}, num_classes=5)
