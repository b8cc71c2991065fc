"""The one Python version check, run when ``partitioner`` or ``runtime`` is imported.

Python 3.11 or newer: the code reads TOML with the standard library's ``tomllib`` (3.11), and the
pinned numpy and transformers (constraints.txt) need 3.11. pyproject.toml says the same
(``requires-python``), so pip refuses an older interpreter; this check covers a checkout used
without installing it (PYTHONPATH) and says what to do. Written for any Python 3.
"""

import sys

MINIMUM = (3, 11)


def check_python(version=None):
    version = tuple(sys.version_info if version is None else version)
    if version[:2] < MINIMUM:
        raise ImportError(
            "partitioner needs Python %d.%d or newer (tomllib; the pinned numpy and transformers), and this is "
            "Python %s: create the environment with a newer interpreter, e.g. `python3.11 -m venv .venv` "
            "(README \"Install\")" % (MINIMUM + (".".join(map(str, version[:3])),)))
