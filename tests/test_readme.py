"""Every Python and bash block of README.md runs, each from a fresh working directory that holds small stand-ins of
the datasets it names (``tests/readme_snippets.py``).

A Python block is executed with the names its surrounding text supplies (``names`` of its rule); a bash block's
commands run one by one: ``lightning-ooc ...`` in this process (a training command with ``SHRINK`` appended: one
short epoch on the CPU), ``python examples/...`` in this process as ``__main__``, ``make TARGET`` as ``make -n TARGET``
(the target exists and its commands expand). Sizes that would take minutes are cut by the substitutions of the
block's rule, each written out below; the API calls and options are left as written. Every block has a rule:
a block added to the README without one fails ``test_every_block_has_a_rule``.

Lines that cannot run here as written are checked otherwise, and listed in ``DIFFERENTLY`` with the reason:

* a training line with ``--trainer.devices 2`` starts a process per device: in the default run it is parsed
  (``--print_config``); the test marked slow runs it in two CPU processes;
* ``lightning-ooc bench embed`` is a benchmark of minutes: ``--help`` here; the slow test runs its smallest setting;
* ``torchrun --nnodes 4 ...`` needs four machines: torchrun's own parser takes its options, each part it names
  exists, and the training command it launches parses (``--print_config``).
"""
from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import yaml

from readme_snippets import (
    REPO,
    SHRINK,
    TRAIN_COMMANDS,
    Block,
    StandIns,
    commands,
    link_repo_dirs,
    point_lightning_logs_at_stderr,
    readme_blocks,
    recording_trainers,
    run_script,
    substitute,
)

BLOCKS = readme_blocks()


@dataclass
class Context:
    """What a block's run leaves for its check."""

    cwd: Path
    calls: list = field(default_factory=list)  # (method, trainer) of every Trainer.fit/test/... that returned
    ns: dict = field(default_factory=dict)  # a Python block's namespace
    out: list = field(default_factory=list)  # the stdout of each command of a bash block


@dataclass
class Rule:
    needs: dict[str, str] = field(default_factory=dict)  # path in the working directory -> stand-in kind
    subs: tuple[tuple[str, str], ...] = ()  # (old, new) in the block's text, each with its reason beside it
    names: Callable[[Path], dict[str, Any]] | None = None  # a Python block: the names the text around it supplies
    setup: Callable[[Path, StandIns], None] | None = None
    check: Callable[[Context], None] | None = None
    differently: dict[str, str] = field(default_factory=dict)  # command prefix -> why it is not run as written
    alternatives: bool = False  # the lines are ways to do one thing: each starts without the --out of the others


# --------------------------------------------------------------------------------------------------------------
# checks


def trained(ctx: Context, method: str = "fit", n: int = 1) -> list[Any]:
    """The Trainers whose ``method`` returned: at least ``n``, each finished, a fit having taken a step."""
    trainers = [t for m, t in ctx.calls if m == method]
    assert len(trainers) >= n, f"expected {n} Trainer.{method} to finish, saw {[m for m, _ in ctx.calls]}"
    for t in trainers:
        assert t.state.finished, t.state
        assert method != "fit" or t.global_step > 0
    return trainers


def finite(model: Any) -> None:
    import torch

    assert all(torch.isfinite(p).all() for p in model.parameters())


def check_quick_start(ctx: Context) -> None:
    trained(ctx)
    assert ctx.ns["dm"].num_classes == 4 and ctx.ns["dm"].num_features == 16
    finite(ctx.ns["model"])


def check_link_python(ctx: Context) -> None:
    (trainer,) = trained(ctx)
    logged = set(trainer.callback_metrics)
    assert {"train_loss", "val_mrr", "val_hits@1", "val_hits@10", "val_auc"} <= logged, logged


def check_packed(ctx: Context) -> None:
    import lightning as L

    from lightning_ooc import Packed
    from lightning_ooc.models import GraphSAGE

    dm = ctx.ns["dm"]
    assert isinstance(dm.config.features, Packed) and Path(dm.config.features.pack_dir) == Path("scratch/g.packed")
    model = GraphSAGE(in_channels=dm.num_features, num_classes=dm.num_classes)
    L.Trainer(max_epochs=1).fit(model, datamodule=dm)  # the patched Trainer: two batches, from the packs
    trained(ctx)


