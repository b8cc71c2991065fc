"""The machines a plan runs on: devices (memory, speed, node) and the links between them.

No torch import: the solver and its tests take a ClusterSpec as plain numbers.

Device kinds and their presets: partitioner/config/device_presets.py (Notes [device presets],
[usable memory], [flops per dtype]). One device and one link: partitioner/config/device_link_specs.py.

Note [collectives as NCCL runs them]
    A data-parallel all-reduce is priced as one ring over an equivalent link
    (``ClusterSpec.allreduce_link``), so every pricer keeps its one formula
    2 (d - 1) (S / d / bandwidth + latency):
    * on one node, the intra-node link; on cpu devices (gloo's flat ring), the slowest link;
    * across nodes on accelerators, hierarchically, as NCCL's rings and trees over NVLink and one
      NIC per GPU run it: a reduce-scatter among the g members of each node, an all-reduce of the
      1/g slice between the n nodes, an all-gather within the node:
          S (2 (g - 1) / g / intra_bw + 2 (n - 1) / n / g / inter_bw),  2 (g-1) + 2 (n-1) latencies;
      with one member per node (tensor parallelism fills the node), a ring over the NICs;
    * ``collective_lanes``: a device that is a tensor group of tp GPUs (``group_cluster``) holds
      tp times one member's gradients, and each member all-reduces its own with its peers in the
      other groups, at once, on its own link: the equivalent bandwidth is tp times one link's.
    Pipeline sends keep the link between the two devices (``link_between``): each member of a
    tensor group sends its own copy of a boundary, in parallel with the others.

Note [core sharing]
    A ``cpu`` device is a process computing on its node's cores, and every rank placed on that
    node shares them: 4 ranks on a 2-core machine each get half a core, whatever the plan says.
    ``DeviceSpec.cores`` is that node's core count (None for an accelerator, whose compute does
    not run on the host's cores). It defaults to ``os.cpu_count()`` of the compiling machine for
    the ``cpu`` kind (``ClusterSpec.homogeneous(..., cores=N)`` or ``cores = N`` in a cluster
    file's group overrides it). The time model divides by it: see ``core_sharing_factor`` in
    partitioner/solver/problem.py.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "DeviceSpec",
    "LinkSpec",
    "ClusterSpec",
    "DevicePreset",
    "DEVICE_PRESETS",
    "DEFAULT_LINKS",
    "GIB",
    "resolve_kind",
    # the cpu kind's fixed costs, re-exported: the presets are part of this module's interface
    "CPU_DTENSOR_OP_S", "CPU_MICROBATCH_OVERHEAD_S", "CPU_RECOMPUTE_FIXED_S", "CPU_TP_COLLECTIVE_S", "CPU_TP_SKEW",
    "FLOPS_PER_S_BY_DTYPE",
]

from runtime.file_trust import JSON_CAP, read_bounded
from partitioner.config.device_link_specs import DEFAULT_LINKS, DeviceSpec, LinkSpec, _default_name
from partitioner.config.device_presets import (
    CPU_DTENSOR_OP_S, CPU_MICROBATCH_OVERHEAD_S, CPU_RECOMPUTE_FIXED_S, CPU_TP_COLLECTIVE_S, CPU_TP_SKEW,
    DEVICE_PRESETS, FLOPS_PER_S_BY_DTYPE, GIB, _KIND_ALIASES, DevicePreset, default_cores, resolve_kind,
)


@dataclass(frozen=True)
class ClusterSpec:
    """Devices (index = position in ``devices``) and the two kinds of link that join them."""

    devices: tuple[DeviceSpec, ...]
    intra_node_link: LinkSpec
    inter_node_link: LinkSpec
    # Physical devices behind each device of this spec (partitioner/solver/tensor_groups.py
    # ``group_cluster``: a tensor group of tp): each runs its own share of a data-parallel
    # collective on its own link at once (Note [collectives as NCCL runs them]).
    collective_lanes: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.collective_lanes, bool) or not isinstance(self.collective_lanes, int) \
                or self.collective_lanes < 1:
            raise ValueError(f"ClusterSpec.collective_lanes={self.collective_lanes!r} must be an int >= 1")
        if not isinstance(self.devices, tuple):
            object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices:
            raise ValueError("ClusterSpec.devices=() is empty: give at least one DeviceSpec")
        for i, device in enumerate(self.devices):
            if not isinstance(device, DeviceSpec):
                raise ValueError(f"ClusterSpec.devices[{i}]={device!r} must be a DeviceSpec")
        seen_names: dict[str, int] = {}
        for d in self.devices:  # counted in one pass: names.count per name was O(devices^2)
            seen_names[d.name] = seen_names.get(d.name, 0) + 1
        duplicates = sorted(n for n, k in seen_names.items() if k > 1)
        if duplicates:
            raise ValueError(f"ClusterSpec.devices has duplicate names {duplicates}: give each device its own name")
        for field_name in ("intra_node_link", "inter_node_link"):
            if not isinstance(getattr(self, field_name), LinkSpec):
                raise ValueError(f"ClusterSpec.{field_name}={getattr(self, field_name)!r} must be a LinkSpec")
        cores_of_node: dict[int, int] = {}
        for device in self.devices:
            if device.cores is None:
                continue
            seen = cores_of_node.setdefault(device.node, device.cores)
            if seen != device.cores:
                raise ValueError(f"node {device.node} is given {seen} and {device.cores} cores "
                                 f"({device.name}): give every cpu device of a node the same cores")

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def homogeneous(
        cls, num_devices: int, kind: str = "cpu", devices_per_node: int | None = None,
        cores: int | None = None,
    ) -> "ClusterSpec":
        """``num_devices`` identical preset devices, ``devices_per_node`` to a node (default 8;
        for ``cpu`` every device is a process on this one host). ``cores``: each node's CPU cores
        for the ``cpu`` kind (default this machine's; Note [core sharing])."""
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
            raise ValueError(f"num_devices={num_devices!r} must be an int >= 1")
        canonical = resolve_kind(kind)
        if devices_per_node is None:
            devices_per_node = num_devices if canonical == "cpu" else 8
        if isinstance(devices_per_node, bool) or not isinstance(devices_per_node, int) or devices_per_node < 1:
            raise ValueError(f"devices_per_node={devices_per_node!r} must be an int >= 1")
        preset = DEVICE_PRESETS[canonical]
        if cores is not None and canonical != "cpu":
            raise ValueError(f"cores={cores!r} is for cpu devices (Note [core sharing]); {canonical} computes on "
                             "its own: leave cores out")
        node_cores = cores if cores is not None else default_cores(canonical)
        devices = tuple(
            DeviceSpec(
                name=_default_name(canonical, i),
                kind=canonical,
                memory_bytes=preset.memory_bytes,
                flops_per_s=preset.flops_per_s,
                node=i // devices_per_node,
                usable_memory_fraction=preset.usable_memory_fraction,
                memory_reserve_bytes=preset.memory_reserve_bytes,
                cores=node_cores,
            )
            for i in range(num_devices)
        )
        intra, inter = DEFAULT_LINKS[canonical]
        return cls(devices=devices, intra_node_link=intra, inter_node_link=inter)

    @classmethod
    def from_toml(cls, path: str | Path) -> "ClusterSpec":
        """Read a cluster file (see ``from_dict`` for its keys); every error names the file."""
        data = read_toml(path, "cluster file")
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"cluster file {path}: {exc}") from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ClusterSpec":
        """Build from ``{"group": [...], "links": {...}}``.

        Each group: ``kind`` (a preset), ``count``, ``node`` (first node, default 0),
        optional ``devices_per_node`` (a group larger than it spills onto the next nodes),
        ``memory_gib`` or ``memory_bytes``, ``flops_per_s``, ``names`` (one per device),
        ``usable_memory_fraction`` and ``memory_reserve_gib`` or ``memory_reserve_bytes``
        (Note [usable memory]; default: the kind's preset, else 1.0 and 0).
        ``cores`` (each node's CPU cores; default this machine's for ``cpu``, none for
        accelerators; Note [core sharing]).
        Links: ``[links.intra_node]`` / ``[links.inter_node]`` with ``bandwidth_bytes_per_s``
        (or ``bandwidth_gbytes_per_s``, GB = 1e9 bytes) and ``latency_s``; either may be
        omitted and defaults to the first group's kind (``DEFAULT_LINKS``).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"cluster description must be a table/dict, got {type(data).__name__}")
        unknown = set(data) - {"group", "links"}
        if unknown:
            raise ValueError(f"cluster description has unknown keys {sorted(unknown)}; allowed: group, links")
        groups = data.get("group")
        if not groups or not isinstance(groups, list):
            raise ValueError(
                "cluster description needs at least one [[group]] with kind and count, "
                'e.g. [[group]] kind = "h100"; count = 8'
            )
        allowed_group_keys = {"kind", "count", "node", "devices_per_node", "memory_gib", "memory_bytes",
                              "flops_per_s", "names", "cores", *_HEADROOM_KEYS}
        devices: list[DeviceSpec] = []
        first_kind = None
        for gi, group in enumerate(groups):
            if not isinstance(group, Mapping):
                raise ValueError(f"group[{gi}] must be a table, got {group!r}")
            extra = set(group) - allowed_group_keys
            if extra:
                raise ValueError(f"group[{gi}] has unknown keys {sorted(extra)}; allowed: {sorted(allowed_group_keys)}")
            if "kind" not in group or "count" not in group:
                raise ValueError(f"group[{gi}] needs 'kind' and 'count' (got keys {sorted(group)})")
            kind = str(group["kind"])
            count = group["count"]
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"group[{gi}].count={count!r} must be an int >= 1")
            has_overrides = "memory_gib" in group or "memory_bytes" in group
            if kind in DEVICE_PRESETS or kind in _KIND_ALIASES:
                kind = resolve_kind(kind)
                preset = DEVICE_PRESETS[kind]
            elif has_overrides and "flops_per_s" in group:
                preset = None  # a custom kind described entirely by the file
            else:
                resolve_kind(kind)  # raises the error that lists known kinds
                raise AssertionError("unreachable")
            first_kind = first_kind or kind
            if "memory_bytes" in group:
                memory_bytes = group["memory_bytes"]
                if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int):
                    raise ValueError(f"group[{gi}].memory_bytes={memory_bytes!r} must be an int")
            elif "memory_gib" in group:
                memory_gib = group["memory_gib"]
                if isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float)) or memory_gib <= 0:
                    raise ValueError(f"group[{gi}].memory_gib={memory_gib!r} must be a positive number")
                memory_bytes = int(memory_gib * GIB)
            else:
                assert preset is not None
                memory_bytes = preset.memory_bytes
            fraction, reserve = _headroom_from_group(group, gi, preset)
            flops_per_s = float(group["flops_per_s"]) if "flops_per_s" in group else preset.flops_per_s  # type: ignore[union-attr]
            node = group.get("node", 0)
            if isinstance(node, bool) or not isinstance(node, int) or node < 0:
                raise ValueError(f"group[{gi}].node={node!r} must be an int >= 0")
            per_node = group.get("devices_per_node", count)
            if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
                raise ValueError(f"group[{gi}].devices_per_node={per_node!r} must be an int >= 1")
            cores = group.get("cores", default_cores(kind))
            if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
                raise ValueError(f"group[{gi}].cores={cores!r} must be an int >= 1 (CPU cores of each node)")
            names = group.get("names")
            if names is not None and (not isinstance(names, list) or len(names) != count):
                raise ValueError(f"group[{gi}].names must be a list of {count} names, got {names!r}")
            for i in range(count):
                index = len(devices)
                devices.append(
                    DeviceSpec(
                        name=str(names[i]) if names is not None else _default_name(kind, index),
                        kind=kind,
                        memory_bytes=memory_bytes,
                        flops_per_s=flops_per_s,
                        node=node + i // per_node,
                        usable_memory_fraction=fraction,
                        memory_reserve_bytes=reserve,
                        cores=cores,
                    )
                )
        links = data.get("links", {})
        if not isinstance(links, Mapping):
            raise ValueError(f"links must be a table, got {links!r}")
        extra = set(links) - {"intra_node", "inter_node"}
        if extra:
            raise ValueError(f"links has unknown keys {sorted(extra)}; allowed: intra_node, inter_node")
        default_intra, default_inter = DEFAULT_LINKS.get(first_kind or "", DEFAULT_LINKS["cpu"])
        intra = _link_from_dict(links.get("intra_node"), default_intra, "links.intra_node")
        inter = _link_from_dict(links.get("inter_node"), default_inter, "links.inter_node")
        return cls(devices=tuple(devices), intra_node_link=intra, inter_node_link=inter)

    def to_dict(self) -> dict[str, Any]:
        """The ``from_dict`` form; ``ClusterSpec.from_dict(c.to_dict()) == c``."""
        groups: list[dict[str, Any]] = []
        run_start = 0
        for i in range(1, len(self.devices) + 1):
            if i < len(self.devices) and _same_group(self.devices[run_start], self.devices[i]):
                continue
            run = self.devices[run_start:i]
            head = run[0]
            group: dict[str, Any] = {
                "kind": head.kind,
                "count": len(run),
                "node": head.node,
                "memory_bytes": head.memory_bytes,
                "flops_per_s": head.flops_per_s,
                "usable_memory_fraction": head.usable_memory_fraction,
                "memory_reserve_bytes": head.memory_reserve_bytes,
            }
            if head.cores is not None:  # explicit: the plan records what it assumed of this machine
                group["cores"] = head.cores
            if any(d.name != _default_name(d.kind, run_start + j) for j, d in enumerate(run)):
                group["names"] = [d.name for d in run]
            groups.append(group)
            run_start = i
        return {
            "group": groups,
            "links": {
                "intra_node": {
                    "bandwidth_bytes_per_s": self.intra_node_link.bandwidth_bytes_per_s,
                    "latency_s": self.intra_node_link.latency_s,
                },
                "inter_node": {
                    "bandwidth_bytes_per_s": self.inter_node_link.bandwidth_bytes_per_s,
                    "latency_s": self.inter_node_link.latency_s,
                },
            },
        }

    # ---- queries ------------------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    # Note [cluster queries are cached]: a cluster of 16,384 devices is asked these questions
    # for every candidate the solver prices; each answer is a pass over the devices, so they are
    # computed once per (frozen) spec and kept in the instance's __dict__ (cached_property), which
    # leaves the fields, equality and the serialized form as they were.
    @functools.cached_property
    def is_homogeneous(self) -> bool:
        return len(self.device_classes) == 1

    @functools.cached_property
    def device_classes(self) -> dict[tuple, tuple[DeviceSpec, DeviceSpec, int]]:
        """{device class: (its first device, its last device, how many)}, in first-appearance
        order (Note [cluster queries are cached])."""
        classes: dict[tuple, tuple[DeviceSpec, DeviceSpec, int]] = {}
        for d in self.devices:
            known = classes.get(d.device_class)
            classes[d.device_class] = (d, d, 1) if known is None else (known[0], d, known[2] + 1)
        return classes

    @functools.cached_property
    def memo(self) -> dict:
        """Answers that depend only on this spec and device indices, kept per spec (callers key
        them by their own name first): Note [cluster queries are cached]."""
        return {}

    def least_usable_memory_bytes(self, device_indices: "tuple[int, ...]") -> int:
        """The smallest ``usable_memory_bytes`` among ``device_indices`` (a stage's replicas),
        memoized per spec (Note [cluster queries are cached])."""
        key = ("least_usable_memory_bytes", tuple(device_indices))
        known = self.memo.get(key)
        if known is None:
            known = self.memo[key] = min(self.devices[i].usable_memory_bytes for i in device_indices)
        return known

    @functools.cached_property
    def fastest_device(self) -> DeviceSpec:
        """The first device of the most flops/s (Note [cluster queries are cached])."""
        return max(self.devices, key=lambda dev: dev.flops_per_s)

    @functools.cached_property
    def most_usable_memory_bytes(self) -> int:
        """The largest ``usable_memory_bytes`` of any device (Note [cluster queries are cached])."""
        return max(dev.usable_memory_bytes for dev in self.devices)

    def link_between(self, dev_a: int | DeviceSpec, dev_b: int | DeviceSpec) -> LinkSpec:
        """The link joining two devices (given by index or spec): intra-node on the same node."""
        a = self.devices[dev_a] if isinstance(dev_a, int) else dev_a
        b = self.devices[dev_b] if isinstance(dev_b, int) else dev_b
        return self.intra_node_link if a.node == b.node else self.inter_node_link

    def slowest_link(self, device_indices: "list[int] | tuple[int, ...]") -> LinkSpec | None:
        """The slowest link among a set of devices (None for fewer than two devices)."""
        if len(device_indices) < 2:
            return None
        nodes = {self.devices[i].node for i in device_indices}
        return self.intra_node_link if len(nodes) == 1 else self.inter_node_link

    def allreduce_link(self, device_indices: "list[int] | tuple[int, ...]") -> LinkSpec | None:
        """The one link a ring all-reduce among ``device_indices`` runs as fast over as the group
        really does (Note [collectives as NCCL runs them]): its time for S bytes over d members is
        2 (d - 1) (S / d / bandwidth + latency), as every pricer writes it. None for one device."""
        d = len(device_indices)
        if d < 2:
            return None
        lanes = self.collective_lanes
        per_node: dict[int, int] = {}
        for i in device_indices:
            per_node[self.devices[i].node] = per_node.get(self.devices[i].node, 0) + 1
        accelerators = all(self.devices[i].cores is None for i in device_indices)
        if len(per_node) == 1 or not accelerators:  # one node, or gloo's flat ring on cpu
            link = self.slowest_link(device_indices)
            return LinkSpec(link.bandwidth_bytes_per_s * lanes, link.latency_s)
        g, n = max(per_node.values()), len(per_node)  # members per node (the fullest), nodes
        intra, inter = self.intra_node_link, self.inter_node_link
        # reduce-scatter and all-gather within each node, the all-reduce of a 1/g slice between nodes
        s_per_byte = 2 * (g - 1) / g / intra.bandwidth_bytes_per_s + 2 * (n - 1) / n / g / inter.bandwidth_bytes_per_s
        latency_s = 2 * (g - 1) * intra.latency_s + 2 * (n - 1) * inter.latency_s
        return LinkSpec(lanes * 2 * (d - 1) / d / s_per_byte, latency_s / (2 * (d - 1)))


def _same_group(a: DeviceSpec, b: DeviceSpec) -> bool:
    return (a.kind == b.kind and a.node == b.node and a.memory_bytes == b.memory_bytes
            and a.flops_per_s == b.flops_per_s and a.cores == b.cores
            and a.usable_memory_fraction == b.usable_memory_fraction
            and a.memory_reserve_bytes == b.memory_reserve_bytes)



_HEADROOM_KEYS = ("usable_memory_fraction", "memory_reserve_gib", "memory_reserve_bytes")


def _headroom_from_group(group: Mapping[str, Any], gi: int, preset: DevicePreset | None) -> tuple[float, int]:
    """(usable_memory_fraction, memory_reserve_bytes) of a cluster-file group (Note [usable memory])."""
    fraction = group.get("usable_memory_fraction", preset.usable_memory_fraction if preset else 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(
            f"group[{gi}].usable_memory_fraction={fraction!r} must be a number in (0, 1], the share of "
            "memory_bytes the solver may fill: e.g. usable_memory_fraction = 0.9")
    if "memory_reserve_bytes" in group and "memory_reserve_gib" in group:
        raise ValueError(f"group[{gi}] gives both memory_reserve_bytes and memory_reserve_gib: keep one")
    if "memory_reserve_bytes" in group:
        reserve = group["memory_reserve_bytes"]
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ValueError(f"group[{gi}].memory_reserve_bytes={reserve!r} must be an int >= 0 (bytes the "
                             "runtime holds outside the predicted tensors): e.g. memory_reserve_bytes = 1073741824")
    elif "memory_reserve_gib" in group:
        gib = group["memory_reserve_gib"]
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib < 0:
            raise ValueError(f"group[{gi}].memory_reserve_gib={gib!r} must be a number >= 0 (GiB the runtime "
                             "holds outside the predicted tensors): e.g. memory_reserve_gib = 1.5")
        reserve = int(gib * GIB)
    else:
        reserve = preset.memory_reserve_bytes if preset else 0
    return float(fraction), int(reserve)


def _link_from_dict(data: Any, default: LinkSpec, where: str) -> LinkSpec:
    if data is None:
        return default
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a table with bandwidth_bytes_per_s and latency_s, got {data!r}")
    extra = set(data) - {"bandwidth_bytes_per_s", "bandwidth_gbytes_per_s", "latency_s"}
    if extra:
        raise ValueError(f"{where} has unknown keys {sorted(extra)}; allowed: bandwidth_bytes_per_s, "
                         "bandwidth_gbytes_per_s, latency_s")
    if "bandwidth_bytes_per_s" in data:
        bandwidth = float(data["bandwidth_bytes_per_s"])
    elif "bandwidth_gbytes_per_s" in data:
        bandwidth = float(data["bandwidth_gbytes_per_s"]) * 1e9
    else:
        bandwidth = default.bandwidth_bytes_per_s
    latency = float(data.get("latency_s", default.latency_s))
    return LinkSpec(bandwidth_bytes_per_s=bandwidth, latency_s=latency)


def read_toml(path: str | Path, what: str) -> dict:
    """The table of TOML file ``path`` (a cluster or job file): ValueError naming ``what`` and the
    file when it is no regular file, too large, not UTF-8 text (a binary file) or not TOML."""
    try:
        raw = read_bounded(str(path), cap=JSON_CAP, follow=True)  # a FIFO or /dev/zero is refused
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {path} is not text (byte {exc.start} is not UTF-8: a binary file?): "
                         f"pass the TOML file (docs/configuration.md)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {path}: not valid TOML: {exc}") from None
