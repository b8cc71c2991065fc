"""Note [autograd Functions run as themselves] (partitioner/frontend/autograd_functions.py): a custom
torch.autograd.Function is one graph node that calls its own ``apply``, so the traced graph trains
with the user's backward and is priced by running it; what cannot be exact is refused in one line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from partitioner.cli import main
from partitioner.errors import TraceError
from partitioner.frontend.autograd_functions import FunctionApply
from partitioner.frontend.trace import trace

OWN = Path(__file__).resolve().parent.parent / "own_model"


def _straight_through(monkeypatch):
    """The model file imported by its name, as `partitioner compile straight_through.py:build` does."""
    spec = importlib.util.spec_from_file_location("straight_through", OWN / "straight_through.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "straight_through", module)
    return module


def _applies(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, FunctionApply)]


def test_a_straight_through_function_is_one_node_and_trains_with_its_own_backward(monkeypatch):
    """Traced through, round's gradient (zero) would leave `inp` untrained; as one node calling
    RoundSTE.apply the traced graph's gradients are the eager model's, bit for bit."""
    module = _straight_through(monkeypatch)
    workload = module.build()
    traced = trace(workload.model, workload.example_args)
    (node,) = _applies(traced.gm)
    assert node.target.function is module.RoundSTE and node.args[1] == 4.0  # its plain arguments kept
    assert "RoundSTE.apply(" in node.meta["stack_trace"]  # the user's line, for the stage file's comment
    assert not [n for n in traced.gm.graph.nodes if "round" in str(n.target)]  # its forward is not inlined
    (x,), target = workload.make_batch(1, 4)
    for model in (traced.gm, workload.model):
        module.loss(model(x), target).backward()
    grads = {n: p.grad for n, p in traced.gm.named_parameters()}
    for name, p in workload.model.named_parameters():
        assert torch.equal(grads[name], p.grad), name
    assert grads["inp.weight"].abs().sum() > 0


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad


round_ste = RoundSTE.apply  # an alias bound at import, before any trace


def test_a_function_applied_through_an_alias_bound_before_the_trace_is_one_node_too():
    """The alias skips the class attribute a trace could replace; torch's inner apply, where it
    ends, is replaced instead. (Before, the trace ran its forward and kept aten.round: zero gradient.)"""
    model = Applying(lambda x: round_ste(x * 4))
    traced = trace(model, (torch.randn(2, 4),))
    (node,) = _applies(traced.gm)
    assert node.target.function is RoundSTE
    x = torch.randn(2, 4)
    traced.gm(x).sum().backward()
    assert traced.gm.layer.weight.grad.abs().sum() > 0


class MatMul(torch.autograd.Function):
    """x @ w with a backward that computes both gradients whether needed or not."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w, x.sum()

    @staticmethod
    def backward(ctx, grad, _grad_sum):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


class Priced(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        out, _total = MatMul.apply(x, self.w)
        return out


def test_a_function_is_priced_by_running_its_forward_and_its_own_backward():
    # lazy: loads networkx
    from partitioner.frontend.analysis import annotate
    from passes import ir

    gm = annotate(trace(Priced(), (torch.randn(4, 8),)))
    (node,) = _applies(gm)
    flops = ir.get(node, ir.FLOPS)
    assert flops.fwd_flops == 2 * 4 * 8 * 16  # x @ w
    assert flops.bwd_flops == 2 * (2 * 4 * 8 * 16)  # the user's backward: both products


class Noisy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + 0.1 * torch.randn_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Counted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, 3

    @staticmethod
    def backward(ctx, grad, _count):
        return grad * 2


class Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scaler):
        return x * scaler.scale

    @staticmethod
    def backward(ctx, grad, _scaler):
        return grad, None


class _Scale:
    scale = 2.0


def _local_function():
    class Local(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    return Local


class Applying(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.layer, self.call = nn.Linear(4, 4), call

    def forward(self, x):
        return self.call(self.layer(x))


@pytest.mark.parametrize("call,name,why", [
    (Noisy.apply, "Noisy", r"draws random numbers \(aten\.randn.*draw outside the Function"),  # an alias
    (lambda x: InPlace.apply(x * 1), "InPlace", r"writes an input in place.*return a new tensor"),
    (lambda x: Counted.apply(x)[0], "Counted", r"returns a int value, and a graph node carries tensors only"),
    (lambda x: Scaled.apply(x, _Scale()), "Scaled", r"passed a _Scale, which a stage file cannot write"),
    (lambda x: _local_function().apply(x), "_local_function.<locals>.Local", r"defined inside a function"),
])
def test_what_cannot_run_exactly_as_itself_is_refused_in_one_line(call, name, why):
    with pytest.raises(TraceError, match=why) as info:
        trace(Applying(call), (torch.randn(2, 4),))
    message = str(info.value)
    assert f"the custom autograd Function {__name__}.{name} at " in message and "test_autograd_functions.py:" in message
    assert "cannot run as itself" in message and "\n" not in message


def test_a_refused_function_is_one_line_and_exit_2_at_the_cli(tmp_path, capsys, monkeypatch):
    (tmp_path / "noisy.py").write_text(
        "import torch\nimport torch.nn as nn\nfrom partitioner import Workload\n\n\n"
        "class Noisy(torch.autograd.Function):\n"
        "    @staticmethod\n"
        "    def forward(ctx, x):\n"
        "        return x + torch.rand_like(x)\n\n"
        "    @staticmethod\n"
        "    def backward(ctx, grad):\n"
        "        return grad\n\n\n"
        "class Model(nn.Linear):\n"
        "    def forward(self, x):\n"
        "        return Noisy.apply(super().forward(x))\n\n\n"
        "def build():\n"
        "    return Workload(model=Model(4, 4), example_args=(torch.randn(2, 4),), loss_fn=None)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "noisy.py:build", "-o", "out", "--devices", "1", "-q"]) == 2
    err = "\n".join(line for line in capsys.readouterr().err.splitlines() if line.strip())
    assert len(err.splitlines()) == 1 and "noisy.Noisy" in err and "noisy.py:18" in err, err
    assert "random numbers" in err and "Traceback" not in err and not (tmp_path / "out").exists()
