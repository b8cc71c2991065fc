"""Compile a workload to a program folder, and train several folders in one torchrun launch: what
the end-to-end and distributed tests share."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import partitioner
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt, hf_llama
from tests.drivers import RUN_MANY
from runtime.launch.torchrun import run_env, torchrun_command

STEPS = 3


def tiny_llama():
    """The tensor-parallel tests' Llama: 4 heads over tp 2, dropout on (the masks must match the oracle's)."""
    return hf_llama(layers=2, width=32, heads=4, vocab=64, seq=8, batch=2, dropout=0.1)


def tiny_gpt():
    """The built-in GPT at the same size: a fused qkv in Megatron's per-head layout, split column-wise."""
    return gpt(layers=2, width=32, heads=4, vocab=64, seq=8, batch=2, dropout=0.1)


def compile_to(folder: Path, workload, *, devices, global_batch=8, flops_per_s=None, **options):
    """``flops_per_s``: a slower cpu, so that compute, not the per-microbatch overhead (Note
    [whole-step terms]), decides where a tiny model is cut."""
    cluster = (ClusterSpec.homogeneous(devices, "cpu") if flops_per_s is None else
               ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": devices, "flops_per_s": flops_per_s}]}))
    plan = partitioner.compile(workload, cluster=cluster, global_batch=global_batch, **options)
    plan.save(folder)
    return plan


def run_folders(world_size: int, folders: list[Path], steps: int = STEPS) -> str:
    """Train every folder in one torchrun of `world_size` workers (one import of torch each);
    returns their output."""
    for folder in folders:
        assert json.loads((folder / "plan.json").read_text())["program"]["world_size"] == world_size
    jobs = [arg for folder in folders for arg in ("--", str(folder), "--steps", str(steps))]
    command = torchrun_command(RUN_MANY, world_size, args=jobs[1:])
    done = subprocess.run(command, env=run_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout
