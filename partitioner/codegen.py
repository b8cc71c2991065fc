"""Plan + traced graph → the program folder (DESIGN section 6).

```
DIR/plan.json          the plan, its hash, the "program" the runtime reads, every file's sha256, and
                       the solver's problem and assignment (what `inspect --node` prices moves with)
DIR/stage_<k>.py       stage k's forward as FX emits it, with the user's source lines as comments
DIR/rank_<r>.py        rank r: its stages, its pipeline and data-parallel peers, one call into runtime
DIR/train.py           the torchrun entry: runs rank_<RANK>.py (both: runtime/entry_files.py)
DIR/weights/stage_<k>.safetensors   initial parameters keyed by their original names
DIR/README.md          how to run it here and on N nodes
```
Same inputs give the same bytes: nothing here reads the clock, and every mapping is sorted or
in graph order. Generated files import only torch and runtime, and the modules that register
custom ops a stage calls (Note [custom ops travel]).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import textwrap
from pathlib import Path

import torch
import torch.fx as fx

from partitioner.plan import Plan
from partitioner.solver import serialize
from partitioner.split import StageGraph
from runtime.entry_files import entry_files


# Names FX code may use besides `torch`, and how a generated file defines them.
_GLOBAL_DEFS = {
    "torch": None,
    "inf": "inf = float('inf')",
    "nan": "nan = float('nan')",
    "device": "device = torch.device",
    "NoneType": "NoneType = type(None)",
    "runtime_recompute_checkpointed":
        "from runtime.recompute import checkpointed as runtime_recompute_checkpointed",
}


# Op namespaces torch itself registers: a stage calling them needs only `import torch`.
_TORCH_NAMESPACES = {"aten", "prims", "prim", "quantized", "_quantized", "c10d", "c10d_functional",
                     "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "higher_order",
                     "profiler", "rngprims", "inductor", "debugprims", "mkldnn", "mkl", "onednn"}


def op_modules(*graphs: fx.Graph) -> list[str]:
    """The Python modules that register every op namespace ``graphs`` call outside torch's own.

    Note [custom ops travel]: an op such as ``torch.ops.transformers.grouped_mm_fallback`` (the
    MoE kernel of Hugging Face transformers) exists only once the module that defines it has run,
    and a torchrun worker imports nothing but the stage file. The stage file therefore imports,
    for each such op, the module its ``torch.library.custom_op`` definition lives in, or else the
    package named like the namespace. An op with neither is refused here, at compile time."""
    from torch._library.custom_ops import OPDEFS

    modules: set[str] = set()
    for node in (n for graph in graphs for n in graph.nodes):
        target = node.target
        namespace = getattr(target, "namespace", None)
        if node.op != "call_function" or namespace is None or namespace in _TORCH_NAMESPACES:
            continue
        qualname = target.name().split(".")[0]  # "ns::op" (the overload is not part of the key)
        definition = OPDEFS.get(qualname)
        module = getattr(getattr(definition, "_init_fn", None), "__module__", None)
        if module is None or module == "__main__":
            import importlib.util

            module = namespace if importlib.util.find_spec(namespace) is not None else None
        if module is None:
            raise ValueError(
                f"node {node.name!r} calls the custom op {qualname}, and no importable module registers "
                f"it (no torch.library.custom_op definition in an importable module, no package "
                f"named {namespace!r}): define the op with torch.library.custom_op in an importable "
                "module so that the generated stage file can import it")
        modules.add(module)
    return sorted(modules)


def stage_source(stage: StageGraph, plan_hash: str, plan: Plan) -> str:
    code = stage.gm.graph.python_code("self", verbose=True)
    methods = [(run, run.graph.python_code("self", verbose=True)) for run in stage.checkpointed]
    custom_op_imports = [f"import {m}  # registers torch.ops it calls (Note [custom ops travel])"
                         for m in op_modules(stage.gm.graph, *(run.graph for run in stage.checkpointed))]
    preamble = []
    sources = [code] + [c for _, c in methods]
    # Keyed random ops (Note [randomness keyed by meaning] in runtime/randomness.py) read as
    # `randomness.dropout(...)`, from one import, instead of FX's mangled global names.
    keyed = {name: obj for c in sources for name, obj in c.globals.items()
             if getattr(obj, "__module__", None) == "runtime.randomness"}

    def readable(src: str) -> str:
        src = src.strip("\n")
        for name, obj in keyed.items():
            src = re.sub(rf"(?<![.\w]){re.escape(name)}\(", f"randomness.{obj.__name__}(", src)
        return src

    texts = [readable(c.src) for c in sources]
    if keyed:
        preamble.append("from runtime import randomness")
    used = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", "\n".join(texts)))
    for name in sorted(set().union(*(c.globals for c in sources)) & used):
        if name not in _GLOBAL_DEFS:
            raise ValueError(f"stage {stage.index} uses {name!r}, which a generated file cannot import")
        if _GLOBAL_DEFS[name]:
            preamble.append(_GLOBAL_DEFS[name])
    body = _comment_checkpoint_calls(texts[0], stage.checkpointed)
    for (run, _), text in zip(methods, texts[1:]):
        body += "\n\n" + _method_source(run, text)
    names = plan.stages[stage.index].region_names
    lines = [
        f'"""Stage {stage.index} of {plan.num_stages}: {", ".join(names)}.',
        "",
        f"Generated by partitioner from plan {plan_hash} for {plan.workload}.",
        "The forward below is the traced model's own code for this stage, as torch.fx emits it;",
        "comments point at the model's source lines. Do not edit: the runtime checks every file",
        "against the sha256 listed in plan.json.",
        *_recompute_paragraph(stage, plan),
        '"""',
        "import torch",
        *custom_op_imports,
        *preamble,
        "",
        f"PARAMETERS = {json.dumps(stage.params, indent=4)}",
        f"BUFFERS = {json.dumps(stage.buffers, indent=4)}  # held, never trained",
        "# Updated in place by forward (running statistics): checkpointed, and kept equal across",
        "# data-parallel replicas (Note [mutable buffers] in partitioner/split.py).",
        f"MUTABLE_BUFFERS = {json.dumps(stage.mutable_buffers, indent=4)}",
        f"INPUTS = {json.dumps([v.name for v in stage.inputs])}",
        f"OUTPUTS = {json.dumps([v.name for v in stage.outputs])}",
        "",
        "",
        f"class Stage{stage.index}(torch.nn.Module):",
        '    """Holds no parameters of its own: runtime.stage registers PARAMETERS under their original names."""',
        "",
        *[("    " + line) if line else "" for line in body.splitlines()],
        "",
    ]
    return "\n".join(_strip_trailing(lines))


