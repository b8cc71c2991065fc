"""A rank's place in the world: its device, made current before any group talks, and the default
process group it joins (rank.py's start-up and the elastic re-plan's, elastic.py)."""

from __future__ import annotations

import os
from datetime import timedelta

from runtime.launch.torchrun import LOOPBACK, loopback_store


class LaunchError(ValueError):
    """The process was started in a way that does not match the program (world size, rank)."""


def worker_store(rank: int, world: int, timeout: timedelta):
    """The store init_process_group meets on. On a single host (MASTER_ADDR is loopback) rank 0
    serves it on 127.0.0.1 only (Note [loopback only] in runtime/launch/torchrun.py); across hosts,
    None: torch's env:// store, which listens on every interface (README "Trust model")."""
    addr = os.environ.get("MASTER_ADDR", "")
    if addr not in ("127.0.0.1", "localhost", "::1") or "MASTER_PORT" not in os.environ:
        return None
    # lazy: loads torch
    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    if rank == 0:
        return loopback_store(port, world_size=world, timeout_s=timeout.total_seconds())
    return dist.TCPStore(LOOPBACK, port, world, False, timeout)


# Note [every rank on one GPU]: a check's override, never a user's: PARTITIONER_ONE_GPU_RANKS=1 puts
# every rank of a host on cuda:0 and makes the default group gloo for CPU and CUDA tensors alike.
# NCCL refuses two ranks of one communicator on one GPU, so this is how one GPU runs a multi-rank
# program's CUDA tensors through the runtime's data-parallel code (gloo all-reduces and broadcasts
# CUDA tensors through host copies); it tests the device handling, not NCCL. Pipeline programs
# stay out: gloo's send and receive take host pointers (benchmarks/gpu_check.py, phase P7).
ONE_GPU_RANKS = "PARTITIONER_ONE_GPU_RANKS"


def one_gpu_ranks() -> bool:
    return os.environ.get(ONE_GPU_RANKS) == "1"


def rank_device(kind: str, local_rank: int):
    """This rank's device, made current before any group talks: NCCL puts a communicator on the
    current device, and without set_device that is cuda:0 on every rank of a host."""
    import torch  # lazy: loads torch

    if kind != "cuda":
        return torch.device(kind)
    if one_gpu_ranks():  # Note [every rank on one GPU]
        local_rank = 0
    count = torch.cuda.device_count()
    if local_rank >= count:
        ranks = os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1))
        fix = (f"start at most {count} ranks per host (torchrun --nproc-per-node {count}, or --hosts), or make "
               "more GPUs visible (CUDA_VISIBLE_DEVICES)") if count else \
            "run it on a GPU host, or compile the program for --device cpu"
        raise LaunchError(f"{ranks} ranks on this host (LOCAL_RANK {local_rank} wants cuda:{local_rank}) but "
                          f"torch.cuda.device_count() is {count}: {fix}")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def init_group(backend: str, rank: int, world: int, timeout: timedelta, device, store=None) -> None:
    """The default process group, bound to the rank's device under CUDA (one NCCL communicator made
    at once and split for every new group, not one per group at its first use); on ``store`` when
    given (a smaller world on the store a larger one met on: Note [standing by])."""
    import torch.distributed as dist  # lazy: loads torch

    bound = {"device_id": device} if device.type == "cuda" else {}
    if device.type == "cuda" and one_gpu_ranks():  # Note [every rank on one GPU]
        backend, bound = "cpu:gloo,cuda:gloo", {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                            store=store if store is not None else worker_store(rank, world, timeout), **bound)


def init_world(rank: int, world: int, timeout_s: float, backend: str, device_kind: str = "cpu",
               store=None) -> None:
    """The default process group, before the program is chosen (runtime/launch/elastic.py)."""
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    init_group(backend, rank, world, timedelta(seconds=timeout_s), rank_device(device_kind, local_rank), store)