def check_kge_python(ctx: Context) -> None:
    trained(ctx)
    assert ctx.ns["dm"].num_relations == 3


def check_learnable(ctx: Context) -> None:
    import lightning as L

    dm, model = ctx.ns["dm"], ctx.ns["model"]
    assert dm.num_features == 64 and (ctx.cwd / "data" / "g-emb").is_dir()
    L.Trainer(max_epochs=1).fit(model, datamodule=dm)
    trained(ctx)


def check_layerwise(ctx: Context) -> None:
    import lightning_ooc

    logits = np.load(ctx.cwd / "logits.npy")
    assert logits.shape == (600, 4) and np.isfinite(logits).all()
    assert lightning_ooc.open_dataset(ctx.cwd / "data" / "papers-logits").num_features == 4
    assert "partitions" in ctx.ns["result"].plan.describe()


def check_pyg_loader(ctx: Context) -> None:
    batch = next(iter(ctx.ns["loader"]))
    assert batch.x.shape[1] == 16 and batch.edge_index.shape[0] == 2 and batch.batch_size > 0
    assert bool(ctx.ns["data"].train_mask[batch.n_id[: batch.batch_size]].all())
    links = next(iter(ctx.ns["links"]))
    assert links.edge_label_index.shape[0] == 2 and float(links.edge_label.mean()) == 0.5
    ctx.ns["data"].close()


def check_temporal_lines(ctx: Context) -> None:
    import lightning_ooc

    trained(ctx)
    ds = lightning_ooc.open_dataset(ctx.cwd / "data" / "temporal")
    assert ds.num_nodes == 3000 and ds.neighbor_order == "edge_time" and ds.split_time("train") is not None


def check_temporal_python(ctx: Context) -> None:
    dm = ctx.ns["dm"]
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch.seed_time.numel() == batch.batch_size and batch.batch.numel() == batch.n_id.numel()
    assert dm.config.time.time_attr == "edge_time" and batch.n_id.numel() > batch.batch_size
    dm.teardown()


def check_open_dataset(ctx: Context) -> None:
    ds = ctx.ns["ds"]
    assert ds.num_nodes == 600 and len(ds.split("train")) > 0 and ds.features_path.is_file()


def check_training_lines(ctx: Context) -> None:
    trained(ctx, n=2)  # configs/demo.yaml, configs/link_demo.yaml (the two-process lines: --print_config)
    assert (ctx.cwd / "data" / "links" / "meta.json").is_file()  # written by examples/train_link.py --make


def check_hetero_training(ctx: Context) -> None:
    import lightning_ooc

    trained(ctx)
    assert lightning_ooc.open_dataset(ctx.cwd / "data" / "igbh-demo").node("paper").num_classes == 8


def check_partitions(ctx: Context) -> None:
    for k in range(4):  # the README copies part-0000K to machine K
        assert (ctx.cwd / "data" / "papers-parts" / f"part-{k:05d}").is_dir(), sorted(
            p.name for p in (ctx.cwd / "data" / "papers-parts").iterdir())  # fmt: skip


def check_kge_lines(ctx: Context) -> None:
    (trainer,) = trained(ctx)
    assert any(k.startswith("test_mrr") for k in trainer.callback_metrics), set(trainer.callback_metrics)
    assert "--num-negatives" in ctx.out[-1]  # bench embed --help


def check_predict(ctx: Context) -> None:
    import lightning_ooc

    trained(ctx, "predict", n=2)
    pred = np.load(ctx.cwd / "predictions.npy")
    assert pred.shape == (600,) and pred.min() >= 0 and pred.max() < 4
    assert lightning_ooc.open_dataset(ctx.cwd / "data" / "demo-logits").num_features == 4


