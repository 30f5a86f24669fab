"""The package's layer order (docs/architecture.md), enforced on every import, also inside functions.

A module may import from its own component (e.g. `retrieval` from `retrieval`) and from components
of lower layers only. The `t5r` dispatch table in `cli.py` names commands by string
(`importlib.import_module`), which is the one way a lower layer reaches a higher one.
"""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first. Components in one layer do not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("artefact_io",),
    ("__init__", "logs", "gin_utils", "sharding", "checksums"),
    ("data",),
    ("tasks",),
    ("checkpoint",),
    ("models",),
    ("losses", "multitask", "retrieval", "optim"),
    ("inference",),
    ("train_step",),
    ("train", "query_side", "fusion", "export", "probe", "searcher", "plan"),
    ("stages",),
    ("ance",),
    ("results",),
    ("demo",),
    ("commands", "cli"),
]
LAYER_OF = {component: i for i, layer in enumerate(LAYERS) for component in layer}


def component_of(module: str) -> str | None:
    """'t5_retrieval.data.stores.kb' -> 'data'; third-party modules -> None."""
    parts = module.split(".")
    if parts[0] != "t5_retrieval":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def source_files() -> list[tuple[str, str]]:
    """(path, module name) of every Python file of the library (task declarations included)."""
    out = []
    for top in ("t5_retrieval",):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    out.append((path, rel.removesuffix(".__init__")))
    return out


def imported_modules(path: str) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth; `from p import a` yields p.a."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [(node.lineno, f"{absolute_module(path, node)}.{alias.name}") for alias in node.names]
    return out


def absolute_module(path: str, node: ast.ImportFrom) -> str:
    """The module `from ... import` names, a relative one resolved against the file's package (the
    export's standalone `modeling_t5r.py` imports its sibling so: transformers copies only those)."""
    if node.level == 0:
        return node.module
    package = os.path.relpath(os.path.dirname(path), REPO).split(os.sep)
    return ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])])


def upward_imports() -> list[str]:
    problems = []
    for path, module in source_files():
        own = component_of(module)
        for line, target in imported_modules(path):
            other = component_of(target)
            if other is None or other == own:
                continue
            if LAYER_OF[other] >= LAYER_OF[own]:
                problems.append(f"{os.path.relpath(path, REPO)}:{line}: {own} (layer {LAYER_OF[own]}) imports "
                                f"{target} ({other}, layer {LAYER_OF[other]})")
    return problems


def module_of(target: str, modules: set[str]) -> str | None:
    """The library module an import names: 'p.m.Class' -> 'p.m' (the longest known prefix)."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def import_cycles() -> list[list[str]]:
    """Cycles among the modules of one component (e.g. `data.tasks.retrieval_tasks` <-> `data.tasks.task_names`).

    Imports across components are ordered by the layers; inside a component nothing orders them, so
    this is where a cycle hides. A package importing its own submodules (`__init__` re-exports) is not
    counted: Python runs the package first, so that edge cannot make a cycle at import time."""
    files = source_files()
    modules = {module for _, module in files}
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for path, module in files:
        for _, target in imported_modules(path):
            other = module_of(target, modules)
            if other and other != module and component_of(other) == component_of(module) \
                    and not other.startswith(module + "."):
                graph[module].add(other)
    cycles, done, stack = [], set(), []

    def visit(node: str) -> None:
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt in stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt)
        stack.pop()
        done.add(node)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return cycles


def test_no_import_cycle_inside_a_component():
    cycles = import_cycles()
    assert not cycles, "import cycles (break them by moving the shared piece into a module both import):\n" + \
        "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    package = tmp_path / "t5_retrieval" / "data"
    package.mkdir(parents=True)
    (package / "a.py").write_text("from t5_retrieval.data.b import f\n")
    (package / "b.py").write_text("def f():\n    from t5_retrieval.data import a\n    return a\n")
    monkeypatch.setattr(__import__(__name__), "REPO", str(tmp_path))
    assert import_cycles() == [["t5_retrieval.data.a", "t5_retrieval.data.b", "t5_retrieval.data.a"]]


def test_every_component_has_a_layer():
    components = {component_of(module) for _, module in source_files()}
    missing = sorted(components - set(LAYER_OF))
    assert not missing, f"components not placed in LAYERS (and docs/architecture.md): {missing}"


def test_no_module_imports_from_its_own_layer_or_above():
    problems = upward_imports()
    order = " < ".join(", ".join(layer) for layer in LAYERS)
    assert not problems, "imports against the layer order " + order + ":\n" + "\n".join(problems)


def test_the_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    """The scan must catch a lazy import, the usual way a back-edge hides."""
    package = tmp_path / "t5_retrieval" / "data"
    package.mkdir(parents=True)
    (package / "sneaky.py").write_text("def f():\n    from t5_retrieval.train import train\n    return train\n")
    monkeypatch.setattr(__import__(__name__), "REPO", str(tmp_path))
    assert upward_imports() == [
        f"t5_retrieval/data/sneaky.py:2: data (layer {LAYER_OF['data']}) imports t5_retrieval.train.train "
        f"(train, layer {LAYER_OF['train']})"]


@pytest.mark.parametrize("module,component", [("t5_retrieval.data.stores.kb", "data"), ("t5_retrieval.tasks.kilt", "tasks"),
                                              ("t5_retrieval", "__init__"), ("numpy", None)])
def test_component_of(module, component):
    assert component_of(module) == component
