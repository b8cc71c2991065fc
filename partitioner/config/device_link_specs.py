"""One device and one link of a cluster, each checked when built (``DeviceSpec``, ``LinkSpec``), and
each device kind's default links (``DEFAULT_LINKS``); partitioner/config/cluster.py puts them
together as a ClusterSpec and re-exports them. No torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

__all__ = ["DEFAULT_LINKS", "DeviceSpec", "LinkSpec"]


@dataclass(frozen=True)
class LinkSpec:
    """A point-to-point link: time to move n bytes = latency_s + n / bandwidth_bytes_per_s."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise ValueError(
                f"LinkSpec.bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r} must be a positive "
                "finite number of bytes per second (e.g. 25e9 for a 200 Gb/s NIC)"
            )
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(
                f"LinkSpec.latency_s={self.latency_s!r} must be a finite number of seconds >= 0 "
                "(e.g. 5e-6)"
            )

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


# (intra-node, inter-node) defaults per device kind; see Note [device presets].
DEFAULT_LINKS: Mapping[str, tuple[LinkSpec, LinkSpec]] = {
    "a100-40gb": (LinkSpec(200e9, 5e-6), LinkSpec(25e9, 10e-6)),
    "a100-80gb": (LinkSpec(200e9, 5e-6), LinkSpec(25e9, 10e-6)),
    "h100": (LinkSpec(300e9, 5e-6), LinkSpec(25e9, 10e-6)),
    "h200": (LinkSpec(300e9, 5e-6), LinkSpec(25e9, 10e-6)),
    "cpu": (LinkSpec(1e9, 50e-6), LinkSpec(1.25e9, 50e-6)),
}


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU process): its memory, sustained speed and the node it sits on."""

    name: str
    kind: str
    memory_bytes: int
    flops_per_s: float
    node: int
    usable_memory_fraction: float = 1.0  # Note [usable memory]
    memory_reserve_bytes: int = 0
    cores: int | None = None  # its node's cores, shared by the ranks there (Note [core sharing])

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"DeviceSpec.name={self.name!r} must be a non-empty string")
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"DeviceSpec.kind={self.kind!r} must be a non-empty string such as 'h100'")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise ValueError(
                f"DeviceSpec({self.name}).memory_bytes={self.memory_bytes!r} must be a positive int "
                "(bytes; e.g. 80 * 2**30 for 80 GiB)"
            )
        if not (self.flops_per_s > 0 and math.isfinite(self.flops_per_s)):
            raise ValueError(
                f"DeviceSpec({self.name}).flops_per_s={self.flops_per_s!r} must be a positive finite "
                "sustained rate (e.g. 396e12 for an H100 at 40% of bf16 peak)"
            )
        if isinstance(self.node, bool) or not isinstance(self.node, int) or self.node < 0:
            raise ValueError(f"DeviceSpec({self.name}).node={self.node!r} must be an int >= 0")
        fraction = self.usable_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(
                f"DeviceSpec({self.name}).usable_memory_fraction={fraction!r} must be a number in (0, 1] "
                "(e.g. 0.95 to leave 5% to the allocator)")
        reserve = self.memory_reserve_bytes
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ValueError(f"DeviceSpec({self.name}).memory_reserve_bytes={reserve!r} must be an int >= 0 (bytes)")
        if self.usable_memory_bytes <= 0:
            raise ValueError(
                f"DeviceSpec({self.name}): memory_reserve_bytes={reserve} leaves nothing of "
                f"{self.memory_bytes} * {fraction} usable bytes: lower the reserve or raise the memory")
        if self.cores is not None and (isinstance(self.cores, bool) or not isinstance(self.cores, int)
                                       or self.cores < 1):
            raise ValueError(f"DeviceSpec({self.name}).cores={self.cores!r} must be an int >= 1 (the CPU cores "
                             "of its node) or None for an accelerator")

    @property
    def usable_memory_bytes(self) -> int:
        """What the solver may fill (Note [usable memory])."""
        return int(self.memory_bytes * self.usable_memory_fraction) - self.memory_reserve_bytes

    @property
    def device_class(self) -> tuple[str, int, float]:
        """Devices with the same class are interchangeable for the solver: (kind, usable memory
        bytes, flops/s)."""
        return (self.kind, self.usable_memory_bytes, self.flops_per_s)


def _default_name(kind: str, index: int) -> str:
    return f"{kind}:{index}"
