"""The task x feature backend table: every datamodule and the producer build their pass source through it, and a
pair it lacks is one clear error, not a pass source that ignores what the dataset is."""
import pytest

from lightning_ooc import InMemory, Learnable, Mapped, Packed, Partitioned, Tiered
from lightning_ooc import datamodule as dms
from lightning_ooc.errors import InputError
from lightning_ooc.loader import registry
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext, SourceDefaults
from lightning_ooc.loader.link_task import LinkDataConfig
from lightning_ooc.partitioned.partition import partition_dataset
from lightning_ooc.testing import make_synthetic


def test_every_task_has_its_datamodule_and_every_backend_its_place_in_the_table():
    for task in registry.TASKS:
        cls = dms.datamodule_for(task)
        assert cls.task == registry.TASKS[task].datamodule and (task, "tiered") in registry.SOURCES, cls.__name__
    with pytest.raises(InputError, match="no datamodule runs the task 'edges'"):
        dms.datamodule_for("edges")
    from lightning_ooc.loader.features import StorePair

    for backend in (Tiered, Packed, InMemory, Mapped, Learnable, Partitioned, StorePair):
        assert backend.name in registry.BACKEND_TYPES and backend.name in registry.BACKENDS, backend.__name__
        assert ("node", backend.name) in registry.SOURCES  # node classification runs over every backend
    # and every source offers the declared optional members
    for factory in registry.SOURCES.values():
        assert issubclass(factory, SourceDefaults), factory.__name__
        for name in ("flush", "abort", "close", "run"):
            assert callable(getattr(factory, name)), (factory.__name__, name)


def test_task_of_picks_the_most_derived_settings_and_the_dataset_its_case(tmp_path):
    from lightning_ooc.data.synth_hetero import synthesize_hetero

    homogeneous = str(make_synthetic(tmp_path / "g", num_nodes=200, train_frac=0.3).root)
    typed = synthesize_hetero(tmp_path / "h", "mag", num_nodes=400, num_features=4, progress=False)
    assert registry.task_of(NodeDataConfig(root=homogeneous)).name == "node"
    assert registry.task_of(LinkDataConfig(root=homogeneous)).name == "link"
    assert registry.task_of(NodeDataConfig(root=typed)).name == "hetero"
    assert registry.task_for("node", NodeDataConfig(root=typed)).datamodule == "node"
    with pytest.raises(InputError, match="a heterogeneous dataset; link prediction runs on homogeneous datasets"):
        registry.task_of(LinkDataConfig(root=typed))
    with pytest.raises(InputError, match="a homogeneous dataset has no node types or relations"):
        registry.task_of(NodeDataConfig(root=homogeneous, input_type="paper"))
    with pytest.raises(InputError, match="link prediction runs on homogeneous datasets: num_neighbors is one list"):
        LinkDataConfig(root=homogeneous, num_neighbors={"a__b__c": [2]})


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    base = tmp_path_factory.mktemp("registry")
    ds = make_synthetic(base / "g", num_nodes=400, train_frac=0.3)
    return partition_dataset(ds.root, 2, base / "parts", progress=False)


def test_a_pair_the_table_lacks_is_one_error_naming_both(parts, tmp_path):
    cfg = NodeDataConfig(root=str(parts))  # a partitioned root runs the partitioned backend
    with pytest.raises(InputError, match="node classification on a heterogeneous graph over a partitioned dataset "
                                         "is not supported"):  # fmt: skip
        registry.source("hetero", cfg, ProcessContext())
    cfg = NodeDataConfig(root=str(tmp_path), features=Learnable(str(tmp_path / "emb")))
    with pytest.raises(InputError, match=r"heterogeneous graph over learnable features \(an embedding table\) is not "
                                         "supported"):  # fmt: skip
        registry.source("hetero", cfg, ProcessContext())
    with pytest.raises(InputError, match="features must be a feature backend or one of tiered, packed"):
        NodeDataConfig(root=str(tmp_path), features="disk")
    with pytest.raises(InputError, match="features: unknown backend 'lightning_ooc.Disk'"):
        NodeDataConfig(root=str(tmp_path), features={"class_path": "lightning_ooc.Disk"})


@pytest.mark.parametrize("cls, features", [(dms.OutOfCoreLinkData, "tiered"), (dms.OutOfCoreNodeData, Mapped()),
                                           (dms.OutOfCoreNodeData, InMemory())], ids=["link", "mapped", "in_memory"])
def test_a_partitioned_dataset_is_refused_where_no_source_reads_it(parts, cls, features):
    # before: the link datamodule and the in-memory references opened a part as if it held every row
    dm = cls(parts / "part-00000", batch_size=16, num_neighbors=[2], features=features, progress=False)
    with pytest.raises(InputError, match="partitioned dataset"):
        dm.setup()


def test_learnable_features_of_a_partitioned_dataset_keep_their_message(parts, tmp_path):
    cfg = NodeDataConfig(root=str(parts), features=Learnable(str(tmp_path / "emb")))
    with pytest.raises(InputError, match="learnable features of a partitioned dataset are not supported"):
        registry.backend_for(cfg)


def test_the_datamodule_picks_the_backend_the_data_ask_for(parts, tmp_path):
    ds = make_synthetic(tmp_path / "g", num_nodes=300, train_frac=0.3)
    assert registry.backend_for(NodeDataConfig(root=str(ds.root))) == Tiered()
    assert registry.backend_for(NodeDataConfig(root=str(ds.root), features=Mapped())) == Mapped()
    # a partitioned root runs the row exchange with the tiered settings given, or the remote settings given
    tiers = Tiered(gpu_cache="2MiB", host_cache="16KiB")
    assert registry.backend_for(NodeDataConfig(root=str(parts), features=tiers)) == Partitioned(gpu_cache="2MiB",
                                                                                                 host_cache="16KiB")
    remote = Partitioned(remote_cache="1MiB", remote_cache_policy="static", gpu_cache="2MiB")
    assert registry.backend_for(NodeDataConfig(root=str(parts), features=remote)) is remote
    with pytest.raises(InputError, match="cannot be combined with it"):
        registry.backend_for(NodeDataConfig(root=str(parts), features=Packed()))
    with pytest.raises(InputError, match=r"features=Partitioned\(\.\.\.\) needs a partitioned dataset"):
        registry.backend_for(NodeDataConfig(root=str(ds.root), features=Partitioned()))
    # a PyG store pair reads its own feature store, whatever the root says
    assert registry.backend_for(NodeDataConfig(root=str(ds.root)), stores=object()).name == "pyg_store"
    with pytest.raises(InputError, match="a PyG store pair is read through its own feature store"):
        registry.backend_for(NodeDataConfig(root=str(ds.root), features=InMemory()), stores=object())
    dm = dms.OutOfCoreNodeData(ds.root, batch_size=32, num_neighbors=[2], features=InMemory(), progress=False)
    dm.setup()
    try:
        assert isinstance(dm.source, registry.SOURCES["node", "device_table"])
        assert registry.backend_for(dm.config) == InMemory() and dm.source.close_after_error is None
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
