"""Calibration: measure regions on this machine, fit the time model, apply it to a problem.

    partitioner compile gpt -o out --calibrate --profile-out cpu.profile.json   # measure + fit + use
    partitioner compile gpt -o out --profile cpu.profile.json                    # reuse the fit

Note [the fitted time model]
    The datasheet model prices a region at ``flops / device.flops_per_s``. On a small model (and
    on CPUs) most of the time goes elsewhere: memory-bound ops (layer norm, GELU, adds, softmax
    parts) and a fixed cost per op (dispatch, autograd bookkeeping, Python). The fitted model,
    one per direction (forward, backward) and per device kind, is

        t = matmul_flops / matmul_flops_per_s         (linear, mm, bmm, convolution)
          + other_flops / other_flops_per_s            (attention by formula, anything else counted)
          + memory_bytes / memory_bytes_per_s          (bytes read + written by the other ops)
          + num_ops * op_overhead_s                    (every call_function node but getitem)
          [+ call_overhead_s]                          (one call of a measured sub-module: the
                                                        harness's own cost, fitted, never predicted)

    Its coefficients (the reciprocals, so that the model is linear in them) come from a
    non-negative least-squares fit weighted by 1/measured, i.e. minimizing relative error. Rows are
    the model's regions plus every distinct op run alone (deduplicated by target and input shapes,
    so 32 identical layers cost one measurement): single ops separate the terms, which identical
    transformer blocks alone would not.

Note [measuring a region]
    The traced graph runs once on a real batch (``make_batch``, else the example inputs) and
    every node's value is kept. A region's nodes become a GraphModule whose inputs are the values
    it reads from other regions and whose outputs are the values other regions read. Each
    repeat runs the forward (grad enabled), then backward from the outputs with fixed random
    output gradients; times are medians after warm-up. One more run, untimed, counts the peak of
    live tensor bytes (``LiveBytes``). On CPU the measurement runs with the thread count the
    generated programs get (one, ``OMP_NUM_THREADS=1`` from ``partitioner run``) unless told.

Note [per sample]
    Region times are given to the problem in two parts: the per-op term, which a microbatch pays
    whatever its size (``fwd_s_per_microbatch_by_kind``), and the rest (FLOPs and bytes, which
    grow with the batch) divided by the traced example batch (``fwd_s_per_sample_by_kind``). So a
    plan with microbatches of 1 pays the per-op overhead once per microbatch, not 1/b of it.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from partitioner import ir
from runtime.memory import LiveBytes  # in the runtime: it measures a training rank's peak too

FORMAT = "partitioner.profile/1"
REGION_WEIGHT = 3.0
TERMS = ("matmul_flops", "other_flops", "memory_bytes", "num_ops")
COEFFS = ("s_per_matmul_flop", "s_per_other_flop", "s_per_byte", "op_overhead_s")

_MATMUL = ("linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "conv1d", "conv2d",
           "conv3d", "_scaled_mm", "einsum")
_GATHER = ("embedding", "index", "gather", "index_select")
_VIEW = ("view", "_unsafe_view", "reshape", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
         "squeeze", "t", "alias", "split", "split_with_sizes", "chunk", "unbind", "detach", "as_strided",
         "_assert_tensor_metadata", "lift_fresh_copy")


# ---- features ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Features:
    """The model's terms for one group of nodes, one direction, at the traced batch."""

    matmul_flops: float = 0.0
    other_flops: float = 0.0
    memory_bytes: float = 0.0
    num_ops: float = 0.0

    def vector(self) -> list[float]:
        return [self.matmul_flops, self.other_flops, self.memory_bytes, self.num_ops]

    def __add__(self, other: "Features") -> "Features":
        return Features(*(a + b for a, b in zip(self.vector(), other.vector())))


def _op_name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))  # "linear.default", "add.Tensor"
    return name.split(".")[0]


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel()) * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _requires_grad_nodes(gm: fx.GraphModule) -> set[str]:
    """Nodes whose output autograd differentiates: reached from a trainable parameter through
    ops with floating outputs (placeholders - token ids, the microbatch - never require grad)."""
    trainable = {name for name, p in gm.named_parameters() if p.requires_grad}
    needs: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if node.target in trainable:
                needs.add(node.name)
        elif node.op in ("call_function", "call_method"):
            val = node.meta.get("val")
            flat = val if isinstance(val, (tuple, list)) else (val,)
            floating = any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in flat)
            if floating and any(a.name in needs for a in node.all_input_nodes):
                needs.add(node.name)
    return needs


