"""What a compute canary (Note [compute canaries] in runtime/resilience/canary.py) costs a step.

Note [canary price]: every K steps each rank re-runs one microbatch of its stage (forward and
backward: the stage's per-microbatch compute time, recompute included) after its schedule ends and
before the data-parallel all-reduce, and sends its record of microbatch 0 (the stage's input and
output-gradient bytes of one microbatch) to the next replica. A flat pipeline (gpipe, 1f1b) ends
with the last microbatch's backward walking down from the last stage to stage 0, so stage s is
idle for the backward of the stages before it, sum over j < s of b_j (b_j: stage j's backward
share of its time, by flops, plus its send), while stage 0 still works, and the step's loss
all-reduce over the world waits for stage 0 anyway: that bubble takes the re-run of stage s for
free up to its length. What does not fit is extra:

    rerun_s   = (T_s - comm_s) + record bytes / link bandwidth + 2 link latencies
                (T_s - comm_s: the stage's per-microbatch compute and fixed overhead; two messages)
    bubble_s  = sum_{j < s} b_j                                 (stage 0: none)
    extra_s   = max(0, rerun_s - bubble_s)
    canary_s  = max_s extra_s + (world - 1) * latency           (the verdicts' all_gather)
    per_step  = canary_s / K

Latency and bandwidth are the slowest data-parallel link's (the cluster's, as every pricer's).
plan.json keeps ``predicted.sdc_canary_s_per_step`` (in step_time_s) and
``predicted.sdc_canary_bubble_s`` (the re-run seconds the bubbles absorb, per canary);
benchmarks/sdc_canary_cost.py measures both sides. Like the replica check it stays out of the
ILP's objective (the slowest stage's F + B every K steps changes no partition choice).
"""

from __future__ import annotations

from runtime.features.canaries import EVERY, PREDICTED


def canary_seconds(stages, *, every: int, world_size: int, record_bytes: list[float] | None = None,
                   bandwidth_bytes_per_s: float = 1e9, latency_s: float = 50e-6) -> tuple[float, float]:
    """(seconds per step, bubble seconds used per canary) of canaries every ``every`` steps over
    ``stages`` (the plan's StagePlans, in order: predicted_time_s, compute_time_s and comm_time_s
    per microbatch, fwd_flops and bwd_flops); (0, 0) when ``every`` is 0."""
    if every <= 0 or not stages:
        return 0.0, 0.0
    record_bytes = record_bytes or [0.0] * len(stages)
    backward = []
    for st in stages:
        flops = float(st.fwd_flops + st.bwd_flops)
        share = st.bwd_flops / flops if flops > 0 else 0.5
        backward.append(st.compute_time_s * share + st.comm_time_s)
    extra, used, bubble = 0.0, 0.0, 0.0
    for s, st in enumerate(stages):
        own = max(st.compute_time_s, getattr(st, "predicted_time_s", st.compute_time_s) - st.comm_time_s)
        rerun = own + record_bytes[s] / bandwidth_bytes_per_s + 2 * latency_s
        extra = max(extra, rerun - bubble)
        used += min(rerun, bubble)
        bubble += backward[s]
    return (max(0.0, extra) + max(0, world_size - 1) * latency_s) / every, used


def predicted(decided, facts) -> tuple[float, dict]:
    """(seconds added to the step, plan.json "predicted" entries) of the canaries ``decided`` (the
    feature's decisions, Note [feature pricing] in runtime/features/__init__.py) on ``facts``."""
    every = decided.get(EVERY.key) or 0
    if not every:
        return 0.0, {}
    stages = facts.stages
    per_step, bubble = canary_seconds(stages, every=every, world_size=facts.world_size, latency_s=facts.latency_s,
                                      bandwidth_bytes_per_s=facts.bandwidth_bytes_per_s,
                                      record_bytes=[float((stages[s - 1].send_bytes if s else 0) + st.send_bytes)
                                                    for s, st in enumerate(stages)])
    return per_step, dict(zip(PREDICTED, (per_step, bubble)))
