"""The combination matrix's cells (tests/e2e/test_combination_matrix.py): the factors, the pairs no
runnable cell may hold and why, the pairwise cover (tests/_pairwise.py), and how a row becomes a
compiled program (``compile_cell``) and its train.py flags (``run_flags``)."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import partitioner
from _pairwise import all_pairs
from partitioner.config.cluster import ClusterSpec
from partitioner.errors import PartitionInfeasibleError
from partitioner.models.builtin import load_workload
from partitioner.solver.model import SolverConfig
from runtime.features.canaries import EVERY as CANARY

FACTORS = {
    "stages": [1, 2, 3],  # pipeline ranks (interleaved, zb, zbv: 2 stages on each)
    "dp": [1, 2, 3],
    "tp": [1, 2],
    "precision": ["fp32", "bf16-mixed", "fp16-mixed"],
    "zero": [False, True],
    "recompute": [False, True],
    "dropout": [False, True],
    "schedule": ["gpipe", "1f1b", "interleaved", "zb", "zbv"],
    "clip": [False, True],
    "sdc": [False, True],
    "lossless": [False, True],
    "memtier": [False, True],
    "compiled": [False, True],  # compile_stages: every stage's forward through torch.compile (inductor)
    "canary": [False, True],  # compute canaries (runtime/features/canaries.py): a replica re-runs a microbatch of another's stage
    "eval": [False, True],  # --eval-every: val_loss on the validation split
    "corpus": [False, True],  # training.data: a byte-level corpus replaces the synthetic batches
}
MAX_WORLD = 6
SEVERAL_PER_RANK = ("interleaved", "zb", "zbv")  # 2 stages on each pipeline rank (SolverConfig.local_stages=2)
CLIP = 0.5  # below the tiny GPT's gradient norm: every step is clipped
SDC_EVERY = 2
CANARY_EVERY = 2  # steps 1 and 3: the one after a kill before step 3 re-runs step 3
EVAL_EVERY, EVAL_BATCHES = 2, 1
# 6 regions: 3 ranks x 2 stages; a corpus cell's vocabulary is the corpus's (bytes: 256)
MODEL = "gpt:layers=4,width=32,heads=2,seq=16,dropout={dropout}"
SYNTHETIC_VOCAB = ",vocab=64"

# The pairs a runnable cell may not hold. REFUSED: name -> (the pair, what else its cell sets,
# what the refusal must say); each is compiled and must be refused so, before anything runs.
_CANARY = f"{CANARY.key}=2 \\({CANARY.flag}\\)"
REFUSED = {
    "replica check with ZeRO": ({"zero": True, "sdc": True}, {"dp": 2},
                                [r"sdc_every=2 with shard_optimizer on", r"cannot see corruption",
                                 r"drop --sdc-every, or --shard-optimizer off"]),
    "memory tier with tp 2": ({"tp": 2, "memtier": True}, {},
                              [r"tensor_parallel=2 does not run with the in-memory checkpoint tier",
                               r"leave --memory-tier out", r"or compile with --tp 1"]),
    "ZeRO with dp 1": ({"dp": 1, "zero": True}, {},
                       [r"shard_optimizer 'on' needs a plan with dp > 1, and dp=1 \(--dp 1\) was asked for",
                        r"no replicas to shard", r"use --dp 2 or more, or shard_optimizer 'auto' or 'off'"]),
    **{f"{s} on one pipeline rank": ({"stages": 1, "schedule": s}, {},
                                     [rf"schedule {s} needs at least 2 pipeline ranks",
                                      r"use --schedule 1f1b or gpipe, or more devices \(--devices 2\)"])
       for s in SEVERAL_PER_RANK},
    **{f"compiled stages under {s}": ({"compiled": True, "schedule": s}, {"stages": 2},
                                      [rf"compile_stages with schedule {s} does not run yet",
                                       r"not split into input- and weight-gradient actions",
                                       r"recompile with --schedule 1f1b, gpipe or interleaved, or without "
                                       r"--compile-stages"])
       for s in ("zb", "zbv")},
    "canary with dp 1": ({"canary": True, "dp": 1}, {},
                         [_CANARY + r": the program has dp 1, no second replica", r"recompile with --dp 2"]),
    "canary with tp 2": ({"canary": True, "tp": 2}, {"dp": 2},
                         [_CANARY + r": a canary re-runs a whole stage on one rank", r"tensor groups of 2",
                          r"recompile with --tp 1, or drop it"]),
    "canary with ZeRO": ({"canary": True, "zero": True}, {"dp": 2},
                         [_CANARY + r": with sharded optimizer state \(ZeRO-1\)",
                          r"recompile with --shard-optimizer off, or drop it"]),
    "canary under interleaved": ({"canary": True, "schedule": "interleaved"}, {"dp": 2, "stages": 2},
                                 [_CANARY + r": a canary re-runs the one stage of a rank, and the interleaved "
                                  r"schedule puts 2 on each", r"recompile with --schedule 1f1b or gpipe"]),
    **{f"canary under {s}": ({"canary": True, "schedule": s}, {"dp": 2, "stages": 2},
                             [_CANARY + rf": a canary records a stage's backward as one piece, and schedule {s} "
                              r"splits it", r"recompile with --schedule 1f1b or gpipe, or drop it"])
       for s in ("zb", "zbv")},
}
# Refused by `partitioner run` (and every rank) before a step: what the program's data lacks
# is a run flag's problem, not the plan's.
RUN_REFUSED = {
    "evaluation without a validation split": ({"eval": True, "corpus": False}, {},
                                              [r"--eval-every 2: this program's data has no validation split",
                                               r"--data tokens:DIR"]),
}
INERT = {  # accepted, and compiled to the plain setting: no replicas to compare
    "replica check with dp 1": {"dp": 1, "sdc": True},
}
EXCLUDED = [pair for pair, _, _ in (*REFUSED.values(), *RUN_REFUSED.values())] + list(INERT.values())
_EXCLUDED = [tuple(pair.items()) for pair in EXCLUDED]
_ABSENT = object()


def world(row) -> int:
    return row.get("stages", 1) * row.get("dp", 1) * row.get("tp", 1)


def runnable(row) -> bool:
    """The covering set's filter, on partial rows (tests/_pairwise.py): False once the row holds
    a pair that cannot run here. Called some ten thousand times per cover: kept to plain lookups."""
    if world(row) > MAX_WORLD:
        return False
    return not any(row.get(a, _ABSENT) == x and row.get(b, _ABSENT) == y for (a, x), (b, y) in _EXCLUDED)


def cost(row) -> float:
    """What a cell costs, for the cover (tests/_pairwise.py ``cost``): its ranks, and a compiled
    cell as much again as the largest world, inductor's compile of every stage on two cores."""
    return world(row) + (MAX_WORLD if row["compiled"] else 0)


