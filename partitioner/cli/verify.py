"""`partitioner verify`: the partitioned program against the one-process run of the same model.

The program trains under torchrun exactly as a user runs it; the oracle trains the unpartitioned
model in this process with the same data, loss, optimizer, learning-rate schedule and microbatch
split. The verdict is the largest difference in per-step loss, in every final parameter and in
every buffer the forward updates (BatchNorm running statistics; final/buffers_rank_<r>), and
whether data-parallel replicas hold identical copies of both.

Which oracle: a model without random ops is trained as the user's module itself. A model with
random ops (dropout, attention dropout) is trained as its whole traced graph with those ops keyed
exactly as in the stage files (Note [randomness keyed by meaning] in runtime/execute/randomness.py): the
user's module would draw its masks from torch's global generator, which no partition reproduces.
Either way the oracle computes as the ranks do: on the program's device type (a program for a GPU
kind on CUDA, refused where there is none), with the ranks' thread count and numerics settings
(Note [the oracle computes as the ranks do] in runtime/execute/reference.py).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.program.spec import Program
from runtime.program.parts import Precision
from runtime.launch.agent_output import with_one_line_box
from runtime.launch.torchrun import rank_threads, run_env, run_tree, torchrun_command
from runtime.program.user_code import resolve_callable
from partitioner.solver.plan import Plan
from runtime.program.spec import load_plan, load_program
from partitioner.config.settings import settings_of
from partitioner.models.builtin import load_workload
from partitioner.codegen.split import on_device

# Each microbatch's loss and gradient are computed by the same ops in both runs; what differs is
# the rounding of sums (data-parallel mean, gradient accumulation order), ~1e-7 in the loss.
# Parameters get a looser bound: a parameter whose true gradient is zero (an attention key bias:
# softmax ignores a per-row constant) receives pure rounding noise, which Adam's normalisation
# turns into steps of up to lr. 1e-4 is a tenth of one step at the default lr of 1e-3.
LOSS_TOLERANCE = 1e-5
PARAM_TOLERANCE = 1e-4
# Per precision policy (Note [mixed precision] in runtime/execute/precision.py): (loss, parameters).
# Under autocast both runs round every matmul to bf16/fp16 in the same ops, so what differs is
# still only summation order, but now of values rounded to 8 (bf16) or 11 (fp16) mantissa bits:
# a different order of fp32 sums feeding a bf16 cast can flip its last bit, a relative 2**-8
# (bf16) or 2**-11 (fp16) on that element. The loss is a mean over many such elements, so its
# difference stays far below one rounding step of a single value: 1e-3 (bf16) and 2e-4 (fp16)
# absolute on losses of order 1, the fp32 bound scaled by the mantissa ratio (2**16 and 2**13
# coarser than fp32's 2**-24, damped by the averaging). Parameters follow Adam: a gradient
# element whose sign flips under that noise moves its parameter by up to 2·lr in one step, so
# the bound is 2e-3 (two steps of the default lr 1e-3 going the other way) for both policies.
# Measured (a 2-layer GPT, 2 stages x 2 replicas, sharded state, clipping, 3 steps): loss 4.8e-7,
# parameters 9e-10 (bf16) and 6e-8 (fp16), so the bounds are loose for small models on purpose:
# they must hold for long runs of large ones; what they catch is a policy not applied alike (a
# missed loss scale, clip or optimizer state moves the loss by 1e-2 or more).
# Note [tolerances scale with the run]: the parameter bounds above are for the default lr of 1e-3
# and the default 3 steps. A flip of an update's sign moves a parameter by up to 2 lr per step and
# such flips add up over steps (measured: tp 2 under bf16 drifts 5e-3 on zero-gradient elements in
# 3 steps), so under a mixed policy the bound is max(the table's, 2 lr steps), lr the schedule's
# peak; under fp32 (rounding noise only, rarely a flip) the table's bound scaled by lr / 1e-3.
# Losses are compared relative to max(1, |oracle loss|): a loss of 10 rounds 10 times coarser.
# Note [compiled stages verify]: a program compiled with compile_stages (Note [compiled stages] in
# runtime/execute/compile_stages.py) is held to the same bounds against the same eager oracle. Inductor
# fuses ops and reorders the sums inside a fused kernel (a layer norm's mean, a softmax's sum,
# the gradient of a value used twice), so the program rounds differently from the oracle inside
# each op, not only in the order of the microbatch and replica sums: the same kind of noise, a few
# fp32 ulps per op, and the masks are bit-identical (one custom op in both). Measured (fp32,
# tests/e2e/test_compiled_stages.py): the loss agrees to the printed fp32 digits on every step;
# parameters differ by 1.5e-6 (hf GPT-2, 2 stages, dropout, a tie, a recomputed block, 4 steps),
# 3.2e-5 (the built-in GPT the same way, 3 steps: an attention bias whose true gradient is zero,
# the Adam-amplified noise above), 4.4e-7 (hf-llama tp 2 with attention dropout, every region
# recomputed, 3 steps). All inside 1e-4; a mask drawn under the wrong context or a missed autocast moves the loss by
# 1e-2 or more, which the bounds still catch. Mixed policies keep their bounds for the same reason.
TOLERANCES = {Precision.FP32: (LOSS_TOLERANCE, PARAM_TOLERANCE), Precision.BF16_MIXED: (1e-3, 2e-3),
              Precision.FP16_MIXED: (2e-4, 2e-3)}
DEFAULT_LR = 1e-3
# The global gradient norm (metrics.jsonl grad_norm) against the oracle's, relative.
GRAD_NORM_TOLERANCE = {Precision.FP32: 1e-4, Precision.BF16_MIXED: 1e-2, Precision.FP16_MIXED: 2e-3}
# Running statistics average activations made from those parameters: compared relative to their
# size (|diff| / max(1, |oracle|)), and counters (num_batches_tracked) must agree exactly.
BUFFER_TOLERANCE = 1e-4


@dataclass(frozen=True)
class VerifyReport:
    steps: int
    losses_program: tuple[float, ...]
    losses_oracle: tuple[float, ...]
    max_loss_diff: float
    max_param_diff: float
    worst_param: str
    max_replica_diff: float
    oracle: str  # "original model", "unpartitioned traced graph (keyed randomness)" or "stage chain"
    max_buffer_diff: float = 0.0  # relative: |diff| / max(1, |oracle|)
    worst_buffer: str = "-"
    precision: Precision = Precision.FP32
    max_grad_norm_diff: float = 0.0  # relative: |program - oracle| / oracle, per step
    lr: float = DEFAULT_LR  # the schedule's peak learning rate

    def __post_init__(self):
        object.__setattr__(self, "precision", Precision.of(self.precision))

    @property
    def tolerances(self) -> tuple[float, float]:
        """(loss, parameters) for this run's precision, steps and lr (Note [tolerances scale with the run])."""
        loss_tol, param_tol = TOLERANCES[self.precision]
        if not self.precision.is_mixed:
            return loss_tol, param_tol * max(1.0, self.lr / DEFAULT_LR)
        return loss_tol, max(param_tol, 2 * self.lr * self.steps)

    @property
    def ok(self) -> bool:
        loss_tol, param_tol = self.tolerances
        return (self.max_loss_diff <= loss_tol and self.max_param_diff <= param_tol
                and self.max_buffer_diff <= BUFFER_TOLERANCE and self.max_replica_diff == 0.0
                and self.max_grad_norm_diff <= GRAD_NORM_TOLERANCE[self.precision])

    def text(self) -> str:
        lines = [f"{'step':>4} {'program loss':>14} {'oracle loss':>14} {'diff':>10}"]
        for i, (a, b) in enumerate(zip(self.losses_program, self.losses_oracle)):
            lines.append(f"{i:>4} {a:>14.8f} {b:>14.8f} {abs(a - b):>10.2e}")
        lines += [
            f"oracle: {self.oracle} trained in one process",
            f"largest loss difference {self.max_loss_diff:.3e} (relative to max(1, |loss|)); largest parameter difference "
            f"{self.max_param_diff:.3e} ({self.worst_param}); largest buffer difference "
            f"{self.max_buffer_diff:.3e} ({self.worst_buffer}); replicas differ by {self.max_replica_diff:.3e}",
            f"gradient norm differs by {self.max_grad_norm_diff:.3e} (relative)",
            f"verdict: {'PASS' if self.ok else 'FAIL'} (precision {self.precision}: tolerance "
            f"{self.tolerances[0]:g} loss, {self.tolerances[1]:g} parameters, {BUFFER_TOLERANCE:g} buffers, "
            f"{GRAD_NORM_TOLERANCE[self.precision]:g} gradient norm)",
        ]
        return "\n".join(lines)


