"""What tensor parallelism runs with, compile and run side (Note [what tensor parallelism runs with]
in partitioner/frontend/tp_support.py): ZeRO-1 with tp is a plan the solver weighs and prices
(optimizer state / (tp x dp) per member), and the in-memory checkpoint tier is refused at compile
time and at run time (``partitioner run`` before torchrun, and every worker), naming the fix.
The runs themselves are in tests/e2e/test_tensor_parallel_e2e.py."""

from __future__ import annotations

import dataclasses

import pytest

import partitioner
from partitioner.cli import main
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt, hf_llama
from partitioner.solver.space import SearchSpace, Variant


def _llama():
    return hf_llama(layers=1, width=32, heads=4, vocab=64, seq=8, batch=2)


def _compile(cluster, **options):
    return partitioner.compile(_llama(), cluster=cluster, global_batch=8, num_stages=1, microbatches=2, **options)


def test_sharded_state_with_tp_is_priced_per_member_and_chosen_where_only_it_fits():
    cluster = ClusterSpec.homogeneous(4, "cpu")
    off = _compile(cluster, dp=2, tensor_parallel=2, shard_optimizer="off").plan
    on = _compile(cluster, dp=2, tensor_parallel=2, shard_optimizer="on").plan
    assert on.decisions.shard_optimizer is True and on.tensor_parallel == 2
    # each member: the AdamW state of its local tensors (1/tp of the split ones), then / dp
    assert on.stages[0].memory.optimizer_bytes == pytest.approx(off.stages[0].memory.optimizer_bytes / 2, abs=8)
    peak_on, peak_off = on.stages[0].memory.total_bytes, off.stages[0].memory.total_bytes
    assert peak_on < peak_off
    # devices between the two peaks: "auto" must find the sharded tp 2 x dp 2 plan
    d = cluster.devices[0]
    room = d.memory_reserve_bytes + (peak_on + peak_off) // 2
    small = dataclasses.replace(cluster, devices=tuple(dataclasses.replace(x, memory_bytes=room)
                                                      for x in cluster.devices))
    auto = _compile(small, dp=2, tensor_parallel=2, shard_optimizer="auto").plan
    # (on gloo sharding costs an all-gather more: "auto" shards only where the replicated state does not fit)
    assert auto.decisions.shard_optimizer is True and auto.tensor_parallel == 2 and auto.dp == 2


def test_the_search_space_weighs_sharded_candidates_with_tp():
    """compile() now passes tp_shard=True (Note [one enumeration])."""
    from partitioner.solver.problem import PartitionProblem, RegionCost, TensorParallelCost

    mib = 1 << 20
    problem = PartitionProblem((RegionCost("b", 1e9, 2e9, mib, mib, 2 * mib, 1024, 1024,
                                           tp=TensorParallelCost(sharded_param_bytes=mib)),), ())
    space = SearchSpace(problem, ClusterSpec.homogeneous(4, "cpu"), tp_degrees=(1, 2), shard="auto", tp_shard=True)
    assert Variant(2, True) in space.variants(2) and Variant(2, False) in space.variants(2)
    assert "unsharded" not in space.scope_words()


def test_a_memory_tier_with_tp_is_refused_at_compile_time_even_without_redundancy():
    """"none" is a memory tier without a peer copy, not "off": it was let through before."""
    for tier in ("none", {"mode": "copy"}):
        with pytest.raises(ValueError, match="in-memory checkpoint tier.*leave --memory-tier out"):
            partitioner.compile(gpt(layers=1, width=16, heads=2, vocab=32, seq=8),
                                cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=4, tensor_parallel=2,
                                training={"memory_tier": tier})


@pytest.fixture(scope="module")
def tp_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_settings") / "tp2"
    partitioner.compile(_llama(), cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=4, num_stages=1,
                        microbatches=2, tensor_parallel=2).save(out)
    return out


