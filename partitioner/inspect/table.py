"""The terminal table `partitioner inspect DIR` and `compile(...).summary()` print: stages, predicted
step, balance, solver, baselines, cut edges, ties and the memory tier."""

from __future__ import annotations

from typing import TYPE_CHECKING

from partitioner.inspect.layout import layout_lines
from runtime.features.registry import FEATURES, asked
from partitioner.inspect.mfu import mfu_line
from partitioner.inspect.units import GIB, byte_unit, held, human_bytes, ms, render_columns, si

if TYPE_CHECKING:  # annotations only
    from partitioner.solver.plan import Plan


def balance(plan: Plan) -> dict:
    times = [s.predicted_time_s for s in plan.stages]
    mems = [s.peak_memory_bytes for s in plan.stages]
    mean_t = sum(times) / len(times)
    mean_m = sum(mems) / len(mems)
    return {"time_max_over_mean": max(times) / mean_t if mean_t > 0 else 1.0,
            "memory_max_over_mean": max(mems) / mean_m if mean_m > 0 else 1.0}


def samples_per_s(plan: Plan) -> float:
    step = plan.predicted["step_time_s"]
    return plan.predicted.get("samples_per_s") or (plan.global_batch / step if step > 0 else 0.0)


def training_line(plan: Plan) -> str:
    """Precision, optimizer-state sharding and clipping (Notes [mixed precision], [sharding as a
    candidate], [global gradient norm])."""
    shard = "sharded over the dp replicas (ZeRO-1)" if plan.decisions.shard_optimizer else "replicated"
    clip = plan.training.clip_grad_norm
    return (f"precision {plan.decisions.precision}; optimizer state {shard}; "
            f"gradient clipping {'at global norm ' + format(clip, 'g') if clip else 'off'}")


def recompute_words(plan: Plan) -> str:
    """The recompute setting and what it recomputed (Note [recompute a user pins] in
    partitioner/solver/recompute_cost.py)."""
    how = {"auto": "the solver's choice", "none": "pinned off", "full": "pinned full"}.get(plan.training.recompute)
    done = sum(r.recompute for r in plan.regions)
    if plan.training.recompute == "selective":  # Note [selective recompute] in partitioner/solver/recompute_cost.py
        cores = plan.solver.get("attention_cores", {})
        saved = human_bytes(sum(c["saved_bytes_per_sample"] for c in cores.values()))
        return (f"recompute selective (pinned): {sum(c['cores'] for c in cores.values())} attention core(s) "
                f"recomputed, in {len(cores)} of {len(plan.regions)} regions, saving {saved} of activations per "
                f"sample; {done} regions recomputed whole")
    return f"recompute {plan.training.recompute} ({how}): {done} of {len(plan.regions)} regions recomputed"


def time_model_text(record: dict) -> str:
    """plan.json's ``predicted.cpu_time_model`` in words (Note [machine profile] in
    partitioner/calibrate/machine.py)."""
    regions = ("regions by the machine's reference fit" if record.get("regions") == "machine"
               else "regions by the given profile")
    refits = record.get("refits") or 0
    overhead = record.get("microbatch_overhead_s")
    return (f"{record.get('source', 'machine profile')} {record.get('file') or record.get('key')}: {regions}"
            + (f", {overhead * 1e3:.2f} ms per microbatch" if overhead is not None else "")
            + (f", refit from {refits} run(s)" if refits else "")
            + " (partitioner calibrate --machine shows it)")


def unpriced_line(record: dict) -> str:
    """The words for ``predicted.unpriced_flops`` (Note [experts priced at 0] in passes/flops.py)."""
    mods = record.get("modules") or []
    shown = ", ".join(mods[:3]) + (f" and {len(mods) - 3} more" if len(mods) > 3 else "")
    ops = f" (ops {', '.join(record['ops'])})" if record.get("ops") else ""
    return (f"{len(mods)} mixture-of-experts module(s) priced at 0 FLOPs: {shown}{ops}; their routed tokens "
            "are data-dependent, so the predicted step time and the stage balance leave the experts' work out")


