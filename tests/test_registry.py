"""The task x feature backend table: every datamodule and the producer build their pass source through it, and a
pair it lacks is one clear error, not a pass source that ignores what the dataset is."""
import pytest

from lightning_ooc import datamodule as dms
from lightning_ooc.errors import InputError
from lightning_ooc.loader import registry
from lightning_ooc.loader.config import HeteroNodeDataConfig, NodeDataConfig
from lightning_ooc.loader.context import ProcessContext, SourceDefaults
from lightning_ooc.loader.links import LinkDataConfig
from lightning_ooc.partitioned.partition import partition_dataset
from lightning_ooc.testing import make_synthetic


def test_every_named_datamodule_is_a_pair_of_the_table():
    for (task, backend), cls in dms.DATAMODULES.items():
        assert (task, backend) in registry.SOURCES
        assert (cls.task, cls.backend) == (task, backend), cls.__name__
    # and every source offers the declared optional members
    for factory in registry.SOURCES.values():
        assert issubclass(factory, SourceDefaults), factory.__name__
        for name in ("flush", "abort", "close", "run"):
            assert callable(getattr(factory, name)), (factory.__name__, name)


def test_task_of_picks_the_most_derived_settings():
    assert registry.task_of(NodeDataConfig(root="r")).name == "node"
    assert registry.task_of(LinkDataConfig(root="r")).name == "link"
    assert registry.task_of(HeteroNodeDataConfig(root="r")).name == "hetero"


def test_a_pair_the_table_lacks_is_one_error_naming_both(tmp_path):
    cfg = HeteroNodeDataConfig(root=str(tmp_path))
    with pytest.raises(InputError, match="node classification on a heterogeneous graph over a partitioned dataset "
                                         "is not supported"):  # fmt: skip
        registry.source("hetero", "partitioned", cfg, ProcessContext())
    with pytest.raises(InputError, match="unknown feature backend 'disk'"):
        registry.source("node", "disk", cfg, ProcessContext())


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    base = tmp_path_factory.mktemp("registry")
    ds = make_synthetic(base / "g", num_nodes=400, train_frac=0.3)
    return partition_dataset(ds.root, 2, base / "parts", progress=False)


@pytest.mark.parametrize("cls", [dms.OutOfCoreLinkData, dms.BaselineNodeData, dms.DeviceTableNodeData])
def test_a_partitioned_dataset_is_refused_where_no_source_reads_it(parts, cls):
    # before: the link datamodule and the in-memory references opened a part as if it held every row
    dm = cls(parts / "part-00000", batch_size=16, num_neighbors=[2], progress=False)
    with pytest.raises(InputError, match="partitioned dataset"):
        dm.setup()


def test_learnable_features_of_a_partitioned_dataset_keep_their_message(parts, tmp_path):
    cfg = NodeDataConfig(root=str(parts), features="learnable", embeddings=str(tmp_path / "emb"))
    with pytest.raises(InputError, match="learnable features of a partitioned dataset are not supported"):
        registry.backend_for(cfg, "tiered")


def test_the_datamodule_picks_the_backend_the_data_ask_for(tmp_path):
    ds = make_synthetic(tmp_path / "g", num_nodes=300, train_frac=0.3)
    assert registry.backend_for(NodeDataConfig(root=str(ds.root)), "tiered") == "tiered"
    assert registry.backend_for(NodeDataConfig(root=str(ds.root)), "sync") == "sync"
    dm = dms.DeviceTableNodeData(ds.root, batch_size=32, num_neighbors=[2], progress=False)
    dm.setup()
    try:
        assert isinstance(dm.source, registry.SOURCES["node", "device_table"])
        assert dm.source.close_after_error is None
    finally:
        dm.teardown()


def test_every_pass_source_of_the_grid_is_a_backend_over_its_tasks_batches():
    """A task's batches (seeds, samplers, sample function) come from its task class only: no pass source of the
    grid defines them again; the named classes are a backend's class with the task as ``task_type``."""
    from lightning_ooc.loader.baseline import SyncPasses
    from lightning_ooc.loader.context import SourceDefaults
    from lightning_ooc.loader.source import LocalPasses

    hooks = {"_samplers", "_sample_fn", "_presample_nodes", "_seeds_per_batch", "_seed_memory", "sample",
             "sample_subgraph"}
    for (task, backend), cls in registry.SOURCES.items():
        assert cls.task_type is registry.TASKS[task].batches, (task, backend)
        assert issubclass(cls, registry.BACKEND_TYPES[backend]), (task, backend)
        built = registry.combine(backend, registry.TASKS[task])  # what a task registered anew gets
        assert built.task_type is cls.task_type and issubclass(built, registry.BACKEND_TYPES[backend])
        for klass in cls.__mro__:  # what lies between the grid's class and its backend's base class
            if klass in (LocalPasses, SyncPasses, SourceDefaults, object):
                continue
            assert not hooks & set(vars(klass)), (task, backend, klass.__name__, hooks & set(vars(klass)))
