"""Single-process tests of runtime/: stage building, layout, schedule text, LR schedule, the
reference trainer, tie gradients, entry files and launch errors."""

from __future__ import annotations

import functools
import json
import os
import py_compile
import subprocess
import sys

import pytest
import torch

from _runtime_folders import (OPTIMIZER, child_env, gpt_folder, mlp_folder,  # noqa: F401
                              one_thread,
                              read_final, read_metrics)
from runtime.data.synthetic import causal_lm_loss, token_batch
from runtime.launch.rank import LaunchError, main
from runtime.launch.entry_files import launch_text, rank_role, role_text
from runtime.program.layout import Layout
from runtime.program.spec import Program, load_program
from runtime.execute.reference import train_reference, train_reference_from_folder
from runtime.execute.schedule import schedule_text, simulate
from runtime.execute.stage import StageFileError, build_stage
from runtime.parallel.grad_sync import Groups, sync_gradients
from runtime.execute.train import lr_factor


def test_build_stage_registers_original_names(tmp_path):
    model, _ = mlp_folder(str(tmp_path), splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)])
    stage = build_stage(str(tmp_path), 1, "cpu")
    want = {n: p for n, p in model.named_parameters() if n.startswith(("layers.2", "layers.3"))}
    got = dict(stage.named_parameters())
    assert sorted(got) == sorted(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)
    x = torch.randn(4, 32)
    torch.testing.assert_close(stage(x), model.layers[3](torch.tanh(model.layers[2](x))))


def test_build_stage_errors(tmp_path):
    mlp_folder(str(tmp_path), splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)])
    src = open(tmp_path / "stage_1.py").read()
    (tmp_path / "stage_1.py").write_text(src.replace("class Stage1", "class Other"))
    with pytest.raises(StageFileError, match="no class Stage1"):
        build_stage(str(tmp_path), 1)
    os.remove(tmp_path / "weights" / "stage_0.safetensors")
    # a missing weights file is only fine for a program compiled on the meta device (init recipes)
    with pytest.raises(StageFileError, match="stage_0.safetensors is missing and the program has no init"):
        build_stage(str(tmp_path), 0)


def _program(tmp_path, **kw):
    mlp_folder(str(tmp_path), **kw)
    return load_program(str(tmp_path))


def test_layout_groups(tmp_path):
    prog = _program(tmp_path, splits=[[0], [1], [2], [3]], dp=2, num_microbatches=2,
                    ranks=[([0, 2], 0), ([1, 3], 0), ([0, 2], 1), ([1, 3], 1)], schedule="interleaved")
    data = prog.to_dict()  # a parameter "w" with copies on stages 0 and 3
    data["ties"] = [{"param": "w", "stages": [0, 3]}]
    for k in (0, 3):
        data["stages"][k]["params"].append("w")
    lay = Layout.from_program(Program.from_dict(data))
    assert lay.pipelines == ((0, 1), (2, 3))
    assert lay.dp_groups == ((0, 2), (1, 3))
    assert lay.tie_groups == (((0, 1), (2, 3)),)
    assert lay.stage_rank(3, 1) == 3


def test_layout_and_batch_errors(tmp_path):
    prog = _program(tmp_path, splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)])
    bad = prog.to_dict()
    bad["ranks"] = [{"rank": 0, "stages": [1], "replica": 0}, {"rank": 1, "stages": [0], "replica": 0}]
    with pytest.raises(ValueError, match="give it stages"):
        Program.from_dict(bad)
    with pytest.raises(ValueError, match="not divisible"):
        Program.from_dict(dict(prog.to_dict(), global_batch=18))
    with pytest.raises(ValueError, match="microbatch"):
        Program.from_dict(dict(prog.to_dict(), global_batch=32))
    with pytest.raises(ValueError, match=r"unknown keys \['num_microbatch'\]"):
        Program.from_dict(dict(prog.to_dict(), num_microbatch=4))
    with pytest.raises(ValueError, match=r"stages\[1\] lacks \['outputs'\]"):
        d = prog.to_dict()
        del d["stages"][1]["outputs"]
        Program.from_dict(d)


@pytest.mark.parametrize("name,pp,stages", [("gpipe", 2, 2), ("1f1b", 4, 4), ("interleaved", 2, 4)])
def test_schedule_simulation_runs_every_action_once(name, pp, stages):
    m = 4
    timeline = simulate(name, pp, stages, m)
    acts = [a for row in timeline for a in row if a is not None]
    assert sorted(acts) == sorted((k, s, i) for k in "FB" for s in range(stages) for i in range(m))


