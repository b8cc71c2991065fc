"""Compiled plans, run as generated programs under torchrun (gloo), against one-process training.

The oracle is always the unpartitioned model trained in this process with the same data, loss,
optimizer and microbatch split (runtime.execute.reference.train_reference).
"""

from __future__ import annotations

import functools
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import partitioner
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt, hf_bert, hf_gpt2, hf_llama, hf_qwen2_moe
from _programs import STEPS, compile_to
from _shared_launch import Job, prepare
from partitioner.cli.verify import read_program_run
from partitioner.frontend.workload import Workload
from runtime.data import synthetic as data
from runtime.program.spec import Program
from runtime.execute.reference import train_reference
from runtime.launch.torchrun import run_env, torchrun_command



class LongSkip(nn.Module):
    """A tensor made first is read last: under 3 stages it crosses two boundaries."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        h0 = self.inp(x)
        h = h0
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return self.out(h + h0)


def long_skip_workload() -> Workload:
    torch.manual_seed(0)
    return Workload(
        model=LongSkip(), example_args=(torch.zeros(2, 8),), loss_fn=data.mse_loss,
        make_batch=functools.partial(data.regression_batch, features=8, outputs=4, seed=0),
        name="long-skip",
        source={"make_batch": ("runtime.data.synthetic:regression_batch", {"features": 8, "outputs": 4, "seed": 0}),
                "loss_fn": ("runtime.data.synthetic:mse_loss", {})},
    )


def hf_tiny(builder):
    return builder(layers=2, width=32, heads=2, vocab=64, seq=16)


def hf_tiny_moe():
    """Qwen2-MoE, 4 experts, top-2: its experts run through transformers' own custom op."""
    return hf_qwen2_moe(layers=2, width=32, heads=2, vocab=64, seq=16, experts=4, top_k=2)


def tiny_gpt():
    return gpt(layers=4, width=32, heads=2, vocab=64, seq=16)


def assert_matches_oracle(folder: Path, workload, steps: int = STEPS):
    plan = partitioner.solver.plan.Plan.load(folder)
    program = Program.from_dict(json.loads((folder / "plan.json").read_text())["program"])
    losses, params, replica_diff = read_program_run(folder / "run")
    ref_losses, ref_state, _ = train_reference(
        workload.model, workload.make_batch, workload.loss_fn, program.optimizer, plan.global_batch,
        plan.dp * plan.num_microbatches, steps, program.seed)
    assert len(losses) == steps
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    assert replica_diff == 0.0, "data-parallel replicas of a parameter diverged"
    assert set(params) <= set(ref_state)
    for name, tensor in params.items():
        # atol 1e-4: see verify.PARAM_TOLERANCE (parameters with a zero true gradient drift by noise).
        torch.testing.assert_close(tensor, ref_state[name], rtol=1e-4, atol=1e-4, msg=name)
    return plan


@prepare
def _programs(root: Path):
    made = {
        "gpt_2stage": compile_to(root / "gpt_2stage", tiny_gpt(), devices=2, num_stages=2, microbatches=4),
        "hf_gpt2_2stage": compile_to(root / "hf_gpt2_2stage", hf_gpt2(layers=2, width=32, heads=2, vocab=64, seq=16),
                                     devices=2, num_stages=2, microbatches=4),
        "hf_llama_2stage": compile_to(root / "hf_llama_2stage", hf_tiny(hf_llama), devices=2, num_stages=2,
                                      microbatches=4),
        "hf_bert_2stage": compile_to(root / "hf_bert_2stage", hf_tiny(hf_bert), devices=2, num_stages=2,
                                     microbatches=4, granularity="op", flops_per_s=1e9),
        "gpt_2x2": compile_to(root / "gpt_2x2", tiny_gpt(), devices=4, num_stages=2, dp=2, microbatches=2),
        "moe_2stage": compile_to(root / "moe_2stage", hf_tiny_moe(), devices=2, num_stages=2, microbatches=2),
        "skip_3stage": compile_to(root / "skip_3stage", long_skip_workload(), devices=3, num_stages=3,
                                  microbatches=4, granularity="node", flops_per_s=1e9),
    }
    # the compiled folder as the compiler left it, for the tests that compile it again or edit it
    shutil.copytree(root / "gpt_2stage", root / "gpt_2stage_as_compiled")
    steps = ["--steps", str(STEPS)]
    jobs = [Job(2, [root / name, *steps]) for name in ("gpt_2stage", "hf_gpt2_2stage", "hf_llama_2stage",
                                                       "hf_bert_2stage", "moe_2stage")]
    jobs += [Job(4, [root / "gpt_2x2", *steps]), Job(3, [root / "skip_3stage", *steps])]
    return (root, made), jobs


@pytest.fixture(scope="module")
def folders(shared_launches):
    """Every folder trained in the session's shared launches (Note [shared launches])."""
    (root, made), outputs = shared_launches.result(_programs)
    return root, {**made, "stdout": "".join(out.stdout for out in outputs)}


def _as_compiled(folders, to: Path) -> Path:
    """A fresh copy of tiny_gpt() compiled to 2 stages x 4 microbatches (as compile_to makes it)."""
    root, _ = folders
    shutil.copytree(root / "gpt_2stage_as_compiled", to)
    return to


