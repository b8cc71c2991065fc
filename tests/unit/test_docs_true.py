"""What README and docs/ say a user can copy is what the code takes: the own-model example is the file
the e2e test runs, the job and cluster examples parse, the Python floor is stated and checked; the
README stays a ten-minute read whose every link, and every page's, resolves."""

from __future__ import annotations

import ast
import functools
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from partitioner.config.cluster import ClusterSpec
from partitioner.config.job import load_job, training_settings
from runtime.python_version import check_python

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
CONFIGURATION = (REPO / "docs/configuration.md").read_text()
README_MAX_LINES = 260  # issue 43: "README.md at most about 250 lines"


def _block(text: str, after_heading: str, lang: str) -> str:
    section = text[text.index(after_heading):]
    return re.search(rf"```{lang}\n(.*?)```", section, re.S).group(1)


def test_bring_your_own_model_shows_the_file_the_tests_run():
    own = README[README.index("## Bring your own model"):]
    assert "```python\n" + (REPO / "tests/own_model/my_model.py").read_text() + "```" in own


def test_the_job_file_example_loads(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(_block(CONFIGURATION, "## Job file", "toml"))
    job = load_job(path)
    got = training_settings(job.training)
    assert got.optimizer.lr == 3e-4 and got.clip_grad_norm == 1.0
    assert job.cluster.num_devices == 16


def test_the_cluster_file_example_loads():
    cluster = ClusterSpec.from_dict(tomllib.loads(_block(CONFIGURATION, "## Cluster file", "toml")))
    assert cluster.num_devices == 16 and {d.node for d in cluster.devices} == {0, 1}


def test_python_floor_is_stated_and_checked():
    assert "Python 3.11 or newer" in README
    assert 'requires-python = ">=3.11"' in (REPO / "pyproject.toml").read_text()
    with pytest.raises(ImportError, match=r"needs Python 3.11 or newer.*this is Python 3.10.12.*python3.11 -m venv"):
        check_python((3, 10, 12))
    check_python((3, 11, 0))


# ---- the README is short, and every link in it and in docs/ resolves --------------------------------
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_CITED = re.compile(r"""README \\?["']([^"'\\]+)\\?["']""")  # README "Heading", as code cites it


def broken_links(page: Path) -> list[str]:
    """The relative links of markdown ``page`` (images too) that name no file."""
    return [target for target in _LINK.findall(page.read_text())
            if "://" not in target and not (page.parent / target).exists()]


def test_the_readme_is_short_and_links_every_docs_page():
    lines = README.count("\n")
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines; move a topic to its page under docs/"
    linked = {Path(t).name for t in _LINK.findall(README) if t.startswith("docs/")}
    pages = {p.name for p in (REPO / "docs").glob("*.md") if not p.name.startswith("_")}
    assert pages <= linked, f"README links no docs page for {sorted(pages - linked)}"


def test_every_link_of_the_readme_and_docs_resolves(tmp_path):
    broken = [f"{page.relative_to(REPO)}: {target}" for page in [REPO / "README.md", *sorted((REPO / "docs").glob("[!_]*.md"))]
              for target in broken_links(page)]
    assert not broken, broken
    # the check can fail: a page linking a file that is not there
    (tmp_path / "a.md").write_text("[x](b.md) [y](https://example.com) ![z](c.png) [w](c.png#top)")
    (tmp_path / "c.png").write_bytes(b"")
    assert broken_links(tmp_path / "a.md") == ["b.md"]


def test_what_the_code_cites_of_the_readme_is_there():
    headings = set(re.findall(r"^#+ (.+)$", README, re.M))
    cited = {(str(path.relative_to(REPO)), name)
             for folder in ("partitioner", "runtime", "passes", "benchmarks", "tests")
             for path in sorted((REPO / folder).rglob("*.py")) + sorted((REPO / folder).rglob("*.toml"))
             if path.name != Path(__file__).name
             for name in _CITED.findall(path.read_text())}
    cited |= {("Makefile", name) for name in _CITED.findall((REPO / "Makefile").read_text())}
    missing = sorted(f"{path}: README \"{name}\"" for path, name in cited if name not in headings)
    assert not missing, f"cited README sections that are not README headings (cite the docs/ page): {missing}"


# ---- docs/design.md against the code --------------------------------------------------------------
DESIGN = (REPO / "docs/design.md").read_text()


def _section(number: int) -> str:
    start = DESIGN.index(f"\n## {number}. ")
    return DESIGN[start:DESIGN.index("\n## ", start + 1)]


def metadata_rows(text: str) -> dict[str, tuple[str, set[str]]]:
    """§4's table: key -> (writer module path, reader module paths)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[2], {r.strip() for r in cells[3].split(",") if r.strip()})
    return rows


@functools.cache
def _ir_names() -> dict[str, frozenset[str]]:
    """Module path -> the ``ir.<NAME>`` attributes it uses, over partitioner/ and passes/."""
    out = {}
    for path in sorted([*(REPO / "partitioner").rglob("*.py"), *(REPO / "passes").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        out[str(path.relative_to(REPO).with_suffix(""))] = frozenset(
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "ir")
    return out


def key_readers(constant: str, writer: str) -> set[str]:
    """The modules of partitioner/ and passes/ that name ``ir.<constant>``, but ir.py and the writer."""
    return {module for module, names in _ir_names().items()
            if constant in names and module not in ("partitioner/ir", writer)}


def table_problems(rows, value_types, writers, constants, readers_of) -> list[str]:
    problems = [f"§4 has no row for {key}" for key in value_types if key not in rows]
    problems += [f"§4 lists {key}, which passes/ir.py does not define" for key in rows if key not in value_types]
    for key, (writer, readers) in rows.items():
        if key not in value_types:
            continue
        want = writers[key].rsplit(".", 1)[0].replace(".", "/")
        if writer != want:
            problems.append(f"§4: {key}'s writer is {want} (passes/ir.py WRITER), not {writer}")
        actual = readers_of(constants[key], want)
        if readers != actual:
            problems.append(f"§4: {key}'s readers are {sorted(actual)}, not {sorted(readers)}")
    return problems


def test_the_metadata_table_is_the_contract():
    from passes import ir

    constants = {value: name for name, value in vars(ir).items() if isinstance(value, str) and value in ir.VALUE_TYPES}
    problems = table_problems(metadata_rows(_section(4)), ir.VALUE_TYPES, ir.WRITER, constants, key_readers)
    assert not problems, "\n".join(problems)
    # the check can fail: a stale row, a wrong writer, a missing reader
    stale = {**metadata_rows(_section(4)), "partitioner.stage": ("partitioner/codegen", {"partitioner/codegen"})}
    assert "§4 lists partitioner.stage, which passes/ir.py does not define" in table_problems(
        stale, ir.VALUE_TYPES, ir.WRITER, constants, lambda constant, writer: set())
    assert table_problems({"k": ("passes/x", {"a"})}, {"k": object}, {"k": "passes.y.run"}, {"k": "K"},
                          lambda constant, writer: {"a", "b"}) == [
        "§4: k's writer is passes/y (passes/ir.py WRITER), not passes/x", "§4: k's readers are ['a', 'b'], not ['a']"]


def test_the_layout_names_every_module():
    layout = _section(3)
    missing = [f"{package}/{name}" for package in ("partitioner", "passes", "runtime")
               for name in sorted({p.name for p in (REPO / package).glob("*.py") if p.name != "__init__.py"}
                                  | {f"{d.name}/" for d in (REPO / package).iterdir() if (d / "__init__.py").is_file()})
               if not re.search(rf"(?<![\w/.]){re.escape(name)}(?![\w])", layout)]
    assert not missing, f"docs/design.md §3 does not name {missing}"


def torchrun_starters(sources: dict[str, str]) -> set[str]:
    """The unit test files that start torchrun: a torchrun command run in a process, or `partitioner run`."""
    return {path for path, text in sources.items()
            if ("torchrun_command(" in text and ("Popen(" in text or "run_tree(" in text))
            or re.search(r"""["']partitioner(?:\.cli)?["'],\s*["']run["']""", text)}


