"""No module imports a name it never uses (what `python -m pyflakes partitioner/ runtime/ passes/`
reports as "imported but unused"), read from the source: a stale import hides an edge of the
import graph (tests/unit/test_import_graph.py) and tells the reader of a dependency there is not.

A name a module re-exports is used when the module lists it in ``__all__``: that is how a caller is
told it may take the name from here (partitioner/calibrate/machine.py, partitioner/config/cluster.py).
The rule is a function from source text to its offenders (``file:line: what``), fed a broken input
below; pyflakes is not a dependency of the project, so the rule is written here.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("partitioner", "passes", "runtime")


def _bound(node: ast.Import | ast.ImportFrom) -> list[tuple[str, str]]:
    """(name bound, as written) of each alias of an import; `import a.b` binds `a`."""
    out = []
    for alias in node.names:
        if alias.name == "*":
            continue
        bound = alias.asname or (alias.name.split(".")[0] if isinstance(node, ast.Import) else alias.name)
        out.append((bound, alias.name))
    return out


def _annotation_names(tree: ast.AST) -> set[str]:
    """Names inside string annotations (``"ClusterSpec"``, ``"list[int] | None"``)."""
    annotations = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations.append(node.returns)
            every = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            annotations += [a.annotation for a in every + [node.args.vararg, node.args.kwarg] if a is not None]
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
    names: set[str] = set()
    for annotation in annotations:
        for part in ast.walk(annotation) if annotation is not None else ():
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                try:
                    names |= {n.id for n in ast.walk(ast.parse(part.value, mode="eval")) if isinstance(n, ast.Name)}
                except SyntaxError:
                    pass  # a string that is no expression names nothing
    return names


def _exported(tree: ast.Module) -> set[str]:
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            out |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return out


def unused_import_problems(sources: dict[str, str]) -> list[str]:
    problems = []
    for path, text in sources.items():
        tree = ast.parse(text)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | _annotation_names(tree) | _exported(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "module", None) == "__future__":
                continue
            for bound, written in _bound(node):
                if bound not in used:
                    problems.append(f"{path}:{node.lineno}: {written!r} imported but unused: remove it, or list it "
                                    "in __all__ where callers take it from here")
    return sorted(problems, key=lambda p: (p.split(":")[0], int(p.split(":")[1])))


def test_no_module_imports_a_name_it_never_uses():
    sources = {str(p.relative_to(REPO)): p.read_text() for root in PACKAGES for p in sorted((REPO / root).rglob("*.py"))}
    problems = unused_import_problems(sources)
    assert not problems, f"{len(problems)} unused imports:\n" + "\n".join(problems)


def test_the_rule_finds_the_unused_one_and_spares_the_used_and_the_exported():
    source = (
        "from __future__ import annotations\n"
        "import os.path\n"
        "import json\n"
        "from typing import Mapping, Sequence\n"
        "from a import b as c, d\n"
        "__all__ = ['d']\n\n\n"
        "def f(x: 'Mapping[str, int]') -> None:\n"
        "    import re  # lazy: a test\n"
        "    return os.path.join(c)\n")
    assert unused_import_problems({"m.py": source}) == [
        "m.py:3: 'json' imported but unused: remove it, or list it in __all__ where callers take it from here",
        "m.py:4: 'Sequence' imported but unused: remove it, or list it in __all__ where callers take it from here",
        "m.py:10: 're' imported but unused: remove it, or list it in __all__ where callers take it from here",
    ]
