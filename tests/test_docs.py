"""The examples in docstrings run and give what they show.

The modules are found in the package itself: every module whose source holds an example (``>>>`` in a docstring)
is a case, so a new module's examples run without being listed anywhere.
"""
import ast
import doctest
import importlib
from pathlib import Path

import pytest

import lightning_ooc

PACKAGE = Path(lightning_ooc.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _has_examples(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if ">>>" in (ast.get_docstring(node, clean=False) or ""):
                return True
    return False


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")
WITH_EXAMPLES = [_module_name(p) for p in SOURCES if _has_examples(p)]

#: modules that had examples when the list was kept by hand: each must keep at least one
LISTED = [
    "lightning_ooc",
    "lightning_ooc.data.format",
    "lightning_ooc.data.dataset",
    "lightning_ooc.data.commit",
    "lightning_ooc.data.writer",
    "lightning_ooc.data.synth",
    "lightning_ooc.data.prepare",
    "lightning_ooc.data.link_splits",
    "lightning_ooc.data.hetero_dataset",
    "lightning_ooc.data.synth_hetero",
    "lightning_ooc.data.prepare_hetero",
    "lightning_ooc.testing",
    "lightning_ooc.io",
    "lightning_ooc.io.reader",
    "lightning_ooc.io.bulk",
    "lightning_ooc.io.stats",
    "lightning_ooc.store.feature_buffer",
    "lightning_ooc.store.staging",
    "lightning_ooc.store.host_cache",
    "lightning_ooc.store.uva",
    "lightning_ooc.store.tiered",
    "lightning_ooc.store.tiers",
    "lightning_ooc.store.factory",
    "lightning_ooc.store.planner",
    "lightning_ooc.store.limits",
    "lightning_ooc.store.tally",
    "lightning_ooc.store.typed_stores",
    "lightning_ooc.utils.cancel",
    "lightning_ooc.embed.batch",
    "lightning_ooc.embed.table",
    "lightning_ooc.embed.buckets",
    "lightning_ooc.embed.partition_buffer",
    "lightning_ooc.embed.order",
    "lightning_ooc.embed.optim",
    "lightning_ooc.embed.embedding_data",
    "lightning_ooc.embed.rows",
    "lightning_ooc.loader.learnable_passes",
    "lightning_ooc.models.kge",
    "lightning_ooc.utils.logs",
    "lightning_ooc.loader.config",
    "lightning_ooc.loader.features",
    "lightning_ooc.loader.settings",
    "lightning_ooc.loader.batches",
    "lightning_ooc.loader.context",
    "lightning_ooc.loader.source",
    "lightning_ooc.loader.link_task",
    "lightning_ooc.models",
    "lightning_ooc.models.node_classifier",
    "lightning_ooc.models.checks",
    "lightning_ooc.models.relational",
    "lightning_ooc.datamodule",
    "lightning_ooc.callbacks",
    "lightning_ooc.strategy.ooc",
    "lightning_ooc.strategy.shared",
    "lightning_ooc.strategy.mps",
    "lightning_ooc.strategy.signals",
    "lightning_ooc.utils.trace",
    "lightning_ooc.partitioned.partition",
    "lightning_ooc.store.policy",
    "lightning_ooc.loader.partitioned",
    "lightning_ooc.store.scored_cache",
    "lightning_ooc.cli",
]


def test_every_listed_module_still_has_examples():
    assert sorted(set(LISTED) - set(WITH_EXAMPLES)) == []


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0


#: the packages whose ``__all__`` is the public surface a user reads first
PUBLIC = ["lightning_ooc", "lightning_ooc.models"]


@pytest.mark.parametrize("package", PUBLIC)
def test_every_public_class_has_an_example(package):
    import inspect

    module = importlib.import_module(package)
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) and ">>>" not in (obj.__doc__ or ""):
            missing.append(name)
    assert missing == [], f"classes of {package}.__all__ without an example in their docstring: {missing}"


def _example_lines(path: Path) -> list[str]:
    """The example lines (``>>>`` and ``...``) of every docstring of a module's source."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True) or ""
            lines += [ln.strip() for ln in doc.splitlines() if ln.strip().startswith((">>>", "..."))]
    return lines


def test_every_class_a_module_lists_as_public_has_a_running_example():
    """Every class in the ``__all__`` of any module of the package has an example that runs (the doctests above):
    in its own docstring, or in another docstring of the module that defines it, naming it."""
    import inspect
    import re
    import sys

    missing = set()
    for path in SOURCES:
        module = importlib.import_module(_module_name(path))
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if not inspect.isclass(obj) or not obj.__module__.startswith("lightning_ooc"):
                continue
            if ">>>" in (obj.__doc__ or ""):
                continue
            home = Path(sys.modules[obj.__module__].__file__)
            if not any(re.search(rf"\b{obj.__name__}\b", ln) for ln in _example_lines(home)):
                missing.add(f"{obj.__module__}.{obj.__name__}")
    assert sorted(missing) == [], "\n".join(sorted(missing))
