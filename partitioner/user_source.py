"""Where generated programs find the user's code: ``make_batch``, ``loss_fn`` and the modules that
register custom ops, derived from the functions themselves, checked before anything is traced; the
user's files that travel into the program folder (the model file and the local modules it imports);
and a model file loaded as a script would run.

Note [user code travels]: a program's ranks import the user's data and loss functions by the
names plan.json's program gives them (runtime/user_code.py ``resolve_callable``). Each rank runs
with its program folder, not the user's working directory, as its home, and with
PYTHONSAFEPATH=1 (runtime/torchrun.py ``run_env``), so a name that worked at compile time only
because the current directory was on sys.path would fail inside every rank. Hence, per function:

  * a module-level function of an importable module (an installed package, or one on
    PYTHONPATH, which workers inherit) is named "package.module:function";
  * a module-level function of a ``.py`` file that is no importable module (the
    ``partitioner compile my_model.py:build`` case) has that file copied into the program folder as
    ``user/<file>.py`` and is named "user/<file>.py:function", a path relative to the folder: the
    folder then runs wherever it is copied, and plan.json's file map hashes the copy like every
    other file, so Note [folder integrity] (runtime/program.py) covers the code the ranks import.
    The file's own local imports travel with it (Note [local modules travel]), and the ranks import
    the copies by their module names (Note [one user root] in runtime/user_code.py);
  * a module importable only from the current directory is refused with the fix (install it,
    set PYTHONPATH, or name its file);
  * lambdas, nested functions (closures), bound methods and callable objects are refused with the
    fix: a rank cannot import them. ``functools.partial(f, key=value)`` of such a function is
    fine: its keyword arguments travel as the spec's kwargs (they must be JSON values).

``Workload.source`` still wins where it names a function (built-ins do, pointing into runtime/).

Note [local modules travel]: a model file rarely stands alone: `from my_blocks import Block`, a
package of layers next to it. Every rank runs without the user's folder (above), so the folder's
modules the travelling files import travel too, copied into DIR/user/ laid out as in the folder
(``local_modules``): found by reading the files' import statements, function bodies and relative
imports included, transitively, and resolved against the file's own folder (its "root": where
`python my_model.py` would look first; ``load_model_file`` runs the model file that way). What
resolves to a file of the root travels and is hashed like every other file; what resolves to an
installed module (stdlib, site-packages, an editable install, PYTHONPATH, which ranks inherit)
stays a plain import. Refused at compile time, in one line with the fix (install the code,
pip install -e ., or export PYTHONPATH=<its folder>, so the ranks import it where it is):

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
import functools
import importlib.machinery
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tokenize
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path

from runtime.user_code import USER_DIR, active_user_root, leave_user_root, user_module_name

ROLES = ("make_batch", "loss_fn")


@dataclass(frozen=True)
class UserSources:
    """What lowering writes: the specs plan.json's program names, and the files to copy."""

    specs: dict  # role -> ("module:function" | "user/<file>.py:function", {kwargs})
    files: dict = field(default_factory=dict)  # "user/<rel>.py" -> absolute path of the original
    # custom op "ns::op" -> the module its stage file imports (Note [custom ops travel])
    op_imports: dict = field(default_factory=dict)


def _fix(role: str) -> str:
    return (f"define {role} with `def` at the top level of your model file (or of an importable "
            f"module), or bind its settings with functools.partial(function, key=value)")


def _unwrap(fn, role: str, workload_name: str) -> tuple[types.FunctionType, dict]:
    kwargs: dict = {}
    while isinstance(fn, functools.partial):
        if fn.args:
            raise ValueError(f"workload {workload_name!r}: {role} is functools.partial with positional "
                             f"arguments {fn.args!r}, which a generated program cannot name: pass them by "
                             f"keyword (functools.partial(f, key=value))")
        kwargs = {**fn.keywords, **kwargs}
        fn = fn.func
    if not isinstance(fn, types.FunctionType):
        kind = "a bound method" if inspect.ismethod(fn) else f"a {type(fn).__name__} object"
        raise ValueError(f"workload {workload_name!r}: {role} is {kind} ({fn!r}); generated programs import "
                         f"{role} by name in every rank: {_fix(role)}")
    if fn.__name__ == "<lambda>":
        raise ValueError(f"workload {workload_name!r}: {role} is a lambda; generated programs import {role} "
                         f"by name in every rank: {_fix(role)}")
    if "<locals>" in fn.__qualname__ or fn.__qualname__ != fn.__name__:
        raise ValueError(f"workload {workload_name!r}: {role} is {fn.__qualname__}, defined inside another "
                         f"function or class, which no rank can import: {_fix(role)}")
    try:
        json.dumps(kwargs)
    except TypeError:
        raise ValueError(f"workload {workload_name!r}: {role}'s bound arguments {sorted(kwargs)} are not all "
                         "JSON values (numbers, strings, lists, dicts): plan.json records them; bind "
                         "plain values, or build the objects inside the function") from None
    return fn, kwargs


