"""The lightning-ooc command line."""
import json
import subprocess
import sys

from typing import Any

import lightning as L
import numpy as np
import pytest

import lightning_ooc
from lightning_ooc.cli import main


def test_version_via_module():
    out = subprocess.run([sys.executable, "-m", "lightning_ooc", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and lightning_ooc.__version__ in out.stdout


def test_synth_config_info_verify(tmp_path, capsys):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("nodes: 1500\navg_degree: 5\ndim: 12\nclasses: 3\nseed: 4\n")
    assert main(["synth", "--config", str(cfg), "--out", str(tmp_path / "g"), "--dim", "6", "--no-progress"]) == 0
    ds = lightning_ooc.open_dataset(tmp_path / "g")
    assert (ds.num_nodes, ds.num_features, ds.num_classes) == (1500, 6, 3)  # flag beats file
    assert ds.meta["source"]["seed"] == 4
    capsys.readouterr()
    assert main(["info", str(tmp_path / "g")]) == 0
    text = capsys.readouterr().out
    for needle in ("nodes        1,500", "6 x float32", "in-degree", "class balance", "splits       train", "features"):
        assert needle in text, text
    assert main(["info", "--json", str(tmp_path / "g")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_edges"] == ds.num_edges and sum(info["class_counts"]) == 1500
    assert info["bytes_on_disk"] == sum(p.stat().st_size for p in (tmp_path / "g").iterdir()) - (
        tmp_path / "g" / "meta.json"
    ).stat().st_size
    assert main(["verify", "--no-progress", str(tmp_path / "g")]) == 0
    assert "all checks passed" in capsys.readouterr().out
    with open(tmp_path / "g" / "features.bin", "r+b") as f:
        f.write(b"\xff\xff")
    assert main(["verify", "--no-progress", str(tmp_path / "g")]) == 1
    assert "[FAIL] features.bin" in capsys.readouterr().out


def test_prepare_cli_three_inputs(tmp_path):
    rng = np.random.default_rng(0)
    n = 40
    ei = rng.integers(0, n, (2, 200))
    np.save(tmp_path / "ei.npy", ei)
    np.save(tmp_path / "x.npy", rng.random((n, 3)).astype(np.float32))
    np.save(tmp_path / "y.npy", rng.integers(0, 3, n))
    np.save(tmp_path / "train.npy", np.arange(10))
    (tmp_path / "e.tsv").write_text("\n".join(f"{s}\t{d}" for s, d in ei.T))
    assert main(["prepare", "--out", str(tmp_path / "a"), "--edge-index", str(tmp_path / "ei.npy"),
                 "--x", str(tmp_path / "x.npy"), "--y", str(tmp_path / "y.npy"), "--train", str(tmp_path / "train.npy"),
                 "--dtype", "bfloat16", "--add-reverse", "--no-progress"]) == 0  # fmt: skip
    a = lightning_ooc.open_dataset(tmp_path / "a")
    assert a.num_edges == 400 and a.feature_dtype_name == "bfloat16" and a.split("train").tolist() == list(range(10))
    assert main(["prepare", "--out", str(tmp_path / "b"), "--edges", str(tmp_path / "e.tsv"),
                 "--x", str(tmp_path / "x.npy"), "--add-reverse", "--no-progress"]) == 0  # fmt: skip
    b = lightning_ooc.open_dataset(tmp_path / "b")
    np.testing.assert_array_equal(np.asarray(a.indices), np.asarray(b.indices))
    assert b.num_classes == 0 and int(np.asarray(b.labels).max()) == -1
    import torch
    from torch_geometric.data import Data

    torch.save(Data(x=torch.rand(n, 3), edge_index=torch.from_numpy(ei), y=torch.from_numpy(np.load(tmp_path / "y.npy"))),
               tmp_path / "g.pt")  # fmt: skip
    assert main(["prepare", "--out", str(tmp_path / "c"), "--pyg", str(tmp_path / "g.pt"), "--no-progress"]) == 0
    assert lightning_ooc.open_dataset(tmp_path / "c").num_classes == 3


@pytest.fixture(scope="module")
def split_inputs(tmp_path_factory):
    """Arrays, a labelled dataset and an unlabelled one, for prepare's --split."""
    from lightning_ooc.data.prepare import prepare_from_arrays
    from lightning_ooc.testing import make_synthetic

    tmp = tmp_path_factory.mktemp("split")
    rng = np.random.default_rng(0)
    np.save(tmp / "ei.npy", rng.integers(0, 60, (2, 300)))
    np.save(tmp / "x.npy", rng.random((60, 3), dtype=np.float32))
    np.save(tmp / "y.npy", rng.integers(0, 3, 60))
    np.save(tmp / "train.npy", np.arange(10))
    make_synthetic(tmp / "labelled", num_nodes=300, num_features=4)
    prepare_from_arrays(tmp / "unlabelled", np.load(tmp / "ei.npy"), np.load(tmp / "x.npy"), progress=False)
    return tmp


ARRAYS = ["--edge-index", "{t}/ei.npy", "--x", "{t}/x.npy"]
BAD_FRACTIONS = "--split (split=) takes three finite fractions >= 0 adding up to at most 1"


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "{t}/labelled", "--split", "0.9,0.9,0.9"], BAD_FRACTIONS + " (train,val,test shares of the "
                                                              "labelled nodes), got [0.9, 0.9, 0.9]"),
    (["--dataset", "{t}/labelled", "--split", "0.6,0.2,0.2"], "--split (split=) draws random node splits, but the "
                                                              "node splits of {t}/labelled are carried over"),
    (["--dataset", "{t}/unlabelled", "--split", "0.6,0.2,0.2"], "no labels were given (--y, y=)"),
    ([*ARRAYS, "--y", "{t}/y.npy", "--split", "nan,0,0"], BAD_FRACTIONS),
    ([*ARRAYS, "--y", "{t}/y.npy", "--split", "inf,0,0"], BAD_FRACTIONS),
    ([*ARRAYS, "--y", "{t}/y.npy", "--split=-0.1,0.5,0.5"], BAD_FRACTIONS),
    ([*ARRAYS, "--y", "{t}/y.npy", "--split", "0.5,0.5"], BAD_FRACTIONS),
    ([*ARRAYS, "--y", "{t}/y.npy", "--train", "{t}/train.npy", "--split", "0.6,0.2,0.2"],
     "--split (split=) draws random node splits, but node splits are given (train: from --train"),
    ([*ARRAYS, "--split", "0.6,0.2,0.2"], "no labels were given (--y, y=), so every node split would be empty"),
])  # fmt: skip
def test_prepare_split_that_is_invalid_or_would_be_ignored_is_one_line(split_inputs, tmp_path, capsys, argv, message):
    """``prepare --dataset DIR --split 0.9,0.9,0.9`` used to write a dataset with DIR's splits and exit 0."""
    t = str(split_inputs)
    argv = ["prepare", "--out", str(tmp_path / "o"), "--no-progress", *(a.format(t=t) for a in argv)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-ooc: error: ") and message.format(t=t) in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_prepare_split_where_it_is_used(split_inputs, tmp_path):
    t = str(split_inputs)
    assert main(["prepare", "--out", str(tmp_path / "o"), "--no-progress", *(a.format(t=t) for a in ARRAYS),
                 "--y", f"{t}/y.npy", "--split", "0.5,0.25,0.25"]) == 0  # fmt: skip
    ds = lightning_ooc.open_dataset(tmp_path / "o")
    assert [len(ds.split(s)) for s in ("train", "val", "test")] == [30, 15, 15]
    assert main(["prepare", "--out", str(tmp_path / "d"), "--no-progress", "--dataset", f"{t}/labelled"]) == 0
    src = lightning_ooc.open_dataset(f"{t}/labelled")
    assert lightning_ooc.open_dataset(tmp_path / "d").split("val").tolist() == src.split("val").tolist()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["info", "{tmp}/missing"], "no such dataset directory"),
        (["prepare", "--out", "{tmp}/o", "--pyg", "{tmp}/nothing.pt"], "no such file"),
        (["prepare", "--out", "{tmp}/o", "--edge-index", "{tmp}/junk.npy", "--x", "{tmp}/junk.npy"], "junk.npy: cannot read"),
        (["prepare", "--out", "{tmp}/o", "--pyg", "{tmp}/junk.npy"], "cannot load it with torch.load"),
    ],
)
def test_errors_are_one_line_with_the_file(tmp_path, capsys, argv, message):
    (tmp_path / "junk.npy").write_bytes(b"not an array at all")
    rc = main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_prepare_requires_features(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["prepare", "--out", str(tmp_path / "o"), "--edges", str(tmp_path / "e.csv")])
    assert "--x (the feature matrix) is required" in capsys.readouterr().err


