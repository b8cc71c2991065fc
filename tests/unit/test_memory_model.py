"""The memory model (Note [memory model] in partitioner/solver/evaluate.py): each term where it
belongs, the ILP equal to the checker with every term in play, the usable-memory override of a
cluster file, and one real stage whose measured peak stays under the prediction."""

import itertools
import random

import pytest
import torch
import torch.nn as nn

from passes import ir
from partitioner.config.cluster import GIB, ClusterSpec
from partitioner.solver import Assignment, Edge, PartitionProblem, RegionCost, SolverConfig, evaluate, place_stages
from partitioner.solver import solve_candidate
from partitioner.solver.chain_dp import chain_lower_bound_s
from partitioner.solver.bounds import candidate_lower_bound_s
from partitioner.solver.check import structural_violations

MIB = 2**20


def chain(num_regions=4, *, act=MIB, transient=0, edge=MIB // 4, grads=MIB, **problem_kw):
    regions = tuple(RegionCost(f"r{i}", 1e9, 2e9, grads, grads, 2 * grads, act, act // 8,
                           transient_bytes_per_sample=transient * (i + 1)) for i in range(num_regions))
    edges = tuple(Edge(i, i + 1, edge) for i in range(num_regions - 1))
    return PartitionProblem(regions, edges, **problem_kw)


def cost(problem, *, stages, p, d=1, m=4, b=2, recompute=None, schedule="1f1b"):
    cluster = ClusterSpec.homogeneous(p * d)
    a = Assignment(stages, recompute or (False,) * problem.num_regions, place_stages(cluster, p, d), p, d, m, b,
                   schedule)
    return evaluate(problem, cluster, a)


def test_receive_buffers_live_only_in_flight():
    """Note [receive buffers in flight] in runtime/execute/recv_buffers.py: whatever the microbatch
    count, two of each way beyond the received inputs held in flight; every rank builds the batch."""
    problem = chain(input_bytes_per_sample=100, target_bytes_per_sample=50)
    edge, b = MIB // 4, 2
    for m in (2, 8):
        st0, st1 = cost(problem, stages=(0, 0, 1, 1), p=2, m=m, b=b).stages
        assert st0.buffers_bytes == 2 * b * edge + m * b * 150  # gradients being received
        assert st1.buffers_bytes == 2 * b * edge + m * b * 150  # an input ahead, the input gradient sent
        # the received inputs of the microbatches in flight (1F1B: 1 on the last stage), held to their backward
        assert st1.activations_bytes == 1 * b * (2 * MIB + edge)


def test_transient_is_the_largest_region_not_the_sum_and_grows_with_recompute():
    problem = chain(transient=MIB)  # region i has (i + 1) MiB per sample
    b = 2
    st0, st1 = cost(problem, stages=(0, 0, 1, 1), p=2, b=b).stages
    assert st0.transient_bytes == b * 2 * MIB and st1.transient_bytes == b * 4 * MIB
    recomputed = cost(problem, stages=(0, 0, 1, 1), p=2, b=b, recompute=(True, False, False, False)).stages[0]
    # region 0 recomputed: its rerun forward's activations (1 MiB) join its transient (1 MiB)
    assert recomputed.transient_bytes == b * 2 * MIB
    recomputed = cost(problem, stages=(0, 0, 1, 1), p=2, b=b, recompute=(False, True, False, False)).stages[0]
    assert recomputed.transient_bytes == b * (2 + 1) * MIB
    assert recomputed.memory_bytes == (recomputed.params_bytes + recomputed.grads_bytes + recomputed.optimizer_bytes
                                       + recomputed.buffers_bytes + recomputed.activations_bytes
                                       + recomputed.transient_bytes)


def test_parameter_gradients_in_the_transient_do_not_scale_with_the_microbatch():
    region = RegionCost("r", 1e9, 2e9, MIB, MIB, 2 * MIB, MIB, MIB // 8, transient_bytes_per_sample=MIB,
                    transient_fixed_bytes=3 * MIB)
    assert region.transient_bytes(1, False) == 4 * MIB and region.transient_bytes(4, False) == 7 * MIB
    assert region.transient_bytes(4, True) == 4 * (MIB + MIB) + 3 * MIB


def test_outputs_and_received_inputs_are_held_until_their_backward():
    problem = chain(act=0)
    st0, st1 = cost(problem, stages=(0, 0, 1, 1), p=2, m=4, b=2).stages
    assert st0.activations_bytes == 2 * 2 * MIB // 4  # 1F1B: 2 in flight x b x the cut (its outputs)
    assert st1.activations_bytes == 1 * 2 * MIB // 4  # 1 in flight x b x the cut (its received inputs)


def test_dp_all_reduce_bucket_is_min_of_grads_and_bucket():
    small = chain(grads=MIB, allreduce_bucket_bytes=3 * MIB)
    one = cost(small, stages=(0, 0, 1, 1), p=2, d=1).stages[0]
    two = cost(small, stages=(0, 0, 1, 1), p=2, d=2).stages[0]
    assert one.step_buffers_bytes == 0
    assert two.step_buffers_bytes == 2 * MIB  # the stage's gradients, under the bucket
    assert cost(small, stages=(0, 0, 0, 1), p=2, d=2).stages[0].step_buffers_bytes == 3 * MIB
    # the step phase is after the schedule: it competes with activations, it does not add to them
    assert two.memory_bytes == (two.params_bytes + two.grads_bytes + two.optimizer_bytes + two.buffers_bytes
                                + max(two.activations_bytes + two.transient_bytes, two.step_buffers_bytes))


def _random_problem(seed: int, n: int) -> PartitionProblem:
    rng = random.Random(seed)
    regions = []
    for i in range(n):
        static = rng.randint(1, 4) * MIB
        act = rng.randint(0, 3) * MIB
        regions.append(RegionCost(f"r{i}", rng.uniform(0.5, 3) * 1e9, rng.uniform(1, 6) * 1e9, static // 4,
                              static // 4, static // 2, act, act // 4,
                              transient_bytes_per_sample=rng.randint(0, 4) * MIB))
    edges = tuple(Edge(i, i + 1, rng.randint(0, 3) * MIB // 4) for i in range(n - 1))
    return PartitionProblem(tuple(regions), edges, input_bytes_per_sample=rng.randint(0, 2) * MIB // 8,
                            target_bytes_per_sample=rng.randint(0, 2) * MIB // 8,
                            allreduce_bucket_bytes=rng.randint(1, 3) * MIB,
                            boundary_holders=rng.randint(1, 3))  # Note [boundary holders]


@pytest.mark.parametrize("seed", range(4))
def test_ilp_equals_exhaustive_checker_with_every_memory_term(seed):
    """Transients (max, recompute adding its activations), receive buffers, held outputs, the
    batch and the dp bucket disjunction: the ILP's optimum is the best plan ``evaluate`` fits."""
    n, p, d, m = 5, 2, 1 + seed % 2, 4
    problem = _random_problem(200 + seed, n)

    def plans(cluster, recompute_options):
        placement = place_stages(cluster, p, d)
        out = []
        for stages in itertools.product(range(p), repeat=n):
            for recompute in recompute_options:
                a = Assignment(stages, recompute, placement, p, d, m, 1, "1f1b")
                if structural_violations(problem, cluster, a):
                    break
                c = evaluate(problem, cluster, a)
                out.append((c.step_time_s, max(st.memory_bytes for st in c.stages)))
        return out

    def cluster_with(memory):
        return ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": p * d, "devices_per_node": d,
                                                 "memory_bytes": memory}]})

    free = plans(cluster_with(2**50), [(False,) * n])
    capacity = int(sorted(peak for _, peak in free)[1])  # memory binds: almost nothing fits
    every = plans(cluster_with(capacity), list(itertools.product((False, True), repeat=n)))
    best = min((t for t, peak in every if peak <= capacity), default=None)
    solution, status, _ = solve_candidate(problem, cluster_with(capacity), num_stages=p, dp=d, num_microbatches=m,
                                          global_batch=d * m, config=SolverConfig(time_limit_s=10))
    if best is None:
        assert solution is None
        return
    assert status == "OPTIMAL"
    assert solution.step_time_s == pytest.approx(best, rel=1e-5)
    # the bounds that prune the enumeration stay below every fitting plan
    cluster = cluster_with(capacity)
    assert candidate_lower_bound_s(problem, cluster, num_stages=p, dp=d, num_microbatches=m, microbatch_size=1,
                                   schedule="1f1b") <= best * (1 + 1e-9)
    if d == 1:
        assert chain_lower_bound_s(problem, cluster, num_stages=p, num_microbatches=m, microbatch_size=1,
                                   schedule="1f1b", placement=place_stages(cluster, p, 1)) <= best * (1 + 1e-9)


