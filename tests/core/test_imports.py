"""How the package's modules import each other: no cycle, and no import from a higher floor.

Every import between two `multihead` modules counts: at module level, inside a function (an
import deferred to run time is still a dependency) and under ``TYPE_CHECKING`` (a type-only cycle
still ties the two modules together). ``from multihead.a import b`` names the module ``a.b`` when
there is one, else the package ``a``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

#: The floor of each top-level module and package of `multihead`, as docs/architecture.md's table
#: draws them (1 core, 2 building blocks, 3 layers, 4 applications); a test below reads the table
#: and fails when the two differ.
FLOORS = {
    **dict.fromkeys(
        [
            "conventions",
            "blocks",
            "values",
            "masks",
            "scores",
            "sinks",
            "scoring",
            "call",
            "reference",
            "blockwise",
            "merge",
            "cascade",
        ],
        1,
    ),
    **dict.fromkeys(
        ["nonfinite", "inputs", "validation", "attention", "explain", "plans", "guards", "memo", "backends"], 1
    ),
    **dict.fromkeys(["caches", "positions"], 2),
    **dict.fromkeys(["layers", "capture", "hooks", "distributed"], 3),
    **dict.fromkeys(["models", "viz", "apps", "integrations"], 4),
}
#: Modules the table leaves out, placed by the doc's words: the version (imports nothing), the
#: package itself ("`import multihead` loads floors 1-3") and `python -m multihead` (the CLI).
UNLISTED = {"_version": 1, "": 3, "__main__": 4}


def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "multihead").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """``module -> the multihead modules it imports``."""
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package this module is in
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                while target and target not in known:  # import a.b.c of a module a.b: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def floor_of(module: str) -> int | None:
    """The floor of ``multihead.x...`` (``x``'s), ``None`` when neither table has it."""
    top = module.split(".")[1] if "." in module else ""
    return FLOORS.get(top, UNLISTED.get(top))


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module on a higher floor than the importer's, as a readable line."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            low, high = floor_of(module), floor_of(target)
            if low is not None and high is not None and high > low:
                found.append(f"{module} (floor {low}) imports {target} (floor {high})")
    return found


def documented_floors() -> dict[str, int]:
    """``name -> floor`` of the table in docs/architecture.md: a row's floor is the last one named
    in the first column, its modules the backticked ``x.py`` and ``x/`` of the second."""
    floors: dict[str, int] = {}
    floor = None
    for line in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) < 2 or not re.match(r"(\d|$)", cells[0]):
            continue  # not a row of the floors' table (its header and rule included)
        if cells[0]:
            floor = int(cells[0].split()[0])
        for name in re.findall(r"`(\w+)(?:\.py|/)`", cells[1]):
            floors[name] = floor
    return floors


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
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
                    work.append((child, iter(sorted(graph[child]))))
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


def test_the_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_every_kind_of_import():
    graph = import_graph()
    assert "multihead.scores.base" in graph["multihead.scores.user"]  # module level
    assert "multihead.attention" in graph["multihead"]  # the package's own __init__
    assert len(graph) > 80


def test_no_module_imports_itself_back():
    found = cycles(import_graph())
    assert found == [], f"import cycles (module level, deferred or type-only): {found}"


def test_the_floor_check_sees_an_upward_import():
    graph = {"multihead.backends.sdpa": {"multihead.layers.heads", "multihead.masks"}, "multihead.layers": set()}
    assert upward_imports(graph) == ["multihead.backends.sdpa (floor 1) imports multihead.layers.heads (floor 3)"]


def test_every_module_has_a_floor():
    missing = sorted(m for m in import_graph() if floor_of(m) is None)
    assert missing == [], f"modules with no floor (add them to docs/architecture.md's table and FLOORS): {missing}"


def test_the_floors_are_the_ones_the_architecture_doc_draws():
    assert documented_floors() == FLOORS


def test_no_module_imports_from_a_higher_floor():
    found = upward_imports(import_graph())
    assert found == [], "imports from a higher floor (module level, deferred or type-only):\n" + "\n".join(found)


def test_masks_and_scores_share_the_value_base_and_import_nothing_of_each_other():
    """Issue 27, item 4: one value-object base (multihead.values) under both families, so that
    neither reaches into the other for its value machinery."""
    graph = import_graph()
    for family, other in (("multihead.scores", "multihead.masks"), ("multihead.masks", "multihead.scores")):
        members = [m for m in graph if m == family or m.startswith(family + ".")]
        crossing = sorted((m, t) for m in members for t in graph[m] if t == other or t.startswith(other + "."))
        assert crossing == [], f"{family} imports {other}: {crossing}"
    assert "multihead.values" in graph["multihead.masks.base"] and "multihead.values" in graph["multihead.scores.base"]