def test_synth_requires_sizes(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["synth", "--out", str(tmp_path / "g")])
    assert "missing --nodes, --avg-degree, --dim, --classes" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arg, message",
    [
        ("--data.batch_size=0", "batch_size must be an integer >= 1, got 0"),
        ("--data.batch_size=-5", "batch_size must be an integer >= 1, got -5"),
        ("--data.eval_batch_size=-1", "eval_batch_size must be an integer >= 1, got -1"),
        ("--data.pipeline.order=bogus", "order must be one of out_of_order, in_order, got 'bogus'"),
        ("--data.features.gpu_cache=-1GiB", "gpu_cache: byte budget must be >= 0, got '-1GiB'"),
        ("--data.features.host_cache=abc", "host_cache: cannot parse byte budget 'abc'"),
        ("--data.features.host_cache_policy=bogus",
         "host_cache_policy must be one of presample, degree, scored, got 'bogus'"),
        ("--data.num_neighbors=[]", "num_neighbors must be a non-empty list of fanouts per hop"),
        ("--data.pipeline.num_samplers=0", "num_samplers must be an integer >= 1, got 0"),
        ("--data.memory_limit=lots", "memory_limit must be 'auto'"),
        ("--trainer.devices=0", "Trainer(devices='0')"),
        ("--model.hidden_channels=0", "hidden_channels must be an integer >= 1, got 0"),
        ("--model.lr=-1", "lr must be a finite number > 0, got -1.0"),
        ("--model.num_layers=0", "num_layers must be an integer >= 1, got 0"),  # trained silently before
        ("--model.dropout=1.5", "dropout must be a probability in [0, 1), got 1.5"),
        ("--ckpt_path={tmp}/missing.ckpt", "missing.ckpt: no such file"),
        ("--ckpt_path={tmp}/garbage.ckpt", "garbage.ckpt: not a checkpoint, or not a whole one"),
        ("--ckpt_path={tmp}", "not a file"),
    ],
)
def test_fit_with_a_bad_setting_is_one_line_and_status_2(demo_dataset, capsys, monkeypatch, tmp_path, arg, message):
    (tmp_path / "garbage.ckpt").write_text("garbage\n")
    rc, last = _fit(monkeypatch, capsys, "demo.yaml", demo_dataset.root, tmp_path, [arg.format(tmp=tmp_path)])
    assert rc == 2 and last.startswith("lightning-ooc: error: ") and message in last, last