def table(plan: Plan) -> str:
    p = plan.predicted
    lines = [
        f"plan {plan.content_hash()}  {plan.workload}",
        f"{plan.num_stages} stage(s) x {plan.dp} data-parallel"
        + (f" x {plan.tensor_parallel} tensor-parallel" if plan.tensor_parallel > 1 else "")
        + f" = {plan.world_size} rank(s); "
        f"{plan.num_microbatches} microbatches of {plan.microbatch_size} (global batch {plan.global_batch}); "
        f"schedule {plan.schedule}",
        training_line(plan),
        recompute_words(plan),
        "",
    ]
    mem_unit, mem_scale = byte_unit(max(s.peak_memory_bytes for s in plan.stages))
    send_unit, send_scale = byte_unit(max([s.send_bytes for s in plan.stages] + [1]))
    # Two tables, time then memory, so that each fits a terminal; ranks as ranges (0-63), so a
    # 1,024-device plan's rows are as wide as a 4-device plan's.
    header = ["stage", "ranks", "device", "regions held", "params", "fwd FLOP", "bwd FLOP", "compute",
              "comm", "time", "send"]
    units = ["", "", "", "", "", "/mb", "/mb", "ms/mb", "ms/mb", "ms/mb", f"{send_unit}/mb"]
    rows, mem_rows = [], []
    for s in plan.stages:
        m = s.memory
        mem = [f"{b / mem_scale:.1f}" for b in (m.params_bytes, m.grads_bytes, m.optimizer_bytes,
                                                m.activations_bytes, m.buffers_bytes, m.transient_bytes,
                                                s.peak_memory_bytes)]
        used = 100.0 * s.peak_memory_bytes / s.memory_capacity_bytes if s.memory_capacity_bytes else 0.0
        rows.append([str(s.index), rank_ranges(s.ranks), s.device, held(s.region_names), si(s.params),
                     si(s.fwd_flops), si(s.bwd_flops), ms(s.compute_time_s), ms(s.comm_time_s),
                     ms(s.predicted_time_s), f"{s.send_bytes / send_scale:.1f}" if s.send_bytes else "-"])
        mem_rows.append([str(s.index), *mem, f"{s.memory_capacity_bytes / GIB:.1f}",
                         "<0.01" if used < 0.01 else f"{used:.2f}" if used < 10 else f"{used:.1f}"])
    lines += render_columns(header, units, rows, "><<<>>>>>>>")
    lines += layout_lines(plan)  # tensor groups, at tp > 1
    lines += ["", "memory per rank of each stage"]
    lines += render_columns(["stage", "weights", "grads", "optim", "activ", "buffers", "transient", "peak",
                             "capacity", "used"], [""] + [mem_unit] * 7 + ["GiB", "%"], mem_rows, ">>>>>>>>>>")
    lines += _rank_peaks(plan)

    bal = balance(plan)
    solver = plan.solver
    lower = p["lower_bound_step_time_s"]
    lines += [
        "",
        f"predicted step  {ms(p['step_time_s'])} ms, {samples_per_s(plan):.1f} samples/s, "
        f"bubble {p['bubble_fraction'] * 100:.1f}%, lower bound {ms(lower)} ms"
        + (f" (step is {p['step_time_s'] / lower:.2f}x it)" if lower > 0 else ""),
        f"balance         max/mean stage time {bal['time_max_over_mean']:.3f}, "
        f"max/mean peak memory {bal['memory_max_over_mean']:.3f}",
        f"solver          {solver['status']}, objective {_num(solver.get('objective'))}, "
        f"bound {_num(solver.get('bound'))}, gap {_pct(solver.get('gap'))}, {solver.get('solve_time_s', 0.0):.2f} s",
    ]
    if solver.get("optimal_over"):
        lines.append(f"optimal over    {solver['optimal_over']}")
    if p.get("cpu_time_model"):  # absent: the cpu preset, or no cpu device (Note [machine profile])
        lines.append(f"cpu time model  {time_model_text(p['cpu_time_model'])}")
    if p.get("unpriced_flops"):  # Note [experts priced at 0] in passes/flops.py
        lines.append(f"not priced      {unpriced_line(p['unpriced_flops'])}")
    if (mfu := mfu_line(plan)) is not None:  # Note [predicted MFU against published runs] in inspect/mfu.py
        lines.append(mfu)

    base_rows = [["ours", ms(p["step_time_s"]), f"{samples_per_s(plan):.1f}", "1.00x"]]
    for name in ("uniform", "param_balanced"):
        base = plan.baselines.get(name) or {}
        t = base.get("step_time_s")
        label = name
        if base.get("num_stages") is not None:  # priced at its own best (Note [fair baselines])
            label += (f" ({base['num_stages']} x dp {base['dp']}, {base['num_microbatches']} mb"
                      f"{', recompute' if base.get('recompute') else ''})")
        if t:
            base_rows.append([label, ms(t), f"{plan.global_batch / t:.1f}", f"{t / p['step_time_s']:.2f}x"])
        elif name in plan.baselines:
            base_rows.append([label, "does not fit", "-", "-"])
    lines += ["", "baselines (same cost model, each at its own best stages x dp x microbatches)"]
    lines += ["  " + x for x in render_columns(["split", "step", "samples/s", "vs ours"],
                                                 ["", "ms", "", "time"], base_rows, "<>>>")]

    lines += ["", "cut edges"]
    if plan.cut_edges:
        names = {r.id: r.name for r in plan.regions}
        cut_unit, cut_scale = byte_unit(max(e.bytes_per_microbatch for e in plan.cut_edges))
        cut_rows = []
        for e in plan.cut_edges:
            for i, (tensor, shape) in enumerate(zip(e.tensors, e.shapes)):
                first = i == 0
                cut_rows.append([
                    tensor, "x".join(map(str, shape)) or "scalar",
                    f"{e.bytes_per_microbatch / cut_scale:.1f}" if first else "",
                    f"{names.get(e.src_region, e.src_region)} -> {names.get(e.dst_region, e.dst_region)}" if first else "",
                    ",".join(f"{b}|{b + 1}" for b in e.boundaries) if first else ""])
        lines += ["  " + x for x in render_columns(["tensor", "shape", "bytes", "regions", "boundaries"],
                                                     ["", "", f"{cut_unit}/mb", "", ""], cut_rows, "<<><<")]
    else:
        lines.append("  none (one stage)")
    for t in plan.ties:
        lines.append(f"tied parameter {t.param}: {t.placement} on stages {list(t.stages)}, "
                     f"costs {ms(t.cost_s)} ms/step")
    if plan.decisions.memory_tier:
        lines.append(memory_tier_line(plan.decisions.memory_tier))
    if plan.dp > 1:
        lines.append(sdc_line(plan))
    for feature in FEATURES:  # Note [one feature, one module] in runtime/features/__init__.py
        lines += feature.inspect_lines(asked(feature, plan.decisions.features), plan.predicted, plan.dp, ms)
    return "\n".join(lines)


