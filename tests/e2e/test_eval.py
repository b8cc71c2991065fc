"""Evaluation on the validation split (Note [evaluation on the pipeline] in runtime/execute/validation.py):
a GPT with dropout compiled on a token corpus (2 stages on 2 ranks, 1F1B) and a hand-made 4-stage GPT
under interleaved 1F1B (2 stages a rank) report val_loss after the steps --eval-every names, equal to
the unpartitioned model in eval mode (dropout off) on the same validation batches, and train bit for
bit as runs without evaluation; so does the GPT at 4 stages under zbv (two adjacent stages on one
rank). A program without a validation split is refused before training.
Every run is a job of the session's 2-worker shared launch (tests/_shared_launch.py)."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _runtime_folders import TinyGPT, child_env, gpt_folder
from _shared_launch import Job, prepare
from partitioner.cli import main
from runtime.launch.run_options import FlagError, RunOptions
from runtime.features import evaluation
from runtime.program.spec import load_program
from runtime.program.user_code import resolve_callable

MODEL = "gpt:layers=2,width=32,heads=2,seq=32,dropout=0.1"
STEPS, EVERY, BATCHES = 6, 3, 2
HAND_STEPS, HAND_EVERY = 3, 2
ZBV_STEPS, ZBV_EVERY = 3, 2
HAND = dict(splits=[[0], [1], [2], [3]], ranks=[([0, 2], 0), ([1, 3], 0)], dp=1, schedule="interleaved",
            num_microbatches=4, global_batch=8, dropout=0.1)
VAL_DATA = ["runtime.data.synthetic:token_batch", {"vocab": 64, "seq": 8, "seed": 7}]  # another stream: "validation"


def _corpus(out: Path) -> Path:
    """A byte-level corpus of four standard-library modules, the last one the validation split."""
    from runtime.data.corpus.prepare import prepare as prepare_corpus  # lazy: only the preparer writes one

    lib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(lib, name) for name in ("argparse.py", "textwrap.py", "string.py", "random.py")]
    prepare_corpus(files, str(out), tokenizer="bytes", val_fraction=0.25)
    return out


@prepare
def _eval_programs(root: Path):
    corpus = _corpus(root / "corpus")
    folder = root / "gpt"
    assert main(["compile", MODEL, "--data", f"tokens:{corpus}", "--devices", "2", "--stages", "2",
                 "--global-batch", "8", "--no-calibrate", "-q", "-o", str(folder)]) == 0
    zbv = root / "zbv"  # Note [evaluation under a V]: rank 1 holds stages 1 and 2
    assert main(["compile", MODEL, "--data", f"tokens:{corpus}", "--devices", "2", "--stages", "4",
                 "--schedule", "zbv", "--microbatches", "4", "--global-batch", "8", "--no-calibrate", "-q",
                 "-o", str(zbv)]) == 0
    hand = root / "hand"
    data = {"make_batch": ["runtime.data.synthetic:token_batch", {"vocab": 64, "seq": 8, "seed": 0}],
            "loss_fn": ["runtime.data.synthetic:causal_lm_loss", {}], "eval_batch": VAL_DATA}
    gpt_folder(str(hand), steps=HAND_STEPS, extra={"data": data}, **HAND)

    def job(where, name, steps, *flags):
        return Job(2, [where, "--steps", str(steps), "--run-dir", root / name, "--checkpoint-dir",
                       root / f"ck_{name}", *flags])

    jobs = [job(folder, "eval", STEPS, "--eval-every", str(EVERY), "--eval-batches", str(BATCHES)),
            job(folder, "plain", STEPS),
            job(hand, "hand_eval", HAND_STEPS, "--eval-every", str(HAND_EVERY), "--eval-batches", str(BATCHES)),
            job(hand, "hand_plain", HAND_STEPS),
            job(zbv, "zbv_eval", ZBV_STEPS, "--eval-every", str(ZBV_EVERY), "--eval-batches", str(BATCHES)),
            job(zbv, "zbv_plain", ZBV_STEPS)]
    return (root, folder, hand), jobs


@pytest.fixture(scope="module")
def runs(shared_launches):
    (root, folder, hand), outputs = shared_launches.result(_eval_programs)
    return root, folder, hand, outputs


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(str(run_dir / "final" / "rank_*.safetensors"))):
        weights.update(load_file(path))
    return weights


def _reference_val_loss(model: torch.nn.Module, folder: Path, batches: int) -> float:
    """The unpartitioned model in eval mode over the same validation batches, microbatched as the
    program cuts them: the mean of the microbatch losses (= the mean over samples)."""
    program = load_program(str(folder))
    eval_batch = resolve_callable(program.data.eval_batch, str(folder))
    loss_fn = resolve_callable(program.data.loss_fn, str(folder))
    parts = program.num_microbatches * program.dp
    model.eval()
    losses = []
    with torch.no_grad():
        for i in range(batches):
            (tokens,), target = eval_batch(i, program.global_batch)
            for x, y in zip(tokens.chunk(parts), target.chunk(parts)):
                losses.append(float(loss_fn(model(x), y)))
    return sum(losses) / len(losses)


def test_val_loss_after_the_steps_eval_every_names_and_the_last(runs):
    root, *_ = runs
    rows = _metrics(root / "eval")
    evaluated = [r["step"] for r in rows if "val_loss" in r]
    assert evaluated == [EVERY - 1, STEPS - 1]  # steps 2 and 5 (0-based)
    for r in rows:
        if "val_loss" in r:
            assert math.isfinite(r["val_loss"]) and r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
    summary = json.loads((root / "eval" / "summary.json").read_text())
    assert summary["last_val_loss"] == rows[-1]["val_loss"]
    # the pricing's approximation: N batches at the forward third of a predicted step
    assert summary["predicted_eval_s"] == pytest.approx(BATCHES / 3 * summary["predicted_step_time_s"])
    hand_rows = _metrics(root / "hand_eval")
    assert [r["step"] for r in hand_rows if "val_loss" in r] == [HAND_EVERY - 1, HAND_STEPS - 1]


def test_the_step_line_shows_the_val_loss(runs):
    *_, outputs = runs
    lines = [line for line in outputs[0].stdout.splitlines() if line.startswith(f"step {EVERY}/{STEPS} ")]
    assert lines and " val " in lines[0], outputs[0].stdout
    assert "eval predicted ~" in outputs[0].stdout


def test_an_evaluation_changes_no_training_number(runs):
    root, *_ = runs
    for evaluated, plain in (("eval", "plain"), ("hand_eval", "hand_plain"), ("zbv_eval", "zbv_plain")):
        assert [r["loss"] for r in _metrics(root / evaluated)] == [r["loss"] for r in _metrics(root / plain)]
        a, b = _final(root / evaluated), _final(root / plain)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_val_loss_is_the_unpartitioned_model_in_eval_mode(runs):
    """The compiled stages draw their dropout through runtime.execute.randomness with a fixed train
    flag (Note [evaluation turns dropout off]); a difference from the eval-mode model would show it on."""
    from partitioner.models.builtin import load_workload  # lazy: the model builder, for the reference only

    root, folder, *_ = runs
    model = load_workload(MODEL, data=f"tokens:{root / 'corpus'}").model
    model.load_state_dict(_final(root / "eval"))
    assert _metrics(root / "eval")[-1]["val_loss"] == pytest.approx(
        _reference_val_loss(model, folder, BATCHES), abs=1e-5)


def test_interleaved_val_loss_is_the_unpartitioned_model_in_eval_mode(runs):
    root, _folder, hand, _outputs = runs
    model = TinyGPT(vocab=64, seq=8, d=16, layers=4, dropout=HAND["dropout"])
    model.load_state_dict(_final(root / "hand_eval"))
    assert _metrics(root / "hand_eval")[-1]["val_loss"] == pytest.approx(
        _reference_val_loss(model, hand, BATCHES), abs=1e-5)


def test_zbv_evaluates_and_goes_on_training(runs):
    """zbv's V puts two adjacent stages on rank 1, whose evaluation died inside torch ("can't
    steal_bwd_input": Note [evaluation under a V]); now its val_loss is the eval-mode model's after
    the step --eval-every names and after the last, and training goes on after it."""
    from partitioner.models.builtin import load_workload  # lazy: the model builder, for the reference only

    root, *_ = runs
    rows = _metrics(root / "zbv_eval")
    assert [r["step"] for r in rows if "val_loss" in r] == [ZBV_EVERY - 1, ZBV_STEPS - 1]
    model = load_workload(MODEL, data=f"tokens:{root / 'corpus'}").model
    model.load_state_dict(_final(root / "zbv_eval"))
    assert rows[-1]["val_loss"] == pytest.approx(_reference_val_loss(model, root / "zbv", BATCHES), abs=1e-5)


def test_a_program_without_a_validation_split_is_refused_before_training(runs, capsys):
    root, *_ = runs
    # train.py started by hand on a 1-rank program whose data has no eval_batch
    one = root / "one"
    gpt_folder(str(one), splits=[[0, 1]], ranks=[([0], 0)], num_microbatches=2, global_batch=4)
    env = {**child_env(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    done = subprocess.run([sys.executable, str(one / "train.py"), "--steps", "2", "--eval-every", "1"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done
    assert "--eval-every 1: this program's data has no validation split" in done.stderr, done.stderr
    assert "--data tokens:DIR" in done.stderr and not (one / "run").exists()  # refused before a step


def test_partitioner_run_refuses_eval_without_a_validation_split(tmp_path, capsys):
    folder = tmp_path / "mlp"
    assert main(["compile", "mlp", "-o", str(folder), "--devices", "1", "-q", "--no-calibrate"]) == 0
    capsys.readouterr()
    assert main(["run", str(folder), "--eval-every", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no validation split" in err and "--data tokens:DIR" in err, err
    assert not (folder / "run").exists() and not (folder / "checkpoints").exists()  # nothing started


@pytest.mark.parametrize("flags, needle", [
    (["--eval-every", "0"], "--eval-every 0: evaluate every 1 or more steps"),
    (["--eval-every", "-2"], "--eval-every -2: evaluate every 1 or more steps"),
    (["--eval-every", "5", "--eval-batches", "0"], "--eval-batches 0: evaluate on 1 or more"),
    (["--eval-batches", "3"], "--eval-batches 3 sizes the evaluation of --eval-every: add --eval-every K"),
])
def test_bad_eval_flags_are_refused(flags, needle):
    with pytest.raises(FlagError) as refused:
        RunOptions.parse(flags)
    assert needle in str(refused.value)


def test_eval_flags_reach_the_ranks():
    options = RunOptions.parse(["--eval-every", "5"])
    assert options.features == {"eval_every": 5} and RunOptions.parse(options.to_argv()) == options
    assert "no validation split" in evaluation.FEATURE.run_refusal({"data": {}}, options)  # Note [one feature, one module]
    assert evaluation.FEATURE.run_refusal({"data": {"eval_batch": ["m:f", {}]}}, options) is None