def test_run_refuses_the_memory_tier_on_a_tp_folder_before_torchrun(capsys, tp_folder, monkeypatch):
    import partitioner.cli.run as run_command

    def no_torchrun(*_a, **_k):
        raise AssertionError("torchrun started")

    monkeypatch.setattr(run_command, "run_tree", no_torchrun)
    code = main(["run", str(tp_folder), "--steps", "1", "--memory-tier", "copy"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--memory-tier copy" in err[0] and "tensor_parallel=2" in err[0] and "--memory-tier off" in err[0]


def test_a_worker_refuses_the_memory_tier_on_a_tp_program(tp_folder, monkeypatch):
    """train.py run by hand (no `partitioner run`): the worker's own check, before any process group."""
    from runtime.launch.rank import LaunchError
    from runtime.launch.rank import main as launch_main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(LaunchError, match="in-memory checkpoint tier does not run with tensor parallelism"):
        launch_main(str(tp_folder), rank=0, exit_on_error=False,
                    argv=["--steps", "1", "--memory-tier", "none", "--checkpoint-dir", str(tp_folder / "ck")])


def _zero_tp_shard(rank, name, start, end, lo, hi, values):
    """A shard's (tensors, meta) holding one ZeRO piece [start, end) of the tensor-parallel piece
    rows [lo, hi) of a [4, 2] parameter split on dim 0."""
    import torch

    piece = torch.tensor(values, dtype=torch.float32)
    return ({f"optim_tp_shard/{name}/exp_avg": piece, f"optim_tp_shard/{name}/exp_avg_sq": piece * 10},
            {"optim_tp_pieces": {name: [start, end, 0, lo, hi, 4, hi - lo, 2]}, "param_steps": {name: 3.0}})


def test_sharded_tp_state_is_stitched_whole_and_a_missing_piece_is_refused():
    """Note [sharded state with tensor parallelism] holds: two tensor pieces (rows 0-1, 2-3) of a [4, 2]
    parameter, each split over two replicas' ZeRO ranges, come back as the whole state; without
    one replica's shard the reader refuses the checkpoint instead of restoring a hole."""
    import torch

    from runtime.resilience.checkpoint.state import LoadedCheckpoint
    from runtime.resilience.checkpoint.tp_pieces import stitch_sharded_tp_state
    from runtime.errors import CheckpointCorruptError

    name = "w"
    shards = {0: _zero_tp_shard(0, name, 0, 3, 0, 2, [0, 1, 2]), 2: _zero_tp_shard(2, name, 3, 4, 0, 2, [3]),
              1: _zero_tp_shard(1, name, 0, 3, 2, 4, [4, 5, 6]), 3: _zero_tp_shard(3, name, 3, 4, 2, 4, [7])}
    manifest = {"shards": [{"rank": r, "stages": [0], "params": [name] if r < 2 else []} for r in range(4)]}

    def loaded():
        return LoadedCheckpoint(2, manifest, {}, {}, {}, {}, None, None)

    ck = loaded()
    read = {0: shards[0]}
    stitch_sharded_tp_state(ck, [name], read, manifest, lambda e: shards[e["rank"]], 2)
    assert sorted(read) == [0, 1, 2, 3]  # every shard of the stage read for its pieces
    torch.testing.assert_close(ck.optim[name]["exp_avg"], torch.arange(8, dtype=torch.float32).reshape(4, 2))
    torch.testing.assert_close(ck.optim[name]["exp_avg_sq"], 10 * torch.arange(8, dtype=torch.float32).reshape(4, 2))
    assert ck.param_steps[name] == 3.0
    lost = {r: s for r, s in shards.items() if r != 3}
    manifest["shards"] = [e for e in manifest["shards"] if e["rank"] != 3]
    with pytest.raises(CheckpointCorruptError, match="'w'"):
        stitch_sharded_tp_state(loaded(), [name], {0: lost[0]}, manifest, lambda e: lost[e["rank"]], 2)