SEED = 38  # of seeds 0-49, a cover with the fewest cells (then compiled cells, then ranks): 17, 4 compiled, 84 ranks
ROWS, NOT_COVERED = all_pairs(FACTORS, valid=runnable, seed=SEED, cost=cost)
DEFAULTS = {"stages": 1, "dp": 1, "tp": 1, "precision": "fp32", "zero": False, "recompute": False, "dropout": False,
            "schedule": "1f1b", "clip": False, "sdc": False, "lossless": False, "memtier": False,
            "compiled": False, "canary": False, "eval": False, "corpus": False}
FLAGS = ("zero", "recompute", "dropout", "clip", "sdc", "lossless", "memtier", "compiled", "canary", "eval", "corpus")


def name_of(row) -> str:
    return f"{row['stages']}x{row['dp']}x{row['tp']}-{row['schedule']}-{row['precision']}" + \
        "".join(f"-{f}" for f in FLAGS if row[f])


def local_stages(row) -> int:
    return 2 if row["schedule"] in SEVERAL_PER_RANK else 1


def microbatches(row) -> int:
    """As few as the schedule allows, and at least 2 (gradients accumulate): 1F1B needs one per
    stage, interleaved and zb one per pipeline rank (torch's rounds: max(1, m // ranks) divides m)."""
    return max(2, row["stages"])


def samples(row) -> int:
    """Per microbatch: 2 where recompute must be chosen. With ZeRO-1 on one stage the optimizer
    step's peak (the gathered parameters) is above the backward's at 1 sample, and no recompute
    can lower it (squeezed_memory)."""
    return 2 if row["recompute"] else 1


def write_corpus(out: Path) -> str:
    """A byte-level corpus of four standard-library modules, the last the validation split: the
    data spec of the corpus cells."""
    from runtime.data.corpus.prepare import prepare as prepare_corpus  # lazy: only the preparer writes one

    lib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(lib, name) for name in ("argparse.py", "textwrap.py", "string.py", "random.py")]
    prepare_corpus(files, str(out), tokenizer="bytes", val_fraction=0.25)
    return f"tokens:{out}"


