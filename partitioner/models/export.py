"""`partitioner export TARGET -o DIR`: a checkpoint as one consolidated set of weights by original
name, in the format ``from_pretrained`` reads.

TARGET: a program folder (its checkpoints/), the run folder beside it (DIR/run), a checkpoint
folder (step_N directories; the program from --program or the folder above), or one step_N
directory. A folder exports its newest committed checkpoint; every shard is read through
runtime/resilience/checkpoint (manifest, size and sha256 checked), so a corrupt checkpoint is refused with
the reason and a partial one (no manifest) is never exported. A Hugging Face model
(runtime.execute.pretrained:hf_weights in the program) is written by ``save_pretrained``: config.json
and model.safetensors (sharded above 5 GB, with its index); buffers the checkpoint does not hold
(they never change: rotary tables, position ids) are made as the ranks made them. The built-in
``gpt`` is written as transformers' GPT2LMHeadModel the same way (Note [the built-in gpt is GPT-2]
in partitioner/models/gpt_as_gpt2.py); a built-in ``hf-*`` compiled on cpu (its weights made at
compile time) carries no config, and the report says to compile it with device=meta. Any other model: model.safetensors by original names, and
the report says in one line why there is no config.json and how to load the file. DIR is built in a temporary sibling, fsynced and renamed
into place: it exists whole or not at all.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from partitioner.models import gpt_as_gpt2
from partitioner.models.hf import no_progress_bars
from runtime import scratch
from runtime.execute import pretrained
from runtime.resilience.checkpoint import MANIFEST, fsync_dir, list_step_dirs, load_for_rank, step_dirname
from runtime.program.spec import load_plan

HF_WEIGHTS = "runtime.execute.pretrained:hf_weights"


@dataclass(frozen=True)
class ExportReport:
    output: Path
    step: int
    checkpoint: Path
    num_tensors: int
    bytes: int
    files: tuple[str, ...]
    architecture: str | None
    skipped: tuple[str, ...] = ()  # newer step directories that are not committed checkpoints
    no_config: str | None = None  # why no config.json was written (no transformers class fits the model)

    def text(self) -> str:
        lines = [f"exported step {self.step} of {self.checkpoint} ({self.num_tensors} tensors, "
                 f"{self.bytes / 2**20:.1f} MiB) to {self.output}: {', '.join(self.files)}"]
        lines += [f"  not exported: {why}" for why in self.skipped]
        if self.architecture:
            lines.append(f"load it: transformers.{self.architecture}.from_pretrained({str(self.output)!r})")
        elif self.no_config:
            weights = str(self.output / "model.safetensors")
            lines.append(f"no config.json: {self.no_config}; load it into your model: "
                         f"model.load_state_dict(safetensors.torch.load_file({weights!r}))")
        return "\n".join(lines)


def _program_folder(path: Path) -> Path | None:
    return path if (path / "plan.json").is_file() else None


def resolve(target: Path, program_dir: Path | None) -> tuple[Path, Path, int | None]:
    """(checkpoint folder, program folder, one step or None) named by TARGET."""
    # lazy: loads OR-Tools
    from partitioner.inspect.checkpoints import is_checkpoint_dir, is_step_dir

    target = Path(target)
    if target.is_file() and target.name == "manifest.json":
        target = target.parent
    if not target.exists():
        raise ValueError(f"export {target}: no such file or folder; pass a program folder, its checkpoint "
                         "folder or one step_N in it")
    step = None
    if is_step_dir(target):
        ckpt, step = target.parent, int(target.name.removeprefix("step_"))
    elif _program_folder(target):
        ckpt = target / "checkpoints"
    elif (target / "metrics.jsonl").is_file() and _program_folder(target.parent):  # DIR/run
        ckpt = target.parent / "checkpoints"
    elif is_checkpoint_dir(target):
        ckpt = target
    else:
        raise ValueError(f"export {target}: not a program folder, a run folder beside one, a checkpoint folder "
                         "(step_N directories) or a step_N directory")
    if program_dir is not None and not (Path(program_dir) / "plan.json").is_file():
        raise ValueError(f"export --program {program_dir}: no plan.json there; pass the folder `partitioner compile "
                         "-o DIR` wrote")
    program = program_dir or _program_folder(ckpt.parent) or (_program_folder(target) if target != ckpt else None)
    if program is None or not (Path(program) / "plan.json").is_file():
        raise ValueError(f"export {target}: cannot find the program folder of {ckpt} (it is not beside it): "
                         "pass --program DIR, the folder `partitioner compile -o DIR` wrote")
    return ckpt, Path(program), step


def committed_steps(ckpt: Path) -> list[int]:
    """The steps of ``ckpt`` with a manifest (committed checkpoints), newest first; none of a missing folder."""
    return [s for s in list_step_dirs(str(ckpt)) if (Path(ckpt) / step_dirname(s) / MANIFEST).is_file()]


def choose_step(ckpt: Path, step: int | None) -> tuple[int, tuple[str, ...]]:
    """The step to export: the one named (refused if it was never committed), or the newest
    committed one. Newer uncommitted step directories are reported, never exported."""
    steps = list_step_dirs(str(ckpt))
    committed = committed_steps(ckpt)
    if step is not None:
        if step not in committed:
            newest = f"the newest committed one is {ckpt / step_dirname(committed[0])}" if committed else \
                "it holds no committed checkpoint"
            raise ValueError(f"export: {ckpt / step_dirname(step)} has no {MANIFEST}: a partial checkpoint (a run "
                             f"stopped while writing it) is not a checkpoint; {newest}")
        return step, ()
    if not committed:
        raise ValueError(f"export: {ckpt} holds no committed checkpoint (no step_N with a {MANIFEST}); "
                         "`partitioner run DIR --steps N` always leaves one of its last step")
    skipped = tuple(f"{ckpt / step_dirname(s)} (no {MANIFEST}: partial)" for s in steps if s > committed[0])
    return committed[0], skipped


def read_state(ckpt: Path, step: int, program) -> dict[str, torch.Tensor]:
    """Every trained parameter and mutable buffer of checkpoint ``step``, verified shard by shard."""
    names = program.params_of(range(program.num_stages))
    names += [n for s in program.stages for n in s.mutable_buffers]
    loaded = load_for_rank(str(ckpt), step, program, -1, names)  # rank -1: no own shard, any holder
    return {**loaded.params, **loaded.buffers}


@dataclass(frozen=True)
class TrainedState:
    """One committed checkpoint of a program folder, consolidated: what export writes and
    generate samples from (partitioner/models/generate.py)."""

    state: dict[str, torch.Tensor]  # every trained parameter and mutable buffer by original name
    step: int
    checkpoint: Path
    skipped: tuple[str, ...]  # newer step directories that are not committed checkpoints
    weights_spec: list | None  # plan.json program.init.weights: how the ranks made the model's tensors


def trained_state(ckpt: Path, folder: Path, step: int | None = None) -> TrainedState:
    """Checkpoint ``step`` of ``ckpt`` (None: the newest committed) of the program in ``folder``,
    checked against that program and read shard by shard (choose_step, read_state)."""
    # lazy: loads OR-Tools
    from partitioner.inspect.checkpoints import program_of

    program = program_of(folder)
    step, skipped = choose_step(Path(ckpt), step)
    weights_spec = (load_plan(str(folder))["program"].get("init") or {}).get("weights")
    state = read_state(Path(ckpt), step, program)
    check_model_shapes(state, model_shapes(Path(folder), program, weights_spec), Path(ckpt) / step_dirname(step))
    return TrainedState(state, step, Path(ckpt), skipped, weights_spec)


def model_shapes(folder: Path, program, weights_spec) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in the model the program trains, from headers alone (nothing is
    materialised): the meta-built Hugging Face model, else the program's weights/ headers and its
    init recipes (a model compiled on meta)."""
    if is_hf(weights_spec):
        kwargs = weights_spec[1]
        model = pretrained.build_meta(kwargs["config"], kwargs["architecture"])
        return {n: tuple(getattr(*pretrained.owner_of(model, n)).shape) for n in pretrained.aliases(model)}
    # lazy: loads safetensors
    from safetensors import SafetensorError, safe_open

    shapes = {n: tuple(r.shape) for n, r in (program.init.params.items() if program.init else ())}
    for k in range(program.num_stages):
        path = folder / "weights" / f"stage_{k}.safetensors"
        if not path.is_file():
            continue
        try:
            with safe_open(str(path), framework="pt") as fh:
                shapes.update({n: tuple(fh.get_slice(n).get_shape()) for n in fh.keys()})
        except SafetensorError as exc:
            raise ValueError(f"export: {path} is not a safetensors file ({exc}): recompile the program "
                             "(`partitioner compile ... -o DIR`)") from None
    return shapes