def check_synth_lines(ctx: Context) -> None:
    import lightning_ooc

    ds = lightning_ooc.open_dataset(ctx.cwd / "data" / "g")
    assert (ds.num_nodes, ds.num_features, ds.num_classes) == (2000, 128, 32)
    assert "all checks passed" in ctx.out[-1]


def check_prepare_lines(ctx: Context) -> None:
    import lightning_ooc

    mine = lightning_ooc.open_dataset(ctx.cwd / "data" / "mine")
    assert mine.feature_dtype_name == "bfloat16"  # the last line that writes data/mine
    for links in ("links", "g-links"):
        assert lightning_ooc.open_dataset(ctx.cwd / "data" / links).link_split("test").index.shape[1] > 0


def check_hetero_lines(ctx: Context) -> None:
    import lightning_ooc

    assert lightning_ooc.open_dataset(ctx.cwd / "data" / "igbh").node("paper").num_features == 128
    assert lightning_ooc.open_dataset(ctx.cwd / "data" / "mine-hetero").node("paper").num_classes == 3


# --------------------------------------------------------------------------------------------------------------
# the names the README's text supplies around a Python block


def quick_start_names(cwd: Path) -> dict[str, Any]:
    import lightning

    from lightning_ooc import OutOfCoreNodeData
    from lightning_ooc.models import GraphSAGE

    return {"OutOfCoreNodeData": OutOfCoreNodeData, "GraphSAGE": GraphSAGE, "lightning": lightning}


def lightning_and(*names: str) -> Callable[[Path], dict[str, Any]]:
    """``L`` (``import lightning as L``, from the block above) and the named classes of the package."""

    def make(cwd: Path) -> dict[str, Any]:
        import importlib

        import lightning as L

        where = {"LinkPredictor": "lightning_ooc.models", "GraphSAGE": "lightning_ooc.models",
                 "OutOfCoreNodeData": "lightning_ooc", "Learnable": "lightning_ooc",
                 "init_embeddings": "lightning_ooc.embed"}  # fmt: skip
        return {"L": L, **{n: getattr(importlib.import_module(where[n]), n) for n in names}}

    return make


def triples(cwd: Path) -> dict[str, Any]:
    """``L``, ``n`` nodes and (head, relation, tail) triples of 3 relations: ``h, r, t`` to train, ``hv, rv, tv`` and
    ``ht, rt, tt`` to evaluate, as the block's comment asks for."""
    import torch

    g = torch.Generator().manual_seed(0)
    n = 2000
    out: dict[str, Any] = {"n": n, **lightning_and()(cwd)}
    for names, m in ((("h", "r", "t"), 6000), (("hv", "rv", "tv"), 200), (("ht", "rt", "tt"), 200)):
        for name, high in zip(names, (n, 3, n)):
            out[name] = torch.randint(0, high, (m,), generator=g)
    return out


def untrained_model(cwd: Path) -> dict[str, Any]:
    """``model``: a GraphSAGE for ``data/papers`` (the block follows training)."""
    import lightning_ooc
    from lightning_ooc.models import GraphSAGE

    ds = lightning_ooc.open_dataset(cwd / "data" / "papers")
    return {"model": GraphSAGE(in_channels=ds.num_features, num_classes=ds.num_classes)}


def checkpoint(cwd: Path, stand_ins: StandIns) -> None:
    """``CKPT``: a checkpoint of ``configs/demo.yaml``'s model (made once per test run)."""
    shutil.copy(stand_ins.get("ckpt"), cwd / "demo.ckpt")


# --------------------------------------------------------------------------------------------------------------
# a rule per block

TWO_PROCESSES = "starts a process per device: parsed here (--print_config); the slow test runs it in two processes"
BENCHMARK = ("a benchmark of minutes (a worker process per variant): --help here; the slow test runs it with "
             "BENCH_SMALL's options")  # fmt: skip
#: appended to a benchmark line of DIFFERENTLY by the slow test: its smallest run of every variant and order
BENCH_SMALL = {"lightning-ooc bench embed": ("--nodes 3000", "--partitions 6", "--max-partitions 6", "--epochs 1",
                                            "--out bench/embed", "--workdir bench")}  # fmt: skip
