"""Our datamodule over a PyG (FeatureStore, GraphStore) pair of another backend (the pyg_store backend): the
topology from the graph store's CSC, x through the feature store's multi_get_tensor on the extractor threads."""
import threading

import numpy as np
import pytest
import torch
from torch_geometric.distributed import LocalFeatureStore
from torch_geometric.testing.graph_store import MyGraphStore

from lightning_ooc import InMemory, OutOfCoreLinkData, OutOfCoreNodeData, Tiered
from lightning_ooc.errors import InputError
from lightning_ooc.loader import registry
from lightning_ooc.testing import make_synthetic


class RecordingStore(LocalFeatureStore):
    """PyG's in-memory feature store, noting the threads that ask it for rows of x."""

    def __init__(self):
        super().__init__()
        self.threads = set()

    def _multi_get_tensor(self, attrs):
        self.threads.add(threading.current_thread().name)
        return super()._multi_get_tensor(attrs)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("src") / "g", num_nodes=3000, avg_degree=6, num_features=12,
                          num_classes=4, train_frac=0.3)


def _pair(ds, masks=True):
    """The dataset in another backend's stores: x, y and the split masks in a feature store, the edges (in CSC
    order, sorted by destination) in a graph store."""
    n = ds.num_nodes
    fs = RecordingStore.from_data(torch.arange(n), x=torch.from_numpy(np.array(ds.features_memmap())),
                                  y=torch.from_numpy(np.array(ds.labels)))  # fmt: skip
    if masks:
        for split in ("train", "val", "test"):
            mask = torch.zeros(n, dtype=torch.bool)
            mask[ds.split(split)] = True
            fs.put_tensor(mask, group_name=None, attr_name=f"{split}_mask", index=None)
    gs = MyGraphStore()
    dst = torch.repeat_interleave(torch.arange(n), torch.from_numpy(np.diff(ds.indptr)))
    gs.put_edge_index((torch.from_numpy(ds.indices.astype(np.int64)), dst), edge_type=None, layout="coo",
                      is_sorted=True, size=(n, n))  # fmt: skip
    return fs, gs


def _batches(dm, split="train"):
    dm.setup("fit")
    try:
        loader = {"train": dm.train_dataloader, "val": dm.val_dataloader}[split]()
        return [(b.n_id.clone(), b.x.clone(), b.y.clone(), b.edge_index.clone()) for b in loader]
    finally:
        dm.teardown("fit")


def test_a_store_pair_gives_the_batches_of_the_dataset(ds):
    """In order, the same seeds, samples and rows as the same datamodule over the dataset directory; the rows
    come from the store's multi_get_tensor, called by the extractor threads."""
    fs, gs = _pair(ds)
    opts = dict(batch_size=128, num_neighbors=[5, 3], pipeline=dict(order="in_order", num_extractors=2),
                progress=False)  # fmt: skip
    over_pair = OutOfCoreNodeData((fs, gs), **opts)  # the pair reads its own feature store: no tiers to give
    assert over_pair.num_features == 12 and over_pair.num_classes == 4  # before set-up, as a model needs them
    got = _batches(over_pair)
    ref = _batches(OutOfCoreNodeData(ds.root, features=Tiered(gpu_cache="2MiB", host_cache="64KiB", staging="1MiB"),
                                     **opts))  # fmt: skip
    assert len(got) == len(ref) == -(-ds.split("train").numel() // 128)
    for a, b in zip(got, ref):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert fs.threads and all("extractor" in t for t in fs.threads), fs.threads
    assert registry.SOURCES["node", "pyg_store"].__name__ == "StorePairPasses"
    val = _batches(OutOfCoreNodeData((fs, gs), **opts), "val")
    assert sum(int(b[2].numel() > 0) for b in val) == len(val) > 0


def test_trains_with_lightning(ds):
    import lightning as L

    from lightning_ooc.models import GraphSAGE

    fs, gs = _pair(ds)
    dm = OutOfCoreNodeData((fs, gs), batch_size=256, num_neighbors=[4, 4], progress=False)
    model = GraphSAGE(dm.num_features, dm.num_classes, hidden_channels=16, num_layers=2)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=2)  # fmt: skip
    trainer.fit(model, datamodule=dm)
    assert torch.isfinite(trainer.logged_metrics["train_loss"])
    assert "val_acc" in trainer.logged_metrics


