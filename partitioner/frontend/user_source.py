"""Where generated programs find the user's code: ``make_batch``, ``loss_fn`` and the modules that
register custom ops, derived from the functions themselves, checked before anything is traced, and
a model file loaded as a script would run. The user's files that travel with them, the model file
and the local modules it imports, are found by partitioner/frontend/local_modules.py.

Note [user code travels]: a program's ranks import the user's data and loss functions by the
names plan.json's program gives them (runtime/program/user_code.py ``resolve_callable``). Each rank runs
with its program folder, not the user's working directory, as its home, and with
PYTHONSAFEPATH=1 (runtime/launch/torchrun.py ``run_env``), so a name that worked at compile time only
because the current directory was on sys.path would fail inside every rank. Hence, per function:

  * a module-level function of an importable module (an installed package, or one on
    PYTHONPATH, which workers inherit) is named "package.module:function";
  * a module-level function of a ``.py`` file that is no importable module (the
    ``partitioner compile my_model.py:build`` case) has that file copied into the program folder as
    ``user/<file>.py`` and is named "user/<file>.py:function", a path relative to the folder: the
    folder then runs wherever it is copied, and plan.json's file map hashes the copy like every
    other file, so Note [folder integrity] (runtime/program/spec.py) covers the code the ranks import.
    The file's own local imports travel with it (Note [local modules travel] in
    partitioner/frontend/local_modules.py), and the ranks import
    the copies by their module names (Note [one user root] in runtime/program/user_code.py);
  * a module importable only from the current directory is refused with the fix (install it,
    set PYTHONPATH, or name its file);
  * lambdas, nested functions (closures), bound methods and callable objects are refused with the
    fix: a rank cannot import them. ``functools.partial(f, key=value)`` of such a function is
    fine: its keyword arguments travel as the spec's kwargs (they must be JSON values).

``Workload.source`` still wins where it names a function (built-ins do, pointing into runtime/).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import sys
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path

from partitioner.frontend.local_modules import locate, local_modules
from partitioner.frontend.rank_imports import MODEL_ROOTS, found_through, location, places, rank_path, rank_spec, within
from runtime.errors import import_failure
from runtime.program.user_code import USER_DIR, leave_user_root, user_module_name

ROLES = ("make_batch", "loss_fn")
# Roles only a source names, never derived from a function (Note [a corpus replaces make_batch]).
OPTIONAL_ROLES = ("rows", "eval_batch")


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
    importable = registered and module_name != "__main__" and found_through(module_name, path, None)
    if importable and found_through(module_name, path, rank_path()):
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
    for role in OPTIONAL_ROLES:
        given = workload.source.get(role)
        if given is not None:
            specs[role] = (given, {}) if isinstance(given, str) else tuple(given)
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
# Custom ops (Note [custom ops travel] in partitioner/codegen/stage_code.py).

def _module_root(name: str, path: str) -> str | None:
    """The sys.path entry module ``name`` was imported from, given its file, or None when the
    name does not match the file's place (a file imported by path under another name)."""
    parts = name.split(".") + (["__init__"] if os.path.basename(path) == "__init__.py" else [])
    folders = os.path.realpath(path).removesuffix(".py").split(os.sep)
    if len(folders) <= len(parts) or folders[-len(parts):] != parts:
        return None
    return os.sep.join(folders[:-len(parts)]) or os.sep