def test_every_run_ends_with_predicted_and_measured_step_time(folders):
    """Note [step time summary] in runtime/execute/train.py: the plan's figure reaches the program and the
    run prints and records it beside the median it measured (values never asserted: wall clock)."""
    root, made = folders
    for name in ("gpt_2stage", "gpt_2x2"):
        predicted = made[name].predicted["step_time_s"]
        summary = json.loads((root / name / "run" / "summary.json").read_text())
        times = [json.loads(line)["step_time_s"] for line in (root / name / "run" / "metrics.jsonl").open()]
        assert summary["predicted_step_time_s"] == predicted > 0
        assert summary["measured_step_time_s"] == pytest.approx(statistics.median(times[1:]))
        assert f"predicted {predicted:.4g} s/step, measured {summary['measured_step_time_s']:.4g} s/step" \
            in made["stdout"]


def test_two_stage_gpt_trains_like_one_process(folders):
    root, _ = folders
    assert_matches_oracle(root / "gpt_2stage", tiny_gpt())


def test_two_by_two_gpt_trains_like_one_process(folders):
    root, made = folders
    plan = made["gpt_2x2"]
    assert (plan.num_stages, plan.dp, plan.world_size) == (2, 2, 4)
    assert_matches_oracle(root / "gpt_2x2", tiny_gpt())


def test_hf_gpt2_with_tied_embeddings_trains_like_one_process(folders):
    root, made = folders
    plan = made["hf_gpt2_2stage"]
    tie = [t for t in plan.ties if t.param in ("transformer.wte.weight", "lm_head.weight")]
    assert tie, "GPT-2's embedding and head share one parameter: the plan must report the tie"
    assert tie[0].placement == "replicated" and tie[0].stages == (0, 1)
    assert_matches_oracle(root / "hf_gpt2_2stage", hf_gpt2(layers=2, width=32, heads=2, vocab=64, seq=16))


@pytest.mark.parametrize("name, builder", [("hf_llama_2stage", hf_llama), ("hf_bert_2stage", hf_bert)])
def test_hf_llama_and_bert_train_like_one_process(folders, name, builder):
    """Llama sends batch-independent rotary tables between stages, BERT an expanded mask (a view)."""
    root, _ = folders
    assert_matches_oracle(root / name, hf_tiny(builder))


def test_mixture_of_experts_stage_files_import_their_custom_op_and_train_like_one_process(folders):
    """Note [custom ops travel] holds: the stage files call torch.ops.transformers.*, which exists only
    once transformers' MoE module has run; a torchrun worker imports nothing else."""
    root, _ = folders
    for k in (0, 1):
        text = (root / "moe_2stage" / f"stage_{k}.py").read_text()
        if "torch.ops.transformers." in text:
            assert "\nimport transformers.integrations.moe" in text, text[:800]
    assert any("torch.ops.transformers." in (root / "moe_2stage" / f"stage_{k}.py").read_text() for k in (0, 1))
    assert_matches_oracle(root / "moe_2stage", hf_tiny_moe())


def test_op_granularity_cut_inside_attention_trains(folders):
    """At "op" granularity the solver may cut between two projections of one attention (BERT's
    query on stage 0, key onward on stage 1): the query, the mask and the residual all cross."""
    _, made = folders
    plan = made["hf_bert_2stage"]
    last0, first1 = plan.stages[0].region_names[-1], plan.stages[1].region_names[0]
    assert last0.rsplit(".", 1)[0] == first1.rsplit(".", 1)[0], (last0, first1)  # one sublayer, two stages


def test_skip_connection_across_two_boundaries_trains(folders):
    root, made = folders
    plan = made["skip_3stage"]
    assert any(len(edge.boundaries) == 2 for edge in plan.cut_edges), plan.cut_edges
    stage1 = (root / "skip_3stage" / "stage_1.py").read_text()
    assert "INPUTS" in stage1
    assert_matches_oracle(root / "skip_3stage", long_skip_workload())


def test_two_compiles_give_byte_identical_folders(folders, tmp_path):
    _as_compiled(folders, tmp_path / "a")  # the shared launch's compile; this test's own is "b"
    compile_to(tmp_path / "b", tiny_gpt(), devices=2, num_stages=2, microbatches=4)
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert files_a == files_b
    # compile_stats.json holds the solver's wall-clock time (Note [plans are deterministic]).
    differing = [str(f) for f in files_a if (tmp_path / "a" / f).read_bytes() != (tmp_path / "b" / f).read_bytes()]
    assert differing in ([], ["compile_stats.json"])
    for f in files_a:
        if f.suffix == ".py":
            text = (tmp_path / "a" / f).read_text()
            compile(text, str(f), "exec")
            imports = {line.split()[1].split(".")[0] for line in text.splitlines()
                       if line.startswith(("import ", "from "))}
            assert imports <= {"torch", "runtime"} | set(sys.stdlib_module_names), (f, imports)


def test_edited_folder_is_refused(folders, tmp_path):
    from partitioner.errors import PlanMismatchError
    from runtime.program.spec import load_program

    folder = _as_compiled(folders, tmp_path / "prog")
    stage = folder / "stage_1.py"
    stage.write_text(stage.read_text().replace("F.gelu(", "F.relu(", 1))
    with pytest.raises(PlanMismatchError, match="stage_1.py"):
        load_program(str(folder))
    done = subprocess.run([sys.executable, "-m", "partitioner.cli", "run", str(folder), "--steps", "1"],
                          capture_output=True, text=True, timeout=120, env=run_env())
    assert done.returncode != 0
    assert "stage_1.py (changed)" in done.stdout + done.stderr


def test_wrong_world_size_is_a_clear_error(folders, tmp_path):
    folder = _as_compiled(folders, tmp_path / "prog")
    command = torchrun_command(folder / "train.py", 1, args=["--steps", "1"])
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=run_env())
    assert done.returncode != 0
    assert "world_size=2 but WORLD_SIZE=1" in done.stdout + done.stderr
