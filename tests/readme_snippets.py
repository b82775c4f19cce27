"""Helpers of tests/test_readme.py: the README's code blocks, their commands, small stand-ins for the datasets
they name, and runs of ``lightning-ooc`` in this process that record the Trainers they build."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CONFIGS = REPO / "configs"
TRAIN_COMMANDS = ("fit", "validate", "test", "predict")

#: appended to a training command: later arguments win in LightningCLI, so each run is one short epoch on the CPU
#: with nothing written but the config it saves (``--trainer.limit_predict_batches`` is left alone: a predict run
#: writes every node's prediction)
SHRINK = ("--trainer.accelerator", "cpu", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
          "--trainer.limit_val_batches", "1", "--trainer.limit_test_batches", "1", "--trainer.logger", "false",
          "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false")  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# the README's blocks


@dataclass(frozen=True)
class Block:
    heading: str  # the nearest heading above the block
    index: int  # 1, 2, ... among the runnable blocks under that heading
    lang: str  # "python" or "bash"
    text: str
    line: int  # of the opening fence in README.md

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")
        return f"{slug}-{self.index}"


def readme_blocks(text: str | None = None, langs: tuple[str, ...] = ("python", "bash")) -> list[Block]:
    """The fenced blocks of the README in ``langs``, in order (a block of another language, or none, is text)."""
    lines = (README.read_text() if text is None else text).splitlines()
    blocks, heading, counts, i = [], "top", {}, 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^```\s*([\w+-]*)\s*$", line)
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            assert end is not None, f"README.md:{i + 1}: a code block that is never closed"
            if fence.group(1) in langs:
                counts[heading] = counts.get(heading, 0) + 1
                blocks.append(Block(heading, counts[heading], fence.group(1), "\n".join(lines[i + 1 : end]) + "\n",
                                    i + 1))  # fmt: skip
            i = end + 1
            continue
        if re.match(r"^#{1,6} ", line):
            heading = line.lstrip("#").strip()
        i += 1
    return blocks


def commands(text: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, ``a && b`` as two commands."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            if words[:cut]:
                out.append(words[:cut])
            words = words[cut + 1 :]
    return out


def substitute(text: str, subs: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> str:
    """``text`` with each ``(old, new)`` replaced; an ``old`` that the text no longer holds is an error, so that a
    substitution never outlives the words it was written for."""
    for old, new in subs:
        assert old in text, f"the substitution {old!r} -> {new!r} no longer matches the block:\n{text}"
        text = text.replace(old, new)
    return text


# --------------------------------------------------------------------------------------------------------------
# stand-ins for the datasets the README and the configs name


def make_node(root: Path) -> Path:
    """A homogeneous graph with node classes and node splits: 600 nodes, 16 features, 4 classes."""
    from lightning_ooc.testing import make_synthetic

    return make_synthetic(root, num_nodes=600, avg_degree=8, num_features=16, train_frac=0.3, val_frac=0.1,
                          test_frac=0.1).root


def make_temporal(root: Path) -> Path:
    from lightning_ooc.data.synth import synthesize

    return synthesize(root, num_nodes=600, avg_degree=6, num_features=16, num_classes=4, train_frac=0.3,
                      val_frac=0.1, test_frac=0.1, temporal=True, progress=False, overwrite=True)  # fmt: skip


def make_node_with_links(root: Path, node: Path) -> Path:
    """The graph of :func:`make_node` with link splits too (the README's ``ds.link_split("val")`` line)."""
    import lightning_ooc
    from lightning_ooc.data.prepare import prepare_from_arrays

    ds = lightning_ooc.open_dataset(node)
    ei = np.stack([np.asarray(ds.indices, dtype=np.int64),
                   np.repeat(np.arange(ds.num_nodes), np.diff(np.asarray(ds.indptr)))])  # fmt: skip
    x = np.fromfile(ds.features_path, dtype=np.float32).reshape(ds.num_nodes, ds.num_features)
    out = prepare_from_arrays(root, ei, x, np.asarray(ds.labels), train=ds.split("train").numpy(),
                              val=ds.split("val").numpy(), test=ds.split("test").numpy(), split_edges=(0.9, 0.05, 0.05),
                              progress=False)  # fmt: skip
    return out


def make_links(root: Path, negatives: int = 20) -> Path:
    """A graph of 500 nodes with link splits: val/test edges held out, ``negatives`` given negatives each (as
    ``examples/train_link.py --make`` writes)."""
    from lightning_ooc.data.prepare import prepare_from_arrays

    rng = np.random.default_rng(0)
    n = 500
    pairs = np.unique(rng.integers(0, n, (3000, 2)), axis=0)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    k = len(pairs) // 10
    val, test, train = pairs[:k], pairs[k : 2 * k], pairs[2 * k :]
    splits = {"train": train.T, "val": {"index": val.T, "neg_dst": rng.integers(0, n, (k, negatives))},
              "test": {"index": test.T, "neg_dst": rng.integers(0, n, (k, negatives))}}  # fmt: skip
    x = rng.standard_normal((n, 12)).astype(np.float32)
    return prepare_from_arrays(root, train.T, x, link_splits=splits, progress=False)


def make_hetero(root: Path) -> Path:
    """An IGBH-shaped heterogeneous graph of 600 papers, 8 features, 3 classes."""
    from lightning_ooc.data.synth_hetero import synthesize_hetero

    return synthesize_hetero(root, "igbh", num_nodes=600, num_features=8, num_classes=3, train_frac=0.3,
                             progress=False)  # fmt: skip


def make_table(root: Path, dataset: Path) -> Path:
    """An embedding table of 6 partitions over ``dataset``'s link splits."""
    from lightning_ooc.embed import init_embeddings

    return init_embeddings(root, dataset=dataset, dim=16, partitions=6, progress=False)


def make_inputs(where: Path) -> Path:
    """The input files the README's ``prepare`` lines name: ``graph.pt`` (a PyG ``Data``), ``edge_index.npy``,
    ``x.npy``, ``y.npy``, ``train_idx.npy``, ``edges.csv``, ``split.pt`` (``RandomLinkSplit``'s three) and
    ``hetero.pt`` (a ``HeteroData``)."""
    import torch
    from torch_geometric.data import Data, HeteroData
    from torch_geometric.transforms import RandomLinkSplit

    where.mkdir(parents=True)
    rng = np.random.default_rng(0)
    n = 300
    ei = rng.integers(0, n, (2, 1500))
    x = rng.standard_normal((n, 8)).astype(np.float32)
    y = rng.integers(0, 3, n)
    np.save(where / "edge_index.npy", ei)
    np.save(where / "x.npy", x)
    np.save(where / "y.npy", y)
    np.save(where / "train_idx.npy", np.arange(0, n, 3))
    (where / "edges.csv").write_text("".join(f"{s},{d}\n" for s, d in ei.T))
    mask = torch.zeros(n, dtype=torch.bool)
    train, val, test = mask.clone(), mask.clone(), mask.clone()
    train[: n // 2], val[n // 2 : 2 * n // 3], test[2 * n // 3 :] = True, True, True
    data = Data(x=torch.from_numpy(x), y=torch.from_numpy(y), edge_index=torch.from_numpy(ei), train_mask=train,
                val_mask=val, test_mask=test)  # fmt: skip
    torch.save(data, where / "graph.pt")
    torch.save(RandomLinkSplit(num_val=0.05, num_test=0.1)(Data(x=data.x, edge_index=data.edge_index)),
               where / "split.pt")  # fmt: skip
    h = HeteroData()
    h["paper"].x, h["paper"].y = data.x, data.y
    h["paper"].train_mask, h["paper"].val_mask, h["paper"].test_mask = train, val, test
    h["author"].x = torch.randn(100, 8)
    h["paper", "cites", "paper"].edge_index = data.edge_index
    writes = [torch.randint(0, 100, (400,)), torch.randint(0, n, (400,))]
    h["author", "writes", "paper"].edge_index = torch.stack(writes)
    torch.save(h, where / "hetero.pt")
    return where


class StandIns:
    """Stand-in datasets made once per test module under ``cache`` and copied into a working directory on demand."""

    BUILDERS: dict[str, Callable[["StandIns", Path], Path]] = {
        "node": lambda self, p: make_node(p),
        "temporal": lambda self, p: make_temporal(p),
        "node+links": lambda self, p: make_node_with_links(p, self.get("node")),
        "links": lambda self, p: make_links(p),
        "hetero": lambda self, p: make_hetero(p),
        "table": lambda self, p: make_table(p, self.get("links")),
        "inputs": lambda self, p: make_inputs(p),
    }

    def __init__(self, cache: Path):
        self.cache = cache
        self.made: dict[str, Path] = {}

    def get(self, kind: str) -> Path:
        if kind not in self.made:
            with quiet():
                self.made[kind] = Path(self.BUILDERS[kind](self, self.cache / kind))
        return self.made[kind]

    def place(self, cwd: Path, needs: dict[str, str]) -> None:
        """Copy the stand-in of each kind to its path (relative to ``cwd``; ``"."`` for the input files)."""
        for rel, kind in needs.items():
            src, dst = self.get(kind), cwd / rel
            if rel == ".":
                for f in src.iterdir():
                    shutil.copy2(f, cwd / f.name)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, dst, symlinks=True)  # a table names its dataset by path: the one in the cache


def make_checkpoint(stand_ins: StandIns, path: Path) -> Path:
    """A checkpoint of ``configs/demo.yaml``'s model, trained two batches on the node stand-in."""
    from lightning_ooc.cli import main

    path.mkdir()
    with recording_trainers() as calls:
        rc = main(["fit", "--config", str(CONFIGS / "demo.yaml"), "--data.root", str(stand_ins.get("node")), *SHRINK,
                   "--trainer.default_root_dir", str(path), "--test_after_fit", "false"])  # fmt: skip
    assert rc == 0 and calls
    calls[-1][1].save_checkpoint(path / "demo.ckpt")
    return path / "demo.ckpt"


StandIns.BUILDERS["ckpt"] = make_checkpoint


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence stdout (progress lines of the stand-in builders)."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


# --------------------------------------------------------------------------------------------------------------
# runs


@contextlib.contextmanager
def recording_trainers() -> Iterator[list[tuple[str, Any]]]:
    """Record ``(fn, trainer)`` for every ``Trainer.fit/validate/test/predict`` that returns meanwhile (``fn``:
    ``"fit"``, ...). Trainer's private ``_run``, which each of them calls, is wrapped: LightningCLI reads the
    signatures of the public methods to parse their arguments (``--ckpt_path``)."""
    import lightning.pytorch as pl

    calls: list[tuple[str, Any]] = []
    original = pl.Trainer._run

    def _run(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append((self.state.fn.value, self))
        return out

    pl.Trainer._run = _run
    try:
        yield calls
    finally:
        pl.Trainer._run = original


def point_lightning_logs_at_stderr(monkeypatch) -> None:
    """Lightning's handlers keep the stderr of the test that imported it; point them at this one's."""
    import logging

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        for h in logging.getLogger(name).handlers:
            if isinstance(h, logging.StreamHandler):
                monkeypatch.setattr(h, "stream", sys.stderr)


def run_script(argv: list[str], cwd: Path, monkeypatch) -> None:
    """``python SCRIPT ARGS`` in this process (as ``__main__``), from ``cwd``."""
    import runpy

    import logging

    script = cwd / argv[0]
    assert script.is_file(), f"no such script: {argv[0]}"
    monkeypatch.setattr(sys, "argv", [str(script), *argv[1:]])
    loggers = [logging.getLogger(name) for name in ("", "lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]  # a script sets them for its own process
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        assert e.code in (None, 0), f"{shlex.join(argv)} exited with {e.code}"
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def link_repo_dirs(cwd: Path) -> None:
    """``configs/`` and ``examples/`` of the repository in ``cwd``: the commands run as from a clone's root."""
    for name in ("configs", "examples"):
        (cwd / name).symlink_to(REPO / name, target_is_directory=True)
