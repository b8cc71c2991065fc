"""An accelerator's time model from published measurements, where nothing was measured here.

Note [accelerator roofline]
    A GPU kind without a measured profile is priced by the fitted time model's own terms (Note
    [the fitted time model] in partitioner/calibrate/__init__.py) with published coefficients
    instead of a fit: the sustained GEMM rate of the policy's dtype for matmuls, the fused-attention
    rate for the other FLOPs, achievable HBM bandwidth for the memory-bound ops, a per-kernel floor.
    So a model whose time is in memory-bound ops is not priced at the matmul rate, and the matmul
    rate is what large GEMMs reach, not a blanket 40% of the datasheet (the preset ``flops_per_s``,
    kept for kinds without a table here). Bytes are priced in the dtype each op runs in under the
    policy (Note [bytes under autocast] in partitioner/calibrate/features.py); the AdamW step is
    memory-bound and priced per parameter byte on the stage holding it. A cluster file that sets
    ``flops_per_s`` for a GPU group keeps the flat model for that kind: the user's figure wins.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from partitioner.calibrate.profiles import DeviceProfile, DirectionFit
from partitioner.config.cluster import DEVICE_PRESETS, ClusterSpec
from runtime.program.parts import Precision


@dataclass(frozen=True)
class AcceleratorRates:
    """Sustained rates of one GPU kind; every figure's source is beside it in ``RATES``."""

    gemm_flops_per_s: Mapping[str, float]       # by compute dtype: fp32, bf16, fp16
    attention_flops_per_s: Mapping[str, float]  # fused attention forward + backward, by dtype
    hbm_bytes_per_s: float                      # achievable, read + write
    kernel_floor_s: float                       # a kernel's cost when it is tiny


# A GPU runs at about 90% of its HBM datasheet bandwidth in a streaming copy (the common figure of
# bandwidthTest / BabelStream-style copies on A100 and H100: 1.8-1.9 of 2.04 TB/s on A100 80GB; a
# published H100 NVL measurement: 3.57 of 3.94 TB/s, 90.6%), so HBM = 0.9 x datasheet.
_HBM_ACHIEVED = 0.9
# A kernel's floor: a kernel replayed from a CUDA graph costs 1.3 us, one issued from Python 4.2 us
# (a published H100 measurement); eager PyTorch issues ahead of the device, so a short kernel costs
# between the two: 2 us.
_KERNEL_FLOOR_S = 2e-6
# Sustained dense GEMM rates are Stas Bekman's "maximum achievable matmul FLOPS" (ml-engineering,
# compute/accelerator/README.md, bf16, CUDA 12.1): A100 SXM 267.9 of 312 TFLOP/s (85.9%), H100 SXM
# 792.1 of 989 (80.1%); H200 has the H100's compute (794.5 measured on H100/H200). fp16 runs at the
# bf16 rate on both. fp32 (no TF32: torch's default) takes the same efficiency of its own peak
# (A100 19.5, H100 67 TFLOP/s): not measured.
# Fused attention is FlashAttention-2's forward + backward (Dao 2023, arXiv 2307.08691, Fig. 5-6):
# 50-73% of the A100's peak, about 180 TFLOP/s at head dim 64-128 with a causal mask; on H100
# about 335 TFLOP/s (the FlashAttention-3 paper's FA2 baseline, arXiv 2407.08608). fp32 SDPA runs
# the memory-efficient kernel on CUDA cores: half the fp32 GEMM rate, not measured.
_A100 = AcceleratorRates(
    gemm_flops_per_s={"bf16": 267.9e12, "fp16": 267.9e12, "fp32": 0.859 * 19.5e12},
    attention_flops_per_s={"bf16": 180e12, "fp16": 180e12, "fp32": 0.5 * 0.859 * 19.5e12},
    hbm_bytes_per_s=_HBM_ACHIEVED * 2039e9, kernel_floor_s=_KERNEL_FLOOR_S)
_H100 = AcceleratorRates(
    gemm_flops_per_s={"bf16": 792.1e12, "fp16": 792.1e12, "fp32": 0.801 * 67e12},
    attention_flops_per_s={"bf16": 335e12, "fp16": 335e12, "fp32": 0.5 * 0.801 * 67e12},
    hbm_bytes_per_s=_HBM_ACHIEVED * 3350e9, kernel_floor_s=_KERNEL_FLOOR_S)
RATES: Mapping[str, AcceleratorRates] = {
    "a100-80gb": _A100,
    "a100-40gb": replace(_A100, hbm_bytes_per_s=_HBM_ACHIEVED * 1555e9),  # HBM2, 1.555 TB/s
    "h100": _H100,
    "h200": replace(_H100, hbm_bytes_per_s=_HBM_ACHIEVED * 4800e9),        # HBM3e, 4.8 TB/s
}
# AdamW's step (torch's fused/foreach kernels) reads parameter, gradient and both moments and
# writes parameter and both moments: 7 passes over 4-byte tensors per 4-byte parameter (the
# autocast weight copies, rebuilt once per step, are left out: 1.5 more bytes per byte).
ADAMW_BYTES_PER_PARAM_BYTE = 7.0

def datasheet_profile(kind: str, precision: Precision | str) -> DeviceProfile | None:
    """The roofline profile of ``kind`` under ``precision`` (Note [accelerator roofline]), or None
    for a kind without published rates here (cpu: its preset or a measured profile)."""
    rates = RATES.get(kind)
    if rates is None:
        return None
    precision = Precision.of(precision)
    dtype = precision.dtype_name
    fit = DirectionFit(s_per_matmul_flop=1.0 / rates.gemm_flops_per_s[dtype],
                       s_per_other_flop=1.0 / rates.attention_flops_per_s[dtype],
                       s_per_byte=1.0 / rates.hbm_bytes_per_s, op_overhead_s=rates.kernel_floor_s)
    return DeviceProfile(kind=kind, forward=fit, backward=fit,
                         optimizer_s_per_param_byte=ADAMW_BYTES_PER_PARAM_BYTE / rates.hbm_bytes_per_s,
                         meta={"source": "datasheet", "precision": precision.value,
                               "note": "Note [accelerator roofline] in partitioner/calibrate/datasheet.py"})


def datasheet_profiles(cluster: ClusterSpec, precision: Precision | str, *, measured_kinds=()) -> list[DeviceProfile]:
    """A roofline profile for every accelerator kind of ``cluster`` that has published rates, no
    measured profile (``measured_kinds``) and no ``flops_per_s`` of the user's own in the cluster
    file (a figure the user gave is theirs to keep)."""
    out = []
    for kind in sorted({d.kind for d in cluster.devices}):
        preset = DEVICE_PRESETS.get(kind)
        if kind in measured_kinds or preset is None:
            continue
        if any(d.flops_per_s != preset.flops_per_s for d in cluster.devices if d.kind == kind):
            continue
        profile = datasheet_profile(kind, precision)
        if profile is not None:
            out.append(profile)
    return out