def _fit(monkeypatch, capsys, config, root, tmp_path, args):
    """``lightning-ooc fit --config configs/CONFIG --data.root ROOT ARGS`` in this process: its status and the last
    line of its stderr (which holds no traceback)."""
    import logging
    from pathlib import Path

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):  # Lightning's handlers keep the stderr of
        for h in logging.getLogger(name).handlers:  # the test that imported it; point them at this one's
            if isinstance(h, logging.StreamHandler):
                monkeypatch.setattr(h, "stream", sys.stderr)

    path = Path(lightning_ooc.__file__).resolve().parents[1] / "configs" / config
    rc = main(["fit", "--config", str(path), "--data.root", str(root), "--trainer.logger=false",
               "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}",
               "--trainer.accelerator=cpu", "--trainer.max_epochs=1", "--trainer.enable_progress_bar=false",
               "--test_after_fit=false", *args])  # fmt: skip
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    return rc, err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def other_kinds(tmp_path_factory):
    """A link-prediction dataset with node labels and one without, and a heterogeneous dataset."""
    from lightning_ooc.data.prepare import prepare_from_arrays
    from lightning_ooc.data.synth_hetero import synthesize_hetero

    t = tmp_path_factory.mktemp("kinds")
    rng = np.random.default_rng(0)
    ei, x = rng.integers(0, 400, (2, 2400)), rng.random((400, 8), dtype=np.float32)
    return {
        "labelled_links": prepare_from_arrays(t / "ll", ei, x, rng.integers(0, 3, 400), split_edges=(0.8, 0.1, 0.1),
                                              progress=False),
        "links": prepare_from_arrays(t / "l", ei, x, split_edges=(0.8, 0.1, 0.1), progress=False),
        "hetero": synthesize_hetero(t / "h", "igbh", num_nodes=600, num_features=8, num_classes=3, train_frac=0.3,
                                    progress=False),
    }  # fmt: skip


