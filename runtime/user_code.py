"""The names a program holds, made objects: user callables ("pkg.mod:fn" or "path/file.py:fn"),
.py files imported by path, dtypes by name."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from typing import Callable


def resolve_callable(spec: list | tuple | str, folder: str | None = None) -> Callable:
    """``["pkg.mod:fn", {kwargs}]`` or ``"pkg.mod:fn"`` -> fn with kwargs bound.

    The module part may also be a path to a .py file (relative paths are taken from the program
    folder), for user code that is not an installed package.
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
        module = _file_module(os.path.abspath(path))
    else:
        module = importlib.import_module(mod_name)
    fn = getattr(module, fn_name)
    return functools.partial(fn, **kwargs) if kwargs else fn


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
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
