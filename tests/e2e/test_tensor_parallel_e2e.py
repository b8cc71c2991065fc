"""Tensor parallelism in the generated program (Note [tensor-parallel stages] in
runtime/parallel/tensor_parallel.py), trained under torchrun (gloo) against the one-process oracle:
tp 2 (2 ranks), tp 2 x pp 2 (4 ranks, clipped) and tp 2 x dp 2 (4 ranks: the replicas' gradient
all-reduce and digests on each tensor index's pieces), with keyed attention dropout on sharded heads and with
GPT-2's tied embedding (a vocab-split tie across two stages), and checkpoints written at tp 2
resumed at tp 1 (and 2 stages) and the other way round (Note [tensor-parallel pieces]); tp 2
under bf16-mixed and fp16-mixed, and tp 2 x dp 2 with ZeRO-1 whose checkpoint resumes at tp 1 x
dp 4 (Note [sharded state with tensor parallelism]).

Every job joins the session's shared launches (tests/_shared_launch.py): the 2-rank jobs in the
2-worker launch, the 4-rank ones in the 4-worker launch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _programs import compile_to, tiny_gpt as builtin_gpt, tiny_llama as llama
from _shared_launch import Job, prepare
from partitioner.models.builtin import hf_gpt2
from partitioner.cli.verify import check_run, read_program_run, train_oracle
from runtime.resilience.checkpoint.load import read_shard
from runtime.resilience.checkpoint.manifest import read_manifest
from runtime.program.spec import load_program


def gpt2():
    return hf_gpt2(layers=2, width=32, heads=4, vocab=64, seq=8, batch=2, dropout=0.1)


@prepare
def _tp_programs(root: Path):
    """A new job joins the shared launch of its world size: one more Job(world, job(...)) below."""
    options = dict(global_batch=4, microbatches=2)
    plans = {
        "tp2": compile_to(root / "tp2", llama(), devices=2, num_stages=1, tensor_parallel=2, **options),
        "pp2": compile_to(root / "pp2", llama(), devices=2, num_stages=2, **options),  # tp 1
        # clipped hard (the norm is ~1): the global norm must count each shard once
        "tp2pp2": compile_to(root / "tp2pp2", llama(), devices=4, num_stages=2, tensor_parallel=2,
                             clip_grad_norm=0.05, **options),
        "gpt2": compile_to(root / "gpt2", gpt2(), devices=4, num_stages=2, tensor_parallel=2, **options),
        "gpt_tp2": compile_to(root / "gpt_tp2", builtin_gpt(), devices=2, num_stages=1, tensor_parallel=2,
                              **options),
        "tp2dp2": compile_to(root / "tp2dp2", llama(), devices=4, num_stages=1, dp=2, tensor_parallel=2,
                             global_batch=8, microbatches=2),
    }

    def job(name, steps, ckpt, run):
        return [str(root / name), "--steps", str(steps), "--checkpoint-dir", str(root / ckpt),
                "--run-dir", str(root / run)]

    plans.update(_mixed_and_sharded_plans(root, options))
    jobs = [Job(2, job("tp2", 2, "ck_a", "run_a")),        # tp 2, then resumed at tp 1 (run_c)
            Job(2, job("pp2", 2, "ck_b", "run_b")),        # tp 1, then resumed at tp 2 (run_d)
            Job(2, job("pp2", 4, "ck_a", "run_c")),
            Job(2, job("tp2", 4, "ck_b", "run_d")),
            Job(2, job("gpt_tp2", 3, "ck_h", "run_h")),
            Job(2, job("tp2", 2, "ck_mem", "run_mem") + ["--measure-memory", "--no-checkpoint"])]
    jobs += [Job(2, j) for j in _mixed_jobs(job)]
    jobs += [Job(4, job("tp2pp2", 3, "ck_e", "run_e")), Job(4, job("gpt2", 3, "ck_f", "run_f")),
             Job(4, job("tp2dp2", 3, "ck_g", "run_g")),
             # rank 1 (tensor index 1, replica 0) flips a bit of its vocab shard before step 2; a
             # hang would end at the collective timeout (60 s), a failed job
             Job(4, job("tp2dp2", 3, "ck_flip", "run_flip") + ["--checkpoint-every", "1", "--sdc-every", "1",
                                                              "--flip-bit", "1:2", "--collective-timeout", "60"])]
    jobs += [Job(4, j) for j in _sharded_jobs(job)]
    return (root, plans), jobs


@pytest.fixture(scope="module")
def runs(shared_launches):
    """Trained in the session's shared launches (Note [shared launches] in tests/_shared_launch.py)."""
    return shared_launches.result(_tp_programs)[0]