@pytest.mark.parametrize(
    "config, kind, args, message",
    [
        ("link_demo.yaml", "labelled_links", ["--model", "lightning_ooc.models.GraphSAGE"],
         "GraphSAGE classifies nodes, but OutOfCoreLinkData gives link-prediction batches"),
        ("link_demo.yaml", "links", ["--model", "lightning_ooc.models.GraphSAGE"],
         "num_classes must be an integer >= 2 (node classification tells classes apart), got 0"),
        ("demo.yaml", "links", [], "a link-prediction dataset) trains with lightning_ooc.models.LinkPredictor"),
        ("demo.yaml", "labelled_links", ["--model", "lightning_ooc.models.LinkPredictor"],
         "LinkPredictor scores links, but OutOfCoreNodeData gives node-classification batches"),
        ("link_demo.yaml", "links", ["--model.init_args.decoder=bogus"], "unknown decoder 'bogus'; use 'dot' or 'mlp'"),
        ("demo.yaml", "hetero", [], "the dataset is heterogeneous; train it with a relational model"),
        ("link_demo.yaml", "hetero", [], "a heterogeneous dataset; link prediction runs on homogeneous datasets"),
        ("rgat_demo.yaml", "hetero", ["--model.init_args.heads=0"], "heads must be an integer >= 1, got 0"),
    ],
)
def test_fit_of_a_model_and_data_that_do_not_go_together_is_one_line(other_kinds, capsys, monkeypatch, tmp_path,
                                                                      config, kind, args, message):
    rc, last = _fit(monkeypatch, capsys, config, other_kinds[kind], tmp_path, args)
    assert rc == 2 and last.startswith("lightning-ooc: error: ") and message in last, last


