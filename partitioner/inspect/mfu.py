"""The plan's predicted model-FLOP utilisation beside the best any published run reports on its
device kind: `partitioner inspect`'s MFU line.

Note [predicted MFU against published runs]
    A prediction is only as good as the rates it prices with (Note [accelerator roofline] in
    partitioner/calibrate/datasheet.py): the dense GEMM rate there is the best a sweep of matmul
    shapes reaches alone on the device, not what a training step's GEMMs average. A plan whose
    predicted MFU is above what every published training run on that device kind measured is a
    claim no one has seen hold, so `inspect` prints the two side by side: predicted MFU (model
    FLOPs of a step, the runtime's definition: Note [model FLOPs and MFU] in
    runtime/observe/watch.py, over the predicted step and the datasheet peak of every rank's device:
    Note [datasheet peaks] in partitioner/config/device_presets.py) and the published figure, with
    its source. ``PUBLISHED_MFU`` holds one row per device kind, the highest MFU a paper states
    for a dense transformer trained on that kind (MFU as PaLM and Megatron-LM define it: model
    FLOPs, recompute not counted); a kind without a row (cpu, h200) prints the prediction alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.config.device_presets import world_peak_flops_per_s
from runtime.program.parts import Precision


@dataclass(frozen=True)
class PublishedMfu:
    """The best MFU a published run measured on one device kind, and where it is stated."""

    mfu: float
    source: str


PUBLISHED_MFU: dict[str, PublishedMfu] = {
    # Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    # (arXiv 2205.05198), Table 5: the 1T GPT (tp 8 x pp 64, 512 A100-80GB, sequence parallelism and
    # selective recompute) at 56.3% MFU (57.0% HFU); their 530B row 56.0%
    "a100-80gb": PublishedMfu(0.563, "Korthikanti et al. 2022 (arXiv 2205.05198), 1T GPT on 512 A100-80GB"),
    # Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 4: Llama 3 405B in
    # bf16 on 8,192 to 16,384 H100s at 38-43% MFU
    "h100": PublishedMfu(0.43, "Dubey et al. 2024 (arXiv 2407.21783), Llama 3 405B on 8,192 H100"),
}


def predicted_mfu(plan) -> float | None:
    """Model FLOPs of one step over the predicted step time and the datasheet peak of every rank's
    device (Note [predicted MFU against published runs]); None without a datasheet peak (cpu) or
    FLOPs."""
    step = plan.predicted.get("step_time_s") or 0.0
    peak = world_peak_flops_per_s(plan.stages, plan.tensor_parallel, Precision.of(plan.decisions.precision).dtype_name)
    flops = sum(s.fwd_flops + s.bwd_flops for s in plan.stages) * plan.num_microbatches * plan.dp
    if not peak or step <= 0 or flops <= 0:
        return None
    return flops / step / peak


def mfu_line(plan) -> str | None:
    """`inspect`'s line: the predicted MFU, and beside it the best published one for the device
    kind with its source; None where the plan's devices have no datasheet peak."""
    mfu = predicted_mfu(plan)
    if mfu is None:
        return None
    kinds = sorted({s.device for s in plan.stages})
    published = [(k, PUBLISHED_MFU[k]) for k in kinds if k in PUBLISHED_MFU]
    line = f"predicted MFU   {mfu * 100:.1f}% of the datasheet peak"
    if not published:
        return line + f"; no published training run on {', '.join(kinds)} to compare with"
    best = max(p.mfu for _, p in published)
    words = "; ".join(f"{k}: best published {p.mfu * 100:.1f}% ({p.source})" for k, p in published)
    if mfu > best:
        words += " - the prediction is above every published run: read it as optimistic"
    return f"{line}  |  {words}"
