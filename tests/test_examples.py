"""The example scripts can be imported again by a spawned process (a rank, a gather producer) without running."""
import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_importing_an_example_runs_nothing(path, monkeypatch, capsys):
    # What the spawn start method does in a child: run the file under another name than __main__.
    monkeypatch.setattr(sys, "argv", [str(path)])  # no arguments: a script that ran would fail to parse them
    namespace = runpy.run_path(str(path), run_name="__mp_main__")
    assert callable(namespace.get("main")), f"{path.name} should keep its work in main()"
    assert capsys.readouterr().out == ""


def test_the_readme_quick_start_trains(tmp_path, monkeypatch):
    """The three lines at the top of the README run as written (logs and a checkpoint land in the working directory,
    here a temporary one), on a small graph at the path they name."""
    import re

    import lightning
    import torch

    from lightning_ooc import OutOfCoreNodeData
    from lightning_ooc.models import GraphSAGE
    from lightning_ooc.testing import make_synthetic

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"```python\n(dm = OutOfCoreNodeData\(\"data/demo\"\).*?)```", readme, re.S)
    assert block is not None, "the README's quick start is gone"
    code = block.group(1)
    assert len(code.strip().splitlines()) == 3
    monkeypatch.chdir(tmp_path)
    make_synthetic(tmp_path / "data" / "demo", num_nodes=600, train_frac=0.3)
    namespace = {"OutOfCoreNodeData": OutOfCoreNodeData, "GraphSAGE": GraphSAGE, "lightning": lightning}
    exec(compile(code, "README.md", "exec"), namespace)
    model = namespace["model"]
    assert namespace["dm"].num_classes == 4
    assert model.trainer is not None and model.trainer.state.finished
    assert all(torch.isfinite(p).all() for p in model.parameters())
