"""Every config under configs/ runs as its comments say it is used, over a small stand-in of the dataset it names
(``tests/readme_snippets.py``), from a working directory where that dataset lies at the path the config gives.

A training config runs ``lightning-ooc fit --config X`` (``predict`` for configs/predict_layerwise.yaml, on top of
configs/demo.yaml and a checkpoint) in this process with ``SHRINK`` appended (one short epoch on the CPU): the
model and datamodule classes, their nested settings (``features:``, ``pipeline:``, ``buffer:``...) and the links
between them are built and train two batches. ``--print_config`` checks the classes it names too. A generator
config under configs/synth/ runs ``lightning-ooc synth --config X``, the large one with fewer nodes.
"""
from __future__ import annotations

import shlex

import numpy as np
import pytest
import yaml

from readme_snippets import (
    CONFIGS,
    SHRINK,
    link_repo_dirs,
    point_lightning_logs_at_stderr,
    recording_trainers,
)

TRAINING = sorted(CONFIGS.glob("*.yaml"))
SYNTH = sorted((CONFIGS / "synth").glob("*.yaml"))

#: the datasets the configs name -> the stand-in made there (a config naming another one fails until it is added)
DATA = {
    "data/demo": {"data/demo": "node"},
    "data/papers100M": {"data/papers100M": "node"},
    "data/igbh-demo": {"data/igbh-demo": "hetero"},
    "data/igbh": {"data/igbh": "hetero"},
    "data/links": {"data/links": "links"},
    "data/citation2": {"data/citation2": "links"},
    "data/links-emb": {"data/links-emb": "table"},  # over the links stand-in
    "data/temporal": {"data/temporal": "temporal"},
}
#: configs that are run on top of another one (their comments say how): the command, before ``--config X``
ON_TOP = {"predict_layerwise.yaml": ["predict", "--config", "configs/demo.yaml"]}
#: configs whose full setting takes long on 2 cores: the options of the default run (the slow test runs it as
#: written); rgat_igbh.yaml's are its own comment's "small setting for a CPU"
SMALL = {"rgat_igbh.yaml": ["--model.init_args.hidden_channels", "64", "--data.init_args.batch_size", "256",
                            "--data.init_args.num_neighbors", "[5,5,5]"]}  # fmt: skip
#: generator configs whose graph takes minutes: the options appended (the file's other values are kept)
SYNTH_SMALL = {"bench-2m.yaml": ["--nodes", "2000"]}


def _data_root(config: dict) -> str:
    data = config.get("data") or {}
    args = data.get("init_args") or data
    root = args.get("root") or args.get("table")
    assert isinstance(root, str), f"no data root in {data}"
    return root


@pytest.mark.parametrize(
    "path, small",
    [pytest.param(p, True, id=p.name) for p in TRAINING]
    + [pytest.param(p, False, marks=pytest.mark.slow, id=f"{p.name}-as-written") for p in TRAINING if p.name in SMALL],
)
def test_config_trains(path, small, stand_ins, tmp_path, capsys, monkeypatch):  # noqa: F811
    from lightning_ooc.cli import main

    config = yaml.safe_load(path.read_text())
    monkeypatch.chdir(tmp_path)
    point_lightning_logs_at_stderr(monkeypatch)
    link_repo_dirs(tmp_path)
    head = ON_TOP.get(path.name, ["fit"])
    base = yaml.safe_load((tmp_path / head[2]).read_text()) if len(head) > 1 else config
    root = _data_root(base)
    assert root in DATA, f"{path.name} names {root}: add a stand-in for it to DATA in tests/test_configs.py"
    stand_ins.place(tmp_path, DATA[root])
    argv = [*head, "--config", f"configs/{path.name}"]
    if head[0] == "predict":
        (tmp_path / "demo.ckpt").write_bytes(stand_ins.get("ckpt").read_bytes())
        argv += ["--ckpt_path", "demo.ckpt"]

    # the classes it names, as LightningCLI parses them
    with pytest.raises(SystemExit) as done:
        main([*argv, "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert done.value.code in (0, None)
    for section in ("model", "data"):
        want = (config.get(section) or {}).get("class_path")
        if want is not None:
            assert printed[section]["class_path"] == want, (section, printed[section])

    with recording_trainers() as calls:
        rc = main([*argv, *SHRINK, *(SMALL.get(path.name, []) if small else [])])
    err = capsys.readouterr().err
    assert rc == 0, f"{shlex.join(argv)}: status {rc}\n{err[-3000:]}"
    fns = [fn for fn, _ in calls]
    if head[0] == "predict":
        assert fns == ["predict"] and calls[0][1].state.finished
        out = config["trainer"]["callbacks"][0]["init_args"]["path"]
        assert np.load(tmp_path / out).shape == (600,)
        assert (tmp_path / config["data"]["predict"]["inference_out"] / "meta.json").is_file()
        return
    assert fns[0] == "fit" and calls[0][1].state.finished and calls[0][1].global_step > 0, fns
    if config.get("test_after_fit"):
        assert fns[1:] == ["test"], fns


@pytest.mark.parametrize("path", SYNTH, ids=lambda p: f"synth-{p.name}")
def test_synth_config_generates(path, tmp_path, capsys):
    import lightning_ooc
    from lightning_ooc.cli import main

    settings = yaml.safe_load(path.read_text())
    extra = SYNTH_SMALL.get(path.name, [])
    out = tmp_path / "data" / "g"
    # as `make demo` runs configs/synth/demo.yaml
    assert main(["synth", "--config", str(path), "--out", str(out), "--overwrite", "--no-progress", *extra]) == 0
    ds = lightning_ooc.open_dataset(out)
    nodes = int(extra[extra.index("--nodes") + 1]) if "--nodes" in extra else settings["nodes"]
    assert (ds.num_nodes, ds.num_features, ds.num_classes) == (nodes, settings["dim"], settings["classes"])
    assert ds.meta["source"]["seed"] == settings["seed"]
    assert 0 < len(ds.split("train")) <= 2 * settings["train_frac"] * nodes + 2