def _recompute_paragraph(stage: StageGraph, plan: Plan) -> list[str]:
    """Which regions this stage recomputes and why, with the plan's figures
    (Note [recompute keeps a region's inputs] in partitioner/recompute.py)."""
    if not stage.checkpointed:
        return []
    from partitioner.inspect.units import human_bytes
    from partitioner.solver.problem import in_flight_microbatches

    sp = plan.stages[stage.index]
    regions = list(dict.fromkeys(run.region for run in stage.checkpointed))
    saved_per_sample = sum(r.activation_bytes for r in plan.regions if r.name in regions)
    kept = sum(run.kept_bytes for run in stage.checkpointed)
    in_flight = (in_flight_microbatches(plan.schedule, stage.index, plan.num_stages, plan.num_microbatches)
                 if plan.schedule in ("gpipe", "1f1b") else plan.num_microbatches)
    extra = max(0, in_flight * (plan.microbatch_size * saved_per_sample - kept))
    return [""] + textwrap.wrap(
        f"Recomputed in backward (activation checkpointing through runtime.recompute.checkpointed, one "
        f"checkpoint per region): {', '.join(regions)}. The plan chose it because memory binds on this "
        f"stage's device ({sp.device}): predicted peak {human_bytes(sp.peak_memory_bytes)} with recompute, "
        f"capacity {human_bytes(sp.memory_capacity_bytes)}; keeping these regions' activations "
        f"({human_bytes(saved_per_sample)} per sample) instead of their inputs ({human_bytes(kept)} per "
        f"microbatch) for the {in_flight} microbatch(es) in flight would need about "
        f"{human_bytes(sp.peak_memory_bytes + extra)}.", width=96, break_on_hyphens=False)


