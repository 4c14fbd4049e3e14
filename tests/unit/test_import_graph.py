"""The import graph of ``pace/``: no circles, and the math modules import no engine or distributed code.

Every ``pace/**/*.py`` is parsed with ``ast`` (nothing is imported). Every import statement counts,
module-level and inside functions, except those under ``if TYPE_CHECKING:`` (never run). Relative
imports are resolved against the importing module's package; ``from pace.x import y`` is an edge to
``pace.x.y`` when that is a module and to ``pace.x`` (its ``__init__``) when ``y`` is a name of it.
Importing ``pace.x.y`` also runs the
package ``pace.x`` (its ``__init__``), so that edge is added too, unless the importer lives inside
``pace.x`` (which is then already imported). A package's ``__init__`` importing its own submodules
counts like any other module. A failure names the shortest cycle of each circle found.

The math modules (STYLE.md principle 2) are checked transitively: neither they, nor the packages
above them (whose ``__init__`` runs first), nor any ``pace`` module those reach through the graph
(function-level imports included) may import ``vllm`` or ``torch.distributed``, in any form
(``import torch.distributed as dist``, ``from torch import distributed``, ``from vllm.x import y``).

The weight path (``pace/weights/``) reaches nothing of ``pace/rollout/`` through the graph, so that
its modules load (in an engine worker, in scripts/gpu_smoke.py) without the rollout's.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

MATH_MODULES = (
    "pace.staleness",
    "pace.pool.scoring",
    "pace.algo.loss",
    "pace.algo.correction",
    "pace.algo.m2po",
    "pace.algo.advantages",
    "pace.reward",
)
FORBIDDEN_IN_MATH = ("vllm", "torch.distributed")
WEIGHTS, ROLLOUT = "pace.weights", "pace.rollout"  # the weight path is the rollout's server, never its client


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def runtime_imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_names(name: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Absolute dotted names a statement imports: ``a.b`` for ``import a.b [as c]``; for
    ``from m import x`` both ``m`` and ``m.x`` (the caller keeps those that are modules)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = name if is_package(path) else name.rpartition(".")[0]
        base_parts = package.split(".")
        base_parts = base_parts[: len(base_parts) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]


@functools.cache
def parse_tree(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between the modules of ``root``/pace, every dotted name each module imports)."""
    files = {module_name(p, root): p for p in sorted((root / "pace").rglob("*.py"))}
    edges: dict[str, set[str]] = {name: set() for name in files}
    external: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in runtime_imports(tree):
            names = imported_names(name, path, node)
            if isinstance(node, ast.ImportFrom):
                base, members = names[0], names[1:]
                targets = [m for m in members if m in files]
                if len(targets) < len(members) or not members:  # a name from m itself: its __init__
                    targets.append(base)
            else:
                targets = names
            external[name].update(names)
            for target in targets:
                if target in files and target != name:
                    edges[name].add(target)
                parts = target.split(".")
                for i in range(1, len(parts)):  # the packages above the target run first
                    package = ".".join(parts[:i])
                    inside = name == package or name.startswith(package + ".")
                    if package in files and not inside:
                        edges[name].add(package)
    return edges, external


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def shortest_cycle(edges: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The shortest path start → … → start inside one component (the message names the shortest
    cycle of each component, and the component's size when it holds more modules)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges[v] & within):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start] + path[::-1][1:] + [start] if v != start else [start, start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def describe_cycles(edges: dict[str, set[str]]) -> list[str]:
    lines = []
    for component in strongly_connected(edges):
        cycle = min((shortest_cycle(edges, v, set(component)) for v in component), key=lambda c: (len(c), c))
        extra = f" (component of {len(component)}: {', '.join(component)})" if len(component) > len(cycle) - 1 else ""
        lines.append(" → ".join(cycle) + extra)
    return lines


def reachable(edges: dict[str, set[str]], starts: list[str]) -> dict[str, list[str]]:
    """Each module reachable from ``starts`` with its shortest route there (breadth-first)."""
    routes = {s: [s] for s in starts}
    order = list(starts)
    for v in order:
        for w in sorted(edges[v]):
            if w not in routes:
                routes[w] = routes[v] + [w]
                order.append(w)
    return routes


def test_no_import_cycles() -> None:
    edges, _ = parse_tree()
    cycles = describe_cycles(edges)
    assert not cycles, "import cycles in pace/:\n  " + "\n  ".join(cycles)


@pytest.mark.parametrize("math_module", MATH_MODULES)
def test_math_modules_import_no_engine_or_distributed(math_module: str) -> None:
    edges, external = parse_tree()
    assert math_module in edges, f"{math_module} is not a module of pace/ (update MATH_MODULES)"
    parts = math_module.split(".")
    packages = [".".join(parts[:i]) for i in range(1, len(parts))]  # their __init__ runs first
    offenders = [
        f"{' → '.join(route)} imports {name}"
        for module, route in reachable(edges, [math_module] + [p for p in packages if p in edges]).items()
        for name in sorted(external[module])
        for forbidden in FORBIDDEN_IN_MATH
        if name == forbidden or name.startswith(forbidden + ".")
    ]
    assert not offenders, f"{math_module} reaches engine/distributed code: " + "; ".join(offenders)


def rollout_reached_from_weights(edges: dict[str, set[str]]) -> list[str]:
    """Each route from a ``pace.weights`` module to a ``pace.rollout`` one (shortest, one per target)."""
    inside = lambda name, package: name == package or name.startswith(package + ".")  # noqa: E731
    starts = [m for m in sorted(edges) if inside(m, WEIGHTS)]
    return [" → ".join(route) for module, route in reachable(edges, starts).items() if inside(module, ROLLOUT)]


def test_the_weight_path_imports_nothing_from_the_rollout() -> None:
    edges, _ = parse_tree()
    assert any(m.startswith(WEIGHTS + ".") for m in edges), f"no {WEIGHTS} modules in pace/ (update WEIGHTS)"
    routes = rollout_reached_from_weights(edges)
    assert not routes, f"{WEIGHTS} reaches {ROLLOUT}: " + "; ".join(routes)


def test_the_graph_reads_every_kind_of_import(tmp_path: Path) -> None:
    """The parser on a tree of its own: a function-level relative import, ``import a.b as c``, a
    relative import two levels up, a package's ``__init__`` reached through its submodule; an import
    under ``if TYPE_CHECKING:`` is no edge."""
    files = {
        "pace/__init__.py": "",
        "pace/a.py": "def f():\n    from . import b\n",
        "pace/b.py": "import pace.sub.c as c\n",
        "pace/sub/__init__.py": "from .c import X\n",
        "pace/sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pace import b\nX = 1\n",
        "pace/sub/d.py": "from ..a import f\n",
        "pace/e.py": "from pace.sub import d\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges, _ = parse_tree(tmp_path)
    assert edges["pace.a"] == {"pace.b"}
    assert edges["pace.b"] == {"pace.sub.c", "pace.sub"}  # pace.sub's __init__ runs first
    assert edges["pace.sub"] == {"pace.sub.c"} and edges["pace.sub.c"] == set()
    assert edges["pace.sub.d"] == {"pace.a"} and edges["pace.e"] == {"pace.sub.d", "pace.sub"}
    assert describe_cycles(edges) == []
    (tmp_path / "pace/sub/c.py").write_text("def g():\n    import pace.e\n")
    parse_tree.cache_clear()
    assert describe_cycles(parse_tree(tmp_path)[0]) == [
        "pace.e → pace.sub → pace.sub.c → pace.e"
        " (component of 6: pace.a, pace.b, pace.e, pace.sub, pace.sub.c, pace.sub.d)"]