FOUR_MACHINES = ("four machines: torchrun's parser takes the options, the parts exist, the training command parses "
                 "(--print_config)")  # fmt: skip

RULES: dict[str, Rule] = {
    "lightning-ooc-1": Rule(),  # make demo, make test: make -n
    "lightning-ooc-2": Rule(needs={"data/demo": "node"}, names=quick_start_names, check=check_quick_start),
    "training-1": Rule(
        needs={"data/demo": "node", "data/papers100M": "node"},
        subs=(("/ssd/papers100M", "data/papers100M"),  # a path outside the working directory
              ("--make 20000", "--make 2000")),  # fmt: skip
        differently={
            "lightning-ooc fit --config configs/demo.yaml --trainer.accelerator cpu --trainer.devices 2": TWO_PROCESSES,
            "lightning-ooc fit --config configs/sage_papers.yaml --data.root data/papers100M --trainer.devices 2":
                TWO_PROCESSES,
        },
        check=check_training_lines,
    ),
    "training-2": Rule(subs=(("--nodes 20000", "--nodes 2000"),), check=check_hetero_training),
    "training-3": Rule(
        needs={"data/g": "node"},
        subs=(('accelerator="gpu", devices=2', 'accelerator="cpu", devices=1'),),  # two GPUs
        check=lambda ctx: (trained(ctx), finite(ctx.ns["model"])),
    ),
    "training-4": Rule(needs={"data/links": "links"}, names=lightning_and("LinkPredictor"), check=check_link_python),
    "several-machines-features-partitioned-1": Rule(
        needs={"data/papers": "node"},
        subs=(("--node-rank K", "--node-rank 0"),),  # the machine's rank, a placeholder
        differently={"torchrun ": FOUR_MACHINES},
        check=check_partitions,
    ),
    "packed-minibatches-sequential-reads-instead-of-random-ones-1": Rule(
        needs={"data/g": "node"},
        subs=(('"/scratch/g.packed"', '"scratch/g.packed"'),),  # a path outside the working directory
        check=check_packed,
    ),
    "node-embeddings-larger-than-memory-1": Rule(
        subs=(("--make 20000", "--make 2000"),),
        differently={"lightning-ooc bench embed": BENCHMARK},
        check=check_kge_lines,
    ),
    "node-embeddings-larger-than-memory-2": Rule(names=triples, check=check_kge_python),
    "node-embeddings-larger-than-memory-3": Rule(
        needs={"data/g": "node"}, names=lightning_and("init_embeddings", "OutOfCoreNodeData", "Learnable", "GraphSAGE"),
        check=check_learnable,
    ),
    "predicting-every-node-layer-wise-inference-out-of-core-1": Rule(
        needs={"data/papers": "node"}, names=untrained_model, check=check_layerwise
    ),
    "predicting-every-node-layer-wise-inference-out-of-core-2": Rule(
        needs={"data/demo": "node"}, subs=(("CKPT", "demo.ckpt"),), setup=checkpoint, check=check_predict
    ),
    "time-temporal-sampling-out-of-core-1": Rule(
        subs=(("--out data/temporal", "--out data/temporal --nodes 3000"),), check=check_temporal_lines),
    "time-temporal-sampling-out-of-core-2": Rule(needs={"data/temporal": "temporal"}, names=quick_start_names,
                                                 check=check_temporal_python),  # fmt: skip
    "using-pyg-s-loaders-1": Rule(needs={"data/papers": "node"}, check=check_pyg_loader),
    "getting-a-graph-onto-disk-1": Rule(subs=(("--nodes 2000000", "--nodes 2000"),), check=check_synth_lines),
    "getting-a-graph-onto-disk-2": Rule(needs={".": "inputs", "data/g": "node"}, alternatives=True,
                                        check=check_prepare_lines),
    "getting-a-graph-onto-disk-3": Rule(
        needs={".": "inputs"}, subs=(("--nodes 100000", "--nodes 1000"),), check=check_hetero_lines
    ),
    "getting-a-graph-onto-disk-4": Rule(needs={"data/g": "node", "data/g-links": "node+links"},
                                        check=check_open_dataset),
}

