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
