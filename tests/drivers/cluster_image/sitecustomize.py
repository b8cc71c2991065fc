"""Makes a process look like a GPU cluster's image (Note [what the runtime needs] in
runtime/torch_version.py). Put this folder first on PYTHONPATH: Python imports ``sitecustomize``
at start-up, and from then on a top-level module is importable only when it is in the standard
library's folders, is ``runtime``, or is one of the import names PARTITIONER_IMAGE_ALLOWS lists (comma
separated; tests/e2e/test_runtime_needs.py lists torch with every package it requires, numpy
and safetensors). Any other (ortools, zstandard, tensorboard, transformers, partitioner, passes)
looks not installed: every finder answers "not found" for it, as when it is absent, so
``importlib.util.find_spec`` says None and ``import`` raises ModuleNotFoundError.
PARTITIONER_IMAGE_REPORT: a file that receives, at exit, the top-level modules loaded and the
ones refused, as JSON.
"""

import atexit
import json
import os
import sys
import sysconfig

_ALLOWED = {name for name in os.environ.get("PARTITIONER_IMAGE_ALLOWS", "").split(",") if name}
_ALLOWED |= {"runtime", "sitecustomize"}
# the standard library's folders (a module there is allowed whatever its name: _sysconfigdata_*)
_STDLIB = tuple(os.path.join(os.path.realpath(sysconfig.get_paths()[key]), "") for key in ("stdlib", "platstdlib"))
_REFUSED: set = set()


def _in_stdlib(spec) -> bool:
    origin = spec.origin or ""
    if origin in ("built-in", "frozen"):
        return True
    origin = os.path.realpath(origin) if origin else ""
    return (origin.startswith(_STDLIB) and "site-packages" not in origin and "dist-packages" not in origin)


class _Gate:
    """A finder of the import system that answers "not found" for a refused top-level name and
    asks the finder it wraps otherwise."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        find = getattr(self.inner, "find_spec", None)
        spec = find(name, path, target) if find is not None else None
        top = name.partition(".")[0]
        if spec is None or "." in name or top in _ALLOWED or _in_stdlib(spec):
            return spec  # a submodule follows its package: refused packages have none loaded
        _REFUSED.add(top)
        return None

    def invalidate_caches(self):
        if hasattr(self.inner, "invalidate_caches"):
            self.inner.invalidate_caches()


def _report():
    path = os.environ.get("PARTITIONER_IMAGE_REPORT")
    if path:
        loaded = sorted({name.partition(".")[0] for name in list(sys.modules)})
        with open(path, "w") as f:
            json.dump({"loaded": loaded, "refused": sorted(_REFUSED)}, f)


sys.meta_path[:] = [_Gate(finder) for finder in sys.meta_path]
atexit.register(_report)
