"""Write the program folder atomically (docs/design.md §6): every file built in a temporary
sibling, checked, hashed into plan.json, and renamed into place only when whole."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from partitioner.codegen.readme import readme_source
from partitioner.codegen.split import StageGraph
from partitioner.codegen.stage_code import stage_source
from partitioner.solver.plan import Plan
from partitioner.solver import serialize
from runtime.errors import DiskFullError, is_no_space
from runtime.launch.entry_files import entry_files
from runtime.program.spec import Program, file_digests, seal_plan


def write_program(folder: str | Path, *, plan: Plan, stages: list[StageGraph], program: Program,
                  state: dict[str, torch.Tensor] | None, problem=None, assignment=None,
                  user_files: dict[str, str] | None = None, op_imports: dict[str, str] | None = None,
                  check_user_files: Callable[[Path], None] | None = None) -> Path:
    """Write the folder atomically: built in a temporary sibling, renamed into place when whole.

    ``problem`` and ``assignment`` (the solver's, plain numbers) go into plan.json beside the plan
    (outside its hash), so `inspect --node` prices moves exactly as the solver would.
    ``user_files``: {"user/<file>.py": original path}, the user's files the ranks import, copied
    in and hashed like the rest (Note [user code travels] in partitioner/frontend/user_source.py);
    ``check_user_files(tmp)`` then tries them as a rank will, before anything else is written
    (Note [local modules travel]); ``op_imports``: the module each custom op's stage file imports
    (Note [custom ops travel] in partitioner/codegen/stage_code.py)."""
    folder = Path(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError as exc:
        raise _unwritable(folder, exc) from None
    plan_hash = plan.content_hash()
    try:
        files: dict[str, str] = {}
        for stage in stages:
            files[f"stage_{stage.index}.py"] = stage_source(stage, plan_hash, plan, op_imports)
        files.update(entry_files(program))
        files["README.md"] = readme_source(plan, plan_hash)
        for name, text in files.items():  # O(stages) files: Note [roles from the plan] in runtime/launch/entry_files.py
            (tmp / name).write_text(text)
            if name.endswith(".py"):
                compile(text, name, "exec")  # a generated file that doesn't parse is our bug
        for rel, original in sorted((user_files or {}).items()):
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(original, tmp / rel)
        if user_files and check_user_files is not None:
            check_user_files(tmp)
        if state is not None:
            # lazy: loads safetensors
            from safetensors.torch import save_file

            (tmp / "weights").mkdir()
            for stage in stages:
                # all of a stage's tensors, or only the lifted constants of a program whose ranks
                # make their weights (Note [constants travel] in runtime/execute/stage.py)
                tensors = {name: state[name].detach().to("cpu").contiguous().clone()
                           for name in stage.params + stage.buffers if name in state}
                if tensors:
                    save_file(tensors, str(tmp / "weights" / f"stage_{stage.index}.safetensors"),
                              metadata={"plan_hash": plan_hash})
        digests = file_digests(str(tmp))  # every file written so far (plan.json comes next)
        body = plan.stable_dict()
        body["plan_hash"] = plan_hash
        body["program"] = program.to_dict()  # the one JSON form; the ranks read it back (load_program)
        if problem is not None:
            body["problem"] = serialize.to_dict(problem)
            body["assignment"] = serialize.to_dict(assignment)
        # The file map and program_hash over all of plan.json (Note [folder integrity] in runtime/program/spec.py).
        body = seal_plan(body, digests)
        (tmp / "plan.json").write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        # Wall-clock figures: the one file two compiles may differ in (Note [plans are deterministic]).
        (tmp / "compile_stats.json").write_text(json.dumps(plan.timing(), indent=1, sort_keys=True) + "\n")
        if folder.exists():
            if not (folder / "plan.json").exists() and any(folder.iterdir()):
                raise ValueError(f"{folder} exists and is not a program folder: choose another -o DIR")
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        os.chmod(folder, 0o755)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, DiskFullError) and is_no_space(exc):
            raise _unwritable(folder, exc) from exc
        raise
    return folder


def _unwritable(folder: Path, exc: OSError) -> Exception:
    """One line naming the program folder and the fix (docs/design.md §8), not an errno."""
    if is_no_space(exc):
        return DiskFullError(f"No space left on device writing the program folder {folder}: free space on the disk "
                             f"of {folder.parent}, or pass -o DIR on a disk with room (nothing was left behind)")
    return ValueError(f"-o {folder}: cannot write a folder in {folder.parent} ({exc.strerror or exc}): pass -o DIR "
                      "in a folder you can write")