def _read_finals(run_dir: Path, pattern: str) -> tuple[dict[str, torch.Tensor], float]:
    """Tensors of every final/<pattern> file by original name, and the largest difference between
    two ranks' copies of one name (data-parallel replicas, tied copies)."""
    # lazy: loads safetensors
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    replica_diff = 0.0
    for path in sorted((Path(run_dir) / "final").glob(pattern)):
        for name, tensor in load_file(str(path)).items():
            if name in tensors:
                replica_diff = max(replica_diff, float((tensors[name] - tensor).abs().max()))
            else:
                tensors[name] = tensor
    return tensors, replica_diff


def read_grad_norms(run_dir: Path) -> list[float]:
    """metrics.jsonl's grad_norm per step (the last attempt of a re-run step)."""
    norms: dict[int, float] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "grad_norm" in row:
            norms[row["step"]] = float("inf") if row["grad_norm"] is None else row["grad_norm"]
    return [norms[k] for k in sorted(norms)]


def read_program_run(run_dir: Path) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """Per-step losses, final parameters by original name, and the largest difference between
    copies (of a parameter or of a mutable buffer)."""
    losses: dict[int, float] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        losses[row["step"]] = row["loss"]  # a resumed step overwrites the lost attempt's line
    params, param_diff = _read_finals(run_dir, "rank_*.safetensors")
    _, buffer_diff = _read_finals(run_dir, "buffers_rank_*.safetensors")
    return [losses[k] for k in sorted(losses)], params, max(param_diff, buffer_diff)