def check_model_shapes(state: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], where: Path) -> None:
    """A checkpoint tensor of another shape than the model's is refused by name, both shapes
    given: its header lies (the sha256 was made to match) or it is another configuration's, and
    written out it would load into nothing (from_pretrained refuses it, or worse, broadcasts)."""
    for name, tensor in sorted(state.items()):
        want = shapes.get(name)
        if want is not None and tuple(tensor.shape) != want:
            raise ValueError(f"export: checkpoint {where} holds {name} of shape {list(tensor.shape)}, but the "
                             f"model's {name} is {list(want)}: the checkpoint does not fit this program's model; "
                             "export a checkpoint this program wrote (an older step_N), or pass --program with "
                             "the program that wrote it")


def is_hf(weights_spec) -> bool:
    return bool(weights_spec) and weights_spec[0] == HF_WEIGHTS


def hf_model(state: dict[str, torch.Tensor], weights_spec: list) -> tuple[torch.nn.Module, set]:
    """The transformers model of ``weights_spec`` holding ``state`` (tied names share one tensor);
    buffers the checkpoint does not hold are made as the ranks made them. Returns the model and its
    groups of tied names."""
    kwargs = dict(weights_spec[1])
    model = pretrained.build_meta(kwargs["config"], kwargs["architecture"])
    alias = pretrained.aliases(model)
    unknown = sorted(set(state) - set(alias))
    if unknown:
        raise ValueError(f"the checkpoint holds {unknown[:3]}, which {kwargs['architecture']} does not have: "
                         "export with the program folder that wrote it (--program)")
    groups = {tuple(names) for names in alias.values()}
    held = {names: next((state[n] for n in names if n in state), None) for names in groups}
    made = pretrained.hf_weights([names[0] for names, v in held.items() if v is None], **kwargs, report=False)
    for names, value in held.items():
        value = made[names[0]] if value is None else value
        owner, leaf = pretrained.owner_of(model, names[0])
        is_param = leaf in owner._parameters
        tensor = torch.nn.Parameter(value.clone(), requires_grad=True) if is_param else value.clone()
        for name in names:
            o, l = pretrained.owner_of(model, name)
            (o._parameters if is_param else o._buffers)[l] = tensor
    return model, groups


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(str(folder))


