"""The local modules a travelling file imports, and the copies imported as a rank will import them.

Note [local modules travel]: a model file rarely stands alone: `from my_blocks import Block`, a
package of layers next to it. Every rank runs without the user's folder (Note [user code travels] in
partitioner/frontend/user_source.py), so the folder's modules the travelling files import travel too, copied
into DIR/user/ laid out as in the folder (``local_modules``): found by reading the files' import
statements, function bodies and relative imports included, transitively, and resolved against the
file's own folder (its "root": where `python my_model.py` would look first; ``load_model_file`` in
partitioner/frontend/user_source.py runs the model file that way). What resolves to a file of the root
travels and is hashed like every other file; what resolves to an installed module (stdlib,
site-packages, an editable install, PYTHONPATH, which ranks inherit) stays a plain import. Refused
at compile time, in one line with the fix (install the code, pip install -e ., or export
PYTHONPATH=<its folder>, so the ranks import it where it is):

  * a C extension of the folder (a compiled binary does not travel);
  * a module of the folder named like an installed one that the model loaded (the ranks append
    DIR/user/ to sys.path and would import the installed one: rename it);
  * an import the model loaded from outside the root that no rank can import (found through the
    current directory, `python -m partitioner` from a project folder);
  * whatever else fails when the copies are imported as a rank will import them (``check_imports``:
    a fresh interpreter, PYTHONSAFEPATH=1, the program folder as working directory, only DIR/user/
    added): a module reading a file next to itself at import, an import by computed name
    (importlib.import_module(name)) the reading cannot follow. It runs on the folder in its
    temporary place, so a refused compile leaves no output folder, and only when files travel
    (about 1.6 s here: one interpreter importing torch; the reading itself takes milliseconds).
"""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import subprocess
import sys
import tokenize
from pathlib import Path
from typing import TYPE_CHECKING

from partitioner.frontend.rank_imports import location, places, rank_spec, within
from runtime.launch.torchrun import run_env
from runtime.program.user_code import USER_DIR, user_module_name

if TYPE_CHECKING:
    from partitioner.frontend.user_source import UserSources

_INSTALL_FIX = "pip install -e . (a pyproject.toml in that folder), or export PYTHONPATH={entry}"


def _fix_where(entry: str) -> str:
    return ("make it importable where it is, so the ranks import it instead of a copy: "
            + _INSTALL_FIX.format(entry=entry))


def locate(root: str, parts: list[str]) -> tuple[str, str | None]:
    """What importing ``parts`` finds in ``root``, in Python's order: ("package", its __init__.py),
    ("extension", the binary), ("module", the .py file), ("namespace", the folder), or ("", None)."""
    base = os.path.join(root, *parts)
    if os.path.isfile(os.path.join(base, "__init__.py")):
        return "package", os.path.join(base, "__init__.py")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if os.path.isfile(base + suffix):
            return "extension", base + suffix
    if os.path.isfile(base + ".py"):
        return "module", base + ".py"
    if os.path.isdir(base) and all(p.isidentifier() for p in parts):
        return "namespace", base
    return "", None


def _package_of(rel: str) -> str:
    """The package a file at ``rel`` (relative to its root) belongs to: "" at the root."""
    parts = rel.removesuffix(".py").split(os.sep)
    return ".".join(parts[:-1])


def _imported_names(path: str, package: str) -> list[tuple[str, int]]:
    """(absolute dotted name, line) of every import statement in ``path``, function bodies and
    relative imports included; ``from a import b`` gives a and a.b (b may be a module)."""
    try:
        with tokenize.open(path) as f:  # the file's own encoding cookie, as Python reads it
            tree = ast.parse(f.read(), path)
    except (SyntaxError, UnicodeDecodeError) as exc:  # a module the model imports only when a function runs
        line = getattr(exc, "lineno", None)
        raise ValueError(f"{path}{f':{line}' if line else ''} is not valid Python ({type(exc).__name__}: "
                         f"{getattr(exc, 'msg', exc)}), and the ranks would import it: fix the file") from None
    names: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: against the file's package (none at the root: Python refuses it too)
                base = package.split(".") if package else []
                if not base or node.level - 1 > len(base) - 1:
                    continue
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module:
                continue
            names.append((module, node.lineno))
            names += [(f"{module}.{alias.name}", node.lineno) for alias in node.names if alias.name != "*"]
    return names


def _check_top(top: str, root: str, kind: str, found: str | None, where: str, who: str) -> bool:
    """Whether the top-level import ``top`` is the root's (it travels); refuses what cannot travel."""
    spec = rank_spec(top)
    loaded = location(sys.modules.get(top))
    if not kind:
        if spec is None and loaded and not within(loaded, [root]):
            entry = os.path.dirname(os.path.dirname(loaded)) if os.path.basename(loaded) == "__init__.py" \
                else os.path.dirname(loaded)
            raise ValueError(f"{who}: {where} imports {top} ({loaded}), which is neither in the model's folder "
                             f"{root} nor installed, so no rank could import it (it is found here only through "
                             f"the current directory or a path set up at compile time): move it into {root}, or "
                             + _fix_where(entry))
        return False  # installed (a rank imports it by name), or never loaded (an optional import)
    if spec is not None and kind != "namespace":
        if found and within(found, places(spec)):
            return False  # the root is itself importable by the ranks (PYTHONPATH): by name, not copied
        if loaded and os.path.realpath(loaded) == os.path.realpath(found or ""):
            theirs = spec.origin if spec.origin not in (None, "built-in", "frozen") else "Python's own module"
            raise ValueError(f"{who}: {where} imports {top}, and your {found} has the name of the installed "
                             f"{theirs}: the ranks put the program's copy of your files after the installed "
                             f"packages and would import that one: rename your file")
        return False  # the installed one is what the model loaded, as the ranks will
    if spec is not None:
        return False  # a bare folder (namespace package) loses to an installed package of that name
    if kind == "extension":
        raise ValueError(f"{who}: {where} imports {top}, a compiled extension ({found}): a binary does not travel "
                         f"with the program: " + _fix_where(root))
    return True


