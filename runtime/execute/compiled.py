"""Compiled stages: each stage's forward through ``torch.compile`` (inductor), warmed before step 1.

Note [compiled stages]: a program compiled with ``--compile-stages`` (plan.json's
``program.compile_stages``) runs the same stage files, with each stage module's ``forward``
replaced by ``torch.compile(forward, dynamic=False)`` and each recomputed region's method
(``recompute_<region>``) compiled on its own. What stays outside the compiled graphs, and why:

- the module's hooks: ``module(*args)`` runs the forward pre-hooks (the randomness context of the
  microbatch, Note [randomness per microbatch]; autocast's entry, Note [mixed precision]) and then
  the compiled forward. dynamo
  guards on the ambient grad mode and autocast state, so the policy's autocast applies inside;
- the keyed draws: one opaque custom op that reads the context when it runs (Note [masks outside
  the compiled graph] in runtime/execute/randomness.py), so the masks are bit-identical to eager
  and no microbatch recompiles;
- ``checkpointed``: a graph break (``torch.compiler.disable``). The recompute is torch's reentrant
  checkpoint around the region's own compiled method, rerun in backward under the forward's
  randomness context (Note [recompute draws the same randomness]). Tracing the checkpoint into
  the stage's graph instead would let AOTAutograd rerun the region in backward with no context to
  restore. The region's method compiles twice: once under no_grad (the checkpoint's forward), once
  with grad (its rerun in backward).

Shapes are static (every microbatch of a program has the same shape): ``dynamic=False`` compiles
each graph once for the microbatch's shapes. The first call compiles, so ``warm_up`` runs every
stage's forward and backward once on zero inputs of the microbatch's shapes before step 1, with
the mutable buffers, gradients and generator states put back after, and its seconds are the run's
``compile_s`` (a log line, and stage_times_rank_<r>.json's ``compile_s``), never a step's time.
The evaluation pass (no_grad, dropout off) compiles its own variant when it first runs.

Not with tensor parallelism (refused: Note [what tensor parallelism runs with] in
partitioner/frontend/tp_support.py): inductor fails on the DTensor stage and dynamo silently runs
the forward eagerly, and a graph served from the FX cache names the process group of the launch
that compiled it ("Could not resolve the process group registered under the name 6").
"""

from __future__ import annotations

import os
import time

import torch

from runtime.execute import recompute
from runtime.execute.precision import step_context
from runtime.execute.stage import example_args


def _compiled_checkpointed():
    # lazy: loads torch._dynamo (only a compiled program pays for it)
    # recursive: torch's checkpoint runs eagerly; the region's method passed to it is compiled itself
    return torch.compiler.disable(recompute.checkpointed)


def compile_stage(module: torch.nn.Module) -> torch.nn.Module:
    """``module``'s forward and its recomputed regions' methods compiled (Note [compiled stages])."""
    # One compile thread per rank: ranks share the machine's cores as they do for training.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # the stage file's own name for it (its namespace: stage files are imported by path, not by
    # module name) becomes a graph break
    names = type(module).forward.__globals__
    if names.get("checkpointed") is recompute.checkpointed:
        names["checkpointed"] = _compiled_checkpointed()
    for name in dir(type(module)):
        if name.startswith("recompute_") and callable(getattr(type(module), name)):
            setattr(module, name, torch.compile(getattr(module, name), dynamic=False))
    module.forward = torch.compile(module.forward, dynamic=False)
    module.compiled_stage = True
    return module


def _zeros(like: tuple[torch.Tensor, ...], device: torch.device) -> list[torch.Tensor]:
    """Zeros shaped as the microbatch's inputs: valid indices for a lookup, finite for the rest."""
    return [torch.zeros(t.shape, dtype=t.dtype, device=device).requires_grad_(t.requires_grad) for t in like]


def warm_up(trainer) -> float:
    """Run each of ``trainer``'s stages forward and backward once so every graph is compiled
    before step 1; returns the seconds it took. Leaves parameters, gradients, mutable buffers and
    the generators as they were (Note [compiled stages])."""
    program = trainer.program
    start = time.perf_counter()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if trainer.device.type == "cuda" else None
    buffers = {name: b.detach().clone() for name, b in trainer.named_mutable_buffers().items()}
    for hook in trainer.randomness_hooks:
        hook.start(0, 0)
    try:
        with step_context(program.precision, trainer.device.type):
            for s, module in zip(trainer.stage_ids, trainer.modules):
                args = _zeros(example_args(program.stages[s].inputs, requires_grad=s > 0), trainer.device)
                outputs = module(*args)
                outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
                grads = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
                if grads:
                    torch.autograd.backward([g.float().sum() for g in grads])
    finally:
        for module in trainer.modules:
            for p in module.parameters():
                p.grad = None
        with torch.no_grad():
            for name, value in trainer.named_mutable_buffers().items():
                value.copy_(buffers[name])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return time.perf_counter() - start


def compile_rank(trainer) -> float:
    """Compile every stage of ``trainer``'s rank and warm them; the seconds, also in its stage times."""
    for module in trainer.modules:
        compile_stage(module)
    compile_s = warm_up(trainer)
    trainer.stage_times.compile_s = compile_s
    print(f"rank {trainer.rank}: compiled stages {list(trainer.stage_ids)} in {compile_s:.1f} s (before step 1, "
          "not in any step's time)", flush=True)
    return compile_s
