"""The datamodule's settings: the feature backend as a value (each backend checks its own settings), the pipeline
and predict groups, one spelling for each setting, nested YAML and the command line, checkpoints."""
from __future__ import annotations

import importlib
import inspect
from dataclasses import fields

import lightning as L
import pytest
import torch
import yaml

import lightning_ooc
from lightning_ooc import (
    InMemory,
    Learnable,
    Mapped,
    OutOfCoreLinkData,
    OutOfCoreNodeData,
    Packed,
    Partitioned,
    Pipeline,
    PredictSettings,
    Tiered,
)
from lightning_ooc.errors import InputError
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.features import NAMES, as_backend

from jobs import REPO

MiB = 1 << 20
#: every backend, with its own settings' names
BACKENDS = (Tiered, Packed, InMemory, Mapped, Learnable, Partitioned)


def _names(cls):
    """The settings a backend takes: its constructor's, and the tiered ones where it passes ``**tiered`` on."""
    params = inspect.signature(cls.__init__).parameters
    own = {name for name in params if name not in ("self", "tiered")}
    return own | _names(Tiered) if "tiered" in params else own


def test_sizes_are_bytes_at_construction_and_settings_keep_what_was_given():
    t = Tiered(gpu_cache="4GiB", host_cache=0, staging="1MiB")
    assert (t.gpu_cache, t.host_cache, t.staging) == (4 << 30, 0, MiB)
    assert t.settings() == {"gpu_cache": "4GiB", "host_cache": 0, "staging": "1MiB"}  # the defaults are left out
    assert repr(t) == "Tiered(gpu_cache='4GiB', host_cache=0, staging='1MiB')"
    same = Tiered(gpu_cache=4 << 30, host_cache="0B", staging=MiB)  # the same sizes, written another way
    assert t == same and hash(t) == hash(same)
    assert Packed() != Tiered() and Tiered() == Tiered() and Tiered(gpu_cache="2GiB") != Tiered()
    p = Packed(pack_memory="16MiB", pack_space=2, gpu_cache="8MiB", host_cache_policy="degree")
    assert (p.pack_memory, p.pack_space, p.gpu_cache, p.host_cache_policy) == (16 * MiB, 2.0, 8 * MiB, "degree")
    assert p.tiered() == {"gpu_cache": "8MiB", "host_cache_policy": "degree"}  # what a tiered store is built with
    lr = Learnable("emb", lr=0.5, gpu_cache="2MiB")
    assert (lr.table, lr.lr, lr.gpu_cache, lr.host_cache) == ("emb", 0.5, 2 * MiB, 0)  # no host cache, ever
    r = Partitioned(remote_cache="8MiB", remote_cache_policy="static", host_cache="1MiB")
    assert (r.remote_cache, r.remote_cache_policy, r.host_cache) == (8 * MiB, "static", MiB)
    assert Mapped().source_options() == {"features": "mmap", "madvise_random": True}
    assert Mapped(madvise="normal").source_options() == {"features": "mmap", "madvise_random": False}
    assert Mapped(in_ram=True).source_options()["features"] == "ram"
    assert InMemory() == InMemory() and InMemory().settings() == {}
    # the planner's changes make a copy, in final form; the backend given is left as it was
    lowered = t.replaced(host_cache=MiB)
    assert (lowered.host_cache, t.host_cache, type(lowered)) == (MiB, 0, Tiered)
    with pytest.raises(TypeError, match="Tiered has no setting"):
        t.replaced(pack_space=2)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Tiered(staging="lots"), "staging: cannot parse byte budget 'lots'"),
        (lambda: Tiered(gpu_cache="-1GiB"), "gpu_cache: byte budget must be >= 0, got '-1GiB'"),
        (lambda: Tiered(host_cache=True), "host_cache: cannot parse byte budget True"),
        (lambda: Tiered(host_cache_policy="lru"), "host_cache_policy must be one of presample, degree, scored, "
                                                  "got 'lru'"),
        (lambda: Tiered(presample_batches=-1), "presample_batches must be an integer >= 0, got -1"),
        (lambda: Tiered(host_cache_fill="later"), "host_cache_fill must be one of auto, setup, background"),
        (lambda: Tiered(cache_decay=0), "cache_decay must lie in (0, 1]"),
        (lambda: Tiered(cache_decay=1.5), "cache_decay must lie in (0, 1]"),
        (lambda: Tiered(cache_interval=0), "cache_interval must be an integer >= 1, got 0"),
        (lambda: Tiered(io_backend="aio"), "io_backend must be one of auto, uring, pread, buffered, mmap, got 'aio'"),
        (lambda: Tiered(queue_depth=0), "queue_depth must be an integer >= 1, got 0"),
        (lambda: Packed(host_cache_policy="scored"), "host_cache_policy='scored' replaces rows as training runs"),
        (lambda: Packed(pack_space=0), "pack_space must be a multiple of the feature files' size > 0"),
        (lambda: Packed(pack_space="much"), "pack_space must be a multiple of the feature files' size > 0"),
        (lambda: Packed(pack_memory="4MiB"), "pack_memory must be at least 8MiB, got '4MiB'"),
        (lambda: Packed(first_epoch="later"), "first_epoch must be one of pack, random, got 'later'"),
        (lambda: Packed(staging="lots"), "staging: cannot parse byte budget 'lots'"),  # its tiered settings too
        (lambda: Learnable(""), "Learnable needs table: an embedding table for the dataset's nodes"),
        (lambda: Learnable("emb", lr=0), "lr must be > 0"),
        (lambda: Learnable("emb", gpu_cache="x"), "gpu_cache: cannot parse byte budget 'x'"),
        (lambda: Partitioned(remote_cache="x"), "remote_cache: cannot parse byte budget 'x'"),
        (lambda: Partitioned(remote_cache_policy="lru"), "remote_cache_policy must be one of scored, static, none"),
        (lambda: Partitioned(exchange_timeout=0), "exchange_timeout must be > 0 seconds, got 0"),
        (lambda: Partitioned(queue_depth=0), "queue_depth must be an integer >= 1, got 0"),
        (lambda: Mapped(madvise="sequential"), "madvise must be one of random, normal, got 'sequential'"),
        (lambda: Mapped(in_ram="yes"), "in_ram must be true or false, got 'yes'"),
        (lambda: Pipeline(order="bogus"), "order must be one of out_of_order, in_order, got 'bogus'"),
        (lambda: Pipeline(num_extractors=0), "num_extractors must be an integer >= 1, got 0"),
        (lambda: PredictSettings(inference="full"), "inference must be one of sampled, layerwise, got 'full'"),
        (lambda: PredictSettings(inference_memory="x"), "inference_memory: cannot parse byte budget 'x'"),
        (lambda: PredictSettings(inference_chunk=0), "inference_chunk must be an integer >= 1, got 0"),
    ],
)
def test_each_backend_and_group_checks_its_settings_at_construction(make, message):
    with pytest.raises(InputError) as e:
        make()
    assert message in str(e.value)


