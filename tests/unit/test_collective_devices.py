"""A lint over runtime/ (read from the source, nothing imported): every collective or point-to-point
call on a group NCCL would serve sends tensors made with ``device=``, never a factory's default
(the CPU on a GPU run: "No backend type associated with device type cpu"). Calls on a gloo group
(the control group, the Checkpointer's, the memory tier's: Note [the control group] in
runtime/parallel/control.py) may send host tensors. What the lint cannot see, a ``device=`` that
names the CPU, the run-time emulation does (Note [NCCL emulation] in
runtime/parallel/nccl_emulation.py) and the other way round."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COLLECTIVES = {"all_reduce", "all_gather", "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "all_gather_into_tensor", "reduce_scatter_single", "all_gather_single", "gather", "scatter",
               "all_to_all_single", "isend", "irecv", "send", "recv", "_REDUCE_SCATTER", "_ALL_GATHER"}
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "as_tensor",
             "frombuffer", "from_numpy", "linspace", "eye"}
# gloo groups, by what the call site passes as group= (each checked to be gloo by test_the_gloo_groups_are_gloo)
GLOO_GROUPS = {"control_group()", "tier.group", "Checkpointer:self.group", "MemoryTier:self.group"}


def _collective(call: ast.Call) -> str | None:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "dist" else (
        f.id if isinstance(f, ast.Name) else None)
    return name if name in COLLECTIVES else None


def _assignments(fn: ast.AST) -> dict[str, list[tuple[int, ast.expr]]]:
    out: dict[str, list] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out.setdefault(target.id, []).append((node.lineno, node.value))
                elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for t, v in zip(target.elts, node.value.elts):
                        if isinstance(t, ast.Name):
                            out.setdefault(t.id, []).append((node.lineno, v))
    return out


def _last(assigned, name: str, line: int) -> ast.expr | None:
    before = [v for ln, v in assigned.get(name, ()) if ln <= line]
    return before[-1] if before else None


def _deviceless_factory(expr: ast.expr) -> str | None:
    """The factory call in ``expr`` made without device= (directly, or as a list's elements)."""
    if isinstance(expr, (ast.ListComp, ast.List)):
        for e in ([expr.elt] if isinstance(expr, ast.ListComp) else expr.elts):
            if (bad := _deviceless_factory(e)) is not None:
                return bad
        return None
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and isinstance(expr.func.value, ast.Name) \
            and expr.func.value.id == "torch" and expr.func.attr in FACTORIES:
        if not any(k.arg == "device" for k in expr.keywords):
            return f"torch.{expr.func.attr}"
    return None


def offenders(sources: dict[str, str]) -> list[str]:
    """``file:line: what`` for each collective on a device group sending a tensor made without device=."""
    out = []
    for path, text in sources.items():
        tree = ast.parse(text)
        for cls in [None, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
            body = tree.body if cls is None else cls.body
            for fn in [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
                assigned = _assignments(fn)
                for call in [n for n in ast.walk(fn) if isinstance(n, ast.Call)]:
                    what = _collective(call)
                    if what is None:
                        continue
                    group = next((k.value for k in call.keywords if k.arg == "group"), None)
                    if isinstance(group, ast.Name) and (v := _last(assigned, group.id, call.lineno)) is not None:
                        group = v
                    text_of = ast.unparse(group) if group is not None else ""
                    if text_of in GLOO_GROUPS or f"{cls.name if cls else ''}:{text_of}" in GLOO_GROUPS:
                        continue
                    for arg in call.args:
                        expr = _last(assigned, arg.id, call.lineno) if isinstance(arg, ast.Name) else arg
                        if expr is not None and (bad := _deviceless_factory(expr)) is not None:
                            out.append(f"{path}:{call.lineno}: dist.{what} on {text_of or 'the default group'} sends "
                                       f"a {bad} made without device=")
    return out


def _runtime() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "runtime").rglob("*.py"))}


def test_collectives_on_device_groups_send_device_tensors():
    bad = offenders(_runtime())
    assert not bad, "\n".join(bad)


def test_the_lint_finds_startup_recoverys_old_gather():
    old = '''
def recover(trainer, ckpt_dir, *, group=None):
    mine = torch.full((64,), -1, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)

def choose(self):
    figures = torch.tensor([1.0, 2.0], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)

def fine(self):
    figures = torch.tensor([1.0, 2.0], dtype=torch.float64)
    dist.all_reduce(figures, group=control_group())
    rows = [torch.zeros(2, device=device) for _ in range(3)]
    dist.all_gather(rows, torch.ones(2, device=device))
'''
    assert offenders({"old.py": old}) == [
        "old.py:5: dist.all_gather on group sends a torch.full made without device=",
        "old.py:9: dist.all_reduce on the default group sends a torch.tensor made without device="]


def test_the_gloo_groups_are_gloo():
    """What GLOO_GROUPS trusts: each class's self.group and the control group are made with backend="gloo"."""
    made = {"Checkpointer": "runtime/resilience/checkpoint/persist.py", "MemoryTier": "runtime/resilience/memtier/tier.py"}
    for cls_name, path in made.items():
        tree = ast.parse((REPO / path).read_text())
        cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name)
        assigns = [n for n in ast.walk(cls) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "self.group"]
        assert assigns and all("backend='gloo'" in ast.unparse(a.value) for a in assigns), cls_name
    control = (REPO / "runtime/parallel/control.py").read_text()
    assert 'backend="gloo"' in control
