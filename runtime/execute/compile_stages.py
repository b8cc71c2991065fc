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

With tensor parallelism the compiled forward takes the stage's DTensor parameters (the hooks
that make its inputs Replicate DTensors and its outputs whole stay outside): dynamo traces
through DTensor's dispatch once, so the graph holds the local ops and the collectives DTensor
inserts (``_c10d_functional.all_reduce_`` on the tensor group, run by inductor as a fallback
kernel), and no step pays DTensor's per-op Python dispatch (Note [compiled regions priced] in
partitioner/calibrate/measure.py prices that). Attention runs on each rank's heads as local
tensors, keyed dropout included (``randomness.tensor_parallel_attention``): on DTensors, the explicit
attention's backward needs a strided head split made whole, which inductor in torch 2.13 cannot
trace (``aten._local_scalar_dense``), and dynamo then runs the whole forward eagerly.

Note [graph breaks are said]: dynamo falls back to eager silently where it cannot compile
(a graph break, or a backend failure it turns into one): the program still trains correctly,
only slower than its plan assumed. So the warm-up counts the graphs it compiled and the breaks
(torch._dynamo's counters, before and after), prints both on the ``compiled stages`` line, the
three commonest reasons as warnings, and writes ``compiled_graphs`` and ``graph_breaks`` into
stage_times_rank_<r>.json; tests assert zero breaks for the plans they compile. The break at each
``checkpointed`` call is the recompute's own (above) and is counted apart, not warned of.
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


# Note [compile threads]: inductor compiles a graph's kernels in a pool of
# ``torch._inductor.config.compile_threads`` workers. CPU ranks share the host's cores as they do
# for training, so each compiles on one. A GPU rank computes on its GPU and the host's cores are
# idle while it compiles: each gets its share of them (cores / ranks on the host, at most
# inductor's own cap of 32), or the Triton kernels of a large stage compile one at a time for
# minutes and the ranks' start-up skew nears the collective timeout. Set in inductor's config,
# not TORCHINDUCTOR_COMPILE_THREADS: the config reads that variable once, when it is first
# imported, which torch.distributed.pipelining has done before any stage is built. A user's
# TORCHINDUCTOR_COMPILE_THREADS wins.
def compile_threads(device_type: str, environ=None) -> int:
    """Compile workers for one rank on ``device_type`` (Note [compile threads])."""
    environ = os.environ if environ is None else environ
    if environ.get("TORCHINDUCTOR_COMPILE_THREADS", "").strip().isdigit():
        return max(1, int(environ["TORCHINDUCTOR_COMPILE_THREADS"]))
    if device_type != "cuda":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = environ.get("LOCAL_WORLD_SIZE", "1")
    ranks_here = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, min(32, cores // ranks_here))


def compile_stage(module: torch.nn.Module, device_type: str = "cpu") -> torch.nn.Module:
    """``module``'s forward and its recomputed regions' methods compiled (Note [compiled stages]),
    with the rank's share of the host's cores to compile on (Note [compile threads])."""
    # lazy: loads torch._inductor (only a compiled program pays for it)
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = compile_threads(device_type)
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


def _dynamo_counts() -> tuple[int, dict[str, int]]:
    """(graphs dynamo has compiled in this process, graph-break reason -> count) so far."""
    from torch._dynamo.utils import counters  # lazy: loads torch._dynamo

    return counters["stats"]["unique_graphs"], dict(counters["graph_break"])


def _at_a_checkpoint(reason: str) -> bool:
    """A break at ``checkpointed`` (``torch.compiler.disable``): the recompute's, by design."""
    return "compiler.disable" in reason and "function checkpointed" in reason


def compile_rank(trainer) -> float:
    """Compile every stage of ``trainer``'s rank and warm them; the seconds, also in its stage times,
    with the graphs compiled and the graph breaks (Note [graph breaks are said])."""
    for module in trainer.modules:
        compile_stage(module, trainer.device.type)
    graphs_before, breaks_before = _dynamo_counts()
    compile_s = warm_up(trainer)
    graphs_after, breaks_after = _dynamo_counts()
    breaks = {reason: n - breaks_before.get(reason, 0) for reason, n in breaks_after.items()
              if n > breaks_before.get(reason, 0)}
    planned = sum(n for reason, n in breaks.items() if _at_a_checkpoint(reason))
    breaks = {reason: n for reason, n in breaks.items() if not _at_a_checkpoint(reason)}
    times = trainer.stage_times
    times.compile_s = compile_s
    times.compiled_graphs, times.graph_breaks = graphs_after - graphs_before, sum(breaks.values())
    print(f"rank {trainer.rank}: compiled stages {list(trainer.stage_ids)} in {compile_s:.1f} s, "
          f"{times.compiled_graphs} graphs, {times.graph_breaks} graph breaks"
          f"{f' (and {planned} at recomputed regions, by design)' if planned else ''} (before step 1, not in "
          "any step's time)", flush=True)
    for reason, n in sorted(breaks.items(), key=lambda kv: -kv[1])[:3]:
        print(f"rank {trainer.rank}: warning: {n} graph break(s), the code after each runs eagerly: "
              f"{' '.join(reason.split())[:300]}", flush=True)
    return compile_s