def node_features(node: fx.Node, requires_grad: set[str]) -> tuple[Features, Features]:
    """(forward, backward) terms of one node (Note [the fitted time model])."""
    if node.op not in ("call_function", "call_method") or node.target is operator.getitem:
        return Features(), Features()
    name = _op_name(node)
    flops = ir.get(node, ir.FLOPS)
    differentiable = node.name in requires_grad
    if name in _MATMUL:
        return (Features(matmul_flops=flops.fwd_flops, num_ops=1),
                Features(matmul_flops=flops.bwd_flops, num_ops=1 if differentiable else 0))
    if flops.fwd_flops or flops.bwd_flops:  # attention by formula, anything else FlopCounter counts
        return (Features(other_flops=flops.fwd_flops, num_ops=1),
                Features(other_flops=flops.bwd_flops, num_ops=1 if differentiable else 0))
    if name in _VIEW:
        return Features(num_ops=1), Features(num_ops=1 if differentiable else 0)
    out_bytes = ir.get(node, ir.SHAPE).output_bytes
    if name in _GATHER:  # reads only the rows it gathers; backward scatters into a full table
        table = sum(_tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes if a.op == "get_attr")
        fwd_bytes, bwd_bytes = 2 * out_bytes, out_bytes + table
    else:
        in_bytes = sum(_tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
        fwd_bytes = in_bytes + out_bytes
        bwd_bytes = fwd_bytes + out_bytes  # read the output's gradient and inputs, write inputs' gradients
    return (Features(memory_bytes=fwd_bytes, num_ops=1),
            Features(memory_bytes=bwd_bytes if differentiable else 0, num_ops=1 if differentiable else 0))


def group_features(nodes: Iterable[fx.Node], requires_grad: set[str]) -> tuple[Features, Features]:
    fwd, bwd = Features(), Features()
    for node in nodes:
        f, b = node_features(node, requires_grad)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def region_features(gm: fx.GraphModule) -> list[tuple[Features, Features]]:
    """(forward, backward) terms per region id, at the traced batch."""
    members: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        members.setdefault(ir.get(node, ir.REGION).region_id, []).append(node)
    needs = _requires_grad_nodes(gm)
    return [group_features(members[r], needs) for r in sorted(members)]


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
                **({"microbatch_overhead_s": self.microbatch_overhead_s}
                   if self.microbatch_overhead_s is not None else {})}

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "profile") -> "DeviceProfile":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{where}: not a device profile (expected \"format\": \"{FORMAT}\"); "
                             "write one with `partitioner compile MODEL --calibrate --profile-out FILE`")
        try:
            return cls(kind=str(data["kind"]), forward=DirectionFit(**data["forward"]),
                       backward=DirectionFit(**data["backward"]), meta=dict(data.get("meta", {})),
                       measurements=tuple(data.get("measurements", ())),
                       microbatch_overhead_s=data.get("microbatch_overhead_s"))
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
    features = region_features(gm)
    if len(features) != problem.num_regions:
        raise AssertionError(f"{len(features)} region feature rows for {problem.num_regions} regions")
    regions = []
    for region, (fwd, bwd) in zip(problem.regions, features):
        fwd_by_kind = dict(region.fwd_s_per_sample_by_kind or {})
        bwd_by_kind = dict(region.bwd_s_per_sample_by_kind or {})
        fwd_fixed = dict(region.fwd_s_per_microbatch_by_kind or {})
        bwd_fixed = dict(region.bwd_s_per_microbatch_by_kind or {})
        for profile in profiles:
            f_s, b_s = profile.region_seconds(fwd, bwd)
            fwd_fixed[profile.kind], bwd_fixed[profile.kind] = profile.fixed_seconds(fwd, bwd)
            fwd_by_kind[profile.kind] = (f_s - fwd_fixed[profile.kind]) / batch_size
            bwd_by_kind[profile.kind] = (b_s - bwd_fixed[profile.kind]) / batch_size
        regions.append(replace(region, fwd_s_per_sample_by_kind=fwd_by_kind, bwd_s_per_sample_by_kind=bwd_by_kind,
                               fwd_s_per_microbatch_by_kind=fwd_fixed, bwd_s_per_microbatch_by_kind=bwd_fixed))
    overhead = dict(problem.microbatch_overhead_s_by_kind or {})
    for profile in profiles:
        if profile.microbatch_overhead_s is not None:
            overhead[profile.kind] = profile.microbatch_overhead_s
    return replace(problem, regions=tuple(regions), microbatch_overhead_s_by_kind=overhead or None)


# ---- the fit -------------------------------------------------------------------------------------

def nnls_relative(rows: Sequence[Sequence[float]], seconds: Sequence[float],
                  weights: Sequence[float] | None = None) -> list[float]:
    """Non-negative least squares of ``rows @ x ≈ seconds`` in relative error (each row weighted by
    1/seconds). Few columns, so every subset of columns is solved and the best non-negative one
    kept (exact NNLS for this size; no scipy)."""
    import numpy as np

    a = np.asarray(rows, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if a.ndim != 2 or len(a) != len(y) or len(y) == 0:
        raise ValueError(f"fit needs as many measurements as rows, got {a.shape} and {y.shape}")
    if (y <= 0).any():
        raise ValueError("measured seconds must be positive")
    w = 1.0 / y * (np.sqrt(np.asarray(weights, dtype=float)) if weights is not None else 1.0)
    aw, yw = a * w[:, None], y * w
    scale = np.where(aw.max(axis=0) > 0, aw.max(axis=0), 1.0)  # columns differ by 1e12: condition them
    aws = aw / scale
    num_cols = a.shape[1]
    best, best_res = np.zeros(num_cols), float(np.sum(yw ** 2))
    for k in range(1, num_cols + 1):
        for cols in itertools.combinations(range(num_cols), k):
            sub = aws[:, cols]
            if not sub.any():
                continue
            x, *_ = np.linalg.lstsq(sub, yw, rcond=None)
            if (x < 0).any():
                continue
            res = float(np.sum((sub @ x - yw) ** 2))
            if res < best_res - 1e-15:
                full = np.zeros(num_cols)
                full[list(cols)] = x
                best, best_res = full, res
    return list(best / scale)


def fit_direction(rows: Sequence[tuple[Features, float]], *, call_overhead: bool = True,
                  weights: Sequence[float] | None = None) -> DirectionFit:
    """Fit one direction from (features of a measured group, its measured seconds)."""
    matrix = [f.vector() + ([1.0] if call_overhead else []) for f, _ in rows]
    coeffs = nnls_relative(matrix, [s for _, s in rows], weights)
    return DirectionFit(*coeffs[:4], call_overhead_s=coeffs[4] if call_overhead else 0.0)


def relative_errors(fit: DirectionFit, rows: Sequence[tuple[Features, float]]) -> list[float]:
    return [abs(fit.seconds(f) + fit.call_overhead_s - s) / s for f, s in rows]


# ---- measuring ------------------------------------------------------------------------------------

def _detached(value, requires_grad: bool):
    if isinstance(value, torch.Tensor):
        out = value.detach().clone()
        if requires_grad and out.dtype.is_floating_point:
            out.requires_grad_(True)
        return out
    return value


@dataclass
class GroupRun:
    """A node group as a runnable sub-module, with its real inputs."""

    name: str
    module: fx.GraphModule
    inputs: list
    input_needs_grad: list[bool]


def _build_group(gm: fx.GraphModule, nodes: list[fx.Node], values: dict, needs: set[str], name: str) -> GroupRun:
    inside = {n.name for n in nodes}
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    inputs, input_needs = [], []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.name in env or arg.name in inside:
                continue
            if arg.op == "get_attr":
                env[arg.name] = graph.get_attr(arg.target)
            else:
                env[arg.name] = graph.placeholder(arg.name)
                inputs.append(values[arg.name])
                input_needs.append(arg.name in needs)
            env[arg.name].meta = dict(arg.meta)
        if node.op == "get_attr":
            env[node.name] = graph.get_attr(node.target)
        else:
            env[node.name] = graph.node_copy(node, lambda n: env[n.name])
    outputs = [env[n.name] for n in nodes
               if n.op != "get_attr" and any(u.name not in inside for u in n.users)]
    graph.output(tuple(outputs))
    return GroupRun(name, fx.GraphModule(gm, graph), inputs, input_needs)


def _time_group(run: GroupRun, *, warmup: int, repeats: int, params) -> tuple[float, float, int]:
    """(median forward s, median backward s, peak live bytes of one forward + backward)."""
    generator = torch.Generator().manual_seed(0)
    grads_out = None
    fwd_times, bwd_times, peak = [], [], 0
    for i in range(warmup + repeats + 1):
        inputs = [_detached(v, need) for v, need in zip(run.inputs, run.input_needs_grad)]
        measure_memory = i == warmup + repeats
        mode = LiveBytes() if measure_memory else None
        if mode is not None:
            mode.__enter__()
        try:
            start = time.perf_counter()
            outs = run.module(*inputs)
            middle = time.perf_counter()
            flat = [o for o in tree_flatten(outs)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            if grads_out is None:
                grads_out = [torch.randn(o.shape, generator=generator, dtype=o.dtype).to(o.device) for o in flat]
            before_bwd = time.perf_counter()
            if flat:
                torch.autograd.backward(flat, grads_out)
            end = time.perf_counter()
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
        if measure_memory:
            peak = mode.peak
        elif i >= warmup:
            fwd_times.append(middle - start)
            bwd_times.append(end - before_bwd)
        del outs, flat, inputs
        for p in params:
            p.grad = None
    return statistics.median(fwd_times), statistics.median(bwd_times), peak


def local_device_kind() -> str:
    """The preset kind of this machine's device: a GPU by its name, else cpu."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower()
        for key, kind in (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80gb")):
            if key in name:
                return kind
        return name.replace(" ", "-")
    return "cpu"


def measure(workload, gm: fx.GraphModule, *, warmup: int = 3, repeats: int = 10, single_ops: bool = True,
            threads: int | None = 1, device: str | None = None,
            progress: Callable[[str], None] | None = None) -> list[dict]:
    """Measure every region of the annotated ``gm`` (and every distinct op alone) on this machine.

    Returns one dict per measured group: name, kind ("region" or "op"), fwd_s, bwd_s,
    peak_live_bytes and the (forward, backward) features (Note [measuring a region])."""
    if any(p.device.type == "meta" for p in gm.parameters()):
        raise ValueError(f"--calibrate runs the model, but {workload.name} lives on the meta device: calibrate "
                         "on a smaller configuration of the same model (same kinds of ops) and pass the "
                         "profile with --profile")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    old_threads = torch.get_num_threads()
    if threads and device == "cpu":
        torch.set_num_threads(threads)
    try:
        return _measure(workload, gm, warmup=warmup, repeats=repeats, single_ops=single_ops, device=device,
                        progress=progress)
    finally:
        torch.set_num_threads(old_threads)


def _example_inputs(workload) -> tuple:
    args = workload.example_args
    if workload.make_batch is not None:
        try:
            args, _ = workload.make_batch(0, workload.example_batch_size)
        except Exception:  # noqa: BLE001 - the example inputs are a fine fallback
            args = workload.example_args
    return tuple(args)


def _measure(workload, gm, *, warmup, repeats, single_ops, device, progress) -> list[dict]:
    gm = gm.to(device)
    params = list(gm.parameters())
    needs = _requires_grad_nodes(gm)
    values: dict = {}

    class Keep(fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            values[n.name] = result.detach() if isinstance(result, torch.Tensor) else result
            return result

    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in _example_inputs(workload)]
    with torch.no_grad():
        Keep(gm).run(*args)

    members: dict[int, list[fx.Node]] = {}
    names: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        meta = ir.get(node, ir.REGION)
        members.setdefault(meta.region_id, []).append(node)
        names[meta.region_id] = meta.name
    groups: list[tuple[str, str, list[fx.Node]]] = [("region", names[r], members[r]) for r in sorted(members)]
    if single_ops:
        seen = set()
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem or _op_name(node) in _VIEW:
                continue
            shapes = tuple(tuple(getattr(values.get(a.name), "shape", ())) for a in node.all_input_nodes)
            key = (str(node.target), shapes, node.name in needs, str(node.args[1:]) if len(node.args) > 1 else "")
            if key in seen:
                continue
            seen.add(key)
            getitems = [u for u in node.users if u.target is operator.getitem]
            groups.append(("op", node.name, [a for a in node.all_input_nodes if a.op == "get_attr"] + [node] + getitems))
    results = []
    for kind, name, nodes in groups:
        run = _build_group(gm, nodes, values, needs, name)
        fwd_s, bwd_s, peak = _time_group(run, warmup=warmup, repeats=repeats, params=params)
        fwd_f, bwd_f = group_features(nodes, needs)
        results.append({"kind": kind, "name": name, "fwd_s": fwd_s, "bwd_s": bwd_s, "peak_live_bytes": peak,
                        "fwd_features": asdict(fwd_f), "bwd_features": asdict(bwd_f)})
    if progress:
        progress(f"calibrate: measured {sum(r['kind'] == 'region' for r in results)} regions and "
                 f"{sum(r['kind'] == 'op' for r in results)} distinct ops, {repeats} repeats each")
    return results


def fit_profile(measurements: Sequence[dict], *, kind: str, meta: dict | None = None) -> DeviceProfile:
    """Fit both directions from ``measure``'s rows (groups with no backward are left out of that fit)."""
    fwd = [m for m in measurements if m["fwd_s"] > 0]
    bwd = [m for m in measurements if m["bwd_s"] > 0 and any(Features(**m["bwd_features"]).vector())]
    fwd_rows = [(Features(**m["fwd_features"]), m["fwd_s"]) for m in fwd]
    bwd_rows = [(Features(**m["bwd_features"]), m["bwd_s"]) for m in bwd]
    if len(fwd_rows) < 2 or len(bwd_rows) < 2:
        raise ValueError(f"calibration measured too little to fit ({len(fwd_rows)} forward, "
                         f"{len(bwd_rows)} backward groups): use a model with trainable ops")

    def weights(ms):
        # Single ops are there to tell the terms apart; regions are what gets predicted: all the
        # regions together weigh REGION_WEIGHT times all the single ops together.
        num_regions = sum(m.get("kind") == "region" for m in ms) or 1
        num_ops = sum(m.get("kind") != "region" for m in ms) or 1
        return [REGION_WEIGHT * num_ops / num_regions if m.get("kind") == "region" else 1.0 for m in ms]

    forward = fit_direction(fwd_rows, weights=weights(fwd))
    backward = fit_direction(bwd_rows, weights=weights(bwd))

    def quality(fit, rows, which):
        errs = relative_errors(fit, rows)
        return {f"{which}_median_rel_error": statistics.median(errs), f"{which}_worst_rel_error": max(errs),
                f"{which}_rows": len(rows)}

    info = {"torch": torch.__version__, "machine": platform.machine(), "processor": platform.processor() or None,
            "threads": torch.get_num_threads(), **(meta or {}),
            **quality(forward, fwd_rows, "forward"), **quality(backward, bwd_rows, "backward")}
    return DeviceProfile(kind=kind, forward=forward, backward=backward, meta=info, measurements=tuple(measurements))


def calibrate(workload, gm: fx.GraphModule, *, kind: str | None = None, warmup: int = 3, repeats: int = 10,
              threads: int | None = 1, progress: Callable[[str], None] | None = None) -> DeviceProfile:
    """Measure ``gm``'s regions and ops here and fit a profile for this device kind."""
    kind = kind or local_device_kind()
    rows = measure(workload, gm, warmup=warmup, repeats=repeats, threads=threads, progress=progress)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return fit_profile(rows, kind=kind, meta={"workload": workload.name, "warmup": warmup, "repeats": repeats,
                                                  "threads": threads or old})
    finally:
        torch.set_num_threads(old)


@dataclass(frozen=True)
class CalibrationConfig:
    """What ``compile(..., calibrate=CalibrationConfig(...))`` measures, and where it saves the fit."""

    warmup: int = 3
    repeats: int = 10
    threads: int | None = 1
    kind: str | None = None  # default: this machine's device (local_device_kind)
    profile_out: str | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"calibration repeats={self.repeats} must be >= 1 and warmup={self.warmup} >= 0")

    def run(self, workload, gm: fx.GraphModule, *, progress: Callable[[str], None] | None = None) -> DeviceProfile:
        profile = calibrate(workload, gm, kind=self.kind, warmup=self.warmup, repeats=self.repeats,
                            threads=self.threads, progress=progress)
        if self.profile_out:
            profile.save(self.profile_out)
            if progress:
                fwd, bwd = profile.meta["forward_median_rel_error"], profile.meta["backward_median_rel_error"]
                progress(f"calibrate: wrote {self.profile_out} (kind {profile.kind}; fit median error "
                         f"forward {fwd:.0%}, backward {bwd:.0%})")
        return profile
