"""Tensor parallelism's per-rank terms against a hand count of a Megatron-shaped block (the built-in
GPT: fused qkv in Megatron's per-head layout, 4h MLP), and the GPU cost model's collectives and
roofline (Notes [tensor-parallel pricing], [collectives as NCCL runs them], [accelerator roofline]).

Per rank at degree t, for hidden h, sequence s, a heads (per sample, fp32 as traced):
- weights: the column and row matmuls' weights and the column biases are split,
  12 h^2 + 7 h elements / t; the two layer norms and the row biases are whole, 6 h;
- FLOPs: every matmul and the attention between them is split: 24 s h^2 + 4 s^2 h per sample
  forward, all / t;
- saved activations (Korthikanti et al. 2022, no sequence parallelism: s b h (10 + 24/t + 5 a s/(h t))
  bytes at 2 bytes an element with 1-byte dropout masks): without dropout and with fused attention
  (no a s^2 scores), in elements, 4 s h whole (both norms' inputs and outputs) + 12 s h / t (q, k,
  v, the attention output, the MLP's 4h input and output) + the kernel's a s row statistics / t.
"""

from __future__ import annotations

import math

import pytest

from partitioner import analyze
from partitioner.calibrate.priced_problem import build_problem
from partitioner.calibrate.datasheet import RATES, datasheet_profile, datasheet_profiles
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt
from partitioner.solver.precision_cost import precision_problem
from partitioner.solver.tensor_groups import group_cluster, tp_priced_problem
from partitioner.solver.zero_choice import sharded_problem

H, S, A, V = 64, 16, 4, 128


@pytest.fixture(scope="module")
def problem():
    workload = gpt(layers=1, width=H, heads=A, vocab=V, seq=S, batch=2)
    gm, _ = analyze(workload)
    return build_problem(gm, 2)


def _region(problem, name):
    return next(r for r in problem.regions if r.name == name)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("precision, bytes_per_weight", [("fp32", 4), ("bf16-mixed", 6)])
