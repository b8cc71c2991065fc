"""A device profile: the fitted seconds per term for one device kind, its file format, and how it
prices a problem's regions (Note [per sample] in partitioner/calibrate/__init__.py)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch.fx as fx

from partitioner.calibrate.features import Features, autocast_byte_scale, region_features
from runtime.program.parts import Precision


FORMAT = "partitioner.profile/1"
COEFFS = ("s_per_matmul_flop", "s_per_other_flop", "s_per_byte", "op_overhead_s")
# ---- the profile ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class DirectionFit:
    """Seconds per unit of each term (Note [the fitted time model]); call_overhead_s is the
    measuring harness's per-call cost, fitted to keep it out of the other terms, never predicted."""

    s_per_matmul_flop: float
    s_per_other_flop: float
    s_per_byte: float
    op_overhead_s: float
    call_overhead_s: float = 0.0

    def seconds(self, features: Features) -> float:
        return (features.matmul_flops * self.s_per_matmul_flop + features.other_flops * self.s_per_other_flop
                + features.memory_bytes * self.s_per_byte + features.num_ops * self.op_overhead_s)

    def rates(self) -> dict:
        def inv(x):
            return 1.0 / x if x > 0 else math.inf

        return {"matmul_flops_per_s": inv(self.s_per_matmul_flop), "other_flops_per_s": inv(self.s_per_other_flop),
                "memory_bytes_per_s": inv(self.s_per_byte), "op_overhead_s": self.op_overhead_s}


_OPTIONAL = ("microbatch_overhead_s", "dtensor_op_s", "tp_collective_s", "tp_skew", "recompute_fixed_s",
             "optimizer_s_per_param_byte")  # measured figures a profile may carry


@dataclass(frozen=True)
class DeviceProfile:
    """A fitted time model for one device kind."""

    kind: str
    forward: DirectionFit
    backward: DirectionFit
    meta: dict = field(default_factory=dict, compare=False)  # where/how it was measured, fit quality
    measurements: tuple = field(default=(), compare=False)
    # A stage's fixed seconds per microbatch besides its regions, when measured (Note [whole-step
    # terms] in partitioner/solver/problem.py); None: the device kind's preset.
    microbatch_overhead_s: float | None = None
    # Tensor parallelism's fixed costs, when measured (partitioner/calibrate/tp_overheads.py, Note
    # [tensor-parallel overheads]); None: the device kind's preset.
    dtensor_op_s: float | None = None
    tp_collective_s: float | None = None
    tp_skew: float | None = None
    # Seconds a recomputed region costs a microbatch beyond its fitted forward, when measured
    # (Note [recompute fixed cost] in partitioner/solver/recompute_cost.py); None: the preset's.
    recompute_fixed_s: float | None = None
    # Seconds of the optimizer's step per parameter byte, paid once per step by the stage holding
    # the parameter (Note [accelerator roofline] in partitioner/calibrate/datasheet.py); None: not priced.
    optimizer_s_per_param_byte: float | None = None

    def region_seconds(self, fwd: Features, bwd: Features) -> tuple[float, float]:
        return self.forward.seconds(fwd), self.backward.seconds(bwd)

    def fixed_seconds(self, fwd: Features, bwd: Features) -> tuple[float, float]:
        """The per-op part of ``region_seconds``: paid once per microbatch (Note [per sample])."""
        return fwd.num_ops * self.forward.op_overhead_s, bwd.num_ops * self.backward.op_overhead_s

    def to_dict(self) -> dict:
        return {"format": FORMAT, "kind": self.kind,
                "forward": asdict(self.forward), "backward": asdict(self.backward),
                "rates": {"forward": self.forward.rates(), "backward": self.backward.rates()},
                "meta": self.meta, "measurements": list(self.measurements),
                **{name: getattr(self, name) for name in _OPTIONAL if getattr(self, name) is not None}}

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "profile") -> "DeviceProfile":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{where}: not a device profile (expected \"format\": \"{FORMAT}\"); "
                             "write one with `partitioner compile MODEL --calibrate --profile-out FILE`")
        try:
            return cls(kind=str(data["kind"]), forward=DirectionFit(**data["forward"]),
                       backward=DirectionFit(**data["backward"]), meta=dict(data.get("meta", {})),
                       measurements=tuple(data.get("measurements", ())),
                       **{name: data.get(name) for name in _OPTIONAL})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}: malformed profile ({type(exc).__name__}: {exc})") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True, default=float) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "DeviceProfile":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"--profile {path}: no such file; make one with "
                             "`partitioner compile MODEL --calibrate --profile-out FILE`")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile {path}: not JSON ({exc})") from None
        return cls.from_dict(data, where=str(path))