def test_a_backend_takes_only_its_own_settings():
    for make in (lambda: Tiered(pack_space=2), lambda: Packed(remote_cache="1MiB"), lambda: InMemory(gpu_cache=1),
                 lambda: Mapped(host_cache=0), lambda: Learnable("emb", host_cache="1GiB"),
                 lambda: Partitioned(pack_dir="p")):  # fmt: skip
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            make()
    assert _names(Tiered) < _names(Packed) and _names(Tiered) < _names(Partitioned)
    assert "host_cache" not in _names(Learnable) and not _names(InMemory)


def test_short_names_stand_for_backends_with_their_defaults():
    assert {name: type(as_backend(name)) for name in NAMES} == {"tiered": Tiered, "packed": Packed,
                                                                "in_memory": InMemory, "mapped": Mapped,
                                                                "partitioned": Partitioned}  # fmt: skip
    for name, cls in NAMES.items():
        assert as_backend(name) == cls()
    assert as_backend(None) == Tiered() and as_backend(t := Tiered(gpu_cache=1)) is t
    assert OutOfCoreNodeData("r", features="in_memory").config.features == InMemory()
    with pytest.raises(InputError, match=r"features='learnable' needs its table: features=Learnable\(table=TABLE\)"):
        as_backend("learnable")
    with pytest.raises(InputError, match="features must be a feature backend or one of tiered, packed, in_memory, "
                                         "mapped, partitioned, got 'mmap'"):  # fmt: skip
        OutOfCoreNodeData("r", features="mmap")
    with pytest.raises(InputError, match=r"features must be a feature backend \(Tiered\(...\), .* got int"):
        NodeDataConfig("r", features=4)