def workload(row, corpus: str | None = None):
    """The cell's model: ``corpus`` (the data spec) for a corpus cell, which must have it."""
    spec = MODEL.format(dropout=0.1 if row["dropout"] else 0.0)
    if not row["corpus"]:
        return load_workload(spec + SYNTHETIC_VOCAB)
    assert corpus is not None, "a corpus cell needs the corpus"
    return load_workload(spec, data=corpus)


def compile_cell(row, corpus: str | None = None, memory_bytes: int | None = None):
    pp, dp, tp = row["stages"], row["dp"], row["tp"]
    local, m = local_stages(row), microbatches(row)
    group = {"kind": "cpu", "count": pp * dp * tp}
    if memory_bytes is not None:
        group["memory_bytes"] = int(memory_bytes)
    training = {"sdc_every": SDC_EVERY if row["sdc"] else 0, CANARY.key: CANARY_EVERY if row["canary"] else 0,
                "compile_stages": row["compiled"]}
    if row["memtier"]:
        training["memory_tier"] = "auto"  # one host: every rank's own shared memory
    if row["corpus"]:
        training["data"] = corpus
    return partitioner.compile(
        workload(row, corpus), cluster=ClusterSpec.from_dict({"group": [group]}), global_batch=dp * m * samples(row),
        num_stages=pp * local, dp=dp, tensor_parallel=tp, microbatches=m, schedule=row["schedule"],
        precision=row["precision"], clip_grad_norm=CLIP if row["clip"] else None,
        shard_optimizer="on" if row["zero"] else "off", training=training,
        solver_config=SolverConfig(local_stages=local) if local > 1 else None)


def squeezed_memory(plan, share: float) -> int:
    """Device memory ``share`` of the fullest device's activations short of the plan's peak: the
    solver must recompute to fit (a block recomputed keeps only its input)."""
    # a rank's figure is its tensor group's (Note [tensor groups] in partitioner/solver/tensor_groups.py)
    peaks = [x / plan.tensor_parallel for x in plan.predicted.get("rank_peak_memory_bytes", ())] or \
        [s.peak_memory_bytes for s in plan.stages]
    fullest = max(plan.stages, key=lambda s: s.peak_memory_bytes)
    return int(max(peaks) - share * fullest.memory.activations_bytes)


# What recompute can save: 40% of the activations on a deep stage, less where the head's logits
# (a corpus cell's 256-token vocabulary) are most of them and only the blocks recompute.
SQUEEZES = (0.4, 0.2, 0.1)


def compile_runnable(row, corpus: str | None = None):
    compiled = compile_cell(row, corpus)
    for _ in range(3 if row["recompute"] else 0):  # squeezed, a plan may fit by moving a cut instead
        if any(r.recompute for r in compiled.plan.regions):
            break
        for share in SQUEEZES:
            try:
                compiled = compile_cell(row, corpus, memory_bytes=squeezed_memory(compiled.plan, share))
                break
            except PartitionInfeasibleError:  # more than recompute saves: squeeze less
                continue
    return compiled


# Checkpoints every step; the kill comes before step 3. A checkpoint point first joins the
# previous persist (Note [distributed commit]) and every rank has started step 2 when any rank
# reaches step 3, so rank 0 has committed the checkpoint of step 1 by then: the resume is from a
# checkpoint whatever the timing (the newer ones may still be in flight). Lossless cells die one
# step later, so the resume is from a delta (step 1 is the chain's full checkpoint).
STEPS, KILL_STEP = 4, 3
LOSSLESS_STEPS, LOSSLESS_KILL_STEP = 5, 4


def steps_and_kill(row) -> tuple[int, int]:
    return (LOSSLESS_STEPS, LOSSLESS_KILL_STEP) if row["lossless"] else (STEPS, KILL_STEP)


def run_flags(row) -> list:
    """train.py flags of both runs of a cell (the killed one adds --fail-at)."""
    flags = ["--steps", steps_and_kill(row)[0], "--checkpoint-every", 1, "--quiet"]
    if row["lossless"]:  # every checkpoint kept: the one resumed from is still there to be read
        flags += ["--checkpoint-compression", "lossless", "--keep-checkpoints", 8]
    if row["eval"]:
        flags += ["--eval-every", EVAL_EVERY, "--eval-batches", EVAL_BATCHES]
    return flags


def kill_rank(row, index: int) -> int:
    return index % world(row)  # cell by cell, another role dies (first stage, last stage, a replica)