def test_fit_on_a_full_disk_is_one_line_naming_the_file(demo_dataset, capsys, monkeypatch, tmp_path):
    """A checkpoint (or config.yaml, a log, learnable features' journal) that fills the disk: the OSError's own
    words in one line, without a traceback."""
    import errno
    import os

    import lightning as L

    def full(self, filepath, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/tmp/tmpabc", None, str(filepath))  # as a move

    monkeypatch.setattr(L.Trainer, "save_checkpoint", full)
    rc, last = _fit(monkeypatch, capsys, "demo.yaml", demo_dataset.root, tmp_path,
                    ["--trainer.enable_checkpointing=true"])  # fmt: skip
    assert rc == 2 and last.startswith(f"lightning-ooc: error: no space left on device writing {tmp_path}/"), last
    assert ".ckpt ([Errno 28] No space left on device: '/tmp/tmpabc' -> " in last and "default_root_dir" in last


def test_a_write_back_that_fails_after_the_error_is_one_logged_line(demo_dataset, tmp_path, caplog):
    """Learnable features write their trained rows back when an error stops the run; on a full disk that fails
    too, and was logged with a whole traceback before the run's own error. Now one line (the traceback at debug)."""
    import errno
    import logging
    import os

    from lightning_ooc import Learnable, OutOfCoreNodeData
    from lightning_ooc.loader.context import SourceDefaults
    from lightning_ooc.loader.learnable_passes import LearnableMixin

    class Source(SourceDefaults):  # the learnable pass source, whose write-back finds the disk full
        close_after_error = LearnableMixin.close_after_error  # what the real one says it writes

        def __init__(self, cfg):
            self.cfg = cfg

        def close(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "emb" / "state.json"))

    dm = OutOfCoreNodeData(demo_dataset.root, features=Learnable(str(tmp_path / "emb")), progress=False)
    dm.source = Source(dm.config)
    with caplog.at_level(logging.DEBUG, logger="lightning_ooc"):
        dm.on_exception(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert errors[0].getMessage() == (f"writing the trained feature rows back to {tmp_path}/emb after the error failed "
                                      f"as well: OSError: [Errno 28] No space left on device: "
                                      f"'{tmp_path}/emb/state.json'")  # fmt: skip
    assert [r.exc_info[0] for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info] == [OSError]


@pytest.mark.parametrize("argv", [["--avg-degree", "nan"], ["--avg-degree", "inf"], ["--avg-degree", "3", "--homophily",
                                  "nan"], ["--hetero", "igbh", "--degree-scale", "inf"]])  # fmt: skip
def test_synth_with_a_number_that_is_not_finite_is_one_line(tmp_path, capsys, argv):
    if "--hetero" not in argv:
        argv = [*argv, "--dim", "4", "--classes", "2"]
    rc = main(["synth", "--out", str(tmp_path / "g"), "--nodes", "100", "--no-progress", *argv])
    err = capsys.readouterr().err
    name = argv[argv.index(next(a for a in argv if a in ("nan", "inf"))) - 1][2:].replace("-", "_")
    assert rc == 2 and f"lightning-ooc: error: {name} must be a finite number" in err and "Traceback" not in err
    assert not (tmp_path / "g").exists()


class _Crafted:
    """Unpickling this runs ``os.mkdir(path)``: a stand-in for a file that runs code when loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os

        return (os.mkdir, (self.path,))


def test_prepare_pyg_does_not_run_code_from_the_file(tmp_path, capsys):
    import torch

    marker = tmp_path / "ran"
    torch.save({"edge_index": torch.zeros(2, 1, dtype=torch.long), "x": _Crafted(str(marker))}, tmp_path / "g.pt")
    rc = main(["prepare", "--out", str(tmp_path / "o"), "--pyg", str(tmp_path / "g.pt"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and not marker.exists() and not (tmp_path / "o").exists()
    assert "not loaded: it names posix.mkdir" in err and "--allow-pickle" in err and "Traceback" not in err
    # the opt-in really unpickles (so the file above really would have run code)
    rc = main(["prepare", "--out", str(tmp_path / "o"), "--pyg", str(tmp_path / "g.pt"), "--allow-pickle",
               "--no-progress"])  # fmt: skip
    assert marker.is_dir() and rc == 2 and "holds a dict without edge_index and x" in capsys.readouterr().err


def test_prepare_pyg_loads_data_saved_by_pyg_without_pickle(tmp_path):
    import torch
    from torch_geometric.data import Data

    import lightning_ooc

    data = Data(x=torch.randn(50, 4), edge_index=torch.randint(0, 50, (2, 200)), y=torch.randint(0, 3, (50,)),
                train_mask=torch.arange(50) < 30)  # fmt: skip
    torch.save(data, tmp_path / "d.pt")
    assert main(["prepare", "--out", str(tmp_path / "o"), "--pyg", str(tmp_path / "d.pt"), "--no-progress"]) == 0
    ds = lightning_ooc.open_dataset(tmp_path / "o")
    assert ds.num_nodes == 50 and ds.split("train").numel() == 30


def test_synth_with_one_class_is_refused(tmp_path, capsys):
    rc = main(["synth", "--out", str(tmp_path / "g"), "--nodes", "100", "--avg-degree", "3", "--dim", "4",
               "--classes", "1", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "need classes >= 2" in err and "Traceback" not in err and not (tmp_path / "g").exists()


def test_edge_list_id_above_int64_is_one_line_with_the_line(tmp_path, capsys):
    (tmp_path / "e.csv").write_text("0,1\n1,99999999999999999999999\n")
    np.save(tmp_path / "x.npy", np.ones((3, 2), np.float32))
    rc = main(["prepare", "--out", str(tmp_path / "o"), "--edges", str(tmp_path / "e.csv"), "--x",
               str(tmp_path / "x.npy"), "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "e.csv:2: node id 99999999999999999999999 does not fit in 64 bits" in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_link_prediction_from_yaml(tmp_path, capsys):
    """`lightning-ooc fit --config configs/link_demo.yaml`: OutOfCoreLinkData named by class_path, LinkPredictor,
    in_channels from the dataset; ranking metrics at the end of validation and test."""
    import numpy as np
    import yaml
    from pathlib import Path

    from lightning_ooc.data.prepare import prepare_from_arrays

    rng = np.random.default_rng(0)
    root = prepare_from_arrays(tmp_path / "g", rng.integers(0, 500, (2, 3000)), rng.random((500, 12), dtype=np.float32),
                               split_edges=(0.8, 0.1, 0.1), progress=False)  # fmt: skip
    config = Path(lightning_ooc.__file__).resolve().parents[1] / "configs" / "link_demo.yaml"
    assert yaml.safe_load(config.read_text())["data"]["class_path"] == "lightning_ooc.OutOfCoreLinkData"
    out = tmp_path / "run"
    rc = main(["fit", "--config", str(config), "--data.root", str(root), "--data.batch_size", "256",
               "--data.neg_sampling", "{mode: triplet, amount: 5}", "--trainer.max_epochs", "1",
               "--trainer.accelerator", "cpu", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
               "--trainer.enable_progress_bar", "false", f"--trainer.default_root_dir={out}"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err[-3000:]
    saved = yaml.safe_load((out / "config.yaml").read_text())  # in_channels is linked when built, not saved
    assert saved["model"]["class_path"] == "lightning_ooc.models.LinkPredictor"
    assert saved["data"]["init_args"]["batch_size"] == 256 and saved["data"]["init_args"]["neg_sampling"]["amount"] == 5


class PyGStyleNodeModel(L.LightningModule):
    """A model written with PyG's argument names (``in_channels``, ``out_channels``; no ``num_classes``)."""

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 2):
        super().__init__()
        self.save_hyperparameters()