def apply_profiles(problem, gm: fx.GraphModule, batch_size: int, profiles: Sequence[DeviceProfile]):
    """The problem with measured-model seconds per sample by kind on every region (Note [per sample])."""
    if not profiles:
        return problem
    kinds = [p.kind for p in profiles]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"two profiles for the same device kind {kinds}: give one per kind")
    # lazy: loads networkx
    from passes.tp_activations import tp_divided_nodes

    divided_nodes = tp_divided_nodes(gm)  # Note [tensor-parallel pricing]
    traced = (region_features(gm), region_features(gm, only=divided_nodes))
    if len(traced[0]) != problem.num_regions:
        raise AssertionError(f"{len(traced[0])} region feature rows for {problem.num_regions} regions")
    autocast = {}  # precision -> features with bytes under autocast (Note [bytes under autocast])
    for profile in profiles:
        precision = Precision.of(profile.meta.get("precision", Precision.FP32))
        if profile.meta.get("source") == "datasheet" and precision.is_mixed and precision not in autocast:
            scale = autocast_byte_scale(gm)
            autocast[precision] = (region_features(gm, byte_scale=scale),
                                   region_features(gm, only=divided_nodes, byte_scale=scale))

    def features_of(profile):
        """A fitted profile keeps the traced bytes it was fitted on; the roofline moves autocast's."""
        if profile.meta.get("source") == "datasheet":
            return autocast.get(Precision.of(profile.meta.get("precision", Precision.FP32)), traced)
        return traced

    regions = []
    for r, region in enumerate(problem.regions):
        fwd_by_kind = dict(region.fwd_s_per_sample_by_kind or {})
        bwd_by_kind = dict(region.bwd_s_per_sample_by_kind or {})
        fwd_fixed = dict(region.fwd_s_per_microbatch_by_kind or {})
        bwd_fixed = dict(region.bwd_s_per_microbatch_by_kind or {})
        split_fraction = dict(region.tp.split_fraction_by_kind or {})
        step = dict(region.step_s_by_kind or {})
        for profile in profiles:
            whole_features, split_features = features_of(profile)
            (fwd, bwd), (split_fwd, split_bwd) = whole_features[r], split_features[r]
            f_s, b_s = profile.region_seconds(fwd, bwd)
            fwd_fixed[profile.kind], bwd_fixed[profile.kind] = profile.fixed_seconds(fwd, bwd)
            fwd_by_kind[profile.kind] = (f_s - fwd_fixed[profile.kind]) / batch_size
            bwd_by_kind[profile.kind] = (b_s - bwd_fixed[profile.kind]) / batch_size
            # the per-op part excluded: a tensor group's members each run every op
            whole = f_s + b_s - sum(profile.fixed_seconds(fwd, bwd))
            split = sum(profile.region_seconds(split_fwd, split_bwd)) - sum(profile.fixed_seconds(split_fwd, split_bwd))
            split_fraction[profile.kind] = min(1.0, split / whole) if whole > 0 else 0.0
            if profile.optimizer_s_per_param_byte:  # Note [accelerator roofline]: AdamW's step
                step[profile.kind] = step.get(profile.kind, 0.0) + profile.optimizer_s_per_param_byte * region.param_bytes
        regions.append(replace(region, fwd_s_per_sample_by_kind=fwd_by_kind, bwd_s_per_sample_by_kind=bwd_by_kind,
                               fwd_s_per_microbatch_by_kind=fwd_fixed, bwd_s_per_microbatch_by_kind=bwd_fixed,
                               tp=replace(region.tp, split_fraction_by_kind=split_fraction),
                               step_s_by_kind={k: v for k, v in step.items() if v} or None))
    measured = {}
    for name, field_name in (("microbatch_overhead_s", "microbatch_overhead_s_by_kind"),
                             ("dtensor_op_s", "dtensor_op_s_by_kind"), ("tp_collective_s", "tp_collective_s_by_kind"),
                             ("tp_skew", "tp_skew_by_kind"), ("recompute_fixed_s", "recompute_fixed_s_by_kind")):
        by_kind = dict(getattr(problem, field_name) or {})
        for profile in profiles:
            if getattr(profile, name) is not None:
                by_kind[profile.kind] = getattr(profile, name)
        measured[field_name] = by_kind or None
    return replace(problem, regions=tuple(regions), **measured)


def compiled_profile_refusal(profile: DeviceProfile, compile_stages: bool) -> str | None:
    """Why ``profile`` cannot price a plan with (or without) compiled stages, or None (Note
    [compiled regions priced] in partitioner/calibrate/measure.py). A profile without the key
    (fitted before it existed, or by `calibrate --machine`) was measured eager."""
    fitted = bool(profile.meta.get("compiled", False))
    if fitted == compile_stages:
        return None
    if compile_stages:
        return (f"the {profile.kind} profile was measured eager, but this plan compiles its stages: recalibrate "
                "with --calibrate --compile-stages, or compile without --compile-stages")
    return (f"the {profile.kind} profile was measured with compiled regions, but this plan runs eager stages: "
            "recalibrate with --calibrate, or compile with --compile-stages")