# --- tp with mixed precision and with ZeRO-1 (Notes [tensor parallelism under autocast] in
# runtime/parallel/tensor_parallel.py, [what tensor parallelism runs with] in partitioner/frontend/tp_support.py)

MIXED = ("bf16-mixed", "fp16-mixed")


def _mixed_and_sharded_plans(root, options):
    plans = {f"tp2_{p}": compile_to(root / f"tp2_{p}", llama(), devices=2, num_stages=1, tensor_parallel=2,
                                    precision=p, **options) for p in MIXED}
    sharded = dict(devices=4, num_stages=1, global_batch=8, microbatches=2, shard_optimizer="on", clip_grad_norm=0.05)
    plans["zero_tp2dp2"] = compile_to(root / "zero_tp2dp2", llama(), dp=2, tensor_parallel=2, **sharded)
    plans["zero_tp1dp4"] = compile_to(root / "zero_tp1dp4", llama(), dp=4, tensor_parallel=1, **sharded)
    return plans


def _mixed_jobs(job):
    """2 ranks: tp 2 under each mixed policy, 2 steps (fp16's second step overflows its first
    scale: skipped), no checkpoints."""
    return [job(f"tp2_{p}", 2, f"ck_{p}", f"run_{p}") + ["--no-checkpoint"] for p in MIXED]


def _sharded_jobs(job):
    """4 ranks: tp 2 x dp 2 with ZeRO-1 for 2 steps, then its checkpoint resumed at tp 1 x dp 4
    (sharded over other slices) for steps 2 and 3."""
    return [job("zero_tp2dp2", 2, "ck_zero", "run_zero"), job("zero_tp1dp4", 4, "ck_zero", "run_zero4")]


@pytest.mark.parametrize("precision", MIXED)
def test_tensor_parallel_trains_like_one_process_under_mixed_precision(runs, precision):
    """verify's verdict under the policy's tolerance (the oracle runs the same autocast), with
    keyed dropout; fp16 skips the steps the oracle skips (the overflow test sees every shard)."""
    root, plans = runs
    folder, run = root / f"tp2_{precision}", root / f"run_{precision}"
    report = check_run(folder, run, workload=llama())
    assert report.precision == precision and report.ok, report.text()
    if precision == "fp16-mixed":
        from runtime.execute.reference import train_reference_from_folder

        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        oracle_skipped: list[bool] = []
        train_reference_from_folder(str(folder), 2, skipped=oracle_skipped)
        assert [r["skipped"] for r in rows] == oracle_skipped and any(oracle_skipped)


def test_measure_memory_reports_a_peak_per_rank_of_a_tensor_parallel_program(runs):
    """--measure-memory on tp 2 (Note [a DTensor's bytes] in runtime/observe/memory.py): each rank counts
    its DTensors' local shards, writes its peak and trains as it does unmeasured."""
    root, plans = runs
    rows = [json.loads((root / "run_mem" / f"memory_rank_{r}.json").read_text()) for r in (0, 1)]
    for rank, row in enumerate(rows):
        assert row["rank"] == rank and row["method"] == "live tensor storages"
        assert 0 < row["static_bytes"] < row["measured_peak_bytes"] and row["predicted_peak_bytes"] > 0
    losses, _, _ = read_program_run(root / "run_mem")
    assert losses == read_program_run(root / "run_a")[0]  # the tp2 job's first 2 steps, unmeasured


