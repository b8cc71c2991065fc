"""What a rank can import: the sys.path a rank has (the compiler's, less what is there only
because of where the compiler was started), the spec a rank would import a top-level name by, and
where a loaded module came from. Shared by the user code that travels (partitioner/frontend/user_source.py,
Note [user code travels]) and its local modules (partitioner/frontend/local_modules.py, Note [local modules
travel])."""

from __future__ import annotations

import importlib.machinery
import os
import sys

from runtime.program.user_code import active_user_root


def spec_through(top: str, entries: list[str] | None):
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


def places(spec) -> list[str]:
    return list(spec.submodule_search_locations or []) or ([os.path.dirname(spec.origin)] if spec.origin else [])


def within(path: str, places: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real.startswith(os.path.realpath(p) + os.sep) for p in places)


def found_through(module_name: str, path: str, entries: list[str] | None) -> bool:
    """Does importing ``module_name``'s top package through ``entries`` (None: every sys.path
    entry) or an import hook (editable installs) find the package holding ``path``?"""
    spec = spec_through(module_name.partition(".")[0], entries)
    return spec is not None and within(path, places(spec))


MODEL_ROOTS: list[str] = []  # the folder ``load_model_file`` put on sys.path (realpath), if any


def cwd_only(entry: str) -> bool:
    """Is sys.path ``entry`` there only because of where the compiler was started (the current
    directory, the directory of the script run, the folder of the model file loaded, a program's
    user root entered by verify), i.e. absent in a rank?"""
    inherited = [os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    real = os.path.realpath(entry or os.curdir)
    if real in inherited:
        return False
    script_dir = os.path.realpath(os.path.dirname(os.path.abspath(sys.argv[0]))) if sys.argv and sys.argv[0] else None
    return (entry in ("", ".") or real == os.path.realpath(os.getcwd()) or real == script_dir
            or real in MODEL_ROOTS or real == active_user_root())


def rank_path() -> list[str]:
    """The sys.path entries a rank has too."""
    return [e for e in sys.path if not cwd_only(e)]


def rank_spec(top: str):
    """The spec a rank would import top-level ``top`` by (None: it has none): stdlib, installed,
    PYTHONPATH, builtins."""
    if top in sys.builtin_module_names:
        return importlib.machinery.ModuleSpec(top, None, origin="built-in")
    return spec_through(top, rank_path())


def location(module) -> str | None:
    """The file (or a namespace package's first folder) a loaded module came from."""
    where = getattr(module, "__file__", None)
    if where:
        return os.path.realpath(where)
    path = list(getattr(module, "__path__", None) or [])
    return os.path.realpath(path[0]) if path else None
