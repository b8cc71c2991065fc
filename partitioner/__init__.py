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

The rooms (docs/design.md §3), in the order data flows through them:

workload.py               what a user hands the compiler: model, example inputs, loss, make_batch
models.py                 built-in workloads and the MODEL spec of the command line
hf.py                     ``hf:CONFIG_DIR``: a Workload from a Hugging Face config, local files only
user_source.py            where the ranks find make_batch, loss_fn and custom ops; a model file run
local_modules.py          the local modules a travelling file imports, tried as a rank imports them
rank_imports.py           what a rank can import: its sys.path, the spec it would find a name by
job.py                    training settings: defaults < job file < training= / flags, checked
settings.py               TrainingSettings, Request, Decisions: what the user asks and what compile chose
cluster.py                ClusterSpec: devices, nodes, links, cluster files
device_presets.py         device kinds: memory, FLOP/s per dtype, usable memory, cpu fixed costs
tensor_parallel.py        what compile() accepts with a tensor-parallel degree, refused in words
trace.py                  the only file that calls torch.export / symbolic_trace
ir.py                     the metadata contract between passes (docs/design.md §4)
analysis.py               front end: trace, key random ops, the passes, the PartitionProblem
calibrate/                a fitted per-kind time model; this machine's cpu profile
solver/                   the partition problem as plain numbers, solved and checked
plan.py                   the frozen Plan: JSON, content hash
compiler.py               compile(): the straight list of named steps
compiled.py               what compile() returns: the plan and what writing its program needs
lower.py                  back end: retrace at the microbatch, split, program object, emit
lower_tensor_parallel.py  where a tensor group settles its collectives, written into a stage graph
codegen/                  the lowering passes and the program folder's text
inspect/                  plans and checkpoints for people, one module per view
verify.py                 the program against the one-process oracle
export.py                 a verified checkpoint as from_pretrained-ready weights
data_prepare.py           text and JSONL tokenized into a corpus folder runtime/corpus/ reads; decode
errors.py                 the domain errors (runtime's re-exported)
cli/                      the `partitioner` command
__main__.py               ``python -m partitioner``
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
        # lazy: loads torch
        from partitioner.workload import Workload

        return Workload
    raise AttributeError(f"module 'partitioner' has no attribute {name!r}")


def compile(workload, *, cluster, global_batch, **options):  # noqa: A001 - the product's verb
    from partitioner.compiler import compile_workload

    return compile_workload(workload, cluster=cluster, global_batch=global_batch, **options)


def analyze(workload, *, granularity: str = "block"):
    """Trace and annotate a workload: returns (GraphModule, per-region cost table)."""
    # lazy: loads torch
    from partitioner.analysis import analyze as _analyze

    return _analyze(workload, granularity=granularity)


__all__ = [
    "ClusterSpec", "Workload", "compile", "analyze", "PartitionerError", "TraceError",
    "PartitionInfeasibleError", "PlanMismatchError", "CheckpointCorruptError",
]
