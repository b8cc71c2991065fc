"""The one-process oracle: the unpartitioned model trained with exactly the runtime's math.

Per step: batch = make_batch(step, global_batch), cut into ``num_microbatches`` consecutive
microbatches along dim 0 (pass dp * program num_microbatches to match a data-parallel run: the
runtime's global batch is cut into that many), loss_i = loss_fn(model(*args_i), target_i) with the
randomness context of microbatch i set (Note [randomness keyed by meaning] in runtime/execute/randomness.py),
backward of each loss_i, gradients divided by the number of microbatches (Note [mean over
microbatches] in runtime/execute/schedule.py), AdamW step, LR schedule step. The step's loss is the mean of the loss_i.
Buffers the forward updates (BatchNorm running statistics) are updated by every microbatch in
order, as the stage holding them does; with ``replicas`` > 1 they end each step as the first
replica's microbatches left them (Note [buffers across replicas] in runtime/execute/train.py).

Note [the oracle computes as the ranks do]: verify holds the program to the oracle within a few
rounding steps, so the oracle runs the ranks' kernels, not merely the same math. Three things pick
kernels besides the ops. (1) The thread count: reductions sum in another order with another
number of threads, and a BatchNorm over few values with Adam amplifies that step after step (a
tiny ResNet-18 ended 6 steps 4e-4 apart in the loss at 2 threads against 1, bit-identical at 1
and 1); so verify passes the ranks' ``rank_threads()`` and the oracle sets it for its run, in
this process. (2) The device type: on CUDA autocast casts other ops, convolutions pick cuDNN's
algorithms and keyed masks come from the device's generator, so a GPU program's oracle runs on
CUDA too (``oracle_device``), and a machine without CUDA refuses to verify it rather than compare
it with a CPU run. (3) The numerics settings: ``_device_numerics``, as the ranks set them.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Callable, Sequence

import torch

from runtime.execute import grad_norm as gn
from runtime.execute import randomness
from runtime.data.synthetic import batch_inputs, with_constants
from runtime.execute.precision import (LossScaler, Precision, autocast, clip_coefficient, device_numerics,
                                       wrap_forward)
from runtime.execute.train import make_optimizer, microbatch_seed, seed_host_generators
from runtime.program.user_code import resolve_callable
from runtime.program.spec import load_program
from runtime.execute.stage import build_stage


class OracleDeviceError(RuntimeError):
    """The oracle cannot run on the program's device type here (Note [the oracle computes as the ranks do])."""


def oracle_device(device_type: str, folder: str = "") -> torch.device:
    """Where the oracle of a program on ``device_type`` ("cpu" or "cuda") trains: the same device
    type (Note [the oracle computes as the ranks do]); a CUDA program on a machine without CUDA is refused."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise OracleDeviceError(
                f"the program{' in ' + folder if folder else ''} runs on cuda and its oracle must too (other autocast op lists, kernels and dropout "
                "masks on a CPU), but this machine has no CUDA device: verify on a machine with a GPU, or "
                "compile for --device cpu to verify here")
        return torch.device("cuda")  # the current one, chosen when the oracle makes its first tensor
    return torch.device(device_type)


@contextlib.contextmanager
def _device_numerics(device: torch.device, precision: Precision):
    """The kernel choices the ranks make on ``device`` under ``precision``, for the oracle's run:
    the one place the oracle sets them, with the ranks' own function (``device_numerics``, Note
    [deterministic kernels on a GPU]; Note [the oracle computes as the ranks do]). On CUDA:
    deterministic kernels and no TF32 (cuDNN allows it by default, ~1e-3 relative against a 1e-5
    bound). The caller's settings are put back after."""
    if device.type != "cuda":
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    device_numerics(device, precision)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
         torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) = before[2:]


@contextlib.contextmanager
def computing_as_the_ranks(device: torch.device | str, precision: Precision | str = Precision.FP32,
                           threads: int | None = None):
    """``with computing_as_the_ranks(device, precision, threads):`` the oracle's run with the ranks'
    thread count (``threads``: ``runtime.launch.torchrun.rank_threads()`` for ranks it launched;
    None leaves this process's) and ``device``'s numerics settings; the caller's are restored
    after (Note [the oracle computes as the ranks do])."""
    before = torch.get_num_threads()
    torch.set_num_threads(before if threads is None else threads)
    try:
        with _device_numerics(torch.device(device), Precision.of(precision)):
            yield
    finally:
        torch.set_num_threads(before)