def test_as_backend_builds_a_class_path_dict():
    """What LightningCLI and a checkpoint hold: ``{"class_path": ..., "init_args": {...}}``."""
    assert as_backend({"class_path": "lightning_ooc.Packed", "init_args": {"pack_space": 2}}) == Packed(pack_space=2)
    assert as_backend({"class_path": "lightning_ooc.loader.features.InMemory"}) == InMemory()
    assert as_backend({"class_path": "Mapped", "init_args": {"madvise": "normal"}}) == Mapped(madvise="normal")
    for backend in (Tiered(gpu_cache="4GiB", io_backend="pread"), Packed(pack_dir="/p", pack_memory="16MiB"),
                    InMemory(), Mapped(in_ram=True), Learnable("emb", lr=0.1),
                    Partitioned(remote_cache="2MiB", host_cache=0)):  # fmt: skip
        plain = backend.plain()
        assert plain["class_path"] == f"lightning_ooc.{type(backend).__name__}"
        assert getattr(lightning_ooc, type(backend).__name__) is type(backend)  # the class_path names it
        assert as_backend(plain) == backend
    with pytest.raises(InputError, match="features: unknown backend 'lightning_ooc.Remote'; one of Tiered, Packed"):
        as_backend({"class_path": "lightning_ooc.Remote"})
    with pytest.raises(InputError, match="features: Tiered: .*unexpected keyword argument 'pack_space'"):
        as_backend({"class_path": "lightning_ooc.Tiered", "init_args": {"pack_space": 2}})
    with pytest.raises(InputError, match="host_cache_policy must be one of"):  # its own checks, as given
        as_backend({"class_path": "lightning_ooc.Tiered", "init_args": {"host_cache_policy": "lru"}})


def test_the_datamodule_signature_is_short_and_has_no_flat_names():
    flat = set().union(*map(_names, BACKENDS), {f.name for f in fields(Pipeline)},
                       {f.name for f in fields(PredictSettings)})  # fmt: skip
    legacy = {"budgets", "caching", "io", "remote", "learnable", "embeddings", "embedding_lr", "madvise_random"}
    for cls in (OutOfCoreNodeData, OutOfCoreLinkData):
        params = inspect.signature(cls).parameters
        assert len(params) <= 17, (cls.__name__, list(params))  # the time group (temporal sampling) made it 17
        assert not (set(params) & (flat | legacy)), (cls.__name__, set(params) & (flat | legacy))
    params = inspect.signature(OutOfCoreNodeData).parameters
    assert {"features", "pipeline", "predict", "memory_limit"} <= set(params)
    assert params["features"].default == Tiered() and params["pipeline"].default is params["predict"].default is None
    # each default is written once: the datamodule's settings with nothing given are the config's
    assert OutOfCoreNodeData("r").config == NodeDataConfig("r")
    assert not hasattr(OutOfCoreNodeData, "backend")  # the backend is a value: config.features
    datamodule = importlib.import_module("lightning_ooc.datamodule")
    for gone in ("BaselineNodeData", "DeviceTableNodeData", "PackedLinkData", "DATAMODULES"):
        assert not hasattr(datamodule, gone), gone
    assert datamodule.datamodule_for("hetero") is OutOfCoreNodeData  # the dataset says which case
    assert not issubclass(OutOfCoreLinkData, OutOfCoreNodeData)  # one task each, one shared base
    # three datamodule classes in the package's names, and the two earlier names kept as warned aliases
    classes = [n for n in lightning_ooc.__all__ if isinstance(getattr(lightning_ooc, n), type)
               and issubclass(getattr(lightning_ooc, n), L.LightningDataModule)]  # fmt: skip
    assert sorted(classes) == ["OutOfCoreEmbeddingData", "OutOfCoreLinkData", "OutOfCoreNodeData"]
    assert {"OutOfCoreHeteroNodeData", "PackedNodeData"} <= set(lightning_ooc.__all__)


@pytest.mark.parametrize("cls", [OutOfCoreNodeData, OutOfCoreLinkData])
@pytest.mark.parametrize("flat", [{"gpu_cache": "4GiB"}, {"num_samplers": 2}, {"order": "in_order"},
                                  {"profile": "trace"}, {"inference": "layerwise"}, {"budgets": {"staging": 1}},
                                  {"embeddings": "emb"}, {"madvise_random": True}])  # fmt: skip
