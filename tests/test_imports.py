"""The package's import graph has no circle.

The graph is read from the source with the standard library (``ast``): an edge for every import of a module of the
package, at module top or inside a function (a function-level import is an edge too: it runs when the function
does), leaving out only imports under ``if TYPE_CHECKING:``. ``from P import n`` is an edge to ``P.n`` where that is
a module, else to ``P``. Importing ``P.n`` also runs ``P/__init__.py``; that implied edge is not counted, so a
package's ``__init__`` may import its own modules.
"""
import ast
import sys
from collections import defaultdict
from pathlib import Path

import lightning_ooc

PACKAGE = Path(lightning_ooc.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for folder in (PACKAGE.parent / "ext").iterdir():  # the compiled modules (setup.py: ext/NAME -> _NAME): leaves
        if folder.is_dir() and folder.name != "include":
            mods[f"lightning_ooc._{folder.name}"] = folder
    return mods


def _absolute(module: str | None, level: int, importer: str, is_package: bool) -> str:
    if not level:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        if path.suffix != ".py":
            continue
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST) -> None:
            for child in ast.iter_child_nodes(node):
                if _type_checking(child):
                    continue
                if isinstance(child, ast.Import):
                    graph[name].update(a.name for a in child.names if a.name in mods)
                elif isinstance(child, ast.ImportFrom):
                    base = _absolute(child.module, child.level, name, is_package)
                    for alias in child.names:
                        target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                        if target in mods:
                            graph[name].add(target)
                visit(child)

        visit(ast.parse(path.read_text(), str(path)))
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_real_edges():
    graph = import_graph()
    # top-level and function-level imports, relative and absolute, ``from P import module``
    assert "lightning_ooc.data.dataset" in graph["lightning_ooc"]
    assert "lightning_ooc.models.checks" in graph["lightning_ooc.models.kge"]
    assert "lightning_ooc.lightning_cli" in graph["lightning_ooc.cli"]  # inside a function
    assert "lightning_ooc._io" in graph["lightning_ooc.io.backends"]  # a compiled module


def test_a_circle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_circle():
    found = cycles(import_graph())
    assert found == [], "import circles (each a set of modules that import each other, directly or not): " + \
        "; ".join(" <-> ".join(c) for c in found)


def _function_imports():
    """(file, line, statement, has a reason) of every import inside a function of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            guarded = set()  # an import inside try/except ImportError: optional, the handler says what then
            for node in ast.walk(fn):
                if isinstance(node, ast.Try) and any(h.type is not None and "ImportError" in ast.unparse(h.type)
                                                     for h in node.handlers):  # fmt: skip
                    guarded.update(id(n) for b in node.body for n in ast.walk(b))
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    line, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
                    reason = "#" in line or above.startswith("#") or id(node) in guarded
                    yield path.relative_to(PACKAGE.parent), node.lineno, ast.unparse(node), reason


def test_imports_are_at_module_top_or_say_why_not():
    # imports inside functions are for heavy or optional dependencies (Lightning, PyG, Triton, matplotlib,
    # torch-sparse, pymetis, the native modules) or modules that import them, each with its reason beside it
    missing = [f"{p}:{n}: {s}" for p, n, s, reason in _function_imports() if not reason]
    assert missing == [], "imports inside functions without a reason (move them to the top, or say why):\n" + \
        "\n".join(missing)


def test_a_function_import_without_a_reason_is_found(tmp_path, monkeypatch):
    pkg = tmp_path / "lightning_ooc"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f():\n    import json\n\n\ndef g():\n    import yaml  # lazy: a reason\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    found = [(str(p), n, reason) for p, n, _, reason in _function_imports()]
    assert found == [("lightning_ooc/m.py", 2, False), ("lightning_ooc/m.py", 6, True)]


def test_the_data_commands_never_import_lightning(tmp_path):
    # the reason the imports left inside functions are there: synth, info and the parser (every subcommand's
    # options, bench included) stay free of Lightning, PyG's loaders and matplotlib
    import subprocess

    code = (
        "import sys\n"
        "from lightning_ooc.cli import build_parser, main\n"
        "build_parser()\n"
        f"assert main(['synth', '--out', {str(tmp_path / 'g')!r}, '--nodes', '300', '--avg-degree', '4', "
        "'--dim', '4', '--classes', '2']) == 0\n"
        f"assert main(['info', {str(tmp_path / 'g')!r}]) == 0\n"
        "print(sorted(m for m in ('lightning', 'lightning.pytorch', 'matplotlib') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"
