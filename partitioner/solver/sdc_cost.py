"""What the replica check of runtime/resilience/sdc.py costs a step (Note [replica digests] there).

Every K steps each rank reads its parameters and optimizer state once (one int64 sum over their
bit patterns, memory-bound) and takes part in one all_gather of 16 bytes per rank:

    check_s        = max over stages of (params_bytes + optimizer_bytes) / digest rate
                     + (world - 1) * link latency              (a ring all_gather of tiny rows)
    per_step_s     = check_s / K

The check is the same on every partition up to which stage holds the most state, and it is a
fraction of a percent of a step at the default K (benchmarks/checkpoint_overhead.py measures
it), so it stays out of the ILP's objective, where it would change no choice; ``evaluate``
(Note [whole-step terms] in problem.py) adds it to the plan's predicted step time, next to the
data-parallel all-reduce, when given the plan's ``sdc_every`` (``Decisions.sdc_every``, default
``default_every(dp)``); plan.json keeps it as ``predicted.sdc_check_s_per_step``.
"""

from __future__ import annotations

# Bytes per second one rank sums: CPU memory-bound int32 -> int64 sums (measured here, ~0.3-1 GB/s
# on a loaded 2-core machine); an accelerator reads HBM at TB/s, of which a reduction gets ~1/3.
DIGEST_BYTES_PER_S = {"cpu": 0.5e9}
DEFAULT_ACCELERATOR_DIGEST_BYTES_PER_S = 1e12


def default_every(dp: int) -> int:
    """The plan's K when the training settings leave ``sdc_every`` out: the runtime's default with
    replicas to compare, else 0 (off)."""
    # lazy: loads torch
    from runtime.resilience.sdc import DEFAULT_EVERY

    return DEFAULT_EVERY if dp > 1 else 0


def digest_rate(device_kind: str) -> float:
    return DIGEST_BYTES_PER_S.get(device_kind, DEFAULT_ACCELERATOR_DIGEST_BYTES_PER_S)


def replica_check_s(state_bytes_per_stage: list[float], device_kinds: list[str], *, world_size: int,
                    latency_s: float) -> float:
    """Seconds one check takes (the slowest stage's digest, then the all_gather)."""
    digest = max((b / digest_rate(kind) for b, kind in zip(state_bytes_per_stage, device_kinds)), default=0.0)
    return digest + max(0, world_size - 1) * latency_s


def replica_check_s_per_step(plan, every: int, *, latency_s: float = 50e-6) -> float:
    """The check's cost per step of ``plan`` (a partitioner.solver.plan.Plan) at K = ``every``; 0 without
    data parallelism (nothing to compare) or with every = 0."""
    if every <= 0 or plan.dp < 2:
        return 0.0
    state = [float(s.memory.params_bytes + s.memory.optimizer_bytes) for s in plan.stages]
    return replica_check_s(state, [s.device for s in plan.stages], world_size=plan.world_size,
                           latency_s=latency_s) / every
