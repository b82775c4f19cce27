"""The architecture page's worked example (adding a feature backend) runs as written and does what it says."""
import re
from pathlib import Path

import pytest

from lightning_ooc.loader import registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _example() -> str:
    text = DOC.read_text()
    section = text.split("### Worked example: adding a feature backend", 1)
    assert len(section) == 2, "the architecture page's worked example is gone"
    block = re.search(r"```python\n(.*?)```", section[1], re.S)
    assert block is not None, "the worked example has no python block"
    return block.group(1)


@pytest.fixture
def clean_grid():
    saved = dict(registry.SOURCES), dict(registry.BACKENDS), dict(registry.BACKEND_TYPES)
    yield
    for table, before in zip((registry.SOURCES, registry.BACKENDS, registry.BACKEND_TYPES), saved):
        table.clear()
        table.update(before)


def test_the_worked_example_adds_a_backend_that_runs(clean_grid, capsys):
    namespace = {"__name__": "worked_example"}
    exec(compile(_example(), str(DOC), "exec"), namespace)
    # it printed what the comment says: the backend as given, and noise of its std on the batch's rows
    assert capsys.readouterr().out.split() == ["NoisyRows(std=0.5)", "0.5"]
    noisy = namespace["NoisyRows"]
    # one registration put it in the grid for the tasks named, and nowhere else
    assert {t for (t, b) in registry.SOURCES if b == "noisy"} == {"node", "link"}
    assert registry.SOURCES["link", "noisy"].task_type is registry.TASKS["link"].batches
    assert registry.BACKENDS["noisy"] == "features in RAM with Gaussian noise"
    # its setting is checked once, at construction, and kept for checkpoints as LightningCLI writes a class
    with pytest.raises(Exception, match="std must be a number >= 0"):
        noisy(std=-1)
    assert noisy(std=0.25).plain() == {"class_path": "worked_example.NoisyRows", "init_args": {"std": 0.25}}
    # a task it was not registered for is the grid's one error, naming both
    from lightning_ooc.errors import InputError
    from lightning_ooc.loader.config import NodeDataConfig
    from lightning_ooc.loader.context import ProcessContext

    with pytest.raises(InputError, match="node classification on a heterogeneous graph over features in RAM with "
                                         "Gaussian noise is not supported"):  # fmt: skip
        registry.source("hetero", NodeDataConfig("r", features=noisy()), ProcessContext())