def op_sources(ops: dict, sources: UserSources, workload_name: str) -> UserSources:
    """``sources`` with each custom op's module to import and the files that travel for it.

    ``ops``: {"ns::op": (namespace, node name, the function its torch.library.custom_op
    definition wraps or None)}. A module a rank can import is imported by its name; one of the
    user's folder (the model file itself, a sibling: run by path, as __main__, or found through the
    current directory) travels into DIR/user/ with its local imports and is imported there by its
    module name (Note [one user root] in runtime/program/user_code.py); else the package named like the
    namespace; else refused."""
    who = f"workload {workload_name!r}"
    imports: dict[str, str] = {}
    files = dict(sources.files)
    for qualname, (namespace, node, fn) in sorted(ops.items()):
        what = "custom op" if namespace else "autograd Function"  # Note [autograd Functions run as themselves]
        module = getattr(fn, "__module__", None)
        path = inspect.getsourcefile(fn) if fn is not None else None
        path = os.path.realpath(path) if path and os.path.isfile(path) else None
        name = None
        if module and module != "__main__" and path and found_through(module, path, rank_path()):
            name = module  # installed: the ranks import it by name
        elif path and path.endswith(".py"):
            root = _module_root(module, path) if module and module != "__main__" else None
            if root is None or rank_spec(module.partition(".")[0]) is not None:
                root = os.path.dirname(path)  # run by path, as __main__, or named like no file of its folder
            name = user_module_name(os.path.relpath(path, root).replace(os.sep, "/"))
            if not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"{who}: the {what} {qualname} is defined in {path}, which a stage file "
                                 f"imports by its module name {name!r}, not a Python name: rename the file")
            if rank_spec(name.partition(".")[0]) is not None:
                raise ValueError(f"{who}: the {what} {qualname} is defined in {path}, and the ranks would "
                                 f"import the installed module {name.partition('.')[0]} by that name instead: "
                                 "rename your file")
            files = _merge(files, local_modules(path, root, who), workload_name)
        elif namespace and importlib.util.find_spec(namespace) is not None:
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
# The model file, run as `python my_model.py` would run it.

def _user_frame(exc: BaseException, root: str) -> str:
    """``file:line `code``` of the deepest traceback frame in ``root``: where the user's file failed."""
    found = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if within(frame.filename, [root]):
            found = f"{frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"
    return found


def _broke_outside(exc: BaseException, root: str) -> bool:
    """Whether ``exc`` was raised from another exception or in a file outside the user's folder
    ``root`` (not by the import system itself: a missing module is the user's line)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    return exc.__cause__ is not None or (bool(frames) and not within(frames[-1].filename, [root]))


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
        where = location(module)
        if not where or not locate(root, [top])[0]:
            continue
        spec = rank_spec(top)
        if spec is None or not within(where, places(spec)):
            del sys.modules[name]
    importlib.invalidate_caches()


def _known_by_its_name(module: types.ModuleType, path: Path) -> None:
    """``module`` (the file ``path`` just run) as sys.modules[its name] when that name finds this file.

    Note [a model file runs once]: what this process imports by the file's name later (make_batch's
    "user/my_model.py" in verify's oracle, a stage file's `import my_model`) is then this module,
    not a second run of the file. A second run re-registers the file's torch.library custom ops,
    and torch then drops the first run's registration: the model built from the first run calls an
    op whose handle is gone (an internal assert in torch's dispatcher, or worse), as verify's
    oracle once did at random under the whole suite."""
    try:
        found = importlib.util.find_spec(path.stem)
    except (ImportError, ValueError):
        return
    if found is not None and found.origin and Path(found.origin).resolve() == path:
        sys.modules[path.stem] = module


def load_model_file(path: str | Path, spec: str) -> types.ModuleType:
    """Run a MODEL file as `python my_model.py` would (its folder first on sys.path, its local
    modules imported afresh), then leave its folder at the end of sys.path, where the ranks have
    their copy of it (Note [one user root] in runtime/program/user_code.py); a failure is one line naming
    the file's line and what to do."""
    path = Path(path).resolve()
    root = str(path.parent)
    leave_user_root()  # a program folder verify entered: its copies are not this model's modules
    for old in MODEL_ROOTS:  # the previous model's folder, appended below: only that entry
        if old in sys.path:
            del sys.path[len(sys.path) - 1 - sys.path[::-1].index(old)]
    MODEL_ROOTS[:] = [root]
    _forget_local_modules(root)
    sys.path.insert(0, root)
    try:
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        _known_by_its_name(module, path)
    except Exception as exc:  # noqa: BLE001 - the user's file; reported in their terms
        where = _user_frame(exc, root)
        if _broke_outside(exc, root):  # a package it imports: Note [the real import error] in runtime/errors.py
            raise ValueError(f"MODEL {spec!r}: running {path.name}, {where or 'an import'} raised "
                             f"{import_failure(exc)}") from None
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
