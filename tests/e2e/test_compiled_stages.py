"""Compiled stages end to end (Note [compiled stages] in runtime/execute/compile_stages.py): programs
compiled with compile_stages train under torchrun against the one-process eager oracle (verify's
tolerances, Note [compiled stages verify] in partitioner/cli/verify.py), and a killed rank resumes
bit-exact; tp 2 compiled (DTensor stages, keyed attention dropout on each rank's heads, every
region recomputed) passes verify with no graph break; fp16-mixed with dp 2 and the replica check
every step, on a Hugging Face Llama, passes verify. Inductor compiles slowly here, so every
program trains in one torchrun launch (tests/drivers/run_many.py) and the FX graph cache serves the
repeated graphs."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from tests.drivers import RUN_MANY
from partitioner.cli.verify import check_run
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import hf_gpt2, hf_llama
import partitioner
from runtime.launch.torchrun import run_env, torchrun_command

STEPS = 4
COMPILED = {"compile_stages": True}


def gpt2():
    """A tie (embedding and head on both stages), dropout, and, on 600 kB devices, a recomputed block."""
    return hf_gpt2(layers=2, width=32, heads=2, vocab=64, seq=16, dropout=0.1)


def llama():
    """Before keyed attention ran on local heads, inductor failed on this stage's backward and dynamo
    ran the whole forward eagerly (Note [compiled stages])."""
    return hf_llama(layers=2, width=32, heads=4, vocab=64, seq=8, batch=2, dropout=0.1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    small = ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 2, "memory_bytes": 600_000}]})
    plans = {"gpt2": partitioner.compile(gpt2(), cluster=small, global_batch=8, num_stages=2, microbatches=4,
                                         training=COMPILED)}
    plans["gpt2"].save(root / "gpt2")
    tight = ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 2, "memory_bytes": 300_000}]})
    plans["tp2"] = partitioner.compile(llama(), cluster=tight, global_batch=4, num_stages=1, microbatches=2,
                                       tensor_parallel=2, machine_profile="preset",
                                       training={**COMPILED, "recompute": "full"})  # every region, whatever fits
    plans["tp2"].save(root / "tp2")
    # fp16-mixed (loss scaling, autocast inside the compiled graph) with dp 2 and the replica check
    # every step: the features that live outside the stage's forward, on the compiled stage
    plans["dp2_fp16_sdc"] = partitioner.compile(llama(), cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8,
                                                num_stages=1, dp=2, microbatches=2, precision="fp16-mixed",
                                                machine_profile="preset", training={**COMPILED, "sdc_every": 1})
    plans["dp2_fp16_sdc"].save(root / "dp2_fp16_sdc")
    gpt2_dir = root / "gpt2"
    jobs = [["--restarts", "1", gpt2_dir, "--steps", STEPS, "--checkpoint-every", 2, "--fail-at", "1:3:kill",
             "--checkpoint-dir", root / "ck_killed", "--run-dir", root / "killed"],
            [gpt2_dir, "--steps", STEPS, "--checkpoint-dir", root / "ck_full", "--run-dir", root / "full"],
            [root / "tp2", "--steps", 3, "--checkpoint-dir", root / "ck_tp2", "--run-dir", root / "tp2_run"],
            [root / "dp2_fp16_sdc", "--steps", 3, "--checkpoint-dir", root / "ck_dp2", "--run-dir", root / "dp2_run"]]
    args = [str(a) for job in jobs for a in ["--", *job]][1:]
    done = subprocess.run(torchrun_command(RUN_MANY, 2, args=args), env=run_env(), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return root, plans, done.stdout + done.stderr


def test_two_compiled_stages_with_dropout_a_tie_and_recompute_pass_verify(runs):
    root, plans, out = runs
    plan = plans["gpt2"]
    assert any(r.recompute for r in plan.regions) and plan.ties, "the case needs a recomputed region and a tie"
    assert json.loads((root / "gpt2" / "plan.json").read_text())["program"]["compile_stages"] is True
    assert "checkpointed(self.recompute_" in "".join(p.read_text() for p in (root / "gpt2").glob("stage_*.py"))
    assert "compiled stages [0]" in out and "before step 1" in out
    times = json.loads((root / "full" / "stage_times_rank_0.json").read_text())
    assert times["compile_s"] > 0  # reported apart from the steps
    assert times["compiled_graphs"] > 0 and times["graph_breaks"] == 0  # Note [graph breaks are said]
    report = check_run(root / "gpt2", root / "full", steps=STEPS, workload=gpt2())
    assert report.ok, report.text()


def test_tensor_parallel_compiled_stages_with_dropout_and_recompute_pass_verify_without_graph_breaks(runs):
    root, plans, out = runs
    plan = plans["tp2"]
    assert plan.tensor_parallel == 2 and all(r.recompute for r in plan.regions)
    assert "randomness.tensor_parallel_attention(" in (root / "tp2" / "stage_0.py").read_text()
    for rank in (0, 1):
        times = json.loads((root / "tp2_run" / f"stage_times_rank_{rank}.json").read_text())
        assert times["compiled_graphs"] > 0 and times["graph_breaks"] == 0, times
    assert "graph break(s), the code after each runs eagerly" not in out  # no rank warned of one
    report = check_run(root / "tp2", root / "tp2_run", steps=3, workload=llama())
    assert report.ok, report.text()


def test_a_killed_compiled_rank_resumes_bit_exact(runs):
    root, _, out = runs
    assert "fault injection: kill before step 3" in out

    def losses(run):
        return [json.loads(line)["loss"] for line in (root / run / "metrics.jsonl").read_text().splitlines()]

    assert losses("killed") == losses("full")  # exact fp32 values, every step
    for rank in (0, 1):
        for part in (f"rank_{rank}", f"optim_rank_{rank}"):
            got = load_file(root / "killed" / "final" / f"{part}.safetensors")
            want = load_file(root / "full" / "final" / f"{part}.safetensors")
            assert sorted(got) == sorted(want)
            for name in want:
                assert torch.equal(got[name], want[name]), (part, name)


def test_compiled_stages_with_fp16_dp2_and_the_replica_check_pass_verify(runs):
    """A model we did not write (a Hugging Face Llama from its config), dropout on, fp16-mixed with
    its loss scale, two replicas compared every step: all outside the compiled forward, and held to
    the eager oracle within the fp16 policy's tolerances."""
    root, plans, _ = runs
    program = json.loads((root / "dp2_fp16_sdc" / "plan.json").read_text())["program"]
    assert program["compile_stages"] is True and program["sdc_every"] == 1 and plans["dp2_fp16_sdc"].dp == 2
    times = json.loads((root / "dp2_run" / "stage_times_rank_1.json").read_text())
    assert times["compiled_graphs"] > 0 and times["graph_breaks"] == 0, times
    report = check_run(root / "dp2_fp16_sdc", root / "dp2_run", steps=3, workload=llama())
    assert report.ok, report.text()
