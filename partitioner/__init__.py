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
"""

from runtime.python_version import check_python as _check_python

_check_python()  # before anything that needs 3.11 (tomllib in partitioner.cluster)

from partitioner.cluster import ClusterSpec  # noqa: E402
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
        from partitioner.workload import Workload

        return Workload
    raise AttributeError(f"module 'partitioner' has no attribute {name!r}")


def compile(workload, *, cluster, global_batch, **options):  # noqa: A001 - the product's verb
    from partitioner.compiler import compile_workload

    return compile_workload(workload, cluster=cluster, global_batch=global_batch, **options)


def analyze(workload, *, granularity: str = "block"):
    """Trace and annotate a workload: returns (GraphModule, per-region cost table)."""
    from partitioner.analysis import analyze as _analyze

    return _analyze(workload, granularity=granularity)


__all__ = [
    "ClusterSpec", "Workload", "compile", "analyze", "PartitionerError", "TraceError",
    "PartitionInfeasibleError", "PlanMismatchError", "CheckpointCorruptError",
]