def read_program_buffers(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final mutable buffers (running statistics) by original name."""
    return _read_finals(run_dir, "buffers_rank_*.safetensors")[0]


def _retarget(graph_module: torch.fx.GraphModule, device: torch.device) -> torch.fx.GraphModule:
    """``graph_module`` with every device its trace baked in (``aten.arange(..., device=cpu)``:
    traced here, on the CPU) and every factory that names none on ``device``, where the oracle
    trains: the stages' own rule (Note [tensors a stage makes] in partitioner/codegen/split.py)."""
    if device.type == "cpu":
        return graph_module
    for node in graph_module.graph.nodes:
        if node.op == "call_function":
            node.args, node.kwargs = on_device(node, node.args, node.kwargs, device)
    graph_module.recompile()
    return graph_module


def train_oracle(folder: str | Path, program: Program, workload, steps: int, grad_norms: list | None = None):
    """(losses, final state, which oracle) of the one-process run ``verify`` compares against,
    under the program's precision policy and clipping, on the program's device type with the
    ranks' thread count (Note [the oracle computes as the ranks do] in runtime/execute/reference.py);
    ``grad_norms`` gets the oracle's norms. The state is on the CPU."""
    # lazy: loads safetensors
    from runtime.execute.reference import (computing_as_the_ranks, oracle_device, train_reference,
                                           train_reference_from_folder)

    device, threads = oracle_device(program.device, str(folder)), rank_threads()
    if workload is None:
        losses, state, _ = train_reference_from_folder(str(folder), steps, threads=threads, grad_norms=grad_norms)
        return losses, {n: t.cpu() for n, t in state.items()}, "stage chain"
    if workload.model.parameters().__next__().device.type == "meta":
        raise ValueError("the workload's model is on the meta device: verify needs real weights; "
                         "verify a smaller configuration of the same model")
    num_microbatches = program.dp * program.num_microbatches
    model, oracle = workload.model, "original model"
    if program.randomness is not None and program.randomness.keyed_ops:
        # lazy: loads OR-Tools
        from partitioner.frontend.randomness import keyed_graph

        model, _ = keyed_graph(workload, program.global_batch // num_microbatches)
        model = _retarget(model, device)
        oracle = "unpartitioned traced graph (keyed randomness)"
    data = program.data
    with computing_as_the_ranks(device, program.precision, threads):
        losses, state, _ = train_reference(
            model, resolve_callable(data.make_batch, str(folder)), resolve_callable(data.loss_fn, str(folder)),
            program.optimizer, program.global_batch, num_microbatches, steps, program.seed,
            replicas=program.dp, keywords=data.keywords, call_with_keywords=oracle == "original model",
            constants=data.constants, precision=program.precision, clip_grad_norm=program.clip_grad_norm,
            grad_norms=grad_norms, device=device)
    return losses, {n: t.cpu() for n, t in state.items()}, oracle


def verify(folder: str | Path, *, steps: int = 3, workload=None, timeout_s: float = 600) -> VerifyReport:
    folder = Path(folder).resolve()
    plan = Plan.load(folder)
    program = load_program(str(folder))  # an edited or broken folder is refused before anything starts
    # lazy: loads safetensors
    from runtime.execute.reference import oracle_device

    oracle_device(program.device, str(folder))  # nor a CUDA program where its oracle cannot run,
    rank_threads()  # nor a thread count the oracle cannot match
    if workload is None and plan.training.model_spec:

        workload = load_workload(plan.training.model_spec, pretrained=plan.training.pretrained, data=plan.training.data)
    with tempfile.TemporaryDirectory(prefix="verify-") as tmp:
        run_dir = Path(tmp) / "run"
        # A fresh checkpoint directory: the program must train from step 0, not resume a run.
        try:
            # In its own session; on the timeout the agent and every worker are stopped (Note
            # [process groups] in runtime/launch/torchrun.py), the rendezvous a private file.
            command = torchrun_command(folder / "train.py", plan.world_size, args=[
                "--steps", str(steps), "--run-dir", str(run_dir),
                "--checkpoint-dir", str(Path(tmp) / "checkpoints")])
            done = run_tree(command, env=run_env(), capture=True, timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the program in {folder} did not finish {steps} steps in {timeout_s:.0f} s") from None
        if done.returncode != 0:
            # the ranks' own lines, not torchrun's box (Note [torchrun's failure box])
            tail = "\n".join((done.stdout + with_one_line_box(done.stderr)).strip().splitlines()[-8:])
            raise RuntimeError(f"the program in {folder} failed (exit {done.returncode}):\n{tail}")
        return check_run(folder, run_dir, steps=steps, workload=workload)


def check_run(folder: str | Path, run_dir: str | Path, *, steps: int | None = None, workload=None) -> VerifyReport:
    """The verdict on a finished run of the program in ``folder`` (its metrics.jsonl and final/
    in ``run_dir``): the same steps trained by the oracle in this process. ``steps``: how many the
    run was asked for (default: as many as it logged)."""
    folder = Path(folder).resolve()
    program = load_program(str(folder))
    # lazy: loads safetensors
    from runtime.execute.reference import oracle_device

    oracle_device(program.device, str(folder))  # before reading the run: the verdict cannot be had here
    settings = settings_of(load_plan(str(folder)))  # a hand-written folder has no full Plan
    if workload is None and settings.model_spec:

        workload = load_workload(settings.model_spec, pretrained=settings.pretrained, data=settings.data)
    losses, params, replica_diff = read_program_run(Path(run_dir))
    buffers = read_program_buffers(Path(run_dir))
    steps = len(losses) if steps is None else steps
    ref_norms: list[float] = []
    ref_losses, ref_state, oracle = train_oracle(folder, program, workload, steps, ref_norms)
    norms = read_grad_norms(Path(run_dir))
    norm_diff = max((0.0 if a == b else abs(a - b) / max(abs(b), 1e-12) for a, b in zip(norms, ref_norms)),
                    default=0.0)  # both inf (a step fp16 skipped in both) is agreement
    if norms and len(norms) != len(ref_norms):
        norm_diff = float("inf")
    # relative to max(1, |oracle|) (Note [tolerances scale with the run])
    loss_diff = max((abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref_losses)), default=float("inf"))
    if len(losses) != len(ref_losses):
        loss_diff = float("inf")
    worst, param_diff = "-", 0.0
    for name, tensor in params.items():
        if name not in ref_state:
            raise AssertionError(f"the program trained {name!r}, which the oracle model does not have")
        diff = float((tensor - ref_state[name].to(tensor.dtype)).abs().max())
        if diff > param_diff:
            worst, param_diff = name, diff
    worst_buffer, buffer_diff = "-", 0.0
    for name, tensor in buffers.items():
        if name not in ref_state:
            raise AssertionError(f"the program updated buffer {name!r}, which the oracle model does not have")
        want = ref_state[name].to(torch.float64)
        diff = float(((tensor.to(torch.float64) - want).abs() / want.abs().clamp(min=1.0)).max())
        if diff > buffer_diff:
            worst_buffer, buffer_diff = name, diff
    return VerifyReport(steps, tuple(losses), tuple(ref_losses), loss_diff, param_diff, worst, replica_diff, oracle,
                        buffer_diff, worst_buffer, program.precision, norm_diff, lr=float(program.optimizer.lr))