#: every line run otherwise than as written, by block: grows only with this list
DIFFERENTLY = {bid: sorted(rule.differently) for bid, rule in RULES.items() if rule.differently}
EXPECTED_DIFFERENTLY = 4


# --------------------------------------------------------------------------------------------------------------
# running


def _devices(argv: list[str]) -> int:
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--trainer.devices"]
    return int(values[-1]) if values and values[-1].isdigit() else 1


def run_training(argv: list[str], ctx: Context, capsys) -> None:
    """``lightning-ooc fit|predict|...`` in this process, shrunk."""
    from lightning_ooc.cli import main

    if "--print_config" in argv:
        with pytest.raises(SystemExit) as done:  # LightningCLI exits once it has printed
            main(argv[1:])
        rc = done.value.code or 0
        out = capsys.readouterr().out
        assert rc == 0 and yaml.safe_load(out)["data"], out[-2000:]
        ctx.out.append(out)
        return
    with recording_trainers() as calls:
        rc = main([*argv[1:], *SHRINK])
    err = capsys.readouterr().err
    assert rc == 0, f"{shlex.join(argv)}: status {rc}\n{err[-3000:]}"
    assert calls and calls[0][0] == argv[1], f"{shlex.join(argv)} ran no Trainer.{argv[1]}"
    ctx.calls += calls


def run_otherwise(argv: list[str], reason: str, ctx: Context, capsys) -> None:
    """A line of ``DIFFERENTLY``."""
    if argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[1:])
        assert args.module and args.training_script == "lightning_ooc" and args.nnodes == "4"
        launched = ["lightning-ooc", *args.training_script_args]
        root = launched[launched.index("--data.root") + 1]
        assert f"--trainer.num_nodes {args.nnodes}" in shlex.join(launched) and root == "/data/papers-parts"
        run_training([*launched, "--print_config"], ctx, capsys)
        return
    if argv[:2] == ["lightning-ooc", "bench"]:
        from lightning_ooc.cli import main

        with pytest.raises(SystemExit) as done:
            main([*argv[1:], "--help"])
        assert done.value.code == 0
        ctx.out.append(capsys.readouterr().out)
        return
    assert _devices(argv) > 1, reason
    run_training([*argv, "--print_config"], ctx, capsys)


