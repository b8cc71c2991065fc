"""The passes' contract (docs/design.md §4, Note [one writer per key] in passes/ir.py), held on
the product's own pass list: ``passes.PIPELINE``, which ``partitioner.frontend.analysis.annotate`` runs.

- every key a pass declares it reads was written by an earlier pass of the list;
- running the list, every key of ours a pass reads or writes is one it declared.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch

import passes
from passes import ir
from partitioner.models import builtin as models
from partitioner.frontend.analysis import annotate
from partitioner.frontend.trace import trace

OURS = frozenset(ir.VALUE_TYPES)


def order_problems(specs) -> list[str]:
    """Declared reads that no earlier pass of ``specs`` (``ir.PassSpec``, in run order) writes."""
    written: set[str] = set()
    problems = []
    for spec in specs:
        problems += [f"{spec.name} reads {key}, which no earlier pass writes" for key in spec.reads if key not in written]
        written |= set(spec.writes)
    return problems


def test_each_declared_read_is_written_by_an_earlier_pass():
    specs = [graph_pass.spec for graph_pass in passes.PIPELINE]
    assert not order_problems(specs)
    assert [key for spec in specs for key in spec.writes] == list(ir.WRITER)  # every key has its writer in the list
    # the check can fail: the same list with memory (reads shapes) moved first
    moved = [specs[2], *specs[:2], *specs[3:]]
    assert order_problems(moved) == [f"{specs[2].name} reads {ir.SHAPE}, which no earlier pass writes"]


class _Watched(dict):
    """A node's meta that records which keys are read (``[]``, ``get``, ``in``) and written."""

    def __init__(self, meta, log):
        super().__init__(meta)
        self.log = log

    def __getitem__(self, key):
        self.log.append(("read", key))
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.log.append(("read", key))
        return super().get(key, default)

    def __contains__(self, key):
        self.log.append(("read", key))
        return super().__contains__(key)

    def __setitem__(self, key, value):
        self.log.append(("write", key))
        super().__setitem__(key, value)


def touched_keys(gm, monkeypatch, *, via=None) -> dict[str, dict[str, set[str]]]:
    """Run the product's pass list over ``gm`` (through ``via``, default ``passes.run_all``) and
    return, per pass, the keys of ours it read and wrote."""
    log: list = []
    for node in gm.graph.nodes:
        node.meta = _Watched(node.meta, log)
    touched = collections.defaultdict(lambda: {"read": set(), "write": set()})
    ran = []

    def watched(graph_pass):
        @functools.wraps(graph_pass)
        def run(*args, **kwargs):
            del log[:]
            result = graph_pass(*args, **kwargs)
            ran.append(graph_pass.spec.name)
            for what, key in log:
                if key in OURS:
                    touched[graph_pass.spec.name][what].add(key)
            return result
        return run

    monkeypatch.setattr(passes, "PIPELINE", tuple(watched(p) for p in passes.PIPELINE))
    (via or passes.run_all)(gm)
    assert ran == [p.spec.name for p in passes.PIPELINE]
    return touched


def undeclared(touched, specs) -> list[str]:
    problems = []
    for spec in specs:
        own = set(spec.writes)
        problems += [f"{spec.name} reads {key} but declares reads={spec.reads}"
                     for key in sorted(touched[spec.name]["read"] - set(spec.reads) - own)]
        problems += [f"{spec.name} writes {key} but declares writes={spec.writes}"
                     for key in sorted(touched[spec.name]["write"] - own)]
    return problems


@functools.cache
def _workload():
    return models.gpt(layers=1, width=16, heads=2, vocab=32, seq=4, batch=2)


def test_the_compiler_runs_the_pass_list_and_each_pass_touches_what_it_declares(monkeypatch):
    workload = _workload()
    traced = trace(workload.model, workload.example_args)
    touched = touched_keys(traced.gm, monkeypatch, via=lambda gm: annotate(traced, loss_outside_graph=True))
    specs = [p.spec for p in passes.PIPELINE]
    assert not undeclared(touched, specs)
    assert touched["passes.memory.annotate_memory"]["read"] - {ir.MEMORY} == {ir.SHAPE}  # it sees a real read
    # and fails when a declaration leaves one out
    memory = next(s for s in specs if s.name == "passes.memory.annotate_memory")
    assert undeclared(touched, [ir.PassSpec(memory.name, (), memory.writes)]) == [
        f"passes.memory.annotate_memory reads {ir.SHAPE} but declares reads=()"]


def test_run_all_is_the_pass_list(monkeypatch):
    gm = trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.zeros(2, 4),)).gm
    touched = touched_keys(gm, monkeypatch)
    assert set(touched) == {p.spec.name for p in passes.PIPELINE}
    for node in gm.graph.nodes:
        assert OURS <= set(dict.keys(node.meta)), node.name


def test_a_pass_must_declare_its_reads():
    with pytest.raises(TypeError, match="reads"):
        ir.graph_pass(writes=(ir.SHAPE,))
