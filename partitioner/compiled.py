"""What compile() returns: the plan (plain data) with what writing its program needs.

A ``Plan`` is frozen, hashed, JSON plain data that imports nothing above it; writing the program
folder needs more than the plan says: the model itself (to trace again at the microbatch size and
to take the initial weights from) and the solver's problem and assignment (kept in plan.json so
`inspect --node` prices moves on the solver's own numbers). ``Compiled`` holds both, and reads
through to the plan, so ``compile(...).num_stages`` and docs/design.md §11's
``plan = compile(...); plan.summary(); plan.save(DIR)`` keep working.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from partitioner.inspect import table
from partitioner.solver.plan import Plan
from partitioner.solver.problem import Assignment, PartitionProblem
from partitioner.frontend.user_source import UserSources
from partitioner.frontend.workload import Workload


@dataclass(frozen=True)
class Compiled:
    plan: Plan
    workload: Workload
    granularity: str
    problem: PartitionProblem
    assignment: Assignment
    sources: UserSources | None = None  # where the ranks find make_batch and loss_fn (partitioner/frontend/user_source.py)
    fewer_devices: str | None = None  # why the plan leaves devices idle (Note [fewer devices than given])
    # compile's own (traced, annotated gm, keyed ops) at the example batch, for this object's first save
    # only: not an init field, so dataclasses.replace makes a copy without it (Note [one trace when the
    # sizes agree] in partitioner/codegen/lower.py)
    first_trace: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def save(self, folder: str | Path) -> Path:
        """Write the program folder (docs/design.md §6): partitioner/codegen/lower.py."""
        from partitioner.codegen.lower import write_program_folder  # traces the model: torch, loaded late

        return write_program_folder(self, folder)

    def summary(self) -> str:
        return table(self.plan) + (f"\n\ndevices: {self.fewer_devices}" if self.fewer_devices else "")

    def __getattr__(self, name: str):
        # Only for names Compiled lacks: the plan's fields and methods (num_stages, regions, ...).
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.plan, name)
