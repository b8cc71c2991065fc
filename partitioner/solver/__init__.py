"""The partition solver: plain-number problem in, verified plan out (no torch import here).

    problem.py   Region / Edge / Tie / PartitionProblem, Assignment, the time model
    check.py     evaluate() (the float cost model) and check_assignment() (the verifier)
    model.py     the CP-SAT model of one (stages, dp, microbatches) candidate; SolverConfig
    solve.py     solve(): enumerate candidates, solve, keep the best, verify
    baselines.py uniform-by-layer and parameter-balanced splits
    chain_dp.py  exact dynamic program for chains (the ILP's oracle in tests)
"""

from partitioner.solver.baselines import BaselineCost, evaluate_baselines, param_balanced_split, uniform_split
from partitioner.solver.chain_dp import ChainDPResult, solve_chain_dp
from partitioner.solver.check import (
    AssignmentError,
    CostBreakdown,
    StageCost,
    TieCost,
    check_assignment,
    evaluate,
    lower_bound_step_time_s,
)
from partitioner.solver.model import SolverConfig
from partitioner.solver.problem import (
    SCHEDULES,
    Assignment,
    Edge,
    PartitionProblem,
    Region,
    Tie,
    in_flight_microbatches,
    place_stages,
    region_times_s,
)
from partitioner.solver.solve import CandidateRecord, Solution, solve, solve_candidate

__all__ = [
    "Assignment", "AssignmentError", "BaselineCost", "CandidateRecord", "ChainDPResult", "CostBreakdown", "Edge",
    "PartitionProblem", "Region", "SCHEDULES", "Solution", "SolverConfig", "StageCost", "Tie", "TieCost",
    "check_assignment", "evaluate", "evaluate_baselines", "in_flight_microbatches", "lower_bound_step_time_s",
    "param_balanced_split", "place_stages", "region_times_s", "solve", "solve_candidate", "solve_chain_dp",
    "uniform_split",
]
