"""Link prediction with strategy="ooc" and two processes: disjoint seed edges, identical parameters."""
import json
import sys

import numpy as np
import pytest

from jobs import TESTS, _run


@pytest.mark.slow  # the node two-process test (test_strategy.py) runs the same strategy path in make test
def test_two_processes_train_disjoint_seed_edges_with_identical_parameters(tmp_path):
    from lightning_ooc.data.prepare import prepare_from_arrays

    rng = np.random.default_rng(0)
    root = prepare_from_arrays(tmp_path / "g", rng.integers(0, 3000, (2, 12000)),
                               rng.random((3000, 16), dtype=np.float32), split_edges=(0.85, 0.05, 0.10),
                               progress=False)  # fmt: skip
    _run([sys.executable, str(TESTS / "link_ddp_run.py"), str(root), str(tmp_path / "probe")], tmp_path)
    r0, r1 = (json.loads((tmp_path / "probe" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2 and r0["pid"] != r1["pid"]
    import lightning_ooc

    train = lightning_ooc.open_dataset(root).link_splits["splits"]["train"]["edges"]
    for e in ("0", "1"):  # every epoch the ranks' edges are disjoint and together cover the training split
        e0, e1 = r0["edges"][e], r1["edges"][e]
        assert not set(e0) & set(e1) and sorted(e0 + e1) == list(range(train))
    assert r0["edges"]["0"] != r0["edges"]["1"]  # reshuffled per epoch
    assert r0["params"] == r1["params"] and len(set(r0["params"])) == len(r0["params"]) > 4  # synced, and changing