def sdc_line(plan) -> str:
    """The replica check's interval and what it adds to the predicted step (Note [replica digests])."""
    every = plan.decisions.sdc_every
    if not every and plan.decisions.shard_optimizer and plan.dp > 1:
        return ("replica check   off: the optimizer state is sharded, so replicas agree even on a corrupted state "
                "(Note [no replica check on sharded state]); --shard-optimizer off to run it")
    if not every:
        return "replica check   off (sdc_every = 0): replicas' digests are never compared"
    cost = plan.predicted.get("sdc_check_s_per_step", 0.0)
    return (f"replica check   digests of the {plan.dp} replicas compared every {every} steps, "
            f"{ms(cost)} ms/step in the predicted step")


def _first(items, n: int, *, join: bool = False) -> str:
    """The first ``n`` of a long list and how many there are (a 1,024-device plan stays one line)."""
    items = list(items)
    shown = ", ".join(items[:n]) if join else str(items[:n])[:-1] if len(items) > n else str(items)
    if len(items) <= n:
        return ", ".join(items) if join else shown
    return f"{shown}, ... ({len(items)} in all)" + ("" if join else "]")


def rank_ranges(ranks) -> str:
    """Ranks as runs: (0, 1, 2, 3) -> "0-3"; (0, 16, 32, 48) -> "0-48/16"; (0, 2, 3) -> "0,2-3"."""
    ranks = sorted(ranks)
    if len(ranks) >= 3:
        step = ranks[1] - ranks[0]
        if step > 1 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return f"{ranks[0]}-{ranks[-1]}/{step}"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def memory_tier_line(choice: dict) -> str:
    """The plan's memory tier: redundancy, groups, and the host memory it costs."""
    unit, scale = byte_unit(max(choice["per_host_bytes"] + [1]))
    what = {"none": "no redundancy (one host: covers worker crashes, not a lost host)",
            "copy": "full copy on a peer host", "parity": f"XOR parity over groups of {choice['group_size']} hosts"}
    extra = [r / s for r, s in zip(choice["redundancy_bytes"], choice["own_bytes"]) if s]
    return (f"memory tier     every {choice['every']} step(s), {what.get(choice['mode'], choice['mode'])}"
            + (f", groups {_first(choice['groups'], 4)}" if choice["mode"] != "none" else "")
            + f"; host memory {_first([f'{b / scale:.1f}' for b in choice['per_host_bytes']], 8, join=True)} {unit} per host"
            + (f" (redundancy {max(extra):.2f} x the own snapshots)" if extra and choice["mode"] != "none" else "")
            + " (two slots each)")


def _num(value) -> str:
    return "-" if value is None else f"{value:.6g}"


def _pct(value) -> str:
    return "-" if value is None else f"{value * 100:.2f}%"


def _rank_peaks(plan) -> list[str]:
    """Interleaved, zb, zbv: each rank's peak, its stages together (what the solver bounds; Note
    [interleaved pricing] in partitioner/solver/interleaved.py)."""
    peaks = plan.predicted.get("rank_peak_memory_bytes")
    if not peaks:
        return []
    out = []
    for pos, peak in enumerate(peaks):
        # stage pos sits on position pos under every schedule (s % pp, or zbv's V: stages pos and
        # 2 pp - 1 - pos), so its ranks name the position's stages
        stages = [s for s in plan.stages if s.ranks == plan.stages[pos].ranks]
        capacity = stages[0].memory_capacity_bytes
        out.append(f"rank position {pos} (stages {', '.join(str(s.index) for s in stages)}; ranks "
                   f"{', '.join(str(r) for r in stages[0].ranks)}): peak {human_bytes(peak)} of "
                   f"{human_bytes(capacity)} ({100 * peak / capacity:.2g}%)")
    return ["the stages of a rank share its device:"] + ["  " + line for line in out]
