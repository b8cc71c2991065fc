"""Random chains on heterogeneous multi-node clusters and their optimum by exhaustive search.

The reference is independent of the solver: every contiguous split (for a chain every valid plan
is contiguous) times every ordered choice of devices torchrun can start (all permutations, deduplicated only by the
exact (device class, node) of every slot), costed by the project's ``evaluate``."""

from __future__ import annotations

import itertools
import math
import random

from partitioner.config.cluster import ClusterSpec
from partitioner.solver import Assignment, Edge, PartitionProblem, RegionCost, evaluate

MIB = 2**20
GIB = 2**30


def het_cluster(per_node=2, memory_gib_a100=40, inter_gbytes_per_s=12.5) -> ClusterSpec:
    """``per_node`` x H100 on node 0, ``per_node`` x A100 on node 1."""
    return ClusterSpec.from_dict({
        "group": [{"kind": "h100", "count": per_node, "node": 0},
                  {"kind": "a100-40gb", "count": per_node, "node": 1, "memory_gib": memory_gib_a100}],
        "links": {"inter_node": {"bandwidth_gbytes_per_s": inter_gbytes_per_s, "latency_s": 2e-5}},
    })


def random_chain(seed: int, num_regions: int = 6) -> PartitionProblem:
    """Regions of uneven work and size joined by activations large enough that the inter-node
    link matters (a few GB/s against tens of TFLOP/s)."""
    rng = random.Random(seed)
    regions = []
    for i in range(num_regions):
        static = rng.randint(1, 40) * 64 * MIB
        act = rng.randint(1, 20) * 16 * MIB
        regions.append(RegionCost(f"r{i}", rng.uniform(0.2, 4) * 1e12, rng.uniform(0.4, 8) * 1e12,
                                  static // 4, static // 4, static // 2, act, act))
    edges = [Edge(i, i + 1, rng.randint(1, 64) * 4 * MIB) for i in range(num_regions - 1)]
    return PartitionProblem(tuple(regions), tuple(edges))


def contiguous_splits(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0,) + cuts + (n,)
        yield tuple(s for s in range(p) for _ in range(bounds[s], bounds[s + 1]))


def torchrun_can_start(cluster: ClusterSpec, devices) -> bool:
    """torchrun hands each node a block of consecutive ranks, and rank r runs on cuda:LOCAL_RANK:
    the k-th rank of a node's block must run on the node's k-th device."""
    on_node = {}
    for rank, i in enumerate(devices):
        on_node.setdefault(cluster.devices[i].node, []).append((rank, i))
    for node, pairs in on_node.items():
        local = [i for i, dev in enumerate(cluster.devices) if dev.node == node]
        ranks = [r for r, _ in pairs]
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            return False
        if [i for _, i in pairs] != local[:len(pairs)]:
            return False
    return True


def device_orders(cluster: ClusterSpec, p: int, d: int):
    """Every (stage, replica) -> device grid torchrun can start, one per distinct grid of
    (class, node) labels."""
    seen = set()
    label = [(dev.device_class, dev.node) for dev in cluster.devices]
    for devices in itertools.permutations(range(cluster.num_devices), p * d):
        grid = tuple(tuple(devices[s * d:(s + 1) * d]) for s in range(p))
        if any(len({cluster.devices[i].device_class for i in row}) > 1 for row in grid):
            continue
        if not torchrun_can_start(cluster, devices):
            continue
        key = tuple(tuple(label[i] for i in row) for row in grid)
        if key not in seen:
            seen.add(key)
            yield grid


def exhaustive_optimum(problem, cluster, *, p, d, m, b, schedule="1f1b") -> float:
    """The smallest ``evaluate`` step time over every contiguous split and device grid that fits
    memory (no recompute); inf when none fits."""
    best = math.inf
    for grid in device_orders(cluster, p, d):
        for split in contiguous_splits(problem.num_regions, p):
            cost = evaluate(problem, cluster, Assignment(split, (False,) * problem.num_regions, grid, p, d, m, b,
                                                         schedule))
            if cost.fits_memory and cost.step_time_s < best:
                best = cost.step_time_s
    return best