def run_command(argv: list[str], rule: Rule, ctx: Context, capsys, monkeypatch) -> None:
    line = shlex.join(argv)
    special = [reason for prefix, reason in rule.differently.items() if line.startswith(prefix)]
    if special:
        run_otherwise(argv, special[0], ctx, capsys)
        return
    assert argv[0] != "torchrun" and not (argv[0] == "lightning-ooc" and _devices(argv) > 1), (
        f"{line}: needs several processes or machines, and its block's rule does not say how to check it")
    if argv[0] == "make":
        assert len(argv) == 2, line
        out = subprocess.run(["make", "-n", argv[1]], cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 0, f"make -n {argv[1]}: {out.stderr}"
    elif argv[0] == "lightning-ooc" and argv[1] in TRAIN_COMMANDS:
        run_training(argv, ctx, capsys)
    elif argv[0] == "lightning-ooc":
        from lightning_ooc.cli import main

        rc = main(argv[1:])
        captured = capsys.readouterr()
        assert rc == 0, f"{line}: status {rc}\n{captured.err[-3000:]}"
        ctx.out.append(captured.out)
    elif argv[0] == "python":
        with recording_trainers() as calls:
            run_script(argv[1:], ctx.cwd, monkeypatch)
        ctx.calls += calls
    else:
        pytest.fail(f"{line}: no way to run {argv[0]!r} (tests/test_readme.py, run_command)")


def run_block(block: Block, rule: Rule, cwd: Path, stand_ins: StandIns, capsys, monkeypatch) -> Context:
    import lightning

    monkeypatch.chdir(cwd)
    point_lightning_logs_at_stderr(monkeypatch)
    link_repo_dirs(cwd)
    stand_ins.place(cwd, rule.needs)
    if rule.setup is not None:
        rule.setup(cwd, stand_ins)
    text = substitute(block.text, rule.subs)
    ctx = Context(cwd)
    capsys.readouterr()
    if block.lang == "bash":
        for argv in commands(text):
            if rule.alternatives and "--out" in argv:
                shutil.rmtree(cwd / argv[argv.index("--out") + 1], ignore_errors=True)
            run_command(argv, rule, ctx, capsys, monkeypatch)
        if rule.check is not None:
            rule.check(ctx)
        return ctx
    monkeypatch.setattr(lightning, "Trainer", small_trainer())
    monkeypatch.setattr(lightning.pytorch, "Trainer", small_trainer())
    ns = {"__name__": "__main__", **(rule.names(cwd) if rule.names else {})}
    with recording_trainers() as calls:
        exec(compile(text, f"README.md:{block.line + 1}", "exec"), ns)
        ctx.ns, ctx.calls = ns, calls
        if rule.check is not None:
            rule.check(ctx)
    return ctx


@functools.lru_cache(maxsize=None)
def small_trainer() -> type:
    """``lightning.Trainer`` for a README block's ``Trainer(...)``: one short epoch (at most two batches), nothing
    written; what the block gives wins, except ``max_epochs``, cut to 1."""
    import lightning

    class SmallTrainer(lightning.Trainer):
        def __init__(self, *args, **kwargs):
            small = {"limit_train_batches": 2, "limit_val_batches": 1, "limit_test_batches": 1, "logger": False,
                     "enable_checkpointing": False, "enable_progress_bar": False, "num_sanity_val_steps": 0}
            super().__init__(*args, **{**small, **kwargs, "max_epochs": min(kwargs.get("max_epochs") or 1, 1)})

    return SmallTrainer


def test_every_block_has_a_rule():
    ids = [b.id for b in BLOCKS]
    assert len(ids) == len(set(ids)), ids
    assert set(ids) - set(RULES) == set(), "README blocks without a rule in tests/test_readme.py"
    assert set(RULES) - set(ids) == set(), "rules of tests/test_readme.py for blocks the README no longer has"
    assert sum(len(v) for v in DIFFERENTLY.values()) == EXPECTED_DIFFERENTLY, DIFFERENTLY


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block_runs(block, stand_ins, tmp_path, capsys, monkeypatch):
    if block.id not in RULES:
        pytest.fail(f"README.md:{block.line}: block {block.id} has no rule in tests/test_readme.py")
    run_block(block, RULES[block.id], tmp_path, stand_ins, capsys, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("bid, prefix", [(b, p) for b, ps in DIFFERENTLY.items() for p in ps if "torchrun" not in p])
def test_readme_lines_checked_otherwise_run(bid, prefix, stand_ins, tmp_path):
    """The lines with ``--trainer.devices 2`` train in two CPU processes (the launcher runs the command again for
    rank 1); a benchmark line runs with ``BENCH_SMALL``'s options."""
    rule = RULES[bid]
    stand_ins.place(tmp_path, rule.needs)
    link_repo_dirs(tmp_path)
    (argv,) = [a for a in commands(substitute(next(b for b in BLOCKS if b.id == bid).text, rule.subs))
               if shlex.join(a).startswith(prefix)]  # fmt: skip
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}  # the in-process runs' rendezvous
    bench = argv[1] == "bench"
    extra = [a for opt in BENCH_SMALL[prefix] for a in opt.split()] if bench else list(SHRINK)
    out = subprocess.run([sys.executable, "-m", "lightning_ooc", *argv[1:], *extra],
                         cwd=tmp_path, capture_output=True, text=True, timeout=280, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    if bench:
        assert list(tmp_path.glob("bench/embed*.json")), out.stdout[-3000:]
    else:
        report = out.stdout + out.stderr  # RunReport's line: both ranks trained
        assert "training seeds per epoch over 2 process(es)" in report, report[-3000:]