def test_store_pair_errors(ds):
    fs, gs = _pair(ds, masks=False)
    with pytest.raises(InputError, match=r"no train_mask or train_idx of group None"):
        OutOfCoreNodeData((fs, gs), progress=False).setup("fit")
    fs, gs = _pair(ds)
    with pytest.raises(InputError, match=r"link prediction over a PyG \(FeatureStore, GraphStore\) pair is not "
                                         r"supported"):  # fmt: skip
        OutOfCoreLinkData((fs, gs), progress=False)
    for features in (InMemory(), Tiered(gpu_cache="2MiB")):  # a backend of ours is no way to read the pair's rows
        with pytest.raises(InputError, match=r"a PyG store pair is read through its own feature store; leave "
                                             r"features unset"):  # fmt: skip
            OutOfCoreNodeData((fs, gs), features=features, progress=False)  # at construction, before any set-up
    het = MyGraphStore()
    het.put_edge_index((torch.tensor([0]), torch.tensor([1])), edge_type=("a", "to", "b"), layout="coo", size=(2, 2))
    with pytest.raises(InputError, match=r"heterogeneous graph store"):
        OutOfCoreNodeData((fs, het), progress=False).setup("fit")
    bare = LocalFeatureStore.from_data(torch.arange(ds.num_nodes), x=torch.zeros(ds.num_nodes, 2))
    with pytest.raises(InputError, match=r"needs x and y of group None"):
        OutOfCoreNodeData((bare, gs), progress=False).setup("fit")


def test_e_id_over_a_store_pair_is_the_graph_stores_edge_id(ds):
    """Issue 34's ``e_id`` over a store pair: the graph store's id of each edge (its COO position), through the
    permutation its ``csc()`` returns, as PyG's loaders give it; here the edges are put in shuffled order."""
    fs, _ = _pair(ds)
    n = ds.num_nodes
    dst = torch.repeat_interleave(torch.arange(n), torch.from_numpy(np.diff(ds.indptr)))
    src = torch.from_numpy(ds.indices.astype(np.int64))
    order = torch.randperm(src.numel(), generator=torch.Generator().manual_seed(0))
    gs = MyGraphStore()
    gs.put_edge_index((src[order], dst[order]), edge_type=None, layout="coo", size=(n, n))
    assert gs.csc()[2] is not None  # the store sorts by destination: its CSC positions are not its ids
    dm = OutOfCoreNodeData((fs, gs), batch_size=128, num_neighbors=[5, 3], return_e_id=True, progress=False)
    dm.setup("fit")
    try:
        batch = next(iter(dm.train_dataloader()))
    finally:
        dm.teardown("fit")
    assert batch.e_id.numel() == batch.edge_index.shape[1] > 0
    assert torch.equal(src[order][batch.e_id], batch.n_id[batch.edge_index[0]])
    assert torch.equal(dst[order][batch.e_id], batch.n_id[batch.edge_index[1]])


def test_a_store_pair_is_kept_by_its_name_and_never_copied_for_the_hyperparameters(ds):
    """Lightning reads the init arguments of every ``__init__`` frame and copies them: the pair (which may hold
    open files, a lock, a connection) is left out and kept by its name."""
    fs, gs = _pair(ds)

    def refuse(memo):
        raise TypeError("this store cannot be copied")

    fs.__deepcopy__ = gs.__deepcopy__ = refuse  # as a store holding a lock or a connection
    dm = OutOfCoreNodeData((fs, gs), batch_size=64, num_neighbors=[2], progress=False)
    assert dm.hparams["root"] == dm.config.root and isinstance(dm.hparams["root"], str)
    assert dm.stores == (fs, gs)
