"""The device kinds the cluster file and ``--device`` name: memory, sustained FLOP/s per dtype, usable
memory, and the measured fixed costs of the ``cpu`` kind. Plain numbers, no torch (partitioner/
cluster.py builds devices from them; partitioner/calibrate/datasheet.py prices the GPU kinds' ops).


Note [device presets]
    Memory is the HBM as sold (GiB = 2**30 bytes; the H200's 141 GB is decimal). ``flops_per_s``
    is a *sustained* bf16 dense rate, 40% of the vendor's dense peak, what well-tuned transformer
    training reaches (Megatron-LM and torchtitan report 38-45% MFU): A100 312 -> 125e12, H100/H200
    989 -> 396e12; cpu 50e9, a many-core socket running fp32 GEMMs. Links (``DEFAULT_LINKS``) are
    achievable point-to-point rates, about 2/3 of nominal: NVLink3 200e9, NVLink4 300e9, one
    InfiniBand NIC per GPU 25e9; cpu: gloo over loopback 1e9 and 50 us (measured on this 2-core
    machine: a 2-rank all_reduce of 4.2 MB in 5.7 ms), 10 GbE across. On the GPU kinds
    ``flops_per_s`` is only the fallback: without a measured profile ops are priced by the
    roofline of published rates (Note [accelerator roofline] in partitioner/calibrate/datasheet.py).
    Calibrate with measured numbers (``[[group]] flops_per_s = ...``) where they are known.

Note [usable memory]
    The solver fills a device to ``floor(memory_bytes * usable_memory_fraction) -
    memory_reserve_bytes``: the reserve is what the runtime holds outside the priced tensors (CUDA
    context, cuBLAS workspaces, NCCL buffers: ~1 GiB), the fraction what the caching allocator loses
    to fragmentation (5%). GPU kinds: 0.95 and 1 GiB; cpu: 1.0 and 0 (its 16 GiB is already one
    process's budget). The reserve is one figure, not priced per communicator, though NCCL holds
    buffers per group a rank joins; a CUDA run records the reserved and device-wide peaks (Note
    [what a GPU holds beyond the tensors] in runtime/observe/memory.py) to check it against.
    Override per group with ``usable_memory_fraction`` and ``memory_reserve_gib``; a hand-built
    DeviceSpec defaults to 1.0 and no reserve.

"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


GIB = 2**30


@dataclass(frozen=True)
class DevicePreset:
    memory_bytes: int
    flops_per_s: float
    usable_memory_fraction: float = 1.0   # Note [usable memory]
    memory_reserve_bytes: int = 0
    # Seconds a stage pays per microbatch besides its regions (Note [whole-step terms] in
    # partitioner/solver/problem.py); measured for cpu only, 0 (not measured) for accelerators.
    microbatch_overhead_s: float = 0.0
    # Tensor parallelism's fixed costs (Note [tensor-parallel overheads] in
    # partitioner/solver/tensor_groups.py): DTensor dispatch per op, and per collective beyond
    # the link, and the members' drift per second computed; measured for cpu (CPU_DTENSOR_OP_S,
    # CPU_TP_COLLECTIVE_S, CPU_TP_SKEW), 0 for accelerators.
    dtensor_op_s: float = 0.0
    tp_collective_s: float = 0.0
    tp_skew: float = 0.0
    # Seconds a recomputed region costs per microbatch beyond its forward (Note [recompute fixed
    # cost] in partitioner/solver/recompute_cost.py); measured for cpu only, 0 for accelerators.
    recompute_fixed_s: float = 0.0


# Note [whole-step terms] in partitioner/solver/problem.py. Measured with
# benchmarks/step_time_accuracy.py (its "implied per-microbatch stage overhead", 2 shared cores, one
# thread per rank): 0.8 ms (1 stage) and 0.9 ms (2 stages) on the demo's GPT in its quietest runs;
# 1.0 to 3.9 ms, median 2.1 ms, over nine plans of a 4-round run at load average 2 to 4. The
# quieter figure is kept: the prediction is for a machine whose cores the job has to itself.
CPU_MICROBATCH_OVERHEAD_S = 1e-3

# Note [tensor-parallel overheads] in partitioner/solver/tensor_groups.py, measured here with
# partitioner/calibrate/tp_overheads.py (2 shared cores, load average ~4.6, one thread):
# DTensor's dispatch 45 us per op on the hf-llama of benchmarks/tensor_parallel.py (28 to 49 us
# over six runs; 130 us per op on the repo's GPT, whose fused ops decompose into more in
# backward than the graph counts); a small functional all-reduce between two gloo processes
# that compute in between, 0.6 to 0.9 ms fixed plus 0.5 to 1.6 s of waiting per s of compute
# since the last collective (three runs, load average 4.6 to 5.7): the lowest are kept, as for
# the overhead above. All grow with the machine's load: ``--calibrate`` measures them at the time.
CPU_DTENSOR_OP_S = 45e-6
CPU_TP_COLLECTIVE_S = 0.6e-3
CPU_TP_SKEW = 0.5
# Note [recompute fixed cost] in partitioner/solver/recompute_cost.py. Measured with
# benchmarks/recompute_overhead.py (one thread's CPU time, paired rounds, 2 shared cores at load 5
# to 7): a recomputed width-32 GPT block at microbatch 2 (the small-microbatch case) costs
# 0.71 to 1.34 ms over plain under the reentrant checkpoint, of which its FLOPs price 0.08 ms:
# 0.62 to 1.26 ms unpriced, rising with the load (1.2 to 2.4 ms under the non-reentrant checkpoint
# it replaced). The quietest figure is kept, as for the overhead above.
CPU_RECOMPUTE_FIXED_S = 0.6e-3

# See Note [device presets] for where each number comes from, Note [usable memory] for the headroom.
_GPU_MEMORY_HEADROOM = {"usable_memory_fraction": 0.95, "memory_reserve_bytes": GIB}
DEVICE_PRESETS: Mapping[str, DevicePreset] = {
    "a100-40gb": DevicePreset(memory_bytes=40 * GIB, flops_per_s=125e12, **_GPU_MEMORY_HEADROOM),
    "a100-80gb": DevicePreset(memory_bytes=80 * GIB, flops_per_s=125e12, **_GPU_MEMORY_HEADROOM),
    "h100": DevicePreset(memory_bytes=80 * GIB, flops_per_s=396e12, **_GPU_MEMORY_HEADROOM),
    "h200": DevicePreset(memory_bytes=141 * 10**9, flops_per_s=396e12, **_GPU_MEMORY_HEADROOM),
    "cpu": DevicePreset(memory_bytes=16 * GIB, flops_per_s=50e9, microbatch_overhead_s=CPU_MICROBATCH_OVERHEAD_S,
                        dtensor_op_s=CPU_DTENSOR_OP_S, tp_collective_s=CPU_TP_COLLECTIVE_S, tp_skew=CPU_TP_SKEW,
                        recompute_fixed_s=CPU_RECOMPUTE_FIXED_S),
}
_KIND_ALIASES: Mapping[str, str] = {"a100": "a100-80gb"}

# Note [flops per dtype]: sustained FLOP/s per compute dtype, the same 40% of the datasheet's dense
# peak the presets' ``flops_per_s`` take (which is the rate at the kind's default precision:
# bf16 on the GPUs, fp32 on cpu; runtime/program/parts.py ``Precision.default_for``). A100: 19.5 fp32,
# 156 tf32, 312 bf16/fp16 TFLOP/s; H100/H200 SXM: 67, 495, 989, 989. torch computes fp32
# matmuls in full fp32 unless told otherwise (allow_tf32 is off by default), so the fp32 policy
# gets the fp32 rate. cpu: a 512^3 matmul alone (one thread, this Xeon with AMX-BF16) runs at fp32
# 37, bf16 109, fp16 20 GFLOP/s, but a whole small GPT step under bf16 autocast measured 1.4x
# *slower* than fp32 (benchmarks/precision.py: the casts and the non-matmul ops in bf16 cost
# more than the matmuls save at these sizes), so the preset takes bf16 = fp32 / 1.4 and fp16 =
# 0.55 x fp32 (its matmul ratio; nothing faster to expect) of the preset's 50 GFLOP/s. A CPU
# without AMX is slower still in bf16: calibrate it.
# ``partitioner.solver.precision_cost.cluster_for_precision`` scales each device's flops_per_s by
# rate[policy dtype] / rate[default dtype] of its kind, so a cluster file's own figure is read
# as its rate at the kind's default precision.
FLOPS_PER_S_BY_DTYPE: Mapping[str, Mapping[str, float]] = {
    "a100-40gb": {"fp32": 7.8e12, "tf32": 62.4e12, "bf16": 125e12, "fp16": 125e12},
    "a100-80gb": {"fp32": 7.8e12, "tf32": 62.4e12, "bf16": 125e12, "fp16": 125e12},
    "h100": {"fp32": 26.8e12, "tf32": 198e12, "bf16": 396e12, "fp16": 396e12},
    "h200": {"fp32": 26.8e12, "tf32": 198e12, "bf16": 396e12, "fp16": 396e12},
    "cpu": {"fp32": 50e9, "tf32": 50e9, "bf16": 36e9, "fp16": 27e9},
}


# Note [datasheet peaks]: the vendor's dense peak FLOP/s per compute dtype, what MFU divides by
# (Note [model FLOPs and MFU] in runtime/observe/watch.py; the usual definition: PaLM, Megatron-LM),
# where the presets' ``flops_per_s`` and FLOPS_PER_S_BY_DTYPE are 40% of it, for pricing. fp32 is the
# CUDA-core rate: runtime/execute/precision.py ``device_numerics`` turns TF32 off. A100 SXM 19.5 /
# 156 / 312 / 312 TFLOP/s, H100 and H200 SXM 67 / 495 / 989 / 989 (NVIDIA's datasheets, without
# sparsity). cpu has no datasheet here: its MFU divides by the preset's nominal rate (a relative figure).
PEAK_FLOPS_PER_S_BY_DTYPE: Mapping[str, Mapping[str, float]] = {
    "a100-40gb": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "a100-80gb": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "h100": {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12},
    "h200": {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12},
}


def datasheet_peak(kind: str, dtype: str) -> float | None:
    """The dense peak FLOP/s of one device of ``kind`` computing in ``dtype`` ("fp32", "bf16", ...)
    (Note [datasheet peaks]); None for cpu and for a kind the cluster file describes by its numbers."""
    return PEAK_FLOPS_PER_S_BY_DTYPE.get(_KIND_ALIASES.get(kind, kind), {}).get(dtype)


def world_peak_flops_per_s(stages, tensor_parallel: int, dtype: str) -> float | None:
    """The datasheet peak of every rank's device together (Note [datasheet peaks]): ``stages`` are
    a plan's (each with ``ranks``, the first rank of each replica's tensor group, and ``device``, its
    kind); each rank counts once (an interleaved rank holds several stages, a tensor group
    ``tensor_parallel`` ranks). None when a kind has no datasheet (cpu)."""
    kind_of_rank = {first + t: stage.device for stage in stages for first in stage.ranks
                    for t in range(tensor_parallel)}
    peaks = [datasheet_peak(kind, dtype) for kind in kind_of_rank.values()]
    return None if not peaks or None in peaks else float(sum(peaks))


def default_cores(kind: str) -> int | None:
    """Cores a device of ``kind`` computes on (Note [core sharing]): this machine's count for
    ``cpu``, None (not core-bound) for an accelerator."""
    return (os.cpu_count() or 1) if kind == "cpu" else None


def resolve_kind(kind: str) -> str:
    """The canonical preset name of ``kind`` (aliases resolved), or ValueError listing known kinds."""
    canonical = _KIND_ALIASES.get(kind, kind)
    if canonical not in DEVICE_PRESETS:
        known = sorted([*DEVICE_PRESETS, *_KIND_ALIASES])
        raise ValueError(
            f"unknown device kind {kind!r}; known kinds: {', '.join(known)} "
            "(or give memory_gib and flops_per_s explicitly in the cluster file)"
        )
    return canonical