def test_a_flat_name_is_a_type_error(cls, flat):
    """One spelling: ``features=Tiered(gpu_cache=...)``, ``pipeline={"num_samplers": ...}``; the old flat names
    and groups are not taken."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(flat))}'"):
        cls("r", **flat)
    with pytest.raises(TypeError):
        NodeDataConfig("r", **flat)


def test_groups_take_an_instance_or_a_dict_of_their_fields_and_nothing_else():
    a = OutOfCoreNodeData("r", pipeline={"num_samplers": 2, "order": "in_order"}, predict={"inference_memory": "2GiB"},
                          memory_limit=None, features=Tiered(gpu_cache="4GiB"))  # fmt: skip
    b = OutOfCoreNodeData("r", pipeline=Pipeline(num_samplers=2, order="in_order"), memory_limit=None,
                          predict=PredictSettings(inference_memory=2 << 30), features=Tiered(gpu_cache=4 << 30))
    assert a.config == b.config and a.order == "in_order"
    assert (a.config.features.gpu_cache, a.config.pipeline.num_samplers, a.config.predict.inference_memory,
            a.config.memory_limit) == (4 << 30, 2, 2 << 30, None)  # fmt: skip
    with pytest.raises(InputError, match=r"pipeline: unknown setting\(s\) samplers; it takes order, num_samplers"):
        OutOfCoreNodeData("r", pipeline={"samplers": 2})
    with pytest.raises(InputError, match=r"pipeline: unknown setting\(s\) gpu_cache"):  # the backend's setting
        OutOfCoreLinkData("r", pipeline={"gpu_cache": "4GiB"})
    with pytest.raises(InputError, match=r"predict: unknown setting\(s\) memory; it takes inference"):
        OutOfCoreNodeData("r", predict={"memory": "1GiB"})
    with pytest.raises(InputError, match="num_samplers must be an integer >= 1, got 0"):
        OutOfCoreNodeData("r", num_neighbors={("a", "r", "b"): [2]}, pipeline={"num_samplers": 0})
    with pytest.raises(InputError, match="pipeline must be a Pipeline or a dict of its fields, got list"):
        OutOfCoreNodeData("r", pipeline=[2])
    with pytest.raises(InputError, match="memory_limit must be 'auto'"):
        OutOfCoreNodeData("r", memory_limit="lots")


def test_with_settings_is_a_modified_copy():
    cfg = NodeDataConfig("r", features=Packed(pack_memory="16MiB", gpu_cache="4GiB"), pipeline={"num_samplers": 4})
    low = cfg.with_settings(features={"host_cache": 0, "gpu_cache": MiB}, pipeline={"num_samplers": 1}, seed=3)
    assert (low.features.host_cache, low.features.gpu_cache, low.pipeline.num_samplers, low.seed) == (0, MiB, 1, 3)
    assert type(low.features) is Packed and low.features.pack_memory == 16 * MiB
    assert (cfg.features.host_cache, cfg.features.gpu_cache, cfg.pipeline.num_samplers, cfg.seed) == \
        (1 << 30, 4 << 30, 4, 0)  # fmt: skip
    with pytest.raises(TypeError, match="Packed has no setting"):
        cfg.with_settings(features={"remote_cache": 0})
    with pytest.raises(TypeError, match="NodeDataConfig has no setting gpu_cache"):
        cfg.with_settings(gpu_cache=0)


def test_hyperparameters_round_trip_the_backend_through_a_checkpoint(tmp_path):
    """Checkpoints keep the datamodule's hyperparameters and load them with ``weights_only``: the backend as its
    ``class_path`` and ``init_args``, groups as dicts, paths as strings, negative sampling as a dict, a
    heterogeneous fanout keyed by relation strings; the datamodule rebuilt from them has the same settings."""
    dm = OutOfCoreLinkData(tmp_path / "g", neg_sampling="triplet",
                           pipeline=Pipeline(num_samplers=2, profile=tmp_path / "t"),
                           features=Packed(pack_dir=tmp_path / "packs", pack_memory="16MiB", gpu_cache="4GiB"),
                           predict=PredictSettings(inference="layerwise", inference_memory="2GiB"))  # fmt: skip
    hp = dict(dm.hparams)
    assert hp["features"] == {"class_path": "lightning_ooc.Packed", "init_args": {
        "gpu_cache": "4GiB", "pack_dir": str(tmp_path / "packs"), "pack_memory": "16MiB"}}
    assert hp["pipeline"] == {**vars(Pipeline()), "num_samplers": 2, "profile": str(tmp_path / "t")}
    assert hp["predict"]["inference"] == "layerwise" and hp["predict"]["inference_memory"] == 2 << 30
    assert hp["root"] == str(tmp_path / "g") and hp["neg_sampling"]["mode"] == "triplet"
    het = OutOfCoreNodeData(tmp_path / "h", num_neighbors={("a", "r", "b"): [2, 1]}, input_type="b",
                            features=Mapped(madvise="normal"))  # fmt: skip
    assert dict(het.hparams)["num_neighbors"] == {"a__r__b": [2, 1]} and het.hparams["input_type"] == "b"
    short = OutOfCoreNodeData(tmp_path / "n", features="in_memory")
    for module in (dm, het, short):
        path = tmp_path / f"{type(module).__name__}.ckpt"
        torch.save({"pytorch-lightning_version": L.__version__, "state_dict": {},
                    "datamodule_hyper_parameters": dict(module.hparams)}, path)  # as Lightning writes them
        again = type(module).load_from_checkpoint(path, weights_only=True)
        assert again.config == module.config and type(again.config.features) is type(module.config.features)
    assert again.config.features == InMemory()


def test_groups_given_as_dicts_with_paths_are_plain_in_the_hyperparameters(tmp_path):
    """A group may be a dict of its fields (as YAML gives it); a path in it (``profile``, ``inference_out``) is a
    string in the hyperparameters, as the group holds it, so that the checkpoint loads with ``weights_only``."""
    dm = OutOfCoreNodeData(tmp_path / "g", pipeline={"profile": tmp_path / "t"},
                           predict={"inference_out": tmp_path / "o"})  # fmt: skip
    hp = dict(dm.hparams)
    assert hp["pipeline"]["profile"] == str(tmp_path / "t") and hp["predict"]["inference_out"] == str(tmp_path / "o")
    path = tmp_path / "dm.ckpt"
    torch.save({"pytorch-lightning_version": L.__version__, "state_dict": {}, "datamodule_hyper_parameters": hp}, path)
    assert OutOfCoreNodeData.load_from_checkpoint(path, weights_only=True).config == dm.config


def test_a_trained_checkpoint_rebuilds_the_datamodule_with_its_backend(demo_dataset, tmp_path):
    """The same through a real fit: ``trainer.save_checkpoint`` and ``load_from_checkpoint``."""
    from lightning_ooc.models import GraphSAGE

    tiers = Tiered(gpu_cache="4MiB", host_cache="16KiB", staging="1MiB", presample_batches=2, host_cache_fill="setup")
    dm = OutOfCoreNodeData(str(demo_dataset.root), batch_size=64, num_neighbors=[3], features=tiers, progress=False,
                           pipeline={"num_samplers": 1, "num_extractors": 1, "order": "in_order"})  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(GraphSAGE(demo_dataset.num_features, demo_dataset.num_classes, hidden_channels=8, num_layers=1),
                datamodule=dm)  # fmt: skip
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    again = OutOfCoreNodeData.load_from_checkpoint(tmp_path / "last.ckpt", weights_only=True)
    assert again.config.features == tiers and again.config.pipeline == dm.config.pipeline
    assert again.config.features.host_cache == 16 << 10 and again.config.root == dm.config.root


def _printed_data(capsys, *args: str) -> dict:
    """``data.init_args`` of the config ``lightning-ooc fit --print_config ARGS`` prints."""
    from lightning_ooc.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["fit", "--print_config", *args])
    assert stop.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]


def test_lightning_cli_fills_the_backend_and_groups_from_nested_yaml(tmp_path, capsys):
    """``configs/sage_papers.yaml`` writes its backend with ``class_path`` and its pipeline as a group; the full
    config printed back has them, and a nested override from the command line lands in the backend or group."""
    data = _printed_data(capsys, "--config", str(REPO / "configs" / "sage_papers.yaml"),
                         "--data.features.host_cache", "2GiB", "--data.pipeline.num_samplers", "3")  # fmt: skip
    assert data["features"]["class_path"] == "lightning_ooc.Tiered"
    tiers = data["features"]["init_args"]
    assert tiers["gpu_cache"] == "4GiB" and tiers["host_cache"] == "2GiB"
    assert data["pipeline"]["num_samplers"] == 3 and data["pipeline"]["order"] == "out_of_order"
    assert not {"gpu_cache", "host_cache", "num_samplers", "budgets"} & set(data)  # one spelling each
    cfg = OutOfCoreNodeData(**{k: v for k, v in data.items() if v is not None}).config
    assert cfg.features == Tiered(gpu_cache="4GiB", host_cache="2GiB", staging="256MiB")
    assert cfg.pipeline.num_samplers == 3

    # a YAML of one's own: another backend named by class_path, with its own settings
    own = tmp_path / "mapped.yaml"
    mapped = {"class_path": "lightning_ooc.Mapped", "init_args": {"madvise": "normal"}}
    own.write_text(yaml.safe_dump({"data": {"root": str(tmp_path / "g"), "features": mapped,
                                            "predict": {"inference": "layerwise"}}}))
    data = _printed_data(capsys, "--config", str(REPO / "configs" / "demo.yaml"), "--config", str(own))
    assert data["features"]["class_path"] == "lightning_ooc.Mapped"
    cfg = OutOfCoreNodeData(**{k: v for k, v in data.items() if v is not None}).config
    assert cfg.features == Mapped(madvise="normal") and cfg.predict.inference == "layerwise"


def test_lightning_cli_switches_the_backend_from_the_command_line(capsys):
    """``--data.features Packed --data.features.pack_space 2``: another backend, its own setting, and the tiered
    settings of the config (``configs/demo.yaml``'s) carried over to it."""
    data = _printed_data(capsys, "--config", str(REPO / "configs" / "demo.yaml"),
                         "--data.features", "Packed", "--data.features.pack_space", "2")  # fmt: skip
    assert data["features"]["class_path"] == "lightning_ooc.Packed"
    assert data["features"]["init_args"]["pack_space"] == 2 and data["features"]["init_args"]["gpu_cache"] == "64MiB"
    features = OutOfCoreNodeData(**{k: v for k, v in data.items() if v is not None}).config.features
    assert type(features) is Packed and features.pack_space == 2.0
    assert (features.gpu_cache, features.host_cache, features.staging) == (64 * MiB, 4 * MiB, 8 * MiB)


def test_lightning_cli_reaches_return_e_id_and_hits_ties(capsys):
    """Settings from a config's YAML: the link datamodule's ``return_e_id`` (batches with ``e_id``) and the link
    model's ``hits_ties`` (the Hits@K protocol)."""
    from lightning_ooc.cli import main
    from lightning_ooc.models import LinkPredictor

    with pytest.raises(SystemExit) as stop:
        main(["fit", "--print_config", "--config", str(REPO / "configs" / "link_demo.yaml"),
              "--data.init_args.return_e_id=true", "--model.init_args.hits_ties=average"])  # fmt: skip
    assert stop.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    data, model = config["data"]["init_args"], config["model"]["init_args"]
    assert data["return_e_id"] is True and model["hits_ties"] == "average"
    assert OutOfCoreLinkData(**{k: v for k, v in data.items() if v is not None}).config.return_e_id is True
    assert LinkPredictor(**{k: v for k, v in model.items() if v is not None}, in_channels=4).hits_ties == "average"


def test_packed_node_data_warns_once_and_is_the_packed_backend(monkeypatch, caplog, tmp_path):
    import lightning_ooc.datamodule as datamodule

    monkeypatch.setattr(datamodule, "_warned", set())
    said: list[str] = []  # what the package's logger is asked to warn (whatever handlers other runs left on it)
    monkeypatch.setattr(datamodule.log, "warning", lambda msg, *a: said.append(msg % a if a else msg))
    first = lightning_ooc.PackedNodeData(tmp_path / "g", pack_memory="16MiB", pack_space=2, batch_size=64,
                                         pipeline={"num_samplers": 1})  # fmt: skip
    second = lightning_ooc.PackedNodeData(tmp_path / "g", pack_dir=tmp_path / "packs", host_cache="256KiB")
    assert said == ["PackedNodeData(root, pack_memory=...) is spelled OutOfCoreNodeData(root, "
                    "features=Packed(pack_memory=...)) now"]  # fmt: skip
    assert type(first) is OutOfCoreNodeData and first.config.features == Packed(pack_memory="16MiB", pack_space=2)
    assert first.config.batch_size == 64 and first.config.pipeline.num_samplers == 1
    # its earlier keywords of the tiers go to the backend, as they did
    assert second.config.features == Packed(pack_dir=tmp_path / "packs", host_cache="256KiB")
    with pytest.raises(TypeError):
        lightning_ooc.PackedNodeData(tmp_path / "g", num_samplers=2)  # the pipeline is a group there too


def test_the_heterogeneous_datamodule_name_warns_once_and_is_the_node_datamodule(monkeypatch, tmp_path):
    import lightning_ooc.datamodule as datamodule

    monkeypatch.setattr(datamodule, "_warned", set())
    said: list[str] = []
    monkeypatch.setattr(datamodule.log, "warning", lambda msg, *a: said.append(msg % a if a else msg))
    first = lightning_ooc.OutOfCoreHeteroNodeData(tmp_path / "h", batch_size=64, input_type="paper",
                                                  num_neighbors={("paper", "cites", "paper"): [3, 2]})
    second = lightning_ooc.OutOfCoreHeteroNodeData(tmp_path / "h")
    assert said == ["OutOfCoreHeteroNodeData(root, ...) is spelled OutOfCoreNodeData(root, ...) now: the dataset "
                    "says whether it is heterogeneous"]  # fmt: skip
    assert type(first) is type(second) is OutOfCoreNodeData
    # its earlier positional order and defaults
    assert (second.config.batch_size, second.config.num_neighbors) == (1024, [15, 10, 5])
    positional = lightning_ooc.OutOfCoreHeteroNodeData(tmp_path / "h", 256, [4, 2], "author")
    assert (positional.config.batch_size, positional.config.num_neighbors, positional.config.input_type,
            positional.config.replace) == (256, [4, 2], "author", False)  # fmt: skip
    assert first.config == NodeDataConfig(tmp_path / "h", batch_size=64, input_type="paper",
                                          num_neighbors={"paper__cites__paper": [3, 2]})


class _MyTiered(Tiered):
    """A backend of a user's own: the tiers with another default."""

    def __init__(self, staging: int | str = "1MiB", **tiered):
        super().__init__(staging=staging, **tiered)


def test_a_modified_copy_reports_what_it_holds_and_a_subclass_round_trips():
    t = Tiered(gpu_cache="4MiB")
    lowered = t.replaced(host_cache=0)
    assert lowered.host_cache == 0 and t.host_cache == 1 << 30
    assert lowered.settings() == {"gpu_cache": "4MiB", "host_cache": 0} and "host_cache=0" in repr(lowered)
    mine = _MyTiered(gpu_cache="2MiB")
    plain = mine.plain()
    assert plain["class_path"] == f"{__name__}._MyTiered"
    back = as_backend(plain)
    assert type(back) is _MyTiered and back == mine and back.staging == 1 << 20
    with pytest.raises(InputError, match="unknown backend 'os.path'"):
        as_backend({"class_path": "os.path", "init_args": {}})


def test_the_loggers_copy_of_the_hyperparameters_is_plain(tmp_path):
    dm = OutOfCoreNodeData(tmp_path / "g", features=Packed(pack_space=2), pipeline=Pipeline(num_samplers=1))
    for hp in (dm.hparams, dm.hparams_initial):  # hparams.yaml is written from the second
        text = yaml.safe_dump(dict(hp))  # a Python object in it would not dump safely
        assert "class_path: lightning_ooc.Packed" in text and "!!python" not in text


def test_a_mapped_datamodule_gives_its_sampler_and_runs_in_sampling_order(tmp_path):
    from lightning_ooc.data.synth import synthesize

    root = synthesize(tmp_path / "g", num_nodes=400, avg_degree=4, num_features=4, num_classes=2, progress=False)
    dm = OutOfCoreNodeData(root, batch_size=50, num_neighbors=[3], features=Mapped(), progress=False)
    assert dm.order == "in_order" and dm.sampler is None
    dm.setup()
    assert dm.sampler is not None and dm.sampler is dm.source.sampler
    dm.teardown()


def test_a_config_without_a_backend_takes_the_tiered_settings_on_the_command_line(capsys):
    """``configs/predict_layerwise.yaml`` names no backend: ``--data.features.host_cache`` still reaches Tiered's."""
    from lightning_ooc.cli import main

    with pytest.raises(SystemExit):
        main(["predict", "--print_config", "--config", str(REPO / "configs" / "predict_layerwise.yaml"),
              "--data.root", "data/g", "--data.features.host_cache", "16GiB"])  # fmt: skip
    features = yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]["features"]
    assert features["class_path"] == "lightning_ooc.Tiered" and features["init_args"]["host_cache"] == "16GiB"