def test_a_flipped_bit_on_a_tensor_parallel_rank_is_found_and_rolled_back_without_a_hang(runs):
    """--flip-bit on tp 2 x dp 2 (Note [a flip without a collective] in runtime/resilience/faults.py): rank 1
    flips its local piece of the vocab-split embedding (no collective on one rank: no hang); its
    replica group (ranks 1 and 3, tensor index 1) disagrees after the step, the job rolls back to
    the checkpoint of step 2 and ends bit for bit where the clean run (run_g) ends."""
    from safetensors.torch import load_file

    root, _ = runs
    finding, rollback = [json.loads(line) for line in (root / "run_flip" / "sdc.jsonl").read_text().splitlines()]
    assert finding["ranks"] == [1, 3] and finding["stages"] == [0] and finding["what"] == "parameters"
    assert finding["step"] == 3 and finding["last_agreed_step"] == 2
    assert rollback["rolled_back_to"] == 2 and rollback["detected_at"] == 3
    faults = [json.loads(line) for line in (root / "run_flip" / "faults.jsonl").read_text().splitlines()]
    assert faults == [{**faults[0], "rank": 1, "step": 2, "mode": "flip-bit model.embed_tokens.weight"}]
    assert read_program_run(root / "run_flip")[0] == read_program_run(root / "run_g")[0]
    for r in range(4):
        got = load_file(root / "run_flip" / "final" / f"rank_{r}.safetensors")
        want = load_file(root / "run_g" / "final" / f"rank_{r}.safetensors")
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), r


def test_the_stage_file_shows_what_is_split(runs):
    root, plans = runs
    text = (root / "tp2" / "stage_0.py").read_text()
    assert "#   model.layers.0.self_attn.q_proj.weight | column-parallel | 0 | [32, 32] -> [16, 32]" in text
    assert "#   model.layers.0.mlp.down_proj.weight | row-parallel | 1 | [32, 80] -> [32, 40]" in text
    assert '"model.embed_tokens.weight": 0,' in text and "tensor_parallel.vocab_embedding(" in text
    assert "model.norm.weight\": " not in text.split("TENSOR_PARALLEL = {")[1].split("}")[0]
    fused = (root / "gpt_tp2" / "stage_0.py").read_text()
    assert "#   blocks.0.attn.qkv.weight | column-parallel | 0 | [96, 32] -> [48, 32]" in fused
    assert "#   blocks.0.attn.proj.weight | row-parallel | 1 | [32, 32] -> [32, 16]" in fused
    program = load_program(str(root / "tp2pp2"))
    assert program.tensor_parallel == 2 and program.world_size == 4
    assert [(e.rank, e.stages, e.tp_index) for e in program.ranks] == [(0, (0,), 0), (1, (0,), 1),
                                                                       (2, (1,), 0), (3, (1,), 1)]


@pytest.mark.parametrize("name, run, workload", [("tp2", "run_a", llama), ("tp2pp2", "run_e", llama),
                                                 ("gpt2", "run_f", gpt2), ("tp2dp2", "run_g", llama),
                                                 ("gpt_tp2", "run_h", builtin_gpt)])
def test_tensor_parallel_trains_like_one_process(runs, name, run, workload):
    """verify's verdict: losses, every final parameter, the gradient norm, with keyed dropout
    (and clipping on tp2pp2)."""
    root, plans = runs
    report = check_run(root / name, root / run, workload=workload())
    assert report.oracle == "unpartitioned traced graph (keyed randomness)"
    assert report.ok, report.text()
    if name == "tp2pp2":
        from partitioner.cli.verify import read_grad_norms

        assert plans[name].training.clip_grad_norm == 0.05 < min(read_grad_norms(root / run))


def test_the_tied_embedding_is_split_and_summed_across_stages(runs):
    root, plans = runs
    tie = [t for t in plans["gpt2"].ties if t.param == "lm_head.weight"]
    assert tie and tie[0].stages == (0, 1) and tie[0].placement == "replicated"
    for k in (0, 1):
        assert '"lm_head.weight": 0,' in (root / "gpt2" / f"stage_{k}.py").read_text()


