"""A pipeline stage holds its receive buffers only while their microbatch is in flight (Note
[receive buffers in flight] in runtime/execute/recv_buffers.py). Two real gloo processes run a
2-stage pipeline of 8 microbatches under 1F1B and GPipe, two steps each, with and without
``hold_in_flight``: the gradients are equal bit for bit, and between steps the held stage keeps no
receive buffer bytes where torch's keeps one per microbatch each way."""

from __future__ import annotations

import json

from tests._spawned import run_ranks

M = 8


def _rank(rank: int, init_file: str, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from runtime.execute.recv_buffers import hold_in_flight

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    results = {}
    for schedule in (Schedule1F1B, ScheduleGPipe):
        for held in (False, True):
            torch.manual_seed(0)
            stages = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()), torch.nn.Linear(16, 4)]
            module = stages[rank]
            x, y = torch.randn(2 * M, 8), torch.randn(2 * M, 4)
            width = (8, 16)[rank]
            stage = PipelineStage(module, rank, 2, torch.device("cpu"),
                                  input_args=torch.randn(2, width, requires_grad=rank > 0),
                                  output_args=torch.randn(2, (16, 4)[rank], requires_grad=True))
            stage = hold_in_flight(stage) if held else stage
            run = schedule(stage, n_microbatches=M, loss_fn=torch.nn.functional.mse_loss)
            for _ in range(2):
                for p in module.parameters():
                    p.grad = None
                run.step(x) if rank == 0 else run.step(target=y)
            kept = sum(info.buffer.numel() for table in (stage.args_recv_info, stage.grad_recv_info)
                       for infos in table.values() for info in infos if getattr(info, "buffer", None) is not None)
            results[f"{schedule.__name__} {held}"] = {"grads": [p.grad.flatten().tolist() for p in module.parameters()],
                                                      "kept": kept}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def test_receive_buffers_are_released_and_the_gradients_unchanged(tmp_path):
    out = str(tmp_path / "results")
    run_ranks(_rank, lambda r: (r, str(tmp_path / "init"), out))
    for rank in range(2):
        results = json.load(open(f"{out}.{rank}"))
        for schedule in ("Schedule1F1B", "ScheduleGPipe"):
            plain, held = results[f"{schedule} False"], results[f"{schedule} True"]
            assert held["grads"] == plain["grads"], (rank, schedule)  # bit for bit
            # torch's: one buffer per microbatch each way (rank 0 receives gradients, rank 1 activations)
            assert plain["kept"] == M * 2 * 16 and held["kept"] == 0, (rank, schedule, plain, held)
