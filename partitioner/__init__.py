"""partitioner: a compiler for distributed training of PyTorch models.

    plan = compile(workload, cluster=ClusterSpec.homogeneous(4, "cpu"), global_batch=32)
    print(plan.summary())
    plan.save("out/")          # the program folder: partitioner run out (plan.world_size ranks)

Glossary (the words mean exactly this everywhere in the code):

node        one operation of the traced torch.fx graph.
region      a group of nodes along module boundaries (a transformer block, or its attention or
            MLP); the unit the solver places. Regions form a DAG in topological order.
stage       a contiguous slice of regions run by one pipeline step; stage k sends to stage k + 1.
rank        one process of the job (torchrun's RANK). A rank holds one stage (several under an
            interleaved schedule) of one data-parallel replica. `stage` never means `rank`.
device      the accelerator (or CPU) a rank runs on; a ClusterSpec lists them.
replica     one of the `dp` data-parallel copies of the whole pipeline.
microbatch  a slice of a replica's batch; the pipeline keeps several in flight.

The rooms (docs/design.md §3), in the order data flows through them (each folder's __init__
maps its modules):

config/                   what the user asks, typed: training settings, job files, the cluster, device kinds
models/                   built-in workloads and the MODEL spec, Hugging Face configs in, weights out
frontend/                 the workload traced and annotated (the passes), the PartitionProblem, what
                          the ranks will import of the user's code
calibrate/                a fitted per-kind time model; this machine's cpu profile
solver/                   the partition problem as plain numbers, solved and checked; the frozen Plan
codegen/                  the back end: lowering passes and the program folder's text
inspect/                  plans, checkpoints and programs for people; `verify` against the oracle
cli/                      the `partitioner` command

compiler.py               compile(): the straight list of named steps
compiled.py               what compile() returns: the plan and what writing its program needs
compile_features.py       the compile's side of the training features: their decisions and prices
replan.py                 a program re-planned for the ranks left, on the same cuts, from its saved problem
errors.py                 the domain errors (runtime's re-exported)
__main__.py               ``python -m partitioner``

The metadata contract between passes is passes/ir.py (the passes own it; nothing in passes/
imports partitioner).
"""

from runtime.python_version import check_python as _check_python

_check_python()  # before anything that needs 3.11 (tomllib in partitioner.config.cluster)

from partitioner.config.cluster import ClusterSpec  # noqa: E402
from partitioner.errors import (
    CheckpointCorruptError,
    PartitionerError,
    PartitionInfeasibleError,
    PlanMismatchError,
    TraceError,
)


def __getattr__(name):
    # Workload imports torch (seconds); `partitioner inspect` and the solver never need it.
    if name == "Workload":
        # lazy: loads torch
        from partitioner.frontend.workload import Workload

        return Workload
    raise AttributeError(f"module 'partitioner' has no attribute {name!r}")


def compile(workload, *, cluster, global_batch, **options):  # noqa: A001 - the product's verb
    from partitioner.compiler import compile_workload

    return compile_workload(workload, cluster=cluster, global_batch=global_batch, **options)


def analyze(workload, *, granularity: str = "block"):
    """Trace and annotate a workload: returns (GraphModule, per-region cost table)."""
    # lazy: loads torch
    from partitioner.frontend.analysis import analyze as _analyze

    return _analyze(workload, granularity=granularity)


__all__ = [
    "ClusterSpec", "Workload", "compile", "analyze", "PartitionerError", "TraceError",
    "PartitionInfeasibleError", "PlanMismatchError", "CheckpointCorruptError",
]
