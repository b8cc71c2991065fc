"""The partition solver: plain-number problem in, verified plan out (no torch import here).

    plan.py             the frozen Plan (PlanRegion, PlanTie, ...): JSON round-trip, content hash
    problem.py          RegionCost / Edge / SharedParam / PartitionProblem, Assignment, the time model
    device_layout.py    the device of each (stage, replica) and the links a placement's transfers cross
    evaluate.py         evaluate(): the float cost model (Notes [cost model], [memory model])
    recompute_cost.py   what recomputing a region costs a microbatch (Note [recompute fixed cost])
    precision_cost.py   the precision policy as a transformed problem and cluster
    grad_norm_cost.py   what the global gradient norm costs a step, where the program computes it
    sdc_cost.py         what the replica digest check (runtime/resilience/sdc.py) costs a step, beside the plan
    canary_cost.py      what the compute canaries (runtime/resilience/canary.py) cost a step: bubble used, else
                        extra (Note [canary price])
    tensor_groups.py    a tensor group planned as one device (Notes [tensor groups], [tensor-parallel pricing])
    sequence_parallel.py  sequence parallelism priced on a tp plan, and the choice of it (Note [sequence
                        parallelism as a decision])
    interleaved.py      the facts of torch's interleaved 1F1B the cost model prices (Note [interleaved pricing])
    zero_bubble.py      zb and zbv: torch's order simulated over F, B and W, its path forms (Note [zero-bubble pricing])
    schedules.py        each schedule with its price: pipeline time, lower bound (Note [one class per schedule])
    bounds.py           lower bounds on the step time, for pruning and for the report
    check.py            check_assignment(): the independent verifier
    model.py            the CP-SAT model of one (stages, dp, microbatches) candidate; SolverConfig
    model_placement.py  its constraint families, one module a concern: placement,
    model_time.py         time and the objective,
    model_memory.py       memory,
    model_interleaved.py  the interleaved schedule's time and memory,
    model_hints.py        hints and search help
    terms.py            a linear expression kept as terms (posted and evaluated on hints)
    cp_sat.py           OR-Tools' CP-SAT, imported at its first use (Note [the solver loads OR-Tools on demand])
    placements.py       every distinct placement of a candidate's stages on a mixed cluster
    placed.py           one candidate over its placements, exactly or by the relaxation
    space.py            the space searched: (stages, dp, microbatches) x variants (tp, sharding)
    candidate.py        one candidate: (stages, dp, microbatches, microbatch size, schedule) as one value
    candidates.py       the candidates solve() enumerates, and their pruning
    solve.py            solve(): solve each candidate, keep the best, verify (Note [honest optimality])
    solution.py         what solve() returns and records per candidate, and its progress reports
    schedule_choice.py  `--schedule auto`: one solve per schedule, the faster plan kept
    zero_choice.py      whether to shard the optimizer state (Note [sharding as a candidate])
    baselines.py        uniform-by-layer and parameter-balanced splits
    fair_baselines.py   each baseline at its own best configuration (Note [fair baselines])
    chain_dp.py         exact dynamic program for chains (the ILP's oracle in tests)
    serialize.py        problem and assignment to and from plain dicts (plan.json)
"""

from partitioner.solver.baselines import BaselineCost, evaluate_baselines, param_balanced_split, uniform_split
from partitioner.solver.bounds import lower_bound_step_time_s
from partitioner.solver.chain_dp import ChainDPResult, solve_chain_dp
from partitioner.solver.check import AssignmentError, check_assignment
from partitioner.solver.evaluate import CostBreakdown, StageCost, TieCost, evaluate
from partitioner.solver.model import SolverConfig
from partitioner.solver.problem import (
    Assignment,
    Edge,
    PartitionProblem,
    RegionCost,
    SharedParam,
    TensorParallelCost,
    region_times_s,
)
from partitioner.solver.device_layout import place_stages
from partitioner.solver.solve import CandidateRecord, Solution, solve, solve_candidate

__all__ = [
    "Assignment", "AssignmentError", "BaselineCost", "CandidateRecord", "ChainDPResult", "CostBreakdown", "Edge",
    "PartitionProblem", "RegionCost", "SharedParam", "Solution", "SolverConfig", "StageCost",
    "TensorParallelCost", "TieCost", "check_assignment", "evaluate", "evaluate_baselines",
    "lower_bound_step_time_s", "param_balanced_split", "place_stages", "region_times_s", "solve", "solve_candidate",
    "solve_chain_dp", "uniform_split",
]
