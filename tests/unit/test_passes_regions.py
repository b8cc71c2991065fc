"""Regions: a partition of the nodes into a DAG along module boundaries, and its cost tables."""

from __future__ import annotations

import functools

import networkx as nx
import pytest
import torch
import torch.nn as nn

import passes
from passes import ir
from partitioner.models import builtin as models
from partitioner.frontend.trace import trace


@functools.cache
def traced(key: str):
    builders = {
        "gpt12": lambda: models.gpt(layers=12, width=16, heads=2, vocab=32, seq=8, batch=2),
        "gpt2": lambda: models.hf_gpt2(layers=2, width=32, heads=2, vocab=64, seq=16),
        "llama": lambda: models.hf_llama(layers=3, width=32, heads=2, vocab=64, seq=16),
        "bert": lambda: models.hf_bert(layers=2, width=32, heads=2, vocab=64, seq=16),
        "mlp": lambda: models.mlp(features=8, hidden=16, depth=3, outputs=4),
    }
    workload = builders[key]()
    gm = trace(workload.model, workload.example_args).gm
    passes.annotate_shapes(gm)
    passes.annotate_flops(gm)
    passes.annotate_memory(gm)
    return workload, gm


def regions_of(gm, granularity: str):
    passes.annotate_regions(gm, granularity=granularity)
    return passes.region_table(gm)


def check_partition_and_dag(gm, table) -> None:
    """Every node in exactly one region; ids 0..n-1; the node-level data flow between regions is
    acyclic and always goes from a lower id to a higher one."""
    listed = [name for row in table for name in row.node_names]
    assert sorted(listed) == sorted(n.name for n in gm.graph.nodes)
    assert len(listed) == len(set(listed))
    assert [row.region_id for row in table] == list(range(len(table)))
    for node in gm.graph.nodes:
        assert node.name in table[ir.get(node, ir.REGION).region_id].node_names
    region_graph = nx.DiGraph()
    region_graph.add_nodes_from(range(len(table)))
    for node in gm.graph.nodes:  # every data dependency, recomputed from the graph itself
        for source in node.all_input_nodes:
            if source.op == "get_attr":
                continue
            src, dst = ir.get(source, ir.REGION).region_id, ir.get(node, ir.REGION).region_id
            if src != dst:
                region_graph.add_edge(src, dst)
    assert nx.is_directed_acyclic_graph(region_graph)
    assert all(src < dst for src, dst in region_graph.edges)
    assert {(s, d) for s, d, _ in passes.region_edges(gm)} == set(region_graph.edges)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert all(ir.get(n, ir.REGION).region_id == 0 for n in placeholders)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert ir.get(output, ir.REGION).region_id == len(table) - 1
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            first_user = min(node.users, key=lambda u: list(gm.graph.nodes).index(u))
            assert ir.get(node, ir.REGION) == ir.get(first_user, ir.REGION)


def check_sums(gm, table) -> None:
    for field, key in [("fwd_flops", ir.FLOPS), ("bwd_flops", ir.FLOPS), ("param_bytes", ir.MEMORY),
                       ("saved_activation_bytes", ir.MEMORY), ("optimizer_bytes", ir.MEMORY)]:
        assert sum(getattr(r, field) for r in table) == sum(getattr(ir.get(n, key), field) for n in gm.graph.nodes)


@pytest.mark.parametrize("key", ["gpt12", "gpt2", "llama", "bert", "mlp"])
@pytest.mark.parametrize("granularity", ["block", "sublayer", "op", "node"])
def test_regions_partition_the_graph_into_a_dag(key, granularity):
    _, gm = traced(key)
    table = regions_of(gm, granularity)
    check_partition_and_dag(gm, table)
    check_sums(gm, table)


def test_twelve_layer_gpt_block_regions():
    _, gm = traced("gpt12")
    table = regions_of(gm, "block")
    assert [r.name for r in table] == ["embed"] + [f"block.{i}" for i in range(12)] + ["head"]
    assert [r.layer for r in table] == [None] + list(range(12)) + [None]
    blocks = table[1:-1]
    assert len({(r.fwd_flops, r.bwd_flops, r.param_bytes, r.saved_activation_bytes) for r in blocks}) == 1
    assert blocks[0].param_bytes == (12 * 16 * 16 + 13 * 16) * 4
    assert blocks[0].fwd_flops > 0 and blocks[0].output_bytes == 2 * 8 * 16 * 4
    # The residual stream is the only thing crossing a block boundary.
    assert passes.region_edges(gm) == [(k, k + 1, 2 * 8 * 16 * 4) for k in range(13)]