def test_cluster_file_overrides_usable_memory(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text('[[group]]\nkind = "h100"\ncount = 2\nusable_memory_fraction = 0.9\nmemory_reserve_gib = 2\n'
                    '[[group]]\nkind = "a100-40gb"\ncount = 2\nnode = 1\n')
    cluster = ClusterSpec.from_toml(path)
    h100, a100 = cluster.devices[0], cluster.devices[2]
    assert h100.usable_memory_bytes == int(80 * GIB * 0.9) - 2 * GIB
    assert a100.usable_memory_bytes == int(40 * GIB * 0.95) - GIB  # the preset's headroom
    assert ClusterSpec.homogeneous(1, "cpu").devices[0].usable_memory_bytes == 16 * GIB
    assert ClusterSpec.from_dict(cluster.to_dict()) == cluster


@pytest.mark.parametrize("group, words", [
    ({"usable_memory_fraction": 1.5}, ["usable_memory_fraction=1.5", "(0, 1]", "e.g."]),
    ({"memory_reserve_gib": -1}, ["memory_reserve_gib=-1", ">= 0", "e.g."]),
    ({"memory_reserve_bytes": "1G"}, ["memory_reserve_bytes='1G'", "int >= 0"]),
    ({"memory_reserve_gib": 1, "memory_reserve_bytes": 5}, ["both", "keep one"]),
    ({"memory_gib": 1, "memory_reserve_gib": 2}, ["leaves nothing", "lower the reserve"]),
])
def test_bad_usable_memory_in_a_cluster_file_names_the_value_and_the_fix(group, words):
    with pytest.raises(ValueError) as info:
        ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 1, **group}]})
    for word in words:
        assert word in str(info.value)