class PyGStyleHeteroModel(L.LightningModule):
    """A heterogeneous model as PyG's are written: ``metadata``, ``in_channels`` per node type, ``out_channels``."""

    def __init__(self, metadata: Any, in_channels: dict[str, int], hidden_channels: int, out_channels: int):
        super().__init__()
        self.save_hyperparameters()


def _built_model(args):
    """The model ``lightning-ooc`` builds from ``args`` (nothing runs)."""
    from lightning_ooc.lightning_cli import OutOfCoreCLI

    cli = OutOfCoreCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                       run=False, args=args, save_config_callback=None)  # fmt: skip
    return cli.model


def test_a_pyg_style_model_gets_every_dimension_from_the_dataset(demo_dataset, other_kinds):
    """``out_channels`` (PyG's name of the class count) needed ``--model.out_channels N`` by hand: the CLI
    linked ``num_classes`` only. A node classifier's ``out_channels`` is the class count now, beside ``in_channels``
    and, for a heterogeneous dataset, ``metadata``; a link model's ``out_channels`` stays its own."""
    model = _built_model(["--data.root", str(demo_dataset.root), "--model", "test_cli.PyGStyleNodeModel",
                          "--model.hidden_channels", "16"])  # fmt: skip
    ds = lightning_ooc.open_dataset(demo_dataset.root)
    assert (model.hparams.in_channels, model.hparams.out_channels) == (ds.num_features, ds.num_classes)

    model = _built_model(["--data", "lightning_ooc.OutOfCoreNodeData", "--data.root", str(other_kinds["hetero"]),
                          "--model", "test_cli.PyGStyleHeteroModel", "--model.hidden_channels", "16"])  # fmt: skip
    hetero = lightning_ooc.open_dataset(other_kinds["hetero"])
    node_types, edge_types = hetero.metadata()
    assert model.hparams.out_channels == 3 and model.hparams.metadata == [node_types, [list(e) for e in edge_types]]
    assert model.hparams.in_channels == {t: hetero.node(t).num_features for t in node_types}

    model = _built_model(["--data", "lightning_ooc.OutOfCoreLinkData", "--data.root", str(other_kinds["links"]),
                          "--model", "test_cli.PyGStyleNodeModel", "--model.hidden_channels", "16",
                          "--model.out_channels", "32"])  # fmt: skip
    assert (model.hparams.in_channels, model.hparams.out_channels) == (8, 32)  # the embedding size, as given


