"""The memory model at depth, held against a hand count of the layout Korthikanti et al. 2022
(arXiv 2205.05198) trained their 1T GPT in: 128 layers, hidden h = 25600, 160 heads, sequence
s = 2048, tp 8 x pp 64 on 512 A100-80GB, dp 1, global batch 512 in microbatches of 1, every layer
recomputed, 1F1B (issue 44 item 4).

Per GPU of the stage at depth 1 (two layers, 63 microbatches in flight), with their formulas as the
reference:
- model state: a layer has 12 h^2 + 13 h parameters, 12 h^2 + 7 h of them split over tp; each
  parameter costs 4 (fp32 master) + 2 (autocast's fp16 copy) + 4 (fp32 gradient) + 8 (AdamW) =
  18 bytes, Megatron's 18 (2 fp16 + 4 fp32 gradient + 4 master + 8 Adam): 33 GiB for two layers;
- activations in flight (full recompute: Korthikanti's 2 s b h bytes per layer at 2 bytes an
  element): ours keeps the layer input in fp32 (torch autocast leaves the residual stream fp32),
  4 s b h per layer, and PipelineStage keeps the stage's output and its received input until their
  backward (Megatron frees the output's data after the send); the received input is also the first
  layer's saved input, counted twice (conservative): 63 x 4 x 4 s h = 49.2 GiB;
- receive buffers: only those in flight (Note [receive buffers in flight] in
  runtime/execute/recv_buffers.py), two each way, 0.8 GiB, where torch's PipelineStage alone keeps
  one per microbatch each way, 512 x 2 x 4 s h = 200 GiB a GPU; every member of the tensor group
  holds the whole tensor (Note [boundary holders] in partitioner/solver/tensor_groups.py).
So two layers do not fit at depth 1 (85 GiB with the rerun layer's activations, of 75 usable); one
layer does, and two from depth 18 on, three from depth 44 on: the solver's uneven split.
"""

from __future__ import annotations

from partitioner.config.cluster import ClusterSpec
from partitioner.solver import Assignment, Edge, PartitionProblem, RegionCost, evaluate, place_stages
from partitioner.solver.problem import TensorParallelCost
from partitioner.solver.tensor_groups import group_cluster, tp_problem

H, S, LAYERS, TP, PP, M = 25600, 2048, 128, 8, 64, 512
GIB = 2**30
TOKENS = 8 * S  # int64 token ids (and as many targets) per sample


def layer() -> RegionCost:
    params, split = 12 * H * H + 13 * H, 12 * H * H + 7 * H
    return RegionCost("block", 1.0, 2.0, param_bytes=6 * params, grad_bytes=4 * params, optimizer_bytes=8 * params,
                      activation_bytes_per_sample=34 * S * H, recompute_activation_bytes_per_sample=4 * S * H,
                      tp=TensorParallelCost(sharded_param_bytes=6 * split))


def test_the_1t_layout_per_gpu_by_hand():
    regions = tuple(layer() for _ in range(LAYERS))
    problem = tp_problem(PartitionProblem(regions, tuple(Edge(i, i + 1, 4 * S * H) for i in range(LAYERS - 1)),
                                          input_bytes_per_sample=TOKENS, target_bytes_per_sample=TOKENS), TP)
    cluster = group_cluster(ClusterSpec.from_dict({"group": [{"kind": "a100-80gb", "count": TP * PP,
                                                             "devices_per_node": 8}]}), TP)
    stage_of = (0,) + tuple(1 + (i - 1) // 2 for i in range(1, 127)) + (PP - 1,)  # 1, 2 x 62, 1 layers
    a = Assignment(stage_of, (True,) * LAYERS, place_stages(cluster, PP, 1), PP, 1, M, 1, "1f1b")
    st = evaluate(problem, cluster, a).stages[1]
    per_gpu = {k: getattr(st, k) / TP for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                  "activations_bytes", "buffers_bytes")}
    per_layer = (12 * H * H + 7 * H) / TP + 6 * H  # parameters a member holds
    assert per_gpu["params_bytes"] == 2 * 6 * per_layer
    assert per_gpu["grads_bytes"] == 2 * 4 * per_layer
    assert per_gpu["optimizer_bytes"] == 2 * 8 * per_layer
    assert round((per_gpu["params_bytes"] + per_gpu["grads_bytes"] + per_gpu["optimizer_bytes"]) / GIB) == 33
    in_flight = PP - 1
    assert per_gpu["activations_bytes"] == in_flight * (2 * 4 * S * H + 4 * S * H + 4 * S * H)
    assert round(per_gpu["activations_bytes"] / GIB, 1) == 49.2
    assert per_gpu["buffers_bytes"] == 2 * (4 * S * H + 4 * S * H) + M * 2 * TOKENS
    assert round(per_gpu["buffers_bytes"] / GIB, 1) == 0.8 and st.capacity_bytes / TP / GIB == 75.0
    assert round(st.memory_bytes / TP / GIB) == 85 > 75
