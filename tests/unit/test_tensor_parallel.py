"""Tensor parallelism, compile side: the roles and region figures of passes/tp_roles.py
(Note [tensor-parallel roles]), the plan's ``tensor_parallel`` field, compile(tensor_parallel=N)
and its refusals (Note [what tensor parallelism runs with]), and the tensor groups of
partitioner/solver/tensor_groups.py (Note [tensor groups])."""

from __future__ import annotations

import json

import pytest
import torch

import partitioner
from passes import ir
from partitioner.frontend.analysis import annotate, trace_keyed
from partitioner.calibrate.priced_problem import build_problem
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt, hf_llama
from partitioner.solver.plan import Plan
from partitioner.solver import problem as sp
from partitioner.solver.tensor_groups import group_cluster, tp_problem
from passes.region_graph import region_table
from passes.tp_roles import check_degree, sharded_parameters


def _annotated(workload, granularity="block"):
    traced, _ = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    return annotate(traced, granularity=granularity, loss_outside_graph=True)


def _roles(gm) -> dict[str, str]:
    """weight name -> role of the node reading it, for linear / embedding nodes."""
    out = {}
    for n in gm.graph.nodes:
        role = ir.get(n, ir.TP).role
        if role is not None:
            weight = n.args[0] if "embedding" in str(n.target) else n.args[1]
            out[weight.target] = role
    return out


def test_llama_roles_are_megatrons():
    gm = _annotated(hf_llama(layers=2, width=32, heads=4, vocab=64, seq=8))
    roles = _roles(gm)
    for i in range(2):
        layer = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert roles[f"{layer}.{name}.weight"] == "column", name
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert roles[f"{layer}.{name}.weight"] == "row", name
    assert roles["model.embed_tokens.weight"] == "vocab"
    assert roles["lm_head.weight"] == "vocab"
    sharded = sharded_parameters(gm)
    assert sharded["model.layers.0.mlp.down_proj.weight"] == ("row", 1)
    assert sharded["model.layers.0.self_attn.q_proj.weight"] == ("column", 0)
    assert not any("norm" in name for name in sharded)  # norms stay whole on every rank


