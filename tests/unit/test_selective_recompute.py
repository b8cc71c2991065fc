"""Selective recompute priced (Note [selective recompute] in partitioner/solver/recompute_cost.py):
what each attention core drops, keeps and reruns, held to a hand count on the built-in GPT, and the
problem every pricer then sees; selective refused where it does not run (tensor parallelism)."""

from __future__ import annotations

import pytest

import passes
from passes.attention_core import CoreCost, core_costs
from partitioner.cli import main
from partitioner.config.cluster import ClusterSpec
from partitioner.config.settings import TrainingSettings
from partitioner.frontend.analysis import COSTING_RANDOMNESS
from partitioner.frontend.randomness import lower_randomness
from partitioner.frontend.tp_support import check_tensor_parallel
from partitioner.frontend.trace import trace
from partitioner.models import builtin as models
from partitioner.solver import SolverConfig, evaluate, solve
from partitioner.solver.recompute_cost import pinned_recompute, priced_selective
from runtime.execute import randomness
from tests.unit.test_solver_hand import chain, region

B, H, S, W = 2, 4, 16, 32  # batch, heads, sequence, width: head dim D = W / H = 8
D = W // H


def _gpt_costs(dropout: float) -> dict[int, CoreCost]:
    w = models.gpt(layers=1, width=W, heads=H, vocab=32, seq=S, batch=B, attn="eager", dropout=dropout)
    gm = trace(w.model, w.example_args).gm
    lower_randomness(gm, batch_size=B)  # the compiler's graph: the keyed dropout
    with randomness.restored(COSTING_RANDOMNESS):
        passes.run_all(gm)
        return core_costs(gm)


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_a_gpt_core_drops_its_quadratic_tensors_keeps_qkv_and_reruns_two_matmuls(dropout):
    """By hand, fp32: the s² tensors are the probabilities (4 B), with dropout also its output (4 B)
    and its mask (1 B, bool), per element of B x H x S²: Korthikanti's 2 and 5 bytes at fp16 are 4
    and 9 here. Besides: matmul's copies of q, k and v (the transposed views it makes dense) and
    the causal mask (S² bool). Kept: the qkv projection's output the core reads (B x S x 3W fp32),
    which nothing saved before. Rerun: q kᵀ and p v, 2 B H S² D FLOPs each."""
    costs = _gpt_costs(dropout)
    assert list(costs) == [1]  # block.0, one core
    quadratic = (4 + (4 + 1 if dropout else 0)) * B * H * S * S
    copies = 3 * 4 * B * H * S * D
    assert costs[1] == CoreCost(dropped_bytes=quadratic + copies + S * S, kept_bytes=4 * B * S * 3 * W,
                                fwd_flops=2 * (2 * B * H * S * S * D), cores=1)


def test_the_problem_every_pricer_sees():
    """Per sample: activations less what is dropped (rounded down) plus what is kept (up); the
    backward runs the core's forward again; its transient holds the rebuilt core once; a measured
    kind pays the core's share of the measured forward and one checkpoint's fixed cost."""
    base = region("block", fwd=1000.0, act=10_000, transient_bytes_per_sample=50,
                  fwd_s_per_sample_by_kind={"cpu": 1.0}, bwd_s_per_sample_by_kind={"cpu": 2.0},
                  fwd_s_per_microbatch_by_kind={"cpu": 0.0}, bwd_s_per_microbatch_by_kind={"cpu": 0.5})
    problem = chain([region("embed"), base])
    out = priced_selective(problem, {1: CoreCost(dropped_bytes=9_001, kept_bytes=2_001, fwd_flops=500, cores=2)}, 2)
    assert out.regions[0] == problem.regions[0]
    r = out.regions[1]
    assert r.activation_bytes_per_sample == 10_000 - 4_500 + 1_001
    assert r.bwd_flops_per_sample == 2000.0 + 250.0
    assert r.transient_bytes_per_sample == 50 + 4_501
    assert r.bwd_s_per_sample_by_kind == {"cpu": 2.0 + 0.25 * 1.0}  # 250 of 1000 forward FLOPs per sample
    fixed = problem.recompute_fixed_s_by_kind  # None: the cpu preset's
    from partitioner.config.device_presets import DEVICE_PRESETS

    per_core = (fixed or {}).get("cpu", DEVICE_PRESETS["cpu"].recompute_fixed_s)
    assert r.bwd_s_per_microbatch_by_kind == {"cpu": pytest.approx(0.5 + 2 * per_core)}


def test_selective_pins_regions_off_and_plans_price_the_cores():
    problem = chain([region(f"r{i}", act=1000) for i in range(4)])
    cores = {i: CoreCost(dropped_bytes=1200, kept_bytes=200, fwd_flops=int(2e8), cores=1) for i in range(4)}
    out = priced_selective(problem, cores, 2)
    assert pinned_recompute(out, "selective") == (False,) * 4
    config = SolverConfig(time_limit_s=5, recompute="selective")
    assert not config.allow_recompute and config.recompute == "selective"
    cluster = ClusterSpec.homogeneous(2)
    plain = solve(problem, cluster, 4, num_stages=2, dp=1, microbatches=2, config=SolverConfig(time_limit_s=5,
                                                                                              recompute="none"))
    sel = solve(out, cluster, 4, num_stages=2, dp=1, microbatches=2, config=config)
    assert not any(sel.recompute) and "pinned: --recompute selective" in sel.optimal_over
    assert sel.step_time_s == pytest.approx(evaluate(out, cluster, sel.assignment).step_time_s)
    assert sel.step_time_s > plain.step_time_s  # the reruns are priced
    peak = max(s.memory_bytes for s in evaluate(out, cluster, sel.assignment).stages)
    assert peak < max(s.memory_bytes for s in evaluate(problem, cluster, plain.assignment).stages)


def test_selective_under_tensor_parallelism_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"tensor_parallel=2 does not run with selective recompute .*--recompute full"):
        check_tensor_parallel(2, ClusterSpec.homogeneous(2), TrainingSettings(recompute="selective"))


def test_selective_on_a_model_without_attention_is_refused_in_one_line(tmp_path, capsys):
    """It would run as "none": refused, naming what it looks for and what to use instead."""
    code = main(["compile", "mlp", "-o", str(tmp_path / "out"), "--recompute", "selective", "-q"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and "no attention core" in err and "Traceback" not in err, err
    assert "--recompute full or auto" in err and not (tmp_path / "out").exists()
