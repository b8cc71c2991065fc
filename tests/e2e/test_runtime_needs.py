"""A compiled program folder trains where only a GPU cluster's image is installed (Note [what the
runtime needs] in runtime/torch_version.py): a one-rank GPT folder, compiled here (OR-Tools), runs
its train.py in a process that can import nothing but the standard library, runtime/,
torch with the packages torch requires, numpy and safetensors (tests/drivers/cluster_image/: ortools,
zstandard, tensorboard, transformers, partitioner and passes look not installed). There, asking for
lossless checkpoints, or resuming from one, is one line naming ``pip install zstandard`` before
any step, never a traceback mid-run nor a lossless checkpoint skipped as corrupt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from _programs import compile_to
from partitioner.models.builtin import gpt
from runtime.launch.torchrun import free_port, run_env

REPO = Path(__file__).resolve().parents[2]
IMAGE = REPO / "tests" / "drivers" / "cluster_image"
NEEDED = ("torch", "numpy", "safetensors")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_import_names(roots=NEEDED) -> set[str]:
    """The top-level import names of ``roots`` and of every distribution they require (extras left
    out), as installed here: what a cluster image with those packages has."""
    dists, todo = set(), list(roots)
    while todo:
        name = _norm(todo.pop())
        if name in dists:
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        dists.add(name)
        for requirement in requires:
            if "extra" not in requirement.partition(";")[2]:
                todo.append(re.match(r"[A-Za-z0-9._-]+", requirement)[0])
    return {top for top, of in metadata.packages_distributions().items() if any(_norm(d) in dists for d in of)}


def on_the_image(command: list[str], tmp: Path, **env) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``command`` as on a cluster image; (its result, the modules it loaded and was refused)."""
    report = tmp / f"image_{len(list(tmp.glob('image_*.json')))}.json"
    child = run_env(pythonpath=f"{IMAGE}{os.pathsep}{REPO}")
    child.update({"PARTITIONER_IMAGE_ALLOWS": ",".join(sorted(image_import_names())),
                  "PARTITIONER_IMAGE_REPORT": str(report), **env})
    done = subprocess.run(command, env=child, capture_output=True, text=True, timeout=120)
    seen = json.loads(report.read_text()) if report.exists() else {}
    return done, seen


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("image") / "gpt"
    compile_to(out, gpt(layers=1, width=16, heads=2, vocab=32, seq=8, device="meta"), devices=1,
               num_stages=1, microbatches=2, global_batch=4)
    return out


def _rank_env() -> dict:
    """What torchrun gives a worker of a one-rank job."""
    return dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def test_the_runtime_trains_where_only_torch_numpy_and_safetensors_are_installed(folder, tmp_path):
    done, seen = on_the_image([sys.executable, str(folder / "train.py"), "--steps", "2",
                               "--run-dir", str(tmp_path / "run"), "--checkpoint-dir", str(tmp_path / "ck")],
                              tmp_path, **_rank_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained steps 1..2" in done.stdout
    assert any((tmp_path / "ck").glob("step_*/manifest.json"))  # its last step checkpointed, on the image too
    # the image really lacked the compiler (the editable install would otherwise find it) ...
    assert not {"partitioner", "passes", "ortools", "zstandard"} & set(seen["loaded"]), seen["loaded"]
    # ... and the run loaded only what the image has
    assert {"torch", "numpy", "safetensors", "runtime"} <= set(seen["loaded"])
    if importlib.util.find_spec("tensorboard") is not None:  # installed here, hidden there: the board is off
        assert "tensorboard" in seen["refused"], seen


def test_lossless_checkpoints_without_zstandard_are_one_line_at_start(folder, tmp_path):
    done, _ = on_the_image([sys.executable, str(folder / "train.py"), "--steps", "2",
                            "--checkpoint-compression", "lossless", "--run-dir", str(tmp_path / "run"),
                            "--checkpoint-dir", str(tmp_path / "ck")], tmp_path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "--checkpoint-compression lossless needs the zstandard package" in lines[0]
    assert "pip install zstandard" in lines[0]
    assert "step 1" not in done.stdout  # at start-up (this interpreter has zstandard: the image hid it)


def test_resuming_a_lossless_checkpoint_without_zstandard_is_one_line_not_a_skipped_checkpoint(folder, tmp_path):
    """Without the one line the run skipped every lossless checkpoint as corrupt and trained from
    step 0 (and retention could then delete them)."""
    pytest.importorskip("zstandard")
    ck = tmp_path / "ck"
    write = subprocess.run([sys.executable, str(folder / "train.py"), "--steps", "1",
                            "--checkpoint-compression", "lossless", "--run-dir", str(tmp_path / "run"),
                            "--checkpoint-dir", str(ck)],
                           env=run_env(pythonpath=str(REPO)), capture_output=True, text=True, timeout=120)
    assert write.returncode == 0, write.stderr[-3000:]
    before = sorted(p.name for p in ck.iterdir())
    done, _ = on_the_image([sys.executable, str(folder / "train.py"), "--steps", "2", "--run-dir",
                            str(tmp_path / "run"), "--checkpoint-dir", str(ck)], tmp_path)
    assert done.returncode == 1, done.stdout[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "is a lossless checkpoint" in lines[0] and "pip install zstandard" in lines[0]
    assert "skipping checkpoint" not in done.stdout + done.stderr
    assert sorted(p.name for p in ck.iterdir()) == before  # nothing pruned, nothing written


def test_partitioner_run_and_inspect_need_no_ortools(folder, tmp_path):
    """The command that runs a folder is first-class on a cluster too (Note [the solver loads
    OR-Tools on demand] in partitioner/solver/cp_sat.py): with the compiler's own code present but
    OR-Tools absent, `partitioner run` trains and `partitioner inspect` reads the plan."""
    allow = ",".join(sorted(image_import_names() | {"partitioner", "passes"}))
    run, seen = on_the_image([sys.executable, "-m", "partitioner", "run", str(folder), "--steps", "2",
                              "--run-dir", str(tmp_path / "run"), "--checkpoint-dir", str(tmp_path / "ck")], tmp_path,
                             PARTITIONER_IMAGE_ALLOWS=allow)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained steps 1..2" in run.stdout
    assert "ortools" not in seen["loaded"], seen
    shown, seen = on_the_image([sys.executable, "-m", "partitioner", "inspect", str(folder)], tmp_path,
                               PARTITIONER_IMAGE_ALLOWS=allow)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "ortools" not in seen["loaded"], seen
