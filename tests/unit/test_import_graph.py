"""The house's import rules, read from the source (no import is executed): no import cycle among
partitioner/, passes/ and runtime/, and runtime/ never imports the compiler (docs/design.md §3:
generated programs run with torch and runtime alone).

Every import counts, a function-local one too (it hides a cycle, it does not remove it), except
those under ``if TYPE_CHECKING:``, which only annotate.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("partitioner", "passes", "runtime")

# Cycles known and accepted (none: data flows one way, trace -> ... -> program folder).
KNOWN_CYCLES: list[set[str]] = []


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of import nodes under ``if TYPE_CHECKING:``."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from package import module` depends on that module; `from module import name` on the module
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target)
    return graph


def test_runtime_imports_nothing_from_the_compiler_or_its_passes():
    graph = import_graph()
    reaching_out = sorted((a, b) for a, b in graph.edges
                          if a.split(".")[0] == "runtime" and b.split(".")[0] in ("partitioner", "passes"))
    assert reaching_out == [], f"runtime must run without the compiler: {reaching_out}"


def test_no_import_cycle_beyond_the_known_ones():
    graph = import_graph()
    tangles = [set(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    unknown = [sorted(t) for t in tangles if t not in KNOWN_CYCLES]
    assert unknown == [], "import cycles: " + "; ".join(
        " -> ".join(c + [c[0]]) for t in unknown for c in nx.simple_cycles(graph.subgraph(t)))
    gone = [sorted(k) for k in KNOWN_CYCLES if k not in tangles]
    assert gone == [], f"{gone} no longer form a cycle: take them off KNOWN_CYCLES"


def test_every_import_of_our_packages_in_benchmarks_and_tests_resolves():
    """Benchmarks import most of what they use inside functions, so a renamed module or name would
    surface only in `make bench`, minutes in: resolve every such import here instead."""
    import ast
    import importlib

    missing = []
    for folder in ("benchmarks", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
                    continue
                if node.module.split(".")[0] not in PACKAGES:
                    continue
                try:
                    module = importlib.import_module(node.module)
                except ImportError as exc:
                    missing.append(f"{path.name}:{node.lineno} {node.module} ({exc})")
                    continue
                for alias in node.names:
                    if alias.name != "*" and not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            missing.append(f"{path.name}:{node.lineno} {node.module}.{alias.name}")
    assert missing == [], missing


def test_every_package_folder_is_listed_in_pyproject():
    """pyproject.toml lists the import packages explicitly (docs/design.md §3): a new room left off
    the list works in this editable checkout and is missing from a real install."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {str(p.parent.relative_to(REPO)).replace("/", ".") for top in PACKAGES
             for p in (REPO / top).rglob("__init__.py")}
    assert found == listed, f"in the tree, not listed: {sorted(found - listed)}; listed, not in the tree: {sorted(listed - found)}"


# ---- Rooms ------------------------------------------------------------------------------------
# Note [rooms in one order]: each package's rooms (its sub-folders; the modules at a package's top
# are its base, or its top) stand in one order, and a room imports only rooms before it: what a
# newcomer reads first never needs what comes later. The order is the one data flows in (runtime:
# a program is described, then executed, then kept safe, then launched; partitioner: what the user
# asks, the solver's plain numbers, the views of them, the front end, the models, the back end, the
# measured time model, the command), so a module that wants a later room is in the wrong room.
ROOM_ORDER = {
    "runtime": ["data", "program", "observe", "parallel", "execute", "resilience", "features", "launch"],
    "partitioner": ["config", "solver", "inspect", "frontend", "models", "codegen", "calibrate"],
    "passes": [],
}
# A face stands over the whole compiler and is in no order: the command may import anything.
FACES = {"partitioner": ["cli"], "runtime": [], "passes": []}
# Modules at a package's top: the base every room may import, and the top no room may.
BASE = {"runtime.errors", "runtime.python_version", "runtime.file_trust", "runtime.exchange", "partitioner.errors", "passes.ir"}
TOP = {"partitioner.compiler", "partitioner.compiled", "partitioner.__main__", "partitioner"}


def room_of(module: str) -> tuple[str, int] | None:
    """(package, index in its ROOM_ORDER) of a module in a room; None for a package's top-level module."""
    package, _, rest = module.partition(".")
    room = rest.partition(".")[0]
    order = ROOM_ORDER[package]
    return (package, order.index(room)) if room in order else None


def arrows_up(graph: nx.DiGraph) -> list[str]:
    """Every import from a room of a later room, or of the package's top."""
    out = []
    for a, b in sorted(graph.edges):
        ra, rb = room_of(a), room_of(b)
        if ra is None or a.split(".")[1] in FACES[a.split(".")[0]]:
            continue
        if b in TOP or (rb is not None and ra[0] == rb[0] and rb[1] > ra[1]):
            out.append(f"{a} -> {b}")
    return out


def test_every_folder_is_a_room_in_the_order():
    rooms = {package: sorted(p.name for p in (REPO / package).iterdir() if (p / "__init__.py").is_file())
             for package in PACKAGES}
    assert rooms == {package: sorted(order + FACES[package]) for package, order in ROOM_ORDER.items()}, \
        "a new folder takes its place in ROOM_ORDER (Note [rooms in one order])"


def test_no_room_imports_a_later_room_or_the_top():
    up = arrows_up(import_graph())
    assert up == [], "imports against the room order (Note [rooms in one order]):\n" + "\n".join(up)


def test_the_room_rule_finds_an_arrow_up():
    graph = nx.DiGraph([("runtime.program.spec", "runtime.execute.stage"), ("runtime.execute.stage", "runtime.program.spec"),
                        ("partitioner.solver.model", "partitioner.compiler"), ("partitioner.cli.commands", "partitioner.compiler")])
    assert arrows_up(graph) == ["partitioner.solver.model -> partitioner.compiler",
                                "runtime.program.spec -> runtime.execute.stage"]
