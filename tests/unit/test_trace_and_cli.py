"""Bad input at the front door: the tracer's errors and the CLI's one-line messages."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from partitioner.cli import main
from partitioner.errors import TraceError
from partitioner.models.builtin import load_workload
from partitioner.frontend.trace import trace


class ValueDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # Python control flow on a tensor's value
            return self.layer(x)
        return x


def test_value_dependent_control_flow_names_the_construct_and_both_tracers():
    with pytest.raises(TraceError) as info:
        trace(ValueDependent(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "if x.sum() > 0:" in message and "test_trace_and_cli.py" in message
    assert "torch.export said:" in message and "symbolic_trace said:" in message
    assert "torch.cond" in message  # the fix


def test_inputs_that_do_not_fit_forward_say_what_was_expected():
    with pytest.raises(ValueError, match=r"forward\(x\).*too many positional"):
        trace(ValueDependent(), (torch.randn(2, 4), torch.randn(2, 4)))
    with pytest.raises(ValueError, match="example_args must be a tuple"):
        from partitioner.frontend.workload import Workload

        Workload(model=ValueDependent(), example_args=torch.randn(2, 4), loss_fn=None)


def test_a_model_on_the_meta_device_traces():
    workload = load_workload("gpt:layers=2,width=32,heads=2,vocab=64,seq=16,device=meta")
    traced = trace(workload.model, workload.example_args)
    assert traced.tracer == "export"
    assert any(n.op == "get_attr" and n.target == "blocks.1.mlp.fc.weight" for n in traced.gm.graph.nodes)


def error_lines(stderr: str) -> str:
    """The error message, without the progress lines printed before it."""
    lines = stderr.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("error:"))
    return "\n".join(lines[first:])


@pytest.mark.parametrize("spec, expected", [
    ("nosuchmodel", "is not a built-in"),
    ("gpt:layers", "is not key=value"),
    ("gpt:depth=3", "gpt takes layers, width"),
    ("no/such/file.py:build", "does not exist"),
    ("json:dumps", "must build and return a Workload"),
    ("platform:system", "returned str, expected a Workload"),
])
def test_bad_model_spec_is_one_line_and_exit_2(tmp_path, capsys, spec, expected):
    out = tmp_path / "out"
    assert main(["compile", spec, "-o", str(out)]) == 2
    err = error_lines(capsys.readouterr().err)
    assert err.startswith("error:") and expected in err and len(err.splitlines()) <= 2
    assert not out.exists()


def test_infeasible_cluster_names_memory_and_leaves_no_folder(tmp_path, capsys):
    cluster = tmp_path / "tiny.toml"
    cluster.write_text('[[group]]\nkind = "cpu"\ncount = 2\nnode = 0\nmemory_gib = 0.001\n')
    out = tmp_path / "out"
    code = main(["compile", "gpt:layers=2,width=64,heads=2,vocab=512,seq=32", "-o", str(out),
                 "--cluster", str(cluster), "-q"])
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and "GiB" in err and ("add devices" in err or "recompute" in err), err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_missing_cluster_file_and_missing_folders(tmp_path, capsys):
    assert main(["compile", "gpt", "-o", str(tmp_path / "o"), "--cluster", str(tmp_path / "none.toml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "nowhere"), "--steps", "1"]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "nowhere")]) == 2
    assert "no plan.json" in capsys.readouterr().err


def test_every_subcommand_has_help_with_examples():
    for command in ("compile", "inspect", "run", "verify"):
        done = subprocess.run([sys.executable, "-m", "partitioner.cli", command, "--help"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "examples:" in done.stdout, command


def test_run_checks_its_flags_before_any_worker_starts(tmp_path, capsys):
    """A bad --mtbf is refused in words, by the launcher, not by every worker (nor by a NameError)."""
    folder = tmp_path / "prog"
    assert main(["compile", "mlp", "-o", str(folder), "--devices", "1", "-q"]) == 0
    assert main(["run", str(folder), "--steps", "1", "--mtbf", "six hours"]) == 2
    err = error_lines(capsys.readouterr().err)
    assert err.startswith("error:") and "six hours" in err, err


class ReentrantCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=True)


def test_a_reentrant_checkpoint_and_a_backward_hook_are_refused_and_cond_is_not():
    """The trace runs a reentrant checkpoint's forward under no_grad (its parameters would get no
    gradient) and drops a backward hook; torch.cond stays one node with its backward (and a custom
    op's autograd: Qwen2-MoE's grouped_mm, tests/e2e/test_program_e2e.py)."""
    with pytest.raises(TraceError, match=r"CheckpointFunction.*use_reentrant=False"):
        trace(ReentrantCheckpoint(), (torch.randn(2, 4),))
    hooked = nn.Sequential(nn.Linear(4, 4))
    hooked[0].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    with pytest.raises(TraceError, match=r"BackwardHookFunction.*remove the module's backward hook"):
        trace(hooked, (torch.randn(2, 4),))  # the program would never call the hook

    class Cond(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda x: self.layer(x), lambda x: x * 2, (x,))

    assert trace(Cond(), (torch.randn(2, 4),)).tracer == "export"