def test_block_weights_grads_and_optimizer_per_rank(problem, tp, precision, bytes_per_weight):
    """bf16-mixed adds a 2-byte autocast copy per 4-byte weight, split as its weight is."""
    priced = tp_priced_problem(precision_problem(problem, precision, 4), ClusterSpec.homogeneous(tp, "h100"), tp)
    block = _region(priced, "block.0")
    split, whole = 12 * H * H + 7 * H, 6 * H
    per_rank = split / tp + whole
    # a tensor group is planned as one device of tp members: its figure is tp times one member's
    assert block.param_bytes / tp == pytest.approx(bytes_per_weight * per_rank, abs=tp)
    assert block.grad_bytes / tp == pytest.approx(4 * per_rank, abs=tp)
    assert block.optimizer_bytes / tp == pytest.approx(8 * per_rank, abs=tp)
    d = 4  # ZeRO-1 shards the AdamW state of every rank's own weights over the replicas
    assert sharded_problem(priced, d).regions[1].optimizer_bytes / tp == pytest.approx(8 * per_rank / d, abs=tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_block_flops_per_rank_are_the_whole_blocks_over_tp(problem, tp):
    block = _region(problem, "block.0")
    assert block.fwd_flops_per_sample == 24 * S * H * H + 4 * S * S * H
    assert block.tp_flop_share == 1.0  # norms and adds count no FLOPs; everything counted is split
    priced = _region(tp_priced_problem(problem, ClusterSpec.homogeneous(tp, "h100"), tp), "block.0")
    # in units of the group's tp x FLOP/s: the same FLOPs, i.e. 1/tp of them per member
    assert priced.fwd_flops_per_sample == pytest.approx(block.fwd_flops_per_sample)
    assert priced.bwd_flops_per_sample == pytest.approx(block.bwd_flops_per_sample)


@pytest.mark.parametrize("tp", [2, 4])
def test_block_saved_activations_per_rank_follow_korthikanti(problem, tp):
    block = _region(problem, "block.0")
    whole_elems, split_elems = 4 * S * H, 12 * S * H + A * S
    norm_stats = 2 * 2 * S  # each layer norm saves its mean and rstd per token
    assert block.tp.sharded_activation_bytes_per_sample == 4 * split_elems
    assert block.activation_bytes_per_sample == 4 * (whole_elems + split_elems + norm_stats)
    priced = _region(tp_priced_problem(problem, ClusterSpec.homogeneous(tp, "h100"), tp), "block.0")
    assert priced.activation_bytes_per_sample / tp == pytest.approx(
        4 * (whole_elems + norm_stats + split_elems / tp), abs=1)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_vocab_split_embedding_and_head(problem, tp):
    """Token embedding rows and the head's rows split on the vocabulary; positions whole; the
    head's matmul split, the lookup's all-reduce of the embedding's output once per microbatch."""
    priced = tp_priced_problem(problem, ClusterSpec.homogeneous(tp, "h100"), tp)
    embed, head = _region(priced, "embed"), _region(priced, "head")
    assert embed.param_bytes / tp == pytest.approx(4 * (V * H / tp + S * H), abs=tp)
    assert _region(problem, "head").fwd_flops_per_sample == 2 * S * H * V
    assert _region(problem, "head").tp_flop_share == 1.0
    assert head.fwd_flops_per_sample == pytest.approx(2 * S * H * V)  # group units: 1/tp per member
    assert _region(problem, "embed").tp.comm_bytes == 4 * S * H


def test_allreduce_link_is_hierarchical_across_nodes_and_per_lane_in_tensor_groups():
    cluster = ClusterSpec.from_dict({
        "group": [{"kind": "a100-80gb", "count": 32, "devices_per_node": 8}],
        "links": {"intra_node": {"bandwidth_gbytes_per_s": 300, "latency_s": 5e-6},
                  "inter_node": {"bandwidth_gbytes_per_s": 25, "latency_s": 1e-5}}})
    nbytes = 3.4e9
    link = cluster.allreduce_link(list(range(32)))  # 4 nodes x 8
    ring = 2 * 31 * (nbytes / 32 / link.bandwidth_bytes_per_s + link.latency_s)
    by_hand = (2 * 7 / 8 * nbytes / 300e9 + 2 * 3 / 4 * (nbytes / 8) / 25e9
               + 2 * 7 * 5e-6 + 2 * 3 * 1e-5)
    assert ring == pytest.approx(by_hand, rel=1e-12)
    assert cluster.allreduce_link(list(range(8))) == cluster.intra_node_link  # one node: NVLink
    # tensor groups of 8 fill a node: the replicas' ring runs over the NICs, one per member, at once
    groups = group_cluster(cluster, 8)
    across = groups.allreduce_link([0, 1, 2, 3])
    group_bytes = 8 * nbytes  # a group holds 8 members' gradients
    t = 2 * 3 * (group_bytes / 4 / across.bandwidth_bytes_per_s + across.latency_s)
    assert t == pytest.approx(2 * 3 / 4 * nbytes / 25e9 + 2 * 3 * 1e-5, rel=1e-12)
    cpu = ClusterSpec.homogeneous(4, "cpu", devices_per_node=2)  # gloo: a flat ring on the slowest link
    assert cpu.allreduce_link([0, 1, 2, 3]) == cpu.inter_node_link


def test_the_roofline_prices_matmuls_attention_and_memory_bound_ops(problem):
    from partitioner.calibrate.features import Features

    profile = datasheet_profile("a100-80gb", "fp16-mixed")
    fp32 = datasheet_profile("a100-80gb", "fp32")
    # each term priced at its own rate, by hand: 1 TFLOP of GEMM at the sustained fp16 rate, 1 TFLOP of
    # fused attention at its own, 1 GB of memory-bound traffic at 90% of the 2.039 TB/s HBM, 10 kernels
    terms = Features(matmul_flops=1e12, other_flops=1e12, memory_bytes=1e9, num_ops=10)
    by_hand = 1e12 / 267.9e12 + 1e12 / 180e12 + 1e9 / (0.9 * 2039e9) + 10 * 2e-6
    assert profile.forward.seconds(terms) == pytest.approx(by_hand, rel=1e-12)
    assert profile.backward.seconds(terms) == pytest.approx(by_hand, rel=1e-12)
    # fp32 has no tensor-core rate: the same GEMM FLOPs take the fp32 peak's share, 312 / 19.5 = 16x longer
    gemm = Features(matmul_flops=1e12)
    assert fp32.forward.seconds(gemm) / profile.forward.seconds(gemm) == pytest.approx(312 / 19.5, rel=0.01)
    assert profile.meta["precision"] == "fp16-mixed"
    assert datasheet_profile("cpu", "fp32") is None
    cluster = ClusterSpec.homogeneous(2, "a100-80gb")
    assert [p.kind for p in datasheet_profiles(cluster, "bf16-mixed")] == ["a100-80gb"]
    own = ClusterSpec.from_dict({"group": [{"kind": "a100-80gb", "count": 2, "flops_per_s": 1e14}]})
    assert datasheet_profiles(own, "bf16-mixed") == []  # the user's figure wins
    assert datasheet_profiles(cluster, "bf16-mixed", measured_kinds={"a100-80gb"}) == []


def test_the_roofline_profile_reaches_the_problem_and_its_tp_split(problem):
    workload = gpt(layers=1, width=H, heads=A, vocab=V, seq=S, batch=2)
    gm, _ = analyze(workload)
    profile = datasheet_profile("h100", "bf16-mixed")
    priced = build_problem(gm, 2, profiles=[profile])
    block = _region(priced, "block.0")
    rates = RATES["h100"]
    # a lower bound by hand: the block's matmul FLOPs at the GEMM rate (the rest adds to it)
    assert block.fwd_s_per_sample_by_kind["h100"] > 24 * S * H * H / rates.gemm_flops_per_s["bf16"]
    # the norms and residual adds are memory-bound and whole on every member: less than all of it splits
    assert 0.0 < block.tp.split_fraction_by_kind["h100"] < 1.0
    # AdamW's step, once per step: 7 passes over the parameters at the HBM rate
    assert block.step_s_by_kind["h100"] == pytest.approx(7 * block.param_bytes / rates.hbm_bytes_per_s)
    one = _region(tp_priced_problem(priced, ClusterSpec.homogeneous(2, "h100"), 2), "block.0")
    split = block.tp.split_fraction_by_kind["h100"]
    compute = block.fwd_s_per_sample_by_kind["h100"] * (split / 2 + 1 - split)
    assert one.fwd_s_per_sample_by_kind["h100"] >= compute
    assert math.isfinite(one.fwd_s_per_sample_by_kind["h100"])