def local_modules(seed: str, root: str, who: str) -> dict[str, str]:
    """{"user/<rel>": original} for ``seed`` (a .py file under ``root``) and every module of ``root``
    it imports, transitively (Note [local modules travel]); raises ValueError for what cannot travel."""
    root, seed = os.path.abspath(root), os.path.abspath(seed)
    out: dict[str, str] = {}
    todo = [seed]
    rel = os.path.relpath(seed, root).split(os.sep)
    for i in range(1, len(rel)):  # a seed inside a package needs its packages' __init__.py too
        kind, found = locate(root, rel[:i])
        if kind == "package":
            todo.append(found)
    while todo:
        path = todo.pop()
        rel_path = os.path.relpath(path, root)
        key = f"{USER_DIR}/{rel_path.replace(os.sep, '/')}"
        if key in out:
            continue
        out[key] = path
        package = _package_of(rel_path)
        if os.path.basename(path) == "__init__.py":
            package = ".".join(rel_path.split(os.sep)[:-1])
        for name, line in _imported_names(path, package):
            parts = name.split(".")
            kind, found = locate(root, parts[:1])
            if not _check_top(parts[0], root, kind, found, f"{path}:{line}", who):
                continue
            for i in range(1, len(parts) + 1):
                kind, found = locate(root, parts[:i])
                if kind == "extension":
                    raise ValueError(f"{who}: {path}:{line} imports {'.'.join(parts[:i])}, a compiled extension "
                                     f"({found}): a binary does not travel with the program: " + _fix_where(root))
                if kind in ("package", "module"):
                    todo.append(found)
                if kind not in ("package", "namespace"):
                    break
    return dict(sorted(out.items()))


_TRY_IMPORTS = r"""
import json, os, sys, traceback
folder, specs, modules = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
try:
    from runtime.program.user_code import import_user_module, resolve_callable
    for spec in specs:
        resolve_callable(spec, folder)
    for name in modules:
        import_user_module(folder, name)
except BaseException as exc:
    user = os.path.realpath(os.path.join(folder, "user")) + os.sep
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename).startswith(user)]
    text = str(exc).strip().splitlines()
    print(json.dumps({"error": f"{type(exc).__name__}: {text[0] if text else ''}",
                      "file": os.path.realpath(frames[-1].filename)[len(user):] if frames else None,
                      "line": frames[-1].lineno if frames else None,
                      "code": (frames[-1].line or "").strip() if frames else None}))
    sys.exit(3)
"""
TRY_IMPORTS_TIMEOUT_S = 300


def check_imports(folder: str | Path, sources: UserSources, *, final: str | Path, workload_name: str) -> None:
    """Import the copies in ``folder``/user/ (the program folder in its temporary place; ``final``:
    where it goes) as a rank will, in a fresh interpreter: every user/ spec and every module a stage
    file imports from there; raises ValueError with the user's file and line and the fix when that
    fails (Note [local modules travel])."""
    if not sources.files:
        return

    folder = str(Path(folder).resolve())
    specs = [list(spec) for spec in sources.specs.values() if str(spec[0]).startswith(USER_DIR + "/")]
    travelled = {user_module_name(rel) for rel in sources.files}
    modules = sorted({m for m in sources.op_imports.values() if m in travelled})
    env = {**run_env(), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run([sys.executable, "-c", _TRY_IMPORTS, folder, json.dumps(specs), json.dumps(modules)],
                              cwd=folder, env=env, capture_output=True, text=True, timeout=TRY_IMPORTS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"workload {workload_name!r}: importing your files as a rank will ({', '.join(sorted(sources.files))}) "
                         f"took more than {TRY_IMPORTS_TIMEOUT_S} s: move slow work out of import time, into "
                         "build() or make_batch") from None
    if done.returncode == 0:
        return
    try:
        report = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        report = {"error": (done.stderr.strip().splitlines() or ["the interpreter failed"])[-1], "file": None}
    original = sources.files.get(f"{USER_DIR}/{report['file']}") if report.get("file") else None
    where = f"{original or report['file']}:{report['line']} `{report['code']}`" if report.get("file") else ""
    error = report["error"].replace(folder, str(final))
    # PYTHONPATH for the folder the failing file was copied from (else the model file's)
    roots = [original[:-len(report["file"])].rstrip(os.sep)] if original else sorted(
        {os.path.dirname(p) for rel, p in sources.files.items() if rel.count("/") == 1})
    raise ValueError(
        f"workload {workload_name!r}: the ranks cannot import your code from the program folder"
        + (f": {where} raised {error}" if where else f": {error}")
        + f". Only the .py files your model file imports travel (to {final}/user/); a data file, a compiled "
        "extension or a module found only from the current directory does not. Fix: read such a file in build() "
        "or make_batch rather than at import, or " + _fix_where(roots[0] if roots else "<your folder>"))