class _SplitThenViewAttention(torch.nn.Module):
    """GPT-2's fused layout: q, k and v each a contiguous third of qkv's rows."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


def test_a_fused_qkv_split_before_its_heads_stays_replicated_and_its_mlp_is_sharded():
    workload = gpt(layers=2, width=32, heads=2, vocab=64, seq=16)
    for block in workload.model.blocks:
        block.attn = _SplitThenViewAttention(32, 2)
    gm = _annotated(workload)
    roles = _roles(gm)
    assert roles["blocks.0.attn.qkv.weight"] == "replicated"  # split on its features: would mix heads
    assert roles["blocks.0.attn.proj.weight"] == "replicated"
    assert roles["blocks.0.mlp.fc.weight"] == "column" and roles["blocks.0.mlp.proj.weight"] == "row"


def test_the_builtin_gpts_per_head_fused_qkv_is_column_parallel():
    gm = _annotated(gpt(layers=2, width=32, heads=2, vocab=64, seq=16))
    roles = _roles(gm)
    # Megatron's layout: viewed per head before the split, so a slice of rows is whole heads
    assert roles["blocks.0.attn.qkv.weight"] == "column"
    assert roles["blocks.0.attn.proj.weight"] == "row"
    assert roles["blocks.0.mlp.fc.weight"] == "column" and roles["blocks.0.mlp.proj.weight"] == "row"
    assert roles["tok_emb.weight"] == "vocab"
    assert roles["pos_emb.weight"] == "replicated"  # indexed by an arange, not the tokens
    assert roles["head.weight"] == "vocab"
    check_degree(gm, 2)
    with pytest.raises(ValueError, match="does not divide the 2 heads"):
        check_degree(gm, 4)


def test_region_figures_are_the_collectives_and_the_sharded_bytes():
    workload = hf_llama(layers=2, width=32, heads=4, vocab=64, seq=8, batch=2)
    gm = _annotated(workload)
    table = {r.name: r for r in region_table(gm)}
    block = table["block.0"]
    # two all-reduces of [batch, seq, width] fp32 per block: attention output and MLP down
    assert block.tp_comm_bytes == 2 * 2 * 8 * 32 * 4
    # every linear weight of the block is split (no biases in Llama), the two norms are not
    linears = 4 * 32 * 32 + 3 * 32 * (int(32 * 8 / 3) // 8 * 8)
    assert block.tp_sharded_param_bytes == 4 * linears
    assert block.tp_sharded_param_bytes == block.param_bytes - 4 * 2 * 32
    problem = build_problem(gm, workload.example_batch_size)
    by_name = {r.name: r for r in problem.regions}
    assert by_name["block.0"].tp.comm_bytes == block.tp_comm_bytes // 2  # per sample
    assert by_name["block.0"].tp.sharded_param_bytes == block.tp_sharded_param_bytes
    assert by_name["embed"].tp.comm_bytes == 8 * 32 * 4  # the vocab-split lookup's all-reduce


def test_a_degree_that_does_not_divide_the_heads_is_refused():
    gm = _annotated(hf_llama(layers=1, width=32, heads=4, vocab=60, seq=8))  # 60 rows: 3 divides them
    check_degree(gm, 2)
    check_degree(gm, 4)
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide the 4 heads"):
        check_degree(gm, 3)


def test_group_cluster_and_tp_problem():
    cluster = ClusterSpec.homogeneous(16, "h100", devices_per_node=8)
    grouped = group_cluster(cluster, 4)
    assert grouped.num_devices == 4 and {d.node for d in grouped.devices} == {0, 1}
    assert grouped.devices[0].memory_bytes == 4 * cluster.devices[0].memory_bytes
    assert grouped.devices[0].flops_per_s == 4 * cluster.devices[0].flops_per_s
    with pytest.raises(ValueError, match="spans nodes"):
        group_cluster(ClusterSpec.homogeneous(12, "h100", devices_per_node=6), 4)
    with pytest.raises(ValueError, match="does not divide the cluster's 6 devices"):
        group_cluster(ClusterSpec.homogeneous(6, "h100"), 4)
    region = sp.RegionCost("r", 1.0, 2.0, 1000, 1000, 2000, 10, 5,
                           tp=sp.TensorParallelCost(sharded_param_bytes=800, comm_bytes=7))
    problem = sp.PartitionProblem((region,), ())
    grouped_problem = tp_problem(problem, 2)
    r = grouped_problem.regions[0]
    # per member: 200 replicated + 800 / 2 sharded = 600; a group of 2 holds 1200
    assert (r.param_bytes, r.grad_bytes, r.optimizer_bytes) == (1200, 1200, 2400)
    assert r.activation_bytes_per_sample == 20  # whole on every member
    assert tp_problem(problem, 1) is problem


def test_compile_with_tp_2_lays_out_tensor_groups():
    workload = hf_llama(layers=2, width=32, heads=4, vocab=64, seq=8, batch=2)
    compiled = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(4, "cpu", cores=4), global_batch=4,
                                   num_stages=2, microbatches=2, tensor_parallel=2)
    plan = compiled.plan
    assert plan.tensor_parallel == 2 and plan.world_size == 4 and plan.dp == 1
    assert plan.decisions.shard_optimizer is False  # ZeRO-1 is not a candidate with tensor groups
    assert [s.ranks for s in plan.stages] == [(0,), (2,)]
    assert plan.rank_layout() == [{"rank": 0, "stages": [0], "replica": 0, "tp_index": 0},
                                  {"rank": 1, "stages": [0], "replica": 0, "tp_index": 1},
                                  {"rank": 2, "stages": [1], "replica": 0, "tp_index": 0},
                                  {"rank": 3, "stages": [1], "replica": 0, "tp_index": 1}]
    body = json.loads(plan.to_json())
    assert body["tensor_parallel"] == 2
    assert Plan.from_dict(body).tensor_parallel == 2


def test_a_plan_without_the_key_is_tp_1_and_hashes_as_before():
    workload = gpt(layers=1, width=16, heads=2, vocab=32, seq=8)
    plan = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(1, "cpu", cores=1), global_batch=2).plan
    body = json.loads(plan.to_json())
    assert "tensor_parallel" not in body
    again = Plan.from_dict(body)
    assert again.tensor_parallel == 1 and again.content_hash() == plan.content_hash()


@pytest.mark.parametrize("options, message", [
    ({"training": {"memory_tier": {"mode": "copy"}}}, "in-memory checkpoint tier"),
    ({"tensor_parallel": 0}, "must be an int >= 1"),
    ({"tensor_parallel": 3}, "does not divide the cluster's 4 devices"),
])
def test_what_tp_does_not_run_with_is_refused_before_the_trace(options, message):
    workload = gpt(layers=1, width=16, heads=2, vocab=32, seq=8)
    options = {"tensor_parallel": 2, **options}
    with pytest.raises(ValueError, match=message):
        partitioner.compile(workload, cluster=ClusterSpec.homogeneous(4, "cpu", cores=4), global_batch=4, **options)


def test_tp_compiles_under_mixed_precision_and_prices_its_collectives_at_two_bytes():
    """Note [what tensor parallelism runs with] holds: no refusal under bf16-mixed / fp16-mixed (a GPU's
    default), and the tensor-parallel payloads are priced at the compute dtype's 2 bytes (Note
    [tensor parallelism under autocast])."""
    workload = hf_llama(layers=2, width=32, heads=4, vocab=64, seq=8, batch=2)
    per_precision = {}
    for precision in ("fp32", "fp16-mixed"):
        compiled = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=4,
                                       num_stages=1, microbatches=2, tensor_parallel=2, precision=precision)
        assert compiled.plan.tensor_parallel == 2 and compiled.plan.decisions.precision == precision
        regions = compiled.problem.regions
        per_precision[precision] = [sum(getattr(r.tp, f) for r in regions) for f in
                                    ("comm_bytes", "comm_bwd_bytes", "gather_bytes", "lookup_bytes")]
    comm, bwd, gather, lookup = per_precision["fp32"]
    assert comm > lookup > 0 and bwd > 0 and gather > 0
    # the vocab lookup's all-reduce stays in the embedding's fp32; everything else moves 2 bytes
    assert per_precision["fp16-mixed"] == pytest.approx([(comm - lookup) / 2 + lookup, bwd / 2, gather / 2, lookup],
                                                        abs=8)
    gpu = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(2, "h100"), global_batch=4, num_stages=1,
                              microbatches=2, tensor_parallel=2)  # bf16-mixed, the GPU default
    assert gpu.plan.tensor_parallel == 2 and gpu.plan.decisions.precision == "bf16-mixed"
    assert [sum(getattr(r.tp, f) for r in gpu.problem.regions) for f in
            ("comm_bytes", "comm_bwd_bytes", "gather_bytes", "lookup_bytes")] == per_precision["fp16-mixed"]
