"""The grouped settings: each default once, groups and flat names mapped onto each other, nested YAML."""
from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
import torch
import yaml

from lightning_ooc import OutOfCoreHeteroNodeData, OutOfCoreLinkData, OutOfCoreNodeData
from lightning_ooc.errors import InputError
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.settings import FLAT, GROUPS, Budgets, PipelineShape, default, merge

from jobs import REPO


def test_every_flat_name_belongs_to_one_group_and_takes_its_default_from_there():
    signature = inspect.signature(OutOfCoreNodeData.__init__).parameters
    names = [f.name for cls in GROUPS.values() for f in fields(cls)]
    assert len(names) == len(set(names)) == len(FLAT)
    for name, group in FLAT.items():
        assert name in signature, name
        # the very object the group holds: the default is written once, in the group
        assert signature[name].default is default(name), name
        assert getattr(NodeDataConfig(root="r"), name) == getattr(getattr(NodeDataConfig(root="r"), group), name)
    for group in GROUPS:
        assert signature[group].default is None


def test_flat_names_and_groups_give_the_same_settings():
    flat = OutOfCoreNodeData("r", gpu_cache="4GiB", host_cache="2GiB", num_samplers=2, order="in_order",
                             memory_limit=None, queue_depth=64, remote_cache_policy="static", cache_interval=8)
    grouped = OutOfCoreNodeData("r", budgets=Budgets(gpu_cache="4GiB", host_cache="2GiB", memory_limit=None),
                                pipeline={"num_samplers": 2, "order": "in_order"}, io={"queue_depth": 64},
                                remote={"remote_cache_policy": "static"}, caching={"cache_interval": 8})
    assert flat.config == grouped.config
    assert grouped.config.gpu_cache == "4GiB" and grouped.config.memory_limit is None
    assert grouped.order == "in_order"
    # a flat name at its default defers to the group; a flat name set beside an unset group field wins
    mixed = OutOfCoreNodeData("r", gpu_cache="1GiB", staging="8MiB", budgets={"gpu_cache": "4GiB"})
    assert (mixed.config.gpu_cache, mixed.config.staging) == ("4GiB", "8MiB")


def test_a_setting_given_twice_or_unknown_or_invalid_in_a_group_is_an_error():
    with pytest.raises(InputError, match=r"gpu_cache is given twice: gpu_cache='2GiB' and budgets.gpu_cache='4GiB'"):
        OutOfCoreNodeData("r", gpu_cache="2GiB", budgets={"gpu_cache": "4GiB"})
    with pytest.raises(InputError, match=r"pipeline: unknown setting\(s\) samplers; it takes order, num_samplers"):
        OutOfCoreNodeData("r", pipeline={"samplers": 2})
    with pytest.raises(InputError, match="num_samplers must be an integer >= 1, got 0"):
        OutOfCoreNodeData("r", pipeline={"num_samplers": 0})
    with pytest.raises(InputError, match="num_samplers must be an integer >= 1, got 0"):
        OutOfCoreNodeData("r", pipeline=PipelineShape(num_samplers=4), num_samplers=0)
    with pytest.raises(InputError, match="budgets must be a Budgets or a dict of its fields, got list"):
        merge("budgets", ["4GiB"], {})
    with pytest.raises(InputError, match="features='learnable' needs embeddings"):
        OutOfCoreLinkData("r", learnable={"features": "learnable"})


def test_hyperparameters_are_plain_and_rebuild_the_same_datamodule(tmp_path):
    """Checkpoints keep the datamodule's hyperparameters and load them with ``weights_only``: groups as dicts,
    paths as strings, negative sampling as a dict, a heterogeneous fanout keyed by relation strings."""
    dm = OutOfCoreLinkData(tmp_path / "g", budgets=Budgets(gpu_cache="4GiB"), num_samplers=2,
                           neg_sampling="triplet", profile=tmp_path / "trace")  # fmt: skip
    hp = dict(dm.hparams)
    assert hp["budgets"] == {"gpu_cache": "4GiB", "host_cache": "1GiB", "staging": "256MiB", "memory_limit": "auto"}
    assert hp["root"] == str(tmp_path / "g") and hp["profile"] == str(tmp_path / "trace")
    assert hp["neg_sampling"]["mode"] == "triplet"
    torch.save(hp, tmp_path / "hp.pt")
    again = OutOfCoreLinkData(**torch.load(tmp_path / "hp.pt", weights_only=True))
    assert again.config == dm.config
    het = OutOfCoreHeteroNodeData(tmp_path / "h", num_neighbors={("a", "r", "b"): [2, 1]}, caching={"cache_decay": 0.5})
    assert dict(het.hparams)["num_neighbors"] == {"a__r__b": [2, 1]}
    assert OutOfCoreHeteroNodeData(**dict(het.hparams)).config == het.config


def test_lightning_cli_fills_the_groups_from_nested_yaml(tmp_path, capsys):
    """``configs/sage_papers.yaml`` writes its budgets and pipeline as groups; the full config printed back
    has them, and a nested override from the command line lands in its group."""
    from lightning_ooc.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["fit", "--print_config", "--config", str(REPO / "configs" / "sage_papers.yaml"),
              "--data.budgets.host_cache", "2GiB", "--data.init_args.pipeline.num_samplers", "3"])  # fmt: skip
    assert stop.value.code in (0, None)
    data = yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]
    assert data["budgets"]["gpu_cache"] == "4GiB" and data["budgets"]["host_cache"] == "2GiB"
    assert data["pipeline"]["num_samplers"] == 3 and data["pipeline"]["order"] == "out_of_order"
    assert data["gpu_cache"] == "1GiB"  # the flat name stays at its default: the group's value is the one used
    init = {k: v for k, v in data.items() if v is not None}
    assert OutOfCoreNodeData(**init).config.host_cache == "2GiB"


def test_lightning_cli_reaches_return_e_id_and_hits_ties(capsys):
    """Issue 34's new settings, from a config's YAML: the link datamodule's ``return_e_id`` (batches with
    ``e_id``) and the link model's ``hits_ties`` (the Hits@K protocol)."""
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


def test_setting_a_flat_name_makes_a_new_group_and_checks_it():
    import dataclasses

    a = NodeDataConfig(root="r", budgets=Budgets(gpu_cache="4GiB"))
    b = dataclasses.replace(a, root="s")
    b.gpu_cache = "8GiB"
    assert (a.gpu_cache, b.gpu_cache, b.budgets.gpu_cache) == ("4GiB", "8GiB", "8GiB")
    with pytest.raises(InputError, match="staging: cannot parse byte budget"):
        b.staging = "much"