def _chain(stages: Sequence[torch.nn.Module]) -> Callable:
    def run(step: int, mb: int, seed: int, *args):
        x = args
        for k, stage in enumerate(stages):
            torch.manual_seed(microbatch_seed(seed, step, getattr(stage, "stage_index", k), mb))
            x = stage(*x)
            if not isinstance(x, tuple):
                x = (x,)
        return x[0] if len(x) == 1 else x

    return run


def tie_stage_parameters(stages: Sequence[torch.nn.Module]) -> None:
    """Make parameters with the same original name in several stages one shared Parameter."""
    seen: dict[str, torch.nn.Parameter] = {}
    for stage in stages:
        for name, p in list(stage.named_parameters()):
            if name in seen and seen[name] is not p:
                prefix, _, leaf = name.rpartition(".")
                parent = stage.get_submodule(prefix) if prefix else stage
                parent.register_parameter(leaf, seen[name])
            else:
                seen.setdefault(name, p)


def train_reference(model: torch.nn.Module | Sequence[torch.nn.Module], make_batch: Callable,
                    loss_fn: Callable, optimizer_cfg: dict, global_batch: int,
                    num_microbatches: int, steps: int, seed: int = 0, *,
                    batch_dims: Sequence[int] | None = None, replicas: int = 1,
                    keywords: Sequence[str] = (), call_with_keywords: bool = False, constants: Sequence = (),
                    precision: Precision | str = Precision.FP32, clip_grad_norm: float | None = None,
                    grad_norms: list | None = None, skipped: list | None = None,
                    device: torch.device | str | None = None):
    """Train a copy of ``model`` in one process; returns (losses, final_state_dict, optimizer_state).

    model: the unpartitioned module (the user's, or the traced graph with its random ops keyed:
        ``partitioner.frontend.randomness.keyed_graph``), or the list of stage modules
        (``runtime.execute.stage.build_stage``), whose same-named parameters are tied. Keyed random ops
        draw the runtime's masks in either; unkeyed ones only in the stage chain (Note
        [randomness per microbatch] in runtime/execute/train.py).
    keywords: the program's keyword inputs (Note [keyword inputs] in runtime/data/synthetic.py): a dict
        batch is flattened in this order; ``call_with_keywords`` passes them back by name to a
        ``model`` that is the user's module (a traced graph and the stages take them by position).
    constants: the program's constant inputs (Note [constant inputs] in runtime/data/synthetic.py): checked in
        every batch and dropped; given back in place to the user's module (``call_with_keywords``).
    replicas: the data-parallel degree whose buffer handling to reproduce: the microbatches are
        cut into ``replicas`` consecutive groups and buffers end each step as the first group
        left them (Note [buffers across replicas]).
    precision: the policy's autocast and fp16 loss scaling (Note [mixed precision] in
        runtime/execute/precision.py); clip_grad_norm: clip the global norm (Note [global gradient norm]
        in runtime/execute/grad_norm.py). grad_norms / skipped, when given, get each step's norm and
        whether fp16 loss scaling skipped it.
    device: where the copy trains and the batches go (default: where ``model``'s parameters are);
        autocast is that device type's. The final state stays there.
    losses: per-step mean loss (Python floats of the fp32 values).
    final_state_dict: original name -> tensor, parameters (aliases of a tied parameter all
        present) and buffers.
    optimizer_state: original name (aliases too) -> {"exp_avg", "exp_avg_sq", "step"}.
    """
    if global_batch % num_microbatches:
        raise ValueError(f"global_batch={global_batch} is not divisible by "
                         f"num_microbatches={num_microbatches}")
    if replicas < 1 or num_microbatches % replicas:
        raise ValueError(f"num_microbatches={num_microbatches} is not a multiple of replicas={replicas}: "
                         "pass dp * the program's num_microbatches and replicas=dp")
    seed_host_generators(seed)  # Note [global generators] in runtime/execute/train.py (as rank 0)
    if isinstance(model, torch.nn.Module):
        model = copy.deepcopy(model)
        if device is not None:
            model.to(device)
        modules = [model]

        users_module = call_with_keywords and (keywords or constants)

        def forward(step, mb, seed, *args):
            torch.manual_seed(microbatch_seed(seed, step, 0, mb))
            if users_module:
                positional, named = with_constants(args, keywords, constants)
                return model(*positional, **named)
            return model(*args)
    else:
        modules = list(copy.deepcopy(list(model)))
        if device is not None:
            for m in modules:
                m.to(device)
        tie_stage_parameters(modules)
        forward = _chain(modules)
    for m in modules:
        m.train()
    named: dict[str, torch.nn.Parameter] = {}
    for m in modules:
        for n, p in m.named_parameters(remove_duplicate=False):
            named.setdefault(n, p)
    unique = list({id(p): p for p in named.values()}.values())
    buffers: dict[str, torch.Tensor] = {}
    for m in modules:
        for n, b in m.named_buffers(remove_duplicate=False):
            buffers.setdefault(n, b)
    first_replica_end = num_microbatches // replicas
    name_of = {}
    for n, p in named.items():
        name_of.setdefault(id(p), n)
    optimizer, lr_scheduler = make_optimizer(unique, optimizer_cfg, [name_of[id(p)] for p in unique])
    precision = Precision.of(precision)  # callers may name it (tests, benchmarks)
    scaler = LossScaler.for_policy(precision)
    if device is None:
        device = unique[0].device if unique else torch.device("cpu")
    device = torch.device(device)
    device_type = device.type
    default_device = contextlib.nullcontext() if device_type == "cpu" else device
    losses = []
    for step in range(steps):
        args, target = make_batch(step, global_batch)
        args = batch_inputs(args, keywords, constants, step=step)
        args = [a.to(device) if torch.is_tensor(a) else a for a in args]
        target = target.to(device)
        dims = list(batch_dims) if batch_dims is not None else [0] * len(args)
        arg_chunks = [torch.tensor_split(a, num_microbatches, dim=d) for a, d in zip(args, dims)]
        target_chunks = torch.tensor_split(target, num_microbatches, dim=0)
        total = torch.zeros((), dtype=torch.float32, device=device)
        for i in range(num_microbatches):
            randomness.set_context(seed=seed, step=step, microbatch=i,
                                   first_sample=i * (global_batch // num_microbatches))
            # Factories that name no device (a keyed rand, user code) make their tensors on the
            # oracle's, as stage code does on a rank's (Note [the oracle computes as the ranks do]).
            with autocast(precision, device_type), default_device:
                out = forward(step, i, seed, *(c[i] for c in arg_chunks))
                loss = loss_fn(out, target_chunks[i])
            (loss.float() * scaler.scale if scaler.enabled else loss).backward()
            total += loss.detach().float()
            if replicas > 1 and i == first_replica_end - 1:
                kept = {n: b.detach().clone() for n, b in buffers.items()}
        if replicas > 1:
            with torch.no_grad():
                for n, b in buffers.items():
                    b.copy_(kept[n])
        for p in unique:
            if p.grad is not None:
                p.grad.div_(num_microbatches)
        grads = [p.grad for p in unique if p.grad is not None]
        if scaler.enabled:
            gn.scale_(grads, 1.0 / scaler.scale)
        norm = gn.as_norm(float(gn.squares_sum(grads)))
        take = scaler.update(math.isfinite(norm))
        if take:
            gn.scale_(grads, clip_coefficient(norm, clip_grad_norm))
            optimizer.step()
        if grad_norms is not None:
            grad_norms.append(norm)
        if skipped is not None:
            skipped.append(not take)
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total / num_microbatches))
    state = {n: p.detach().clone() for n, p in named.items()}
    state.update({n: b.detach().clone() for n, b in buffers.items()})
    opt_state = {}
    for n, p in named.items():
        st = optimizer.state.get(p)
        if st:
            opt_state[n] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    return losses, state, opt_state


