"""The oldest torch the runtime runs under, checked first thing when a rank starts
(``runtime.launch.rank.main``), without importing torch.

Note [what the runtime needs]: a program folder is compiled where OR-Tools is installed and run
anywhere, typically on a GPU cluster's image with an older torch and neither OR-Tools nor
zstandard. So the runtime (this package, train.py and the stage files codegen writes) needs at start only torch
>= 2.11, numpy and safetensors, and never imports ortools, partitioner or passes
(tests/unit/test_import_graph.py; tests/e2e/test_runtime_needs.py trains where those cannot be
imported). Optional packages are imported only where a run asks for them (zstandard for lossless
checkpoints, a missing one one line at start-up, never a checkpoint skipped as corrupt;
tensorboard, transformers, datasets, tokenizers). 2.11 is the oldest torch whose API the runtime
calls as it does (docs/gpu.md), so an older one is refused here in one line; two kinds of
pipeline plan need a newer one (Note [torch 2.11's pipelining]).
"""

from __future__ import annotations

import re
import sys

from runtime.errors import MissingPackageError

MINIMUM = (2, 11)
TESTED = "2.11 through 2.13"


def installed_torch_version() -> str | None:
    """The version of the torch this process imports: the loaded module's, else the installed
    distribution's (reading it is milliseconds, importing torch is seconds); None when no torch
    can be imported."""
    loaded = sys.modules.get("torch")
    if loaded is not None and getattr(loaded, "__version__", None) is not None:
        return str(loaded.__version__)
    # lazy: metadata lookups only when torch is not loaded yet
    from importlib import metadata, util

    if util.find_spec("torch") is None:
        return None
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # importable without a distribution (a source build on the path)
        # lazy: the only way left to learn its version
        import torch

        return str(torch.__version__)


def major_minor(version: str) -> tuple[int, int] | None:
    """(2, 11) of "2.11.0+cu130", "2.11.0a0+git70d99e9", "2.11.0.dev20260101"; None when the text
    does not start with two numbers."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def check_torch(version: str | None = None) -> None:
    """MissingPackageError, one line, when torch is missing or older than ``MINIMUM``. ``version``:
    the text to judge (default: the installed torch's). A version that does not parse is let
    through: refusing a torch that may work would be worse than its first AttributeError."""
    text = installed_torch_version() if version is None else version
    want = "%d.%d" % MINIMUM
    if text is None:
        raise MissingPackageError(f"the runtime needs torch >= {want} and none is installed here: "
                                  f"pip install 'torch>={want}' (a build for this machine's CUDA)")
    got = major_minor(text)
    if got is not None and got < MINIMUM:
        raise MissingPackageError(f"torch {text} is older than the oldest the runtime runs under "
                                  f"(torch {want}; run under {TESTED}): install a newer one here, "
                                  f"e.g. pip install 'torch>={want}' (a build for this machine's CUDA)")


# Note [torch 2.11's pipelining]: torch.distributed.pipelining before 2.13, read in the source of
# 2.11 and 2.12 and run here on CPU under both, fails at the first step of two kinds of plan that
# 2.13 runs: (1) a plan with an integer or boolean tensor crossing a stage boundary (HF models'
# position ids and masks): 2.11 gives every received tensor requires_grad ("only Tensors of
# floating point dtype can require gradients"); 2.12 creates the buffers right but still expects a
# gradient back for each ("has gradients None and is expecting to send gradients"); (2) under
# torch 2.11, a rank holding two adjacent stages (zbv's V) over gloo: every stage first exchanges
# a warm-up message with its neighbours, its own rank included, and gloo cannot send to its own
# rank ("Pair is not connected"; NCCL can: not refused there). So a rank refuses such a plan at
# start, in one line naming the tensor or the stages and the fix, instead of a traceback at step 1.
INTEGER_BOUNDARIES = (2, 13)  # the first torch that passes an integer tensor between stages
NEIGHBOURS_ON_ONE_RANK = (2, 12)  # the first whose warm-up skips a neighbour on the same rank


def _floating(dtype: str) -> bool:
    name = dtype.removeprefix("torch.")
    return "float" in name or name in ("half", "double")


def _install(version: tuple[int, int]) -> str:
    return "install torch >= %d.%d here (pip install 'torch>=%d.%d')" % (version + version)


def pipeline_refusal(program, version: str | None = None) -> str | None:
    """Why torch ``version`` (default: the installed one) cannot run ``program``'s pipeline (Note
    [torch 2.11's pipelining]), or None."""
    text = installed_torch_version() if version is None else version
    got = major_minor(text or "")
    if got is None:
        return None
    if got < INTEGER_BOUNDARIES:
        for stage in program.stages[1:]:  # stage k > 0 receives every input from stage k - 1
            for t in stage.inputs:
                if not _floating(t.dtype):
                    return (f"torch {text} cannot pass {t.name!r} ({t.dtype}) from stage {stage.index - 1} to "
                            f"stage {stage.index}: its pipelining expects a gradient for every tensor between "
                            f"stages, and only floating-point tensors have one: {_install(INTEGER_BOUNDARIES)}, "
                            f"or compile with --stages 1")
    if got < NEIGHBOURS_ON_ONE_RANK and program.backend == "gloo":
        for rank, held in enumerate(program.layout.stages_of_rank):
            pair = next(((a, b) for a, b in zip(held, held[1:]) if b == a + 1), None)
            if pair is not None:
                return (f"torch {text} cannot run stages {pair[0]} and {pair[1]} on one rank (rank {rank}) over "
                        f"gloo: its pipelining sends a warm-up message from each stage to its neighbours, and "
                        f"gloo cannot send to its own rank: {_install(NEIGHBOURS_ON_ONE_RANK)}, or compile "
                        f"with another --schedule than {program.schedule}")
    return None
