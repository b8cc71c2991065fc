"""NCCL's device rules on CPU (Note [NCCL emulation] in runtime/parallel/nccl_emulation.py) and the
start-up device fixes they guard: a host tensor is refused on the groups NCCL would serve and
taken on gloo groups, a lone isend is refused there, fused AdamW refuses a host step (a restored
checkpoint's, before the fix), and a CUDA program on a host without enough GPUs is refused in one
line before any process group talks (elastic re-plans included). Real gloo groups (world 1), real
optimizers, real trainers."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from runtime.parallel import nccl_emulation
from runtime.parallel.nccl_emulation import emulated, is_host
from runtime.resilience import checkpoint as ck
from runtime.resilience.checkpoint.state import cuda_rng_split, dropped_rng_line
from tests.drivers.checkpoint_drills import trainers_at

CPU = torch.device("cpu")  # a torch.device object: what the runtime passes as the program's device


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setenv(nccl_emulation.ENV, "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_host_tensors_are_marked_as_on_a_gpu(monkeypatch):
    monkeypatch.setenv(nccl_emulation.ENV, "1")
    with emulated():
        host = torch.full((3,), -1, dtype=torch.int64)
        dev = torch.zeros(3, device=CPU)
        assert is_host(host) and not is_host(dev)
        assert is_host(torch.empty_like(host)) and not is_host(torch.empty_like(dev))
        assert is_host(host + 1) and not is_host(dev + torch.tensor(1.0))  # a 0-dim host scalar joins the device
        moved = host.to(CPU)
        assert not is_host(moved) and moved is not host  # a GPU copies
        assert is_host(dev.cpu()) and not is_host(dev) and is_host(dev.to("cpu"))
        assert is_host(torch.zeros(2, device=host.device))  # the device of a host tensor is the host
        dev[:2] = torch.tensor([5.0, 6.0])
        assert not is_host(dev)  # an in-place write keeps the tensor where it is


def test_device_groups_refuse_host_tensors_as_nccl_does(world):
    with emulated():
        gloo = dist.new_group([0], backend="gloo")
        device_group = dist.new_group([0])
        host = torch.zeros(2, dtype=torch.int64)
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(host)
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_gather([torch.empty_like(host)], host, group=device_group)
        dist.all_reduce(host, group=gloo)  # a gloo group takes the host's
        dist.all_reduce(torch.zeros(2, device=CPU))
        with pytest.raises(RuntimeError, match="batch_isend_irecv"):
            dist.isend(torch.zeros(1, device=CPU), 0, group=device_group)
    dist.all_reduce(torch.zeros(2, dtype=torch.int64))  # outside the block: plain gloo again


def test_fused_adamw_refuses_a_host_step(monkeypatch):
    monkeypatch.setenv(nccl_emulation.ENV, "1")
    with emulated():
        p = torch.nn.Parameter(torch.ones(4, device=CPU))
        opt = torch.optim.AdamW([p], fused=True)
        p.grad = torch.ones(4, device=CPU)
        opt.step()  # torch made the step on the parameter's device
        opt.state[p]["step"] = torch.tensor(1.0)
        with pytest.raises(RuntimeError, match="fused AdamW"):
            opt.step()


def test_a_restored_step_is_where_fused_adamw_reads_it(tmp_path, monkeypatch):
    """B2: restore made the AdamW ``step`` on the CPU whatever the kernel; fused on CUDA reads it on
    the device."""
    from tests._checkpoint_helpers import two_stage_mlp_folder

    folder = two_stage_mlp_folder(str(tmp_path / "mlp"), model_fingerprint="mlp", plan_hash="plan-b2")
    ckpt = str(tmp_path / "ck")
    trainers = trainers_at(folder, 2)
    program = trainers[0].program
    ck.commit_local(ckpt, [ck.snapshot(t) for t in trainers], program)
    fresh = trainers_at(folder, 0)[0]
    loaded = ck.load_for_rank(ckpt, 2, program, 0, ck.needed_names(fresh))
    monkeypatch.setenv(nccl_emulation.ENV, "1")
    with emulated():
        ck.restore(fresh, loaded)
        assert fresh.optimizer.defaults.get("fused")
        for p in fresh.named_parameters().values():
            assert not is_host(fresh.optimizer.state[p]["step"])
            p.grad = torch.ones_like(p)
        fresh.optimizer.step()  # the fused kernel takes them


def test_sharded_optimizer_buffers_are_on_the_ranks_device_without_parameters():
    """A4: a rank with no trained parameter put its ZeRO buffers on the CPU."""
    from runtime.execute.train import make_optimizer
    from runtime.parallel.zero import ShardedOptimizer

    zero = ShardedOptimizer({}, {"lr": 1e-3}, dp=1, replica=0, group=None, make_optimizer=make_optimizer,
                            device=torch.device("meta"))
    assert zero.device == torch.device("meta")


def _cuda_folder(tmp_path) -> str:
    from _runtime_folders import mlp_folder

    folder = str(tmp_path / "cuda_mlp")
    mlp_folder(folder, splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)],
               extra={"device": "cuda", "backend": "nccl"})
    return folder


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="needs a host with fewer GPUs than ranks")
def test_more_ranks_than_gpus_is_one_line_before_any_group(tmp_path, monkeypatch):
    """F3 (and B3: the elastic path sets the device before its group talks)."""
    from runtime.launch import elastic, rank, world
    from runtime.launch.run_options import RunOptions

    folder = _cuda_folder(tmp_path)
    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(rank.LaunchError, match=r"2 ranks on this host .*device_count\(\) is 0: run it on a GPU host"):
        rank.main(folder, exit_on_error=False, argv=["--no-checkpoint"])
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "1")  # an elastic round that closed with one survivor
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(elastic.HOST_ENV, "0")
    with pytest.raises(rank.LaunchError, match="device_count"):
        elastic.resolve(folder, RunOptions(hosts="0,1"), world.init_world)
    assert not dist.is_initialized()


def test_cuda_generator_states_this_host_cannot_run_are_dropped_and_said():
    """F4: a writer with 12 GPUs, a host with 4 (and device 10 sorts after 2)."""
    keys = [f"rng/cuda_{i}" for i in range(12)]
    keep, dropped = cuda_rng_split(keys, 4)
    assert keep == [(i, f"rng/cuda_{i}") for i in range(4)]
    assert dropped == list(range(4, 12))
    line = dropped_rng_line(12, 4, dropped)
    assert "12 devices" in line and "sees 4" in line and "cuda:4,5" in line
    assert cuda_rng_split(keys, 16) == ([(i, f"rng/cuda_{i}") for i in range(12)], [])


def test_the_emulation_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv(nccl_emulation.ENV, raising=False)
    with emulated():
        assert not is_host(torch.zeros(1))
    assert os.environ.get(nccl_emulation.ENV) is None
