"""Sequence parallelism's price against a hand count of a Megatron-shaped block (the built-in GPT,
as tests/unit/test_tp_hand_count.py counts it without), what the generated stage sends, counted
on torch's fake process group (tests/unit/test_tp_traffic.py's child), and the compiler's choice
(Note [sequence parallelism as a decision] in partitioner/solver/sequence_parallel.py).

Per rank at degree t, per sample, fp32: without it a member holds the block's whole activations
(both norms' inputs and outputs, 4 s h, and their mean and rstd, 4 s) and 1/t of the split ones;
with it the norms' inputs and statistics are a 1/t slice, their outputs (the column linears'
gathered inputs, saved whole) are not: 4 (2 s h + 4 s) / t + 4 (2 s h) + split / t. Collectives:
the two row all-reduces (2 (t-1)/t of s h each) become reduce-scatters ((t-1)/t) and the two
column inputs are all-gathered ((t-1)/t): forward sends 2 (t-1)/t 2 s h either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import partitioner
from partitioner import analyze
from partitioner.calibrate.priced_problem import build_problem
from partitioner.config.cluster import ClusterSpec
from partitioner.inspect import inspect_json, table
from partitioner.models.builtin import gpt, hf_llama
from partitioner.solver.sequence_parallel import sent_bytes, sp_priced_problem
from partitioner.solver.tensor_groups import tp_priced_problem

H, S, A, V = 64, 16, 4, 128
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def problem():
    gm, _ = analyze(gpt(layers=1, width=H, heads=A, vocab=V, seq=S, batch=2))
    return build_problem(gm, 2)


def _block(problem):
    return next(r for r in problem.regions if r.name == "block.0")


@pytest.mark.parametrize("tp", [2, 4])
def test_block_activations_per_rank_shrink_where_sliced(problem, tp):
    cluster = ClusterSpec.homogeneous(tp, "h100")
    tp_priced = tp_priced_problem(problem, cluster, tp)
    block = _block(sp_priced_problem(tp_priced, cluster, tp))
    split = 4 * (12 * S * H + A * S)
    per_rank = 4 * (2 * S * H + 4 * S) / tp + 4 * 2 * S * H + split / tp
    assert block.activation_bytes_per_sample / tp == pytest.approx(per_rank, abs=1)
    assert block.activation_bytes_per_sample < _block(tp_priced).activation_bytes_per_sample


@pytest.mark.parametrize("tp", [2, 4])
def test_block_collectives_send_the_same_bytes_split_in_two(problem, tp):
    block = _block(problem)
    assert block.tp.comm_bytes == block.tp.comm_bwd_bytes == 4 * 2 * S * H  # two rows, two column inputs
    step = (tp - 1) / tp
    assert sent_bytes(block, tp, False) == pytest.approx((2 * step * 8 * S * H, 2 * step * 8 * S * H))
    assert sent_bytes(block, tp, True) == pytest.approx((step * 16 * S * H, step * 16 * S * H))
    # on an accelerator (no fixed cost per call) the time is the same; on cpu each extra call costs gloo's
    for kind, same in (("h100", True), ("cpu", False)):
        cluster = ClusterSpec.homogeneous(tp, kind)
        tp_priced = tp_priced_problem(problem, cluster, tp)
        before, after = _block(tp_priced), _block(sp_priced_problem(tp_priced, cluster, tp))
        assert (after.fwd_s_per_microbatch_by_kind == before.fwd_s_per_microbatch_by_kind) is same
        assert after.fwd_s_per_sample_by_kind[kind] == pytest.approx(before.fwd_s_per_sample_by_kind[kind])


def _compile(kind, sp, tp=2, **options):
    # no dropout: the fake group's child runs a stage outside the trainer's randomness context
    return partitioner.compile(hf_llama(layers=2, width=32, heads=4, vocab=64, seq=8, batch=2),
                               cluster=ClusterSpec.homogeneous(2, kind), global_batch=2, num_stages=1,
                               microbatches=1, tensor_parallel=tp, sequence_parallel=sp, **options)


@pytest.fixture(scope="module")
def pinned():
    return {sp: _compile("cpu", sp) for sp in ("on", "off")}


def test_auto_chooses_it_where_it_is_no_slower_and_pinned_overrides(pinned):
    assert _compile("h100", "auto").plan.decisions.sequence_parallel is True  # as fast, smaller
    assert _compile("cpu", "auto").plan.decisions.sequence_parallel is False  # gloo's calls cost more
    on, off = pinned["on"], pinned["off"]
    assert on.plan.decisions.sequence_parallel is True and on.plan.decisions.to_dict()["sequence_parallel"] is True
    assert "sequence_parallel" not in off.plan.decisions.to_dict()  # a plan from before it hashes the same
    assert on.plan.stages[0].peak_memory_bytes < off.plan.stages[0].peak_memory_bytes
    # inspect shows the choice (the table and --json)
    assert "sequence par.   on: norms, dropouts and residual adds" in table(on.plan)
    assert "sequence par.   off" in table(off.plan)
    assert inspect_json(on.plan)["layout"]["sequence_parallel"] is True


@pytest.mark.parametrize("options, words", [
    (dict(tp=1), "the plan has no tensor parallelism (tp 1)"),
    (dict(training={"compile_stages": True}), "compiled stages do not run sequence parallelism yet")])
def test_what_it_cannot_run_is_refused_at_compile_time(options, words):
    with pytest.raises(ValueError, match="--sequence-parallel on") as e:
        _compile("cpu", "on", **options)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_stage_reduce_scatters_and_gathers_what_the_model_prices(pinned, tmp_path):
    folders = {}
    for sp, compiled in pinned.items():
        folders[sp] = str(tmp_path / sp)
        compiled.save(folders[sp])
    child = os.path.join(ROOT, "tests", "unit", "test_tp_traffic.py")
    result = subprocess.run([sys.executable, child, json.dumps(folders)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    counted = json.loads(result.stdout.strip().splitlines()[-1])
    on, off = counted["on"], counted["off"]
    # forward, 2 layers: the 4 row linears reduce-scatter (no all-reduce but the vocab lookup's);
    # 3 column inputs and the head's gather a slice, the 4th is the stage input's norm, whole
    # (Replicate), and the logits are gathered as without
    assert on["forward"]["calls"] == {"all_reduce": 1, "reduce_scatter_tensor": 4, "all_gather_into_tensor": 5}
    assert off["forward"]["calls"] == {"all_reduce": 5, "all_gather_into_tensor": 1}
    # backward: those 4 column inputs reduce-scatter their gradient, the whole one all-reduces it;
    # the 4 rows' gradients and the stage input's (sliced at the first residual add) are gathered
    assert on["backward"]["calls"] == {"all_reduce": 1, "reduce_scatter_tensor": 4, "all_gather_into_tensor": 5}
    # per step, the 4 norm weights' gradients that slices made (Partial) are summed: 32 fp32 each
    assert on["step"]["calls"] == {"all_reduce": 4} and on["step"]["bytes"] == {"all_reduce": 4 * 32 * 4}
    # the same bytes as without, but the boundary gradient's gather ((tp-1) x a 1/2 slice of [2, 8, 32])
    slice_bytes = 2 * 8 * 32 * 4 // 2
    assert on["forward"]["sent"] == off["forward"]["sent"]
    assert on["backward"]["sent"] == off["backward"]["sent"] + slice_bytes
    compiled = pinned["on"]
    regions = compiled.problem.regions
    # priced: the same bytes in all (the head's input counted gathered in forward, the boundary's
    # gradient not in backward: one slice either way per stage, Note [sequence parallelism as a decision])
    b = compiled.plan.microbatch_size
    priced = {sp: b * sum(sum(sent_bytes(r, 2, sp)) for r in regions) for sp in (True, False)}
    assert priced[True] == pytest.approx(priced[False])
    assert priced[True] == pytest.approx(on["forward"]["sent"] + on["backward"]["sent"] - slice_bytes
                                         - 2048 - 2048)  # less the lookup's all-reduce and the logits' gather
