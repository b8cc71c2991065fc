"""Mixed precision does not depend on where the solver cuts (Note [boundaries in the autocast
dtype] in partitioner/codegen/boundary_dtypes.py): a boundary crosses in the dtype autocast made
it in, so the partitioned program computes what the unpartitioned model computes under the same
autocast. The README's own model (tests/own_model/my_model.py: a bf16 residual stream) at 2 and
3 stages: step 0 runs on identical weights, so its loss must equal the oracle's bit for bit, and
the run verifies. The jobs join the session's shared launches (tests/_shared_launch.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from _programs import compile_to
from _shared_launch import Job, prepare
from partitioner.codegen.boundary_dtypes import autocast_dtypes
from partitioner.cli.verify import check_run, read_program_run, train_oracle
from runtime.program.spec import load_program

OWN = Path(__file__).resolve().parent.parent / "own_model"
CELLS = {"bf16_2": ("bf16-mixed", 2), "bf16_3": ("bf16-mixed", 3), "fp16_2": ("fp16-mixed", 2)}


def _my_model():
    spec = importlib.util.spec_from_file_location("my_model_for_cuts", OWN / "my_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build()


@prepare
def _cut_programs(root: Path):
    jobs = []
    for cell, (precision, stages) in CELLS.items():
        compile_to(root / cell, _my_model(), devices=stages, num_stages=stages, dp=1, global_batch=8,
                   microbatches=4, precision=precision, flops_per_s=1e9)
        jobs.append(Job(stages, [root / cell, "--steps", "3", "--run-dir", root / f"run_{cell}"]))
    return root, jobs


@pytest.fixture(scope="module")
def cuts(shared_launches):
    return shared_launches.result(_cut_programs)[0]


@pytest.mark.parametrize("cell", list(CELLS))
def test_a_mixed_precision_cut_computes_what_the_unpartitioned_model_does(cuts, cell):
    folder, run = cuts / cell, cuts / f"run_{cell}"
    program = load_program(str(folder))
    boundary = [spec for stage in program.stages[:-1] for spec in stage.outputs]
    # the residual stream leaves each block as tanh(bf16 matmul) + bf16: it crosses in half precision
    low = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[CELLS[cell][0]]
    assert boundary and all(spec.dtype.removeprefix("torch.") == low for spec in boundary), boundary
    losses, _params, _replicas = read_program_run(str(run))
    oracle_losses, _state, oracle = train_oracle(folder, program, _my_model(), 1)
    assert oracle == "original model"
    assert losses[0] == oracle_losses[0], (losses, oracle_losses)  # identical weights, identical numerics
    report = check_run(folder, run, steps=3, workload=_my_model())
    assert report.ok, report.text()


class _NormThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        h = self.fc(x)
        return self.norm(h), torch.softmax(h, dim=-1), h + x


def test_the_dtypes_follow_the_programs_device_autocast_without_a_gpu():
    """CPU and CUDA autocast keep different op lists: CUDA's layer_norm and softmax write fp32,
    CPU's write bf16; a matmul writes bf16 on both, and bf16 + fp32 promotes to fp32. The CUDA
    answer comes from autocast's own CUDA kernels, run on fake tensors on this GPU-less machine."""
    from partitioner.frontend.trace import trace

    traced = trace(_NormThenLinear(), (torch.randn(4, 8),))
    gm = traced.gm
    outputs = [n.name for n in next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes]
    fc = next(n.name for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target))
    for device_type, norm_and_softmax in (("cpu", "bfloat16"), ("cuda", "float32")):
        dtypes = autocast_dtypes(gm, "bf16-mixed", device_type)
        assert dtypes[fc] == "bfloat16"
        assert [dtypes[n] for n in outputs] == [norm_and_softmax, norm_and_softmax, "float32"], (device_type, dtypes)
    assert autocast_dtypes(gm, "fp32", "cuda") == {}
    assert json.dumps(autocast_dtypes(gm, "fp16-mixed", "cuda")).count("float16") >= 1