def test_schedule_text(tmp_path):
    prog = _program(tmp_path, splits=[[0, 1], [2, 3]], dp=2, num_microbatches=4,
                    ranks=[([0], 0), ([1], 0), ([0], 1), ([1], 1)])
    text = schedule_text(prog)
    assert "rank 0,2  F0 F1 .  B0 F2 B1 F3 B2 .  B3" in text
    assert "rank 1,3  .  F0 B0 F1 B1 F2 B2 F3 B3" in text


def test_lr_factor():
    cfg = dict(OPTIMIZER, warmup_steps=2, total_steps=12)
    assert [lr_factor(s, cfg) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_factor(7, cfg) == pytest.approx(0.5)
    assert lr_factor(12, cfg) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(5, dict(cfg, lr_schedule="constant")) == 1.0


def test_reference_on_stage_chain_equals_unpartitioned_model(tmp_path):
    """The stage files + tie of a GPT split equal the original (tied) model, step for step."""
    model, _ = gpt_folder(str(tmp_path), splits=[[0], [1]], ranks=[([0], 0), ([1], 0)])
    make_batch = functools.partial(token_batch, vocab=64, seq=8, seed=0)
    want = train_reference(model, make_batch, causal_lm_loss, OPTIMIZER, 4, 2, 3, 0)
    got = train_reference_from_folder(str(tmp_path), 3)
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for name, value in got[1].items():
        torch.testing.assert_close(value, want[1][name], rtol=1e-5, atol=1e-6)
    assert abs(want[0][0] - want[0][-1]) > 1e-3  # it trained


def test_tie_gradients_sum_local_copies(tmp_path):
    """Two stages on one rank holding copies of one parameter: both get the summed gradient."""
    gpt_folder(str(tmp_path), splits=[[0], [1]], ranks=[([0], 0), ([1], 0)])
    prog = load_program(str(tmp_path))
    s0, s1 = build_stage(str(tmp_path), 0), build_stage(str(tmp_path), 1)
    tokens = torch.randint(0, 64, (2, 8))
    causal_lm_loss(s1(s0(tokens)), tokens).backward()
    g0, g1 = s0.tok_emb.weight.grad.clone(), s1.tok_emb.weight.grad.clone()
    sync_gradients([s0, s1], prog, Groups(pipeline=None, data_parallel=None, ties=[None]))
    torch.testing.assert_close(s0.tok_emb.weight.grad, g0 + g1)
    torch.testing.assert_close(s1.tok_emb.weight.grad, g0 + g1)


def test_entry_files_compile(tmp_path):
    mlp_folder(str(tmp_path), splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)])
    for name in ("train.py", "stage_0.py", "stage_1.py"):
        py_compile.compile(str(tmp_path / name), doraise=True)


def test_a_folder_holds_no_file_per_rank(tmp_path):
    """Issue 48: per-stage code, plan.json and one train.py, whatever the world size (Note [roles
    from the plan] in runtime/launch/entry_files.py)."""
    mlp_folder(str(tmp_path), splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([0], 1), ([1], 0), ([1], 1)], dp=2,
               num_microbatches=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "stage_0.py", "stage_1.py", "train.py",
                                                          "weights"]


def test_a_ranks_role_names_its_stages_and_peers(tmp_path):
    _, program = mlp_folder(str(tmp_path), splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([0], 1), ([1], 0), ([1], 1)],
                            dp=2, num_microbatches=2)
    role = rank_role(program, 2)
    assert role["stages"] == [1] and role["replica"] == 0
    assert role["pipeline_ranks"] == [0, 2] and role["data_parallel_ranks"] == [2, 3]
    text = role_text(program, 2)
    assert text.startswith("rank 2 of 4: stage(s) [1] of 2, data-parallel replica 0 of 2;")
    assert "pipeline peers [0, 2]:" in text and "data-parallel peers [2, 3]:" in text
    with pytest.raises(ValueError, match=r"--rank 4: the program has ranks 0..3"):
        rank_role(program, 4)


def test_a_ranks_role_states_the_schedule_of_its_stages(tmp_path):
    _, program = mlp_folder(str(tmp_path), splits=[[0], [1], [2], [3]], num_microbatches=2, global_batch=8,
                            ranks=[([0, 2], 0), ([1, 3], 0)], schedule="interleaved")
    role = rank_role(program, 1)
    assert role["stages"] == [1, 3] and role["pipeline_ranks"] == [0, 1, 0, 1]
    assert role["num_microbatches"] == 2 and role["microbatch_size"] == 4
    assert sorted(map(tuple, role["actions"])) == sorted((k, s, i) for k in "FB" for s in (1, 3) for i in range(2))
    assert role["launch"] == launch_text(2) and "torchrun --nproc-per-node 2 " in role["launch"]


