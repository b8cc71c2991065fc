"""Every distinct way to put a candidate's stages on a heterogeneous cluster's devices.

Note [exact placements]
    On a heterogeneous cluster a plan's cost depends on which devices run each stage: their class
    and their nodes (every link is intra- or inter-node). Two devices of one class on one node are
    interchangeable, so a placement is, up to cost, a grid of (class, node) labels, one per (stage,
    replica), a stage's replicas of one class; replicas as whole columns and nodes holding the same
    devices are interchangeable too, which keeps the list short without losing a cost. Only
    placements torchrun can launch are listed (``is_launchable``): a node gets a contiguous block
    of ranks and runs local rank k on its k-th device, so a grid such as H100, A100, H100, A100
    over two nodes is not searched. ``solve_candidate`` solves one CP-SAT model per placement, with
    exact links and core sharing, and keeps the best: OPTIMAL then means optimal over every
    placement, not over classes priced at an assumed link. Past ``limit`` placements the caller
    falls back to the relaxation in placement_relaxation.py.
"""

from __future__ import annotations

from partitioner.config.cluster import ClusterSpec, LinkSpec

__all__ = ["enumerate_placements", "fastest_link", "is_launchable", "placement_key"]

Label = tuple  # (device_class, node)


def fastest_link(cluster: ClusterSpec) -> LinkSpec:
    """A link no placement beats: the cluster's best bandwidth and best latency (on one node,
    the intra-node link itself; Note [heterogeneous devices] in model.py)."""
    links = [cluster.intra_node_link]
    if len({d.node for d in cluster.devices}) > 1:
        links.append(cluster.inter_node_link)
    return LinkSpec(max(link.bandwidth_bytes_per_s for link in links), min(link.latency_s for link in links))


def is_launchable(cluster: ClusterSpec, placement: tuple[tuple[int, ...], ...]) -> bool:
    """Whether torchrun can start ``placement`` (Note [exact placements]): every node's ranks
    consecutive, and rank a + k of a node whose first rank is a on a device of the class of the
    node's k-th device."""
    ranks = [i for row in placement for i in row]  # device of rank r = ranks[r]
    node_devices: dict[int, list[int]] = {}
    for i, device in enumerate(cluster.devices):
        node_devices.setdefault(device.node, []).append(i)
    seen: dict[int, list[int]] = {}
    for rank, i in enumerate(ranks):
        seen.setdefault(cluster.devices[i].node, []).append(rank)
    for node, node_ranks in seen.items():
        if node_ranks != list(range(node_ranks[0], node_ranks[0] + len(node_ranks))):
            return False
        local = node_devices[node]
        for k, rank in enumerate(node_ranks):
            if cluster.devices[ranks[rank]].device_class != cluster.devices[local[k]].device_class:
                return False
    return True


def _groups(cluster: ClusterSpec) -> dict[Label, list[int]]:
    groups: dict[Label, list[int]] = {}
    for i, device in enumerate(cluster.devices):
        groups.setdefault((device.device_class, device.node), []).append(i)
    return groups


def _node_signature(cluster: ClusterSpec) -> dict[int, tuple]:
    """What a node holds (its cores, then (class, count) sorted): equal signatures are interchangeable."""
    held: dict[int, dict] = {}
    cores: dict[int, int | None] = {}
    for device in cluster.devices:
        counts = held.setdefault(device.node, {})
        counts[device.device_class] = counts.get(device.device_class, 0) + 1
        cores[device.node] = device.cores
    return {node: (cores[node], tuple(sorted(counts.items()))) for node, counts in held.items()}


def placement_key(cluster: ClusterSpec, labels: tuple[tuple[Label, ...], ...]) -> tuple:
    """A canonical form of a label grid under the symmetries of Note [exact placements]:
    replica columns sorted, and nodes of equal signature renamed in order of first use."""
    signature = _node_signature(cluster)
    columns = sorted(tuple(row[r] for row in labels) for r in range(len(labels[0])))
    renamed: dict[int, tuple] = {}
    seen: dict[tuple, int] = {}
    for column in columns:
        for _, node in column:
            if node not in renamed:
                sig = signature[node]
                renamed[node] = (sig, seen.get(sig, 0))
                seen[sig] = seen.get(sig, 0) + 1
    return tuple(tuple((c, renamed[node]) for c, node in column) for column in columns)


def enumerate_placements(
    cluster: ClusterSpec, num_stages: int, dp: int, *, limit: int = 64,
) -> list[tuple[tuple[int, ...], ...]] | None:
    """One placement (device index per stage and replica, as Assignment.device_of_stage_replica)
    per class of equal-cost placements (Note [exact placements]); None when there are more than
    ``limit``; [] when the devices cannot hold p stages of d replicas of one class each."""
    groups = _groups(cluster)
    labels = sorted(groups)
    left = {label: len(groups[label]) for label in labels}
    found: dict[tuple, tuple[tuple[Label, ...], ...]] = {}
    visited = 0
    budget = 200 * limit  # raw grids walked before giving up (each is cheap)

    def stage_rows(device_class, r, row):
        """Every replica row of one stage, all of ``device_class``."""
        if r == dp:
            yield tuple(row)
            return
        for label in labels:
            if label[0] == device_class and left[label] > 0:
                left[label] -= 1
                row.append(label)
                yield from stage_rows(device_class, r + 1, row)
                row.pop()
                left[label] += 1

    def walk(s, grid):
        nonlocal visited
        if visited > budget or len(found) > limit:
            return
        if s == num_stages:
            visited += 1
            if is_launchable(cluster, _devices_of(groups, labels, grid)):
                found.setdefault(placement_key(cluster, tuple(grid)), tuple(grid))
            return
        for device_class in sorted({label[0] for label in labels}):
            for row in stage_rows(device_class, 0, []):  # holds the row's devices while it yields
                grid.append(row)
                walk(s + 1, grid)
                grid.pop()

    walk(0, [])
    if visited > budget or len(found) > limit:
        return None
    return sorted(_devices_of(groups, labels, grid) for grid in found.values())


def _devices_of(groups, labels, grid) -> tuple[tuple[int, ...], ...]:
    """Device indices for a label grid: each label's devices in index order, in rank order (so
    a node's ranks take its devices in local order)."""
    free = {label: list(groups[label]) for label in labels}
    return tuple(tuple(free[label].pop(0) for label in row) for row in grid)
