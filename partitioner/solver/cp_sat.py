"""OR-Tools' CP-SAT, loaded at its first use (Note [the solver loads OR-Tools on demand]).

Note [the solver loads OR-Tools on demand]: program folders are compiled where OR-Tools is and run
anywhere; a GPU cluster's image has no OR-Tools. Every `partitioner` command that reads a plan (run,
verify, inspect, export, generate) imports the solver package for its plain-number types, so the
modules that build CP-SAT models name ``cp_model`` through this proxy, which imports OR-Tools the
first time an attribute is read: in a solve, never in a command that only reads a plan.
"""

from __future__ import annotations

import importlib


class _CpModel:
    """``ortools.sat.python.cp_model``, imported when first read."""

    def __getattr__(self, name: str):
        try:
            module = importlib.import_module("ortools.sat.python.cp_model")
        except ImportError as exc:
            raise ImportError(f"compiling a plan needs OR-Tools ({exc}): pip install ortools, or compile on "
                              "a machine that has it and carry the program folder here") from exc
        return getattr(module, name)


cp_model = _CpModel()
