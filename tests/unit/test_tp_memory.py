"""What each member of a tensor group holds, counted by hand: the boundary tensors whole (Note
[boundary holders] in partitioner/solver/tensor_groups.py), the backward transient split as the
tensors are (Note [sharded transients] in passes/tp_activations.py, on the built-in GPT's block).

Sharded transients:
Per microbatch of b samples, width h, sequence s, fp32 (4 bytes), narrow = b s h 4, wide = b s 4h 4.
The block's largest transient is the GELU's backward: the residual gradient waiting for the
block's end (narrow, whole) + the GELU output's gradient arriving from the row linear (wide) + the
gradient it makes for its input (wide) + its own temporary (wide): narrow + 3 wide, the wide part
split (the MLP's 4h features between the column and the row linear). The largest whole part of
any node's transient is the second residual add's: its output gradient, the two input gradients it
makes and its temporary, 4 narrow. So a member at degree t holds at most
4 narrow + (narrow + 3 wide - 4 narrow) / t, where main held all of narrow + 3 wide on every member.
"""

from __future__ import annotations

from partitioner import analyze
from partitioner.calibrate.priced_problem import build_problem
from partitioner.models.builtin import gpt
from partitioner.config.cluster import ClusterSpec
from partitioner.solver import Assignment, Edge, PartitionProblem, RegionCost, evaluate, place_stages
from partitioner.solver.tensor_groups import group_cluster, tp_problem
from passes.tp_activations import sharded_transient_bytes

H, S, B = 64, 32, 2


def test_a_tensor_group_holds_the_split_part_of_the_backward_transient_once():
    gm, _ = analyze(gpt(layers=1, width=H, heads=4, vocab=128, seq=S, attn="eager", dropout=0.0, batch=B))
    narrow, wide = B * S * H * 4, B * S * 4 * H * 4
    block = 1  # regions: embed, block.0, head
    assert sharded_transient_bytes(gm)[block] == (narrow + 3 * wide) - 4 * narrow
    problem = build_problem(gm, B)
    region = problem.regions[block]
    assert region.transient_bytes_per_sample * B == narrow + 3 * wide
    for t in (2, 4):
        group = tp_problem(problem, t).regions[block]
        per_member = group.transient_bytes_per_sample * B / t
        assert per_member == 4 * narrow + (narrow + 3 * wide - 4 * narrow) / t
        assert per_member < region.transient_bytes_per_sample * B  # main: all of it on every member


def test_every_member_holds_the_whole_boundary_tensor():
    """Two regions on two stages of a tensor group of 4: per member, stage 0 keeps its output for
    every microbatch in flight, stage 1 its received input, and each two receive buffers in flight
    (Note [receive buffers in flight]): the edge's bytes each, whole on every member (each runs its
    own pipeline), where main counted 1/4 of them."""
    edge, m, b, t = 3 << 20, 4, 2, 4
    regions = tuple(RegionCost(f"r{i}", 1e9, 2e9, 1 << 20, 1 << 20, 2 << 20, 1 << 20, 1 << 18) for i in range(2))
    problem = tp_problem(PartitionProblem(regions, (Edge(0, 1, edge),)), t)
    assert problem.boundary_holders == t
    cluster = group_cluster(ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 2 * t, "devices_per_node": t}]}), t)
    st0, st1 = evaluate(problem, cluster, Assignment((0, 1), (False, False), place_stages(cluster, 2, 1), 2, 1, m, b,
                                                     "1f1b")).stages
    in_flight = 2  # 1F1B, stage 0 of 2
    saved = regions[0].activation_bytes_per_sample * t  # tp_problem: every member holds it whole
    assert st0.activations_bytes / t == (in_flight * b * (saved + t * edge)) / t == in_flight * b * (saved / t + edge)
    assert st0.buffers_bytes / t == st1.buffers_bytes / t == 2 * b * edge
    saved1 = regions[1].activation_bytes_per_sample * t
    assert st1.activations_bytes / t == 1 * b * (saved1 / t + edge)  # 1F1B: one in flight on the last stage
