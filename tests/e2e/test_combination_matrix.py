"""The combination matrix (issue 26, "never silently wrong: every feature with every other"): a
pairwise covering set over the training features, each cell compiled, trained a few steps with a
rank SIGKILLed and the job resumed from its checkpoint, and verified against the one-process
oracle (partitioner/cli/verify.py) and bit for bit against the same cell trained without the kill.
The cells the product refuses at compile time are listed below with the refusal they must get.

Factors (FACTORS): pipeline ranks ("stages") 1/2/3, dp 1/2/3, tp 1/2, precision fp32/bf16-mixed/
fp16-mixed, ZeRO-1 (shard_optimizer) off/on, recompute off/on, dropout off/on, schedule
gpipe/1f1b/interleaved, clipping off/on, the replica check (SDC) off/on, lossless checkpoints
off/on, the memory tier off/on. How each is pinned: ``compile_cell`` (compile keywords and
``training`` settings) and ``run_flags`` (train.py flags). Recompute is asked for the way a user
gets it: devices too small for the plan without it (``squeezed_memory``), so the solver chooses
it. Interleaved puts 2 stages on each pipeline rank (SolverConfig.local_stages=2).

The covering set (tests/_pairwise.py, seeded: the same cells every run) holds every pair of
values of every two factors except:

- over the world cap: stages 3 x dp 3 is 9 ranks (tp 1), and every cell here runs on at most 6:
  on two cores a 9-rank cell needs a launch of its own, 9 workers importing torch (some 45
  CPU-seconds before its first step), and 9 processes on 2 cores. No other pair needs more than
  6: stages 3 x tp 2, dp 3 x tp 2, stages 3 x dp 2 and stages 2 x dp 3 run at 6 with the third
  factor 1.
- refused by the product (REFUSED, each asserted with its message): the replica check with ZeRO
  (sharded state cannot be compared), the memory tier with tp 2, interleaved on one pipeline
  rank, ZeRO with dp 1 (no replicas to shard over).
- inert (INERT, asserted to compile to the plain setting): the replica check with dp 1, where
  there are no replicas to compare; the plan keeps sdc_every and prices no check.

Every cell's kill is a real SIGKILL of one rank (--fail-at RANK:3:kill, lossless cells 4; a
checkpoint every step) in the session's shared launch of its world size; the job is restarted on
its own in forked workers (Job(restarts=1), Note [restarts in a fork] in tests/drivers/run_many.py),
recovers from the newest checkpoint (memory tier cells: from host memory, Note [memory tier
fallback]), and must end bit for bit where the uninterrupted run of the same cell ends.
Run with -s to see the table of cells and verdicts; PARTITIONER_MATRIX_TABLE=PATH also writes it
as markdown.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import partitioner
from _pairwise import all_pairs, uncovered
from _runtime_folders import one_thread  # noqa: F401 - the oracles train here, beside the workers
from _shared_launch import Job, prepare
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import load_workload
from partitioner.solver.model import SolverConfig
from partitioner.cli.verify import check_run, read_grad_norms
from runtime.resilience.checkpoint.shard import step_dirname

FACTORS = {
    "stages": [1, 2, 3],  # pipeline ranks (interleaved: 2 stages on each)
    "dp": [1, 2, 3],
    "tp": [1, 2],
    "precision": ["fp32", "bf16-mixed", "fp16-mixed"],
    "zero": [False, True],
    "recompute": [False, True],
    "dropout": [False, True],
    "schedule": ["gpipe", "1f1b", "interleaved"],
    "clip": [False, True],
    "sdc": [False, True],
    "lossless": [False, True],
    "memtier": [False, True],
}
MAX_WORLD = 6
SEED = 21  # of the seeds tried, the cover with the fewest ranks in all (13 cells, 55 ranks)
# Checkpoints every step; the kill comes before step 3. A checkpoint point first joins the
# previous persist (Note [distributed commit]) and every rank has started step 2 when any rank
# reaches step 3, so rank 0 has committed the checkpoint of step 1 by then: the resume is from a
# checkpoint whatever the timing (the newer ones may still be in flight). Lossless cells die one
# step later, so the resume is from a delta (step 1 is the chain's full checkpoint).
STEPS, KILL_STEP = 4, 3
LOSSLESS_STEPS, LOSSLESS_KILL_STEP = 5, 4
# Note [memory tier fallback]: a memory tier cell resumes from host memory, unless no step is in
# every rank's memory: each rank keeps its two newest snapshots, and the killed rank may already
# be overwriting the older while a slower peer is still committing the newer (a window of the
# copy's hash, in a background thread). The product then says so and recovers from disk, as it
# should; the cell accepts that, and only that (test_memory_tier_dist.py holds the tier to memory).
CLIP = 0.5  # below the tiny GPT's gradient norm: every step is clipped
SDC_EVERY = 2
MODEL = "gpt:layers=4,width=32,heads=2,vocab=64,seq=16,dropout={dropout}"  # 6 regions: 3 ranks x 2 interleaved

# The pairs a runnable cell may not hold. REFUSED: name -> (the pair, what else its cell sets,
# what the refusal must say); each is compiled below and must be refused so.
REFUSED = {
    "replica check with ZeRO": ({"zero": True, "sdc": True}, {"dp": 2},
                                [r"sdc_every=2 with shard_optimizer on", r"cannot see corruption",
                                 r"drop --sdc-every, or --shard-optimizer off"]),
    "memory tier with tp 2": ({"tp": 2, "memtier": True}, {},
                              [r"tensor_parallel=2 does not run with the in-memory checkpoint tier",
                               r"leave --memory-tier out", r"or compile with --tp 1"]),
    "interleaved on one pipeline rank": ({"stages": 1, "schedule": "interleaved"}, {},
                                         [r"schedule interleaved needs at least 2 pipeline ranks",
                                          r"use --schedule 1f1b or gpipe, or more devices \(--devices 2\)"]),
    "ZeRO with dp 1": ({"dp": 1, "zero": True}, {},
                       [r"shard_optimizer 'on' needs a plan with dp > 1, and dp=1 \(--dp 1\) was asked for",
                        r"no replicas to shard", r"use --dp 2 or more, or shard_optimizer 'auto' or 'off'"]),
}
INERT = {  # accepted, and compiled to the plain setting: no replicas to compare
    "replica check with dp 1": {"dp": 1, "sdc": True},
}
EXCLUDED = [pair for pair, _, _ in REFUSED.values()] + list(INERT.values())


def world(row) -> int:
    return row.get("stages", 1) * row.get("dp", 1) * row.get("tp", 1)


def _holds(row, pair: dict) -> bool:
    return all(k in row and row[k] == v for k, v in pair.items())


def runnable(row) -> bool:
    """The covering set's filter, on partial rows (tests/_pairwise.py): False once the row holds
    a pair that cannot run here."""
    return world(row) <= MAX_WORLD and not any(_holds(row, pair) for pair in EXCLUDED)


ROWS, NOT_COVERED = all_pairs(FACTORS, valid=runnable, seed=SEED, cost=world)
EXPECTED_NOT_COVERED = [
    (("stages", 3), ("dp", 3)),                  # 9 ranks: over the cap
    (("stages", 1), ("schedule", "interleaved")),  # refused
    (("dp", 1), ("zero", True)),                 # refused
    (("dp", 1), ("sdc", True)),                  # inert
    (("tp", 2), ("memtier", True)),              # refused
    (("zero", True), ("sdc", True)),             # refused
]
DEFAULTS = {"stages": 1, "dp": 1, "tp": 1, "precision": "fp32", "zero": False, "recompute": False, "dropout": False,
            "schedule": "1f1b", "clip": False, "sdc": False, "lossless": False, "memtier": False}


def name_of(row) -> str:
    flags = [k for k in ("zero", "recompute", "dropout", "clip", "sdc", "lossless", "memtier") if row[k]]
    return f"{row['stages']}x{row['dp']}x{row['tp']}-{row['schedule']}-{row['precision']}" + \
        "".join(f"-{f}" for f in flags)


def microbatches(row) -> int:
    """As few as the schedule allows, and at least 2 (gradients accumulate): 1F1B needs one per
    stage, interleaved one per pipeline rank (torch's rounds: max(1, m // ranks) divides m)."""
    return max(2, row["stages"])


def workload(row):
    return load_workload(MODEL.format(dropout=0.1 if row["dropout"] else 0.0))


def compile_cell(row, memory_bytes: int | None = None):
    pp, dp, tp = row["stages"], row["dp"], row["tp"]
    local = 2 if row["schedule"] == "interleaved" else 1
    m = microbatches(row)
    group = {"kind": "cpu", "count": pp * dp * tp}
    if memory_bytes is not None:
        group["memory_bytes"] = int(memory_bytes)
    training = {"sdc_every": SDC_EVERY if row["sdc"] else 0}
    if row["memtier"]:
        training["memory_tier"] = "auto"  # one host: every rank's own shared memory
    return partitioner.compile(
        workload(row), cluster=ClusterSpec.from_dict({"group": [group]}), global_batch=dp * m,
        num_stages=pp * local, dp=dp, tensor_parallel=tp, microbatches=m, schedule=row["schedule"],
        precision=row["precision"], clip_grad_norm=CLIP if row["clip"] else None,
        shard_optimizer="on" if row["zero"] else "off", training=training,
        solver_config=SolverConfig(local_stages=local) if local > 1 else None)


def squeezed_memory(plan) -> int:
    """Device memory 40% of the fullest device's activations short of the plan's peak: the
    solver must recompute to fit (a block recomputed keeps only its input)."""
    peaks = plan.predicted.get("rank_peak_memory_bytes") or [s.peak_memory_bytes for s in plan.stages]
    fullest = max(plan.stages, key=lambda s: s.peak_memory_bytes)
    return int(max(peaks) - 0.4 * fullest.memory.activations_bytes)


def compile_runnable(row):
    compiled = compile_cell(row)
    for _ in range(3 if row["recompute"] else 0):  # squeezed, a plan may fit by moving a cut instead
        if any(r.recompute for r in compiled.plan.regions):
            break
        compiled = compile_cell(row, memory_bytes=squeezed_memory(compiled.plan))
    return compiled


def steps_and_kill(row) -> tuple[int, int]:
    return (LOSSLESS_STEPS, LOSSLESS_KILL_STEP) if row["lossless"] else (STEPS, KILL_STEP)


def run_flags(row) -> list:
    """train.py flags of both runs of a cell (the killed one adds --fail-at)."""
    flags = ["--steps", steps_and_kill(row)[0], "--checkpoint-every", 1, "--quiet"]
    if row["lossless"]:  # every checkpoint kept: the one resumed from is still there to be read
        flags += ["--checkpoint-compression", "lossless", "--keep-checkpoints", 8]
    return flags


def kill_rank(row, index: int) -> int:
    return index % world(row)  # cell by cell, another role dies (first stage, last stage, a replica)


@prepare
def _matrix(root: Path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the session's first module may not have asked for one thread yet
    try:
        return _cells_and_jobs(root)
    finally:
        torch.set_num_threads(threads)


def _cells_and_jobs(root: Path):
    cells, jobs = [], []
    for i, row in enumerate(ROWS):
        folder = root / f"cell_{i:02d}"
        try:
            compiled = compile_runnable(row)
        except Exception as error:  # noqa: BLE001 - the cell's test reports it, the others still run
            cells.append({"row": row, "folder": folder, "error": error})
            continue
        compiled.save(folder / "program")
        cells.append({"row": row, "folder": folder, "plan": compiled.plan, "jobs": (len(jobs), len(jobs) + 1)})
        flags = run_flags(row)
        jobs.append(Job(world(row), [folder / "program", *flags, "--run-dir", folder / "clean",
                                     "--checkpoint-dir", folder / "ck_clean"]))
        kill = f"{kill_rank(row, i)}:{steps_and_kill(row)[1]}:kill"
        jobs.append(Job(world(row), [folder / "program", *flags, "--fail-at", kill, "--run-dir", folder / "killed",
                                     "--checkpoint-dir", folder / "ck_killed"], restarts=1))
    return cells, jobs


@pytest.fixture(scope="module")
def matrix(shared_launches):
    return shared_launches.result(_matrix)


VERDICTS: dict[str, tuple[dict, str]] = {}


@pytest.fixture(scope="module", autouse=True)
def table(tmp_path_factory):
    """After the module: the cells and their verdicts, printed (-s) and, with
    PARTITIONER_MATRIX_TABLE, written as markdown."""
    yield
    names = list(FACTORS)
    lines = ["| cell | " + " | ".join(names) + " | ranks | verdict |", "|" + "---|" * (len(names) + 3)]
    for name, (row, verdict) in VERDICTS.items():
        lines.append(f"| {name} | " + " | ".join(_show(row.get(n)) for n in names) + f" | {world(row)} | {verdict} |")
    text = "\n".join(lines) + "\n"
    (tmp_path_factory.getbasetemp() / "matrix_cells.md").write_text(text)
    if os.environ.get("PARTITIONER_MATRIX_TABLE"):
        Path(os.environ["PARTITIONER_MATRIX_TABLE"]).write_text(text)
    print("\n" + text)


def _show(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def test_the_cells_cover_every_pair_that_can_run_here():
    assert NOT_COVERED == EXPECTED_NOT_COVERED
    assert uncovered(ROWS, FACTORS) == EXPECTED_NOT_COVERED
    assert all(runnable(row) and world(row) <= MAX_WORLD for row in ROWS)
    for pair in (dict(p) for p in EXPECTED_NOT_COVERED):  # each has its reason, and only these
        assert (pair in EXCLUDED) != (world({**DEFAULTS, **pair}) > MAX_WORLD), pair


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in rows}  # a step re-run after the kill overwrites the lost one
    return [by_step[k] for k in sorted(by_step)]


def _finals(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(str(p)) for p in sorted((run_dir / "final").glob("*.safetensors"))}


@pytest.mark.parametrize("index", range(len(ROWS)), ids=[name_of(r) for r in ROWS])
def test_cell_compiles_as_pinned_survives_a_kill_and_trains_like_the_oracle(matrix, index):
    cells, outputs = matrix
    cell = cells[index]
    row, folder = cell["row"], cell["folder"]
    name = name_of(row)
    VERDICTS[name] = (row, "FAIL")
    if "error" in cell:
        raise AssertionError(f"cell {name} was refused at compile time: {cell['error']}") from cell["error"]
    plan = cell["plan"]
    local = 2 if row["schedule"] == "interleaved" else 1
    assert (plan.num_stages, plan.dp, plan.tensor_parallel, plan.schedule, plan.world_size) == \
        (row["stages"] * local, row["dp"], row["tp"], row["schedule"], world(row))
    decisions = plan.decisions  # what the compiler chose (Note [settings and decisions])
    assert decisions.precision == row["precision"]
    assert decisions.shard_optimizer is row["zero"]
    assert plan.training.clip_grad_norm == (CLIP if row["clip"] else None)
    assert decisions.sdc_every == (SDC_EVERY if row["sdc"] else 0)
    assert (decisions.memory_tier or {}).get("mode", "off") == ("none" if row["memtier"] else "off")
    assert any(r.recompute for r in plan.regions) is row["recompute"], [r.name for r in plan.regions if r.recompute]

    steps, kill_step = steps_and_kill(row)
    killed, clean = folder / "killed", folder / "clean"
    killed_out = outputs[cell["jobs"][1]]
    killed_text = killed_out.stdout + killed_out.stderr
    assert f"fault injection: kill before step {kill_step}" in killed_text, killed_text[-3000:]
    assert "run_many: job" in killed_text and "restarting it" in killed_text, killed_text[-3000:]
    source = "disk"
    if row["memtier"]:
        recoveries = [json.loads(line) for line in (killed / "recovery.jsonl").read_text().splitlines()]
        assert sorted(r["rank"] for r in recoveries) == list(range(world(row))), recoveries
        assert len({(r["step"], r["tier"]) for r in recoveries}) == 1, recoveries  # every rank alike
        resumed, source = recoveries[0]["step"], recoveries[0]["tier"]
        if source == "memory":
            assert {r["disk_shards_read"] for r in recoveries} == {0}, recoveries
        else:  # Note [memory tier fallback] above: only with the product saying why
            fallback = re.search(r"memory tier: (.*): recovering from disk", killed_text)
            assert source == "disk" and fallback, (recoveries, killed_text[-3000:])
            source = f"disk (memory tier: {fallback.group(1)})"
    else:
        found = re.findall(r"resuming from checkpoint \S+ at step (\d+)", killed_text)
        assert found, killed_text[-3000:]
        resumed = int(found[-1])
    assert kill_step - 2 <= resumed <= kill_step, resumed  # see STEPS: never from scratch, whatever the timing
    if row["lossless"] and source.startswith("disk"):  # the resume read a delta and its base
        manifest = json.loads((folder / "ck_killed" / step_dirname(resumed) / "manifest.json").read_text())
        assert manifest["compression"] == "lossless" and manifest["base_step"] is not None, manifest

    assert _losses(killed) == _losses(clean)  # bit for bit: the resumed run is the uninterrupted one
    want, got = _finals(clean), _finals(killed)
    assert sorted(got) == sorted(want)
    for file, tensors in want.items():
        assert sorted(got[file]) == sorted(tensors), file
        for tensor_name, tensor in tensors.items():
            assert torch.equal(got[file][tensor_name], tensor), (file, tensor_name)
    # the global norm is computed exactly when something needs it (Note [global gradient norm])
    assert len(read_grad_norms(killed)) == (steps if row["clip"] or row["precision"] == "fp16-mixed" else 0)
    checks = [json.loads(p.read_text())["checks"] for p in sorted(killed.glob("sdc_stats_rank_*.json"))]
    assert (len(checks), min(checks, default=0) > 0) == ((world(row), True) if row["sdc"] else (0, False)), checks

    report = check_run(folder / "program", killed, steps=steps, workload=workload(row))
    assert report.ok, f"{name}:\n{report.text()}"
    VERDICTS[name] = (row, f"PASS: loss diff {report.max_loss_diff:.1e}, params {report.max_param_diff:.1e} "
                           f"({report.oracle}); rank {kill_rank(row, index)} killed before step {kill_step}, "
                           f"resumed at step {resumed} from {source}, "
                           "bit-exact with the uninterrupted run")


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_cell_names_the_reason_and_the_fix(name):
    pair, extra, messages = REFUSED[name]
    row = {**DEFAULTS, **extra, **pair}
    with pytest.raises(ValueError) as info:
        compile_cell(row)
    text = str(info.value)
    for pattern in messages:
        assert re.search(pattern, text), f"{name}: {pattern!r} not in the refusal:\n{text}"
    VERDICTS[f"refused: {name}"] = (row, f"refused: {text}")


@pytest.mark.parametrize("name", list(INERT))
def test_inert_cell_compiles_to_the_plain_setting(name):
    row = {**DEFAULTS, **INERT[name]}
    plan = compile_cell(row).plan
    assert plan.dp == 1 and plan.decisions.shard_optimizer is False
    assert plan.predicted["sdc_check_s_per_step"] == 0.0  # no replica check is priced: none runs at dp 1
    VERDICTS[f"inert: {name}"] = (row, "compiles; no replicas to compare at dp 1, no check priced or run")