def test_twelve_layer_gpt_sublayer_regions():
    _, gm = traced("gpt12")
    table = regions_of(gm, "sublayer")
    expected = ["embed"] + [f"block.{i}.{s}" for i in range(12) for s in ("attn", "mlp")] + ["head"]
    assert [r.name for r in table] == expected
    attn = next(r for r in table if r.name == "block.3.attn")
    assert any("layer_norm" in n for n in attn.node_names)  # ln_1 goes with the attention after it
    assert attn.node_names[-1].startswith("add")  # the residual add goes with the sublayer before it
    assert attn.layer == 3


@pytest.mark.parametrize("key,names", [
    ("gpt2", ["embed", "block.0", "block.1", "head"]),
    ("llama", ["embed", "block.0", "block.1", "block.2", "head"]),
    ("bert", ["embed", "block.0", "block.1", "head"]),
    ("mlp", ["block.0", "block.1", "block.2", "head"]),
])
def test_block_regions_of_third_party_models(key, names):
    _, gm = traced(key)
    assert [r.name for r in regions_of(gm, "block")] == names


def test_sublayers_of_llama_and_bert():
    _, gm = traced("llama")
    names = [r.name for r in regions_of(gm, "sublayer")]
    assert names[1:3] == ["block.0.self_attn", "block.0.mlp"] and len(names) == 2 * 3 + 2
    _, gm = traced("bert")
    names = [r.name for r in regions_of(gm, "sublayer")]
    assert names[1:4] == ["block.0.attention", "block.0.intermediate", "block.0.output"]


