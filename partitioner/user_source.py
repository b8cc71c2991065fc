"""Where generated programs find a workload's ``make_batch`` and ``loss_fn``: derived from the
functions themselves, checked before anything is traced.

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
    other file, so Note [folder integrity] (runtime/program.py) covers the code the ranks import;
  * a module importable only from the current directory is refused with the fix (install it,
    set PYTHONPATH, or name its file);
  * lambdas, nested functions (closures), bound methods and callable objects are refused with the
    fix: a rank cannot import them. ``functools.partial(f, key=value)`` of such a function is
    fine: its keyword arguments travel as the spec's kwargs (they must be JSON values).

``Workload.source`` still wins where it names a function (built-ins do, pointing into runtime/).
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import inspect
import json
import os
import sys
import types
from dataclasses import dataclass, field

ROLES = ("make_batch", "loss_fn")
USER_DIR = "user"  # inside the program folder


@dataclass(frozen=True)
class UserSources:
    """What lowering writes: the specs plan.json's program names, and the files to copy."""

    specs: dict  # role -> ("module:function" | "user/<file>.py:function", {kwargs})
    files: dict = field(default_factory=dict)  # "user/<file>.py" -> absolute path of the original


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


def _found(module_name: str, path: str, entries: list[str] | None) -> bool:
    """Does importing ``module_name``'s top package through ``entries`` (None: every sys.path
    entry) or an import hook (editable installs) find the package holding ``path``?"""
    top = module_name.partition(".")[0]
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
    if spec is None:
        return False
    places = list(spec.submodule_search_locations or []) or ([os.path.dirname(spec.origin)] if spec.origin else [])
    real = os.path.realpath(path)
    return any(real.startswith(os.path.realpath(p) + os.sep) for p in places)


def _cwd_only(entry: str) -> bool:
    """Is sys.path ``entry`` there only because of where the compiler was started (the current
    directory, or the directory of the script run), i.e. absent in a rank?"""
    inherited = [os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    real = os.path.realpath(entry or os.curdir)
    if real in inherited:
        return False
    script_dir = os.path.realpath(os.path.dirname(os.path.abspath(sys.argv[0]))) if sys.argv and sys.argv[0] else None
    return entry in ("", ".") or real == os.path.realpath(os.getcwd()) or real == script_dir


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
    if importable and _found(module_name, path, [e for e in sys.path if not _cwd_only(e)]):
        return (f"{module_name}:{fn.__name__}", kwargs), {}
    if importable and "." in module_name:
        here = os.path.realpath(os.getcwd())
        raise ValueError(
            f"workload {workload_name!r}: {role} is {module_name}.{fn.__name__}, importable here only "
            f"because the current directory ({here}) is on sys.path; the ranks run from their program "
            f"folder and do not see it: install the package (pip install -e .), or export PYTHONPATH={here}")
    # A single file (loaded by path, or a top-level module next to the caller): it travels.
    if not path.endswith(".py"):
        raise ValueError(f"workload {workload_name!r}: {role} comes from {path}, not a .py file: {_fix(role)}")
    rel = f"{USER_DIR}/{os.path.basename(path)}"
    return (f"{rel}:{fn.__name__}", kwargs), {rel: os.path.abspath(path)}


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
        for rel, original in copied.items():
            if files.get(rel, original) != original:
                raise ValueError(f"workload {workload.name!r}: two different files are both named "
                                 f"{os.path.basename(original)} ({files[rel]}, {original}): rename one")
        files.update(copied)
        specs[role] = spec
    return UserSources(specs, files)
