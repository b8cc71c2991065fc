"""No schedule name comparisons outside the schedule module (Note [one class per schedule] in
runtime/program/schedules.py), read from the source as tests/unit/test_house_rules.py reads it
(nothing here imports the product).

A caller asks the schedule object (``split_backward``, ``replans``, ``canary_refusal``, ...); only
runtime/program/schedules.py and its priced half, partitioner/solver/schedules.py, spell a name in a
comparison. The rule is a function from source text to its offenders (``file:line: what``), so a
test feeds it the forms it must catch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("partitioner", "passes", "runtime", "benchmarks")
SCHEDULE_MODULES = ("runtime/program/schedules.py", "partitioner/solver/schedules.py")
_NAMED = ("schedule", "schedule_name")  # a variable or attribute holding a schedule's name


def schedule_names(module_source: str) -> set[str]:
    """The names the schedule module gives its classes and its refused schedules."""
    names = set(re.findall(r'name: ClassVar\[str\] = "(\w+)"', module_source))
    refused = re.search(r"^REFUSED = \{(.*?)\}$", module_source, re.M | re.S)
    return names | set(re.findall(r'"(\w+)":', refused.group(1) if refused else ""))


def _ident(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _spells_a_name(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_spells_a_name(e, names) for e in node.elts)
    return False


def _registry(node: ast.AST) -> bool:
    """A module-level table of schedule names (SCHEDULES, SCHEDULE_ORDER, AUTO, ...), LR_ ones aside."""
    ident = _ident(node) or ""
    return ident.isupper() and ("SCHEDULE" in ident or ident == "AUTO") and not ident.startswith("LR_")


def comparison_problems(sources: dict[str, str], names: set[str]) -> list[str]:
    """Comparisons that decide by a schedule's name: against a literal name, membership in a table
    of names, or a name-holding variable against a constant or another one."""
    out = []
    for path, text in sources.items():
        if path in SCHEDULE_MODULES:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Compare) or all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                continue
            operands = [node.left, *node.comparators]
            named = [o for o in operands if _ident(o) in _NAMED]
            if any(_spells_a_name(o, names) for o in operands):
                why = "compares with a schedule's name"
            elif any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and _registry(node.comparators[-1]):
                why = "tests membership in a table of schedule names"
            elif named and (len(named) > 1 or any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
                            or any(isinstance(o, ast.Constant) and isinstance(o.value, str) or _registry(o) for o in operands)):
                why = "compares a schedule by its name"
            else:
                continue
            out.append(f"{path}:{node.lineno}: {ast.get_source_segment(text, node)} {why}: ask the schedule object")
    return out


def _product_sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))}


def test_no_schedule_name_comparisons_outside_the_schedule_module():
    names = schedule_names((REPO / SCHEDULE_MODULES[0]).read_text())
    assert {"gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"} <= names
    problems = comparison_problems(_product_sources(), names)
    assert not problems, "\n".join(problems)


def test_the_rule_finds_each_form_of_name_comparison():
    names = {"1f1b", "zb", "zbv"}
    caught = {
        "a.py": 'if schedule in ("zb", "zbv"):\n    pass\n',
        "b.py": 'ok = plan.schedule == "1f1b"\n',
        "c.py": "ok = plan.schedule not in RUNNABLE_SCHEDULES\n",
        "d.py": "ok = schedule == AUTO\n",
        "e.py": "ok = c.schedule != plan.schedule\n",
        "f.py": 'ok = "zbv" != name\n',
        "g.py": "ok = schedule in REFUSED\n",
    }
    assert [p.split(":")[0] for p in comparison_problems(caught, names)] == sorted(caught)
    fine = {
        "i.py": "ok = schedule.split_backward and plan.pipeline_schedule.replans and schedule is not None\n",
        "h.py": 'ok = name in REFUSED_FUNCTIONS or lr_schedule in LR_SCHEDULES or x == "cosine"\n',
        "runtime/program/schedules.py": 'ok = name == "zb"\n',
    }
    assert comparison_problems(fine, names) == []
