"""A pipeline stage's receive buffers, held only while their microbatch is in flight.

Note [receive buffers in flight]
    torch's PipelineStage allocates, at its first step, an activation receive buffer and a
    gradient receive buffer for every microbatch, and keeps all of them for the run: m x (cut_in +
    cut_out) bytes on every rank whatever the schedule (on Korthikanti et al.'s 1T layout, 512
    microbatches of 4 s h fp32 bytes each way, 200 GiB a GPU, where Megatron allocates one per
    transfer). ``hold_in_flight`` makes a stage allocate a microbatch's receive buffers just before
    their receive is posted and drop them after that microbatch's backward: an activation buffer
    then lives from its receive to its backward (the stage's fwd_cache keeps it as the input that
    long anyway), a gradient buffer from its receive to the backward that reads it. It changes no
    value: the receive writes the whole buffer, and a fresh one is what torch's buffer is between
    steps once ``clear_runtime_states`` has dropped its gradient. It rests on what torch's
    PipelineStage has had since 2.4 (``args_recv_info`` / ``grad_recv_info``: chunk -> tuple of
    recv infos, each with a ``buffer``, filled one chunk at a time; ``get_fwd_recv_ops``,
    ``get_bwd_recv_ops`` and ``backward_one_chunk`` by chunk id), and refuses a stage without it.
    The memory model prices this (Note [memory model] in partitioner/solver/evaluate.py).
"""

from __future__ import annotations

import torch


class _RecvTable(dict):
    """A stage's chunk -> recv infos whose tensor buffers are released until asked for: each
    released buffer's layout is kept, and a fresh buffer of it made by ``allocate``."""

    def __init__(self, existing: dict):
        super().__init__()
        self.layouts: dict[tuple[int, int], tuple] = {}
        for chunk, infos in existing.items():
            self[chunk] = infos

    def __setitem__(self, chunk, infos) -> None:
        super().__setitem__(chunk, infos)
        self.release(chunk)  # torch fills the table one chunk at a time: never m buffers at once

    def release(self, chunk) -> None:
        for i, info in enumerate(self.get(chunk, ())):
            buffer = getattr(info, "buffer", None)
            if isinstance(buffer, torch.Tensor):  # a received buffer, or a same-rank stage's tensor (V schedules)
                self.layouts.setdefault((chunk, i), (tuple(buffer.shape), buffer.stride(), buffer.dtype,
                                                     buffer.device, buffer.requires_grad))
                info.buffer = torch.empty(0, dtype=buffer.dtype, device=buffer.device)

    def allocate(self, chunk) -> None:
        for i, info in enumerate(self.get(chunk, ())):
            layout = self.layouts.pop((chunk, i), None)
            if layout is not None:
                shape, stride, dtype, device, requires_grad = layout
                info.buffer = torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(
                    requires_grad)


def hold_in_flight(stage):
    """``stage`` (a torch PipelineStage, not yet stepped) holding its receive buffers only while
    their microbatch is in flight (Note [receive buffers in flight])."""
    needed = ("args_recv_info", "grad_recv_info", "get_fwd_recv_ops", "get_bwd_recv_ops", "backward_one_chunk")
    missing = [name for name in needed if not hasattr(stage, name)]
    if missing:
        raise RuntimeError(f"this torch's PipelineStage lacks {', '.join(missing)}: the runtime needs torch 2.11 "
                           f"to 2.13 (Note [receive buffers in flight] in runtime/execute/recv_buffers.py)")
    activations, gradients = _RecvTable(stage.args_recv_info), _RecvTable(stage.grad_recv_info)
    stage.args_recv_info, stage.grad_recv_info = activations, gradients
    fwd_recv, bwd_recv, backward = stage.get_fwd_recv_ops, stage.get_bwd_recv_ops, stage.backward_one_chunk

    def get_fwd_recv_ops(fwd_chunk_id, *args, **kwargs):
        activations.allocate(fwd_chunk_id)
        return fwd_recv(fwd_chunk_id, *args, **kwargs)

    def get_bwd_recv_ops(bwd_chunk_id, *args, **kwargs):
        gradients.allocate(bwd_chunk_id)
        return bwd_recv(bwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
        out = backward(bwd_chunk_id, *args, **kwargs)
        activations.release(bwd_chunk_id)
        gradients.release(bwd_chunk_id)
        return out

    stage.get_fwd_recv_ops, stage.get_bwd_recv_ops = get_fwd_recv_ops, get_bwd_recv_ops
    stage.backward_one_chunk = backward_one_chunk
    return stage