def train_reference_from_folder(folder: str, steps: int, *, num_microbatches: int | None = None,
                                threads: int | None = None, device: torch.device | str | None = None, **kwargs):
    """The oracle of a program folder: its stage modules chained in one process, with the
    program's data, loss, optimizer and seed (what ``partitioner verify`` compares against), on the
    program's device type with the ranks' ``threads`` (None: this process's; Note [the oracle
    computes as the ranks do]). ``device``: another device to train on (a check comparing a CUDA
    program with the CPU oracle verify used to run). The final state is on the device it trained on."""
    program = load_program(folder)
    device = oracle_device(program.device, folder) if device is None else torch.device(device)
    with computing_as_the_ranks(device, program.precision, threads):
        stages = [build_stage(folder, k, device) for k in range(program.num_stages)]
        for k, stage in enumerate(stages):  # the boundary casts the runtime does (Note [mixed precision])
            wrap_forward(stage, program.precision, device.type, program.stages[k].outputs)
        data = program.data
        return train_reference(
            stages, resolve_callable(data.make_batch, folder), resolve_callable(data.loss_fn, folder),
            program.optimizer, program.global_batch,
            num_microbatches or program.dp * program.num_microbatches, steps, program.seed,
            batch_dims=[a.batch_dim or 0 for a in program.stages[0].inputs], keywords=data.keywords,
            constants=data.constants,
            replicas=program.dp if num_microbatches is None else 1,
            precision=program.precision, clip_grad_norm=program.clip_grad_norm, device=device, **kwargs)


