"""The house rules of docs/design.md §9, read from the source (nothing here imports the product):

- every cited ``Note [name]`` is defined exactly once;
- every module is in its package's map (the package ``__init__.py`` docstring), and the map names
  no module that does not exist;
- a function-local import carries a comment naming its reason, on its line or the line above;
- no module is over 500 lines;
- a citation that says where (``Note [name] in path``) names the file that defines the Note;
- a Note is at most 15 lines: the decision and its reason, not a retelling of the code;
- one meaning per file name: modules share a name only on the short list of same-subject pairs.

Each rule is a function from source text to the list of its offenders (``file:line: what``), so a
test can feed it a broken input and see it fail; the tests over the repository assert the list is
empty and print it otherwise.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("partitioner", "passes", "runtime")
NOTE_ROOTS = (*PACKAGES, "benchmarks", "tests")
NOTE_FILES = ("docs/design.md",)
MAX_LINES = 500
MAX_NOTE_LINES = 15


def _sources(roots=PACKAGES) -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for root in roots for p in sorted((REPO / root).rglob("*.py"))}


# ---- Notes -------------------------------------------------------------------------------------
# A definition is a line whose prose (after indentation, `#` and an opening docstring quote) starts
# with `Note [name]` followed by `:` or nothing: the heading form (`Note [name]` alone, its body
# indented below) or the paragraph form (`Note [name]: the body`). Every other mention is a
# citation, a plural one too (`Notes [a], [b] and [c]`); a name may wrap onto the next line.
_PROSE_PREFIX = re.compile(r"^[ \t]*(?:#+[ \t]?)?[ \t]*(?:[rRbBuU]?(?:\"\"\"|'''))?[ \t]*", re.M)
_DEFINITION = re.compile(r"Note \[([^\]]+)\](?::|[ \t]*$)")
_MENTION = re.compile(r"\bNotes?\s+((?:\[[^\]]+\](?:\s*,\s*|\s+and\s+|,\s+and\s+)?)+)")


def _prose(text: str) -> str:
    """``text`` with each line's indentation, comment marker and opening quote cut, lines kept."""
    return _PROSE_PREFIX.sub("", text)


def _name(raw: str) -> str:
    """One Note's name as written, its wrapping undone: across lines, and across the pieces of an
    implicitly joined string literal (``"... (Note [tensor-parallel", "# stages] ..."``)."""
    return " ".join(re.sub(r"[\"']\s*,?\s*[rRbBfFuU]*[\"']\s*#?", " ", raw).split())