def test_op_granularity_splits_sublayers_at_their_matmuls():
    """Each projection and the attention core get a region; the norm joins the first matmul of
    its sublayer, the residual add the last."""
    _, gm = traced("llama")
    table = regions_of(gm, "op")
    names = [r.name for r in table]
    assert names[:9] == ["embed"] + [f"block.0.self_attn.{m}" for m in
                                     ("q_proj", "k_proj", "v_proj", "scaled_dot_product_attention", "o_proj")] + \
        [f"block.0.mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
    assert names[-1] == "head" and len(table) == 2 + 3 * 8
    by_name = {r.name: r for r in table}
    assert any("norm" in n or "rsqrt" in n or "pow" in n for n in by_name["block.0.self_attn.q_proj"].node_names)
    assert by_name["block.1.mlp.gate_proj"].fwd_flops == by_name["block.1.mlp.up_proj"].fwd_flops > 0
    sublayer = {r.name: r for r in regions_of(gm, "sublayer")}
    ops = [r for r in table if r.name.startswith("block.1.self_attn.")]
    assert sum(r.fwd_flops for r in ops) == sublayer["block.1.self_attn"].fwd_flops
    # GPT-2's fused qkv projection (Conv1D) is one region, the attention core another.
    _, gm2 = traced("gpt2")
    names2 = [r.name for r in regions_of(gm2, "op")]
    assert names2[1:6] == ["block.0.attn.c_attn", "block.0.attn.scaled_dot_product_attention",
                           "block.0.attn.c_proj", "block.0.mlp.c_fc", "block.0.mlp.c_proj"]


def test_node_granularity_is_one_region_per_compute_node():
    _, gm = traced("gpt2")
    table = regions_of(gm, "node")
    compute = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(table) == len(compute)
    assert table[5].name.split(".")[0] in ("embed", "block", "head")


def test_tied_embedding_is_a_tie_not_an_edge():
    workload, gm = traced("gpt2")
    table = regions_of(gm, "block")
    ties = passes.region_ties(gm)
    nbytes = workload.model.lm_head.weight.numel() * 4
    assert ties == [passes.TieRow("lm_head.weight", nbytes, (0, len(table) - 1))]
    assert table[0].param_bytes >= nbytes and table[-1].param_bytes < nbytes  # owned by embed only
    assert all(b < nbytes or (s, d) != (0, len(table) - 1) for s, d, b in passes.region_edges(gm))


def test_edges_count_each_tensor_once_per_destination():
    _, gm = traced("llama")
    regions_of(gm, "block")
    edges = {(s, d): b for s, d, b in passes.region_edges(gm)}
    residual = 2 * 16 * 32 * 4
    # Each block receives the residual stream from its predecessor, and rotary cos/sin + mask
    # from the embedding region, once each although every attention reads them twice.
    assert edges[(1, 2)] == residual and edges[(2, 3)] == residual
    assert 0 < edges[(0, 2)] == edges[(0, 3)] < residual
    assert edges[(0, 1)] == residual + edges[(0, 2)]


def test_cut_edges_price_each_tensor_once_per_boundary():
    """The rotary tables go from the embedding to every block: priced on one edge to the last
    block, so a boundary between blocks pays them once, as the forwarding runtime sends them."""
    _, gm = traced("llama")
    regions_of(gm, "block")
    per_destination = {(s, d): b for s, d, b in passes.region_edges(gm)}
    cut = {(s, d): b for s, d, b in passes.region_cut_edges(gm)}
    tables = per_destination[(0, 2)]
    last_block = max(d for _, d in per_destination if d < len(regions_of(gm, "block")) - 1)
    assert cut[(0, last_block)] == tables and cut[(0, 2)] == 0
    # block 1 reaches the last block through the residual stream: no ordering edge between them
    # (Note [one priced reader]); the old pass added a 0-byte one
    assert (1, last_block) not in cut or last_block == 2
    assert cut[(0, 1)] == per_destination[(0, 1)] - tables  # the residual stream only
    crossing = lambda edges, k: sum(b for (s, d), b in edges.items() if s <= k < d)  # noqa: E731
    assert crossing(per_destination, 1) - crossing(cut, 1) == tables  # counted twice before, once now
    # Every reader still depends on the producer, so the region DAG is unchanged.
    assert {(s, d) for (s, d) in cut if (s, d) in per_destination} == set(per_destination)


def test_ordering_edges_only_where_no_dependency_orders_the_readers():
    """Note [one priced reader] holds: at block, sublayer and op granularity no zoo model needs an
    ordering edge (the search is over data dependencies only); at node granularity some do."""
    for key in ("gpt12", "llama", "bert"):
        _, gm = traced(key)
        for granularity in ("block", "sublayer", "op"):
            regions_of(gm, granularity)
            assert passes.region_graph.ordering_edges(gm) == [], (key, granularity)
    _, gm = traced("bert")
    regions_of(gm, "node")
    assert passes.region_graph.ordering_edges(gm)  # q, k, v read the same hidden state, none feeds another


@pytest.mark.parametrize("key, stages", [("bert", 4), ("gpt12", 2)])
def test_ordering_edges_do_not_change_the_optimum(key, stages):
    """Without the ordering edges the problem can only underprice (a plan with a reader after the
    priced one pays less than it sends), so its optimum is a lower bound on the true one, and the
    optimum with them an upper bound: equal optima prove the edges cost nothing here."""
    import dataclasses

    from partitioner.calibrate.priced_problem import build_problem
    from partitioner.config.cluster import ClusterSpec
    from partitioner.solver import Edge, SolverConfig, solve

    workload, gm = traced(key)
    regions_of(gm, "node")
    batch = workload.example_batch_size
    problem = build_problem(gm, batch)
    relaxed = dataclasses.replace(problem, edges=tuple(
        Edge(s, d, int(round(b / batch))) for s, d, b in passes.region_cut_edges(gm, order_readers=False)))
    assert len(relaxed.edges) < len(problem.edges)
    cluster = ClusterSpec.homogeneous(stages, "h100")
    config = SolverConfig(time_limit_s=20, total_time_limit_s=60)
    ordered, free = (solve(pr, cluster, 8, num_stages=stages, dp=1, microbatches=8, config=config)
                     for pr in (problem, relaxed))
    assert ordered.status == free.status == "OPTIMAL"
    slack = max(s.rounding_slack_units * s.time_unit_s for s in (ordered, free))
    assert abs(ordered.step_time_s - free.step_time_s) <= slack


class Ping(nn.Module):
    """A block whose ``attn`` child runs twice around ``mlp``: attn -> mlp -> attn is a cycle."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)

    def forward(self, x):
        return self.attn(self.mlp(self.attn(x)))


class PingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Ping() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_cyclic_grouping_is_merged_into_one_region():
    gm = trace(PingModel(), (torch.zeros(2, 8),)).gm
    passes.run_all(gm, granularity="sublayer")
    table = passes.region_table(gm)
    assert [r.name for r in table] == ["block.0.attn+block.0.mlp", "block.1.attn+block.1.mlp"]
    assert table[0].layer == 0
    check_partition_and_dag(gm, table)


def test_model_without_repeated_blocks_uses_top_level_children():
    model = nn.Sequential()  # numbered children are blocks too
    model.add_module("0", nn.Linear(4, 4))
    model.add_module("1", nn.ReLU())

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = nn.Linear(4, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.decoder(torch.relu(self.encoder(x)))

    gm = trace(Plain(), (torch.zeros(2, 4),)).gm
    passes.run_all(gm)
    table = passes.region_table(gm)
    assert [r.name for r in table] == ["encoder", "decoder"]
    check_partition_and_dag(gm, table)
    gm = trace(model, (torch.zeros(2, 4),)).gm
    passes.run_all(gm)
    assert [r.name for r in passes.region_table(gm)] == ["block.0", "block.1"]


def test_unknown_granularity_is_refused():
    _, gm = traced("mlp")
    with pytest.raises(ValueError, match="granularity"):
        passes.annotate_regions(gm, granularity="layer")


def test_region_table_needs_the_cost_passes():
    workload = models.mlp(features=4, hidden=4, depth=1, outputs=2)
    gm = trace(workload.model, workload.example_args).gm
    passes.annotate_regions(gm)
    with pytest.raises(ir.MissingMetaError, match="passes.shapes.annotate_shapes|passes.flops.annotate_flops"):
        passes.region_table(gm)