@pytest.mark.parametrize(
    "config, kind, args, message",
    [
        ("demo.yaml", None, ["--model.out_channels", "7"],
         "--model.out_channels 7: PyGStyleNodeModel classifies the nodes of a dataset with"),
        ("link_demo.yaml", "links", [],
         "PyGStyleNodeModel takes out_channels, which OutOfCoreLinkData does not determine"),
    ],
)
def test_an_out_channels_the_dataset_contradicts_or_does_not_give_is_one_line(demo_dataset, other_kinds, capsys,
                                                                              monkeypatch, tmp_path, config, kind,
                                                                              args, message):  # fmt: skip
    root = demo_dataset.root if kind is None else other_kinds[kind]
    rc, last = _fit(monkeypatch, capsys, config, root, tmp_path,
                    ["--model", "test_cli.PyGStyleNodeModel", "--model.hidden_channels", "16", *args])  # fmt: skip
    assert rc == 2 and last.startswith("lightning-ooc: error: ") and message in last, last


def test_fit_resumes_from_a_checkpoint_through_the_cli(demo_dataset, capsys, monkeypatch, tmp_path):
    """``--ckpt_path`` parses the checkpoint's hyperparameters back into the config; they carried the targets
    of the links to ``out_channels`` and ``metadata`` (left out for GraphSAGE) with no value, which became
    keyword arguments GraphSAGE does not take: every resume through the CLI failed with a TypeError."""
    ckpts = tmp_path / "ckpt"
    rc, last = _fit(monkeypatch, capsys, "demo.yaml", demo_dataset.root, tmp_path,
                    ["--trainer.enable_checkpointing=true", "--trainer.callbacks+=ModelCheckpoint",
                     f"--trainer.callbacks.dirpath={ckpts}", "--trainer.max_steps=2"])  # fmt: skip
    assert rc == 0, last
    (ckpt,) = ckpts.glob("*.ckpt")
    rc, last = _fit(monkeypatch, capsys, "demo.yaml", demo_dataset.root, tmp_path,
                    ["--trainer.max_steps=4", f"--ckpt_path={ckpt}"])  # fmt: skip
    assert rc == 0, last
