"""GraphSAGE learns from the sampler's minibatches, directly and through PyG's NodeLoader.

The synthetic graph has noisy features (an MLP on them alone stays well
below the GNN) and homophilous edges, so reaching the asserted accuracy needs
both working minibatches and correct edges: with the edges of a wrong node,
the neighbour average carries no class signal and accuracy falls to the MLP's.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch_geometric.data import Data
from torch_geometric.loader import NodeLoader
from torch_geometric.nn import MLP, GraphSAGE

import lightning_ooc
from lightning_ooc.data.synth import synthesize
from lightning_ooc.sampling import NeighborSampler, PyGNeighborSampler

NUM_CLASSES = 4
FANOUTS = [10, 10]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny matrices: one intra-op thread is as fast, and immune to a busy second core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    root = synthesize(
        tmp_path_factory.mktemp("train") / "g", num_nodes=3000, avg_degree=10, num_features=16,
        num_classes=NUM_CLASSES, seed=0, homophily=0.9, feature_noise=3.0, train_frac=0.3, val_frac=0.0,
        test_frac=0.3, progress=False,
    )  # fmt: skip
    return lightning_ooc.open_dataset(root)


def _model() -> GraphSAGE:
    torch.manual_seed(0)
    return GraphSAGE(16, 64, num_layers=len(FANOUTS), out_channels=NUM_CLASSES)


def _fit_and_score(model, train_batches, test_batches, epochs=15) -> float:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(epochs):
        model.train()
        for batch in train_batches():
            opt.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            F.cross_entropy(out, batch.y[: batch.batch_size]).backward()
            opt.step()
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in test_batches():
            pred = model(batch.x, batch.edge_index)[: batch.batch_size].argmax(-1)
            correct += int((pred == batch.y[: batch.batch_size]).sum())
            total += batch.batch_size
    return correct / total


def _mlp_accuracy(ds) -> float:
    x = ds.read_features(np.arange(ds.num_nodes))
    y = torch.from_numpy(np.array(ds.labels))
    train, test = ds.split("train"), ds.split("test")
    torch.manual_seed(0)
    mlp = MLP([16, 64, NUM_CLASSES])
    opt = torch.optim.Adam(mlp.parameters(), lr=0.01)
    for _ in range(200):
        opt.zero_grad()
        F.cross_entropy(mlp(x[train]), y[train]).backward()
        opt.step()
    mlp.eval()
    return float((mlp(x[test]).argmax(-1) == y[test]).float().mean())


@pytest.fixture(scope="module")
def mlp_accuracy(graph):
    return _mlp_accuracy(graph)


def _accuracy_floor(mlp_acc: float) -> float:
    # chance is 1 / NUM_CLASSES = 0.25; the GNN must beat it and the MLP on the same features clearly
    return max(0.6, mlp_acc + 0.15)


def test_graphsage_learns_from_sampled_minibatches(graph, mlp_accuracy):
    sampler = NeighborSampler(graph, FANOUTS, load_features=True)
    train, test = graph.split("train"), graph.split("test")
    gen = torch.Generator().manual_seed(0)

    def batches(ids, shuffle):
        def it():
            order = ids[torch.randperm(ids.numel(), generator=gen)] if shuffle else ids
            for i in range(0, order.numel(), 128):
                yield sampler.sample(order[i : i + 128], seed=int(torch.randint(1 << 30, (), generator=gen)))

        return it

    acc = _fit_and_score(_model(), batches(train, True), batches(test, False))
    assert acc > _accuracy_floor(mlp_accuracy), (acc, mlp_accuracy)


def test_graphsage_learns_through_node_loader(graph, mlp_accuracy):
    n = graph.num_nodes
    dst = torch.repeat_interleave(torch.arange(n), torch.from_numpy(graph.in_degree))
    data = Data(
        x=graph.read_features(np.arange(n)),
        y=torch.from_numpy(np.array(graph.labels)),
        edge_index=torch.stack([torch.from_numpy(np.array(graph.indices)).long(), dst]),
    )
    sampler = PyGNeighborSampler(data, FANOUTS)
    torch.manual_seed(0)
    train_loader = NodeLoader(data, sampler, input_nodes=graph.split("train"), batch_size=128, shuffle=True)
    test_loader = NodeLoader(data, sampler, input_nodes=graph.split("test"), batch_size=256)
    acc = _fit_and_score(_model(), lambda: train_loader, lambda: test_loader)
    assert acc > _accuracy_floor(mlp_accuracy), (acc, mlp_accuracy)


def test_wrong_edges_do_not_learn(graph, mlp_accuracy):
    """Control: the same training with every edge's source replaced by a random node stays near the MLP."""
    n = graph.num_nodes
    dst = torch.repeat_interleave(torch.arange(n), torch.from_numpy(graph.in_degree))
    src = torch.randint(0, n, (dst.numel(),), generator=torch.Generator().manual_seed(1))
    data = Data(
        x=graph.read_features(np.arange(n)),
        y=torch.from_numpy(np.array(graph.labels)),
        edge_index=torch.stack([src, dst]),
    )
    sampler = PyGNeighborSampler(data, FANOUTS)
    torch.manual_seed(0)
    train_loader = NodeLoader(data, sampler, input_nodes=graph.split("train"), batch_size=128, shuffle=True)
    test_loader = NodeLoader(data, sampler, input_nodes=graph.split("test"), batch_size=256)
    acc = _fit_and_score(_model(), lambda: train_loader, lambda: test_loader)
    assert acc < _accuracy_floor(mlp_accuracy), (acc, mlp_accuracy)
