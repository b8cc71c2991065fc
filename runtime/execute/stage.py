"""Build one stage's nn.Module from DIR/stage_<k>.py and DIR/weights/stage_<k>.safetensors."""

from __future__ import annotations

import os
import re

import torch
from safetensors.torch import load_file

from typing import TYPE_CHECKING, Sequence

from runtime.program.spec import Program, load_plan
from runtime.program.user_code import enter_user_root, import_path, tensor_dtype

if TYPE_CHECKING:
    from runtime.program.parts import TensorSpec


class StageFileError(ValueError):
    pass


class _Container(torch.nn.Module):
    """A module of the model's tree, holding only what the stage uses: ``self.blocks[0]`` reads
    child "0" as the model's ModuleList does (Note [stage code] in partitioner/codegen/stage_code.py)."""

    def __getitem__(self, key) -> torch.nn.Module:
        return self._modules[str(key)]


def _set_tensor(root: torch.nn.Module, dotted: str, value: torch.Tensor, *, buffer: bool) -> None:
    """Register ``value`` at ``dotted`` (e.g. "blocks.0.attn.qkv.weight"), creating _Containers
    along the path so that ``self.blocks[0].attn.qkv.weight`` resolves."""
    *path, leaf = dotted.split(".")
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = _Container()
            mod.add_module(part, child)
        mod = child
    if buffer:
        mod.register_buffer(leaf, value)
    else:
        mod.register_parameter(leaf, torch.nn.Parameter(value))


def load_stage_module(folder: str, stage_index: int):
    path = os.path.join(folder, f"stage_{stage_index}.py")
    if not os.path.isfile(path):
        raise StageFileError(f"{path} is missing")
    # The stage file imports the copied user module that registers a custom op it calls (Note
    # [custom ops travel]): from this folder's DIR/user/ (Note [one user root] in runtime/program/user_code.py).
    enter_user_root(folder)
    return import_path(path, name=f"_runtime_stage_{stage_index}_{abs(hash(os.path.abspath(path)))}")


# Note [aten ops this torch has]: a stage file calls aten ops by name, as the compiling torch wrote
# them; a cluster's older torch (the runtime runs under 2.11 and later: Note [what the runtime
# needs] in runtime/torch_version.py) may lack one, and would say so only at its first call, deep
# in step 1. Every aten op the file names is looked up when the stage is built instead: one line
# naming the op, the file and the fix.
_ATEN_CALL = re.compile(r"torch\.ops\.aten\.(\w+)\.(\w+)")


def missing_aten_ops(source_text: str) -> list[str]:
    """The ``aten.<op>.<overload>`` names ``source_text`` calls that this torch does not have."""
    missing = []
    for op, overload in sorted(set(_ATEN_CALL.findall(source_text))):
        packet = getattr(torch.ops.aten, op, None)
        if packet is None or not hasattr(packet, overload):
            missing.append(f"aten.{op}.{overload}")
    return missing


def build_stage(folder: str, stage_index: int, device: torch.device | str = "cpu",
                *, weights: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """Instantiate Stage<k> with its parameters (original dotted names) loaded and on ``device``.

    ``weights`` overrides the safetensors file (e.g. a checkpoint keyed by original names).
    """
    source = load_stage_module(folder, stage_index)
    path = os.path.join(folder, f"stage_{stage_index}.py")
    with open(path, encoding="utf-8") as f:
        missing = missing_aten_ops(f.read())
    if missing:  # Note [aten ops this torch has]
        raise StageFileError(f"{path} calls {', '.join(missing[:3])}, which torch {torch.__version__} does not have: "
                             "install the torch the program was compiled with, or compile it again with this torch")
    cls_name = f"Stage{stage_index}"
    cls = getattr(source, cls_name, None)
    if cls is None:
        raise StageFileError(f"{folder}/stage_{stage_index}.py defines no class {cls_name}")
    param_names = list(getattr(source, "PARAMETERS", []))
    buffer_names = list(getattr(source, "BUFFERS", []))
    mutable_names = list(getattr(source, "MUTABLE_BUFFERS", []))
    if not set(mutable_names) <= set(buffer_names):
        raise StageFileError(f"{folder}/stage_{stage_index}.py lists MUTABLE_BUFFERS {sorted(set(mutable_names) - set(buffer_names))} "
                             "that are not in BUFFERS: recompile the program")
    module = cls()
    own = [n for n, _ in module.named_parameters()]
    if own:
        raise StageFileError(f"{cls_name} has parameters of its own {own[:3]}: stage classes must "
                             "take parameters only from PARAMETERS")
    if weights is None:
        wpath = os.path.join(folder, "weights", f"stage_{stage_index}.safetensors")
        weights = load_file(wpath) if os.path.isfile(wpath) and (param_names or buffer_names) else {}
        # Note [constants travel]: a program whose ranks make their weights may still ship, in
        # weights/, the constants the trace lifted (no init can make those); the rest is made here.
        to_make = [n for n in param_names + buffer_names if n not in weights]
        if to_make:  # compiled on the meta device (Note [materialize per rank] in runtime/execute/materialize.py)
            from runtime.execute.materialize import materialize_all

            init = Program.from_dict(load_plan(folder)["program"]).init
            if not init:
                raise StageFileError(f"{wpath} is missing and the program has no init recipes: recompile")
            if init.weights is not None:  # Notes [own initialisation per rank], [pretrained per rank]
                from runtime.program.user_code import resolve_callable

                weights = {**resolve_callable(init.weights, folder)(to_make), **weights}
            else:
                weights = {**materialize_all(to_make, init.params, init.seed), **weights}
    absent = [n for n in param_names + buffer_names if n not in weights]
    if absent:
        raise StageFileError(f"weights for stage {stage_index} lack {absent[:5]} "
                             f"({len(absent)} missing)")
    for name in param_names:
        _set_tensor(module, name, weights[name].clone(), buffer=False)
    for name in buffer_names:
        _set_tensor(module, name, weights[name].clone(), buffer=True)
    module.stage_index = stage_index
    module.parameter_names = tuple(param_names)
    # Note [tensor-parallel stages] in runtime/parallel/tensor_parallel.py: what the file says is split
    module.tensor_parallel_dims = dict(getattr(source, "TENSOR_PARALLEL", {}))
    module.mutable_buffer_names = tuple(mutable_names)
    return module.to(device)


def example_args(specs: "Sequence[TensorSpec]", *, requires_grad: bool) -> tuple[torch.Tensor, ...]:
    """Meta tensors for one microbatch from the plan's input/output specs, so PipelineStage can
    skip shape inference (no forward pass, no communication at start-up). Floating tensors carry
    ``requires_grad`` so gradients flow between stages."""
    out = []
    for spec in specs:
        dtype = tensor_dtype(spec.dtype)
        t = torch.empty(spec.shape, dtype=dtype, device="meta")
        out.append(t.requires_grad_(requires_grad and dtype.is_floating_point))
    return tuple(out)
