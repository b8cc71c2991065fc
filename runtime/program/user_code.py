"""The names a program holds, made objects: user callables ("pkg.mod:fn" or "path/file.py:fn"),
the user's files of DIR/user/ imported by their module names, other .py files imported by path,
dtypes by name."""

from __future__ import annotations

import filecmp
import functools
import importlib
import importlib.util
import os
import sys
from typing import Callable

USER_DIR = "user"  # the program folder's copy of the user's files (Note [user code travels])

# Note [one user root]: the user's files a program needs (the model file, the sibling modules and
# local packages it imports, partitioner/frontend/user_source.py) are copied into DIR/user/ laid out as in
# the user's folder, and a rank imports them from there by their own module names, as the model
# file did at compile time: DIR/user/ is appended to sys.path (``enter_user_root``), so
# `from my_blocks import Block` inside the copied model file finds the copied sibling, a stage
# file's `import my_model` (Note [custom ops travel]) and make_batch's "user/my_model.py" are one
# module executed once (a custom op registered once), and nothing installed is ever shadowed
# (appended, not prepended: the compiler refuses a sibling or a custom op's file whose name an
# installed module has; a make_batch file named like one is imported by path, ``_user_module``).
# One root at a time: a process that runs several folders one after another (tests/drivers/run_many.py,
# verify in the compiler's process) leaves the previous root first, dropping the modules imported
# from it, so two programs whose files share a name (two my_model.py) never see each other's.
_ROOT: list[str] = []  # the active user root, if any (realpath)


def user_module_name(rel: str) -> str:
    """"user/layers/mix.py" -> "layers.mix" (a package's __init__.py: the package)."""
    parts = rel.removeprefix(USER_DIR + "/").removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _under(path: str | None, root: str) -> bool:
    return bool(path) and os.path.realpath(path).startswith(root + os.sep)


def leave_user_root() -> None:
    """Drop the active user root from sys.path and its modules from sys.modules (Note [one user root])."""
    if not _ROOT:
        return
    root = _ROOT.pop()
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    for name, module in list(sys.modules.items()):
        if _under(getattr(module, "__file__", None), root):
            del sys.modules[name]
    importlib.invalidate_caches()


def enter_user_root(folder: str) -> None:
    """Make ``folder``/user the one user root (Note [one user root]); a folder without one leaves
    the previous root all the same."""
    root = os.path.realpath(os.path.join(folder, USER_DIR))
    if _ROOT == [root]:
        return
    leave_user_root()
    if os.path.isdir(root):
        sys.path.append(root)
        _ROOT.append(root)
        importlib.invalidate_caches()


def active_user_root() -> str | None:
    return _ROOT[0] if _ROOT else None


def import_user_module(folder: str, name: str):
    """The module ``name`` of ``folder``/user, imported by its name (Note [one user root])."""
    enter_user_root(folder)
    return importlib.import_module(name)


def resolve_callable(spec: list | tuple | str, folder: str | None = None) -> Callable:
    """``["pkg.mod:fn", {kwargs}]`` or ``"pkg.mod:fn"`` -> fn with kwargs bound.

    The module part may also be a path to a .py file (relative paths are taken from the program
    folder), for user code that is not an installed package: one under DIR/user/ is imported by
    its module name (Note [one user root]), any other by path.
    """
    if isinstance(spec, str):
        target, kwargs = spec, {}
    else:
        target, kwargs = spec[0], dict(spec[1] if len(spec) > 1 else {})
    mod_name, _, fn_name = target.rpartition(":")
    if not mod_name or not fn_name:
        raise ValueError(f"callable {target!r} must look like 'package.module:function'")
    if mod_name.endswith(".py"):
        path = mod_name if os.path.isabs(mod_name) or folder is None else os.path.join(folder, mod_name)
        module = _user_module(folder, mod_name) if folder is not None else None
        if module is None:
            module = _file_module(os.path.abspath(path))
    else:
        module = importlib.import_module(mod_name)
    fn = getattr(module, fn_name)
    return functools.partial(fn, **kwargs) if kwargs else fn


def _user_module(folder: str, rel: str):
    """The copy DIR/user/<rel> imported by its module name, or None when ``rel`` is not under
    user/ or that name is another module here (a rank whose PYTHONPATH holds the user's own folder,
    the compiler's process holding the original): then the file is imported by path."""
    path = os.path.realpath(os.path.join(folder, rel))
    if os.path.isabs(rel) or not rel.startswith(USER_DIR + "/") or not os.path.isfile(path):
        return None
    name = user_module_name(rel)
    enter_user_root(folder)
    try:  # where the name resolves, without running it
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    origin = os.path.realpath(found.origin) if found is not None and found.origin else None
    if origin is not None and origin != path and not filecmp.cmp(origin, path, shallow=False):
        return None  # another file of that name (an earlier model's folder on sys.path): not ours to run
    module = import_user_module(folder, name)
    file = os.path.realpath(getattr(module, "__file__", "") or "")
    # the model file the compiler's process ran, identical to its copy: that module, not a second run
    # of the file (Note [a model file runs once] in partitioner/frontend/user_source.py)
    same = file == path or (os.path.isfile(file) and filecmp.cmp(file, path, shallow=False))
    return module if same else None


_FILE_MODULES: dict = {}


def _file_module(path: str):
    """One import per file and version of it: make_batch and loss_fn of one user file
    (DIR/user/<file>.py) share a module, run once."""
    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _FILE_MODULES:
        _FILE_MODULES[key] = import_path(path)
    return _FILE_MODULES[key]


def import_path(path: str, name: str | None = None):
    """Import a .py file by path without touching sys.path or sys.modules."""
    path = os.path.abspath(path)
    name = name or "_runtime_loaded_" + str(abs(hash(path)))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tensor_dtype(name: str):
    # lazy: loads torch
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