def test_a_checkpoint_stores_each_ranks_piece_with_its_place(runs):
    root, _ = runs
    manifest = read_manifest(str(root / "ck_a"), 2)
    shards = {e["rank"]: read_shard(str(root / "ck_a"), manifest, e) for e in manifest["shards"]}
    name = "model.layers.0.self_attn.q_proj.weight"
    for rank, (tensors, meta) in shards.items():
        assert tuple(tensors[f"param/{name}"].shape) == (16, 32)
        assert meta["tp_pieces"][name] == [0, 16 * rank, 16 * (rank + 1), 32]
        assert tuple(tensors[f"optim/{name}/exp_avg"].shape) == (16, 32)
    # a replicated parameter is written once, by tensor index 0
    assert "param/model.norm.weight" in shards[0][0] and "param/model.norm.weight" not in shards[1][0]


@pytest.mark.parametrize("name, run, written_by", [("pp2", "run_c", "tp2"), ("tp2", "run_d", "pp2")])
def test_a_checkpoint_resumes_at_another_tensor_parallel_degree(runs, name, run, written_by):
    """run_c: tp 1 x 2 stages resumes tp 2's step 2; run_d: tp 2 resumes tp 1 x 2 stages' step 2.
    Steps 2 and 3 and the final parameters match the oracle's four uninterrupted steps."""
    root, _ = runs
    folder = root / name
    losses, params, replica_diff = read_program_run(root / run)
    assert len(losses) == 2 and replica_diff == 0.0  # steps 2 and 3; tensor ranks hold one value
    ref_losses, ref_state, _ = train_oracle(folder, load_program(str(folder)), llama(), 4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[2:]), rtol=0, atol=1e-5)
    for param, tensor in params.items():
        torch.testing.assert_close(tensor, ref_state[param], rtol=0, atol=1e-4, msg=param)
    summary = json.loads((root / run / "summary.json").read_text())
    assert summary["first_step"] == 2


def test_tensor_parallel_with_sharded_optimizer_state_trains_like_one_process(runs):
    """tp 2 x dp 2 with ZeRO-1 (each tensor index's replicas shard their local pieces), clipped
    hard: the global norm counts each piece once."""
    root, plans = runs
    assert plans["zero_tp2dp2"].decisions.shard_optimizer is True and plans["zero_tp2dp2"].tensor_parallel == 2
    report = check_run(root / "zero_tp2dp2", root / "run_zero", workload=llama())
    assert report.ok, report.text()


def test_a_sharded_tensor_parallel_checkpoint_stores_both_layouts_and_resumes_at_tp_1(runs):
    """Note [sharded state with tensor parallelism] holds: each rank's AdamW piece of a split parameter
    is of its tensor-parallel shard, with both places; the run resumed at tp 1 x dp 4 matches the
    oracle's steps 2 and 3."""
    root, plans = runs
    manifest = read_manifest(str(root / "ck_zero"), 2)
    name = "model.layers.0.self_attn.q_proj.weight"  # [32, 32], rows split over the tensor group
    spans = {}
    for entry in manifest["shards"]:
        tensors, meta = read_shard(str(root / "ck_zero"), manifest, entry)
        span = (meta.get("optim_tp_pieces") or {}).get(name)
        if span is not None:
            start, end, dim, lo, hi, size, *shape = span
            assert (dim, size, shape) == (0, 32, [16, 32]) and (hi - lo) == 16
            assert tuple(tensors[f"optim_tp_shard/{name}/exp_avg"].shape) == (end - start,)
            spans.setdefault(lo, []).append((start, end))
    # both tensor-parallel pieces, each covered by its replicas' ZeRO ranges
    assert sorted(spans) == [0, 16]
    for ranges in spans.values():
        covered = 0
        for start, end in sorted(ranges):
            assert start == covered
            covered = end
        assert covered == 16 * 32
    folder = root / "zero_tp1dp4"
    losses, params, replica_diff = read_program_run(root / "run_zero4")
    assert len(losses) == 2 and replica_diff == 0.0
    ref_losses, ref_state, _ = train_oracle(folder, load_program(str(folder)), llama(), 4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[2:]), rtol=0, atol=1e-5)
    for param, tensor in params.items():
        torch.testing.assert_close(tensor, ref_state[param], rtol=0, atol=1e-4, msg=param)