def notes(sources: dict[str, str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(definitions, citations): each Note's name -> the ``file:line`` places."""
    definitions: dict[str, list[str]] = defaultdict(list)
    citations: dict[str, list[str]] = defaultdict(list)
    for path, text in sources.items():
        prose = _prose(text)
        starts = [0] + [m.end() for m in re.finditer("\n", prose)]
        line_of = lambda offset: next(i for i in range(len(starts), 0, -1) if starts[i - 1] <= offset)  # noqa: E731
        defined_at = set()
        for number, line in enumerate(prose.split("\n"), 1):
            m = _DEFINITION.match(line)
            if m:
                definitions[_name(m.group(1))].append(f"{path}:{number}")
                defined_at.add(starts[number - 1])
        for m in _MENTION.finditer(prose):
            for bracket in re.finditer(r"\[([^\]]+)\]", m.group(1)):
                offset = m.start(1) + bracket.start()
                if m.start() in defined_at and bracket.start() == 0:
                    continue
                citations[_name(bracket.group(1))].append(f"{path}:{line_of(offset)}")
    return definitions, citations


def note_problems(sources: dict[str, str]) -> list[str]:
    definitions, citations = notes(sources)
    problems = [f"{places[0]}: Note [{name}] is cited but never defined (also cited at {len(places) - 1} more places)"
                for name, places in sorted(citations.items()) if name not in definitions]
    problems += [f"{places[1]}: Note [{name}] is defined {len(places)} times ({', '.join(places)}): keep the one "
                 "where the decision is made and cite it at the others (`Note [name]` not opening a line, or "
                 "not followed by a colon)" for name, places in sorted(definitions.items()) if len(places) > 1]
    return problems


def _note_sources() -> dict[str, str]:
    sources = {**_sources(NOTE_ROOTS), **{f: (REPO / f).read_text() for f in NOTE_FILES}}
    del sources[str(Path(__file__).resolve().relative_to(REPO))]  # its examples are no Notes
    return sources


_WHERE = re.compile(_MENTION.pattern + r"\s*in\s+`?([\w./-]+\.(?:py|md))\b")


def citation_place_problems(sources: dict[str, str]) -> list[str]:
    """A citation's ``in path`` (a full path, or a file name its definer's path ends with) must be
    where the Note is defined: a moved Note or a renamed module leaves it pointing at nothing."""
    definitions, _ = notes(sources)
    problems = []
    for path, text in sources.items():
        prose = _prose(text)
        for m in _WHERE.finditer(prose):
            target = m.group(2)
            for bracket in re.finditer(r"\[([^\]]+)\]", m.group(1)):
                name = _name(bracket.group(1))
                homes = [place.rsplit(":", 1)[0] for place in definitions.get(name, ())]
                if homes and not any(home == target or home.endswith("/" + target) for home in homes):
                    line = prose.count("\n", 0, m.start(2)) + 1
                    problems.append(f"{path}:{line}: Note [{name}] cited in {target}, defined in "
                                    f"{', '.join(homes)}: cite the file that defines it")
    return problems


def test_every_cited_note_is_defined_once():
    problems = note_problems(_note_sources())
    assert not problems, "\n".join(problems)


def test_every_citation_names_the_file_that_defines_its_note():
    problems = citation_place_problems(_note_sources())
    assert not problems, "\n".join(problems)


def test_citation_place_rule_finds_the_stale_path():
    sources = {
        "p/home.py": "# Note [here]: the decision.\n",
        "p/a.py": "x = 1  # Note [here] in p/home.py\n",
        "p/b.py": "x = 1  # Note [here] in home.py\n",
        "p/c.py": '"""Text (Note [here] in\np/gone.py) more."""\n',
    }
    assert citation_place_problems(sources) == [
        "p/c.py:2: Note [here] cited in p/gone.py, defined in p/home.py: cite the file that defines it"]


def test_note_rule_finds_an_undefined_and_a_twice_defined_note():
    sources = {
        "a.py": '"""Note [kept]\n    the body.\n\nNote [twice]: first.\n"""\nx = 1  # Note [kept], Note [nowhere]\n',
        "b.py": "# Note [twice]: again\n# see Notes [kept] and [wrapped\n# name]\n",
        "c.md": "Prose (Note [kept]), a citation.\nNote [wrapped name]: a definition.\n",
    }
    definitions, citations = notes(sources)
    assert definitions == {"kept": ["a.py:1"], "twice": ["a.py:4", "b.py:1"], "wrapped name": ["c.md:2"]}
    assert citations == {"kept": ["a.py:6", "b.py:2", "c.md:1"], "nowhere": ["a.py:6"], "wrapped name": ["b.py:2"]}
    assert note_problems(sources) == [
        "a.py:6: Note [nowhere] is cited but never defined (also cited at 0 more places)",
        "b.py:1: Note [twice] is defined 2 times (a.py:4, b.py:1): keep the one where the decision is made and "
        "cite it at the others (`Note [name]` not opening a line, or not followed by a colon)",
    ]


# ---- Note length -------------------------------------------------------------------------------
# A Note runs from its definition line to the end of its comment block (the first line that is no
# comment at the definition's column) or, in a docstring or a page, to its first blank line or the
# closing quotes. A heading-form Note's body is what is indented deeper than its heading, blank
# lines inside included. A next definition ends it too.
_QUOTES = ('"""', "'''")


def _defines(line: str) -> re.Match | None:
    return _DEFINITION.match(_PROSE_PREFIX.sub("", line, count=1))


def _depth(line: str) -> int:
    """Indentation of a line's prose: after the `#` marker for a comment."""
    text = line.lstrip()
    text = text.lstrip("#") if text.startswith("#") else line
    return len(text) - len(text.lstrip())


def note_spans(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, number of lines) of every Note ``text`` defines."""
    lines = text.splitlines()
    spans = []
    for i, first in enumerate(lines):
        m = _defines(first)
        if not m:
            continue
        heading, comment = not m.group(0).endswith(":"), first.lstrip().startswith("#")
        column = len(first) - len(first.lstrip())
        last = i
        opened = re.sub(r"^[rRbBuU]?(?:\"\"\"|''')", "", first.strip())
        for j in range(i + 1, len(lines)) if comment or not any(q in opened for q in _QUOTES) else ():
            line = lines[j]
            if comment and (not line.lstrip().startswith("#") or len(line) - len(line.lstrip()) != column):
                break
            if _defines(line) or (not comment and line.strip() in _QUOTES):
                break
            if not line.strip().lstrip("#").strip():  # blank: a paragraph's end, a heading's pause
                if heading:
                    continue
                break
            if heading and _depth(line) <= _depth(first):
                break
            last = j
            if not comment and any(q in line for q in _QUOTES):
                break
        spans.append((_name(m.group(1)), i + 1, last - i + 1))
    return spans


def note_length_problems(sources: dict[str, str], limit: int = MAX_NOTE_LINES) -> list[str]:
    return [f"{path}:{line}: Note [{name}] is {count} lines, over {limit}: keep the decision and its reason; "
            "what the code says plainly goes"
            for path, text in sources.items() for name, line, count in note_spans(text) if count > limit]


def test_every_note_is_at_most_15_lines():
    problems = note_length_problems(_note_sources())
    assert not problems, f"{len(problems)} Notes over {MAX_NOTE_LINES} lines:\n" + "\n".join(problems)


def test_note_length_rule_measures_each_form():
    sources = {
        "a.py": ("# Note [block]: one\n#   two\nx = 1  # three\n"
                 "    # Note [next]: one\n    # Note [after]: a next definition ends the one before\n"),
        "b.py": ('"""Note [para]: one\ntwo\n\nnot it.\n\nNote [heading]\n    one\n\n    two\nnot it\n"""\n'
                 'def f():\n    """Text.\n\n    Note [closing]: one\n    two."""\n'),
        "c.py": '"""Note [one line]: all."""\n# Note [head]\n#     one\n#     two\n# not it\n',
    }
    assert {path: note_spans(text) for path, text in sources.items()} == {
        "a.py": [("block", 1, 2), ("next", 4, 1), ("after", 5, 1)],
        "b.py": [("para", 1, 2), ("heading", 6, 4), ("closing", 15, 2)],
        "c.py": [("one line", 1, 1), ("head", 2, 3)],
    }
    assert note_length_problems(sources, limit=3) == [
        "b.py:6: Note [heading] is 4 lines, over 3: keep the decision and its reason; what the code says plainly goes"]


# ---- Module maps -------------------------------------------------------------------------------
# A package's map is its ``__init__.py`` docstring's entries: a line whose first word is a module's
# file name (``name.py``) or a sub-package's folder (``name/``) followed by what it holds, so the
# map reads as the folder's listing does.
_MAP_ENTRY = re.compile(r"^[ \t]*([A-Za-z_]\w*(?:\.py|/))(?=[ \t]|$)", re.M)


def map_entries(init_source: str) -> dict[str, int]:
    """The names a package's map lists -> the docstring line (1-based, in the file) naming them."""
    tree = ast.parse(init_source)
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    if doc is None or not isinstance(doc.value, ast.Constant) or not isinstance(doc.value.value, str):
        return {}
    first_line = doc.lineno
    raw = init_source.splitlines()[first_line - 1:doc.end_lineno]
    text = "\n".join(raw)
    return {m.group(1): first_line + text.count("\n", 0, m.start()) for m in _MAP_ENTRY.finditer(text)}


def map_problems(package: str, init_source: str, listing: set[str]) -> list[str]:
    """``listing``: the package folder's module files (``__init__.py`` aside) and sub-packages (``name/``)."""
    entries = map_entries(init_source)
    where = f"{package}/__init__.py"
    problems = [f"{where}:1: the map leaves out {name} (add a line `{name}  what it holds` to the docstring)"
                for name in sorted(listing - set(entries))]
    problems += [f"{where}:{line}: the map names {name}, which is not in {package}/"
                 for name, line in sorted(entries.items()) if name not in listing]
    return problems


def _packages() -> dict[str, set[str]]:
    out = {}
    for root in PACKAGES:
        for init in sorted((REPO / root).rglob("__init__.py")):
            folder = init.parent
            out[str(folder.relative_to(REPO))] = (
                {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
                | {f"{d.name}/" for d in folder.iterdir() if (d / "__init__.py").is_file()})
    return out


def test_every_module_is_in_its_packages_map():
    problems = [p for package, listing in _packages().items()
                for p in map_problems(package, (REPO / package / "__init__.py").read_text(), listing)]
    assert not problems, "\n".join(problems)


def test_map_rule_finds_a_missing_and_a_stale_module():
    init = '"""The room.\n\nshapes.py   what each node produces\nsolver/     the solver\ngone.py     removed\n"""\nx = 1\n'
    assert map_entries(init) == {"shapes.py": 3, "solver/": 4, "gone.py": 5}
    assert map_problems("pkg", init, {"shapes.py", "solver/", "flops.py"}) == [
        "pkg/__init__.py:1: the map leaves out flops.py (add a line `flops.py  what it holds` to the docstring)",
        "pkg/__init__.py:5: the map names gone.py, which is not in pkg/",
    ]
    assert map_problems("pkg", "x = 1\n", {"a.py"}) == [
        "pkg/__init__.py:1: the map leaves out a.py (add a line `a.py  what it holds` to the docstring)"]


# ---- Function-local imports --------------------------------------------------------------------
# An import inside a function hides an edge of the import graph and costs the reader a search, so
# one carries its reason (``# lazy: loads torch``, ``# optional dependency: ...``) on its line or
# the line above; one with no reason belongs at the top of the module.

def _comment_lines(text: str) -> set[int]:
    return {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT}


def local_import_problems(sources: dict[str, str]) -> list[str]:
    problems = []
    for path, text in sources.items():
        if "import" not in text:
            continue
        tree = ast.parse(text)
        commented = None  # tokenized only where a function imports
        seen: set[int] = set()
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in seen:
                    seen.add(node.lineno)
                    commented = _comment_lines(text) if commented is None else commented
                    if not commented & set(range(node.lineno - 1, node.end_lineno + 1)):
                        names = ", ".join(a.name for a in node.names)
                        what = f"from {'.' * node.level}{node.module or ''} import {names}" \
                            if isinstance(node, ast.ImportFrom) else f"import {names}"
                        problems.append(f"{path}:{node.lineno}: `{what}` in {function.name}() has no comment naming "
                                        "why it is local: move it to the top of the module, or say why not")
    return sorted(problems, key=lambda p: (p.split(":")[0], int(p.split(":")[1])))


def test_every_function_local_import_says_why():
    problems = local_import_problems(_sources())
    assert not problems, f"{len(problems)} function-local imports without a reason:\n" + "\n".join(problems)


def test_local_import_rule_finds_the_bare_one():
    source = (
        "import os\n\n\ndef f():\n    import json\n    return json\n\n\n"
        "def g():\n    # lazy: loads torch\n    import torch\n    from a import (b,\n                   c)  # lazy: loads a\n"
        "    return torch\n")
    assert local_import_problems({"m.py": source}) == [
        "m.py:5: `import json` in f() has no comment naming why it is local: move it to the top of the module, "
        "or say why not"]


# ---- Module size -------------------------------------------------------------------------------

def size_problems(sources: dict[str, str], limit: int = MAX_LINES) -> list[str]:
    counts = {path: len(text.splitlines()) for path, text in sources.items()}
    return [f"{path}:{limit + 1}: {count} lines, over {limit}: split it along a seam (a room per concern)"
            for path, count in sorted(counts.items(), key=lambda item: -item[1]) if count > limit]


def test_no_module_is_over_500_lines():
    problems = size_problems(_sources())
    assert not problems, "\n".join(problems)


def test_size_rule_names_the_long_module():
    assert size_problems({"a.py": "x = 1\n" * 3, "b.py": "x = 1\n" * 2}, limit=2) == [
        "a.py:3: 3 lines, over 2: split it along a seam (a room per concern)"]


# ---- One meaning per file name ------------------------------------------------------------------
# Two modules may share a name only as the same subject seen from two phases (what compile decides,
# what the run does, or the command and its library); any other twin is a reader's trap (issue 43:
# runtime's compiled.py and evaluate.py meant other things than partitioner's).
SAME_SUBJECT = {
    "elastic.py": {"partitioner/cli/elastic.py", "runtime/launch/elastic.py"},
    "errors.py": {"partitioner/errors.py", "runtime/errors.py"},
    "generate.py": {"partitioner/cli/generate.py", "partitioner/models/generate.py"},
    "layout.py": {"partitioner/inspect/layout.py", "runtime/program/layout.py"},
    "memory.py": {"passes/memory.py", "runtime/observe/memory.py"},
    "randomness.py": {"partitioner/frontend/randomness.py", "runtime/execute/randomness.py"},
    "recompute.py": {"partitioner/codegen/recompute.py", "runtime/execute/recompute.py"},
    "recompute_cost.py": {"partitioner/calibrate/recompute_cost.py", "partitioner/solver/recompute_cost.py"},
    "schedules.py": {"partitioner/solver/schedules.py", "runtime/program/schedules.py"},
    "spec.py": {"runtime/data/corpus/spec.py", "runtime/program/spec.py"},
}
_ANY_NUMBER = {"__init__.py", "__main__.py"}


def twin_problems(paths, same_subject=SAME_SUBJECT) -> list[str]:
    by_name: dict[str, set[str]] = defaultdict(set)
    for path in paths:
        by_name[Path(path).name].add(path)
    return [f"{sorted(places)[0]}:1: {name} is also {', '.join(sorted(places)[1:])}: name each for what it "
            f"holds (or, if they are one subject at two phases, add them to SAME_SUBJECT)"
            for name, places in sorted(by_name.items())
            if len(places) > 1 and name not in _ANY_NUMBER and places != same_subject.get(name)]


def test_one_meaning_per_file_name():
    problems = twin_problems(_sources())
    assert not problems, "\n".join(problems)


def test_twin_rule_names_the_new_twin():
    paths = ["a/x.py", "b/x.py", "a/y.py", "b/y.py", "c/y.py", "a/__init__.py", "b/__init__.py"]
    assert twin_problems(paths, same_subject={"y.py": {"a/y.py", "b/y.py"}}) == [
        "a/x.py:1: x.py is also b/x.py: name each for what it holds (or, if they are one subject at two "
        "phases, add them to SAME_SUBJECT)",
        "a/y.py:1: y.py is also b/y.py, c/y.py: name each for what it holds (or, if they are one subject at two "
        "phases, add them to SAME_SUBJECT)"]