def _comment_checkpoint_calls(src: str, runs) -> str:
    """Say above each checkpointed call which region it recomputes (FX has no comment of its own
    for a node it did not trace: it writes 'No stacktrace found')."""
    lines = src.splitlines()
    for run in runs:
        call = f"runtime_recompute_checkpointed(self.{run.name}"
        at = next(i for i, line in enumerate(lines) if call in line)
        comment = f"# region {run.region}: recomputed in backward; its forward is {run.name} below"
        indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
        if at > 0 and lines[at - 1].strip().startswith("# No stacktrace found"):
            lines[at - 1] = indent + comment
        else:
            lines.insert(at, indent + comment)
    return "\n".join(lines)


def _method_source(run, src: str) -> str:
    """The run's graph as a method of the Stage class, named for it, with a docstring."""
    lines = src.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("def forward("))
    lines[start] = lines[start].replace("def forward(", f"def {run.name}(", 1)
    end = next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith(":"))
    doc = (f'    """Region {run.region} (through runtime.recompute.checkpointed): its activations are '
           'dropped\n    after the forward and recomputed in backward."""')
    return "\n".join(lines[:end + 1] + [doc] + lines[end + 1:])


def _strip_trailing(lines: list[str]) -> list[str]:
    return [line.rstrip() for line in lines]


def readme_source(plan: Plan, plan_hash: str) -> str:
    n = plan.world_size
    return f"""# Generated training program: {plan.workload}

Plan `{plan_hash}`: {plan.num_stages} pipeline stage(s) × {plan.dp} data-parallel replica(s) = {n} ranks,
{plan.num_microbatches} microbatches of {plan.microbatch_size} per step ({plan.global_batch} samples),
schedule `{plan.schedule}`, predicted step time {plan.predicted.get("step_time_s", 0):.4g} s.

## Run on this machine

    partitioner run .            # or:
    torchrun --standalone --nproc-per-node {n} train.py --steps 20

## Run on N nodes

Split the {n} ranks over nodes (e.g. 2 nodes × {max(1, n // 2)}), and on every node run

    torchrun --nnodes 2 --nproc-per-node {max(1, n // 2)} --node-rank $NODE_RANK \\
             --rdzv-backend c10d --rdzv-endpoint $MASTER_HOST:29500 train.py --steps 20

## Files

- `plan.json`: the plan, the program the runtime reads, and the sha256 of every file below.
- `stage_<k>.py`: each stage's forward as torch.fx emits it.
- `rank_<r>.py`: which stages a rank holds and its peers.
- `weights/stage_<k>.safetensors`: initial parameters by their original names.
"""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_program(folder: str | Path, *, plan: Plan, stages: list[StageGraph], program: dict,
                  state: dict[str, torch.Tensor] | None, problem=None, assignment=None) -> Path:
    """Write the folder atomically: built in a temporary sibling, renamed into place when whole.

    ``problem`` and ``assignment`` (the solver's, plain numbers) go into plan.json beside the plan
    (outside its hash), so `inspect --node` prices moves exactly as the solver would."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    plan_hash = plan.content_hash()
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        files: dict[str, str] = {}
        for stage in stages:
            files[f"stage_{stage.index}.py"] = stage_source(stage, plan_hash, plan)
        files.update(entry_files(program, plan_hash))
        files["README.md"] = readme_source(plan, plan_hash)
        for name, text in files.items():
            (tmp / name).write_text(text)
            if name.endswith(".py"):
                compile(text, name, "exec")  # a generated file that doesn't parse is our bug
        if state is not None:
            from safetensors.torch import save_file

            (tmp / "weights").mkdir()
            for stage in stages:
                tensors = {name: state[name].detach().to("cpu").contiguous().clone()
                           for name in stage.params + stage.buffers}
                save_file(tensors, str(tmp / "weights" / f"stage_{stage.index}.safetensors"),
                          metadata={"plan_hash": plan_hash})
        digests = {str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        body = plan.stable_dict()
        body["plan_hash"] = plan_hash
        body["program"] = program
        body["files"] = digests
        if problem is not None:
            body["problem"] = serialize.to_dict(problem)
            body["assignment"] = serialize.to_dict(assignment)
        (tmp / "plan.json").write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        # Wall-clock figures: the one file two compiles may differ in (Note [plans are deterministic]).
        (tmp / "compile_stats.json").write_text(json.dumps(plan.timing(), indent=1, sort_keys=True) + "\n")
        if folder.exists():
            if not (folder / "plan.json").exists() and any(folder.iterdir()):
                raise ValueError(f"{folder} exists and is not a program folder: choose another -o DIR")
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        os.chmod(folder, 0o755)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
