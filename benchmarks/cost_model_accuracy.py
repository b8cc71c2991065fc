"""Predicted vs measured per-stage time and per-rank peak memory, datasheet vs calibrated model.

    .venv/bin/python benchmarks/cost_model_accuracy.py [--repeats 15] [--json results.json]

For the built-in GPT, Hugging Face GPT-2 and Hugging Face Llama (sizes that train in well under a
second per step here), each at 2 and 4 pipeline stages (dp 1, 4 microbatches of the example batch,
1F1B):

1. calibrate on this machine (partitioner/calibrate/: every region and every distinct op run
   alone, median of repeats, weighted NNLS fit), one profile per model;
2. compile with that profile and write the program folder;
3. measure every stage module (runtime.execute.stage.build_stage on the folder) alone: forward + backward
   of one microbatch on real inputs (stage k's inputs are what stages < k produced for the same
   batch), backward from fixed random output gradients, one torch thread (what `partitioner run`
   gives each rank), median of --repeats after warm-up;
4. predict the same stages (the same assignment) with the cost model
   (partitioner.solver.evaluate.evaluate, compute time of a stage) three ways: the datasheet model
   (FLOPs / the cpu preset's 50 GFLOP/s), the model's own calibrated profile, and - to show how
   a profile transfers - the profile fitted on the built-in GPT;
5. peak memory of a rank (``runtime_peak``): parameters, buffers and AdamW state (bytes of the
   real tensors) + the peak of live tensor bytes (calibrate.LiveBytes, a TorchDispatchMode that
   tracks every storage an op creates until it is freed; views of the parameters are not new
   storage) over one training step emulated in one process as runtime/execute/train.py runs it over
   PipelineStage: the global batch, an activation and a gradient receive buffer per microbatch,
   1F1B with min(p - s, m) microbatches in flight, the outputs kept until their backward, the
   loss on the last stage, gradients, the fused AdamW step, zero_grad. Predicted: the plan's
   peak_memory_bytes (Note [memory model] in partitioner/solver/evaluate.py);
6. memory-binding cases (memory only): a capacity 8% under the best recompute-free plan's peak,
   so the solver recomputes (the generated program does not recompute yet on this branch: those
   stages run from the split graph with recomputed regions under torch.utils.checkpoint), and a
   16384-token vocabulary at width 128 (the last stage's logits dominate). Every stage's
   predicted / measured is printed; the targets are >= 0.97 on every stage and a median <= 1.10.

Relative error = |predicted - measured| / measured. The machine is 2 shared CPU cores: medians
over repeats, and times vary by ~10% between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from partitioner.config.settings import program_optimizer  # noqa: E402

MODELS = [
    ("gpt", "gpt:layers=4,width=256,heads=4,vocab=2048,seq=128,batch=2"),
    ("hf-gpt2", "hf-gpt2:layers=4,width=256,heads=4,vocab=2048,seq=128,batch=2"),
    ("hf-llama", "hf-llama:layers=4,width=256,heads=4,vocab=2048,seq=128,batch=2"),
]
STAGES = (2, 4)
MICROBATCHES = 4


def _rel(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def _clone_inputs(values):
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            c = v.detach().clone()
            out.append(c.requires_grad_(True) if c.dtype.is_floating_point else c)
        else:
            out.append(v)
    return out


def _flat_outputs(out):
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


def stage_inputs(folder: str, modules, batch_args) -> list[list]:
    """Real inputs of every stage: run the stages in order on one batch."""
    inputs, current = [], list(batch_args)
    with torch.no_grad():
        for module in modules:
            inputs.append([c.detach() if isinstance(c, torch.Tensor) else c for c in current])
            out = module(*current)
            current = list(out) if isinstance(out, (tuple, list)) else [out]
    return inputs


def time_stage(module, inputs, *, warmup: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(0)
    grads = None
    times = []
    for i in range(warmup + repeats):
        xs = _clone_inputs(inputs)
        start = time.perf_counter()
        outs = _flat_outputs(module(*xs))
        if grads is None:
            grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
        torch.autograd.backward(outs, grads)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
        for p in module.parameters():
            p.grad = None
    return statistics.median(times)


class RegionCheckpointed(torch.nn.Module):
    """A stage graph run region by region, the recomputed regions under
    torch.utils.checkpoint (inputs kept, forward rerun in backward): what the plan's recompute
    means, for measuring it where the generated program does not recompute yet."""

    def __init__(self, gm: torch.fx.GraphModule, region_of: dict[str, int], recomputed: set[int]):
        super().__init__()
        self.gm, self.region_of, self.recomputed = gm, region_of, recomputed
        nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        self.groups: list[tuple[int, list]] = []
        for n in nodes:
            rid = self.region_of.get(n.name, -1)
            if self.groups and self.groups[-1][0] == rid:
                self.groups[-1][1].append(n)
            else:
                self.groups.append((rid, [n]))

    def _free(self, env: dict, done: set) -> None:
        """Drop values no node left to run reads (what fx.Interpreter.run does)."""
        for node in [n for n in env if n.users and all(u in done for u in n.users)]:
            del env[node]

    def forward(self, *args):
        import torch.utils.checkpoint as checkpoint

        interp = torch.fx.Interpreter(self.gm)
        env = interp.env
        done: set = set()
        for node, value in zip(self.placeholders, args):
            env[node] = value
        for rid, group in self.groups:
            members = set(group)
            if rid not in self.recomputed:
                for n in group:
                    env[n] = interp.run_node(n)
                    done.add(n)
                    self._free(env, done)
                continue
            inputs = list(dict.fromkeys(a for n in group for a in n.all_input_nodes if a not in members))
            used_later = [n for n in group if any(u not in members for u in n.users)]

            def run(*values, group=group, inputs=inputs, used_later=used_later):
                inner = torch.fx.Interpreter(self.gm)
                inner.env.update(zip(inputs, values))
                inner_done = set(inputs)
                for n in group:
                    inner.env[n] = inner.run_node(n)
                    inner_done.add(n)
                    for v in [v for v in inner.env if v not in used_later and v.users
                              and all(u in inner_done or u not in group for u in v.users)]:
                        del inner.env[v]
                return tuple(inner.env[n] for n in used_later)

            outs = checkpoint.checkpoint(run, *[env[a] for a in inputs], use_reentrant=False)
            env.update(zip(used_later, outs))
            done |= members
            self._free(env, done)
        return torch.fx.node.map_arg(self.output.args[0], lambda n: env[n])


def runtime_peak(module, inputs, *, stage: int, num_stages: int, num_microbatches: int, in_flight: int,
                 make_batch, global_batch: int, loss_fn, optimizer_cfg: dict, dp: int = 1) -> dict:
    """Peak bytes one rank holds while it trains stage ``stage`` for a step, emulated in one
    process as the runtime runs it (runtime/execute/train.py over PipelineStage):

    * model state: parameters and buffers, AdamW state (the optimizer runtime.execute.train builds,
      fused), gradients (made in the backward, freed by zero_grad(set_to_none) after the step);
    * the global batch every rank builds (make_batch(step, global_batch));
    * PipelineStage's receive buffers: an activation buffer per microbatch for every input
      (stages > 0) and a gradient buffer per microbatch for every float output (all but the
      last stage), allocated for the whole step; the input gradients sent back, alive until the
      next backward's (the send);
    * 1F1B with ``in_flight`` microbatches at most between a forward and its backward, the
      forward's outputs kept until its backward (fwd_cache); on the last stage loss_fn applied
      to the outputs and backward from the loss;
    * after the schedule: gradients divided by m in place (scale_grads), for dp > 1 the
      all-reduce's flat buckets (runtime.parallel.grad_sync.allreduce_flat_ without the collective), the
      optimizer step, zero_grad.
    One step first (the optimizer state), then the second step under LiveBytes, which counts
    the storages the step creates (views of parameters are not new storage)."""
    from collections import deque

    from partitioner.calibrate import LiveBytes
    from runtime.execute.train import make_optimizer

    m = num_microbatches
    first, last = stage == 0, stage == num_stages - 1
    params = list(module.parameters())
    optimizer, _ = make_optimizer(params, optimizer_cfg)
    with torch.no_grad():
        out = module(*inputs)
    out_meta = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.dtype.is_floating_point]
    del out

    def step():
        args, target = make_batch(0, global_batch)
        args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
        if first:
            chunks = [a.tensor_split(m) for a in args]
            recv = [[c[j] for c in chunks] for j in range(m)]
        else:
            recv = [[x.clone().requires_grad_(x.dtype.is_floating_point) for x in inputs] for _ in range(m)]
        grad_recv = None if last else [[torch.ones(o.shape, dtype=o.dtype) for o in out_meta] for _ in range(m)]
        targets = target.tensor_split(m) if last else None
        pending: deque = deque()
        sent = None

        def backward(j, outs, loss):
            nonlocal sent
            if last:
                loss.backward()
            else:
                flat = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,))
                        if isinstance(o, torch.Tensor) and o.dtype.is_floating_point]
                pairs = [(o, g) for o, g in zip(flat, grad_recv[j]) if o.requires_grad]
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grads = []
            for x in recv[j]:
                if isinstance(x, torch.Tensor) and x.grad is not None:
                    grads.append(x.grad)
                    x.grad = None
            sent = grads

        for j in range(m):
            if len(pending) == in_flight:
                backward(*pending.popleft())
            outs = module(*recv[j])
            loss = None
            if last:
                single = outs[0] if isinstance(outs, (tuple, list)) and len(outs) == 1 else outs
                loss = loss_fn(single, targets[j])
            pending.append((j, outs, loss))
            del outs, loss
        while pending:
            backward(*pending.popleft())
        del sent
        grads = [p.grad for p in params if p.grad is not None]
        for g in grads:
            g.div_(m)
        if dp > 1:  # the flat buckets of allreduce_flat_, one at a time
            bucket, size = [], 0
            for g in grads + [None]:
                if g is not None and (size + g.numel() <= 1 << 25 or not bucket):
                    bucket.append(g)
                    size += g.numel()
                    continue
                flat = torch.cat([b.reshape(-1) for b in bucket])
                del flat
                bucket, size = ([g], g.numel()) if g is not None else ([], 0)
        del grads
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    mode = LiveBytes()
    # Tensors that exist before the step (parameters, buffers, optimizer state, the example
    # inputs) are counted statically below; views of them made during the step (a weight's
    # transpose that a linear saves) share their storage and are no new bytes. LiveBytes counts
    # a storage it has not seen, so register these as seen, with 0 bytes.
    existing = list(params) + list(module.buffers()) + [t for st in optimizer.state.values() for t in st.values()
                                                         if isinstance(t, torch.Tensor)]
    existing += [x for x in inputs if isinstance(x, torch.Tensor)]
    mode.already_counted(existing)
    with mode:
        step()
    param_bytes = sum(p.numel() * p.element_size() for p in params) + sum(
        b.numel() * b.element_size() for b in module.buffers())
    state_bytes = sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
                      if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"static_bytes": param_bytes + state_bytes, "activation_peak_bytes": mode.peak,
            "peak_bytes": param_bytes + state_bytes + mode.peak}


def run(repeats: int, warmup: int, calib_repeats: int, models, stages_list) -> dict:
    import partitioner
    from partitioner.calibrate import calibrate
    from partitioner.config.cluster import ClusterSpec
    from partitioner.frontend.analysis import analyze
    from partitioner.calibrate.priced_problem import build_problem
    from partitioner.models.builtin import load_workload
    from partitioner.solver.evaluate import evaluate
    from partitioner.solver.problem import Assignment
    from partitioner.solver.device_layout import place_stages
    from runtime.execute.stage import build_stage

    torch.set_num_threads(1)
    results = {"configs": [], "profiles": {}}
    gpt_profile = None
    with tempfile.TemporaryDirectory() as tmp:
        for label, spec in models:
            workload = load_workload(spec)
            gm, _table = analyze(workload)
            started = time.perf_counter()
            profile = calibrate(workload, gm, repeats=calib_repeats, threads=1)
            calib_s = time.perf_counter() - started
            if label == "gpt":
                gpt_profile = profile
            results["profiles"][label] = {"calibrate_s": calib_s, "forward": profile.forward.rates(),
                                          "backward": profile.backward.rates(),
                                          **{k: v for k, v in profile.meta.items() if "error" in k}}
            b = workload.example_batch_size
            args, _target = workload.make_batch(0, b)
            problems = {"datasheet": build_problem(gm, b), "calibrated": build_problem(gm, b, profiles=[profile])}
            if gpt_profile is not None and label != "gpt":
                problems["calibrated_on_gpt"] = build_problem(gm, b, profiles=[gpt_profile])
            for num_stages in stages_list:
                # Each stage is measured alone on one thread: predict a rank with a core of its own
                # (the core-sharing factor of a plan for more ranks than cores is the whole-step
                # benchmark's business, benchmarks/step_time_accuracy.py).
                cluster = ClusterSpec.homogeneous(num_stages, "cpu", cores=num_stages)
                plan = partitioner.compile(workload, cluster=cluster, global_batch=b * MICROBATCHES,
                                           num_stages=num_stages, dp=1, microbatches=MICROBATCHES,
                                           profiles=[profile])
                folder = os.path.join(tmp, f"{label}_{num_stages}")
                plan.save(folder)
                assignment = Assignment(
                    stage_of_region=tuple(r.stage for r in plan.regions),
                    recompute=tuple(r.recompute for r in plan.regions),
                    device_of_stage_replica=place_stages(cluster, num_stages, 1), num_stages=num_stages, dp=1,
                    num_microbatches=plan.num_microbatches, microbatch_size=plan.microbatch_size,
                    schedule=plan.schedule)
                predicted = {name: [st.compute_s for st in evaluate(problem, cluster, assignment).stages]
                             for name, problem in problems.items()}
                modules = [build_stage(folder, s) for s in range(num_stages)]
                inputs = stage_inputs(folder, modules, args)
                for s, module in enumerate(modules):
                    measured_s = time_stage(module, inputs[s], warmup=warmup, repeats=repeats)
                    k = plan.pipeline_schedule.in_flight(s, num_stages, plan.num_microbatches)
                    memory = runtime_peak(module, inputs[s], stage=s, num_stages=num_stages,
                                          num_microbatches=plan.num_microbatches, in_flight=k,
                                          make_batch=workload.make_batch, global_batch=plan.global_batch,
                                          loss_fn=workload.loss_fn,
                                          optimizer_cfg=program_optimizer(plan.training, plan.decisions))
                    row = {"model": label, "spec": spec, "stages": num_stages, "stage": s,
                           "regions": list(plan.stages[s].region_names), "measured_s": measured_s,
                           "predicted_s": {name: p[s] for name, p in predicted.items()},
                           "measured_peak_bytes": memory["peak_bytes"],
                           "measured_static_bytes": memory["static_bytes"],
                           "measured_activation_peak_bytes": memory["activation_peak_bytes"],
                           "predicted_memory": dict(vars(plan.stages[s].memory)),
                           "predicted_static_bytes": plan.stages[s].memory.params_bytes
                           + plan.stages[s].memory.grads_bytes + plan.stages[s].memory.optimizer_bytes,
                           "predicted_peak_bytes": plan.stages[s].peak_memory_bytes}
                    results["configs"].append(row)
                    print(f"  {label:9} p={num_stages} stage {s}: measured {measured_s * 1e3:7.2f} ms  "
                          + "  ".join(f"{n} {v[s] * 1e3:7.2f}" for n, v in predicted.items())
                          + f"   peak {memory['peak_bytes'] / 2**20:6.2f} MiB measured, "
                          f"{plan.stages[s].peak_memory_bytes / 2**20:6.2f} predicted", flush=True)
    return results


# Cases where memory binds (memory only, no timing): (label, model spec, stages, usable memory
# per device in MiB or None for the preset). "recompute": the capacity is below every
# recompute-free plan's need, so the solver recomputes; "vocab": a 16384-token vocabulary at
# width 128 makes the last stage's logits, their float copy and gradients dominate.
MEMORY_CASES = [
    ("gpt-recompute", "gpt:layers=4,width=256,heads=4,vocab=2048,seq=128,batch=2", 2, "recompute"),
    ("llama-recompute", "hf-llama:layers=4,width=256,heads=4,vocab=2048,seq=128,batch=2", 2, "recompute"),
    ("gpt-vocab16k", "gpt:layers=2,width=128,heads=4,vocab=16384,seq=128,batch=2", 2, None),
    ("gpt-vocab16k", "gpt:layers=2,width=128,heads=4,vocab=16384,seq=128,batch=2", 3, None),
]


def _recompute_capacity(workload, num_stages: int) -> int:
    """Bytes per device below the best recompute-free plan's peak and above the best plan's
    with every region recomputable: the solver must recompute."""
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.solver.model import SolverConfig

    b = workload.example_batch_size
    common = dict(global_batch=b * MICROBATCHES, num_stages=num_stages, dp=1, microbatches=MICROBATCHES)
    free = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(num_stages, "cpu"),
                               solver_config=SolverConfig(allow_recompute=False), **common)
    need = min(max(st.peak_memory_bytes for st in free.stages), 2**40)
    # The smallest peak a no-recompute split reaches is `need`; 8% under it leaves recompute as
    # the only way (a rebalanced split only moves bytes between the two stages).
    return int(need * 0.92)


def measure_memory_case(label: str, spec: str, num_stages: int, kind: str | None, tmp: str) -> list[dict]:
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.frontend.analysis import analyze
    from partitioner.models.builtin import load_workload
    from partitioner.codegen.split import split_graph
    from runtime.execute.stage import build_stage

    workload = load_workload(spec)
    b = workload.example_batch_size
    capacity = _recompute_capacity(workload, num_stages) if kind == "recompute" else None
    cluster = (ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": num_stages, "memory_bytes": capacity}]})
               if capacity else ClusterSpec.homogeneous(num_stages, "cpu"))
    plan = partitioner.compile(workload, cluster=cluster, global_batch=b * MICROBATCHES, num_stages=num_stages,
                               dp=1, microbatches=MICROBATCHES)
    recomputed = {r.id for r in plan.regions if r.recompute}
    args, _target = workload.make_batch(0, b)
    if recomputed:
        # The generated program does not recompute on this branch: run the plan's stages from
        # the split graph, recomputed regions under torch.utils.checkpoint (RegionCheckpointed).
        gm, _ = analyze(workload)
        node_stage = {name: r.stage for r in plan.regions for name in r.nodes}
        region_of = {name: r.id for r in plan.regions for name in r.nodes}
        modules = [RegionCheckpointed(sg.gm, region_of, recomputed)
                   for sg in split_graph(gm, node_stage, num_stages)]
    else:
        folder = os.path.join(tmp, f"{label}_{num_stages}")
        plan.save(folder)
        modules = [build_stage(folder, s) for s in range(num_stages)]
    inputs = stage_inputs("", modules, args)
    rows = []
    for s, module in enumerate(modules):
        k = plan.pipeline_schedule.in_flight(s, num_stages, plan.num_microbatches)
        memory = runtime_peak(module, inputs[s], stage=s, num_stages=num_stages,
                              num_microbatches=plan.num_microbatches, in_flight=k,
                              make_batch=workload.make_batch, global_batch=plan.global_batch,
                              loss_fn=workload.loss_fn, optimizer_cfg=program_optimizer(plan.training, plan.decisions))
        st = plan.stages[s]
        rows.append({"case": label, "spec": spec, "stages": num_stages, "stage": s,
                     "capacity_bytes": st.memory_capacity_bytes,
                     "recompute_regions": [plan.regions[r].name for r in st.regions if plan.regions[r].recompute],
                     "measured_peak_bytes": memory["peak_bytes"], "predicted_peak_bytes": st.peak_memory_bytes,
                     "predicted_memory": dict(vars(st.memory))})
        print(f"  {label:15} p={num_stages} stage {s}: peak {memory['peak_bytes'] / 2**20:7.2f} MiB measured, "
              f"{st.peak_memory_bytes / 2**20:7.2f} predicted ({st.peak_memory_bytes / memory['peak_bytes']:.3f}), "
              f"recompute {len(rows[-1]['recompute_regions'])} regions, capacity "
              f"{st.memory_capacity_bytes / 2**20:.1f} MiB", flush=True)
    return rows


def summarize(results: dict) -> dict:
    rows = results["configs"]
    summary = {}
    for model in sorted({r["model"] for r in rows}) + ["all"]:
        mine = [r for r in rows if model in ("all", r["model"])]
        entry = {}
        for name in ("datasheet", "calibrated", "calibrated_on_gpt"):
            errs = [_rel(r["predicted_s"][name], r["measured_s"]) for r in mine if name in r["predicted_s"]]
            if errs:
                entry[f"time_{name}"] = {"median": statistics.median(errs), "worst": max(errs), "n": len(errs)}
        errs = [_rel(r["predicted_peak_bytes"], r["measured_peak_bytes"]) for r in mine]
        entry["peak_memory"] = {"median": statistics.median(errs), "worst": max(errs), "n": len(errs)}
        summary[model] = entry
    return summary


def memory_table(results: dict) -> dict:
    """Predicted / measured peak per stage of every plan, and the targets of docs/design.md §12:
    never under by more than 3%, median over-prediction <= 10%."""
    rows = [(f"{r['model']} p={r['stages']}", r["stage"], r["predicted_peak_bytes"], r["measured_peak_bytes"])
            for r in results["configs"]]
    rows += [(f"{r['case']} p={r['stages']}", r["stage"], r["predicted_peak_bytes"], r["measured_peak_bytes"])
             for r in results.get("memory_cases", [])]
    print(f"\n{'plan':22} {'stage':>5} {'predicted MiB':>14} {'measured MiB':>13} {'pred/meas':>10}")
    for plan, stage, pred, meas in rows:
        print(f"{plan:22} {stage:>5} {pred / 2**20:>14.2f} {meas / 2**20:>13.2f} {pred / meas:>10.3f}")
    ratios = [pred / meas for _, _, pred, meas in rows]
    summary = {"n": len(ratios), "min_ratio": min(ratios), "median_ratio": statistics.median(ratios),
               "max_ratio": max(ratios),
               "never_under_by_3pct": min(ratios) >= 0.97, "median_over_at_most_10pct": statistics.median(ratios) <= 1.10}
    print(f"predicted / measured over {len(ratios)} stages: min {summary['min_ratio']:.3f}, median "
          f"{summary['median_ratio']:.3f}, max {summary['max_ratio']:.3f}; targets: min >= 0.97 "
          f"({'met' if summary['never_under_by_3pct'] else 'MISSED'}), median <= 1.10 "
          f"({'met' if summary['median_over_at_most_10pct'] else 'MISSED'})")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--calibrate-repeats", type=int, default=10)
    parser.add_argument("--models", nargs="*", default=[m for m, _ in MODELS])
    parser.add_argument("--stages", type=int, nargs="*", default=list(STAGES))
    parser.add_argument("--json", help="write every row and the summary here")
    parser.add_argument("--skip-memory-cases", action="store_true", help="only the timed plans")
    args = parser.parse_args()
    models = [(m, s) for m, s in MODELS if m in args.models]
    print(f"per-stage forward+backward of one microbatch (median of {args.repeats}, 1 thread) and per-rank "
          "peak memory; predicted: datasheet / calibrated / calibrated on gpt")
    results = run(args.repeats, args.warmup, args.calibrate_repeats, models, args.stages)
    summary = summarize(results)
    results["summary"] = summary
    print(f"\n{'model':10} {'n':>3}  {'time err: datasheet':>21} {'calibrated':>15} {'calib. on gpt':>15}  "
          f"{'peak mem err':>15}")
    for model, entry in summary.items():
        def cell(key):
            e = entry.get(key)
            return f"{e['median']:6.1%} / {e['worst']:6.1%}" if e else f"{'-':>15}"
        print(f"{model:10} {entry['peak_memory']['n']:>3}  {cell('time_datasheet'):>21} {cell('time_calibrated'):>15} "
              f"{cell('time_calibrated_on_gpt'):>15}  {cell('peak_memory'):>15}")
    print("errors: median / worst relative error over stages; targets: stage time <= 10% median, peak memory "
          "<= 10%")
    for label, info in results["profiles"].items():
        f, b = info["forward"], info["backward"]
        print(f"profile {label}: calibrated in {info['calibrate_s']:.1f} s; forward matmul "
              f"{f['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, memory {f['memory_bytes_per_s'] / 1e9:.1f} GB/s, "
              f"{f['op_overhead_s'] * 1e6:.1f} us/op; backward matmul {b['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, "
              f"{b['op_overhead_s'] * 1e6:.1f} us/op")
    if not args.skip_memory_cases:
        print("\nmemory-binding cases (memory only): recompute under a tight capacity, a 16384-token vocabulary")
        with tempfile.TemporaryDirectory() as tmp:
            results["memory_cases"] = [row for case in MEMORY_CASES for row in measure_memory_case(*case, tmp)]
    results["memory_summary"] = memory_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
    all_ = summary["all"]
    improved = all_["time_calibrated"]["median"] < all_["time_datasheet"]["median"]
    print(f"calibration {'improves' if improved else 'does NOT improve'} the median stage-time error: "
          f"{all_['time_datasheet']['median']:.1%} -> {all_['time_calibrated']['median']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
