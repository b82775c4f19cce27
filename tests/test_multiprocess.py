"""Every task under strategy="ooc" with two processes: disjoint seeds that cover the training split every epoch,
reshuffled per epoch, bit-identical parameters after every step, the topology in one node-shared segment.

The node task's run through the command line, with more of the strategy's checks (staging, resume, signals), is
in test_strategy.py.
"""
import json
import sys

import numpy as np
import pytest

import lightning_ooc
from jobs import TESTS, _run
from lightning_ooc.data.prepare import prepare_from_arrays
from lightning_ooc.data.synth_hetero import synthesize_hetero
from lightning_ooc.testing import make_synthetic


def _dataset(task: str, tmp_path):
    if task == "link":
        rng = np.random.default_rng(0)
        return prepare_from_arrays(tmp_path / "g", rng.integers(0, 3000, (2, 12000)),
                                   rng.random((3000, 16), dtype=np.float32), split_edges=(0.85, 0.05, 0.10),
                                   progress=False)  # fmt: skip
    if task == "hetero":
        return synthesize_hetero(tmp_path / "igbh", "igbh", num_nodes=3000, num_features=16, num_classes=4,
                                 train_frac=0.3, val_frac=0.1, test_frac=0.2, seed=0, progress=False)  # fmt: skip
    return make_synthetic(tmp_path / "g", num_nodes=3000, avg_degree=8, num_features=16, train_frac=0.2).root


def _training_seeds(task: str, root) -> list[int]:
    ds = lightning_ooc.open_dataset(root)
    if task == "link":  # positions of the training edges in their split
        return list(range(ds.link_splits["splits"]["train"]["edges"]))
    return sorted(ds.split("train").tolist())


# slow, all three: make test runs the node task's two processes through the command line and the strategy
# (test_strategy.py's test of the same name), which this path shares
@pytest.mark.parametrize("task", [pytest.param("node", marks=pytest.mark.slow),
                                  pytest.param("link", marks=pytest.mark.slow),
                                  pytest.param("hetero", marks=pytest.mark.slow)])
def test_two_processes_train_disjoint_seeds_with_identical_parameters(task, tmp_path):
    root = _dataset(task, tmp_path)
    _run([sys.executable, str(TESTS / "task_ddp_run.py"), task, str(root), str(tmp_path / "probe")], tmp_path)
    r0, r1 = (json.loads((tmp_path / "probe" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2 and r0["pid"] != r1["pid"]
    train = _training_seeds(task, root)
    for e in ("0", "1"):  # every epoch the ranks' seeds are disjoint and together cover the training split
        s0, s1 = r0["seeds"][e], r1["seeds"][e]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == train
    assert r0["seeds"]["0"] != r0["seeds"]["1"]  # reshuffled per epoch
    assert r0["params"] == r1["params"] and len(set(r0["params"])) == len(r0["params"]) > 4  # synced, and changing
    # every indptr is in one node-shared segment, mapped by both ranks
    assert r0["indptr"] and r0["indptr"] == r1["indptr"]
    assert all("/dev/shm/looc-" in p for p in r0["indptr"].values())
