"""Training on a real corpus (`--data`, Note [a corpus replaces make_batch]): a small GPT compiled
through the Python API on the Python standard library's own sources (byte-level), trained by the
generated programs in one torchrun launch of 3 workers (tests/drivers/run_many.py):

- the 3-stage run matches the one-process oracle (`verify`'s check_run), and its validation loss falls;
- a run stopped at step 4 and resumed on another layout (1 stage x 3 replicas instead of 3
  stages) trains the uninterrupted run's samples: its losses are the uninterrupted ones;
- the middle stage reads no byte of the corpus, the first and the last only their rows (Note [a
  rank reads its rows]);
- a Megatron indexed dataset (.bin/.idx written here in Megatron's layout, a PREFIX_val pair its
  validation dataset) trains too, and its training and validation losses fall;
- a model vocabulary smaller than the corpus's is refused at compile time, naming both.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import partitioner
from partitioner.cli.verify import check_run
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import load_workload
from runtime.data.corpus import open_source, CorpusSpec
from runtime.data.corpus.prepare import prepare
from runtime.launch.torchrun import run_env, torchrun_command
from tests.drivers import RUN_MANY
from tests.unit.test_corpus_formats import write_megatron

pytestmark = pytest.mark.e2e

MODEL = "gpt:layers=1,width=32,heads=2,seq=32"
GLOBAL_BATCH, STEPS, STOP = 6, 8, 4
EVAL_EVERY, EVAL_BATCHES = 4, 2


def _stdlib_files() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted((stdlib / "json").glob("*.py"))]


def _compile(folder: Path, data: str, **options) -> None:
    workload = load_workload(MODEL, data=data)
    plan = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(3, "cpu"), global_batch=GLOBAL_BATCH,
                               training={"data": data, "model_spec": MODEL}, machine_profile="preset", **options)
    plan.save(folder)


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> loss, of the steps this run dir logged."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    prepare(_stdlib_files(), root / "data", tokenizer="bytes")
    tokens = open_source(CorpusSpec.parse(f"tokens:{root / 'data'}")).split("train")
    write_megatron(root / "mega", [tokens[i:i + 5000].tolist() for i in range(0, 40000, 5000)])
    write_megatron(root / "mega_val", [tokens[40000:42000].tolist()])  # Megatron's validation dataset
    data = f"tokens:{root / 'data'}"
    _compile(root / "piped", data, num_stages=3)
    _compile(root / "replicated", data, num_stages=1, dp=3)
    _compile(root / "megatron", f"megatron:{root / 'mega'}", num_stages=1, dp=3)
    jobs = [["piped", "full", "ck_full", STEPS], ["piped", "half", "ck_resume", STOP],
            ["replicated", "resumed", "ck_resume", STEPS], ["megatron", "mega_run", "ck_mega", STEPS]]
    args = []
    for folder, run, ck, steps in jobs:
        args += ["--", str(root / folder), "--steps", str(steps), "--run-dir", str(root / run),
                 "--checkpoint-dir", str(root / ck)]
        if run in ("full", "mega_run"):  # evaluation changes no training number (Note [evaluation on the pipeline])
            args += ["--eval-every", str(EVAL_EVERY), "--eval-batches", str(EVAL_BATCHES)]
    done = subprocess.run(torchrun_command(RUN_MANY, 3, args=args[1:]), env=run_env(), capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return root


def test_the_pipelined_run_is_the_one_process_oracles(runs):
    report = check_run(runs / "piped", runs / "full", steps=STEPS)
    assert report.ok, report.text()


def test_a_resume_on_another_layout_trains_the_uninterrupted_runs_samples(runs):
    full, half, resumed = _losses(runs / "full"), _losses(runs / "half"), _losses(runs / "resumed")
    assert half == {s: full[s] for s in range(STOP)}  # the same program, the same steps: bit for bit
    later = list(range(STOP, STEPS))
    assert sorted(s for s in resumed if s >= STOP) == later  # it resumed at STOP, not from scratch
    # 1 stage x 3 replicas sums the gradients in another order than 3 stages: equal to rounding
    assert np.allclose([resumed[s] for s in later], [full[s] for s in later], rtol=0, atol=1e-5), (resumed, full)


def test_the_middle_stage_reads_nothing_and_the_ends_their_rows(runs):
    reads = {r: json.loads((runs / "full" / f"data_reads_rank_{r}.json").read_text()) for r in range(3)}
    assert reads[1]["bytes_read"] == 0 and reads[1]["windows_read"] == 0
    for r in (0, 2):  # one replica: every row of every step, seq tokens of 2 bytes (uint16) each, and the
        # validation batches once (the evaluator keeps them)
        assert reads[r]["windows_read"] == (STEPS + EVAL_BATCHES) * GLOBAL_BATCH
        assert reads[r]["bytes_read"] >= STEPS * GLOBAL_BATCH * 32 * 2
    replicated = [json.loads((runs / "resumed" / f"data_reads_rank_{r}.json").read_text()) for r in range(3)]
    assert [r["windows_read"] for r in replicated] == [(STEPS - STOP) * GLOBAL_BATCH // 3] * 3  # its rows only


def test_a_megatron_indexed_dataset_trains_and_its_validation_loss_falls(runs):
    losses = _losses(runs / "mega_run")
    assert sorted(losses) == list(range(STEPS)) and losses[STEPS - 1] < losses[0] - 0.1, losses
    records = [json.loads(line) for line in (runs / "mega_run" / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}  # PREFIX_val.bin/.idx
    assert sorted(val) == [EVAL_EVERY - 1, STEPS - 1] and val[STEPS - 1] < val[EVAL_EVERY - 1], val


def test_a_model_vocabulary_smaller_than_the_corpus_is_refused(runs):
    with pytest.raises(ValueError, match=r"vocabulary is 256 ids but .* embeds 64: build the model with vocab >= 256"):
        partitioner.compile(load_workload(MODEL + ",vocab=64"), cluster=ClusterSpec.homogeneous(1, "cpu"),
                            global_batch=GLOBAL_BATCH, training={"data": f"tokens:{runs / 'data'}"},
                            machine_profile="preset")


def test_generate_samples_with_the_corpus_tokenizer(runs):
    """No --tokenizer-from: the program's data names its prepared folder (Note [where the tokenizer
    comes from]), and a gpt that took the corpus's vocabulary rebuilds at that size."""
    done = subprocess.run([sys.executable, "-m", "partitioner", "generate", str(runs / "piped"), "--prompt", "def ",
                           "--max-new-tokens", "12", "--temperature", "0", "--checkpoint-dir", str(runs / "ck_full")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("def ") and len(done.stdout) > len("def "), done.stdout


def test_the_validation_loss_falls(runs):
    records = [json.loads(line) for line in (runs / "full" / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(val) == [EVAL_EVERY - 1, STEPS - 1]
    assert val[STEPS - 1] < val[EVAL_EVERY - 1], val