def _spec(top: str, entries: list[str] | None):
    """The spec importing top-level ``top`` finds through ``entries`` (None: every sys.path entry)
    or an import hook (editable installs), or None."""
    spec = importlib.machinery.PathFinder.find_spec(top, entries)
    if spec is None and entries is not None:
        for finder in sys.meta_path:  # editable installs and other import hooks, not sys.path's finder
            if finder is importlib.machinery.PathFinder or not hasattr(finder, "find_spec"):
                continue
            try:
                spec = finder.find_spec(top, None)
            except Exception:  # noqa: BLE001 - a hook that cannot answer does not find it
                spec = None
            if spec is not None:
                break
    return spec


def _places(spec) -> list[str]:
    return list(spec.submodule_search_locations or []) or ([os.path.dirname(spec.origin)] if spec.origin else [])


def _within(path: str, places: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real.startswith(os.path.realpath(p) + os.sep) for p in places)


def _found(module_name: str, path: str, entries: list[str] | None) -> bool:
    """Does importing ``module_name``'s top package through ``entries`` (None: every sys.path
    entry) or an import hook (editable installs) find the package holding ``path``?"""
    spec = _spec(module_name.partition(".")[0], entries)
    return spec is not None and _within(path, _places(spec))


_MODEL_ROOTS: list[str] = []  # the folder ``load_model_file`` put on sys.path (realpath), if any