def test_a_folder_of_the_old_shape_is_refused_naming_the_fix(tmp_path, monkeypatch, capsys):
    """A folder with rank_<r>.py files (an older compiler's, whose train.py runs them), even sealed
    into plan.json's file map, is refused with the fix, before anything runs; `partitioner run`
    refuses it too, in one line."""
    from runtime.program.spec import seal_folder
    from partitioner.cli import main as cli_main

    mlp_folder(str(tmp_path), splits=[[0, 1, 2, 3]], ranks=[([0], 0)], steps=1)
    (tmp_path / "rank_0.py").write_text("import runtime.launch.rank\nruntime.launch.rank.main('.', rank=0)\n")
    seal_folder(str(tmp_path))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "x")  # registers the key for restoration
        monkeypatch.delenv(key)
    with pytest.raises(LaunchError, match=r"older partitioner \(1 per-rank file\(s\) such as rank_0.py\).*recompile"):
        main(str(tmp_path), exit_on_error=False, argv=[])
    assert not (tmp_path / "run").exists()
    assert cli_main(["run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "older partitioner" in err and "recompile" in err and "Traceback" not in err


def test_train_py_without_rank_exits_naming_torchrun(tmp_path):
    """Started by hand, train.py must not guess rank 0 and wait for peers that never come."""
    mlp_folder(str(tmp_path), splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)])
    env = {k: v for k, v in child_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(tmp_path / "train.py")], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert "RANK is not set" in proc.stderr and "torchrun --nproc-per-node 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_wrong_world_size_is_a_clear_error(tmp_path, monkeypatch):
    mlp_folder(str(tmp_path), splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)])
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(LaunchError, match=r"world_size=2 but WORLD_SIZE=3.*torchrun --nproc-per-node 2"):
        main(str(tmp_path), rank=0, exit_on_error=False, argv=[])
    # the generated entry point exits non-zero with that one line, no traceback
    proc = subprocess.run([sys.executable, str(tmp_path / "train.py")], capture_output=True, text=True,
                          env=dict(child_env(), WORLD_SIZE="1", RANK="0"), timeout=60)
    assert proc.returncode == 1
    assert "world_size=2 but WORLD_SIZE=1" in proc.stderr and "Traceback" not in proc.stderr
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(LaunchError, match="needs 2 processes"):
        main(str(tmp_path), rank=0, exit_on_error=False, argv=[])


def test_one_rank_program_runs_in_process(tmp_path, monkeypatch):
    """A one-rank, one-stage program runs as plain `python train.py` (no torchrun needed)."""
    model, _ = mlp_folder(str(tmp_path), splits=[[0, 1, 2, 3]], ranks=[([0], 0)], steps=2)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv(key, "x")  # registers the key for restoration
        monkeypatch.delenv(key)
    losses = main(str(tmp_path), exit_on_error=False, argv=[])
    from runtime.data.synthetic import mse_loss, regression_batch
    want, state, _ = train_reference(model, functools.partial(regression_batch, features=8, outputs=4),
                                     mse_loss, OPTIMIZER, 16, 4, 2, 0)
    assert losses == pytest.approx(want, rel=1e-6)
    assert [m["loss"] for m in read_metrics(str(tmp_path))] == losses
    for name, value in read_final(str(tmp_path), 0).items():
        torch.testing.assert_close(value, state[name], rtol=1e-5, atol=1e-6)


def test_bucketed_allreduce_copies_back_every_tensor(tmp_path):
    """World of one (file rendezvous): the sum is the identity, so this checks bucketing."""
    import torch.distributed as dist

    from runtime.parallel.grad_sync import allreduce_flat_

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        tensors = [torch.randn(5, 3), torch.randn(7), torch.arange(4.0, dtype=torch.float64), torch.randn(2, 2)]
        want = [t.clone() for t in tensors]
        allreduce_flat_(tensors, None, divide_by=2, bucket_elems=10)
        for t, w in zip(tensors, want):
            torch.testing.assert_close(t, w / 2)
    finally:
        dist.destroy_process_group()


def test_a_stage_calling_an_aten_op_this_torch_lacks_is_one_line_at_build(tmp_path):
    """A folder compiled by a newer torch than the cluster's (Note [aten ops this torch has] in
    runtime/execute/stage.py)."""
    from runtime.execute.stage import missing_aten_ops

    mlp_folder(str(tmp_path), splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)])
    assert missing_aten_ops(open(tmp_path / "stage_0.py").read()) == []
    src = open(tmp_path / "stage_1.py").read()
    (tmp_path / "stage_1.py").write_text(src + "\n# a later torch's op\n"
                                         "_LATER = 'torch.ops.aten.op_of_a_later_torch.default'\n")
    with pytest.raises(StageFileError, match=r"stage_1.py calls aten.op_of_a_later_torch.default, which torch "
                                             r"\S+ does not have: install the torch"):
        build_stage(str(tmp_path), 1)
    assert missing_aten_ops("torch.ops.aten.mm.not_an_overload(a, b)") == ["aten.mm.not_an_overload"]
