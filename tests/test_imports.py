"""No import cycle in the package: each module's imports of speculant modules (at the top or inside a function,
type-checking imports aside) form a graph without a circle, so every module can be read, imported and tested from
its own dependencies up."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "speculant"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run, leaving out `if TYPE_CHECKING:` blocks."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        found += runtime_imports(node)
    return found


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    graph = {}
    for name, path in names.items():
        deps = set()
        for node in runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod itself.
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports (its modules in order, the first again at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the path being walked, "done" after

    def walk(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := walk(dep, path + [dep])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := walk(start, [start])):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "speculant.engine" in graph and "speculant.scheduler" in graph["speculant.engine"]
    cycle = find_cycle(graph)
    assert cycle is None, " → ".join(cycle)


def test_models_import_nothing_above_them():
    """models/ is the bottom layer: the decoder, its kernels and loaders know nothing of engines or servers."""
    up = {name: sorted(d for d in deps if not d.startswith(("speculant.models", "speculant.errors")))
          for name, deps in import_graph().items() if name.startswith("speculant.models")}
    assert not any(up.values()), {name: deps for name, deps in up.items() if deps}


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


UPPER = ("speculant.engine", "speculant.drafting", "speculant.grammar_steps", "speculant.scheduler", "speculant.server",
         "speculant.llm", "speculant.runner", "speculant.cli", "speculant.arguments", "speculant.bench",
         "speculant.training", "speculant.audit")


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_grammars_proposers_and_models_reach_nothing_of_the_engine_or_server():
    """structured/, proposers/ and models/ are the engine's parts: not one of their imports, however indirect,
    leads back up into the engine, its scheduler, the server or the tools above them."""
    graph = import_graph()
    up = {name: sorted(d for d in reachable(graph, name) if d.startswith(UPPER))
          for name in graph if name.startswith(("speculant.structured", "speculant.proposers", "speculant.models"))}
    assert not any(up.values()), {name: deps for name, deps in up.items() if deps}


def test_structured_stands_on_config_and_models_alone():
    """Grammars and tool formats know the request's settings (config.py) and the models' tokenizers, nothing of how
    a step drafts or samples: the step's grammar hooks live beside the drafting step (grammar_steps.py)."""
    graph = import_graph()
    below = ("speculant.structured", "speculant.config", "speculant.defaults", "speculant.errors", "speculant.models")
    up = {name: sorted(d for d in reachable(graph, name) if not d.startswith(below))
          for name in graph if name.startswith("speculant.structured")}
    assert not any(up.values()), {name: deps for name, deps in up.items() if deps}