def _cwd_only(entry: str) -> bool:
    """Is sys.path ``entry`` there only because of where the compiler was started (the current
    directory, the directory of the script run, the folder of the model file loaded, a program's
    user root entered by verify), i.e. absent in a rank?"""
    inherited = [os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    real = os.path.realpath(entry or os.curdir)
    if real in inherited:
        return False
    script_dir = os.path.realpath(os.path.dirname(os.path.abspath(sys.argv[0]))) if sys.argv and sys.argv[0] else None
    return (entry in ("", ".") or real == os.path.realpath(os.getcwd()) or real == script_dir
            or real in _MODEL_ROOTS or real == active_user_root())


def _rank_path() -> list[str]:
    """The sys.path entries a rank has too."""
    return [e for e in sys.path if not _cwd_only(e)]


def _rank_spec(top: str):
    """The spec a rank would import top-level ``top`` by (None: it has none): stdlib, installed,
    PYTHONPATH, builtins."""
    if top in sys.builtin_module_names:
        return importlib.machinery.ModuleSpec(top, None, origin="built-in")
    return _spec(top, _rank_path())


def _location(module) -> str | None:
    """The file (or a namespace package's first folder) a loaded module came from."""
    where = getattr(module, "__file__", None)
    if where:
        return os.path.realpath(where)
    path = list(getattr(module, "__path__", None) or [])
    return os.path.realpath(path[0]) if path else None


def derive_one(fn, role: str, workload_name: str = "model") -> tuple[tuple, dict]:
    """((spec, kwargs), {copied file: original}) for one user callable (Note [user code travels])."""
    fn, kwargs = _unwrap(fn, role, workload_name)
    path = inspect.getsourcefile(fn) or ""
    if not path or not os.path.isfile(path):
        raise ValueError(f"workload {workload_name!r}: {role} ({fn.__qualname__}) has no source file "
                         f"(defined interactively?): {_fix(role)} in a .py file")
    module_name = fn.__module__ or ""
    module = sys.modules.get(module_name)
    registered = module is not None and getattr(module, fn.__name__, None) is fn
    importable = registered and module_name != "__main__" and _found(module_name, path, None)
    if importable and _found(module_name, path, _rank_path()):
        return (f"{module_name}:{fn.__name__}", kwargs), {}
    if importable and "." in module_name:
        here = os.path.realpath(os.getcwd())
        raise ValueError(
            f"workload {workload_name!r}: {role} is {module_name}.{fn.__name__}, importable here only "
            f"because the current directory ({here}) is on sys.path; the ranks run from their program "
            f"folder and do not see it: install the package (pip install -e .), or export PYTHONPATH={here}")
    # A single file (loaded by path, or a top-level module next to the caller): it travels, with
    # the local modules it imports (Note [local modules travel]).
    if not path.endswith(".py"):
        raise ValueError(f"workload {workload_name!r}: {role} comes from {path}, not a .py file: {_fix(role)}")
    rel = f"{USER_DIR}/{os.path.basename(path)}"
    path = os.path.abspath(path)
    return (f"{rel}:{fn.__name__}", kwargs), local_modules(path, os.path.dirname(path), f"workload {workload_name!r}")


def derive_sources(workload, *, require: bool = True) -> UserSources:
    """Every role's spec: Workload.source's where given, else derived from the function; raises
    ValueError naming the role and the fix. compile() calls it before the trace with
    ``require=False`` (a plan needs no data; writing its program folder does: lowering requires)."""
    specs: dict = {}
    files: dict = {}
    for role in ROLES:
        given = workload.source.get(role)
        if given is not None:
            specs[role] = (given, {}) if isinstance(given, str) else tuple(given)
            continue
        fn = getattr(workload, role)
        if fn is None and not require:
            continue
        if fn is None:
            if role == "loss_fn":
                raise ValueError(f"workload {workload.name!r} has no loss_fn: generated programs need "
                                 "loss_fn(output, target) -> scalar (for a model that returns its own loss: "
                                 "def loss(output, target): return output[0])")
            raise ValueError(f"workload {workload.name!r} has no make_batch: generated programs need "
                             "make_batch(step, batch_size) -> (inputs, target), deterministic in step")
        spec, copied = derive_one(fn, role, workload.name)
        files = _merge(files, copied, workload.name)
        specs[role] = spec
    return UserSources(specs, files)


def _merge(files: dict, more: dict, workload_name: str) -> dict:
    """``files`` and ``more`` ({"user/<rel>": original}) in one DIR/user/, refusing two different
    originals for one copy."""
    out = dict(files)
    for rel, original in more.items():
        if out.get(rel, original) != original:
            raise ValueError(f"workload {workload_name!r}: two different files would both be the program's {rel} "
                             f"({out[rel]}, {original}): rename one")
        out[rel] = original
    return out


# ---------------------------------------------------------------------------------------------
# The local modules a travelling file imports (Note [local modules travel]).

_INSTALL_FIX = "pip install -e . (a pyproject.toml in that folder), or export PYTHONPATH={entry}"


def _fix_where(entry: str) -> str:
    return ("make it importable where it is, so the ranks import it instead of a copy: "
            + _INSTALL_FIX.format(entry=entry))


def _locate(root: str, parts: list[str]) -> tuple[str, str | None]:
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
    spec = _rank_spec(top)
    loaded = _location(sys.modules.get(top))
    if not kind:
        if spec is None and loaded and not _within(loaded, [root]):
            entry = os.path.dirname(os.path.dirname(loaded)) if os.path.basename(loaded) == "__init__.py" \
                else os.path.dirname(loaded)
            raise ValueError(f"{who}: {where} imports {top} ({loaded}), which is neither in the model's folder "
                             f"{root} nor installed, so no rank could import it (it is found here only through "
                             f"the current directory or a path set up at compile time): move it into {root}, or "
                             + _fix_where(entry))
        return False  # installed (a rank imports it by name), or never loaded (an optional import)
    if spec is not None and kind != "namespace":
        if found and _within(found, _places(spec)):
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
        kind, found = _locate(root, rel[:i])
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
            kind, found = _locate(root, parts[:1])
            if not _check_top(parts[0], root, kind, found, f"{path}:{line}", who):
                continue
            for i in range(1, len(parts) + 1):
                kind, found = _locate(root, parts[:i])
                if kind == "extension":
                    raise ValueError(f"{who}: {path}:{line} imports {'.'.join(parts[:i])}, a compiled extension "
                                     f"({found}): a binary does not travel with the program: " + _fix_where(root))
                if kind in ("package", "module"):
                    todo.append(found)
                if kind not in ("package", "namespace"):
                    break
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------
# The model file, run as `python my_model.py` would run it.

def _user_frame(exc: BaseException, root: str) -> str:
    """``file:line `code``` of the deepest traceback frame in ``root``: where the user's file failed."""
    found = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if _within(frame.filename, [root]):
            found = f"{frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"
    return found


def _forget_local_modules(root: str) -> None:
    """Drop from sys.modules what an earlier load imported from a folder under a name ``root``
    has too (another model's my_blocks), so this model file imports its own modules afresh."""
    try:  # the top-level names the root offers: its .py files, binaries and folders
        local = {entry.split(".")[0] for entry in os.listdir(root)}
    except OSError:
        return
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        if top not in local:
            continue
        where = _location(module)
        if not where or not _locate(root, [top])[0]:
            continue
        spec = _rank_spec(top)
        if spec is None or not _within(where, _places(spec)):
            del sys.modules[name]
    importlib.invalidate_caches()


def load_model_file(path: str | Path, spec: str) -> types.ModuleType:
    """Run a MODEL file as `python my_model.py` would (its folder first on sys.path, its local
    modules imported afresh), then leave its folder at the end of sys.path, where the ranks have
    their copy of it (Note [one user root] in runtime/user_code.py); a failure is one line naming
    the file's line and what to do."""
    path = Path(path).resolve()
    root = str(path.parent)
    leave_user_root()  # a program folder verify entered: its copies are not this model's modules
    for old in _MODEL_ROOTS:  # the previous model's folder, appended below: only that entry
        if old in sys.path:
            del sys.path[len(sys.path) - 1 - sys.path[::-1].index(old)]
    _MODEL_ROOTS[:] = [root]
    _forget_local_modules(root)
    sys.path.insert(0, root)
    try:
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file; reported in their terms
        where = _user_frame(exc, root)
        text = str(exc).strip().splitlines()
        message = f"{type(exc).__name__}: {text[0] if text else ''}"
        fix = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            fix = (f": {exc.name} is neither installed nor a module of {root} (where the model file's own "
                   f"modules are looked for): install it, or put {exc.name.partition('.')[0]}.py next to {path.name}")
        raise ValueError(f"MODEL {spec!r}: running {path.name} raised {message}"
                         + (f" at {where}" if where else "") + fix) from None
    finally:
        sys.path.remove(root)
        sys.path.append(root)
    return module


# ---------------------------------------------------------------------------------------------
# Custom ops (Note [custom ops travel] in partitioner/codegen/stage_code.py).

def _module_root(name: str, path: str) -> str | None:
    """The sys.path entry module ``name`` was imported from, given its file, or None when the
    name does not match the file's place (a file imported by path under another name)."""
    parts = name.split(".") + (["__init__"] if os.path.basename(path) == "__init__.py" else [])
    places = os.path.realpath(path).removesuffix(".py").split(os.sep)
    if len(places) <= len(parts) or places[-len(parts):] != parts:
        return None
    return os.sep.join(places[:-len(parts)]) or os.sep


def op_sources(ops: dict, sources: UserSources, workload_name: str) -> UserSources:
    """``sources`` with each custom op's module to import and the files that travel for it.

    ``ops``: {"ns::op": (namespace, node name, the function its torch.library.custom_op
    definition wraps or None)}. A module a rank can import is imported by its name; one of the
    user's folder (the model file itself, a sibling: run by path, as __main__, or found through the
    current directory) travels into DIR/user/ with its local imports and is imported there by its
    module name (Note [one user root] in runtime/user_code.py); else the package named like the
    namespace; else refused."""
    who = f"workload {workload_name!r}"
    imports: dict[str, str] = {}
    files = dict(sources.files)
    for qualname, (namespace, node, fn) in sorted(ops.items()):
        module = getattr(fn, "__module__", None)
        path = inspect.getsourcefile(fn) if fn is not None else None
        path = os.path.realpath(path) if path and os.path.isfile(path) else None
        name = None
        if module and module != "__main__" and path and _found(module, path, _rank_path()):
            name = module  # installed: the ranks import it by name
        elif path and path.endswith(".py"):
            root = _module_root(module, path) if module and module != "__main__" else None
            if root is None or _rank_spec(module.partition(".")[0]) is not None:
                root = os.path.dirname(path)  # run by path, as __main__, or named like no file of its folder
            name = user_module_name(os.path.relpath(path, root).replace(os.sep, "/"))
            if not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"{who}: the custom op {qualname} is defined in {path}, which a stage file "
                                 f"imports by its module name {name!r}, not a Python name: rename the file")
            if _rank_spec(name.partition(".")[0]) is not None:
                raise ValueError(f"{who}: the custom op {qualname} is defined in {path}, and the ranks would "
                                 f"import the installed module {name.partition('.')[0]} by that name instead: "
                                 "rename your file")
            files = _merge(files, local_modules(path, root, who), workload_name)
        elif importlib.util.find_spec(namespace) is not None:
            name = namespace
        if name is None:
            raise ValueError(
                f"node {node!r} calls the custom op {qualname}, and no importable module registers "
                f"it (no torch.library.custom_op definition in a file of yours or an importable module, no "
                f"package named {namespace!r}): define the op with torch.library.custom_op in your model "
                "file or a module it imports, so that the generated stage file can import it")
        imports[qualname] = name
    return UserSources(sources.specs, files, imports)


# ---------------------------------------------------------------------------------------------
# The copies imported as a rank will import them.

_TRY_IMPORTS = r"""
import json, os, sys, traceback
folder, specs, modules = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
try:
    from runtime.user_code import import_user_module, resolve_callable
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
    from runtime.torchrun import run_env

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
