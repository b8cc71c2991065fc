"""Which device runs each (stage, replica) of a candidate, and the links its pipeline boundaries,
all-reduces and tied parameters cross: the layout every pricer (evaluate.py, the CP-SAT model, the
bounds, chain_dp.py) and the checker read a placement by (Note [rank layout] in solution.py).
Plain numbers, no torch."""

from __future__ import annotations

from partitioner.config.cluster import ClusterSpec, LinkSpec

__all__ = ["SAME_DEVICE", "place_stages", "plan_links"]


def place_stages(
    cluster: ClusterSpec, num_stages: int, dp: int, stage_classes: "list[tuple] | None" = None, *,
    local_stages: int = 1, position_of=None,
) -> tuple[tuple[int, ...], ...]:
    """Devices for every (stage, replica) (Note [rank layout] in solution.py).

    Homogeneous (``stage_classes`` None): rank order = device order, so stage s replica r runs on
    device s * dp + r. Heterogeneous: ``stage_classes[s]`` is the ``DeviceSpec.device_class`` of
    stage s; each class's devices are handed out in (node, index) order, stage by stage, so a
    stage's replicas share a node whenever the class has dp devices on one node. Interleaved
    (``local_stages`` v > 1, one device class): stage s runs on the devices of pipeline position
    s % (p / v), so the rows repeat every p / v stages; ``position_of(stage, ranks)`` overrides
    that position (the V schedules: runtime/program/schedules.py).
    """
    if local_stages > 1:
        if stage_classes is not None:
            raise ValueError("interleaved placement is on one device class only (Note [interleaved pricing])")
        ranks = num_stages // local_stages
        if ranks * dp > cluster.num_devices:
            raise ValueError(f"{ranks} pipeline ranks * dp {dp} exceeds the cluster's {cluster.num_devices} devices")
        position = position_of or (lambda s, pp: s % pp)
        return tuple(tuple(position(s, ranks) * dp + r for r in range(dp)) for s in range(num_stages))
    if num_stages * dp > cluster.num_devices:
        raise ValueError(
            f"num_stages * dp = {num_stages} * {dp} = {num_stages * dp} exceeds the cluster's "
            f"{cluster.num_devices} devices"
        )
    if stage_classes is None:
        return tuple(tuple(s * dp + r for r in range(dp)) for s in range(num_stages))
    free: dict[tuple, list[int]] = {}
    for i, device in sorted(enumerate(cluster.devices), key=lambda item: (item[1].node, item[0])):
        free.setdefault(device.device_class, []).append(i)
    placement = []
    for s, device_class in enumerate(stage_classes):
        pool = free.get(device_class, [])
        if len(pool) < dp:
            raise ValueError(f"stage {s} needs {dp} devices of class {device_class}, only {len(pool)} left")
        placement.append(tuple(pool[:dp]))
        del pool[:dp]
    return tuple(placement)


SAME_DEVICE = LinkSpec(bandwidth_bytes_per_s=1e30, latency_s=0.0)  # a boundary within one rank: no transfer


def plan_links(
    cluster: ClusterSpec, placement: tuple[tuple[int, ...], ...]
) -> tuple[list[LinkSpec], list[LinkSpec | None], LinkSpec | None]:
    """(boundary links, data-parallel link per stage, tie link) of a placement (Note [cost model] in evaluate.py).

    Boundary k joins stage k and k + 1: the slowest link between them over the replicas; none
    (``SAME_DEVICE``) where both stages are on one device (zbv's turn of the V: torch hands the
    output over in memory, no send).
    Stage s's all-reduce: the slowest link among its replicas (None when dp = 1). Ties: the
    slowest link within one replica's pipeline, worst over replicas (None for one stage).
    """
    key = ("plan_links", tuple(map(tuple, placement)))  # Note [cluster queries are cached] in partitioner/config/cluster.py
    known = cluster.memo.get(key)
    if known is None:
        known = cluster.memo[key] = _plan_links(cluster, placement)
    boundary, dp_links, tie_link = known
    return list(boundary), list(dp_links), tie_link  # copies: a caller's edits stay its own


def _plan_links(cluster: ClusterSpec, placement: tuple[tuple[int, ...], ...]):
    num_stages, dp = len(placement), len(placement[0])
    boundary = [
        max(
            (SAME_DEVICE if placement[k][r] == placement[k + 1][r]
             else cluster.link_between(placement[k][r], placement[k + 1][r]) for r in range(dp)),
            key=lambda link: (1.0 / link.bandwidth_bytes_per_s, link.latency_s),
        )
        for k in range(num_stages - 1)
    ]
    dp_links = [cluster.allreduce_link(list(row)) for row in placement]  # Note [collectives as NCCL runs them]
    tie_link = None
    for r in range(dp):
        link = cluster.slowest_link([placement[s][r] for s in range(num_stages)])
        if link is not None and (tie_link is None or link.bandwidth_bytes_per_s < tie_link.bandwidth_bytes_per_s):
            tie_link = link
    return boundary, dp_links, tie_link