class _Tiny(nn.Module):
    """Embedding, two MLP blocks with residuals, a wide head: a small LM-shaped model."""

    def __init__(self, vocab=512, width=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_last_stage_carries_the_loss_and_a_real_stage_stays_under_its_prediction():
    """Trace a tiny LM, split it in two, train stage 1 for a step as the runtime does (an
    activation and a gradient buffer per microbatch... here the last stage: activation buffers,
    1F1B with one microbatch in flight, cross entropy, fused AdamW) and measure the live bytes:
    the plan's prediction must not be below it."""
    from partitioner.calibrate import LiveBytes
    from partitioner.frontend.analysis import annotate
    from partitioner.calibrate.priced_problem import build_problem
    from partitioner.codegen.split import split_graph
    from partitioner.frontend.trace import trace
    from runtime.data.synthetic import causal_lm_loss
    from runtime.execute.train import make_optimizer

    torch.manual_seed(0)
    model, b, seq, m, p = _Tiny(), 2, 16, 4, 2
    tokens = torch.randint(0, 512, (b, seq))
    gm = annotate(trace(model, (tokens,)), granularity="block", loss_outside_graph=True)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    logits = b * seq * 512
    assert ir.get(output, ir.MEMORY).held_bytes == 4 * logits + 4 * logits  # the logits + their float copy
    assert ir.get(output, ir.MEMORY).bwd_transient_bytes == 8 * logits
    problem = build_problem(gm, b, target_bytes=b * seq * 8)
    assert problem.regions[-1].activation_bytes_per_sample >= 8 * logits // b

    stage_of_region = tuple(0 if r.name in ("embed", "block.0") else 1 for r in problem.regions)
    cluster = ClusterSpec.homogeneous(p)
    assignment = Assignment(stage_of_region, (False,) * problem.num_regions, place_stages(cluster, p, 1), p, 1, m,
                            b, "1f1b")
    predicted = evaluate(problem, cluster, assignment).stages[1]
    assert predicted.transient_bytes >= b * 8 * logits // b

    region_of = {n.name: ir.get(n, ir.REGION).region_id for n in gm.graph.nodes}
    node_stage = {name: stage_of_region[rid] for name, rid in region_of.items()}
    stage0, stage1 = (sg.gm for sg in split_graph(gm, node_stage, p))
    with torch.no_grad():
        sent = stage0(tokens)
    sent = sent if isinstance(sent, tuple) else (sent,)
    params = list(stage1.parameters())
    optimizer, _ = make_optimizer(params, {"lr": 1e-3})

    def step():
        targets = torch.randint(0, 512, (m * b, seq)).tensor_split(m)  # every rank builds the batch
        recv = [[x.clone().requires_grad_(x.dtype.is_floating_point) for x in sent] for _ in range(m)]
        for j in range(m):  # the last stage of 1F1B: one microbatch in flight
            loss = causal_lm_loss(stage1(*recv[j]), targets[j])
            loss.backward()
            grads = [x.grad for x in recv[j]]  # the input gradient, sent back
            for x in recv[j]:
                x.grad = None
            del loss, grads
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on
    mode = LiveBytes()
    existing = params + [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    mode.already_counted(existing + list(sent))  # their views are no new storage
    with mode:
        step()
    static = sum(t.numel() * t.element_size() for t in existing if t.dim() > 0)
    measured = static + mode.peak
    assert predicted.memory_bytes >= measured, (predicted, measured)
    assert predicted.memory_bytes <= 1.5 * measured  # conservative, not absurd
