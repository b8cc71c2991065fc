"""The combination matrix (issue 26, "never silently wrong: every feature with every other"; grown by
issue 41): a pairwise covering set over the training features, each cell compiled, trained a few
steps with a rank SIGKILLed and the job resumed from its checkpoint, and verified against the
one-process oracle (partitioner/cli/verify.py, to the tolerance of the cell's precision) and bit
for bit against the same cell trained without the kill. The pairs the product refuses are listed
with the refusal they must get.

Factors (tests/_matrix_cells.py FACTORS): pipeline ranks ("stages") 1/2/3, dp 1/2/3, tp 1/2,
precision fp32/bf16-mixed/fp16-mixed, ZeRO-1 (shard_optimizer) off/on, recompute off/on, dropout
off/on, schedule gpipe/1f1b/interleaved/zb/zbv, clipping off/on, the replica check (SDC) off/on,
lossless checkpoints off/on, the memory tier off/on, compiled stages off/on, compute canaries
off/on, evaluation (--eval-every) off/on, and the data: synthetic batches or a byte-level token
corpus. How each is pinned: ``compile_cell`` (compile keywords and ``training`` settings) and
``run_flags`` (train.py flags). Recompute is asked for the way a user gets it: devices too small
for the plan without it (``squeezed_memory``), so the solver chooses it. Interleaved, zb and zbv
put 2 stages on each pipeline rank (SolverConfig.local_stages=2).

The covering set (tests/_pairwise.py, seeded: the same cells every run) holds every pair of
values of every two factors except:

- over the world cap: stages 3 x dp 3 is 9 ranks (tp 1), and every cell here runs on at most 6:
  on two cores a 9-rank cell needs a launch of its own, 9 workers importing torch (some 45
  CPU-seconds before its first step), and 9 processes on 2 cores. No other pair needs more than
  6: stages 3 x tp 2, dp 3 x tp 2, stages 3 x dp 2 and stages 2 x dp 3 run at 6 with the third
  factor 1.
- refused at compile time (REFUSED, each asserted with its message): the replica check with
  ZeRO (sharded state cannot be compared), the memory tier with tp 2, a schedule of 2 stages per
  rank on one pipeline rank, ZeRO with dp 1 (no replicas to shard over), compiled stages under
  zb or zbv (a compiled backward is one graph, not split in two), and a canary with dp 1, tp 2,
  ZeRO, or 2 stages per rank (runtime/resilience/canary_rules.py).
- refused by `partitioner run` before a step (RUN_REFUSED): evaluation of synthetic batches,
  which have no validation split.
- inert (INERT, asserted to compile to the plain setting): the replica check with dp 1, where
  there are no replicas to compare; the plan keeps sdc_every and prices no check.

Every cell's kill is a real SIGKILL of one rank (--fail-at RANK:3:kill, lossless cells 4; a
checkpoint every step) in the session's shared launch of its world size; the job is restarted on
its own in forked workers (Job(restarts=1), Note [restarts in a fork] in tests/drivers/run_many.py),
recovers from the newest checkpoint (memory tier cells: from host memory, Note [memory tier
fallback]), and must end bit for bit where the uninterrupted run of the same cell ends: losses,
parameters, optimizer state and, in an evaluating cell, every val_loss. An evaluating cell's
last val_loss is also the unpartitioned model's in eval mode on the same validation batches; a
compiled cell compiled every stage without a graph break; a canary cell ran its canaries on
every rank and found nothing.
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

from _matrix_cells import (CANARY_EVERY, CLIP, DEFAULTS, EVAL_BATCHES, EVAL_EVERY, FACTORS, INERT, REFUSED, ROWS,
                           RUN_REFUSED, SDC_EVERY, compile_cell, compile_runnable, kill_rank, local_stages, name_of,
                           run_flags, steps_and_kill, workload, world, write_corpus)
from _runtime_folders import one_thread  # noqa: F401 - the oracles train here, beside the workers
from _shared_launch import Job, prepare
from partitioner.cli import main
from partitioner.cli.verify import TOLERANCES, check_run, read_grad_norms, read_program_run
from runtime.execute.precision import autocast
from runtime.features.canaries import EVERY as CANARY
from runtime.program.parts import Precision
from runtime.program.spec import load_program
from runtime.program.user_code import resolve_callable
from runtime.resilience.checkpoint.shard import step_dirname

@prepare
def _matrix(root: Path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the session's first module may not have asked for one thread yet
    try:
        return _cells_and_jobs(root)
    finally:
        torch.set_num_threads(threads)


def _cells_and_jobs(root: Path):
    corpus = write_corpus(root / "corpus")
    cells, jobs = [], []
    for i, row in enumerate(ROWS):
        folder = root / f"cell_{i:02d}"
        try:
            compiled = compile_runnable(row, corpus)
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
    return (cells, corpus), jobs


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


def _rows(run_dir: Path) -> dict[int, dict]:
    """step -> its metrics row (a step re-run after the kill overwrites the lost one)."""
    return {r["step"]: r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())}


def _losses(run_dir: Path) -> list[float]:
    rows = _rows(run_dir)
    return [rows[k]["loss"] for k in sorted(rows)]


def _finals(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(str(p)) for p in sorted((run_dir / "final").glob("*.safetensors"))}


def _reference_val_loss(row, folder: Path, corpus: str, params: dict[str, torch.Tensor]) -> float:
    """The unpartitioned model with the run's final parameters, in eval mode (dropout off), over
    the same validation batches cut into the program's microbatches, under the cell's autocast:
    the mean of the microbatch losses."""
    program = load_program(str(folder))
    eval_batch = resolve_callable(program.data.eval_batch, str(folder))
    loss_fn = resolve_callable(program.data.loss_fn, str(folder))
    model = workload(row, corpus).model
    model.load_state_dict(params, strict=False)
    model.eval()
    losses = []
    with torch.no_grad(), autocast(Precision.of(row["precision"]), "cpu"):
        for i in range(EVAL_BATCHES):
            (tokens,), target = eval_batch(i, program.global_batch)
            parts = program.num_microbatches * program.dp
            losses += [float(loss_fn(model(x), y)) for x, y in zip(tokens.chunk(parts), target.chunk(parts))]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("index", range(len(ROWS)), ids=[name_of(r) for r in ROWS])
def test_cell_compiles_as_pinned_survives_a_kill_and_trains_like_the_oracle(matrix, index):
    (cells, corpus), outputs = matrix
    cell = cells[index]
    row, folder = cell["row"], cell["folder"]
    name = name_of(row)
    VERDICTS[name] = (row, "FAIL")
    if "error" in cell:
        raise AssertionError(f"cell {name} was refused at compile time: {cell['error']}") from cell["error"]
    plan = cell["plan"]
    assert (plan.num_stages, plan.dp, plan.tensor_parallel, plan.schedule, plan.world_size) == \
        (row["stages"] * local_stages(row), row["dp"], row["tp"], row["schedule"], world(row))
    decisions = plan.decisions  # what the compiler chose (Note [settings and decisions])
    assert decisions.precision == row["precision"]
    assert decisions.shard_optimizer is row["zero"]
    assert plan.training.clip_grad_norm == (CLIP if row["clip"] else None)
    assert decisions.sdc_every == (SDC_EVERY if row["sdc"] else 0)
    assert decisions.features.get(CANARY.key, 0) == (CANARY_EVERY if row["canary"] else 0)
    assert bool(plan.training.compile_stages) is row["compiled"]
    assert (plan.training.data is not None) is row["corpus"]
    assert (decisions.memory_tier or {}).get("mode", "off") == ("none" if row["memtier"] else "off")
    assert any(r.recompute for r in plan.regions) is row["recompute"], [r.name for r in plan.regions if r.recompute]

    steps, kill_step = steps_and_kill(row)
    killed, clean = folder / "killed", folder / "clean"
    killed_out = outputs[cell["jobs"][1]]
    killed_text = killed_out.stdout + killed_out.stderr
    assert f"fault injection: kill before step {kill_step}" in killed_text, killed_text[-3000:]
    assert "run_many: job" in killed_text and "restarting it" in killed_text, killed_text[-3000:]
    resumed, source = _resumed(row, folder, killed_text)
    assert kill_step - 2 <= resumed <= kill_step, resumed  # see STEPS: never from scratch, whatever the timing

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
    extra = _features_ran(row, folder, corpus, clean, killed, resumed)

    report = check_run(folder / "program", killed, steps=steps, workload=workload(row, corpus))
    assert report.ok, f"{name}:\n{report.text()}"
    VERDICTS[name] = (row, f"PASS: loss diff {report.max_loss_diff:.1e}, params {report.max_param_diff:.1e} "
                           f"({report.oracle}); rank {kill_rank(row, index)} killed before step {kill_step}, "
                           f"resumed at step {resumed} from {source}, "
                           f"bit-exact with the uninterrupted run{extra}")


# Note [memory tier fallback]: a memory tier cell resumes from host memory, unless no step is in
# every rank's memory: each rank keeps its two newest snapshots, and the killed rank may already
# be overwriting the older while a slower peer is still committing the newer (a window of the
# copy's hash, in a background thread). The product then says so and recovers from disk, as it
# should; the cell accepts that, and only that (test_memory_tier_dist.py holds the tier to memory).
def _resumed(row, folder: Path, killed_text: str) -> tuple[int, str]:
    """(the step the killed run resumed at, from where)."""
    if row["memtier"]:
        recoveries = [json.loads(line) for line in (folder / "killed" / "recovery.jsonl").read_text().splitlines()]
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
        resumed, source = int(found[-1]), "disk"
    if row["lossless"] and source.startswith("disk"):  # the resume read a delta and its base
        manifest = json.loads((folder / "ck_killed" / step_dirname(resumed) / "manifest.json").read_text())
        assert manifest["compression"] == "lossless" and manifest["base_step"] is not None, manifest
    return resumed, source


def _features_ran(row, folder: Path, corpus: str, clean: Path, killed: Path, resumed: int) -> str:
    """The compiled stages, the canaries and the evaluation did run, and as they should; what the
    verdict adds about them."""
    said = ""
    if row["compiled"]:  # Note [graph breaks are said] in runtime/execute/compile_stages.py
        for rank in range(world(row)):
            times = json.loads((clean / f"stage_times_rank_{rank}.json").read_text())
            assert times["compiled_graphs"] > 0 and times["graph_breaks"] == 0, (rank, times)
        said += "; compiled, no graph break"
    steps = steps_and_kill(row)[0]
    for run, first in ((clean, 0), (killed, resumed)):  # Note [compute canaries]: a healthy run's find nothing
        due = len([s for s in range(first, steps) if (s + 1) % CANARY_EVERY == 0]) if row["canary"] else None
        stats = [json.loads((run / f"canary_stats_rank_{r}.json").read_text())["canaries"] if row["canary"] else None
                 for r in range(world(row))]
        assert stats == [due] * world(row), (run, stats, due)  # the resumed run: the steps it trained
        assert not (run / "canary.jsonl").exists() and not (run / "exclude.json").exists(), run
    if row["canary"]:
        said += f"; canaries every {CANARY_EVERY} steps found nothing"
    if row["eval"]:
        evaluated = {k: r["val_loss"] for k, r in _rows(clean).items() if "val_loss" in r}
        assert sorted(evaluated) == [k for k in range(steps) if (k + 1) % EVAL_EVERY == 0 or k == steps - 1]
        again = {k: r["val_loss"] for k, r in _rows(killed).items() if "val_loss" in r}
        assert again == evaluated  # bit for bit, every evaluation the resumed run made again too
        want = _reference_val_loss(row, folder / "program", corpus, read_program_run(clean)[1])
        tolerance = TOLERANCES[Precision.of(row["precision"])][0]
        diff = abs(evaluated[steps - 1] - want) / max(1.0, abs(want))
        assert diff <= tolerance, (evaluated[steps - 1], want, diff, tolerance)
        said += f"; val_loss diff {diff:.1e} from the eval-mode model"
    return said


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


@pytest.mark.parametrize("name", list(RUN_REFUSED))
def test_run_refuses_the_cell_before_a_step(name, tmp_path, capsys):
    pair, extra, messages = RUN_REFUSED[name]
    row = {**DEFAULTS, **extra, **pair}
    folder = tmp_path / "program"
    compile_cell(row).save(folder)
    assert main(["run", str(folder), *map(str, run_flags(row))]) == 2
    text = capsys.readouterr().err.strip()
    assert len(text.splitlines()) == 1, text
    for pattern in messages:
        assert re.search(pattern, text), f"{name}: {pattern!r} not in the refusal:\n{text}"
    assert not (folder / "run").exists() and not (folder / "checkpoints").exists()  # nothing started
    VERDICTS[f"refused by run: {name}"] = (row, f"refused: {text}")


@pytest.mark.parametrize("name", list(INERT))
def test_inert_cell_compiles_to_the_plain_setting(name):
    row = {**DEFAULTS, **INERT[name]}
    plan = compile_cell(row).plan
    assert plan.dp == 1 and plan.decisions.shard_optimizer is False
    assert plan.predicted["sdc_check_s_per_step"] == 0.0  # no replica check is priced: none runs at dp 1
    VERDICTS[f"inert: {name}"] = (row, "compiles; no replicas to compare at dp 1, no check priced or run")