def test_the_unit_tests_that_start_torchrun_are_named():
    starters = torchrun_starters({p.name: p.read_text() for p in sorted((REPO / "tests/unit").glob("test_*.py"))
                                  if p.name != Path(__file__).name})  # its examples start nothing
    assert starters, "none found: the detection is broken"
    unnamed = sorted(name for name in starters if name not in _section(3))
    assert not unnamed, f"docs/design.md §3 says unit tests are one process each but for those it names; also {unnamed}"
    assert torchrun_starters({"a.py": 'subprocess.run([sys.executable, "-m", "partitioner", "run", d])',
                              "b.py": "torchrun_command('t.py', 2)", "c.py": "x = 1"}) == {"a.py"}


def readme_commands(text: str) -> list[list[str]]:
    """Every `partitioner ...` line of the README's plain code blocks, continuations joined, comments cut."""
    fence, kept = None, []  # fence: the opening line of the block we are in
    for line in text.splitlines():
        if line.startswith("```"):
            fence = line if fence is None else None
        elif fence == "```":  # plain blocks only: not python, toml
            kept.append(line)
    lines = "\n".join(kept).replace("\\\n", " ").splitlines()
    return [shlex.split(line.split("  #")[0])[1:] for line in lines if line.startswith("partitioner ")]


def test_the_commands_the_readme_shows_parse():
    from partitioner.cli.commands import build_parser

    commands = readme_commands(README)
    assert {c[0] for c in commands} >= {"data", "compile", "inspect", "run", "generate", "export", "verify"}
    for argv in commands:
        build_parser().parse_args(argv)  # a flag the CLI lost: SystemExit, naming it
    with pytest.raises(SystemExit):
        build_parser().parse_args(readme_commands("```\npartitioner run out --no-such-flag\n```")[0])