def _write_hf(tmp: Path, state: dict[str, torch.Tensor], weights_spec: list) -> str:
    model, groups = hf_model(state, weights_spec)
    with no_progress_bars():
        model.save_pretrained(str(tmp))
    _every_tied_name(tmp / "model.safetensors", groups)
    return weights_spec[1]["architecture"]


def _every_tied_name(path: Path, groups) -> None:
    """save_pretrained stores a tied group under one name (from_pretrained ties the rest again); a
    user's ``load_state_dict(..., strict=True)`` wants every name, so the file gets the others as
    copies (equal values: from_pretrained loads them as they are). A sharded save keeps its index."""
    # lazy: loads safetensors
    from safetensors.torch import load_file, save_file

    if not path.is_file():
        return
    stored = load_file(str(path))
    added = {}
    for names in groups:
        have = next((n for n in names if n in stored), None)
        if have is not None:
            added.update({n: stored[have].clone() for n in names if n not in stored})
    if added:
        save_file({**stored, **added}, str(path), metadata={"format": "pt"})


def _as_gpt2(state: dict[str, torch.Tensor], workload: str | None) -> tuple[dict | None, str | None]:
    """(the built-in GPT's arguments, None) when ``state`` converts to GPT2LMHeadModel, else (None, why
    not: a line for the report)."""
    args = gpt_as_gpt2.gpt_args(workload)
    builtin_hf = re.fullmatch(r"(hf-[\w-]+)\(.*\)", workload or "")
    if args is None and builtin_hf:
        # its name leaves out settings its config needs (dropout, experts): rebuilt from it, a config
        # could be silently wrong, so only a program that carries its config (device=meta) gets one
        return None, (f"{workload} was compiled with its weights made at compile time, so its program holds no "
                      f"Hugging Face config; to export one, compile it as {builtin_hf.group(1)}:...,device=meta "
                      "(every rank then makes its weights from the config)")
    if args is None:
        return None, (f"{workload or 'the model'} is neither a Hugging Face model nor the built-in gpt, so no "
                      "transformers class is known to fit it")
    off = gpt_as_gpt2.mismatch(state, args)
    if off is not None:
        return None, f"the workload is named {workload}, but {off}, so it is not written as GPT-2"
    if importlib.util.find_spec("transformers") is None:  # the [hf] extra; without it, the gpt's own names
        return None, ("writing the built-in gpt as GPT2LMHeadModel needs transformers "
                      "(pip install -c constraints.txt '.[hf]'), and it is not installed")
    return args, None


def _write_gpt2(tmp: Path, state: dict[str, torch.Tensor], args: dict) -> str:
    model = gpt_as_gpt2.gpt2_model(state, args)
    with no_progress_bars():
        model.save_pretrained(str(tmp))
    return gpt_as_gpt2.ARCHITECTURE


def export(target, output, *, program_dir=None) -> ExportReport:
    # lazy: loads safetensors
    from safetensors.torch import save_file

    output = Path(output)
    if output.is_symlink():  # a dangling one too: the rename below would write through it
        raise ValueError(f"export -o {output}: it is a symbolic link (to {os.readlink(output)}); pass a new "
                         "folder (export never writes through a link)")
    if output.exists():
        raise ValueError(f"export -o {output}: it exists; pass a new folder (export never overwrites)")
    if not output.parent.is_dir():
        raise ValueError(f"export -o {output}: its parent folder {output.parent} does not exist")
    ckpt, folder, step = resolve(Path(target), Path(program_dir) if program_dir else None)
    trained = trained_state(ckpt, folder, step)
    state, step, skipped, weights_spec = trained.state, trained.step, trained.skipped, trained.weights_spec
    prefix = f".{output.name}.tmp-"
    scratch.sweep_abandoned(str(output.parent), prefix)  # Note [abandoned scratch folders] in runtime/scratch.py
    path, lock = scratch.make_scratch(str(output.parent), prefix)  # mkdtemp: 0700, a fresh name no link can hold
    tmp = Path(path)
    try:
        architecture, no_config = None, None
        if is_hf(weights_spec):
            architecture = _write_hf(tmp, state, weights_spec)
        else:
            gpt, no_config = _as_gpt2(state, load_plan(str(folder)).get("workload"))
            if gpt is not None:
                architecture = _write_gpt2(tmp, state, gpt)
            else:
                save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        _fsync_tree(tmp)
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        scratch.release(lock)

    fsync_dir(str(output.parent))
    files = tuple(sorted(p.name for p in output.iterdir()))
    size = sum(v.numel() * v.element_size() for v in state.values())
    return ExportReport(output, step, ckpt, len(state), size, files, architecture, skipped, no_config)
